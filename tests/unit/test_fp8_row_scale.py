"""The row-wise GEMM's expanded weight scale is kept per scale tensor and follows in-place changes."""

from __future__ import annotations

import torch

from comfyui_lowvram_dit.kernels import fp8


def test_row_scale_is_reused_and_follows_in_place_changes() -> None:
    scale = torch.tensor(0.5)
    first = fp8._weight_scale_row(scale, 8)
    assert first.shape == (1, 8) and first.is_contiguous() and torch.all(first == 0.5)
    assert fp8._weight_scale_row(scale, 8) is first  # no new tensor (no copy kernel) per call
    scale.mul_(2)  # e.g. a state dict loaded into the same parameter
    again = fp8._weight_scale_row(scale, 8)
    assert torch.all(again == 1.0)
    assert fp8._weight_scale_row(scale, 4).shape == (1, 4)


def test_inference_tensors_are_expanded_each_call() -> None:
    with torch.inference_mode():
        scale = torch.tensor(0.25)
    assert torch.all(fp8._weight_scale_row(scale, 3) == 0.25)
    assert id(scale) not in fp8._ROW_SCALES


def test_lookups_never_compare_tensors(monkeypatch) -> None:
    """A cache hit must not call Tensor.__eq__ (elementwise, a GPU sync per linear on CUDA)."""
    scale = torch.tensor(0.5)
    fp8._weight_scale_row(scale, 8)
    monkeypatch.setattr(torch.Tensor, "__eq__", lambda *a: (_ for _ in ()).throw(AssertionError("compared")))
    assert fp8._weight_scale_row(scale, 8).shape == (1, 8)


def test_a_dead_scale_leaves_no_entry() -> None:
    scale = torch.tensor(1.0)
    fp8._weight_scale_row(scale, 2)
    n = len(fp8._ROW_SCALES)
    del scale
    assert len(fp8._ROW_SCALES) == n - 1
