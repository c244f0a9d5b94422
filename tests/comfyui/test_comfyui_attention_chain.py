"""The Attention node composed with other attention overrides, in-process and through a real server.

The rule: an override another node installed stays and runs first, whichever order the nodes are wired, and the
pack's attention is what it falls back to (the ``func`` it is handed when the pack comes after it, the override
it wrapped when the pack comes before). The other overrides: newer ComfyUI's block-sparse attention node (re-created
in tests/newer_comfyui.py, with its per-step re-assertion where the host supports it) and a counting override that
chains (tests/fixture_nodes). Expected outputs follow from the rule: the pack's attention equals ComfyUI's within
the tolerance the attention tests use, so "sparse, then the pack" equals "sparse alone". Needs COMFYUI_PATH.
"""

from __future__ import annotations

import functools
import logging
import uuid
from typing import Any

import pytest
import torch

from comfy_server import chain_nodes, comfyui_in_process_or_skip, sample_nodes, sample_wan

pytestmark = pytest.mark.comfyui
_sample = functools.partial(sample_wan, frames=1, steps=4)
TOL = {"rtol": 1e-4, "atol": 1e-4}  # the attention node's equality tolerance (test_comfyui_attention_compile.py)
CALLS_PER_STEP = 2 * 2  # the tiny Wan: 2 blocks x (self + cross attention); cond and uncond run as one batch


@pytest.fixture(scope="module")
def tiny_wan() -> Any:
    """A 2-block Wan 2.2 14B-layout model (dim 256) from the synthetic checkpoint, as UNETLoader builds it."""
    comfyui_in_process_or_skip()
    from comfyui_lowvram_dit.synthetic import checkpoints as synth
    import comfy.sd

    return comfy.sd.load_diffusion_model_state_dict(synth.synthetic_state_dict("wan22_t2v_14B", size="tiny"))


