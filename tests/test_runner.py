"""`python -m comfyui_lowvram_dit run` without ComfyUI: where it finds workflows, what it says, what it writes.

The end-to-end runs (a real ComfyUI started by the runner) are in tests/test_comfyui_workflows.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from comfyui_lowvram_dit.tools import runner, synth
from comfyui_lowvram_dit.tools.model_specs import spec_nbytes
from test_workflows import OFFICIAL_LORAS

REPO = Path(__file__).resolve().parent.parent
SHIPPED = sorted(p.stem for p in (REPO / "workflows").glob("*.json"))
# ComfyUI hard-codes these widths (tools/model_specs.py): full-width files even when "tiny".
FIXED_WIDTH = {"wan2.2_vae.safetensors", "qwen_image_fp8_e4m3fn.safetensors", "qwen_2.5_vl_7b_fp8_scaled.safetensors"}


def test_shipped_workflows_resolve_by_name_from_the_pack_root() -> None:
    assert (runner.PACK_DIR / "__init__.py").is_file() and (runner.PACK_DIR / "workflows").is_dir()
    assert len(SHIPPED) == 6
    for name in SHIPPED:
        assert runner.resolve_workflow(name) == REPO / "workflows" / f"{name}.json"
    with pytest.raises(runner.RunError, match="shipped workflows: qwen_image_t2i, qwen_image_t2i_4step, wan22_i2v_a14b"):
        runner.resolve_workflow("nope")


def _workflow_files() -> tuple[set[str], set[str]]:
    names: set[str] = set()
    staged: set[str] = set()
    for name in SHIPPED:
        wf = json.loads(runner.resolve_workflow(name).read_text())
        names |= runner.referenced_model_files(wf)
        staged |= runner.staged_text_encoder_files(wf)
    # the 4-step workflows' LoRAs count once the runner writes synthetic LoRAs (test_workflows skips them until then)
    return {n for n in names if n in runner.KNOWN_MODEL_FILES or n not in OFFICIAL_LORAS}, staged


def test_synthetic_tiny_files_of_all_shipped_workflows_stay_small() -> None:
    """Bytes `run --synthetic tiny` writes for the four workflows together (computed from the file layouts)."""
    names, staged = _workflow_files()
    sizes = {}
    for n in names:
        _, model, fmt = runner.KNOWN_MODEL_FILES[n]
        config = runner.tiny_text_encoder_config(model) if n in staged else None
        sizes[n] = spec_nbytes(synth._plan(model, "tiny", fmt, None, config)[0])
    small = {n: s for n, s in sizes.items() if n not in FIXED_WIDTH}
    assert max(small.values()) < 16e6, small
    assert sum(small.values()) < 60e6, small
    # The fixed-width files: Wan 2.2 VAE 705 M params at 2 bytes (its release dtype), Qwen-Image 1 block,
    # Qwen2.5-VL 2 layers with ComfyUI's full vocabulary and vision tower.
    assert sizes["wan2.2_vae.safetensors"] < 1.45e9
    assert sum(sizes.values()) < 3.7e9, sizes


def test_cached_synthetic_models_are_kept_without_a_word(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    names = {"wan_2.1_vae.safetensors", "umt5_xxl_fp8_e4m3fn_scaled.safetensors"}
    staged = {"umt5_xxl_fp8_e4m3fn_scaled.safetensors"}
    paths = runner.write_synthetic_models(names, tmp_path, "tiny", staged)
    out = capsys.readouterr().out
    assert out.startswith(f"writing 2 synthetic tiny model file(s) (random weights) to {tmp_path}")
    assert "2-layer umt5_xxl_enc (fp8_scaled) -> text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors" in out
    stamps = [p.stat().st_mtime_ns for p in paths]
    assert runner.write_synthetic_models(names, tmp_path, "tiny", staged) == paths
    assert capsys.readouterr().out == ""
    assert [p.stat().st_mtime_ns for p in paths] == stamps
    assert runner._layer_count(tmp_path / "text_encoders" / "umt5_xxl_fp8_e4m3fn_scaled.safetensors") == 2


def test_a_cached_run_does_not_import_torch(tmp_path: Path) -> None:
    """The cache check and the GPU check of a CPU machine are header reads, not a torch import (seconds)."""
    names = {"wan_2.1_vae.safetensors", "umt5_xxl_fp8_e4m3fn_scaled.safetensors"}
    runner.write_synthetic_models(names, tmp_path, "tiny", {"umt5_xxl_fp8_e4m3fn_scaled.safetensors"})
    code = (
        "import sys; from pathlib import Path; from comfyui_lowvram_dit.tools import runner; "
        f"runner.write_synthetic_models({sorted(names)!r}, Path({str(tmp_path)!r}), 'tiny', "
        "{'umt5_xxl_fp8_e4m3fn_scaled.safetensors'}); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_run_help_describes_every_option(capsys: pytest.CaptureFixture) -> None:
    parser = runner._parser()
    undocumented = [a.dest for a in parser._actions if not a.help]
    assert not undocumented
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "--set NODE.INPUT=VALUE" in text and "KSampler.steps=4" in text


def test_default_output_folder_is_ignored_by_git() -> None:
    default = runner._parser().get_default("output")
    assert f"{default}/" in (REPO / ".gitignore").read_text().splitlines()
