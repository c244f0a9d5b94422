"""The pack inside a real ComfyUI: nodes registered as their schemas say, prompts validated, example
workflows served, fixture nodes usable. Run: see tests/comfy_server.py (needs COMFYUI_PATH)."""

from __future__ import annotations

import importlib
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from comfy_server import (
    PACK_FOLDER,
    REPO_ROOT,
    ComfyServer,
    comfyui_path_or_reason,
    import_comfyui_in_process,
    pack_import_line_seen,
    pack_import_problems,
)

# UI-only node types: the frontend drops them when it converts a workflow to a prompt.
UI_ONLY_TYPES = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode", "PrimitiveString", "GetNode", "SetNode"}
WORKFLOW_DIRS = ("example_workflows", "workflows")  # both are served by ComfyUI's workflow_templates route


def _jsonable(value: Any) -> Any:
    """What ``value`` looks like after the server's JSON round trip (tuples become lists)."""
    return json.loads(json.dumps(value))


def _pack_node_classes() -> dict[str, list[type]]:
    """{node module name: its NODES} for every node module file that exists, imported in this process.

    A module that exists but fails to import fails the test (with its traceback), unlike inside
    ComfyUI, where the pack only logs it and disables that module's nodes.
    """
    comfy, reason = comfyui_path_or_reason()
    assert comfy is not None, reason
    import_comfyui_in_process(comfy)
    from comfyui_lowvram_dit.nodes import NODE_MODULES

    found: dict[str, list[type]] = {}
    for name in NODE_MODULES:
        if not ((REPO_ROOT / "nodes" / f"{name}.py").is_file() or (REPO_ROOT / "nodes" / name).is_dir()):
            continue  # capability not built yet
        module = importlib.import_module(f"comfyui_lowvram_dit.nodes.{name}")
        nodes = getattr(module, "NODES", None)
        assert isinstance(nodes, (list, tuple)) and nodes, f"nodes/{name}.py must export a non-empty NODES list"
        found[name] = list(nodes)
    return found


def _comparable(info: dict) -> dict:
    """The parts of a node's object_info that do not depend on the process (combo file lists do)."""
    info = _jsonable(info)
    for section in info.get("input", {}).values():
        for spec in section.values():
            if spec[0] == "COMBO" and len(spec) > 1:
                spec[1].pop("options", None)
            elif isinstance(spec[0], list):  # V1 combo: the options list is the type
                spec[0] = "COMBO"
    keep = ("input", "input_order", "output", "output_is_list", "output_name", "name", "display_name",
            "category", "description", "output_node", "deprecated", "experimental")
    return {k: info.get(k) for k in keep}


def test_pack_imports_without_disabled_node_modules(comfy_server: ComfyServer) -> None:
    """No node module was disabled at startup (the pack logs 'nodes in <module> disabled: <why>')."""
    disabled = [ln for ln in comfy_server.log_text().splitlines() if re.search(r"lowvram_dit: nodes in \S+ disabled", ln)]
    assert not disabled, "node modules failed inside ComfyUI:\n" + "\n".join(disabled)


def test_every_pack_node_registered_as_its_schema_says(comfy_server: ComfyServer) -> None:
    """Each node class of each existing node module is in /object_info exactly as its schema builds it."""
    from comfyui_lowvram_dit.host.names import CATEGORY, node_id

    classes = _pack_node_classes()
    served = comfy_server.object_info()
    ours = {k for k, v in served.items() if v.get("python_module") == f"custom_nodes.{PACK_FOLDER}"}
    expected_ids: set[str] = set()
    for module, nodes in classes.items():
        for cls in nodes:
            expected = cls.GET_NODE_INFO_V1()
            nid = expected["name"]
            expected_ids.add(nid)
            assert nid.startswith(node_id("")), f"{module}: node id {nid!r} must come from _common.node_id()"
            assert expected["category"].startswith(CATEGORY), f"{nid}: category {expected['category']!r}"
            assert nid in served, f"{nid} (nodes/{module}.py) is missing from /object_info"
            assert served[nid]["python_module"] == f"custom_nodes.{PACK_FOLDER}", served[nid]["python_module"]
            assert _comparable(served[nid]) == _comparable(expected), f"{nid}: /object_info differs from its schema"
            for section in ("required", "optional"):
                for name, spec in expected["input"].get(section, {}).items():
                    assert spec[1].get("tooltip"), f"{nid}: input {name!r} has no tooltip"
    assert ours == expected_ids, f"registered but not in any NODES: {ours - expected_ids}"


