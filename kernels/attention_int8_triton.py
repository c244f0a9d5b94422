"""Triton kernels behind kernels.attention_int8: the quantization prologue and the 8-bit attention loop.

Only imported when Triton is importable (kernels.attention_int8 guards the import). The algorithm, which
``attention_int8_reference`` emulates in fp32, is:

- Q and K are first rotated by the same signed Hadamard matrix R (entries ±1, R·Rᵀ = D·I), so
  (Q·R)·(K·R)ᵀ = D·Q·Kᵀ: a few outlier channels are spread over all D channels before the 8-bit scales are
  taken (one tensor-core product per tile here, nothing in the main loop).
- Q: per-token scale, Q·Kᵀ operands in int8 (or fp8 e4m3). The token's scale also carries sm_scale·log2(e)/D,
  so scores come out in the log2 domain and the softmax uses exp2 with no extra multiply.
- K: smoothed by its per-channel mean over the sequence (softmax is invariant to it: it shifts a query's
  scores by the constant q·mean; the rotated mean mean·R is subtracted from K·R), then one scale per
  KBLK-token block.
- V: minus its per-channel mean (added back after the softmax), per-channel scale over the sequence
  ((amax|V| + |mean|)/448, a bound on the centred amax: fp8 loses nothing to the slack), stored transposed ([D, L], tokens contiguous) because
  Hopper's fp8/int8 wgmma wants both operands K-major.
- int8 P·V (the default): V minus its mean in int8 with one scale per KBLK keys and channel; per tile
  P = exp2(s - tile max) in (0, 1] as round(254·P) - 127 (int8 around a zero point of 127, which V's column sums
  add back), the exact int32 product scaled by the tile's P unit exp2(tile max - m) / 254 and V's scales; the 16-bit
  keys' P·V runs in fp16 on their input values.
- fp8 P·V: P = exp2(s - m + 8) lies in (0, 256], exactly inside e4m3's range; the 2^8 cancels in acc / l.
- Non-finite input: tl.max and tl.maximum drop NaN (max.f32 returns the other operand), so the Q and K
  quantizers count NaNs per token / block and give those a NaN scale; the 8-bit codes cannot hold NaN, the scale
  carries it into every score of that query (Q) or of every query (K block), and the softmax makes those output
  rows NaN, as exact attention does. An inf gives an inf scale and NaN scores (0·inf or inf - inf). NaN or inf in V
  reaches the output through v_scale and v_mean (torch reductions, which propagate NaN).
- P·V runs per BLOCK_N tile at fp8 speed and is added to the fp32 accumulator outside the tensor core
  (Hopper's fp8 wgmma accumulates with ~14 mantissa bits; long sequences would drift).
"""

from __future__ import annotations

import triton
import triton.language as tl

# int8 dot products of length <= 256 fit in |x| < 2^22, where float(x) == bits(x + 0x4B400000) - 1.5*2^23.
# One integer add replaces the int->float conversion, which issues at a quarter rate on sm80-sm90.
MAGIC_I2F_BITS = tl.constexpr(0x4B400000)
MAGIC_I2F_VALUE = tl.constexpr(12582912.0)
# exp2 offset that puts P in (0, 256] for fp8 e4m3 (max 448); a power of two so exp2 stays exact at the top.
P_LOG2_OFFSET = tl.constexpr(8.0)
# int8 P·V's frame stays within 2^FRAME_SPAN of the running max: a tile further below adds < 2^-64 of the output, and
# acc never grows past 2^64 times its true size
FRAME_SPAN = tl.constexpr(64.0)
KBLK = 128  # K tokens per int8 scale; every kernel BLOCK_N divides it
# The sequence length only bounds masks in the prologue: specialising it (divisibility by 16) would build each
# quantizer twice, for Wan's 32,760 video tokens and its 512 text tokens
PROLOGUE_UNSPECIALISED = ["L"]
PAD = 128  # Q/K/V sequence padding, >= every BLOCK_M / BLOCK_N so kernel loads need no masks


@triton.jit
def _round_half_away(x):
    """Round to nearest, ties away from zero (fptosi alone would truncate)."""
    return tl.where(x >= 0, x + 0.5, x - 0.5)


@triton.jit
def _source_rows(Order, pid_bh, offs_l, L, GATHER: tl.constexpr):
    """Input row of each output position: Order[bh, l] (the sorted key order) when GATHER, else l itself."""
    if GATHER:
        return tl.load(Order + pid_bh.to(tl.int64) * L + offs_l, mask=offs_l < L, other=0)
    return offs_l


