"""Block Swap inside ComfyUI: in-process patcher checks and a real server run (stock UNETLoader -> Block Swap ->
KSampler), an interrupt mid-sampling followed by a normal run, and a model switch. Needs COMFYUI_PATH.

On a CPU-only ComfyUI the node runs its CPU path when ``blocks_to_swap`` or ``vram_budget_gb`` is set (a CPU
"ring", synchronous copies): that is the path tested here; with neither set it passes the model through.
"""

from __future__ import annotations

import functools
import logging
import re
import time
import uuid

import pytest
import torch
from comfy_server import comfyui_in_process_or_skip, sample_wan

pytestmark = pytest.mark.comfyui


def _comfy():  # noqa: ANN202
    comfyui_in_process_or_skip()


def _tiny_wan_patcher(num_layers: int = 6, seed: int = 0):  # noqa: ANN202
    import comfy.sd

    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    sd = synth.synthetic_state_dict("wan21_t2v_1_3B", size="tiny", fmt="bf16", seed=seed, num_layers=num_layers)
    return comfy.sd.load_diffusion_model_state_dict(sd, {"dtype": torch.bfloat16})


_sample = functools.partial(sample_wan, cfg=2.0)  # the shared tiny-Wan KSampler path (tests/comfy_server.py)


def test_in_process_swapped_sampling_equals_plain_and_accounts_memory(caplog):  # noqa: ANN001
    _comfy()
    caplog.set_level(logging.INFO, logger="comfyui_lowvram_dit")
    import comfy.model_management as mm

    from comfyui_lowvram_dit.offload.plan import SwapConfig
    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY, apply_block_swap

    plain = _tiny_wan_patcher()
    ref = _sample(plain)
    swapped = apply_block_swap(plain, SwapConfig(blocks_to_swap=3, prefetch=1))
    ctl = swapped.attachments[SWAP_KEY]
    assert type(swapped).__name__.startswith("BlockSwap") and type(swapped.clone()) is type(swapped)
    out = _sample(swapped)
    assert torch.equal(out, ref)
    assert ctl.active and ctl.plan.streamed == (1, 3, 5) and ctl.streamer.stats.loads > 0
    # the activation line says how long ComfyUI's load of the resident part took (an expert switch's share)
    assert re.search(r"Block Swap: 3 of 6 blocks streamed .* activated in \d+\.\d\d s.*, after ComfyUI loaded the "
                     r"resident part in \d+\.\d\d s", caplog.text), caplog.text[-2000:]
    # ComfyUI accounts resident weights + ring, not the streamed blocks
    assert swapped.model_size() == ctl.gpu_bytes(ctl.plan) < ctl.full_bytes
    assert swapped.model.model_loaded_weight_memory >= ctl.plan.ring_bytes
    # a second sampler run reuses the plan; the wrap-around prefetch leaves nothing on demand after step 1
    out2 = _sample(swapped, steps=3)
    assert ctl.streamer.stats.on_demand == 0
    assert torch.equal(_sample(plain, steps=3), out2)  # switching back to the plain clone reloads cleanly
    mm.unload_all_models()
    assert not ctl.active and swapped.model.model_loaded_weight_memory == 0


def test_block_swap_leaves_for_activations_what_comfyui_leaves_in_its_own_partial_load(monkeypatch):  # noqa: ANN001
    """The budget's activation share is the single-batch estimate ComfyUI passes as ``minimum_memory_required``;
    the cond+uncond estimate (``memory_required``, about twice) would stream blocks that stock loading keeps."""
    _comfy()
    import comfy.model_management as mm

    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY, apply_block_swap
    from comfyui_lowvram_dit.offload.plan import SwapConfig

    asked = []
    load = mm.load_models_gpu

    def recording(models, memory_required=0, minimum_memory_required=None, **kw):  # noqa: ANN001, ANN202
        asked.append((memory_required, minimum_memory_required))
        return load(models, memory_required=memory_required, minimum_memory_required=minimum_memory_required, **kw)

    monkeypatch.setattr(mm, "load_models_gpu", recording)
    swapped = apply_block_swap(_tiny_wan_patcher(), SwapConfig(vram_budget_gb=4.0, prefetch=1))
    ctl = swapped.attachments[SWAP_KEY]
    _sample(swapped)  # cfg 2: a cond and an uncond
    mm.unload_all_models()
    full, minimum = asked[0]
    assert full > minimum > 0  # the two estimates differ, so the test tells them apart
    assert ctl.activation_bytes == int(minimum)


