"""8-bit attention: quantization math and its fp32 emulation on CPU, the Triton kernels under the Triton
interpreter (subprocess, when triton is installed), and the real kernels against SDPA on a GPU (`cuda`)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from comfyui_lowvram_dit.kernels import attention_int8 as A
from triton_interpreter import interpreter_env, interpreter_problem

HAS_TRITON = A._triton_module() is not None


def make_qkv(b: int, h: int, lq: int, lk: int, d: int, kind: str = "gauss", seed: int = 0,
             dtype: torch.dtype = torch.bfloat16, device: str = "cpu"
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, H, L, D] inputs: "gauss" (zero-mean V: fp8's worst case) or "outlier" (see below)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g)
    k = torch.randn(b, h, lk, d, generator=g)
    v = torch.randn(b, h, lk, d, generator=g)
    if kind == "outlier":
        # 4 channels 20-50x larger in Q and K, K with a large channel bias, then per-token RMSNorm as Wan and
        # Qwen-Image apply before attention; V with a channel mean, as real activations have.
        ch = torch.randperm(d, generator=g)[:4]
        mult = torch.tensor([20.0, 30.0, 40.0, 50.0])
        q[..., ch] *= mult
        k[..., ch] = k[..., ch] * mult + 2 * mult
        q = q / q.pow(2).mean(-1, keepdim=True).sqrt()
        k = k / k.pow(2).mean(-1, keepdim=True).sqrt()
        v = v + 0.5 * torch.randn(d, generator=g)
    elif kind != "gauss":
        raise ValueError(kind)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


def exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """fp32 attention, the accuracy yardstick."""
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float())


# ------------------------------------------------------------------------------------------------------------
# CPU: quantization math and the fp32 emulation


def test_rotation_is_a_fixed_signed_hadamard() -> None:
    for d in (64, 128):
        r = A.rotation(d)
        assert set(r.unique().tolist()) == {-1.0, 1.0}
        assert torch.equal(r @ r.T, d * torch.eye(d))  # Q·R·(K·R)ᵀ = D·Q·Kᵀ exactly
        assert torch.equal(r, A.rotation(d, torch.bfloat16).float())  # ±1 is exact in the kernels' dtypes
        assert 0 < int((r[:, 0] < 0).sum()) < d  # the signs are mixed: first column is not the constant one
    assert A._rotation_signs(128) == A._rotation_signs(128)
    with pytest.raises(ValueError, match="power-of-two"):
        A.rotation(96)


def test_prologue_rotates_in_the_inputs_16_bit_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Q / K quantizers get the rotation in the input's dtype where it is 16-bit (16-bit tensor cores, exact
    for ±1) and fp32 otherwise, and fp32 under Triton's interpreter, whose bf16 dot is wrong."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for dtype, want in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                        (torch.float32, torch.float32)):
        rot = A._rotation_for(torch.zeros(2, dtype=dtype), 64)
        assert rot.dtype == want and torch.equal(rot.float(), A.rotation(64))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert A._rotation_for(torch.zeros(2, dtype=torch.bfloat16), 64).dtype == torch.float32


def test_rotation_spreads_a_channel_outlier() -> None:
    """One channel 100x: without the rotation it sets every token's int8 step; rotated, amax/rms is Gaussian-like."""
    q = torch.randn(256, 128, generator=torch.Generator().manual_seed(0))
    q[:, 7] *= 100

    def amax_over_rms(x: torch.Tensor) -> float:
        return float((x.abs().amax(-1) / x.pow(2).mean(-1).sqrt()).median())

    assert amax_over_rms(q) > 10 and amax_over_rms(q @ A.rotation(128)) < 4


