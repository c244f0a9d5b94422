"""Interrupting a sampler mid-step with Block Swap AND Torch Compile active leaves the model usable and its memory
accounted. Needs COMFYUI_PATH.

Two levels:
- in process: a tiny Wan through ``apply_block_swap`` -> ``apply_compile`` (real dynamo, a pass-through backend
  so it runs in seconds); an interrupt raised inside a streamed block's swap patch, i.e. with the block's ring
  slot bound and the compiled regions swapped into the model. Afterwards the ring holds nothing, the model holds
  its own modules again, the accounting still matches the plan, the next run gives the reference answer without
  recompiling, and unloading returns every byte.
- on the server: Wan Loader (fp8) -> Block Swap (3 of 6 blocks streamed, the CPU test path) -> Attention -> Torch Compile
  (inductor: block swap replaces any CUDA-graph choice with inductor/default, so that is what runs) -> KSampler,
  a 10000-step prompt interrupted once sampling is under way, the same graph run to completion, a switch to
  another model and back. Checked: identical results, finite output, no traceback / compile fallback / ComfyUI
  leak warning in the log, and ComfyUI's own load accounting ("loaded completely; ... MB loaded") equal to the
  resident weights at every load of the swapped model.

Inductor compiling the block on the CPU dominates the server test's time.
"""

from __future__ import annotations

import functools
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from comfy_server import ComfyServer, comfyui_in_process_or_skip, loader_swap_nodes, sample_nodes, sample_wan

pytestmark = pytest.mark.comfyui

NUM_LAYERS = 6
SWAPPED = 3  # blocks_to_swap: streams blocks 1, 3 and 5 of 6 (kernels/swap_plan.plan_swap spreads them)


# ------------------------------------------------------------------------------------------------ in process


def _comfy() -> None:
    comfyui_in_process_or_skip()


def _tiny_wan_patcher(seed: int = 0) -> Any:
    import comfy.sd
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    sd = synth.synthetic_state_dict("wan21_t2v_1_3B", size="tiny", fmt="bf16", seed=seed, num_layers=NUM_LAYERS)
    return comfy.sd.load_diffusion_model_state_dict(sd, {"dtype": torch.bfloat16})


_sample = functools.partial(sample_wan, steps=3)  # the shared tiny-Wan KSampler path (tests/comfy_server.py)


class _PassThroughCompiler:
    """compile_fn for apply_compile: real dynamo tracing and guards, the traced graph run as is (no codegen)."""

    def __init__(self) -> None:
        self.graphs = 0

        def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
            self.graphs += 1
            return gm.forward

        # one backend object for every region, as with backend="inductor": blocks share their graphs (a new
        # callable per region, even a fresh bound method, fails dynamo's backend-match guard: one compile per block)
        self.backend = backend

    def __call__(self, module: torch.nn.Module, **kw: Any) -> Any:
        return torch.compile(module, backend=self.backend,
                             options={"guard_filter_fn": kw["options"]["guard_filter_fn"]},
                             dynamic=kw["dynamic"], fullgraph=kw["fullgraph"])


class _InterruptOnce:
    """A ``("double_block", i)`` patch that raises ComfyUI's interrupt on its n-th call (then runs the block)."""

    def __init__(self, on_call: int) -> None:
        self.on_call, self.calls = on_call, 0

    def __deepcopy__(self, memo: dict) -> _InterruptOnce:
        return self  # clones deep-copy model_options: keep one counter

    def __call__(self, args: dict, extra: dict) -> dict:
        import comfy.model_management as mm

        self.calls += 1
        if self.calls == self.on_call:
            mm.interrupt_current_processing(True)
            mm.throw_exception_if_processing_interrupted()  # what ComfyUI's ops and progress hook call
        return extra["original_block"](args)


@pytest.fixture
def fresh_selector() -> Iterator[Any]:
    """A fresh process-wide attention selector for the whole test (compiled graphs guard on its decisions)."""
    from comfyui_lowvram_dit.kernels import attention as ak

    with ak.isolated_selector() as sel:
        yield sel


