"""Outlier-heavy attention inputs: the families the 8-bit attention kernel must keep within its error budget.

Each family is [B, H, L, D] q, k, v built from standard normals plus one kind of structure that breaks naive
8-bit quantization. Families marked "temperature-normalised" rescale q per head so the logits q·kᵀ/√D have a
standard deviation of TEMPERATURE over the keys (median over sampled queries): the structure then changes how
the logits are spread over channels, tokens and heads, not how sharp the attention is, which is the model's
business (sharper attention raises every 8-bit kernel's error; see the "sharp" family). Unless a family says
otherwise, v = N(0, 1) + a per-channel offset N(0, 0.5²), as real value projections carry a bias.

COMBINATIONS stack several of those structures in one input ("a+b+c": each part a family above, applied in
the order channel outliers, mean offsets, head scales, temperature, token outliers): real projections carry
outlier channels, biases and odd tokens at once, and a scheme that handles each alone can still fail on the mix.

Plain torch, any device: tests use it on CPU at small L, benchmarks/bench_attention_int8.py on the GPU at the
Wan shapes (generating on the device with a device generator, so values differ between devices).
"""

from __future__ import annotations

import math

import torch

SINKS = 4  # sink keys of the attention_sinks family
TEMPERATURE = 2.0  # logit std over keys; ~0.2 % of 32k keys then carry half the attention mass
OUTLIER_MULTS = (10.0, 25.0, 50.0, 100.0)
# Wan's 3-axis RoPE splits head dim 128 into [44, 42, 42] channels for (t, h, w)
WAN_ROPE_SPLIT = (44, 42, 42)

FAMILIES: dict[str, str] = {
    "gauss": "q, k, v N(0, 1), no structure, no offsets: the output is averaged zero-mean noise (not outlier-heavy; "
             "fp8 P·V's worst case)",
    "rmsnorm_outliers": "4 channels 20-50x in q and k, k channel bias, per-token RMSNorm (the tests' 'outlier')",
    "q_channel_outliers": "4 channels of q 10-100x; temperature-normalised",
    "k_channel_outliers": "4 channels of k 10-100x (spread, not mean); temperature-normalised",
    "qk_channel_outliers": "the same 4 channels 10-100x in q and k; temperature-normalised",
    "k_mean_offsets": "k + per-channel offsets N(0, 10²) (softmax-invariant); temperature-normalised",
    "qk_mean_offsets": "q + offsets N(0, 3²), k + offsets N(0, 10²) per channel; temperature-normalised",
    "head_scales": "q, k, v 10x larger in every 4th head, 10x smaller in the next; temperature-normalised per head",
    "token_outliers": "0.5 % of the tokens (at least 2) of q and of v 10-100x, after temperature normalisation",
    "k_token_outliers": "0.5 % of the tokens (at least 2) of k 10-100x, after temperature normalisation: those "
                        "keys' logits grow 10-100x, so attention is near one-hot on them",
    "v_outliers": "v: 4 channels 10-100x and offsets N(0, 5²); q, k temperature-normalised",
    "wan_like": "Wan 2.2 q/k: offsets and 4 outlier channels, RMSNorm over all heads with a spread gain, 3-axis "
                "RoPE on a (t, h, w) grid; v with offsets and outlier channels",
    "attention_sinks": "4 sink keys every query attends to (a shared query offset along their direction) holding about "
                       "half the attention mass at any length, with near-zero values; the rest temperature-normalised",
    "heavy_tailed_v": "q, k N(0, 1) as gauss; v Student-t with 3 degrees of freedom (heavy tails: rare values 10-50x "
                      "the typical one in every channel)",
}

# Families that compose with each other (the structures of FAMILIES that act on different axes)
COMPOSABLE = ("q_channel_outliers", "k_channel_outliers", "qk_channel_outliers", "k_mean_offsets", "qk_mean_offsets",
              "head_scales", "token_outliers", "k_token_outliers")
COMBINATIONS: tuple[str, ...] = (
    "qk_channel_outliers+k_mean_offsets",  # a few channels of q and k scaled up + a mean offset on k
    "qk_channel_outliers+qk_mean_offsets",
    "q_channel_outliers+k_mean_offsets",
    "k_channel_outliers+qk_mean_offsets",
    "qk_channel_outliers+head_scales",
    "qk_mean_offsets+head_scales",
    "qk_channel_outliers+token_outliers",
    "qk_channel_outliers+k_token_outliers",
    "qk_mean_offsets+token_outliers",
    "qk_mean_offsets+k_token_outliers",
    "head_scales+token_outliers",
    "head_scales+k_token_outliers",
    "qk_channel_outliers+qk_mean_offsets+head_scales",
    "q_channel_outliers+qk_mean_offsets+head_scales+token_outliers",  # everything on q
    "k_channel_outliers+k_mean_offsets+head_scales+k_token_outliers",  # everything on k
    "qk_channel_outliers+qk_mean_offsets+head_scales+token_outliers+k_token_outliers",
)
ALL_FAMILIES: tuple[str, ...] = (*FAMILIES, *COMBINATIONS)


