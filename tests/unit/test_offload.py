"""CPU tests for offload/engine.py, swap_plan.py and host_memory.py: the schedule, the flat layout, and the engine on a CPU "device"."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import pytest

from comfyui_lowvram_dit.offload import host_memory, engine as offload, plan as swap_plan
from comfyui_lowvram_dit.offload.engine import BlockStreamer, flat_layout, flat_views
from comfyui_lowvram_dit.offload.plan import (
    SwapConfig, aligned, blocks_to_swap_for_budget, load_sequence, plan_swap, prefetch_targets, ring_slots,
    streamed_block_indices,
)


# ---------------------------------------------------------------------------------------------------------
# A tiny Wan-like model with the real per-block key names (comfy/ldm/wan/model.py WanAttentionBlock)


class Fp8Linear(torch.nn.Module):
    """The fp8 layer contract: plain fp8 `weight` + fp32 `weight_scale` Parameters."""

    def __init__(self, fin: int, fout: int) -> None:
        super().__init__()
        w = torch.randn(fout, fin) * 0.05
        scale = w.abs().amax() / 448.0
        self.weight = torch.nn.Parameter((w / scale).to(torch.float8_e4m3fn), requires_grad=False)
        self.weight_scale = torch.nn.Parameter(scale.float(), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.randn(fout) * 0.01, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight.float() * self.weight_scale, self.bias)


def _linear(fin: int, fout: int, fp8: bool) -> torch.nn.Module:
    return Fp8Linear(fin, fout) if fp8 else torch.nn.Linear(fin, fout)


class Attn(torch.nn.Module):
    def __init__(self, d: int, fp8: bool) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (_linear(d, d, fp8) for _ in range(4))
        self.norm_q = torch.nn.RMSNorm(d)
        self.norm_k = torch.nn.RMSNorm(d)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        q, k, v = self.norm_q(self.q(x)), self.norm_k(self.k(ctx)), self.v(ctx)
        return self.o(torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ v)


class WanBlock(torch.nn.Module):
    def __init__(self, d: int, ffn: int, fp8: bool = False) -> None:
        super().__init__()
        self.modulation = torch.nn.Parameter(torch.randn(1, 6, d) / d**0.5)
        self.self_attn = Attn(d, fp8)
        self.norm3 = torch.nn.LayerNorm(d)
        self.cross_attn = Attn(d, fp8)
        self.ffn = torch.nn.Sequential(_linear(d, ffn, fp8), torch.nn.GELU(approximate="tanh"), _linear(ffn, d, fp8))
        self.register_buffer("step_bias", torch.full((d,), 0.01))

    def forward(self, x: torch.Tensor, e: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        m = (self.modulation + e).chunk(6, dim=1)
        x = x + self.self_attn(x * (1 + m[1]) + m[0], x * (1 + m[1]) + m[0]) * m[2]
        x = x + self.cross_attn(self.norm3(x), ctx)
        return x + self.ffn(x * (1 + m[4]) + m[3]) * m[5] + self.step_bias


class TinyWan(torch.nn.Module):
    def __init__(self, n: int = 8, d: int = 32, ffn: int = 64, fp8: bool = False) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(WanBlock(d, ffn, fp8) for _ in range(n))

    def forward(self, x: torch.Tensor, e: torch.Tensor, ctx: torch.Tensor, streamer: BlockStreamer | None = None,
                order: list[int] | None = None) -> torch.Tensor:
        for i in (order if order is not None else range(len(self.blocks))):
            if streamer is not None:
                streamer.before_block(i)
            try:
                x = self.blocks[i](x, e, ctx)
            finally:
                if streamer is not None:
                    streamer.after_block(i)
        return x


def _inputs(d: int = 32, batch: int = 2):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch, 10, d, generator=g), torch.randn(batch, 6, d, generator=g) * 0.1,
            torch.randn(batch, 7, d, generator=g))


# ---------------------------------------------------------------------------------------------------------
# Scheduling


def test_streamed_blocks_are_evenly_spaced_midpoints():
    assert streamed_block_indices(40, 0) == []
    assert streamed_block_indices(40, 4) == [5, 15, 25, 35]
    assert streamed_block_indices(10, 3) == [1, 5, 8]
    assert streamed_block_indices(40, 40) == list(range(40))
    for n in (30, 40, 60):
        for s in range(n + 1):
            idx = streamed_block_indices(n, s)
            assert len(set(idx)) == s and all(0 <= i < n for i in idx)
            if s >= 2:  # gaps differ by at most one: each transfer hides behind about N/S blocks
                gaps = [b - a for a, b in zip(idx, idx[1:])]
                assert max(gaps) - min(gaps) <= 1
    with pytest.raises(ValueError):
        streamed_block_indices(4, 5)


def test_ring_slots_and_prefetch_targets_wrap_around():
    assert ring_slots(1, 10) == 2 and ring_slots(3, 10) == 4 and ring_slots(3, 2) == 2 and ring_slots(1, 0) == 0
    assert prefetch_targets(0, 5, 2) == [0, 1]
    assert prefetch_targets(4, 5, 3) == [4, 0, 1]  # the next forward's first blocks load during this one's tail
    assert prefetch_targets(1, 2, 4) == [1, 0]


def test_load_sequence_is_a_fifo_ring_over_a_cyclic_order():
    seq = load_sequence(num_streamed=3, ring=2, forwards=2)
    assert seq[:4] == [(0, 0), (1, 1), (2, 0), (0, 1)]
    assert [o for o, _ in seq] == [0, 1, 2, 0, 1, 2, 0]  # one more than consumed: wrap-around prefetch
    assert load_sequence(0, 0, 3) == []


def test_budget_to_blocks():
    gb = 10**9
    blocks = [351 * 10**6] * 40  # Wan 14B fp8 block (offload-fp8-compile.md §0)
    assert blocks_to_swap_for_budget(blocks, 100 * gb, gb, gb, 1) == 0  # everything fits
    s = blocks_to_swap_for_budget(blocks, 8 * gb, gb, 2 * gb, 1)
    resident = 40 - s
    slot = aligned(blocks[0])
    assert resident * blocks[0] + 2 * slot <= 5 * gb  # fits
    assert (resident + 1) * blocks[0] + 2 * slot > 5 * gb  # and is the fewest streamed blocks that fit
    assert blocks_to_swap_for_budget(blocks, gb, gb, gb, 1) == 40  # cannot fit: stream all (caller warns)
    # a deeper prefetch costs ring slots, so more blocks stream
    assert blocks_to_swap_for_budget(blocks, 8 * gb, gb, 2 * gb, 3) >= s + 2


def test_plan_swap_explicit_and_budget():
    blocks = [1000] * 10
    p = plan_swap(blocks, SwapConfig(blocks_to_swap=3, prefetch=2))
    assert p.streamed == (1, 5, 8) and p.ring == 3 and p.slot_bytes == aligned(1000) and p.ring_bytes == 3 * 1024
    assert plan_swap(blocks, SwapConfig()).streamed == ()  # auto without a budget: nothing to stream
    p = plan_swap(blocks, SwapConfig(), budget_bytes=8000, fixed_bytes=500, activation_bytes=500)
    # 7000 B left: 5 resident (5000) + ring 2x1024 = 7048 does not fit, 4 resident (4000) + 2048 does
    assert len(p.streamed) == 6 and p.ring == 2
    with pytest.raises(ValueError):
        SwapConfig(prefetch=0)
    with pytest.raises(ValueError, match="SwapConfig.dynamic_vram='streaming'"):  # checked where it is built
        SwapConfig(dynamic_vram="streaming")
    assert SwapConfig(dynamic_vram="step aside").dynamic_vram == "step aside"


# ---------------------------------------------------------------------------------------------------------
# Flat layout


def test_flat_layout_alignment_and_views_roundtrip():
    block = WanBlock(32, 64, fp8=True)
    tensors = offload.block_tensors(block)
    layout, total = flat_layout(tensors)
    assert total % swap_plan.ALIGN == 0
    for a, b in zip(layout, layout[1:]):
        assert b.offset % swap_plan.ALIGN == 0 and b.offset >= a.offset + a.nbytes
    flat = torch.zeros(total + 512, dtype=torch.uint8)
    views = flat_views(flat, layout, base=512)
    for (name, t), s in zip(tensors, layout):
        views[name].copy_(t)
        assert views[name].dtype == t.dtype and views[name].shape == t.shape
        assert views[name].data_ptr() == flat.data_ptr() + 512 + s.offset
        assert torch.equal(views[name].reshape(-1).view(torch.uint8), t.detach().reshape(-1).view(torch.uint8))
    # the scalar fp32 weight_scale and the fp8 weight are both there
    assert views["ffn.0.weight_scale"].shape == () and views["ffn.0.weight"].dtype == torch.float8_e4m3fn


def test_tensor_subclass_is_refused_with_a_fix():
    class Sub(torch.Tensor):
        pass

    m = torch.nn.Linear(4, 4)
    m.weight = torch.nn.Parameter(torch.randn(4, 4).as_subclass(Sub), requires_grad=False)
    with pytest.raises(TypeError, match="holds a Sub, which Block Swap cannot stream.*UnetLoaderGGUF"):
        offload.block_tensors(m)


# ---------------------------------------------------------------------------------------------------------
# Engine on the CPU "device"


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("swap,prefetch", [(3, 1), (8, 3), (1, 2), (5, 2)])
def test_swapped_output_equals_resident_on_cpu(fp8, swap, prefetch):
    torch.manual_seed(0)
    model = TinyWan(fp8=fp8).eval()
    x, e, ctx = _inputs()
    with torch.no_grad():
        ref = model(x, e, ctx)
        plan = plan_swap([offload.block_nbytes(b) for b in model.blocks], SwapConfig(blocks_to_swap=swap, prefetch=prefetch))
        st = BlockStreamer(model.blocks, plan, "cpu", pinned=False)
        st.activate()
        for _ in range(3):  # several forwards: wrap-around prefetch and slot reuse
            st.begin_forward()
            out = model(x, e, ctx, streamer=st)
            stats = st.end_forward()
            assert torch.equal(out, ref)
            assert stats.on_demand == 0
        st.release()
        assert torch.equal(model(x, e, ctx), ref)  # the model is intact after release


def test_streamed_blocks_point_at_the_arena_between_blocks_and_the_ring_inside():
    model = TinyWan()
    plan = plan_swap([offload.block_nbytes(b) for b in model.blocks], SwapConfig(blocks_to_swap=2))
    st = BlockStreamer(model.blocks, plan, "cpu", pinned=False)
    st.activate()
    b = plan.streamed[0]
    w = model.blocks[b].ffn[0].weight
    assert st.arena.contains(w) and isinstance(w, torch.nn.Parameter) and not w.requires_grad
    st.begin_forward()
    st.before_block(b)
    inside = model.blocks[b].ffn[0].weight
    assert not st.arena.contains(inside)
    assert any(inside.data_ptr() >= s.flat.data_ptr() and inside.data_ptr() < s.flat.data_ptr() + s.flat.numel()
               for s in st.slots)
    st.after_block(b)
    assert st.arena.contains(model.blocks[b].ffn[0].weight)
    # resident blocks are never touched
    assert not st.arena.contains(model.blocks[0].ffn[0].weight)
    st.end_forward()
    # the arena replaced the original (anonymous) tensors: no second copy of streamed blocks in RAM
    assert st.streamed_bytes == st.arena.buffer.numel()


def test_self_healing_after_an_interrupt_and_out_of_order_blocks():
    torch.manual_seed(0)
    model = TinyWan(n=8)
    x, e, ctx = _inputs()
    with torch.no_grad():
        ref = model(x, e, ctx)
        plan = plan_swap([offload.block_nbytes(b) for b in model.blocks], SwapConfig(blocks_to_swap=4, prefetch=1))
        st = BlockStreamer(model.blocks, plan, "cpu", pinned=False)
        st.activate()

        class Interrupt(Exception):
            pass

        boom = plan.streamed[1]
        orig_forward = model.blocks[boom].forward
        model.blocks[boom].forward = lambda *a, **k: (_ for _ in ()).throw(Interrupt())
        st.begin_forward()
        with pytest.raises(Interrupt):
            model(x, e, ctx, streamer=st)
        st.end_forward()
        model.blocks[boom].forward = orig_forward
        assert st.arena.contains(model.blocks[boom].ffn[0].weight)  # rebound to CPU despite the exception
        for order in (list(range(8)), list(range(8))[::-1], list(range(8))):
            st.begin_forward()
            out = model(x, e, ctx, streamer=st, order=order)
            st.end_forward()
            if order == list(range(8)):
                assert torch.equal(out, ref)
        assert len(st.slots) == plan.ring  # no allocation churn


def test_engine_event_order_with_a_recording_sync(monkeypatch):
    """Every copy into a slot waits on that slot's free event; every streamed block waits on its ready event."""
    log: list[tuple] = []

    class Ev:
        n = 0

        def __init__(self, timing=False):
            Ev.n += 1
            self.id = Ev.n

        def record(self, stream=None):
            log.append(("record", getattr(stream, "name", None), self.id))

        def elapsed_time(self, other):
            return 0.0

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_event(self, ev):
            log.append(("wait", self.name, ev.id))

        def __enter__(self):
            return self

        def __exit__(self, *a):
            pass

    class RecSync:
        cuda = False
        can_time = False

        def __init__(self, device, timing):
            self.copy_stream = Stream("copy")
            self._compute = Stream("compute")

        def event(self, timing=False):
            return Ev(timing)

        def compute_stream(self):
            return self._compute

        def copy_context(self):
            return self.copy_stream

    monkeypatch.setattr(offload, "_Sync", RecSync)
    model = TinyWan(n=6)
    plan = plan_swap([offload.block_nbytes(b) for b in model.blocks], SwapConfig(blocks_to_swap=3, prefetch=1))
    st = BlockStreamer(model.blocks, plan, "cpu", pinned=False)
    st.activate()
    x, e, ctx = _inputs()
    with torch.no_grad():
        for _ in range(2):
            st.begin_forward()
            model(x, e, ctx, streamer=st)
            st.end_forward()
    free_ids = {s.free.id for s in st.slots}
    ready_ids = {s.ready.id for s in st.slots}
    copy_waits = [ev for op, stream, ev in log if op == "wait" and stream == "copy"]
    compute_waits = [ev for op, stream, ev in log if op == "wait" and stream == "compute"]
    assert copy_waits and set(copy_waits) <= free_ids
    assert len(compute_waits) == 2 * len(plan.streamed) and set(compute_waits) <= ready_ids
    assert all(op != "wait" or stream in ("copy", "compute") for op, stream, _ in log)


