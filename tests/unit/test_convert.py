"""``convert`` on ComfyUI's official Wan 2.2 and Qwen-Image templates (installed package, no server).

Checks on the real templates: every pack node is wired where the stock node was (same consumers, promoted
subgraph widgets moved with it), every other node and link is kept byte for byte, subgraphs are converted, links
stay consistent on both sides, a second conversion changes nothing, the input is never written and ``--vram``
reaches Block Swap. The end-to-end runs are in tests/comfyui/test_comfyui_templates.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from comfyui_lowvram_dit.cli import convert
from comfyui_lowvram_dit.cli.main import main
from template_files import QWEN_TEMPLATES, TEMPLATES, WAN_TEMPLATES, graphs, link_problems, links_of, load_template

REPLACED = {"UNETLoader", "CLIPLoader", "CLIPTextEncode", "TextEncodeQwenImageEditPlus", "VAELoader"}
EDIT_TEMPLATES = [n for n in QWEN_TEMPLATES if "edit" in n]


def _converted(name: str, **opts: object) -> tuple[dict, dict, convert.Report]:
    original = load_template(name)
    work = copy.deepcopy(original)
    report = convert.convert_workflow(work, convert.ConvertOptions(**opts), name)
    return original, work, report


def _nodes(workflow: dict) -> dict[int, tuple[dict, dict]]:
    return {n["id"]: (n, g) for _, g in graphs(workflow) for n in g["nodes"]}


def _consumers(graph: dict, node_id: int, slot: int = 0) -> set[tuple[int, int]]:
    return {(lk["target_id"], lk["target_slot"]) for lk in links_of(graph).values()
            if lk["origin_id"] == node_id and lk["origin_slot"] == slot}


def _chain(graph: dict, node_id: int, types: list[str]) -> int:
    """Follow output 0 through nodes of ``types`` in order; returns the last node's id."""
    nodes = {n["id"]: n for n in graph["nodes"]}
    for kind in types:
        (target, slot), = _consumers(graph, node_id)
        assert nodes[target]["type"] == kind and slot == 0, (node_id, nodes[target]["type"], kind)
        node_id = target
    return node_id


@pytest.mark.parametrize("name", TEMPLATES)
def test_links_consistent_and_ids_fresh(name: str) -> None:
    original, work, report = _converted(name, vram_gb=8)
    assert link_problems(original) == []  # the check itself accepts the official file
    assert link_problems(work) == [], report.lines()
    ids = [n["id"] for _, g in graphs(work) for n in g["nodes"]]
    assert work["last_node_id"] >= max(ids)
    assert all(g.get("state", {}).get("lastNodeId", work["last_node_id"]) == work["last_node_id"]
               for _, g in graphs(work)[1:])


@pytest.mark.parametrize("name", WAN_TEMPLATES)
def test_wan_loaders_get_fp8_block_swap_attention_with_same_consumers(name: str) -> None:
    original, work, _ = _converted(name, vram_gb=8, fp8="block-wise")
    before, after = _nodes(original), _nodes(work)
    unets = [i for i, (n, _) in before.items() if n["type"] == "UNETLoader"]
    assert unets
    for uid in unets:
        node, graph = after[uid]
        old_graph = before[uid][1]
        assert node["type"] == "LowVRAM_WanLoader"
        assert node["widgets_values"] == [before[uid][0]["widgets_values"][0], "fp8 block-wise", "128", "auto", False]
        last = _chain(graph, uid, ["LowVRAM_BlockSwap", "LowVRAM_Attention"])
        swap = next(n for n in graph["nodes"] if n["type"] == "LowVRAM_BlockSwap" and _consumers(graph, n["id"]) ==
                    {(last, 0)})
        assert swap["widgets_values"][:2] == [6.0, -1]  # --vram 8 -> budget 8 - 2 GB, fewest blocks
        assert _consumers(graph, last) == _consumers(old_graph, uid)
        assert not any(n["type"] == "UNETLoader" for _, g in graphs(work) for n in g["nodes"])


