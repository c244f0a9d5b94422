"""Delayed per-tensor activation scales (kernels/fp8.py ``ActQuant(state=...)``), shared input quantization and
the one-pass row quantizer: the torch reference on the CPU, the Triton kernels under the interpreter (no GPU) or
on the GPU (``cuda`` marker), saturation and underflow fallbacks, and NaN / inf propagation."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from comfyui_lowvram_dit.kernels import fp8, fp8_triton

E4 = torch.float8_e4m3fn
TW = "scaled_mm_tensorwise"


def _act(m: int = 48, k: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, 5] *= 40  # an outlier channel
    x[min(7, m - 1)] *= 8  # an outlier token
    return x


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _is_pow2(t: torch.Tensor) -> bool:
    return bool((t.float().contiguous().view(torch.int32) & 0x7FFFFF == 0).all())


def _stats(state: torch.Tensor) -> tuple[float, float]:
    st = fp8.delayed_stats(state)
    return st["requantized_calls"], st["calls"]


def test_first_call_measures_then_the_state_carries_a_power_of_two_scale_with_headroom():
    x = _act().bfloat16()
    state = fp8.new_act_state()
    q, s = fp8.quantize_delayed_torch(x, state)
    amax = x.float().abs().max()
    assert _is_pow2(s) and amax / 448 <= s < 2 * amax / 448  # re-quantized with its own amax
    assert _stats(state) == (1.0, 1.0)
    assert _is_pow2(state[0]) and state[0] >= 2 * amax / 448 and state[1] == 0
    q2, s2 = fp8.quantize_delayed_torch(x, state)  # same statistics: one pass, the delayed scale
    assert _stats(state) == (1.0, 2.0) and s2 == 2 * s
    # power-of-two scales: every value in the normal fp8 range of both gets the same rounding
    normal = (x.float().abs() / s2 >= 2.0**-6)
    assert torch.equal((q.float() * s)[normal], (q2.float() * s2)[normal])


@pytest.mark.parametrize("growth", [1.0, 1.5, 1.99])
def test_growth_within_the_headroom_saturates_nothing_and_does_not_requantize(growth: float):
    x = _act()
    state = fp8.new_act_state()
    fp8.quantize_delayed_torch(x.bfloat16(), state)
    q, s = fp8.quantize_delayed_torch((x * growth).bfloat16(), state)
    assert _stats(state) == (1.0, 2.0)
    assert (q.float().abs() < 448).all()


@pytest.mark.parametrize("factor", [2.5, 10.0, 1e4])
def test_saturation_falls_back_to_the_call_own_scale(factor: float):
    """Statistics that grow past the headroom re-quantize: no finite value is clipped, the error is the per-call one."""
    x = _act()
    state = fp8.new_act_state()
    fp8.quantize_delayed_torch(x.bfloat16(), state)
    big = (x * factor).bfloat16()
    q, s = fp8.quantize_delayed_torch(big, state)
    assert _stats(state) == (2.0, 2.0)
    deq = q.float() * s
    assert (deq.abs().max() - big.float().abs().max()).abs() <= big.float().abs().max() * 2.0**-4
    fresh = fp8.new_act_state()  # a state without history gives the same bits
    qf, sf = fp8.quantize_delayed_torch(big, fresh)
    assert torch.equal(qf.view(torch.uint8), q.view(torch.uint8)) and sf == s


def test_a_scale_far_too_large_requantizes():
    x = _act()
    state = fp8.new_act_state()
    fp8.quantize_delayed_torch(x.bfloat16(), state)
    fp8.quantize_delayed_torch((x / 8).bfloat16(), state)  # within the underflow bound: kept
    assert _stats(state) == (1.0, 2.0)
    q, s = fp8.quantize_delayed_torch((x / 1000).bfloat16(), state)
    assert _stats(state) == (2.0, 3.0) and q.float().abs().max() > 224


def test_all_zero_input_keeps_the_scale_and_gives_zero_codes():
    state = fp8.new_act_state()
    fp8.quantize_delayed_torch(_act().bfloat16(), state)
    before = state[0].clone()
    q, s = fp8.quantize_delayed_torch(torch.zeros(4, 256, dtype=torch.bfloat16), state)
    assert (q.float() == 0).all() and s == before and state[0] == before and _stats(state) == (1.0, 2.0)


def test_nan_and_inf_give_nan_codes_and_never_enter_the_state():
    x = _act()
    clean_state = fp8.new_act_state()
    fp8.quantize_delayed_torch(x.bfloat16(), clean_state)
    bad = x.clone()
    bad[3, 10], bad[9, 0], bad[11, 1] = float("nan"), float("inf"), -float("inf")
    state = fp8.new_act_state()
    q, s = fp8.quantize_delayed_torch(bad.bfloat16(), state)
    nan = q.float().isnan()
    assert nan[3, 10] and nan[9, 0] and nan[11, 1] and nan.sum() == 3  # only the bad elements
    assert torch.isfinite(s) and torch.equal(state, clean_state)  # finite amax: same state as the clean input


def test_fp8_linear_with_a_delayed_scale_matches_its_reference_and_keeps_bad_rows_non_finite():
    w = torch.randn(192, 256) / 16
    qw, sw = fp8.quantize_per_tensor(w)
    x = _act(18, 256).reshape(2, 9, 256).bfloat16()
    bias = (torch.randn(192) * 0.1).bfloat16()
    st, st_ref = fp8.new_act_state(), fp8.new_act_state()
    for scale in (1.0, 1.3, 6.0):  # measure, delayed, saturation fallback
        xs = (x.float() * scale).bfloat16()
        y = fp8.fp8_linear(xs, qw, sw, bias, path=TW, act=fp8.ActQuant(state=st))
        ref = fp8.fp8_linear_reference(xs, qw, sw, bias, path=TW, act=fp8.ActQuant(state=st_ref))
        assert y.shape == (2, 9, 192) and _rel(y, ref) < 2e-3 and torch.equal(st, st_ref)
        assert _rel(y, F.linear(xs.float(), w, bias.float())) < 0.06
    bad = x.clone()
    bad[0, 2, 3], bad[1, 4, 0] = float("nan"), float("inf")
    y = fp8.fp8_linear(bad, qw, sw, bias, path=TW, act=fp8.ActQuant(state=st))
    rows = torch.nonzero(~torch.isfinite(y.float()).all(-1)).tolist()
    assert rows == [[0, 2], [1, 4]]


def test_fp8_linear_auto_path_with_a_state_on_cpu_dequantizes_and_leaves_the_state():
    qw, sw = fp8.quantize_per_tensor(torch.randn(64, 128))
    st = fp8.new_act_state()
    fp8.fp8_linear(torch.randn(4, 128).bfloat16(), qw, sw, act=fp8.ActQuant(state=st))
    assert torch.equal(st, fp8.new_act_state())


def test_shared_quantization_equals_one_linear_each():
    ws = [fp8.quantize_per_tensor(torch.randn(n, 256) / 16) for n in (64, 64, 128)]
    x = _act(18, 256).reshape(2, 9, 256).bfloat16()
    b = (torch.randn(64) * 0.1).bfloat16()
    layers = [(ws[0][0], ws[0][1], b), (ws[1][0], ws[1][1], None), (ws[2][0], ws[2][1], None)]
    shared_state = fp8.new_act_state()
    outs = fp8.fp8_linear_shared(x, layers, act=fp8.ActQuant(state=shared_state))
    for (w, s, bias), out in zip(layers, outs):
        one = fp8.fp8_linear(x, w, s, bias, path=TW, act=fp8.ActQuant(state=fp8.new_act_state()))
        assert out.shape == one.shape and torch.equal(out, one)
    assert _stats(shared_state) == (1.0, 1.0)  # one quantization for the three


def test_a_delayed_scale_is_refused_where_it_cannot_apply():
    qw, sw = fp8.quantize_per_tensor(torch.randn(128, 128))
    qb, sb = fp8.quantize_blockwise(torch.randn(128, 128), 128)
    x = torch.randn(4, 128).bfloat16()
    st = fp8.new_act_state()
    with pytest.raises(ValueError, match="per tensor"):
        fp8.fp8_linear(x, qw, sw, path="scaled_mm_rowwise", act=fp8.ActQuant(state=st))
    with pytest.raises(ValueError, match="per-tensor weights"):  # block-wise weights where fp8 matmul runs
        fp8._resolve_act("scaled_mm_blockwise", 128, fp8.ActQuant(state=st))
    fp8.fp8_linear(x, qb, sb, block_size=128, path="dequantize", act=fp8.ActQuant(state=st))  # no act quantization
    with pytest.raises(ValueError, match="new_act_state"):
        fp8.fp8_linear(x, qw, sw, path=TW, act=fp8.ActQuant(state=torch.zeros(3)))


def test_fast_accum_runs_where_torch_takes_it():
    qw, sw = fp8.quantize_per_tensor(torch.randn(64, 128))
    x = torch.randn(4, 128).bfloat16()
    try:
        y = fp8.fp8_linear(x, qw, sw, path=TW, act=fp8.ActQuant(fast_accum=True))
    except (RuntimeError, TypeError) as exc:  # a CPU kernel without the argument
        pytest.skip(f"this torch's CPU _scaled_mm rejects use_fast_accum: {exc}")
    assert _rel(y, fp8.fp8_linear(x, qw, sw, path=TW)) < 1e-2


# ---- Triton kernels: the interpreter on CPU (these kernels have no loops), the GPU below ---------------------

_INTERPRETED = textwrap.dedent("""
    import torch
    from comfyui_lowvram_dit.kernels import fp8, fp8_triton as ft
    torch.manual_seed(0)
    e4 = torch.float8_e4m3fn
    same = lambda qf, qr: torch.equal(qf.to(e4).view(torch.uint8), qr.view(torch.uint8))
    x = torch.randn(37, 300); x[:, 7] *= 40; x[5] *= 9
    st, sr = fp8.new_act_state(), fp8.new_act_state()
    for mult in (1.0, 1.5, 10.0, 1e-3, 0.0, 1.0):  # measure, headroom, saturation, underflow, zeros, back
        xx = (x * mult).bfloat16()
        qf, s = ft._launch_delayed(xx, st, torch.float32, ft._direct)
        qr, s_ref = fp8.quantize_delayed_torch(xx, sr)
        assert torch.equal(s, s_ref) and same(qf, qr) and torch.equal(st, sr), (mult, st, sr)
    bad = x.clone(); bad[3, 4] = float("nan"); bad[6, 0] = float("inf")
    qf, s = ft._launch_delayed(bad.bfloat16(), st, torch.float32, ft._direct)
    qr, s_ref = fp8.quantize_delayed_torch(bad.bfloat16(), sr)
    assert torch.equal(s, s_ref) and torch.equal(st, sr) and torch.isfinite(st).all()
    assert torch.equal(qf.isnan(), qr.float().isnan()) and qf.isnan().sum() == 2
    bad[9, 9] = float("nan"); bad[12, 3] = -float("inf")
    for xx in (x.bfloat16(), bad.bfloat16()):
        qf, s = ft._launch_rows_one_pass(xx, torch.float32, ft._direct); qr, s_ref = fp8.quantize_rowwise_torch(xx)
        assert torch.equal(s.isnan(), s_ref.isnan()) and torch.equal(s.isinf(), s_ref.isinf())
        ok = torch.isfinite(s_ref).flatten()
        assert torch.equal(s[ok], s_ref[ok]) and torch.equal(qf.to(e4).view(torch.uint8)[ok], qr.view(torch.uint8)[ok])
        assert torch.equal(qf.isnan(), qr.float().isnan())
    print("OK")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed in this venv")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the cuda tests below run the real kernels")
