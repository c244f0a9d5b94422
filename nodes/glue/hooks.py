"""Install a kernels/hooks.py ``HookRegistry`` into a ComfyUI MODEL (ModelPatcher).

One registry per MODEL, installed as one ``APPLY_MODEL`` wrapper (the forward chain, with the BaseModel as the
module) and, when a hook acts per block, one ``patches_replace["dit"][("double_block", i)]`` patch per block
(the block chain; a replace patch already there from another pack keeps running inside it). Registering and
removing go through a copy of the registry, so clones made earlier keep the hooks they had; removing the last
hook restores the patches that were there before.
"""

from __future__ import annotations

from typing import Any

from ...kernels.hooks import HookRegistry, ModelHook, find_blocks
from .host_compiler import outside_allocation_graph

HOOKS_KEY = "lowvram_dit_hooks"


class _HookedForward:
    """``APPLY_MODEL`` wrapper: runs the model call inside the registry's forward chain."""

    def __init__(self, registry: HookRegistry) -> None:
        self.registry = registry

    def __deepcopy__(self, memo: dict) -> _HookedForward:
        return self

    def __call__(self, executor: Any, *args: Any, **kwargs: Any) -> Any:
        return self.registry.run_forward(executor.class_obj, lambda: executor(*args, **kwargs), (args, kwargs))


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