@pytest.mark.parametrize("name", WAN_TEMPLATES)
def test_wan_text_encode_takes_over_both_prompts(name: str) -> None:
    original, work, _ = _converted(name)
    before, after = _nodes(original), _nodes(work)
    (tid, (text, graph)), = [(i, v) for i, v in after.items() if v[0]["type"] == "LowVRAM_WanTextEncode"]
    old_graph = before[tid][1]
    encoders = [i for i, (n, g) in before.items() if n["type"] == "CLIPTextEncode"]
    roles = {}
    for eid in encoders:
        names = {before[t][0]["inputs"][s]["name"] for t, s in _consumers(old_graph, eid)}
        roles[names.pop()] = eid
    assert _consumers(graph, tid, 0) == _consumers(old_graph, roles["positive"])
    assert _consumers(graph, tid, 1) == _consumers(old_graph, roles["negative"])
    clip = next(n for n, _ in before.values() if n["type"] == "CLIPLoader")
    pos_text = before[roles["positive"]][0]["widgets_values"][0]
    assert text["widgets_values"] == [clip["widgets_values"][0], pos_text,
                                      before[roles["negative"]][0]["widgets_values"][0], True, "auto"]
    assert not any(n["type"] in ("CLIPLoader", "CLIPTextEncode") for n, _ in after.values())
    # promoted widgets (subgraph inputs and proxyWidgets) now feed the new node's own widgets
    widget_names = {inp["name"] for inp in text["inputs"]}
    for node, _ in after.values():
        for target, widget in (node.get("properties") or {}).get("proxyWidgets") or []:
            assert int(target) in after, (target, widget)
            if int(target) == tid:
                assert widget in ("clip_name", "positive", "negative")
    assert "clip_name" in widget_names or name == "video_wan2_2_5B_ti2v"  # subgraph templates promote clip_name


@pytest.mark.parametrize("name", TEMPLATES)
def test_every_other_node_and_link_is_kept(name: str) -> None:
    original, work, report = _converted(name, vram_gb=12)
    before, after = _nodes(original), _nodes(work)
    replaced = {i for i, (n, _) in before.items() if n["type"] in REPLACED and (i not in after or after[i][0] != n)}
    for nid, (node, old_graph) in before.items():
        if nid in replaced:
            continue
        kept, old = copy.deepcopy(after[nid][0]), copy.deepcopy(node)
        for new_out, old_out in zip(kept.get("outputs") or [], old.get("outputs") or [], strict=True):
            # a link may go only where it ended at a replaced node (an Edit encoder's duplicate image link)
            old_ids, new_ids = set(old_out.pop("links", None) or []), set(new_out.pop("links", None) or [])
            assert new_ids <= old_ids, (nid, new_ids - old_ids)
            assert all(links_of(old_graph)[i]["target_id"] in replaced for i in old_ids - new_ids), nid
        new_proxies = kept.get("properties", {}).pop("proxyWidgets", None)
        old_proxies = old.get("properties", {}).pop("proxyWidgets", None)
        assert kept == old, f"node {nid} {node['type']} changed"
        for new_p, old_p in zip(new_proxies or [], old_proxies or [], strict=True):  # only moved promoted widgets
            assert new_p == old_p or int(old_p[0]) in replaced, (new_p, old_p)
    for (gname, old), (_, new) in zip(graphs(original), graphs(work), strict=True):
        old_links, new_links = links_of(old), links_of(new)
        for lid, lk in old_links.items():
            ends = {lk["origin_id"], lk["target_id"]}
            if ends & replaced:
                continue
            assert new_links.get(lid) == lk, f"{gname}: link {lid} changed"
    assert sum(report.kept.values()) >= len(before) - len(replaced) - sum(
        1 for n, _ in before.values() if n["type"] in ("MarkdownNote", "Note")) - 1


@pytest.mark.parametrize("name", TEMPLATES)
def test_converting_twice_changes_nothing(name: str) -> None:
    _, once, _ = _converted(name, vram_gb=8)
    twice = copy.deepcopy(once)
    report = convert.convert_workflow(twice, convert.ConvertOptions(vram_gb=8), name)
    assert twice == once
    assert report.changes == []


