"""The render scenario's API graphs: the shipped workflows converted node for node (``ui_to_api``, as the front end
sends them, so they cannot drift from what users load) with a row's card, file format and setup, and their native
equivalents (``to_native``: each pack node replaced by what ComfyUI's official template wires there)."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from typing import Any

from comfyui_lowvram_dit.cli.ui_graph import BYPASSED_MODES, FRONTEND_ONLY
from comfyui_lowvram_dit.cli.workflow import WORKFLOWS_DIR

WIDGET_TYPES = frozenset({"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"})
DYNAMIC_COMBO = "COMFY_DYNAMICCOMBO_V3"  # a combo whose chosen option brings widgets of its own (0.33.0's SaveVideo)
SAMPLERS = frozenset({"KSampler", "KSamplerAdvanced"})
DECODERS = frozenset({"VAEDecode", "LowVRAM_QwenImageDecode"})
SEED_INPUTS = ("seed", "noise_seed")
# Pack nodes that only change how a MODEL runs: native graphs leave them out (their model input goes straight on).
MODEL_PASS_THROUGH = frozenset({"LowVRAM_BlockSwap", "LowVRAM_Attention", "LowVRAM_TorchCompile", "LowVRAM_NanGuard"})
INT8_BACKEND = "lowvram 8-bit"
NEW_PROMPT = ", seen from a low angle in light rain"  # appended to the positive prompt: new text, same scene
LATENT_PREFIX = "render"  # SaveLatent's folder in the server's output


class GraphError(ValueError):
    """A shipped workflow or setup this module cannot turn into a render graph; the message names it."""


def node(class_type: str, title: str, /, **inputs: Any) -> dict:
    """One API-graph node."""
    return {"class_type": class_type, "inputs": inputs, "_meta": {"title": title}}


def _is_widget(spec: list) -> bool:
    """Whether an input spec from /object_info is a widget (a value in widgets_values) rather than a socket."""
    return bool(spec) and (isinstance(spec[0], list) or spec[0] in WIDGET_TYPES)


def _specs(inputs: dict, order: dict) -> list[tuple[str, list]]:
    """(name, spec) of a schema's inputs, required then optional, each section in ``input_order``'s order."""
    out = []
    for section in ("required", "optional"):
        specs = inputs.get(section) or {}
        out += [(name, specs.get(name) or []) for name in order.get(section) or list(specs)]
    return out


def _extra(spec: list) -> dict:
    return spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}


def widget_inputs(inputs: dict, values: list, order: dict | None = None, prefix: str = "") -> dict:
    """The inputs ``values`` (consumed) set, as the front end sends them: in schema order, a seed's control value
    skipped, a missing one at its default, a dynamic combo's chosen option's widgets after it as ``combo.widget``."""
    out: dict[str, Any] = {}
    for name, spec in _specs(inputs, order or {}):
        dynamic = bool(spec) and spec[0] == DYNAMIC_COMBO
        if not (_is_widget(spec) or dynamic):
            continue
        extra, key = _extra(spec), prefix + name
        if values:
            out[key] = values.pop(0)
            if extra.get("control_after_generate") and values:
                values.pop(0)  # 'fixed' / 'randomize': front-end only
        elif "default" in extra:
            out[key] = extra["default"]
        if dynamic and key in out:
            chosen = next((o for o in extra.get("options") or [] if o.get("key") == out[key]), {})
            out.update(widget_inputs(chosen.get("inputs") or {}, values, prefix=f"{key}."))
    return out


def ui_to_api(workflow: dict, object_info: dict, source: str = "workflow") -> dict:
    """A UI workflow without subgraphs as the API graph the front end queues: ids kept, each widget value on the
    input the node's schema names at its place, each link as ``[origin id, slot]``, notes left out."""
    if (workflow.get("definitions") or {}).get("subgraphs"):
        raise GraphError(f"{source}: subgraphs are not supported here (convert it with comfy-cli)")
    links = {int(lk[0]): lk for lk in workflow.get("links") or []}
    api: dict[str, dict] = {}
    for n in workflow["nodes"]:
        kind = n.get("type")
        if kind in FRONTEND_ONLY:
            continue
        if n.get("mode", 0) in BYPASSED_MODES:
            raise GraphError(f"{source}: node {n['id']} ({kind}) is bypassed or muted; un-bypass it or remove it")
        info = object_info.get(kind)
        if info is None:
            raise GraphError(f"{source}: node {n['id']} is a {kind}, which the node schemas do not list")
        inputs = widget_inputs(info.get("input", {}), list(n.get("widgets_values") or []), info.get("input_order"))
        for inp in n.get("inputs") or []:
            if inp.get("link") is not None:
                link = links[int(inp["link"])]
                inputs[inp["name"]] = [str(link[1]), int(link[2])]
        api[str(n["id"])] = node(kind, n.get("title") or kind, **inputs)
    return api