def _parts(name: str) -> set[str]:
    """The structures of a family name: {name} for FAMILIES, its COMPOSABLE parts for "a+b+..."."""
    if name in FAMILIES:
        return {name}
    parts = name.split("+")
    if len(parts) < 2 or len(set(parts)) != len(parts) or any(p not in COMPOSABLE for p in parts):
        raise ValueError(f"attention_families: unknown family {name!r}; known: {', '.join(FAMILIES)}, or "
                         f"combinations 'a+b' of {', '.join(COMPOSABLE)}")
    return set(parts)


def _randn(g: torch.Generator, *shape: int, device: torch.device) -> torch.Tensor:
    return torch.randn(*shape, generator=g, device=device)


def _pick(g: torch.Generator, n: int, count: int, device: torch.device) -> torch.Tensor:
    """count distinct indices out of n."""
    return torch.randperm(n, generator=g, device=device)[:count]


def _mults(count: int, device: torch.device) -> torch.Tensor:
    """OUTLIER_MULTS repeated to count entries."""
    return torch.tensor([OUTLIER_MULTS[i % len(OUTLIER_MULTS)] for i in range(count)], device=device)


def logit_std(q: torch.Tensor, k: torch.Tensor, samples: int = 128) -> torch.Tensor:
    """Per-head median over sampled queries of the std over keys of q·kᵀ/√D: [B, H] (fp32)."""
    lq = q.shape[2]
    rows = torch.linspace(0, lq - 1, min(lq, samples), device=q.device).long()
    s = q[:, :, rows].float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])
    return s.std(dim=-1).median(dim=-1).values


def normalise_temperature(q: torch.Tensor, k: torch.Tensor, target: float = TEMPERATURE) -> torch.Tensor:
    """q rescaled per head so that logit_std(q, k) == target."""
    return q * (target / logit_std(q, k).clamp_min(1e-6))[:, :, None, None]


