"""Regional compile with fallback: chain, injected compile errors and OOMs, no recompiles, no `_orig_mod.`."""

from __future__ import annotations

import logging
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter

from comfyui_lowvram_dit.kernels import compile as cmp
from comfyui_lowvram_dit.kernels.compile import CompileConfig, CompiledRegions

DIM, HEADS, FFN = 64, 2, 128  # a Wan block at 1/80 width, same structure and key names



def mode_of(kw: dict) -> str:
    """The compile mode a ``torch.compile`` call stands for, also when spelled as inductor options (a guard
    filter or deterministic mode needs ``options``, which torch refuses next to ``mode``)."""
    if "mode" in kw or kw["backend"] != "inductor":
        return kw.get("mode") or kw["backend"]
    options = kw.get("options", {})
    if options.get("triton.cudagraphs"):
        return "reduce-overhead"
    return "max-autotune-no-cudagraphs" if options.get("max_autotune") else "default"

class TinyWanBlock(nn.Module):
    """WanAttentionBlock's layout (self_attn q/k/v/o, cross_attn, ffn.0/ffn.2, modulation) and call signature."""

    def __init__(self) -> None:
        super().__init__()
        self.modulation = nn.Parameter(torch.randn(1, 6, DIM) / DIM**0.5)
        self.norm1 = nn.LayerNorm(DIM, elementwise_affine=False)
        self.self_attn = nn.ModuleDict({n: nn.Linear(DIM, DIM) for n in ("q", "k", "v", "o")})
        self.ffn = nn.Sequential(nn.Linear(DIM, FFN), nn.GELU(approximate="tanh"), nn.Linear(FFN, DIM))

    def forward(self, x: torch.Tensor, e: torch.Tensor, transformer_options: dict = {}) -> torch.Tensor:  # noqa: B006
        # ComfyUI puts block_index (and sigmas, patches) in transformer_options; reading it makes dynamo guard it.
        scale = 1.0 if transformer_options.get("block_index", 0) >= 0 else 0.0
        m = (self.modulation + e).chunk(6, dim=1)  # e stays fp32, as Wan's timestep embedding does
        h = self.norm1(x) * (1 + m[1]) + m[0]
        b, n, _ = h.shape
        q, k, v = (self.self_attn[t](h).view(b, n, HEADS, -1).transpose(1, 2) for t in ("q", "k", "v"))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, DIM)
        x = x + self.self_attn["o"](a) * m[2] * scale
        return x + self.ffn(self.norm1(x) * (1 + m[4]) + m[3]) * m[5]


class TinyWan(nn.Module):
    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.patch_embedding = nn.Linear(16, DIM)
        self.blocks = nn.ModuleList(TinyWanBlock() for _ in range(blocks))
        self.head = nn.Linear(DIM, 16)

    def forward(self, x: torch.Tensor, t: torch.Tensor, transformer_options: dict | None = None) -> torch.Tensor:
        opts = dict(transformer_options or {})
        h = self.patch_embedding(x)
        e = t.float().view(-1, 1, 1).expand(-1, 6, DIM)
        for i, block in enumerate(self.blocks):
            opts["block_index"] = i
            h = block(h, e, transformer_options=opts)
        return self.head(h)


def _inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 24, 16, generator=g), torch.rand(2, generator=g)


class FakeCompiler:
    """A ``compile_fn`` that really runs dynamo but lets a test fail chosen modes at compile or first run."""

    def __init__(self, fail_compile: Callable[[str], BaseException | None] = lambda m: None,
                 fail_run: Callable[[str], BaseException | None] = lambda m: None) -> None:
        self.fail_compile, self.fail_run = fail_compile, fail_run
        self.modes: list[str] = []
        self.graphs = 0

    def __call__(self, module: nn.Module, **kw: Any) -> Any:
        mode = mode_of(kw)
        self.modes.append(mode)

        def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
            self.graphs += 1
            if (exc := self.fail_compile(mode)) is not None:
                raise exc
            if (exc := self.fail_run(mode)) is not None:
                def first_run(*args: Any) -> Any:
                    raise exc
                return first_run
            return gm.forward

        return torch.compile(module, backend=backend, fullgraph=kw["fullgraph"], dynamic=kw["dynamic"])


