"""Host memory for streamed weights: one pinned arena per model, and which CPU tensors are file-backed.

An arena is pinned with ``cudaHostRegister`` (exact size, unlike ``pin_memory()``, which rounds to powers of
two). A tensor whose storage lies in a file mapping (a mapped safetensors file) costs page cache, not anonymous
RAM, so an idle model can go back to it, offering its arena's memory to the next arena of the same size.
"""

from __future__ import annotations

import bisect
import logging
import weakref
from typing import Iterable, Protocol

import torch

from ..checkpoints.safetensors_io import MADV_DONTNEED, advise_mapped

log = logging.getLogger("comfyui_lowvram_dit")


def file_backed_ranges() -> list[tuple[int, int]]:
    """Address ranges of file-backed mappings of this process, by address (Linux /proc/self/maps; empty elsewhere).

    A ComfyUI process has well over a thousand (every library it loaded): read them once per batch of tensors."""
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[5].startswith("/"):
                    lo, hi = parts[0].split("-")
                    ranges.append((int(lo, 16), int(hi, 16)))
    except OSError:
        pass
    return sorted(ranges)


def page_out(tensors: Iterable[torch.Tensor], ranges: list[tuple[int, int]] | None = None) -> int:
    """Drop the pages under file-backed CPU tensors from this process's RSS (Linux); returns bytes advised.

    After the arena copy the mapped file pages are only needed again when the model is re-activated, so they
    should not sit in RSS. MADV_DONTNEED unmaps them from this process only: the page cache keeps them (the kernel
    reclaims it under pressure), so the next load of the same file (the next render, the other expert's switch
    back) reads RAM, not the disk. MADV_PAGEOUT would evict them from the page cache as well, making every later
    load re-read the whole file. The tensors are never written, so nothing is lost either way. A no-op elsewhere.
    ``ranges``: ``file_backed_ranges()`` read by the caller (read here when not given).
    """
    # Only tensors inside a file mapping: MADV_DONTNEED on anonymous memory (an arena view, a private copy) would
    # zero it.
    maps = file_backed_ranges() if ranges is None else ranges
    return advise_mapped([t for t in tensors if is_file_backed(t, maps)], MADV_DONTNEED)


def is_file_backed(t: torch.Tensor, ranges: list[tuple[int, int]] | None = None) -> bool:
    """True if ``t``'s CPU storage lies in a file mapping (e.g. a safetensors mmap): it costs no anonymous RAM.

    ``ranges``: ``file_backed_ranges()`` (sorted, not overlapping) read by the caller; read here when not given."""
    if t.device.type != "cpu" or t.numel() == 0:
        return False
    ptr = t.data_ptr()
    ranges = file_backed_ranges() if ranges is None else ranges
    i = bisect.bisect_right(ranges, (ptr, float("inf"))) - 1  # the last range starting at or below ptr
    return i >= 0 and ranges[i][0] <= ptr < ranges[i][1]


class PinBudget(Protocol):
    """The host application's account of page-locked RAM, shared with the memory it pins itself."""

    def reserve(self, nbytes: int) -> bool:
        """Count ``nbytes`` about to be registered; False when the account has no room (nothing counted)."""

    def release(self, nbytes: int) -> None:
        """Stop counting ``nbytes`` that were unregistered."""


