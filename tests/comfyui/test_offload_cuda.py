"""GPU tests for offload/engine.py (and the Block Swap patcher): bit-exact swapped == resident, no CPU sync in the
loop, memory within the plan, pinned arena, overlap counters. The lead runs them on an H100:

    python -m pytest tests/comfyui/test_offload_cuda.py -q -m cuda
    COMFYUI_PATH=/path/to/ComfyUI python -m pytest tests/comfyui/test_offload_cuda.py -q -m cuda   (adds the ComfyUI test)
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from test_offload import TinyWan, _inputs

from comfyui_lowvram_dit.offload import engine as offload
from comfyui_lowvram_dit.offload.plan import SwapConfig, plan_swap
from comfyui_lowvram_dit.offload.engine import BlockStreamer

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")
D, FFN, N = 1024, 4096, 12  # ~25 MB bf16 per block: big enough for real async copies, small for CI


def _model(fp8: bool) -> TinyWan:
    """bf16 blocks, or fp8 `weight` + fp32 `weight_scale` layers (B2's contract) with fp32 everything else."""
    torch.manual_seed(0)
    model = TinyWan(n=N, d=D, ffn=FFN, fp8=fp8).eval()
    return model if fp8 else model.to(torch.bfloat16)


def _gpu_model(fp8: bool, swap: int, prefetch: int = 1):  # noqa: ANN202
    """Resident blocks on the GPU, streamed blocks left on the CPU (what the patcher's load does)."""
    model = _model(fp8)
    plan = plan_swap([offload.block_nbytes(b) for b in model.blocks], SwapConfig(blocks_to_swap=swap, prefetch=prefetch))
    for i, b in enumerate(model.blocks):
        if i not in plan.streamed:
            b.to(CUDA)
    return model, plan


def _gpu_inputs(dtype: torch.dtype):  # noqa: ANN202
    return tuple(t.to(CUDA, dtype) for t in _inputs(D, batch=2))


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("swap,prefetch", [(4, 1), (12, 2), (6, 3)])
def test_swapped_equals_resident_bit_exact(fp8, swap, prefetch):
    dtype = torch.float32 if fp8 else torch.bfloat16
    ref_model = _model(fp8).to(CUDA)
    x, e, ctx = _gpu_inputs(dtype)
    with torch.no_grad():
        ref = ref_model(x, e, ctx)
    model, plan = _gpu_model(fp8, swap, prefetch)
    st = BlockStreamer(model.blocks, plan, CUDA, pinned=True)
    st.activate()
    assert st.arena.pinned and st.arena.buffer.is_pinned()
    with torch.no_grad():
        for _ in range(3):
            st.begin_forward()
            out = model(x, e, ctx, streamer=st)
            stats = st.end_forward()
            assert torch.equal(out, ref)
            assert stats.on_demand == 0
    st.release()


def test_no_cpu_synchronization_in_the_loop():
    model, plan = _gpu_model(False, 6, 1)
    st = BlockStreamer(model.blocks, plan, CUDA, pinned=True)
    st.activate()
    x, e, ctx = _gpu_inputs(torch.bfloat16)
    with torch.no_grad():
        st.begin_forward()
        model(x, e, ctx, streamer=st)  # warm-up (cuBLAS handles, lazy inits may sync)
        st.end_forward()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        measured = []
        try:
            for _ in range(3):  # forwards 2 and 3 are timed for the load's verdict: events queried, never waited
                st.begin_forward()
                model(x, e, ctx, streamer=st)
                st.end_forward()
                measured += st.take_measurement()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    calls = measured or st.take_measurement(wait=True)
    assert len(calls) == 2 and st.take_measurement(wait=True) == []  # handed over once
    for c in calls:
        assert c.timed and c.copies == c.blocks_run == len(plan.streamed)
        assert 0 < c.compute_ms < c.call_ms and c.transfer_ms > 0 and 0 <= c.stall_ms < c.call_ms
    torch.cuda.synchronize()
    st.release()


def test_memory_within_plan_and_no_allocator_churn():
    x, e, ctx = _gpu_inputs(torch.bfloat16)
    resident = _model(False).to(CUDA)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        resident(x, e, ctx)
    resident_peak = torch.cuda.max_memory_allocated()  # inputs + all weights + activations
    del resident
    torch.cuda.empty_cache()

    model, plan = _gpu_model(False, 8, 1)
    st = BlockStreamer(model.blocks, plan, CUDA, pinned=True)
    st.activate()
    with torch.no_grad():
        st.begin_forward()
        model(x, e, ctx, streamer=st)
        st.end_forward()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        reserved = torch.cuda.memory_reserved()
        for _ in range(3):
            st.begin_forward()
            model(x, e, ctx, streamer=st)
            st.end_forward()
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    block = sum(p.numel() * p.element_size() for p in model.blocks[0].state_dict().values())
    expected = resident_peak - len(plan.streamed) * block + plan.ring_bytes  # streamed blocks out, ring in
    assert peak <= expected + 2**20, (peak, resident_peak, expected)
    assert torch.cuda.memory_reserved() == reserved  # no allocator growth across forwards
    st.release()


def test_debug_reports_transfer_and_overlap():
    model, plan = _gpu_model(False, 4, 1)
    st = BlockStreamer(model.blocks, plan, CUDA, pinned=True, debug=True)
    st.activate()
    x, e, ctx = _gpu_inputs(torch.bfloat16)
    with torch.no_grad():
        for _ in range(2):
            st.begin_forward()
            model(x, e, ctx, streamer=st)
            stats = st.end_forward()
    assert stats.transfer_ms > 0 and stats.compute_ms > 0 and 0.0 <= stats.overlap <= 1.0
    assert set(stats.per_block) >= set(plan.streamed)
    assert "overlap" in offload.format_stats(stats)
    st.release()


@pytest.mark.skipif(not os.environ.get("COMFYUI_PATH"), reason="COMFYUI_PATH not set")
def test_comfyui_block_swap_on_gpu_matches_plain_and_frees_the_ring():
    import comfy_native
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    comfy = comfy_native.import_comfy(cpu=False)
    mm = comfy.model_management
    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY, apply_block_swap

    sd = synth.synthetic_state_dict("wan21_t2v_1_3B", size="full", fmt="bf16", seed=0, device="cuda")
    plain = comfy.sd.load_diffusion_model_state_dict(sd, {"dtype": torch.bfloat16})
    inputs = comfy_native.wan_inputs(plain, 480, 320, 9)
    mm.load_models_gpu([plain])
    comfy_native.forward(plain, inputs)  # a process's first forward times the kernel choices, with other candidates
    ref = comfy_native.forward(plain, inputs)
    swapped = apply_block_swap(plain, SwapConfig(blocks_to_swap=20, prefetch=2))
    mm.load_models_gpu([swapped])
    ctl = swapped.attachments[SWAP_KEY]
    assert ctl.active and len(ctl.plan.streamed) == 20
    streamed = ctl.blocks[ctl.plan.streamed[0]]
    assert next(streamed.parameters()).device.type == "cpu"  # ComfyUI did not load the streamed blocks
    for _ in range(2):
        out = comfy_native.forward(swapped, inputs)
        assert torch.equal(out, ref)
    assert ctl.streamer.stats.on_demand == 0
    ring = ctl.plan.ring_bytes
    assert swapped.model.model_loaded_weight_memory >= ring  # the memory manager sees the ring
    before = torch.cuda.memory_allocated()
    mm.unload_all_models()
    torch.cuda.synchronize()
    assert not ctl.active and torch.cuda.memory_allocated() <= before - ring


def test_an_expert_switch_filled_beside_the_first_forward_equals_the_fill_at_load(tmp_path, monkeypatch):
    """Two LoRA'd experts of one layout from mapped fp8 files (Wan 2.2's switch, 1.3B-sized), alternating: from the
    second load on, each arena is the memory the other expert dropped (pinned), and it is copied beside the first
    forward (offload/arena_fill.py), which merges the LoRA in the ring slots. Every forward equals the same sequence
    filled at load, bit for bit, and the merged arenas hold the bytes a merge into the arena at load (a weights read,
    ``force_patch_weights``) writes."""
    import comfy_native
    from test_comfyui_lora_fp8 import wan_lora

    from comfyui_lowvram_dit.host import block_swap
    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY, apply_block_swap
    from comfyui_lowvram_dit.host.wan_loader import load_wan_model
    from comfyui_lowvram_dit.offload import host_memory
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    comfy = comfy_native.import_comfy(cpu=False)
    mm = comfy.model_management
    name = "wan21_t2v_1_3B"
    paths = [tmp_path / f"expert{i}.safetensors" for i in range(2)]
    for i, path in enumerate(paths):
        synth.write_synthetic(name, path, size="full", fmt="fp8_scaled", seed=i)
    lora = wan_lora(synth.synthetic_state_dict(name, size="full", fmt="bf16", seed=0), style="lightx2v", rank=16)

    def experts() -> list:  # noqa: ANN202
        out = []
        for path in paths:
            model = apply_block_swap(load_wan_model(path, "per_tensor", 128, "auto"),
                                     SwapConfig(blocks_to_swap=24, prefetch=2))
            out.append(comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0)[0])
        return out

    def digest(model) -> str:  # noqa: ANN001
        ctl = model.attachments[SWAP_KEY]
        streamed = [model.model.diffusion_model.blocks[b].state_dict() for b in ctl.plan.streamed]
        return hashlib.sha256(b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes()
                                       for sd in streamed for _, t in sorted(sd.items()))).hexdigest()

    def read_at_load() -> list[str]:
        host_memory.release_spares()
        out = []
        for model in experts():
            mm.load_models_gpu([model], force_patch_weights=True)
            assert model.attachments[SWAP_KEY].lora.is_current(model)
            out.append(digest(model))
            mm.unload_all_models()
        return out

    def run(beside: bool) -> list[tuple[torch.Tensor, str, bool]]:
        monkeypatch.setattr(block_swap, "fills_beside_forward", lambda device: beside and device.type == "cuda")
        host_memory.release_spares()  # the first expert's arena is a fresh one in both runs
        models = experts()
        inputs = comfy_native.wan_inputs(models[0], 480, 320, 9)
        outs = []
        for model in models + models:
            mm.load_models_gpu([model])
            ctl = model.attachments[SWAP_KEY]
            out = comfy_native.forward(model, inputs)
            assert ctl.lora.is_current(model) and ctl.lora.in_ring
            outs.append((out, digest(model), ctl.streamer.took["background"]))
            mm.unload_all_models()
        return outs

    run(False)  # a process's first forwards time the kernel choices (and may compute with another candidate)
    eager, beside = run(False), run(True)
    assert [digest for _, digest, _ in eager] == read_at_load() * 2
    assert [b for *_, b in eager] == [False] * 4 and [b for *_, b in beside] == [False, True, True, True]
    assert all(a[1] == b[1] for a, b in zip(eager, beside))  # the merged arenas hold the same bytes
    assert all(torch.equal(a[0], b[0]) for a, b in zip(eager, beside))
    assert not torch.equal(eager[0][0], eager[1][0])


