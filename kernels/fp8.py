"""FP8 (e4m3fn) weights: per-tensor and block-wise quantization, and an fp8 linear with one path per GPU.

Weights are plain tensors: a float8_e4m3fn `weight` [N, K] and an fp32 `weight_scale` (0-dim for per-tensor,
[ceil(N/bs), ceil(K/bs)] for block-wise), so block swap moves them like any other parameter.
Dequantization is always `q.float() * scale`. Activations are quantized dynamically on every call, in one fused
pass (Triton, see fp8_triton.py), because an eager amax + divide + cast costs more than the fp8 matmul saves.

Paths (`Fp8Path`), picked by `select_path` and overridable:
- "scaled_mm_rowwise": per-tensor weight, one activation scale per token, `torch._scaled_mm` (SM89/SM90).
- "scaled_mm_tensorwise": per-tensor weight, one activation scale per batch sample, `torch._scaled_mm` (SM89+).
- "scaled_mm_blockwise": 128x128 weight blocks, 1x128 activation groups, `F.scaled_mm` (SM90, torch >= 2.10).
  Block-wise weights on other GPUs dequantize (no Triton block-scaled GEMM ships yet).
- "dequantize": weight -> compute dtype, then `F.linear` (CPU, pre-Ada GPUs, odd shapes, fp32 activations).

GEMM options beyond the path (`ActQuant`, chosen per call by the caller; `DEFAULT_ACT` when none is given):
`use_fast_accum`, on by default.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F

from . import fp8_triton
from .decisions import samples_of

log = logging.getLogger("comfyui_lowvram_dit")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Floor for scales: an all-zero tensor or block gets this instead of 0, so quantizing never divides by zero.
SCALE_MIN = fp8_triton.SCALE_MIN  # torch.finfo(torch.float32).tiny
DEFAULT_BLOCK_SIZE = 128

Fp8Path = Literal[
    "scaled_mm_rowwise", "scaled_mm_tensorwise", "scaled_mm_blockwise", "dequantize"
]
Fp8Compute = Literal["auto", "fp8", "dequantize"]
FP8_PATHS: tuple[str, ...] = get_args(Fp8Path)
FP8_COMPUTE: tuple[str, ...] = get_args(Fp8Compute)

# How per-tensor fp8 weights scale their activations on GPUs that can do both (SM89/SM90): one scale per
# token ("scaled_mm_rowwise", robust to outlier tokens) or one per batch sample ("scaled_mm_tensorwise", needs an
# amax per sample). The one-line switch (docs/benchmarks.md compares the two).
PER_TENSOR_DEFAULT_PATH: Fp8Path = "scaled_mm_rowwise"

# Paths whose GEMM adds the bias in its epilogue (torch requires bias dtype == output dtype there).
_EPILOGUE_BIAS_PATHS = frozenset({"scaled_mm_tensorwise", "scaled_mm_rowwise", "scaled_mm_blockwise"})
_FP8_ACT_DTYPES = (torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------------------------
# Weight quantization


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """fp32 scale amax / 448 (IEEE division on every device); zero amax gets SCALE_MIN."""
    a = amax.float()
    # The divisor is a tensor on amax's device, not the Python float 448: torch's CUDA kernel evaluates
    # `t / 448.0` as t * fp32(1/448) (aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu, a CPU-scalar divisor),
    # 1 ulp off the IEEE quotient for some amax, while its CPU kernel and the
    # Triton kernels (div_rn) divide, so GPU and CPU weight scales could differ.
    # A tensor / tensor division is IEEE on CPU and CUDA alike, so weights quantized on either device and
    # activations quantized by torch or Triton are bit-identical, and re-quantizing q * scale returns scale.
    return (a / a.new_full((), FP8_MAX)).clamp_min(SCALE_MIN)


def _cast_fp8(x32: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Divide by the (broadcast) scale, saturate to ±FP8_MAX and round to e4m3fn (round to nearest even)."""
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize any tensor to e4m3fn with one fp32 scale (0-dim): w ≈ q.float() * scale."""
    w32 = w.float()
    scale = _scale_from_amax(w32.abs().amax() if w32.numel() else w32.new_zeros(()))
    return _cast_fp8(w32, scale), scale


def dequantize_per_tensor(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """q.float() * scale, cast to dtype."""
    return (q.float() * scale.float()).to(dtype)


def _check_blockwise(w: torch.Tensor, block_size: int) -> None:
    if w.dim() != 2:
        raise ValueError(f"block-wise fp8 needs a 2-D weight [out, in], got shape {tuple(w.shape)}; "
                         "use quantize_per_tensor for other tensors")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int (128 or 64), got {block_size!r}")


def blockwise_scale_shape(out_features: int, in_features: int, block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[int, int]:
    """Shape of the block-wise scale of an [out, in] weight: (ceil(out/bs), ceil(in/bs))."""
    return math.ceil(out_features / block_size), math.ceil(in_features / block_size)


def quantize_blockwise(w: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight per (block_size x block_size) tile; edge tiles are partial (zero-padded for amax)."""
    _check_blockwise(w, block_size)
    n, k = w.shape
    nb, kb = blockwise_scale_shape(n, k, block_size)
    # Zero padding does not change a tile's amax, so partial edge tiles are handled exactly.
    wp = F.pad(w.float(), (0, kb * block_size - k, 0, nb * block_size - n)).view(nb, block_size, kb, block_size)
    scale = _scale_from_amax(wp.abs().amax(dim=(1, 3)))
    q = _cast_fp8(wp, scale[:, None, :, None]).view(nb * block_size, kb * block_size)
    return q[:n, :k].contiguous(), scale


