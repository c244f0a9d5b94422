"""Install a kernels/hooks.py ``HookRegistry`` into a ComfyUI MODEL (ModelPatcher).

One registry per MODEL, installed as one ``APPLY_MODEL`` wrapper (the forward chain, with the BaseModel as the
module) and, when a hook acts per block, one ``patches_replace["dit"][("double_block", i)]`` patch per block
(the block chain; a replace patch already there from another pack keeps running inside it). Registering and
removing go through a copy of the registry, so clones made earlier keep the hooks they had; removing the last
hook restores the patches that were there before.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..kernels.hooks import HookRegistry, ModelHook, find_blocks
from .compiler import outside_allocation_graph

log = logging.getLogger("comfyui_lowvram_dit")

HOOKS_KEY = "lowvram_dit_hooks"
# BaseModel.apply_model's positional parameters, as ComfyUI's wrapper executor passes them on.
APPLY_MODEL_PARAMS: tuple[str, ...] = ("x", "t", "c_concat", "c_crossattn", "control", "transformer_options")
# transformer_options lists with one entry per batched chunk (comfy/samplers.py ``_calc_cond_batch``).
PER_CHUNK_OPTIONS: tuple[str, ...] = ("cond_or_uncond", "uuids")


def call_arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    """``apply_model``'s arguments by name, positional and keyword alike."""
    return {**dict(zip(APPLY_MODEL_PARAMS, args)), **kwargs}


class _Unsplittable(Exception):
    """An argument whose batch layout is not known: the call runs batched."""