def test_in_process_interrupt_with_swap_and_compile_restores_model_and_accounting(fresh_selector: Any) -> None:
    _comfy()
    import comfy.model_management as mm
    from comfyui_lowvram_dit.kernels.compile import CompileConfig
    from comfyui_lowvram_dit.offload.plan import SwapConfig
    from comfyui_lowvram_dit.host.attention import apply_attention
    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY, apply_block_swap
    from comfyui_lowvram_dit.host.torch_compile import COMPILE_KEY, apply_compile

    torch._dynamo.reset()
    plain = _tiny_wan_patcher(seed=2)
    ref = _sample(plain, seed=4)
    victim = 3  # a streamed block: the interrupt fires while its ring slot is bound
    flaky = _InterruptOnce(on_call=2)  # second forward = mid-sampling, after the first (compiling) call
    plain.set_model_patch_replace(flaky, "dit", "double_block", victim)  # Block Swap wraps it (inner patch)
    swapped = apply_block_swap(plain, SwapConfig(blocks_to_swap=SWAPPED, prefetch=1))
    # the attention override keeps ComfyUI's CPU attention (sub-quadratic, which graph-breaks on a psutil call
    # in every block) out of the traced blocks: half the tracing time here
    compiler = _PassThroughCompiler()
    model = apply_compile(apply_attention(swapped, "auto"), CompileConfig(), "blocks", compile_fn=compiler)
    ctl, regions = model.attachments[SWAP_KEY], model.attachments[COMPILE_KEY]
    blocks = model.model.diffusion_model.blocks
    originals = list(blocks)

    with pytest.raises(mm.InterruptProcessingException):
        try:
            _sample(model, seed=4)
        finally:
            mm.interrupt_current_processing(False)
    assert flaky.calls == 2 and compiler.graphs >= 1, (flaky.calls, compiler.graphs)
    assert ctl.plan is not None and victim in ctl.plan.streamed, ctl.plan
    # nothing left half-done: no ring slot bound, the model holds its own blocks, no compiled wrapper leaks out
    assert not ctl.streamer._bound, ctl.streamer._bound
    assert all(a is b for a, b in zip(blocks, originals)) and len(blocks) == NUM_LAYERS
    assert not [k for k in model.model_state_dict() if "_orig_mod" in k]
    # still loaded and accounted as planned: resident weights + ring, never the streamed blocks
    assert ctl.active, "the interrupt deactivated the ring (the next run would re-plan)"
    assert model.model_size() == ctl.gpu_bytes(ctl.plan) < ctl.full_bytes
    loaded = model.model.model_loaded_weight_memory
    assert loaded >= ctl.plan.ring_bytes, (loaded, ctl.plan.ring_bytes)

    graphs = compiler.graphs
    out = _sample(model, seed=4)  # the same sampler run again: completes, reference answer, no recompile
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert torch.isfinite(out).all()
    assert compiler.graphs == graphs, f"recompiled after the interrupt ({graphs} -> {compiler.graphs} graphs)"
    assert not ctl.streamer._bound and ctl.streamer.stats.loads > 0
    assert model.model.model_loaded_weight_memory == loaded, "accounting drifted across the interrupt"
    assert regions.current is not None and regions.current.describe() == "inductor/default", regions.status()
    mm.unload_all_models()
    assert not ctl.active and model.model.model_loaded_weight_memory == 0


# ---------------------------------------------------------------------------------------------------- server


def _write_wan(server: ComfyServer, name: str, seed: int) -> str:
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    synth.write_synthetic("wan21_t2v_1_3B", server.base_dir / "models" / "diffusion_models" / name, size="tiny",
                          fmt="bf16", seed=seed, num_layers=NUM_LAYERS)
    return name


def _graph(unet: str, seed: int, steps: int) -> dict:
    """Wan Loader (fp8) -> Block Swap -> Attention -> Torch Compile -> KSampler -> LatentStats; random conditioning.

    The Attention node keeps ComfyUI's CPU attention (sub-quadratic, graph-breaking on a psutil call) out of
    the compiled blocks, which roughly halves the compile time here."""
    return {
        **loader_swap_nodes(unet, SWAPPED),
        "9": {"class_type": "LowVRAM_Attention", "inputs": {"model": ["2", 0], "backend": "auto"}},
        "3": {"class_type": "LowVRAM_TorchCompile", "inputs": {
            "model": ["9", 0], "mode": "default", "backend": "inductor", "dynamic": "auto", "fullgraph": False,
            "cache_size_limit": 16, "fallback": True, "scope": "blocks"}},
        **sample_nodes(seed, steps, size=64, cond_length=12),
        "10": {"class_type": "LowVRAMTest_ModelInfo", "inputs": {"model": ["1", 0]}},  # whole model
        "11": {"class_type": "LowVRAMTest_ModelInfo", "inputs": {"model": ["3", 0]}},  # swapped + compiled
    }


def _run(server: ComfyServer, graph: dict, sizes: list | None = None) -> dict:
    """Run ``graph``; assert the sampler really executed (not served from cache); return its latent stats.

    ``sizes`` collects (whole model, swapped model) ``model_size()`` bytes when the loader ran this time."""
    entry = server.run(graph, timeout=300)
    cached = [m.get("nodes", []) for k, m in entry["status"].get("messages", []) if k == "execution_cached"]
    assert not any("7" in nodes for nodes in cached), f"KSampler was served from cache: {cached}"
    stats = entry["outputs"]["8"]["latent_stats"][0]
    assert stats["finite"], stats
    if sizes is not None and "10" in entry["outputs"]:
        sizes.append(tuple(entry["outputs"][n]["model_info"][0]["model_size_bytes"] for n in ("10", "11")))
    return stats


