"""CPU tests for offload/verdict.py (the verdict on measured copies vs compute) and for the engine's timing of
a few forwards per load (offload/engine.py), driven by injected event timings since CPU events are no-ops.

The "measured" numbers are the debug-forward timings of benchmarks/results/block_swap_*.md (H200, Wan 14B fp8,
the swap_b2 variants); call_ms there is the variant's median forward. The stalling cases are built from the
projection in benchmarks/results/block_swap_projection.md (a bf16 block over PCIe 4: 28 ms per copy) and say so.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch
from comfyui_lowvram_dit.offload import engine as offload
from comfyui_lowvram_dit.offload.engine import BlockStreamer, StreamHook
from comfyui_lowvram_dit.offload.plan import SwapConfig, plan_swap
from comfyui_lowvram_dit.offload.verdict import StreamStats, SwapSetup, fewer_blocks, hidden_capacity, swap_verdict
from test_offload import TinyWan, _inputs

GIB = 2**30
BLOCK = int(0.655 * GIB / 2)  # one Wan 14B fp8 ring slot (ring_gib=0.655 for 2 slots in the result files)


def _setup(streamed: int, loaded_gib: float, **kw) -> SwapSetup:
    """A Wan 14B fp8 load as the result files describe it (loaded_gib = resident weights + ring)."""
    args = {"model": "WanModel", "num_blocks": 40, "streamed": streamed, "prefetch": 1, "pinned": True,
            "block_bytes": BLOCK, "ring_bytes": 2 * BLOCK, "resident_bytes": int(loaded_gib * GIB) - 2 * BLOCK}
    return SwapSetup(**{**args, **kw})


def _call(n: int, transfer_ms: float, compute_ms: float, stall_ms: float, call_ms: float, **kw) -> StreamStats:
    return StreamStats(loads=n, copies=n, blocks_run=n, transfer_ms=transfer_ms, compute_ms=compute_ms,
                       stall_ms=stall_ms, call_ms=call_ms, timed=True, **kw)


# ---------------------------------------------------------------------------------------------------------
# The verdict, from measured numbers


def test_480p81_copies_are_hidden_and_the_gain_is_memory():
    """block_swap_480p81.md, cap 8: 37 streamed, transfer 235.7 ms, compute 2260.54 ms, stall 0.09 ms."""
    v = swap_verdict([_call(37, 235.70, 2260.54, 0.09, 2457.32)], _setup(37, 2.071))
    assert v.kind == "hidden"
    assert v.copy_ms == pytest.approx(6.37, abs=0.01) and v.compute_ms == pytest.approx(61.1, abs=0.05)
    assert v.stall_ms == pytest.approx(0.09) and v.stall_share < 1e-4
    assert "61.1 ms of compute per streamed block covers its 6.4 ms copy" in v.text
    assert "ComfyUI's own partial loading keeps up too" in v.text and "buys on this run is memory" in v.text
    assert "13.01 GB of blocks stay in host RAM" in v.text  # 37 x 0.352 GB
    assert "Streaming all 40 blocks would stay hidden too: a lower vram_budget_gb frees VRAM" in v.text
    assert not v.suggestions


def test_480p17_is_hidden_by_a_thin_margin_that_prefetch_covers():
    """block_swap_480p17.md, cap 8: 24 streamed, 6.37 ms copy vs 7.68 ms compute per block (1.2x)."""
    v = swap_verdict([_call(24, 152.88, 184.24, 0.07, 320.47)], _setup(24, 6.327))
    assert v.kind == "hidden"
    assert "The margin is thin (1.2x per block)" in v.text and "the ring's prefetch is what hides them" in v.text
    assert "partial loading keeps up" not in v.text
    # 40 copies of 6.37 ms fit in ~320 ms of compute, and 6.37 ms < 7.68 ms: even adjacent blocks hide
    assert "Streaming all 40 blocks would stay hidden too" in v.text
    explicit = swap_verdict([_call(24, 152.88, 184.24, 0.07, 320.47)], _setup(24, 6.327, blocks_to_swap=24))
    assert "a higher blocks_to_swap frees VRAM" in explicit.text


def test_copies_longer_than_a_block_can_hide_behind_the_resident_blocks_between():
    """Synthetic: 6 of 20 streamed, a 7 ms copy against 5.5 ms blocks, 3 blocks apart with prefetch 2."""
    v = swap_verdict([_call(6, 42.0, 33.0, 0.2, 110.2)], _setup(6, 5.0, num_blocks=20, prefetch=2))
    assert v.kind == "hidden" and "each 7.0 ms copy hides behind more than its own block's 5.5 ms" in v.text
    assert "(0.8x per block)" in v.text and "Up to about 14 streamed blocks" in v.text


def test_hidden_copies_name_how_far_streaming_could_go():
    """Synthetic: 7 ms copies; 200 ms of compute holds about 25 of them, 220 ms with 7.5 ms blocks only 20."""
    some = swap_verdict([_call(20, 140.0, 180.0, 0.5, 200.5)], _setup(20, 6.0))
    assert some.kind == "hidden" and "Up to about 25 streamed blocks should stay hidden" in some.text
    edge = swap_verdict([_call(30, 210.0, 225.0, 0.5, 220.5)], _setup(30, 4.0))
    assert edge.kind == "hidden" and "Streaming more blocks would start to stall" in edge.text


@pytest.mark.parametrize("streamed,transfer,compute,stall,call,loaded", [
    (25, 159.07, 1533.39, 0.08, 2466.46, 8.84 - 1.0),  # block_swap_480p81_cap12.md
    (37, 236.07, 9435.31, 0.11, 10221.61, 2.2),  # block_swap_720p81_cap16.md
])
def test_other_measured_loads_are_hidden(streamed, transfer, compute, stall, call, loaded):
    v = swap_verdict([_call(streamed, transfer, compute, stall, call)], _setup(streamed, loaded))
    assert v.kind == "hidden" and "partial loading keeps up too" in v.text


# ---------------------------------------------------------------------------------------------------------
# Stalls: the suggestions follow from the numbers


def test_a_link_bound_bf16_load_names_fewer_blocks_and_fp8_not_prefetch():
    """Projection: a bf16 block over PCIe 4 x16 takes 28 ms; 480p17 compute is 7.7 ms per block (40 blocks)."""
    busy = 40 * 7.7 + 12.0
    transfer = 37 * 28.0
    stall = transfer - busy
    setup = _setup(37, 2.071, source_itemsize=2, block_bytes=2 * BLOCK, ring_bytes=4 * BLOCK)
    v = swap_verdict([_call(37, transfer, 37 * 7.7, stall, busy + stall)], setup)
    assert v.kind == "stalls"
    assert f"copies stall compute by {stall:.1f} ms per model call" in v.text
    assert "The link is the limit" in v.text and "prefetch=" not in v.text
    capacity = int(0.9 * busy / 28.0)  # copies that fit in 90 % of the compute
    assert capacity == 10
    assert any(s.startswith(f"blocks_to_swap={capacity} ") for s in v.suggestions)
    assert f"{(37 - capacity) * 2 * BLOCK / 1e9:.2f} GB more free" in v.text
    fp8 = next(s for s in v.suggestions if s.startswith("fp8 weights instead of 16-bit"))
    assert "about 14.0 ms" in fp8 and "should hide" not in fp8  # 37 x 14 ms still exceeds ~320 ms of compute


def test_a_latency_bound_load_asks_for_prefetch_first():
    """Copies fit in the call's compute (37 x 7.5 < 0.9 x 320 ms) but adjacent streamed blocks wait for them."""
    v = swap_verdict([_call(37, 37 * 7.5, 37 * 7.7, 20.0, 340.0)], _setup(37, 2.071, vram_budget_gb=8.0))
    assert v.kind == "stalls" and "The link is the limit" not in v.text
    assert v.suggestions[0].startswith("prefetch=2 ")
    # more than half streamed puts streamed blocks side by side: 7.5 ms > 0.9 x 7.7 ms, so keep half resident
    assert v.suggestions[1].startswith("vram_budget_gb=")
    assert v.suggestions[1].startswith("vram_budget_gb=14.0 (20 streamed)")  # 8 GB + 17 blocks of 0.35 GB, rounded up