def test_quantize_reference_ranges_scales_and_smoothing() -> None:
    q, k, v = make_qkv(2, 3, 77, 129, 64, "outlier")
    q_q, q_scale, k_q, k_scale, v_q, v_scale, v_mean = A.quantize_reference(q, k, v)
    for t in (q_q, k_q):  # int8 values, full range used
        assert torch.equal(t, t.round()) and t.abs().max() == 127
    assert q_scale.shape == (2, 3, 77) and k_scale.shape == (2, 3, 2)  # 129 keys -> 2 blocks of 128
    # Q: dequantized within half a step of the rotated input (q_scale carries sm_scale*log2e/D)
    rot = A.rotation(64)
    step = q_scale / (64 ** -0.5 * A.LOG2E / 64)
    assert ((q_q * step[..., None] - q.float() @ rot).abs() <= step[..., None] * 0.5001).all()
    # K: mean removed and rotated, then per 128-token block
    k_c = (k.float() - k.float().mean(dim=2, keepdim=True)) @ rot
    k_step = k_scale.repeat_interleave(128, dim=2)[:, :, :129]
    assert ((k_q * k_step[..., None] - k_c).abs() <= k_step[..., None] * 0.5001 + 1e-5).all()
    # V: fp8 values of (v - mean) within e4m3's relative rounding (2^-4)
    assert torch.allclose(v_mean, v.float().mean(dim=2))
    v_c = v.float() - v_mean[:, :, None]
    assert torch.allclose(v_q * v_scale[:, :, None], v_c, rtol=2 ** -4, atol=float(v_scale.max()) * 2 ** -9)
    assert v_q.abs().max() <= 448


def test_quantize_reference_int8_values_per_block_and_channel() -> None:
    """int8 P·V's V: mean removed, one scale per 128 keys and channel, within half a step of the input."""
    q, k, v = make_qkv(1, 2, 16, 300, 64, "outlier")
    *_, v_q, v_scale, v_mean = A.quantize_reference(q, k, v, pv_format="int8")
    assert v_scale.shape == (1, 2, 3, 64) and torch.equal(v_q, v_q.round()) and v_q.abs().max() == 127
    step = v_scale.repeat_interleave(128, dim=2)[:, :, :300]
    assert ((v_q * step - (v.float() - v_mean[:, :, None])).abs() <= step * 0.5001).all()


@pytest.mark.parametrize("kind,qk,pv,budget", [
    ("outlier", "int8", "int8", 0.02),
    ("gauss", "int8", "int8", 0.02),  # 8 bits of P and V: zero-mean noise within budget, unlike fp8
    ("outlier", "int8", "fp8", 0.02),
    ("outlier", "int8", "fp16", 0.02),
    ("gauss", "int8", "fp16", 0.02),
    # zero-mean random V is fp8's worst case: P and V rounding (3 mantissa bits) each add ~2.5%
    ("gauss", "int8", "fp8", 0.05),
])
def test_reference_accuracy_vs_fp32(kind: str, qk: str, pv: str, budget: float) -> None:
    q, k, v = make_qkv(1, 2, 300, 1000, 128, kind, seed=1)
    err = A.relative_error(A.attention_int8_reference(q, k, v, qk_format=qk, pv_format=pv), exact(q, k, v))
    assert err <= budget, f"{kind} {qk}/{pv}: rel err {err:.4f} > {budget}"


def test_int8_qk_beats_fp8_qk_on_outliers() -> None:
    """The measured reason DEFAULT_QK_FORMAT is int8 (e4m3 keeps 3 mantissa bits, int8 7)."""
    q, k, v = make_qkv(1, 2, 256, 512, 128, "outlier", seed=2)
    ref = exact(q, k, v)
    e_int8 = A.relative_error(A.attention_int8_reference(q, k, v, qk_format="int8", pv_format="fp16", hi_keys=0), ref)
    e_fp8 = A.relative_error(A.attention_int8_reference(q, k, v, qk_format="fp8", pv_format="fp16", hi_keys=0), ref)
    assert e_int8 < 0.5 * e_fp8


@pytest.mark.parametrize("b,h,lq,lk,d", [(1, 1, 1, 1, 64), (2, 2, 77, 513, 128), (1, 3, 200, 77, 64)])
def test_reference_ragged_shapes(b: int, h: int, lq: int, lk: int, d: int) -> None:
    q, k, v = make_qkv(b, h, lq, lk, d, "outlier", seed=3, dtype=torch.float16)
    out = A.attention_int8_reference(q, k, v)
    assert out.shape == q.shape and out.dtype == torch.float16
    assert A.relative_error(out, exact(q, k, v)) <= 0.03


def test_reference_single_key_is_exact_after_smoothing() -> None:
    """Lk=1: smoothing zeroes K (all scores equal), softmax picks the one value; only the fp8 V rounding
    remains, and with one key V - mean is 0, so the output is V itself."""
    q, k, v = make_qkv(1, 2, 5, 1, 64)
    out = A.attention_int8_reference(q, k, v)
    assert torch.equal(out, v.expand_as(out))


