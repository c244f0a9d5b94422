"""kernels/block_graphs.py on the CPU: when a block is captured, replayed, captured again or left eager.

A stand-in for the CUDA calls (``FakeCuda``) records a capture as its Python body, without running it (a capture
computes nothing), and replays it by running that body, so the static buffers, the layouts, the pointer checks and the decisions gate are exercised as on a
GPU (tests/comfyui/test_block_graphs_cuda.py runs the real graphs).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import pytest
import torch

from comfyui_lowvram_dit.kernels import decisions
from comfyui_lowvram_dit.kernels.block_graphs import BlockGraphs, CudaApi, layout
from comfyui_lowvram_dit.kernels.hooks import HookRegistry


class FakeStream:
    def wait_stream(self, other: Any) -> None:
        pass


class FakeGraph:
    def __init__(self) -> None:
        self.body = None
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.body()


class FakeCuda(CudaApi):
    def __init__(self, fail: BaseException | None = None) -> None:
        self.fail = fail
        self.recorded: list[FakeGraph] = []

    def usable(self, x: torch.Tensor) -> bool:
        return True

    def new_stream(self, device: torch.device) -> FakeStream:
        return FakeStream()

    def new_pool(self) -> int:
        self.pools = getattr(self, "pools", 0) + 1
        return self.pools

    def current_stream(self, device: torch.device) -> FakeStream:
        return FakeStream()

    def on_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def new_graph(self) -> FakeGraph:
        return FakeGraph()

    def free_graph_memory(self, device: torch.device) -> None:
        self.freed = [*getattr(self, "freed", []), device]

    def record(self, graph: FakeGraph, pool: Any, body: Any) -> None:
        """As a capture: nothing runs now (a capture enqueues nothing); a replay runs the body."""
        if self.fail is not None:
            raise self.fail
        graph.body = body
        self.recorded.append(graph)


class Block(torch.nn.Module):
    def __init__(self, d: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(d, d)
        self.calls = 0  # Python runs of forward: eager calls and captures (replays run the recorded body)

    def forward(self, args: dict) -> dict:
        self.calls += 1
        return {"img": torch.tanh(self.lin(args["img"]) + args["vec"])}


class Model(torch.nn.Module):
    def __init__(self, n: int = 3, d: int = 8) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d, i) for i in range(n))


def _forward(registry: HookRegistry, model: Model, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
    def run() -> torch.Tensor:
        img = x
        for i, block in enumerate(model.blocks):
            img = registry.run_block(i, {"img": img, "vec": vec, "transformer_options": {}}, block)["img"]
        return img.clone()

    return registry.run_forward(model, run, ((x,), {}))


def _setup(fail: BaseException | None = None, aside: Any = None) -> tuple[HookRegistry, BlockGraphs, FakeCuda]:
    cuda = FakeCuda(fail)
    hook = BlockGraphs(aside, cuda)
    registry = HookRegistry()
    registry.register("graphs", hook)
    return registry, hook, cuda


def _inputs(rows: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=g), torch.randn(1, 8, generator=g)


@torch.no_grad()
def test_eager_then_warm_up_then_capture_then_replay_give_the_eager_output() -> None:
    registry, hook, cuda = _setup()
    model = Model()
    plain = HookRegistry()
    outs = []
    for seed in range(5):
        x, vec = _inputs(seed=seed)
        outs.append((_forward(registry, model, x, vec), _forward(plain, model, x, vec)))
    for graphed, eager in outs:
        torch.testing.assert_close(graphed, eager, rtol=0, atol=0)
    # call 1 eager; call 2: block 0 warms the capture stream, blocks 1-2 captured; call 3: block 0 captured
    assert hook.stats() == {"captured": 3, "replays": 2 + 3 + 3 + 3, "failed": 0}
    assert len(cuda.recorded) == 3


@torch.no_grad()
def test_a_call_that_made_a_decision_is_not_followed_by_a_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    registry, hook, _ = _setup()
    model = Model(n=1)
    count = iter(range(100))
    monkeypatch.setattr(decisions, "made", lambda: next(count))  # every call decides something
    for seed in range(3):
        _forward(registry, model, *_inputs(seed=seed))
    assert hook.stats()["captured"] == 0
    monkeypatch.setattr(decisions, "made", lambda: 0)  # decisions settled
    for seed in range(4):
        _forward(registry, model, *_inputs(seed=seed))
    assert hook.stats()["captured"] == 1


@torch.no_grad()
def test_a_weight_bound_elsewhere_is_captured_again_and_used() -> None:
    registry, hook, _ = _setup()
    model = Model(n=2)
    for seed in range(4):
        _forward(registry, model, *_inputs(seed=seed))
    assert hook.stats()["captured"] == 2
    model.blocks[1].lin.weight = torch.nn.Parameter(torch.full((8, 8), 0.01))  # what unpatching a LoRA does
    x, vec = _inputs(seed=9)
    for _ in range(3):  # eager once (new pointers), then captured, then replayed
        out = _forward(registry, model, x, vec)
        torch.testing.assert_close(out, _forward(HookRegistry(), model, x, vec), rtol=0, atol=0)
    assert hook.stats()["captured"] == 3


@torch.no_grad()
def test_when_every_graph_is_gone_later_captures_use_a_new_pool() -> None:
    """torch's native allocator releases a capture pool that no graph uses; capturing into its id again fails."""
    registry, hook, cuda = _setup()
    model = Model(n=2)
    for seed in range(4):
        _forward(registry, model, *_inputs(seed=seed))
    state = next(iter(hook._devices.values()))
    first_pool = state.pool
    model.blocks[0].lin.weight = torch.nn.Parameter(model.blocks[0].lin.weight.clone())
    _forward(registry, model, *_inputs())
    assert state.pool == first_pool  # block 1's graph still uses it
    model.blocks[1].lin.weight = torch.nn.Parameter(model.blocks[1].lin.weight.clone())
    _forward(registry, model, *_inputs())  # block 0 captured again (a graph exists) before block 1's goes
    assert state.pool == first_pool
    for block in model.blocks:  # a LoRA loaded on a new patcher: every weight re-bound
        block.lin.weight = torch.nn.Parameter(block.lin.weight.clone())
    _forward(registry, model, *_inputs())
    assert state.pool != first_pool and cuda.pools == 2
    for _ in range(2):
        _forward(registry, model, *_inputs())
    assert hook.stats()["failed"] == 0 and hook.stats()["captured"] == 5