def shipped_workflow(name: str) -> dict:
    """workflows/<name>.json as a dict."""
    return json.loads((WORKFLOWS_DIR / f"{name}.json").read_text(encoding="utf-8"))


def ui_node_types(workflow: dict) -> set[str]:
    """The node types a UI workflow sends to the server (notes left out)."""
    return {n["type"] for n in workflow["nodes"] if n["type"] not in FRONTEND_ONLY}


def new_id(graph: dict) -> str:
    """A node id above every numeric id in ``graph``."""
    return str(max((int(k) for k in graph if k.isdigit()), default=0) + 1)


def rewire(graph: dict, old: list, new: list, skip: dict | None = None) -> None:
    """Every input fed by ``old`` ([id, slot]) is fed by ``new`` instead (``skip``: a node left as it is)."""
    for n in graph.values():
        for key, value in n["inputs"].items():
            if value == list(old) and n is not skip:
                n["inputs"][key] = list(new)


def bypass(graph: dict, nid: str) -> None:
    """Remove a MODEL -> MODEL node, its consumers fed by its model input."""
    rewire(graph, [nid, 0], graph[nid]["inputs"]["model"])
    del graph[nid]


def insert_after(graph: dict, source: list, new: dict) -> None:
    """Put ``new`` (a MODEL -> MODEL node) between ``source`` ([id, slot]) and everything it fed."""
    nid = new_id(graph)
    new["inputs"]["model"] = list(source)
    graph[nid] = new
    rewire(graph, source, [nid, 0], skip=new)


def of_type(graph: dict, *kinds: str) -> list[str]:
    """Ids of the nodes of these types, in id order."""
    return sorted((k for k, n in graph.items() if n["class_type"] in kinds), key=lambda k: (len(k), k))


def node_defaults(kind: str, object_info: dict, **overrides: Any) -> dict:
    """A node of ``kind`` with every widget at its schema default (a combo's first option) and ``overrides``."""
    info = object_info.get(kind)
    if info is None:
        raise GraphError(f"the node schemas do not list {kind}: is the pack loaded in this ComfyUI?")
    inputs = {}
    for name, spec in _specs(info["input"], {}):
        if _is_widget(spec):
            extra = _extra(spec)
            options = spec[0] if isinstance(spec[0], list) else extra.get("options")
            if "default" in extra:
                inputs[name] = extra["default"]
            elif options:
                inputs[name] = options[0]
    return node(kind, info.get("display_name") or kind, **{**inputs, **overrides})


