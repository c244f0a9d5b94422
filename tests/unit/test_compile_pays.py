"""Torch Compile only where it pays: the decision from planted call timings, its log, and its kept verdict."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import pytest
import torch
from torch import nn

from comfyui_lowvram_dit.kernels import compile as cmp
from comfyui_lowvram_dit.kernels import compile_pays as cp
from comfyui_lowvram_dit.kernels import decision_store
from comfyui_lowvram_dit.kernels.compile import CompileConfig, CompiledRegions
from comfyui_lowvram_dit.kernels.compile_pays import call_device

KIND = ("cuda", "NVIDIA H200", 9, 0)
SIG = (((1, 16, 1, 166, 166), torch.bfloat16, "cuda"),)


class PlantedTimer:
    """A CallTimer whose milliseconds are planted; ``done`` says whether the GPU has passed the call yet."""

    def __init__(self, ms: float) -> None:
        self.planted, self.done, self.started, self.stopped, self.waited = ms, True, 0, 0, 0
        self.failed = False

    def start(self) -> None:
        self.started += 1

    def stop(self) -> None:
        self.stopped += 1

    def wait(self) -> None:
        self.waited += 1
        self.done = True  # the GPU has caught up

    def ms(self) -> Optional[float]:
        return self.planted if self.done else None


def planted(eager_ms: float, compiled_ms: float) -> tuple[cp.CompilePays, list[PlantedTimer]]:
    made: list[PlantedTimer] = []

    def timer(device: Optional[torch.device]) -> PlantedTimer:
        made.append(PlantedTimer(compiled_ms if not made else eager_ms))  # timed in this order
        return made[-1]

    return cp.CompilePays(timer=timer), made


def key(config: str = "inductor/default") -> tuple:
    return ("QwenImage", SIG, KIND, config)


def plans(pays: cp.CompilePays, calls: int, k: tuple = key()) -> list[tuple[str, bool]]:
    return [(how, timer is not None) for how, timer in (pays.plan(k) for _ in range(calls))]


@pytest.fixture(autouse=True)
def _no_store() -> None:
    decision_store.keep_in(None)
    yield
    decision_store.keep_in(None)


def test_compile_that_does_not_pay_leaves_the_model_eager(caplog: pytest.LogCaptureFixture) -> None:
    """Two eager warm-ups, compiled (compiles), compiled (CUDA graphs record), compiled timed, eager timed; then a
    compiled call only 3 % faster: eager."""
    pays, _ = planted(eager_ms=320.0, compiled_ms=310.0)
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        got = plans(pays, 8)
    assert got == [("eager", False), ("eager", False), ("compiled", False), ("compiled", False), ("compiled", True),
                   ("eager", True), ("eager", False), ("eager", False)]
    assert pays.winners == {key(): "eager"}
    line = next(r.getMessage() for r in caplog.records if "compiled call" in r.getMessage())
    assert "QwenImage (1x16x1x166x166) on cuda NVIDIA H200 (SM 9.0), inductor/default" in line
    assert "compiled call 310.0 ms, eager 320.0 ms: compiling does not pay here" in line


def test_compile_that_pays_stays_compiled() -> None:
    pays, _ = planted(eager_ms=210.0, compiled_ms=113.0)
    assert plans(pays, 8)[6:] == [("compiled", False), ("compiled", False)]
    assert pays.winners == {key(): "compiled"}


def test_the_decision_waits_for_the_gpu_and_never_syncs() -> None:
    """Until the timed calls' events have completed, calls go on compiled and nothing is decided."""
    pays, made = planted(eager_ms=300.0, compiled_ms=100.0)
    plans(pays, 6)
    made[1].done = False
    assert plans(pays, 3) == [("compiled", False)] * 3 and pays.winners == {}
    made[1].done = True
    assert plans(pays, 1) == [("compiled", False)] and pays.winners == {key(): "compiled"}


def test_a_timed_call_waits_until_its_model_is_warm_that_way() -> None:
    """A model's first compiled (or eager) call is not timed: it runs untimed and the schedule waits for the next."""
    pays, made = planted(eager_ms=300.0, compiled_ms=100.0)
    both, eager_only, none = frozenset(("eager", "compiled")), frozenset(("eager",)), frozenset()
    got = [pays.plan(key(), warm=both)[0] for _ in range(4)]
    assert got == ["eager", "eager", "compiled", "compiled"] and made == []
    assert pays.plan(key(), warm=eager_only) == ("compiled", None)  # traces this model's blocks: not timed
    how, timer = pays.plan(key(), warm=both)
    assert how == "compiled" and timer is made[0]
    assert pays.plan(key(), warm=none) == ("eager", None)
    how, timer = pays.plan(key(), warm=eager_only)
    assert how == "eager" and timer is made[1] and len(made) == 2