def test_qwen_image_t2i_becomes_the_qwen_image_loader_and_text_encode() -> None:
    """UNETLoader + VAELoader -> Qwen-Image Loader (then Attention auto; its VAE feeds the decode), the CLIPLoader +
    CLIPTextEncode pair -> Qwen-Image Text Encode feeding both samplers' conditioning: a new prompt re-runs only the
    text node."""
    original, work, report = _converted("image_qwen_image", vram_gb=16)
    before, after = _nodes(original), _nodes(work)
    (sid, (loader, graph)), = [(i, v) for i, v in after.items() if v[0]["type"] == "LowVRAM_QwenImageLoader"]
    assert before[sid][0]["type"] == "UNETLoader"
    (vid, (vae, old_graph)), = [(i, v) for i, v in before.items() if v[0]["type"] == "VAELoader"]
    assert vid not in after and not any(n["type"] == "VAELoader" for n, _ in after.values())
    assert loader["widgets_values"] == [before[sid][0]["widgets_values"][0], vae["widgets_values"][0],
                                        "fp8 per-tensor", 14.0, -1, "auto"]
    assert _consumers(graph, sid, 1) == _consumers(old_graph, vid)  # the loader's VAE feeds the decode
    assert [o["type"] for o in loader["outputs"]] == ["MODEL", "VAE"]
    (tid, (text, _)), = [(i, v) for i, v in after.items() if v[0]["type"] == "LowVRAM_QwenImageTextEncode"]
    clip_name, positive, negative, cache, te_device, batch_cfg = text["widgets_values"]
    assert clip_name == next(n for n, _ in before.values() if n["type"] == "CLIPLoader")["widgets_values"][0]
    assert positive and (cache, te_device, batch_cfg) == (True, "auto", True)
    assert not any(n["type"] in ("CLIPLoader", "CLIPTextEncode") for n, _ in after.values())
    attn = _chain(graph, sid, ["LowVRAM_Attention"])
    assert _consumers(graph, attn) == _consumers(before[sid][1], sid)
    assert {t for t, _ in _consumers(graph, tid, 0)} == {t for t, _ in _consumers(graph, tid, 1)} == {
        n["id"] for n in graph["nodes"] if n["type"] == "KSampler"}
    assert any("LowVRAM_QwenImageTextEncode" in c for c in report.changes), report.changes


def _edit_template_parts(workflow: dict) -> tuple[dict, dict, dict, dict, dict, dict]:
    """The Edit template's subgraph and its UNETLoader, CLIPLoader, VAELoader, positive and negative encoders."""
    (graph,) = [g for _, g in graphs(workflow) if any(n["type"] == "UNETLoader" for n in g["nodes"])]
    one = {t: [n for n in graph["nodes"] if n["type"] == t] for t in ("UNETLoader", "CLIPLoader", "VAELoader")}
    assert all(len(v) == 1 for v in one.values())
    encoders = [n for n in graph["nodes"] if n["type"] == "TextEncodeQwenImageEditPlus"]
    pos, neg = sorted(encoders, key=lambda n: n["widgets_values"][0] == "")  # the negative prompt is empty
    return graph, one["UNETLoader"][0], one["CLIPLoader"][0], one["VAELoader"][0], pos, neg


