"""How a read model is built (checkpoints/build_recipe.py), and the loading functions' vocabulary check."""

from __future__ import annotations

import pytest
import torch

from comfyui_lowvram_dit.checkpoints.build_recipe import AS_UNETLOADER, qwen_image_recipe, wan_recipe
from comfyui_lowvram_dit.host.model_loading import COMPUTE, check_load_options


def test_files_without_the_packs_fp8_layers_build_as_unetloader() -> None:
    assert wan_recipe(0, 128) == AS_UNETLOADER and qwen_image_recipe("none", 128) == AS_UNETLOADER
    assert AS_UNETLOADER.fp8_block_size is None and AS_UNETLOADER.dtype is None and AS_UNETLOADER.dynamic_vram


def test_fp8_models_run_bf16_and_only_wan_under_dynamic_vram() -> None:
    wan, qwen = wan_recipe(400, 64), qwen_image_recipe("blockwise", 128)
    assert (wan.fp8_block_size, wan.dtype, wan.dynamic_vram) == (64, torch.bfloat16, True)
    assert (qwen.fp8_block_size, qwen.dtype, qwen.dynamic_vram) == (128, torch.bfloat16, False)


def test_the_loaders_take_modes_not_labels() -> None:
    for mode in ("none", "per_tensor", "blockwise"):
        for compute in COMPUTE.values():
            check_load_options("Wan Loader", mode, compute)
    with pytest.raises(ValueError, match=r"Wan Loader: quantization must be one of .*got 'fp8 per-tensor' and 'auto'"):
        check_load_options("Wan Loader", "fp8 per-tensor", "auto")  # a node's label
    with pytest.raises(ValueError, match=r"Qwen-Image staged loader: .* compute one of \['auto', 'dequantize', "
                                         r"'fp8', 'int8'\], got 'per_tensor' and 'int8 matmul'"):
        check_load_options("Qwen-Image staged loader", "per_tensor", "int8 matmul")
