"""benchmarks/profile_fp8_linear.py: the report names the native row of every ratio; the delayed-scale candidate
scales with the largest earlier amax and records the current one (CUDA)."""

from __future__ import annotations

import pytest
import torch

from comfyui_lowvram_dit.benchmarks import profile_fp8_linear as prof


def _row(name: str, ms: float, **extra: float) -> dict:
    return {"variant": name, "time_ms": ms, "gemm_kernel_ms": ms * 0.8, "other_kernel_ms": ms * 0.2,
            "sustained_ms": ms, **extra}


def test_summary_and_markdown_name_the_native_row() -> None:
    rows = [_row("native fp8_e4m3fn_fast", 20.0, rel_err_vs_fp32=0.05), _row("pack per-call scale (tensor-wise)", 16.0),
            _row("GEMMs only, native operands (unscaled weight)", 15.0, sm_clock_mhz=1300.0, power_w=699.0),
            _row("GEMMs only, pack operands, per-tensor scales", 16.5, sm_clock_mhz=1260.0, power_w=698.0),
            _row("quantize: native clamp_ + cast", 3.0)]
    summary = prof.summarize(rows)
    assert "pack per-call scale (tensor-wise): 16.000 ms per block = 1.250x against the native fp8_e4m3fn_fast " \
           "row (20.000 ms)" in summary
    assert not any(line.startswith("quantize") for line in summary)  # quantization alone is no block
    assert any("15.000 vs 16.500 ms (1.100x)" in line and "1300.0 vs 1260.0 MHz" in line for line in summary)
    ab = [{"activations": "native", "weights": "native", "ms": 15.0, "sm_clock_mhz": 1300.0, "power_w": 699.0},
          {"activations": "pack", "weights": "pack", "ms": 16.5, "sm_clock_mhz": 1260.0, "power_w": 698.0}]
    md = prof.markdown(rows, [], ab, {"device_name": "GPU X"}, summary)
    assert "| pack per-call scale (tensor-wise) | 16.000 | 1.250x |" in md
    assert "| pack | pack | 16.500 | 1.100x | 1260.0 | 698.0 |" in md
    assert "- device_name: GPU X" in md


@pytest.mark.skipif(not torch.cuda.is_available() or prof.triton is None, reason="needs CUDA and Triton")
def test_delayed_scale_uses_history_and_records_amax() -> None:
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    state = torch.zeros(2, dtype=torch.float32, device="cuda")
    q, s = prof.quantize_delayed(x, state)  # no history: scale 1, as native's unscaled cast
    assert float(s) == 1.0
    assert torch.equal(q, x.float().clamp(-448, 448).to(torch.float8_e4m3fn))
    amax = x.float().abs().max()
    assert float(state[0]) == float(amax) == float(state[1])
    q2, s2 = prof.quantize_delayed(x * 2, state)  # scaled by the history (amax of x): 2x saturates
    assert float(s2) == pytest.approx(float(amax) / 448, rel=1e-6)
    assert float(q2.float().abs().max()) == 448.0
    assert float(state[0]) == pytest.approx(2 * float(amax), rel=1e-2)