@pytest.mark.parametrize("name", EDIT_TEMPLATES)
def test_qwen_image_edit_becomes_the_loader_and_the_edit_text_encode(name: str) -> None:
    """Qwen-Image Loader (the UNETLoader's id) + Attention, and Qwen-Image-Edit Text Encode (the positive encoder's id)
    with the encoders' image links, prompts and the loader's VAE; the loader's VAE output and the text node's
    positive / negative reach what the VAE Loader and the encoders fed; every other node stays."""
    original, work, report = _converted(name, vram_gb=10)
    old_graph, unet, clip, vae, pos, neg = _edit_template_parts(original)
    (graph,) = [g for _, g in graphs(work) if g.get("id") == old_graph.get("id")]
    nodes = {n["id"]: n for n in graph["nodes"]}
    loader, text = nodes[unet["id"]], nodes[pos["id"]]
    assert (loader["type"], text["type"]) == ("LowVRAM_QwenImageLoader", "LowVRAM_QwenImageEditTextEncode")
    assert {clip["id"], vae["id"], neg["id"]}.isdisjoint(nodes)
    assert loader["widgets_values"] == [unet["widgets_values"][0], vae["widgets_values"][0], "fp8 per-tensor", 8.0,
                                        -1, "auto"]
    assert text["widgets_values"] == [clip["widgets_values"][0], pos["widgets_values"][0], neg["widgets_values"][0],
                                      True, "auto", True]  # ..., cache, text_encoder_device, batch_cfg
    old_links, new_links = links_of(old_graph), links_of(graph)
    held = {i["name"]: i["link"] for i in text["inputs"]}
    assert (new_links[held["vae"]]["origin_id"], new_links[held["vae"]]["origin_slot"]) == (unet["id"], 1)
    for name_in in ("image1", "image2", "image3"):
        old = next(i["link"] for i in pos["inputs"] if i["name"] == name_in)
        assert (old is None) == (held[name_in] is None)
        if old is not None:  # the same origin as before (a LoadImage / scale node, or the subgraph's input side)
            assert (new_links[held[name_in]]["origin_id"], new_links[held[name_in]]["origin_slot"]) == (
                old_links[old]["origin_id"], old_links[old]["origin_slot"])
    gone = {(n, s) for n in (pos["id"], neg["id"]) for s in range(6)}
    assert _consumers(graph, _chain(graph, unet["id"], ["LowVRAM_Attention"])) == _consumers(old_graph, unet["id"])
    assert _consumers(graph, unet["id"], 1) - {(pos["id"], 1)} == _consumers(old_graph, vae["id"]) - gone
    assert _consumers(graph, pos["id"], 0) == _consumers(old_graph, pos["id"]) - gone
    assert _consumers(graph, pos["id"], 1) == _consumers(old_graph, neg["id"]) - gone
    assert {n["type"] for n in graph["nodes"]} >= {"KSampler", "VAEEncode", "VAEDecode", "LoraLoaderModelOnly",
                                                   "FluxKontextImageScale", "ModelSamplingAuraFlow", "CFGNorm"}
    proxies = [tuple(p) for _, g in graphs(work) for n in g["nodes"] for p in
               (n.get("properties") or {}).get("proxyWidgets") or []]
    moved = {(str(pos["id"]), w) for w in ("positive", "negative", "clip_name")} | {
        (str(unet["id"]), w) for w in ("vae_name", "unet_name")}
    assert moved <= set(proxies) and not {p for p in proxies if p[0] in {str(clip["id"]), str(vae["id"])}}
    (change,) = [c for c in report.changes if "LowVRAM_QwenImageEditTextEncode" in c]
    assert "a new instruction re-runs only this node" in change and not report.notes, change
    assert link_problems(work) == []


def _edit_link(graph: dict, node: dict, input_name: str) -> dict:
    return next(lk for lk in graph["links"] if lk["id"] == next(
        i["link"] for i in node["inputs"] if i["name"] == input_name))


def _other_image(graph: dict, neg: dict) -> None:
    """Feed the negative encoder's image1 straight from the subgraph's first input (the positive's goes through
    FluxKontextImageScale): the two encoders then see different images."""
    link = _edit_link(graph, neg, "image1")
    origin = next(n for n in graph["nodes"] if n["id"] == link["origin_id"])
    assert origin["type"] == "FluxKontextImageScale"
    origin["outputs"][0]["links"].remove(link["id"])
    link["origin_id"], link["origin_slot"] = -10, 0
    graph["inputs"][0]["linkIds"].append(link["id"])


def _negative_without_vae(graph: dict, neg: dict) -> None:
    """Unplug the negative encoder's vae: it then makes no reference latents, which the staged loader always does."""
    link = _edit_link(graph, neg, "vae")
    graph["links"].remove(link)
    vae = next(n for n in graph["nodes"] if n["id"] == link["origin_id"])
    vae["outputs"][0]["links"].remove(link["id"])
    next(i for i in neg["inputs"] if i["name"] == "vae")["link"] = None


@pytest.mark.parametrize("change, words", [(_other_image, "different image1 inputs"),
                                           (_negative_without_vae, "does not take its vae")])
