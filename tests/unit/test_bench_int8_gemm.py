"""The int8_gemm scenario's flow on the CPU (``--tiny``: scaled-down shapes, every variant this machine can run, the
Wan block chain's error, the reports)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from comfyui_lowvram_dit.benchmarks import bench_int8_gemm


@pytest.mark.slow  # a few seconds of CPU GEMMs
def test_tiny_run_writes_every_shape_and_the_block_errors(tmp_path: Path) -> None:
    assert bench_int8_gemm.main(["--tiny", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "bench_int8_gemm_tiny.json").read_text())
    assert {r["shape"] for r in doc["rows"]} == set(bench_int8_gemm.TINY)
    ok = [r for r in doc["rows"] if r["status"] == "ok" and r.get("rel_err") is not None]
    assert ok and all(0 <= r["rel_err"] < 0.2 for r in ok), ok
    assert doc["block"] and all(b["block_rel_err"] < 0.2 for b in doc["block"])
    assert doc["env"]["device"] == "cpu" and "--tiny" in doc["env"]["command"]
    md = (tmp_path / "bench_int8_gemm_tiny.md").read_text()
    assert md.startswith("# int8_gemm:") and "| shape (M, K -> N) | variant |" in md and "## Summary" in md
