"""Whether parsed JSON is a ComfyUI workflow the tools can walk: checked field by field before ``convert`` edits it
or ``run`` queues it, so a wrong type anywhere is a GraphError naming the file and the field, never a TypeError from
deep inside a tool.

UI format (what Workflow > Save writes; cli/ui_graph.py describes it): ``nodes`` a list of objects, each with an id
(number or string), a ``type`` string, ``inputs`` / ``outputs`` lists of objects whose ``link`` / ``links`` hold link
ids, ``widgets_values`` a list or object; ``links`` lists ``[id, origin_id, origin_slot, target_id, target_slot,
type]`` (root) or objects with those keys (subgraphs), ids and slots integers; ``definitions.subgraphs`` a list of
such graphs. API format (what ``/prompt`` takes): an object of node id -> ``{"class_type": str, "inputs": {...}}``.
Fields the tools never read are not checked.
"""

from __future__ import annotations

from typing import Any

from .errors import InputError

LINK_FIELDS = ("id", "origin_id", "origin_slot", "target_id", "target_slot", "type")
RESAVE = "open it in ComfyUI and save it again (Workflow > Save), or give the file ComfyUI saved"


class GraphError(InputError, ValueError):
    """The JSON is not a workflow the tools can read; the message names the file and the field."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _need(ok: bool, where: str, what: str, value: Any) -> None:
    if not ok:
        raise GraphError(f"{where}: expected {what}, found {_kind(value)}")


def _check_link(link: Any, where: str) -> None:
    if isinstance(link, list):
        _need(len(link) == 6 and all(_is_int(v) for v in link[:5]), where,
              "a link [id, origin_id, origin_slot, target_id, target_slot, type] of integers", link)
        slots = (link[2], link[4])
    else:
        _need(isinstance(link, dict) and all(_is_int(link.get(k)) for k in LINK_FIELDS[:5]), where,
              f"a link object with integer {', '.join(LINK_FIELDS[:5])}", link)
        slots = (link["origin_slot"], link["target_slot"])
    _need(min(slots) >= 0, where, "slots of 0 or more", -1)


def _check_slots(node: dict, key: str, link_key: str, where: str) -> None:
    slots = node.get(key)
    _need(slots is None or isinstance(slots, list), f"{where}.{key}", "a list", slots)
    for i, slot in enumerate(slots or []):
        here = f"{where}.{key}[{i}]"
        _need(isinstance(slot, dict), here, "an object", slot)
        _need(isinstance(slot.get("name", ""), str), f"{here}.name", "a string", slot.get("name"))
        value = slot.get(link_key)
        if link_key == "link":
            _need(value is None or _is_int(value), f"{here}.link", "a link id (integer) or null", value)
        else:
            _need(value is None or isinstance(value, list) and all(_is_int(v) for v in value), f"{here}.links",
                  "a list of link ids (integers) or null", value)


def _check_node(node: Any, where: str) -> None:
    _need(isinstance(node, dict), where, "a node object", node)
    _need(_is_int(node.get("id")) or isinstance(node.get("id"), str), f"{where}.id", "a number or string",
          node.get("id"))
    _need(isinstance(node.get("type"), str), f"{where}.type", "a string", node.get("type"))
    _need(_is_int(node.get("mode", 0)), f"{where}.mode", "an integer", node.get("mode"))
    _check_slots(node, "inputs", "link", where)
    _check_slots(node, "outputs", "links", where)
    values = node.get("widgets_values")
    _need(values is None or isinstance(values, (list, dict)), f"{where}.widgets_values", "a list or object", values)
    props = node.get("properties")
    _need(props is None or isinstance(props, dict), f"{where}.properties", "an object", props)
    _need(isinstance(node.get("title", ""), (str, type(None))), f"{where}.title", "a string", node.get("title"))


def _check_graph(graph: Any, where: str) -> None:
    _need(isinstance(graph, dict), where, "a graph object", graph)
    _need(isinstance(graph.get("nodes"), list), f"{where}: 'nodes'", "a list of nodes", graph.get("nodes"))
    for i, node in enumerate(graph["nodes"]):
        _check_node(node, f"{where}, nodes[{i}]")
    links = graph.get("links")
    _need(links is None or isinstance(links, list), f"{where}: 'links'", "a list of links", links)
    for i, link in enumerate(links or []):
        _check_link(link, f"{where}, links[{i}]")
    for key in ("inputs", "outputs"):  # a subgraph's sides
        sides = graph.get(key) or []
        _need(isinstance(sides, list), f"{where}: {key}", "a list", sides)
        for i, side in enumerate(sides):
            _need(isinstance(side, dict), f"{where}: {key}[{i}]", "an object", side)
            ids = side.get("linkIds")
            _need(ids is None or isinstance(ids, list) and all(_is_int(v) for v in ids),
                  f"{where}: {key}[{i}].linkIds", "a list of link ids", ids)
    for key in ("last_node_id", "last_link_id"):
        _need(graph.get(key) is None or _is_int(graph[key]), f"{where}: {key}", "an integer", graph.get(key))
    state = graph.get("state", {})
    _need(isinstance(state, dict) and all(state.get(k) is None or _is_int(state[k]) for k in
                                          ("lastNodeId", "lastLinkId")), f"{where}: state",
          "an object with integer lastNodeId and lastLinkId", state)


def check_ui_workflow(data: dict, source: str) -> None:
    """GraphError naming ``source`` and the field unless ``data`` (a dict with ``nodes``) is a UI-format workflow
    whose every field the tools read has the type they expect."""
    try:
        _check_graph(data, "root graph")
        definitions = data.get("definitions") or {}
        _need(isinstance(definitions, dict), "definitions", "an object", definitions)
        subgraphs = definitions.get("subgraphs") or []
        _need(isinstance(subgraphs, list), "definitions.subgraphs", "a list", subgraphs)
        for i, sg in enumerate(subgraphs):
            _check_graph(sg, f"subgraph {i}")
            _need(isinstance(sg.get("id", ""), (str, int)), f"subgraph {i}: id", "a string", sg.get("id"))
    except GraphError as exc:
        raise GraphError(f"{source}: {exc}; {RESAVE}") from None


def check_api_workflow(data: dict, source: str) -> None:
    """GraphError naming ``source`` and the node unless every value of ``data`` is an API-format node."""
    for node_id, node in data.items():
        where = f"{source}: node {str(node_id)[:40]!r}"
        ok = isinstance(node, dict) and isinstance(node.get("class_type"), str) \
            and isinstance(node.get("inputs", {}), dict) and isinstance(node.get("_meta", {}), dict)
        if not ok:
            raise GraphError(f"{where}: expected {{\"class_type\": str, \"inputs\": {{...}}}}; {RESAVE} "
                             "(Export (API) for the API format)")