def _run(regions: CompiledRegions, model: TinyWan, *, streaming: bool = False) -> torch.Tensor:
    x, t = _inputs()
    return regions.run(model, lambda: model(x, t), streaming=streaming)


def _assert_clean(model: TinyWan) -> None:
    assert all(type(b) is TinyWanBlock for b in model.blocks), "a compiled wrapper was left in the model"
    assert not any("_orig_mod" in k for k in model.state_dict())


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


def test_fallback_chain_and_streaming_twins() -> None:
    ro = CompileConfig(mode="reduce-overhead")
    assert [c and c.mode for c in cmp.fallback_chain(ro)] == ["reduce-overhead", "default", None]
    ma = CompileConfig(mode="max-autotune")
    assert [c and c.mode for c in cmp.fallback_chain(ma)] == \
        ["max-autotune", "max-autotune-no-cudagraphs", "default", None]
    assert [c and c.describe() for c in cmp.fallback_chain(CompileConfig(backend="cudagraphs"))] == \
        ["cudagraphs", "inductor/default", None]
    assert cmp.fallback_chain(CompileConfig(fallback=False)) == [CompileConfig(fallback=False)]
    assert not cmp.without_cuda_graphs(ma).uses_cuda_graphs and ma.uses_cuda_graphs
    with pytest.raises(ValueError, match="mode"):
        CompileConfig(mode="fast")


def test_compile_kwargs_never_combine_mode_and_options() -> None:
    f = cmp.transformer_options_guard_filter
    kw = cmp.compile_kwargs(CompileConfig(mode="reduce-overhead"), f)
    assert "mode" not in kw and kw["options"]["triton.cudagraphs"] is True and kw["options"]["guard_filter_fn"] is f
    kw = cmp.compile_kwargs(CompileConfig(mode="max-autotune-no-cudagraphs"), f)
    assert kw["options"].get("max_autotune") and not kw["options"].get("triton.cudagraphs")
    assert cmp.compile_kwargs(CompileConfig(mode="max-autotune"), None)["mode"] == "max-autotune"


def test_failure_classification() -> None:
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    wrapped = RuntimeError("backend failed")
    wrapped.__cause__ = oom
    assert cmp.is_oom(oom) and cmp.is_oom(wrapped) and cmp.is_oom(RuntimeError("CUDA error: out of memory"))
    assert not cmp.is_oom(ValueError("shapes"))
    assert not cmp.is_compile_failure(ValueError("shapes"))


class ReplayingCompiler:
    """A ``compile_fn`` that behaves like CUDA-graph replay in one shared pool: each call of any compiled block
    recycles the previous call's output (here: fills it with NaN) before writing its own."""

    def __init__(self) -> None:
        self.last: torch.Tensor | None = None
        self.modes: list[str] = []

    def __call__(self, module: nn.Module, **kw: Any) -> nn.Module:
        self.modes.append(mode_of(kw))
        owner = self

        class Replay(nn.Module):
            def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
                if owner.last is not None:
                    owner.last.fill_(float("nan"))  # the next replay reuses the pool
                owner.last = module(*args, **kwargs)
                return owner.last

        return Replay()


def test_inductor_compiles_deterministically_unless_max_autotune() -> None:
    """Inductor's timed choice of reduction configs differs between GPUs: a MultiGPU split's second model copy
    rounded differently. Deterministic mode fixes the choice, where torch has it."""
    import torch._inductor.config as inductor_config

    known = hasattr(inductor_config, "deterministic")
    kw = cmp.compile_kwargs(CompileConfig())
    assert ("mode" not in kw and kw["options"]["deterministic"] is True) if known else kw["mode"] == "default"
    kw = cmp.compile_kwargs(CompileConfig(mode="reduce-overhead"), lambda entries: [True] * len(entries))
    assert kw["options"].get("deterministic") is (True if known else None) and kw["options"]["triton.cudagraphs"]
    assert "deterministic" not in cmp.compile_kwargs(CompileConfig(mode="max-autotune"), lambda e: e)["options"]
    assert cmp.compile_kwargs(CompileConfig(deterministic=False)) == {"backend": "inductor", "fullgraph": False,
                                                                       "dynamic": None, "mode": "default"}


