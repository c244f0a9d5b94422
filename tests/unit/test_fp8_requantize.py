"""kernels/fp8_requantize.py on the CPU: the torch reference against the steps it replaces, the clip peak, and the
Triton kernel under the interpreter (fp32 codes there: the interpreter's own fp8 cast is wrong; the GPU cast is
covered by tests/unit/test_fp8_requantize_cuda.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest
import torch

from comfyui_lowvram_dit.kernels import fp8, fp8_requantize as rq
from triton_interpreter import interpreter_env, interpreter_problem

E4 = torch.float8_e4m3fn


def _weight(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.05).half()


def test_per_tensor_codes_are_the_division_clamp_and_cast():
    w = _weight((64, 96))
    scale = torch.tensor(0.05 / 300)  # some values land past 448
    q, peak = rq.requantize(w, scale, None, E4)
    codes = w.float() / scale
    assert torch.equal(q.view(torch.uint8), codes.clamp(-448, 448).to(E4).view(torch.uint8))
    assert codes.abs().max() > 448 and torch.equal(peak, codes.abs().max() / 448)


def test_block_scales_follow_their_tiles_on_a_ragged_weight():
    w = _weight((130, 200), seed=1)
    s = fp8.quantize_blockwise(w.float(), 64)[1]  # a [3, 4] scale, partial edge tiles
    q, peak = rq.requantize(w, s, 64, E4)
    expect = (w.float() / fp8.expand_block_scale(s, (130, 200), 64)).clamp(-448, 448).to(E4)
    assert torch.equal(q.view(torch.uint8), expect.view(torch.uint8)) and peak.item() == 0.0


def test_the_peak_ignores_nan_and_values_in_range():
    w = torch.tensor([[1.0, -2.0, float("nan"), 3.0]])
    q, peak = rq.requantize(w, torch.tensor(1.0), None, E4)
    assert peak.item() == 0.0 and torch.isnan(q.float()[0, 2]) and q.float()[0, 3] == 3.0
    q, peak = rq.requantize(w * 300, torch.tensor(1.0), None, E4)  # 900 is the largest past 448
    assert peak.item() == pytest.approx(900 / 448, rel=1e-6) and q.float()[0, 3] == 448 and q.float()[0, 1] == -448


def test_an_empty_weight_has_no_peak():
    q, peak = rq.requantize(torch.zeros((0, 8)), torch.tensor(1.0), None, E4)
    assert q.shape == (0, 8) and q.dtype == E4 and peak.item() == 0.0


def test_a_block_scale_of_the_wrong_shape_is_named():
    with pytest.raises(ValueError, match="block scale shape"):
        rq.requantize(_weight((128, 128)), torch.ones(3, 3), 64, E4)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed in this venv")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: tests/unit/test_fp8_requantize_cuda.py runs "
                    "the real kernel")
def test_the_triton_kernel_matches_torch_in_the_interpreter():
    if (problem := interpreter_problem()) is not None:
        pytest.skip(problem)
    script = textwrap.dedent("""
        import torch
        from comfyui_lowvram_dit.kernels import fp8, fp8_requantize as rq
        torch.manual_seed(0)
        e4 = torch.float8_e4m3fn
        w = (torch.randn(130, 4100) * 0.05).half(); w[0, :5] = torch.tensor([float("nan"), 7.0, -9.0, 0.0, 1e-7])
        for scale, bs in ((torch.tensor(0.05 / 300), None), (fp8.quantize_blockwise(w.float(), 128)[1], 128)):
            q, peak = rq._launch(w, scale, bs, torch.float32, rq.launcher)
            qr, pr = rq.requantize_torch(w, scale, bs, e4)
            assert torch.equal(q.to(e4).view(torch.uint8), qr.view(torch.uint8)), bs
            assert torch.equal(peak, pr), (bs, peak, pr)
        print("OK")
    """)
    r = subprocess.run([sys.executable, "-c", script], env=interpreter_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
