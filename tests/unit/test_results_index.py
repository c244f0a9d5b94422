"""The results index (benchmarks/results_index.py): the committed files are current, result files read right.

CPU only, plain JSON: the planted result files below are in the common format, plus a kernel result (a component).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from comfyui_lowvram_dit.benchmarks import results_index
from comfyui_lowvram_dit.benchmarks.results_index import ROW_FIELDS

ENV = {"device": "cuda", "gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "comfyui": "0.33.0",
       "comfy_kitchen": "0.2.31", "commit": "abc1234-dirty", "date": "2026-11-24T08:52:15+0000", "command": "render"}
WAN = {"model": "Wan 2.2 T2V-A14B", "resolution": "832x480", "frames": 81, "steps": 6, "card_gib": 8.0,
       "file_format": "fp8_scaled", "cfg": 3.5}


def _row(name: str, side: str, s_per_step: float | None, **more: object) -> dict:
    return {"name": name, **WAN, "setup": f"{name} graph", "memory_manager": "Block Swap" if side == "pack" else
            "DynamicVRAM", "s_per_step": s_per_step, "render_s": None, "peak_vram_gib": 9.0,
            "peak_rss_gib": 15.0 if side == "pack" else 35.0, "against": None, "ratio": None, "side": side, **more}


PLANTED = {
    "server_0.33/run_8gb.json": {"env": ENV, "rows": [
        _row("native_ck_8gb", "native", 6.0), _row("pack_swap_8gb", "pack", 4.8),
        _row("pack_int8_8gb", "pack", None, status="skipped")], "recorded": {"variants": []}},
    "in_process/caps.json": {"env": {**ENV, "comfyui": "0.8.0"}, "rows": [
        _row("cap8 native", "native", 0.5, how="in process", steps=None, cfg=1.0),
        _row("cap8 swap", "pack", 0.32, how="in process", steps=None, cfg=1.0)]},
    "kernels_gemm.json": {"env": {"command": "python -m comfyui_lowvram_dit.benchmarks fp8_gemm",
                                  "device_name": "NVIDIA H200", "git_sha": "0123456789"},
                          "rows": [{"shape": "5120x5120", "ms": 1.0}]},
    "edit/edit_8gb.json": {"env": ENV, "rows": [_row("native_edit", "native", 1.3, model="Qwen-Image-Edit"),
                                                _row("pack_edit", "pack", 0.65, model="Qwen-Image-Edit")]},
    "multigpu/split.json": {"env": ENV, "rows": [_row("pack_stack", "pack", 4.3, card_gib=None),
                                                 _row("pack_stack_split", "pack", 2.2, card_gib=None, gpus=2)]},
    "workflow/t2v.api.json": {"3": {"class_type": "KSampler"}},  # a workflow, not a result
    "render/wan5b_12gb.json": {
        "env": {"device": "cuda", "gpu": "NVIDIA H200", "torch": "2.11.0", "comfyui": "0.33.0",
                "comfy_kitchen": "0.2.31", "commit": "def5678", "date": "2026-11-28", "command": "render"},
        "rows": [{"name": "native", "model": "Wan 2.2 TI2V-5B", "resolution": "1280x704", "frames": 121, "steps": 20,
                  "card_gib": 12.0, "file_format": "fp8_scaled", "setup": "template", "memory_manager": "DynamicVRAM",
                  "s_per_step": 2.0, "render_s": 60.0, "peak_vram_gib": 11.0, "peak_rss_gib": 20.0, "against": None,
                  "ratio": None, "side": "native"},
                 {"name": "pack", "model": "Wan 2.2 TI2V-5B", "resolution": "1280x704", "frames": 121, "steps": 20,
                  "card_gib": 12.0, "file_format": "fp8_scaled", "setup": "Wan Loader + Block Swap",
                  "memory_manager": "Block Swap", "s_per_step": 1.6, "render_s": 50.0, "peak_vram_gib": 10.0,
                  "peak_rss_gib": 12.0, "against": "native", "ratio": None, "side": "pack"}]},
    "investigations/2026-11-20-old/superseded.json": {"anything": "dated evidence is not indexed"},
}


@pytest.fixture
def planted(tmp_path: Path) -> Path:
    for rel, data in PLANTED.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(json.dumps(data), encoding="utf-8")
    (tmp_path / "edit" / "README.md").write_text("# the edit rows\n", encoding="utf-8")
    return tmp_path


def _by_name(rows: list[dict]) -> dict[str, dict]:
    return {r["name"]: r for r in rows}


def test_committed_index_is_current() -> None:
    """INDEX.md, index.json and docs/by-card.md are what the generator writes from today's result files."""
    for path, text in results_index.outputs().items():
        assert path.is_file() and path.read_text(encoding="utf-8") == text, \
            f"{path.name} is stale: run {results_index.COMMAND}"