def test_reference_tile_size_and_layout() -> None:
    q, k, v = make_qkv(2, 3, 50, 300, 64, "outlier", seed=4)
    a = A.attention_int8_reference(q, k, v, block_n=128)
    b = A.attention_int8_reference(q, k, v, block_n=64)
    assert A.relative_error(a, b) < 0.01  # differs only by where fp8 P is rounded
    blhd = A.attention_int8_reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout="BLHD")
    assert torch.equal(blhd.transpose(1, 2), a)


def test_input_validation_and_support() -> None:
    q, k, v = make_qkv(1, 2, 8, 8, 64)
    with pytest.raises(ValueError, match="head dim"):
        A.attention_int8_reference(q[..., :32], k[..., :32], v[..., :32])
    with pytest.raises(ValueError, match="bf16 or fp16"):
        A.attention_int8_reference(q.float(), k.float(), v.float())
    with pytest.raises(ValueError, match="matching q"):
        A.attention_int8_reference(q, k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="layout"):
        A.attention_int8_reference(q, k, v, layout="BHDL")  # type: ignore[arg-type]
    assert not A.is_supported("cpu", torch.bfloat16, 128)
    assert not A.is_supported("cuda", torch.float32, 128)
    assert not A.is_supported("cuda", torch.bfloat16, 96)
    if not A._interpreting():
        with pytest.raises(ValueError, match="CUDA GPU"):
            A.attention_int8(q, k, v)


# ------------------------------------------------------------------------------------------------------------
# The Triton kernels under TRITON_INTERPRET=1 (numpy), in a subprocess so the flag stays out of this process

_INTERPRETER_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    sys.path[:0] = [sys.argv[1], sys.argv[1].rsplit("/", 1)[0]]
    from test_attention_int8 import make_qkv
    from comfyui_lowvram_dit.kernels import attention_int8 as A
    rows = []
    for b, h, lq, lk, d, qk, pv, layout, variant in json.loads(sys.argv[2]):
        q, k, v = make_qkv(b, h, lq, lk, d, "outlier", seed=lq + lk)
        if layout == "BLHD":
            q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        config = {"BLOCK_M": 64, "BLOCK_N": 64, **variant}
        out = A.attention_int8(q, k, v, layout=layout, qk_format=qk, pv_format=pv, config=config)
        ref = A.attention_int8_reference(q, k, v, layout=layout, qk_format=qk, pv_format=pv,
                                         block_n=config["BLOCK_N"])
        rows.append({"shape": [b, h, lq, lk, d], "qk": qk, "pv": pv, "layout": layout, "variant": variant,
                     "same_shape": list(out.shape) == list(q.shape), "err_vs_ref": A.relative_error(out, ref)})
    print("RESULT" + json.dumps(rows))
