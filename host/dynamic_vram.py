"""Taking a model off ComfyUI's DynamicVRAM for a node that must own its weights' placement (compile, Block Swap).

ComfyUI's own protocol, as its TorchCompileModel node uses it: ``clone(disable_dynamic=True)`` rebuilds the model
through the loader's ``cached_patcher_init`` with ``disable_dynamic=True`` and hands back a legacy ``ModelPatcher``.
That plain class has none of the loader's patcher mixins, so the pack's file-backed offload is given again to the
rebuilt model (its mapped weights would otherwise be pinned into anonymous copies).
"""

from __future__ import annotations

import logging
from typing import Any

from .log import say_once
from .mapped_weights import keep_file_backed
from .patchers import dynamic_vram_manages

log = logging.getLogger("comfyui_lowvram_dit")


def legacy_clone(patcher: Any, node: str) -> Any | None:
    """A clone of a DynamicVRAM-managed ``patcher`` under ComfyUI's legacy loading, or None when this model cannot
    be rebuilt (its loader registered no ``cached_patcher_init``). A patcher DynamicVRAM does not manage: None."""
    if not dynamic_vram_manages(patcher) or getattr(patcher, "cached_patcher_init", None) is None:
        return None
    clone = keep_file_backed(patcher.clone(disable_dynamic=True))
    say_once(log, f"lowvram_dit {node}: the model leaves ComfyUI's DynamicVRAM for its legacy loading (as ComfyUI's "
                  "own TorchCompileModel does), so this node can place its weights; it is rebuilt from its file once")
    return clone