def test_bad_prompt_is_rejected_with_node_errors(comfy_server: ComfyServer) -> None:
    """An out-of-range input gives HTTP 400 with node_errors naming the node and the input."""
    api = {
        "1": {"class_type": "LowVRAMTest_RandomConditioning", "inputs": {"seed": 0, "length": 0, "dim": 4096, "std": 1.0}},
        "2": {"class_type": "LowVRAMTest_ConditioningStats", "inputs": {"conditioning": ["1", 0]}},
    }
    status, reply = comfy_server.post_prompt(api)
    assert status == 400, reply
    assert reply["error"]["type"] == "prompt_outputs_failed_validation", reply
    errors = reply["node_errors"]["1"]["errors"]
    assert any(e["type"] == "value_smaller_than_min" and "length" in e["details"] for e in errors), errors
    status, reply = comfy_server.post_prompt({"1": {"class_type": "NoSuchNode_LowVRAM", "inputs": {}}})
    assert status == 400 and "NoSuchNode_LowVRAM" in json.dumps(reply), reply


NEWER_CORE_NODES = {"SelectModelDevice"}  # ComfyUI 0.23+: wan22_t2v_a14b_2gpu's note says so


def _older_than(version: tuple[int, ...]) -> bool:
    from comfyui_lowvram_dit.host.version import comfyui_version

    found = comfyui_version(os.environ["COMFYUI_PATH"]) or "0"
    return tuple(int(p) for p in found.split(".")[:len(version)] if p.isdigit()) < version


def _workflow_files() -> dict[str, Path]:
    files: dict[str, Path] = {}
    for folder in WORKFLOW_DIRS:
        for path in sorted((REPO_ROOT / folder).glob("*.json")):
            files[path.stem] = path
    return files


def _workflow_node_types(wf: dict) -> set[str]:
    """Node types a workflow (UI or API format) uses, minus UI-only ones and subgraph instances."""
    if "nodes" in wf:
        subgraphs = {s.get("id") for s in wf.get("definitions", {}).get("subgraphs", [])}
        inner = [n for s in wf.get("definitions", {}).get("subgraphs", []) for n in s.get("nodes", [])]
        types = {n["type"] for n in [*wf["nodes"], *inner]}
        return types - subgraphs - UI_ONLY_TYPES
    return {n["class_type"] for n in wf.values() if isinstance(n, dict) and "class_type" in n}


def test_workflow_templates_route_serves_the_pack_workflows(comfy_server: ComfyServer) -> None:
    """/api/workflow_templates lists every shipped workflow; each is served verbatim and uses known nodes."""
    files = _workflow_files()
    listed = comfy_server.get("/api/workflow_templates")
    if not files:
        assert PACK_FOLDER not in listed, listed
        return
    assert sorted(listed.get(PACK_FOLDER, [])) == sorted(files), listed
    known = set(comfy_server.object_info())
    for stem, path in files.items():
        wf = json.loads(path.read_text())
        served = comfy_server.get(f"/api/workflow_templates/{PACK_FOLDER}/{path.name}")
        assert served == wf, f"{path.name} is not served verbatim"
        unknown = _workflow_node_types(wf) - known
        if _older_than((0, 23)):  # core nodes a workflow may use from that version on
            unknown -= NEWER_CORE_NODES
        assert not unknown, f"{path.relative_to(REPO_ROOT)} uses node types ComfyUI does not know: {unknown}"


