"""The 8-bit attention loop for Hopper (sm90) in Gluon, warp-specialized: int8 Q·Kᵀ, fp16 P·V.

Same scheme as attention_int8_triton.attn_fwd_kernel with fp16 P·V (the prologue of kernels.attention_int8 with
pv_format "fp16": rotated int8 Q and centred K, 16-bit logits for the keys farthest from their mean, V - mean in fp16
per channel), scheduled as FlashAttention-3 does, which Triton's own pipeliner does not do on sm90:

- one loader partition streams the K (int8) and Vᵀ (fp16) tiles with TMA into a ring of shared-memory stages, each
  guarded by mbarriers (ready: the copy landed; empty: every consumer is done with it);
- two consumer warpgroups, each its own partition with its own 64 query rows, so no CTA-wide barrier keeps them in
  lockstep; each issues tile j's Q·Kᵀ and tile j-1's P·V on the tensor cores and runs tile j's softmax while that
  P·V runs.

Only imported when Triton's Gluon for Hopper is importable (kernels.attention_int8 guards the import).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# int8 dot products of length <= 256 fit in |x| < 2^22, where float(x) == bits(x + 0x4B400000) - 1.5*2^23. The
# Q·Kᵀ wgmma starts its int32 accumulator at 0x4B400000, so the tensor cores add it and the scores reach the softmax
# as floats by a bitcast (no int->float conversion and no integer add per score).
MAGIC_I2F_BITS = gl.constexpr(0x4B400000)
MAGIC_I2F_VALUE = gl.constexpr(12582912.0)
KBLK = gl.constexpr(128)  # keys per int8 K scale (attention_int8.KBLK)
BLOCK_M = 128  # queries per program: two consumer warpgroups of 64
BLOCK_N = 128  # keys per tile
STAGES = 2  # K / Vᵀ ring depth (docs/investigations/2026-11-30-gluon-attention.md compares 3)
HEAD_DIMS = (128, )


@gluon.jit
def _load_v(vt_desc, v_smem, v_ready, v_empty, i, v_row, col, STAGES: gl.constexpr):
    """The i-th Vᵀ tile of the ring (16-bit keys' tiles first, then the int8 keys')."""
    st = i % STAGES
    mbarrier.wait(v_empty.index(st), ((i // STAGES) & 1) ^ 1)  # barriers start as if phase 1 completed
    mbarrier.expect(v_ready.index(st), vt_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(vt_desc, [v_row, col], v_ready.index(st), v_smem.index(st))


@gluon.jit
def _tile_start(j, n_tiles, BLOCK_N: gl.constexpr):
    """First key (past the 16-bit ones) of the j-th int8 tile: the last, ragged tile goes first, where the consumer
    masks, so the pipelined loop after it needs no mask and no peeled step (a branch around the async wgmmas makes
    ptxas serialise every wgmma of the kernel: C7513)."""
    return (j - 1 + n_tiles * (j == 0)) * BLOCK_N  # no runtime modulo: a division is a long sequence per tile


@gluon.jit
def _loader(q_desc, k_desc, vt_desc, khi_desc, q_smem, k_smem, v_smem, khi_smem, bars, q_row, k_row, khi_row, v_row,
            n_hi_tiles, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The loader partition: both Q halves once, the 16-bit key tiles with their values, then the int8 ones."""
    q_bar, k_ready, k_empty, v_ready, v_empty, khi_ready, khi_empty = bars
    HALF: gl.constexpr = q_desc.block_type.shape[0]
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    for i in gl.static_range(2):
        tma.async_copy_global_to_shared(q_desc, [q_row + i * HALF, 0], q_bar, q_smem.index(i))
    for t in range(n_hi_tiles):
        mbarrier.wait(khi_empty, (t & 1) ^ 1)
        mbarrier.expect(khi_ready, khi_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(khi_desc, [khi_row + t * BLOCK_N, 0], khi_ready, khi_smem)
        _load_v(vt_desc, v_smem, v_ready, v_empty, t, v_row, t * BLOCK_N, STAGES)
    for j in range(n_tiles):
        st = j % STAGES
        start = _tile_start(j, n_tiles, BLOCK_N)
        mbarrier.wait(k_empty.index(st), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_row + start, 0], k_ready.index(st), k_smem.index(st))
        _load_v(vt_desc, v_smem, v_ready, v_empty, n_hi_tiles + j, v_row, n_hi_tiles * BLOCK_N + start, STAGES)


