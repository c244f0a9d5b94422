"""The shipped workflows (workflows/*.json) validated offline, without ComfyUI.

Schemas: tests/object_info-0.8.0.schema.json (stock ComfyUI v0.8.0 /object_info, copied from the team's shared
capture), tests/object_info-0.33.0-multigpu.schema.json (core's Select Model Device as 0.33.0 lists it on a
machine with two GPUs: its device options are the machine's GPUs) + tests/pack_object_info.json (this pack's
nodes as the live /object_info lists them; the comfyui-marked tests/comfyui/test_comfyui_workflows.py checks it
still matches). Every node must exist, its widget values must fit its
inputs (count, combo options, numeric ranges), every link must join matching types, every required input must be
connected, model files must be official names the runner knows (in the right folder), and comfy-cli's
convert_ui_to_api must turn each workflow into a complete API prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from comfyui_lowvram_dit.cli import server, ui_graph, workflow, workflow_models
from comfyui_lowvram_dit.synthetic import tiny
from comfyui_lowvram_dit.synthetic.lora import KNOWN_LORA_FILES

TESTS = Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((TESTS.parent / "workflows").glob("*.json"))
EXPECTED = {"wan22_t2v_a14b", "wan22_i2v_a14b", "wan22_ti2v_5b", "qwen_image_t2i", "wan22_t2v_a14b_4step",
            "qwen_image_t2i_4step", "wan22_t2v_a14b_2gpu"}
# The 4-step LoRAs under the names ComfyUI's official templates use (Wan 2.2 T2V, Qwen-Image controlnet templates).
OFFICIAL_LORAS = {"wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors",
                  "wan2.2_t2v_lightx2v_4steps_lora_v1.1_low_noise.safetensors",
                  "Qwen-Image-Lightning-4steps-V1.0.safetensors"}
NOTE_TYPES = {"Note", "MarkdownNote"}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
FILE_INPUTS = {"unet_name": "diffusion_models", "clip_name": "text_encoders", "vae_name": "vae", "lora_name": "loras"}
PACK_CNR = "comfyui-lowvram-dit"


def _load(name: str) -> dict:
    return json.loads((TESTS / name).read_text())


OBJECT_INFO = {**_load("object_info-0.8.0.schema.json"), **_load("object_info-0.33.0-multigpu.schema.json"),
               **_load("pack_object_info.json")}


def _workflow(path: Path) -> dict:
    return json.loads(path.read_text())


def _inputs(info: dict) -> list[tuple[str, list]]:
    """(name, spec) in the order ComfyUI lists them (required, then optional)."""
    specs = {**info["input"].get("required", {}), **info["input"].get("optional", {})}
    order = info.get("input_order", {})
    return [(n, specs[n]) for n in order.get("required", []) + order.get("optional", [])]


def _is_widget(spec: list) -> bool:
    return isinstance(spec[0], list) or spec[0] in WIDGET_TYPES


def _options(spec: list) -> list | None:
    if isinstance(spec[0], list):
        return spec[0]
    if spec[0] == "COMBO":
        return spec[1].get("options") if len(spec) > 1 else None
    return None


def test_all_expected_workflows_ship() -> None:
    assert {p.stem for p in WORKFLOWS} == EXPECTED


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_nodes_widgets_and_links_match_the_schemas(path: Path) -> None:
    wf = _workflow(path)
    nodes = {n["id"]: n for n in wf["nodes"]}
    assert wf["last_node_id"] >= max(nodes) and wf["last_link_id"] >= max(link[0] for link in wf["links"])
    assert any(n["type"] in NOTE_TYPES for n in nodes.values()), "every workflow explains its settings in a Note"
    for node in nodes.values():
        if node["type"] in NOTE_TYPES:
            assert isinstance(node["widgets_values"][0], str) and node["widgets_values"][0].strip()
            continue
        assert node["type"] in OBJECT_INFO, f"{path.name}: {node['type']} is not a v0.8.0 or pack node"
        info = OBJECT_INFO[node["type"]]
        values = list(node.get("widgets_values", []))
        linked = {i["name"] for i in node.get("inputs", []) if i.get("link") is not None}
        for name, spec in _inputs(info):
            required = name in info["input"].get("required", {})
            if not _is_widget(spec):
                assert name in linked or not required, f"{path.name}: {node['type']}.{name} is not connected"
                continue
            assert values, f"{path.name}: {node['type']} has too few widget values (at {name})"
            value = values.pop(0)
            opts = _options(spec)
            if name == "lora_name" and value not in workflow_models.KNOWN_MODEL_FILES:
                assert value in OFFICIAL_LORAS, f"{path.name}: {value} is not an official LoRA file name"
            elif name in FILE_INPUTS:  # file lists are dynamic: the runner must know the official name
                assert value in workflow_models.KNOWN_MODEL_FILES, f"{path.name}: {value} is not an official file name"
                assert workflow_models.KNOWN_MODEL_FILES[value][0] == FILE_INPUTS[name], (value, name)
            elif node["type"] == "LoadImage" and name == "image":
                assert isinstance(value, str) and value.endswith(".png")
                assert values.pop(0) == "image"  # the upload widget
            elif opts is not None:
                assert value in opts, f"{path.name}: {node['type']}.{name}={value!r} not in {opts}"
            else:
                kind = spec[0]
                py = {"INT": int, "FLOAT": (int, float), "STRING": str, "BOOLEAN": bool}[kind]
                assert isinstance(value, py) and (kind != "INT" or not isinstance(value, bool)), (node["type"], name)
                extra = spec[1] if len(spec) > 1 else {}
                if kind in ("INT", "FLOAT"):
                    assert extra.get("min", value) <= value <= extra.get("max", value), (node["type"], name, value)
                if extra.get("control_after_generate"):
                    assert values.pop(0) in ("fixed", "increment", "decrement", "randomize")
        assert not values, f"{path.name}: {node['type']} has extra widget values {values}"
        for slot, out in enumerate(node.get("outputs", [])):
            assert out["type"] == info["output"][slot], (node["type"], slot)
    for link_id, src, src_slot, dst, dst_slot, typ in wf["links"]:
        out = nodes[src]["outputs"][src_slot]
        inp = nodes[dst]["inputs"][dst_slot]
        assert link_id in out["links"] and inp["link"] == link_id, f"{path.name}: link {link_id} is not wired both ways"
        assert out["type"] == inp["type"] == typ, f"{path.name}: link {link_id} joins {out['type']} to {inp['type']}"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_pack_nodes_carry_the_registry_id(path: Path) -> None:
    pack_nodes = [n for n in _workflow(path)["nodes"] if n["type"].startswith("LowVRAM_")]
    assert pack_nodes
    for node in pack_nodes:
        props = node["properties"]
        assert props["cnr_id"] == PACK_CNR and props["ver"] and props["Node name for S&R"] == node["type"], props


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_converts_to_a_complete_api_prompt(path: Path) -> None:
    convert = pytest.importorskip("comfy_cli.workflow_to_api").convert_ui_to_api
    wf = _workflow(path)
    api = convert(wf, OBJECT_INFO)
    real = {str(n["id"]) for n in wf["nodes"] if n["type"] not in NOTE_TYPES}
    assert set(api) == real
    for nid, node in api.items():
        info = OBJECT_INFO[node["class_type"]]
        missing = set(info["input"].get("required", {})) - set(node["inputs"])
        assert not missing, f"{path.name}: node {nid} {node['class_type']} lacks {missing}"
        for value in node["inputs"].values():
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                assert value[0] in api, f"{path.name}: node {nid} links to a missing node {value[0]}"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_synthetic_tiny_plan(path: Path) -> None:
    """What `run --synthetic tiny` does with each workflow: known files, 2-layer text encoders, tiny sizes."""
    wf = _workflow(path)
    files = workflow_models.referenced_model_files(wf)
    loras = files & OFFICIAL_LORAS
    assert loras <= set(KNOWN_LORA_FILES)  # the runner writes a synthetic stand-in for every LoRA a workflow wires
    files -= loras
    assert files and all(f in workflow_models.KNOWN_MODEL_FILES for f in files)
    tes = {f for f in files if workflow_models.KNOWN_MODEL_FILES[f][0] == "text_encoders"}
    assert tes and workflow_models.staged_text_encoder_files(wf) >= tes  # every encoder goes through a staged node
    for f in tes:
        assert tiny.tiny_text_encoder_config(workflow_models.KNOWN_MODEL_FILES[f][1]).num_layers == tiny.TINY_TE_LAYERS
    convert = pytest.importorskip("comfy_cli.workflow_to_api").convert_ui_to_api
    api = convert(wf, OBJECT_INFO)
    sets = workflow.tiny_overrides(api)
    api = workflow.apply_overrides(api, sets)
    for node in api.values():
        inp = node["inputs"]
        if node["class_type"] in workflow.TINY_OVERRIDES:
            assert inp["width"] == inp["height"] == 64
        if node["class_type"] in ("KSampler", "KSamplerAdvanced"):
            assert inp["steps"] == workflow.TINY_STEPS
    adv = sorted((n["inputs"]["start_at_step"], n["inputs"]["end_at_step"]) for n in api.values()
                 if n["class_type"] == "KSamplerAdvanced")
    if adv:  # the two-expert split survives the step change
        assert adv == [(0, 1), (1, 10000)]


def test_tiny_overrides_scale_a_step_split() -> None:
    api = {"1": {"class_type": "KSamplerAdvanced", "inputs": {"steps": 30, "start_at_step": 0, "end_at_step": 15}},
           "2": {"class_type": "KSamplerAdvanced", "inputs": {"steps": 30, "start_at_step": 15, "end_at_step": 10000}},
           "3": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 832, "height": 480, "length": 81}}}
    out = workflow.apply_overrides(api, workflow.tiny_overrides(api))
    assert out["1"]["inputs"] == {"steps": 2, "start_at_step": 0, "end_at_step": 1}
    assert out["2"]["inputs"] == {"steps": 2, "start_at_step": 1, "end_at_step": 10000}
    assert out["3"]["inputs"] == {"width": 64, "height": 64, "length": 5}


def test_staged_text_encoder_files_excludes_stock_users() -> None:
    wf = {"nodes": [{"type": "LowVRAM_WanTextEncode", "widgets_values": ["umt5_xxl_fp16.safetensors", "a", "b", True]},
                    {"type": "CLIPLoader", "widgets_values": ["umt5_xxl_fp16.safetensors", "wan", "default"]},
                    {"type": "LowVRAM_WanTextEncode",
                     "widgets_values": ["umt5_xxl_fp8_e4m3fn_scaled.safetensors", "a", "b", True]}]}
    assert workflow_models.staged_text_encoder_files(wf) & set(workflow_models.KNOWN_MODEL_FILES) == {
        "umt5_xxl_fp8_e4m3fn_scaled.safetensors"}


def test_input_images_are_drawn_for_synthetic_runs_and_required_otherwise(tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    wf = _workflow(TESTS.parent / "workflows" / "wan22_i2v_a14b.json")
    with pytest.raises(server.RunError, match="LoadImage wants"):
        workflow.ensure_input_images(wf, tmp_path / "in", False, [tmp_path])
    placed = workflow.ensure_input_images(wf, tmp_path / "in", True, [tmp_path])
    assert len(placed) == 1 and placed[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


SAMPLERS = {"KSampler", "KSamplerAdvanced"}
MODEL_LOADERS = {"LowVRAM_WanLoader", "LowVRAM_QwenImageLoader", "LowVRAM_QwenImageStagedLoader",
                 "LowVRAM_QwenImageEditStagedLoader"}


def _model_path(graph: ui_graph.Graph, node: dict) -> list[str]:
    """The node types on the ``model`` input chain from ``node`` up to (and with) the node that has no such input."""
    path = []
    while (link := graph.input_link(node, "model")) is not None:
        node = graph.node(link["origin_id"])
        path.append(node["type"])
    return path


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_every_sampler_runs_the_pack_s_attention(path: Path) -> None:
    """Each sampler's model comes from a pack loader through Attention (LowVRAM): without it a render runs
    ComfyUI's own attention (SDPA, flash first), which the shipped Qwen-Image workflows once did."""
    graph = ui_graph.Workflow(_workflow(path), path.name).root
    samplers = [n for n in graph.nodes if n["type"] in SAMPLERS]
    assert samplers, path.name
    for node in samplers:
        chain = _model_path(graph, node)
        assert chain and chain[-1] in MODEL_LOADERS, (path.name, node["id"], chain)
        assert "LowVRAM_Attention" in chain, (path.name, node["id"], chain)
