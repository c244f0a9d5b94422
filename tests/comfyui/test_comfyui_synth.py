"""Synthetic checkpoints inside a real ComfyUI: stock loaders detect and load every tiny file and run it.

DiTs: UNETLoader -> KSampler (2 steps, cfg 2, random conditioning from the fixture nodes) -> latent stats.
VAEs: VAELoader -> VAEDecode -> VAEEncode. Text encoders (full size even when "tiny": ComfyUI's configs are
fixed, see synthetic/specs.py) and the Wan 2.2 VAE (dim 160 fixed, 1.4 GB) are marked ``slow``.
Run: see tests/comfy_server.py (needs COMFYUI_PATH).
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any

import pytest
from comfy_server import ComfyServer

from comfyui_lowvram_dit.synthetic import checkpoints as synth
from comfyui_lowvram_dit.synthetic.specs import MODEL_FOLDER

pytestmark = pytest.mark.comfyui
_seed = itertools.count(1000)  # identical prompts are cached by ComfyUI: vary a seed per run

# (model, format) -> ComfyUI model class that must be built. ComfyUI picks the config from the weights:
# Wan 2.2 I2V (in_dim 36, no CLIP branch) -> WAN21_T2V, out_dim 48 -> WAN22_T2V (5B), img_emb -> WAN21_I2V.
DIT_CASES = {
    ("wan22_t2v_14B", "bf16"): "WAN21",
    ("wan22_t2v_14B", "fp8"): "WAN21",
    ("wan22_t2v_14B", "fp8_scaled"): "WAN21",
    ("wan22_i2v_14B", "bf16"): "WAN21",
    ("wan22_i2v_14B", "fp8_scaled"): "WAN21",
    ("wan22_ti2v_5B", "bf16"): "WAN22",
    ("wan21_t2v_1_3B", "bf16"): "WAN21",
    ("wan21_i2v_14B", "bf16"): "WAN21",
    ("qwen_image", "fp8_scaled"): "QwenImage",
}


def _place(server: ComfyServer, model: str, fmt: str, size: str = "tiny", num_layers: int | None = None) -> str:
    """Write the file under the server's models/<folder> with a unique name; returns the name for loaders."""
    name = f"synthtest_{model}_{size}_{fmt}_{uuid.uuid4().hex[:8]}.safetensors"
    synth.write_synthetic(model, server.base_dir / "models" / MODEL_FOLDER[model] / name, size, fmt, seed=1,
                          num_layers=num_layers)
    return name


def _node_ui(entry: dict, node_id: str, key: str) -> Any:
    return entry["outputs"][node_id][key][0]


