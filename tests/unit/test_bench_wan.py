"""benchmarks/bench_wan.py without ComfyUI: presets as data, variant names and kwargs, ratios within a group."""

from __future__ import annotations

from pathlib import Path

import pytest
from comfyui_lowvram_dit.benchmarks import bench_wan as W


def test_every_preset_row_is_a_known_weights_kind() -> None:
    for preset in W.PRESETS.values():
        for row in preset.rows.values():
            assert row.get("load") or row["weights"] in W.WEIGHTS
        assert set(preset.bases) <= set(preset.rows) and set(preset.res) <= set(W.RESOLUTIONS)


def test_block_swap_variants_name_resolution_cap_and_kind(tmp_path: Path) -> None:
    preset = W.PRESETS["block_swap"]
    vs = W.variants(preset, ["native", "swap_b2"], "720p81", [None, 8.0], False, tmp_path, tmp_path / "f")
    assert [v.name for v in vs] == ["720p81 cap=none native", "720p81 cap=none swap_b2", "720p81 cap=8.0 native",
                                    "720p81 cap=8.0 swap_b2"]
    assert vs[3].kwargs == {"weights": "per_tensor", "swap": True, "size": "full", "width": 1280, "height": 720,
                            "frames": 81, "vram_cap_gb": 8.0}
    smoke = W.variants(preset, ["swap"], "480p81", [None], True, tmp_path, tmp_path / "f")
    assert smoke[0].kwargs["blocks_to_swap"] == 2 and smoke[0].kwargs["size"] == "tiny"


def test_fp8_rows_share_one_reference_and_load_row_quantizes_a_file(tmp_path: Path) -> None:
    vs = W.variants(W.PRESETS["fp8"], ["native_bf16", "ours_blockwise64", "quantize_on_load"], "480p81", [None],
                    False, tmp_path, tmp_path / "w.safetensors")
    assert vs[0].kwargs["save_ref"] and vs[0].kwargs["ref_path"] == vs[1].kwargs["ref_path"]
    assert vs[1].kwargs["block_size"] == 64 and vs[1].kwargs["weights"] == "blockwise"
    assert vs[2].target.endswith(":quantize_on_load") and vs[2].kwargs["path"] == str(tmp_path / "w.safetensors")
    stack = W.variants(W.PRESETS["stack"], ["model_fp8_int8attn_ours_default"], "480p81", [None], True, tmp_path,
                       tmp_path / "f")
    assert stack[0].kwargs["compile"] == "default" and stack[0].kwargs["backend"] == "cudagraphs"


def test_ratios_are_taken_within_a_group_against_its_bases() -> None:
    results = [{"name": "480p81 cap=8 native", "status": "ok", "time_ms": 300.0},
               {"name": "480p81 cap=8 swap_b2", "status": "ok", "time_ms": 200.0},
               {"name": "480p17 cap=8 swap_b2", "status": "ok", "time_ms": 100.0},
               {"name": "480p17 cap=8 native", "status": "oom"}]
    text = W.ratios(results, ("native",))
    assert "| 480p81 cap=8 swap_b2 | 200.0 | 1.500x vs 480p81 cap=8 native |" in text
    assert "| 480p17 cap=8 swap_b2 | 100.0 |  |" in text and "| 480p17 cap=8 native | oom |  |" in text


def test_unknown_rows_are_refused() -> None:
    with pytest.raises(SystemExit):
        W.main(["--preset", "nan_guard", "--kinds", "swap"])
