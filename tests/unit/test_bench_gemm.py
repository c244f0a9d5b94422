"""The GEMM scenarios on the CPU (benchmarks/bench_gemm.py): fp8_gemm's ``--dry`` (every variant's code path, ComfyUI's
native Linear replicated without COMFYUI_PATH) and int8_gemm's ``--tiny`` (scaled-down shapes, the Wan block chain's
error), each writing its reports; an option of the other scenario is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from comfyui_lowvram_dit.benchmarks import bench_gemm
from comfyui_lowvram_dit.benchmarks.__main__ import main as suite_main


@pytest.mark.parametrize("family", ["massive"])
def test_fp8_dry_run_exercises_every_variant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    monkeypatch.delenv("COMFYUI_PATH", raising=False)  # the replicated native steps
    assert suite_main(["fp8_gemm", "--dry", "--families", family, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_fp8_gemm_block_dry.json").read_text())
    assert report["native"].startswith("replicated")
    rows = report["rows"]
    block = {r["variant"]: r for r in rows if r["kind"] == "block8"}
    assert set(block) == {"bf16 F.linear", "native fp8_e4m3fn_fast", "pack today (scale chooser, fast accum)",
                          "pack row-wise, no fast accum", "pack tensor-wise (amax pass), no fast accum",
                          "pack row-wise + fast accum"}
    for v in ("bf16 F.linear", "native fp8_e4m3fn_fast", "pack today (scale chooser, fast accum)",
              "pack tensor-wise (amax pass), no fast accum"):
        assert block[v]["status"] == "ok", block[v]
    assert block["native fp8_e4m3fn_fast"]["err_mean"] > 0.2  # clamped at +-448: the massive channels are lost
    assert block["pack tensor-wise (amax pass), no fast accum"]["err_mean"] < 0.06
    assert {r["kind"] for r in rows} == {"block8", "block6", "linear", "quant"}
    assert "Verdict" in (tmp_path / "bench_fp8_gemm_block_dry.md").read_text()


@pytest.mark.slow  # a few seconds of CPU GEMMs
def test_int8_tiny_run_writes_every_shape_and_the_block_errors(tmp_path: Path) -> None:
    assert bench_gemm.main(["int8_gemm", "--tiny", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "bench_int8_gemm_tiny.json").read_text())
    assert {r["shape"] for r in doc["rows"]} == set(bench_gemm.TINY)
    ok = [r for r in doc["rows"] if r["status"] == "ok" and r.get("rel_err") is not None]
    assert ok and all(0 <= r["rel_err"] < 0.2 for r in ok), ok
    assert doc["block"] and all(b["block_rel_err"] < 0.2 for b in doc["block"])
    assert doc["env"]["device"] == "cpu" and "int8_gemm --tiny" in doc["env"]["command"]
    md = (tmp_path / "bench_int8_gemm_tiny.md").read_text()
    assert md.startswith("# int8_gemm:") and "| shape (M, K -> N) | variant |" in md and "## Summary" in md


def test_int8_rows_name_comfy_kitchen_and_say_why_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without comfy-kitchen >= 0.2.40 its int8_linear rows say why; with one, they run its int8_linear on the pack's
    int8 weight (rotated: the activation rotated first) at the pack's own error there."""
    import torch

    from comfyui_lowvram_dit.kernels import int8, int8_comfy_kitchen

    x, w, b = bench_gemm.make_operands(*bench_gemm.TINY["tiny_qkvo"], torch.device("cpu"))
    monkeypatch.setattr(int8_comfy_kitchen, "_load", lambda: (None, "comfy-kitchen 0.2.31 is older than 0.2.40"))
    monkeypatch.setattr(int8_comfy_kitchen, "installed_version", lambda: "0.2.31")
    rows = bench_gemm.variants(x, w, b)
    assert rows["comfy-kitchen 0.2.31 int8_linear rotated"] == rows["comfy-kitchen 0.2.31 int8_linear plain"] == \
        "comfy-kitchen 0.2.31 is older than 0.2.40 (its int8_linear is a candidate from 0.2.40)"

    class Kitchen:  # comfy_kitchen.int8_linear's contract: per-row int8 activations, its own quantizer (here torch's)
        calls = 0

        @classmethod
        def int8_linear(cls, x2, wq, ws, bias, out_dtype):  # noqa: ANN001, ANN206
            cls.calls += 1
            xq, xs = int8.quantize_activation(x2, False)
            out = (xq.float() @ wq.float().t()) * xs.float().reshape(-1, 1) * ws.float().reshape(1, -1)
            return (out + (bias.float() if bias is not None else 0)).to(out_dtype)

    monkeypatch.setattr(int8_comfy_kitchen, "_load", lambda: (Kitchen, ""))
    monkeypatch.setattr(int8_comfy_kitchen, "installed_version", lambda: "0.2.40")
    rows = bench_gemm.variants(x, w, b)
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    theirs = rows["comfy-kitchen 0.2.40 int8_linear rotated"]().float()
    ours = rows["int8 int_mm rotated"]().float()
    assert Kitchen.calls == 1 and bench_gemm.relative_error(theirs, ref) <= 1.05 * bench_gemm.relative_error(ours, ref)


@pytest.mark.parametrize("argv", [["int8_gemm", "--dry"], ["fp8_gemm", "--quick"], ["gemm"]])
def test_an_option_of_the_other_scenario_is_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        bench_gemm.parse_args(argv)
