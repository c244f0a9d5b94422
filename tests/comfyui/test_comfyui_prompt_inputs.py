"""Inputs ComfyUI does not validate, sent through a real server's ``/prompt``: an option of the pack's nodes that writes
files (``STRICT_BOOLEANS``, host/prompt_inputs.py) takes only a JSON boolean. ComfyUI turns any BOOLEAN value into
``bool(value)``, so the string "false" would save a copy; the pack makes ComfyUI refuse the prompt, naming the node
and the option, before anything runs. Needs COMFYUI_PATH.
"""

from __future__ import annotations

import importlib
import json
import uuid

import pytest
from comfy_server import ComfyServer, comfyui_in_process_or_skip
from comfyui_lowvram_dit.synthetic import checkpoints as synth
from comfyui_lowvram_dit.synthetic.specs import UMT5Config

pytestmark = pytest.mark.comfyui
NOT_BOOLEANS = ["false", "False", "0", "", 0, 1, None, {"__value__": "false"}]


def _wan_loader(unet: str, save: object) -> dict:
    return {"1": {"class_type": "LowVRAM_WanLoader", "inputs": {
                "unet_name": unet, "quantization": "fp8 per-tensor", "block_size": "128", "compute": "auto",
                "save_quantized": save}},
            "2": {"class_type": "LowVRAMTest_ModelInfo", "inputs": {"model": ["1", 0]}}}


def _refused(server: ComfyServer, graph: dict, node: str, option: str) -> None:
    status, body = server.post_prompt(graph)
    text = json.dumps(body)
    assert status == 400, (status, text[:1500])
    errors = body.get("node_errors", {}).get(node, {}).get("errors", [])
    assert any(option in json.dumps(e) and "not a boolean" in json.dumps(e) and "true or false" in json.dumps(e)
               for e in errors), text[:1500]


@pytest.mark.parametrize("value", NOT_BOOLEANS, ids=repr)
def test_save_quantized_takes_only_a_real_boolean(comfy_server: ComfyServer, value: object) -> None:
    models = comfy_server.base_dir / "models" / "diffusion_models"
    src = synth.write_synthetic("wan21_t2v_1_3B", models / f"strict_{uuid.uuid4().hex[:8]}.safetensors",
                                size="tiny", fmt="bf16", seed=2, num_layers=1)
    try:
        _refused(comfy_server, _wan_loader(src.name, value), "1", "save_quantized")
        assert sorted(p.name for p in models.glob(f"{src.stem}*")) == [src.name]  # no copy saved
    finally:
        src.unlink(missing_ok=True)


def test_a_real_false_saves_nothing_and_true_is_still_accepted(comfy_server: ComfyServer) -> None:
    models = comfy_server.base_dir / "models" / "diffusion_models"
    src = synth.write_synthetic("wan21_t2v_1_3B", models / f"strict_{uuid.uuid4().hex[:8]}.safetensors",
                                size="tiny", fmt="bf16", seed=2, num_layers=1)
    try:
        comfy_server.run(_wan_loader(src.name, False), timeout=300)
        assert sorted(p.name for p in models.glob(f"{src.stem}*")) == [src.name]
        comfy_server.run(_wan_loader(src.name, True), timeout=300)
        assert len(list(models.glob(f"{src.stem}.lowvram-*.safetensors"))) == 1
    finally:
        for p in models.glob(f"{src.stem}*"):
            p.unlink(missing_ok=True)


def test_cache_embeddings_takes_only_a_real_boolean(comfy_server: ComfyServer) -> None:
    te = comfy_server.base_dir / "models" / "text_encoders" / f"strict_umt5_{uuid.uuid4().hex[:8]}.safetensors"
    synth.write_synthetic("umt5_xxl_enc", te, fmt="bf16", seed=1,
                          config=UMT5Config(num_layers=1, d_ff=64, num_heads=2, vocab_size=512))
    try:
        graph = {"1": {"class_type": "LowVRAM_WanTextEncode", "inputs": {
                    "clip_name": te.name, "positive": "a cat", "negative": "", "cache_embeddings": "false"}},
                 "2": {"class_type": "LowVRAMTest_ConditioningStats", "inputs": {"conditioning": ["1", 0]}}}
        _refused(comfy_server, graph, "1", "cache_embeddings")
    finally:
        te.unlink(missing_ok=True)


def test_every_strict_option_is_a_boolean_input_of_its_node(comfy_server: ComfyServer) -> None:
    comfyui_in_process_or_skip()
    from comfyui_lowvram_dit.nodes import NODE_MODULES

    info = comfy_server.object_info()
    checked = 0
    for name in NODE_MODULES:
        for cls in importlib.import_module(f"comfyui_lowvram_dit.nodes.{name}").NODES:
            for option in getattr(cls, "STRICT_BOOLEANS", ()):
                node = info[cls.define_schema().node_id]["input"]
                spec = {**node.get("required", {}), **node.get("optional", {})}[option]
                assert spec[0] == "BOOLEAN", (cls.__name__, option, spec)
                checked += 1
    assert checked >= 4  # Wan Loader, Wan Text Encode, both Qwen-Image staged loaders
