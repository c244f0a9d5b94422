"""The pack's nodes under ComfyUI's own MultiGPU CFG split, on the CPU with two fake devices. Needs COMFYUI_PATH.

ComfyUI (0.23+) deep-clones the model for every extra device (``cached_patcher_init``), then runs cond and uncond
on the devices in one thread each (comfy/samplers.py ``_calc_cond_batch_multigpu``). Here the devices are
``cpu`` and ``cpu:0``: two distinct device keys whose tensors live in the same memory, so the whole split path
(deep clone, clone callbacks, thread pool, per-device patchers) runs without GPUs. The split output must equal
the single-device output exactly, and every per-model piece of state (Block Swap's ring and plan, NaN Guard's
record) must belong to the model copy that uses it.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from comfy_server import comfyui_in_process_or_skip, sample_wan

pytestmark = pytest.mark.comfyui

_sample = functools.partial(sample_wan, cfg=3.0, steps=2, frames=1)
FAKE_SECOND = torch.device("cpu", 0)
# CPU GEMMs block a batch of one and of two differently, so even native's split differs from its one-device run by
# rounding (about 3e-7 relative here); a wrong computation on one device is orders of magnitude above this.
CPU_GEMM_TOLERANCE = 1e-5


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture
def two_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """ComfyUI sees two devices: its own CPU device and ``cpu:0``."""
    comfyui_in_process_or_skip()
    import comfy.model_management as mm

    try:
        import comfy.multigpu  # noqa: F401
    except ImportError:
        pytest.skip("this ComfyUI has no MultiGPU work units (comfy/multigpu.py, ComfyUI 0.23+)")
    monkeypatch.setattr(mm, "get_all_torch_devices",
                        lambda exclude_current=False: [mm.get_torch_device(), FAKE_SECOND])
    yield
    mm.unload_all_models()


@pytest.fixture(scope="module")
def wan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    comfyui_in_process_or_skip()
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    path = tmp_path_factory.mktemp("multigpu") / "wan_tiny.safetensors"
    return synth.write_synthetic("wan21_t2v_1_3B", path, size="tiny", fmt="bf16", seed=7, num_layers=4)


def _split(model):  # noqa: ANN001, ANN202 - ModelPatcher in, (split ModelPatcher, the copy for cpu:0) out
    import comfy.multigpu

    split = comfy.multigpu.create_multigpu_deepclones(model, 2, reuse_loaded=True)
    (copy,) = split.get_additional_models_with_key("multigpu")
    assert copy.load_device == FAKE_SECOND and copy.model is not model.model
    return split, copy


def _fp8(path: Path):  # noqa: ANN202
    from comfyui_lowvram_dit.host.wan_loader import load_wan_model

    return load_wan_model(path, "per_tensor", 128, "auto")


def _variants(path: Path) -> dict:
    import comfy.sd

    from comfyui_lowvram_dit.kernels.compile import CompileConfig
    from comfyui_lowvram_dit.offload.plan import SwapConfig
    from comfyui_lowvram_dit.host.attention import apply_attention
    from comfyui_lowvram_dit.host.block_swap import apply_block_swap
    from comfyui_lowvram_dit.host.torch_compile import apply_compile
    from comfyui_lowvram_dit.host.nan_guard import apply_nan_guard
    from comfyui_lowvram_dit.host.wan_loader import load_wan_model

    return {
        "native": lambda: comfy.sd.load_diffusion_model(str(path)),
        "wan_loader_fp8": lambda: _fp8(path),
        "wan_loader_blockwise": lambda: load_wan_model(path, "blockwise", 64),
        "attention_auto": lambda: apply_attention(_fp8(path), "auto"),
        "attention_math": lambda: apply_attention(_fp8(path), "SDPA math"),
        "nan_guard": lambda: apply_nan_guard(_fp8(path), "raise"),
        "block_swap": lambda: apply_block_swap(_fp8(path), SwapConfig(blocks_to_swap=2, prefetch=1)),
        "compile": lambda: apply_compile(_fp8(path), CompileConfig(), compile_fn=lambda module, **kw: module),
    }


@pytest.mark.parametrize("variant", ["native", "wan_loader_fp8", "wan_loader_blockwise", "attention_auto",
                                     "attention_math", "nan_guard", "block_swap", "compile"])
def test_split_equals_one_device(two_devices: None, wan_file: Path, variant: str) -> None:
    model = _variants(wan_file)[variant]()
    alone = _sample(model)
    split, _ = _split(model)
    assert _relative(_sample(split), alone) <= CPU_GEMM_TOLERANCE


def test_block_swap_copy_streams_its_own_blocks(two_devices: None, wan_file: Path) -> None:
    from comfyui_lowvram_dit.offload.plan import SwapConfig
    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY, apply_block_swap

    model = apply_block_swap(_fp8(wan_file), SwapConfig(blocks_to_swap=2, prefetch=1))
    alone = _sample(model)
    split, copy = _split(model)
    assert _relative(_sample(split), alone) <= CPU_GEMM_TOLERANCE
    mine, its = split.attachments[SWAP_KEY], copy.attachments[SWAP_KEY]
    assert mine is not its and its.model_ref() is copy.model and mine.model_ref() is split.model
    assert its.streamer is not None and its.streamer.stats.loads > 0  # the copy's ring ran its own blocks
    assert all(b is not c for b, c in zip(its.blocks, mine.blocks))


def test_nan_guard_keeps_a_record_per_model_copy(two_devices: None, wan_file: Path) -> None:
    from comfyui_lowvram_dit.host.nan_guard import GUARD_KEY, apply_nan_guard

    model = apply_nan_guard(_fp8(wan_file), "raise")
    split, copy = _split(model)
    _sample(split)
    guard = split.attachments[GUARD_KEY]
    served = {guard.for_model(split.model), guard.for_model(copy.model)}
    assert len(served) == 2 and all(g.tracker.pending == 0 for g in served)


def test_compiled_native_model_split_equals_one_device_exactly(two_devices: None, wan_file: Path) -> None:
    """Torch Compile runs every sample alone (batch-invariance), so even native's GEMMs, which round a batch of
    one and of two differently, give the split and the one-device run bit for bit."""
    import comfy.sd

    from comfyui_lowvram_dit.kernels.compile import CompileConfig
    from comfyui_lowvram_dit.host.torch_compile import apply_compile

    model = apply_compile(comfy.sd.load_diffusion_model(str(wan_file)), CompileConfig(),
                          compile_fn=lambda module, **kw: module)
    alone = _sample(model)
    split, _ = _split(model)
    assert torch.equal(_sample(split), alone)
