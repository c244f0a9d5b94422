"""Attention and Torch Compile nodes against real ComfyUI v0.8: the override contract, a tiny Wan sampled
in-process through comfy.sample (KSampler's path), no `_orig_mod.` in saved state, and the server graph
UNETLoader -> Attention -> Torch Compile -> KSampler.

Run: COMFYUI_PATH=/path/to/ComfyUI python -m pytest tests/comfyui/test_comfyui_attention_compile.py
"""

from __future__ import annotations

import functools
import logging
import uuid
from typing import Any

import pytest
import torch

from comfy_server import comfyui_in_process_or_skip, sample_wan

pytestmark = pytest.mark.comfyui


@pytest.fixture(scope="module")
def comfy() -> Any:
    """ComfyUI importable in this process, on CPU."""
    path = comfyui_in_process_or_skip()
    import comfy.model_management  # noqa: F401 - after args.cpu

    return path


@pytest.fixture(scope="module")
def tiny_wan(comfy: Any) -> Any:
    """A 2-block Wan 2.2 14B-layout model (dim 256) from synthetic/checkpoints.py, as UNETLoader builds it."""
    synth = pytest.importorskip("comfyui_lowvram_dit.synthetic.checkpoints")
    import comfy.sd

    return comfy.sd.load_diffusion_model_state_dict(synth.synthetic_state_dict("wan22_t2v_14B", size="tiny"))


_sample = functools.partial(sample_wan, frames=1)  # the shared tiny-Wan KSampler path (tests/comfy_server.py)


# -------------------------------------------------------------------------------------------- attention


@pytest.mark.parametrize("layout", ["wan", "qwen"])
def test_override_matches_comfy_attention_through_wrap_attn(comfy: Any, layout: str) -> None:
    """Call ComfyUI's own wrapped functions with our override, in Wan's and Qwen-Image's exact call forms."""
    from comfy.ldm.modules import attention as ca

    from comfyui_lowvram_dit.kernels import attention as ak
    from comfyui_lowvram_dit.host.attention import AttentionOverride

    g = torch.Generator().manual_seed(1)
    b, h, lq, lk, d = 2, 3, 40, 24, 32
    with ak.isolated_selector() as sel:
        opts = {"optimized_attention_override": AttentionOverride("auto")}
        if layout == "wan":  # optimized_attention(q, k, v, heads=H, transformer_options=...) on [B, L, H*D]
            q, k, v = torch.randn(b, lq, h * d, generator=g), torch.randn(b, lk, h * d, generator=g), \
                torch.randn(b, lk, h * d, generator=g)
            ours = ca.attention_pytorch(q, k, v, heads=h, transformer_options=opts)
            ref = ca.attention_pytorch(q, k, v, heads=h, transformer_options={})
        else:  # optimized_attention_masked(q, k, v, H, mask, transformer_options=..., skip_reshape=True)
            q, k, v = (torch.randn(b, h, n, d, generator=g) for n in (lq, lk, lk))
            mask = torch.zeros(b, lq, lk)
            mask[:, :, -5:] = float("-inf")  # padded text tokens
            ours = ca.attention_pytorch(q, k, v, h, mask, transformer_options=opts, skip_reshape=True)
            ref = ca.attention_pytorch(q, k, v, h, mask, transformer_options={}, skip_reshape=True)
        assert ours.shape == ref.shape == (b, lq, h * d)
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)
        assert len(sel.decisions) == 1


def test_attention_node_is_per_model_and_samples(tiny_wan: Any, caplog: pytest.LogCaptureFixture) -> None:
    from comfyui_lowvram_dit.kernels import attention as ak
    from comfyui_lowvram_dit.nodes.attention import AttentionSelect

    base = _sample(tiny_wan)
    with ak.isolated_selector() as sel, caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        patched = AttentionSelect.execute(tiny_wan, "SDPA math").result[0]
        out = _sample(patched)
    assert "optimized_attention_override" not in tiny_wan.model_options["transformer_options"]  # per model
    torch.testing.assert_close(out, base, rtol=1e-4, atol=1e-4)
    # Wan self-attention (L = 16 tokens) and cross-attention (12 text tokens) both went through the selector
    lk = sorted(key[3] for key in sel.decisions)  # (request, heads, Lq, Lk, ...)
    assert lk == [12, 16], sel.report()
    assert all(name == "sdpa_math" for name in sel.decisions.values())
    assert any("SDPA math" in r.getMessage() for r in caplog.records)


