"""Attention and per-tensor fp8 linears as opaque ops under torch.compile (kernels/opaque_ops.py).

Each compiled path is compared with eager and with the traced path it replaces (``OPAQUE_UNDER_COMPILE = False``),
which breaks the graph or compiles more graphs in the same situation, so the counts asserted here can fail.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from comfyui_lowvram_dit.kernels import attention as attn

from comfyui_lowvram_dit.kernels import attention_backends, attention_check
from comfyui_lowvram_dit.kernels import fp8, fp8_choice, opaque_ops
from comfyui_lowvram_dit.kernels.compile import CompileConfig, CompiledRegions, transformer_options_guard_filter

pytestmark = pytest.mark.skipif(opaque_ops.ATTENTION_OP is None, reason="torch has no torch.library.custom_op")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


def _node(name: str) -> str:
    """How an FX graph names this copy's op ``name``: 'lowvram_dit.attention_<suffix>.default'."""
    return opaque_ops.op_name(name).replace("::", ".") + ".default"


def _qkv(b: int = 1, h: int = 4, lq: int = 64, lk: int = 64, d: int = 32, dtype: torch.dtype = torch.float32,
         seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Wan's [B, L, H*D] projections viewed as [B, H, L, D], as the Attention node passes them
    return tuple(torch.randn(b, n, h * d, generator=g).to(dtype).view(b, n, h, d).transpose(1, 2)
                 for n in (lq, lk, lk))


class GraphRecorder:
    """A torch.compile backend that keeps every FX graph it is given and runs it as traced."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        self.graphs.append(gm)
        return gm.forward

    def targets(self) -> list[str]:
        return [str(n.target) for gm in self.graphs for n in gm.graph.nodes if n.op == "call_function"]


def _breaks(fn: Callable, *args: Any) -> int:
    return torch._dynamo.explain(fn)(*args).graph_break_count


# ------------------------------------------------------------------------------------------------ attention


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_attention_op_passes_torch_library_checks(mask_kind: str) -> None:
    """Schema, fake vs real metadata (strides included) and AOT dispatch, on self- and cross-attention shapes."""
    for lq, lk in ((48, 48), (48, 20)):
        q, k, v = _qkv(lq=lq, lk=lk)
        mask = None if mask_kind == "none" else torch.rand(1, 1, lq, lk) > 0.2
        if mask_kind == "float":
            mask = torch.zeros(1, 1, lq, lk).masked_fill(~mask, float("-inf"))
        with attn.isolated_selector():
            result = torch.library.opcheck(opaque_ops.ATTENTION_OP, (q, k, v, mask, "sdpa_math", ""))
        assert all(v == "SUCCESS" for v in result.values()), result


def test_attention_fake_matches_the_real_output() -> None:
    q, k, v = _qkv(b=2, h=3, lq=40, lk=24, d=16, dtype=torch.bfloat16)
    with attn.isolated_selector():
        real = opaque_ops.ATTENTION_OP(q, k, v, None, "auto", "")
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fake = opaque_ops.ATTENTION_OP(fq, fk, fv, None, "auto", "")
    assert fake.shape == real.shape == (2, 40, 3, 16)
    assert fake.dtype == real.dtype == torch.bfloat16 and fake.stride() == real.stride()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_undecided_auto_compiles_without_a_graph_break(backend: str, traced_breaks: int) -> None:
    """The selector's first decision runs inside the op when the graph runs: no break, eager's output."""
    q, k, v = _qkv()

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return opaque_ops.selected_attention(q * 1.5, k, v, None, "auto") * 2

    with attn.isolated_selector() as sel:
        assert _breaks(fn, q, k, v) == 0
        assert len(sel.decisions) == 1  # decided while the graph ran
        torch._dynamo.reset()
        out = torch.compile(fn, backend=backend, fullgraph=True)(q, k, v)
        torch.testing.assert_close(out, sel.run(q * 1.5, k, v, None, "auto") * 2, rtol=0, atol=0)
    assert traced_breaks >= 1


@pytest.fixture
def traced_breaks(monkeypatch: pytest.MonkeyPatch) -> int:
    """Graph breaks of the same undecided call on the traced path (the one the op replaces)."""
    monkeypatch.setattr(opaque_ops, "OPAQUE_UNDER_COMPILE", False)
    q, k, v = _qkv()
    with attn.isolated_selector():
        n = _breaks(lambda q, k, v: opaque_ops.selected_attention(q * 1.5, k, v, None, "auto") * 2, q, k, v)
    monkeypatch.setattr(opaque_ops, "OPAQUE_UNDER_COMPILE", True)
    torch._dynamo.reset()
    return n


def _untraceable(monkeypatch: pytest.MonkeyPatch, calls: list[bool]) -> None:
    """Register 'probe', a backend Dynamo must not trace (as the 8-bit kernel), which records each call."""
    registry = dict(attn.BACKENDS)  # one copy for the registry module and the selector that reads it
    monkeypatch.setattr(attention_backends, "BACKENDS", registry)
    monkeypatch.setattr(attn, "BACKENDS", registry)

    def probe(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        calls.append(torch.compiler.is_compiling())
        return attention_check.reference_attention(q, k, v, mask).to(q.dtype)

    attention_backends.register_backend(attn.AttentionBackend("probe", "PROBE", probe, lambda *a: None, compile_safe=False))


@pytest.mark.parametrize("opaque", [True, False])
def test_untraceable_backend_is_one_op_instead_of_a_break_per_call(opaque: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []
    _untraceable(monkeypatch, calls)
    monkeypatch.setattr(opaque_ops, "OPAQUE_UNDER_COMPILE", opaque)
    q, k, v = _qkv()

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        a = opaque_ops.selected_attention(q + 1, k, v, None, "probe")
        return opaque_ops.selected_attention(a.transpose(1, 2).contiguous().transpose(1, 2), k, v, None, "probe")

    with attn.isolated_selector() as sel:
        eager = fn(q, k, v)  # decided before compiling: only the backend call itself is left
        recorder = GraphRecorder()
        out = torch.compile(fn, backend=recorder)(q, k, v)
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
        assert sel.decisions and set(sel.decisions.values()) == {"probe"}
    op_calls = recorder.targets().count(_node("attention"))
    if opaque:
        assert len(recorder.graphs) == 1 and op_calls == 2
    else:  # the traced path leaves the graph at each call of the backend
        assert len(recorder.graphs) >= 2 and op_calls == 0
    assert not any(calls), "the backend ran while Dynamo traced"


def test_host_backends_reach_the_op_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host's backends join auto inside the op exactly as eagerly, registered up front or while tracing."""
    seen: list[str] = []

    def host_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        seen.append("host")
        return attention_check.reference_attention(q, k, v, mask).to(q.dtype)

    host = attn.HostAttention((attn.AttentionBackend("probehost:x", "host x", host_fn, lambda *a: None),),
                              "probehost:x", "host x")
    q, k, v = _qkv()
    for name in (opaque_ops.register_host(host), ""):
        seen.clear()
        torch._dynamo.reset()
        with attn.isolated_selector() as sel:
            fn = torch.compile(lambda q, k, v, name=name: opaque_ops.selected_attention(q, k, v, None, "auto", host,
                                                                                        name),
                               backend="eager", fullgraph=True)
            out = fn(q, k, v)
            assert seen and "probehost:x" in sel.details[attn._key("auto", q, k, None, host)].timings_ms
            torch.testing.assert_close(out, sel.run(q, k, v, None, "auto", host), rtol=0, atol=0)


# ----------------------------------------------------------------------------------- regional compile, sigmas


class AttnBlock(nn.Module):
    """A Wan-like block: modulation by the timestep embedding, self- and cross-attention through the selector."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.o = nn.Linear(dim, dim)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, n, c = t.shape
        return t.view(b, n, self.heads, c // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor, e: torch.Tensor, context: torch.Tensor,
                transformer_options: dict = {}) -> torch.Tensor:  # noqa: B006 - ComfyUI's signature
        backend = transformer_options.get("backend", "auto")
        h = x * (1 + e)
        q, k, v = (self._heads(t) for t in self.qkv(h).chunk(3, dim=-1))
        a = opaque_ops.selected_attention(q, k, v, None, backend).transpose(1, 2).flatten(2)
        ck, cv = (self._heads(t) for t in self.kv(context).chunk(2, dim=-1))
        c = opaque_ops.selected_attention(self._heads(a), ck, cv, None, backend).transpose(1, 2).flatten(2)
        return x + self.o(c)


class AttnModel(nn.Module):
    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(AttnBlock() for _ in range(blocks))

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        opts = {"sigmas": sigma, "backend": "auto"}
        for i, block in enumerate(self.blocks):
            opts["block_index"] = i
            x = block(x, sigma.view(-1, 1, 1) * 0.1, context, transformer_options=opts)
        return x


def _regional_frames(opaque: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[torch.Tensor]]:
    """Graphs compiled after each of three sampler steps (sigma changes), and the outputs vs eager's."""
    monkeypatch.setattr(opaque_ops, "OPAQUE_UNDER_COMPILE", opaque)
    torch._dynamo.reset()
    model = AttnModel()
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():  # as sampling makes them (block 1 gets an inference tensor either way)
        x, context = torch.randn(2, 40, 64, generator=g), torch.randn(2, 12, 64, generator=g)
    recorder = GraphRecorder()

    def compile_fn(module: nn.Module, **kw: Any) -> Any:
        return torch.compile(module, backend=recorder, options={"guard_filter_fn": kw["options"]["guard_filter_fn"]})

    regions = CompiledRegions(CompileConfig(), [f"blocks.{i}" for i in range(3)],
                              guard_filter_fn=transformer_options_guard_filter, compile_fn=compile_fn)
    frames, diffs = [], []
    with attn.isolated_selector(), torch.inference_mode():
        for sigma in (0.99, 0.75, 0.31):
            s = torch.full((2,), sigma)
            out = regions.run(model, lambda s=s: model(x, s, context))
            frames.append(len(recorder.graphs))
            diffs.append((out - model(x, s, context)).abs().max())
    return frames, diffs


def test_regional_compile_traces_one_graph_for_every_block_and_step(monkeypatch: pytest.MonkeyPatch) -> None:
    frames, diffs = _regional_frames(True, monkeypatch)
    assert frames == [1, 1, 1], f"graphs after each step: {frames}"
    assert all(d == 0 for d in diffs)
    traced_frames, traced_diffs = _regional_frames(False, monkeypatch)
    assert traced_frames[0] > 1, "the traced path should break at the first decision and compile again"
    assert traced_frames[-1] == traced_frames[0], "the traced path recompiled on a sigma change"
    assert all(d == 0 for d in traced_diffs)


# --------------------------------------------------------------------------------------------------- fp8


def _fp8_args(rows: int = 10, n: int = 48, k: int = 32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(5)
    w, s = fp8.quantize_per_tensor(torch.randn(n, k, generator=g))
    return (torch.randn(2, rows, k, generator=g).to(torch.bfloat16), w, s,
            torch.randn(n, generator=g).to(torch.bfloat16))


@pytest.mark.parametrize("path", ["dequantize", "scaled_mm_tensorwise"])
def test_fp8_linear_op_passes_torch_library_checks(path: str) -> None:
    # test_schema compares inputs with arithmetic CPU torch lacks for fp8 (mul on Float8_e4m3fn): left out
    result = torch.library.opcheck(opaque_ops.FP8_LINEAR_OP, (*_fp8_args(), path),
                                   test_utils=("test_autograd_registration", "test_faketensor",
                                               "test_aot_dispatch_dynamic"))
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("opaque", [True, False])
def test_per_tensor_fp8_matmul_is_one_op_under_compile(opaque: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU has a per-tensor ``torch._scaled_mm``: the compiled linear gives eager's bits either way, as one op
    (opaque) or as the traced quantize + ``_scaled_mm`` (the older path)."""
    monkeypatch.setattr(opaque_ops, "OPAQUE_UNDER_COMPILE", opaque)
    x, w, s, b = _fp8_args()
    eager = fp8.fp8_linear(x, w, s, b, path="scaled_mm_tensorwise", out_dtype=x.dtype)
    recorder = GraphRecorder()
    fn = torch.compile(lambda x: opaque_ops.fp8_linear(x * 2, w, s, b, None, "scaled_mm_tensorwise"),
                       backend=recorder, fullgraph=True)
    torch.testing.assert_close(fn(x / 2), eager, rtol=0, atol=0)
    targets = recorder.targets()
    op = _node("fp8_linear")
    assert len(recorder.graphs) == 1
    assert (targets.count(op), any("_scaled_mm" in t for t in targets)) == ((1, False) if opaque else (0, True))


def test_dequantize_and_blockwise_fp8_stay_traceable() -> None:
    """Paths without a per-shape choice keep their traced form (Inductor fuses the dequantize)."""
    x, w, s, b = _fp8_args()
    wb, sb = fp8.quantize_blockwise(torch.randn(48, 32), 16)
    for args in ((w, s, b, None, "dequantize"), (wb, sb, b, 16, "dequantize")):
        recorder = GraphRecorder()
        torch._dynamo.reset()
        torch.compile(lambda x, args=args: opaque_ops.fp8_linear(x, *args), backend=recorder, fullgraph=True)(x)
        assert _node("fp8_linear") not in recorder.targets() and len(recorder.graphs) == 1


def test_the_scale_choice_runs_inside_the_op_on_real_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[type, str]] = []

    def choose(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
               path: str) -> str:
        seen.append((type(x), path))
        return "scaled_mm_tensorwise"

    monkeypatch.setattr(fp8_choice.CHOOSER, "choose", choose)
    x, w, s, b = _fp8_args()
    fn = torch.compile(lambda x: opaque_ops.fp8_linear(x, w, s, b, None, "scaled_mm_rowwise"), backend="aot_eager",
                       fullgraph=True)
    out = fn(x)
    fn(x)
    assert seen == [(torch.Tensor, "scaled_mm_rowwise")] * 2  # every call, at run time, never on fake tensors
    torch.testing.assert_close(out, fp8.fp8_linear(x, w, s, b, path="scaled_mm_tensorwise"), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------- real compilers


@pytest.mark.slow
def test_inductor_on_cpu_matches_eager() -> None:
    """The real compiler on CPU (needs a C++ compiler): both ops as extern calls between generated kernels."""
    q, k, v = _qkv(dtype=torch.bfloat16)
    x, w, s, b = _fp8_args(rows=16, n=64, k=128)

    def fn(q: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = opaque_ops.selected_attention(torch.sin(q), k, v, None, "auto") + 1
        return a, opaque_ops.fp8_linear(torch.cos(x), w, s, b, None, "scaled_mm_tensorwise") * 3

    with attn.isolated_selector():
        eager = fn(q, x)
        compiled = torch.compile(fn, backend="inductor", fullgraph=True)(q, x)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # inductor's sin/cos round differently


@pytest.mark.cuda
def test_cuda_int8_attention_and_fp8_rowwise_under_inductor_match_eager() -> None:
    from comfyui_lowvram_dit.kernels import attention_int8

    dev = torch.device("cuda")
    if not attention_int8.is_supported(dev, torch.bfloat16, 128) or fp8.device_capability(dev) < (8, 9):
        pytest.skip("needs an sm89+ GPU with Triton")
    q, k, v = (t.to(dev) for t in _qkv(b=2, h=8, lq=4096, lk=4096, d=128, dtype=torch.bfloat16))
    x, w, s, b = (t.to(dev) for t in _fp8_args(rows=4096, n=1024, k=1024))

    def fn(q: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (opaque_ops.selected_attention(q, k, v, None, "int8"),
                opaque_ops.fp8_linear(x, w, s, b, None, "scaled_mm_rowwise"))

    with attn.isolated_selector():
        eager = fn(q, x)
        assert _breaks(fn, q, x) == 0
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="inductor", fullgraph=True)(q, x)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