@pytest.fixture
def pack_calls(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every call that reaches the pack's attention override (its backend name per call)."""
    from comfyui_lowvram_dit.host import attention

    calls: list = []
    original = attention.AttentionOverride.__call__

    def counted(self: Any, func: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(self.backend)
        return original(self, func, *args, **kwargs)

    monkeypatch.setattr(attention.AttentionOverride, "__call__", counted)
    return calls


def _lines(caplog: pytest.LogCaptureFixture, marker: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if marker in r.getMessage()]


def _sparse(model: Any) -> tuple[Any, Any]:
    from newer_comfyui import apply_block_sparse_attention

    return apply_block_sparse_attention(model, start_percent=0.1)  # sparse self-attention from the second step


# ------------------------------------------------------------------------------------------------ in-process


def test_describe_override_names_module_and_function() -> None:
    from comfyui_lowvram_dit.host.attention import describe_override

    def make() -> Any:
        def override(func: Any, *a: Any, **k: Any) -> Any:
            return func(*a, **k)
        return override

    class Callable_:
        def __call__(self, func: Any, *a: Any, **k: Any) -> Any:
            return func(*a, **k)

    here = __name__
    assert describe_override(make()) == f"{here}.test_describe_override_names_module_and_function"
    assert describe_override(Callable_()) == f"{here}.test_describe_override_names_module_and_function"
    assert describe_override(functools.partial(make(), None)) == describe_override(make())
    assert describe_override(print) == "builtins.print"


@pytest.mark.parametrize("order", ["sparse_then_pack", "pack_then_sparse"])
def test_sparse_node_and_pack_attention_compose(tiny_wan: Any, pack_calls: list, order: str,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """Both orders: the sparse node takes its calls, every call it declines runs the pack's attention once, the
    output equals the sparse node alone; one line says which runs where."""
    from newer_comfyui import sparse_reasserts_each_step

    from comfyui_lowvram_dit.host.attention import ChainedOverride, apply_attention

    pack_only = _sample(apply_attention(tiny_wan, "auto"), seed=3)
    alone, alone_patch = _sparse(tiny_wan)
    ref = _sample(alone, seed=3)
    taken, declined = alone_patch.taken, alone_patch.declined
    assert taken > 0 and declined > 0 and taken + declined == 4 * CALLS_PER_STEP
    assert not torch.allclose(ref, pack_only, **TOL)  # the sparse calls change the output: the test can tell
    pack_calls.clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        if order == "sparse_then_pack":
            model, patch = _sparse(tiny_wan)
            model = apply_attention(model, "auto")
            assert isinstance(model.model_options["transformer_options"]["optimized_attention_override"],
                              ChainedOverride)
        else:
            model, patch = _sparse(apply_attention(tiny_wan, "auto"))
        out = _sample(model, seed=3)
    torch.testing.assert_close(out, ref, **TOL)
    assert patch.taken == taken and len(pack_calls) == declined, (patch.taken, len(pack_calls))
    # sparse first: its per-step re-assertion wraps the composed override once more; the inner copy declines the
    # same calls again (so each declined call is counted twice) and the output does not change
    rewrapped = order == "sparse_then_pack" and sparse_reasserts_each_step()
    assert patch.installs == (2 if rewrapped else 1) and patch.declined == declined * (2 if rewrapped else 1)
    where = _lines(caplog, "another attention override (newer_comfyui.make_sparse_override)")
    if order == "sparse_then_pack":
        assert where == ["lowvram_dit attention: model uses auto inside another attention override "
                         "(newer_comfyui.make_sparse_override): that override runs first and the calls it does "
                         "not take run auto"], caplog.text
    else:
        assert where == ["lowvram_dit attention: another attention override (newer_comfyui.make_sparse_override), "
                         "applied after the Attention node, runs first on this model; the calls it passes on to "
                         "the override it wrapped run auto"], caplog.text
    assert not _lines(caplog, "replaced")


@pytest.mark.parametrize("order", ["counting_then_pack", "pack_then_counting"])
def test_counting_override_and_pack_attention_compose(tiny_wan: Any, pack_calls: list, order: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """An override that takes nothing and chains: every call passes through it to the pack, bit for bit the
    pack's output."""
    from fixture_nodes.fixture_nodes import CountingOverride

    from comfyui_lowvram_dit.host.attention import apply_attention

    pack_only = _sample(apply_attention(tiny_wan, "auto"), seed=4)
    pack_calls.clear()

    def counting(model: Any) -> tuple[Any, CountingOverride]:
        m = model.clone()
        opts = m.model_options["transformer_options"]
        opts["optimized_attention_override"] = counter = CountingOverride(opts.get("optimized_attention_override"))
        return m, counter

    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        if order == "counting_then_pack":
            model, counter = counting(tiny_wan)
            model = apply_attention(model, "auto")
        else:
            model, counter = counting(apply_attention(tiny_wan, "auto"))
        out = _sample(model, seed=4)
    assert torch.equal(out, pack_only)
    total = 4 * CALLS_PER_STEP
    assert counter.calls == total and len(pack_calls) == total
    if order == "counting_then_pack":  # the pack is the function it falls back to
        assert counter.fallbacks == {"lowvram_dit auto": total} and counter.previous is None
    else:  # the pack is the override it wrapped; ComfyUI's own function is what it was handed
        assert type(counter.previous).__name__ == "AttentionOverride" and "lowvram_dit auto" not in counter.fallbacks
    lines = _lines(caplog, "another attention override (")
    assert len(lines) == 1 and "fixture_nodes.CountingOverride" in lines[0], lines


def test_comfy_default_keeps_the_other_override_and_a_second_node_replaces_only_the_pack(
        tiny_wan: Any, caplog: pytest.LogCaptureFixture) -> None:
    import comfy.patcher_extension as pe

    from comfyui_lowvram_dit.host.attention import OVERRIDE_KEY, ChainedOverride, apply_attention

    sparse, _ = _sparse(tiny_wan)
    ref = _sample(sparse, seed=5)
    auto = apply_attention(sparse, "auto")
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        math = apply_attention(auto, "SDPA math")
        default = apply_attention(auto, "ComfyUI default")
    top = math.model_options["transformer_options"][OVERRIDE_KEY]
    outer = sparse.model_options["transformer_options"][OVERRIDE_KEY]
    assert isinstance(top, ChainedOverride) and top.outer is outer and top.inner.backend == "sdpa_math"
    assert len(math.get_callbacks(pe.CallbacksMP.ON_PRE_RUN, OVERRIDE_KEY)) == 1  # the later node's watcher only
    assert default.model_options["transformer_options"][OVERRIDE_KEY] is outer
    assert torch.equal(_sample(default, seed=5), ref)  # ComfyUI's function under the sparse node, as alone
    assert _lines(caplog, "model uses ComfyUI default; another attention override "
                          "(newer_comfyui.make_sparse_override) stays on it and runs first")


def test_tensor_containers_reach_the_composed_override_as_tensors(tiny_wan: Any) -> None:
    """Newer Wan hands q/k/v to ComfyUI's attention in single-owner containers; wrap_attn unwraps them for an
    override without a container path, so the composed override sees tensors and gives the same result."""
    from comfy.ldm.modules import attention as core

    from comfyui_lowvram_dit.host.attention import OVERRIDE_KEY, ChainedOverride, apply_attention

    if not hasattr(core, "AttentionTensorContainer"):
        pytest.skip("this ComfyUI has no AttentionTensorContainer (0.33 and newer: the attention wrapper unwraps it)")
    model = apply_attention(_sparse(tiny_wan)[0], "auto")
    top = model.model_options["transformer_options"][OVERRIDE_KEY]
    assert isinstance(top, ChainedOverride) and not hasattr(top, "container_function")
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 32, 2 * 64, generator=g) for _ in range(3))
    opts = {OVERRIDE_KEY: top, "sigmas": torch.tensor([0.5])}
    ref = core.optimized_attention(q, k, v, heads=2, transformer_options=opts)
    boxed = [core.AttentionTensorContainer(t.clone()) for t in (q, k, v)]
    out = core.optimized_attention(*boxed, heads=2, transformer_options=opts)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert all(box.tensor is None for box in boxed)  # consumed, as their single owner expects


# ------------------------------------------------------------------------------------------------ server


def _graph(unet: str, chain: list[tuple[str, dict]], tag: str, seed: int) -> dict:
    """UNETLoader -> the nodes in ``chain`` (class, inputs) in order -> KSampler (4 steps) -> stats and counts."""
    g = {**chain_nodes({"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": "default"}}, chain),
         **sample_nodes(seed, steps=4, size=64, cond_length=12)}
    if any(cls.startswith("LowVRAMTest_") for cls, _ in chain):
        g["counts"] = {"class_type": "LowVRAMTest_AttentionCounts", "inputs": {"latent": ["7", 0], "tag": tag}}
    return g


def _close(a: dict, b: dict) -> bool:
    return all(a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-4) for k in ("mean", "std", "min", "max"))


