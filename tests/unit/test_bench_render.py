"""The render scenario on CPU, without ComfyUI (benchmarks/server_render*.py): the pack graphs are the shipped
workflows node for node, the native graphs are the official templates' nodes and validate against the schemas,
setups, formats and budgets follow the workflows' own notes, the render split from planted websocket events, the
rows, flags and model files, and the report."""

from __future__ import annotations

import argparse
import sys
import json
import re
from pathlib import Path

import numpy as np
import pytest
from comfyui_lowvram_dit.benchmarks import server_render as sr
from comfyui_lowvram_dit.benchmarks import server_render_models as sm
from comfyui_lowvram_dit.benchmarks import server_render_graphs as rg
from comfyui_lowvram_dit.benchmarks import server_render_report as rr
from comfyui_lowvram_dit.benchmarks.server_render_split import PARTS, split
from comfyui_lowvram_dit.cli.ui_graph import FRONTEND_ONLY
from comfyui_lowvram_dit.cli.workflow_models import KNOWN_MODEL_FILES
from comfyui_lowvram_dit.synthetic.lora import KNOWN_LORA_FILES
from test_bench_server import OBJECT_INFO, _problems

SHIPPED = sorted({w.shipped for w in rg.WORKFLOWS.values() if w.shipped})
# 0.33.0's Create Video and Save Video (its format and codec are dynamic combos) over the 0.8.0 schemas
OBJECT_INFO_0_33 = {**OBJECT_INFO, **json.loads((Path(__file__).resolve().parents[1]
                                                / "object_info-0.33.0-video.schema.json").read_text())}
CARDS = (8.0, 12.0, 16.0, 24.0, None)


def _graph(key: str, setup: str = "pack", card: float | None = 12.0, fmt: str | None = None) -> dict:
    wf = rg.WORKFLOWS[key]
    return rg.render_graph(wf, setup, card, fmt or wf.default_format, OBJECT_INFO, "row")


