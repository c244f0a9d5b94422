"""CPU tests for offload/arena_fill.py: a host arena filled by a thread beside the first forward (``activate(...,
background=True)``), as an expert switch into the memory the idle expert left does on a GPU."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from test_offload import TinyWan, _forward, _mapped_wan

from comfyui_lowvram_dit.offload import engine as offload, host_memory
from comfyui_lowvram_dit.offload.arena_fill import BackgroundFill
from comfyui_lowvram_dit.offload.engine import BlockStreamer
from comfyui_lowvram_dit.offload.plan import SwapConfig, plan_swap


@pytest.fixture(autouse=True)
def _no_spare_arenas():
    host_memory.release_spares()
    yield
    host_memory.release_spares()


class _SlowMerge:
    """A ``BlockFill`` standing in for the LoRA merge: doubles each block's first ffn weight in the arena, in a thread
    of its own, some time after the block was handed over; the first block waits until ``go`` is set."""

    def __init__(self, st: BlockStreamer, delay: float = 0.02, fail_at: int | None = None) -> None:
        self.st, self.delay, self.fail_at = st, delay, fail_at
        self.go, self.blocked = threading.Event(), False
        self.blocks: list[int] = []
        self.jobs: list[Future] = []
        self.waits = 0

    def block(self, b: int) -> Future:
        if not self.blocks:
            self.blocked = not self.go.wait(10)  # the activation has to return before this is set
        self.blocks.append(b)
        job: Future = Future()

        def run() -> None:
            time.sleep(self.delay)
            if b == self.fail_at:
                job.set_exception(RuntimeError(f"planted failure at block {b}"))
                return
            self.st.cpu_views(b)["ffn.0.weight"].mul_(2)
            job.set_result(None)

        threading.Thread(target=run).start()
        self.jobs.append(job)
        return job

    def settle(self, job: Future) -> None:
        job.result()

    def wait(self) -> None:  # as BlockMerge.wait: every job settled, the first error raised
        self.waits += 1
        for job in self.jobs:
            job.exception()
        for job in self.jobs:
            job.result()


def _doubled(model: TinyWan, blocks: tuple[int, ...]) -> torch.Tensor:
    """The model's output with the first ffn weight of ``blocks`` doubled (what _SlowMerge writes)."""
    saved = {b: model.blocks[b].ffn[0].weight.detach().clone() for b in blocks}
    for b in blocks:
        model.blocks[b].ffn[0].weight = torch.nn.Parameter(saved[b] * 2, requires_grad=False)
    out = _forward(model, None)
    for b in blocks:
        model.blocks[b].ffn[0].weight = torch.nn.Parameter(saved[b], requires_grad=False)
    return out


def _streamer(model: TinyWan) -> BlockStreamer:
    plan = plan_swap([offload.block_nbytes(b) for b in model.blocks], SwapConfig(blocks_to_swap=3, prefetch=1))
    return BlockStreamer(model.blocks, plan, "cpu", pinned=False)


def test_the_first_forward_waits_for_each_block_it_loads_and_no_longer(tmp_path: Path) -> None:
    """activate returns before the first block is copied; the forward loads each block once its copy and its fill
    work are done, so it computes with the merged weights; afterwards every block is bound to the arena and
    ``on_filled`` ran once, on the forward's thread."""
    model = _mapped_wan(tmp_path / "m.safetensors", 3)
    st = _streamer(model)
    ref = _doubled(model, st.plan.streamed)
    fill = _SlowMerge(st)
    done: list[str] = []
    st.activate(fill, on_filled=lambda: done.append(threading.current_thread().name), background=True)
    fill.go.set()
    assert st.took["background"] and st.took["filled"] and not done
    assert torch.equal(_forward(model, st), ref)
    assert not fill.blocked and fill.blocks == list(st.plan.streamed) and fill.waits == 1
    assert done == [threading.current_thread().name]
    assert all(st.arena.contains(model.blocks[b].ffn[0].weight) for b in st.plan.streamed)
    assert all(host_memory.is_file_backed(t) for b in st.plan.streamed for t in st.originals[b].values())
    assert torch.equal(_forward(model, st), ref)  # the next forward: nothing left to wait for
    st.detach()
    st.activate()  # the arena is current: nothing is copied again
    assert not st.took["background"] and torch.equal(_forward(model, st), ref)
    st.release()