@pytest.fixture(autouse=True)
def _no_spare_arenas():
    """Each test starts and ends with no arena memory on offer (a spare another test left would be taken)."""
    host_memory.release_spares()
    yield
    host_memory.release_spares()


def _mapped_wan(path: Path, seed: int) -> TinyWan:
    """A TinyWan whose weights are the mapped tensors of a safetensors file (as ComfyUI's loaders leave them)."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    model = TinyWan(n=4)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, path)
    model.load_state_dict(load_file(path), assign=True)
    if not host_memory.is_file_backed(model.blocks[1].ffn[0].weight):
        pytest.skip("safetensors did not return mmap-backed tensors on this platform")
    return model


def _forward(model: TinyWan, st: BlockStreamer | None) -> torch.Tensor:
    x, e, ctx = _inputs()
    with torch.no_grad():
        if st is None:
            return model(x, e, ctx)
        st.begin_forward()
        out = model(x, e, ctx, streamer=st)
        st.end_forward()
        return out


def test_is_file_backed_finds_the_range_around_a_pointer() -> None:
    """A lookup among the sorted ranges of /proc/self/maps (a ComfyUI process has over a thousand): the start of a
    range is inside it, its end is not, and a pointer between ranges or before the first is in none."""
    t = torch.empty(16, dtype=torch.uint8)
    p = t.data_ptr()
    assert host_memory.is_file_backed(t, [(p - 64, p - 32), (p, p + 16), (p + 32, p + 64)])
    assert host_memory.is_file_backed(t, [(p - 8, p + 1)])
    assert not host_memory.is_file_backed(t, [(p - 64, p), (p + 1, p + 64)])  # ends at p, starts after p
    assert not host_memory.is_file_backed(t, [(p + 1, p + 2)])
    assert not host_memory.is_file_backed(t, [])
    ranges = host_memory.file_backed_ranges()
    assert ranges == sorted(ranges)


def test_release_restores_file_backed_originals(tmp_path):
    """The idle expert costs no anonymous RAM when its weights came from a file mapping (two-expert RSS goal)."""
    model = _mapped_wan(tmp_path / "m.safetensors", 0)
    plan = plan_swap([offload.block_nbytes(b) for b in model.blocks], SwapConfig(blocks_to_swap=2))
    st = BlockStreamer(model.blocks, plan, "cpu", pinned=False)
    st.activate()
    assert st.arena is not None
    st.release()
    assert st.arena is None
    assert host_memory.is_file_backed(model.blocks[plan.streamed[0]].ffn[0].weight)
    st.activate()  # and comes back
    out = _forward(model, st)
    st.release()
    assert torch.equal(out, _forward(model, None))


class _PlusOne:
    """An engine ``RingFill`` that adds one to each streamed block's first ffn weight in its slot, once per block."""

    def __init__(self, blocks: list[int]) -> None:
        self.pending, self.calls = set(blocks), []

    def wants(self, b: int) -> bool:
        return b in self.pending

    def fill(self, b: int, views: dict[str, torch.Tensor]) -> list[str]:
        self.calls.append(b)
        views["ffn.0.weight"].add_(1)
        self.pending.discard(b)
        return ["ffn.0.weight"]


