"""How host/ builds a native MODEL from a state dict this package read: its layers, its dtype, and whether ComfyUI's
DynamicVRAM may manage it. Decided from what the file is and what the read made of it; host/model_loading.py
``build_model`` carries it out."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fp8_state import QuantMode


@dataclass(frozen=True)
class BuildRecipe:
    """A model's build: the pack's fp8 layers (with their block size) or ComfyUI's own, its dtype, DynamicVRAM."""

    fp8_block_size: int | None  # the pack's fp8 layers with this block size; None: ComfyUI's own (as UNETLoader)
    dtype: torch.dtype | None = None  # the compute dtype of the model; None: ComfyUI's own pick
    dynamic_vram: bool = True  # whether ComfyUI's DynamicVRAM may manage the model where it is on


AS_UNETLOADER = BuildRecipe(None)


def wan_recipe(fp8_layers: int, block_size: int) -> BuildRecipe:
    """A Wan model holding ``fp8_layers`` fp8 weights for the pack's layers (0: a file ComfyUI's layers build)."""
    if fp8_layers == 0:
        return AS_UNETLOADER
    # bf16: the fp8 GEMMs' outputs are bf16-native, and Wan's default fp16 risks overflow in the residual stream.
    # The pack's fp8 layers take their weights through ComfyUI's cast_bias_weight, so DynamicVRAM can manage them.
    return BuildRecipe(block_size, torch.bfloat16, dynamic_vram=True)


def qwen_image_recipe(mode: QuantMode, block_size: int) -> BuildRecipe:
    """A Qwen-Image transformer whose block weights are now ``mode`` ("none": ComfyUI's layers build it)."""
    if mode == "none":
        return AS_UNETLOADER
    # bf16: ComfyUI runs Qwen-Image in bf16 only. The Staged Loader streams it with Block Swap under the legacy
    # patcher; its DynamicVRAM path has not been built or measured.
    return BuildRecipe(block_size, torch.bfloat16, dynamic_vram=False)
