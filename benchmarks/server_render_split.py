"""A render's wall time split by node type (load, text encode, sampling, VAE decode, save, other) from the server's
websocket events; a sampler's first step above its median step counts as load, so the parts add up to the total."""

from __future__ import annotations

import statistics
from itertools import pairwise
from typing import Any

from comfyui_lowvram_dit.cli.memwatch import GIB

PARTS = ("load_s", "text_encode_s", "sampling_s", "vae_decode_s", "save_s", "other_s")
PART_OF = {  # node type -> the part its seconds go to (any other node type: other_s)
    **dict.fromkeys(("UNETLoader", "CLIPLoader", "VAELoader", "CLIPVisionLoader", "LoraLoaderModelOnly",
                     "LowVRAM_WanLoader", "LowVRAM_BlockSwap", "LowVRAM_Attention", "LowVRAM_TorchCompile",
                     "LowVRAM_NanGuard", "ModelSamplingSD3", "ModelSamplingAuraFlow", "CFGNorm",
                     "LowVRAMTest_StreamedCLIPLoader", "LowVRAM_QwenImageLoader"), "load_s"),
    **dict.fromkeys(("CLIPTextEncode", "LowVRAM_WanTextEncode", "TextEncodeQwenImageEditPlus",
                     "LowVRAM_QwenImageTextEncode", "LowVRAM_QwenImageEditTextEncode"), "text_encode_s"),
    **dict.fromkeys(("KSampler", "KSamplerAdvanced"), "sampling_s"),
    **dict.fromkeys(("VAEDecode", "VAEDecodeTiled", "LowVRAM_QwenImageDecode"), "vae_decode_s"),
    **dict.fromkeys(("SaveAnimatedWEBP", "SaveImage", "SaveLatent", "SaveVideo", "CreateVideo", "SaveWEBM"), "save_s")}


def node_windows(events: list[tuple[float, dict]]) -> list[tuple[str, float, float]]:
    """(node, start, end) per executed node, in run order: from its 'executing' message to the next one's."""
    marks = [(t, m["data"].get("node")) for t, m in events if m.get("type") == "executing"]
    return [(str(nid), t, t_next) for (t, nid), (t_next, _) in pairwise(marks) if nid is not None]


def node_times(events: list[tuple[float, dict]]) -> dict[str, float]:
    """Seconds each executed node took: from its 'executing' message to the next node's (or the end)."""
    out: dict[str, float] = {}
    for nid, t, t_next in node_windows(events):
        out[nid] = round(out.get(nid, 0.0) + t_next - t, 3)
    return out


def node_memory(events: list[tuple[float, dict]], samples: list[dict], t0: float) -> dict[str, dict]:
    """Per executed node, from memory samples taken while it ran (``t`` seconds after ``t0``, the clock of the
    events; ``anon`` / ``file`` bytes): the highest anonymous and file-backed RSS and the anonymous RSS of its last
    sample, in GiB, and the GiB read from storage (``disk`` bytes) from the last sample before it to the first after
    it (so up to a sampling interval of its neighbours' reads on each side). A node no sample fell into is left out;
    one that ran twice keeps its higher peaks and the sum of its reads."""
    out: dict[str, dict] = {}
    reads = [s for s in samples if s.get("disk") is not None]
    for nid, start, end in node_windows(events):
        inside = [s for s in samples if start <= t0 + s["t"] <= end]
        if not inside:
            continue
        seen = out.get(nid, {"anon_peak_gib": 0.0, "file_peak_gib": 0.0})
        out[nid] = {"anon_peak_gib": max(seen["anon_peak_gib"], round(max(s["anon"] for s in inside) / GIB, 3)),
                    "file_peak_gib": max(seen["file_peak_gib"], round(max(s["file"] for s in inside) / GIB, 3)),
                    "anon_end_gib": round(inside[-1]["anon"] / GIB, 3)}
        before = [s["disk"] for s in reads if t0 + s["t"] <= start] or [s["disk"] for s in reads[:1]]
        after = [s["disk"] for s in reads if t0 + s["t"] >= end] or [s["disk"] for s in reads[-1:]]
        if before and after:
            out[nid]["disk_read_gib"] = round(seen.get("disk_read_gib", 0.0) + (after[0] - before[-1]) / GIB, 3)
    return out


def sampler_steps(events: list[tuple[float, dict]], nid: str, spent: float = 0.0, title: str = "") -> dict:
    """One sampler node from its websocket 'progress' messages (a re-sent value counts once): its first step
    ('executing' to the first 'progress', load inside), its later steps and their median, and the load part."""
    start = next((t for t, m in events if m.get("type") == "executing" and m["data"].get("node") == nid), None)
    seen: dict[int, float] = {}
    for t, m in events:
        if m.get("type") == "progress" and str(m["data"].get("node")) == nid:
            seen.setdefault(int(m["data"]["value"]), t)  # a re-sent value keeps its first arrival
    stamps = [seen[v] for v in sorted(seen)]
    first = round(stamps[0] - start, 3) if stamps and start is not None else None
    later = [round(b - a, 3) for a, b in pairwise(stamps)]
    median = round(statistics.median(later), 3) if later else None
    load = round(max(first - median, 0.0), 3) if first is not None and median is not None else None
    return {"node": nid, "title": title, "steps": len(stamps), "first_step_s": first, "median_step_s": median,
            "later_steps_s": later, "load_part_s": load, "node_s": spent}


def split(events: list[tuple[float, dict]], graph: dict, posted_at: float, total_s: float) -> dict[str, Any]:
    """Seconds per part, node and sampler, and the cached nodes, of a render POSTed at ``posted_at``."""
    spent = node_times(events)
    parts = dict.fromkeys(PARTS, 0.0)
    nodes, samplers = {}, []
    for nid, seconds in spent.items():
        kind = graph.get(nid, {}).get("class_type", "?")
        part = PART_OF.get(kind, "other_s")
        nodes[nid] = {"type": kind, "part": part, "s": seconds}
        if part == "sampling_s":
            s = sampler_steps(events, nid, seconds, graph[nid].get("_meta", {}).get("title", kind))
            samplers.append(s)
            moved = s["load_part_s"] or 0.0
            parts["load_s"] += moved
            seconds -= moved
        parts[part] += seconds
    queue = next((round(t - posted_at, 3) for t, m in events  # from the POST to the first node's start
                  if m.get("type") == "executing" and m["data"].get("node") is not None), None)
    parts["other_s"] += max(total_s - sum(parts.values()), 0.0)
    cached = next((m["data"].get("nodes", []) for _, m in events if m.get("type") == "execution_cached"), [])
    later = [s for d in samplers for s in d["later_steps_s"]]
    return {"total_s": round(total_s, 2), **{k: round(v, 2) for k, v in parts.items()}, "queue_s": queue,
            "s_per_step": round(statistics.median(later), 3) if later else None, "samplers": samplers,
            "nodes": nodes, "cached_nodes": [str(n) for n in cached]}
