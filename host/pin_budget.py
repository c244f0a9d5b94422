"""Block Swap's pinned host arena inside ComfyUI's own pinned-memory account.

ComfyUI caps the RAM it page-locks (``comfy.model_management.MAX_PINNED_MEMORY``, counted in
``TOTAL_PINNED_MEMORY``; newer releases refuse a pin past it and evict inactive models' pins to make room). The
arena is registered by the pack itself, so without this ComfyUI would pin up to its cap on top of it. Here the
arena asks ComfyUI for room first (its own eviction, never the active model's pins), is counted while registered
and stays pageable when there is no room or ComfyUI's pinning is off (``--disable-pinned-memory``). Hosts that
keep no account are not limited. What the host offers is probed, never its version.
"""

from __future__ import annotations

import inspect
from typing import Any

from .system_ram import usable_ram

_HELD = [0]  # bytes of pack arenas counted in ComfyUI's account right now (for the Doctor)


def _account() -> Any | None:
    """``comfy.model_management`` when it keeps a pinned-memory account, else None."""
    import comfy.model_management as mm

    if isinstance(getattr(mm, "TOTAL_PINNED_MEMORY", None), (int, float)) and isinstance(
            getattr(mm, "MAX_PINNED_MEMORY", None), (int, float)):
        return mm
    return None


def _ensure(ensure: Any, nbytes: int) -> bool:
    """ComfyUI's ``ensure_pin_*(nbytes)``: True when it made room. evict_active=False where it takes it: the pins of
    the model being loaded (often this one's embeddings) stay where they are."""
    try:
        takes_evict = "evict_active" in inspect.signature(ensure).parameters
    except (TypeError, ValueError):
        takes_evict = False
    return bool(ensure(nbytes, evict_active=False) if takes_evict else ensure(nbytes))


def _room(mm: Any, nbytes: int) -> bool:
    """Whether ComfyUI's account can take ``nbytes`` more, after ComfyUI freed what it is willing to free."""
    ensure = getattr(mm, "ensure_pin_registerable", None)
    if not callable(ensure):
        return mm.TOTAL_PINNED_MEMORY + nbytes <= mm.MAX_PINNED_MEMORY
    return _ensure(ensure, nbytes)


class ComfyPinBudget:
    """offload/host_memory.py ``PinBudget`` backed by ComfyUI's pinned-memory account."""

    def reserve(self, nbytes: int) -> bool:
        """Count ``nbytes`` in ComfyUI's account; False when it has no room or pinning is off there."""
        mm = _account()
        if mm is None:
            return True
        if mm.MAX_PINNED_MEMORY <= 0 or not _room(mm, nbytes):
            return False
        mm.TOTAL_PINNED_MEMORY += nbytes
        _HELD[0] += nbytes
        return True

    def release(self, nbytes: int) -> None:
        """Stop counting ``nbytes`` (the arena was unregistered)."""
        mm = _account()
        if mm is not None:
            mm.TOTAL_PINNED_MEMORY = max(0, mm.TOTAL_PINNED_MEMORY - nbytes)
        _HELD[0] = max(0, _HELD[0] - nbytes)


def pinned_by_pack() -> int:
    """Bytes of Block Swap arenas counted in ComfyUI's pinned-memory account now."""
    return _HELD[0]


# Free RAM left after a new pinned allocation where ComfyUI has no RAM check of its own (0.8.0): page-locked memory
# cannot be swapped, so the rest of the process and the page cache need room beside it.
RAM_HEADROOM = 4 << 30


def ram_allows(nbytes: int) -> bool:
    """Whether ``nbytes`` of new page-locked RAM fits: ComfyUI's own check (``ensure_pin_budget``, which first frees
    idle models' pins) where it has one, else free RAM above RAM_HEADROOM."""
    import comfy.model_management as mm

    ensure = getattr(mm, "ensure_pin_budget", None)
    if callable(ensure):
        return _ensure(ensure, nbytes)
    return usable_ram().available - nbytes >= RAM_HEADROOM