def test_in_process_interrupt_mid_step_leaves_the_model_usable():
    _comfy()
    import comfy.model_management as mm

    from comfyui_lowvram_dit.offload.plan import SwapConfig
    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY, apply_block_swap

    plain = _tiny_wan_patcher(seed=1)
    ref = _sample(plain, seed=3)
    swapped = apply_block_swap(plain, SwapConfig(blocks_to_swap=2, prefetch=2))
    ctl = swapped.attachments[SWAP_KEY]
    blocks = plain.model.diffusion_model.blocks
    victim = 4  # a streamed block (6 blocks, 2 streamed: midpoints 1 and 4): the interrupt fires while it is bound
    calls = {"n": 0}
    orig = blocks[victim].forward

    def flaky(*a, **k):  # noqa: ANN002, ANN003, ANN202
        calls["n"] += 1
        if calls["n"] == 2:
            mm.interrupt_current_processing(True)
            mm.throw_exception_if_processing_interrupted()
        return orig(*a, **k)

    blocks[victim].forward = flaky
    try:
        with pytest.raises(mm.InterruptProcessingException):
            _sample(swapped, seed=3)
    finally:
        blocks[victim].forward = orig
        mm.interrupt_current_processing(False)
    assert not ctl.streamer._bound  # nothing left bound to the ring
    assert torch.equal(_sample(swapped, seed=3), ref)
    mm.unload_all_models()


def test_in_process_verdict_once_per_load_never_on_plain_cpu_and_in_the_doctor(monkeypatch, caplog):  # noqa: ANN001
    _comfy()
    import comfy.model_management as mm
    from test_swap_verdict import TimedSync

    from comfyui_lowvram_dit.offload import engine as offload
    from comfyui_lowvram_dit.offload.plan import SwapConfig
    from comfyui_lowvram_dit.host import block_swap
    from comfyui_lowvram_dit.nodes import doctor

    monkeypatch.setattr(block_swap, "_measured", {})
    swapped = block_swap.apply_block_swap(_tiny_wan_patcher(seed=2), SwapConfig(blocks_to_swap=3))

    def lines(marker: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if marker in r.getMessage()]

    with caplog.at_level(logging.DEBUG, logger="comfyui_lowvram_dit"):
        _sample(swapped, steps=4)  # the CPU "ring": copies are synchronous, nothing is timed, nothing is claimed
        assert lines("Block Swap: 3 of 6 blocks streamed") and not lines("Block Swap measured")
        assert "nothing measured yet" in doctor.Doctor.execute(gpu_probes=False).result[0]
        mm.unload_all_models()
        caplog.clear()
        monkeypatch.setattr(offload, "_Sync", TimedSync)  # timing events standing in for CUDA's
        for steps in (4, 6):
            _sample(swapped, steps=steps)
        mm.unload_all_models()
    loads = lines("Block Swap: 3 of 6 blocks streamed")
    measured = [m.removeprefix("lowvram_dit ") for m in lines("Block Swap measured")]
    assert loads and len(measured) == len(loads)  # one line per load, not per step or per CFG call
    assert "the host copy is pageable" in measured[-1]  # a CPU arena is never pinned: the verdict says so
    assert "page-locking (it failed at load" in measured[-1]  # `pinned` is on: the verdict does not ask for it
    report = doctor.Doctor.execute(gpu_probes=False).result[0]
    assert measured[-1] in report and "nothing measured yet" not in report


def _write_tiny_wan(server, name: str, seed: int, num_layers: int = 6) -> str:  # noqa: ANN001
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    path = server.base_dir / "models" / "diffusion_models" / name
    synth.write_synthetic("wan21_t2v_1_3B", path, size="tiny", fmt="bf16", seed=seed, num_layers=num_layers)
    return name


