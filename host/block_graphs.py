"""Block graphs on the pack's Qwen-Image transformer: kernels/block_graphs.py's hook, and ComfyUI's reasons to leave a
model call eager.

Installed by the Qwen-Image loaders (host/qwen_stages.py ``load_staged_model``), beside Block Swap's hook. A model
call runs eagerly, with one log line per reason, while anything could change what a block computes without the
graph seeing it: ComfyUI started with ``--disable-cuda-graphs``, Torch Compile on the model, a ControlNet, a text
attention mask (the block reads it from its caller, a new tensor each call), another node's patches or replace
patches, another node's attention override. The graphs are dropped when the model's weights leave the GPU
(``ON_DETACH`` with ``unpatch_all``), so no captured scratch memory outlives the weights it was captured for, and
given back first when ComfyUI or a pack node needs memory beside the loaded weights (``release_block_graphs``): a
model that stays loaded loses the graphs' speed-up (little where its streamed blocks' copies are the limit, as on an
8 GB card), one unloaded for a few hundred MB costs its whole load again in the next render.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from ..kernels.block_graphs import BlockGraphs
from ..kernels.hooks import HookRegistry
from .attention import OVERRIDE_KEY, foreign_part
from .hooks import call_arguments, hook_registry, is_our_block_patch, register_hook
from .torch_compile import COMPILE_KEY, CORE_COMPILE_KEY

GRAPHS_KEY = "lowvram_dit_block_graphs"
log = logging.getLogger("comfyui_lowvram_dit")


def why_eager(module: Any, registry: HookRegistry, inputs: tuple) -> str | None:
    """Why this model call must run its blocks eagerly, or None when they may replay CUDA graphs."""
    import comfy.model_management as mm
    from comfy.patcher_extension import WrappersMP

    if getattr(getattr(mm, "args", None), "disable_cuda_graphs", False):
        return "ComfyUI runs with --disable-cuda-graphs"
    named = call_arguments(*inputs)
    options = named.get("transformer_options") or {}
    if COMPILE_KEY in registry or ((options.get("wrappers") or {}).get(WrappersMP.APPLY_MODEL) or {}).get(
            CORE_COMPILE_KEY):
        return "Torch Compile is on this model"
    if named.get("control") is not None:
        return "a ControlNet is attached"
    if named.get("attention_mask") is not None:
        return "the text has an attention mask"
    patches = sorted(k for k, v in (options.get("patches") or {}).items() if v)
    if patches:
        return f"another node's patches ({', '.join(patches)})"
    replace = options.get("patches_replace") or {}
    foreign = [k for k, v in replace.items() if k != "dit" and v]
    foreign += [k for k, v in (replace.get("dit") or {}).items() if not is_our_block_patch(v)]
    if foreign:
        return f"another node's replace patches ({', '.join(map(str, foreign))})"
    if foreign_part(options.get(OVERRIDE_KEY)) is not None:
        return "another node's attention override"
    return None


class _DropOnDetach:
    """``ON_DETACH`` callback: when the model's weights leave the GPU (``unpatch_all``), its graphs and their memory go
    too. ComfyUI also detaches between two samplings of the same loaded model (``unpatch_all=False``): the weights
    stay where they are, and so do the graphs (a block whose tensors did move is captured again anyway)."""

    def __init__(self, graphs: BlockGraphs) -> None:
        self.graphs = graphs

    def __deepcopy__(self, memo: dict) -> _DropOnDetach:
        return self

    def __call__(self, patcher: Any, unpatch_all: bool = True, *args: Any) -> None:
        if unpatch_all:
            for graphs in _every_instance(self.graphs):
                graphs.drop()


def _every_instance(graphs: BlockGraphs) -> list[BlockGraphs]:
    """The instance installed in a model and those serving its MultiGPU copies."""
    return [graphs, *(g for g in graphs.models.others() if isinstance(g, BlockGraphs))]


def release_block_graphs(device: torch.device, patchers: Iterable[Any] | None = None) -> int:
    """Give back the memory the block graphs of ``patchers`` (None: every model ComfyUI has loaded) hold on
    ``device``; those models run eagerly until their weights leave. The bytes of free memory that gained (0 when no
    graphs were held)."""
    import comfy.model_management as mm

    if patchers is None:
        patchers = [loaded.model for loaded in mm.current_loaded_models]
    found = [g for p in patchers if p is not None and (g := block_graphs_of(p)) is not None]
    if not found:
        return 0
    before = mm.get_free_memory(device)
    held = [g.give_back(device) for graphs in found for g in _every_instance(graphs)]
    if not any(held):
        return 0
    mm.soft_empty_cache()
    freed = max(0, int(mm.get_free_memory(device) - before))
    log.info("lowvram_dit block graphs: gave back %.2f GiB on %s so that the loaded weights can stay; the model runs "
             "its blocks eagerly until it is loaded again", freed / 2**30, device)
    return freed


def apply_block_graphs(model: Any) -> Any:
    """A clone of ``model`` (ModelPatcher) whose transformer blocks replay CUDA graphs where they may."""
    import comfy.patcher_extension as pe

    graphs = BlockGraphs(why_eager)
    m = model.clone()
    register_hook(m, GRAPHS_KEY, graphs)
    m.add_callback_with_key(pe.CallbacksMP.ON_DETACH, GRAPHS_KEY, _DropOnDetach(graphs))
    return m


def block_graphs_of(model: Any) -> BlockGraphs | None:
    """The block graphs installed in ``model`` (ModelPatcher), or None."""
    hook = hook_registry(model).get(GRAPHS_KEY)
    return hook if isinstance(hook, BlockGraphs) else None