def test_a_ring_fill_runs_once_per_block_and_its_bytes_go_back_to_the_arena():
    """The first forward fills each streamed block in its slot before it runs; the engine copies the filled weight
    back into the arena, so later forwards (and a re-activation on the kept arena) run the filled bytes without
    filling again; resident blocks are never handed over."""
    torch.manual_seed(0)
    model = TinyWan(n=4)
    plan = plan_swap([offload.block_nbytes(b) for b in model.blocks], SwapConfig(blocks_to_swap=2))
    before = {b: model.blocks[b].ffn[0].weight.detach().clone() for b in range(4)}
    for b in plan.streamed:
        model.blocks[b].ffn[0].weight.data.add_(1)
    ref = _forward(model, None)
    for b in plan.streamed:
        model.blocks[b].ffn[0].weight.data.copy_(before[b])
    st = BlockStreamer(model.blocks, plan, "cpu", pinned=False)
    fill = _PlusOne(list(plan.streamed))
    st.activate(fill)
    assert torch.equal(_forward(model, st), ref) and fill.calls == list(plan.streamed)
    assert all(torch.equal(st.cpu_views(b)["ffn.0.weight"], before[b] + 1) for b in plan.streamed)
    assert torch.equal(_forward(model, st), ref) and fill.calls == list(plan.streamed)
    st.detach()
    st.activate()
    assert torch.equal(_forward(model, st), ref) and fill.calls == list(plan.streamed)
    assert all(torch.equal(model.blocks[b].ffn[0].weight, before[b]) for b in range(4) if b not in plan.streamed)
    st.release()