@torch.no_grad()
def test_graphs_given_back_leave_the_model_eager_until_its_weights_leave(caplog: pytest.LogCaptureFixture) -> None:
    """The host takes the graphs' memory back (a decode beside the loaded weights): captured again, they would be
    given back after every render, so the model runs eagerly until ``drop`` (its weights left the GPU)."""
    registry, hook, cuda = _setup()
    model = Model(n=2)
    for seed in range(4):
        _forward(registry, model, *_inputs(seed=seed))
    assert hook.stats()["captured"] == 2
    assert not hook.give_back(torch.device("cuda", 0)) and hook._devices  # another device's memory: kept
    assert hook.give_back(torch.device("cpu")) and not hook._devices
    assert cuda.freed == [torch.device("cpu")]  # the graphs' memory handed back to the device, not kept for graphs
    assert not hook.give_back(torch.device("cpu"))  # nothing held any more
    calls = [b.calls for b in model.blocks]
    x, vec = _inputs(seed=7)
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        for _ in range(4):
            torch.testing.assert_close(_forward(registry, model, x, vec), _forward(HookRegistry(), model, x, vec),
                                       rtol=0, atol=0)
    assert hook.stats()["captured"] == 0 and len(cuda.recorded) == 2 and not hook._devices
    assert [b.calls - c for b, c in zip(model.blocks, calls)] == [8, 8]  # every call ran each block in Python
    assert sum("memory its graphs held was needed" in r.getMessage() for r in caplog.records) == 1
    hook.drop()  # unloaded and loaded again: captured as on a first load
    for seed in range(4):
        _forward(registry, model, *_inputs(seed=seed))
    assert hook.stats()["captured"] == 2


@torch.no_grad()
def test_each_layout_has_its_graphs_and_shares_buffers_across_blocks() -> None:
    registry, hook, _ = _setup()
    model = Model(n=3)
    for rows in (4, 6, 4, 6, 4, 6, 4, 6):
        _forward(registry, model, *_inputs(rows=rows))
    state = next(iter(hook._devices.values()))
    assert hook.stats()["captured"] == 6
    assert len(state.layouts) == 2  # one set of static inputs / outputs per layout, whatever the block count


