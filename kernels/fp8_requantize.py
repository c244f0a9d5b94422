"""A patched weight back to fp8 codes with its layer's own scale, in one pass: the LoRA merge's last step.

``codes = fp8(clamp(weight / scale, +-448))`` with a per-tensor (0-d) or block-wise scale, and the clip check's
peak: the largest ``|weight / scale|`` past 448, divided by 448 (0 where none is; NaN never counts), left on the
device so that a merge inside a forward never waits for the GPU. In torch that is eight passes over the weight
(the fp32 copy, the division, abs, the comparison, where, amax, clamp and the cast) for each merged weight at
each load. The Triton kernel reads the weight once and writes the codes and one partial peak per program; its bits
equal the torch reference's (IEEE division through tl.math.div_rn, round-to-nearest-even casts, NaN kept by the
clamp), which tests/unit/test_fp8_requantize_cuda.py checks on the GPU.

Plain torch and Triton, no ComfyUI import.
"""

from __future__ import annotations

import torch

from .fp8 import FP8_MAX, check_block_scale, expand_scale
from .triton_launch import launcher

try:  # Triton is optional: CPU boxes, and Windows installs without triton-windows
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except Exception:  # noqa: BLE001 - a broken triton install must not break the pack
    TRITON_AVAILABLE = False

_BLOCK = 4096  # elements per program

if TRITON_AVAILABLE:

    @triton.jit
    def _requant_kernel(w_ptr, s_ptr, q_ptr, peak_ptr, n, k, n_kb, BS: tl.constexpr, PER_TENSOR: tl.constexpr,
                        BLOCK: tl.constexpr):
        """codes of BLOCK elements of a contiguous [N, K] weight and their clip peak (one partial per program)."""
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        w = tl.load(w_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        if PER_TENSOR:
            scale = tl.load(s_ptr)
        else:  # block (r // BS, c // BS) of the [ceil(N/BS), ceil(K/BS)] scale
            scale = tl.load(s_ptr + (offs // k // BS) * n_kb + (offs % k) // BS, mask=inside, other=1.0)
        c = tl.math.div_rn(w, scale)
        mag = tl.abs(c)
        tl.store(peak_ptr + pid, tl.max(tl.where(mag > 448.0, mag, 0.0), axis=0))  # NaN > 448 is False
        q = tl.clamp(c, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
        tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=inside)


def requantize_torch(weight: torch.Tensor, scale: torch.Tensor, block_size: int | None,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference (and the CPU path): ``(codes, peak)`` as the module doc says, in torch ops."""
    codes = weight.float() / expand_scale(scale, tuple(weight.shape), block_size, weight.device)
    mag = codes.abs()
    peak = (torch.where(mag > FP8_MAX, mag, 0.0).amax() if codes.numel() else codes.new_zeros(())) / FP8_MAX
    return codes.clamp_(-FP8_MAX, FP8_MAX).to(dtype), peak


def _triton_applies(weight: torch.Tensor, scale: torch.Tensor, block_size: int | None, dtype: torch.dtype) -> bool:
    if not (TRITON_AVAILABLE and weight.is_cuda and torch.version.hip is None and dtype == torch.float8_e4m3fn
            and weight.is_contiguous() and weight.numel()
            and weight.dtype in (torch.float16, torch.bfloat16, torch.float32)):
        return False
    if torch.cuda.get_device_capability(weight.device) < (8, 9):  # no fp8 conversion instructions before Ada
        return False
    return scale.ndim == 0 or (weight.dim() == 2 and scale.dim() == 2 and bool(block_size))


def requantize(weight: torch.Tensor, scale: torch.Tensor, block_size: int | None,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (real values, any float dtype) as ``dtype`` codes of ``scale`` (0-d per tensor, or per
    ``block_size`` x ``block_size`` tile of a 2-D weight) and the clip peak (0-d fp32 on the weight's device).
    One Triton kernel on a CUDA GPU with fp8 conversions (sm89+), the torch reference elsewhere; same bits."""
    if not _triton_applies(weight, scale, block_size, dtype):
        return requantize_torch(weight, scale, block_size, dtype)
    return _launch(weight, scale, block_size, dtype, launcher)


def _launch(weight: torch.Tensor, scale: torch.Tensor, block_size: int | None, dtype: torch.dtype,
            wrap) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001 - a kernel wrapper
    s = scale.to(device=weight.device, dtype=torch.float32).contiguous()
    per_tensor = s.ndim == 0
    if not per_tensor:
        check_block_scale(s, tuple(weight.shape), block_size)
    n = weight.numel()
    k = weight.shape[-1] if weight.dim() else 1
    grid = triton.cdiv(n, _BLOCK)
    q = torch.empty_like(weight, dtype=dtype)
    partial = torch.empty(grid, dtype=torch.float32, device=weight.device)
    wrap(_requant_kernel)[(grid,)](weight, s, q, partial, n, k, 1 if per_tensor else s.shape[1],
                                   BS=1 if per_tensor else block_size, PER_TENSOR=per_tensor, BLOCK=_BLOCK)
    return q, partial.amax() / FP8_MAX
