"""The fp8_gemm benchmark's ``--block --dry`` mode on the CPU: every variant's code path runs (ComfyUI's native
Linear is replicated without COMFYUI_PATH), the reports are written and the delayed states count their calls."""

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
    for v in ("bf16 F.linear", "native fp8_e4m3fn_fast", "cand delayed", "cand delayed, q/k/v quantized once",
              "pack tensor-wise (amax pass), no fast accum"):
        assert block[v]["status"] == "ok", block[v]
    assert block["native fp8_e4m3fn_fast"]["err_mean"] > 0.2  # clamped at +-448: the massive channels are lost
    assert block["cand delayed"]["err_mean"] < 0.06
    states = {r["variant"]: r for r in rows if r["kind"] == "states"}
    shared = states["cand delayed, q/k/v quantized once"]
    assert shared["states"] == 6 and shared["calls"] > 0 and shared["requantized_calls"] >= shared["states"]
    assert "Verdict" in (tmp_path / "bench_fp8_gemm_block_dry.md").read_text()
