"""ComfyUI's official workflow templates for the tests, read from the installed ``comfyui-workflow-templates-json``
package (part of the ``[test]`` extra); a test skips with the reason when the package or a template is missing.
Also a link-consistency check of UI-format workflows (root graph and subgraphs) shared by the converter tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

WAN_TEMPLATES = ("video_wan2_2_14B_t2v", "video_wan2_2_14B_i2v", "video_wan2_2_5B_ti2v")
QWEN_TEMPLATES = ("image_qwen_image", "image_qwen_image_edit_2509", "image_qwen_image_edit_2511")
TEMPLATES = WAN_TEMPLATES + QWEN_TEMPLATES
PACKAGE = "comfyui_workflow_templates_json"


def template_path(name: str) -> Path:
    """The installed template ``name`` (.json), or a skip naming what to install."""
    try:
        import comfyui_workflow_templates_json as pkg
    except ImportError:
        pytest.skip("the official templates are not installed: pip install comfyui-workflow-templates-json "
                    "(in the [test] extra)")
    path = Path(pkg.__file__).parent / "templates" / f"{name}.json"
    if not path.is_file():
        pytest.skip(f"{name}.json is not in this version of comfyui-workflow-templates-json")
    return path


def load_template(name: str) -> dict:
    return json.loads(template_path(name).read_text(encoding="utf-8"))


def graphs(workflow: dict) -> list[tuple[str, dict]]:
    """(name, graph) for the root and every subgraph definition."""
    subs = (workflow.get("definitions") or {}).get("subgraphs") or []
    return [("root", workflow), *((f"subgraph {sg.get('name')}", sg) for sg in subs)]


def links_of(graph: dict) -> dict[int, dict]:
    keys = ("id", "origin_id", "origin_slot", "target_id", "target_slot", "type")
    return {int(lk[0] if isinstance(lk, list) else lk["id"]): dict(zip(keys, lk, strict=False)) if isinstance(
        lk, list) else lk for lk in graph.get("links") or []}


def link_problems(workflow: dict) -> list[str]:
    """Every inconsistency between the links lists and the nodes' own link fields, and duplicate node ids."""
    problems: list[str] = []
    seen_ids: set[int] = set()
    for name, graph in graphs(workflow):
        nodes = {n["id"]: n for n in graph["nodes"]}
        dup = seen_ids & nodes.keys()
        problems += [f"{name}: node id {i} used twice in the workflow" for i in dup]
        seen_ids |= nodes.keys()
        links = links_of(graph)
        for lid, lk in links.items():
            origin, target = nodes.get(lk["origin_id"]), nodes.get(lk["target_id"])
            if origin is None and lk["origin_id"] != -10:
                problems.append(f"{name}: link {lid} starts at missing node {lk['origin_id']}")
            elif origin is not None and lid not in (origin["outputs"][lk["origin_slot"]].get("links") or []):
                problems.append(f"{name}: link {lid} not listed by output {lk['origin_slot']} of {lk['origin_id']}")
            if target is None and lk["target_id"] != -20:
                problems.append(f"{name}: link {lid} ends at missing node {lk['target_id']}")
            elif target is not None and target["inputs"][lk["target_slot"]].get("link") != lid:
                problems.append(f"{name}: link {lid} not held by input {lk['target_slot']} of {lk['target_id']}")
        for node in nodes.values():
            for inp in node.get("inputs") or []:
                if inp.get("link") is not None and inp["link"] not in links:
                    problems.append(f"{name}: node {node['id']} input {inp['name']} holds missing link {inp['link']}")
            for out in node.get("outputs") or []:
                problems += [f"{name}: node {node['id']} output lists missing link {i}"
                             for i in out.get("links") or [] if i not in links]
        for side in ("inputs", "outputs"):
            for port in graph.get(side) or [] if name != "root" else []:
                problems += [f"{name}: subgraph {side} {port['name']} lists missing link {i}"
                             for i in port.get("linkIds") or [] if i not in links]
    return problems