def check_block_scale(scale: torch.Tensor, shape: tuple[int, int], block_size: int) -> None:
    """Raise a ValueError naming both shapes unless ``scale`` is the block scale of an [N, K] weight."""
    n, k = shape
    if tuple(scale.shape) != blockwise_scale_shape(n, k, block_size):
        raise ValueError(f"block scale shape {tuple(scale.shape)} does not match weight {tuple(shape)} with "
                         f"block_size {block_size} (expected {blockwise_scale_shape(n, k, block_size)})")


def expand_block_scale(scale: torch.Tensor, shape: tuple[int, int], block_size: int) -> torch.Tensor:
    """Per-element fp32 scale of an [N, K] weight from its block scale [ceil(N/bs), ceil(K/bs)]."""
    n, k = shape
    check_block_scale(scale, shape, block_size)
    s = scale.float().repeat_interleave(block_size, 0).repeat_interleave(block_size, 1)
    return s[:n, :k]


def expand_scale(scale: torch.Tensor, shape: tuple[int, int], block_size: int, device: torch.device) -> torch.Tensor:
    """fp32 scale of an [N, K] weight on ``device``: a 0-d per-tensor scale as is, a block scale per element."""
    s = scale.to(device=device, dtype=torch.float32)
    return s if s.ndim == 0 else expand_block_scale(s, shape, block_size)


