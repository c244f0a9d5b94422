"""Block swap engine: stream whole transformer blocks host-to-device through a ring of GPU slots.

Design (after musubi-tuner's ``LoRAStreamOffloader``):
- H2D only. Every streamed block has one flat, exact-size master region in a host arena (pinned with
  ``cudaHostRegister``, never ``pin_memory()``, which rounds to powers of two); its parameters and buffers are
  256-byte aligned views into it. Eviction rebinds the block to those CPU views: no D2H traffic.
- Loading is one ``copy_`` into one of R preallocated GPU slots on a side stream. The copy stream waits on the
  slot's ``free`` event (recorded on the compute stream after the previous occupant ran); compute waits on the
  slot's ``ready`` event. No CPU synchronisation in the loop, no allocation after ``activate``.
- Work on a block's bytes that must happen once per load (Block Swap's LoRA merge) runs in the ring: the first
  forward hands each streamed block's slot to a ``RingFill`` on the compute stream right before the block runs, and
  the engine copies what it wrote back into the arena behind it (a D2H copy on the copy stream, the one exception
  to H2D only), so every later load brings the filled bytes.
- Which blocks stream and the ring size come from offload/plan.py, decided once per load. Prefetch wraps
  around, so the next forward's first streamed blocks load during this forward's tail. A block that is not where
  the schedule expects it is loaded on demand (self-healing), which keeps interrupts, skipped blocks and extra
  forwards correct.
- Each activation times a few forwards with CUDA events (copy, wait and compute per streamed block), read only
  once the GPU has passed them (``Event.query``, no sync); ``take_measurement`` hands them over once per load for
  offload/verdict.py. Debug mode times every forward and syncs at its end.

GGUF models (ComfyUI-GGUF's ``GGMLTensor`` weights) stream as they are: their raw quantized bytes fill the arena and
the ring, and every bound view is made a GGML tensor again (offload/ggml_tensors.py), so their layers dequantize on
use exactly as without Block Swap.

``StreamHook`` attaches a streamer to a model through kernels/hooks.py. Plain torch, no ComfyUI import. The
engine runs on a CPU "device" too (streams and events become no-ops), so swapped == resident can be checked
without a GPU.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Iterable, Protocol, Sequence

import torch

from ..kernels.hooks import HookRegistry, ModelHook, PerModel
from . import ggml_tensors as ggml
from .arena_fill import BackgroundFill
from .host_memory import (HostArena, PinBudget, SpareArena, file_backed_ranges, is_file_backed, page_out,
                          release_spares, take_spare)
from .plan import ALIGN, SwapPlan, aligned, prefetch_targets
from .verdict import CallTimer, StreamStats, format_stats

# Forwards after each activation: the first is left untimed (the ring starts cold; compile and autotune land
# there), the next ones are timed; the quickest of them stands for the steady state.
MEASURE_SKIP = 1
MEASURE_CALLS = 2

log = logging.getLogger("comfyui_lowvram_dit")


# ----------------------------------------------------------------------------------------------------------
# Flat layout


@dataclass(frozen=True)
class TensorSlot:
    """Where one parameter or buffer of a block lives inside the block's flat buffer."""

    name: str  # dotted name inside the block, e.g. "self_attn.q.weight"
    shape: tuple[int, ...]  # as stored (a GGML tensor's raw bytes)
    dtype: torch.dtype
    offset: int
    nbytes: int
    ggml: tuple[type, dict[str, Any]] | None = None  # a GGML tensor's class and type/shape (ggml_tensors.identity)


def flat_layout(tensors: Iterable[tuple[str, torch.Tensor]], align: int = ALIGN) -> tuple[list[TensorSlot], int]:
    """Lay tensors out back to back at ``align``-byte offsets; returns the slots and the total (aligned) size."""
    slots: list[TensorSlot] = []
    offset = 0
    for name, t in tensors:
        raw = ggml.stored(t)
        nbytes = raw.numel() * raw.element_size()
        slots.append(TensorSlot(name, tuple(raw.shape), raw.dtype, offset, nbytes, ggml.identity(t)))
        offset = aligned(offset + nbytes, align)
    return slots, offset