def _wait_for(server: ComfyServer, pattern: str, since: int, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    rx = re.compile(pattern)
    while not rx.search(server.log_text()[since:]):
        assert server.proc.poll() is None, f"ComfyUI exited while waiting for {what}"
        assert time.monotonic() < deadline, f"{what} not seen in {timeout:.0f} s; log tail:\n" \
                                            f"{server.log_text()[-3000:]}"
        time.sleep(0.1)


def _interrupt_when_sampling(server: ComfyServer, graph: dict) -> dict:
    """Queue ``graph`` (many steps), interrupt it after a few sampler steps; return its history entry."""
    mark = len(server.log_text())
    status, reply = server.post_prompt(graph)
    assert status == 200, reply
    pid = reply["prompt_id"]
    steps = graph["7"]["inputs"]["steps"]
    # tqdm's "k/steps" counter reaches the log (stderr) once per step: interrupt inside the sampling loop
    _wait_for(server, rf"\b[2-9]/{steps}\b", mark, 120, "the second sampler step")
    server.interrupt()
    deadline = time.monotonic() + 60
    while True:
        entry = server.get(f"/history/{pid}").get(pid)
        if entry and entry.get("status", {}).get("status_str") in ("success", "error"):
            return entry
        assert time.monotonic() < deadline, "interrupt was not honoured in 60 s"
        time.sleep(0.1)


def _loaded_mb(log: str) -> list[float]:
    """ComfyUI's accounting of each model load: the "MB loaded" figure of its "loaded ..." log lines (0.8.0 also
    names the usable MB first; newer ComfyUI does not)."""
    return [float(x) for x in re.findall(
        r"loaded (?:completely|partially);(?: [\d.]+ MB usable,)?\s+([\d.]+) MB loaded", log)]


def test_server_interrupt_with_block_swap_and_compile_then_switch_models(comfy_server: ComfyServer) -> None:
    tag = uuid.uuid4().hex[:8]
    a = _write_wan(comfy_server, f"ic_a_{tag}.safetensors", seed=0)
    b = _write_wan(comfy_server, f"ic_b_{tag}.safetensors", seed=7)
    start = len(comfy_server.log_text())

    sizes: list[tuple[int, int]] = []
    ref = _run(comfy_server, _graph(a, seed=11, steps=2), sizes)  # compiles (inductor, ~17-40 s on 2 cores)
    log = comfy_server.log_text()[start:]
    assert f"Block Swap: {SWAPPED} of {NUM_LAYERS} blocks streamed" in log, log[-3000:]
    assert "torch.compile inductor/default: running inductor/default over" in log, log[-3000:]
    first_load = _loaded_mb(log)
    assert first_load, f"no ComfyUI 'loaded ...' accounting line for the swapped model:\n{log[-3000:]}"

    entry = _interrupt_when_sampling(comfy_server, _graph(a, seed=12, steps=10000))
    kinds = [k for k, _ in entry["status"].get("messages", [])]
    assert "execution_interrupted" in kinds, kinds
    interrupted_at = next(m for k, m in entry["status"]["messages"] if k == "execution_interrupted")
    assert interrupted_at["node_type"] == "KSampler", interrupted_at

    again = _run(comfy_server, _graph(a, seed=11, steps=2))  # same graph, to completion, same answer
    assert again == ref, (again, ref)

    other = _run(comfy_server, _graph(b, seed=11, steps=2), sizes)  # model switch (compiles b's blocks)
    assert other != ref
    back = _run(comfy_server, _graph(a, seed=11, steps=2), sizes)
    assert back == ref, (back, ref)

    log = comfy_server.log_text()[start:]
    assert "Processing interrupted" in log
    assert "Traceback" not in log, log[log.index("Traceback") - 500:][:4000]
    assert "Potential memory leak" not in log, "ComfyUI found a model kept alive after its patcher died"
    assert not re.search(r"lowvram_dit compile: .* failed", log), "compile fell back: " + log[-3000:]
    assert "model ran without a load" not in log, "Block Swap ran a forward without ComfyUI loading the model"
    # ComfyUI's accounting of every load of a swapped model: the resident weights (2 of 4 blocks + embeddings,
    # the same file layout for a and b), never the whole model; equal at every load, before and after the
    # interrupt and the switch.
    loads = _loaded_mb(log)
    assert len(loads) >= 3 and len(set(loads)) == 1, f"per-load 'MB loaded' differs: {loads}"
    # what the pack tells ComfyUI to budget: whole model minus the streamed blocks plus a 2-block ring; the
    # six blocks are the same size, so block = whole - swapped and the stock loader moved whole - 3 blocks
    # (less the per-block `modulation` params, which no leaf module owns: a few KB here)
    assert len(set(sizes)) == 1 and len(sizes) == 3, sizes
    whole, swapped = sizes[0]
    block = whole - swapped
    assert block > 0, sizes
    resident = whole - SWAPPED * block
    assert resident * 0.97 <= loads[0] * 2**20 <= resident, (loads[0] * 2**20, resident, sizes)
