"""Fused Triton kernels for fp8 linears: row-wise, group-wise and tensor-wise activation quantization.

Activation quantization must be one kernel: amax, scale and cast done eagerly cost about as much as the fp8 GEMM
saves. The kernels are registered as
`torch.library.triton_op`s (namespace `lowvram_dit`), so torch.compile traces through them without a graph break
and inductor sees the Triton kernel itself.

The math is exactly kernels/fp8.py's torch versions: scale = max(amax / 448, SCALE_MIN) and
q = e4m3fn(clamp(x / scale, ±448)), both divisions IEEE-rounded (tl.math.div_rn; Triton's plain `/` on fp32 is the
approximate div.full.f32), so the GPU bits match the torch reference on CPU and on CUDA.
Non-finite values behave as in torch, whose amax and clamp propagate NaN: a NaN in a row (group, tensor) makes its
scale NaN and every code of it NaN; an inf makes the scale inf, the inf itself a NaN code (inf / inf) and the row's
GEMM output non-finite. Triton's tl.max / tl.maximum / tl.clamp drop NaN by default (max.f32 returns the other
operand), so the row kernel keeps NaN in its per-lane amax (propagate_nan=ALL, the same max instruction) and the
group kernel counts NaNs per row (one integer add per element); neither adds a pass or a launch. Clamps use
propagate_nan=ALL; without that a NaN activation got a finite scale and finite codes, and NaN Guard never saw
it (benchmarks/results/gpu_hostile.md, finding 1). Kernel constants are tl.constexpr, never Python-float kernel arguments: under inductor a float argument becomes
fp64 and Triton rejects it ("Expected dtype ['fp32'] but got fp64", torch 2.11).
Importing this module without Triton is fine: TRITON_AVAILABLE is False and nothing is registered.
"""

from __future__ import annotations

import torch

from .triton_launch import launcher

try:  # Triton is optional: CPU boxes, and Windows installs without triton-windows
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except Exception:  # noqa: BLE001 - a broken triton install must not break the pack
    TRITON_AVAILABLE = False

FP8_MAX = 448.0
SCALE_MIN = 2.0**-126  # smallest normal fp32 == torch.finfo(torch.float32).tiny == kernels.fp8.SCALE_MIN
_ROW_BLOCK_K = 1024  # row kernel: K chunk per loop step (two passes over the row; the second hits L2)
_GROUP_BLOCK_M = 32  # group kernel: rows per program
_SCALAR_BLOCK = 4096  # tensor-wise cast kernel: elements per program


if TRITON_AVAILABLE:
    _SCALE_MIN_C = tl.constexpr(SCALE_MIN)

    @triton.jit
    def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, fold_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr,
                           FOLD: tl.constexpr):
        """One program per row: pass 1 finds the row amax (NaN kept per lane), pass 2 scales, saturates and casts.
        FOLD: the stored scale is the row's times the scalar at fold_ptr (a per-tensor weight scale)."""
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_xm
        q_row = q_ptr + row * stride_qm
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            v = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v), propagate_nan=tl.PropagateNan.ALL)  # a NaN lane stays NaN
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), 448.0), _SCALE_MIN_C)
        # tl.max's reduction drops NaN lanes; their sum does not (NaN in -> NaN scale -> NaN out)
        scale = tl.where(tl.sum(amax, axis=0) != tl.sum(amax, axis=0), float("nan"), scale)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            v = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            q = tl.clamp(tl.math.div_rn(v, scale), -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
            tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)
        if FOLD:
            scale = scale * tl.load(fold_ptr).to(tl.float32)
        tl.store(s_ptr + row, scale)

    @triton.jit
    def _quant_groups_kernel(x_ptr, q_ptr, s_ptr, M, Mp, K, stride_xm, stride_qm, stride_sm, stride_sg,
                             GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
        """One program per (BLOCK_M rows, one K-group): amax per row, scale, cast; rows M..Mp are zero padding."""
        rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        g = tl.program_id(1)
        cols = g * GROUP + tl.arange(0, GROUP)
        col_ok = cols[None, :] < K
        v = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=(rows[:, None] < M) & col_ok,
                    other=0.0).to(tl.float32)
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(v), axis=1), 448.0), _SCALE_MIN_C)
        scale = tl.where(tl.sum((v != v).to(tl.int32), axis=1) > 0, float("nan"), scale)
        q = tl.clamp(tl.math.div_rn(v, scale[:, None]), -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
        tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q.to(q_ptr.dtype.element_ty),
                 mask=(rows[:, None] < Mp) & col_ok)
        tl.store(s_ptr + rows * stride_sm + g * stride_sg, scale, mask=rows < Mp)

    @triton.jit
    def _quant_scalar_kernel(x_ptr, q_ptr, amax_ptr, s_ptr, N, BLOCK: tl.constexpr):
        """Scale from a precomputed amax (one torch reduction before this), then cast; program 0 stores the scale."""
        pid = tl.program_id(0)
        scale = tl.maximum(tl.math.div_rn(tl.load(amax_ptr).to(tl.float32), 448.0), _SCALE_MIN_C,
                           propagate_nan=tl.PropagateNan.ALL)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(v, scale), -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
        tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=offs < N)
        if pid == 0:
            tl.store(s_ptr, scale)


