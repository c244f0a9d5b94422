"""Int8 W8A8 linears for GPUs without fp8 matmul: int8 weights per output channel, int8 activations per token.

RTX 20xx/30xx and A-series GPUs (compute capability 7.5 to 8.7) have int8 tensor cores but no fp8 ones, so the
pack's fp8 weights would otherwise dequantize to bf16 there. This module turns a weight (fp8 with a per-tensor or
block-wise scale, or a float weight) into int8 codes with one fp32 scale per output channel, quantizes the
activation per token in one pass (symmetric: scale = amax / 127), and runs an int8 x int8 -> int32 GEMM whose
epilogue applies both scales and the bias and casts to the output dtype:

    y[m, n] = (acc[m, n] * x_scale[m]) * w_scale[n] + bias[n]

GEMMs (``Int8Gemm``): "int_mm" is ``torch._int_mm`` (cuBLASLt on CUDA, also on CPU) with the epilogue in torch;
"triton" is kernels/int8_triton.py's GEMM with the epilogue fused (CUDA, compute capability >= 8.0); "reference"
is an exact float64 emulation for tests. The accumulation is exact integer arithmetic, so every GEMM gives the same
int32 sums, and a row's output never depends on the rows it is batched with (per-token scales, exact sums).

Optional rotation (``rotate=True``): activations and weights are both multiplied by the same orthonormal
block-diagonal Hadamard matrix (blocks of ROTATION_BLOCK along K) before quantization. x W^T is unchanged
((x H)(W H)^T = x W^T), but an outlier channel is spread over its block, so the per-token amax (and the int8
step) shrinks. It needs K to be a multiple of ROTATION_BLOCK.

Non-finite activations stay non-finite: a NaN in a token makes its amax and scale NaN (torch's amax and clamp
propagate NaN, the Triton kernel keeps it explicitly), and the epilogue multiplies the whole output row by that
scale; an inf gives an inf scale, so the row's outputs are inf or NaN. The int8 codes of such a row are
meaningless and never looked at.
"""

from __future__ import annotations

import functools
from typing import Literal, get_args

import torch

from . import fp8, int8_triton

INT8_MAX = 127.0
SCALE_MIN = fp8.SCALE_MIN  # floor for scales: an all-zero row or token never divides by zero
ROTATION_BLOCK = 128
Int8Gemm = Literal["int_mm", "triton", "reference"]
INT8_GEMMS: tuple[str, ...] = get_args(Int8Gemm)
_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --------------------------------------------------------------------------------------------------------------
# Quantization (torch versions: CPU, the reference, and the fallback without Triton)


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """fp32 amax / 127 with an IEEE tensor division (as kernels/fp8.py: bit-equal on CPU, CUDA and Triton)."""
    a = amax.float()
    return (a / a.new_full((), INT8_MAX)).clamp_min(SCALE_MIN)