def test_fixture_nodes_feed_stock_nodes(comfy_server: ComfyServer) -> None:
    """Random conditioning goes through stock nodes; stats come back through /history."""
    api = {
        "1": {"class_type": "LowVRAMTest_RandomConditioning", "inputs": {"seed": 7, "length": 7, "dim": 4096, "std": 2.0}},
        "2": {"class_type": "ConditioningSetTimestepRange", "inputs": {"conditioning": ["1", 0], "start": 0.25, "end": 0.75}},
        "3": {"class_type": "LowVRAMTest_ConditioningStats", "inputs": {"conditioning": ["2", 0]}},
        "4": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["1", 0]}},
        "5": {"class_type": "LowVRAMTest_ConditioningStats", "inputs": {"conditioning": ["4", 0]}},
    }
    outputs = comfy_server.run(api, timeout=120)["outputs"]
    (ranged,) = outputs["3"]["conditioning_stats"]
    assert ranged["shape"] == [1, 7, 4096] and ranged["dtype"] == "float32" and ranged["finite"]
    assert ranged["std"] == pytest.approx(2.0, rel=0.03)  # 28672 Gaussian samples: std error ~0.4 %
    assert ranged["keys"] == ["end_percent", "start_percent"]
    (zeroed,) = outputs["5"]["conditioning_stats"]
    assert zeroed["shape"] == [1, 7, 4096] and zeroed["min"] == zeroed["max"] == 0.0


def test_node_failure_reaches_the_test_with_its_message(comfy_server: ComfyServer) -> None:
    """run() raises AssertionError carrying the node type and ComfyUI's exception message."""
    with pytest.raises(AssertionError, match=r"LowVRAMTest_Raise.*RuntimeError: boom from the harness test"):
        comfy_server.run({"1": {"class_type": "LowVRAMTest_Raise", "inputs": {"message": "boom from the harness test"}}},
                         timeout=60)


# Real ComfyUI 0.8.0 log lines (nodes.py load_custom_node / init_external_custom_nodes), for the log checks.
_LOG = """\
Traceback (most recent call last):
  File "/c/ComfyUI/nodes.py", line 2155, in load_custom_node
Cannot import /c/ComfyUI/comfy_extras/nodes_audio.py module for custom nodes: No module named 'torchaudio'
Cannot import /b/custom_nodes/comfyui-lowvram-dit module for custom nodes: name 'this' is not defined
Error while calling comfy_entrypoint in /b/custom_nodes/ComfyUI-LowVRAM-DiT-0.1.0: boom

Import times for custom nodes:
   0.0 seconds: /b/custom_nodes/zz_lowvram_dit_test_nodes
   0.0 seconds (IMPORT FAILED): /b/custom_nodes/comfyui-lowvram-dit
   0.1 seconds (IMPORT FAILED): /b/custom_nodes/ComfyUI-LowVRAM-DiT-0.1.0

IMPORT FAILED: nodes_audio.py
"""


def test_log_checks_name_only_the_given_pack_folder() -> None:
    """The harness's import-failure scan matches the pack's own lines, never core's or another folder's."""
    pack, alt, fixture = (Path("/b/custom_nodes") / n for n in
                          ("comfyui-lowvram-dit", "ComfyUI-LowVRAM-DiT-0.1.0", "zz_lowvram_dit_test_nodes"))
    assert len(pack_import_problems(_LOG, pack)) == 2
    assert len(pack_import_problems(_LOG, alt)) == 2
    assert pack_import_problems(_LOG, fixture) == []
    assert pack_import_problems(_LOG, Path("/b/custom_nodes/comfyui-lowvram")) == []  # a prefix is not a match
    assert pack_import_line_seen(_LOG, fixture) and pack_import_line_seen(_LOG, pack)
    assert not pack_import_line_seen(_LOG, Path("/b/custom_nodes/other"))


# Real ComfyUI 0.33.0 lines: the level name, coloured, comes first.
_LOG_033 = ("\x1b[32m[INFO]\x1b[0m    0.0 seconds: /b/custom_nodes/zz_lowvram_dit_test_nodes\n"
            "\x1b[32m[INFO]\x1b[0m    3.6 seconds: /b/custom_nodes/comfyui-lowvram-dit\n"
            "\x1b[32m[INFO]\x1b[0m    0.1 seconds (IMPORT FAILED): /b/custom_nodes/ComfyUI-LowVRAM-DiT-0.1.0\n")


def test_import_lines_of_newer_comfyui_are_recognised() -> None:
    pack, alt = Path("/b/custom_nodes/comfyui-lowvram-dit"), Path("/b/custom_nodes/ComfyUI-LowVRAM-DiT-0.1.0")
    assert pack_import_line_seen(_LOG_033, pack) and pack_import_problems(_LOG_033, pack) == []
    assert pack_import_line_seen(_LOG_033, alt) and len(pack_import_problems(_LOG_033, alt)) == 1
    assert not pack_import_line_seen(_LOG_033, Path("/b/custom_nodes/comfyui-lowvram"))
