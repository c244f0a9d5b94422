"""More of the pack's model paths under ComfyUI's MultiGPU CFG split, on the CPU with two fake devices.

Companion of test_comfyui_multigpu.py (same fake devices ``cpu`` and ``cpu:0``, same tolerance): a Wan file that
is already fp8 (``*_fp8_scaled``, read as it is), the stock LoRA loader on a Block Swap model (the LoRA is merged
into each copy's own host arena), the Qwen-Image Staged transformer with Attention auto, and core's Select Model
Device moving a pack model to the other device. The Qwen-Image-Edit Staged Loader builds its transformer with the
same staged load, so the Qwen row covers it; no pack node outputs a CLIP, so Select CLIP Device never meets one.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from comfy_server import comfyui_in_process_or_skip, sample_wan
from test_comfyui_multigpu import CPU_GEMM_TOLERANCE, FAKE_SECOND, _relative, _split, two_devices  # noqa: F401

pytestmark = pytest.mark.comfyui

_sample = functools.partial(sample_wan, cfg=3.0, steps=2, frames=1)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    comfyui_in_process_or_skip()
    from comfyui_lowvram_dit.synthetic import checkpoints as synth
    from comfyui_lowvram_dit.synthetic.lora import synthetic_lora

    folder = tmp_path_factory.mktemp("multigpu_models")
    out = {
        "wan_fp8_scaled": synth.write_synthetic("wan22_t2v_14B", folder / "wan_fp8_scaled.safetensors", size="tiny",
                                                fmt="fp8_scaled", seed=3, num_layers=2),
        "wan_bf16": synth.write_synthetic("wan22_t2v_14B", folder / "wan_bf16.safetensors", size="tiny",
                                          fmt="bf16", seed=4, num_layers=2),
        "qwen": synth.write_synthetic("qwen_image", folder / "qwen.safetensors", size="tiny", fmt="bf16", seed=5),
    }
    from safetensors.torch import save_file

    lora = synthetic_lora("wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors", "tiny")
    save_file(lora, str(folder / "lora.safetensors"))
    out["lora"] = folder / "lora.safetensors"
    return out


def _wan(path: Path):  # noqa: ANN202 - ModelPatcher
    from comfyui_lowvram_dit.host.wan_loader import load_wan_model

    return load_wan_model(path, "per_tensor", 128, "auto")


def test_prequantized_wan_file_split_equals_one_device(two_devices: None, files: dict[str, Path]) -> None:
    model = _wan(files["wan_fp8_scaled"])
    alone = _sample(model)
    split, _ = _split(model)
    assert _relative(_sample(split), alone) <= CPU_GEMM_TOLERANCE


def test_lora_on_block_swap_split_equals_one_device(two_devices: None, files: dict[str, Path]) -> None:
    import comfy.sd
    import comfy.utils

    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY, apply_block_swap
    from comfyui_lowvram_dit.offload.plan import SwapConfig

    base = _wan(files["wan_bf16"])
    plain = _sample(base)
    lora = comfy.utils.load_torch_file(str(files["lora"]))
    patched = comfy.sd.load_lora_for_models(base, None, lora, 1.0, 0.0)[0]
    model = apply_block_swap(patched, SwapConfig(blocks_to_swap=1, prefetch=1))
    alone = _sample(model)
    assert _relative(alone, plain) > 100 * CPU_GEMM_TOLERANCE  # the LoRA really changes the output
    split, copy = _split(model)
    assert _relative(_sample(split), alone) <= CPU_GEMM_TOLERANCE
    assert split.attachments[SWAP_KEY] is not copy.attachments[SWAP_KEY]


def _sample_qwen(patcher, seed: int = 0):  # noqa: ANN001, ANN202 - ModelPatcher in, latent out
    """KSampler's path on a Qwen-Image latent (4-D, made 5-D as KSampler does) with tiny-width conditioning."""
    import comfy.sample

    from comfyui_lowvram_dit.synthetic.specs import QWEN_TINY_JOINT_DIM

    g = torch.Generator().manual_seed(seed)
    latent = torch.zeros(1, 16, 1, 8, 8)
    noise = torch.randn(latent.shape, generator=g)
    pos = [[torch.randn(1, 12, QWEN_TINY_JOINT_DIM, generator=g), {}]]
    neg = [[torch.randn(1, 12, QWEN_TINY_JOINT_DIM, generator=g), {}]]
    return comfy.sample.sample(patcher, noise, 2, 3.0, "euler", "simple", pos, neg, latent, seed=seed,
                               disable_pbar=True)


def test_qwen_image_staged_split_equals_one_device(two_devices: None, files: dict[str, Path]) -> None:
    from comfyui_lowvram_dit.host.attention import apply_attention
    from comfyui_lowvram_dit.host.qwen_stages import load_staged_model

    model = apply_attention(load_staged_model(str(files["qwen"]), "per_tensor")[0], "auto")
    alone = _sample_qwen(model)
    assert torch.isfinite(alone).all()
    split, _ = _split(model)
    assert _relative(_sample_qwen(split), alone) <= CPU_GEMM_TOLERANCE


def test_select_model_device_moves_a_pack_model_with_its_patches(two_devices: None, files: dict[str, Path]) -> None:
    """Core's Select Model Device, for a GPU other than the model's, rebuilds the model there through the loader's
    factory (``_retarget_patcher`` -> ``deepclone_multigpu``; the fake second device is a CPU device, for which the
    node itself would take its CPU branch, so its GPU branch is called directly). The pack's Block Swap and
    Attention come along, with state of the new copy's own, and the picture is the one the first device gives."""
    from comfy_extras import nodes_multigpu

    from comfyui_lowvram_dit.host.attention import apply_attention
    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY, apply_block_swap
    from comfyui_lowvram_dit.offload.plan import SwapConfig

    model = apply_attention(apply_block_swap(_wan(files["wan_bf16"]), SwapConfig(blocks_to_swap=1)), "auto")
    alone = _sample(model)
    if not hasattr(nodes_multigpu, "_retarget_patcher"):
        pytest.skip("this ComfyUI's Select Model Device has no _retarget_patcher")
    moved = nodes_multigpu._retarget_patcher(model.clone(), FAKE_SECOND, model.offload_device)
    assert moved.load_device == FAKE_SECOND and moved.model is not model.model
    assert moved.attachments[SWAP_KEY] is not model.attachments[SWAP_KEY]
    assert _relative(_sample(moved), alone) <= CPU_GEMM_TOLERANCE
