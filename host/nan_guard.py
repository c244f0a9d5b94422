"""NaN Guard: name the first transformer block that produced NaN/inf, and the likely cause.

The guard is a kernels/nan_guard.py ``NanGuardHook`` installed through host/hooks.py: one device flag per
block output, read once at the end of each model call. Wan (``blocks``) and Qwen-Image (``transformer_blocks``:
both its image and text streams are checked).
"""

from __future__ import annotations

import torch

from ..kernels.hooks import find_blocks
from ..kernels.nan_guard import ACTIONS, NanGuardHook
from .hooks import register_hook

GUARD_KEY = "lowvram_dit_nan_guard"


def _attention_override(inputs: dict) -> bool:
    """Whether this model call runs a per-model attention override (the LowVRAM Attention node sets one)."""
    return "optimized_attention_override" in (inputs.get("transformer_options") or {})


def apply_nan_guard(model, action: str = "warn"):  # noqa: ANN001, ANN201 - ModelPatcher in and out
    """Return a clone of ``model`` whose every forward checks each block output for NaN/inf."""
    import comfy.model_management as mm

    if action not in ACTIONS:
        raise ValueError(f"NaN Guard: action must be one of {ACTIONS}, got {action!r}")
    dm = model.model.diffusion_model
    list_name, _ = find_blocks(dm, "NaN Guard")
    fp8 = any(p.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for p in dm.parameters())
    m = model.clone()
    guard = NanGuardHook(list_name, action, fp8_weights=fp8, global_sage=bool(mm.sage_attention_enabled()),
                         attention_override=_attention_override)
    register_hook(m, GUARD_KEY, guard)  # applied twice: the last one wins
    m.set_attachments(GUARD_KEY, guard)
    return m