def _types(graph: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for n in graph.values():
        out.setdefault(n["class_type"], []).append(n["inputs"])
    return out


def _widget_values(node: dict, api: dict) -> list:
    """The API node's widget inputs in the order the UI stores them (control values put back after seeds)."""
    values = []
    info = OBJECT_INFO[node["type"]]
    widgets = [(name, rg._extra(spec).get("control_after_generate"))  # the order of a UI node's widgets_values
               for name, spec in rg._specs(info["input"], info.get("input_order") or {}) if rg._is_widget(spec)]
    for name, control in widgets:
        values.append(api["inputs"][name])
        if control:
            values.append(node["widgets_values"][len(values)])
    return values


# ----------------------------------------------------------------------------------------------------------
# pack graphs: the shipped workflows node for node


@pytest.mark.parametrize("name", SHIPPED)
def test_pack_graph_is_the_shipped_workflow_node_for_node(name: str) -> None:
    """Every node the shipped workflow sends, with its type, widget values and links, is in the render graph at 12 GB
    (the card the workflows are set for) and nothing else but the final latent's SaveLatent: a change to a shipped
    workflow is a change to its render rows."""
    ui = rg.shipped_workflow(name)
    key = next(k for k, w in rg.WORKFLOWS.items() if w.shipped == name and not w.four_step_loras)
    graph = _graph(key)
    sent = [n for n in ui["nodes"] if n["type"] not in FRONTEND_ONLY]
    assert {str(n["id"]) for n in sent} | {max(graph, key=int)} == set(graph)
    assert graph[max(graph, key=int)]["class_type"] == "SaveLatent"
    links = {lk[0]: lk for lk in ui["links"]}
    for n in sent:
        api = graph[str(n["id"])]
        assert api["class_type"] == n["type"]
        assert _widget_values(n, api) == n["widgets_values"][:len(_widget_values(n, api))], n["id"]
        for inp in n.get("inputs") or []:
            if inp.get("link") is not None:
                assert api["inputs"][inp["name"]] == [str(links[inp["link"]][1]), links[inp["link"]][2]]


@pytest.mark.parametrize("schemas", ["0.8.0", "0.33.0"])
@pytest.mark.parametrize("name", SHIPPED)
def test_conversion_agrees_with_comfy_cli(name: str, schemas: str) -> None:
    """The runner's UI -> API conversion (the GPU machine has no comfy-cli) gives what comfy-cli gives."""
    cli = pytest.importorskip("comfy_cli.workflow_to_api", reason="comfy-cli is not installed (the [test] extra)")
    info = OBJECT_INFO_0_33 if schemas == "0.33.0" else OBJECT_INFO
    ui = rg.shipped_workflow(name)
    strip = lambda g: {k: (v["class_type"], v["inputs"]) for k, v in g.items()}  # noqa: E731
    assert strip(rg.ui_to_api(ui, info)) == strip(cli.convert_ui_to_api(json.loads(json.dumps(ui)), info))


def test_conversion_reads_dynamic_combos_and_fills_defaults() -> None:
    """0.33.0's Save Video: the chosen format's codec, and that codec's encoding widgets, follow it as dotted
    inputs; Create Video's bit depth, which 0.8.0 lacks and so the workflows do not store, gets its default."""
    ui = rg.shipped_workflow("wan22_t2v_a14b_4step")
    save = next(n for n in ui["nodes"] if n["type"] == "SaveVideo")
    api = rg.ui_to_api(ui, OBJECT_INFO_0_33)
    assert api[str(save["id"])]["inputs"] == {"filename_prefix": "lowvram_dit/wan22_t2v_4step", "format": "auto",
                                              "format.codec": "auto", "video": ["19", 0]}
    assert api["19"]["inputs"] == {"fps": 16.0, "bit_depth": 8, "images": ["18", 0]}
    assert _problems(api, OBJECT_INFO_0_33) == []
    api[str(save["id"])]["inputs"]["format.crf"] = 18.0  # crf belongs to a codec's re-encode option
    assert _problems(api, OBJECT_INFO_0_33) == [f"{save['id']}: unknown input format.crf"]
    save["widgets_values"] = ["clip", "mp4", "h264", "re-encode", 18.0, "sRGB"]
    inputs = rg.ui_to_api(ui, OBJECT_INFO_0_33)[str(save["id"])]["inputs"]
    assert {k: v for k, v in inputs.items() if k.startswith("format")} == {
        "format": "mp4", "format.codec": "h264", "format.codec.encoding": "re-encode",
        "format.codec.encoding.crf": 18.0, "format.codec.encoding.color_space": "sRGB"}
    assert rg.ui_to_api(ui, OBJECT_INFO)[str(save["id"])]["inputs"]["codec"] == "h264"  # 0.8.0: plain combos


def test_conversion_refuses_what_it_cannot_convert() -> None:
    ui = rg.shipped_workflow("wan22_t2v_a14b_4step")
    ui["nodes"][2]["mode"] = 4
    with pytest.raises(rg.GraphError, match="bypassed"):
        rg.ui_to_api(ui, OBJECT_INFO)
    with pytest.raises(rg.GraphError, match="subgraphs"):
        rg.ui_to_api({**ui, "definitions": {"subgraphs": [{}]}}, OBJECT_INFO)
    with pytest.raises(rg.GraphError, match="LowVRAM_WanLoader"):
        rg.ui_to_api(rg.shipped_workflow("wan22_t2v_a14b_4step"), {})


def _note_budgets(name: str) -> dict[float | None, float]:
    """The Block Swap budget per card the workflow's notes give (a table or 'N GB card: B' lines)."""
    text = "\n".join(str(n["widgets_values"][0]) for n in rg.shipped_workflow(name)["nodes"]
                     if n["type"] == "MarkdownNote")
    found = {float(c): float(b) for c, b in re.findall(r"\|\s*(\d+) GB\s*\|\s*([\d.]+)", text)}
    found |= {float(c): float(b) for c, b in re.findall(r"(\d+) GB(?: card)?: ([\d.]+)(?![\dx])", text)}
    if re.search(r"\|\s*32 GB\+\s*\|\s*0\b", text) or "24 GB: 0" in text:
        found[None] = 0.0
    return found


@pytest.mark.parametrize("key", [k for k, w in rg.WORKFLOWS.items() if w.shipped])
def test_card_budgets_are_the_workflow_notes(key: str) -> None:
    wf = rg.WORKFLOWS[key]
    base = {"qwen_image_t2i_4step": "qwen_image_t2i"}.get(wf.shipped, wf.shipped)  # its note points there
    assert _note_budgets(base) == wf.budgets
    shipped = {n["inputs"]["vram_budget_gb"] for n in _graph(key).values() if "vram_budget_gb" in n["inputs"]}
    assert shipped == {wf.budgets[12.0]} == {10.0}  # the workflows ship set for a 12 GB card
    for card in CARDS:
        g = _graph(key, card=card)
        assert {n["inputs"]["vram_budget_gb"] for n in g.values() if "vram_budget_gb" in n["inputs"]} \
            == {wf.budgets[card]}


# ----------------------------------------------------------------------------------------------------------
# native graphs


@pytest.mark.parametrize("key", list(rg.WORKFLOWS))
@pytest.mark.parametrize("setup", list(rg.SETUPS))
def test_every_row_graph_validates(key: str, setup: str) -> None:
    wf = rg.WORKFLOWS[key]
    for fmt in wf.formats:
        if rg.setup_applies(wf, setup, fmt) is None:
            for card in (12.0, None):
                problems = _problems(_graph(key, setup, card, fmt))
                assert [p for p in problems if not re.match(r"\d+\.image: ", p)] == [], (setup, fmt, card)


@pytest.mark.parametrize("key, template", [("wan_t2v_4step", "video_wan2_2_14B_t2v"),
                                           ("wan_i2v_4step", "video_wan2_2_14B_i2v"),
                                           ("wan_ti2v_5b", "video_wan2_2_5B_ti2v"),
                                           ("qwen_t2i_4step", "image_qwen_image"),
                                           ("qwen_edit", "image_qwen_image_edit_2509")])
def test_native_graph_is_made_of_the_official_templates_nodes(key: str, template: str) -> None:
    """Native's best: the official template's nodes (plus the latent save, and SaveImage for Edit: 0.8.0 lacks its
    template's saver), no pack node, UNETLoader fp8_e4m3fn_fast, the server's ck attention flag; the same sampling
    as the pack graph."""
    from comfyui_lowvram_dit.cli.ui_graph import all_nodes
    from template_files import load_template

    official = {n["type"] for n in all_nodes(load_template(template), instances=False)}
    native, pack = _graph(key, "native_best"), _graph(key, "pack")
    kinds = set(_types(native))
    older_saver = {"SaveImage"} if key == "qwen_edit" else set()  # the 2509 template's SaveImageAdvanced is 0.33+
    assert kinds - official == {"SaveLatent", *older_saver}, kinds - official
    assert not any(k.startswith("LowVRAM_") for k in kinds)
    assert {i["weight_dtype"] for i in _types(native)["UNETLoader"]} == {"fp8_e4m3fn_fast"}
    assert sr.make_row(key, "native_best", 12.0).server_args(140.0) == ["--use-ck-attention", "--reserve-vram=128.00"]
    for kind in ("KSampler", "KSamplerAdvanced", "ModelSamplingSD3", "ModelSamplingAuraFlow", "LoraLoaderModelOnly"):
        def widgets(g: dict) -> list[dict]:
            return [{k: v for k, v in i.items() if not isinstance(v, list)} for i in _types(g).get(kind, [])]

        assert widgets(native) == widgets(pack), kind


def test_native_text_and_decode_replace_the_pack_nodes() -> None:
    wan = _types(_graph("wan_t2v_4step", "native_best"))
    pack = _types(_graph("wan_t2v_4step"))["LowVRAM_WanTextEncode"][0]
    assert wan["CLIPLoader"] == [{"clip_name": pack["clip_name"], "type": "wan", "device": "default"}]
    assert sorted(i["text"] for i in wan["CLIPTextEncode"]) == sorted([pack["positive"], pack["negative"]])
    g = _graph("qwen_t2i_4step", "native_best")
    sampler = g[rg.of_type(g, "KSampler")[0]]["inputs"]
    assert g[sampler["positive"][0]]["inputs"]["text"].startswith("A cozy bookshop")
    assert g[sampler["negative"][0]]["class_type"] == "CLIPTextEncode"
    decode = _types(g)["VAEDecode"][0]
    assert g[decode["vae"][0]]["class_type"] == "VAELoader" and decode["samples"] == [rg.of_type(g, "KSampler")[0], 0]
    with pytest.raises(rg.GraphError, match="LowVRAM_Mystery"):
        rg.to_native({"1": {"class_type": "LowVRAM_Mystery", "inputs": {}}}, "default")


def test_every_pack_node_of_a_shipped_workflow_has_a_native_equivalent() -> None:
    for name in SHIPPED + ["wan22_t2v_a14b_2gpu"]:
        kinds = rg.ui_node_types(rg.shipped_workflow(name))
        unknown = {k for k in kinds if k.startswith("LowVRAM_")} - rg.MODEL_PASS_THROUGH - {
            "LowVRAM_WanLoader", "LowVRAM_WanTextEncode", "LowVRAM_QwenImageLoader", "LowVRAM_QwenImageTextEncode",
            "LowVRAM_QwenImageDecode"}
        assert not unknown, (name, unknown)


# ----------------------------------------------------------------------------------------------------------
# setups, formats, 4-step variant


def _model_chain(graph: dict, sampler: str) -> list[str]:
    """Node types from a sampler's model input back to its loader."""
    out, src = [], graph[sampler]["inputs"]["model"]
    while src:
        n = graph[src[0]]
        out.append(n["class_type"])
        src = n["inputs"].get("model")
    return out


def test_a_native_setup_cannot_set_a_pack_option() -> None:
    """render_graph applies the pack-only options to any graph: a native row that set one would change its graph."""
    with pytest.raises(ValueError, match="native setup 'x' sets a pack node's option"):
        rg.Setup(True, "x", compile={})
    assert rg.Setup(True, "x", "fp8_e4m3fn_fast", True, easycache=True).native


def test_pack_setups() -> None:
    g = _graph("wan_t2v_4step", "pack_no_blockswap")
    assert "LowVRAM_BlockSwap" not in _types(g)
    assert _model_chain(g, "15") == ["ModelSamplingSD3", "LowVRAM_Attention", "LoraLoaderModelOnly",
                                     "LowVRAM_WanLoader"]
    g = _graph("wan_t2v_4step", "pack_stream")
    assert [i["dynamic_vram"] for i in _types(g)["LowVRAM_BlockSwap"]] == ["stream", "stream"]
    assert [i["dynamic_vram"] for i in _types(_graph("wan_t2v_4step", "pack"))["LowVRAM_BlockSwap"]] == ["auto"] * 2
    g = _graph("wan_t2v_4step", "pack_int8")
    assert {i["backend"] for i in _types(g)["LowVRAM_Attention"]} == {rg.INT8_BACKEND}
    assert {i["backend"] for i in _types(_graph("wan_t2v_4step", "pack_cudnn"))["LowVRAM_Attention"]} == \
        {"SDPA cuDNN"}
    from comfyui_lowvram_dit.host.attention import BACKEND_CHOICES  # a setup's backend must be a node choice

    assert {s.attention for s in rg.SETUPS.values() if s.attention} <= BACKEND_CHOICES.keys()
    g = _graph("wan_t2v_4step", "pack_compile")
    assert _model_chain(g, "16")[:3] == ["ModelSamplingSD3", "LowVRAM_TorchCompile", "LowVRAM_Attention"]
    compile_inputs = {k: v for k, v in _types(g)["LowVRAM_TorchCompile"][0].items() if k != "model"}
    assert compile_inputs == {"mode": "default", "backend": "inductor", "dynamic": "auto", "fullgraph": False,
                              "cache_size_limit": 64, "fallback": True, "scope": "blocks", "when": "it pays"}
    assert [i["batch_cfg"] for i in _types(_graph("qwen_t2i", "pack_no_batch_cfg"))["LowVRAM_QwenImageTextEncode"]] \
        == [False]
    assert [i["batch_cfg"] for i in _types(_graph("qwen_t2i", "pack"))["LowVRAM_QwenImageTextEncode"]] == [True]
    graphs = _types(_graph("qwen_t2i", "pack_compile_graphs"))["LowVRAM_TorchCompile"]
    assert [{k: i[k] for k in ("mode", "backend", "scope")} for i in graphs] == [
        {"mode": "reduce-overhead", "backend": "inductor", "scope": "blocks"}]
    q = _graph("qwen_t2i_4step", "pack_int8")
    assert _model_chain(q, "6")[:3] == ["ModelSamplingAuraFlow", "LoraLoaderModelOnly", "LowVRAM_Attention"]
    assert rg.setup_applies(rg.WORKFLOWS["qwen_t2i_4step"], "pack_no_blockswap", "fp8_scaled")
    assert rg.setup_applies(rg.WORKFLOWS["wan_t2v"], "native_best", "pack_fp8")


def test_formats_rename_to_files_the_runner_can_write() -> None:
    for key, wf in rg.WORKFLOWS.items():
        shipped = rg.model_files(wf, wf.default_format)
        assert set(wf.sixteen_bit) <= set(shipped) | set(rg.I2V_LORAS), key  # a renamed shipped file breaks this
        for fmt in wf.formats:
            names = rg.model_files(wf, fmt)
            assert set(names) <= KNOWN_MODEL_FILES.keys() | KNOWN_LORA_FILES.keys() | sm.gguf_files().keys(), (key, fmt)
            g = _graph(key, "pack", 12.0, fmt)
            used = {v for n in g.values() for v in n["inputs"].values() if isinstance(v, str) and v.endswith(
                (".safetensors", ".gguf"))}
            assert used == set(names), (key, fmt)
    assert "wan2.2_t2v_high_noise_14B_fp16.safetensors" in rg.model_files(rg.WORKFLOWS["wan_t2v_4step"], "bf16")


def _without(graph: dict, kind: str) -> dict:
    return {k: n for k, n in graph.items() if n["class_type"] != kind}


def test_gguf_rows_load_the_gguf_files_through_unet_loader_gguf() -> None:
    """Native: ComfyUI-GGUF's UnetLoaderGGUF in place of UNETLoader, the rest of native's graph and its attention flag
    kept; pack: UnetLoaderGGUF in place of the Wan Loader, every other node kept (Block Swap at the card's budget)."""
    q8 = {f"wan2.2_t2v_{e}_noise_14B_Q8_0.gguf" for e in ("high", "low")}
    native = _graph("wan_t2v_4step", "native_best", 8.0, "gguf_q8_0")
    assert {i["unet_name"] for i in _types(native)["UnetLoaderGGUF"]} == q8 == set(sm.gguf_files()) & q8
    assert _without(native, "UnetLoaderGGUF") == _without(_graph("wan_t2v_4step", "native_best", 8.0), "UNETLoader")
    assert _model_chain(native, "15") == ["ModelSamplingSD3", "LoraLoaderModelOnly", "UnetLoaderGGUF"]
    row = sr.make_row("wan_t2v_4step", "native_best", 8.0, True, "gguf_q8_0")
    assert row.name == "wan_t2v_4step_native_best_8gb_gguf_q8_0" and row.name in sr.all_rows()
    assert row.server_args(140.0) == ["--use-ck-attention", "--reserve-vram=132.00"]
    assert sr.head(row)["setup"].endswith(": UnetLoaderGGUF (ComfyUI-GGUF) Q8_0, --use-ck-attention")
    pack = _graph("wan_t2v_4step", "pack", 8.0, "gguf_q4_k")
    assert {i["unet_name"] for i in _types(pack)["UnetLoaderGGUF"]} == {n.replace("Q8_0", "Q4_K") for n in q8}
    assert _without(pack, "UnetLoaderGGUF") == _without(_graph("wan_t2v_4step", "pack", 8.0), "LowVRAM_WanLoader")
    assert _model_chain(pack, "16") == ["ModelSamplingSD3", "LowVRAM_Attention", "LowVRAM_BlockSwap",
                                        "LoraLoaderModelOnly", "UnetLoaderGGUF"]
    assert [i["vram_budget_gb"] for i in _types(pack)["LowVRAM_BlockSwap"]] == [6.5, 6.5]
    stream = _graph("wan_t2v_4step", "pack_stream", 12.0, "gguf_q8_0")
    assert [i["dynamic_vram"] for i in _types(stream)["LowVRAM_BlockSwap"]] == ["stream", "stream"]
    head = sr.head(sr.make_row("wan_t2v_4step", "pack", 8.0, True, "gguf_q4_k"))
    assert (head["name"], head["file_format"], head["memory_manager"]) == (  # auto: DynamicVRAM does not manage it
        "wan_t2v_4step_pack_8gb_gguf_q4_k", "gguf_q4_k", "Block Swap")
    assert sr.head(row)["memory_manager"] == "ComfyUI legacy loading"  # ComfyUI-GGUF's patcher, either server flag
    assert head["setup"] == ("workflows/wan22_t2v_a14b_4step.json, UnetLoaderGGUF (ComfyUI-GGUF) Q4_K in place of the "
                             "Wan Loader, as shipped, Block Swap budget 6.5 GB")
    picked = sr.pick_rows(_opts(rows="wan_t2v_4step", cards="8,12", formats="gguf_q8_0", setups="native_best,pack"))
    assert [r.name for r in picked] == [f"wan_t2v_4step_{s}_{c}gb_gguf_q8_0" for c in (8, 12) for s in ("native_best",
                                                                                                       "pack")]
    assert sm.file_gb("wan2.2_t2v_low_noise_14B_Q4_K.gguf") < sm.file_gb("wan2.2_t2v_low_noise_14B_Q8_0.gguf") < 16
    five = _graph("wan_ti2v_5b", "pack", 8.0, "gguf_q8_0")  # the TI2V-5B workflow's one loader, from its fp16 name
    assert [i["unet_name"] for i in _types(five)["UnetLoaderGGUF"]] == ["wan2.2_ti2v_5B_Q8_0.gguf"]
    assert "wan2.2_ti2v_5B_Q8_0.gguf" in rg.model_files(rg.WORKFLOWS["wan_ti2v_5b"], "gguf_q8_0")
    assert sm.file_gb("wan2.2_ti2v_5B_Q4_K.gguf") < sm.file_gb("wan2.2_ti2v_5B_Q8_0.gguf") < sm.file_gb("x_5B_fp16")


def test_qwen_image_gguf_rows_put_block_swap_and_a_vae_loader_where_the_qwen_image_loader_was() -> None:
    """Native: UnetLoaderGGUF in place of UNETLoader; pack: UnetLoaderGGUF, then Block Swap at the loader's budget
    (the Qwen-Image Loader swaps blocks itself), its VAE from a VAELoader, every other node kept."""
    native = _graph("qwen_t2i_4step", "native_best", 12.0, "gguf_q8_0")
    assert [i["unet_name"] for i in _types(native)["UnetLoaderGGUF"]] == ["qwen_image_Q8_0.gguf"]
    assert _without(native, "UnetLoaderGGUF") == _without(_graph("qwen_t2i_4step", "native_best", 12.0), "UNETLoader")
    plain, pack = _graph("qwen_t2i_4step", "pack", 12.0), _graph("qwen_t2i_4step", "pack", 12.0, "gguf_q4_k")
    types = _types(pack)
    assert [i["unet_name"] for i in types["UnetLoaderGGUF"]] == ["qwen_image_Q4_K.gguf"]
    assert [i["vram_budget_gb"] for i in types["LowVRAM_BlockSwap"]] == [10.0]
    assert "LowVRAM_QwenImageLoader" not in types
    loader = _types(plain)["LowVRAM_QwenImageLoader"][0]
    assert [i["vae_name"] for i in types["VAELoader"]] == [loader["vae_name"]]
    sampler = next(k for k, n in pack.items() if n["class_type"] == "KSampler")
    assert _model_chain(pack, sampler) == ["ModelSamplingAuraFlow", "LoraLoaderModelOnly", "LowVRAM_Attention",
                                           "LowVRAM_BlockSwap", "UnetLoaderGGUF"]
    decode = types["LowVRAM_QwenImageDecode"][0]
    assert pack[decode["vae"][0]]["class_type"] == "VAELoader"
    assert sm.file_gb("qwen_image_Q4_K.gguf") < sm.file_gb("qwen_image_Q8_0.gguf") < sm.file_gb("qwen_image_bf16")
    head = sr.head(sr.make_row("qwen_t2i_4step", "pack", 12.0, True, "gguf_q8_0"))
    assert head["setup"].startswith("workflows/qwen_image_t2i_4step.json, UnetLoaderGGUF (ComfyUI-GGUF) Q8_0 in place "
                                    "of the Qwen-Image Loader (+ Block Swap, Load VAE), as shipped")


@pytest.mark.parametrize("key", ["wan_t2v", "qwen_t2i", "wan_t2v_4step"])
@pytest.mark.parametrize("setup", ["native_best_easycache", "pack_easycache"])
def test_easycache_sits_on_the_model_right_before_each_sampler(key: str, setup: str) -> None:
    """Core's EasyCache with the defaults its schema declares, between each sampler and what fed its model; the rest
    of the graph is the setup without it."""
    graph, plain = _graph(key, setup, 24.0), _graph(key, setup.removesuffix("_easycache"), 24.0)
    samplers = rg.of_type(graph, *rg.SAMPLERS)
    declared = {k: spec[1]["default"] for k, spec in OBJECT_INFO["EasyCache"]["input"]["required"].items()
                if k != "model"}
    assert declared == {"reuse_threshold": 0.2, "start_percent": 0.15, "end_percent": 0.95, "verbose": False}
    for nid in samplers:
        cache = graph[graph[nid]["inputs"]["model"][0]]
        assert cache["class_type"] == "EasyCache" and cache["inputs"] == {**declared, "model": plain[nid]["inputs"][
            "model"]}
    assert len(rg.of_type(graph, "EasyCache")) == len(samplers) >= 1
    kinds = sorted(n["class_type"] for n in graph.values())
    assert kinds == sorted([n["class_type"] for n in plain.values()] + ["EasyCache"] * len(samplers))
    assert sr.make_row(key, setup, 24.0).name == f"{key}_{setup}_24gb"
    assert "EasyCache (its defaults) before each sampler" in sr.head(sr.make_row(key, setup, 24.0))["setup"]


def test_easycache_threshold_option_sets_every_cache_node_and_names_its_own_workload() -> None:
    """--easycache-threshold: the EasyCache rows' nodes get it (the other rows are untouched), their setup text and
    step cache name it, so the index never compares them with rows at the default."""
    class Server:
        def object_info(self, kind: str) -> dict | None:
            return OBJECT_INFO.get(kind)

    opts = _opts(rows="qwen_t2i_native_best_24gb,qwen_t2i_pack_easycache_24gb", easycache_threshold=0.5,
                 empty_image=False, smoke=False)
    plain, cached = sr.pick_rows(opts)
    assert (plain.easycache_threshold, cached.easycache_threshold) == (None, 0.5)
    caches = [n for n in sr.build_graph(cached, Server(), opts).values() if n["class_type"] == "EasyCache"]
    assert [n["inputs"]["reuse_threshold"] for n in caches] == [0.5]
    assert caches[0]["inputs"]["start_percent"] == 0.15  # the rest at the node's defaults
    head = sr.head(cached)
    assert head["step_cache"] == "EasyCache (reuse_threshold 0.5)" and "EasyCache (reuse_threshold 0.5) before" in \
        head["setup"]
    assert sr.head(sr.make_row("qwen_t2i", "pack_easycache", 24.0))["step_cache"] == "EasyCache"
    assert sr.head(plain)["step_cache"] is None


def test_easycache_skips_are_read_per_sampler_and_reported() -> None:
    log = ("EasyCache enabled - threshold: 0.2, start_percent: 0.15, end_percent: 0.95\n"
           "EasyCache - skipped 3/10 steps (1.43x speedup).\nPrompt executed in 9 s\n"
           "EasyCache - skipped 4/10 steps (1.67x speedup).\n")
    assert sr.EASYCACHE_SKIPS.findall(log) == [("3", "10"), ("4", "10")]
    row = _row("e", "pack_easycache", 24.0, 20.0)
    row["renders"]["warm"]["easycache_skipped"] = [[3, 10], [4, 10]]
    assert rr._warm_split(row).endswith("; EasyCache skipped 3/10, 4/10 steps")
    assert "EasyCache" not in rr._warm_split(_row("p", "pack", 24.0, 20.0))


def test_the_warm_split_says_what_each_sampler_and_the_render_read_from_the_disk() -> None:
    row = _row("p", "pack", 12.0, 20.0)
    warm = row["renders"]["warm"]
    assert "read" not in rr._warm_split(row)  # a result from before the reads were sampled
    warm["samplers"] = [{"steps": 2, "first_step_s": 6.9, "median_step_s": 2.34, "node_s": 9.3,
                         "disk_read_gib": 4.04}]
    warm["disk_read_gib"] = 8.46
    assert rr._warm_split(row).endswith("(9.3: 6.9 + 1 x 2.34; 4.0 GiB read); 8.5 GiB read from the disk")


def test_a_cached_row_is_compared_with_native_under_the_same_cache_and_threshold() -> None:
    """A pack row with EasyCache at a set threshold against native's best with that cache and threshold, never one
    at another threshold; native's cached row against native's best without a cache."""
    cache = "EasyCache (reuse_threshold 1)"
    rows = [_row("n", "native_best", 24.0, 30.0, side="native"),
            _row("nc", "native_best_easycache", 24.0, 20.0, step_cache=cache, side="native"),
            _row("nd", "native_best_easycache", 24.0, 25.0, step_cache="EasyCache", side="native"),
            _row("pc", "pack_easycache", 24.0, 15.0, step_cache=cache)]
    assert rr.native_row(rows[3], rows)["name"] == "nc"
    assert rr.native_row(rows[1], rows)["name"] == "n"
    assert rr.native_row(rows[3], rows[:1] + rows[2:]) is None


def test_i2v_4step_is_the_i2v_workflow_with_the_t2v_4step_sampling() -> None:
    i2v, t2v = _graph("wan_i2v_4step"), _graph("wan_t2v_4step")
    loras = _types(i2v)["LoraLoaderModelOnly"]
    assert {i["lora_name"] for i in loras} <= KNOWN_LORA_FILES.keys() and len(loras) == 2
    keys = ("steps", "cfg", "start_at_step", "end_at_step", "shift")
    for kind in ("KSamplerAdvanced", "ModelSamplingSD3"):
        assert [{k: v for k, v in i.items() if k in keys} for i in _types(i2v)[kind]] == \
            [{k: v for k, v in i.items() if k in keys} for i in _types(t2v)[kind]], kind
    assert _model_chain(i2v, "16") == ["ModelSamplingSD3", "LowVRAM_Attention", "LowVRAM_BlockSwap",
                                       "LoraLoaderModelOnly", "LowVRAM_WanLoader"]


def test_seed_and_prompt_changes() -> None:
    g = _graph("wan_t2v_4step")
    warm = rg.with_seed(g, 1)
    assert (warm["15"]["inputs"]["noise_seed"], warm["16"]["inputs"]["noise_seed"]) == (43, 0)  # the low one adds none
    assert {k for k in g if g[k] != warm[k]} == {"15"}
    new = rg.with_new_prompt(warm)
    assert new["11"]["inputs"]["positive"].endswith(rg.NEW_PROMPT) and new["11"]["inputs"]["negative"] == \
        g["11"]["inputs"]["negative"]
    for key in ("wan_i2v", "qwen_t2i_4step", "qwen_edit"):
        for setup in ("pack", "native_best"):
            g = _graph(key, setup)
            assert rg.with_new_prompt(g) != g, (key, setup)
    with pytest.raises(rg.GraphError, match="positive prompt"):
        rg.with_new_prompt({"1": {"class_type": "KSampler", "inputs": {}}})


def test_smoke_graph_shrinks_and_stands_in_for_the_stock_text_encoder() -> None:
    g = sr.smoke_graph(_graph("wan_t2v_4step", "native_best"), native=True)
    assert _types(g)["EmptyHunyuanLatentVideo"][0] | {} == {"width": 64, "height": 64, "length": 5, "batch_size": 1}
    assert [(i["steps"], i["start_at_step"], i["end_at_step"]) for i in _types(g)["KSamplerAdvanced"]] == \
        [(2, 0, 1), (2, 1, 10000)]
    assert sr.STAND_IN_CLIP in _types(g) and "CLIPLoader" not in _types(g)
    assert sr.graph_facts(_graph("wan_t2v_4step")) == {"resolution": "832x480", "frames": 81, "steps": 4, "cfg": 1.0}
    assert sr.graph_facts(_graph("wan_t2v")) == {"resolution": "832x480", "frames": 81, "steps": 20, "cfg": 3.5}
    assert sr.graph_facts(_graph("qwen_t2i_4step")) == {"resolution": "1328x1328", "frames": None, "steps": 4,
                                                        "cfg": 1.0}
    assert sr.graph_facts(_graph("qwen_edit"))["resolution"] == "1024x1024"


# ----------------------------------------------------------------------------------------------------------
# rows, flags, files


def _opts(**kw: object) -> argparse.Namespace:
    base = {"rows": "core", "cards": None, "setups": ",".join(sr.DEFAULT_SETUPS), "memory": "on", "formats": None}
    return argparse.Namespace(**{**base, **kw})


def test_core_group() -> None:
    rows = sr.pick_rows(_opts())
    assert [r.name for r in rows] == [
        "wan_t2v_4step_native_best_12gb", "wan_t2v_4step_pack_12gb", "wan_t2v_4step_pack_stream_12gb",
        "wan_t2v_4step_native_best_24gb", "wan_t2v_4step_pack_24gb", "wan_t2v_4step_pack_stream_24gb",
        "wan_t2v_4step_native_best_whole", "wan_t2v_4step_pack_whole", "wan_t2v_4step_pack_stream_whole",
        "qwen_t2i_4step_native_best_12gb", "qwen_t2i_4step_pack_12gb",
        "qwen_t2i_4step_native_best_24gb", "qwen_t2i_4step_pack_24gb"]
    assert all(r.dynamic_vram and r.file_format == "fp8_scaled" for r in rows)
    assert [r.name for r in sr.pick_rows(_opts(cards="whole"))] == [r.name for r in rows if r.card_gib is None]


def test_pick_rows_expands_workflows() -> None:
    rows = sr.pick_rows(_opts(rows="wan_t2v", cards="8", setups="native_default,pack", formats="fp8_scaled,bf16",
                              memory="on,off"))
    assert len(rows) == 8 and {r.card_gib for r in rows} == {8.0}
    assert "wan_t2v_pack_8gb_legacy_bf16" in {r.name for r in rows}
    assert sr.make_row("wan_t2v", "pack", None, False, "bf16").server_args(140.0) == ["--disable-dynamic-vram"]
    q = sr.pick_rows(_opts(rows="qwen_t2i_4step"))  # no Block Swap to remove: that setup is left out
    assert {r.setup for r in q} == {"native_best", "pack"}
    with pytest.raises(SystemExit, match="unknown"):
        sr.pick_rows(_opts(rows="core,nope"))
    assert sr.parse_cards("12,24gb,whole") == [12.0, 24.0, None]


def test_flags_left_out_where_the_host_or_the_cpu_lacks_them() -> None:
    row = sr.make_row("wan_t2v_4step", "native_best", 12.0, False)
    flags = row.server_args(143.0)
    assert flags == ["--use-ck-attention", "--disable-dynamic-vram", "--reserve-vram=131.00"]
    host_080 = '"--reserve-vram", type=float'  # ComfyUI 0.8.0 has neither other flag
    ctx = sr.RunContext(argparse.Namespace(smoke=False), None, 143.0, host_080, "0.8.0", ())
    assert sr.row_flags(ctx, row) == (["--reserve-vram=131.00"], [f"{f} (not a flag of ComfyUI 0.8.0)" for f in (
        "--use-ck-attention", "--disable-dynamic-vram")])
    ctx.opts.smoke, ctx.host_flags = True, '"--disable-dynamic-vram", "--use-ck-attention"'
    assert sr.row_flags(ctx, row) == (["--disable-dynamic-vram"], ["--use-ck-attention (no comfy-kitchen attention on "
                                                                  "the CPU)"])
    with pytest.raises(ValueError, match="drop the capped"):
        row.server_args(8.0)


def _synthetic_file(path: Path, synthetic: bool) -> None:
    meta = {"synthetic": "comfyui_lowvram_dit"} if synthetic else {"format": "pt"}
    header = json.dumps({"__metadata__": meta}).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(len(header).to_bytes(8, "little") + header)


def test_model_files_written_when_needed_and_only_synthetic_ones_freed(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    wan, qwen = sr.make_row("wan_t2v_4step", "pack", 12.0), sr.make_row("qwen_t2i_4step", "pack", 12.0)
    written: list[str] = []

    def child(code: str, models: str, result: str, *names: str) -> None:
        assert code == sm.WRITE_CHILD and models == str(tmp_path)
        written.extend(names)
        Path(result).write_text(json.dumps({n: 1.0 for n in names}))

    monkeypatch.setattr(sm, "run_child", child)
    for name in rg.model_files(wan.spec, wan.file_format):
        _synthetic_file(tmp_path / "diffusion_models" / name, synthetic=True)
    _synthetic_file(tmp_path / "vae" / "users_own_vae.safetensors", synthetic=False)
    with pytest.raises(sm.cli_server.RunError, match="--write-models"):
        sm.ModelFiles(tmp_path).prepare(qwen, [])
    files = sm.ModelFiles(tmp_path, write=True, free_disk=True)
    files.prepare(wan, [qwen])
    assert written == []  # all there
    files.prepare(qwen, [])
    assert set(written) == set(rg.model_files(qwen.spec, qwen.file_format))
    assert set(files.freed) == set(rg.model_files(wan.spec, wan.file_format)) - set(written)
    assert files.took == {n: 1.0 for n in written} and not (tmp_path / ".write_models.json").exists()
    assert (tmp_path / "vae" / "users_own_vae.safetensors").is_file()


def test_free_disk_deletes_the_synthetic_gguf_files_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF file the runner wrote (its ``synthetic`` key) is freed for a later row; a user's GGUF file is not."""
    gguf = pytest.importorskip("gguf", reason="the gguf package is missing: pip install -e '.[test]' adds it")
    monkeypatch.setattr(sm, "run_child", lambda code, models, result, *names: Path(result).write_text("{}"))
    ours = tmp_path / "diffusion_models" / "wan2.2_t2v_high_noise_14B_Q8_0.gguf"
    sm.write_gguf_models(tmp_path, {ours.name}, "tiny", "cpu")
    users = tmp_path / "diffusion_models" / "users_own_Q8_0.gguf"
    writer = gguf.GGUFWriter(str(users), arch="wan")
    writer.add_tensor("blocks.0.norm3.weight", np.ones(256, dtype=np.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file, writer.close):
        step()
    assert sm._synthetic(ours) and not sm._synthetic(users)
    files = sm.ModelFiles(tmp_path, write=True, free_disk=True)
    gguf_row = sr.make_row("wan_t2v_4step", "pack", 8.0, True, "gguf_q8_0")
    files.prepare(sr.make_row("qwen_t2i_4step", "pack", 12.0), [gguf_row])
    assert ours.is_file() and files.freed == []  # a later row loads it
    files.prepare(sr.make_row("qwen_t2i_4step", "pack", 24.0), [])
    assert not ours.exists() and files.freed == [ours.name] and users.is_file()


def test_estimates_grow_with_renders_cards_and_missing_files(tmp_path: Path) -> None:
    opts = argparse.Namespace(reserve_estimate=0.0, warm_repeats=1)
    ctx = sr.RunContext(opts, sm.ModelFiles(tmp_path), 143.0, "", "0.33.0", ("first_ever", "warm", "cold"))
    small, whole = sr.make_row("wan_t2v_4step", "pack", 12.0), sr.make_row("wan_t2v_4step", "pack", None)
    assert sr.estimate_s(ctx, small) > sr.estimate_s(ctx, whole) > 2 * sr.ESTIMATE_S["wan_t2v_4step"][0]
    writing = sr.RunContext(opts, sm.ModelFiles(tmp_path, write=True), 143.0, "", "0.33.0", ctx.renders)
    assert sr.estimate_s(writing, whole) > sr.estimate_s(ctx, whole) + 40  # ~38 GB to write
    assert sm.file_gb("qwen_image_vae.safetensors") < 1 < sm.file_gb("qwen_image_fp8_e4m3fn.safetensors")
    assert sr.estimate_s(sr.RunContext(argparse.Namespace(reserve_estimate=7.0), ctx.models, 1.0, "", "", ()),
                         whole) == 7.0
    repeats = sr.RunContext(argparse.Namespace(reserve_estimate=0.0, warm_repeats=3), ctx.models, 143.0, "", "",
                            ctx.renders)
    assert sr.estimate_s(repeats, whole) == sr.estimate_s(ctx, whole) + 2 * sr.ESTIMATE_S["wan_t2v_4step"][1]
    assert set(sr.ESTIMATE_S) == set(rg.WORKFLOWS)
    assert all(warm < cold for cold, warm in sr.ESTIMATE_S.values())  # the models are loaded


# ----------------------------------------------------------------------------------------------------------
# the split


def _ev(t: float, kind: str, **data: object) -> tuple[float, dict]:
    return (t, {"type": kind, "data": data})


GRAPH = {"3": {"class_type": "LowVRAM_WanLoader", "inputs": {}}, "11": {"class_type": "LowVRAM_WanTextEncode",
                                                                        "inputs": {}},
         "13": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {}},
         "15": {"class_type": "KSamplerAdvanced", "inputs": {}, "_meta": {"title": "Sampler (high noise)"}},
         "16": {"class_type": "KSamplerAdvanced", "inputs": {}, "_meta": {"title": "Sampler (low noise)"}},
         "18": {"class_type": "VAEDecode", "inputs": {}}, "19": {"class_type": "CreateVideo", "inputs": {}},
         "20": {"class_type": "SaveVideo", "inputs": {}}, "22": {"class_type": "SaveLatent", "inputs": {}}}
EVENTS = [
    _ev(100.2, "execution_start"), _ev(100.3, "execution_cached", nodes=["12"]), _ev(100.5, "executing", node="3"),
    _ev(102.0, "progress", node="3", value=1000, max=1000), _ev(103.5, "executing", node="11"),
    _ev(105.0, "executing", node="13"), _ev(105.1, "executing", node="15"),
    _ev(112.1, "progress", node="15", value=1, max=4), _ev(114.1, "progress", node="15", value=2, max=4),
    _ev(114.3, "executing", node="16"), _ev(118.3, "progress", node="16", value=1, max=4),
    _ev(120.3, "progress", node="16", value=2, max=4), _ev(120.5, "executing", node="18"),
    _ev(126.5, "executing", node="22"), _ev(126.7, "executing", node="19"), _ev(126.8, "executing", node="20"),
    _ev(128.0, "executing", node=None),
]


def test_split_from_planted_events() -> None:
    s = split(EVENTS, GRAPH, posted_at=100.0, total_s=28.3)
    hi, lo = s["samplers"]
    assert (hi["first_step_s"], hi["median_step_s"], hi["load_part_s"], hi["steps"]) == (7.0, 2.0, 5.0, 2)
    assert (lo["first_step_s"], lo["load_part_s"], lo["node_s"]) == (4.0, 2.0, 6.2)
    assert s["load_s"] == pytest.approx(3.0 + 5.0 + 2.0)  # the Wan Loader + each sampler's first step above its median
    assert s["text_encode_s"] == 1.5 and s["vae_decode_s"] == 6.0 and s["save_s"] == pytest.approx(1.5)
    assert s["sampling_s"] == pytest.approx(9.2 + 6.2 - 7.0)
    assert s["queue_s"] == 0.5 and s["s_per_step"] == 2.0 and s["cached_nodes"] == ["12"]
    assert sum(s[k] for k in PARTS) == pytest.approx(s["total_s"], abs=0.05)
    assert s["other_s"] == pytest.approx(0.1 + 0.5 + 0.3, abs=0.02)  # latent node, queue, after the last node
    assert s["nodes"]["11"] == {"type": "LowVRAM_WanTextEncode", "part": "text_encode_s", "s": 1.5}
    assert {s["nodes"][k]["part"] for k in ("19", "20", "22")} == {"save_s"}  # Create Video counts as saving


def test_step_sync_waits_for_the_gpu_before_each_progress_message_and_wraps_once() -> None:
    from comfyui_lowvram_dit.benchmarks import step_sync

    calls: list = []

    class Bar:
        def update_absolute(self, value: int, total: int | None = None, preview: object = None) -> None:
            calls.append(("update", value, total))

    wrapped = step_sync.synced(Bar.update_absolute, lambda: calls.append("sync"))
    assert step_sync.synced(wrapped, lambda: calls.append("twice")) is wrapped  # a second load adds no second sync
    Bar.update_absolute = wrapped
    Bar().update_absolute(3, 4)
    assert calls == ["sync", ("update", 3, 4)]


def test_report_names_the_clock_of_the_step_times() -> None:
    synced = [{"lives": [{"step_sync": True}, {"step_sync": True}]}]
    assert "device times" in rr.step_clock(synced)
    assert "host" in rr.step_clock(synced + [{"lives": [{"step_sync": False}]}])  # one unsynced life: host times
    assert "host" in rr.step_clock([{"lives": []}])


def test_split_of_a_warm_render_and_of_a_one_step_sampler() -> None:
    warm = [_ev(0.1, "executing", node="15"), _ev(2.1, "progress", node="15", value=1, max=1),
            _ev(2.2, "executing", node="18"), _ev(3.0, "executing", node=None)]
    s = split(warm, GRAPH, posted_at=0.0, total_s=3.1)
    assert s["load_s"] == 0.0 and s["sampling_s"] == 2.1 and s["samplers"][0]["median_step_s"] is None
    assert s["s_per_step"] is None and s["vae_decode_s"] == 0.8


# ----------------------------------------------------------------------------------------------------------
# the report


def _save_latent(path: Path, values: list[float]) -> None:
    import torch
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"latent_tensor": torch.tensor(values)}, str(path))


