"""Block Swap's timings and what they mean for the user: are the copies hidden behind compute, or do they stall it?

offload/engine.py times a few model calls after each load: ``CallTimer`` collects one call's event spans (copy,
wait and compute per streamed block) and sums them into its ``StreamStats`` once the GPU has passed them.
``swap_verdict`` turns those stats and the load's shape (``SwapSetup``) into one sentence: either the copies are
hidden (streaming costs no speed; what Block Swap buys is memory) or they stall compute by X ms per model call,
with the settings that would help, computed from the same numbers. Plain Python, no torch (events come in
through ``sync``): tested on CPU with recorded Block Swap timings.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .plan import MAX_PREFETCH

# A call whose stall is at most this share of its time counts as hidden: event timing itself jitters by ~0.1 ms.
HIDDEN_SHARE = 0.02
# Compute/copy ratio per block above which ComfyUI's own partial loading keeps up as well (docs/benchmarks.md).
PARTIAL_LOADING_KEEPS_UP = 5.0
# Share of a call's compute that copies may fill and still hide: the rest absorbs jitter and uneven block gaps.
COPY_FILL = 0.9


@dataclass
class StreamStats:
    """Counters for one model call; a timed call adds CUDA-event timings (``timed``), read after the call."""

    loads: int = 0
    on_demand: int = 0  # loads the schedule did not foresee (self-healing)
    transfer_ms: float = 0.0  # every copy issued during the call (incl. the wrap-around ones for the next call)
    stall_ms: float = 0.0  # time the compute stream waited for a copy
    compute_ms: float = 0.0  # streamed blocks' own compute
    call_ms: float = 0.0  # the whole model call on the compute stream
    copies: int = 0  # timed copies in transfer_ms
    blocks_run: int = 0  # timed streamed blocks in compute_ms
    timed: bool = False
    per_block: dict[int, dict[str, float]] = field(default_factory=dict)

    @property
    def overlap(self) -> float:
        """Fraction of transfer time hidden behind compute (1.0 = fully hidden)."""
        return 1.0 - min(self.stall_ms, self.transfer_ms) / self.transfer_ms if self.transfer_ms > 0 else 1.0


class CallTimer:
    """Event spans of one timed forward: recorded in the loop, read once the GPU has passed them.

    ``sync`` is offload/engine.py's streams-and-events object (CUDA events, or test doubles with the same methods).
    """

    def __init__(self, sync: Any, stats: StreamStats) -> None:
        self.sync, self.stats = sync, stats
        self.spans: list[tuple[int, str, Any, Any]] = []
        self.started: dict[int, Any] = {}  # streamed block -> the event its compute started at
        self.start = self.mark(sync.compute_stream())
        self.end: Any = None
        self.last_copy: Any = None

    def mark(self, stream: Any) -> Any:
        """A timing event recorded on ``stream`` now."""
        event = self.sync.event(True)
        event.record(stream)
        return event

    def finish(self) -> None:
        """End of the forward on the compute stream."""
        self.end = self.mark(self.sync.compute_stream())

    def done(self) -> bool:
        """True once the GPU has passed every event (each stream runs in order: its last event says it)."""
        return all(e.query() for e in (self.end, self.last_copy) if e is not None)

    def wait(self) -> None:
        """Block until ``done`` (outside the loop only: unload, debug mode)."""
        for e in (self.end, self.last_copy):
            if e is not None:
                e.synchronize()

    def read(self) -> StreamStats:
        """Sum the spans into this forward's ``StreamStats`` (only after ``done``)."""
        st = self.stats
        for b, kind, a, z in self.spans:
            ms = a.elapsed_time(z)
            st.per_block.setdefault(b, {}).setdefault(kind, 0.0)
            st.per_block[b][kind] += ms
            if kind == "transfer":
                st.transfer_ms += ms
                st.copies += 1
            elif kind == "stall":
                st.stall_ms += ms
            elif kind == "compute":
                st.compute_ms += ms
                st.blocks_run += 1
        st.call_ms = self.start.elapsed_time(self.end)
        st.timed = True
        self.spans.clear()
        return st


def format_stats(stats: StreamStats) -> str:
    """One human-readable report of a forward's transfers (debug mode)."""
    lines = [(f"block swap: {stats.loads} loads ({stats.on_demand} on demand), transfer {stats.transfer_ms:.1f} ms, "
              f"stall {stats.stall_ms:.1f} ms, streamed compute {stats.compute_ms:.1f} ms, "
              f"overlap {100 * stats.overlap:.1f} %" + (f", call {stats.call_ms:.1f} ms" if stats.timed else ""))]
    for b in sorted(stats.per_block):
        d = stats.per_block[b]
        lines.append(f"  block {b:3d}: transfer {d.get('transfer', 0):7.2f} ms  compute {d.get('compute', 0):7.2f} ms"
                     f"  stall {d.get('stall', 0):6.2f} ms")
    return "\n".join(lines)


