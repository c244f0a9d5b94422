"""Rewrite a ComfyUI workflow to use this pack: ``python -m comfyui_lowvram_dit convert WORKFLOW.json``.

Made for ComfyUI's official Wan 2.2 and Qwen-Image templates (UI format, subgraphs included), it works on any
UI-format workflow and changes only what it recognises, in every graph (the table is in docs/convert.md): stock Wan
loaders become the Wan Loader + Block Swap + Attention, Wan CLIPLoader + prompt encoders one Wan Text Encode, Qwen-Image
(Edit) loaders and encoders the staged loaders + Attention. A rewritten node keeps its id, so links, promoted
subgraph widgets and LoRA chains stay; a graph it cannot rewrite is kept and the summary says why. Everything else
is kept as it is; converting a converted workflow changes nothing, and the input file is never written.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoints.safe_write import UnsafeTargetError, write_atomic
from ..offload.plan import BUDGET_MAX_GB
from .errors import InputError, one_line
from .inputs import read_json_file
from .ui_graph import BYPASSED_MODES, FRONTEND_ONLY, Graph, GraphError, Workflow
from .workflow_shape import RESAVE

PACK_CNR_ID = "comfyui-lowvram-dit"
FP8_CHOICES = {"per-tensor": "fp8 per-tensor", "block-wise": "fp8 block-wise", "none": "none"}
# Card VRAM the budget leaves for the desktop, the CUDA context and the other models of the workflow.
VRAM_RESERVE_GB = 2.0
MIN_BUDGET_GB = 1.0
VRAM_MAX_GB = BUDGET_MAX_GB + VRAM_RESERVE_GB  # the largest --vram whose budget the nodes accept
STAGED_NEGATIVE_DEFAULT = " "
WAN_LOADER_INPUTS = [("unet_name", "COMBO", True), ("quantization", "COMBO", True), ("block_size", "COMBO", True),
                     ("compute", "COMBO", True), ("save_quantized", "BOOLEAN", True)]
WAN_TEXT_INPUTS = [("clip_name", "COMBO", True), ("positive", "STRING", True), ("negative", "STRING", True),
                   ("cache_embeddings", "BOOLEAN", True)]
QWEN_LOADER_INPUTS = [("unet_name", "COMBO", True), ("vae_name", "COMBO", True), ("quantization", "COMBO", True),
                      ("vram_budget_gb", "FLOAT", True), ("blocks_to_swap", "INT", True), ("compute", "COMBO", True)]
QWEN_TEXT_INPUTS = WAN_TEXT_INPUTS  # clip_name, positive, negative, cache_embeddings (the options are optional)
EDIT_ENCODER = "TextEncodeQwenImageEditPlus"
EDIT_IMAGES = ("image1", "image2", "image3")
QWEN_EDIT_TEXT_INPUTS = [("clip_name", "COMBO", True), ("vae", "VAE", False), ("positive", "STRING", True),
                         ("negative", "STRING", True), ("cache_embeddings", "BOOLEAN", True),
                         *((name, "IMAGE", False) for name in EDIT_IMAGES)]
INSERT_OFFSET = (40.0, 140.0)  # where an inserted node goes, relative to the node it follows
WAN_FILE = re.compile(r"wan2[._][12][_-](t2v|i2v|ti2v)[_-]")  # official Wan 2.1 / 2.2 T2V, I2V, TI2V file names


class ConvertError(InputError):
    """The workflow cannot be converted; the message names the file or option (exit code 2)."""


@dataclass(frozen=True)
class ConvertOptions:
    """What the converted workflow uses."""

    fp8: str = "per-tensor"  # a FP8_CHOICES key
    vram_gb: float | None = None  # the card's VRAM; None: Block Swap uses what ComfyUI has free
    staged_text: bool = True  # Wan: CLIPLoader + CLIPTextEncode -> Wan Text Encode

    @property
    def budget_gb(self) -> float:
        """Block Swap's ``vram_budget_gb``: the card minus VRAM_RESERVE_GB (0 = what ComfyUI has free)."""
        return 0.0 if self.vram_gb is None else max(self.vram_gb - VRAM_RESERVE_GB, MIN_BUDGET_GB)