def _launch_rows(x: torch.Tensor, fold: torch.Tensor | None, q_dtype: torch.dtype,
                 wrap) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    q = torch.empty((m, k), dtype=q_dtype, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        wrap(_quant_rows_kernel)[(m,)](x, q, s, s if fold is None else fold, k, x.stride(0), q.stride(0),
                                       BLOCK_K=_ROW_BLOCK_K, FOLD=fold is not None)
    return q, s


def _launch_groups(x: torch.Tensor, group_size: int, pad_rows_to: int, q_dtype: torch.dtype,
                   wrap) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    mp = -(-m // pad_rows_to) * pad_rows_to
    kg = -(-k // group_size)
    q = torch.empty((mp, k), dtype=q_dtype, device=x.device)
    s = torch.empty((kg, mp), dtype=torch.float32, device=x.device).t()  # column-major [Mp, kg] for F.scaled_mm
    if mp:
        grid = (triton.cdiv(mp, _GROUP_BLOCK_M), kg)
        wrap(_quant_groups_kernel)[grid](x, q, s, m, mp, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
                                         GROUP=group_size, BLOCK_M=_GROUP_BLOCK_M)
    return q, s


def _launch_scalar(x: torch.Tensor, q_dtype: torch.dtype, wrap) -> tuple[torch.Tensor, torch.Tensor]:
    # inf-norm = max |x| in one reduction kernel (abs, max and the fp32 result fused by torch; exact in any dtype).
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dtype=torch.float32)
    q = torch.empty_like(x, dtype=q_dtype)
    n = x.numel()
    if not n:
        return q, torch.full((), SCALE_MIN, dtype=torch.float32, device=x.device)
    s = torch.empty((), dtype=torch.float32, device=x.device)
    wrap(_quant_scalar_kernel)[(triton.cdiv(n, _SCALAR_BLOCK),)](x, q, amax, s, n, BLOCK=_SCALAR_BLOCK)
    return q, s


def _direct(kernel):
    return launcher(kernel)  # the kernel itself, except inside a CUDA graph capture (kernels/triton_launch.py)


# ---- torch.library registration: traceable by dynamo, kernels visible to inductor -------------------------------
_OPS: dict[str, object] = {}
_REGISTERED = [False]  # set once the ops exist (read while Dynamo traces: a list item, not the dict's truth)
_NS = "lowvram_dit"


def _register_ops() -> None:
    """Register the quantizers as triton_ops once per process (also when this file is imported twice)."""
    from torch.library import triton_op, wrap_triton

    def rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _launch_rows(x, None, torch.float8_e4m3fn, wrap_triton)

    def rows_folded(x: torch.Tensor, fold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _launch_rows(x, fold, torch.float8_e4m3fn, wrap_triton)

    def groups(x: torch.Tensor, group_size: int, pad_rows_to: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _launch_groups(x, group_size, pad_rows_to, torch.float8_e4m3fn, wrap_triton)

    def scalar(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _launch_scalar(x, torch.float8_e4m3fn, wrap_triton)

    for name, fn in (("fp8_quant_rows", rows), ("fp8_quant_rows_folded", rows_folded), ("fp8_quant_groups", groups),
                     ("fp8_quant_tensor", scalar)):
        try:
            _OPS[name] = triton_op(f"{_NS}::{name}", fn, mutates_args=())
        except RuntimeError:  # already registered by another import of this file (e.g. ComfyUI + editable install)
            _OPS[name] = getattr(getattr(torch.ops, _NS), name).default
    _REGISTERED[0] = True


if TRITON_AVAILABLE and hasattr(torch.library, "triton_op"):
    _register_ops()


def _traced() -> bool:
    """True while torch.compile traces: the registered op then lets inductor see the kernel. Eager calls launch
    the kernel directly; the op's dispatch costs several times the launch itself, and a model made of short
    linears (Qwen-Image at 1328x1328) is then bound by the CPU, not the GPU."""
    return torch.compiler.is_compiling() and _REGISTERED[0]  # Dynamo cannot trace bool() of a dict


def _op(name: str):
    return _OPS[name]


def quantize_rowwise(x: torch.Tensor, fold: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] contiguous -> (q e4m3fn [M, K], scale fp32 [M, 1]) in one fused kernel. ``fold`` (a one-element fp32
    tensor on x's device) multiplies the returned scales: a per-tensor weight scale then costs no launch of its own."""
    if _traced():
        return _op("fp8_quant_rows")(x) if fold is None else _op("fp8_quant_rows_folded")(x, fold)
    return _launch_rows(x, fold, torch.float8_e4m3fn, _direct)


def quantize_groupwise(x: torch.Tensor, group_size: int = 128, pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (q [Mp, K], scale [Mp, ceil(K/g)] column-major), rows zero-padded to a multiple of pad_rows_to."""
    if _traced():
        return _op("fp8_quant_groups")(x, group_size, pad_rows_to)
    return _launch_groups(x, group_size, pad_rows_to, torch.float8_e4m3fn, _direct)


def quantize_tensorwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (q, scale 0-dim fp32): a torch inf-norm, then one Triton cast kernel."""
    if _traced():
        return _op("fp8_quant_tensor")(x)
    return _launch_scalar(x, torch.float8_e4m3fn, _direct)