def test_result_files_read_into_common_rows(planted: Path) -> None:
    rows, components = results_index.collect(planted)
    by = _by_name(rows)
    assert set(by) == {"native_ck_8gb", "pack_swap_8gb", "pack_int8_8gb", "cap8 native", "cap8 swap", "native_edit",
                       "pack_edit", "pack_stack", "pack_stack_split", "native", "pack"}
    assert all(set(ROW_FIELDS) <= set(r) for r in rows)
    server = by["pack_swap_8gb"]
    assert (server["how"], server["gpus"], server["lora"]) == ("server", 1, None)  # the optional fields' defaults
    assert (server["against"], server["ratio"], server["gpu"], server["date"], server["commit"]) == \
        ("native_ck_8gb", 1.25, "H100 80GB HBM3", "2026-11-24", "abc1234-dirty")
    assert by["pack_int8_8gb"]["status"] == "skipped" and by["pack_int8_8gb"]["ratio"] is None
    in_process = by["cap8 swap"]
    assert (in_process["how"], in_process["against"], in_process["ratio"], in_process["comfyui"]) == \
        ("in process", "cap8 native", 1.562, "0.8.0")
    assert by["pack_edit"]["against"] == "native_edit" and by["pack_edit"]["ratio"] == 2.0
    assert by["pack_edit"]["link"] == "edit/README.md"  # no edit_8gb.md: the folder's README is the report
    assert by["pack_stack_split"]["gpus"] == 2 and by["pack_stack_split"]["against"] is None  # no native row
    assert by["pack"]["against"] == "native" and by["pack"]["ratio"] == 1.25  # the given baseline, ratio filled in
    assert [c["source"] for c in components] == ["kernels_gemm.json"]
    assert components[0]["what"].startswith("fp8 GEMMs of one Wan 14B block")  # the scenario's own description
    assert (components[0]["gpu"], components[0]["commit"]) == ("H200", "0123456")


def test_index_and_by_card_pages(planted: Path) -> None:
    rows, components = results_index.collect(planted)
    index = results_index.index_markdown(rows, components)
    assert "### run_8gb" in index and "[edit/README.md](edit/README.md)" in index
    assert "| pack_swap_8gb | pack | pack_swap_8gb graph | 832x480x81, 6 steps, cfg 3.5 | 8 GB |" in index
    by_card = results_index.by_card_markdown(rows)
    eight = by_card.split("## 8 GB card")[1].split("## ")[0]
    assert "| Wan 2.2 T2V-A14B | fp8_scaled | 832x480x81, 6 steps, cfg 3.5 |" in eight and "**1.25x**" in eight
    assert "| Qwen-Image | fp8_scaled | not measured |" in eight
    twelve = by_card.split("## 12 GB card")[1].split("## ")[0]
    # rows with a render time are compared by it (what users wait for), their s/step shown beside it
    assert "Wan Loader + Block Swap | 50 s render (1.6 s/step) | template | 60 s render (2 s/step) | **1.20x**" \
        in twelve
    assert "(../benchmarks/results/INDEX.md#wan5b_12gb)" in twelve
    assert "x2 GPUs" not in by_card and "MultiGPU" not in by_card  # one card only


def test_a_file_not_in_the_common_format_names_itself(planted: Path) -> None:
    (planted / "odd.json").write_text(json.dumps({"numbers": [1, 2]}), encoding="utf-8")
    with pytest.raises(ValueError, match=r"odd\.json: not a result in the common format"):
        results_index.collect(planted)


def test_check_reports_stale_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture) -> None:
    target = tmp_path / "INDEX.md"
    monkeypatch.setattr(results_index, "outputs", lambda: {target: "fresh\n"})
    assert results_index.main(["--check"]) == 1 and "INDEX.md is stale" in capsys.readouterr().err
    assert results_index.main([]) == 0 and target.read_text() == "fresh\n"
    assert results_index.main(["--check"]) == 0