def _graph(unet: str, seed: int, steps: int, swap: int | None, width: int = 64, frames: int = 5) -> dict:
    g = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": "default"}},
        "3": {"class_type": "LowVRAMTest_RandomConditioning", "inputs": {"seed": 1, "length": 12, "dim": 4096,
                                                                         "std": 1.0}},
        "4": {"class_type": "LowVRAMTest_RandomConditioning", "inputs": {"seed": 2, "length": 12, "dim": 4096,
                                                                         "std": 1.0}},
        "5": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": width, "height": 64, "length": frames,
                                                                   "batch_size": 1}},
        "6": {"class_type": "KSampler", "inputs": {"model": ["2", 0] if swap is not None else ["1", 0],
                                                    "seed": seed, "steps": steps, "cfg": 3.0,
                                                    "sampler_name": "euler", "scheduler": "simple",
                                                    "positive": ["3", 0], "negative": ["4", 0],
                                                    "latent_image": ["5", 0], "denoise": 1.0}},
        "7": {"class_type": "LowVRAMTest_LatentStats", "inputs": {"latent": ["6", 0]}},
    }
    if swap is not None:
        g["2"] = {"class_type": "LowVRAM_BlockSwap", "inputs": {
            "model": ["1", 0], "vram_budget_gb": 0.0, "blocks_to_swap": swap, "prefetch": 1, "pinned": True,
            "offload_embeddings": False, "debug": False}}
    return g


def _stats(entry: dict) -> dict:
    return entry["outputs"]["7"]["latent_stats"][0]


def test_server_block_swap_interrupt_and_model_switch(comfy_server):  # noqa: ANN001
    tag = uuid.uuid4().hex[:8]
    a = _write_tiny_wan(comfy_server, f"bs_a_{tag}.safetensors", seed=0)
    b = _write_tiny_wan(comfy_server, f"bs_b_{tag}.safetensors", seed=7)

    info = comfy_server.object_info("LowVRAM_BlockSwap")
    assert info, "LowVRAM_BlockSwap is not registered"
    for name in ("vram_budget_gb", "blocks_to_swap", "prefetch", "pinned", "offload_embeddings"):
        assert name in info["input"]["required"], name

    plain = _stats(comfy_server.run(_graph(a, seed=11, steps=3, swap=None)))
    swapped = _stats(comfy_server.run(_graph(a, seed=11, steps=3, swap=3)))
    assert swapped == plain  # exact on CPU: same kernels, same order
    assert "Block Swap: 3 of 6 blocks streamed" in comfy_server.log_text()
    assert "Block Swap measured" not in comfy_server.log_text()  # a CPU run claims no copy/compute timings

    # interrupt mid-sampling: a long run, interrupted once the sampler is under way
    status, reply = comfy_server.post_prompt(_graph(a, seed=12, steps=10000, swap=2, width=96, frames=9))
    assert status == 200, reply
    pid = reply["prompt_id"]
    mark = len(comfy_server.log_text())
    deadline = time.monotonic() + 120
    while "Block Swap: 2 of 6 blocks streamed" not in comfy_server.log_text()[mark - 2000:]:
        assert time.monotonic() < deadline, "the long run never reached the sampler"
        time.sleep(0.1)
    time.sleep(1.0)
    comfy_server.interrupt()
    deadline = time.monotonic() + 120
    while True:
        entry = comfy_server.get(f"/history/{pid}").get(pid)
        if entry and entry.get("status", {}).get("status_str") in ("success", "error"):
            break
        assert time.monotonic() < deadline, "interrupt was not honoured"
        time.sleep(0.1)
    kinds = [k for k, _ in entry["status"].get("messages", [])]
    assert "execution_interrupted" in kinds, kinds

    # the model is still usable and gives the same answer as before
    again = _stats(comfy_server.run(_graph(a, seed=11, steps=3, swap=3)))
    assert again == plain

    # model switch: another checkpoint through Block Swap, then back
    other = _stats(comfy_server.run(_graph(b, seed=11, steps=3, swap=2)))
    assert other != plain and other["finite"]
    assert _stats(comfy_server.run(_graph(a, seed=11, steps=3, swap=3))) == plain
    comfy_server.free()
    assert _stats(comfy_server.run(_graph(a, seed=11, steps=3, swap=None))) == plain


