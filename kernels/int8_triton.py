"""Triton kernels of the int8 W8A8 linear: one-pass per-row int8 quantization and an int8 GEMM with a fused epilogue.

``quantize_rows``: one program per BLOCK_R rows walks K in tiles of 128 twice (amax, then codes; the second read
hits L2), optionally multiplying each tile by the orthonormal 128x128 Hadamard first (kernels/int8.py's rotation,
one tensor-core ``tl.dot`` per tile) and optionally reading the pack's fp8 weights with their per-tensor or
block-wise scale. The fp8 codes are decoded from their bits (Triton has no e4m3fn type before SM89, and these
kernels are for the GPUs without it). Math as kernels/int8.py: scale = max(amax / 127, SCALE_MIN) with IEEE
division (``div_rn``), codes = rint(v / scale) saturated to +-127.

NaN is kept as kernels/fp8_triton.py keeps it: ``tl.max`` drops NaN lanes, so NaNs are counted per row (one
integer add per element) and a row with one gets a NaN scale; an inf gives an inf amax and scale. The epilogue
multiplies by the row scale, so the output row is non-finite. The codes of such a row are written as 0 (a NaN
float to int conversion is undefined).

``int8_mm``: int8 [M, K] x int8 [N, K]^T with an int32 accumulator (``tl.dot`` on int8 runs on the int8 tensor
cores of SM80+), epilogue (acc * x_scale[m]) * w_scale[n] + bias[n] in fp32, stored in the output dtype; K and N
need no alignment (edges are masked). Tile shapes are autotuned per (N, K, row bucket).

Both are ``torch.library.triton_op``s when torch has them (torch.compile traces through). Constants are
tl.constexpr, never Python-float kernel arguments (inductor would pass fp64). Without Triton, TRITON_AVAILABLE is
False and nothing is registered.
"""

from __future__ import annotations

import torch

from .decisions import autotune_keeping_results
from .triton_launch import launcher

try:  # Triton is optional: CPU boxes, and Windows installs without triton-windows
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except Exception:  # noqa: BLE001 - a broken triton install must not break the pack
    TRITON_AVAILABLE = False

SCALE_MIN = 2.0**-126  # == kernels.fp8.SCALE_MIN
ROTATION_BLOCK = 128  # == kernels.int8.ROTATION_BLOCK: the K tile, and the Hadamard block
_ROWS = 32  # rows per quantization program (tl.dot needs >= 16)
MIN_CAPABILITY = (8, 0)  # int8 and bf16 tl.dot on tensor cores


def available(device: torch.device | str) -> bool:
    """Whether these kernels run on ``device``: Triton present and an NVIDIA GPU of compute capability >= 8.0."""
    dev = torch.device(device)
    if not TRITON_AVAILABLE or dev.type != "cuda" or torch.version.hip is not None or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(dev.index if dev.index is not None else torch.cuda.current_device()) \
        >= MIN_CAPABILITY


def gemm_available(device: torch.device | str) -> bool:
    """Whether the fused Triton GEMM runs on ``device`` (the same rule as the quantizer)."""
    return available(device)