def _row(name: str, setup: str, card: float | None, warm: float, status: str = "ok", **kw: object) -> dict:
    renders = {k: {"kind": k, "status": "ok", "total_s": t, "load_s": 1.0, "samplers": []}
               for k, t in (("first_ever", warm * 3), ("cold", warm * 2), ("warm", warm))}
    return {"name": name, "workflow": "wan_t2v_4step", "title": "Wan 2.2 T2V-A14B 4-step", "model": "Wan 2.2 T2V-A14B",
            "setup_id": setup, "setup": f"{setup} as wired", "card_gib": card, "dynamic_vram": True,
            "format": "fp8_scaled", "file_format": "fp8_scaled", "status": status, "render_s": warm,
            "renders": renders, "lives": [{"renders": ["first_ever"], "log": [f"{name} log line"]}],
            "resolution": "832x480", "frames": 81, "steps": 4, **kw}


def test_report_compares_rows_with_the_native_row_of_their_card(tmp_path: Path) -> None:
    rows = [_row("n12", "native_best", 12.0, 40.0), _row("p12", "pack", 12.0, 20.0),
            _row("n24", "native_best", 24.0, 30.0), _row("p24", "pack", 24.0, 60.0),
            _row("ref", "native_default", None, 50.0, format="bf16", file_format="fp16"),
            {"name": "skipped", "setup_id": "pack", "status": "skipped", "error": "not started: time budget"}]
    latents = tmp_path / "latents"
    _save_latent(latents / "n12.first_ever.latent", [1.0, 2.0, 2.0])
    _save_latent(latents / "p12.first_ever.latent", [1.0, 2.0, 2.3])
    _save_latent(latents / "p12.cold.latent", [1.0, 2.0, 2.3])
    _save_latent(latents / "ref.first_ever.latent", [1.0, 2.0, 2.0])
    paths = rr.write(tmp_path / "out", "core", rows, {"gpu": "H200", "command": "python3 -m x"}, {"renders": []},
                     latents)
    doc = json.loads(paths[0].read_text())
    by = {r["name"]: r for r in doc["rows"]}
    assert set(doc) == {"scenario", "env", "settings", "rows", "logs"}
    assert doc["logs"]["p12"] == [["p12 log line"]] and "log" not in by["p12"]["lives"][0]
    assert (by["p12"]["against"], by["p12"]["ratio"]) == ("n12", 2.0)
    assert (by["p24"]["against"], by["p24"]["ratio"]) == ("n24", 0.5)
    assert by["n12"]["against"] is None and by["n12"]["ratio"] is None
    assert by["p12"]["error_vs_native"] == pytest.approx(0.1) and by["p12"]["error_vs_bf16"] == pytest.approx(0.1)
    assert by["p12"]["outputs_compared"]["cold_vs_first_ever"]["identical"]
    assert by["p24"]["outputs_compared"]["vs_native"]["error"] == "latent not kept in this run"
    assert all(k in by["skipped"] for k in rr.ROW_KEYS)
    md = paths[1].read_text()
    assert "## Wan 2.2 T2V-A14B 4-step, 12 GB card" in md and "## Wan 2.2 T2V-A14B 4-step, whole GPU" in md
    assert "| pack | p12 | 60.0 (2.00x) | 40.0 (2.00x) | 20.0 (2.00x) | — |" in md
    assert "| 0.1; bf16: 0.1 | n12 | ok |" in md
    assert all(line.count("|") == 14 for line in md.splitlines() if line.startswith("|"))
    assert "| native_best | n12 |" in md.split("| pack | p12")[0]
    assert rr.finished_rows(paths[0]) and all(r["source"] == "core.json" for r in rr.finished_rows(paths[0]))
    assert {r["name"] for r in rr.finished_rows(paths[0])} == {"n12", "p12", "n24", "p24", "ref"}
    assert rr.finished_rows(paths[0])[1]["lives"][0]["log"] == ["p12 log line"]  # --resume keeps the logs


