"""benchmarks/bench_attention_kitchen.py on the CPU: wheels that cannot be installed and workers that fail are rows of
the report, worker rows merge beside ours, and the markdown shows every backend per shape and family."""

from __future__ import annotations

import zipfile
from pathlib import Path

from comfyui_lowvram_dit.benchmarks import bench_attention_kitchen as K


def _report() -> dict:
    env = {"gpu": "planted GPU", "torch": "2.11", "command": "python -m ... attention_kitchen"}
    return {"bench": K.STEM, "env": env, "kitchen": [], "checks": [
        {"shape": [1, 2, 77, 513, 64], "family": "gauss", "backend": "int8_int8", "err_vs_emulation": 0.004,
         "err_vs_fp32": 0.013, "emulation_vs_fp32": 0.012}],
        "speed": [{"shape_name": "wan14b_480p_self", "backend": "sdpa_cudnn", "time_ms": 38.0},
                  {"shape_name": "wan14b_480p_self", "backend": "int8_fp8", "time_ms": 30.4}],
        "errors": [{"shape_name": "wan14b_480p_self", "family": "gauss", "errors": {"int8_fp8": 0.048}, "notes": {}}]}


def test_worker_rows_merge_beside_ours_and_failures_are_rows() -> None:
    report = _report()
    worker = {"versions": ["comfy_kitchen 0.2.40"],
              "speed": [{"shape_name": "wan14b_480p_self", "backend": "comfy_kitchen 0.2.40", "time_ms": 47.6}],
              "errors": [{"shape_name": "wan14b_480p_self", "family": "gauss",
                          "errors": {"comfy_kitchen 0.2.40": 0.0167}, "notes": {}}]}
    K.merge(report, worker, "comfy_kitchen-0.2.40-cp312-abi3.whl")
    K.merge(report, {"site": "installed", "error": "ImportError: no comfy_kitchen"}, "installed")
    assert report["errors"][0]["errors"] == {"int8_fp8": 0.048, "comfy_kitchen 0.2.40": 0.0167}
    assert report["kitchen"] == [{"comfy_kitchen-0.2.40-cp312-abi3.whl": ["comfy_kitchen 0.2.40"]},
                                 {"installed": "ImportError: no comfy_kitchen"}]
    text = K.to_markdown(report)
    assert "| wan14b_480p_self | comfy_kitchen 0.2.40 | 47.60 | 0.80x |" in text
    assert "| wan14b_480p_self | int8_fp8 | 30.40 | 1.25x |" in text
    assert "| wan14b_480p_self | gauss | 4.80% | 1.67% |" in text
    assert "ImportError: no comfy_kitchen" in text and "planted GPU" in text


def test_wheels_that_do_not_install_are_recorded(tmp_path: Path) -> None:
    bad = tmp_path / "wheels"
    bad.mkdir()
    (bad / "comfy_kitchen-9.9.9-py3-none-any.whl").write_bytes(b"not a zip")
    good = tmp_path / "good"
    good.mkdir()
    with zipfile.ZipFile(good / "comfy_kitchen-0.0.1-py3-none-any.whl", "w") as whl:
        whl.writestr("comfy_kitchen/__init__.py", "raise ImportError('planted')\n")
    sites = K.install_wheels([bad, good, tmp_path / "missing"], tmp_path / "sites")
    by_wheel = {s["wheel"]: s for s in sites}
    assert "error" in by_wheel["comfy_kitchen-9.9.9-py3-none-any.whl"]
    assert "site" in by_wheel["comfy_kitchen-0.0.1-py3-none-any.whl"]
    assert by_wheel[str(tmp_path / "missing")]["error"] == "no such folder"