if TRITON_AVAILABLE:
    _SCALE_MIN_C = tl.constexpr(SCALE_MIN)
    _INV_SQRT_BLOCK = tl.constexpr(ROTATION_BLOCK**-0.5)

    @triton.jit
    def _e4m3_to_f32(b):
        """float8_e4m3fn bits (uint8) -> fp32 values: normals by re-biasing the exponent, subnormals m * 2^-9."""
        b = b.to(tl.int32)
        e = (b >> 3) & 15
        m = b & 7
        mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125,
                       (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True))
        mag = tl.where((e == 15) & (m == 7), float("nan"), mag)
        return tl.where((b >> 7) != 0, -mag, mag)

    @triton.jit
    def _tile(x_ptr, sc_ptr, h, rows, row_ok, k0, K, stride_x, stride_sr, stride_sc, FP8: tl.constexpr,
              IN_BLOCK: tl.constexpr, HAS_SCALE: tl.constexpr, SCALE_AFTER: tl.constexpr, ROTATE: tl.constexpr,
              BLOCK_K: tl.constexpr):
        """One [rows, BLOCK_K] tile as fp32 values: decoded, scaled, rotated."""
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols[None, :] < K)
        raw = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0)
        v = _e4m3_to_f32(raw) if FP8 else raw
        # A scale constant over the tile (per-tensor, or blocks a multiple of the tile wide) commutes with the
        # rotation: rotate the exact codes first (bf16 holds every e4m3 value), scale after (SCALE_AFTER, decided
        # on the host: a constexpr, so the compiler drops the other branches and ``v`` may change type).
        if HAS_SCALE and IN_BLOCK == 0:
            s = tl.load(sc_ptr)
        elif HAS_SCALE:
            s = tl.load(sc_ptr + (rows // IN_BLOCK)[:, None] * stride_sr + (cols // IN_BLOCK)[None, :] * stride_sc,
                        mask=mask, other=1.0)
        if HAS_SCALE and not SCALE_AFTER:
            v = v.to(tl.float32) * s
        elif FP8:
            v = v.to(tl.float16)  # exact: fp16 holds every e4m3 value (4 significant bits, 2^-9 to 448)
        if ROTATE:
            if v.dtype == tl.float32:  # no lossless narrow type: an IEEE fp32 product
                v = tl.dot(v, h.to(tl.float32), input_precision="ieee") * _INV_SQRT_BLOCK
            else:  # bf16/fp16 values times +-1: exact products, fp32 sums on tensor cores
                v = tl.dot(v.to(h.dtype), h) * _INV_SQRT_BLOCK
        v = v.to(tl.float32)
        if SCALE_AFTER:
            v = v * s
        return v

    @triton.jit
    def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, sc_ptr, h_ptr, R, K, stride_x, stride_q, stride_sr, stride_sc,
                           FP8: tl.constexpr, IN_BLOCK: tl.constexpr, HAS_SCALE: tl.constexpr,
                           SCALE_AFTER: tl.constexpr, ROTATE: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_K: tl.constexpr):
        """Pass 1: per-row amax and NaN count over K; pass 2: codes. One scale per row."""
        rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        row_ok = rows < R
        h = tl.load(h_ptr + tl.arange(0, BLOCK_K)[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :])
        amax = tl.zeros([BLOCK_R], dtype=tl.float32)
        nans = tl.zeros([BLOCK_R], dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            v = _tile(x_ptr, sc_ptr, h, rows, row_ok, k0, K, stride_x, stride_sr, stride_sc, FP8, IN_BLOCK,
                      HAS_SCALE, SCALE_AFTER, ROTATE, BLOCK_K)
            nans += tl.sum((v != v).to(tl.int32), axis=1)
            amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
        scale = tl.maximum(tl.math.div_rn(amax, 127.0), _SCALE_MIN_C)
        scale = tl.where(nans > 0, float("nan"), scale)
        for k0 in range(0, K, BLOCK_K):
            v = _tile(x_ptr, sc_ptr, h, rows, row_ok, k0, K, stride_x, stride_sr, stride_sc, FP8, IN_BLOCK,
                      HAS_SCALE, SCALE_AFTER, ROTATE, BLOCK_K)
            q = tl.clamp(_rint(tl.math.div_rn(v, scale[:, None])), -127.0, 127.0, propagate_nan=tl.PropagateNan.ALL)
            q = tl.where(q == q, q, 0.0)
            cols = k0 + tl.arange(0, BLOCK_K)
            tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], q.to(tl.int8),
                     mask=row_ok[:, None] & (cols[None, :] < K))
        tl.store(s_ptr + rows, scale, mask=row_ok)

    @triton.jit
    def _rint(v):
        """Round half to even (torch.round): add and subtract 1.5 * 2^23, exact for |v| < 2^22 (codes are <= 127
        after the clamp that follows; larger values only need to stay large)."""
        big = tl.where(v < 0, -12582912.0, 12582912.0)
        r = (v + big) - big
        return tl.where(tl.abs(v) < 4194304.0, r, v)

    def _gemm_configs() -> list:
        shapes = [(128, 128, 128, 4, 8), (128, 256, 128, 3, 8), (256, 128, 128, 3, 8), (128, 128, 64, 4, 4),
                  (64, 128, 128, 4, 4), (64, 64, 128, 4, 4)]
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=st,
                              num_warps=wp) for bm, bn, bk, st, wp in shapes]

    # the tile choice is kept in Triton's on-disk cache where it can: a restart runs the same tile
    @triton.autotune(configs=_gemm_configs(), key=["N", "K", "M_BUCKET"],
                     **autotune_keeping_results(triton.autotune))
    @triton.jit
    def _int8_mm_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, M_BUCKET, stride_am, stride_bn,
                        stride_cm, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """C[M, N] = epilogue(A[M, K] @ B[N, K]^T); grouped program order for L2 reuse of B."""
        pid = tl.program_id(0)
        grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        width = GROUP_M * grid_n
        first_m = (pid // width) * GROUP_M
        group_m = min(grid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % group_m
        pid_n = (pid % width) // group_m
        rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        rk = tl.arange(0, BLOCK_K)
        a = a_ptr + rm[:, None] * stride_am + rk[None, :]
        b = b_ptr + rn[None, :] * stride_bn + rk[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            a_t = tl.load(a, mask=(rm[:, None] < M) & (rk[None, :] + k0 < K), other=0)
            b_t = tl.load(b, mask=(rn[None, :] < N) & (rk[:, None] + k0 < K), other=0)
            acc = tl.dot(a_t, b_t, acc, out_dtype=tl.int32)
            a += BLOCK_K
            b += BLOCK_K
        sa = tl.load(sa_ptr + rm, mask=rm < M, other=0.0)
        sb = tl.load(sb_ptr + rn, mask=rn < N, other=0.0)
        out = (acc.to(tl.float32) * sa[:, None]) * sb[None, :]
        if HAS_BIAS:
            out = out + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], out.to(c_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


def _hadamard_unnormalized(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The +-1 Sylvester-Hadamard matrix of ROTATION_BLOCK (exact in every float type)."""
    h = torch.ones(1, 1)
    while h.shape[0] < ROTATION_BLOCK:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h.to(device=device, dtype=dtype).contiguous()


def _launch_quant(x: torch.Tensor, rotate: bool, in_scale: torch.Tensor | None, in_block: int,
                  wrap) -> tuple[torch.Tensor, torch.Tensor]:
    r, k = x.shape
    q = torch.empty((r, k), dtype=torch.int8, device=x.device)
    s = torch.empty((r, 1), dtype=torch.float32, device=x.device)
    if r == 0:
        return q, s
    fp8 = x.dtype == torch.float8_e4m3fn
    src = x.view(torch.uint8) if fp8 else x
    h = _hadamard_unnormalized(x.device, torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float16)
    sc = in_scale if in_scale is not None else s  # any fp32 pointer when unused
    ssr, ssc = (sc.stride(0), sc.stride(1)) if in_scale is not None and in_scale.ndim == 2 else (0, 0)
    wrap(_quant_rows_kernel)[(triton.cdiv(r, _ROWS),)](
        src, q, s, sc, h, r, k, x.stride(0), q.stride(0), ssr, ssc, FP8=fp8, IN_BLOCK=in_block,
        HAS_SCALE=in_scale is not None, SCALE_AFTER=in_scale is not None and in_block % ROTATION_BLOCK == 0,
        ROTATE=rotate, BLOCK_R=_ROWS, BLOCK_K=ROTATION_BLOCK)
    return q, s


def _row_bucket(m: int) -> int:
    return 1 << max(m - 1, 0).bit_length()


def _launch_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, bias: torch.Tensor | None,
               out_dtype: torch.dtype, wrap) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return c

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    wrap(_int8_mm_kernel)[grid](a, b, c, sa, sb, bias if bias is not None else sb, m, n, k, _row_bucket(m),
                                a.stride(0), b.stride(0), c.stride(0), HAS_BIAS=bias is not None)
    return c


def _direct(kernel):
    return launcher(kernel)  # the kernel itself, except inside a CUDA graph capture (kernels/triton_launch.py)


# ---- torch.library registration: traceable by dynamo, kernels visible to inductor -------------------------------
_OPS: dict[str, object] = {}
_NS = "lowvram_dit"


def _register_ops() -> None:
    """Register the kernels as triton_ops once per process (also when this file is imported twice)."""
    from torch.library import triton_op, wrap_triton

    def quant(x: torch.Tensor, rotate: bool, in_scale: torch.Tensor | None,
              in_block: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _launch_quant(x, rotate, in_scale, in_block, wrap_triton)

    def mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, bias: torch.Tensor | None,
           out_dtype: torch.dtype) -> torch.Tensor:
        return _launch_mm(a, sa, b, sb, bias, out_dtype, wrap_triton)

    for name, fn in (("int8_quant_rows", quant), ("int8_mm", mm)):
        try:
            _OPS[name] = triton_op(f"{_NS}::{name}", fn, mutates_args=())
        except RuntimeError:  # already registered by another import of this file (ComfyUI + editable install)
            _OPS[name] = getattr(getattr(torch.ops, _NS), name).default


if TRITON_AVAILABLE and hasattr(torch.library, "triton_op"):
    _register_ops()


def quantize_rows(x: torch.Tensor, rotate: bool = False, in_scale: torch.Tensor | None = None,
                  in_block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, K] contiguous (bf16/fp16/fp32, or float8_e4m3fn codes times ``in_scale``: 0-d, or block-wise with
    ``in_block``) -> (int8 [R, K], fp32 scale [R, 1]); ``rotate`` needs K % 128 == 0."""
    if rotate and x.shape[1] % ROTATION_BLOCK:
        raise ValueError(f"rotation needs K to be a multiple of {ROTATION_BLOCK}, got K={x.shape[1]}")
    if torch.compiler.is_compiling() and "int8_quant_rows" in _OPS:  # eager: launch directly (cheaper)
        return _OPS["int8_quant_rows"](x, rotate, in_scale, in_block)
    return _launch_quant(x, rotate, in_scale, in_block, _direct)


def int8_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, bias: torch.Tensor | None,
            out_dtype: torch.dtype) -> torch.Tensor:
    """int8 [M, K] x int8 [N, K]^T -> out_dtype [M, N] with (acc * sa[m]) * sb[n] + bias[n] fused."""
    sa, sb = sa.reshape(-1).float().contiguous(), sb.reshape(-1).float().contiguous()
    if torch.compiler.is_compiling() and "int8_mm" in _OPS:
        return _OPS["int8_mm"](a.contiguous(), sa, b.contiguous(), sb, bias, out_dtype)
    return _launch_mm(a.contiguous(), sa, b.contiguous(), sb, bias, out_dtype, _direct)
