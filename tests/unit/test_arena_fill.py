"""CPU tests for offload/arena_fill.py: a host arena filled by a thread beside the first forward (``activate(...,
background=True)``), as an expert switch into the memory the idle expert left does on a GPU."""

from __future__ import annotations

import threading
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


class _Doubler:
    """A ``RingFill`` standing in for the LoRA merge: doubles each block's first ffn weight in its ring slot, once per
    block; the first block waits until ``go`` is set (the activation has to return before it is), and ``fail_at``
    raises once, after it doubled that block's weight in the slot (a merge that stopped half way)."""

    def __init__(self, blocks: list[int], fail_at: int | None = None) -> None:
        self.pending, self.fail_at = set(blocks), fail_at
        self.go, self.blocked = threading.Event(), False
        self.calls: list[int] = []

    def wants(self, b: int) -> bool:
        return b in self.pending

    def fill(self, b: int, views: dict[str, torch.Tensor]) -> list[str]:
        if not self.calls:
            self.blocked = not self.go.wait(10)
        self.calls.append(b)
        views["ffn.0.weight"].mul_(2)
        if b == self.fail_at:
            self.fail_at = None
            raise RuntimeError(f"planted failure at block {b}")
        self.pending.discard(b)
        return ["ffn.0.weight"]


def _doubled(model: TinyWan, blocks: tuple[int, ...]) -> torch.Tensor:
    """The model's output with the first ffn weight of ``blocks`` doubled (what _Doubler writes)."""
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


def test_the_first_forward_waits_for_each_block_it_loads_and_fills_it_in_the_ring(tmp_path: Path) -> None:
    """activate returns before the first block is copied; the forward loads each block once its copy is done and
    fills it in its slot, so it computes with the doubled weights; afterwards every block is bound to the arena,
    the arena holds the doubled bytes (written back from the ring) and the next forward fills nothing."""
    model = _mapped_wan(tmp_path / "m.safetensors", 3)
    st = _streamer(model)
    ref = _doubled(model, st.plan.streamed)
    before = {b: model.blocks[b].ffn[0].weight.detach().clone() for b in st.plan.streamed}
    fill = _Doubler(list(st.plan.streamed))
    st.activate(fill, background=True)
    fill.go.set()
    assert st.took["background"]
    assert torch.equal(_forward(model, st), ref)
    assert not fill.blocked and fill.calls == list(st.plan.streamed)
    assert all(st.arena.contains(model.blocks[b].ffn[0].weight) for b in st.plan.streamed)
    assert all(torch.equal(st.cpu_views(b)["ffn.0.weight"], before[b] * 2) for b in st.plan.streamed)
    assert all(host_memory.is_file_backed(t) for b in st.plan.streamed for t in st.originals[b].values())
    assert torch.equal(_forward(model, st), ref) and len(fill.calls) == len(st.plan.streamed)
    st.detach()
    st.activate()  # the arena is current: nothing is copied again, and it holds the filled bytes
    assert not st.took["background"] and torch.equal(_forward(model, st), ref)
    st.release()


def test_a_detach_before_any_forward_completes_the_copy(tmp_path: Path) -> None:
    """An interrupted prompt (no forward after the load): the detach waits for the copy and binds every block to the
    arena, which holds the blocks as they were (the ring fill never ran); the next load runs on it as it is."""
    model = _mapped_wan(tmp_path / "m.safetensors", 4)
    st = _streamer(model)
    plain = _forward(model, None)
    fill = _Doubler(list(st.plan.streamed))
    st.activate(fill, background=True)
    fill.go.set()
    st.detach()
    assert fill.calls == [] and all(st.arena.contains(model.blocks[b].ffn[0].weight) for b in st.plan.streamed)
    st.activate()
    assert torch.equal(_forward(model, st), plain)
    st.release()


def test_a_fill_that_fails_half_way_fails_the_forward_and_the_next_one_fills_from_the_arena(tmp_path: Path) -> None:
    """An error in a block's fill reaches the forward; the slot it left half done is given up, so the next forward
    copies that block from the arena again and fills it once: the same output as a fill that never failed."""
    model = _mapped_wan(tmp_path / "m.safetensors", 5)
    st = _streamer(model)
    ref = _doubled(model, st.plan.streamed)
    failing = st.plan.streamed[1]
    fill = _Doubler(list(st.plan.streamed), fail_at=failing)
    st.activate(fill, background=True)
    fill.go.set()
    with pytest.raises(RuntimeError, match=f"planted failure at block {failing}"):
        _forward(model, st)
    assert fill.wants(failing)
    assert torch.equal(_forward(model, st), ref)
    assert fill.calls == list(st.plan.streamed[:2]) + list(st.plan.streamed[1:])
    st.detach()
    st.activate()
    assert torch.equal(_forward(model, st), ref)
    st.release()


def test_a_copy_error_releases_every_waiter() -> None:
    """The copy stops at its first error: the blocks after it raise that error instead of waiting forever."""
    def copy(b: int) -> None:
        if b == 2:
            raise OSError("planted read error")

    fill = BackgroundFill([1, 2, 3], copy)
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
    st._build_arena(background=True)
    assert not st.took["background"] and st.arena.contains(model.blocks[plan.streamed[0]].ffn[0].weight)
    st.arena.pin()  # as activate does after the copy
    st.release()  # back to the file; the pinned memory is offered to the next arena of its size
    st.took = {"background": False}
    st._build_arena(background=True)
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