@pytest.mark.parametrize("name", EDIT_TEMPLATES)
def test_qwen_image_edit_that_does_not_fit_keeps_stock(name: str, change: object, words: str) -> None:
    """Encoders with different images, or one without the VAE: the stock nodes stay, Attention follows the
    UNETLoader and the summary says why; converting again changes nothing."""
    work = load_template(name)
    graph, unet, *_, neg = _edit_template_parts(work)
    change(graph, neg)  # type: ignore[operator]
    assert link_problems(work) == []
    before = copy.deepcopy(work)
    report = convert.convert_workflow(work, convert.ConvertOptions(), name)
    assert any(words in n and f"UNETLoader {unet['id']}" in n for n in report.notes), report.lines()
    types = [n["type"] for _, g in graphs(work) for n in g["nodes"]]
    assert types.count("TextEncodeQwenImageEditPlus") == 2 and "LowVRAM_QwenImageEditTextEncode" not in types
    (g,) = [g for _, g in graphs(work) if g.get("id") == graph.get("id")]
    assert _consumers(g, _chain(g, unet["id"], ["LowVRAM_Attention"])) == _consumers(
        [gg for _, gg in graphs(before) if gg.get("id") == graph.get("id")][0], unet["id"])
    assert link_problems(work) == []
    once = copy.deepcopy(work)
    assert convert.convert_workflow(work, convert.ConvertOptions(), name).changes == [] and work == once


def test_clip_feeding_a_third_node_keeps_the_edit_graph_stock() -> None:
    """A CLIPLoader that also feeds another node is left alone (with its encoders and the UNETLoader)."""
    work = load_template("image_qwen_image_edit_2511")
    graph, unet, clip, _, pos, _ = _edit_template_parts(work)
    extra = copy.deepcopy(pos)
    extra["id"] = 9000
    for inp in extra["inputs"]:
        inp["link"] = None
    extra["outputs"][0]["links"] = None
    graph["nodes"].append(extra)
    graph["links"].append({"id": 9001, "origin_id": clip["id"], "origin_slot": 0, "target_id": 9000,
                           "target_slot": 0, "type": "CLIP"})
    clip["outputs"][0]["links"].append(9001)
    extra["inputs"][0]["link"] = 9001
    assert link_problems(work) == []
    report = convert.convert_workflow(work, convert.ConvertOptions(), "edited")
    types = [n["type"] for _, g in graphs(work) for n in g["nodes"]]
    assert "CLIPLoader" in types and "UNETLoader" in types and types.count("TextEncodeQwenImageEditPlus") == 3
    assert any(f"UNETLoader {unet['id']}" in n and "kept" in n for n in report.notes)
    assert link_problems(work) == []


@pytest.mark.parametrize("vram, budget", [(None, 0.0), (8, 6.0), (12, 10.0), (2.5, 1.0)])
def test_vram_sets_the_block_swap_budget(vram: float | None, budget: float) -> None:
    _, work, _ = _converted("video_wan2_2_5B_ti2v", vram_gb=vram)
    swaps = [n for _, g in graphs(work) for n in g["nodes"] if n["type"] == "LowVRAM_BlockSwap"]
    assert swaps and all(n["widgets_values"][0] == budget for n in swaps)