@dataclass
class Report:
    """What a conversion did, one line per change, and what it kept."""

    changes: list[str] = field(default_factory=list)
    kept: Counter = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"  {c}" for c in self.changes] or ["  nothing to convert (no stock Wan / Qwen-Image loaders found)"]
        if self.kept:
            kinds = ", ".join(f"{t} x{n}" if n > 1 else t for t, n in sorted(self.kept.items()))
            out.append(f"  kept {sum(self.kept.values())} other node(s) as they were: {kinds}")
        out += [f"  note: {n}" for n in self.notes]
        return out


def _pack_properties(node_type: str, old: dict | None = None) -> dict:
    props = {k: v for k, v in (old or {}).items() if k == "models"}  # download links of the files stay valid
    return {**props, "cnr_id": PACK_CNR_ID, "Node name for S&R": node_type}


def _set_inputs(graph: Graph, node: dict, spec: list[tuple[str, str, bool]], links: dict[str, dict | None]) -> None:
    """Give ``node`` the inputs of ``spec`` (name, type, is_widget), attaching ``links`` by input name.

    Links into the node's old inputs that are not reused are removed; widget inputs get an entry only when a
    link feeds them (the front end adds the others itself).
    """
    keep = {lk["id"] for lk in links.values() if lk is not None}
    labels = {inp.get("name"): inp.get("label") for inp in node.get("inputs") or []}
    for inp in node.get("inputs") or []:
        lk = graph.links.get(inp.get("link")) if inp.get("link") is not None else None
        if lk is not None and lk["id"] not in keep:
            graph.remove_link(lk)
    entries = []
    for name, kind, widget in spec:
        if widget and links.get(name) is None:
            continue
        entry = {"localized_name": name, "name": name, "type": kind, "link": None}
        if widget:
            entry["widget"] = {"name": name}
        if labels.get(name):
            entry["label"] = labels[name]
        entries.append(entry)
    node["inputs"] = entries
    for name, lk in links.items():
        if lk is not None:
            graph.set_target(lk, node, graph.input_slot(node, name))


def _set_outputs(graph: Graph, node: dict, spec: list[tuple[str, str]]) -> None:
    """Give ``node`` the outputs of ``spec`` (name, type), keeping the links already leaving each slot."""
    node["outputs"] = [{"localized_name": name, "name": name, "type": kind, "slot_index": i,
                        "links": [lk["id"] for lk in graph.out_links(node, i)] or None}
                       for i, (name, kind) in enumerate(spec)]


def _model_input() -> list[dict]:
    return [{"localized_name": "model", "name": "model", "type": "MODEL", "link": None}]


def _model_output() -> list[dict]:
    return [{"localized_name": "MODEL", "name": "MODEL", "type": "MODEL", "slot_index": 0, "links": None}]


def _insert_after(graph: Graph, node: dict, node_type: str, widgets: list, report: Report, what: str) -> dict:
    """Put a MODEL -> MODEL node right after output 0 of ``node``; it takes over that output's links."""
    consumers = graph.out_links(node, 0)
    x, y = _position(node)
    new = graph.add_node(node_type, [x + INSERT_OFFSET[0], y + INSERT_OFFSET[1]], widgets, _model_input(),
                         _model_output(), _pack_properties(node_type))
    for lk in consumers:
        graph.set_origin(lk, new, 0)
    graph.add_link(node, 0, new, 0, "MODEL")
    report.changes.append(f"{graph.name}: inserted node {new['id']} {node_type} ({what}) after node {node['id']}")
    return new


def _position(node: dict) -> tuple[float, float]:
    """A node's canvas position: ``[x, y]`` or an older workflow's ``{"0": x, "1": y}``; (0, 0) when unreadable."""
    pos = node.get("pos")
    pair = [pos.get("0"), pos.get("1")] if isinstance(pos, dict) else pos if isinstance(pos, list) else []
    ok = len(pair) >= 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in pair[:2])
    return (float(pair[0]), float(pair[1])) if ok else (0.0, 0.0)


def _followed_by_attention(graph: Graph, node: dict) -> bool:
    return any((graph.node(lk["target_id"]) or {}).get("type") == "LowVRAM_Attention" for lk in graph.out_links(node))


def _active(node: dict, node_type: str) -> bool:
    return node.get("type") == node_type and node.get("mode", 0) not in BYPASSED_MODES


def _widget(node: dict, index: int) -> object:
    values = node.get("widgets_values")
    return values[index] if isinstance(values, list) and len(values) > index else None