@dataclass(frozen=True)
class SwapSetup:
    """The shape of one load: the plan, the node's options and where the bytes sit."""

    model: str  # the diffusion model's class, e.g. "WanModel"
    num_blocks: int
    streamed: int
    prefetch: int
    pinned: bool  # the host copy is page-locked (async copies); False = pageable
    block_bytes: int  # bytes one copy moves (a streamed block)
    ring_bytes: int
    resident_bytes: int  # weights the GPU keeps besides the ring
    source_itemsize: int = 1  # bytes per element of the weights that dominate a block (1 = fp8)
    vram_budget_gb: float = 0.0
    blocks_to_swap: int = -1
    pinned_option: bool = True  # the node's `pinned`: on with ``pinned`` False means page-locking failed


@dataclass(frozen=True)
class SwapVerdict:
    """The verdict and the numbers behind it (None where nothing was measured)."""

    kind: str  # "hidden", "stalls", "pageable" or "unmeasured"
    text: str
    copy_ms: float | None = None  # per streamed block
    compute_ms: float | None = None  # per streamed block
    stall_ms: float | None = None  # per model call
    stall_share: float | None = None  # of the model call
    suggestions: tuple[str, ...] = ()


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB"


def _memory(setup: SwapSetup) -> str:
    return (f"{_gb(setup.streamed * setup.block_bytes)} of blocks stay in host RAM instead of VRAM (the GPU holds "
            f"{_gb(setup.resident_bytes)} of weights + a {_gb(setup.ring_bytes)} ring)")


def hidden_capacity(setup: SwapSetup, copy_ms: float, compute_ms: float, busy_ms: float) -> int:
    """About how many blocks could stream with their copies still hidden, from one call's timings.

    Copies run one after another on one stream, so they must fit in the call's compute (``busy_ms``); where
    streamed blocks sit next to each other (more than half streamed) each copy only has ``prefetch`` blocks of
    compute to hide behind.
    """
    if copy_ms <= 0:
        return setup.num_blocks
    fit = min(setup.num_blocks, math.floor(COPY_FILL * busy_ms / copy_ms))
    if fit > setup.num_blocks // 2 and copy_ms > COPY_FILL * compute_ms * setup.prefetch:
        fit = setup.num_blocks // 2  # adjacent streamed blocks would wait: keep a resident block between them
    return max(fit, 0)


def fewer_blocks(setup: SwapSetup, target: int) -> str:
    """The setting that streams ``target`` blocks instead of ``setup.streamed``, and the VRAM it costs."""
    extra = (setup.streamed - target) * setup.block_bytes
    if setup.vram_budget_gb > 0 and setup.blocks_to_swap < 0:
        how = f"vram_budget_gb={math.ceil((setup.vram_budget_gb + extra / 1e9) * 10) / 10:.1f}"
    else:
        how = f"blocks_to_swap={target}"
    where = "every block resident" if target == 0 else f"{target} streamed"
    return f"{how} ({where}) if the GPU has {_gb(extra)} more free"


def _stall_advice(setup: SwapSetup, c: StreamStats, copy_ms: float, compute_ms: float,
                  busy_ms: float) -> tuple[str, list[str]]:
    """Why the copies stall (link or latency) and the settings that would help (at least one), from the numbers."""
    tips: list[str] = []
    transfer_ms = c.transfer_ms
    capacity = hidden_capacity(setup, copy_ms, compute_ms, busy_ms)
    copy_bound = transfer_ms > COPY_FILL * busy_ms
    why = ""
    if copy_bound:
        why = (f" The link is the limit: copies take {transfer_ms:.0f} ms per call against {busy_ms:.0f} ms of "
               "compute, so a deeper prefetch cannot help.")
    elif setup.prefetch < MAX_PREFETCH:
        tips.append(f"prefetch={setup.prefetch + 1} (one more {_gb(setup.block_bytes)} ring slot: each copy then "
                    f"overlaps {setup.prefetch + 1} blocks of compute)")
    if capacity >= setup.streamed and (copy_bound or setup.prefetch >= MAX_PREFETCH):
        capacity = max(setup.streamed - math.ceil(c.stall_ms / copy_ms), 0)  # each block out removes one copy
    if capacity < setup.streamed:
        tips.append(fewer_blocks(setup, capacity))
    if setup.source_itemsize > 1:
        fp8_copy = copy_ms / setup.source_itemsize
        hides = hidden_capacity(setup, fp8_copy, compute_ms, busy_ms) >= setup.streamed
        tips.append(f"fp8 weights instead of {8 * setup.source_itemsize}-bit (the pack's Wan / Qwen-Image loaders "
                    f"quantize on load): each copy drops to about {fp8_copy:.1f} ms"
                    + (", which should hide them" if hides else ""))
    return why, tips