def test_cli_writes_beside_input_and_never_overwrites(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "video_wan2_2_14B_t2v.json"
    src.write_text(json.dumps(load_template("video_wan2_2_14B_t2v")))
    before = src.read_bytes()
    assert convert.cli([str(src), "--vram", "8"]) == 0
    out = tmp_path / "video_wan2_2_14B_t2v_lowvram.json"
    text = capsys.readouterr().out
    assert out.is_file() and src.read_bytes() == before
    assert "LowVRAM_WanLoader" in text and "LowVRAM_BlockSwap" in text and "kept" in text
    stamp = out.read_bytes()
    assert main(["convert", str(src)]) == 2  # the output exists: refused
    assert "--force" in capsys.readouterr().err and out.read_bytes() == stamp
    assert main(["convert", str(src), "-o", str(src), "--force"]) == 2  # never the input, even with --force
    assert "never overwrites its input" in capsys.readouterr().err and src.read_bytes() == before
    assert convert.cli([str(src), "--force", "--fp8", "none"]) == 0 and out.read_bytes() != stamp
    assert convert.cli([str(out), "-o", str(tmp_path / "again.json")]) == 0  # converted input: same graph out
    assert json.loads((tmp_path / "again.json").read_text()) == json.loads(out.read_text())
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("content, words", [
    ('{"1": {"class_type": "KSampler", "inputs": {}}}', "API-format"),
    ("[1, 2]", "not a UI-format workflow"),
    ("{not json", "not a JSON file"),
    ('{"nodes": "x", "links": []}', "not a UI-format workflow"),
])
def test_non_workflow_json_is_refused_naming_the_file(content: str, words: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "thing.json"
    src.write_text(content)
    assert main(["convert", str(src)]) == 2
    err = capsys.readouterr().err
    assert str(src) in err and words in err
    assert not (tmp_path / "thing_lowvram.json").exists()


def test_help_describes_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        convert.cli(["--help"])
    text = capsys.readouterr().out
    for option in ("-o", "--vram", "--fp8", "--keep-text-encoders", "--force", "per-tensor", "block-wise"):
        assert option in text


def test_keep_text_encoders_leaves_clip_nodes() -> None:
    original, work, _ = _converted("video_wan2_2_14B_t2v", staged_text=False)
    types = [n["type"] for _, g in graphs(work) for n in g["nodes"]]
    assert types.count("CLIPLoader") == 1 and types.count("CLIPTextEncode") == 2
    assert "LowVRAM_WanTextEncode" not in types and types.count("LowVRAM_WanLoader") == 2


def test_runner_names_the_nodes_a_host_lacks() -> None:
    from comfyui_lowvram_dit.cli.workflow import missing_node_types

    workflow = load_template("video_wan2_2_14B_t2v")
    used = {n["type"] for _, g in graphs(workflow) for n in g["nodes"]}
    host = {t: {} for t in used if t not in ("ComfyMathExpression", "MarkdownNote")}
    # MarkdownNote lives only in the front end; the subgraph node is expanded; ComfyMathExpression is missing
    assert missing_node_types(workflow, host) == ["ComfyMathExpression"]
    for _, g in graphs(workflow):
        for n in g["nodes"]:
            if n["type"] == "ComfyMathExpression":
                n["mode"] = 4  # bypassed: not needed
    assert missing_node_types(workflow, host) == []
    api = {"1": {"class_type": "KSampler", "inputs": {}}, "2": {"class_type": "Nope", "inputs": {}}}
    assert missing_node_types(api, {"KSampler": {}}) == ["Nope"]


def test_template_model_and_lora_names_are_known_to_the_runner() -> None:
    from comfyui_lowvram_dit.cli import workflow_models
    from comfyui_lowvram_dit.synthetic.lora import KNOWN_LORA_FILES, lora_layout

    for name in TEMPLATES:
        names = workflow_models.referenced_model_files(load_template(name))
        assert names and names <= workflow_models.KNOWN_MODEL_FILES.keys() | KNOWN_LORA_FILES.keys(), name
    from comfyui_lowvram_dit.synthetic.specs import model_spec

    layout = dict(lora_layout("wan22_t2v_14B"))
    shapes = {name: tuple(shape) for name, shape, _ in model_spec("wan22_t2v_14B", "tiny")}
    assert layout["blocks.0.ffn.0"] == shapes["blocks.0.ffn.0.weight"]
    assert layout["blocks.1.cross_attn.o"] == shapes["blocks.1.cross_attn.o.weight"]
    assert all(k.startswith("blocks.") for k in layout) and "head.head" not in layout


def test_other_wan_variants_keep_their_loader() -> None:
    from template_files import template_path

    template_path("video_wan2_2_14B_fun_control")  # skips when this template is not in the installed package
    _, work, report = _converted("video_wan2_2_14B_fun_control")
    assert not any(n["type"] == "LowVRAM_WanLoader" for _, g in graphs(work) for n in g["nodes"])
    assert any("kept: not a Wan" in n for n in report.notes)