def _sample_of(value: Any, i: int, batch: int) -> Any:
    """Sample ``i`` of ``value``: a tensor with a leading dim of ``batch`` sliced (a leading 1 broadcasts and
    stays), the same for the tensors of a list or tuple, anything else as it is."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] == 1:
            return value
        if value.shape[0] != batch:
            raise _Unsplittable(f"a tensor of leading dim {value.shape[0]} in a batch of {batch}")
        return value[i:i + 1]
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_sample_of(v, i, batch) for v in value)
    return value


def _sample_options(options: Any, i: int, batch: int) -> Any:
    """A shallow copy of ``transformer_options`` for sample ``i``: its per-chunk lists hold that sample's chunk."""
    if not isinstance(options, dict):
        return options
    mine = dict(options)
    for key in PER_CHUNK_OPTIONS:
        entries = options.get(key)
        if entries is None:
            continue
        if not isinstance(entries, list) or not entries or batch % len(entries):
            raise _Unsplittable(f"transformer_options[{key!r}] does not divide a batch of {batch}")
        mine[key] = [entries[i // (batch // len(entries))]]
    return mine


def split_per_sample(args: tuple, kwargs: dict) -> list[tuple[tuple, dict]] | None:
    """``apply_model``'s (args, kwargs) as one (args, kwargs) per sample, or None when the call stays batched.

    Hooks with ``PER_SAMPLE`` (Torch Compile) need it: ComfyUI's MultiGPU split runs cond and uncond as a batch
    of 1 each where one GPU runs a batch of 2, and compiled kernels round differently by batch size; running
    every sample alone makes both give the same result. Not split: a batch of 1, a ControlNet (its residuals are
    made for the whole batch), or an argument whose batch layout is unknown (one debug line says which)."""
    x = args[0] if args else kwargs.get("x")
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] < 2:
        return None
    batch = int(x.shape[0])
    if call_arguments(args, kwargs).get("control") is not None:
        log.debug("lowvram_dit hooks: a batch of %d runs batched: a ControlNet is attached", batch)
        return None
    try:
        return [_one_sample(args, kwargs, i, batch) for i in range(batch)]
    except _Unsplittable as why:
        log.debug("lowvram_dit hooks: a batch of %d runs batched: %s", batch, why)
        return None


def _one_sample(args: tuple, kwargs: dict, i: int, batch: int) -> tuple[tuple, dict]:
    """Sample ``i``'s (args, kwargs) of an ``apply_model`` call of ``batch`` samples."""
    def pick(name: str, value: Any) -> Any:
        return _sample_options(value, i, batch) if name == "transformer_options" else _sample_of(value, i, batch)

    names = APPLY_MODEL_PARAMS + ("",) * max(0, len(args) - len(APPLY_MODEL_PARAMS))
    return tuple(pick(n, v) for n, v in zip(names, args)), {k: pick(k, v) for k, v in kwargs.items()}


class _HookedForward:
    """``APPLY_MODEL`` wrapper: runs the model call inside the registry's forward chain."""

    def __init__(self, registry: HookRegistry) -> None:
        self.registry = registry

    def __deepcopy__(self, memo: dict) -> _HookedForward:
        return self

    def __call__(self, executor: Any, *args: Any, **kwargs: Any) -> Any:
        """The model call through the chain; one sample at a time when a hook asks for it (``split_per_sample``),
        each sample through the whole chain, the outputs concatenated in batch order."""
        calls = split_per_sample(args, kwargs) if self.registry.per_sample else None
        if calls is None:
            return self.registry.run_forward(executor.class_obj, lambda: executor(*args, **kwargs), (args, kwargs))
        return torch.cat([self.registry.run_forward(executor.class_obj, lambda a=a, k=k: executor(*a, **k), (a, k))
                          for a, k in calls], dim=0)


class _HookedBlock:
    """``("double_block", i)`` replace patch: runs block ``i`` (or the patch it wraps) inside the block chain."""

    def __init__(self, registry: HookRegistry, index: int, inner: Any = None) -> None:
        self.registry, self.index, self.inner = registry, index, inner

    def __deepcopy__(self, memo: dict) -> _HookedBlock:
        return self

    def __call__(self, args: dict, extra: dict) -> dict:
        inner = self.inner
        run = (lambda a: inner(a, extra)) if inner is not None else extra["original_block"]
        with outside_allocation_graph():  # the chain keeps allocations across steps (compile, swap, attention)
            return self.registry.run_block(self.index, args, run)


def is_our_block_patch(patch: Any) -> bool:
    """Whether a ``("double_block", i)`` replace patch is the hooks' own, wrapping no other node's patch."""
    return isinstance(patch, _HookedBlock) and patch.inner is None


def hook_registry(patcher: Any) -> HookRegistry:
    """The registry installed in ``patcher`` (an empty one when none is)."""
    import comfy.patcher_extension as pe

    for wrapper in patcher.get_wrappers(pe.WrappersMP.APPLY_MODEL, HOOKS_KEY):
        if isinstance(wrapper, _HookedForward):
            return wrapper.registry
    return HookRegistry()


def register_hook(patcher: Any, name: str, hook: ModelHook) -> None:
    """Attach ``hook`` under ``name`` to ``patcher`` (a clone the caller owns); the same name is replaced."""
    registry = hook_registry(patcher).copy()
    registry.register(name, hook)
    _install(patcher, registry)


def remove_hook(patcher: Any, name: str) -> ModelHook | None:
    """Detach the hook under ``name`` from ``patcher`` and return it; the last one out restores the model."""
    registry = hook_registry(patcher).copy()
    hook = registry.remove(name)
    _install(patcher, registry)
    return hook


def _install(patcher: Any, registry: HookRegistry) -> None:
    import comfy.patcher_extension as pe

    patcher.remove_wrappers_with_key(pe.WrappersMP.APPLY_MODEL, HOOKS_KEY)
    options = patcher.model_options["transformer_options"]
    replace = options.get("patches_replace", {}).get("dit", {})
    for key, patch in list(replace.items()):  # take ours out, keeping what each one wrapped
        if isinstance(patch, _HookedBlock):
            if patch.inner is None:
                del replace[key]
            else:
                replace[key] = patch.inner
    if registry.per_block:
        _, blocks = find_blocks(patcher.model.diffusion_model, "LowVRAM hooks")
        replace = options.setdefault("patches_replace", {}).setdefault("dit", {})
        for i in range(len(blocks)):
            replace[("double_block", i)] = _HookedBlock(registry, i, replace.get(("double_block", i)))
    if len(registry):
        patcher.add_wrapper_with_key(pe.WrappersMP.APPLY_MODEL, HOOKS_KEY, _HookedForward(registry))