@dataclass(frozen=True)
class RenderWorkflow:
    """One workflow the scenario renders: where its pack graph comes from and what a card and a file format change."""

    key: str  # the row-name prefix
    title: str  # the report's heading
    model: str  # the model as the results index names it
    shipped: str  # workflows/<shipped>.json ("" = built by edit_graph: Qwen-Image-Edit)
    budgets: dict[float | None, float]  # Block Swap vram_budget_gb per card (None: whole GPU), the note's table
    sixteen_bit: dict[str, str] = field(default_factory=dict)  # fp8 file -> its 16-bit file (format 'bf16')
    formats: tuple[str, ...] = ("fp8_scaled", "bf16", "pack_fp8")  # the first: the files the shipped workflow names
    layouts: tuple[str, ...] = ("fp8_scaled", "fp16", "pack_fp8")  # each format's diffusion model file layout
    four_step_loras: dict[str, str] = field(default_factory=dict)  # a derived 4-step variant: expert file -> LoRA
    swaps_blocks: bool = True  # has Block Swap nodes (setup pack_no_blockswap)

    @property
    def default_format(self) -> str:
        """The format of the files the shipped workflow names."""
        return self.formats[0]

    def layout(self, file_format: str) -> str:
        """The diffusion model file's layout in ``file_format``: the results index's ``file_format``."""
        return self.layouts[self.formats.index(file_format)]


BUDGETS = {8.0: 6.5, 12.0: 10.0, 16.0: 14.0, 24.0: 21.0, None: 0.0}  # wan22_*_a14b*.json's and qwen_image_t2i's table
WAN5B_BUDGETS = {8.0: 6.5, 12.0: 10.0, 16.0: 14.0, 24.0: 0.0, None: 0.0}  # workflows/wan22_ti2v_5b.json's note


WAN_16BIT = {k: {f"wan2.2_{k}_{e}_noise_14B_fp8_scaled.safetensors": f"wan2.2_{k}_{e}_noise_14B_fp16.safetensors"
                  for e in ("high", "low")} for k in ("t2v", "i2v")}  # fp8 file -> 16-bit file, per Wan 14B model
I2V_LORAS = {f"wan2.2_i2v_{e}_noise_14B_{f}.safetensors": f"wan2.2_i2v_lightx2v_4steps_lora_v1_{e}_noise.safetensors"
             for e in ("high", "low") for f in ("fp8_scaled", "fp16")}
QWEN_16BIT = {"qwen_image_fp8_e4m3fn.safetensors": "qwen_image_bf16.safetensors"}
# The official image_qwen_image_edit_2509 template: its files, steps, cfg and ModelSamplingAuraFlow shift
EDIT_UNET, EDIT_TEXT_ENCODER, EDIT_VAE = ("qwen_image_edit_2509_fp8_e4m3fn.safetensors",
                                          "qwen_2.5_vl_7b.safetensors", "qwen_image_vae.safetensors")
EDIT_STEPS, EDIT_CFG, EDIT_SHIFT, EDIT_SEED = 20, 2.5, 3.0, 42
EDIT_IMAGE = "lowvram_edit_bench.png"  # the reference image the runner writes into the server's input folder
EDIT_PROMPT = "Replace the cat with a dalmatian, keeping the environment and scene consistent"
T2V, I2V, TI2V, QWEN, EDIT = ("Wan 2.2 T2V-A14B", "Wan 2.2 I2V-A14B", "Wan 2.2 TI2V-5B", "Qwen-Image",
                               "Qwen-Image-Edit")
# ComfyUI-GGUF's UnetLoaderGGUF in place of the diffusion model's loader: format -> GGML type of the Linear weights
GGUF_TYPES = {"gguf_q8_0": "Q8_0", "gguf_q4_k": "Q4_K"}
QWEN_FORMATS = {"formats": ("fp8_scaled", "bf16", *GGUF_TYPES), "layouts": ("fp8_e4m3fn", "bf16", *GGUF_TYPES),
                "swaps_blocks": False}
WAN_T2V_FORMATS = {"formats": ("fp8_scaled", "bf16", "pack_fp8", *GGUF_TYPES),
                   "layouts": ("fp8_scaled", "fp16", "pack_fp8", *GGUF_TYPES)}