def test_an_expert_switch_copies_into_the_memory_the_idle_expert_dropped(tmp_path):
    """Two experts of one layout (Wan 2.2's two 14B models): the one going idle offers its arena's memory, the next
    arena of that size takes it (no new allocation, no pinning); each still computes with its own weights."""
    high, low = _mapped_wan(tmp_path / "high.safetensors", 1), _mapped_wan(tmp_path / "low.safetensors", 2)
    refs = [_forward(high, None), _forward(low, None)]
    assert not torch.equal(*refs)
    plan = plan_swap([offload.block_nbytes(b) for b in high.blocks], SwapConfig(blocks_to_swap=2))
    streamers = [BlockStreamer(m.blocks, plan, "cpu", pinned=False) for m in (high, low)]
    for render in range(2):
        for (model, st), ref in zip(zip((high, low), streamers), refs):
            st.activate()
            assert st.took["reused"] == (render > 0 or st is streamers[1])
            assert torch.equal(_forward(model, st), ref)
            memory = st.arena.buffer.data_ptr()
            st.release()
            assert st.arena is None and st.spare.arena.buffer.data_ptr() == memory  # offered, not freed
    assert streamers[1].spare.arena is not None and streamers[0].spare.arena is None  # one memory between them
    other = BlockStreamer(high.blocks, plan_swap([offload.block_nbytes(b) for b in high.blocks],
                                                 SwapConfig(blocks_to_swap=1)), "cpu", pinned=False)
    other.activate()  # another size: the offered memory is freed before a new arena is allocated, never beside it
    assert not other.took["reused"] and streamers[1].spare.arena is None
    assert torch.equal(_forward(high, other), refs[0])
    other.release()
    assert host_memory.take_spare(streamers[0].streamed_bytes, torch.device("cpu")) is None  # freed: gone
    host_memory.release_spares()  # what the end of a load does with what no arena took
    assert other.spare.arena is None and host_memory.take_spare(other.streamed_bytes, torch.device("cpu")) is None


