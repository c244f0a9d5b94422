"""In a real ComfyUI v0.8.0 server: path-escaping model names are refused and the NaN Guard names a poisoned block.

Both check that the server keeps serving afterwards (a normal prompt still succeeds).
"""

from __future__ import annotations

import json
import uuid

import pytest
from comfy_server import ComfyServer
from comfyui_lowvram_dit.synthetic import checkpoints as synth
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.comfyui
POISONED_BLOCK = 2
ESCAPES = ["../../etc/passwd", "/etc/passwd", "..\\..\\windows\\win.ini", "sub/../../../etc/hosts"]


def _write_wan(server: ComfyServer, poison_block: int | None) -> str:
    """A tiny Wan 2.1 1.3B-layout file (4 blocks); optionally one FFN weight of one block set to inf."""
    name = f"reliab_{uuid.uuid4().hex[:8]}.safetensors"
    path = server.base_dir / "models" / "diffusion_models" / name
    synth.write_synthetic("wan21_t2v_1_3B", path, size="tiny", fmt="bf16", seed=5, num_layers=4)
    if poison_block is not None:
        sd = load_file(str(path))
        w = sd[f"blocks.{poison_block}.ffn.2.weight"].clone()
        w[0, :] = float("inf")
        sd[f"blocks.{poison_block}.ffn.2.weight"] = w
        save_file(sd, str(path))
    return name


def _sampler_graph(model_ref: list, extra: dict, steps: int = 2) -> dict:
    g = {
        "3": {"class_type": "LowVRAMTest_RandomConditioning", "inputs": {"seed": 1, "length": 8, "dim": 4096,
                                                                         "std": 1.0}},
        "5": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 32, "height": 32, "length": 1,
                                                                   "batch_size": 1}},
        "6": {"class_type": "KSampler", "inputs": {"model": model_ref, "seed": 0, "steps": steps, "cfg": 1.0,
                                                    "sampler_name": "euler", "scheduler": "simple",
                                                    "positive": ["3", 0], "negative": ["3", 0],
                                                    "latent_image": ["5", 0], "denoise": 1.0}},
        "7": {"class_type": "LowVRAMTest_LatentStats", "inputs": {"latent": ["6", 0]}},
    }
    g.update(extra)
    return g


def _guarded(unet: str, action: str) -> dict:
    return _sampler_graph(["2", 0], {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": "default"}},
        "2": {"class_type": "LowVRAM_NanGuard", "inputs": {"model": ["1", 0], "action": action}},
    })


def _refused(server: ComfyServer, graph: dict, option: str) -> None:
    status, body = server.post_prompt(graph)
    text = json.dumps(body)
    assert status == 400, f"expected a validation refusal (400), got {status}: {text[:500]}"
    assert option in text, f"the refusal does not name {option!r}: {text[:800]}"


def test_path_escaping_names_are_refused(comfy_server: ComfyServer) -> None:
    good = _write_wan(comfy_server, None)
    for bad in ESCAPES:
        _refused(comfy_server, _sampler_graph(["1", 0], {"1": {"class_type": "LowVRAM_WanLoader", "inputs": {
            "unet_name": bad, "quantization": "fp8 per-tensor", "block_size": "128", "compute": "auto",
            "save_quantized": False}}}), "unet_name")
        _refused(comfy_server, _sampler_graph(["1", 0], {
            "1": {"class_type": "UNETLoader", "inputs": {"unet_name": good, "weight_dtype": "default"}},
            "3": {"class_type": "LowVRAM_WanTextEncode", "inputs": {
                "clip_name": bad, "positive": "a cat", "negative": "", "cache_embeddings": True}}}), "clip_name")
        for option in ("unet_name", "clip_name", "vae_name"):
            names = {"unet_name": good, "clip_name": "none.safetensors", "vae_name": "none.safetensors", option: bad}
            graph = _sampler_graph(["1", 0], {"1": {"class_type": "LowVRAM_QwenImageStagedLoader", "inputs": {
                **names, "positive": "a cat", "negative": " ", "quantization": "fp8 per-tensor", "compute": "auto",
                "vram_budget_gb": 0.0, "blocks_to_swap": -1, "cache_embeddings": True}}})
            graph["6"]["inputs"]["positive"] = ["1", 1]
            graph["6"]["inputs"]["negative"] = ["1", 2]
            _refused(comfy_server, graph, option)
    # still serving: a normal prompt with the same loader succeeds
    entry = comfy_server.run(_sampler_graph(["1", 0], {"1": {"class_type": "LowVRAM_WanLoader", "inputs": {
        "unet_name": good, "quantization": "fp8 per-tensor", "block_size": "128", "compute": "auto",
        "save_quantized": False}}}), timeout=300)
    assert entry["outputs"]["7"]["latent_stats"][0]


def test_nan_guard_names_the_poisoned_block(comfy_server: ComfyServer) -> None:
    clean = _write_wan(comfy_server, None)
    bad = _write_wan(comfy_server, POISONED_BLOCK)
    where = f"transformer block {POISONED_BLOCK} (blocks.{POISONED_BLOCK})"

    entry = comfy_server.run(_guarded(clean, "raise"), timeout=300)  # clean model: the guard stays silent
    assert entry["outputs"]["7"]["latent_stats"][0]

    before = len(comfy_server.log_text())
    comfy_server.run(_guarded(bad, "warn"), timeout=300)  # warn: sampling finishes, the log names the block
    log = comfy_server.log_text()[before:]
    assert "NaN Guard" in log and where in log, log[-3000:]
    assert "check the LoRA / model file" in log
    assert log.count(where) == 1  # once per culprit, not once per step

    with pytest.raises(AssertionError) as err:  # raise: the prompt fails with the same message
        comfy_server.run(_guarded(bad, "raise"), timeout=300)
    assert "NonFiniteError" in str(err.value) and where in str(err.value), str(err.value)[:2000]

    entry = comfy_server.run(_guarded(clean, "warn"), timeout=300)  # the server keeps serving
    assert entry["outputs"]["7"]["latent_stats"][0]