WORKFLOWS: dict[str, RenderWorkflow] = {w.key: w for w in (
    RenderWorkflow("wan_t2v_4step", "Wan 2.2 T2V-A14B 4-step", T2V, "wan22_t2v_a14b_4step", BUDGETS,
                   WAN_16BIT["t2v"], **WAN_T2V_FORMATS),
    RenderWorkflow("wan_t2v", "Wan 2.2 T2V-A14B", T2V, "wan22_t2v_a14b", BUDGETS, WAN_16BIT["t2v"],
                   **WAN_T2V_FORMATS),
    RenderWorkflow("wan_i2v", "Wan 2.2 I2V-A14B", I2V, "wan22_i2v_a14b", BUDGETS, WAN_16BIT["i2v"]),
    RenderWorkflow("wan_i2v_4step", "Wan 2.2 I2V-A14B 4-step", I2V, "wan22_i2v_a14b", BUDGETS,
                   WAN_16BIT["i2v"], four_step_loras=I2V_LORAS),
    RenderWorkflow("wan_ti2v_5b", "Wan 2.2 TI2V-5B", TI2V, "wan22_ti2v_5b", WAN5B_BUDGETS,
                   formats=("bf16", "pack_fp8", *GGUF_TYPES), layouts=("fp16", "pack_fp8", *GGUF_TYPES)),
    RenderWorkflow("qwen_t2i_4step", "Qwen-Image 4-step", QWEN, "qwen_image_t2i_4step", BUDGETS, QWEN_16BIT,
                   **QWEN_FORMATS),
    RenderWorkflow("qwen_t2i", "Qwen-Image", QWEN, "qwen_image_t2i", BUDGETS, QWEN_16BIT, **QWEN_FORMATS),
    RenderWorkflow("qwen_edit", "Qwen-Image-Edit 2509", EDIT, "", BUDGETS, formats=("fp8_scaled",),
                   layouts=("fp8_e4m3fn",), swaps_blocks=False),
)}


@dataclass(frozen=True)
class Setup:
    """How a row's graph differs from the shipped workflow (pack) or which native settings it runs."""

    native: bool
    what: str
    weight_dtype: str = "default"  # native UNETLoader
    ck_attention: bool = False  # server flag --use-ck-attention
    drop_block_swap: bool = False
    block_swap_mode: str | None = None  # every Block Swap node's dynamic_vram option (the shipped "auto" otherwise)
    attention: str | None = None  # every Attention node's backend (one is added where the workflow has none)
    compile: dict | None = None  # Torch Compile after each Attention node: its defaults with these inputs
    easycache: bool = False  # core's EasyCache (its defaults) on the MODEL right before each sampler
    batch_cfg: bool | None = None  # the Qwen-Image Staged Loader's batch_cfg (None: as shipped)
    cuda_graphs: bool = True  # False: server flag --disable-cuda-graphs (the pack's block graphs stand aside)

    def __post_init__(self) -> None:
        pack_only = (self.drop_block_swap, self.block_swap_mode, self.attention, self.compile, self.batch_cfg,
                     not self.cuda_graphs)
        if self.native and any(v not in (None, False) for v in pack_only):
            raise ValueError(f"native setup {self.what!r} sets a pack node's option; render_graph applies those to "
                             "every graph")


NATIVE_BEST = "UNETLoader fp8_e4m3fn_fast, --use-ck-attention"
EASYCACHE = "EasyCache (its defaults) before each sampler"
SETUPS: dict[str, Setup] = {
    "native_best": Setup(True, NATIVE_BEST, "fp8_e4m3fn_fast", True),
    "native_best_easycache": Setup(True, f"{NATIVE_BEST}, {EASYCACHE}", "fp8_e4m3fn_fast", True, easycache=True),
    "native_default": Setup(True, "UNETLoader default, default attention"),
    "pack": Setup(False, "as shipped"),
    "pack_no_blockswap": Setup(False, "Block Swap removed", drop_block_swap=True),
    "pack_stream": Setup(False, "Block Swap dynamic_vram = stream (auto's pick where RAM is short)",
                         block_swap_mode="stream"),
    "pack_int8": Setup(False, "Attention 8-bit", attention=INT8_BACKEND),
    # exact attention fixed: against `pack`, what auto's 8-bit candidate (its compile and timing) adds to a render
    "pack_cudnn": Setup(False, "Attention SDPA cuDNN (exact; no 8-bit kernels compiled or timed)",
                        attention="SDPA cuDNN"),
    "pack_compile": Setup(False, "+ Torch Compile (the node's defaults)", compile={}),
    "pack_no_batch_cfg": Setup(False, "Staged Loader batch_cfg off (each prompt its own model call)",
                               batch_cfg=False),
    "pack_compile_graphs": Setup(False, "+ Torch Compile reduce-overhead, CUDA graphs where no weight streams",
                                 compile={"mode": "reduce-overhead"}),
    "pack_easycache": Setup(False, f"+ {EASYCACHE}", easycache=True),
    # against `pack`: what the Qwen-Image blocks' CUDA graphs give (ComfyUI's own flag turns them off)
    "pack_no_graphs": Setup(False, "--disable-cuda-graphs (blocks run eagerly)", cuda_graphs=False),
}