class HostArena:
    """One exact-size host buffer, optionally pinned with cudaHostRegister (about 10x faster than pin_memory).

    With a ``budget`` the registration is counted in the host's pinned-memory account while it lasts, and the
    arena stays pageable (synchronous copies) when that account has no room.
    """

    def __init__(self, nbytes: int, pin: bool, budget: PinBudget | None = None) -> None:
        self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        self.pinned = False
        self.budget = budget
        self.refused = False  # the budget said no the last time pin() asked
        self.last_copy = None  # event after the latest H2D copy out of the buffer (one copy stream: in order)
        if pin:
            self.pin()

    def pin(self) -> bool:
        """Page-lock the buffer so H2D copies are asynchronous DMA; False (with a log line) when it cannot."""
        if self.pinned or not torch.cuda.is_available():
            return self.pinned
        nbytes = self.buffer.numel()
        if self.budget is not None and not self.budget.reserve(nbytes):
            if not self.refused:  # once per arena, not on every re-load
                log.warning("lowvram_dit block swap: the host's pinned-memory budget has no room for %.2f GB; "
                            "copies will be synchronous. Unload other models, free RAM or turn `pinned` off.",
                            nbytes / 1e9)
            self.refused = True
            return False
        self.refused = False
        err = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), nbytes, 0)
        self.pinned = err == 0  # cudaError_t cudaSuccess (compared as ComfyUI's pin_memory does)
        if not self.pinned:
            if self.budget is not None:
                self.budget.release(nbytes)
            log.warning("lowvram_dit block swap: cudaHostRegister of %.2f GB failed (%s); copies will be "
                        "synchronous. Free RAM or turn `pinned` off.", nbytes / 1e9, err)
        return self.pinned

    def unpin(self) -> None:
        """Release the page lock (the memory stays valid), after the last copy out of it has finished."""
        if not self.pinned:
            return
        if self.last_copy is not None:
            self.last_copy.synchronize()
        err = torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
        self.pinned = False
        if err == 0 and self.budget is not None:
            self.budget.release(self.buffer.numel())
        if err != 0:  # still page-locked: it stays in the budget too
            # Freeing it now would leave a stale registration behind: keep the buffer for the process's life.
            _UNFREED.append(self.buffer)
            log.warning("lowvram_dit block swap: cudaHostUnregister of %.2f GB failed (%s); that RAM stays "
                        "allocated until ComfyUI restarts", self.buffer.numel() / 1e9, err)
            discard_cuda_error()

    def __del__(self) -> None:
        # Memory freed while still registered stays registered in the driver: a later allocation at the same
        # address (a checkpoint read, a state dict) then fails its H2D copy with "CUDA error: invalid argument".
        # ComfyUI drops a patcher without unloading it (weak references; ModelPatcher.__del__ only detaches), so
        # the arena may go with its patcher while pinned: unregister here, before the buffer is freed.
        try:
            self.unpin()
        except Exception:  # noqa: BLE001 - interpreter shutdown or a CUDA context already gone
            pass

    def contains(self, t: torch.Tensor) -> bool:
        """True if ``t`` is a view into this arena."""
        base = self.buffer.data_ptr()
        return t.device.type == "cpu" and base <= t.data_ptr() < base + self.buffer.numel()


_UNFREED: list[torch.Tensor] = []  # buffers whose unregistration failed (see HostArena.unpin)
_SPARES: weakref.WeakSet[SpareArena] = weakref.WeakSet()  # offered, not yet taken


class SpareArena:
    """The memory of an arena its model dropped (pinned, if it was), kept by that model for the next arena of the
    same size on the same device to take.

    Two-expert Wan 2.2 switches experts twice per render: the expert going idle drops its arena for its file pages
    and the other copies its blocks into that same memory, so neither allocates, first-touches nor (un)pins one.
    What no arena takes is freed before any new arena is allocated (RAM never holds both), at the end of the next
    load of a streamed model (``release_spares``), or with the idle model.
    """

    def __init__(self, arena: HostArena, device: torch.device) -> None:
        if arena.last_copy is not None:
            arena.last_copy.synchronize()  # the next owner overwrites it: no copy out of it may still be running
            arena.last_copy = None
        self.arena: HostArena | None = arena
        self.device = device_key(device)
        _SPARES.add(self)

    def release(self) -> None:
        """Unpin and free the memory now, unless an arena took it."""
        _SPARES.discard(self)
        if self.arena is not None:
            self.arena.unpin()
            self.arena = None


def device_key(device: torch.device | str) -> tuple[str, int]:
    """``cuda`` and ``cuda:0`` as one device (ComfyUI names its devices with an index, torch not always)."""
    device = torch.device(device)
    return device.type, device.index or 0


def release_spares(device: torch.device | None = None) -> None:
    """Free every spare no arena has taken (those offered on ``device``; all of them without one)."""
    for spare in list(_SPARES):
        if device is None or spare.device == device_key(device):
            spare.release()


def take_spare(nbytes: int, device: torch.device, first: SpareArena | None = None) -> HostArena | None:
    """A spare arena of exactly ``nbytes`` offered on ``device`` (``first`` if it is one), now the caller's; None
    when there is none."""
    for spare in [first] * (first is not None) + list(_SPARES):
        arena = spare.arena
        if arena is not None and spare.device == device_key(device) and arena.buffer.numel() == max(nbytes, 1):
            spare.arena = None
            _SPARES.discard(spare)
            return arena
    return None


def discard_cuda_error() -> None:
    """Consume an error a failed CUDA runtime call left behind, so the next (unrelated) kernel launch does not
    raise it (as ComfyUI's model_management.discard_cuda_async_error does)."""
    if not torch.cuda.is_available():
        return
    try:
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    except RuntimeError:
        pass