def flat_views(flat: torch.Tensor, layout: Sequence[TensorSlot], base: int = 0) -> dict[str, torch.Tensor]:
    """Typed, shaped views into the uint8 buffer ``flat`` (starting at byte ``base``) for every slot of ``layout``;
    a GGML slot's view is a GGML tensor of its class, type and shape again."""
    views = {}
    for s in layout:
        raw = flat[base + s.offset: base + s.offset + s.nbytes].view(s.dtype).view(s.shape)
        views[s.name] = ggml.as_ggml(raw, s.ggml) if s.ggml is not None else raw
    return views


def block_tensors(block: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``block`` (recursively), in a stable order; plain or GGML tensors only."""
    out = []
    for name, t in list(block.named_parameters()) + list(block.named_buffers()):
        data = t.data if isinstance(t, torch.nn.Parameter) else t
        if type(data) is not torch.Tensor and not ggml.is_ggml(t):
            raise TypeError(f"block swap: {name} holds a {type(data).__name__}, which Block Swap cannot stream: it "
                            "streams plain tensors (UNETLoader, the LowVRAM loaders) and GGUF files' GGML tensors "
                            "(UnetLoaderGGUF)")
        out.append((name, t))
    return out


def block_nbytes(block: torch.nn.Module) -> int:
    """Bytes of ``block`` in its flat layout (what one ring slot must hold)."""
    return flat_layout(block_tensors(block))[1]


def set_param(root: torch.nn.Module, key: str, t: torch.Tensor) -> None:
    """Rebind parameter ``key`` (dotted) of ``root`` to ``t`` (as comfy.utils.set_attr_param; no import at exit)."""
    mod_name, _, attr = key.rpartition(".")
    mod = root.get_submodule(mod_name) if mod_name else root
    mod._parameters[attr] = t if isinstance(t, torch.nn.Parameter) else torch.nn.Parameter(t, requires_grad=False)


def _private_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``'s bytes in memory of its own, of the same kind (a GGML tensor's ``clone`` returns itself)."""
    kind = ggml.identity(t)
    raw = ggml.stored(t).clone()
    return ggml.as_ggml(raw, kind) if kind is not None else raw


def module_bytes(m: torch.nn.Module) -> int:
    """Bytes of ``m``'s state dict (parameters and buffers)."""
    return sum(t.numel() * t.element_size() for t in m.state_dict().values())


class RingFill(Protocol):
    """Work on a streamed block's bytes in its GPU ring slot before the block first runs after a load (Block Swap's
    LoRA merge): called on the forward's thread, its GPU work queued on the compute stream."""

    def wants(self, b: int) -> bool:
        """True while block ``b`` still needs the work."""

    def fill(self, b: int, views: dict[str, torch.Tensor]) -> list[str]:
        """Do the work on ``views`` (block ``b``'s tensors in its slot, by name); the names written, which the engine
        copies back into the arena."""


# ----------------------------------------------------------------------------------------------------------
# Streams and events (CUDA, or no-ops for the CPU "device")


class _NullEvent:
    def record(self, stream=None) -> None:  # noqa: ANN001
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "_NullEvent") -> float:
        return 0.0

    def query(self) -> bool:
        return True


class _NullStream:
    def wait_event(self, event) -> None:  # noqa: ANN001
        pass

    def __enter__(self) -> "_NullStream":
        return self

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        pass


class _Sync:
    """Streams and events of one device; on CPU everything is synchronous and these are no-ops."""

    def __init__(self, device: torch.device, timing: bool) -> None:
        self.cuda = device.type == "cuda"
        self.can_time = self.cuda  # CPU copies are synchronous: there is no overlap to measure
        self.timing = timing
        self.device = device
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else _NullStream()

    def event(self, timing: bool = False):  # noqa: ANN201
        return torch.cuda.Event(enable_timing=timing) if self.cuda else _NullEvent()

    def compute_stream(self):  # noqa: ANN201
        return torch.cuda.current_stream(self.device) if self.cuda else _NullStream()

    def copy_context(self):  # noqa: ANN201
        return torch.cuda.stream(self.copy_stream) if self.cuda else _NullStream()


# ----------------------------------------------------------------------------------------------------------
# The engine