def test_server_sparse_and_counting_overrides_compose_with_the_attention_node(comfy_server: Any) -> None:
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    tag = uuid.uuid4().hex[:8]
    unet = f"chain_wan_{tag}.safetensors"
    synth.write_synthetic("wan22_t2v_14B", comfy_server.base_dir / "models" / "diffusion_models" / unet, size="tiny")
    pack = ("LowVRAM_Attention", {"backend": "auto"})

    def sparse(name: str) -> tuple[str, dict]:
        return "LowVRAMTest_BlockSparseAttention", {"start_percent": 0.1, "tag": f"{name}_{tag}"}

    def counting(name: str) -> tuple[str, dict]:
        return "LowVRAMTest_CountingAttention", {"tag": f"{name}_{tag}"}

    def run(chain: list, name: str = "") -> tuple[dict, dict]:
        entry = comfy_server.run(_graph(unet, chain, f"{name}_{tag}", seed=21))
        counts = entry["outputs"].get("counts", {}).get("attention_counts", [{}])[0]
        return entry["outputs"]["8"]["latent_stats"][0], counts

    pack_only, _ = run([pack])
    alone, alone_counts = run([sparse("alone")], "alone")
    assert alone_counts["taken"] > 0 and alone_counts["declined"] > 0 and not _close(alone, pack_only)
    mark = len(comfy_server.log_text())
    for name, chain in (("sp_first", [sparse("sp_first"), pack]), ("sp_after", [pack, sparse("sp_after")])):
        stats, counts = run(chain, name)
        assert _close(stats, alone), (name, stats, alone)
        assert counts["taken"] == alone_counts["taken"], (name, counts)
    log = comfy_server.log_text()[mark:]
    assert log.count("model uses auto inside another attention override (newer_comfyui.make_sparse_override)") == 1
    assert log.count("another attention override (newer_comfyui.make_sparse_override), applied after the "
                     "Attention node, runs first") == 1
    for name, chain in (("ct_first", [counting("ct_first"), pack]), ("ct_after", [pack, counting("ct_after")])):
        stats, counts = run(chain, name)
        assert stats == pack_only, (name, stats, pack_only)
        assert counts["calls"] == 4 * CALLS_PER_STEP, (name, counts)
    assert "replaced another node's attention override" not in comfy_server.log_text()
