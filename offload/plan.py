"""Block Swap planning: which blocks stream, how large the GPU ring is, and what to change after an OOM.

Streamed blocks are spread evenly among resident ones (midpoint formula, after musubi-tuner's
``LoRAStreamOffloader``), so each transfer hides behind about N/S blocks of compute. Pure functions of block
sizes and a ``SwapConfig``: tested on CPU, consumed by offload/engine.py's ``BlockStreamer``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

from .dynamic_vram_policy import CHOICES as DYNAMIC_VRAM_CHOICES


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
    dynamic_vram: str = "auto"  # a model DynamicVRAM manages: offload/dynamic_vram_policy.py

    def __post_init__(self) -> None:
        if not 1 <= self.prefetch <= MAX_PREFETCH:
            raise ValueError(f"SwapConfig.prefetch={self.prefetch}: use 1..{MAX_PREFETCH}")
        if self.blocks_to_swap < -1:
            raise ValueError(f"SwapConfig.blocks_to_swap={self.blocks_to_swap}: use -1 (auto) or >= 0")
        if self.vram_budget_gb < 0:
            raise ValueError(f"SwapConfig.vram_budget_gb={self.vram_budget_gb}: use 0 (auto) or a positive size")
        if self.dynamic_vram not in DYNAMIC_VRAM_CHOICES:
            raise ValueError(f"SwapConfig.dynamic_vram={self.dynamic_vram!r}: use one of {list(DYNAMIC_VRAM_CHOICES)}")



def aligned(nbytes: int, align: int = ALIGN) -> int:
    """``nbytes`` rounded up to a multiple of ``align``."""
    return (nbytes + align - 1) // align * align


def minimum_bytes(block_bytes: Sequence[int], config: SwapConfig, fixed_bytes: int = 0) -> int:
    """The least GPU memory a load's weights can take: fixed weights and a ring with every block streamed."""
    return fixed_bytes + ring_slots(config.prefetch, len(block_bytes)) * aligned(max(block_bytes, default=0))


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
    """A Block Swap OOM message that says what was on the GPU and the setting that would fit."""
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


def budget_bytes_from_gb(gb: float) -> int:
    """A ``vram_budget_gb`` option to bytes (decimal GB, as GPU marketing and ComfyUI's logs use MB of 2**20)."""
    return int(math.floor(gb * 1e9))


BUDGET_MAX_GB = 1024.0


def budget_problem(vram_budget_gb: object) -> str | None:
    """Why a ``vram_budget_gb`` value is refused (NaN passes ComfyUI's min/max checks and would act as 0), or None."""
    if isinstance(vram_budget_gb, bool) or not isinstance(vram_budget_gb, (int, float)):
        return None  # a linked value: checked when the node runs
    if not math.isfinite(vram_budget_gb) or not 0.0 <= vram_budget_gb <= BUDGET_MAX_GB:
        return (f"vram_budget_gb is {vram_budget_gb}: use 0 (what ComfyUI has free) or a size in GB up to "
                f"{BUDGET_MAX_GB:g}")
    return None


def check_budget(vram_budget_gb: float) -> None:
    """ValueError naming ``vram_budget_gb`` unless it is a finite size in range (for values no validation saw)."""
    problem = budget_problem(float(vram_budget_gb))
    if problem:
        raise ValueError(problem)
