"""8-bit attention (SageAttention-style) in Triton: INT8 (or FP8) Q·Kᵀ, FP16 (or FP8) P·V, fp32 online softmax.

For non-causal full attention as Wan (self and cross) and Qwen-Image (joint) use it: [B, H, L, D] bf16/fp16,
head dim 64 or 128, any Lq and Lk. Attention is about half of a Wan 2.2 14B forward at 480p, and 8-bit tensor
cores run at twice the bf16 rate.

The algorithm (kernels/attention_int8_triton.py has the kernels, `attention_int8_reference` the same math in
fp32 torch):
- prologue, memory-bound: K mean and V per-channel amax (two torch reductions), then one Triton pass per
  tensor: Q·R -> int8 with a per-token scale (sm_scale·log2e/D folded in), (K - mean)·R -> int8 with one scale
  per 128 tokens, V - mean -> fp8 e4m3 scaled per channel and transposed to [D, L]. R is a fixed signed
  Hadamard matrix (±1, R·Rᵀ = D·I): it leaves Q·Kᵀ unchanged (times D) and spreads outlier channels over
  all D channels, so a few 10-100x channels no longer set every token's int8 step. Sequences are zero-padded
  to 128.
- keys sorted per head by ||k - mean(k)||² (largest first; the K and V quantizers read through that order), so
  each 128-key block holds keys of like size; the first hi_key_count(Lk) of them (1 %, whole blocks) get their
  logits from the bf16/fp16 inputs in the main kernel: a key 10-100x larger than the rest has logits whose int8
  error (7 bits of a large number) decides which key wins.
- main loop: scores = int8 dot * q_scale * k_scale in the log2 domain over the 8-bit keys, then the 16-bit keys'
  tiles; P = exp2(s - m + 8) in fp8 on sm89+ (fp16 on sm80/86, or asked for); P·V per tile summed into an fp32
  accumulator; out = acc / l * v_scale + v_mean.

`qk_format="fp8"` swaps the Q·Kᵀ operands to e4m3 (per-token / per-block scales to 448) for comparison;
`pv_format="fp16"` is the slower, more precise P·V (within 2 % also on zero-mean noise, see DEFAULT_PV_FORMAT);
`hi_keys=0` with fp8 P·V is the scheme before the 16-bit keys.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import threading
import time
from typing import Literal

import torch

log = logging.getLogger("comfyui_lowvram_dit")

QkFormat = Literal["auto", "int8", "fp8"]
PvFormat = Literal["auto", "fp8", "fp16"]
Layout = Literal["BHLD", "BLHD"]

LOG2E = 1.4426950408889634
# Q·Kᵀ format that "auto" picks. int8 keeps 7 bits where e4m3 keeps 3: on outlier inputs fp8 Q·Kᵀ is barely faster
# but goes over the 2 % error budget (docs/benchmarks.md).
DEFAULT_QK_FORMAT: Literal["int8", "fp8"] = "int8"
# P·V format that "auto" picks on sm89+ (sm80/sm86 have no fp8 tensor cores, so they always get fp16). fp16 P·V
# runs at half the fp8 tensor rate, which makes the kernel slower than cuDNN's bf16 attention on the H100
# (docs/benchmarks.md): the 8-bit kernel is only worth picking with fp8 P·V. e4m3 keeps 3 mantissa bits of P and V:
# where the output is averaged zero-mean V noise ("gauss" in tests/unit/attention_families.py) that rounding does
# not average out and the error goes over the 2 % budget; outlier-heavy inputs stay within it (the 16-bit keys
# hold the key outliers). pv_format="fp16" is the more precise scheme for callers who want it.
DEFAULT_PV_FORMAT: Literal["fp8", "fp16"] = "fp8"
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
# Floor on every amax, so all-zero rows/blocks (padding, Lk=1 after smoothing) quantize to 0 without 0/0.
# 1e-6 keeps q_scale*k_scale far above fp32's underflow.
AMAX_EPS = 1e-6
KBLK = 128  # K tokens per scale (mirrors attention_int8_triton.KBLK; the reference must not need Triton)
PAD = 128  # sequence padding of the quantized buffers
ROTATION_SIGN_SEED = 0x2545F4914F6CDD1D  # fixed: the kernel and the reference must build the same rotation
P_LOG2_OFFSET = 8.0  # P = exp2(s - m + 8) in (0, 256], inside e4m3's 448
HI_KEY_SHARE = 100  # 1 key in HI_KEY_SHARE (rounded up to whole KBLK blocks) gets 16-bit logits


def _triton_module():
    """kernels.attention_int8_triton, or None when Triton is missing or broken."""
    try:
        from . import attention_int8_triton
    except Exception:  # ImportError, or a Triton that fails to initialise (no driver, old version)
        return None
    return attention_int8_triton


def _interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (CPU tensors run through Triton's numpy interpreter)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def is_supported(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> bool:
    """True when attention_int8 can run here: CUDA sm80+, Triton importable, bf16/fp16, head dim 64/128."""
    device = torch.device(device)
    if device.type != "cuda" or dtype not in SUPPORTED_DTYPES or head_dim not in SUPPORTED_HEAD_DIMS:
        return False
    if not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(index) < (8, 0):
        return False
    return _triton_module() is not None


def resolve_formats(device: torch.device, qk_format: QkFormat = "auto",
                    pv_format: PvFormat = "auto") -> tuple[str, str]:
    """Concrete (qk, pv) formats for a device: fp8 needs sm89+ tensor cores, so sm80 gets int8 + fp16."""
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
    else:  # the Triton interpreter: anything goes
        cap = (9, 0)
    has_fp8 = cap >= (8, 9)
    qk = DEFAULT_QK_FORMAT if qk_format == "auto" else qk_format
    pv = (DEFAULT_PV_FORMAT if has_fp8 else "fp16") if pv_format == "auto" else pv_format
    if qk not in ("int8", "fp8") or pv not in ("fp8", "fp16"):
        raise ValueError(f"attention_int8: qk_format={qk_format!r}, pv_format={pv_format!r}; "
                         "use qk_format in {'auto','int8','fp8'} and pv_format in {'auto','fp8','fp16'}")
    if not has_fp8 and "fp8" in (qk, pv):
        raise ValueError(f"attention_int8: fp8 formats need an sm89+ GPU, this one is sm{cap[0]}{cap[1]}; "
                         "use qk_format='int8', pv_format='fp16' (or 'auto')")
    return qk, pv


def _as_bhld(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    """A [B, H, L, D] view of x (no copy)."""
    if layout == "BHLD":
        return x
    if layout == "BLHD":
        return x.transpose(1, 2)
    raise ValueError(f"attention_int8: layout={layout!r}; use 'BHLD' ([B, H, L, D]) or 'BLHD' ([B, L, H, D])")


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Shapes/dtypes the kernels take (views already in BHLD)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention_int8: q, k, v must be 4-D, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    bq, hq, lq, d = q.shape
    if k.shape != v.shape or k.shape[0] != bq or k.shape[1] != hq or k.shape[3] != d:
        raise ValueError(f"attention_int8: k and v must be [B, H, Lk, D] matching q [B, H, Lq, D]; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (in BHLD order)")
    if lq == 0 or k.shape[2] == 0:
        raise ValueError("attention_int8: empty sequence (Lq or Lk is 0)")
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"attention_int8: q, k, v must all be bf16 or fp16, got {q.dtype}, {k.dtype}, {v.dtype}")
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"attention_int8: head dim {d} unsupported; supported: {SUPPORTED_HEAD_DIMS}")


def _rotation_signs(d: int) -> list[float]:
    """d pseudo-random ±1 from a 64-bit LCG (the same on every machine and torch version)."""
    x, signs = ROTATION_SIGN_SEED, []
    for _ in range(d):
        x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        signs.append(1.0 if x >> 63 else -1.0)
    return signs


@functools.lru_cache(maxsize=16)
def rotation(d: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    """The signed Hadamard matrix diag(s)·H_d [D, D] with entries ±1 (R·Rᵀ = D·I), exact in any float dtype.

    Random signs keep structured inputs (a constant offset, a RoPE pattern) from lining up with one
    Walsh function, which would turn them into a new outlier channel.
    """
    if d & (d - 1):
        raise ValueError(f"attention_int8: the rotation needs a power-of-two head dim, got {d}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (torch.tensor(_rotation_signs(d))[:, None] * h).to(device=device, dtype=dtype)


# ------------------------------------------------------------------------------------------------------------
# Triton path


@dataclasses.dataclass
class QuantizedQKV:
    """Output of the prologue: padded 8-bit operands and their fp32 scales (see the module docstring)."""

    q8: torch.Tensor  # [B*H, Lq_pad, D] int8 / fp8
    q_scale: torch.Tensor  # [B*H, Lq_pad] fp32, includes sm_scale * log2(e) / D
    k8: torch.Tensor  # [B*H, Lk_pad, D] int8 / fp8, mean-smoothed and rotated like q8
    k_scale: torch.Tensor  # [B*H, Lk_pad // KBLK] fp32
    vt: torch.Tensor  # [B*H, D, Lk_pad] fp8 / fp16, scaled per channel
    v_scale: torch.Tensor  # [B*H, D] fp32 (amax / 448)
    v_mean: torch.Tensor  # [B*H, D] fp32, subtracted before quantization, added to the output
    qk_format: str
    pv_format: str
    q16: torch.Tensor  # the input q ([B, H, Lq, D] view), for the 16-bit keys' logits
    k_hi: torch.Tensor  # [B*H, n_hi, D] input dtype: the first n_hi sorted keys, zero past Lk
    k_mean: torch.Tensor  # [B*H, D] fp32, mean of k over the sequence
    n_hi: int  # keys [0, n_hi) of the sorted order get 16-bit logits (0: none, keys in input order)
    sm_scale: float


def _pad(n: int) -> int:
    return (n + PAD - 1) // PAD * PAD


def _sort_keys(tk, k: torch.Tensor, k_mean: torch.Tensor, n_hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [B*H, Lk] int32, k_hi [B*H, n_hi, D]): keys sorted by ||k - mean||² (largest first, stable), and the
    first n_hi of them in the input dtype, zero past Lk. Sorting puts keys of like size in each KBLK block, and the
    few far from the mean (which one int8 step per block cannot hold) into the 16-bit blocks."""
    b, h, lk, d = k.shape
    norm = torch.empty(b * h, lk, device=k.device, dtype=torch.float32)
    tk.key_norm_kernel[(triton_cdiv(lk, 64), b * h)](
        k, k_mean, norm, *k.stride(), h, lk, HEAD_DIM=d, BLOCK=64, num_warps=4)
    order = torch.sort(norm, dim=-1, descending=True, stable=True).indices
    n = min(n_hi, lk)
    k_hi = torch.zeros(b, h, n_hi, d, device=k.device, dtype=k.dtype)
    k_hi[:, :, :n] = k.gather(2, order.view(b, h, lk, 1)[:, :, :n].expand(-1, -1, -1, d))
    return order.to(torch.int32), k_hi.view(b * h, n_hi, d)


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, qk_format: str = "int8",
                 pv_format: str = "fp16", sm_scale: float | None = None, hi_keys: int | None = None) -> QuantizedQKV:
    """The fused prologue on [B, H, L, D] views (any strides): reductions, the key sort, three Triton passes.

    Q and K are rotated by `rotation(D)` on the way (see the module docstring); hi_keys as in attention_int8.
    """
    tk = _triton_module()
    if tk is None:
        raise RuntimeError("attention_int8: Triton is not importable; install triton or use another backend")
    b, h, lq, d = q.shape
    lk = k.shape[2]
    bh = b * h
    lq_pad, lk_pad = _pad(lq), _pad(lk)
    dev = q.device
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    n_hi = hi_key_count(lk) if hi_keys is None else hi_keys
    if n_hi % KBLK:
        raise ValueError(f"attention_int8: hi_keys={hi_keys} must be a multiple of {KBLK}")
    qk_dtype = torch.float8_e4m3fn if qk_format == "fp8" else torch.int8
    pv_dtype = torch.float8_e4m3fn if pv_format == "fp8" else torch.float16
    # Reductions over the sequence: torch reads each tensor once without materialising fp32 copies.
    rot = rotation(d, torch.float32, str(dev))
    k_mean = k.mean(dim=2, dtype=torch.float32).reshape(bh, d).contiguous()
    k_mean_rot = k_mean @ rot
    v_mean = v.mean(dim=2, dtype=torch.float32).reshape(bh, d).contiguous()
    # Bound on amax|V - mean| without a second pass; fp8 is floating point, so the slack costs no precision.
    v_amax = torch.linalg.vector_norm(v, ord=math.inf, dim=2, dtype=torch.float32).reshape(bh, d) + v_mean.abs()
    if n_hi:
        order, k_hi = _sort_keys(tk, k, k_mean, n_hi)
    else:  # the scheme without 16-bit keys: input order (order is never read)
        order, k_hi = k_mean, torch.empty(bh, 0, d, device=dev, dtype=k.dtype)

    q8 = torch.empty(bh, lq_pad, d, device=dev, dtype=qk_dtype)
    q_scale = torch.empty(bh, lq_pad, device=dev, dtype=torch.float32)
    k8 = torch.empty(bh, lk_pad, d, device=dev, dtype=qk_dtype)
    k_scale = torch.empty(bh, lk_pad // KBLK, device=dev, dtype=torch.float32)
    vt = torch.empty(bh, d, lk_pad, device=dev, dtype=pv_dtype)
    to_fp8 = qk_format == "fp8"
    # 128 tokens per program: each program reads the [D, D] fp32 rotation (64 KB at D=128) from L2 once
    tk.quantize_q_kernel[(lq_pad // PAD, bh)](
        q, rot, q8, q_scale, *q.stride(), h, lq, lq_pad, sm_scale * LOG2E / d, AMAX_EPS,
        HEAD_DIM=d, BLOCK=PAD, TO_FP8=to_fp8, num_warps=8)
    tk.quantize_k_kernel[(lk_pad // KBLK, bh)](
        k, rot, k_mean_rot.contiguous(), order, k8, k_scale, *k.stride(), h, lk, lk_pad, AMAX_EPS,
        HEAD_DIM=d, BLOCK=KBLK, TO_FP8=to_fp8, GATHER=n_hi > 0, num_warps=8)
    blk_v = 64
    tk.quantize_v_kernel[(lk_pad // blk_v, bh)](
        v, v_mean, v_amax, order, vt, *v.stride(), h, lk, lk_pad, AMAX_EPS,
        HEAD_DIM=d, BLOCK=blk_v, TO_FP8=pv_format == "fp8", GATHER=n_hi > 0, num_warps=4)
    v_scale = v_amax.clamp_min(AMAX_EPS) / 448.0
    return QuantizedQKV(q8, q_scale, k8, k_scale, vt, v_scale, v_mean, qk_format, pv_format,
                        q, k_hi, k_mean, n_hi, sm_scale)


def _bucket(n: int) -> int:
    """Autotune key for a sequence length: next power of two, at least 128 (one compiled set per bucket)."""
    return max(128, 1 << (n - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _autotuned_kernel():
    tk = _triton_module()
    return tk.make_autotuned_attn()


def attention_from_quantized(qq: QuantizedQKV, out: torch.Tensor, lq: int, lk: int,
                             config: dict | None = None, compile_only: bool = False) -> torch.Tensor:
    """Main loop on prologue output; out is a [B, H, Lq, D] view (any strides) written in place.

    config (None = autotune): BLOCK_M, BLOCK_N, num_warps, num_stages, and optionally the kernel variant flags
    PV_ACC (0/1/2) and EXP_EMU (0/1/2) documented in attention_int8_triton.attn_fwd_kernel. compile_only (autotune
    only): compile every config the autotuner would time for these arguments, run and time none (out untouched).
    """
    tk = _triton_module()
    b, h, _, d = out.shape
    lq_pad, lk_pad = qq.q8.shape[1], qq.k8.shape[1]
    args = (qq.q8, qq.q_scale, qq.k8, qq.k_scale, qq.vt, qq.v_scale, qq.v_mean, out, qq.q16, qq.k_hi, qq.k_mean,
            *out.stride(), *qq.q16.stride(), h, lq, lk, lq_pad, lk_pad, _bucket(lq), _bucket(lk), qq.n_hi // KBLK,
            qq.sm_scale * LOG2E)
    flags = dict(HEAD_DIM=d, KBLK_=KBLK, QK_FP8=qq.qk_format == "fp8", PV_FP8=qq.pv_format == "fp8",
                 F32_DOT=_interpreting())
    if config is None and _interpreting():
        config = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}
    if config is not None:
        bm, bn = config["BLOCK_M"], config["BLOCK_N"]
        if PAD % bm or KBLK % bn:
            raise ValueError(f"attention_int8: config {config}: BLOCK_M must divide {PAD}, BLOCK_N {KBLK}")
        variant = {key: config[key] for key in ("PV_ACC", "EXP_EMU") if key in config}
        tk.attn_fwd_kernel[(triton_cdiv(lq, bm), b * h)](
            *args, **flags, **variant, BLOCK_M=bm, BLOCK_N=bn,
            num_warps=config.get("num_warps", 4), num_stages=config.get("num_stages", 3))
    elif compile_only:
        _autotuned_kernel().warmup(*args, grid=(1, 1), **flags)
    else:
        _autotuned_kernel()[lambda meta: (triton_cdiv(lq, meta["BLOCK_M"]), b * h)](*args, **flags)
    return out


def triton_cdiv(a: int, b: int) -> int:
    """ceil(a / b) for grid sizes."""
    return -(-a // b)


def chosen_configs() -> dict[str, str]:
    """Autotuner picks so far, {key: config} as strings (for the benchmark report)."""
    if _triton_module() is None or _autotuned_kernel.cache_info().currsize == 0:
        return {}
    return {str(key): str(cfg) for key, cfg in _autotuned_kernel().cache.items()}


def attention_int8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: Layout = "BHLD",
                   qk_format: QkFormat = "auto", pv_format: PvFormat = "auto", sm_scale: float | None = None,
                   config: dict | None = None, hi_keys: int | None = None) -> torch.Tensor:
    """Non-causal softmax(q kᵀ / sqrt(D)) v with 8-bit tensor cores; output has q's dtype and layout.

    hi_keys: how many keys (a multiple of KBLK; the ones farthest from the key mean) get logits from the 16-bit
    inputs; None = hi_key_count(Lk); 0 = none, keys in input order (the scheme before 16-bit keys).
    """
    qb, kb, vb = _as_bhld(q, layout), _as_bhld(k, layout), _as_bhld(v, layout)
    _check_inputs(qb, kb, vb)
    if q.device.type != "cuda" and not _interpreting():
        raise ValueError(f"attention_int8: tensors are on {q.device}; this kernel needs a CUDA GPU "
                         "(check kernels.attention_int8.is_supported first)")
    qk, pv = resolve_formats(q.device, qk_format, pv_format)
    wait_for_warmup()
    out = torch.empty_like(q)  # same layout as q; kernels write through strides
    ob = _as_bhld(out, layout)
    # One sample at a time: the prologue's per-head reductions and its small rotation GEMM round differently for
    # another batch size, so cond and uncond batched on one GPU would not match one each on two (ComfyUI's
    # MultiGPU split). Each sample still fills the GPU (L/128 x H programs).
    for i in range(qb.shape[0]):
        qq = quantize_qkv(qb[i:i + 1], kb[i:i + 1], vb[i:i + 1], qk_format=qk, pv_format=pv, sm_scale=sm_scale,
                          hi_keys=hi_keys)
        attention_from_quantized(qq, ob[i:i + 1], qb.shape[2], kb.shape[2], config)
    return out


# ------------------------------------------------------------------------------------------------------------
# Compiling ahead: the kernels built in a background thread before the first sampler step needs them

# Sequence lengths the warm-up runs: Triton specialises integer arguments on divisibility by 16, so one length of
# each kind compiles every variant a real call can need (Wan's 32,760 video tokens are not a multiple of 16, its
# 512 text tokens are).
WARMUP_LENGTHS = (264, 256)  # Wan's video-token kind first
WARMUP_AUTOTUNE_LENGTH = 32_768  # the autotuner's config set for long sequences (>= 8192 tokens)
_WARMUPS: dict[tuple, threading.Thread] = {}
_WARMUP_LOCK = threading.Lock()


def start_warmup(device: torch.device | str, dtype: torch.dtype = torch.bfloat16, heads: int = 24,
                 head_dim: int = 128) -> threading.Thread | None:
    """Compile the quantizers and the autotuner's long-sequence configs of the 8-bit kernel for (device, dtype,
    head_dim) in a daemon thread.

    On a cold Triton cache these compiles take seconds; started when a prompt using the 8-bit backend is queued or a
    model gets it, they run while ComfyUI encodes text, loads the model and torch.compile traces it, instead of
    inside the first sampler step. ``heads`` only matters through its divisibility by 16 (Triton's specialisation). The first real call waits for a warm-up still running (the autotuner is not thread-safe).
    Returns the thread, or None where the kernel cannot run here.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if _interpreting() or not is_supported(device, dtype, head_dim):
        return None
    key = (str(device), dtype, heads % 16 == 0, head_dim)
    with _WARMUP_LOCK:
        if key not in _WARMUPS:
            _WARMUPS[key] = threading.Thread(target=_warm, args=(device, dtype, heads, head_dim), daemon=True,
                                             name=f"lowvram-dit 8-bit attention warm-up {key}")
            _WARMUPS[key].start()
        return _WARMUPS[key]


def _warm(device: torch.device, dtype: torch.dtype, heads: int, head_dim: int) -> None:
    t0 = time.perf_counter()
    try:
        cuda = device.type == "cuda"
        # its own stream: the warm-up's launches and the autotuner's syncs never wait on the loader's copies
        with torch.cuda.device(device) if cuda else contextlib.nullcontext(), \
                torch.cuda.stream(torch.cuda.Stream(device)) if cuda else contextlib.nullcontext():
            qk, pv = resolve_formats(device)
            for length in WARMUP_LENGTHS:
                # [B, H, L, D] views of [B, L, H, D] memory, as models call it; the quantizers run (tiny)
                x = torch.randn(1, length, heads, head_dim, device=device, dtype=dtype).transpose(1, 2)
                qq = quantize_qkv(x, x, x, qk_format=qk, pv_format=pv)
                # The main loop's configs are compiled, never run or timed. Sequence lengths only reach the kernel
                # as unspecialised integers, so the configs the autotuner keeps for long sequences (where the
                # 8-bit kernel is used: Wan video) are picked by passing a long length; shorter sequences compile
                # their extra configs on their first call.
                long = WARMUP_AUTOTUNE_LENGTH
                attention_from_quantized(qq, torch.empty_like(x), long, long, compile_only=True)
            if cuda:
                torch.cuda.current_stream().synchronize()
    except Exception as exc:  # noqa: BLE001 - the first real call compiles instead; never take the server down
        log.info("lowvram_dit 8-bit attention: compiling ahead failed (%s: %s); the first call compiles instead",
                 type(exc).__name__, exc)
        return
    log.info("lowvram_dit 8-bit attention: kernels for %s %s, head dim %d compiled ahead in %.1f s", device,
             str(dtype).removeprefix("torch."), head_dim, time.perf_counter() - t0)


@torch.compiler.disable
def wait_for_warmup() -> None:
    """Block until every warm-up thread has finished (at once when none runs); warm-up threads never wait."""
    me = threading.current_thread()
    for thread in list(_WARMUPS.values()):
        if thread is not me and thread.is_alive():
            thread.join()


# ------------------------------------------------------------------------------------------------------------
# Reference: the same quantized algorithm in fp32 torch (CPU-testable)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, x + 0.5, x - 0.5).trunc()


def quantize_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, qk_format: str = "int8",
                       pv_format: str = "fp16", sm_scale: float | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prologue in fp32 on [B, H, L, D]: (q_q, q_scale[B,H,Lq], k_q, k_scale[B,H,nblk], v_q, v_scale, v_mean).

    Quantized values are returned as fp32 holding the exact int8 / fp8 / fp16 values, unpadded; q_q and k_q
    are the rotated Q·R and (K - mean)·R, so q_q·k_qᵀ·q_scale·k_scale is Q·Kᵀ·sm_scale·log2(e).
    """
    d = q.shape[-1]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    qmax = 448.0 if qk_format == "fp8" else 127.0

    def to_qk(x: torch.Tensor) -> torch.Tensor:
        if qk_format == "fp8":
            return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
        return _round_half_away(x)

    rot = rotation(d, torch.float32, str(q.device))
    q32 = q.float() @ rot
    q_amax = q32.abs().amax(dim=-1).clamp_min(AMAX_EPS)
    q_q = to_qk(q32 * (qmax / q_amax)[..., None])
    q_scale = q_amax / qmax * (sm_scale * LOG2E / d)

    k32 = k.float() @ rot - k.float().mean(dim=2, keepdim=True) @ rot  # the kernel's order: rotate, then centre
    b, h, lk, _ = k32.shape
    nblk = -(-lk // KBLK)
    k_pad = torch.zeros(b, h, nblk * KBLK, d, dtype=torch.float32, device=k.device)
    k_pad[:, :, :lk] = k32
    k_blocks = k_pad.view(b, h, nblk, KBLK, d)
    k_amax = k_blocks.abs().amax(dim=(-1, -2)).clamp_min(AMAX_EPS)
    k_q = to_qk(k_blocks * (qmax / k_amax)[..., None, None]).view(b, h, nblk * KBLK, d)[:, :, :lk]
    k_scale = k_amax / qmax

    v32 = v.float()
    v_mean = v32.mean(dim=2)
    v_amax = (v32.abs().amax(dim=2) + v_mean.abs()).clamp_min(AMAX_EPS)
    v_q = ((v32 - v_mean[:, :, None]) * (448.0 / v_amax)[:, :, None, :]).clamp(-448.0, 448.0)
    v_q = v_q.to(torch.float8_e4m3fn if pv_format == "fp8" else torch.float16).float()
    return q_q, q_scale, k_q, k_scale, v_q, v_amax / 448.0, v_mean


def hi_key_count(lk: int) -> int:
    """How many keys (the largest after centring) get 16-bit logits: 1 % of Lk in whole KBLK blocks, at least one
    block (all keys when Lk <= KBLK)."""
    return KBLK * max(1, -(-lk // (KBLK * HI_KEY_SHARE)))


def key_order_reference(k: torch.Tensor) -> torch.Tensor:
    """Keys of each head sorted by ||k - mean(k)||² (fp32), largest first: [B, H, Lk] int64 (the kernel's order)."""
    k32 = k.float()
    norm = (k32 - k32.mean(dim=2, keepdim=True)).pow(2).sum(dim=-1)
    return torch.sort(norm, dim=-1, descending=True, stable=True).indices


def _hi_scores(q: torch.Tensor, k_hi: torch.Tensor, k_mean: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """log2-domain scores of the 16-bit keys: (q·k - q·mean(k)) · sm_scale·log2(e) from the inputs, in fp32."""
    q32 = q.float()
    return (q32 @ k_hi.float().transpose(-1, -2) - (q32 @ k_mean[..., None])) * (sm_scale * LOG2E)


def attention_int8_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: Layout = "BHLD",
                             qk_format: str = "int8", pv_format: str = "fp16", sm_scale: float | None = None,
                             block_n: int = 128, hi_keys: int | None = None) -> torch.Tensor:
    """fp32 emulation of attention_int8's exact quantization and tile-wise online softmax (any device).

    hi_keys: None = hi_key_count(Lk), 0 = no 16-bit keys and the keys in input order (the scheme before them).
    """
    qb, kb, vb = _as_bhld(q, layout), _as_bhld(k, layout), _as_bhld(v, layout)
    _check_inputs(qb, kb, vb)
    if KBLK % block_n:
        raise ValueError(f"attention_int8_reference: block_n={block_n} must divide {KBLK}")
    n_hi = hi_key_count(kb.shape[2]) if hi_keys is None else hi_keys
    if n_hi % KBLK:
        raise ValueError(f"attention_int8_reference: hi_keys={hi_keys} must be a multiple of {KBLK}")
    sm_scale = 1.0 / math.sqrt(qb.shape[-1]) if sm_scale is None else sm_scale
    if n_hi:  # the kernel's key order: the keys far from the mean first
        order = key_order_reference(kb)[..., None].expand(-1, -1, -1, kb.shape[-1])
        kb, vb = kb.gather(2, order), vb.gather(2, order)
    q_q, q_scale, k_q, k_scale, v_q, v_scale, v_mean = quantize_reference(
        qb, kb, vb, qk_format=qk_format, pv_format=pv_format, sm_scale=sm_scale)
    b, h, lq, d = q_q.shape
    lk = k_q.shape[2]
    s_hi = _hi_scores(qb, kb[:, :, :n_hi], kb.float().mean(dim=2), sm_scale) if n_hi else None
    p_dtype = torch.float8_e4m3fn if pv_format == "fp8" else torch.float16
    m = torch.full((b, h, lq), -math.inf, device=q.device)
    l = torch.zeros(b, h, lq, device=q.device)
    acc = torch.zeros(b, h, lq, d, device=q.device)
    # the kernel's tile order: the 8-bit keys [n_hi, Lk) first, then the 16-bit ones
    for start in [*range(n_hi, lk, block_n), *range(0, min(n_hi, lk), block_n)]:
        stop = min(start + block_n, lk)
        if start < n_hi:
            s = s_hi[..., start:stop]
        else:
            raw = q_q @ k_q[:, :, start:stop].transpose(-1, -2)  # exact: |raw| < 2^24
            s = raw * (q_scale * k_scale[:, :, start // KBLK, None])[..., None]
        m_new = torch.maximum(m, s.amax(dim=-1))
        p = torch.exp2(s - (m_new - P_LOG2_OFFSET)[..., None])
        alpha = torch.exp2(m - m_new)
        l = l * alpha + p.sum(dim=-1)
        acc = acc * alpha[..., None] + p.to(p_dtype).float() @ v_q[:, :, start:stop]
        m = m_new
    out = acc / l[..., None] * v_scale[:, :, None, :] + v_mean[:, :, None, :]
    out = out.to(q.dtype)
    return out if layout == "BHLD" else out.transpose(1, 2)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref||_F / ||ref||_F in fp32 (the error budget is 2 %)."""
    out32, ref32 = out.float(), ref.float()
    return float((out32 - ref32).norm() / ref32.norm().clamp_min(1e-30))