def setup_applies(workflow: RenderWorkflow, setup: str, file_format: str) -> str | None:
    """Why ``setup`` with ``file_format`` is no row of ``workflow`` (None when it is one)."""
    s = SETUPS[setup]
    if file_format not in workflow.formats:
        return f"{workflow.key} has no {file_format} files (formats: {', '.join(workflow.formats)})"
    if (s.drop_block_swap or s.block_swap_mode) and not workflow.swaps_blocks:
        return f"{workflow.key}: Block Swap is part of its loader, it cannot be removed or set"
    if s.native and file_format == "pack_fp8":
        return "the pack's saved fp8 file is read by the Wan Loader only"
    if file_format == "pack_fp8" and not workflow.key.startswith("wan"):
        return "only the Wan Loader saves its quantized file"
    return None


def model_files(workflow: RenderWorkflow, file_format: str) -> list[str]:
    """The model files a row of ``workflow`` in ``file_format`` loads, as the graph names them."""
    if not workflow.shipped:
        return [EDIT_UNET, EDIT_TEXT_ENCODER, EDIT_VAE]
    from comfyui_lowvram_dit.cli.workflow_models import KNOWN_MODEL_FILES, referenced_model_files

    names = referenced_model_files(shipped_workflow(workflow.shipped))
    names |= {workflow.four_step_loras[n] for n in names if n in workflow.four_step_loras}
    if file_format in ("bf16", "pack_fp8"):
        names = {workflow.sixteen_bit.get(n, n) for n in names}
    if file_format in GGUF_TYPES:
        names = {gguf_name(n, file_format) if KNOWN_MODEL_FILES.get(n, ("",))[0] == "diffusion_models" else n
                 for n in names}
    return sorted(names)


def gguf_name(name: str, file_format: str) -> str:
    """``name`` with the GGML type in place of its dtype: ``wan2.2_t2v_high_noise_14B_Q8_0.gguf``."""
    stem = re.sub(r"_(fp8_scaled|fp8_e4m3fn|fp16|bf16)$", "", name.removesuffix(".safetensors"))
    return f"{stem}_{GGUF_TYPES[file_format]}.gguf"