def test_a_step_cache_is_its_own_workload(tmp_path: Path) -> None:
    """EasyCache rows change the output: they are compared with native's row under the same cache, never made
    native's best of the uncached rows, and get their own line on the by-card page."""
    cached = {"step_cache": "EasyCache"}
    rows = [_row("native", "native", 6.0), _row("pack", "pack", 4.8), _row("native_cache", "native", 3.0, **cached),
            _row("pack_cache", "pack", 2.0, render_s=41.0, renders={
                "first_ever": {"easycache_skipped": [[2, 6]]}, "warm": {"easycache_skipped": [[1, 3], [2, 3]]}},
                **cached)]
    (tmp_path / "render").mkdir()
    (tmp_path / "render" / "cache.json").write_text(json.dumps({"env": ENV, "rows": rows}), encoding="utf-8")
    by = _by_name(results_index.collect(tmp_path)[0])
    assert (by["pack"]["against"], by["pack"]["ratio"]) == ("native", 1.25)
    assert (by["pack_cache"]["against"], by["pack_cache"]["ratio"]) == ("native_cache", 1.5)
    eight = results_index.by_card_markdown(list(by.values())).split("## 8 GB card")[1].split("## ")[0]
    assert "| 832x480x81, 6 steps, cfg 3.5 |" in eight and "| 832x480x81, 6 steps, cfg 3.5, EasyCache |" in eight
    assert "41 s render (2 s/step, EasyCache skipped 3/6 steps) |" in eight  # the warm render's, both samplers'
    assert "skipped" not in eight.split("EasyCache skipped")[0]  # the uncached and native rows say nothing of it


def test_a_format_beyond_the_three_is_listed_only_for_the_models_measured_in_it(planted: Path) -> None:
    data = json.loads((planted / "render/wan5b_12gb.json").read_text())
    data["rows"] = [{**r, "file_format": "gguf_q8_0", "name": r["name"] + "_gguf"} for r in data["rows"]]
    (planted / "render/wan5b_12gb_gguf.json").write_text(json.dumps(data))
    by_card = results_index.by_card_markdown(results_index.collect(planted)[0])
    twelve = by_card.split("## 12 GB card")[1].split("## ")[0]
    eight = by_card.split("## 8 GB card")[1].split("## ")[0]
    assert "| Wan 2.2 TI2V-5B | gguf_q8_0 | 1280x704x121" in twelve
    assert "| Wan 2.2 TI2V-5B | gguf_q8_0 | not measured |" in eight  # the model's own gap, on every card
    assert "| Wan 2.2 T2V-A14B | gguf_q8_0 |" not in by_card and "| Qwen-Image | gguf_q8_0 |" not in by_card
    assert "| Qwen-Image | bf16 | not measured |" in eight  # the three formats stay listed for every model


def test_rows_off_dynamic_vram_or_on_an_emulated_machine_get_lines_of_their_own(tmp_path: Path) -> None:
    """A newer run with DynamicVRAM off or on a machine of less RAM never replaces the default run on the by-card
    page: each gets its own line saying how it differs, and is compared only within its own kind."""
    (tmp_path / "render").mkdir()
    runs = {"default.json": ({}, "2026-11-24"), "legacy.json": ({"dynamic_vram": False}, "2026-11-25"),
            "ram32.json": ({"ram_gib": 32.0}, "2026-11-26")}
    for name, (more, day) in runs.items():
        rows = [_row("native", "native", 6.0, **more), _row("pack", "pack", 4.0 if more else 4.8, **more)]
        (tmp_path / "render" / name).write_text(json.dumps({"env": {**ENV, "date": day}, "rows": rows}),
                                                encoding="utf-8")
    eight = results_index.by_card_markdown(results_index.collect(tmp_path)[0]).split("## 8 GB card")[1]
    eight = eight.split("## ")[0]
    assert "| server, H100 80GB HBM3, ComfyUI 0.33.0, 2026-11-24 |" in eight and "**1.25x**" in eight
    assert "| server, DynamicVRAM off, H100 80GB HBM3, ComfyUI 0.33.0, 2026-11-25 |" in eight
    assert "| server, 32 GiB RAM (emulated), H100 80GB HBM3, ComfyUI 0.33.0, 2026-11-26 |" in eight
    assert eight.count("**1.50x**") == 2