def test_two_offered_memories_each_go_back_to_their_own_model(tmp_path):
    """Both experts dropped their arenas (both had been active): each takes its own back, neither keeps two."""
    models = [_mapped_wan(tmp_path / f"{i}.safetensors", i) for i in range(2)]
    plan = plan_swap([offload.block_nbytes(b) for b in models[0].blocks], SwapConfig(blocks_to_swap=2))
    streamers = [BlockStreamer(m.blocks, plan, "cpu", pinned=False) for m in models]
    for st in streamers:
        st.activate()
    memories = [st.arena.buffer.data_ptr() for st in streamers]
    for st in streamers:
        st.release()
    for st, memory in zip(streamers, memories):
        st.activate()
        assert st.took["reused"] and st.arena.buffer.data_ptr() == memory and st.spare is None
        st.release()


def test_offered_pinned_memory_stays_pinned_until_released(monkeypatch):
    """A taker gets the registration too (no cudaHostRegister of its own); release() unregisters what nobody took."""
    from fake_cudart import FakeCudart

    cudart = FakeCudart.install(monkeypatch)
    arena = host_memory.HostArena(4096, pin=True)
    assert arena.pinned and [c[0] for c in cudart.calls] == ["register"]
    spare = host_memory.SpareArena(arena, torch.device("cuda", 0))
    assert host_memory.take_spare(4096, torch.device("cuda", 1)) is None  # pinned for another device's streamer
    host_memory.release_spares(torch.device("cuda", 1))
    assert spare.arena is arena  # another device's release leaves it
    assert host_memory.take_spare(2048, torch.device("cuda", 0)) is None
    taken = host_memory.take_spare(4096, torch.device("cuda"))  # torch's name for the same device
    assert taken is arena and taken.pinned and spare.arena is None and [c[0] for c in cudart.calls] == ["register"]
    host_memory.SpareArena(taken, torch.device("cuda", 0)).release()
    assert [c[0] for c in cudart.calls] == ["register", "unregister"] and not cudart.registered
    assert host_memory.take_spare(4096, torch.device("cuda", 0)) is None