def edit_graph(kind: str, budget: float, weight_dtype: str = "default") -> dict:
    """The Qwen-Image-Edit 2509 graph (no shipped workflow): the official template's nodes (``native``) or the pack's
    Qwen-Image Loader with Block Swap at the card and Qwen-Image-Edit Text Encode (``pack``)."""
    g: dict[str, dict] = {"1": node("LoadImage", "Load Image", image=EDIT_IMAGE),
                          "2": node("FluxKontextImageScale", "FluxKontextImageScale", image=["1", 0])}
    if kind == "native":
        g["3"] = node("UNETLoader", "Load Diffusion Model", unet_name=EDIT_UNET, weight_dtype=weight_dtype)
        g["4"] = node("CLIPLoader", "Load CLIP", clip_name=EDIT_TEXT_ENCODER, type="qwen_image", device="cpu")
        g["5"] = node("VAELoader", "Load VAE", vae_name=EDIT_VAE)
        for nid, text in (("6", EDIT_PROMPT), ("7", "")):
            g[nid] = node("TextEncodeQwenImageEditPlus", "TextEncodeQwenImageEditPlus", clip=["4", 0], prompt=text,
                          vae=["5", 0], image1=["2", 0])
        model, pos, neg, vae = ["3", 0], ["6", 0], ["7", 0], ["5", 0]
    else:
        g["3"] = node("LowVRAM_QwenImageLoader", "Qwen-Image Loader (LowVRAM)", unet_name=EDIT_UNET, vae_name=EDIT_VAE,
                      quantization="fp8 per-tensor", vram_budget_gb=budget, blocks_to_swap=-1, compute="auto")
        g["6"] = node("LowVRAM_QwenImageEditTextEncode", "Qwen-Image-Edit Text Encode (LowVRAM)",
                      clip_name=EDIT_TEXT_ENCODER, vae=["3", 1], positive=EDIT_PROMPT, negative="",
                      cache_embeddings=True, image1=["2", 0])
        model, pos, neg, vae = ["3", 0], ["6", 0], ["6", 1], ["3", 1]
    g["10"] = node("ModelSamplingAuraFlow", "ModelSamplingAuraFlow", model=model, shift=EDIT_SHIFT)
    g["11"] = node("CFGNorm", "CFGNorm", model=["10", 0], strength=1.0)
    g["12"] = node("VAEEncode", "VAE Encode", pixels=["2", 0], vae=vae)
    g["15"] = node("KSampler", "KSampler", model=["11", 0], positive=pos, negative=neg, latent_image=["12", 0],
                   seed=EDIT_SEED, steps=EDIT_STEPS, cfg=EDIT_CFG, sampler_name="euler", scheduler="simple",
                   denoise=1.0)
    g["17"] = node("VAEDecode", "VAE Decode", samples=["15", 0], vae=vae)
    g["19"] = node("SaveImage", "Save", images=["17", 0], filename_prefix=f"bench/{kind}_edit")
    return g


def _four_step(graph: dict, workflow: RenderWorkflow, object_info: dict) -> None:
    """A LoRA after each expert's loader and the sampling of the shipped T2V 4-step workflow, read from it."""
    ref = ui_to_api(shipped_workflow("wan22_t2v_a14b_4step"), object_info, "wan22_t2v_a14b_4step")
    strength = ref[of_type(ref, "LoraLoaderModelOnly")[0]]["inputs"]["strength_model"]
    for nid in of_type(graph, "LowVRAM_WanLoader"):
        lora = workflow.four_step_loras[graph[nid]["inputs"]["unet_name"]]
        insert_after(graph, [nid, 0], node("LoraLoaderModelOnly", "LoRA 4-step", model=None, lora_name=lora,
                                           strength_model=strength))
    keys = ("steps", "cfg", "start_at_step", "end_at_step")
    for mine, theirs in zip(of_type(graph, "KSamplerAdvanced"), of_type(ref, "KSamplerAdvanced"), strict=True):
        graph[mine]["inputs"].update({k: ref[theirs]["inputs"][k] for k in keys})
    shift = {ref[k]["inputs"]["shift"] for k in of_type(ref, "ModelSamplingSD3")}.pop()
    for nid in of_type(graph, "ModelSamplingSD3"):
        graph[nid]["inputs"]["shift"] = shift


NATIVE_TEXT = {"LowVRAM_WanTextEncode": "wan", "LowVRAM_QwenImageTextEncode": "qwen_image"}  # CLIPLoader type


def _text_pair(graph: dict, nid: str, clip_name: str, kind: str, positive: str, negative: str) -> None:
    """CLIPLoader + CLIPTextEncode x2 for the positive / negative outputs (0, 1) of pack text node ``nid``."""
    clip = new_id(graph)
    graph[clip] = node("CLIPLoader", "Load CLIP", clip_name=clip_name, type=kind, device="default")
    for slot, text, title in ((0, positive, "Positive Prompt"), (1, negative, "Negative Prompt")):
        enc = new_id(graph)
        graph[enc] = node("CLIPTextEncode", f"CLIP Text Encode ({title})", text=text, clip=[clip, 0])
        rewire(graph, [nid, slot], [enc, 0])