def _is_wan_file(name: object) -> bool:
    """A Wan 2.1 / 2.2 T2V, I2V or TI2V file (official names): what the Wan 2.2 Loader reads. Fun, VACE, S2V and
    other variants carry extra layers and stay on their stock loader."""
    return isinstance(name, str) and WAN_FILE.match(name.lower()) is not None


def _is_qwen_image_file(name: object) -> bool:
    return isinstance(name, str) and "qwen" in name.lower() and "image" in name.lower()


def _prompt_pair(graph: Graph, clip_loader: dict) -> tuple[dict, dict | None] | None:
    """The (positive, negative) CLIPTextEncode nodes a CLIPLoader feeds, or None when it feeds anything else.

    An encoder's role is the name of every input its output reaches (``positive`` / ``negative``), as in
    KSampler, KSamplerAdvanced and WanImageToVideo.
    """
    encoders = {lk["target_id"]: graph.node(lk["target_id"]) for lk in graph.out_links(clip_loader, 0)}
    roles: dict[str, dict] = {}
    for enc in encoders.values():
        if enc is None or not _active(enc, "CLIPTextEncode"):
            return None
        names = {graph.target_input_name(lk) for lk in graph.out_links(enc, 0)}
        role = next(iter(names)) if len(names) == 1 else None
        if role not in ("positive", "negative") or role in roles:
            return None
        roles[role] = enc
    return (roles["positive"], roles.get("negative")) if "positive" in roles else None


def _absorb_prompts(wf: Workflow, graph: Graph, target: dict, clip_loader: dict, pos: dict, neg: dict | None) -> None:
    """Move the text side onto ``target`` (a text node, already given its new type and widgets) and drop what it
    replaces: the CLIPLoader's ``clip_name`` and the encoders' ``text`` widget links go to ``target``'s inputs
    clip_name / positive / negative, the encoders' outputs leave ``target``'s outputs 0 and 1, promoted subgraph
    widgets follow, and the loader and encoders go."""
    moved = {"clip_name": graph.input_link(clip_loader, "clip_name"), "positive": graph.input_link(pos, "text"),
             "negative": graph.input_link(neg, "text") if neg else None}
    pos_out, neg_out = graph.out_links(pos, 0), graph.out_links(neg, 0) if neg else []
    spec = {"LowVRAM_WanTextEncode": WAN_TEXT_INPUTS, "LowVRAM_QwenImageTextEncode": QWEN_TEXT_INPUTS}[target["type"]]
    _set_inputs(graph, target, spec, moved)
    _set_outputs(graph, target, [("positive", "CONDITIONING"), ("negative", "CONDITIONING")])
    for lk, slot in [*((lk, 0) for lk in pos_out), *((lk, 1) for lk in neg_out)]:
        if (lk["origin_id"], lk["origin_slot"]) != (target["id"], slot):
            graph.set_origin(lk, target, slot)
    for old in (clip_loader, pos, neg):
        if old is not None and old is not target:
            graph.remove_node(old)
    wf.rename_proxy_widget((clip_loader["id"], "clip_name"), (target["id"], "clip_name"))
    wf.rename_proxy_widget((pos["id"], "text"), (target["id"], "positive"))
    if neg is not None:
        wf.rename_proxy_widget((neg["id"], "text"), (target["id"], "negative"))


def _retype(node: dict, node_type: str, widgets: list) -> str:
    """Turn ``node`` into ``node_type`` with these widget values (its id, position and links stay); old type."""
    old = node["type"]
    node["type"], node["widgets_values"] = node_type, widgets
    node["properties"] = _pack_properties(node_type, node.get("properties"))
    node.pop("title", None)  # the old title names the old node ("CLIP Text Encode (Positive Prompt)")
    return old


def _convert_wan_text(wf: Workflow, graph: Graph, clip_loader: dict, report: Report) -> None:
    pair = _prompt_pair(graph, clip_loader)
    if pair is None:
        report.notes.append(f"{graph.name}: CLIPLoader {clip_loader['id']} kept: it feeds more than one "
                            "positive and one negative CLIPTextEncode")
        return
    pos, neg = pair
    widgets = [_widget(clip_loader, 0), _widget(pos, 0) or "", (_widget(neg, 0) if neg else "") or "", True,
               "auto"]  # ..., cache_embeddings, device
    _retype(pos, "LowVRAM_WanTextEncode", widgets)
    _absorb_prompts(wf, graph, pos, clip_loader, pos, neg)
    gone = f"CLIPLoader {clip_loader['id']} + CLIPTextEncode {pos['id']}" + (f", {neg['id']}" if neg else "")
    report.changes.append(f"{graph.name}: replaced {gone} -> node {pos['id']} LowVRAM_WanTextEncode "
                          "(umT5 where ComfyUI runs text encoders, embeddings cached)")