def _cast_int8(x32: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Divide by the (broadcast) scale, round half to even, saturate to +-127 (never -128: symmetric)."""
    return torch.round(x32 / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)


@functools.lru_cache(maxsize=8)
def hadamard(n: int = ROTATION_BLOCK, device: str = "cpu") -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix of size ``n`` (a power of two), fp32, entries +-1/sqrt(n)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard block must be a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n**0.5).to(device)


def rotate_blocks(t: torch.Tensor) -> torch.Tensor:
    """fp32 ``t`` [R, K] times the block-diagonal Hadamard (ROTATION_BLOCK-wide blocks along K)."""
    r, k = t.shape
    if k % ROTATION_BLOCK:
        raise ValueError(f"rotation needs K to be a multiple of {ROTATION_BLOCK}, got K={k}")
    h = hadamard(ROTATION_BLOCK, str(t.device))
    return (t.float().reshape(r, k // ROTATION_BLOCK, ROTATION_BLOCK) @ h).reshape(r, k)


def quantize_rows_torch(t: torch.Tensor, rotate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, K] -> (q int8 [R, K], scale fp32 [R, 1]): one symmetric scale per row (token or output channel)."""
    t32 = rotate_blocks(t) if rotate else t.float()
    scale = _scale_from_amax(t32.abs().amax(dim=1, keepdim=True) if t32.shape[1] else t32.new_zeros(t32.shape[0], 1))
    return _cast_int8(t32, scale), scale


def quantize_activation(x2: torch.Tensor, rotate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token int8 of a 2-D activation: one fused Triton kernel on CUDA, the torch version elsewhere."""
    if x2.is_cuda and int8_triton.TRITON_AVAILABLE:
        return int8_triton.quantize_rows(x2.contiguous(), rotate=rotate)
    return quantize_rows_torch(x2, rotate)


def quantize_weight(w: torch.Tensor, rotate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> (int8 [N, K], fp32 scale [N]): one scale per output channel."""
    if w.dim() != 2:
        raise ValueError(f"int8 weights are 2-D [out, in], got shape {tuple(w.shape)}")
    if w.is_cuda and int8_triton.TRITON_AVAILABLE:
        q, s = int8_triton.quantize_rows(w.contiguous(), rotate=rotate)
    else:
        q, s = quantize_rows_torch(w, rotate)
    return q, s.reshape(-1)


def weight_from_fp8(weight: torch.Tensor, weight_scale: torch.Tensor, block_size: int | None = None,
                    rotate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The pack's fp8 weight (per-tensor scale, or block-wise with ``block_size``) -> per-channel int8 + scale [N].

    Dequantized to fp32 values first, then quantized per row; on CUDA one Triton kernel reads the fp8 codes and
    their scale directly (no fp32 copy of the weight)."""
    if weight.dtype != fp8.FP8_DTYPE or weight.dim() != 2:
        raise ValueError(f"expected a 2-D float8_e4m3fn weight, got {weight.dtype} {tuple(weight.shape)}")
    if weight.is_cuda and int8_triton.TRITON_AVAILABLE:
        s = weight_scale.to(device=weight.device, dtype=torch.float32)
        q, rs = int8_triton.quantize_rows(weight.contiguous(), rotate=rotate, in_scale=s,
                                          in_block=block_size if s.ndim else 0)
        return q, rs.reshape(-1)
    return quantize_weight(fp8.dequantize(weight, weight_scale, block_size, torch.float32), rotate)


# --------------------------------------------------------------------------------------------------------------
# GEMMs


def int_mm_ok(m: int, n: int, k: int) -> bool:
    """Whether ``torch._int_mm`` takes [M, K] x [K, N] as is: K and N multiples of 8 (M <= 16 is padded)."""
    return k > 0 and n > 0 and k % 8 == 0 and n % 8 == 0 and m > 0


def _epilogue(acc: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None,
              out_dtype: torch.dtype) -> torch.Tensor:
    """(acc * x_scale) * w_scale + bias in fp32, then out_dtype (the same order as the Triton epilogue)."""
    out = acc.float().mul_(xs).mul_(ws.reshape(1, -1))
    if bias is not None:
        out.add_(bias.float())
    return out.to(out_dtype)


def _gemm_int_mm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    m = xq.shape[0]
    if m <= 16:  # _int_mm needs more than 16 rows: pad with zero tokens and drop them
        xq = torch.nn.functional.pad(xq, (0, 0, 0, 32 - m))
    acc = torch._int_mm(xq, wq.t())[:m]
    return _epilogue(acc, xs, ws, bias, out_dtype)


def _gemm_float(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """The integer sums in a float GEMM: exact in float64 (the reference), close in fp32 (the odd-shape fallback)."""
    acc = xq.to(dtype) @ wq.to(dtype).t()
    return _epilogue(acc, xs, ws, bias, out_dtype)


def _run_gemm(gemm: Int8Gemm, xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
              bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    m, k = xq.shape
    n = wq.shape[0]
    if gemm == "reference":
        return _gemm_float(xq, xs, wq, ws, bias, out_dtype, torch.float64)
    if gemm == "triton":
        return int8_triton.int8_mm(xq, xs, wq, ws, bias, out_dtype)
    if int_mm_ok(m, n, k):
        return _gemm_int_mm(xq, xs, wq, ws, bias, out_dtype)
    if xq.is_cuda and int8_triton.gemm_available(xq.device):  # odd K or N: Triton masks its edges
        return int8_triton.int8_mm(xq, xs, wq, ws, bias, out_dtype)
    return _gemm_float(xq, xs, wq, ws, bias, out_dtype, torch.float32)


def default_gemm(device: torch.device) -> Int8Gemm:
    """The GEMM to use when none is named: the fused Triton one where it runs (SM80+), else ``torch._int_mm``."""
    return "triton" if torch.device(device).type == "cuda" and int8_triton.gemm_available(device) else "int_mm"


def int8_linear(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                *, out_dtype: torch.dtype | None = None, gemm: Int8Gemm | None = None,
                rotate: bool = False) -> torch.Tensor:
    """y = x @ (weight_q * weight_scale[:, None]).T + bias for x [..., K], activations int8 per token.

    ``weight_q`` int8 [N, K] and ``weight_scale`` fp32 [N] come from ``weight_from_fp8`` / ``quantize_weight``
    with the same ``rotate``; ``gemm`` None = ``default_gemm``."""
    out_dtype = out_dtype or (x.dtype if x.dtype in _ACT_DTYPES else torch.bfloat16)
    if weight_q.dtype != torch.int8 or weight_q.dim() != 2:
        raise ValueError(f"int8_linear needs a 2-D int8 weight, got {weight_q.dtype} {tuple(weight_q.shape)}")
    n, k = weight_q.shape
    if x.shape[-1] != k or weight_scale.numel() != n:
        raise ValueError(f"int8_linear: input has {x.shape[-1]} features, weight {tuple(weight_q.shape)} with "
                         f"{weight_scale.numel()} scales")
    if gemm is not None and gemm not in INT8_GEMMS:
        raise ValueError(f"unknown int8 GEMM {gemm!r}; expected one of {INT8_GEMMS}")
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], n), dtype=out_dtype)
    xq, xs = quantize_activation(x2, rotate)
    b = bias.to(out_dtype) if bias is not None else None  # the bias is rounded to out_dtype, as fp8_linear does
    out = _run_gemm(gemm or default_gemm(x.device), xq, xs, weight_q, weight_scale.float(), b, out_dtype)
    return out.reshape(*x.shape[:-1], n)


def int8_linear_reference(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor,
                          bias: torch.Tensor | None = None, *, out_dtype: torch.dtype | None = None,
                          rotate: bool = False) -> torch.Tensor:
    """Plain-torch emulation of ``int8_linear``: torch quantizers and an exact float64 GEMM."""
    out_dtype = out_dtype or (x.dtype if x.dtype in _ACT_DTYPES else torch.bfloat16)
    n, k = weight_q.shape
    xq, xs = quantize_rows_torch(x.reshape(-1, k), rotate)
    b = bias.to(out_dtype) if bias is not None else None
    out = _gemm_float(xq, xs, weight_q, weight_scale.float(), b, out_dtype, torch.float64)
    return out.reshape(*x.shape[:-1], n)


def describe() -> str:
    """One-line description of the int8 compute path, for logs and reports."""
    return "int8 matmul (W8A8: int8 weights per output channel, int8 activations per token)"
