"""Edit a ComfyUI UI-format workflow (the front end's graph JSON) in place, subgraphs included.

A workflow is a root graph plus, under ``definitions.subgraphs``, one graph per subgraph. Each graph has
``nodes`` and ``links``; the root stores a link as ``[id, origin_id, origin_slot, target_id, target_slot, type]``,
a subgraph as a dict with those keys. Inside a subgraph, node ``-10`` is its input side and ``-20`` its output
side (``inputs[i].linkIds`` / ``outputs[i].linkIds`` name the links that cross them). Node and link ids come from
one counter for the whole workflow (root ``last_node_id`` / ``last_link_id``, each subgraph's ``state``), so new
ids are taken above every id in use. Each node lists its own links too (``inputs[i].link``,
``outputs[j].links``); every edit here keeps both sides in step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .workflow_shape import LINK_FIELDS, GraphError, check_ui_workflow

SUBGRAPH_INPUT = -10  # the pseudo-node of a subgraph's inputs
SUBGRAPH_OUTPUT = -20  # the pseudo-node of a subgraph's outputs
# Nodes that exist only in the front end (never sent to the server).
FRONTEND_ONLY = frozenset({"Note", "MarkdownNote", "Reroute", "PrimitiveNode"})
BYPASSED_MODES = (2, 4)  # muted, bypassed


class _Ids:
    """The workflow-wide id counters."""

    def __init__(self, node: int, link: int) -> None:
        self.node, self.link = node, link

    def next_node(self) -> int:
        self.node += 1
        return self.node

    def next_link(self) -> int:
        self.link += 1
        return self.link


class Graph:
    """One graph (the root or a subgraph definition) with its links as dicts while it is edited."""

    def __init__(self, data: dict, name: str, ids: _Ids, array_links: bool) -> None:
        if not isinstance(data.get("nodes"), list):
            raise GraphError(f"{name}: no 'nodes' list")
        self.data, self.name, self._ids = data, name, ids
        raw = data.get("links") or []
        self._array_links = isinstance(raw[0], list) if raw else array_links
        self.links: dict[int, dict] = {}
        for item in raw:
            link = dict(zip(LINK_FIELDS, item, strict=False)) if isinstance(item, list) else dict(item)
            self.links[int(link["id"])] = link

    @property
    def nodes(self) -> list[dict]:
        return self.data["nodes"]

    def node(self, node_id: int) -> dict | None:
        return next((n for n in self.nodes if n.get("id") == node_id), None)

    def input_slot(self, node: dict, name: str) -> int | None:
        """Index of the input called ``name`` (widget inputs included)."""
        return next((i for i, inp in enumerate(node.get("inputs") or []) if inp.get("name") == name), None)

    def input_link(self, node: dict, name: str) -> dict | None:
        slot = self.input_slot(node, name)
        link_id = None if slot is None else node["inputs"][slot].get("link")
        return self.links.get(link_id) if link_id is not None else None

    def out_links(self, node: dict, slot: int = 0) -> list[dict]:
        """Links leaving output ``slot`` of ``node``, in link-id order."""
        return sorted((lk for lk in self.links.values() if lk["origin_id"] == node["id"] and lk["origin_slot"] == slot),
                      key=lambda lk: lk["id"])

    def target_input_name(self, link: dict) -> str | None:
        """Name of the input a link ends in (None at the subgraph's output side)."""
        target = self.node(link["target_id"])
        inputs = (target or {}).get("inputs") or []
        return inputs[link["target_slot"]].get("name") if link["target_slot"] < len(inputs) else None

    def add_node(self, node_type: str, pos: list[float], widgets_values: list, inputs: list[dict],
                 outputs: list[dict], properties: dict, title: str | None = None) -> dict:
        node: dict[str, Any] = {"id": self._ids.next_node(), "type": node_type, "pos": pos, "size": [320, 120],
                                "flags": {}, "order": len(self.nodes), "mode": 0, "inputs": inputs,
                                "outputs": outputs, "properties": properties, "widgets_values": widgets_values}
        if title:
            node["title"] = title
        self.nodes.append(node)
        return node

    def add_link(self, origin: dict, origin_slot: int, target: dict, target_slot: int, link_type: str) -> dict:
        link = {"id": self._ids.next_link(), "origin_id": origin["id"], "origin_slot": origin_slot,
                "target_id": target["id"], "target_slot": target_slot, "type": link_type}
        self.links[link["id"]] = link
        self._attach_origin(link)
        target["inputs"][target_slot]["link"] = link["id"]
        return link

    def _attach_origin(self, link: dict) -> None:
        origin = self.node(link["origin_id"])
        if origin is not None:
            out = origin["outputs"][link["origin_slot"]]
            out["links"] = sorted({*(out.get("links") or []), link["id"]})

    def _detach_origin(self, link: dict) -> None:
        origin = self.node(link["origin_id"])
        if origin is not None and link["origin_slot"] < len(origin.get("outputs") or []):
            out = origin["outputs"][link["origin_slot"]]
            out["links"] = [i for i in out.get("links") or [] if i != link["id"]] or None

    def set_origin(self, link: dict, node: dict, slot: int) -> None:
        """Make ``link`` start at output ``slot`` of ``node`` (its target is unchanged)."""
        self._detach_origin(link)
        link["origin_id"], link["origin_slot"] = node["id"], slot
        self._attach_origin(link)

    def set_target(self, link: dict, node: dict, slot: int) -> None:
        """Make ``link`` end at input ``slot`` of ``node`` (its origin is unchanged)."""
        old = self.node(link["target_id"])
        if old is not None and link["target_slot"] < len(old.get("inputs") or []):
            if old["inputs"][link["target_slot"]].get("link") == link["id"]:
                old["inputs"][link["target_slot"]]["link"] = None
        link["target_id"], link["target_slot"] = node["id"], slot
        node["inputs"][slot]["link"] = link["id"]

    def remove_link(self, link: dict) -> None:
        self.links.pop(link["id"], None)
        self._detach_origin(link)
        target = self.node(link["target_id"])
        if target is not None and link["target_slot"] < len(target.get("inputs") or []):
            if target["inputs"][link["target_slot"]].get("link") == link["id"]:
                target["inputs"][link["target_slot"]]["link"] = None
        if link["origin_id"] == SUBGRAPH_INPUT:
            for sg_input in self.data.get("inputs") or []:
                if link["id"] in (sg_input.get("linkIds") or []):
                    sg_input["linkIds"] = [i for i in sg_input["linkIds"] if i != link["id"]]

    def remove_node(self, node: dict) -> None:
        """Remove a node and every link that touches it."""
        for link in [lk for lk in self.links.values() if node["id"] in (lk["origin_id"], lk["target_id"])]:
            self.remove_link(link)
        self.data["nodes"] = [n for n in self.nodes if n is not node]

    def finish(self) -> None:
        """Write the links back in this graph's own form."""
        links = [self.links[i] for i in sorted(self.links)]
        self.data["links"] = [[lk[f] for f in LINK_FIELDS] for lk in links] if self._array_links else links


class Workflow:
    """A UI-format workflow: the root graph and its subgraph definitions, edited in place."""

    def __init__(self, data: Any, source: str) -> None:
        if not isinstance(data, dict) or not isinstance(data.get("nodes"), list) or "links" not in data:
            kind = "an API-format workflow" if isinstance(data, dict) and data and all(
                isinstance(v, dict) and "class_type" in v for v in data.values()) else "not a UI-format workflow"
            raise GraphError(f"{source}: {kind} (expected the JSON ComfyUI saves with Workflow > Save, "
                             "with 'nodes' and 'links')")
        check_ui_workflow(data, source)
        self.data, self.source = data, source
        subgraphs = (data.get("definitions") or {}).get("subgraphs") or []
        self._ids = _Ids(*self._max_ids(data, subgraphs))
        self.root = Graph(data, "root graph", self._ids, array_links=True)
        self.subgraphs = [Graph(sg, f"subgraph {sg.get('name') or sg.get('id')!r}", self._ids, array_links=False)
                          for sg in subgraphs]

    @staticmethod
    def _max_ids(data: dict, subgraphs: list[dict]) -> tuple[int, int]:
        node_max = int(data.get("last_node_id") or 0)
        link_max = int(data.get("last_link_id") or 0)
        for g in [data, *subgraphs]:
            state = g.get("state") or {}
            node_max = max(node_max, int(state.get("lastNodeId") or 0),
                           *(int(n["id"]) for n in g.get("nodes") or [] if isinstance(n.get("id"), int)))
            for item in g.get("links") or []:
                link_max = max(link_max, int(item[0] if isinstance(item, list) else item["id"]))
            link_max = max(link_max, int(state.get("lastLinkId") or 0))
        return node_max, link_max

    def graphs(self) -> Iterator[Graph]:
        yield self.root
        yield from self.subgraphs

    def subgraph_ids(self) -> set[str]:
        return {str(g.data.get("id")) for g in self.subgraphs}

    def rename_proxy_widget(self, old: tuple[int, str], new: tuple[int, str]) -> None:
        """Point subgraph instances' promoted widgets (``properties.proxyWidgets``) at a moved widget."""
        for graph in self.graphs():
            for node in graph.nodes:
                proxies = (node.get("properties") or {}).get("proxyWidgets")
                for item in proxies or []:
                    if isinstance(item, list) and len(item) == 2 and (str(item[0]), item[1]) == (str(old[0]), old[1]):
                        item[0], item[1] = str(new[0]), new[1]

    def finish(self) -> dict:
        """Write links back and bring every id counter up to the highest id in use; returns the workflow dict."""
        for graph in self.graphs():
            graph.finish()
        if self.subgraphs or "last_node_id" in self.data:
            self.data["last_node_id"], self.data["last_link_id"] = self._ids.node, self._ids.link
        for graph in self.subgraphs:
            state = graph.data.setdefault("state", {})
            state["lastNodeId"], state["lastLinkId"] = self._ids.node, self._ids.link
        return self.data


def all_nodes(workflow: dict, instances: bool = True) -> Iterator[dict]:
    """Every node of a UI-format workflow: the root graph's and each subgraph definition's.

    ``instances=False`` leaves out the nodes that stand for a subgraph (their widget values are the promoted
    values of nodes inside it)."""
    subgraphs = (workflow.get("definitions") or {}).get("subgraphs") or []
    ids = {str(sg.get("id")) for sg in subgraphs}
    for graph in [workflow, *subgraphs]:
        yield from (n for n in graph.get("nodes") or [] if instances or str(n.get("type")) not in ids)