def _token_outliers(g: torch.Generator, x: torch.Tensor) -> torch.Tensor:
    """x with 0.5 % of its tokens (at least 2) multiplied by OUTLIER_MULTS, per (batch, head)."""
    n = x.shape[2]
    idx = _pick(g, n, max(2, n // 200), x.device)
    x = x.clone()
    x[:, :, idx] *= _mults(len(idx), x.device)[:, None]
    return x


def _rope_angles(l: int, d: int, device: torch.device) -> torch.Tensor:
    """Wan's 3-axis RoPE angles [L, D/2] for L tokens on a (t, h, w) grid close to a 21x30x52 480p latent."""
    w = max(1, min(52, l))
    h = max(1, min(30, -(-l // w)))
    pos = torch.arange(l, device=device)
    coords = (pos // (h * w), (pos // w) % h, pos % w)
    split = WAN_ROPE_SPLIT if d == 128 else (d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6))
    parts = []
    for c, n in zip(coords, split):
        freqs = 10000.0 ** (-torch.arange(0, n, 2, device=device, dtype=torch.float32) / n)
        parts.append(c[:, None].float() * freqs[None, :])
    return torch.cat(parts, dim=1)


def _rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs (2i, 2i+1) by angles[token, i], as ComfyUI's apply_rope1 does."""
    cos, sin = angles.cos(), angles.sin()
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


def _sinks(g: torch.Generator, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SINKS keys along a direction u that every query shares (q + u): their logits sit ln(Lk e^(T²/2) / SINKS)
    above the others' mean, so they hold about half the softmax mass; their values are 0.1x."""
    b, h, _, d = q.shape
    n, lk = min(SINKS, k.shape[2]), k.shape[2]
    u = _randn(g, 1, h, 1, d, device=q.device)
    u = u / u.norm(dim=-1, keepdim=True)
    q = normalise_temperature(q, k) + u * math.sqrt(d)  # q·u = sqrt(D) + N(0, T²·...) for every query
    lift = math.log(lk * math.exp(TEMPERATURE ** 2 / 2) / n)  # logit of a sink over the others' mean
    k, v = k.clone(), v.clone()
    k[:, :, :n] = k[:, :, :n] * 0.1 + u * lift  # (q·k)/sqrt(D) ~= lift for the sinks
    v[:, :, :n] *= 0.1
    return q, k, v


def _student_t(g: torch.Generator, *shape: int, dof: int, device: torch.device) -> torch.Tensor:
    """Student-t samples with ``dof`` degrees of freedom: N(0, 1) / sqrt(chi²_dof / dof)."""
    chi2 = _randn(g, dof, *shape, device=device).pow(2).sum(dim=0)
    return _randn(g, *shape, device=device) / (chi2 / dof).sqrt()


def _wan_like(g: torch.Generator, b: int, h: int, lq: int, lk: int, d: int, device: torch.device):
    """q, k as Wan computes them (projection with offsets/outliers, RMSNorm over H*D with gain, RoPE); v."""
    ch = _pick(g, d, 4, device)

    def qk(l: int, offset_std: float) -> torch.Tensor:
        x = _randn(g, b, h, l, d, device=device) + offset_std * _randn(g, h, 1, d, device=device)
        x[..., ch] *= _mults(4, device) / 4  # 2.5-25x channels after the offsets
        rms = x.pow(2).mean(dim=(1, 3), keepdim=True).sqrt()  # RMSNorm over all heads' channels of a token
        gain = torch.exp(0.5 * _randn(g, h, 1, d, device=device))  # learned gain: a log-normal spread per channel
        return _rope(x / rms * gain, _rope_angles(l, d, device))

    q, k = qk(lq, 1.0), qk(lk, 2.0)
    v = _randn(g, b, h, lk, d, device=device) + 0.5 * _randn(g, h, 1, d, device=device)
    v[..., _pick(g, d, 4, device)] *= _mults(4, device) / 5
    return q, k, v


def make_family(name: str, b: int, h: int, lq: int, lk: int, d: int, *, seed: int = 0,
                device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v ([B, H, L, D], dtype, on device) of one family in ALL_FAMILIES (or any "a+b" of COMPOSABLE);
    same seed and device -> same values."""
    parts = _parts(name)
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    if name == "wan_like":
        q, k, v = _wan_like(g, b, h, lq, lk, d, device)
        return q.to(dtype), k.to(dtype), v.to(dtype)
    q, k, v = (_randn(g, b, h, n, d, device=device) for n in (lq, lk, lk))
    if name == "gauss":
        return q.to(dtype), k.to(dtype), v.to(dtype)
    if name == "heavy_tailed_v":
        return q.to(dtype), k.to(dtype), _student_t(g, b, h, lk, d, dof=3, device=device).to(dtype)
    if name == "attention_sinks":
        q, k, v = _sinks(g, q, k, v)
        return q.to(dtype), k.to(dtype), (v + 0.5 * _randn(g, h, 1, d, device=device)).to(dtype)
    v_offset = 0.5 * _randn(g, h, 1, d, device=device)
    ch = _pick(g, d, 4, device)
    if name == "rmsnorm_outliers":
        mult = torch.tensor([20.0, 30.0, 40.0, 50.0], device=device)
        q[..., ch] *= mult
        k[..., ch] = k[..., ch] * mult + 2 * mult
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True))
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True))
    if parts & {"q_channel_outliers", "qk_channel_outliers"}:
        q[..., ch] *= _mults(4, device)
    if parts & {"k_channel_outliers", "qk_channel_outliers"}:
        k[..., ch] *= _mults(4, device)
    if parts & {"k_mean_offsets", "qk_mean_offsets"}:
        k = k + 10.0 * _randn(g, h, 1, d, device=device)
    if "qk_mean_offsets" in parts:
        q = q + 3.0 * _randn(g, h, 1, d, device=device)
    if "head_scales" in parts:
        mag = torch.tensor([10.0, 0.1, 1.0, 1.0], device=device).repeat(-(-h // 4))[:h][:, None, None]
        q, k, v, v_offset = q * mag, k * mag, v * mag, v_offset * mag
    if name == "v_outliers":
        v_offset = 5.0 * _randn(g, h, 1, d, device=device)
        v[..., _pick(g, d, 4, device)] *= _mults(4, device)
    if name != "rmsnorm_outliers":
        q = normalise_temperature(q, k)
    if "token_outliers" in parts:
        q, v = _token_outliers(g, q), _token_outliers(g, v)
    if "k_token_outliers" in parts:
        k = _token_outliers(g, k)
    return q.to(dtype), k.to(dtype), (v + v_offset).to(dtype)