def test_a_detach_before_any_forward_completes_the_fill(tmp_path: Path) -> None:
    """An interrupted prompt (no forward after the load): the detach waits for the copy, binds every block to the
    arena and runs ``on_filled``; the next load runs on the arena as it is."""
    model = _mapped_wan(tmp_path / "m.safetensors", 4)
    st = _streamer(model)
    ref = _doubled(model, st.plan.streamed)
    fill, done = _SlowMerge(st), []
    st.activate(fill, on_filled=lambda: done.append(True), background=True)
    fill.go.set()
    st.detach()
    assert done == [True] and all(st.arena.contains(model.blocks[b].ffn[0].weight) for b in st.plan.streamed)
    st.activate()
    assert torch.equal(_forward(model, st), ref)
    st.release()


def test_a_failing_fill_fails_the_forward_and_the_next_load_copies_again(tmp_path: Path,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    """An error in a block's fill work reaches the forward that loads that block; the detach after it logs instead
    of raising (ComfyUI unloads on its way out of the failed prompt), ``on_filled`` never runs, and a load after it
    copies the blocks the fill did not reach."""
    model = _mapped_wan(tmp_path / "m.safetensors", 5)
    st = _streamer(model)
    plain = _forward(model, None)
    failing = st.plan.streamed[1]
    fill, done = _SlowMerge(st, fail_at=failing), []
    st.activate(fill, on_filled=lambda: done.append(True), background=True)
    fill.go.set()
    with pytest.raises(RuntimeError, match=f"planted failure at block {failing}"):
        _forward(model, st)
    st.detach()
    assert not done and "filling the host arena failed" in caplog.text
    st.release()  # back to the file: the doubled weights leave with the arena
    st.activate()
    assert torch.equal(_forward(model, st), plain)
    st.release()


def test_a_copy_error_releases_every_waiter() -> None:
    """The copy stops at its first error: the blocks after it raise that error instead of waiting forever."""
    def copy(b: int) -> None:
        if b == 2:
            raise OSError("planted read error")

    fill = BackgroundFill([1, 2, 3], copy, None)
    fill.ready(1)
    for b in (2, 3):
        with pytest.raises(OSError, match="planted read error"):
            fill.ready(b)
    with pytest.raises(OSError):
        fill.join()
    assert fill.copied(1) and not fill.copied(3)


def test_an_arena_to_be_pinned_is_never_filled_beside_the_forward(tmp_path: Path, monkeypatch) -> None:
    """A fresh arena that will be pinned is filled before the pin (registering memory being written is not done),
    even when asked to fill in the background; memory already pinned (an expert switch) is filled beside it."""
    from fake_cudart import FakeCudart

    FakeCudart.install(monkeypatch)
    model = _mapped_wan(tmp_path / "m.safetensors", 6)
    plan = plan_swap([offload.block_nbytes(b) for b in model.blocks], SwapConfig(blocks_to_swap=3))
    st = BlockStreamer(model.blocks, plan, "cpu", pinned=True)
    st.device = torch.device("cuda")  # the arena decisions only (activate's ring would need a GPU)
    st._owners = {b: st._build_owners(b) for b in plan.streamed}
    st.took = {"background": False}
    st._build_arena(None, background=True)
    assert not st.took["background"] and st.arena.contains(model.blocks[plan.streamed[0]].ffn[0].weight)
    st.arena.pin()  # as activate does after the copy
    st.release()  # back to the file; the pinned memory is offered to the next arena of its size
    st.took = {"background": False}
    st._build_arena(None, background=True)
    assert st.took["reused"] and st.arena.pinned and st.took["background"]
    st.finish_fill()
    assert all(st.arena.contains(model.blocks[b].ffn[0].weight) for b in plan.streamed)
    st.release()


def test_an_activation_that_fails_after_the_fill_started_leaves_no_copy_running(tmp_path: Path,
                                                                              monkeypatch) -> None:
    """The ring's allocation fails once the copy thread runs (a GPU out of memory): the release after it waits for
    that thread before it lets the arena go, and a later load runs on the blocks as they are."""
    model = _mapped_wan(tmp_path / "m.safetensors", 7)
    st = _streamer(model)
    ref = _forward(model, None)

    def no_ring(*args, **kwargs):
        raise torch.OutOfMemoryError("planted: no room for the ring")

    monkeypatch.setattr(offload, "_Sync", no_ring)
    with pytest.raises(torch.OutOfMemoryError):
        st.activate(background=True)
    assert st._filling is not None and not st.active
    st.release()
    assert st._filling is None
    monkeypatch.undo()
    st.activate()
    assert torch.equal(_forward(model, st), ref)
    st.release()
