"""The fp8_gemm benchmark's ``--block --dry`` mode on the CPU: every variant's code path runs (ComfyUI's native
Linear is replicated without COMFYUI_PATH) and the reports are written."""

from __future__ import annotations

import json

import pytest

from comfyui_lowvram_dit.benchmarks import bench_fp8_gemm


@pytest.mark.parametrize("family", ["massive"])
def test_block_dry_run_exercises_every_variant(tmp_path, monkeypatch, family):
    monkeypatch.delenv("COMFYUI_PATH", raising=False)  # the replicated native steps
    assert bench_fp8_gemm.main(["--dry", "--families", family, "--out", str(tmp_path)]) == 0
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