def test_cuda_graph_modes_clone_block_outputs_before_the_next_replay() -> None:
    """The error seen on an H100 with reduce-overhead ('accessing tensor output of CUDAGraphs that has been
    overwritten by a subsequent run'): block i's output is block i+1's input and must survive its replay."""
    model = TinyWan(blocks=4)
    with torch.no_grad():
        eager = model(*_inputs())
        replay = ReplayingCompiler()
        regions = CompiledRegions(CompileConfig(mode="reduce-overhead"), cmp.find_block_lists(model), compile_fn=replay)
        torch.testing.assert_close(_run(regions, model), eager)
        torch.testing.assert_close(_run(regions, model), eager)
        assert regions.current == CompileConfig(mode="reduce-overhead") and set(replay.modes) == {"reduce-overhead"}
        _assert_clean(model)
        # the control: a mode without CUDA graphs is not wrapped, so the same replaying fake corrupts the chain
        control = CompiledRegions(CompileConfig(), cmp.find_block_lists(model), compile_fn=ReplayingCompiler())
        assert torch.isnan(_run(control, model)).all()


def test_cuda_graph_wrapper_reads_the_compiled_modules_attributes() -> None:
    """A whole model swapped in under a CUDA-graph mode still answers what ComfyUI reads off it (``dtype``)."""
    model = TinyWan(blocks=2)
    model.dtype = torch.float32  # ComfyUI's diffusion models keep their dtype as an attribute
    wrapped = cmp.GraphOutputsCloned(torch.compile(model, backend="eager"))
    assert wrapped.dtype is torch.float32 and wrapped.blocks is model.blocks
    assert not list(wrapped.parameters()) and not wrapped.state_dict()  # still adds no parameters or keys
    with pytest.raises(AttributeError):
        wrapped.no_such_attribute  # noqa: B018


def test_cuda_graph_runtime_error_steps_down() -> None:
    """A CUDA-graph runtime error (a plain RuntimeError) is the compiler's fault: step down, do not kill the run."""
    err = "Error: accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run."
    assert cmp.is_compile_failure(RuntimeError(err))
    assert cmp.is_compile_failure(RuntimeError("CUDA error: operation not permitted when stream is capturing"))
    model = TinyWan(blocks=2)
    eager = model(*_inputs())
    fake = FakeCompiler(fail_run=lambda m: RuntimeError(err) if m == "reduce-overhead" else None)
    regions = CompiledRegions(CompileConfig(mode="reduce-overhead"), cmp.find_block_lists(model), compile_fn=fake)
    torch.testing.assert_close(_run(regions, model), eager)
    assert regions.current == CompileConfig(mode="default")
    _assert_clean(model)


def _guard_only(kw: dict) -> dict:
    """The guard filter of a compile call's inductor options: a counting backend takes no inductor options."""
    return {"guard_filter_fn": kw["options"]["guard_filter_fn"]}


def test_regional_compile_traces_once_for_all_blocks_with_guard_filter() -> None:
    model = TinyWan(blocks=4)
    eager = model(*_inputs())
    counter = CompileCounter()
    regions = CompiledRegions(CompileConfig(), cmp.find_block_lists(model), guard_filter_fn=cmp.transformer_options_guard_filter,
                              compile_fn=lambda m, **kw: torch.compile(m, backend=counter, options=_guard_only(kw)))
    out = _run(regions, model)
    torch.testing.assert_close(out, eager)
    assert counter.frame_count == 1, "the block should be traced once and reused by the other blocks"
    _assert_clean(model)


def test_without_guard_filter_every_block_recompiles() -> None:
    """The control for the test above: block_index in transformer_options alone forces recompiles (dynamo
    specializes on the int, recompiles on the second block, then makes it dynamic: 2 graphs, 4 with dynamic=False)."""
    model = TinyWan(blocks=4)
    counter = CompileCounter()
    regions = CompiledRegions(CompileConfig(), cmp.find_block_lists(model),
                              compile_fn=lambda m, **kw: torch.compile(m, backend=counter))
    _run(regions, model)
    assert counter.frame_count > 1


class ContiguousOutBlock(TinyWanBlock):
    """Returns contiguous hidden states whatever its input's layout, as Wan's blocks do."""

    def forward(self, x: torch.Tensor, e: torch.Tensor, transformer_options: dict = {}) -> torch.Tensor:  # noqa: B006
        return super().forward(x, e, transformer_options).contiguous()