def test_a_row_is_compared_with_a_finished_native_row_only(tmp_path: Path) -> None:
    rows = [_row("n12", "native_best", 12.0, 40.0, status="error"), _row("p12", "pack", 12.0, 20.0)]
    rr.compare(rows, tmp_path)
    assert rows[1]["against"] is None and rows[1]["ratio"] is None and rows[1]["outputs_compared"] == {
        "cold_vs_first_ever": {"against": "p12 (first_ever)", "error": "latent not kept in this run"}}


def test_resumed_rows_keep_their_comparisons(tmp_path: Path) -> None:
    old = {"vs_native": {"against": "n12 (first_ever)", "rel_diff": 0.25}}
    rows = [_row("n12", "native_best", 12.0, 40.0), _row("p12", "pack", 12.0, 20.0, outputs_compared=old)]
    rr.compare(rows, tmp_path)
    assert rows[1]["error_vs_native"] == 0.25


def test_pack_fp8_rows_get_the_saved_copies_and_16bit_pack_rows_run_without_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Wan Loader picks its saved fp8 copy up by itself: a 16-bit pack row would silently load it."""
    saved: list[str] = []

    def quantize(code: str, src: str, device: str) -> None:  # the child that writes the Wan Loader's saved copy
        saved.append(src)
        Path(src.replace(".safetensors", ".lowvram-fp8-per-tensor.safetensors")).write_bytes(b"copy")

    monkeypatch.setattr(sm, "run_child", quantize)
    for name in rg.model_files(rg.WORKFLOWS["wan_t2v_4step"], "bf16"):
        (tmp_path / "diffusion_models").mkdir(exist_ok=True)
        if "_14B_" in name:
            (tmp_path / "diffusion_models" / name).write_bytes(b"x")
            (tmp_path / "diffusion_models" / name.replace(".safetensors", ".lowvram-fp8-per-tensor.safetensors")
             ).write_bytes(b"copy")
    copies = [c for _, c in sm.quantized_copies(tmp_path, sr.make_row("wan_t2v_4step", "pack", None, True, "bf16"))]
    assert len(copies) == 2
    copies[0].unlink()
    rec: dict = {}
    with sm.pack_copies_for(sr.make_row("wan_t2v_4step", "pack", None, True, "pack_fp8"), tmp_path, "cpu", rec):
        assert all(c.is_file() for c in copies)
    assert list(rec) == ["pack_copy_write_s"] and len(saved) == 1  # only the missing copy written
    with sm.pack_copies_for(sr.make_row("wan_t2v_4step", "pack", None, True, "bf16"), tmp_path, "cpu", rec):
        assert not any(c.is_file() for c in copies)
    assert all(c.read_bytes() == b"copy" for c in copies)
    with sm.pack_copies_for(sr.make_row("wan_t2v_4step", "native_default", None, True, "bf16"), tmp_path, "cpu", rec):
        assert all(c.is_file() for c in copies)  # UNETLoader never reads them


def test_the_model_writer_child_runs(tmp_path: Path) -> None:
    """The child that writes models (so the runner holds no CUDA context) imports this checkout and reports back."""
    sm.run_child(sm.WRITE_CHILD, str(tmp_path), str(tmp_path / "took.json"))
    assert json.loads((tmp_path / "took.json").read_text()) == {}
    with pytest.raises(sm.subprocess.CalledProcessError):
        sm.run_child("raise SystemExit(3)")


def test_rows_carry_the_common_format_fields() -> None:
    """The fields the results index reads, in its vocabulary (benchmarks/README.md, 'The common format')."""
    heads = {r.name: sr.head(r) for r in sr.CORE}
    wan, qwen = heads["wan_t2v_4step_pack_12gb"], heads["qwen_t2i_4step_native_best_24gb"]
    assert (wan["model"], wan["file_format"], wan["memory_manager"], wan["side"], wan["lora"], wan["how"]) == \
        ("Wan 2.2 T2V-A14B", "fp8_scaled", "Block Swap auto", "pack", "4-step LoRA", "server")
    assert heads["wan_t2v_4step_pack_stream_12gb"]["memory_manager"] == "Block Swap"
    assert wan["setup"] == "workflows/wan22_t2v_a14b_4step.json, as shipped, Block Swap budget 10 GB"
    assert (qwen["model"], qwen["file_format"], qwen["memory_manager"], qwen["side"]) == \
        ("Qwen-Image", "fp8_e4m3fn", "DynamicVRAM", "native")
    assert qwen["setup"].endswith("UNETLoader fp8_e4m3fn_fast, --use-ck-attention")
    assert sr.head(sr.make_row("wan_t2v_4step", "pack_no_blockswap", None))["memory_manager"] == "DynamicVRAM"
    legacy = sr.head(sr.make_row("wan_t2v", "native_default", None, False, "bf16"))
    assert (legacy["memory_manager"], legacy["file_format"], legacy["lora"]) == ("ComfyUI legacy loading", "fp16", None)
    assert sr.head(sr.make_row("wan_t2v_4step", "pack", None))["setup"].endswith("budget 0 GB (all free VRAM)")
    assert {h["model"] for h in map(sr.head, sr.all_rows().values())} <= {
        "Wan 2.2 T2V-A14B", "Wan 2.2 I2V-A14B", "Wan 2.2 TI2V-5B", "Qwen-Image", "Qwen-Image-Edit"}


def test_empty_image_replaces_the_loaded_image_at_the_rendered_size() -> None:
    g = sr.empty_images(_graph("wan_i2v"))
    assert "LoadImage" not in _types(g) and _types(g)["EmptyImage"][0]["width"] == 832
    assert _problems(g) == []
    e = sr.empty_images(_graph("qwen_edit", "native_best"))
    assert (_types(e)["EmptyImage"][0]["width"], _types(e)["EmptyImage"][0]["height"]) == (1024, 1024)


def test_cli_defaults_and_refusals(tmp_path: Path) -> None:
    (tmp_path / "main.py").write_text("")
    base = ["--comfyui", str(tmp_path), "--work", str(tmp_path / "work")]

    def prepare(*args: str) -> tuple[argparse.Namespace, list, tuple]:
        opts = sr.parser().parse_args([*base, *args])
        rows, kinds, own = sr._prepare(opts)
        assert not own
        return opts, rows, kinds

    opts, rows, kinds = prepare("--models", str(tmp_path / "models"))
    assert kinds == sr.CORE_RENDERS and len(rows) == len(sr.CORE) and opts.stem == "core"
    assert opts.out == sr.reports.RESULTS / "render" and (tmp_path / "models" / "loras").is_dir()
    opts, rows, kinds = prepare("--smoke", "--rows", "wan_t2v_4step", "--cards", "whole")
    assert kinds == sr.RENDERS and opts.out == sr.SMOKE_OUT and opts.models == (tmp_path / "work" / "models").resolve()
    assert [r.name for r in rows] == ["wan_t2v_4step_native_best_whole", "wan_t2v_4step_pack_whole",
                                      "wan_t2v_4step_pack_stream_whole"]
    for bad, message in ((["--smoke", "--write-models"], "pick one"), (["--renders", "warm,hot"], "unknown hot"),
                         ([], "--models")):
        with pytest.raises(SystemExit, match=message):
            prepare(*bad)
    with pytest.raises(SystemExit, match="main.py"):
        sr._prepare(sr.parser().parse_args(["--comfyui", str(tmp_path / "nowhere"), "--smoke"]))


def test_rows_that_save_video_are_refused_up_front_where_pyav_is_the_gpu_kits_stub(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kit's PyAV stub every SaveVideo fails after the whole render: refused before any model is written."""
    import importlib.machinery
    import types

    stub = types.ModuleType("av")
    stub.__version__ = "0.0.0+stub"
    stub.__spec__ = importlib.machinery.ModuleSpec("av", None)
    monkeypatch.setitem(sys.modules, "av", stub)
    (tmp_path / "main.py").write_text("")
    base = ["--comfyui", str(tmp_path), "--work", str(tmp_path / "work"), "--smoke", "--cards", "whole"]
    with pytest.raises(SystemExit, match=r"wan_t2v_4step save video .*gpu_kit\.sh --av"):
        sr._prepare(sr.parser().parse_args([*base, "--rows", "wan_t2v_4step"]))
    rows, _, _ = sr._prepare(sr.parser().parse_args([*base, "--rows", "qwen_t2i_4step"]))  # saves PNG
    assert rows
    stub.__version__ = "19.0.2"
    assert sr.video_problem(rows + sr.pick_rows(sr.parser().parse_args([*base, "--rows", "wan_t2v_4step"]))) is None