def test_mostly_file_backed_blocks_leave_the_arena_when_idle(tmp_path):
    """Weights mapped from the file, small tensors (biases, norms) private: idle = weights back on the file."""
    from safetensors.torch import save_file

    from comfyui_lowvram_dit.checkpoints.safetensors_io import map_tensors, read_header

    model = TinyWan(n=4, d=64, ffn=128)
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(sd, tmp_path / "m.safetensors")
    mapped = dict(map_tensors(read_header(tmp_path / "m.safetensors")))
    assert all(torch.equal(mapped[k], v) for k, v in sd.items())
    weights = {k: v for k, v in mapped.items() if k.endswith("weight") and v.dim() == 2}
    private = {k: v.clone() for k, v in mapped.items() if k not in weights}  # as ComfyUI copies biases/norms
    model.load_state_dict({**weights, **private}, assign=True)
    w = model.blocks[1].ffn[0].weight
    assert host_memory.is_file_backed(w) and not host_memory.is_file_backed(model.blocks[1].ffn[0].bias)
    plan = plan_swap([offload.block_nbytes(b) for b in model.blocks], SwapConfig(blocks_to_swap=2))
    st = BlockStreamer(model.blocks, plan, "cpu", pinned=False)
    x, e, ctx = _inputs(d=64)
    with torch.no_grad():
        ref = model(x, e, ctx)
    st.activate()
    b = plan.streamed[0]
    assert st.arena is not None and st.arena.contains(model.blocks[b].ffn[0].weight)
    assert host_memory.page_out([model.blocks[b].ffn[0].weight]) >= 0  # never raises, data stays valid
    st.detach()
    assert st.arena is not None  # a detach before a re-load keeps the arena
    st.release()
    assert st.arena is None
    assert host_memory.is_file_backed(model.blocks[b].ffn[0].weight)
    assert not host_memory.is_file_backed(model.blocks[b].ffn[0].bias)
    for _ in range(2):  # comes back, twice
        st.activate()
        with torch.no_grad():
            st.begin_forward()
            out = model(x, e, ctx, streamer=st)
            st.end_forward()
        st.release()
        assert torch.equal(out, ref)
    assert st.arena is None and host_memory.is_file_backed(model.blocks[b].ffn[0].weight)