def _convert_wan_loader(graph: Graph, node: dict, opts: ConvertOptions, report: Report) -> None:
    unet_link = graph.input_link(node, "unet_name")
    _retype(node, "LowVRAM_WanLoader", [_widget(node, 0), FP8_CHOICES[opts.fp8], "128", "auto", False])
    _set_inputs(graph, node, WAN_LOADER_INPUTS, {"unet_name": unet_link})
    report.changes.append(f"{graph.name}: replaced node {node['id']} UNETLoader -> LowVRAM_WanLoader "
                          f"({_widget(node, 0)}, {FP8_CHOICES[opts.fp8]})")
    swap = _insert_after(graph, node, "LowVRAM_BlockSwap", [opts.budget_gb, -1, 1, True, False, False, "auto"], report,
                         f"vram_budget_gb {opts.budget_gb:g}")
    _insert_after(graph, swap, "LowVRAM_Attention", ["auto"], report, "backend auto")


def _find_one(graph: Graph, node_type: str, widget_index: int, value: str) -> dict | None:
    found = [n for n in graph.nodes if _active(n, node_type) and _widget(n, widget_index) == value]
    return found[0] if len(found) == 1 else None


def _conditioning_role(graph: Graph, encoder: dict) -> str | None:
    """``positive`` or ``negative``: the name of every such input the encoder's conditioning reaches, following
    nodes that pass CONDITIONING on (FluxKontextMultiReferenceLatentMethod...); None when mixed or unknown."""
    roles: set[str | None] = set()
    seen, todo = {encoder["id"]}, [encoder]
    while todo:
        node = todo.pop()
        for slot, out in enumerate(node.get("outputs") or []):
            if out.get("type") != "CONDITIONING":
                continue
            for lk in graph.out_links(node, slot):
                name, target = graph.target_input_name(lk), graph.node(lk["target_id"])
                if name in ("positive", "negative") or target is None:  # None: leaves the subgraph
                    roles.add(name if target is not None else None)
                elif target["id"] not in seen:
                    seen.add(target["id"])
                    todo.append(target)
    return next(iter(roles)) if len(roles) == 1 else None


def _edit_pair(graph: Graph, clip_loader: dict) -> tuple[dict, dict] | None:
    """The (positive, negative) TextEncodeQwenImageEditPlus a CLIPLoader feeds, or None when it feeds anything
    else (or not exactly one encoder of each role)."""
    roles: dict[str, dict] = {}
    for lk in graph.out_links(clip_loader, 0):
        enc = graph.node(lk["target_id"])
        if enc is None or not _active(enc, EDIT_ENCODER) or graph.target_input_name(lk) != "clip":
            return None
        role = _conditioning_role(graph, enc)
        if role is None or role in roles:
            return None
        roles[role] = enc
    return (roles["positive"], roles["negative"]) if len(roles) == 2 else None


def _origin(link: dict | None) -> tuple[int, int] | None:
    return None if link is None else (link["origin_id"], link["origin_slot"])


def _edit_problem(graph: Graph, pos: dict, neg: dict, vae_loader: dict) -> str:
    """Why this Edit graph cannot become the staged loader ("" when it can)."""
    for name in EDIT_IMAGES:
        if _origin(graph.input_link(pos, name)) != _origin(graph.input_link(neg, name)):
            return f"the positive and negative {EDIT_ENCODER} get different {name} inputs"
    for enc in (pos, neg):
        if _origin(graph.input_link(enc, "vae")) != (vae_loader["id"], 0):
            return f"{EDIT_ENCODER} {enc['id']} does not take its vae from VAE Loader {vae_loader['id']}"
    return ""


