"""The row-wise fp8 GEMM folds the per-tensor weight scale into the activation's row scales: no per-call launch to
expand it, and nothing kept from one call to the next that an in-place change of the scale could leave stale."""

from __future__ import annotations

import pytest
import torch

from comfyui_lowvram_dit.kernels import fp8


def _layer(scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    with torch.inference_mode():  # as ComfyUI loads weights: inference tensors have no version counter
        w = (torch.randn(16, 32) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        return w, torch.tensor(scale), torch.randn(3, 32, dtype=torch.bfloat16)


def _scaled_mm_semantics(xq, xs, weight, ws, bias, out_dtype, fast_accum, out=None):  # noqa: ANN001, ANN202
    """torch._scaled_mm's row-wise contract, in fp32 (the CPU kernel has per-tensor scales only): (xq * xs) @
    (weight * ws).T + bias, xs [M, 1], ws [1, N]."""
    assert xs.shape == (xq.shape[0], 1) and ws.shape == (1, weight.shape[0])
    y = (xq.float() * xs) @ (weight.float() * ws.t()).t()
    return (y if bias is None else y + bias.float()).to(out_dtype)


def test_row_path_matches_its_reference_and_follows_an_in_place_scale_change(monkeypatch) -> None:
    monkeypatch.setattr(fp8, "_gemm", _scaled_mm_semantics)
    w, s, x = _layer(0.01)
    with torch.inference_mode():
        first = fp8.fp8_linear(x, w, s, path="scaled_mm_rowwise")
        torch.testing.assert_close(first, fp8.fp8_linear_reference(x, w, s, path="scaled_mm_rowwise"))
        s.fill_(0.03)  # e.g. a state dict loaded into the same parameter
        again = fp8.fp8_linear(x, w, s, path="scaled_mm_rowwise")
        torch.testing.assert_close(again, fp8.fp8_linear_reference(x, w, s, path="scaled_mm_rowwise"))
        torch.testing.assert_close(again.float(), first.float() * 3, rtol=2e-2, atol=1e-3)


def test_folded_row_scales_are_the_activation_scales_times_the_weight_scale() -> None:
    x = torch.randn(5, 64)
    q, s = fp8.quantize_activation(x, "row")
    qf, sf = fp8.quantize_activation(x, "row", fold=torch.tensor(0.37))
    assert torch.equal(q.view(torch.uint8), qf.view(torch.uint8)) and torch.equal(sf, s * 0.37)


def test_the_ones_row_is_made_once_per_device_and_width() -> None:
    row = fp8._ones_row(torch.device("cpu"), 24)
    assert row.shape == (1, 24) and row.dtype == torch.float32 and torch.all(row == 1)
    assert fp8._ones_row(torch.device("cpu"), 24) is row
    assert fp8._ones_row(torch.device("cpu"), 8).shape == (1, 8)


def test_a_scale_on_another_device_is_refused_before_any_kernel() -> None:
    """The quantizer reads the scale through a raw pointer: a host scale under device activations must be an error,
    not a read of host memory by the GPU."""
    x = torch.empty(4, 32, device="meta", dtype=torch.bfloat16)
    w = torch.empty(16, 32, device="meta", dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="weight scale on cpu, activations on meta"):
        fp8._linear_scaled_mm(x, w, torch.tensor(0.5), None, "scaled_mm_rowwise", torch.bfloat16)


def test_a_row_wise_call_runs_no_op_besides_quantizer_and_gemm(monkeypatch) -> None:
    """Models of many short linears (Qwen-Image) are bound by the host issuing launches: past the first call, the
    row-wise path may only reshape around its quantizer and GEMM (no copy of the weight scale, no new ones row)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    w, s, x = _layer(0.01)
    with torch.inference_mode():
        b = torch.zeros(16, dtype=torch.bfloat16)
    q, qs, y = torch.zeros(3, 32).to(torch.float8_e4m3fn), torch.ones(3, 1), torch.zeros(3, 16, dtype=torch.bfloat16)
    monkeypatch.setattr(fp8, "quantize_activation", lambda *a, **k: (q, qs))
    monkeypatch.setattr(fp8, "_gemm", lambda *a, **k: y)
    with torch.inference_mode():
        fp8.fp8_linear(x, w, s, b, path="scaled_mm_rowwise")  # the first call may make the ones row
        with Record() as rec:
            fp8.fp8_linear(x, w, s, b, path="scaled_mm_rowwise")
    assert set(rec.ops) <= {"aten.reshape.default", "aten.view.default", "aten.to.dtype"}, rec.ops
