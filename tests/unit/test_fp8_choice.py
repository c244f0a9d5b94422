"""Per-shape choice between per-token and per-call activation scales (kernels/fp8_choice.py), on the CPU.

The timing itself runs on CUDA only; these tests drive the decision with a planted fp8_linear whose two paths take
different times, and check the cache, the keys and the fall-backs."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from comfyui_lowvram_dit.kernels import fp8, fp8_choice

ROW, TENSOR = fp8_choice.CANDIDATES


def _weights(n: int = 64, k: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8.quantize_per_tensor(torch.randn(n, k))


def _planted(monkeypatch: pytest.MonkeyPatch, slow: str, calls: list[str]) -> None:
    def fake_linear(x, w, s, b=None, *, path=None, out_dtype=None, block_size=None):  # noqa: ANN001, ANN202
        calls.append(path)
        time.sleep(0.004 if path == slow else 0.0)
        return torch.zeros(*x.shape[:-1], w.shape[0])

    monkeypatch.setattr(fp8, "fp8_linear", fake_linear)


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "comfyui_lowvram_dit"]


def test_row_bucket_groups_shapes_within_a_factor_of_two() -> None:
    assert [fp8_choice.row_bucket(r) for r in (1, 2, 3, 32760, 32768, 32769, 65520)] == [1, 2, 4, 32768, 32768,
                                                                                         65536, 65536]


@pytest.mark.parametrize("slow, best", [(ROW, TENSOR), (TENSOR, ROW)])
def test_the_faster_path_wins_once_per_shape(slow: str, best: str, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    calls: list[str] = []
    _planted(monkeypatch, slow, calls)
    chooser = fp8_choice.ScaleChooser()
    w, s = _weights()
    x = torch.randn(3, 40, 32)  # 120 rows -> bucket 128
    key = (None, 128, 64, 32, x.dtype)
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        assert chooser._decide(key, x, w, s, None) == best
    assert chooser.decisions[key] == best and set(chooser.timings[key]) == {ROW, TENSOR}
    assert calls.count(ROW) == calls.count(TENSOR) == 4  # one warm-up + three timed runs each
    t = chooser.timings[key]
    assert _messages(caplog) == [f"lowvram_dit fp8 linear 32->64 at <= 128 rows per sample (float32, ?): per-token "
                                 f"scales {t[ROW]:.2f} ms, per-call scale {t[TENSOR]:.2f} ms -> "
                                 f"{fp8.describe_path(best)}"]
    calls.clear()
    assert chooser._decide(key, x, w, s, None) == best and calls == []  # cached: never timed again
    assert len(chooser.report()) == 1 and fp8.describe_path(best) in chooser.report()[0]
    chooser.clear()
    assert chooser.decisions == {} and chooser.timings == {}


@pytest.mark.parametrize("fails", [TENSOR, ROW])
def test_a_path_that_cannot_run_is_not_chosen(fails: str, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """A path that raises (cuBLASLt refused row-wise scales with a bias epilogue at linear 12288->3072, <= 16 rows,
    on an H200) is logged and not chosen: the other path is timed and kept."""
    calls: list[str] = []

    def failing(x, w, s, b=None, *, path=None, out_dtype=None, block_size=None):  # noqa: ANN001, ANN202
        calls.append(path)
        if path == fails:
            raise RuntimeError("CUDA error: planted")
        return torch.zeros(*x.shape[:-1], w.shape[0])

    monkeypatch.setattr(fp8, "fp8_linear", failing)
    chooser = fp8_choice.ScaleChooser()
    w, s = _weights()
    key = (0, 16, 64, 32, torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        other = TENSOR if fails == ROW else ROW
        assert chooser._decide(key, torch.randn(16, 32), w, s, None) == other
    assert chooser.decisions == {key: other} and list(chooser.timings[key]) == [other]
    assert calls.count(fails) == 1 and calls.count(other) >= 2  # warm-up and timed runs of the other only
    what = "per-token scales" if fails == ROW else "the per-call scale"
    shape = "linear 32->64 at <= 16 rows per sample (bfloat16, ?)"
    said = {fails: "cannot run", other: f"{chooser.timings[key][other]:.2f} ms"}
    assert _messages(caplog) == [
        f"lowvram_dit fp8: {what} cannot run {shape} (CUDA error: planted); not chosen",
        f"lowvram_dit fp8 {shape}: per-token scales {said[ROW]}, per-call scale {said[TENSOR]} -> "
        f"{fp8.describe_path(other)}"]


def test_only_per_token_paths_on_cuda_are_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    _planted(monkeypatch, ROW, calls)
    chooser = fp8_choice.ScaleChooser()
    w, s = _weights()
    x = torch.randn(8, 32)
    for path in ("dequantize", "scaled_mm_blockwise", TENSOR, ROW):  # x is on the CPU: nothing is timed
        assert chooser.choose(x, w, s, None, path) == path
    monkeypatch.setattr(fp8_choice, "TIME_PER_SHAPE", False)
    assert chooser.choose(x, w, s, None, ROW) == ROW
    assert calls == [] and chooser.decisions == {}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() not in ((8, 9), (9, 0)),
                    reason="needs an SM89/SM90 GPU (both scaled_mm variants)")
def test_real_choice_on_the_gpu_matches_the_chosen_path() -> None:
    chooser = fp8_choice.ScaleChooser()
    w, s = (t.cuda() for t in _weights(256, 512))
    x = torch.randn(2, 1000, 512, device="cuda", dtype=torch.bfloat16)
    path = chooser.choose(x, w, s, None, ROW)
    assert path in fp8_choice.CANDIDATES and len(chooser.decisions) == 1
    ref = fp8.fp8_linear_reference(x, w, s, path=path).float()
    out = fp8.fp8_linear(x, w, s, path=path).float()
    # fast accumulation (the default) sums in the tensor core's reduced precision: compared as a whole, not per value
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() not in ((8, 9), (9, 0)),
                    reason="needs an SM89/SM90 GPU (both scaled_mm variants)")
def test_a_shape_cublaslt_refuses_row_wise_still_runs() -> None:
    """Qwen-Image's text MLP down-projection (12288->3072, bias) at a short negative prompt's rows: cuBLASLt had no
    row-wise, fast-accumulating kernel with a bias epilogue on an H200 (CUBLAS_STATUS_NOT_SUPPORTED), and the chooser
    used to settle on that path. Whatever this GPU supports, the chosen path runs and is right."""
    chooser = fp8_choice.ScaleChooser()
    w, s = (t.cuda() for t in _weights(3072, 12288))
    bias = torch.randn(3072, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 13, 12288, device="cuda", dtype=torch.bfloat16)
    path = chooser.choose(x, w, s, bias, ROW)
    ref = fp8.fp8_linear_reference(x, w, s, bias, path=path).float()
    out = fp8.fp8_linear(x, w, s, bias, path=path).float()
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-2