def test_a_stall_at_full_prefetch_still_gets_a_suggestion():
    setup = _setup(10, 2.071, prefetch=3, blocks_to_swap=10)
    v = swap_verdict([_call(10, 75.0, 77.0, 15.0, 335.0)], setup)
    assert v.kind == "stalls" and "prefetch=" not in v.text
    assert v.suggestions == (f"blocks_to_swap=8 (8 streamed) if the GPU has {2 * BLOCK / 1e9:.2f} GB more free",)


def test_pageable_copies_say_pinned_first():
    off = swap_verdict([_call(24, 152.88, 184.24, 0.07, 320.47)], _setup(24, 6.327, pinned=False, pinned_option=False))
    assert off.kind == "pageable" and "What would help: pinned on" in off.text
    failed = swap_verdict([_call(24, 152.88, 184.24, 0.07, 320.47)], _setup(24, 6.327, pinned=False))
    assert failed.kind == "pageable" and failed.suggestions[0].startswith("free RAM for page-locking")


def test_on_demand_copies_are_named():
    v = swap_verdict([_call(37, 235.7, 2260.54, 0.09, 2457.32, on_demand=3)], _setup(37, 2.071))
    assert v.kind == "hidden" and "3 of its copies were on demand" in v.text


def test_capacity_and_fewer_blocks_helpers():
    s = _setup(20, 2.0)
    assert hidden_capacity(s, 0.0, 5.0, 100.0) == 40
    assert hidden_capacity(s, 10.0, 5.0, 100.0) == 9
    assert hidden_capacity(s, 1.0, 0.5, 1000.0) == 20  # copy longer than a block's compute: keep half resident
    assert fewer_blocks(s, 0).startswith("blocks_to_swap=0 (every block resident)")