class TransposedEmbedWan(TinyWan):
    """Wan's patch embedding hands block 0 a transposed view ([B, C, L] -> [B, L, C]); later blocks get block
    outputs, which are contiguous."""

    def __init__(self, blocks: int) -> None:
        super().__init__(blocks)
        self.blocks = nn.ModuleList(ContiguousOutBlock() for _ in range(blocks))

    def forward(self, x: torch.Tensor, t: torch.Tensor, transformer_options: dict | None = None) -> torch.Tensor:
        h = self.patch_embedding(x).transpose(1, 2).contiguous().transpose(1, 2)
        e = t.float().view(-1, 1, 1).expand(-1, 6, DIM)
        for i, block in enumerate(self.blocks):
            h = block(h, e, transformer_options={"block_index": i})
        return self.head(h)


@pytest.mark.parametrize("hook", [True, False])
def test_block_zero_transposed_input_shares_the_graph(hook: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo guards on strides: without the contiguous copy, block 0 compiles a graph of its own."""
    if not hook:
        monkeypatch.setattr(cmp, "contiguous_hidden_states", lambda module, args: None)
    model = TransposedEmbedWan(blocks=3)
    eager = model(*_inputs())
    counter = CompileCounter()
    regions = CompiledRegions(CompileConfig(), cmp.find_block_lists(model), guard_filter_fn=cmp.transformer_options_guard_filter,
                              compile_fn=lambda m, **kw: torch.compile(m, backend=counter, options=_guard_only(kw)))
    torch.testing.assert_close(_run(regions, model), eager)
    assert counter.frame_count == (1 if hook else 2)
    assert all(type(b) is ContiguousOutBlock for b in model.blocks)


def test_streamed_weights_do_not_recompile() -> None:
    model = TinyWan(blocks=3)
    counter = CompileCounter()
    regions = CompiledRegions(CompileConfig(), cmp.find_block_lists(model), guard_filter_fn=cmp.transformer_options_guard_filter,
                              compile_fn=lambda m, **kw: torch.compile(m, backend=counter, options=_guard_only(kw)))
    first = _run(regions, model)
    for step in range(3):  # block swap copies each block into fresh buffers every step
        for p in model.blocks.parameters():
            p.data = p.data.clone()
        torch.testing.assert_close(_run(regions, model), first)
    assert counter.frame_count == 1


@pytest.mark.parametrize("where", ["compile", "first_run"])
def test_oom_steps_down_reduce_overhead_to_default_and_retries(where: str, caplog: pytest.LogCaptureFixture) -> None:
    model = TinyWan(blocks=2)
    eager = model(*_inputs())
    oom = lambda m: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB") \
        if m == "reduce-overhead" else None  # noqa: E731
    fake = FakeCompiler(fail_compile=oom) if where == "compile" else FakeCompiler(fail_run=oom)
    regions = CompiledRegions(CompileConfig(mode="reduce-overhead"), cmp.find_block_lists(model), compile_fn=fake)
    with caplog.at_level(logging.WARNING, logger="comfyui_lowvram_dit"):
        out = _run(regions, model)
    torch.testing.assert_close(out, eager)  # the same step was retried and gave the eager answer
    assert regions.current == CompileConfig(mode="default")
    assert "reduce-overhead" in fake.modes and fake.modes[-1] == "default"
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "out of memory" in msg and "retrying this step with inductor/default" in msg
    assert "running inductor/default" in regions.status()
    _assert_clean(model)
    _run(regions, model)  # later steps stay on the working mode
    assert regions.current.mode == "default"


def test_compiler_error_everywhere_ends_in_eager() -> None:
    model = TinyWan(blocks=2)
    eager = model(*_inputs())
    fake = FakeCompiler(fail_compile=lambda m: RuntimeError("triton: ptxas fatal: unsupported GPU"))
    regions = CompiledRegions(CompileConfig(mode="max-autotune"), cmp.find_block_lists(model), compile_fn=fake)
    torch.testing.assert_close(_run(regions, model), eager)
    assert regions.current is None and "eager" in regions.status()
    assert list(dict.fromkeys(fake.modes)) == ["max-autotune", "max-autotune-no-cudagraphs", "default"]
    _assert_clean(model)


def test_fallback_off_raises_and_restores() -> None:
    model = TinyWan(blocks=2)
    fake = FakeCompiler(fail_compile=lambda m: torch.OutOfMemoryError("CUDA out of memory"))
    regions = CompiledRegions(CompileConfig(fallback=False), cmp.find_block_lists(model), compile_fn=fake)
    with pytest.raises(Exception) as info:
        _run(regions, model)
    assert cmp.is_oom(info.value)
    _assert_clean(model)


def test_model_errors_are_not_swallowed() -> None:
    model = TinyWan(blocks=2)
    regions = CompiledRegions(CompileConfig(), cmp.find_block_lists(model), compile_fn=FakeCompiler())
    with pytest.raises(RuntimeError, match="shape|size|mat"):
        regions.run(model, lambda: model(torch.randn(2, 24, 7), torch.rand(2)))
    assert regions.current == CompileConfig()  # a bad input is not a reason to give up compiling
    _assert_clean(model)


def test_streaming_swaps_cuda_graph_modes(caplog: pytest.LogCaptureFixture) -> None:
    model = TinyWan(blocks=2)
    fake = FakeCompiler()
    regions = CompiledRegions(CompileConfig(mode="max-autotune"), cmp.find_block_lists(model), compile_fn=fake)
    with caplog.at_level(logging.WARNING, logger="comfyui_lowvram_dit"):
        _run(regions, model, streaming=True)
    assert set(fake.modes) == {"max-autotune-no-cudagraphs"} and "CUDA graphs disabled" in regions.status()
    assert any("fixed weight addresses" in r.getMessage() for r in caplog.records)


def test_recompile_limit_is_scoped() -> None:
    import torch._dynamo.config as dcfg

    before = dcfg.recompile_limit
    seen = []
    model = TinyWan(blocks=1)
    regions = CompiledRegions(CompileConfig(cache_size_limit=123), ["blocks.0"], compile_fn=FakeCompiler())
    x, t = _inputs()
    regions.run(model, lambda: (seen.append(dcfg.recompile_limit), model(x, t))[1])
    assert seen == [123] and dcfg.recompile_limit == before


def test_recompile_limit_holds_while_another_thread_still_runs() -> None:
    """Two compiled models on two GPUs (MultiGPU split threads): the first to finish must not lower the limit
    under the other; the last one restores it."""
    import threading

    import torch._dynamo.config as dcfg

    before = dcfg.recompile_limit
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, int] = {}

    def first() -> None:
        with cmp._recompile_limit(64):
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def second() -> None:
        a_in.wait(5)
        with cmp._recompile_limit(32):
            b_in.set()
            a_out.wait(5)
            seen["after_first_left"] = dcfg.recompile_limit

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"after_first_left": 64} and dcfg.recompile_limit == before


def test_find_block_lists() -> None:
    assert cmp.find_block_lists(TinyWan(blocks=2)) == ["blocks.0", "blocks.1"]
    wrapper = nn.Module()
    wrapper.diffusion_model = TinyWan(blocks=2)
    assert cmp.find_block_lists(wrapper) == ["diffusion_model.blocks.0", "diffusion_model.blocks.1"]


@pytest.mark.slow
def test_real_inductor_default_matches_eager() -> None:
    """The real compiler on CPU (needs a C++ compiler): compiled blocks give the eager answer."""
    model = TinyWan(blocks=2)
    eager = model(*_inputs())
    regions = CompiledRegions(CompileConfig(), cmp.find_block_lists(model),
                              guard_filter_fn=cmp.transformer_options_guard_filter)
    torch.testing.assert_close(_run(regions, model), eager, rtol=1e-4, atol=1e-4)
    assert regions.current == CompileConfig()
    _assert_clean(model)


@pytest.mark.cuda
def test_cuda_real_oom_under_memory_cap_falls_back_and_frees() -> None:
    """A real CUDA OOM under a per-process cap, raised by the first compiled run, recovers to the next mode."""
    dev = torch.device("cuda", torch.cuda.current_device())  # set_per_process_memory_fraction needs an index
    model = TinyWan().to(dev)
    x, t = (a.to(dev) for a in _inputs())
    eager = model(x, t)
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(0.25, dev)
    try:
        def fail_run(mode: str) -> BaseException | None:
            if mode != "reduce-overhead":
                return None
            try:  # what a cudagraph pool or an autotuning workspace does: ask for more than the cap allows
                torch.empty(int(total * 0.5), dtype=torch.uint8, device=dev)
            except torch.OutOfMemoryError as exc:
                return exc
            raise AssertionError("the cap did not bite")

        baseline = torch.cuda.memory_allocated(dev)
        regions = CompiledRegions(CompileConfig(mode="reduce-overhead"), cmp.find_block_lists(model),
                                  compile_fn=FakeCompiler(fail_run=fail_run))
        out = regions.run(model, lambda: model(x, t))
        torch.testing.assert_close(out, eager)
        assert regions.current.mode == "default"
        assert torch.cuda.memory_allocated(dev) <= baseline + out.numel() * out.element_size() + (1 << 20)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
    _assert_clean(model)


@pytest.mark.cuda
def test_cuda_inductor_streamed_weights_no_recompile() -> None:
    """Real inductor on the GPU: weights moved to new buffers each step cause no new graphs."""
    from torch._dynamo.utils import counters

    dev = torch.device("cuda")
    model = TinyWan(blocks=3).to(dev)  # fp32 like the CPU tests: TinyWan keeps e in fp32, so bf16 weights would mix dtypes
    x, t = (a.to(dev) for a in _inputs())
    regions = CompiledRegions(CompileConfig(), cmp.find_block_lists(model),
                              guard_filter_fn=cmp.transformer_options_guard_filter)
    first = regions.run(model, lambda: model(x, t))
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(3):
        for p in model.blocks.parameters():
            p.data = p.data.to("cpu").to(dev)  # a CPU round trip: new addresses, as block swap gives
        torch.testing.assert_close(regions.run(model, lambda: model(x, t), streaming=True), first)
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.cuda
def test_cuda_real_reduce_overhead_matches_eager_over_steps() -> None:
    """Real inductor + CUDA graphs (reduce-overhead), regional: every step, with new inputs, gives the eager answer
    and stays on reduce-overhead (no fallback needed)."""
    dev = torch.device("cuda")
    model = TinyWan(blocks=4).to(dev)
    regions = CompiledRegions(CompileConfig(mode="reduce-overhead"), cmp.find_block_lists(model),
                              guard_filter_fn=cmp.transformer_options_guard_filter)
    with torch.no_grad():
        for seed in (1, 1, 2, 3, 3):
            x, t = (a.to(dev) for a in _inputs(seed))
            torch.testing.assert_close(regions.run(model, lambda: model(x, t)), model(x, t), rtol=2e-3, atol=2e-3)
    assert regions.current == CompileConfig(mode="reduce-overhead"), regions.status()
    _assert_clean(model)


def test_a_call_that_may_compile_runs_alone_and_known_calls_run_side_by_side() -> None:
    """Dynamo's tracing patches nn.Module.__call__ process-wide: under ComfyUI's MultiGPU split (a model copy per
    GPU, one thread each) a compiling call must not overlap another thread's call; reusing calls may overlap."""
    import threading
    import time

    from comfyui_lowvram_dit.kernels.compile_gate import CompileGate

    gate, log, lock = CompileGate(), [], threading.Lock()

    def call(name: str, may_compile: bool) -> None:
        with gate.call(may_compile):
            with lock:
                log.append(f"{name}>")
            time.sleep(0.05)
            with lock:
                log.append(f"<{name}")

    def run(*calls: tuple[str, bool]) -> list[str]:
        log.clear()
        threads = [threading.Thread(target=call, args=c) for c in calls]
        for t in threads:
            t.start()
            time.sleep(0.01)
        for t in threads:
            t.join(5)
        return list(log)

    assert run(("a", False), ("b", False))[:2] == ["a>", "b>"]  # both in flight at once
    for order in (run(("c", True), ("d", False)), run(("e", False), ("f", True))):
        assert order[1].startswith("<")  # the first call ended before the second began
    with gate.call(True):
        with gate.call(True):  # nested in the compiling call of the same thread: no deadlock
            pass
