"""The pack's per-block and attention code outside ComfyUI's allocation-graph recording (the Comfy Compiler).

Newer ComfyUI records a model's GPU allocations between ``malloc_graph_begin`` and ``malloc_graph_end`` (around
the block loop of models that opt in) and replays that plan in the next step; an allocation that outlives the
step inside it (a cached rotation matrix, compiled code, fused Triton kernels, the Block Swap ring's views) breaks
the plan ("aimdo memory compile error"). ComfyUI's answer is ``comfy.model_prefetch.pause_malloc_graph``: the
pack's block chain and attention run inside it, so what they allocate comes from the normal allocator. A host
without it gets a no-op. Nothing here runs inside a compiled region (a Dynamo trace would break on it).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any


def outside_allocation_graph() -> contextlib.AbstractContextManager[Any]:
    """ComfyUI's ``pause_malloc_graph()`` where this ComfyUI has one (a no-op while nothing records), else a
    no-op context."""
    prefetch = sys.modules.get("comfy.model_prefetch")  # imported by ComfyUI itself wherever it records
    pause = getattr(prefetch, "pause_malloc_graph", None)
    return pause() if callable(pause) else contextlib.nullcontext()