def test_the_deadline_stops_the_run_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a row would not finish in time, it and every later row are skipped (even a shorter one), so --resume
    continues where the run stopped."""
    opts = argparse.Namespace(reserve_estimate=0.0, deadline=380.0, warm_repeats=1)
    ctx = sr.RunContext(opts, sm.ModelFiles(tmp_path), 143.0, "", "0.33.0", sr.CORE_RENDERS)
    rows = [sr.make_row("wan_t2v_4step", "pack", 12.0), sr.make_row("wan_t2v_4step", "pack", None),
            sr.make_row("qwen_t2i_4step", "pack", 24.0)]
    ctx.rows = rows
    ran: list[str] = []
    monkeypatch.setattr(sr.time, "monotonic", lambda: 250.0 if ran else 0.0)  # the first row took 250 s
    monkeypatch.setattr(sr, "run_row", lambda _ctx, r: ran.append(r.name) or {"name": r.name, "status": "ok"})
    results: list[dict] = [{"name": "merged"}]
    written: list[int] = []
    sr.run_all(ctx, lambda done: written.append(len(done)), results, 0.0)
    assert sr.estimate_s(ctx, rows[1]) + 250 > opts.deadline > sr.estimate_s(ctx, rows[2]) + 250
    assert ran == [rows[0].name]  # the Qwen row would fit, but it comes after one that does not
    assert [r.get("status") for r in results] == [None, "ok", "skipped", "skipped"] and written == [2]
    assert [r["what"] for r in results[2:]] == [sr.describe(r) for r in rows[1:]]  # a skipped row says what it was
    ctx.opts.deadline, ran[:], results[:] = 0.0, [], []  # no deadline: every row runs, the reports after each
    sr.run_all(ctx, lambda done: written.append(len(done)), results, 0.0)
    assert ran == [r.name for r in rows] and written == [2, 1, 2, 3]


class _FakeServer:
    """A server whose log grows by one EasyCache line per render."""

    def __init__(self) -> None:
        self.log = ""

    def log_text(self) -> str:
        return self.log


def test_warm_repeats_render_new_seeds_and_keep_the_median(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    srv, seeds, totals = _FakeServer(), [], iter([3.0, 9.0, 5.0, 4.0])

    def render(server, graph, kind, timeout, output, latents, row, first):  # noqa: ANN001, ANN202
        seeds.append(next(n["inputs"]["noise_seed"] for n in graph.values() if "noise_seed" in n["inputs"]))
        server.log += f"EasyCache - skipped {len(seeds)}/4 steps\n"
        return {"kind": kind, "status": "ok", "total_s": next(totals), "first": first}

    monkeypatch.setattr(sr, "render", render)
    graph = {"1": {"class_type": "KSamplerAdvanced", "inputs": {"noise_seed": 10, "add_noise": "enable"}}}
    opts = argparse.Namespace(warm_repeats=3, timeout=1.0, work=tmp_path, drop_page_cache=False)
    warm = sr.render_kind(srv, graph, "warm", opts, tmp_path, "row", False)
    assert seeds == [11, 111, 211]  # the warm seed, then REPEAT_SEED_STEP above it each time
    assert warm["repeats_s"] == [3.0, 9.0, 5.0] and warm["total_s"] == 5.0
    assert warm["easycache_skipped"] == [[3, 4]]  # the median render's own log line
    first = sr.render_kind(srv, graph, "first_ever", opts, tmp_path, "row", True)  # other kinds render once
    assert first["total_s"] == 4.0 and "repeats_s" not in first and first["first"] and seeds[-1] == 10
    assert rr._seconds({"renders": {"warm": warm}}, "warm", None) == "5.0 [3.0-9.0, 3 renders]"


def test_new_prompt_repeats_each_encode_another_prompt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--warm-repeats also repeats the new-prompt render, each with a prompt none before it had (the text encoder
    runs every time), the first one as a single new-prompt render has it."""
    texts = []

    def render(server, graph, kind, timeout, output, latents, row, first):  # noqa: ANN001, ANN202
        texts.append(graph["2"]["inputs"]["text"])
        return {"kind": kind, "status": "ok", "total_s": float(len(texts))}

    monkeypatch.setattr(sr, "render", render)
    graph = {"1": {"class_type": "KSampler", "inputs": {"seed": 10, "positive": ["2", 0]}},
             "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a cat"}}}
    opts = argparse.Namespace(warm_repeats=3, timeout=1.0, work=tmp_path, drop_page_cache=False)
    out = sr.render_kind(_FakeServer(), graph, "warm_new_prompt", opts, tmp_path, "row", False)
    assert texts[0] == "a cat" + rg.NEW_PROMPT and len(set(texts + ["a cat"])) == 4
    assert out["repeats_s"] == [1.0, 2.0, 3.0] and out["total_s"] == 2.0


