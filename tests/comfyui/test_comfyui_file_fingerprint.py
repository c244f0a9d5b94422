"""Loader nodes re-run when a selected file changes on disk under the same name (host/files.py file_fingerprint).
In process; needs COMFYUI_PATH."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from comfy_server import comfyui_in_process_or_skip

pytestmark = pytest.mark.comfyui


def test_fingerprints_follow_the_files(tmp_path: Path) -> None:
    comfyui_in_process_or_skip()
    import folder_paths

    from comfyui_lowvram_dit.nodes.qwen_staged import QwenImageStagedLoader
    from comfyui_lowvram_dit.nodes.wan_text import WanTextEncode

    for folder in ("text_encoders", "diffusion_models", "vae"):
        (tmp_path / folder).mkdir()
        folder_paths.add_model_folder_path(folder, str(tmp_path / folder))
    te = tmp_path / "text_encoders" / "fp_te.safetensors"
    te.write_bytes(b"x" * 10)
    (tmp_path / "vae" / "fp_vae.safetensors").write_bytes(b"v")
    first = WanTextEncode.fingerprint_inputs("fp_te.safetensors")
    assert first.startswith("fp_te.safetensors:10:")
    te.write_bytes(b"y" * 12)
    os.utime(te, ns=(1, 1))
    assert WanTextEncode.fingerprint_inputs("fp_te.safetensors") == "fp_te.safetensors:12:1"
    assert WanTextEncode.fingerprint_inputs("nope.safetensors") == "nope.safetensors:missing"
    joined = QwenImageStagedLoader.fingerprint_inputs("gone.safetensors", "fp_te.safetensors", "fp_vae.safetensors")
    parts = joined.split("|")
    assert parts[0] == "gone.safetensors:missing" and parts[1] == "fp_te.safetensors:12:1"
    assert parts[2].startswith("fp_vae.safetensors:1:")
