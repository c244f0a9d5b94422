"""kernels.nan_guard on the CPU: the first bad block is named, no flag is read before ``finish``, causes by case."""

from __future__ import annotations

import pytest
import torch
from comfyui_lowvram_dit.kernels import nan_guard as ng


class _Block(torch.nn.Module):
    """A Wan-like residual block (norm -> linear -> gelu -> linear), real enough for NaN to propagate."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.ffn = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(self.norm(x))


def _run(tracker: ng.NanTracker, blocks: torch.nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    """What the node's patches do around a forward: begin, input check, one record per block."""
    tracker.begin()
    tracker.record(ng.BEFORE_BLOCKS, x)
    for i, b in enumerate(blocks):
        x = b(x)
        tracker.record(i, x)
    return x


@pytest.mark.parametrize("bad", [0, 3, 7])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_reports_first_poisoned_block(bad: int, poison: float) -> None:
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(_Block(16) for _ in range(8))
    with torch.no_grad():
        blocks[bad].ffn[2].weight[3, 5] = poison
        tr = ng.NanTracker("blocks")
        out = _run(tr, blocks, torch.randn(2, 10, 16))
    assert not torch.isfinite(out).all()  # it propagated to the end: only the first flag tells the culprit
    report = tr.finish()
    assert report is not None and report.position == bad
    assert f"transformer block {bad} (blocks.{bad})" in report.message()
    assert "check the LoRA / model file" in report.cause


def test_clean_forward_reports_nothing_and_queues_device_flags() -> None:
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(_Block(8) for _ in range(4))
    tr = ng.NanTracker()
    with torch.no_grad():
        _run(tr, blocks, torch.randn(1, 4, 8))
    assert tr.pending == 5  # input + 4 blocks, still tensors (not read yet)
    assert all(isinstance(f, torch.Tensor) and f.dtype == torch.bool and f.dim() == 0 for f in tr._flags)
    assert tr.finish() is None
    tr.begin()
    assert tr.pending == 0 and tr.first_bad() is None


def test_no_sync_per_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Recording never converts a flag to a Python value; only ``first_bad`` does, once."""
    reads = {"n": 0}
    orig = torch.Tensor.cpu

    def counting_cpu(self: torch.Tensor, *a, **k) -> torch.Tensor:
        reads["n"] += 1
        return orig(self, *a, **k)

    tr = ng.NanTracker()
    xs = [torch.randn(3, 3) for _ in range(6)]
    xs[4][0, 0] = float("inf")
    monkeypatch.setattr(torch.Tensor, "cpu", counting_cpu)
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("per-block .item() sync"))
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda self: pytest.fail("per-block bool() sync"))
    tr.begin()
    for i, x in enumerate(xs):
        tr.record(i, x)
    assert reads["n"] == 0
    assert tr.first_bad() == 4
    assert reads["n"] == 1


def test_qwen_two_streams_and_input_and_head() -> None:
    """Qwen-Image blocks return (txt, img): a bad text stream alone names the block; bad input / head positions."""
    tr = ng.NanTracker("transformer_blocks")
    img, txt = torch.randn(1, 6, 4), torch.randn(1, 3, 4)
    tr.begin()
    tr.record(ng.BEFORE_BLOCKS, img, txt)
    tr.record(0, img, txt)
    bad_txt = txt.clone()
    bad_txt[0, 1, 2] = float("-inf")
    tr.record(1, img, bad_txt)
    r = tr.finish()
    assert r.position == 1 and "transformer_blocks.1" in r.where

    tr.begin()
    tr.record(ng.BEFORE_BLOCKS, torch.full((2,), float("nan")))
    tr.record(0, torch.full((2,), float("nan")))
    r = tr.finish()
    assert r.position == ng.BEFORE_BLOCKS and "input" in r.where and "latent" in r.cause

    tr.begin()
    tr.record(0, img)
    tr.record(ng.AFTER_BLOCKS, torch.tensor([float("nan")]))
    assert tr.finish().position == ng.AFTER_BLOCKS


def test_non_float_tensors_are_ignored() -> None:
    tr = ng.NanTracker()
    tr.begin()
    tr.record(0, torch.arange(4), None)
    assert tr.pending == 0 and tr.finish() is None


@pytest.mark.parametrize(("dtype", "override", "fp8", "expect"), [
    (torch.float16, False, False, "fp16 overflow"),
    (torch.float16, True, True, "fp16 overflow"),  # fp16 overflow is the likelier culprit even with an override
    (torch.bfloat16, True, True, "fp8 weights + SageAttention / 8-bit attention"),
    (torch.bfloat16, True, False, "SageAttention / 8-bit attention"),
    (torch.bfloat16, False, True, "check the LoRA / model file"),
    (torch.float32, False, False, "check the LoRA / model file"),
])
def test_likely_cause(dtype: torch.dtype, override: bool, fp8: bool, expect: str) -> None:
    assert expect in ng.likely_cause(dtype, attention_override=override, fp8_weights=fp8)


def test_cause_uses_the_recorded_compute_dtype_and_sigma() -> None:
    tr = ng.NanTracker()
    tr.begin()
    tr.sigma = torch.tensor([0.875])
    tr.record(0, torch.tensor([1.0, float("inf")], dtype=torch.float16))
    r = tr.finish()
    assert "fp16 overflow" in r.cause and r.sigma == pytest.approx(0.875)
    assert "at sigma 0.875" in r.message()
