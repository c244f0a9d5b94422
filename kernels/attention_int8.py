"""8-bit attention (SageAttention-style) in Triton: INT8 (or FP8) Q·Kᵀ, FP8 (or INT8 / FP16) P·V, fp32 online softmax.

For non-causal full attention as Wan (self and cross) and Qwen-Image (joint) use it: [B, H, L, D] bf16/fp16,
head dim 64 or 128, any Lq and Lk. Attention is about half of a Wan 2.2 14B forward at 480p, and 8-bit tensor
cores run at twice the bf16 rate.

The algorithm (kernels/attention_int8_triton.py has the kernels, `attention_int8_reference` the same math in
fp32 torch):
- prologue, memory-bound: K and V means (torch reductions), then one Triton pass per tensor: Q·R -> int8 with a
  per-token scale (sm_scale·log2e/D folded in), (K - mean)·R -> int8 with one scale per 128 tokens, V - mean ->
  the P·V format (below), transposed to [D, L]. R is a fixed signed
  Hadamard matrix (±1, R·Rᵀ = D·I): it leaves Q·Kᵀ unchanged (times D) and spreads outlier channels over all D
  channels, so a few 10-100x channels no longer set every token's int8 step. Sequences are zero-padded to 128.
- keys sorted per head by sort_score (||k - mean(k)||², largest first; the K and V quantizers read through that
  order), so each 128-key block holds keys of like size; the first hi_key_count(Lk) of them (1 %, whole blocks)
  get their logits from the bf16/fp16 inputs in the main kernel: a key 10-100x larger than the rest has logits
  whose int8 error (7 bits of a large number) decides which key wins.
- main loop: scores = int8 dot * q_scale * k_scale in the log2 domain over the 8-bit keys, then the 16-bit keys'
  tiles. P·V (DEFAULT_PV_FORMAT): "fp8" P = exp2(s - m + 8) and V per channel in e4m3; "int8" P = exp2(s - f) per
  tile (f: the tile max) in 255 levels around a zero point and V in int8 per 128 keys and channel, the int32
  product scaled into an fp32 accumulator, and the 16-bit keys' P·V in fp16 from their input values (there the
  key sort also counts ||v - mean(v)||², so values 10-100x the rest leave the int8 blocks); "fp16" P and V in fp16.
  out = acc / l (· V's channel scale) + v_mean.
- on sm90 (H100 / H200) with Triton >= 3.6 the fp16 P·V main loop runs in kernels/attention_int8_gluon.py, a
  warp-specialized Gluon kernel (TMA loader + two consumer warpgroups, FlashAttention-3's schedule) that Triton's own
  pipeliner does not produce; there "auto" picks fp16 P·V (resolve_formats; docs/benchmarks.md has both schemes'
  speed and error). Elsewhere (or if it fails) Triton's loop runs.

Where each part's error comes from and what each choice bought is measured on the emulation in
docs/attention_int8_accuracy.md. `qk_format="fp8"` swaps the Q·Kᵀ operands to e4m3 for comparison; `hi_keys=0` is
the scheme without 16-bit keys.
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
PvFormat = Literal["auto", "int8", "fp8", "fp16"]
Layout = Literal["BHLD", "BLHD"]

LOG2E = 1.4426950408889634
# Q·Kᵀ format that "auto" picks. int8 keeps 7 bits where e4m3 keeps 3: on outlier inputs fp8 Q·Kᵀ is barely faster
# but goes over the 2 % error budget (docs/benchmarks.md).
DEFAULT_QK_FORMAT: Literal["int8", "fp8"] = "int8"
# P·V format that "auto" picks on sm89+ (sm80/sm86 have no fp8 tensor cores, so they get fp16). e4m3 keeps 3
# mantissa bits of P and V: on averaged zero-mean values ("gauss" in tests/unit/attention_families.py) that is ~4.8 %
# at Wan 480p; "int8" P·V (P per tile in 255 levels, V per 128 keys and channel) is ~1.5 % there and at most
# comfy-kitchen's error on every family (docs/attention_int8_accuracy.md), but its loop issues ~1.7x the
# instructions of the fp8 one on sm90 (tests/unit/sass_attention_int8.py --pv int8), which this kernel does not
# overlap with its tensor-core work: expected slower than cuDNN there until measured otherwise
# (`attention_int8 --kitchen` times both: benchmarks/results/bench_attention_kitchen.md).
# On sm90 with the Gluon loop "auto" picks fp16 instead (resolve_formats).
DEFAULT_PV_FORMAT: Literal["int8", "fp8", "fp16"] = "fp8"
PV_FORMATS = ("int8", "fp8", "fp16")
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
# Floor on every amax, so all-zero rows/blocks (padding, Lk=1 after smoothing) quantize to 0 without 0/0.
# 1e-6 keeps q_scale*k_scale far above fp32's underflow.
AMAX_EPS = 1e-6
KBLK = 128  # K tokens per scale (mirrors attention_int8_triton.KBLK; the reference must not need Triton)
PAD = 128  # sequence padding of the quantized buffers
Q_BLOCK = 64  # Q tokens per tile of the prologue (divides PAD)
PROLOGUE_TILES = 16  # tiles per program of the Q and K prologue kernels
PROLOGUE_WARPS = 4  # their warps per program
ROTATION_SIGN_SEED = 0x2545F4914F6CDD1D  # fixed: the kernel and the reference must build the same rotation
P_LOG2_OFFSET = 8.0  # P = exp2(s - m + 8) in (0, 256], inside e4m3's 448
HI_V_RANGE = 16384.0  # the 16-bit keys' centred values are scaled into fp16's range: amax -> 2^14
P_INT8_LEVELS = 254.0  # int8 P: round(254·P) in [0, 254], stored minus 127 (the zero point)
FRAME_SPAN = 64.0  # int8 P·V: P's frame stays within 2^64 of the running max (mirrors attention_int8_triton)
HI_KEY_SHARE = 100  # 1 key in HI_KEY_SHARE (rounded up to whole KBLK blocks) gets 16-bit logits


def _triton_module():
    """kernels.attention_int8_triton, or None when Triton is missing or broken."""
    try:
        from . import attention_int8_triton
    except Exception:  # ImportError, or a Triton that fails to initialise (no driver, old version)
        return None
    return attention_int8_triton


@functools.lru_cache(maxsize=None)
def _gluon_module():
    """kernels.attention_int8_gluon (the warp-specialized sm90 loop), or None where Triton has no Gluon for Hopper
    in the form it is written for (Triton 3.6's)."""
    try:
        from . import attention_int8_gluon
    except Exception:  # ImportError on older / newer Gluon APIs, or a Triton that fails to initialise
        return None
    return attention_int8_gluon if attention_int8_gluon.supported_triton() else None


_GLUON_FAILED: list[str] = []  # the first failure of the Gluon loop (compile or launch); Triton's loop after it


def gluon_loop_failure() -> str | None:
    """Why the Gluon loop stopped being used in this process (its first error), or None."""
    return _GLUON_FAILED[0] if _GLUON_FAILED else None


def gluon_loop_usable(device: torch.device) -> bool:
    """True where the fp16 P·V main loop runs in the warp-specialized Gluon kernel: an sm90 GPU (H100 / H200), its
    Triton's Gluon importable, and no earlier failure of it in this process."""
    if device.type != "cuda" or _interpreting() or _GLUON_FAILED:
        return False
    if torch.cuda.get_device_capability(device) != (9, 0):
        return False
    if _gluon_module() is None:
        _log_once("lowvram_dit 8-bit attention: the warp-specialized sm90 loop needs Triton >= 3.6 with Gluon "
                  f"(this is Triton {_triton_version()}); fp16 P·V runs in Triton's loop")
        return False
    return True


def gluon_loop_runs(device: torch.device, head_dim: int) -> bool:
    """gluon_loop_usable, and the loop takes this head size."""
    return gluon_loop_usable(device) and head_dim in _gluon_module().HEAD_DIMS


@functools.lru_cache(maxsize=None)
def _log_once(message: str) -> None:
    log.info(message)


def _triton_version() -> str:
    try:
        import triton
    except Exception:  # noqa: BLE001 - only for a log line
        return "not importable"
    return getattr(triton, "__version__", "?")


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
    """Concrete (qk, pv) formats for a device: fp8 needs sm89+ tensor cores (sm80 gets fp16 for an fp8 default)."""
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
    else:  # the Triton interpreter: anything goes
        cap = (9, 0)
    has_fp8 = cap >= (8, 9)
    qk = DEFAULT_QK_FORMAT if qk_format == "auto" else qk_format
    if pv_format != "auto":
        pv = pv_format
    elif qk == "int8" and gluon_loop_usable(device):
        pv = "fp16"  # the Gluon loop runs it (docs/benchmarks.md compares it with fp8 P·V)
    else:
        pv = DEFAULT_PV_FORMAT if has_fp8 or DEFAULT_PV_FORMAT != "fp8" else "fp16"
    if qk not in ("int8", "fp8") or pv not in PV_FORMATS:
        raise ValueError(f"attention_int8: qk_format={qk_format!r}, pv_format={pv_format!r}; use qk_format in "
                         "{'auto','int8','fp8'} and pv_format in {'auto','int8','fp8','fp16'}")
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
    # int8 P·V only (pv_format "int8"; v_scale is then [B*H, Lk_pad // KBLK, D], one scale per block and channel)
    v_sum: torch.Tensor | None = None  # [B*H, Lk_pad // 64, D] int32: column sums of the int8 V per 64 keys
    v_hi: torch.Tensor | None = None  # [B*H, n_hi, D] fp16: the 16-bit keys' (v - mean) / v_hi_scale, zero past Lk
    v_hi_scale: torch.Tensor | None = None  # [B*H] fp32


def _rotation_for(x: torch.Tensor, d: int) -> torch.Tensor:
    """rotation(d) in x's dtype where it is 16-bit (the prologue's product then runs in it), else fp32 (tf32).
    fp32 under Triton's interpreter, whose bf16 dot gives wrong results."""
    half = x.dtype in (torch.bfloat16, torch.float16) and not _interpreting()
    dtype = x.dtype if half else torch.float32
    return rotation(d, dtype, str(x.device))


def _pad(n: int) -> int:
    return (n + PAD - 1) // PAD * PAD


def _hi_values(v: torch.Tensor, order: torch.Tensor, v_mean: torch.Tensor, n_hi: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(v_hi [B*H, n_hi, D] fp16, scale [B*H]) for int8 P·V: the first n_hi sorted keys' centred values over
    amax / HI_V_RANGE, zero past Lk (hi_values_reference is the same in fp32)."""
    b, h, lk, d = v.shape
    n = min(n_hi, lk)
    rows = order.view(b, h, lk, 1)[:, :, :n].long().expand(-1, -1, -1, d)
    v_c = v.gather(2, rows).float().reshape(b * h, n, d) - v_mean[:, None]
    scale = (v_c.abs().amax(dim=(1, 2)) / HI_V_RANGE).clamp_min(AMAX_EPS)
    v_hi = torch.zeros(b * h, n_hi, d, device=v.device, dtype=torch.float16)
    v_hi[:, :n] = (v_c / scale[:, None, None]).half()
    return v_hi, scale


def _token_norms(tk, x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """||x - mean||² per token of [B, H, L, D] x (any strides), fp32 [B*H, L]."""
    b, h, length, d = x.shape
    norm = torch.empty(b * h, length, device=x.device, dtype=torch.float32)
    tk.key_norm_kernel[(triton_cdiv(length, 64), b * h)](
        x, mean, norm, *x.stride(), h, length, HEAD_DIM=d, BLOCK=64, num_warps=4)
    return norm


def _sort_keys(tk, k: torch.Tensor, k_mean: torch.Tensor, n_hi: int, v: torch.Tensor | None = None,
               v_mean: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [B*H, Lk] int32, k_hi [B*H, n_hi, D]): keys sorted by sort_score (largest first, stable), and the
    first n_hi of them in the input dtype, zero past Lk. Sorting puts keys of like size in each KBLK block, and the
    few far from the mean (which one int8 step per block cannot hold) into the 16-bit blocks; with v (int8 P·V) the
    values far from theirs count too."""
    b, h, lk, d = k.shape
    norm_v = _token_norms(tk, v, v_mean) if v is not None else None
    order = torch.sort(sort_score(_token_norms(tk, k, k_mean), norm_v), dim=-1, descending=True, stable=True).indices
    n = min(n_hi, lk)
    k_hi = torch.zeros(b, h, n_hi, d, device=k.device, dtype=k.dtype)
    k_hi[:, :, :n] = k.gather(2, order.view(b, h, lk, 1)[:, :, :n].expand(-1, -1, -1, d))
    return order.to(torch.int32), k_hi.view(b * h, n_hi, d)


def sort_score(norm_k: torch.Tensor, norm_v: torch.Tensor | None = None) -> torch.Tensor:
    """What keys are sorted by: ||k - mean||², or with the values' norms (int8 P·V) the sum of both, each over its
    mean across the sequence: a value 10-100x the others (which would coarsen its block's int8 V scales) then gets
    16-bit P·V as a key far from its mean gets 16-bit logits."""
    if norm_v is None:
        return norm_k
    return norm_k / norm_k.mean(dim=-1, keepdim=True).clamp_min(1e-30) + \
        norm_v / norm_v.mean(dim=-1, keepdim=True).clamp_min(1e-30)


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
    pv_dtype = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}.get(pv_format, torch.float16)
    # Reductions over the sequence: torch reads each tensor once without materialising fp32 copies.
    rot = rotation(d, torch.float32, str(dev))
    k_mean = k.mean(dim=2, dtype=torch.float32).reshape(bh, d).contiguous()
    k_mean_rot = k_mean @ rot
    v_mean = v.mean(dim=2, dtype=torch.float32).reshape(bh, d).contiguous()
    # Bound on amax|V - mean| without a second pass; fp8 is floating point, so the slack costs no precision.
    if pv_format == "int8":  # int8 V takes its scales per block in its own pass
        v_amax = v_mean
    else:
        v_amax = torch.linalg.vector_norm(v, ord=math.inf, dim=2, dtype=torch.float32).reshape(bh, d) + v_mean.abs()
    if n_hi:
        with_v = (v, v_mean) if pv_format == "int8" else (None, None)
        order, k_hi = _sort_keys(tk, k, k_mean, n_hi, *with_v)
    else:  # the scheme without 16-bit keys: input order (order is never read)
        order, k_hi = k_mean, torch.empty(bh, 0, d, device=dev, dtype=k.dtype)

    q8 = torch.empty(bh, lq_pad, d, device=dev, dtype=qk_dtype)
    q_scale = torch.empty(bh, lq_pad, device=dev, dtype=torch.float32)
    k8 = torch.empty(bh, lk_pad, d, device=dev, dtype=qk_dtype)
    k_scale = torch.empty(bh, lk_pad // KBLK, device=dev, dtype=torch.float32)
    vt = torch.empty(bh, d, lk_pad, device=dev, dtype=pv_dtype)
    to_fp8 = qk_format == "fp8"
    # Each program loops over PROLOGUE_TILES tiles, reading the [D, D] rotation once; the rotation in the input's
    # dtype keeps the product on 16-bit tensor cores (±1 is exact)
    q_tiles, k_tiles = lq_pad // Q_BLOCK, lk_pad // KBLK
    tk.quantize_q_kernel[(triton_cdiv(q_tiles, PROLOGUE_TILES), bh)](
        q, _rotation_for(q, d), q8, q_scale, *q.stride(), h, lq, lq_pad, sm_scale * LOG2E / d, AMAX_EPS,
        HEAD_DIM=d, BLOCK=Q_BLOCK, TO_FP8=to_fp8, TILES=PROLOGUE_TILES, num_warps=PROLOGUE_WARPS)
    tk.quantize_k_kernel[(triton_cdiv(k_tiles, PROLOGUE_TILES), bh)](
        k, _rotation_for(k, d), k_mean_rot.contiguous(), order, k8, k_scale, *k.stride(), h, lk, lk_pad, AMAX_EPS,
        HEAD_DIM=d, BLOCK=KBLK, TO_FP8=to_fp8, GATHER=n_hi > 0, TILES=PROLOGUE_TILES,
        num_warps=PROLOGUE_WARPS)
    qq = QuantizedQKV(q8, q_scale, k8, k_scale, vt, v_amax, v_mean, qk_format, pv_format, q, k_hi, k_mean, n_hi,
                      sm_scale)
    _quantize_v(tk, v, order, qq, lk)
    return qq


def _quantize_v(tk, v: torch.Tensor, order: torch.Tensor, qq: QuantizedQKV, lk: int) -> None:
    """The V pass of the prologue into qq.vt: per-channel fp8 / fp16, or int8 per block and channel with its column
    sums and the 16-bit keys' values (pv_format "int8"); qq.v_scale arrives as the fp8 path's amax bound."""
    bh, d, lk_pad = qq.vt.shape
    h = v.shape[1]
    if qq.pv_format != "int8":
        tk.quantize_v_kernel[(lk_pad // 64, bh)](
            v, qq.v_mean, qq.v_scale, order, qq.vt, *v.stride(), h, lk, lk_pad, AMAX_EPS,
            HEAD_DIM=d, BLOCK=64, TO_FP8=qq.pv_format == "fp8", GATHER=qq.n_hi > 0, num_warps=4)
        qq.v_scale = qq.v_scale.clamp_min(AMAX_EPS) / 448.0
        return
    qq.v_scale = torch.empty(bh, lk_pad // KBLK, d, device=v.device, dtype=torch.float32)
    qq.v_sum = torch.empty(bh, lk_pad // 64, d, device=v.device, dtype=torch.int32)
    tk.quantize_v_int8_kernel[(lk_pad // KBLK, bh)](
        v, qq.v_mean, order, qq.vt, qq.v_scale, qq.v_sum, *v.stride(), h, lk, lk_pad, AMAX_EPS,
        HEAD_DIM=d, BLOCK=KBLK, GATHER=qq.n_hi > 0, num_warps=8)
    if qq.n_hi:
        qq.v_hi, qq.v_hi_scale = _hi_values(v, order, qq.v_mean, qq.n_hi)
    else:  # never read: the kernel reads the 16-bit values only for the 16-bit keys
        qq.v_hi, qq.v_hi_scale = qq.v_mean.half(), qq.v_mean[:, 0]


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
    if config is None and not compile_only and _gluon_loop_fits(qq, out):
        try:
            return _gluon_module().attention_from_quantized(qq, out, lq, lk, qq.sm_scale * LOG2E)
        except Exception as exc:  # noqa: BLE001 - a Triton whose Gluon differs: Triton's own loop instead
            _GLUON_FAILED.append(f"{type(exc).__name__}: {exc}")
            log.warning("lowvram_dit 8-bit attention: the Gluon (sm90) loop failed (%s: %s); using the Triton loop",
                        type(exc).__name__, str(exc)[:300])
    tk = _triton_module()
    b, h, _, d = out.shape
    lq_pad, lk_pad = qq.q8.shape[1], qq.k8.shape[1]
    int8_pv = qq.pv_format == "int8"
    v_sum, v_hi, v_hi_scale = (qq.v_sum, qq.v_hi, qq.v_hi_scale) if int8_pv else (qq.v_scale,) * 3  # unread
    args = (qq.q8, qq.q_scale, qq.k8, qq.k_scale, qq.vt, qq.v_scale, qq.v_mean, out, qq.q16, qq.k_hi, qq.k_mean,
            v_sum, v_hi, v_hi_scale,
            *out.stride(), *qq.q16.stride(), h, lq, lk, lq_pad, lk_pad, _bucket(lq), _bucket(lk), qq.n_hi // KBLK,
            qq.sm_scale * LOG2E)
    flags = dict(HEAD_DIM=d, KBLK_=KBLK, QK_FP8=qq.qk_format == "fp8", PV_FP8=qq.pv_format == "fp8",
                 F32_DOT=_interpreting(), PV_INT8=int8_pv)
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


def _gluon_loop_fits(qq: QuantizedQKV, out: torch.Tensor) -> bool:
    """The Gluon loop takes int8 Q·Kᵀ with fp16 P·V at head dim 128, with unit last strides on q and out."""
    if not gluon_loop_runs(out.device, out.shape[-1]) or (qq.qk_format, qq.pv_format) != ("int8", "fp16"):
        return False
    return out.stride(-1) == 1 and qq.q16.stride(-1) == 1


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

# Sequence lengths the warm-up runs, one of each kind Triton would specialise an integer on (divisibility by 16:
# Wan's 32,760 video tokens are not a multiple of 16, its 512 text tokens are). The quantizers and both loops take
# lengths unspecialised, so the second finds everything compiled, unless a kernel gains a length-specialised argument.
WARMUP_LENGTHS = (264, 256)  # Wan's video-token kind first
WARMUP_AUTOTUNE_LENGTH = 32_768  # the autotuner's config set for long sequences (>= 8192 tokens)
_WARMUPS: dict[tuple, threading.Thread] = {}
_WARMUP_LOCK = threading.Lock()


def start_warmup(device: torch.device | str, dtype: torch.dtype = torch.bfloat16, heads: int = 24,
                 head_dim: int = 128, pv_format: PvFormat = "auto") -> threading.Thread | None:
    """Compile the quantizers and the autotuner's long-sequence configs of the 8-bit kernel for (device, dtype,
    head_dim) in a daemon thread.

    On a cold Triton cache these compiles take seconds; started when a prompt using the 8-bit backend is queued or a
    model gets it, they run while ComfyUI encodes text, loads the model and torch.compile traces it, instead of
    inside the first sampler step. ``heads`` only matters through its divisibility by 16 (Triton's specialisation);
    ``pv_format`` is the P·V format the calls will ask for (each format is its own kernel). The first real call
    waits for a warm-up still running (the autotuner is not thread-safe). Returns the thread, or None where the
    kernel cannot run here.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if _interpreting() or not is_supported(device, dtype, head_dim):
        return None
    formats = resolve_formats(device, "auto", pv_format)
    key = (str(device), dtype, heads % 16 == 0, head_dim, formats)
    with _WARMUP_LOCK:
        if key not in _WARMUPS:
            _WARMUPS[key] = threading.Thread(target=_warm, args=(device, dtype, heads, head_dim, formats),
                                             daemon=True, name=f"lowvram-dit 8-bit attention warm-up {key}")
            _WARMUPS[key].start()
        return _WARMUPS[key]


def _warm(device: torch.device, dtype: torch.dtype, heads: int, head_dim: int, formats: tuple[str, str]) -> None:
    t0 = time.perf_counter()
    try:
        cuda = device.type == "cuda"
        # its own stream: the warm-up's launches and the autotuner's syncs never wait on the loader's copies
        with torch.cuda.device(device) if cuda else contextlib.nullcontext(), \
                torch.cuda.stream(torch.cuda.Stream(device)) if cuda else contextlib.nullcontext():
            qk, pv = formats
            for length in WARMUP_LENGTHS:
                # [B, H, L, D] views of [B, L, H, D] memory, as models call it; the quantizers run (tiny)
                x = torch.randn(1, length, heads, head_dim, device=device, dtype=dtype).transpose(1, 2)
                qq = quantize_qkv(x, x, x, qk_format=qk, pv_format=pv)
                # The main loop's configs are compiled, never run or timed. Sequence lengths only reach the kernel
                # as unspecialised integers, so the configs the autotuner keeps for long sequences (where the
                # 8-bit kernel is used: Wan video) are picked by passing a long length; shorter sequences compile
                # their extra configs on their first call.
                long = WARMUP_AUTOTUNE_LENGTH
                if _gluon_loop_fits(qq, x):  # the Gluon loop has no autotuner: one real call compiles it
                    attention_from_quantized(qq, torch.empty_like(x), length, length)
                else:
                    attention_from_quantized(qq, torch.empty_like(x), long, long, compile_only=True)
            if cuda:
                torch.cuda.current_stream().synchronize()
    except Exception as exc:  # noqa: BLE001 - the first real call compiles instead; never take the server down
        log.info("lowvram_dit 8-bit attention: compiling ahead failed (%s: %s); the first call compiles instead",
                 type(exc).__name__, exc)
        return
    log.info("lowvram_dit 8-bit attention: kernels for %s %s, head dim %d, %s P·V compiled ahead in %.1f s", device,
             str(dtype).removeprefix("torch."), head_dim, formats[1], time.perf_counter() - t0)


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
    if pv_format == "int8":
        v_q, v_scale = _quantize_v_blocks(v32 - v_mean[:, :, None])
        return q_q, q_scale, k_q, k_scale, v_q, v_scale, v_mean
    v_amax = (v32.abs().amax(dim=2) + v_mean.abs()).clamp_min(AMAX_EPS)
    v_q = ((v32 - v_mean[:, :, None]) * (448.0 / v_amax)[:, :, None, :]).clamp(-448.0, 448.0)
    v_q = v_q.to(torch.float8_e4m3fn if pv_format == "fp8" else torch.float16).float()
    return q_q, q_scale, k_q, k_scale, v_q, v_amax / 448.0, v_mean


def _quantize_v_blocks(v_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Centred V [B, H, Lk, D] fp32 -> (int8 values as fp32 [B, H, Lk, D], scale [B, H, nblk, D]): one scale per
    KBLK keys and channel (amax / 127), so a channel's step follows the 128 values it holds there, not the
    largest of the whole sequence."""
    b, h, lk, d = v_c.shape
    nblk = -(-lk // KBLK)
    v_pad = torch.zeros(b, h, nblk * KBLK, d, dtype=torch.float32, device=v_c.device)
    v_pad[:, :, :lk] = v_c
    blocks = v_pad.view(b, h, nblk, KBLK, d)
    amax = blocks.abs().amax(dim=3).clamp_min(AMAX_EPS)  # [B, H, nblk, D]
    v_q = _round_half_away(blocks * (127.0 / amax)[:, :, :, None]).view(b, h, nblk * KBLK, d)[:, :, :lk]
    return v_q, amax / 127.0


def hi_key_count(lk: int) -> int:
    """How many keys (the largest after centring) get 16-bit logits: 1 % of Lk in whole KBLK blocks, at least one
    block (all keys when Lk <= KBLK)."""
    return KBLK * max(1, -(-lk // (KBLK * HI_KEY_SHARE)))


def key_order_reference(k: torch.Tensor, v: torch.Tensor | None = None) -> torch.Tensor:
    """Keys of each head sorted by sort_score (fp32; with v as int8 P·V sorts), largest first: [B, H, Lk] int64
    (the kernel's order)."""
    def norm(x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 - x32.mean(dim=2, keepdim=True)).pow(2).sum(dim=-1)

    return torch.sort(sort_score(norm(k), None if v is None else norm(v)), dim=-1, descending=True, stable=True).indices


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
        order = key_order_reference(kb, vb if pv_format == "int8" else None)[..., None].expand(-1, -1, -1, kb.shape[-1])
        kb, vb = kb.gather(2, order), vb.gather(2, order)
    q_q, q_scale, k_q, k_scale, v_q, v_scale, v_mean = quantize_reference(
        qb, kb, vb, qk_format=qk_format, pv_format=pv_format, sm_scale=sm_scale)
    b, h, lq, d = q_q.shape
    lk = k_q.shape[2]
    s_hi = _hi_scores(qb, kb[:, :, :n_hi], kb.float().mean(dim=2), sm_scale) if n_hi else None
    if pv_format == "int8" and n_hi:
        v16, v16_scale = hi_values_reference(vb[:, :, :n_hi], v_mean)
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
        v_tile = v_q[:, :, start:stop]
        if pv_format == "int8" and start < n_hi:  # the 16-bit keys' P·V in fp16 from the 16-bit values
            m, l, acc = _tile_int8(s, v16[:, :, start:stop], v16_scale, m, l, acc, p16=True)
        elif pv_format == "int8":
            v_tile_scale = v_scale[:, :, start // KBLK, None, :]
            m, l, acc = _tile_int8(s, v_tile, v_tile_scale, m, l, acc)
        else:
            m, l, acc = _tile_float(s, v_tile, torch.float8_e4m3fn if pv_format == "fp8" else torch.float16, m, l, acc)
    if pv_format == "int8":  # V's scales were applied per tile
        out = acc / l[..., None] + v_mean[:, :, None, :]
    else:
        out = acc / l[..., None] * v_scale[:, :, None, :] + v_mean[:, :, None, :]
    out = out.to(q.dtype)
    return out if layout == "BHLD" else out.transpose(1, 2)


def _tile_float(s: torch.Tensor, v_tile: torch.Tensor, p_dtype: torch.dtype, m: torch.Tensor, l: torch.Tensor,
                acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tile of the online softmax with P = exp2(s - m + 8) rounded to p_dtype (fp8 / fp16 P·V)."""
    m_new = torch.maximum(m, s.amax(dim=-1))
    p = torch.exp2(s - (m_new - P_LOG2_OFFSET)[..., None])
    alpha = torch.exp2(m - m_new)
    l = l * alpha + p.sum(dim=-1)
    acc = acc * alpha[..., None] + p.to(p_dtype).float() @ v_tile
    return m_new, l, acc


def hi_values_reference(v_hi: torch.Tensor, v_mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 16-bit keys' values for int8 P·V: (v - mean) / scale in fp16 (as fp32 [B, H, n, D]) and the scale
    [B, H, 1, 1] (amax / HI_V_RANGE, so fp16 never overflows), from the input values of those keys."""
    v_c = v_hi.float() - v_mean[:, :, None]
    scale = (v_c.abs().amax(dim=(2, 3), keepdim=True) / HI_V_RANGE).clamp_min(AMAX_EPS)
    return (v_c / scale).half().float(), scale


def _tile_int8(s: torch.Tensor, v_tile: torch.Tensor, v_tile_scale: torch.Tensor | float, m: torch.Tensor,
               l: torch.Tensor, acc: torch.Tensor, p16: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tile of the online softmax with int8 P·V (p16: the 16-bit keys' fp16 P·V): P = exp2(s - f) in (0, 1]
    per query, f = max(tile max, running max - FRAME_SPAN), rounded to 255 levels as round(254·P) - 127 (int8
    around a zero point of 127, added back through V's column sums) times the int8 V tile, then scaled by V's
    per-channel scale; acc and l are kept relative to the running max here (the kernel keeps them relative to f:
    the same numbers up to fp32 rounding)."""
    t_max = s.amax(dim=-1)
    m_new = torch.maximum(m, t_max)
    frame = torch.maximum(t_max, m_new - FRAME_SPAN)
    p = torch.exp2(s - frame[..., None])
    if p16:
        dot = p.half().float() @ v_tile
        unit = torch.exp2(frame - m_new)
    else:
        p_q = torch.round(p * P_INT8_LEVELS - 127.0)  # the kernel's fma(p, 254, MAGIC - 127): round half to even
        dot = p_q @ v_tile + 127.0 * v_tile.sum(dim=-2, keepdim=True)  # exact integers (< 2^22)
        unit = torch.exp2(frame - m_new) / P_INT8_LEVELS
    alpha = torch.exp2(m - m_new)
    l = l * alpha + p.sum(dim=-1) * torch.exp2(frame - m_new)
    acc = acc * alpha[..., None] + dot * unit[..., None] * v_tile_scale
    return m_new, l, acc


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref||_F / ||ref||_F in fp32 (the error budget is 2 %)."""
    out32, ref32 = out.float(), ref.float()
    return float((out32 - ref32).norm() / ref32.norm().clamp_min(1e-30))