def _sample_graph(unet_name: str, text_dim: int, latent: dict) -> dict:
    seed = next(_seed)
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": unet_name, "weight_dtype": "default"}},
        "2": {"class_type": "LowVRAMTest_RandomConditioning",
              "inputs": {"seed": seed, "length": 8, "dim": text_dim, "std": 1.0}},
        "3": {"class_type": "LowVRAMTest_RandomConditioning",
              "inputs": {"seed": seed + 1, "length": 8, "dim": text_dim, "std": 1.0}},
        "4": latent,
        "5": {"class_type": "KSampler", "inputs": {
            "model": ["1", 0], "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0],
            "seed": seed, "steps": 2, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        "6": {"class_type": "LowVRAMTest_LatentStats", "inputs": {"latent": ["5", 0]}},
        "7": {"class_type": "LowVRAMTest_ModelInfo", "inputs": {"model": ["1", 0]}},
    }


@pytest.mark.parametrize(("model", "fmt"), list(DIT_CASES))
def test_tiny_dit_detected_loaded_and_sampled(comfy_server: ComfyServer, model: str, fmt: str) -> None:
    # Stock UNETLoader builds Qwen-Image at its fixed widths (24 heads, joint dim 3584): a full-width block here.
    # The narrow "tiny" file needs the width-reading Staged Loader (tests/comfyui/test_comfyui_qwen_staged.py).
    unet = _place(comfy_server, model, fmt, *(("full", 1) if model == "qwen_image" else ()))
    if model == "qwen_image":
        latent = {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}
        text_dim = 3584
    else:  # 16-ch video latent; ComfyUI widens an empty latent to the 5B's 48 channels itself
        latent = {"class_type": "EmptyHunyuanLatentVideo",
                  "inputs": {"width": 64, "height": 64, "length": 5, "batch_size": 1}}
        text_dim = 4096
    log_before = len(comfy_server.log_text())
    entry = comfy_server.run(_sample_graph(unet, text_dim, latent), timeout=900)
    stats = _node_ui(entry, "6", "latent_stats")
    info = _node_ui(entry, "7", "model_info")
    assert stats["finite"], stats
    assert stats["std"] > 0
    log = comfy_server.log_text()[log_before:]
    assert info["model_class"] == DIT_CASES[(model, fmt)], info
    assert info["diffusion_model_class"] == ("QwenImageTransformer2DModel" if model == "qwen_image" else "WanModel")
    assert ("model_type FLUX" if model == "qwen_image" else "model_type FLOW") in log, log[-3000:]
    if model == "wan22_ti2v_5B":
        assert stats["shape"][1] == 48, stats
    if model in ("wan22_i2v_14B", "wan21_i2v_14B"):
        # I2V inputs: 16 noise + 20 concat channels, zero-filled by ComfyUI without an image
        assert stats["shape"][1] == 16
    assert any("MLPProj" in c for c in info["layer_classes"]) == (model == "wan21_i2v_14B"), info["layer_classes"]
    if fmt == "fp8_scaled":
        assert "Using mixed precision operations" in log, log[-3000:]
        assert any("MixedPrecisionOps" in c for c in info["layer_classes"]), info["layer_classes"]


def test_tiny_wan21_vae_decodes_and_encodes(comfy_server: ComfyServer) -> None:
    vae = _place(comfy_server, "wan21_vae", "bf16")
    seed = next(_seed)
    api = {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": vae}},
        "2": {"class_type": "EmptyHunyuanLatentVideo",
              "inputs": {"width": 32 + 8 * (seed % 2), "height": 32, "length": 5, "batch_size": 1}},
        "3": {"class_type": "VAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0]}},
        "4": {"class_type": "VAEEncode", "inputs": {"pixels": ["3", 0], "vae": ["1", 0]}},
        "5": {"class_type": "LowVRAMTest_LatentStats", "inputs": {"latent": ["4", 0]}},
    }
    stats = _node_ui(comfy_server.run(api), "5", "latent_stats")
    width = api["2"]["inputs"]["width"]
    assert stats["finite"] and stats["shape"] == [1, 16, 2, 4, width // 8], stats


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_tiny_wan22_autoencoder_loads_as_taehv_and_decodes(comfy_server: ComfyServer, fmt: str) -> None:
    """lighttaew2_2's layout (what `run --synthetic tiny` loads for the Wan 2.2 VAE): stock VAELoader detects a
    48-channel TAEHV, every key fits ComfyUI's module, and it decodes a Wan 2.2 latent to 16x its size."""
    from PIL import Image

    # Under a test name in models/vae (VAELoader takes a TAEHV from either folder; from vae_approx only under its
    # official name, which the runner uses: tests/comfyui/test_comfyui_workflows.py)
    vae = f"synthtest_tae_{fmt}_{uuid.uuid4().hex[:8]}.safetensors"
    synth.write_synthetic("wan22_tae", comfy_server.base_dir / "models" / "vae" / vae, "tiny", fmt, seed=1)
    width = 32 * (1 + next(_seed) % 2)
    api = {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": vae}},
        "2": {"class_type": "Wan22ImageToVideoLatent", "inputs": {
            "vae": ["1", 0], "width": width, "height": 32, "length": 5, "batch_size": 1}},
        "3": {"class_type": "VAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0]}},
        "4": {"class_type": "PreviewImage", "inputs": {"images": ["3", 0]}},
    }
    before = len(comfy_server.log_text())
    entry = comfy_server.run(api)
    log = comfy_server.log_text()[before:]
    assert "Missing VAE keys" not in log and "VAE not initalized" not in log, log[-3000:]
    images = entry["outputs"]["4"]["images"]
    assert len(images) == 5, images  # 2 latent frames -> 5 video frames
    with Image.open(comfy_server.base_dir / "temp" / images[0].get("subfolder", "") / images[0]["filename"]) as img:
        assert img.size == (width, 32)
    (comfy_server.base_dir / "models" / "vae" / vae).unlink()


@pytest.mark.slow
def test_wan22_vae_decodes(comfy_server: ComfyServer) -> None:
    """Wan 2.2 VAE: ComfyUI hard-codes dim 160 / dec_dim 256, so the file is full size (fp16, 1.4 GB)."""
    vae = _place(comfy_server, "wan22_vae", "fp16")
    api = {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": vae}},
        "2": {"class_type": "Wan22ImageToVideoLatent", "inputs": {
            "vae": ["1", 0], "width": 32 * (1 + next(_seed) % 2), "height": 32, "length": 1, "batch_size": 1}},
        "3": {"class_type": "VAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0]}},
        "4": {"class_type": "VAEEncode", "inputs": {"pixels": ["3", 0], "vae": ["1", 0]}},
        "5": {"class_type": "LowVRAMTest_LatentStats", "inputs": {"latent": ["4", 0]}},
    }
    stats = _node_ui(comfy_server.run(api, timeout=1800), "5", "latent_stats")
    assert stats["finite"] and stats["shape"][1] == 48, stats


@pytest.mark.slow
@pytest.mark.parametrize(("model", "clip_type"), [("umt5_xxl_enc", "wan"), ("qwen25_vl_7b", "qwen_image")])
def test_text_encoder_loads_and_encodes(comfy_server: ComfyServer, model: str, clip_type: str) -> None:
    """Full-size TEs (ComfyUI's configs are fixed) in fp8_scaled: CLIPLoader detects them, CLIPTextEncode runs."""
    te = _place(comfy_server, model, "fp8_scaled")
    api = {
        "1": {"class_type": "CLIPLoader", "inputs": {"clip_name": te, "type": clip_type, "device": "default"}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": f"a red cat {next(_seed)}"}},
        "3": {"class_type": "LowVRAMTest_ConditioningStats", "inputs": {"conditioning": ["2", 0]}},
    }
    stats = _node_ui(comfy_server.run(api, timeout=3600), "3", "conditioning_stats")
    assert stats["finite"], stats
    width = 4096 if model == "umt5_xxl_enc" else 3584
    assert stats["shape"][-1] == width
    if model == "umt5_xxl_enc":
        assert stats["shape"][1] == 512  # ComfyUI pads umT5 prompts to 512 tokens
