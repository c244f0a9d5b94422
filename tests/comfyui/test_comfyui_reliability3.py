"""Refusals that name their file and node, in a real ComfyUI server: a text encoder of another architecture given to
Wan Text Encode or the Qwen-Image loaders (embedding cache on and off), and a pickle VAE given to the Qwen-Image
Staged Loader, are refused before the first stage runs. Needs COMFYUI_PATH.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from comfy_server import ComfyServer
from comfyui_lowvram_dit.synthetic import checkpoints as synth
from comfyui_lowvram_dit.synthetic.specs import UMT5Config
from test_staged import write_small_text_encoder

pytestmark = pytest.mark.comfyui


@pytest.fixture(scope="module")
def files(comfy_server: ComfyServer) -> Iterator[dict[str, str]]:
    tag = uuid.uuid4().hex[:8]
    models = comfy_server.base_dir / "models"
    names = {"unet": f"rel3_qwen_{tag}.safetensors", "qwen_te": f"rel3_qwen_te_{tag}.safetensors",
             "umt5": f"rel3_umt5_{tag}.safetensors", "vae": f"rel3_vae_{tag}.safetensors",
             "pt_vae": f"rel3_vae_{tag}.pt"}
    paths = {"unet": models / "diffusion_models" / names["unet"], "qwen_te": models / "text_encoders" /
             names["qwen_te"], "umt5": models / "text_encoders" / names["umt5"], "vae": models / "vae" / names["vae"],
             "pt_vae": models / "vae" / names["pt_vae"]}
    synth.write_synthetic("qwen_image", paths["unet"], "tiny", "bf16", seed=3)
    write_small_text_encoder(paths["qwen_te"], "bf16", seed=0)
    synth.write_synthetic("umt5_xxl_enc", paths["umt5"], fmt="bf16", seed=1,
                          config=UMT5Config(num_layers=1, d_ff=64, num_heads=2, vocab_size=512))
    synth.write_synthetic("wan21_vae", paths["vae"], "tiny", "bf16", seed=3)
    torch.save({"decoder.middle.0.residual.0.gamma": torch.ones(4, 1, 1, 1)}, paths["pt_vae"])
    yield names
    for p in paths.values():
        p.unlink(missing_ok=True)  # the server outlives this module


def _refused(server: ComfyServer, graph: dict, *needles: str) -> str:
    before = len(server.log_text())
    with pytest.raises(AssertionError) as err:
        server.run(graph, timeout=300)
    text = str(err.value)
    for n in needles:
        assert n in text, f"{n!r} not in the error: {text[:1500]}"
    assert "KeyError" not in text
    assert "stage 1" not in server.log_text()[before:], "the text stage ran before the files were checked"
    return text


def _wan_text(te: str, cache: bool) -> dict:
    return {"1": {"class_type": "LowVRAM_WanTextEncode", "inputs": {
                "clip_name": te, "positive": f"a cat {uuid.uuid4().hex}", "negative": "", "cache_embeddings": cache}},
            "2": {"class_type": "LowVRAMTest_ConditioningStats", "inputs": {"conditioning": ["1", 0]}}}


def _qwen(files: dict[str, str], te: str, vae: str, node: str = "LowVRAM_QwenImageStagedLoader") -> dict:
    return {"1": {"class_type": node, "inputs": {
                "unet_name": files["unet"], "clip_name": te, "vae_name": vae, "positive": f"a boat {uuid.uuid4().hex}",
                "negative": " ", "quantization": "fp8 per-tensor", "vram_budget_gb": 0.0, "blocks_to_swap": -1,
                "cache_embeddings": True, "compute": "auto"}},
            "6": {"class_type": "LowVRAMTest_ConditioningStats", "inputs": {"conditioning": ["1", 1]}}}


@pytest.mark.parametrize("cache", [True, False])
def test_wan_text_encode_names_a_text_encoder_of_another_architecture(comfy_server: ComfyServer,
                                                                       files: dict[str, str], cache: bool) -> None:
    _refused(comfy_server, _wan_text(files["qwen_te"], cache), files["qwen_te"], "Wan Text Encode", "clip_name",
             "not a umT5 text encoder")


@pytest.mark.parametrize("node, name", [("LowVRAM_QwenImageStagedLoader", "Qwen-Image Staged Loader"),
                                        ("LowVRAM_QwenImageEditStagedLoader", "Qwen-Image-Edit Staged Loader")])
def test_qwen_loaders_name_a_text_encoder_of_another_architecture(comfy_server: ComfyServer, files: dict[str, str],
                                                                  node: str, name: str) -> None:
    _refused(comfy_server, _qwen(files, files["umt5"], files["vae"], node), files["umt5"], name, "clip_name",
             "not a Qwen2.5-VL text encoder")


def test_a_pickle_vae_is_refused_by_name_before_the_text_stage(comfy_server: ComfyServer,
                                                               files: dict[str, str]) -> None:
    _refused(comfy_server, _qwen(files, files["qwen_te"], files["pt_vae"]), files["pt_vae"],
             "Qwen-Image Staged Loader", "vae_name", "pickle")


def test_good_files_still_load(comfy_server: ComfyServer, files: dict[str, str]) -> None:
    entry = comfy_server.run(_qwen(files, files["qwen_te"], files["vae"]), timeout=600)
    assert entry["outputs"]["6"]
    assert Path(files["unet"]).suffix == ".safetensors"