def _to_qwen_loader(wf: Workflow, graph: Graph, unet: dict, vae_loader: dict, opts: ConvertOptions) -> None:
    """UNETLoader + VAELoader -> Qwen-Image Loader (``unet``'s id, the VAE Loader's file). Its VAE output feeds what
    the VAE Loader fed, so the VAE loads once; the VAE Loader goes."""
    vae_outs = graph.out_links(vae_loader, 0)
    _retype(unet, "LowVRAM_QwenImageLoader", [_widget(unet, 0), _widget(vae_loader, 0), FP8_CHOICES[opts.fp8],
                                              opts.budget_gb, -1, "auto"])  # ..., blocks_to_swap, compute
    _set_inputs(graph, unet, QWEN_LOADER_INPUTS, {"unet_name": graph.input_link(unet, "unet_name"),
                                                  "vae_name": graph.input_link(vae_loader, "vae_name")})
    _set_outputs(graph, unet, [("MODEL", "MODEL"), ("VAE", "VAE")])
    for lk in vae_outs:
        graph.set_origin(lk, unet, 1)
    graph.remove_node(vae_loader)
    wf.rename_proxy_widget((vae_loader["id"], "vae_name"), (unet["id"], "vae_name"))


def _convert_qwen_edit(wf: Workflow, graph: Graph, unet: dict, clip_loader: dict, pair: tuple[dict, dict],
                       vae_loader: dict, opts: ConvertOptions, report: Report) -> None:
    """UNETLoader + VAELoader -> Qwen-Image Loader (``unet``'s id, its VAE output feeding what the VAE Loader fed), and
    CLIPLoader + the two Edit encoders -> Qwen-Image-Edit Text Encode (the positive encoder's id)."""
    pos, neg = pair  # the negative's image links duplicate the positive's (_edit_problem): they go with it
    neg_outs = graph.out_links(neg, 0)
    text_links = {"clip_name": graph.input_link(clip_loader, "clip_name"), "vae": graph.input_link(pos, "vae"),
                  "positive": graph.input_link(pos, "prompt"), "negative": graph.input_link(neg, "prompt"),
                  **{n: graph.input_link(pos, n) for n in EDIT_IMAGES}}
    _to_qwen_loader(wf, graph, unet, vae_loader, opts)  # the encoders' vae inputs now come from the loader
    _retype(pos, "LowVRAM_QwenImageEditTextEncode", [_widget(clip_loader, 0), _widget(pos, 0) or "",
                                                     _widget(neg, 0) or "", True, "auto",
                                                     True])  # ..., cache_embeddings, text_encoder_device, batch_cfg
    _set_inputs(graph, pos, QWEN_EDIT_TEXT_INPUTS, text_links)
    _set_outputs(graph, pos, [("positive", "CONDITIONING"), ("negative", "CONDITIONING")])
    for lk in neg_outs:
        graph.set_origin(lk, pos, 1)
    for old in (clip_loader, neg):
        graph.remove_node(old)
    for old, widget, new in ((clip_loader, "clip_name", "clip_name"), (pos, "prompt", "positive"),
                             (neg, "prompt", "negative")):
        wf.rename_proxy_widget((old["id"], widget), (pos["id"], new))
    report.changes.append(f"{graph.name}: replaced UNETLoader {unet['id']} + VAELoader {vae_loader['id']} -> node "
                          f"{unet['id']} LowVRAM_QwenImageLoader ({FP8_CHOICES[opts.fp8]}, vram_budget_gb "
                          f"{opts.budget_gb:g}) and CLIPLoader {clip_loader['id']} + {EDIT_ENCODER} {pos['id']}, "
                          f"{neg['id']} -> node {pos['id']} LowVRAM_QwenImageEditTextEncode (text and images encoded "
                          "where ComfyUI runs text encoders; a new instruction re-runs only this node)")
    _insert_after(graph, unet, "LowVRAM_Attention", ["auto"], report, "backend auto")


def _keep_qwen_loader(graph: Graph, unet: dict, why: str, report: Report) -> None:
    """Leave a Qwen-Image UNETLoader stock (once) with a note, and put Attention auto after it."""
    if not _followed_by_attention(graph, unet):
        report.notes.append(f"{graph.name}: UNETLoader {unet['id']} ({_widget(unet, 0)}) kept: {why}, so only "
                            "Attention auto is added")
        _insert_after(graph, unet, "LowVRAM_Attention", ["auto"], report, "backend auto")


