"""benchmarks/bench_attention_int8.py on CPU: arguments of both scenarios, unavailable rival backends, comfy-kitchen
wheels that cannot be installed and workers that fail are rows of the report, worker rows merge beside ours, and the
markdown shows every backend per shape and family."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch
from comfyui_lowvram_dit.benchmarks import bench_attention_int8 as B
from comfyui_lowvram_dit.benchmarks.__main__ import SCENARIOS


def test_arguments_name_known_shapes_and_backends() -> None:
    args = B.parse_args(["--shapes", "wan14b_480p_self", "wan14b_720p_self", "--no-sweep"])
    assert args.shapes == ["wan14b_480p_self", "wan14b_720p_self"] and args.families is None
    assert args.backends == list(B.BACKENDS) and "comfy_kitchen_int8" in args.backends and args.repeats == 10
    for bad in (["--shapes", "wan_1080p"], ["--backends", "sage"]):
        with pytest.raises(SystemExit):
            B.parse_args(bad)


def test_kitchen_scenario_defaults() -> None:
    scenario = SCENARIOS["attention_kitchen"]
    args = B.parse_args([*scenario.args])
    assert scenario.module == "bench_attention_int8" and args.kitchen and args.repeats == 6
    assert args.shapes == list(B.SHAPES) and args.backends == list(B.KITCHEN_BACKENDS)
    assert args.families == list(B.families_module().ALL_FAMILIES)


def test_rivals_without_a_gpu_are_skipped_with_a_reason() -> None:
    if torch.cuda.is_available():
        pytest.skip("on a GPU the rivals may run")
    fns = {n: B.backend_fn(n) for n in B.RIVALS}
    assert all(isinstance(why, str) and why for why in fns.values())
    rows = B.time_shapes(["wan14b_480p_cross"], fns, 1, errors=True)
    assert [r["backend"] for r in rows] == list(B.RIVALS)
    assert all(r["skipped"] and "error" not in r and "time_ms" not in r for r in rows)


def _report() -> dict:
    env = {"gpu": "planted GPU", "torch": "2.11", "command": "python -m ... attention_kitchen"}
    return {"bench": B.KITCHEN_STEM, "env": env, "kitchen": [], "autotune": {}, "checks": [
        {"shape": [1, 2, 77, 513, 64], "family": "gauss", "backend": "int8_int8", "err_vs_emulation": 0.004,
         "err_vs_fp32": 0.013, "emulation_vs_fp32": 0.012}],
        "rows": [{"shape_name": "wan14b_480p_self", "backend": "sdpa_cudnn", "time_ms": 38.0},
                 {"shape_name": "wan14b_480p_self", "backend": "int8_fp8", "time_ms": 30.4}],
        "families": [{"shape_name": "wan14b_480p_self", "family": "gauss", "errors": {"int8_fp8": 0.048},
                      "notes": {}}]}


def test_worker_rows_merge_beside_ours_and_failures_are_rows() -> None:
    report = _report()
    worker = {"versions": ["comfy_kitchen 0.2.40"],
              "rows": [{"shape_name": "wan14b_480p_self", "backend": "comfy_kitchen 0.2.40", "time_ms": 47.6}],
              "families": [{"shape_name": "wan14b_480p_self", "family": "gauss",
                            "errors": {"comfy_kitchen 0.2.40": 0.0167}, "notes": {}}]}
    B.merge(report, worker, "comfy_kitchen-0.2.40-cp312-abi3.whl")
    B.merge(report, {"site": "installed", "error": "ImportError: no comfy_kitchen"}, "installed")
    assert report["families"][0]["errors"] == {"int8_fp8": 0.048, "comfy_kitchen 0.2.40": 0.0167}
    assert report["kitchen"] == [{"comfy_kitchen-0.2.40-cp312-abi3.whl": ["comfy_kitchen 0.2.40"]},
                                 {"installed": "ImportError: no comfy_kitchen"}]
    text = "\n".join(B.to_markdown(report))
    assert "| wan14b_480p_self | comfy_kitchen 0.2.40 | 47.60 | — | 0.80x |" in text
    assert "| wan14b_480p_self | int8_fp8 | 30.40 | — | 1.25x |" in text
    assert "| gauss | — | **4.80%** | 1.67% |" in text and "| int8_int8 | 0.0040 | 0.0130 | 0.0120 |" in text
    assert "ImportError: no comfy_kitchen" in text and "planted GPU" in text
    assert text.startswith("# attention_kitchen:")


def test_wheels_that_do_not_install_are_recorded(tmp_path: Path) -> None:
    bad = tmp_path / "wheels"
    bad.mkdir()
    (bad / "comfy_kitchen-9.9.9-py3-none-any.whl").write_bytes(b"not a zip")
    good = tmp_path / "good"
    good.mkdir()
    with zipfile.ZipFile(good / "comfy_kitchen-0.0.1-py3-none-any.whl", "w") as whl:
        whl.writestr("comfy_kitchen/__init__.py", "raise ImportError('planted')\n")
    sites = B.install_wheels([bad, good, tmp_path / "missing"], tmp_path / "sites")
    by_wheel = {s["wheel"]: s for s in sites}
    assert "error" in by_wheel["comfy_kitchen-9.9.9-py3-none-any.whl"]
    assert "site" in by_wheel["comfy_kitchen-0.0.1-py3-none-any.whl"]
    assert by_wheel[str(tmp_path / "missing")]["error"] == "no such folder"


def test_smoke_runs_the_family_errors_on_the_cpu(capsys: pytest.CaptureFixture) -> None:
    assert B.main(["--smoke", "--families", "gauss", "rmsnorm_outliers"]) == 0
    out = capsys.readouterr().out
    assert "| gauss |" in out and "smoke: 2 families, over budget with int8_fp16: none" in out
