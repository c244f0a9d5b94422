"""The results index (benchmarks/results_index.py): the committed files are current, each layout reads right.

CPU only, plain JSON: the planted result files below are one of each layout with the fields their readers use.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from comfyui_lowvram_dit.benchmarks import results_index
from comfyui_lowvram_dit.benchmarks.results_layouts import ROW_FIELDS

SERVER_ENV = {"command": "python3 -m comfyui_lowvram_dit.benchmarks server_wan14b --variants a,b", "git_sha": "abc1234",
              "comfyui_version": "0.33.0", "timestamp": "2026-11-24T08:52:15+0000",
              "device_name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "comfy_kitchen": "0.2.31"}


def _server_variant(name: str, graph: str, s_per_step: float | None, status: str = "ok") -> dict:
    return {"name": name, "what": f"{name} graph, DynamicVRAM, 8 GB card", "status": status,
            "variant": {"graph": graph, "card_gib": 8.0, "block_swap_gb": 8.0 if graph == "pack" else None,
                        "dynamic_vram": True}, "s_per_step": s_per_step, "peak_gpu_gib": 9.0,
            "peak_rss_hwm_gib": 15.0 if graph == "pack" else 35.0}


def _harness_variant(name: str, kind: str, ms: float, cap: float | None) -> dict:
    return {"name": name, "target": "comfyui_lowvram_dit.benchmarks.bench_block_swap:swap_forward",
            "kwargs": {"kind": kind, "width": 832, "height": 480, "frames": 17, "vram_cap_gb": cap},
            "status": "ok", "time_ms": ms, "peak_reserved_gib": 7.5, "peak_rss_gib": 14.3}


EDIT_SETTINGS = {"edit": "2509", "steps": 4, "image_size": [1024, 1024],
                 "unet": "qwen_image_edit_2509_fp8_e4m3fn.safetensors"}
PLANTED = {
    "server_0.33/run_8gb.json": {
        "bench": "run_8gb", "env": SERVER_ENV, "ratios": {}, "goals": [], "notes": [],
        "settings": {"steps_per_expert": 3, "width": 832, "height": 480, "frames": 81, "cfg": 3.5,
                     "model_files_gb": {"wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors": 14.29}},
        "variants": [_server_variant("native_ck_8gb", "native", 6.0), _server_variant("pack_swap_8gb", "pack", 4.8),
                     _server_variant("pack_int8_8gb", "pack", None, "skipped")]},
    "block_swap_480p17.json": {
        "bench": "block_swap_480p17", "settings": {}, "notes": [],
        "env": {"command": "bench_block_swap.py", "comfyui_version": "0.8.0", "timestamp": "2026-11-22T01:08:00+0000",
                "device_name": "NVIDIA H200", "torch": "2.11.0+cu130", "git_sha": None},
        "variants": [_harness_variant("cap8 native", "native", 500.0, 8.0),
                     _harness_variant("cap8 swap", "swap_b2", 320.0, 8.0)]},
    "kernels_gemm.json": {"env": {"command": "python -m comfyui_lowvram_dit.benchmarks fp8_gemm",
                                  "device_name": "NVIDIA H200"}, "rows": [{"shape": "5120x5120", "ms": 1.0}]},
    "edit/native.json": {"env": SERVER_ENV, "goals": {}, "settings": EDIT_SETTINGS,
                         "rows": [{"name": "native_edit", "graph": "native", "card_gib": 8.0, "s_per_step": 1.3}]},
    "edit/pack.json": {"env": SERVER_ENV, "goals": {}, "settings": EDIT_SETTINGS,
                       "rows": [{"name": "pack_edit", "graph": "pack", "card_gib": 8.0, "s_per_step": 0.65}]},
    "multigpu/stack_40blocks.json": {
        "environment": {"gpus": ["NVIDIA H200", "NVIDIA H200"], "comfyui": "0.33.0", "date": "2026-11-26",
                        "shape": "832x480x81, cfg 3.5, 4 steps", "layers": 40},
        "rows": [{"row": "pack_stack", "graph": "Wan Loader fp8", "s_per_step_1gpu": 4.3, "s_per_step_split": 2.2}]},
    "workflow/t2v.json": {"env": {"gpu": "NVIDIA H200", "comfyui": "0.8.0", "date": "2026-11-22", "card_gib": 8.0},
                          "workflow": "t2v.api.json", "wall_s": 104.86, "peak_rss_hwm_gib": 17.2},
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


def test_each_layout_reads_into_common_rows(planted: Path) -> None:
    rows, components = results_index.collect(planted)
    by = _by_name(rows)
    assert set(by) == {"native_ck_8gb", "pack_swap_8gb", "pack_int8_8gb", "cap8 native", "cap8 swap", "native_edit",
                       "pack_edit", "pack_stack", "pack_stack_split", "workflow", "native", "pack"}
    assert all(set(ROW_FIELDS) <= set(r) for r in rows)
    server = by["pack_swap_8gb"]
    assert (server["model"], server["resolution"], server["frames"], server["steps"], server["card_gib"]) == \
        ("Wan 2.2 T2V-A14B", "832x480", 81, 6, 8.0)  # 3 steps per expert, two experts
    assert (server["file_format"], server["memory_manager"], server["setup"]) == \
        ("fp8_scaled", "Block Swap", "pack_swap_8gb graph")
    assert (server["against"], server["ratio"], server["gpu"], server["date"], server["commit"]) == \
        ("native_ck_8gb", 1.25, "H100 80GB HBM3", "2026-11-24", "abc1234")
    assert by["pack_int8_8gb"]["status"] == "skipped" and by["pack_int8_8gb"]["ratio"] is None
    harness = by["cap8 swap"]
    assert (harness["how"], harness["s_per_step"], harness["against"], harness["ratio"], harness["comfyui"]) == \
        ("in process", 0.32, "cap8 native", 1.562, "0.8.0")
    assert by["pack_edit"]["against"] == "native_edit" and by["pack_edit"]["ratio"] == 2.0  # one folder, one run
    assert by["pack_stack_split"]["gpus"] == 2 and by["pack_stack"]["s_per_step"] == 4.3
    assert by["workflow"]["render_s"] == 104.86 and by["workflow"]["card_gib"] == 8.0
    assert by["pack"]["against"] == "native" and by["pack"]["ratio"] == 1.25  # common rows: the ratio filled in
    assert [c["source"] for c in components] == ["kernels_gemm.json"]
    assert components[0]["what"].startswith("fp8 GEMMs")  # the scenario's own description


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


def test_an_unknown_layout_names_its_file(planted: Path) -> None:
    (planted / "odd.json").write_text(json.dumps({"numbers": [1, 2]}), encoding="utf-8")
    with pytest.raises(ValueError, match=r"odd\.json: no reader knows this result layout"):
        results_index.collect(planted)


def test_check_reports_stale_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture) -> None:
    target = tmp_path / "INDEX.md"
    monkeypatch.setattr(results_index, "outputs", lambda: {target: "fresh\n"})
    assert results_index.main(["--check"]) == 1 and "INDEX.md is stale" in capsys.readouterr().err
    assert results_index.main([]) == 0 and target.read_text() == "fresh\n"
    assert results_index.main(["--check"]) == 0