def split_loader(graph: dict, nid: str, weight_dtype: str = "default") -> None:
    """Pack loader ``nid`` as UNETLoader (same id); a Qwen-Image Loader's VAE output from a VAELoader."""
    i = graph[nid]["inputs"]
    graph[nid] = node("UNETLoader", "Load Diffusion Model", unet_name=i["unet_name"], weight_dtype=weight_dtype)
    if "vae_name" in i:
        vae = new_id(graph)
        graph[vae] = node("VAELoader", "Load VAE", vae_name=i["vae_name"])
        rewire(graph, [nid, 1], [vae, 0])


def to_native(graph: dict, weight_dtype: str) -> dict:
    """The native equivalent of a pack graph; GraphError naming a pack node it has no equivalent for."""
    g = copy.deepcopy(graph)
    for nid in list(g):
        n = g.get(nid)
        kind, i = (n["class_type"], n["inputs"]) if n else (None, {})
        if kind in ("LowVRAM_WanLoader", "LowVRAM_QwenImageLoader"):
            split_loader(g, nid, weight_dtype)
        elif kind in MODEL_PASS_THROUGH:
            bypass(g, nid)
        elif kind in NATIVE_TEXT:
            _text_pair(g, nid, i["clip_name"], NATIVE_TEXT[kind], i["positive"], i["negative"])
            del g[nid]
        elif kind == "LowVRAM_QwenImageDecode":
            g[nid] = node("VAEDecode", "VAE Decode", samples=i["samples"], vae=i["vae"])
        elif kind and kind.startswith("LowVRAM_"):
            raise GraphError(f"{kind}: no native equivalent is known to the render scenario; add one to to_native")
    return g


def node_types_needed(workflow: RenderWorkflow) -> set[str]:
    """Node types whose schemas ``render_graph`` reads for ``workflow``: the shipped workflow's nodes, the T2V 4-step
    one's (``_four_step``), the nodes it adds."""
    files = [shipped_workflow(w) for w in (workflow.shipped, "wan22_t2v_a14b_4step") if workflow.shipped]
    return set().union({"LowVRAM_Attention", "LowVRAM_TorchCompile", "KSamplerAdvanced", "LoraLoaderModelOnly",
                        "ModelSamplingSD3", "EasyCache"}, *map(ui_node_types, files))