def test_delayed_and_one_pass_kernels_match_torch_in_the_interpreter():
    """TRITON_INTERPRET=1 in a subprocess (read when kernels are defined). The interpreter's own fp32->fp8 cast is
    wrong, so the kernels write fp32 codes here and torch casts them; the GPU cast is tested below."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


cuda = pytest.mark.cuda
needs_gpu_triton = pytest.mark.skipif(not (torch.cuda.is_available() and fp8_triton.TRITON_AVAILABLE),
                                      reason="needs CUDA and Triton")


@cuda
@needs_gpu_triton
@pytest.mark.parametrize("m,k", [(257, 384), (64, 5120), (3, 13824)])
def test_gpu_delayed_and_one_pass_quantizers_are_bit_exact(m: int, k: int):
    x = _act(m, k).cuda()
    st, sr = fp8.new_act_state("cuda"), fp8.new_act_state("cuda")
    for mult in (1.0, 1.5, 10.0, 1e-3, 0.0):
        xx = (x * mult).bfloat16()
        q, s = fp8_triton.quantize_delayed(xx, st)
        qr, s_ref = fp8.quantize_delayed_torch(xx, sr)
        assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(st, sr)
    q, s = fp8_triton.quantize_rowwise_one_pass(x.bfloat16())
    qr, s_ref = fp8.quantize_rowwise_torch(x.bfloat16())
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), qr.view(torch.uint8))


@cuda
@needs_gpu_triton
def test_gpu_delayed_linear_keeps_bad_rows_non_finite_and_matches_reference():
    if (fp8.device_capability("cuda") or (0, 0)) < (8, 9):
        pytest.skip("no fp8 matmul on this GPU")
    w = torch.randn(128, 256) / 16
    qw, sw = (t.cuda() for t in fp8.quantize_per_tensor(w))
    x = _act(64, 256).cuda().bfloat16()
    st, sr = fp8.new_act_state("cuda"), fp8.new_act_state("cuda")
    for act in (fp8.ActQuant(state=st), fp8.ActQuant(state=st, fast_accum=True)):
        y = fp8.fp8_linear(x, qw, sw, path=TW, act=act)
        ref = fp8.fp8_linear_reference(x, qw, sw, path=TW, act=fp8.ActQuant(state=sr))
        assert _rel(y, ref) < 5e-3
    bad = x.clone()
    bad[3, 1], bad[40, 2] = float("nan"), float("inf")
    y = fp8.fp8_linear(bad, qw, sw, path=TW, act=fp8.ActQuant(state=st))
    assert torch.nonzero(~torch.isfinite(y.float()).all(-1)).flatten().tolist() == [3, 40]
    assert torch.isfinite(st).all()