# ---------------------------------------------------------------------------------------------------------
# No verdict without real timings


def test_nothing_streamed_zero_transfers_and_untimed_calls_give_no_verdict():
    nothing = swap_verdict([], _setup(0, 13.5))
    assert nothing.kind == "unmeasured" and "nothing streams" in nothing.text
    zero = swap_verdict([_call(37, 0.0, 2260.0, 0.0, 2400.0)], _setup(37, 2.071))
    assert zero.kind == "unmeasured" and zero.copy_ms is None
    untimed = StreamStats(loads=37, copies=0, blocks_run=0)
    cpu = swap_verdict([untimed, untimed], _setup(37, 2.071))
    assert cpu.kind == "unmeasured" and " ms" not in cpu.text and "timing needs CUDA events" in cpu.text


def test_the_quickest_complete_call_counts():
    slow = _call(37, 235.7, 40000.0, 0.05, 42000.0)  # a recompile inside the timed call
    cut = _call(10, 60.0, 600.0, 30.0, 700.0)  # interrupted after 10 of 37 streamed blocks
    steady = _call(37, 235.7, 2260.54, 0.09, 2457.32)
    v = swap_verdict([slow, cut, steady], _setup(37, 2.071))
    assert v.kind == "hidden" and v.compute_ms == pytest.approx(2260.54 / 37)


# ---------------------------------------------------------------------------------------------------------
# The engine times a few forwards per load (injected timings: CPU events are no-ops)


class WallEvent:
    """A timing event on the CPU's clock; ``query`` answers what the test says the GPU has reached."""

    gpu_done = True
    created = 0
    syncs = 0

    def __init__(self, timing: bool = False) -> None:
        WallEvent.created += timing
        self.t = 0.0

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, other: WallEvent) -> float:
        return (other.t - self.t) * 1e3

    def query(self) -> bool:
        return WallEvent.gpu_done

    def synchronize(self) -> None:
        WallEvent.syncs += 1


class TimedSync(offload._Sync):
    """The CPU "device" with timing events, standing in for CUDA's."""

    def __init__(self, device: torch.device, timing: bool) -> None:
        super().__init__(device, timing)
        self.can_time = True

    def event(self, timing: bool = False) -> WallEvent:
        return WallEvent(timing)


@pytest.fixture
def timed_sync(monkeypatch):
    monkeypatch.setattr(offload, "_Sync", TimedSync)
    monkeypatch.setattr(WallEvent, "gpu_done", True)
    monkeypatch.setattr(WallEvent, "created", 0)
    monkeypatch.setattr(WallEvent, "syncs", 0)
    return WallEvent