def dequantize_blockwise(
    q: torch.Tensor, scale: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """q.float() * (block scale broadcast over its tile), cast to dtype."""
    _check_blockwise(q, block_size)
    return (q.float() * expand_block_scale(scale, tuple(q.shape), block_size)).to(dtype)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, block_size: int | None = None, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Dequantize a per-tensor (block_size None) or block-wise fp8 weight."""
    if block_size is None:
        return dequantize_per_tensor(q, scale, dtype)
    return dequantize_blockwise(q, scale, block_size, dtype)


# --------------------------------------------------------------------------------------------------------------
# Activation quantization (torch versions: the CPU fallback, the reference, and compile-fusable as written)


def quantize_rowwise_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (q [M, K] e4m3fn, scale [M, 1] fp32): one scale per token."""
    x32 = x.float()
    scale = _scale_from_amax(x32.abs().amax(dim=1, keepdim=True))
    return _cast_fp8(x32, scale), scale


def quantize_groupwise_torch(
    x: torch.Tensor, group_size: int = DEFAULT_BLOCK_SIZE, pad_rows_to: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (q [Mp, K], scale [Mp, ceil(K/g)] column-major): one scale per token per K-group of group_size.

    Rows are zero-padded to Mp = a multiple of pad_rows_to (cuBLASLt wants M % 4 == 0 for 1x128 scales).
    The scale has strides (1, Mp), the layout `F.scaled_mm` BlockWise1x128 requires.
    """
    m, k = x.shape
    mp = -(-m // pad_rows_to) * pad_rows_to
    kg = math.ceil(k / group_size)
    xp = F.pad(x.float(), (0, kg * group_size - k, 0, mp - m)).view(mp, kg, group_size)
    scale = _scale_from_amax(xp.abs().amax(dim=2))
    q = _cast_fp8(xp, scale[:, :, None]).view(mp, kg * group_size)[:, :k].contiguous()
    return q, scale.t().contiguous().t()


def quantize_tensorwise_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (q, scale 0-dim fp32): one scale for the whole activation."""
    return quantize_per_tensor(x)


def quantize_activation(
    x: torch.Tensor, mode: Literal["row", "group", "tensor"], group_size: int = DEFAULT_BLOCK_SIZE, pad_rows_to: int = 1,
    fold: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D activation in one fused pass on CUDA (Triton), or with the torch versions elsewhere.
    ``fold`` (mode "row" only): a one-element fp32 tensor multiplied into the returned row scales."""
    tq = fp8_triton if x.is_cuda and fp8_triton.TRITON_AVAILABLE else None
    if mode == "row":
        if tq:
            return tq.quantize_rowwise(x, fold)
        q, s = quantize_rowwise_torch(x)
        return q, s if fold is None else s * fold
    if mode == "group":
        if tq:
            return tq.quantize_groupwise(x, group_size, pad_rows_to)
        return quantize_groupwise_torch(x, group_size, pad_rows_to)
    if mode == "tensor":
        return tq.quantize_tensorwise(x) if tq else quantize_tensorwise_torch(x)
    raise ValueError(f"unknown activation quantization mode {mode!r}; expected 'row', 'group' or 'tensor'")


# --------------------------------------------------------------------------------------------------------------
# Path selection


@torch.compiler.assume_constant_result
def _cuda_capability(index: int) -> tuple[int, int]:
    # assume_constant_result: dynamo evaluates this once while tracing instead of graph-breaking on it.
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device | str) -> tuple[int, int] | None:
    """(major, minor) of an NVIDIA GPU, None for CPU/other devices and ROCm (whose fp8 is e4m3fnuz)."""
    device = torch.device(device)
    if device.type != "cuda" or torch.version.hip is not None or not torch.cuda.is_available():
        return None
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


def capability_code(cap: tuple[int, int] | None) -> int:
    """(major, minor) as one int (8.9 -> 89, 9.0 -> 90; -1 for no NVIDIA GPU). Code that torch.compile traces
    compares these ints: Dynamo (torch 2.11) fails on comparisons of capability tuples with an internal error."""
    return -1 if cap is None else cap[0] * 10 + cap[1]


def has_blockwise_scaled_mm() -> bool:
    """True when torch has the public F.scaled_mm with 1x128 / 128x128 block scaling (torch >= 2.10)."""
    return hasattr(F, "scaled_mm") and hasattr(F, "ScalingType") and hasattr(F.ScalingType, "BlockWise128x128")


_FALLBACKS_SAID: set[tuple] = set()  # (device, capability, reason) already logged: say each fallback once


def _gpu_name(device: torch.device) -> str:
    try:
        return torch.cuda.get_device_name(device)
    except Exception:  # no driver, CPU-only torch: the device string still identifies it
        return str(device)


def _say_fallback(device: torch.device, cap: tuple[int, int] | None, compute: str, why: str, fix: str) -> None:
    """Log once per device and reason that fp8 matmul was asked for (compute auto/fp8) but dequantize runs."""
    key = (str(device), cap, why)
    if key in _FALLBACKS_SAID or torch.compiler.is_compiling():  # no logging inside a traced region
        return
    _FALLBACKS_SAID.add(key)
    gpu = f"{_gpu_name(device)} ({device}, compute capability {'.'.join(map(str, cap)) if cap else 'unknown'})"
    log.warning("lowvram_dit fp8: compute '%s' asked for fp8 matmul, but %s %s; falling back to 'dequantize' "
                "(fp8 weights in memory, bf16/fp16 matmul: the memory saving stays, the fp8 speed-up does not). %s",
                compute, gpu, why, fix)


def select_path(
    device: torch.device | str,
    block_size: int | None,
    out_features: int,
    in_features: int,
    compute: Fp8Compute = "auto",
    capability: tuple[int, int] | None = None,
) -> Fp8Path:
    """Pick the fp8 linear path for a device and weight layout (block_size None = per-tensor weights).

    compute="auto" uses fp8 matmul wherever the GPU and shape allow it; "fp8" does the same but raises when the
    GPU cannot do fp8 matmul at all; "dequantize" always dequantizes. `capability` overrides the detected
    (major, minor), for tests and planning.
    """
    if compute not in FP8_COMPUTE:
        raise ValueError(f"fp8 compute must be one of {FP8_COMPUTE}, got {compute!r}")
    if compute == "dequantize":
        return "dequantize"
    detected = capability is None  # an explicit capability is planning or a test: nothing to tell the user
    cap = capability if capability is not None else device_capability(device)
    code = capability_code(cap)
    if code < 89:
        if compute == "fp8":
            raise RuntimeError(
                f"fp8 compute='fp8' needs an NVIDIA GPU with compute capability >= 8.9 (RTX 40xx, H100, RTX 50xx); "
                f"device {device} has {cap}. Set compute to 'auto' or 'dequantize'.")
        if detected and torch.device(device).type == "cuda":  # a CPU run never promised fp8 matmul
            why = ("has no fp8 matmul the pack can use (ROCm fp8 is e4m3fnuz, or CUDA is unavailable)" if cap is None
                   else "has no fp8 matmul (needs compute capability >= 8.9: RTX 40xx, H100, RTX 50xx)")
            _say_fallback(torch.device(device), cap, compute, why,
                          "Set compute to 'dequantize' on this GPU to silence this message.")
        return "dequantize"
    if out_features % 16 or in_features % 16:  # cuBLASLt fp8 GEMMs need both dims multiples of 16
        return "dequantize"
    if block_size is None:
        # Row-wise scaled_mm: CUTLASS on SM89 (torch >= 2.7), cuBLASLt/CUTLASS on SM90; not on SM100/SM120.
        if PER_TENSOR_DEFAULT_PATH == "scaled_mm_rowwise" and code in (89, 90):
            return "scaled_mm_rowwise"
        return "scaled_mm_tensorwise"
    if (block_size == 128 and cap[0] == 9 and has_blockwise_scaled_mm()
            and out_features % 128 == 0 and in_features % 128 == 0):
        return "scaled_mm_blockwise"  # cuBLASLt 1x128 x 128x128 exists on SM90 only
    if detected and out_features % 128 == 0 and in_features % 128 == 0:  # odd-shaped small layers: not news
        if block_size != 128:
            why = f"has no fp8 matmul for block-wise weights with block_size {block_size} (only 128 has one)"
        elif cap[0] != 9:
            why = "has no block-wise fp8 matmul (cuBLASLt 1x128/128x128 scaling exists on Hopper, SM 9.0, only)"
        else:
            why = f"runs torch {torch.__version__}, which lacks block-scaled F.scaled_mm (torch >= 2.10)"
        fix = "Quantize with 'fp8 per-tensor' for fp8 matmul on this GPU, or set compute to 'dequantize'."
        if block_size != 128 and cap[0] == 9:
            fix = "Use block_size 128 (or 'fp8 per-tensor') for fp8 matmul on this GPU."
        _say_fallback(torch.device(device), cap, compute, why, fix)
    return "dequantize"


# --------------------------------------------------------------------------------------------------------------
# The fp8 linear


# (device, N) -> a (1, N) fp32 row of ones: row-wise scaled_mm wants a (1, N) scale_b. The weight's per-tensor scale
# is folded into the activation's row scales by the quantizer instead (fp8_triton, FOLD), so that a linear call
# launches no kernel to expand it. ComfyUI loads weights under inference mode, and an inference tensor has no version
# counter to tell whether a kept expansion of its scale is still current; these rows never change.
_ONES_ROWS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _ones_row(device: torch.device, n: int) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return torch.ones((1, n), dtype=torch.float32, device=device)
    row = _ONES_ROWS.get((device, n))
    if row is None:
        row = _ONES_ROWS[(device, n)] = torch.ones((1, n), dtype=torch.float32, device=device)
    return row


def _blockwise_weight_scale(weight_scale: torch.Tensor) -> torch.Tensor:
    """[N/128, K/128] -> [L4, N/128] with strides (1, L4), L4 = K/128 rounded up to 4 (torch's meta check)."""
    kb = weight_scale.shape[1]
    s = weight_scale.float()
    if kb % 4:
        s = F.pad(s, (0, -kb % 4))
    return s.t()


@dataclass(frozen=True)
class ActQuant:
    """How fp8_linear runs its GEMM beyond its path.

    fast_accum: torch._scaled_mm's use_fast_accum (Hopper: fp8 MMA partial sums are not promoted to fp32)."""

    fast_accum: bool = False


# Fast accumulation by default: on Hopper the fp8 MMA's partial sums skip their periodic fp32 promotion. The
# operands' own fp8 rounding dominates the error, so the output barely moves while the GEMM gets faster
# (docs/investigations/2026-11-26-fp8-scale-chooser.md). GPUs without fp8 never reach it.
DEFAULT_ACT = ActQuant(fast_accum=True)


def _gemm(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None,
          out_dtype: torch.dtype, fast_accum: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    kwargs = {} if out is None else {"out": out}
    if fast_accum and xq.is_cuda:  # CPU kernels (tests) have no such mode; older ones reject the argument
        kwargs["use_fast_accum"] = True
    return torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=ws, bias=bias, out_dtype=out_dtype, **kwargs)


def _linear_per_sample(x2: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None, path: Fp8Path, out_dtype: torch.dtype, samples: int,
                       act: ActQuant = DEFAULT_ACT) -> torch.Tensor:
    """One fp8 GEMM per batch sample, so a sample's output never depends on what it is batched with.

    cond and uncond share one call on one GPU but run one each on two under ComfyUI's MultiGPU split: a per-call
    activation scale over both, or a GEMM kernel that cuBLASLt picks for twice the rows (another split of the
    reduction), would give the two a different picture. Each sample's rows are a contiguous block of ``x2``."""
    if samples == 1:
        return _linear_scaled_mm(x2, weight, weight_scale, bias, path, out_dtype, act=act)
    out = torch.empty((x2.shape[0], weight.shape[0]), dtype=out_dtype, device=x2.device)
    for rows, dest in zip(x2.chunk(samples), out.chunk(samples)):
        _linear_scaled_mm(rows, weight, weight_scale, bias, path, out_dtype, out=dest, act=act)
    return out


def _linear_scaled_mm(x2: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                      path: Fp8Path, out_dtype: torch.dtype, out: torch.Tensor | None = None,
                      act: ActQuant = DEFAULT_ACT) -> torch.Tensor:
    """One fp8 GEMM on [M, K] rows (written into ``out`` when given)."""
    n = weight.shape[0]
    if path == "scaled_mm_rowwise":  # per-tensor weight scale folded into the row scales, ones for scale_b
        if weight_scale.device != x2.device:  # the quantizer reads it through a raw pointer
            raise ValueError(f"fp8 linear: weight scale on {weight_scale.device}, activations on {x2.device}")
        xq, xs = quantize_activation(x2, "row", fold=weight_scale)
        return _gemm(xq, xs, weight, _ones_row(x2.device, n), bias, out_dtype, act.fast_accum, out)
    if path == "scaled_mm_tensorwise":
        xq, xs = quantize_activation(x2, "tensor")
        return _gemm(xq, xs, weight, weight_scale.float(), bias, out_dtype, act.fast_accum, out)
    # scaled_mm_blockwise
    m = x2.shape[0]
    xq, xs = quantize_activation(x2, "group", 128, pad_rows_to=4)
    ws = _blockwise_weight_scale(weight_scale)
    if torch.compiler.is_compiling() and _BLOCKWISE_OP is not None:
        y = _BLOCKWISE_OP(xq, weight, xs, ws, bias, out_dtype)
    else:  # eager: call it directly, skipping the custom op's extra Python dispatch
        y = _scaled_mm_blockwise(xq, weight, xs, ws, bias, out_dtype)
    y = y[:m] if y.shape[0] != m else y
    return y if out is None else out.copy_(y)


def _scaled_mm_blockwise(xq: torch.Tensor, weight: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor,
                         bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """F.scaled_mm with 1x128 activation and 128x128 weight scales (layouts from quantize_activation and
    _blockwise_weight_scale)."""
    return F.scaled_mm(xq, weight.t(), xs, F.ScalingType.BlockWise1x128, ws, F.ScalingType.BlockWise128x128,
                       bias=bias, output_dtype=out_dtype)


def _register_blockwise_op():
    """Wrap the block-wise F.scaled_mm in a custom op so torch.compile(fullgraph=True) can hold it.

    Dynamo cannot trace `torch._scaled_mm_v2`, which F.scaled_mm calls (torch 2.11: "Dynamo does not know how to
    trace the builtin torch._VariableFunctionsClass._scaled_mm_v2"), so compiled Wan blocks would graph-break on
    every block-wise linear. As a custom op it is one opaque node; its fake implementation is the same call on
    fake tensors, which runs torch's own meta checks of the scale layouts.
    """
    if not has_blockwise_scaled_mm():
        return None
    name = "lowvram_dit::fp8_scaled_mm_blockwise"
    try:
        op = torch.library.custom_op(name, mutates_args=())(_scaled_mm_blockwise)
        op.register_fake(_scaled_mm_blockwise)
        return op
    except RuntimeError:  # already registered by another import of this file (ComfyUI + editable install)
        return torch.ops.lowvram_dit.fp8_scaled_mm_blockwise.default


_BLOCKWISE_OP = _register_blockwise_op()


def _dequantize_dtype(x: torch.Tensor) -> torch.dtype:
    """The matmul dtype of the dequantize path: the activation's own float dtype, bf16 for anything narrower."""
    return x.dtype if x.dtype.is_floating_point and x.dtype.itemsize >= 2 else torch.bfloat16


def _linear_dequantize(x2: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                       block_size: int | None, out_dtype: torch.dtype) -> torch.Tensor:
    compute = _dequantize_dtype(x2)
    w = dequantize(weight, weight_scale, block_size, compute)
    out = F.linear(x2.to(compute), w, bias.to(compute) if bias is not None else None)
    return out.to(out_dtype)


def _resolve(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block_size: int | None,
             path: Fp8Path | None, out_dtype: torch.dtype) -> Fp8Path:
    """Validate the weight layout and settle the path (auto-selected fp8 paths fall back for fp32 activations)."""
    if weight.dtype != FP8_DTYPE or weight.dim() != 2:
        raise ValueError(f"fp8_linear needs a 2-D float8_e4m3fn weight, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"fp8_linear: input has {x.shape[-1]} features, weight expects {k}")
    if block_size is None and weight_scale.numel() != 1:
        raise ValueError(f"per-tensor fp8 weight needs one scale, got shape {tuple(weight_scale.shape)}; "
                         "pass block_size for block-wise scales")
    if block_size is not None and tuple(weight_scale.shape) != blockwise_scale_shape(n, k, block_size):
        raise ValueError(f"block-wise scale shape {tuple(weight_scale.shape)} does not match weight {(n, k)} "
                         f"with block_size {block_size}")
    fp8_dtypes_ok = x.dtype in _FP8_ACT_DTYPES and out_dtype in _FP8_ACT_DTYPES
    if path is None:
        path = select_path(x.device, block_size, n, k)
        return path if fp8_dtypes_ok or path == "dequantize" else "dequantize"
    if path not in FP8_PATHS:
        raise ValueError(f"unknown fp8 path {path!r}; expected one of {FP8_PATHS}")
    if path != "dequantize" and not fp8_dtypes_ok:
        raise ValueError(f"fp8 path {path!r} needs bf16/fp16 activations and output, got {x.dtype} -> {out_dtype}")
    if path in ("scaled_mm_rowwise", "scaled_mm_tensorwise") and block_size is not None:
        raise ValueError(f"fp8 path {path!r} needs per-tensor weights (block_size=None), got block_size {block_size}")
    if path == "scaled_mm_blockwise" and block_size is None:
        raise ValueError(f"fp8 path {path!r} needs block-wise weights (block_size=128 or 64)")
    if path == "scaled_mm_blockwise" and block_size != 128:
        raise ValueError(f"scaled_mm_blockwise needs block_size 128, got {block_size}; use 'dequantize'")
    return path


def fp8_linear(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None, *,
    block_size: int | None = None, path: Fp8Path | None = None, out_dtype: torch.dtype | None = None,
    act: ActQuant | None = None,
) -> torch.Tensor:
    """y = x @ (weight_fp8 * scale).T + bias for x [..., K]; activations quantized dynamically (path None = auto),
    with the GEMM options of ``act`` (ActQuant; None = DEFAULT_ACT)."""
    out_dtype = out_dtype or x.dtype
    act = act or DEFAULT_ACT
    path = _resolve(x, weight_fp8, weight_scale, block_size, path, out_dtype)
    x2 = x.reshape(-1, x.shape[-1])
    n = weight_fp8.shape[0]
    if path == "dequantize":
        out = _linear_dequantize(x2, weight_fp8, weight_scale, bias, block_size, out_dtype)
    else:
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        b = bias.to(out_dtype) if bias is not None else None
        out = _linear_per_sample(x2, weight_fp8, weight_scale, b if path in _EPILOGUE_BIAS_PATHS else None,
                                 path, out_dtype, samples_of(x), act)
        if b is not None and path not in _EPILOGUE_BIAS_PATHS:
            out = out + b
    return out.reshape(*x.shape[:-1], n)


def fp8_linear_reference(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None, *,
    block_size: int | None = None, path: Fp8Path | None = None, out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """fp32 emulation of exactly what fp8_linear computes on `path` (same quantization, exact fp32 GEMM)."""
    out_dtype = out_dtype or x.dtype
    path = _resolve(x, weight_fp8, weight_scale, block_size, path, out_dtype)
    x2 = x.reshape(-1, x.shape[-1])
    n, k = weight_fp8.shape
    w32 = dequantize(weight_fp8, weight_scale, block_size, torch.float32)
    if path == "dequantize":
        compute = _dequantize_dtype(x2)
        a32 = x2.to(compute).float()
        w32 = w32.to(compute).float()  # the fast path multiplies a weight rounded to the compute dtype
        b32 = bias.to(compute).float() if bias is not None else None
    else:
        if path == "scaled_mm_rowwise":
            xq, xs = quantize_rowwise_torch(x2)
            a32 = xq.float() * xs
        elif path == "scaled_mm_tensorwise":  # one scale per batch sample, as fp8_linear
            a32 = torch.cat([q.float() * s for q, s in map(quantize_tensorwise_torch, x2.chunk(samples_of(x)))])
        else:  # block-wise paths: activation groups of 128 (cuBLASLt) or of block_size (Triton)
            g = 128 if path == "scaled_mm_blockwise" else block_size
            xq, xs = quantize_groupwise_torch(x2, g)
            a32 = xq.float() * xs.repeat_interleave(g, 1)[:, :k]
        b32 = bias.to(out_dtype).float() if bias is not None else None
    out = a32 @ w32.t()
    if b32 is not None:
        out = out + b32
    return out.to(out_dtype).reshape(*x.shape[:-1], n)


@functools.lru_cache(maxsize=None)
def describe_path(path: Fp8Path) -> str:
    """One-line human description of a path, for logs and the doctor node."""
    return {
        "scaled_mm_rowwise": "fp8 matmul, per-token activation scales (torch._scaled_mm row-wise)",
        "scaled_mm_tensorwise": "fp8 matmul, one activation scale per batch sample (torch._scaled_mm)",
        "scaled_mm_blockwise": "fp8 matmul, 1x128 activation / 128x128 weight blocks (F.scaled_mm)",
        "dequantize": "weights dequantized to the compute dtype, bf16/fp16 matmul",
    }[path]