# The 8-bit and comfy-kitchen choices need CUDA (and comfy-kitchen 0.2.40+); this in-process ComfyUI runs on the CPU.
@pytest.mark.parametrize("label", ["flash-attn 3", "lowvram 8-bit, int8 P·V", "comfy-kitchen int8",
                                   "comfy-kitchen sol_attn (approximate)"])
def test_attention_node_falls_back_from_unavailable_backend(tiny_wan: Any, label: str,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    from comfyui_lowvram_dit.kernels import attention as ak
    from comfyui_lowvram_dit.host.attention import BACKEND_CHOICES
    from comfyui_lowvram_dit.nodes.attention import AttentionSelect

    backend = BACKEND_CHOICES[label]
    base = _sample(tiny_wan, seed=3)
    with ak.isolated_selector() as sel, caplog.at_level(logging.WARNING, logger="comfyui_lowvram_dit"):
        out = _sample(AttentionSelect.execute(tiny_wan, label).result[0], seed=3)
    torch.testing.assert_close(out, base, rtol=1e-4, atol=1e-4)
    assert {key[0] for key in sel.decisions} == {backend}  # the label asked for its backend on every shape
    assert all(name != backend for name in sel.decisions.values())
    warned = [r.getMessage() for r in caplog.records if f"{label} cannot run" in r.getMessage()]
    # once per shape (self, cross), not once per call, with the backend's own reason (no CUDA, no comfy-kitchen 0.2.40)
    expected = [f"lowvram_dit attention: {label} cannot run {ak.describe_key(key)}: "
                f"{ak.unavailable_reason(backend, torch.device('cpu'), key[5], key[4])}; falling back"
                for key in sel.decisions]
    assert len(warned) == 2 and sorted(warned) == sorted(expected), warned


def test_comfy_default_removes_override(tiny_wan: Any) -> None:
    from comfyui_lowvram_dit.nodes.attention import AttentionSelect

    m = AttentionSelect.execute(tiny_wan, "SDPA math").result[0]
    m2 = AttentionSelect.execute(m, "ComfyUI default").result[0]
    assert "optimized_attention_override" in m.model_options["transformer_options"]
    assert "optimized_attention_override" not in m2.model_options["transformer_options"]


# ---------------------------------------------------------------------------------------------- compile


class _CountingCompiler:
    """compile_fn for apply_compile: real dynamo, counting backend, optional injected OOM for one mode."""

    def __init__(self, oom_mode: str | None = None) -> None:
        self.oom_mode, self.frames, self.modes = oom_mode, 0, []

    def __call__(self, module: torch.nn.Module, **kw: Any) -> Any:
        mode = kw.get("mode") or ("reduce-overhead" if (kw.get("options") or {}).get("triton.cudagraphs")
                                  else "default")
        self.modes.append(mode)

        def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
            self.frames += 1
            if mode == self.oom_mode:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 GiB (injected)")
            return gm.forward

        return torch.compile(module, backend=backend, options={"guard_filter_fn": kw["options"]["guard_filter_fn"]},
                             dynamic=kw["dynamic"], fullgraph=kw["fullgraph"])


def test_compile_node_regional_sampling_and_state_dict(tiny_wan: Any) -> None:
    from comfyui_lowvram_dit.kernels.compile import CompileConfig
    from comfyui_lowvram_dit.host.attention import apply_attention
    from comfyui_lowvram_dit.host.torch_compile import COMPILE_KEY, apply_compile

    torch._dynamo.reset()
    base = _sample(tiny_wan, seed=5)
    compiler = _CountingCompiler()
    m = apply_compile(apply_attention(tiny_wan, "auto"), CompileConfig(), "blocks", compile_fn=compiler)
    regions = m.attachments[COMPILE_KEY]
    assert regions.paths == ["diffusion_model.blocks.0", "diffusion_model.blocks.1"]
    out = _sample(m, seed=5)
    torch.testing.assert_close(out, base, rtol=1e-4, atol=1e-4)
    frames_after_first = compiler.frames
    assert frames_after_first >= 1
    _sample(m, seed=6)  # second run: same shapes, new sigmas and noise
    assert compiler.frames == frames_after_first, "recompiled on a second run with the same shapes"
    for sd in (m.model_state_dict(), m.model.state_dict(), tiny_wan.model_state_dict()):
        assert sd and not [k for k in sd if "_orig_mod" in k]
    assert all(type(b).__name__ == "WanAttentionBlock" for b in m.model.diffusion_model.blocks)


@pytest.mark.parametrize("opaque", [True, False])
def test_attention_auto_and_compile_trace_one_graph(tiny_wan: Any, opaque: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """KSampler's path with Attention auto + Torch Compile, one backend for every block (as inductor): the selector
    decides inside the attention op and block 0's transposed input is made contiguous, so one graph serves both
    blocks and both steps. The traced selector (the older path) breaks the graph at its first decisions."""
    from comfyui_lowvram_dit.kernels import attention as ak
    from comfyui_lowvram_dit.kernels import opaque_ops
    from comfyui_lowvram_dit.kernels.compile import CompileConfig
    from comfyui_lowvram_dit.host.attention import apply_attention
    from comfyui_lowvram_dit.host.torch_compile import apply_compile

    monkeypatch.setattr(opaque_ops, "OPAQUE_UNDER_COMPILE", opaque)
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        graphs.append(gm)
        return gm.forward

    def compile_fn(module: torch.nn.Module, **kw: Any) -> Any:
        return torch.compile(module, backend=backend, options={"guard_filter_fn": kw["options"]["guard_filter_fn"]})

    with ak.isolated_selector() as sel:
        base = _sample(tiny_wan, seed=5)
        sel.clear()  # the compiled run makes the first decisions itself
        m = apply_compile(apply_attention(tiny_wan, "auto"), CompileConfig(), "blocks", compile_fn=compile_fn)
        out = _sample(m, seed=5)
        first = len(graphs)
        _sample(m, seed=6)  # new sigmas and noise
    torch.testing.assert_close(out, base, rtol=1e-4, atol=1e-4)
    assert len(graphs) == first, "recompiled on a second run with the same shapes"
    assert (first == 1) if opaque else (first > 1), f"{first} graphs"


def test_compile_node_oom_fallback_in_sampler(tiny_wan: Any, caplog: pytest.LogCaptureFixture) -> None:
    from comfyui_lowvram_dit.kernels.compile import CompileConfig
    from comfyui_lowvram_dit.host.torch_compile import COMPILE_KEY, apply_compile

    torch._dynamo.reset()
    base = _sample(tiny_wan, seed=7)
    compiler = _CountingCompiler(oom_mode="reduce-overhead")
    m = apply_compile(tiny_wan, CompileConfig(mode="reduce-overhead"), compile_fn=compiler)
    with caplog.at_level(logging.WARNING, logger="comfyui_lowvram_dit"):
        out = _sample(m, seed=7)
    torch.testing.assert_close(out, base, rtol=1e-4, atol=1e-4)
    assert m.attachments[COMPILE_KEY].current.mode == "default"
    assert any("retrying this step with inductor/default" in r.getMessage() for r in caplog.records)
    assert not [k for k in m.model_state_dict() if "_orig_mod" in k]


def test_compile_node_replaces_core_wrapper(tiny_wan: Any) -> None:
    from comfy.patcher_extension import WrappersMP
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    from comfyui_lowvram_dit.kernels.compile import CompileConfig
    from comfyui_lowvram_dit.host.torch_compile import COMPILE_KEY, CORE_COMPILE_KEY, apply_compile
    from comfyui_lowvram_dit.host.hooks import hook_registry

    core = tiny_wan.clone()
    set_torch_compile_wrapper(core, backend="eager")
    m = apply_compile(core, CompileConfig(), compile_fn=_CountingCompiler())
    assert not m.get_wrappers(WrappersMP.APPLY_MODEL, CORE_COMPILE_KEY)
    m = apply_compile(m, CompileConfig(mode="max-autotune-no-cudagraphs"), compile_fn=_CountingCompiler())
    assert hook_registry(m).names() == [COMPILE_KEY]  # applied twice: one hook, the last one
    assert hook_registry(m).get(COMPILE_KEY).regions is m.attachments[COMPILE_KEY]


def test_each_sampling_run_settles_the_compile_timing(tiny_wan: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """With `when` = it pays, every sampling run ends by deciding what it finished timing (an OUTER_SAMPLE wrapper,
    through ComfyUI's real sampler), so a server restarted after two renders finds the verdict kept; compiling the
    model again leaves one wrapper, and `when` = always adds none."""
    from comfy.patcher_extension import WrappersMP

    from comfyui_lowvram_dit.host.torch_compile import COMPILE_KEY, PAYS, apply_compile
    from comfyui_lowvram_dit.kernels.compile import CompileConfig

    settled: list[int] = []
    monkeypatch.setattr(PAYS, "settle", lambda: settled.append(1))
    m = apply_compile(tiny_wan, CompileConfig(), compile_fn=_CountingCompiler())
    m = apply_compile(m, CompileConfig(), compile_fn=_CountingCompiler())
    assert len(m.get_wrappers(WrappersMP.OUTER_SAMPLE, COMPILE_KEY)) == 1
    _sample(m, seed=5)
    _sample(m, seed=6)
    assert settled == [1, 1]
    always = apply_compile(tiny_wan, CompileConfig(), compile_fn=_CountingCompiler(), when="always")
    assert not always.get_wrappers(WrappersMP.OUTER_SAMPLE, COMPILE_KEY)
    _sample(always, seed=5)
    assert settled == [1, 1]


def test_partial_load_counts_as_streaming() -> None:
    from types import SimpleNamespace

    from comfyui_lowvram_dit.host.torch_compile import partially_loaded

    assert partially_loaded(SimpleNamespace(model_lowvram=True))
    assert not partially_loaded(SimpleNamespace(model_lowvram=False)) and not partially_loaded(SimpleNamespace())


# ------------------------------------------------------------------------------------------------ server


def test_server_unetloader_attention_compile_ksampler(comfy_server: Any) -> None:
    """Stock graph with our two nodes in the middle, on the real server (CPU). Real torch.compile (inductor
    on CPU) would take minutes here, so the graph uses backend=cudagraphs, which on CPU tensors runs the
    AOT graph without recording: it still exercises the wrapper, regional swap and sampling end to end."""
    synth = pytest.importorskip("comfyui_lowvram_dit.synthetic.checkpoints")
    name = f"tiny_wan_attn_compile_{uuid.uuid4().hex[:8]}.safetensors"
    synth.write_synthetic("wan22_t2v_14B", comfy_server.base_dir / "models" / "diffusion_models" / name,
                          size="tiny")
    info = comfy_server.object_info("LowVRAM_Attention")
    assert "auto" in str(info["input"]["required"]["backend"])
    api = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": name, "weight_dtype": "default"}},
        "2": {"class_type": "LowVRAM_Attention", "inputs": {"model": ["1", 0], "backend": "auto"}},
        "3": {"class_type": "LowVRAM_TorchCompile", "inputs": {
            "model": ["2", 0], "mode": "default", "backend": "cudagraphs", "dynamic": "auto", "fullgraph": False,
            "cache_size_limit": 16, "fallback": True, "scope": "blocks"}},
        "4": {"class_type": "LowVRAMTest_RandomConditioning", "inputs": {"seed": 1, "length": 12, "dim": 4096, "std": 1.0}},
        "5": {"class_type": "LowVRAMTest_RandomConditioning", "inputs": {"seed": 2, "length": 12, "dim": 4096, "std": 1.0}},
        "6": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 1,
                                                                  "batch_size": 1}},
        "7": {"class_type": "KSampler", "inputs": {
            "model": ["3", 0], "seed": 0, "steps": 2, "cfg": 3.0, "sampler_name": "euler", "scheduler": "simple",
            "positive": ["4", 0], "negative": ["5", 0], "latent_image": ["6", 0], "denoise": 1.0}},
        "8": {"class_type": "LowVRAMTest_LatentStats", "inputs": {"latent": ["7", 0]}},
    }
    entry = comfy_server.run(api, timeout=600)
    assert entry["status"]["status_str"] == "success"
    log_text = comfy_server.log_text()
    assert "lowvram_dit attention auto" in log_text
    assert "torch.compile cudagraphs: running cudagraphs over 2 region(s)" in log_text  # compiled, no fallback