def test_a_mostly_private_model_keeps_its_arena():
    model = TinyWan(n=4)
    plan = plan_swap([offload.block_nbytes(b) for b in model.blocks], SwapConfig(blocks_to_swap=2))
    st = BlockStreamer(model.blocks, plan, "cpu", pinned=False)
    st.activate()
    st.release()
    assert st.arena is not None  # nothing to fall back to: the arena is the only copy


TORCH_OOM = ("CUDA out of memory. Tried to allocate 1.95 GiB. GPU 0 has a total capacity of 139.80 GiB of which "
             "1.20 GiB is free. Including non-PyTorch memory, this process has 7.61 GiB memory in use.")


def test_parse_oom_reads_torch_numbers():
    assert swap_plan.parse_oom(TORCH_OOM) == (int(1.95 * 2**30), int(1.20 * 2**30))
    assert swap_plan.parse_oom("CUDA out of memory") == (None, None)


def test_oom_advice_names_blocks_that_would_fit():
    blocks = [int(0.35e9)] * 40
    cfg = SwapConfig(vram_budget_gb=8.0)
    plan = plan_swap(blocks, SwapConfig(blocks_to_swap=30))
    msg = swap_plan.oom_advice(plan, blocks, cfg, TORCH_OOM, fixed_bytes=int(0.2e9))
    # shortfall 0.75 GiB + 256 MiB margin = ~1.07 GB -> 4 more blocks of 0.35 GB
    assert "30 of 40 blocks streamed" in msg and "blocks_to_swap=34" in msg and "vram_budget_gb=6.9" in msg
    assert "1.95 GiB with 1.20 GiB free" in msg
    unknown = swap_plan.oom_advice(plan, blocks, cfg, "CUDA out of memory")
    assert "blocks_to_swap=33" in unknown


def test_oom_advice_when_every_block_streams():
    blocks = [int(0.35e9)] * 40
    plan = plan_swap(blocks, SwapConfig(blocks_to_swap=40, prefetch=3))
    msg = swap_plan.oom_advice(plan, blocks, SwapConfig(blocks_to_swap=40, prefetch=3), TORCH_OOM, embed_bytes=int(0.3e9))
    assert "Every block already streams" in msg and "prefetch=1" in msg and "offload_embeddings on" in msg
    assert "resolution" in msg