def test_regions_time_only_calls_of_an_expert_that_ran_that_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wan 2.2's two experts share one key (same class, same inputs), and a 4-step render calls each twice. The timed
    compiled call is not an expert's first compiled call (that one traces its blocks), nor the timed eager call an
    expert's first eager one: with the warm-up rule the timing lands in the second render, on warm calls."""
    monkeypatch.setattr(cmp, "device_kind", lambda device: KIND)
    pays, _ = planted(eager_ms=100.0, compiled_ms=100.0)
    plan, calls = pays.plan, []

    def recording_plan(k: tuple, device: Optional[torch.device] = None, warm: frozenset = frozenset()) -> tuple:
        how, timer = plan(k, device, warm)
        calls.append((expert, how, timer is not None, how in warm))
        return how, timer

    monkeypatch.setattr(pays, "plan", recording_plan)
    regions = CompiledRegions(CompileConfig(), ["blocks.0"], pays=pays, compile_fn=lambda module, **kw: module)
    experts, x, gpu = {"high": Blocks(), "low": Blocks()}, torch.randn(2, 8), torch.device("cuda", 0)
    for expert in ("high", "high", "low", "low") * 2 + ("high",):  # two renders, then the third one's first step
        regions.run(experts[expert], lambda: experts[expert](x), signature=SIG, device=gpu)
    timed = [(e, how) for e, how, is_timed, _ in calls if is_timed]
    assert timed == [("high", "compiled"), ("low", "eager")], calls
    assert all(was_warm for *_, is_timed, was_warm in calls if is_timed)
    assert calls[4] == ("high", "compiled", False, False)  # the high expert's first compiled call: untimed
    assert pays.winners == {("Blocks", SIG, KIND, "inductor/default"): "eager"} and calls[-1][1] == "eager"


def test_a_finished_timing_is_decided_when_sampling_ends(tmp_path: Path) -> None:
    """``settle`` (at the end of a sampling run) decides a key whose two timed calls have run, waiting for the GPU to
    pass them, and keeps the verdict for the next process; a key with one timed call so far stays undecided."""
    decision_store.keep_in(tmp_path / "decisions.json")
    pays, made = planted(eager_ms=320.0, compiled_ms=100.0)
    plans(pays, 5)  # up to the timed compiled call
    pays.settle()
    assert pays.winners == {} and [t.waited for t in made] == [0]
    plans(pays, 1)  # the timed eager call
    made[1].done = False  # the GPU has not passed it yet
    pays.settle()
    assert pays.winners == {key(): "compiled"} and [t.waited for t in made] == [1, 1]
    assert decision_store.kept(cp.TOPIC, key()) == "compiled"
    pays.settle()  # nothing left to decide
    assert [t.waited for t in made] == [1, 1]


def test_a_timed_call_that_raised_is_timed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A timed call that raises (an OOM, an interrupt) never recorded its end: its timing is dropped and the schedule
    starts over, instead of failing the next call or the sampler's end on an unrecorded event."""
    monkeypatch.setattr(cmp, "device_kind", lambda device: KIND)
    pays, made = planted(eager_ms=100.0, compiled_ms=100.0)
    regions = CompiledRegions(CompileConfig(), ["blocks.0"], pays=pays, compile_fn=lambda module, **kw: module)
    model, x, gpu = Blocks(), torch.randn(2, 8), torch.device("cuda", 0)
    for _ in range(5):  # up to the timed compiled call
        regions.run(model, lambda: model(x), signature=SIG, device=gpu)

    def interrupted() -> torch.Tensor:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        regions.run(model, interrupted, signature=SIG, device=gpu)  # the timed eager call
    assert made[1].failed and made[1].stopped == 0
    pays.settle()
    assert pays.winners == {} and made[1].waited == 0
    for _ in range(6):  # the schedule again from its start: two eager, three compiled, then the timed pair
        regions.run(model, lambda: model(x), signature=SIG, device=gpu)
    pays.settle()
    assert len(made) == 4 and pays.winners == {("Blocks", SIG, KIND, "inductor/default"): "eager"}