@torch.no_grad()
def test_a_failed_capture_leaves_that_block_eager_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    registry, hook, _ = _setup(fail=RuntimeError("operation not permitted when stream is capturing"))
    model = Model(n=2)
    x, vec = _inputs()
    with caplog.at_level(logging.WARNING, logger="comfyui_lowvram_dit"):
        for _ in range(5):
            torch.testing.assert_close(_forward(registry, model, x, vec), _forward(HookRegistry(), model, x, vec),
                                       rtol=0, atol=0)
    assert hook.stats() == {"captured": 0, "replays": 0, "failed": 2}
    assert sum("its capture failed" in r.message for r in caplog.records) == 2  # once per block


@torch.no_grad()
def test_an_interrupt_during_a_capture_propagates() -> None:
    class Interrupted(Exception):
        pass

    registry, hook, _ = _setup(fail=Interrupted())
    model = Model(n=1)
    _forward(registry, model, *_inputs())
    _forward(registry, model, *_inputs())  # the capture stream's warm-up
    with pytest.raises(Interrupted):
        _forward(registry, model, *_inputs())
    assert hook.stats()["failed"] == 0


@torch.no_grad()
def test_standing_aside_runs_every_block_eagerly_and_says_why_once(caplog: pytest.LogCaptureFixture) -> None:
    registry, hook, cuda = _setup(aside=lambda module, registry, inputs: "a ControlNet is attached")
    model = Model(n=2)
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        for seed in range(4):
            _forward(registry, model, *_inputs(seed=seed))
    assert hook.stats() == {"captured": 0, "replays": 0, "failed": 0} and not cuda.recorded
    assert sum("a ControlNet is attached" in r.message for r in caplog.records) == 1


@torch.no_grad()
def test_layers_with_per_call_weights_run_eagerly() -> None:
    registry, hook, _ = _setup()
    model = Model(n=2)
    model.blocks[0].lin.weight_function = [lambda w: w * 2]  # a lowvram LoRA patch, as ComfyUI sets it
    model.blocks[1].lin.weight_function = []
    for seed in range(4):
        _forward(registry, model, *_inputs(seed=seed))
    assert hook.stats()["captured"] == 1  # block 1 only


@torch.no_grad()
def test_a_replay_returns_a_new_container_of_the_static_outputs() -> None:
    registry, hook, _ = _setup()
    model = Model(n=1)
    seen = []

    def run(x: torch.Tensor, vec: torch.Tensor) -> Any:
        return registry.run_forward(model, lambda: registry.run_block(
            0, {"img": x, "vec": vec, "transformer_options": {}}, model.blocks[0]), ((x,), {}))

    for seed in range(4):
        out = run(*_inputs(seed=seed))
        seen.append(out)
        out["img"] = None  # the caller may replace entries; the next replay still has its buffers
    assert hook.stats()["replays"] == 2 and seen[-1] is not seen[-2]


def test_layout_names_tensors_and_plain_values_and_refuses_other_kinds() -> None:
    t = torch.zeros(2, 3)
    assert layout({"img": t, "n": 3, "transformer_options": {"x": [1]}}) == (
        ("img", ((2, 3), torch.float32, t.device, (3, 1))), ("n", 3))
    assert layout({"img": t, "extra": [t]}) is None
    assert layout([t]) is None


def test_static_buffers_follow_the_structure_and_the_structure_check_names_every_difference() -> None:
    from comfyui_lowvram_dit.kernels.block_graphs import _copy_into, _empty_like, _same_structure

    value = {"img": torch.randn(2, 3).t(), "pair": (torch.ones(2), 7)}
    static = _empty_like(value)
    assert static["img"].stride() == value["img"].stride() and static["pair"][1] == 7
    assert _empty_like(value, "meta")["img"].device.type == "meta"
    _copy_into(static, value)
    assert torch.equal(static["img"], value["img"]) and torch.equal(static["pair"][0], value["pair"][0])
    assert _same_structure(static, value)
    assert not _same_structure(static, {"img": value["img"], "pair": (torch.ones(3), 7)})  # a shape
    assert not _same_structure(static, {"img": value["img"].contiguous(), "pair": value["pair"]})  # strides
    assert not _same_structure(static, {"img": value["img"], "other": value["pair"]})  # a key
    assert not _same_structure(static, {"img": value["img"], "pair": [torch.ones(2), 7]})  # a container type
    assert not _same_structure(static, {"img": value["img"], "pair": (torch.ones(2), 8)})  # a plain value
    assert not _same_structure(static, {"img": value["img"], "pair": (torch.ones(2), torch.ones(1))})  # a kind