""")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed in this environment")
def test_triton_kernels_under_interpreter() -> None:
    if (problem := interpreter_problem()) is not None:
        pytest.skip(problem)
    cases = [
        [1, 2, 77, 77, 64, "int8", "fp16", "BHLD", {}],
        [2, 1, 65, 129, 128, "int8", "fp16", "BLHD", {}],  # ragged tail, B>1, Lq != Lk
        [1, 1, 3, 1, 64, "int8", "fp16", "BHLD", {}],
        [1, 1, 70, 200, 64, "int8", "fp8", "BHLD", {}],
        [1, 1, 70, 200, 64, "fp8", "fp8", "BHLD", {}],
        # kernel variants: polynomial exp2 for 1/2 and 1/4 of P (incl. the masked tail), P·V accumulation modes
        [1, 1, 70, 200, 64, "int8", "fp16", "BHLD", {"EXP_EMU": 1}],
        [1, 1, 70, 200, 64, "int8", "fp16", "BHLD", {"EXP_EMU": 2}],
        [1, 1, 70, 200, 64, "int8", "fp16", "BHLD", {"PV_ACC": 0}],
        [1, 1, 70, 200, 64, "int8", "fp8", "BHLD", {"PV_ACC": 2}],
        # int8 P·V: 64-key tiles, a 128-key tile with its ragged tail, the layout and an EXP_EMU variant
        [1, 2, 77, 300, 64, "int8", "int8", "BHLD", {}],
        [2, 1, 65, 129, 128, "int8", "int8", "BLHD", {"BLOCK_N": 128}],
        [1, 1, 70, 200, 64, "int8", "int8", "BHLD", {"EXP_EMU": 1}],
    ]
    env = interpreter_env()
    proc = subprocess.run([sys.executable, "-c", _INTERPRETER_SCRIPT, os.path.dirname(__file__), json.dumps(cases)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(proc.stdout.split("RESULT", 1)[1])
    for row in rows:
        assert row["same_shape"], row
        # int8/fp16 and int8/int8 are emulated exactly (up to bf16 output rounding). The interpreter's fp32->fp8 cast (Triton
        # 3.8) rounds values that carry into the next binade to the wrong power of two, so fp8 paths only get a
        # loose bound here; an indexing or scaling bug gives errors near 100%. The GPU tests hold fp8 tight.
        bound = 0.01 if row["pv"] in ("fp16", "int8") else 0.25
        assert row["err_vs_ref"] <= bound, row


_P_CODES_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    sys.path[:0] = [sys.argv[1], sys.argv[1].rsplit("/", 1)[0]]
    from p_int8_probe import p_and_codes
    x = torch.tensor(json.loads(sys.argv[2]), dtype=torch.float32).repeat(16, 1)  # [16, 16]
    rows = []
    for exp_emu in (0, 1, 2):
        p, codes = p_and_codes(x, exp_emu)
        rows.append({"p": p[0].tolist(), "codes": codes[0].tolist()})
    print("RESULT" + json.dumps(rows))
""")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed in this environment")
def test_int8_p_codes_never_wrap_above_one() -> None:
    """int8 P·V codes P = 2^x as round(254·P) - 127. On the GPU a fused multiply-add can leave the tile's max a hair
    above x = 0 (the interpreter's separate roundings give exactly 0); unclamped, x = 0.01 would code 128, which
    wraps to -128 and flips the sign of the key carrying the row's weight. Those offsets must code as P = 1."""
    if (problem := interpreter_problem()) is not None:
        pytest.skip(problem)
    xs = [0.0, 0.003, 0.01, 0.4, 1.5, -1e-6, -0.5, -1.0, -3.0, -8.0, -9.0, -20.0, -64.0, -100.0, float("-inf"), -2.0]
    proc = subprocess.run([sys.executable, "-c", _P_CODES_SCRIPT, os.path.dirname(__file__), json.dumps(xs)],
                          capture_output=True, text=True, env=interpreter_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    want = [round(254 * 2.0 ** min(x, 0.0) - 127) for x in xs]  # half to even, as the magic add rounds
    for row in json.loads(proc.stdout.split("RESULT", 1)[1]):
        assert row["codes"] == want, row
        assert all(0.0 <= p <= 1.0 for p in row["p"]), row
        assert row["p"][:5] == [1.0] * 5, row


# ------------------------------------------------------------------------------------------------------------
# GPU


def _cuda_formats() -> list[tuple[str, str]]:
    if not torch.cuda.is_available():
        return [("int8", "fp8")]
    qk, pv = A.resolve_formats(torch.device("cuda"))
    return [(qk, pv)] + ([("int8", "fp16")] if pv != "fp16" else [])


# The error budget is <= 2% vs fp32 on outlier-heavy inputs at the benchmark shapes (Wan Lk=32760, Qwen 7017).
# Its largest term is rounding P to e4m3 (relative step 2^-3); that noise averages over the keys a query
# attends to, so short sequences sit higher: the exact fp32 emulation of the algorithm itself (no kernel) gives
# 2.04% at (1, 2, 77, 77, 64) and 2.13% at (2, 4, 333, 333, 128), 1.76% at Lk=2048, 1.56% at Lk=4096 (CPU,
# attention_int8_reference, these inputs). Short sequences therefore get 2.5%; Lk >= 4096 keeps the 2%.
SHORT_SEQ_LK = 4096


def fp32_budget(kind: str, pv: str, lk: int) -> float:
    """Relative-error bound vs fp32 math for the GPU tests (see the comment above)."""
    if lk == 1:
        return 0.01
    if kind == "gauss" and pv == "fp8":
        return 0.05  # see test_reference_accuracy_vs_fp32
    if pv == "fp8" and lk < SHORT_SEQ_LK:
        return 0.025
    return 0.02


def test_short_sequence_budget_is_the_algorithms_own_error() -> None:
    """The 2.5% short-sequence bound is what the emulation itself needs, and long sequences get back under 2%."""
    q, k, v = make_qkv(1, 2, 77, 77, 64, "outlier", seed=77)
    err = A.relative_error(A.attention_int8_reference(q, k, v, block_n=64, pv_format="fp8"), exact(q, k, v))
    assert 0.015 < err <= fp32_budget("outlier", "fp8", 77)
    q, k, v = make_qkv(1, 1, 256, 4096, 128, "outlier", seed=5)
    err = A.relative_error(A.attention_int8_reference(q, k, v, pv_format="fp8"), exact(q, k, v))
    assert err <= fp32_budget("outlier", "fp8", 4096)


@pytest.mark.cuda
@pytest.mark.parametrize("b,h,lq,lk,d", [
    (1, 2, 1, 1, 128), (1, 2, 77, 77, 64), (2, 3, 513, 513, 128), (2, 4, 1024, 512, 128),  # Wan cross-attn Lk
    (1, 2, 32760, 32760, 128), (1, 2, 6889 + 128, 6889 + 128, 128), (2, 2, 300, 4000, 64),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_matches_emulation_and_fp32(b: int, h: int, lq: int, lk: int, d: int, dtype: torch.dtype) -> None:
    assert A.is_supported("cuda", dtype, d)
    for kind in ("outlier", "gauss"):
        q, k, v = make_qkv(b, h, lq, lk, d, kind, seed=lq, dtype=dtype, device="cuda")
        ref32 = exact(q, k, v)
        for qk, pv in _cuda_formats():
            out = A.attention_int8(q, k, v, qk_format=qk, pv_format=pv)
            assert out.shape == q.shape and out.dtype == dtype and torch.isfinite(out).all()
            emu = A.attention_int8_reference(q, k, v, qk_format=qk, pv_format=pv, block_n=64)
            err_emu, err = A.relative_error(out, emu), A.relative_error(out, ref32)
            # tile size and exp2 rounding move fp8 P a little; a real bug is far above 1.5%
            assert err_emu <= 0.015, (kind, qk, pv, err_emu)
            assert err <= fp32_budget(kind, pv, lk), (kind, qk, pv, err)


@pytest.mark.cuda
def test_cuda_layouts_and_strides() -> None:
    q, k, v = make_qkv(2, 4, 333, 555, 128, "outlier", device="cuda")
    bhld = A.attention_int8(q, k, v)
    blhd = A.attention_int8(*(t.transpose(1, 2).contiguous() for t in (q, k, v)), layout="BLHD")
    assert blhd.shape == (2, 333, 4, 128)
    assert A.relative_error(blhd.transpose(1, 2), bhld) < 1e-3  # only the mean's reduction order differs
    # non-contiguous BHLD views (as a fused qkv projection yields) read through strides
    qkv = torch.stack([q, k[:, :, :333], v[:, :, :333]], dim=-2)  # [B, H, L, 3, D]
    # keys in input order (hi_keys=0): these keys' distances from their mean nearly tie, so the kernel's sort and
    # the emulation's may order them differently; the strided read is what is checked here
    tile = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}  # the emulation's key tile
    plain = A.attention_int8(qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :], config=tile, hi_keys=0)
    emu = A.attention_int8_reference(q, k[:, :, :333], v[:, :, :333], block_n=64, hi_keys=0)
    assert A.relative_error(plain, emu) <= 0.015
    out = A.attention_int8(qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :])
    pv = A.resolve_formats(torch.device("cuda"))[1]
    assert A.relative_error(out, exact(q, k[:, :, :333], v[:, :, :333])) <= fp32_budget("outlier", pv, 333)