@dataclass
class _Slot:
    flat: torch.Tensor
    ready: object
    free: object
    block: int | None = None  # block whose bytes are (being) copied here
    pending: bool = False  # loaded but not consumed yet


class BlockStreamer:
    """Streams the planned blocks of a block list through a GPU ring; resident blocks are not touched.

    Life cycle: ``BlockStreamer(blocks, plan, device)`` -> ``activate()`` (host arena, ring, CPU views) ->
    per forward ``begin_forward()``, ``before_block(i)`` / ``after_block(i)`` around every block,
    ``end_forward()`` -> ``detach()`` (frees the ring, keeps the arena) or ``release()`` (the arena too); streamed
    blocks stay valid CPU tensors.
    """

    def __init__(self, blocks: Sequence[torch.nn.Module], plan: SwapPlan, device: torch.device | str,
                 *, pinned: bool = True, debug: bool = False, pin_budget: PinBudget | None = None) -> None:
        if len(blocks) != plan.num_blocks:
            raise ValueError(f"plan is for {plan.num_blocks} blocks, model has {len(blocks)}")
        self.blocks = list(blocks)
        self.plan = plan
        self.device = torch.device(device)
        self.pinned = pinned
        self.pin_budget = pin_budget  # the host's pinned-memory account the arena is counted in
        self.debug = debug or os.environ.get("LOWVRAM_DIT_SWAP_DEBUG") == "1"
        self.ordinal = {b: j for j, b in enumerate(plan.streamed)}
        self.active = False
        self.arena: HostArena | None = None
        self.spare: SpareArena | None = None  # the memory of this model's dropped arena, until an arena takes it
        self.originals: dict[int, dict[str, torch.Tensor]] = {}  # file-backed tensors restored on release
        self._filling: BackgroundFill | None = None
        self._unbound: set[int] = set()  # blocks copied by that thread, not yet bound to their arena views
        self.ring_fill: RingFill | None = None  # this load's work on each block in the ring (its first forward)
        self._filled_now = False  # the ring fill ran in this forward
        self._layouts: dict[int, tuple[list[TensorSlot], int]] = {}
        self._cpu_views: dict[int, dict[str, torch.Tensor]] = {}
        self._gpu_views: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._owners: dict[int, dict[str, tuple[torch.nn.Module, str, bool]]] = {}
        self._attrs: dict[tuple[int, str], dict[str, Any]] = {}  # set_tensor_attr: (block, name) -> attributes
        self.slots: list[_Slot] = []
        self._free_order: list[int] = []
        self._where: dict[int, int] = {}  # block -> slot index holding it (pending)
        self._bound: dict[int, int] = {}  # block -> slot its params point at right now
        self._sync: _Sync | None = None
        self.stats = StreamStats()
        self._timer: CallTimer | None = None  # the current forward's, when it is timed
        self._forwards = 0  # since activate
        self._pending: list[CallTimer] = []  # timed forwards the GPU may not have passed yet
        self._measured: list[StreamStats] = []
        self._reported = False

    # -- setup ---------------------------------------------------------------------------------------------

    @property
    def ring_bytes(self) -> int:
        """GPU bytes of the ring (0 when nothing streams)."""
        return self.plan.ring_bytes

    @property
    def streamed_bytes(self) -> int:
        """Bytes of the streamed blocks' masters (host RAM, pinned when ``pinned``)."""
        return sum(self._layout(b)[1] for b in self.plan.streamed)

    def weight_itemsize(self) -> int:
        """Bytes per element of the dtype holding most of a streamed block's bytes (1 for fp8 weights; 0: none)."""
        if not self.plan.streamed:
            return 0
        by_dtype: dict[torch.dtype, int] = {}
        for s in self._layout(self.plan.streamed[0])[0]:
            by_dtype[s.dtype] = by_dtype.get(s.dtype, 0) + s.nbytes
        return torch.empty(0, dtype=max(by_dtype, key=by_dtype.__getitem__)).element_size()

    def _layout(self, b: int) -> tuple[list[TensorSlot], int]:
        if b not in self._layouts:
            self._layouts[b] = flat_layout(block_tensors(self.blocks[b]))
        return self._layouts[b]

    def _build_owners(self, b: int) -> dict[str, tuple[torch.nn.Module, str, bool]]:
        owners = {}
        block = self.blocks[b]
        for s in self._layout(b)[0]:
            mod_name, _, attr = s.name.rpartition(".")
            mod = block.get_submodule(mod_name) if mod_name else block
            owners[s.name] = (mod, attr, attr in mod._parameters)
        return owners

    def set_tensor_attr(self, b: int, name: str, attr: str, value: Any) -> None:
        """Set ``attr`` on every view of block ``b``'s tensor ``name`` that the engine binds, now and later (a GGML
        tensor's LoRA ``patches``, applied by its layer on use)."""
        self._attrs.setdefault((b, name), {})[attr] = value
        bound = [self._cpu_views.get(b, {})] + [v for (blk, _), v in list(self._gpu_views.items()) if blk == b]
        for views in bound:
            if name in views:
                setattr(views[name], attr, value)

    def _stamp(self, b: int, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for name, v in views.items():
            for attr, value in self._attrs.get((b, name), {}).items():
                setattr(v, attr, value)
        return views

    def _bind(self, b: int, views: dict[str, torch.Tensor]) -> None:
        for name, (mod, attr, is_param) in self._owners[b].items():
            if is_param:
                mod._parameters[attr] = views[name]
            else:
                mod._buffers[attr] = views[name]

    def _as_params(self, b: int, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: (torch.nn.Parameter(v, requires_grad=False) if self._owners[b][n][2] else v)
                for n, v in views.items()}

    def _arena_is_current(self) -> bool:
        if self.arena is None or any(b not in self._cpu_views for b in self.plan.streamed):
            return False
        for b in self.plan.streamed:
            for name, (mod, attr, is_param) in self._owners[b].items():
                t = mod._parameters[attr] if is_param else mod._buffers[attr]
                if t.data_ptr() != self._cpu_views[b][name].data_ptr():
                    return False
        return True

    @torch.no_grad()
    def activate(self, ring_fill: RingFill | None = None, background: bool = False) -> None:
        """Copy streamed blocks into the host arena (once), pin it, allocate the ring. Idempotent.

        ``ring_fill`` works on each block in its slot as forwards reach it (the first forward, unless one stops
        early). With ``background`` and an arena whose memory is final (pinned, or never to be pinned: registering
        memory that is being written is not done), the arena is copied beside the first forward
        (``took["background"]``, offload/arena_fill.py; until then the blocks not reached yet stay bound to what they
        were bound to)."""
        if self.active:
            return
        self.finish_fill()
        streamed = self.plan.streamed
        for b in streamed:
            self._owners.setdefault(b, self._build_owners(b))
        t0 = time.perf_counter()
        self.took = {"reused": False, "background": False}  # for the load's log line: copy, pin
        self.ring_fill, self._filled_now = ring_fill, False
        if streamed and not self._arena_is_current():
            self._build_arena(background)
        t1 = time.perf_counter()
        if streamed and self.pinned and self.device.type == "cuda":
            self.arena.pin()
        self.took.update(copy=t1 - t0, pin=time.perf_counter() - t1)
        self._sync = _Sync(self.device, self.debug)
        self.slots = [
            _Slot(torch.empty(self.plan.slot_bytes, dtype=torch.uint8, device=self.device),
                  self._sync.event(), self._sync.event())
            for _ in range(self.plan.ring)
        ]
        self._free_order = list(range(self.plan.ring))
        self._where.clear()
        self._bound.clear()
        self._gpu_views.clear()
        self._forwards, self._timer, self._reported = 0, None, False  # every load is measured afresh
        self._pending.clear()
        self._measured.clear()
        self.active = True

    def _build_arena(self, background: bool) -> None:
        streamed = self.plan.streamed
        offsets, total = {}, 0
        for b in streamed:
            offsets[b] = total
            total += self._layout(b)[1]
        if self.arena is not None:
            self.arena.unpin()  # the old buffer is freed below (its views are rebound to the new one)
        own, self.spare = self.spare, None
        arena = take_spare(total, self.device, first=own)  # its own first: another model's stays offered
        if arena is None:
            release_spares(self.device)  # none of this size: freed before a new arena is allocated, never beside it
        elif own is not None:
            own.release()  # its own memory, unless just taken: not needed beside the one it now has
        self.took["reused"] = arena is not None
        self.arena = arena or HostArena(total, pin=False, budget=self.pin_budget)
        # A fresh arena is filled before it is pinned: registering untouched memory faults every page in one
        # thread, several times slower than the copy and the pin together (docs/investigations, expert switch)
        final = self.arena.pinned or not (self.pinned and self.device.type == "cuda")
        self._arena_offsets = offsets
        self.originals.clear()
        self._cpu_views = {b: v for b, v in self._cpu_views.items() if b not in offsets}
        if final and background:
            self.took["background"] = True
            maps = file_backed_ranges()
            self._unbound = set(streamed)
            self._filling = BackgroundFill(streamed, lambda b: self._copy_block(b, maps))
            return
        mapped = self._copy_blocks()
        log.info("lowvram_dit block swap: %d blocks (%.2f GB) copied into a host arena%s", len(streamed), total / 1e9,
                 f"; {mapped / 1e9:.2f} GB of it stays file-backed for when the model goes idle" if mapped else "")

    def _copy_blocks(self) -> int:
        """Copy every streamed block into its arena region and bind it there; the file-backed bytes among them."""
        maps = file_backed_ranges()
        mapped = 0
        for b in self.plan.streamed:
            mapped += self._copy_block(b, maps)
            self._bind(b, self._cpu_views[b])
        return mapped

    def _copy_block(self, b: int, maps: list[tuple[int, int]]) -> int:
        """Copy block ``b`` into its arena region and make its CPU views (bound by the caller); returns the bytes
        of it that stay file-backed. Reads only what the block's modules are bound to, so a thread can run it."""
        layout = self._layout(b)[0]
        views = flat_views(self.arena.buffer, layout, base=self._arena_offsets[b])
        originals = {}
        for s in layout:
            mod, attr, is_param = self._owners[b][s.name]
            src = mod._parameters[attr] if is_param else mod._buffers[attr]
            ggml.stored(views[s.name]).copy_(ggml.stored(src))
            if is_file_backed(src, maps):
                originals[s.name] = src  # costs no anonymous RAM: restore it when idle (two-expert RSS goal)
        self.originals[b] = originals
        self._cpu_views[b] = self._stamp(b, self._as_params(b, views))
        return page_out(originals.values(), maps)  # per block: the file pages just read never pile up in RSS

    def _await_block(self, b: int) -> None:
        """Before block ``b``'s first copy out of an arena being filled beside the forward: wait for it, bind it."""
        filling = self._filling
        if filling is None or b not in self._unbound:
            return
        filling.ready(b)
        self._bind(b, self._cpu_views[b])
        self._unbound.discard(b)
        if not self._unbound:
            self.finish_fill()

    def finish_fill(self) -> None:
        """Wait for an arena being filled beside the forward and bind every block to it; a no-op when none is.
        Raises what stopped the fill (blocks it did not reach stay bound to their originals)."""
        filling, self._filling = self._filling, None
        if filling is None:
            return
        try:
            filling.join()
        finally:
            for b in sorted(self._unbound):
                if filling.copied(b):
                    self._bind(b, self._cpu_views[b])
            self._unbound.clear()
        nbytes = sum(self._layout(b)[1] for b in self.plan.streamed)
        log.info("lowvram_dit block swap: %d blocks (%.2f GB) copied into a host arena beside the first forward in "
                 "%.2f s", len(self.plan.streamed), nbytes / 1e9, filling.seconds)

    def finish_fill_quietly(self) -> None:
        """``finish_fill`` on the way out of a load (detach, unload): what stopped the fill was raised to the forward
        that needed the block, so here it is logged and unloading goes on."""
        try:
            self.finish_fill()
        except Exception as exc:  # noqa: BLE001
            log.warning("lowvram_dit block swap: filling the host arena failed (%s); the next load copies it again",
                        exc)

    def cpu_views(self, b: int) -> dict[str, torch.Tensor]:
        """Block ``b``'s views into the host arena, by name inside the block (bound between its forwards)."""
        return self._cpu_views[b]

    def _gpu(self, b: int, slot: int) -> dict[str, torch.Tensor]:
        key = (b, slot)
        if key not in self._gpu_views:
            self._gpu_views[key] = self._stamp(b, self._as_params(b, flat_views(self.slots[slot].flat,
                                                                                  self._layout(b)[0])))
        return self._gpu_views[key]

    @torch.no_grad()
    def detach(self) -> None:
        """Free the ring; the arena stays (pinned) for a quick re-``activate``: ComfyUI detaches and re-loads the
        same model around every sampler run. Streamed blocks stay valid CPU tensors."""
        self.finish_fill_quietly()  # also after an activation that failed once the fill had started
        if not self.active:
            return
        for b in list(self._bound):
            self._bind(b, self._cpu_views[b])
        self._bound.clear()
        if self._sync is not None and self._sync.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._sync.copy_stream)
            self._sync.copy_stream.synchronize()  # not the hot loop: copies must finish before unpin/free
        self.slots = []
        self._gpu_views.clear()
        self._where.clear()
        self.ring_fill = None
        self._sync = None
        self._timer = None
        self._pending.clear()
        self.active = False

    def release(self) -> None:
        """Free the ring and let go of the arena: back to the file-backed originals when there are any (its memory
        offered to the next arena of its size), else unpinned and kept as the blocks' CPU copy."""
        self.detach()
        if self.arena is None:
            return
        if self._mostly_file_backed():
            # Idle model ~0 RSS (two-expert Wan 2.2): file-backed masters go back to the file mapping, the
            # rest (biases, norms, modulation: ~0.1 % of a block) gets small private copies, the arena's
            # memory is offered to the next arena of its size (the other expert's, at the next switch).
            for b in list(self._cpu_views):  # a fill that failed left the blocks it did not reach on the file
                keep = self.originals.get(b, {})
                self._bind(b, self._as_params(b, {n: keep[n] if n in keep else _private_copy(v)
                                                  for n, v in self._cpu_views[b].items()}))
            self.originals.clear()
            self.spare = SpareArena(self.arena, self.device)
            self.arena = None
            self._cpu_views.clear()
        else:
            self.arena.unpin()

    def drops_arena_on_release(self) -> bool:
        """True when ``release`` frees the arena and rebinds to the file-backed originals."""
        return self.arena is not None and self._mostly_file_backed()

    def _mostly_file_backed(self) -> bool:
        """True when at least 90 % of the arena's bytes have a file-backed master to fall back to."""
        if not self.originals or self.arena is None:
            return False
        mapped = sum(t.numel() * t.element_size() for o in self.originals.values() for t in o.values())
        return mapped >= 0.9 * self.arena.buffer.numel()

    # -- the hot loop ----------------------------------------------------------------------------------------

    def _load(self, b: int) -> int:
        """Issue the H2D copy of block ``b`` into the oldest free slot; returns the slot index."""
        self._await_block(b)
        i = self._free_order.pop(0)
        slot = self.slots[i]
        if slot.block is not None and self._where.get(slot.block) == i:
            del self._where[slot.block]
        sync = self._sync
        src_base = self._arena_offsets[b]
        n = self._layout(b)[1]
        timer = self._timer
        with sync.copy_context():
            sync.copy_stream.wait_event(slot.free)  # the previous occupant has been consumed
            start = timer.mark(sync.copy_stream) if timer is not None else None
            slot.flat[:n].copy_(self.arena.buffer[src_base: src_base + n], non_blocking=True)
            slot.ready.record(sync.copy_stream)
            self.arena.last_copy = slot.ready
            if timer is not None:
                timer.last_copy = timer.mark(sync.copy_stream)
                timer.spans.append((b, "transfer", start, timer.last_copy))
        slot.block, slot.pending = b, True
        self._where[b] = i
        self.stats.loads += 1
        return i

    def _prefetch(self, position: int) -> None:
        """Make sure the streamed ordinals from ``position`` on (wrap-around) are loading, as slots allow."""
        order = self.plan.streamed
        for j in prefetch_targets(position, len(order), self.plan.ring):
            b = order[j]
            if b in self._where or b in self._bound:
                continue
            if not self._free_order:
                break
            self._load(b)

    def begin_forward(self) -> None:
        """Start of a model forward: make sure the first streamed blocks are loading (no-op if wrap-around did)."""
        if not self.active:
            raise RuntimeError("block swap: BlockStreamer.begin_forward() before activate()")
        self.stats = StreamStats(loads=0)
        self._forwards += 1
        in_window = MEASURE_SKIP < self._forwards <= MEASURE_SKIP + MEASURE_CALLS
        timed = self._sync.can_time and bool(self.plan.streamed) and (self.debug or in_window)
        self._timer = CallTimer(self._sync, self.stats) if timed else None
        if self.plan.streamed:
            self._prefetch(0)

    def before_block(self, i: int) -> None:
        """Before block ``i`` runs: for a streamed block, make compute wait for its copy and bind its GPU views."""
        j = self.ordinal.get(i)
        if j is None:
            return
        sync = self._sync
        s = self._where.get(i)
        if s is None:
            if not self._free_order:  # schedule broken (interrupt, skipped blocks): reclaim the oldest pending slot
                self._reclaim_one(exclude=i)
            s = self._load(i)
            self.stats.on_demand += 1
        compute = sync.compute_stream()
        timer = self._timer
        if timer is not None:
            t0 = timer.mark(compute)
        compute.wait_event(self.slots[s].ready)
        if timer is not None:
            timer.started[i] = timer.mark(compute)
            timer.spans.append((i, "stall", t0, timer.started[i]))
        self._bind(i, self._gpu(i, s))
        if self.ring_fill is not None and self.ring_fill.wants(i):
            self._fill_in_ring(i, s)  # bound to the slot first: the layers' own tensors (fp8 scales) are there too
        self._bound[i] = s
        self._prefetch(j + 1)

    def _fill_in_ring(self, i: int, s: int) -> None:
        """Run the ring fill on block ``i`` in slot ``s`` and copy what it wrote back into the arena behind it. If it
        raises, the block goes back to the arena and the slot is given up: its bytes may be half done, so the block's
        next load copies the arena again."""
        views = self._gpu(i, s)
        try:
            written = self.ring_fill.fill(i, views)
        except BaseException:
            self._bind(i, self._cpu_views[i])
            slot = self.slots[s]
            slot.pending, slot.block = False, None
            del self._where[i]
            self._free_order.append(s)
            raise
        self._filled_now = True
        if not written:
            return
        sync = self._sync
        done = sync.event()
        done.record(sync.compute_stream())
        arena = self._cpu_views[i]
        # the copy stream runs the write-back before any later copy out of the arena or into this slot; an
        # inference-mode arena is written in inference mode
        with sync.copy_context(), torch.inference_mode(self.arena.buffer.is_inference()):
            sync.copy_stream.wait_event(done)
            for name in written:
                ggml.stored(arena[name]).copy_(ggml.stored(views[name]), non_blocking=True)

    def _end_ring_fill(self) -> None:
        """After a forward that ran the ring fill: once no block wants it any more, wait for the write-backs (the
        arena on the CPU then holds every filled byte; the GPU runs on) and drop it."""
        self._filled_now = False
        if any(self.ring_fill.wants(b) for b in self.plan.streamed):
            return  # a forward stopped early: the next one goes on
        self.ring_fill = None
        if self._sync.cuda:
            self._sync.copy_stream.synchronize()

    def after_block(self, i: int) -> None:
        """After block ``i`` ran (or raised): free its slot behind the compute stream and rebind it to the CPU."""
        j = self.ordinal.get(i)
        if j is None or i not in self._bound:
            return
        s = self._bound.pop(i)
        slot = self.slots[s]
        compute = self._sync.compute_stream()
        slot.free.record(compute)
        timer = self._timer
        if timer is not None and i in timer.started:
            timer.spans.append((i, "compute", timer.started.pop(i), timer.mark(compute)))
        self._bind(i, self._cpu_views[i])
        slot.pending = False
        if self._where.get(i) == s:
            del self._where[i]
        self._free_order.append(s)
        self._prefetch(j + 1)

    def _reclaim_one(self, exclude: int) -> None:
        for idx, slot in enumerate(self.slots):
            if slot.pending and slot.block != exclude and slot.block not in self._bound:
                del self._where[slot.block]
                slot.pending = False
                self._free_order.append(idx)
                return
        raise RuntimeError("block swap: every ring slot is bound to a running block; raise prefetch")

    def end_forward(self) -> StreamStats:
        """End of a model forward; in debug mode read its timings now (one sync, outside the loop).

        A timed forward outside debug mode is read later (``take_measurement``): its stats gain their timings then.
        """
        for b in list(self._bound):  # a forward that raised inside a block
            self.after_block(b)
        if self._filled_now:
            self._end_ring_fill()
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.finish()
            in_window = MEASURE_SKIP < self._forwards <= MEASURE_SKIP + MEASURE_CALLS
            if self.debug:
                timer.wait()  # both streams: wrap-around prefetches for the next forward are still copying
                timer.read()
                if in_window:
                    self._measured.append(timer.stats)
            elif in_window:
                self._pending.append(timer)
        return self.stats

    def take_measurement(self, wait: bool = False) -> list[StreamStats]:
        """This load's timed forwards, once, when the GPU has passed them all; else [] (no sync).

        ``wait=True`` (unload: outside the loop) waits for what was timed and hands over even a partial set.
        """
        if self._reported:
            return []
        while self._pending and (wait or self._pending[0].done()):
            timer = self._pending.pop(0)
            if wait:
                timer.wait()
            self._measured.append(timer.read())
        if len(self._measured) < MEASURE_CALLS and not (wait and self._measured):
            return []
        self._reported = True
        return list(self._measured)


