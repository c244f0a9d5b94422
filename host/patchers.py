"""ModelPatcher classes: mixing the pack's behaviour into a patcher's class, and whether DynamicVRAM owns one."""

from __future__ import annotations

from typing import Any

_MIXED: dict[tuple[type, type], type] = {}


def mixed_class(mixin: type, base: type, prefix: str) -> type:
    """``base`` (a ModelPatcher class) with ``mixin`` in front, named ``<prefix><base>``; cached and idempotent,
    so patchers re-mixed on every node run keep one class (and ``clone()``, which uses ``__class__``, keeps it)."""
    if issubclass(base, mixin):
        return base
    key = (mixin, base)
    if key not in _MIXED:
        _MIXED[key] = type(f"{prefix}{base.__name__}", (mixin, base), {})
    return _MIXED[key]


def dynamic_vram_manages(patcher: Any) -> bool:
    """Whether ComfyUI's DynamicVRAM (``ModelPatcherDynamic``, on by default on NVIDIA since 0.16) owns this
    patcher's VRAM; False on hosts without it and under ``--disable-dynamic-vram``."""
    is_dynamic = getattr(patcher, "is_dynamic", None)
    return bool(is_dynamic()) if callable(is_dynamic) else False