def _convert_qwen(wf: Workflow, graph: Graph, unet: dict, opts: ConvertOptions, report: Report) -> None:
    """Qwen-Image text-to-image -> Qwen-Image Loader + Qwen-Image Text Encode, Edit -> Qwen-Image Loader +
    Qwen-Image-Edit Text Encode; other Qwen-Image graphs keep the loader + Attention."""
    clip_loader = _find_one(graph, "CLIPLoader", 1, "qwen_image")
    vae_loaders = [n for n in graph.nodes if _active(n, "VAELoader")]
    edit = _edit_pair(graph, clip_loader) if clip_loader else None
    if edit is not None and len(vae_loaders) == 1:
        problem = _edit_problem(graph, *edit, vae_loaders[0])
        if problem:
            _keep_qwen_loader(graph, unet, problem, report)
        else:
            _convert_qwen_edit(wf, graph, unet, clip_loader, edit, vae_loaders[0], opts, report)
        return
    pair = _prompt_pair(graph, clip_loader) if clip_loader else None
    if pair is None or len(vae_loaders) != 1:
        _keep_qwen_loader(graph, unet, "its text encoding is not a CLIPLoader + positive/negative CLIPTextEncode "
                          f"pair or {EDIT_ENCODER} pair (with one VAE Loader), which the pack's staged loaders "
                          "replace", report)
        return
    pos, neg = pair
    vae = vae_loaders[0]
    _to_qwen_loader(wf, graph, unet, vae, opts)
    widgets = [_widget(clip_loader, 0), _widget(pos, 0) or "",
               (_widget(neg, 0) if neg else "") or STAGED_NEGATIVE_DEFAULT, True, "auto",
               True]  # ..., cache_embeddings, text_encoder_device, batch_cfg
    _retype(pos, "LowVRAM_QwenImageTextEncode", widgets)
    gone = f"CLIPLoader {clip_loader['id']} + CLIPTextEncode {pos['id']}" + (f", {neg['id']}" if neg else "")
    _absorb_prompts(wf, graph, pos, clip_loader, pos, neg)
    report.changes.append(f"{graph.name}: replaced UNETLoader {unet['id']} + VAELoader {vae['id']} -> node "
                          f"{unet['id']} LowVRAM_QwenImageLoader ({FP8_CHOICES[opts.fp8]}, vram_budget_gb "
                          f"{opts.budget_gb:g}) and {gone} -> node {pos['id']} LowVRAM_QwenImageTextEncode (a new "
                          "prompt re-runs only this node)")
    _insert_after(graph, unet, "LowVRAM_Attention", ["auto"], report, "backend auto")


def _check_options(opts: ConvertOptions) -> None:
    if opts.fp8 not in FP8_CHOICES:
        raise ConvertError(f"--fp8 {opts.fp8!r}: choose one of {', '.join(FP8_CHOICES)}")
    vram = opts.vram_gb
    if vram is not None and (isinstance(vram, bool) or not isinstance(vram, (int, float))
                             or not math.isfinite(vram) or not 0 < vram <= VRAM_MAX_GB):
        raise ConvertError(f"--vram {vram}: give the card's VRAM in GB, a number above 0 and at most "
                           f"{VRAM_MAX_GB:g}")


def convert_workflow(workflow: dict, opts: ConvertOptions = ConvertOptions(), source: str = "workflow") -> Report:
    """Convert ``workflow`` (a UI-format dict) in place; returns what was done. Raises ConvertError on bad input."""
    _check_options(opts)
    try:
        wf = Workflow(workflow, source)
    except GraphError as exc:
        raise ConvertError(str(exc)) from None
    try:
        return _convert(wf, opts)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:  # a shape the checks let through
        raise ConvertError(f"{source}: cannot be converted ({one_line(exc)}); {RESAVE}") from None