class StreamOwner(Protocol):
    """What a ``StreamHook`` asks of the code that owns the streamer (the Block Swap patcher)."""

    debug: bool

    def block_streamer(self) -> BlockStreamer | None:
        """The active streamer, or None (blocks then run as they are)."""

    def forward_streamer(self) -> BlockStreamer | None:
        """The active streamer at the start of a forward (activating it if the host skipped the load), or None."""

    def oom_advice(self, message: str) -> str:
        """What to change after a CUDA out-of-memory error with this message."""

    def swap_measured(self, calls: list[StreamStats]) -> None:
        """This load's timed forwards (``BlockStreamer.take_measurement``), handed over once per load."""


class StreamHook(ModelHook):
    """Per block: wait for a streamed block's weights, run it, free its slot; per forward: start the prefetch."""

    ORDER = 40  # innermost: the waits sit right around the block, inside every other hook
    PER_BLOCK = True
    MOVES_WEIGHTS = True

    def __init__(self, owner: StreamOwner) -> None:
        self.owner = owner
        self.models = PerModel()

    def serve(self, module: Any, owner: StreamOwner) -> None:
        """Stream ``module``'s blocks through ``owner`` (a MultiGPU clone's own ring on its own GPU)."""
        self.models.bind(module, StreamHook(owner))

    def for_model(self, module: Any) -> StreamHook:
        """The hook of ``module``'s owner; the model the hook was made for keeps this one."""
        return self.models.get(module, self)

    def wrap_block(self, index: int, inputs: Any, call: Callable[[Any], Any]) -> Any:
        """Bind block ``index``'s streamed weights around ``call`` (its slot is released even when it raises)."""
        st = self.owner.block_streamer()
        if st is None or not st.active:
            return call(inputs)
        st.before_block(index)
        try:
            return call(inputs)
        finally:
            if st.active:
                st.after_block(index)

    def wrap_forward(self, module: Any, call: Callable[[], Any], registry: HookRegistry) -> Any:
        """Start the prefetch before the forward, name what would fit after an OOM, report after.

        After the forward: debug mode logs its transfers; once per load the owner gets the timed forwards.
        """
        st = self.owner.forward_streamer()
        if st is None or not st.active:
            return call()
        st.begin_forward()
        try:
            return call()
        except torch.OutOfMemoryError as exc:  # same type, so the host's OOM handling (unload, report) still runs
            advice = self.owner.oom_advice(str(exc))
            log.error("lowvram_dit %s", advice)
            raise torch.OutOfMemoryError(f"{advice}\n\n{exc}") from exc
        finally:
            stats = st.end_forward()
            if self.owner.debug:
                log.info("lowvram_dit %s", format_stats(stats))
            measured = st.take_measurement()
            if measured:
                self.owner.swap_measured(measured)
