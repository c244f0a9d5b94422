"""fp8 linear options (kernels/fp8.py ``ActQuant``): fast accumulation, and the one-pass row quantizer, checked
against the torch reference under the Triton interpreter (no GPU) or on the GPU (``cuda`` marker), NaN / inf
included."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from comfyui_lowvram_dit.kernels import fp8, fp8_triton

TW = "scaled_mm_tensorwise"


def _act(m: int = 48, k: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, 5] *= 40  # an outlier channel
    x[min(7, m - 1)] *= 8  # an outlier token
    return x


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_fast_accum_runs_where_torch_takes_it():
    qw, sw = fp8.quantize_per_tensor(torch.randn(64, 128))
    x = torch.randn(4, 128).bfloat16()
    try:
        y = fp8.fp8_linear(x, qw, sw, path=TW, act=fp8.ActQuant(fast_accum=True))
    except (RuntimeError, TypeError) as exc:  # a CPU kernel without the argument
        pytest.skip(f"this torch's CPU _scaled_mm rejects use_fast_accum: {exc}")
    assert _rel(y, fp8.fp8_linear(x, qw, sw, path=TW)) < 1e-2


# ---- Triton kernels: the interpreter on CPU (this kernel has no loop), the GPU below -------------------------

_INTERPRETED = textwrap.dedent("""
    import torch
    from comfyui_lowvram_dit.kernels import fp8, fp8_triton as ft
    torch.manual_seed(0)
    e4 = torch.float8_e4m3fn
    x = torch.randn(37, 300); x[:, 7] *= 40; x[5] *= 9
    bad = x.clone(); bad[3, 4] = float("nan"); bad[6, 0] = float("inf")
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
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the cuda test below runs the real kernel")
def test_one_pass_kernel_matches_torch_in_the_interpreter():
    """TRITON_INTERPRET=1 in a subprocess (read when kernels are defined). The interpreter's own fp32->fp8 cast is
    wrong, so the kernel writes fp32 codes here and torch casts them; the GPU cast is tested below."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


cuda = pytest.mark.cuda
needs_gpu_triton = pytest.mark.skipif(not (torch.cuda.is_available() and fp8_triton.TRITON_AVAILABLE),
                                      reason="needs CUDA and Triton")


@cuda
@needs_gpu_triton
@pytest.mark.parametrize("m,k", [(257, 384), (64, 5120), (3, 13824)])
def test_gpu_one_pass_quantizer_is_bit_exact(m: int, k: int):
    x = _act(m, k).cuda()
    q, s = fp8_triton.quantize_rowwise_one_pass(x.bfloat16())
    qr, s_ref = fp8.quantize_rowwise_torch(x.bfloat16())
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
