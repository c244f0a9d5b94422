"""Block swap engine: stream whole transformer blocks host-to-device through a ring of GPU slots.

Design (after musubi-tuner's ``LoRAStreamOffloader``, see /work/shared/research/offload-fp8-compile.md §2.2, §2.8):
- H2D only. Every streamed block has one flat, exact-size master region in a host arena (pinned with
  ``cudaHostRegister``, never ``pin_memory()``, which rounds to powers of two); its parameters and buffers are
  256-byte aligned views into it. Eviction rebinds the block to those CPU views: no D2H traffic.
- Loading is one ``copy_`` into one of R preallocated GPU slots on a side stream. The copy stream waits on the
  slot's ``free`` event (recorded on the compute stream after the previous occupant ran); compute waits on the
  slot's ``ready`` event. No CPU synchronisation in the loop, no allocation after ``activate``.
- Streamed blocks are spread evenly among resident ones (midpoint formula), so each transfer hides behind about
  N/S blocks of compute. Prefetch wraps around, so the next forward's first streamed blocks load during this
  forward's tail. A block that is not where the schedule expects it is loaded on demand (self-healing), which
  keeps interrupts, skipped blocks and extra forwards correct.

Plain torch, no ComfyUI import. The scheduling functions are pure and tested on CPU; the engine itself runs on
a CPU "device" too (streams and events become no-ops), so swapped == resident can be checked without a GPU.
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from .checkpoint_io import MADV_PAGEOUT, advise_mapped

log = logging.getLogger("comfyui_lowvram_dit")

ALIGN = 256  # bytes; cuBLAS/cuDNN and fp8 scaled_mm want >= 16-byte aligned operands, 256 matches the allocator
MAX_PREFETCH = 3


@dataclass(frozen=True)
class SwapConfig:
    """What the Block Swap node asks for; the engine and the patcher consume it."""

    vram_budget_gb: float = 0.0  # 0 = use what the memory manager offers; else weights + ring + activations cap
    blocks_to_swap: int = -1  # -1 = computed from the budget; >= 0 explicit
    prefetch: int = 1  # streamed blocks loading ahead of the one computing; ring slots = prefetch + 1
    pinned: bool = True
    offload_embeddings: bool = False
    debug: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.prefetch <= MAX_PREFETCH:
            raise ValueError(f"SwapConfig.prefetch={self.prefetch}: use 1..{MAX_PREFETCH}")
        if self.blocks_to_swap < -1:
            raise ValueError(f"SwapConfig.blocks_to_swap={self.blocks_to_swap}: use -1 (auto) or >= 0")
        if self.vram_budget_gb < 0:
            raise ValueError(f"SwapConfig.vram_budget_gb={self.vram_budget_gb}: use 0 (auto) or a positive size")


# ----------------------------------------------------------------------------------------------------------
# Scheduling (pure functions)


def streamed_block_indices(num_blocks: int, blocks_to_swap: int) -> list[int]:
    """Indices of the streamed blocks, evenly spaced by the midpoint formula ((2i+1)N)//(2S) (musubi)."""
    if not 0 <= blocks_to_swap <= num_blocks:
        raise ValueError(f"blocks_to_swap={blocks_to_swap} must be within 0..{num_blocks}")
    return [((2 * i + 1) * num_blocks) // (2 * blocks_to_swap) for i in range(blocks_to_swap)]


def ring_slots(prefetch: int, num_streamed: int) -> int:
    """GPU slots in the ring: one computing plus ``prefetch`` loading, never more than there are streamed blocks."""
    return min(prefetch + 1, num_streamed)


def blocks_to_swap_for_budget(
    block_bytes: Sequence[int], budget_bytes: int, fixed_bytes: int, activation_bytes: int, prefetch: int
) -> int:
    """Fewest blocks to stream so resident blocks + ring + fixed weights + activations fit ``budget_bytes``.

    The streamed set is the evenly spaced one, the ring holds the largest streamed block. Returns
    ``len(block_bytes)`` when even streaming everything does not fit (the caller warns).
    """
    n = len(block_bytes)
    available = budget_bytes - fixed_bytes - activation_bytes
    for s in range(n + 1):
        streamed = set(streamed_block_indices(n, s))
        resident = sum(b for i, b in enumerate(block_bytes) if i not in streamed)
        slot = max((aligned(block_bytes[i]) for i in streamed), default=0)
        if resident + ring_slots(prefetch, s) * slot <= available:
            return s
    return n


def prefetch_targets(position: int, num_streamed: int, ring: int) -> list[int]:
    """Streamed ordinals that should be loaded or loading once ordinal ``position`` is about to run (wrap-around)."""
    return [(position + k) % num_streamed for k in range(min(ring, num_streamed))]


def load_sequence(num_streamed: int, ring: int, forwards: int) -> list[tuple[int, int]]:
    """(ordinal, slot) of every H2D copy over ``forwards`` in-order passes: the ring is a FIFO over a cyclic order.

    This is what ``BlockStreamer`` issues when blocks run in order; it documents and tests the ring assignment.
    """
    seq: list[tuple[int, int]] = []
    if num_streamed == 0:
        return seq
    issued = 0  # global load counter; load n goes to slot n % ring
    for n_consumed in range(num_streamed * forwards):
        while issued < n_consumed + ring:  # keep `ring` loads in front of the consumer
            seq.append((issued % num_streamed, issued % ring))
            issued += 1
    return seq


@dataclass(frozen=True)
class SwapPlan:
    """Which blocks stream and how big the ring is: decided once per load, consumed by ``BlockStreamer``."""

    num_blocks: int
    streamed: tuple[int, ...]
    ring: int
    slot_bytes: int  # bytes of one ring slot (largest streamed block, aligned)

    @property
    def ring_bytes(self) -> int:
        """GPU bytes the ring takes (what the memory manager must account for on top of resident weights)."""
        return self.ring * self.slot_bytes


def plan_swap(
    block_bytes: Sequence[int],
    config: SwapConfig,
    *,
    budget_bytes: int | None = None,
    fixed_bytes: int = 0,
    activation_bytes: int = 0,
) -> SwapPlan:
    """Turn a ``SwapConfig`` into a ``SwapPlan``: explicit ``blocks_to_swap``, or the fewest that fit the budget."""
    n = len(block_bytes)
    if config.blocks_to_swap >= 0:
        s = min(config.blocks_to_swap, n)
    elif budget_bytes is None:
        s = 0
    else:
        s = blocks_to_swap_for_budget(block_bytes, budget_bytes, fixed_bytes, activation_bytes, config.prefetch)
        if s == n:
            need = fixed_bytes + activation_bytes + ring_slots(config.prefetch, n) * aligned(max(block_bytes, default=0))
            if need > budget_bytes:
                log.warning(
                    "lowvram_dit block swap: budget %.2f GB is below the minimum %.2f GB (ring of %d blocks + "
                    "fixed weights + activations); streaming every block anyway. Raise vram_budget_gb or lower "
                    "prefetch.", budget_bytes / 1e9, need / 1e9, ring_slots(config.prefetch, n))
    streamed = tuple(streamed_block_indices(n, s))
    slot = max((aligned(block_bytes[i]) for i in streamed), default=0)
    return SwapPlan(num_blocks=n, streamed=streamed, ring=ring_slots(config.prefetch, s), slot_bytes=slot)


# ----------------------------------------------------------------------------------------------------------
# Out of memory during sampling: what would fit


_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
_OOM_TRIED = re.compile(r"Tried to allocate ([\d.]+) (GiB|MiB|KiB|B)")
_OOM_FREE = re.compile(r"of which ([\d.]+) (GiB|MiB|KiB|B) is free")
OOM_MARGIN = 256 << 20  # bytes kept spare in a suggestion: the allocator rounds and fragments


def parse_oom(message: str) -> tuple[int | None, int | None]:
    """(bytes torch tried to allocate, bytes the GPU had free) from a CUDA out-of-memory message (None if absent)."""
    def grab(rx: re.Pattern[str]) -> int | None:
        m = rx.search(message)
        return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None

    return grab(_OOM_TRIED), grab(_OOM_FREE)


def oom_advice(plan: SwapPlan, block_bytes: Sequence[int], config: SwapConfig, message: str,
               fixed_bytes: int = 0, embed_bytes: int = 0) -> str:
    """A Block Swap OOM message that says what was on the GPU and the setting that would fit (issue 8)."""
    tried, free = parse_oom(message)
    streamed = set(plan.streamed)
    resident = [i for i in range(plan.num_blocks) if i not in streamed]
    resident_bytes = sum(block_bytes[i] for i in resident)
    head = (f"Block Swap ran out of GPU memory during sampling (vram_budget_gb={config.vram_budget_gb:g}, "
            f"blocks_to_swap={config.blocks_to_swap}): {len(streamed)} of {plan.num_blocks} blocks streamed, "
            f"{resident_bytes / 1e9:.2f} GB of blocks resident, ring {plan.ring_bytes / 1e9:.2f} GB, other weights "
            f"{fixed_bytes / 1e9:.2f} GB")
    if tried is not None and free is not None:
        head += f"; it tried to allocate {tried / 2**30:.2f} GiB with {free / 2**30:.2f} GiB free"
    head += "."
    shortfall = None if tried is None or free is None else max(tried - free, 0) + OOM_MARGIN
    if resident:
        per_block = resident_bytes / len(resident)
        # unknown shortfall (no torch numbers in the message): 3 blocks is ~1 GB for Wan 14B fp8
        more = min(len(resident), 3 if shortfall is None else max(1, math.ceil(shortfall / per_block)))
        fit = len(streamed) + more
        lower = "" if shortfall is None or config.vram_budget_gb <= 0 else \
            f" or vram_budget_gb={max(config.vram_budget_gb - shortfall / 1e9, 0.1):.1f}"
        return (f"{head} Stream more blocks: blocks_to_swap={fit}{lower} should fit at this size "
                f"(each block frees ~{per_block / 1e9:.2f} GB).")
    tips = ["lower the resolution or the frame count (activations grow with the token count)"]
    if config.prefetch > 1:
        tips.append(f"prefetch=1 (frees {(plan.ring - 2) * plan.slot_bytes / 1e9:.2f} GB of ring)")
    if not config.offload_embeddings and embed_bytes:
        tips.append(f"offload_embeddings on (frees {embed_bytes / 1e9:.2f} GB)")
    tips.append("close other GPU users (another loaded model, the desktop, a second ComfyUI)")
    return f"{head} Every block already streams, so the activations do not fit: " + "; ".join(tips) + "."


# ----------------------------------------------------------------------------------------------------------
# Flat layout


def aligned(nbytes: int, align: int = ALIGN) -> int:
    """``nbytes`` rounded up to a multiple of ``align``."""
    return (nbytes + align - 1) // align * align


@dataclass(frozen=True)
class TensorSlot:
    """Where one parameter or buffer of a block lives inside the block's flat buffer."""

    name: str  # dotted name inside the block, e.g. "self_attn.q.weight"
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


def flat_layout(tensors: Iterable[tuple[str, torch.Tensor]], align: int = ALIGN) -> tuple[list[TensorSlot], int]:
    """Lay tensors out back to back at ``align``-byte offsets; returns the slots and the total (aligned) size."""
    slots: list[TensorSlot] = []
    offset = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        slots.append(TensorSlot(name, tuple(t.shape), t.dtype, offset, nbytes))
        offset = aligned(offset + nbytes, align)
    return slots, offset


def flat_views(flat: torch.Tensor, layout: Sequence[TensorSlot], base: int = 0) -> dict[str, torch.Tensor]:
    """Typed, shaped views into the uint8 buffer ``flat`` (starting at byte ``base``) for every slot of ``layout``."""
    views = {}
    for s in layout:
        raw = flat[base + s.offset: base + s.offset + s.nbytes]
        views[s.name] = raw.view(s.dtype).view(s.shape)
    return views


def block_tensors(block: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``block`` (recursively), in a stable order; tensor subclasses are refused."""
    out = []
    for name, t in list(block.named_parameters()) + list(block.named_buffers()):
        if type(t) not in (torch.Tensor, torch.nn.Parameter) and not isinstance(t, torch.nn.Parameter):
            raise TypeError(f"block swap: {name} is a {type(t).__name__}; only plain tensors can be streamed "
                            "(load the model with the LowVRAM loader, whose fp8 layers hold plain tensors)")
        if isinstance(t, torch.nn.Parameter) and type(t.data) is not torch.Tensor:
            raise TypeError(f"block swap: {name} holds a {type(t.data).__name__}; only plain tensors can be "
                            "streamed (load the model with the LowVRAM loader, whose fp8 layers hold plain tensors)")
        out.append((name, t))
    return out


def block_nbytes(block: torch.nn.Module) -> int:
    """Bytes of ``block`` in its flat layout (what one ring slot must hold)."""
    return flat_layout(block_tensors(block))[1]


# ----------------------------------------------------------------------------------------------------------
# Host memory


def file_backed_ranges() -> list[tuple[int, int]]:
    """Address ranges of file-backed mappings of this process (Linux /proc/self/maps; empty elsewhere)."""
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
    return ranges


def page_out(tensors: Iterable[torch.Tensor]) -> int:
    """Ask the kernel to reclaim the pages under file-backed CPU tensors (Linux); returns bytes advised.

    After the arena copy the mapped file pages are only needed again when the model is re-activated, so they
    should not sit in RSS. MADV_PAGEOUT keeps the data valid (pages re-fault from the file); on other systems
    or older kernels this is a no-op and the kernel reclaims the page cache under pressure anyway.
    """
    return advise_mapped(tensors, MADV_PAGEOUT)


def is_file_backed(t: torch.Tensor, ranges: list[tuple[int, int]] | None = None) -> bool:
    """True if ``t``'s CPU storage lies in a file mapping (e.g. a safetensors mmap): it costs no anonymous RAM."""
    if t.device.type != "cpu" or t.numel() == 0:
        return False
    ptr = t.data_ptr()
    return any(lo <= ptr < hi for lo, hi in (ranges if ranges is not None else file_backed_ranges()))


class HostArena:
    """One exact-size host buffer, optionally pinned with cudaHostRegister (about 10x faster than pin_memory)."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        self.pinned = False
        self.last_copy = None  # event after the latest H2D copy out of the buffer (one copy stream: in order)
        if pin:
            self.pin()

    def pin(self) -> bool:
        """Page-lock the buffer so H2D copies are asynchronous DMA; False (with a log line) when it cannot."""
        if self.pinned or not torch.cuda.is_available():
            return self.pinned
        err = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.buffer.numel(), 0)
        self.pinned = err == 0  # cudaError_t cudaSuccess (compared as ComfyUI's pin_memory does)
        if not self.pinned:
            log.warning("lowvram_dit block swap: cudaHostRegister of %.2f GB failed (%s); copies will be "
                        "synchronous. Free RAM or turn `pinned` off.", self.buffer.numel() / 1e9, err)
        return self.pinned

    def unpin(self) -> None:
        """Release the page lock (the memory stays valid), after the last copy out of it has finished."""
        if not self.pinned:
            return
        if self.last_copy is not None:
            self.last_copy.synchronize()
        err = torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
        self.pinned = False
        if err != 0:
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


# ----------------------------------------------------------------------------------------------------------
# Streams and events (CUDA, or no-ops for the CPU "device")


class _NullEvent:
    def record(self, stream=None) -> None:  # noqa: ANN001
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "_NullEvent") -> float:
        return 0.0


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


@dataclass
class StreamStats:
    """Counters for one forward (debug mode adds CUDA-event timings)."""

    loads: int = 0
    on_demand: int = 0  # loads the schedule did not foresee (self-healing)
    transfer_ms: float = 0.0
    stall_ms: float = 0.0
    compute_ms: float = 0.0
    per_block: dict[int, dict[str, float]] = field(default_factory=dict)

    @property
    def overlap(self) -> float:
        """Fraction of transfer time hidden behind compute (1.0 = fully hidden)."""
        return 1.0 - min(self.stall_ms, self.transfer_ms) / self.transfer_ms if self.transfer_ms > 0 else 1.0


class BlockStreamer:
    """Streams the planned blocks of a block list through a GPU ring; resident blocks are not touched.

    Life cycle: ``BlockStreamer(blocks, plan, device)`` -> ``activate()`` (host arena, ring, CPU views) ->
    per forward ``begin_forward()``, ``before_block(i)`` / ``after_block(i)`` around every block,
    ``end_forward()`` -> ``deactivate()`` (frees the ring; streamed blocks stay valid CPU tensors).
    """

    def __init__(self, blocks: Sequence[torch.nn.Module], plan: SwapPlan, device: torch.device | str,
                 *, pinned: bool = True, debug: bool = False) -> None:
        if len(blocks) != plan.num_blocks:
            raise ValueError(f"plan is for {plan.num_blocks} blocks, model has {len(blocks)}")
        self.blocks = list(blocks)
        self.plan = plan
        self.device = torch.device(device)
        self.pinned = pinned
        self.debug = debug or os.environ.get("LOWVRAM_DIT_SWAP_DEBUG") == "1"
        self.ordinal = {b: j for j, b in enumerate(plan.streamed)}
        self.active = False
        self.arena: HostArena | None = None
        self.originals: dict[int, dict[str, torch.Tensor]] = {}  # file-backed tensors restored on deactivate
        self._layouts: dict[int, tuple[list[TensorSlot], int]] = {}
        self._cpu_views: dict[int, dict[str, torch.Tensor]] = {}
        self._gpu_views: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._owners: dict[int, dict[str, tuple[torch.nn.Module, str, bool]]] = {}
        self.slots: list[_Slot] = []
        self._free_order: list[int] = []
        self._where: dict[int, int] = {}  # block -> slot index holding it (pending)
        self._bound: dict[int, int] = {}  # block -> slot its params point at right now
        self._sync: _Sync | None = None
        self.stats = StreamStats()
        self._timers: list[tuple[int, str, object, object]] = []

    # -- setup ---------------------------------------------------------------------------------------------

    @property
    def ring_bytes(self) -> int:
        """GPU bytes of the ring (0 when nothing streams)."""
        return self.plan.ring_bytes

    @property
    def streamed_bytes(self) -> int:
        """Bytes of the streamed blocks' masters (host RAM, pinned when ``pinned``)."""
        return sum(self._layout(b)[1] for b in self.plan.streamed)

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
        if self.arena is None:
            return False
        for b in self.plan.streamed:
            for name, (mod, attr, is_param) in self._owners[b].items():
                t = mod._parameters[attr] if is_param else mod._buffers[attr]
                if t.data_ptr() != self._cpu_views[b][name].data_ptr():
                    return False
        return True

    @torch.no_grad()
    def activate(self) -> None:
        """Copy streamed blocks into the host arena (once), pin it, allocate the ring. Idempotent."""
        if self.active:
            return
        streamed = self.plan.streamed
        for b in streamed:
            self._owners.setdefault(b, self._build_owners(b))
        if streamed and not self._arena_is_current():
            self._build_arena()
        if streamed and self.pinned and self.device.type == "cuda":
            self.arena.pin()
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
        self.active = True

    def _build_arena(self) -> None:
        streamed = self.plan.streamed
        offsets, total = {}, 0
        for b in streamed:
            offsets[b] = total
            total += self._layout(b)[1]
        if self.arena is not None:
            self.arena.unpin()  # the old buffer is freed below (its views are rebound to the new one)
        self.arena = HostArena(total, pin=False)
        maps = file_backed_ranges()
        self.originals.clear()
        mapped = 0
        for b in streamed:
            layout = self._layout(b)[0]
            views = flat_views(self.arena.buffer, layout, base=offsets[b])
            originals = {}
            for s in layout:
                mod, attr, is_param = self._owners[b][s.name]
                src = mod._parameters[attr] if is_param else mod._buffers[attr]
                views[s.name].copy_(src.detach())
                if is_file_backed(src, maps):
                    originals[s.name] = src  # costs no anonymous RAM: restore it when idle (two-expert RSS goal)
            self.originals[b] = originals
            mapped += page_out(originals.values())  # per block: the file pages just read never pile up in RSS
            self._cpu_views[b] = self._as_params(b, views)
            self._bind(b, self._cpu_views[b])
        self._arena_offsets = offsets
        log.info("lowvram_dit block swap: %d blocks (%.2f GB) copied into a host arena%s", len(streamed), total / 1e9,
                 f"; {mapped / 1e9:.2f} GB of it stays file-backed for when the model goes idle" if mapped else "")

    def _gpu(self, b: int, slot: int) -> dict[str, torch.Tensor]:
        key = (b, slot)
        if key not in self._gpu_views:
            self._gpu_views[key] = self._as_params(b, flat_views(self.slots[slot].flat, self._layout(b)[0]))
        return self._gpu_views[key]

    @torch.no_grad()
    def deactivate(self, release_host: bool = True) -> None:
        """Free the ring; with ``release_host`` also unpin and go back to file-backed originals when there are any.

        ``release_host=False`` keeps the arena pinned for a quick re-``activate`` (ComfyUI detaches and re-loads
        the same model around every sampler run).
        """
        if self.active:
            for b in list(self._bound):
                self._bind(b, self._cpu_views[b])
            self._bound.clear()
            if self._sync is not None and self._sync.cuda:
                torch.cuda.current_stream(self.device).wait_stream(self._sync.copy_stream)
                self._sync.copy_stream.synchronize()  # not the hot loop: copies must finish before unpin/free
            self.slots = []
            self._gpu_views.clear()
            self._where.clear()
            self._sync = None
            self.active = False
        if self.arena is not None and release_host:
            self.arena.unpin()
            if self._mostly_file_backed():
                # Idle model ~0 RSS (two-expert Wan 2.2): file-backed masters go back to the file mapping, the
                # rest (biases, norms, modulation: ~0.1 % of a block) gets small private copies, the arena goes.
                for b in self.plan.streamed:
                    keep = self.originals.get(b, {})
                    self._bind(b, self._as_params(b, {n: keep[n] if n in keep else v.clone()
                                                      for n, v in self._cpu_views[b].items()}))
                self.originals.clear()
                self.arena = None
                self._cpu_views.clear()

    def _mostly_file_backed(self) -> bool:
        """True when at least 90 % of the arena's bytes have a file-backed master to fall back to."""
        if not self.originals or self.arena is None:
            return False
        mapped = sum(t.numel() * t.element_size() for o in self.originals.values() for t in o.values())
        return mapped >= 0.9 * self.arena.buffer.numel()

    # -- the hot loop ----------------------------------------------------------------------------------------

    def _load(self, b: int) -> int:
        """Issue the H2D copy of block ``b`` into the oldest free slot; returns the slot index."""
        i = self._free_order.pop(0)
        slot = self.slots[i]
        if slot.block is not None and self._where.get(slot.block) == i:
            del self._where[slot.block]
        sync = self._sync
        src_base = self._arena_offsets[b]
        n = self._layout(b)[1]
        with sync.copy_context():
            sync.copy_stream.wait_event(slot.free)  # the previous occupant has been consumed
            start = sync.event(True) if self.debug else None
            if start is not None:
                start.record(sync.copy_stream)
            slot.flat[:n].copy_(self.arena.buffer[src_base: src_base + n], non_blocking=True)
            slot.ready.record(sync.copy_stream)
            self.arena.last_copy = slot.ready
            if start is not None:
                end = sync.event(True)
                end.record(sync.copy_stream)
                self._timers.append((b, "transfer", start, end))
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
        self._timers.clear()
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
        if self.debug:
            t0 = sync.event(True)
            t0.record(compute)
        compute.wait_event(self.slots[s].ready)
        if self.debug:
            t1 = sync.event(True)
            t1.record(compute)
            self._timers.append((i, "stall", t0, t1))
            self._timers.append((i, "compute_start", t1, None))
        self._bind(i, self._gpu(i, s))
        self._bound[i] = s
        self._prefetch(j + 1)

    def after_block(self, i: int) -> None:
        """After block ``i`` ran (or raised): free its slot behind the compute stream and rebind it to the CPU."""
        j = self.ordinal.get(i)
        if j is None or i not in self._bound:
            return
        s = self._bound.pop(i)
        slot = self.slots[s]
        compute = self._sync.compute_stream()
        slot.free.record(compute)
        if self.debug:
            t2 = self._sync.event(True)
            t2.record(compute)
            start = next(t for (bi, kind, t, _) in reversed(self._timers) if bi == i and kind == "compute_start")
            self._timers.append((i, "compute", start, t2))
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
        """End of a model forward; in debug mode read the CUDA-event timings (one sync, outside the loop)."""
        for b in list(self._bound):  # a forward that raised inside a block
            self.after_block(b)
        if self.debug and self._sync is not None and self._sync.cuda and self._timers:
            # the device, not just compute: wrap-around prefetches for the next forward are still on the copy stream
            torch.cuda.synchronize(self.device)
            st = self.stats
            for b, kind, a, z in self._timers:
                if z is None:
                    continue
                ms = a.elapsed_time(z)
                st.per_block.setdefault(b, {}).setdefault(kind, 0.0)
                st.per_block[b][kind] += ms
                if kind == "transfer":
                    st.transfer_ms += ms
                elif kind == "stall":
                    st.stall_ms += ms
                elif kind == "compute":
                    st.compute_ms += ms
            self._timers.clear()
        return self.stats


def format_stats(stats: StreamStats) -> str:
    """One human-readable report of a forward's transfers (debug mode)."""
    lines = [f"block swap: {stats.loads} loads ({stats.on_demand} on demand), transfer {stats.transfer_ms:.1f} ms, "
             f"stall {stats.stall_ms:.1f} ms, streamed compute {stats.compute_ms:.1f} ms, "
             f"overlap {100 * stats.overlap:.1f} %"]
    for b in sorted(stats.per_block):
        d = stats.per_block[b]
        lines.append(f"  block {b:3d}: transfer {d.get('transfer', 0):7.2f} ms  compute {d.get('compute', 0):7.2f} ms"
                     f"  stall {d.get('stall', 0):6.2f} ms")
    return "\n".join(lines)


def gib(nbytes: float) -> float:
    """Bytes to GiB (for log lines)."""
    return nbytes / 2**30


def budget_bytes_from_gb(gb: float) -> int:
    """A ``vram_budget_gb`` option to bytes (decimal GB, as GPU marketing and ComfyUI's logs use MB of 2**20)."""
    return int(math.floor(gb * 1e9))
