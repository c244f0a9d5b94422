"""Weights ComfyUI unloads from a Block Swap model, kept as they were on the GPU for the reload.

When a model DynamicVRAM manages (a kept text encoder, the VAE) needs room, ComfyUI unloads part of a legacy-loaded
model (``ModelPatcher.partially_unload``): each moved weight is pointed back at its CPU original (for a mapped
file, its file view, whose pages are out of RSS) and the GPU copy, LoRA merged, is dropped. The sampler's next
load then reads those pages back from the page cache (pageable copies) and merges the LoRA again, weight by
weight; a DynamicVRAM model faults its weights back from pinned memory instead.

``ParkedWeights`` keeps what left the GPU in one pinned host arena, counted in ComfyUI's pinned-memory account:
``park`` copies the moved weights there as ``partially_unload`` returns (or, for a model that streams blocks, as a
full unload returns: a Wan 2.2 expert switch, where the idle expert's resident part would otherwise be read from its
file and merged with its LoRA again at every switch), and ``restore`` (called from
``patch_weight_to_device``, which ComfyUI's load calls for every weight of a module it loads whole) puts one back
with a single asynchronous copy, recording the backup ComfyUI itself would have made. A parked weight serves only a
patcher with the same patches (``patches_uuid``) over the same CPU original and shape; anything else drops it, and
ComfyUI loads and patches that weight as usual. Only plain tensors are parked (ComfyUI's QuantizedTensor and
ComfyUI-GGUF's tensors carry state beside their bytes). Parking happens only where the arena is pinned; the arena
stays for the next park while the model is loaded, and goes with a full unload that does not park (one of a model
that streams nothing or keeps more than ``block_swap.PARK_SHARE`` of itself on the GPU, or with too little RAM) or
with the model (ComfyUI dropping it from its cache).

Never imports ComfyUI at module level.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..offload.host_memory import HostArena, PinBudget, device_key
from .log import say_once
from .pin_budget import ram_allows

log = logging.getLogger("comfyui_lowvram_dit")

ALIGN = 512  # bytes between parked weights' starts (any dtype's alignment; whole cache lines for the copies)
# The arena is allocated in steps of this size: the next partial unload of the same model may free a little more,
# and a new arena pays its first touch and registration again
ARENA_STEP = 512 << 20
# What ModelPatcher.patch_weight_to_device keeps in ``backup`` (a namedtuple of this name and these fields)
_Backup = collections.namedtuple("Dimension", ["weight", "inplace_update"])


@dataclass(frozen=True)
class _Slot:
    offset: int
    shape: torch.Size
    dtype: torch.dtype
    source_ptr: int  # the CPU original the weight was pointed back at by partially_unload
    patches_uuid: Any


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def regular_weights(patcher: Any) -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    """The plain weights, by key, of every module ComfyUI has loaded whole onto ``patcher``'s load device (what an
    unload may move), each with its module: taken just before ComfyUI unloads the model or part of it."""
    out, device = {}, device_key(patcher.load_device)
    for name, m in patcher.model.named_modules():
        if getattr(m, "comfy_patched_weights", False) is not True or not hasattr(m, "comfy_cast_weights"):
            continue
        for attr, p in m.named_parameters(recurse=False):
            if type(p.data) is torch.Tensor and device_key(p.device) == device:
                out[f"{name}.{attr}" if name else attr] = (m, p.data)
    return out


class ParkedWeights:
    """The weights one Block Swap model's partial unloads moved off the GPU, in one pinned host arena."""

    def __init__(self, budget: PinBudget | None = None) -> None:
        self.budget = budget
        self.arena: HostArena | None = None
        self.slots: dict[str, _Slot] = {}
        self.used = 0
        self.device: torch.device | None = None  # where the parked weights came from
        self.restored = 0  # bytes put back by restore() since the last park (for the load's log line)

    def park(self, patcher: Any, before: dict[str, tuple[torch.nn.Module, torch.Tensor]], whole: bool = False) -> int:
        """Copy the weights of ``before`` that ``partially_unload`` moved off the GPU (``whole``: that a full unload
        replaced, every one the model no longer holds) into the arena; their GPU copies are freed when the caller
        drops ``before``. Returns the bytes parked (0 where nothing is pinned)."""
        import comfy.utils

        if whole:
            moved = {k: (m, t) for k, (m, t) in before.items()
                     if comfy.utils.get_attr(patcher.model, k).data_ptr() != t.data_ptr()}
        else:
            moved = {k: (m, t) for k, (m, t) in before.items() if getattr(m, "comfy_patched_weights", None) is False}
        if not moved:
            return 0
        need = sum(_aligned(t.numel() * t.element_size()) for _, t in moved.values())
        if not self._room(need):
            return 0
        self.device = device = next(iter(moved.values()))[1].device
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # a restore's copy out of the arena may still be reading it
        parked = 0
        for key, (_, t) in moved.items():
            n = t.numel() * t.element_size()
            if self.used + n > self.arena.buffer.numel():
                break
            source = comfy.utils.get_attr(patcher.model, key)
            self._view(self.used, t.shape, t.dtype).copy_(t, non_blocking=True)
            self.slots[key] = _Slot(self.used, t.shape, t.dtype, source.data_ptr(), patcher.patches_uuid)
            self.used += _aligned(n)
            parked += n
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the GPU copies may go once the caller returns
        self.restored = 0
        log.info("lowvram_dit Block Swap: %.2f GB that ComfyUI unloaded kept in pinned memory (LoRA merged) for the "
                 "next load", parked / 1e9)
        return parked

    def _room(self, need: int) -> bool:
        """Whether the arena can take ``need`` more bytes, making a pinned one when no weight is parked."""
        if self.arena is not None and self.used + need <= self.arena.buffer.numel():
            return True
        if self.slots:
            return self.arena is not None and self.used < self.arena.buffer.numel()  # park what fits
        size = max(-(-need // ARENA_STEP) * ARENA_STEP, self.arena.buffer.numel() if self.arena is not None else 0)
        self.drop()
        if not ram_allows(size):
            say_once(log, "lowvram_dit Block Swap: not enough free RAM to keep the weights ComfyUI unloads "
                          "in pinned memory; they are loaded again from their files as ComfyUI does")
            return False
        self.arena = HostArena(size, pin=False, budget=self.budget)
        # touched first, by torch's threads: registering untouched memory faults every page in one thread, several
        # times slower than the fill and the registration together
        self.arena.buffer.zero_()
        if not self.arena.pin():
            say_once(log, "lowvram_dit Block Swap: no pinned memory for the weights ComfyUI unloads; they "
                          "are loaded again from their files as ComfyUI does")
            self.drop()
            return False
        return True

    def _view(self, offset: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        n = shape.numel() * dtype.itemsize
        return self.arena.buffer[offset:offset + n].view(dtype).view(shape)

    def restore(self, patcher: Any, key: str, device_to: Any) -> bool:
        """Put the parked ``key`` back on ``device_to`` as ``patch_weight_to_device`` would leave it (the weight set,
        its CPU original in ``backup`` where it has patches); False, with nothing changed, where it cannot."""
        import comfy.utils

        slot = self.slots.pop(key, None)
        if slot is None:
            return False
        if slot.patches_uuid != patcher.patches_uuid:
            self.slots.clear()  # parked for other patches: none of them is the weight this patcher wants
            self.used = 0
            return False
        weight = comfy.utils.get_attr(patcher.model, key)
        if weight.data_ptr() != slot.source_ptr or weight.shape != slot.shape or weight.dtype != slot.dtype:
            return False
        if key in patcher.patches and key not in patcher.backup:
            patcher.backup[key] = _Backup(weight, False)
        back = torch.empty(slot.shape, dtype=slot.dtype, device=device_to)  # a copy even where device_to is the CPU
        comfy.utils.set_attr_param(patcher.model, key,
                                   back.copy_(self._view(slot.offset, slot.shape, slot.dtype), non_blocking=True))
        self.restored += slot.shape.numel() * slot.dtype.itemsize
        if not self.slots:
            self.used = 0
        return True

    def say_restored(self) -> None:
        """After a load: one log line for what restore() put back, if anything; what it did not is forgotten."""
        if self.restored:
            log.info("lowvram_dit Block Swap: %.2f GB loaded again from pinned memory, LoRA already merged",
                     self.restored / 1e9)
            self.restored = 0
        self.forget()

    def forget(self) -> None:
        """After a load: parked weights it did not take back (their blocks stream now, or stayed on the CPU) are
        stale; the arena stays for the next park."""
        if self.slots:
            log.debug("lowvram_dit Block Swap: %d parked weights not loaded back, forgotten", len(self.slots))
        self.slots.clear()
        self.used = 0

    def drop(self) -> None:
        """Forget every parked weight and free the arena (the weights go back to their files)."""
        self.slots.clear()
        self.used = 0
        if self.arena is not None:
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # a restore's copy may still read the arena
            self.arena.unpin()  # unregistered before the memory is freed
            self.arena = None