def test_a_pinned_arena_is_unregistered_when_its_streamer_is_dropped(monkeypatch):
    """ComfyUI drops a patcher without unloading it (ModelPatcher.__del__ only detaches, and our detach keeps the
    arena pinned for the next run): the registration must go with the buffer, or the next allocation at that
    address fails its H2D copy ("CUDA error: invalid argument", seen in the GPU leak test's second prompt)."""
    import gc

    from fake_cudart import FakeCudart

    cudart = FakeCudart.install(monkeypatch)
    model = TinyWan(n=4)
    plan = plan_swap([offload.block_nbytes(b) for b in model.blocks], SwapConfig(blocks_to_swap=2))
    st = BlockStreamer(model.blocks, plan, "cpu", pinned=True)
    st.activate()
    assert st.arena.pin() and list(cudart.registered) == [st.arena.buffer.data_ptr()]
    st.detach()  # what detach(unpatch_all=False) does: keep the arena pinned for a re-load
    assert cudart.registered
    del st
    gc.collect()
    assert cudart.registered == {}, "a pinned arena was freed while registered"
    del model


def test_rebuilding_the_arena_unregisters_the_old_one(monkeypatch):
    from fake_cudart import FakeCudart

    cudart = FakeCudart.install(monkeypatch)
    model = TinyWan(n=4)
    plan = plan_swap([offload.block_nbytes(b) for b in model.blocks], SwapConfig(blocks_to_swap=2))
    st = BlockStreamer(model.blocks, plan, "cpu", pinned=True)
    st.activate()
    st.arena.pin()
    old_arena = st.arena  # held here, so only the rebuild itself can unregister it (not its __del__)
    old = old_arena.buffer.data_ptr()
    st.detach()
    b = plan.streamed[0]
    w = model.blocks[b].ffn[0].weight  # someone (ComfyUI, a LoRA merge) rebinds a streamed weight
    model.blocks[b].ffn[0].weight = torch.nn.Parameter(w.detach().clone(), requires_grad=False)
    st.activate()  # the arena is stale: rebuilt
    assert st.arena is not old_arena
    assert not old_arena.pinned and old not in cudart.registered
    st.release()


def test_unpin_waits_for_the_last_copy_and_keeps_a_buffer_it_cannot_unregister(monkeypatch):
    from fake_cudart import FakeCudart

    cudart = FakeCudart.install(monkeypatch)
    monkeypatch.setattr(host_memory, "discard_cuda_error", lambda: None)
    order = []

    class Event:
        def synchronize(self) -> None:
            order.append("sync")

    arena = host_memory.HostArena(1 << 16, pin=True)
    arena.last_copy = Event()
    real = cudart.cudaHostUnregister
    monkeypatch.setattr(cudart, "cudaHostUnregister", lambda ptr: order.append("unregister") or real(ptr))
    arena.unpin()
    assert order == ["sync", "unregister"] and cudart.registered == {}

    failing = host_memory.HostArena(1 << 16, pin=True)
    monkeypatch.setattr(cudart, "cudaHostUnregister", lambda ptr: 1)  # cudaErrorInvalidValue
    failing.unpin()
    assert not failing.pinned and any(t is failing.buffer for t in host_memory._UNFREED)
    host_memory._UNFREED.clear()



def _resident_fraction(path: Path) -> float:
    """Share of ``path``'s bytes in the page cache."""
    from comfyui_lowvram_dit.benchmarks import page_cache

    return page_cache.resident_bytes(path) / path.stat().st_size


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise / mincore: Linux only")
def test_page_out_leaves_the_page_cache_warm(tmp_path: Path) -> None:
    """After the arena copy the file pages leave this process's RSS but stay cached for the next load."""
    from safetensors.torch import save_file

    from comfyui_lowvram_dit.checkpoints.safetensors_io import map_tensors, read_header

    path = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(1024, 1024)}, str(path))  # 4 MiB
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)  # clean pages: MADV_PAGEOUT could drop them (dirty ones it would keep, hiding the difference)
    os.close(fd)
    w = dict(map_tensors(read_header(path)))["w"]
    total = float(w.sum())  # touch every page: they are in the page cache and this process's RSS
    assert _resident_fraction(path) > 0.99
    assert host_memory.page_out([w]) > 0
    assert _resident_fraction(path) > 0.99  # MADV_PAGEOUT would have evicted them: the next load reads the disk
    assert float(w.sum()) == total  # re-faulted from the cache, same bytes