def render_graph(workflow: RenderWorkflow, setup_name: str, card_gib: float | None, file_format: str,
                 object_info: dict, latent_prefix: str) -> dict:
    """The API graph of one row, plus a SaveLatent of the latent the decoder reads (for output comparisons)."""
    setup = SETUPS[setup_name]
    if reason := setup_applies(workflow, setup_name, file_format):
        raise GraphError(reason)
    if workflow.shipped:
        graph = ui_to_api(shipped_workflow(workflow.shipped), object_info, f"workflows/{workflow.shipped}.json")
        if workflow.four_step_loras:
            _four_step(graph, workflow, object_info)
        for n in graph.values():  # the Block Swap budget the workflow's note gives for the card
            if "vram_budget_gb" in n["inputs"]:
                n["inputs"]["vram_budget_gb"] = workflow.budgets[card_gib]
        graph = to_native(graph, setup.weight_dtype) if setup.native else graph
    else:
        graph = edit_graph("native" if setup.native else "pack", workflow.budgets[card_gib], setup.weight_dtype)
    # as the setup says (only pack setups set these, Setup checks): Block Swap, batch_cfg, Attention, Compile
    for nid in of_type(graph, "LowVRAM_BlockSwap") if setup.drop_block_swap else ():
        bypass(graph, nid)
    qwen_text = ("LowVRAM_QwenImageTextEncode", "LowVRAM_QwenImageEditTextEncode")
    for nid in of_type(graph, *qwen_text) if setup.batch_cfg is not None else ():
        graph[nid]["inputs"]["batch_cfg"] = setup.batch_cfg
    for nid in of_type(graph, "LowVRAM_BlockSwap") if setup.block_swap_mode else ():
        graph[nid]["inputs"]["dynamic_vram"] = setup.block_swap_mode
    if (setup.attention or setup.compile is not None) and not of_type(graph, "LowVRAM_Attention"):
        for nid in of_type(graph, "ModelSamplingSD3", "ModelSamplingAuraFlow"):  # one on each one's model input
            insert_after(graph, graph[nid]["inputs"]["model"], node_defaults("LowVRAM_Attention", object_info))
    for nid in of_type(graph, "LowVRAM_Attention"):
        if setup.attention:
            graph[nid]["inputs"]["backend"] = setup.attention
        if setup.compile is not None:
            insert_after(graph, [nid, 0], node_defaults("LowVRAM_TorchCompile", object_info, model=None,
                                                        **setup.compile))
    for n in graph.values() if file_format in ("bf16", "pack_fp8") else ():  # the 16-bit files' names
        for key, value in n["inputs"].items():
            if isinstance(value, str) and value in workflow.sixteen_bit:
                n["inputs"][key] = workflow.sixteen_bit[value]
    for nid in of_type(graph, "LowVRAM_QwenImageLoader") if file_format in GGUF_TYPES else ():  # swap as a node
        budget = graph[nid]["inputs"]["vram_budget_gb"]
        split_loader(graph, nid)
        insert_after(graph, [nid, 0], node_defaults("LowVRAM_BlockSwap", object_info, model=None,
                                                    vram_budget_gb=budget))
    for nid in of_type(graph, "LowVRAM_WanLoader", "UNETLoader") if file_format in GGUF_TYPES else ():
        graph[nid] = node("UnetLoaderGGUF", "Unet Loader (GGUF)",  # every node after it kept: Block Swap streams it
                          unet_name=gguf_name(graph[nid]["inputs"]["unet_name"], file_format))
    for sampler in of_type(graph, *SAMPLERS) if setup.easycache else ():  # on the MODEL right before each sampler
        nid = new_id(graph)
        graph[nid] = node_defaults("EasyCache", object_info, model=graph[sampler]["inputs"]["model"])
        graph[sampler]["inputs"]["model"] = [nid, 0]
    decoders = of_type(graph, *DECODERS)
    if not decoders:
        raise GraphError("the graph has no VAE decode node whose latent could be saved")
    graph[new_id(graph)] = node("SaveLatent", "Save final latent", samples=graph[decoders[0]]["inputs"]["samples"],
                                filename_prefix=f"{LATENT_PREFIX}/{latent_prefix}")
    return graph


def with_seed(graph: dict, offset: int) -> dict:
    """A copy of ``graph`` whose noise seeds are ``offset`` higher (samplers that add no noise left as they are)."""
    g = copy.deepcopy(graph)
    for n in g.values():
        for key in SEED_INPUTS:
            if key in n["inputs"] and n["inputs"].get("add_noise", "enable") != "disable":
                n["inputs"][key] = int(n["inputs"][key]) + offset
    return g


def with_new_prompt(graph: dict, suffix: str = NEW_PROMPT) -> dict:
    """A copy of ``graph`` whose positive prompt text ends in ``suffix`` (the node that encodes it runs again)."""
    g = copy.deepcopy(graph)
    changed = 0
    for nid in {g[k]["inputs"]["positive"][0] for k in of_type(g, *SAMPLERS)
                if isinstance(g[k]["inputs"].get("positive"), list)}:
        src = g[nid]
        while src["class_type"] in ("WanImageToVideo", "FluxKontextMultiReferenceLatentMethod"):  # conditioning pass
            src = g[(src["inputs"].get("positive") or src["inputs"]["conditioning"])[0]]
        for key in ("text", "positive", "prompt"):
            if isinstance(src["inputs"].get(key), str):
                src["inputs"][key] += suffix
                changed += 1
                break
    if not changed:
        raise GraphError("no positive prompt text found in the graph")
    return g