def _streamer(swap: int = 3, n: int = 8, debug: bool = False):
    torch.manual_seed(0)
    model = TinyWan(n=n)
    plan = plan_swap([offload.block_nbytes(b) for b in model.blocks], SwapConfig(blocks_to_swap=swap))
    st = BlockStreamer(model.blocks, plan, "cpu", pinned=False, debug=debug)
    st.activate()
    return model, plan, st


def _forward(model, st) -> StreamStats:
    with torch.no_grad():
        st.begin_forward()
        model(*_inputs(), streamer=st)
        return st.end_forward()


def test_the_engine_times_forwards_two_and_three_then_stops(timed_sync):
    model, plan, st = _streamer()
    _forward(model, st)
    assert timed_sync.created == 0 and st.take_measurement() == []  # the cold first forward is not timed
    _forward(model, st)
    assert st.take_measurement() == []  # one of two timed forwards so far
    _forward(model, st)
    calls = st.take_measurement()
    assert len(calls) == 2 and timed_sync.syncs == 0  # read through query(), never a sync
    for c in calls:
        assert c.timed and c.copies == c.blocks_run == len(plan.streamed)
        assert c.call_ms > 0 and c.compute_ms > 0 and c.transfer_ms > 0 and c.stall_ms >= 0
        assert set(c.per_block) == set(plan.streamed)
    created = timed_sync.created
    for _ in range(3):
        _forward(model, st)
    assert timed_sync.created == created and st.take_measurement() == []  # handed over once, then no timing
    st.detach()
    st.activate()  # the next load is measured afresh
    for _ in range(3):
        _forward(model, st)
    assert len(st.take_measurement()) == 2


def test_timings_wait_for_the_gpu_without_syncing_and_unload_flushes(timed_sync):
    model, _, st = _streamer()
    timed_sync.gpu_done = False
    for _ in range(4):
        _forward(model, st)
    assert st.take_measurement() == [] and timed_sync.syncs == 0  # the GPU has not passed them yet
    timed_sync.gpu_done = True
    assert len(st.take_measurement()) == 2

    model, _, st = _streamer()
    timed_sync.gpu_done = False
    for _ in range(2):  # a short load: one timed forward
        _forward(model, st)
    calls = st.take_measurement(wait=True)  # what unload does
    assert len(calls) == 1 and calls[0].timed and timed_sync.syncs > 0


def test_debug_times_every_forward_and_reads_it_at_once(timed_sync):
    model, _, st = _streamer(debug=True)
    stats = _forward(model, st)
    assert stats.timed and stats.transfer_ms > 0 and "call " in offload.format_stats(stats)


def test_the_cpu_device_times_nothing_even_in_debug():
    for debug in (False, True):
        model, _, st = _streamer(debug=debug)
        for _ in range(5):
            stats = _forward(model, st)
        assert not stats.timed and st.take_measurement() == [] and st.take_measurement(wait=True) == []


def test_the_hook_hands_the_timings_to_its_owner_once_per_load(timed_sync, caplog):
    model, plan, st = _streamer()
    got: list[list[StreamStats]] = []

    class Owner:
        debug = False

        def block_streamer(self) -> BlockStreamer:
            return st

        def forward_streamer(self) -> BlockStreamer:
            return st

        def oom_advice(self, message: str) -> str:
            return message

        def swap_measured(self, calls: list[StreamStats]) -> None:
            got.append(calls)

    hook = StreamHook(Owner())
    x, e, ctx = _inputs()
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        for _ in range(6):
            hook.wrap_forward(None, lambda: model(x, e, ctx, streamer=st), None)
    assert len(got) == 1 and len(got[0]) == 2
    verdict = swap_verdict(got[0], SwapSetup(model="TinyWan", num_blocks=8, streamed=3, prefetch=1, pinned=True,
                                             block_bytes=st.streamed_bytes // 3, ring_bytes=plan.ring_bytes,
                                             resident_bytes=0))
    assert verdict.kind in ("hidden", "stalls") and verdict.copy_ms > 0
    assert st.weight_itemsize() == 4  # fp32 test blocks