@triton.jit
def _rotate(X, Rot, b, h, rows, valid, offs_d, stride_b, stride_h, stride_l, stride_d, HEAD_DIM: tl.constexpr):
    """Input rows ``rows`` of X (zero where not valid) times the ±1 rotation [D, D], in fp32.

    X is cast to Rot's dtype: X's own 16-bit dtype (exact products, fp32 sums on the 16-bit tensor cores) or fp32,
    which runs in tf32 (10 mantissa bits hold every bf16 and fp16 value and ±1 exactly).
    """
    x = tl.load(X + b * stride_b + h * stride_h + rows[:, None].to(tl.int64) * stride_l + offs_d[None, :] * stride_d,
                mask=valid[:, None], other=0.0)
    rot = tl.load(Rot + offs_d[:, None] * HEAD_DIM + offs_d[None, :])
    return tl.dot(x.to(rot.dtype), rot, input_precision="tf32")


@triton.jit(do_not_specialize=PROLOGUE_UNSPECIALISED)
def quantize_q_kernel(
    X, Rot, Out, Scale,
    stride_b, stride_h, stride_l, stride_d,
    H, L, L_pad, scale_mult, eps,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, TO_FP8: tl.constexpr, TILES: tl.constexpr,
):
    """Q·R -> int8/fp8 [BH, L_pad, D] with one fp32 scale per token (times scale_mult) in [BH, L_pad].

    Each program quantizes TILES tiles of BLOCK tokens in a pipelined loop (one tile per program leaves the
    SM waiting on each tile's loads)."""
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_d = tl.arange(0, HEAD_DIM)
    for tile in tl.range(pid_t * TILES, tl.minimum(pid_t * TILES + TILES, L_pad // BLOCK), num_stages=3):
        offs_l = tile * BLOCK + tl.arange(0, BLOCK)
        x = _rotate(X, Rot, b, h, offs_l, offs_l < L, offs_d, stride_b, stride_h, stride_l, stride_d, HEAD_DIM)
        amax = tl.maximum(tl.max(tl.abs(x), axis=1), eps)
        # tl.max / tl.maximum drop NaN: a token holding one gets a NaN scale, which makes its scores NaN (module doc)
        amax = tl.where(tl.sum((x != x).to(tl.int32), axis=1) > 0, float("nan"), amax)
        if TO_FP8:
            y = x * (448.0 / amax)[:, None]
            y = tl.minimum(tl.maximum(y, -448.0), 448.0).to(tl.float8e4nv)
            s = amax / 448.0
        else:
            y = _round_half_away(x * (127.0 / amax)[:, None]).to(tl.int8)
            s = amax / 127.0
        out_base = pid_bh.to(tl.int64) * L_pad * HEAD_DIM
        tl.store(Out + out_base + offs_l[:, None] * HEAD_DIM + offs_d[None, :], y)
        tl.store(Scale + pid_bh.to(tl.int64) * L_pad + offs_l, s * scale_mult)


@triton.jit(do_not_specialize=PROLOGUE_UNSPECIALISED)
def quantize_k_kernel(
    X, Rot, MeanRot, Order, Out, Scale,
    stride_b, stride_h, stride_l, stride_d,
    H, L, L_pad, eps,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, TO_FP8: tl.constexpr, GATHER: tl.constexpr, TILES: tl.constexpr,
):
    """K·R - mean(K)·R -> int8/fp8 [BH, L_pad, D] with one fp32 scale per BLOCK tokens in [BH, L_pad // BLOCK];
    with GATHER, position l holds input key Order[bh, l] (the keys sorted by distance from their mean). TILES
    blocks per program, as in quantize_q_kernel."""
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_d = tl.arange(0, HEAD_DIM)
    mean = tl.load(MeanRot + pid_bh * HEAD_DIM + offs_d)
    for tile in tl.range(pid_t * TILES, tl.minimum(pid_t * TILES + TILES, L_pad // BLOCK), num_stages=3):
        offs_l = tile * BLOCK + tl.arange(0, BLOCK)
        rows = _source_rows(Order, pid_bh, offs_l, L, GATHER)
        x = _rotate(X, Rot, b, h, rows, offs_l < L, offs_d, stride_b, stride_h, stride_l, stride_d, HEAD_DIM)
        x = tl.where(offs_l[:, None] < L, x - mean[None, :], 0.0)  # padded keys stay exactly zero
        amax = tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), eps)
        amax = tl.where(tl.sum(tl.sum((x != x).to(tl.int32), axis=1), axis=0) > 0, float("nan"), amax)  # as in Q
        if TO_FP8:
            y = (x * (448.0 / amax)).to(tl.float8e4nv)  # |y| <= 448 up to rounding; the cast saturates on GPU
            s = amax / 448.0
        else:
            y = _round_half_away(x * (127.0 / amax)).to(tl.int8)
            s = amax / 127.0
        out_base = pid_bh.to(tl.int64) * L_pad * HEAD_DIM
        tl.store(Out + out_base + offs_l[:, None] * HEAD_DIM + offs_d[None, :], y)
        tl.store(Scale + pid_bh * (L_pad // BLOCK) + tile, s)


@triton.jit
def _centred_values(X, Mean, Order, pid_bh, offs_l, offs_d, stride_b, stride_h, stride_l, stride_d, H, L,
                    HEAD_DIM: tl.constexpr, GATHER: tl.constexpr):
    """Rows offs_l of V (through the key order with GATHER) minus the channel means, fp32, zero past L."""
    valid = offs_l[:, None] < L
    rows = _source_rows(Order, pid_bh, offs_l, L, GATHER)
    x = tl.load(X + (pid_bh // H) * stride_b + (pid_bh % H) * stride_h + rows[:, None].to(tl.int64) * stride_l
                + offs_d[None, :] * stride_d, mask=valid, other=0.0).to(tl.float32)
    return tl.where(valid, x - tl.load(Mean + pid_bh * HEAD_DIM + offs_d)[None, :], 0.0)


@triton.jit(do_not_specialize=PROLOGUE_UNSPECIALISED)
def quantize_v_kernel(
    X, Mean, Amax, Order, Out,
    stride_b, stride_h, stride_l, stride_d,
    H, L, L_pad, eps,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, TO_FP8: tl.constexpr, GATHER: tl.constexpr,
):
    """(V - mean_c) / (amax_c / 448) -> fp8 (or fp16) transposed to [BH, D, L_pad]; padded tokens are zero;
    with GATHER, in the keys' sorted order (as quantize_k_kernel)."""
    pid_l = tl.program_id(0)
    pid_bh = tl.program_id(1)
    offs_l = pid_l * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    x = _centred_values(X, Mean, Order, pid_bh, offs_l, offs_d, stride_b, stride_h, stride_l, stride_d, H, L,
                        HEAD_DIM, GATHER)
    amax = tl.maximum(tl.load(Amax + pid_bh * HEAD_DIM + offs_d), eps)
    y = tl.minimum(tl.maximum(x * (448.0 / amax)[None, :], -448.0), 448.0)
    if TO_FP8:
        y = y.to(tl.float8e4nv)
    else:
        y = y.to(tl.float16)
    out_base = pid_bh.to(tl.int64) * L_pad * HEAD_DIM
    tl.store(Out + out_base + offs_d[None, :] * L_pad + offs_l[:, None], y)


@triton.jit(do_not_specialize=PROLOGUE_UNSPECIALISED)
def quantize_v_int8_kernel(
    X, Mean, Order, Out, Scale, ColSum,
    stride_b, stride_h, stride_l, stride_d,
    H, L, L_pad, eps,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, GATHER: tl.constexpr,
):
    """(V - mean_c) -> int8 transposed to [BH, D, L_pad] with one fp32 scale per BLOCK (= KBLK) tokens and channel
    (amax / 127) in [BH, L_pad // BLOCK, D], and the int8 column sums of each half block (64 tokens) in
    [BH, L_pad // 64, D] int32 (int8 P·V adds back P's zero point through them); padded tokens are zero; with
    GATHER, in the keys' sorted order (as quantize_k_kernel)."""
    pid_l = tl.program_id(0)
    pid_bh = tl.program_id(1)
    offs_l = pid_l * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    x = _centred_values(X, Mean, Order, pid_bh, offs_l, offs_d, stride_b, stride_h, stride_l, stride_d, H, L,
                        HEAD_DIM, GATHER)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), eps)  # [D]
    y = _round_half_away(x * (127.0 / amax)[None, :]).to(tl.int8)
    out_base = pid_bh.to(tl.int64) * L_pad * HEAD_DIM
    tl.store(Out + out_base + offs_d[None, :] * L_pad + offs_l[:, None], y)
    tl.store(Scale + pid_bh.to(tl.int64) * (L_pad // BLOCK) * HEAD_DIM + pid_l * HEAD_DIM + offs_d, amax / 127.0)
    y32 = y.to(tl.int32)
    low = (tl.arange(0, BLOCK) < BLOCK // 2)[:, None]
    sum_base = ColSum + pid_bh.to(tl.int64) * (L_pad // (BLOCK // 2)) * HEAD_DIM + 2 * pid_l * HEAD_DIM
    tl.store(sum_base + offs_d, tl.sum(tl.where(low, y32, 0), axis=0))
    tl.store(sum_base + HEAD_DIM + offs_d, tl.sum(tl.where(low, 0, y32), axis=0))


@triton.jit(do_not_specialize=PROLOGUE_UNSPECIALISED)
def key_norm_kernel(
    X, Mean, Out,
    stride_b, stride_h, stride_l, stride_d,
    H, L,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
):
    """||x - mean(x)||² per token in fp32 -> [BH, L]: what the keys are sorted by before quantization (the keys',
    and with int8 P·V the values' too)."""
    pid_l = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_l = pid_l * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    x = tl.load(X + b * stride_b + h * stride_h + offs_l[:, None] * stride_l + offs_d[None, :] * stride_d,
                mask=offs_l[:, None] < L, other=0.0).to(tl.float32)
    x = x - tl.load(Mean + pid_bh * HEAD_DIM + offs_d)[None, :]
    tl.store(Out + pid_bh.to(tl.int64) * L + offs_l, tl.sum(x * x, axis=1), mask=offs_l < L)


@triton.jit
def _exp2_fma(x):
    """2^x on the FMA/ALU pipes (FA4's trick): P goes to fp8 (3 mantissa bits), so a degree-3 polynomial
    (Taylor, rel. error < 7e-4 on [-0.5, 0.5]) is plenty and the MUFU unit, the softmax's bottleneck, gets relief."""
    x = tl.maximum(x, -60.0)  # -inf (masked keys) -> 2^-60, far below fp8's smallest P (2^-9)
    t = x + MAGIC_I2F_VALUE  # round to nearest integer j: bits(t) = 0x4B400000 + j
    f = x - (t - MAGIC_I2F_VALUE)  # in [-0.5, 0.5]
    poly = 1.0 + f * (0.6931471805599453 + f * (0.2402265069591007 + f * 0.05550410866482158))
    # 2^j * poly: add j to the exponent field; (0x4B400000 + j) << 23 wraps to j << 23 in 32 bits
    return (poly.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _exp2_split(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EXP_EMU: tl.constexpr):
    """2^x with 1/2 (EXP_EMU=1) or 1/4 (EXP_EMU=2) of the columns on the FMA pipe, the rest on MUFU."""
    xa, xb = x.reshape([BLOCK_M, 2, BLOCK_N // 2]).permute(0, 2, 1).split()
    if EXP_EMU == 1:
        pb = _exp2_fma(xb)
    else:
        xb0, xb1 = xb.reshape([BLOCK_M, 2, BLOCK_N // 4]).permute(0, 2, 1).split()
        pb = tl.join(tl.math.exp2(xb0), _exp2_fma(xb1)).permute(0, 2, 1).reshape([BLOCK_M, BLOCK_N // 2])
    return tl.join(tl.math.exp2(xa), pb).permute(0, 2, 1).reshape([BLOCK_M, BLOCK_N])


@triton.jit
def _p_int8(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EXP_EMU: tl.constexpr):
    """(P, its int8 codes) for log2-domain offsets x from the frame: P = 2^x in (0, 1], coded round(254·P) - 127
    (one FMA and the magic add: the low byte of the float's bits is the code).

    x <= 0 holds in exact arithmetic, as the frame is at least the tile's max. The GPU fuses ``s·c - (s_off + f)``
    into one FMA on scores offset by 1.5·2^23, so the max can land above 0 by up to about one raw dot step in log2
    units (large where a row or a key block holds outlier tokens); a P above 1 + 1/508 would code 128, which wraps
    to -128. Hence the clamp (exact where x <= 0).
    """
    x = tl.minimum(x, 0.0)
    if EXP_EMU == 0:
        p = tl.math.exp2(x)
    else:
        p = _exp2_split(x, BLOCK_M, BLOCK_N, EXP_EMU)
    return p, (p * 254.0 + (MAGIC_I2F_VALUE - 127.0)).to(tl.int32, bitcast=True).to(tl.int8)


@triton.jit
def _pv_int8(
    acc, l_i, m_i, f_i, s, c, s_off, vt_ptrs, vscale_ptr, vsum_ptr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EXP_EMU: tl.constexpr,
):
    """int8 P·V of one tile (scores s·c - s_off in the log2 domain, masked keys -inf).

    acc and l are kept relative to a per-query frame f = max(tile max, running max - FRAME_SPAN): P = exp2(score - f)
    lies in (0, 1], is 1 at the tile's max (full int8 resolution for every tile that matters) and moving to the
    next frame costs one row factor exp2(f_old - f) on acc and l, so V's per-channel scale is the only per-element
    factor. P goes to int8 as round(254·P) - 127 (_p_int8); the int8 product starts from MAGIC + 127·(V's column
    sums), which restores P's zero point and makes the exact int32 sum a float of the same bits: one exact
    subtraction and one FMA bring it into acc.
    """
    t_max = tl.max(s, axis=1) * c - s_off
    m_new = tl.maximum(m_i, t_max)
    f_new = tl.maximum(t_max, m_new - FRAME_SPAN)
    p, p8 = _p_int8(s * c[:, None] - (s_off + f_new)[:, None], BLOCK_M, BLOCK_N, EXP_EMU)
    r = tl.math.exp2(f_i - f_new)  # 0 on the first tile (f_i = -inf)
    l_i = l_i * r + tl.sum(p, axis=1)
    offs_d = tl.arange(0, HEAD_DIM)
    col_sum = tl.load(vsum_ptr + offs_d)
    if BLOCK_N == 128:  # column sums are kept per 64 keys
        col_sum += tl.load(vsum_ptr + HEAD_DIM + offs_d)
    start = tl.broadcast_to((col_sum * 127 + MAGIC_I2F_BITS)[None, :], (BLOCK_M, HEAD_DIM))
    # out_dtype: Triton <= 3.6 checks an integer accumulator against it (default float32) and refuses the dot
    bits = tl.dot(p8, tl.trans(tl.load(vt_ptrs)), start, out_dtype=tl.int32)  # exact: |sum of round(254 P)·V| < 2^22
    v_unit = tl.load(vscale_ptr + offs_d) * (1.0 / 254.0)
    pv = bits.to(tl.float32, bitcast=True) - MAGIC_I2F_VALUE  # exact (both within 2^22 of 1.5*2^23)
    acc = acc * r[:, None] + pv * v_unit[None, :]
    return acc, l_i, m_new, f_new


@triton.jit
def _scores(q, k_ptrs):
    """Raw Q·Kᵀ of one tile: int32 (int8 path) or fp32 (fp8 path), [BLOCK_M, BLOCK_N]."""
    return tl.dot(q, tl.trans(tl.load(k_ptrs)))


@triton.jit
def _softmax_pv(
    acc, l_i, m_i, f_i, s, c, vt_ptrs, start_n, Lk, vscale_ptr, vsum_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INT_SCORES: tl.constexpr, PV_FP8: tl.constexpr,
    MASK: tl.constexpr, EXP_EMU: tl.constexpr, PV_ACC: tl.constexpr, HEAD_DIM: tl.constexpr, PV_INT8: tl.constexpr,
):
    """Online softmax of one tile of scores in the log2 domain, then P·V into acc; returns (acc, l, m, f).

    s: raw int32 dots (INT_SCORES, the int8 path) or fp32; c: the per-row factor from s to the log2-domain score.
    PV_INT8: int8 P·V (_pv_int8, acc and l relative to the frame f) with this tile's V scales at vscale_ptr and
    column sums at vsum_ptr (read only there); else fp8 (PV_FP8) or fp16 P·V (_pv_float, relative to m; f unused).
    """
    if INT_SCORES:
        s = (s + MAGIC_I2F_BITS).to(tl.float32, bitcast=True)  # == raw + 1.5*2^23, exactly
        s_off = c * MAGIC_I2F_VALUE
    else:
        s_off = tl.zeros_like(c)
    if MASK:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        s = tl.where((offs_n < Lk)[None, :], s, float("-inf"))
    if PV_INT8:
        acc, l_i, m_new, f_i = _pv_int8(acc, l_i, m_i, f_i, s, c, s_off, vt_ptrs, vscale_ptr, vsum_ptr, HEAD_DIM,
                                        BLOCK_M, BLOCK_N, EXP_EMU)
    else:
        acc, l_i, m_new = _pv_float(acc, l_i, m_i, s, c, s_off, vt_ptrs, BLOCK_M, BLOCK_N, PV_FP8, EXP_EMU, PV_ACC)
    return acc, l_i, m_new, f_i


@triton.jit
def _pv_float(
    acc, l_i, m_i, s, c, s_off, vt_ptrs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PV_FP8: tl.constexpr, EXP_EMU: tl.constexpr, PV_ACC: tl.constexpr,
):
    """fp8 (PV_FP8) or fp16 P·V of one tile: P = exp2(score - m + 8) in (0, 256], V scaled per channel."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * c - s_off)
    # p = exp2(score - m + 8) with score = s*c - s_off: a single FMA per element before exp2.
    x = s * c[:, None] - (s_off + m_new - P_LOG2_OFFSET)[:, None]
    if EXP_EMU == 0:
        p = tl.math.exp2(x)
    else:
        p = _exp2_split(x, BLOCK_M, BLOCK_N, EXP_EMU)
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    vt = tl.load(vt_ptrs)  # [D, BLOCK_N], tokens contiguous
    if PV_FP8:
        p8 = p.to(tl.float8e4nv)
        if PV_ACC == 0:
            # max_num_imprecise_acc=BLOCK_N: the tile's product is summed in fp32 into acc. Triton 3.6 reads the
            # wgmma result before its wait, so ptxas serialises every wgmma in the kernel (C7514).
            acc = tl.dot(p8, tl.trans(vt), acc * alpha[:, None], max_num_imprecise_acc=BLOCK_N)
        elif PV_ACC == 1:
            # same numerics written out: a fresh fp8 product per tile (<= BLOCK_N terms in the tensor core's
            # accumulator), added to the fp32 acc by the CUDA cores after the wgmma wait
            acc = acc * alpha[:, None] + tl.dot(p8, tl.trans(vt))
        else:
            # accumulate across tiles inside the tensor core (Hopper fp8 wgmma keeps ~14 mantissa bits)
            acc = tl.dot(p8, tl.trans(vt), acc * alpha[:, None])
    else:
        acc = tl.dot(p.to(tl.float16), tl.trans(vt), acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _hi_keys(
    acc, l_i, m_i, f_i, Q16, KHi, KMean, VHi, VHiScale, vt_ptrs, b, h, pid_bh, offs_m, offs_d,
    stride_qb, stride_qh, stride_qm, stride_qd, Lq, Lk, N_HI, hi_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PV_FP8: tl.constexpr,
    EXP_EMU: tl.constexpr, PV_ACC: tl.constexpr, F32_DOT: tl.constexpr, PV_INT8: tl.constexpr,
):
    """The first N_HI sorted keys (those farthest from the key mean) with logits from the 16-bit inputs.

    One such key can carry a logit 100x larger than the rest; 7 bits of it (int8) then put an error of several
    units on the exponent. Here the tensor core multiplies the bf16/fp16 inputs exactly in fp32. The int8 keys
    are centred (their scores miss q·mean(k), a per-query constant), so q·mean(k) is taken off these scores too.
    With PV_INT8 their P·V is 16-bit as well (_pv_hi): these keys often carry most of a query's attention.
    """
    q16 = tl.load(Q16 + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qm
                  + offs_d[None, :] * stride_qd, mask=offs_m[:, None] < Lq, other=0.0)
    q_mean = tl.sum(q16.to(tl.float32) * tl.load(KMean + pid_bh * HEAD_DIM + offs_d)[None, :], axis=1)
    c = tl.full([BLOCK_M], hi_scale, tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    tile = pid_bh.to(tl.int64) * N_HI * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    # num_stages=1: a few tiles per program; pipelining them would give this loop its own shared-memory stages
    # next to the main loop's (and cost the main loop its occupancy)
    for start_n in tl.range(0, N_HI, BLOCK_N, num_stages=1):
        k16 = tl.load(KHi + tile + start_n * HEAD_DIM)
        if F32_DOT:  # the same exact products as the 16-bit tensor-core dot (fp32 accumulation)
            s = tl.dot(q16.to(tl.float32), tl.trans(k16.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q16, tl.trans(k16))
        s = s - q_mean[:, None]
        if PV_INT8:
            x = tl.where((start_n + offs_n < Lk)[None, :], s * c[:, None], float("-inf"))
            acc, l_i, m_i, f_i = _pv_hi(acc, l_i, m_i, f_i, x, VHi + tile + start_n * HEAD_DIM,
                                        tl.load(VHiScale + pid_bh), F32_DOT)
        else:
            acc, l_i, m_i, f_i = _softmax_pv(
                acc, l_i, m_i, f_i, s, c, vt_ptrs + start_n, start_n, Lk, VHiScale, VHiScale,
                BLOCK_M, BLOCK_N, False, PV_FP8, True, EXP_EMU, PV_ACC, HEAD_DIM, False)
    return acc, l_i, m_i, f_i


@triton.jit
def _pv_hi(acc, l_i, m_i, f_i, x, v_ptrs, v_scale, F32_DOT: tl.constexpr):
    """16-bit P·V of one tile of the 16-bit keys (int8 P·V mode, same frame f as _pv_int8): x the log2-domain
    scores (masked keys -inf), P = exp2(x - f) in fp16, V the keys' centred values over v_scale in fp16
    ([BLOCK_N, D] at v_ptrs)."""
    t_max = tl.max(x, axis=1)
    m_new = tl.maximum(m_i, t_max)
    f_new = tl.maximum(t_max, m_new - FRAME_SPAN)
    p = tl.math.exp2(x - f_new[:, None])
    r = tl.math.exp2(f_i - f_new)
    l_i = l_i * r + tl.sum(p, axis=1)
    v16 = tl.load(v_ptrs)
    if F32_DOT:  # the interpreter: the same fp16 values multiplied in fp32
        pv = tl.dot(p.to(tl.float16).to(tl.float32), v16.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(tl.float16), v16)
    acc = acc * r[:, None] + pv * v_scale
    return acc, l_i, m_new, f_new


# Lengths vary per call; specialising them (divisibility by 16) would recompile per model resolution.
@triton.jit(do_not_specialize=["Lq", "Lk", "LQ_BUCKET", "LK_BUCKET", "N_HI_BLK"])
def attn_fwd_kernel(
    Q8, QScale, K8, KScale, VT, VScale, VMean, Out, Q16, KHi, KMean, VSum, VHi, VHiScale,
    stride_ob, stride_oh, stride_om, stride_od, stride_qb, stride_qh, stride_qm, stride_qd,
    H, Lq, Lk, Lq_pad, Lk_pad, LQ_BUCKET, LK_BUCKET, N_HI_BLK, hi_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KBLK_: tl.constexpr,
    QK_FP8: tl.constexpr, PV_FP8: tl.constexpr,
    PV_ACC: tl.constexpr = 2, EXP_EMU: tl.constexpr = 0, F32_DOT: tl.constexpr = False, PV_INT8: tl.constexpr = False,
):
    """Non-causal attention over pre-quantized Q8/K8/VT; one program = BLOCK_M queries of one (b, h).

    Keys [0, N_HI) (N_HI = N_HI_BLK·KBLK_, passed in blocks so that the compiler knows the int8 loop's base
    is 128-aligned and keeps its cp.async loads; the keys sorted farthest from their mean first) take their logits from
    Q16 (the input q, any strides) and KHi ([BH, N_HI, D], the input keys in sorted order, zero past Lk): see
    _hi_keys, which runs after the int8 (or fp8) Q·Kᵀ loop over the keys from N_HI on. F32_DOT (the interpreter
    only, whose bf16 dot is wrong) multiplies those 16-bit operands as fp32 instead. PV_INT8: VScale, VSum, VHi and
    VHiScale as QuantizedQKV's v_scale, v_sum, v_hi, v_hi_scale (kernels/attention_int8.py). Variant flags (bench_attention_int8.py --quick times each at Wan 480p): PV_ACC 0/1/2 how P·V reaches the
    fp32 accumulator (see _softmax_pv); EXP_EMU 0/1/2 moves 0, 1/2 or 1/4 of the exp2s from MUFU to a polynomial
    on the FMA pipe. (tl.range(warp_specialize=True) compiles to identical SASS on sm90 with Triton 3.6, and a
    hand-pipelined next-tile Q·Kᵀ gets its wgmma wait placed right after issue, so neither is offered.)
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    bh = pid_bh.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)

    k_ptrs = K8 + bh * Lk_pad * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    vt_ptrs = VT + bh * Lk_pad * HEAD_DIM + offs_d[:, None] * Lk_pad + offs_n[None, :]
    kscale_ptr = KScale + pid_bh * (Lk_pad // KBLK_)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    f_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # int8 P·V's frame (see _pv_int8)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    N_HI = N_HI_BLK * KBLK_
    q = tl.load(Q8 + bh * Lq_pad * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :])
    qscale = tl.load(QScale + bh * Lq_pad + offs_m)
    # The 8-bit loop runs first, over keys [N_HI, Lk), exactly as the scheme without 16-bit keys ran over [0, Lk):
    # base pointers moved up by N_HI, the loop counting from 0, acc starting at zero. With the 16-bit tiles in front
    # of it (or a runtime loop start) the sm90 build of the loop grew by ~3 % of its instructions and ran at the
    # register cap (tests/unit/sass_attention_int8.py); the online softmax does not care about the tile order.
    k8_ptrs = k_ptrs + N_HI * HEAD_DIM
    vt8_ptrs = vt_ptrs + N_HI
    kscale_ptr += N_HI_BLK
    lk_int8 = tl.maximum(Lk - N_HI, 0)  # Lk <= N_HI: every key is a 16-bit key
    n_full = (lk_int8 // BLOCK_N) * BLOCK_N
    vscale8_ptr = VScale + bh * (Lk_pad // KBLK_) * HEAD_DIM + N_HI_BLK * HEAD_DIM
    vsum8_ptr = VSum + bh * (Lk_pad // 64) * HEAD_DIM + N_HI_BLK * (KBLK_ // 64) * HEAD_DIM  # int8 P·V, as K8
    for start_n in range(0, n_full, BLOCK_N):
        s = _scores(q, k8_ptrs + start_n * HEAD_DIM)
        acc, l_i, m_i, f_i = _softmax_pv(
            acc, l_i, m_i, f_i, s, qscale * tl.load(kscale_ptr + start_n // KBLK_), vt8_ptrs + start_n, start_n, lk_int8,
            vscale8_ptr + (start_n // KBLK_) * HEAD_DIM, vsum8_ptr + (start_n // 64) * HEAD_DIM,
            BLOCK_M, BLOCK_N, not QK_FP8, PV_FP8, False, EXP_EMU, PV_ACC, HEAD_DIM, PV_INT8)
    if n_full < lk_int8:  # ragged tail: padded keys are zero in K8/VT, masked out of the softmax here
        s = _scores(q, k8_ptrs + n_full * HEAD_DIM)
        acc, l_i, m_i, f_i = _softmax_pv(
            acc, l_i, m_i, f_i, s, qscale * tl.load(kscale_ptr + n_full // KBLK_), vt8_ptrs + n_full, n_full, lk_int8,
            vscale8_ptr + (n_full // KBLK_) * HEAD_DIM, vsum8_ptr + (n_full // 64) * HEAD_DIM,
            BLOCK_M, BLOCK_N, not QK_FP8, PV_FP8, True, EXP_EMU, PV_ACC, HEAD_DIM, PV_INT8)
    if N_HI > 0:
        acc, l_i, m_i, f_i = _hi_keys(
            acc, l_i, m_i, f_i, Q16, KHi, KMean, VHi, VHiScale, vt_ptrs, b, h, pid_bh, offs_m, offs_d,
            stride_qb, stride_qh, stride_qm, stride_qd, Lq, Lk, N_HI, hi_scale,
            HEAD_DIM, BLOCK_M, BLOCK_N, PV_FP8, EXP_EMU, PV_ACC, F32_DOT, PV_INT8)

    vmean = tl.load(VMean + pid_bh * HEAD_DIM + offs_d)  # softmax rows sum to 1, so the mean adds back as is
    if PV_INT8:  # V's scales were applied per tile
        out = acc * (1.0 / l_i)[:, None] + vmean[None, :]
    else:
        vscale = tl.load(VScale + pid_bh * HEAD_DIM + offs_d)  # amax_c / 448
        out = acc * (1.0 / l_i)[:, None] * vscale[None, :] + vmean[None, :]
    o_ptrs = Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh \
        + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_m[:, None] < Lq)


# Autotune set: (BLOCK_M, BLOCK_N, warps, stages, EXP_EMU). The EXP_EMU variants only move exp2 work between pipes
# (same accuracy), so autotune may pick among them. PV_ACC defaults to 2 (fp8 P·V accumulated across tiles in the
# tensor core): faster than 1 with the same error vs fp32 (docs/benchmarks.md). It only changes the fp8 P·V path.
# 64/128/4/{2,3}: one warpgroup per CTA and two CTAs per SM (252 registers, 72/104 KB shared: see
# tests/unit/sass_attention_int8.py). 128/128/8 runs its two warpgroups in one CTA, whose per-tile barriers keep
# them in lockstep; two independent CTAs can overlap one's softmax with the other's wgmma.
ATTN_CONFIGS = [
    (128, 128, 8, 4, 0),
    (128, 128, 8, 4, 1),
    (128, 128, 8, 4, 2),
    (128, 128, 8, 3, 0),
    (64, 128, 4, 2, 0),
    (64, 128, 4, 3, 0),
    (128, 64, 4, 4, 0),
    (64, 64, 4, 3, 0),
]


# Hopper (sm90) subset: the configs the autotuner picks there (docs/benchmarks.md). Every config it tries is compiled
# and timed inside the first sampler step, so on sm90 only these are tried, and for long sequences (>= 8192 tokens)
# not the 64/64 one. Other GPUs keep the whole set.
HOPPER_CONFIGS = {(128, 128, 8, 4, 0), (128, 64, 4, 4, 0), (64, 128, 4, 3, 0), (64, 64, 4, 3, 0)}
LONG_SEQUENCE = 8192


def pruned_configs(configs: list[tuple[int, int, int, int, int]], capability: tuple[int, int] | None,
                   lq_bucket: int) -> list[tuple[int, int, int, int, int]]:
    """The (BLOCK_M, BLOCK_N, warps, stages, EXP_EMU) configs worth timing on a GPU of ``capability``."""
    if capability is None or capability[0] != 9:
        return list(configs)
    keep = [c for c in configs if c in HOPPER_CONFIGS and not (lq_bucket >= LONG_SEQUENCE and c[:2] == (64, 64))]
    return keep or list(configs)


def _config_tuple(cfg: triton.Config) -> tuple[int, int, int, int, int]:
    kw = cfg.kwargs
    return kw["BLOCK_M"], kw["BLOCK_N"], cfg.num_warps, cfg.num_stages, kw["EXP_EMU"]


def _early_prune(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    """Triton's early_config_prune hook: ``pruned_configs`` for the GPU the kernel runs on."""
    import torch

    cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    lq = int(named_args.get("LQ_BUCKET", kwargs.get("LQ_BUCKET", 0)) or 0)
    keep = set(pruned_configs([_config_tuple(c) for c in configs], cap, lq))
    return [c for c in configs if _config_tuple(c) in keep]


def attn_configs() -> list[triton.Config]:
    """Small autotune set (Hopper first; the smaller tiles keep sm80/sm89 and short sequences covered)."""
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "EXP_EMU": emu}, num_warps=warps, num_stages=stages)
            for bm, bn, warps, stages, emu in ATTN_CONFIGS]


def make_autotuned_attn():
    """attn_fwd_kernel wrapped in triton.autotune keyed on head dim and sequence buckets."""
    kwargs = {}
    try:  # Triton >= 3.3 can keep tuning results on disk across processes
        import inspect

        if "cache_results" in inspect.signature(triton.autotune).parameters:
            kwargs["cache_results"] = True
    except (TypeError, ValueError):
        pass
    return triton.autotune(configs=attn_configs(), key=["HEAD_DIM", "LQ_BUCKET", "LK_BUCKET", "QK_FP8", "PV_FP8",
                                                         "PV_INT8"],
                           prune_configs_by={"early_config_prune": _early_prune}, **kwargs)(attn_fwd_kernel)