@pytest.mark.parametrize("style", ["lightx2v", "kijai"])
def test_the_lora_merge_in_the_ring_never_waits_for_the_gpu(tmp_path, style):
    """The first forward after a load merges each streamed block's LoRA in its ring slot: on the forward's thread,
    so it must not synchronize with the GPU (a sync per weight would stall the forward on every block). Each block
    but the last goes through the engine's before/after_block with sync debug mode on (the last one reads the fp8
    clip checks once, on purpose); the merged blocks equal a merge into the arena at load."""
    import comfy_native
    from test_comfyui_lora_fp8 import wan_lora

    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY, apply_block_swap
    from comfyui_lowvram_dit.host.wan_loader import load_wan_model
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    comfy = comfy_native.import_comfy(cpu=False)
    mm = comfy.model_management
    path = tmp_path / "expert.safetensors"
    synth.write_synthetic("wan21_t2v_1_3B", path, size="tiny", fmt="fp8_scaled", seed=0)
    lora = wan_lora(synth.synthetic_state_dict("wan21_t2v_1_3B", size="tiny", fmt="bf16", seed=0), style=style)

    def expert():  # noqa: ANN202
        model = apply_block_swap(load_wan_model(path, "per_tensor", 128, "auto"), SwapConfig(blocks_to_swap=99))
        return comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0)[0]

    def streamed_bytes(model) -> list[torch.Tensor]:  # noqa: ANN001
        ctl = model.attachments[SWAP_KEY]
        return [t.reshape(-1).view(torch.uint8).clone() for b in ctl.plan.streamed
                for _, t in sorted(model.model.diffusion_model.blocks[b].state_dict().items())]

    reference = expert()
    mm.load_models_gpu([reference], force_patch_weights=True)
    expected = streamed_bytes(reference)
    mm.unload_all_models()
    model = expert()
    mm.load_models_gpu([model])
    ctl = model.attachments[SWAP_KEY]
    st, order = ctl.streamer, list(ctl.plan.streamed)
    assert st.ring_fill is not None and len(order) > 1
    torch.cuda.synchronize()
    with torch.inference_mode():
        st.begin_forward()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for b in order[:-1]:
                st.before_block(b)
                st.after_block(b)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        st.before_block(order[-1])
        st.after_block(order[-1])
        st.end_forward()
    assert ctl.lora.is_current(model) and ctl.lora.in_ring and st.ring_fill is None
    got = streamed_bytes(model)
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))
    mm.unload_all_models()