@gluon.jit
def _online_softmax(s, c, off, m_i, l_i, p_layout: gl.constexpr):
    """One tile of scores s·c - off in the log2 domain (c > 0 and off per row; masked keys have s = -inf): returns
    (P in fp16 as the P·V operand, m, l, alpha). The row max is taken on s, so each score costs one FFMA."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * c - off)
    p = gl.exp2(s * c[:, None] - (off + m_new)[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return gl.convert_layout(p.to(gl.float16), p_layout), m_new, l_i, alpha


@gluon.jit
def _int8_softmax(s, c, m_i, l_i, start_n, lk, MASK: gl.constexpr, BLOCK_N: gl.constexpr, p_layout: gl.constexpr):
    """_online_softmax of a tile of int32 Q·Kᵀ accumulated from MAGIC_I2F_BITS with the rows' scale c; keys from lk
    on masked when MASK."""
    x = s.to(gl.float32, bitcast=True)  # == raw + 1.5*2^23, exactly
    if MASK:
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        x = gl.where((offs_n < lk)[None, :], x, float("-inf"))
    return _online_softmax(x, c, c * MAGIC_I2F_VALUE, m_i, l_i, p_layout)


@gluon.jit
def _hi_tiles(acc, m_i, l_i, q16, q_mean, khi_smem, v_smem, bars, n_hi_tiles, lk, hi_scale,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, qk16_layout: gl.constexpr, p_layout: gl.constexpr,
              row: gl.constexpr):
    """The 16-bit keys (a few tiles): logits from the bf16/fp16 inputs minus q·mean(k), as the int8 keys are centred;
    one tile after the other, nothing overlapped."""
    q_bar, k_ready, k_empty, v_ready, v_empty, khi_ready, khi_empty = bars
    HALF: gl.constexpr = q16.shape[0]
    s0 = gl.zeros([HALF, BLOCK_N], gl.float32, qk16_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, qk16_layout))
    c = gl.full([HALF], hi_scale, gl.float32, gl.SliceLayout(1, qk16_layout))
    for t in range(n_hi_tiles):
        mbarrier.wait(khi_ready, t & 1)
        s = warpgroup_mma(q16, khi_smem.permute((1, 0)), s0, use_acc=False)
        mbarrier.arrive(khi_empty, count=1)
        s = gl.where((t * BLOCK_N + offs_n < lk)[None, :], s, float("-inf"))
        p, m_new, l_new, alpha = _online_softmax(s, c, q_mean * hi_scale,
                                                 gl.convert_layout(m_i, gl.SliceLayout(1, qk16_layout)),
                                                 gl.convert_layout(l_i, gl.SliceLayout(1, qk16_layout)), p_layout)
        m_i = gl.convert_layout(m_new, m_i.type.layout)
        l_i = gl.convert_layout(l_new, l_i.type.layout)
        acc = acc * gl.convert_layout(alpha, row)[:, None]
        mbarrier.wait(v_ready.index(t % STAGES), (t // STAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(t % STAGES).permute((1, 0)), acc)
        mbarrier.arrive(v_empty.index(t % STAGES), count=1)
    return acc, m_i, l_i


@gluon.jit
def _int8_step(acc, m_i, l_i, p, j, s_magic, q_smem, k_smem, v_smem, bars, qscale, kscale_ptr, n_hi_tiles, n_tiles,
               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, p_layout: gl.constexpr, row: gl.constexpr):
    """Tile j >= 1: its Q·Kᵀ and tile j-1's P·V issued together, its softmax while that P·V runs; returns its P."""
    q_bar, k_ready, k_empty, v_ready, v_empty, khi_ready, khi_empty = bars
    st = j % STAGES
    v = n_hi_tiles + j - 1  # the previous tile's place in the V ring
    c = qscale * gl.load(kscale_ptr + ((j - 1) * BLOCK_N) // KBLK)  # _tile_start of j >= 1
    mbarrier.wait(k_ready.index(st), (j // STAGES) & 1)
    mbarrier.wait(v_ready.index(v % STAGES), (v // STAGES) & 1)
    s = warpgroup_mma(q_smem, k_smem.index(st).permute((1, 0)), s_magic, is_async=True)
    acc = warpgroup_mma(p, v_smem.index(v % STAGES).permute((1, 0)), acc, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s, ))  # Q·Kᵀ done; the previous tile's P·V may still run
    mbarrier.arrive(k_empty.index(st), count=1)
    p, m_i, l_i, alpha = _int8_softmax(s, c, m_i, l_i, 0, 0, False, BLOCK_N, p_layout)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(v % STAGES), count=1)
    return acc * gl.convert_layout(alpha, row)[:, None], m_i, l_i, p


@gluon.jit
def _int8_tiles(acc, m_i, l_i, q_smem, k_smem, v_smem, bars, qscale, kscale_ptr, n_hi_tiles, n_tiles, lk8,
                BLOCK_N: gl.constexpr, STAGES: gl.constexpr, qk_layout: gl.constexpr, p_layout: gl.constexpr,
                row: gl.constexpr):
    """The int8 keys, software-pipelined: tile j's Q·Kᵀ and tile j-1's P·V issued together, tile j's softmax under
    that P·V. Tile 0 holds the last keys (_tile_start), the only tile that can be ragged: it alone is masked."""
    q_bar, k_ready, k_empty, v_ready, v_empty, khi_ready, khi_empty = bars
    HALF: gl.constexpr = qscale.shape[0]
    s_magic = gl.full([HALF, BLOCK_N], MAGIC_I2F_BITS, gl.int32, qk_layout)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_magic, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    start = _tile_start(0, n_tiles, BLOCK_N)  # the last keys: the only tile that can be ragged
    p, m_i, l_i, alpha = _int8_softmax(s, qscale * gl.load(kscale_ptr + start // KBLK), m_i, l_i, start, lk8, True,
                                       BLOCK_N, p_layout)
    acc = acc * gl.convert_layout(alpha, row)[:, None]  # the 16-bit keys' share, if any
    for j in range(1, n_tiles):
        acc, m_i, l_i, p = _int8_step(acc, m_i, l_i, p, j, s_magic, q_smem, k_smem, v_smem, bars, qscale, kscale_ptr,
                                      n_hi_tiles, n_tiles, BLOCK_N, STAGES, p_layout, row)
    v = n_hi_tiles + n_tiles - 1
    mbarrier.wait(v_ready.index(v % STAGES), (v // STAGES) & 1)
    acc = warpgroup_mma(p, v_smem.index(v % STAGES).permute((1, 0)), acc)
    mbarrier.arrive(v_empty.index(v % STAGES), count=1)
    return acc, m_i, l_i


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, khi_smem, bars, n_hi_tiles, n_tiles, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, half, ptrs, sizes, strides, hi_scale):
    """One consumer warpgroup: queries [q0 + 64·half, +64) of head bh, from Q to its rows of the output."""
    QScale, KScale, VScale, VMean, KMean, Out, Q16 = ptrs
    q0, bh, kblk0, Lq, Lk, lk8 = sizes
    stride_ob, stride_oh, stride_om, stride_qb, stride_qh, stride_qm, H = strides
    HALF: gl.constexpr = q_smem.shape[1]
    D: gl.constexpr = q_smem.shape[2]
    q_bar, k_ready, k_empty, v_ready, v_empty, khi_ready, khi_empty = bars
    qk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_N, 32])
    qk16_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, BLOCK_N, 16])
    pv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=pv_layout, k_width=2)
    m0 = q0 + half * HALF
    b = bh // H
    h_off = (bh % H).to(gl.int64)
    offs_m = m0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, qk_layout))
    qscale = gl.load(QScale + offs_m, mask=offs_m < Lq, other=0.0)
    m_i = gl.full([HALF], float("-inf"), gl.float32, gl.SliceLayout(1, qk_layout))
    l_i = gl.zeros([HALF], gl.float32, gl.SliceLayout(1, qk_layout))
    acc = gl.zeros([HALF, D], gl.float32, pv_layout)
    if n_hi_tiles > 0:
        blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rows = m0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, blocked))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, blocked))
        q16 = gl.load(Q16 + b.to(gl.int64) * stride_qb + h_off * stride_qh
                      + rows[:, None] * stride_qm + cols[None, :], mask=(rows < Lq)[:, None], other=0.0)
        q_mean = gl.sum(q16.to(gl.float32) * gl.load(KMean + bh * D + cols)[None, :], axis=1)
        q16 = gl.convert_layout(q16, gl.DotOperandLayout(operand_index=0, parent=qk16_layout, k_width=2))
        q_mean = gl.convert_layout(q_mean, gl.SliceLayout(1, qk16_layout))
        acc, m_i, l_i = _hi_tiles(acc, m_i, l_i, q16, q_mean, khi_smem, v_smem, bars, n_hi_tiles, Lk, hi_scale,
                                  BLOCK_N, STAGES, qk16_layout, p_layout, gl.SliceLayout(1, pv_layout))
    mbarrier.wait(q_bar, 0)
    if n_tiles > 0:
        acc, m_i, l_i = _int8_tiles(acc, m_i, l_i, q_smem.index(half), k_smem, v_smem, bars, qscale,
                                    KScale + kblk0, n_hi_tiles, n_tiles, lk8, BLOCK_N, STAGES, qk_layout, p_layout,
                                    gl.SliceLayout(1, pv_layout))
    offs_om = m0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, pv_layout))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, pv_layout))
    vscale = gl.load(VScale + bh * D + offs_d)
    vmean = gl.load(VMean + bh * D + offs_d)
    out = acc * (1.0 / gl.convert_layout(l_i, gl.SliceLayout(1, pv_layout)))[:, None] * vscale[None, :] \
        + vmean[None, :]  # softmax rows sum to 1, so V's mean adds back as is
    o_base = b.to(gl.int64) * stride_ob + h_off * stride_oh
    gl.store(Out + o_base + offs_om[:, None] * stride_om + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=offs_om[:, None] < Lq)