def test_two_expert_renders_keep_the_verdict_at_the_second_renders_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4-step Wan 2.2 render: each expert's sampler (two calls) ends with ``settle``. The verdict is reached when
    the second render's last sampler ends, without waiting for a third render's first call."""
    monkeypatch.setattr(cmp, "device_kind", lambda device: KIND)
    pays, _ = planted(eager_ms=100.0, compiled_ms=100.0)
    regions = CompiledRegions(CompileConfig(), ["blocks.0"], pays=pays, compile_fn=lambda module, **kw: module)
    experts, x, gpu = {"high": Blocks(), "low": Blocks()}, torch.randn(2, 8), torch.device("cuda", 0)
    verdicts = []
    for render in range(2):
        for expert in ("high", "low"):
            for _ in range(2):
                regions.run(experts[expert], lambda: experts[expert](x), signature=SIG, device=gpu)
            pays.settle()
            verdicts.append(dict(pays.winners))
    assert verdicts[:3] == [{}, {}, {}]
    assert verdicts[3] == {("Blocks", SIG, KIND, "inductor/default"): "eager"}


def test_keys_are_measured_apart() -> None:
    """Another resolution or config is its own model call: measured on its own."""
    pays, _ = planted(eager_ms=300.0, compiled_ms=299.0)
    plans(pays, 7)
    other = key("inductor/max-autotune-no-cudagraphs")
    assert plans(pays, 2, other) == [("eager", False), ("eager", False)]
    assert pays.winners == {key(): "eager"}


def test_a_verdict_is_kept_and_read_back_without_timing(tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    decision_store.keep_in(tmp_path / "decisions.json")
    pays, _ = planted(eager_ms=320.0, compiled_ms=330.0)
    plans(pays, 7)
    assert decision_store.kept(cp.TOPIC, key()) == "eager"
    fresh, made = planted(eager_ms=1.0, compiled_ms=1.0)  # a new process: nothing may be timed
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        assert plans(fresh, 3) == [("eager", False)] * 3
    assert made == [] and "compiling did not pay, runs eager without compiling (kept from an earlier run)" in caplog.text


def test_a_models_verdict_over_every_shape_timed(tmp_path: Path) -> None:
    """``model_verdict``: eager where every shape this or an earlier process timed for the model, GPU kind and
    config kept eager; compiled where any kept compile; none where none was timed."""
    decision_store.keep_in(tmp_path / "decisions.json")
    pays, _ = planted(eager_ms=300.0, compiled_ms=299.0)
    assert pays.model_verdict("QwenImage", KIND, "inductor/default") == (None, 0)
    plans(pays, 7)  # this process times one shape: eager
    other_sig = (((1, 16, 1, 128, 128), torch.bfloat16, "cuda"),)
    decision_store.keep(cp.TOPIC, ("QwenImage", other_sig, KIND, "inductor/default"), "eager")  # an earlier run
    decision_store.keep(cp.TOPIC, ("WAN21", SIG, KIND, "inductor/default"), "compiled")  # another model
    assert pays.model_verdict("QwenImage", KIND, "inductor/default") == ("eager", 2)
    assert pays.model_verdict("QwenImage", ("cuda", "NVIDIA H100", 9, 0), "inductor/default") == (None, 0)
    assert pays.model_verdict("QwenImage", KIND, "inductor/max-autotune") == (None, 0)
    decision_store.keep(cp.TOPIC, ("QwenImage", (((1, 16, 1, 64, 64), torch.bfloat16, "cuda"),), KIND,
                                   "inductor/default"), "compiled")
    assert pays.model_verdict("QwenImage", KIND, "inductor/default") == ("compiled", 3)


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def test_regions_run_eager_where_compiling_does_not_pay(monkeypatch: pytest.MonkeyPatch) -> None:
    """CompiledRegions asks ``pays`` per call on a GPU signature: eager calls never reach the compiler, the status
    says why; a CPU call (nothing to measure) always compiles."""
    monkeypatch.setattr(cmp, "device_kind", lambda device: KIND)
    compiled: list[str] = []

    def compile_fn(module: nn.Module, **kw: object) -> nn.Module:
        compiled.append(type(module).__name__)
        return module

    pays, made = planted(eager_ms=100.0, compiled_ms=100.0)
    regions = CompiledRegions(CompileConfig(), ["blocks.0", "blocks.1"], compile_fn=compile_fn, pays=pays)
    model, x = Blocks(), torch.randn(2, 8)
    want = model(x)
    gpu = torch.device("cuda", 0)  # as the call's tensors would say; nothing runs on it here
    for _ in range(2):
        assert torch.equal(regions.run(model, lambda: model(x), signature=SIG, device=gpu), want)
    assert compiled == [] and "eager (timing whether compiling pays)" in regions.status()
    for _ in range(5):
        regions.run(model, lambda: model(x), signature=SIG, device=gpu)
    assert compiled == ["Linear", "Linear"] and [(t.started, t.stopped) for t in made] == [(1, 1), (1, 1)]
    assert pays.winners == {("Blocks", SIG, KIND, "inductor/default"): "eager"}
    assert "eager (compiling did not pay)" in regions.status()
    cpu_sig = (((2, 8), torch.float32, "cpu"),)
    regions.run(model, lambda: model(x), signature=cpu_sig, device=call_device((x,), {}))
    assert "eager" not in regions.status() and len(compiled) == 2  # compiled modules are cached per root


def test_the_call_device_is_the_first_gpu_tensors() -> None:
    """Events are recorded on the GPU the call runs on (the second of two under MultiGPU), not the current one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.zeros(1)
    assert call_device((x, 1.0), {"t": x}) is None
    with FakeTensorMode():  # CUDA tensors in name only: no GPU needed
        on_1 = torch.empty(2, device="cuda:1")
    assert call_device((x, 0.5), {"context": on_1}) == torch.device("cuda", 1)