def _convert(wf: Workflow, opts: ConvertOptions) -> Report:
    report = Report()
    before = {id(n): n.get("type") for g in wf.graphs() for n in g.nodes}
    for graph in wf.graphs():
        for node in list(graph.nodes):
            if node not in graph.nodes:
                continue  # removed by an earlier rewrite
            if opts.staged_text and _active(node, "CLIPLoader") and _widget(node, 1) == "wan":
                _convert_wan_text(wf, graph, node, report)
        for node in list(graph.nodes):
            if _active(node, "UNETLoader") and _is_wan_file(_widget(node, 0)):
                _convert_wan_loader(graph, node, opts, report)
            elif _active(node, "UNETLoader") and "wan" in str(_widget(node, 0)).lower():
                report.notes.append(f"{graph.name}: UNETLoader {node['id']} ({_widget(node, 0)}) kept: not a Wan "
                                    "2.1/2.2 T2V, I2V or TI2V file name the Wan 2.2 Loader is made for")
            elif _active(node, "UNETLoader") and _is_qwen_image_file(_widget(node, 0)):
                _convert_qwen(wf, graph, node, opts, report)
    wf.finish()
    subgraphs = wf.subgraph_ids()
    for graph in wf.graphs():
        for node in graph.nodes:
            kind = str(node.get("type"))
            if before.get(id(node), "") == kind and kind not in FRONTEND_ONLY and kind not in subgraphs:
                report.kept[kind] += 1
    return report


def default_output(path: Path) -> Path:
    """``<stem>_lowvram.json`` beside the input."""
    return path.with_name(f"{path.stem}_lowvram.json")


def convert_file(src: Path, dst: Path | None = None, opts: ConvertOptions = ConvertOptions(),
                 force: bool = False) -> tuple[Path, Report]:
    """Convert ``src`` into ``dst`` (default beside it); never writes ``src``, refuses an existing ``dst``
    unless ``force``. Returns the path written and the report."""
    dst = dst or default_output(src)
    workflow = read_json_file(src)  # a missing file, a folder, a FIFO or non-JSON: an InputError naming it
    if os.path.realpath(dst) == os.path.realpath(src):  # realpath: a link loop is no error here
        raise ConvertError(f"{dst}: that is the input file; the converter never overwrites its input (pick -o)")
    if os.path.lexists(dst) and not force:
        raise ConvertError(f"{dst} exists; pass --force to replace it or -o for another name")
    report = convert_workflow(workflow, opts, str(src))
    dst.parent.mkdir(parents=True, exist_ok=True)
    # a half-written file never takes the output's name; --force is the user's leave to replace a regular file,
    # never a link or a folder
    text = json.dumps(workflow, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    try:
        write_atomic(dst, text, (lambda _p: True) if force else None)
    except UnsafeTargetError as exc:
        raise ConvertError(str(exc)) from None
    return dst, report


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m comfyui_lowvram_dit convert", description=__doc__.splitlines()[0],
        epilog="Load the output in ComfyUI (Workflow > Open) or run it: python -m comfyui_lowvram_dit run OUT.json")
    p.add_argument("workflow", type=Path, help="a UI-format workflow, e.g. an official template such as "
                   "video_wan2_2_14B_t2v.json (package comfyui-workflow-templates-json)")
    p.add_argument("-o", "--output", type=Path, default=None,
                   help="where to write the converted workflow (default: <name>_lowvram.json beside the input)")
    p.add_argument("--vram", type=float, default=None, metavar="GB",
                   help=f"your card's VRAM in GB: Block Swap (and the Qwen-Image staged loader) get a budget of "
                        f"GB - {VRAM_RESERVE_GB:g} (at least {MIN_BUDGET_GB:g}); default: budget 0 = whatever "
                        "ComfyUI has free when the model loads")
    p.add_argument("--fp8", choices=list(FP8_CHOICES), default="per-tensor",
                   help="quantization of the pack's loaders: per-tensor (default; fp8 matmul on RTX 40xx/50xx and "
                        "H100-class cards), block-wise (lower error, fp8 matmul on Hopper only), none (as stored)")
    p.add_argument("--keep-text-encoders", action="store_true",
                   help="Wan: keep CLIPLoader + CLIPTextEncode (text on the GPU) instead of Wan Text Encode")
    p.add_argument("--force", action="store_true", help="replace the output file if it exists")
    return p


def cli(argv: list[str]) -> int:
    """Entry point of ``python -m comfyui_lowvram_dit convert`` (a failure raises ConvertError: cli/main.py)."""
    args = _parser().parse_args(argv)
    opts = ConvertOptions(fp8=args.fp8, vram_gb=args.vram, staged_text=not args.keep_text_encoders)
    dst, report = convert_file(args.workflow, args.output, opts, args.force)
    print(f"{args.workflow} -> {dst}")
    print("\n".join(report.lines()))
    return 0