# Lengths vary per call; specialising them (divisibility by 16) would recompile per model resolution. The pads and
# N_HI are multiples of 128 and the strides of 128-channel heads multiples of 16, so specialising those costs no
# recompiles and simplifies the address arithmetic.
@gluon.jit(do_not_specialize=["H", "Lq", "Lk"])
def attn_fwd_kernel(
    q_desc, k_desc, vt_desc, khi_desc, QScale, KScale, VScale, VMean, KMean, Out, Q16,
    stride_ob, stride_oh, stride_om, stride_qb, stride_qh, stride_qm, H, Lq, Lk, Lq_pad, Lk_pad, N_HI, hi_scale,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
):
    """Non-causal attention over pre-quantized q8 / k8 / fp16 vt (2-D TMA views [B*H*Lq_pad, D] in 64-row blocks,
    [B*H*Lk_pad, D], [B*H*D, Lk_pad]) and the 16-bit keys k_hi ([B*H*N_HI, D]); one program = BLOCK_M queries of
    one (b, h). Keys [0, N_HI) of the sorted order take their logits from Q16 (the input q, any strides but a unit
    last one) and k_hi; keys [N_HI, Lk) from the int8 operands. Out: [B, H, Lq, D] through its strides."""
    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(vt_desc.dtype, [STAGES] + vt_desc.block_type.shape, vt_desc.layout)
    khi_smem = gl.allocate_shared_memory(khi_desc.dtype, khi_desc.block_type.shape, khi_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    khi_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    khi_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(khi_ready, count=1)
    mbarrier.init(khi_empty, count=2)  # both consumers
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)
    bars = (q_bar, k_ready, k_empty, v_ready, v_empty, khi_ready, khi_empty)
    n_hi_tiles = N_HI // BLOCK_N
    lk8 = Lk - N_HI
    n_tiles = gl.cdiv(gl.maximum(lk8, 0), BLOCK_N)
    D: gl.constexpr = q_desc.block_type.shape[1]
    q0 = pid_m * BLOCK_M
    q_row = pid_bh * Lq_pad + q0
    k_row = pid_bh * Lk_pad + N_HI
    khi_row = pid_bh * N_HI
    v_row = pid_bh * D
    ptrs = (QScale + pid_bh * Lq_pad, KScale, VScale, VMean, KMean, Out, Q16)
    sizes = (q0, pid_bh, pid_bh * (Lk_pad // KBLK) + N_HI // KBLK, Lq, Lk, lk8)
    strides = (stride_ob, stride_oh, stride_om, stride_qb, stride_qh, stride_qm, H)
    # (tuples written out: a tuple built by + turns the constexprs in it into tensors)
    gl.warp_specialize([
        (_loader, (q_desc, k_desc, vt_desc, khi_desc, q_smem, k_smem, v_smem, khi_smem, bars, q_row, k_row, khi_row,
                   v_row, n_hi_tiles, n_tiles, BLOCK_N, STAGES)),
        (_consumer, (q_smem, k_smem, v_smem, khi_smem, bars, n_hi_tiles, n_tiles, BLOCK_N, STAGES, 0, ptrs, sizes,
                     strides, hi_scale)),
        (_consumer, (q_smem, k_smem, v_smem, khi_smem, bars, n_hi_tiles, n_tiles, BLOCK_N, STAGES, 1, ptrs, sizes,
                     strides, hi_scale)),
    ], [4, 4], [240, 240])  # the consumers' registers (acc, scores, two P tiles); the loader keeps the rest


def supported_triton() -> bool:
    """True when this Triton's Gluon has the API this file is written in: warp_specialize taking a list of
    (function, args) partitions (Triton 3.6 on; 3.5 had another signature)."""
    params = list(inspect.signature(gl.warp_specialize).parameters)
    return bool(params) and params[0] == "functions_and_args"


def _descriptor(x: torch.Tensor, block: list[int], dtype: gl.dtype) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(x, block, gl.NVMMASharedLayout.get_default_for(block, dtype))


_GL_DTYPES = {torch.int8: gl.int8, torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


def attention_from_quantized(qq: Any, out: torch.Tensor, lq: int, lk: int, hi_scale: float) -> torch.Tensor:
    """Runs attn_fwd_kernel on qq, a kernels.attention_int8.QuantizedQKV (int8 Q·Kᵀ, fp16 vt; not imported here:
    that module imports this one); out [B, H, Lq, D] written in place; hi_scale = sm_scale·log2(e) for the 16-bit
    keys' logits."""
    bh, lq_pad, d = qq.q8.shape
    lk_pad = qq.k8.shape[1]
    n_hi = qq.n_hi
    k_hi = qq.k_hi if n_hi else torch.zeros(BLOCK_N, d, device=out.device, dtype=qq.q16.dtype)  # never read
    descs = (_descriptor(qq.q8.view(bh * lq_pad, d), [BLOCK_M // 2, d], gl.int8),
             _descriptor(qq.k8.view(bh * lk_pad, d), [BLOCK_N, d], gl.int8),
             _descriptor(qq.vt.view(bh * d, lk_pad), [d, BLOCK_N], gl.float16),
             _descriptor(k_hi.reshape(-1, d), [BLOCK_N, d], _GL_DTYPES[k_hi.dtype]))
    q16 = qq.q16
    attn_fwd_kernel[(triton.cdiv(lq, BLOCK_M), bh)](
        *descs, qq.q_scale, qq.k_scale, qq.v_scale, qq.v_mean, qq.k_mean, out, q16,
        out.stride(0), out.stride(1), out.stride(2), q16.stride(0), q16.stride(1), q16.stride(2), out.shape[1], lq,
        lk, lq_pad, lk_pad, n_hi, hi_scale, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=STAGES, num_warps=4,
        maxnreg=168)  # 3 warpgroups x 128 threads x 168 <= 64K registers; setmaxnreg moves them to the consumers
    return out