def _second_block_swap():  # noqa: ANN202 - (first, second) Block Swap MODELs, the second applied to the first
    from comfyui_lowvram_dit.host.block_swap import apply_block_swap
    from comfyui_lowvram_dit.offload.plan import SwapConfig

    first = apply_block_swap(_tiny_wan_patcher(seed=4), SwapConfig(blocks_to_swap=2))
    return first, apply_block_swap(first, SwapConfig(blocks_to_swap=4, prefetch=2))


def test_a_second_block_swap_replaces_the_first_controller_hook_and_wrapper():
    """Two Block Swap nodes in a chain (or one re-run on a model that already has it): only the last one is left."""
    _comfy()
    import comfy.patcher_extension as pe

    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY
    from comfyui_lowvram_dit.host.hooks import hook_registry

    first, second = _second_block_swap()
    ctl = second.attachments[SWAP_KEY]
    assert ctl is not first.attachments[SWAP_KEY] and ctl.config.blocks_to_swap == 4
    prepare = second.get_wrappers(pe.WrappersMP.PREPARE_SAMPLING, SWAP_KEY)
    assert len(prepare) == 1 and prepare[0].ctl is ctl
    assert hook_registry(second).get(SWAP_KEY).owner is ctl
    out = _sample(second)
    assert ctl.active and len(ctl.plan.streamed) == 4 and not first.attachments[SWAP_KEY].active
    assert torch.equal(out, _sample(_tiny_wan_patcher(seed=4)))


def test_a_second_block_swap_replaces_the_first_multigpu_callbacks():
    """ComfyUI's ``add_callback_with_key`` appends: without taking the first Block Swap's MultiGPU callbacks off,
    every model copy for another GPU would be set up twice, the first time with the replaced settings."""
    _comfy()
    import comfy.patcher_extension as pe

    from comfyui_lowvram_dit.host.block_swap import MULTIGPU_CALLBACKS, SWAP_KEY

    kinds = [getattr(pe.CallbacksMP, k) for k in MULTIGPU_CALLBACKS if hasattr(pe.CallbacksMP, k)]
    if not kinds:
        pytest.skip(f"this ComfyUI has no MultiGPU clone callbacks ({', '.join(MULTIGPU_CALLBACKS)}; 0.23+)")
    _, second = _second_block_swap()
    ctl = second.attachments[SWAP_KEY]
    for kind in kinds:
        callbacks = second.get_callbacks(kind, SWAP_KEY)
        assert len(callbacks) == 1 and callbacks[0].hook.owner is ctl, (kind, len(callbacks))


def test_a_block_swap_lora_model_then_the_plain_model_samples_without_the_lora():
    """ComfyUI detaches the Block Swap + LoRA clone without unpatching when a plain clone of the same weights loads;
    the LoRA merged into the streamed blocks' arena must not reach that clone (it unpatches from the shared backup)."""
    _comfy()
    import comfy.model_management as mm
    import comfy.sd

    from comfyui_lowvram_dit.host.block_swap import apply_block_swap
    from comfyui_lowvram_dit.offload.plan import SwapConfig
    from comfyui_lowvram_dit.synthetic.lora import synthetic_lora

    plain = _tiny_wan_patcher(num_layers=2, seed=5)
    lora_sd = synthetic_lora("wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors", size="tiny")
    ref = _sample(plain)
    with_lora = comfy.sd.load_lora_for_models(plain, None, lora_sd, 3.0, 0)[0]
    ref_lora = _sample(with_lora)
    assert not torch.equal(ref, ref_lora)
    assert torch.equal(_sample(apply_block_swap(with_lora, SwapConfig(blocks_to_swap=1))), ref_lora)
    assert torch.equal(_sample(plain), ref)
    mm.unload_all_models()