@pytest.mark.cuda
@pytest.mark.parametrize("variant", [{"PV_ACC": 0}, {"PV_ACC": 1}, {"PV_ACC": 2}, {"EXP_EMU": 1}, {"EXP_EMU": 2}])
@pytest.mark.parametrize("lk", [4097, 700])
def test_cuda_kernel_variants(variant: dict, lk: int) -> None:
    """Every kernel variant the bench sweeps matches the emulation (PV_ACC=2 accumulates in the tensor core
    across tiles, so it only has to stay inside the fp32 budget, which is what the bench's error columns show)."""
    qk, pv = A.resolve_formats(torch.device("cuda"))
    if pv != "fp8" and variant.get("PV_ACC") == 2:
        pytest.skip("PV_ACC=2 is an fp8 P·V mode")
    q, k, v = make_qkv(1, 2, 1000, lk, 128, "outlier", seed=lk, device="cuda")
    out = A.attention_int8(q, k, v, qk_format=qk, pv_format=pv,
                           config={"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 4, **variant})
    emu = A.attention_int8_reference(q, k, v, qk_format=qk, pv_format=pv, block_n=128)
    if variant.get("PV_ACC") != 2:
        assert A.relative_error(out, emu) <= 0.015
    assert A.relative_error(out, exact(q, k, v)) <= fp32_budget("outlier", pv, lk)


# every tile config the autotuner may pick (kernels/attention_int8_triton.ATTN_CONFIGS), fixed here so each one runs
AUTOTUNE_TILES = [(128, 128, 8, 4), (128, 128, 8, 3), (64, 128, 4, 2), (64, 128, 4, 3), (128, 64, 4, 4), (64, 64, 4, 3)]


@pytest.mark.cuda
@pytest.mark.parametrize("tile", AUTOTUNE_TILES)
def test_cuda_autotune_tiles_match_the_emulation(tile: tuple[int, int, int, int]) -> None:
    bm, bn, warps, stages = tile
    qk, pv = A.resolve_formats(torch.device("cuda"))
    q, k, v = make_qkv(2, 2, 777, 1500, 128, "outlier", seed=bm + bn, device="cuda")
    out = A.attention_int8(q, k, v, qk_format=qk, pv_format=pv,
                           config={"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages})
    emu = A.attention_int8_reference(q, k, v, qk_format=qk, pv_format=pv, block_n=bn)
    assert A.relative_error(out, emu) <= 0.015


INT8_PV_FAMILIES = ("gauss", "token_outliers", "qk_mean_offsets+token_outliers", "k_token_outliers", "heavy_tailed_v")


@pytest.mark.cuda
@pytest.mark.parametrize("config", [
    *({"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st} for bm, bn, w, st in AUTOTUNE_TILES),
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 4, "EXP_EMU": 1},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 4, "EXP_EMU": 2},
], ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("family", INT8_PV_FAMILIES)
def test_cuda_int8_pv_matches_its_emulation(config: dict, family: str) -> None:
    """The int8 P·V kernel follows its fp32 emulation on every tile and exp2 variant the autotuner may pick. Token
    outliers test the clamp of P's offsets at 0 (test_int8_p_codes_never_wrap_above_one) where it matters: on the
    GPU, whose fused multiply-adds can put a tile's max above 0."""
    import attention_families as af

    q, k, v = af.make_family(family, 2, 2, 4097, 4097, 128, seed=3, device="cuda")
    out = A.attention_int8(q, k, v, qk_format="int8", pv_format="int8", config=config)
    emu = A.attention_int8_reference(q, k, v, qk_format="int8", pv_format="int8", block_n=config["BLOCK_N"])
    assert A.relative_error(out, emu) <= 0.015, (family, config, A.relative_error(out, exact(q, k, v)))


def test_autotune_tiles_test_covers_every_config() -> None:
    tk = pytest.importorskip("comfyui_lowvram_dit.kernels.attention_int8_triton", reason="needs triton")
    assert {c[:4] for c in tk.ATTN_CONFIGS} == set(AUTOTUNE_TILES)


def test_hopper_tries_only_the_configs_that_won_there() -> None:
    tk = pytest.importorskip("comfyui_lowvram_dit.kernels.attention_int8_triton", reason="needs triton")
    every = list(tk.ATTN_CONFIGS)
    long = tk.pruned_configs(every, (9, 0), 32768)
    assert set(long) == {(128, 128, 8, 4, 0), (128, 64, 4, 4, 0), (64, 128, 4, 3, 0)}  # 64/64: short sequences only
    assert (64, 64, 4, 3, 0) in tk.pruned_configs(every, (9, 0), 1024)
    assert set(long) <= set(every) and len(long) < len(every)
    for cap in [(8, 9), (8, 6), (12, 0), None]:  # nothing measured there: the whole set
        assert tk.pruned_configs(every, cap, 32768) == every
    assert tk.pruned_configs([(64, 64, 4, 3, 0)], (9, 0), 32768) == [(64, 64, 4, 3, 0)]  # never empty
    configs = tk.attn_configs()  # the hook maps triton.Config objects through the same rule
    assert [tk._config_tuple(c) for c in configs] == every


@pytest.mark.cuda
def test_cuda_fp8_qk_variant_runs() -> None:
    if A.resolve_formats(torch.device("cuda"))[1] != "fp8":
        pytest.skip("fp8 needs sm89+")
    q, k, v = make_qkv(1, 2, 1000, 1000, 128, "outlier", device="cuda")
    tile = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}  # the emulation's key tile
    # keys in input order: the outlier keys' distances from their mean nearly tie (see test_cuda_layouts_and_strides)
    out = A.attention_int8(q, k, v, qk_format="fp8", config=tile, hi_keys=0)
    emu = A.attention_int8_reference(q, k, v, qk_format="fp8", block_n=64, hi_keys=0)
    assert A.relative_error(out, emu) <= 0.015
    assert math.isfinite(A.relative_error(out, exact(q, k, v)))


def _sass_module():  # noqa: ANN202 - the tests/unit/sass_attention_int8 module
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        import sass_attention_int8 as sass
    finally:
        sys.path.pop(0)
    return sass


def test_static_profile_of_the_shipped_tile_has_no_spills() -> None:
    """benchmarks/sass_attention_int8.py compiles the kernel for sm90 without a GPU (Triton's bundled ptxas):
    the 128x128 tile's main loop must keep its wgmmas and must not spill (a spilling tile measured 2x slower)."""
    pytest.importorskip("triton", reason="the static profile needs Triton's compiler")
    sass = _sass_module()
    try:
        kernel = sass.compile_kernel(90, 128, 128, 8, 3)
        prof = sass.profile(kernel, 8)
    except (FileNotFoundError, subprocess.CalledProcessError, RuntimeError) as exc:
        pytest.skip(f"Triton cannot compile for sm90 here: {exc}")
    mix = prof["loop_mix"]
    assert mix.get("IGMMA", 0) >= 4 and mix.get("MUFU", 0) >= 64, prof
    assert "LDL" not in mix and "STL" not in mix, prof
    assert prof["ctas_per_sm"] >= 1 and prof["regs"] <= 255


@pytest.mark.parametrize("name", ["quantize_q_kernel", "quantize_k_kernel"])
def test_prologue_kernels_fit_a_consumer_gpu(name: str) -> None:
    """The Q and K quantizers as quantize_qkv launches them, built for an RTX 40xx (sm89) without a GPU, fit the
    99 KB of shared memory a block gets there (and on RTX 30xx / 50xx): their pipelined tiles and the rotation live
    in it, and the H200 the GPU tests run on has 227 KB, so only this catches a launch that consumer cards refuse."""
    pytest.importorskip("triton", reason="the static build needs Triton's compiler")
    sass = _sass_module()
    block = A.Q_BLOCK if name == "quantize_q_kernel" else A.KBLK
    try:
        kernel = sass.compile_prologue_kernel(89, name, block, A.PROLOGUE_TILES, A.PROLOGUE_WARPS)
    except (FileNotFoundError, subprocess.CalledProcessError, RuntimeError) as exc:
        pytest.skip(f"Triton cannot compile for sm89 here: {exc}")
    assert 0 < kernel.metadata.shared <= 99 * 1024, kernel.metadata.shared


def test_static_profile_of_the_int8_pv_tile() -> None:
    """The opt-in int8 P·V variant: both products on the int8 tensor cores, no spills, more issued per tile than
    the default fp8 P·V (why DEFAULT_PV_FORMAT stays fp8). It must compile on every Triton the hosts ship (3.5 and
    3.6 refused its int32-accumulated dot until the dot named out_dtype=tl.int32): a compile error fails here."""
    pytest.importorskip("triton", reason="the static profile needs Triton's compiler")
    sass = _sass_module()
    try:
        prof = sass.profile(sass.compile_kernel(90, 128, 128, 8, 3), 8)
        int8 = sass.profile(sass.compile_kernel(90, 128, 128, 8, 3, pv="int8", pv_acc=2), 8)
    except (FileNotFoundError, subprocess.CalledProcessError, RuntimeError) as exc:
        pytest.skip(f"Triton cannot compile for sm90 here: {exc}")
    assert int8["loop_mix"].get("IGMMA", 0) >= 8 and "QGMMA" not in int8["loop_mix"], int8
    assert "LDL" not in int8["loop_mix"] and "STL" not in int8["loop_mix"], int8
    assert int8["loop_instructions"] > prof["loop_instructions"]