def swap_verdict(calls: Sequence[StreamStats], setup: SwapSetup) -> SwapVerdict:
    """One sentence on this load's copies vs compute, from its timed calls (the quickest complete one counts)."""
    head = (f"Block Swap measured ({setup.model}, {setup.streamed} of {setup.num_blocks} blocks streamed, "
            f"prefetch {setup.prefetch})")
    if setup.streamed == 0:
        return SwapVerdict("unmeasured", f"Block Swap ({setup.model}): nothing streams on this load (every block "
                                         "fits), so it changes nothing here")
    timed = [c for c in calls
             if c.timed and c.copies > 0 and c.transfer_ms > 0 and c.call_ms > 0 and c.blocks_run >= setup.streamed]
    if not timed:
        return SwapVerdict("unmeasured", f"Block Swap ({setup.model}): no complete model call with timed copies "
                                         "on this load (timing needs CUDA events), so no verdict on copies vs "
                                         "compute")
    c = min(timed, key=lambda s: s.call_ms)
    copy_ms, compute_ms = c.transfer_ms / c.copies, c.compute_ms / c.blocks_run
    stall, share = c.stall_ms, c.stall_ms / c.call_ms
    busy = max(c.call_ms - stall, 0.0)
    numbers = {"copy_ms": copy_ms, "compute_ms": compute_ms, "stall_ms": stall, "stall_share": share}
    on_demand = (f" {c.on_demand} of its copies were on demand (blocks ran out of the planned order), and those "
                 "cannot be prefetched." if c.on_demand else "")
    if not setup.pinned:
        tip = ("free RAM for page-locking (it failed at load; the log said why)" if setup.pinned_option else
               "pinned on (page-locked RAM: copies run asynchronously at the link's full speed)")
        return SwapVerdict("pageable", f"{head}: the host copy is pageable, so each {copy_ms:.1f} ms copy blocks "
                                       f"the CPU while the GPU waits for work, which these GPU timings do not "
                                       f"show (stall {stall:.1f} ms per model call). What would help: {tip}.",
                           **numbers, suggestions=(tip,))
    if share <= HIDDEN_SHARE:
        return SwapVerdict("hidden", _hidden_text(head, setup, copy_ms, compute_ms, stall, share, busy) + on_demand,
                           **numbers)
    why, tips = _stall_advice(setup, c, copy_ms, compute_ms, busy)
    text = (f"{head}: copies stall compute by {stall:.1f} ms per model call ({share:.1%} of it); each "
            f"{copy_ms:.1f} ms copy has {compute_ms:.1f} ms of compute per streamed block to hide behind.{why}"
            f"{on_demand} What would help: " + "; ".join(tips) + ".")
    return SwapVerdict("stalls", text, **numbers, suggestions=tuple(tips))


def _hidden_text(head: str, setup: SwapSetup, copy_ms: float, compute_ms: float, stall: float, share: float,
                 busy: float) -> str:
    margin = compute_ms / copy_ms if copy_ms > 0 else math.inf
    cover = (f"{compute_ms:.1f} ms of compute per streamed block covers its {copy_ms:.1f} ms copy" if margin >= 1 else
             f"each {copy_ms:.1f} ms copy hides behind more than its own block's {compute_ms:.1f} ms of compute (the "
             "ring loads it during the blocks before it)")
    text = f"{head}: copies are hidden: {cover} (stall {stall:.1f} ms per model call, {share:.1%})."
    if margin >= PARTIAL_LOADING_KEEPS_UP:
        text += (f" Streaming costs no speed here, and with {margin:.0f}x more compute than copy per block "
                 f"ComfyUI's own partial loading keeps up too, so what Block Swap buys on this run is memory: "
                 f"{_memory(setup)}.")
    else:
        text += (f" The margin is thin ({margin:.1f}x per block): the ring's prefetch is what hides them (at 1.2x "
                 f"ComfyUI's own partial loading lost 14 % to its copies); memory kept off the GPU: {_memory(setup)}.")
    if setup.streamed < setup.num_blocks:
        capacity = hidden_capacity(setup, copy_ms, compute_ms, busy)
        more = "a higher blocks_to_swap" if setup.blocks_to_swap >= 0 else "a lower vram_budget_gb"
        if capacity >= setup.num_blocks:
            text += (f" Streaming all {setup.num_blocks} blocks would stay hidden too: {more} frees VRAM at no "
                     "speed cost at this size.")
        elif capacity > setup.streamed:
            text += f" Up to about {capacity} streamed blocks should stay hidden at this size ({more} frees VRAM)."
        else:
            text += " Streaming more blocks would start to stall at this size."
    return text