def test_a_failed_warm_repeat_is_the_record(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    results = iter([{"kind": "warm", "status": "ok", "total_s": 2.0}, {"kind": "warm", "status": "error",
                                                                        "error": "OOM"}])
    monkeypatch.setattr(sr, "render", lambda *a: next(results))
    opts = argparse.Namespace(warm_repeats=3, timeout=1.0, work=tmp_path, drop_page_cache=False)
    out = sr.render_kind(_FakeServer(), {}, "warm", opts, tmp_path, "row", False)
    assert out == {"kind": "warm", "status": "error", "error": "OOM"}


def test_a_cached_pack_row_is_compared_with_native_under_the_same_cache(tmp_path: Path) -> None:
    rows = [_row("n", "native_best", 24.0, 40.0), _row("nc", "native_best_easycache", 24.0, 30.0, side="native",
                                                        step_cache="EasyCache"),
            _row("pc", "pack_easycache", 24.0, 20.0, side="pack", step_cache="EasyCache")]
    rr.compare(rows, tmp_path)
    assert (rows[2]["against"], rows[2]["ratio"]) == ("nc", 1.5)  # cache against cache
    assert (rows[1]["against"], rows[1]["ratio"]) == ("n", pytest.approx(1.333, abs=1e-3))  # what the cache gains
    row = sr.make_row("wan_t2v", "pack_easycache", 24.0)
    assert sr.head(row)["step_cache"] == "EasyCache"
    assert sr.head(sr.make_row("wan_t2v", "pack", 24.0))["step_cache"] is None
