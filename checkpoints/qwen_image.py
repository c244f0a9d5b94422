"""Qwen-Image transformer files: what a file is, and a streaming read into the in-memory fp8 form.

Plain torch, no ComfyUI. High-precision files are quantized while streaming (checkpoints/fp8_state.py, the same
normaliser as the Wan loader); fp8 files keep their own quantization.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .safetensors_io import (
    CheckpointError, MapHook, SafetensorsHeader, check_ranks, quant_layer_configs, read_header,
)
from .core_quant import core_layouts, read_core_state_dict
from .fp8_state import FP8_DTYPES, Fp8Plan, QuantMode, SourceFormat, read_fp8_state_dict
from .streaming import ProgressFn

log = logging.getLogger("comfyui_lowvram_dit")

_QWEN_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.", "")
_QWEN_BLOCK = re.compile(r"transformer_blocks\.(\d+)\.")


@dataclass(frozen=True)
class QwenImageInfo:
    """What a Qwen-Image transformer file is."""

    path: Path
    prefix: str
    num_blocks: int
    format: SourceFormat  # "high_precision" | "fp8_plain" | "comfy_fp8_scaled" | "comfy_quant" | "core_quant"
    weight_dtype: torch.dtype  # dtype of the block Linear weights in the file
    widths: dict[str, int]  # qwen_image_widths: sizes ComfyUI's model config does not read from the weights
    layers: dict[str, dict] = field(default_factory=dict, compare=False)  # ComfyUI per-layer quant configs


def is_qwen_fp8_target(key: str, shape: tuple[int, ...]) -> bool:
    """Keys quantized from high precision: 2-D Linear weights inside ``transformer_blocks.N.`` (attention
    projections, MLPs and the img/txt modulation Linears, 99.8 % of the 20.4 B weights; embeddings, norms,
    the time embedder and the output projection stay bf16, as in the Wan loader)."""
    return len(shape) == 2 and key.endswith(".weight") and _QWEN_BLOCK.match(key) is not None


def inspect_qwen_image(header: SafetensorsHeader) -> QwenImageInfo:
    """Detect a Qwen-Image transformer (ComfyUI/diffusers key names); CheckpointError with a hint otherwise."""
    names = list(header.tensors)
    prefix = next((p for p in _QWEN_PREFIXES if f"{p}txt_norm.weight" in header.tensors), None)
    if prefix is None or f"{prefix}transformer_blocks.0.img_mod.1.weight" not in header.tensors:
        hint = ""
        if any(".self_attn." in n and "blocks." in n for n in names[:2000]):
            hint = " It looks like a Wan model; use the Wan loader."
        elif "model.embed_tokens.weight" in header.tensors:
            hint = " It is a text encoder; select it as clip_name."
        raise CheckpointError(f"{header.path.name}: not a Qwen-Image transformer (no txt_norm.weight / "
                              f"transformer_blocks.0.img_mod.1.weight).{hint}")
    check_ranks(header, {f"{prefix}transformer_blocks.0.img_mod.1.weight": 2}, "Qwen-Image transformer")
    t = {n[len(prefix):]: i for n, i in header.tensors.items() if n.startswith(prefix)}
    blocks = sorted({int(m.group(1)) for k in t if (m := _QWEN_BLOCK.match(k))})
    if blocks != list(range(len(blocks))):
        raise CheckpointError(f"{header.path.name}: transformer_blocks are not numbered 0..{len(blocks) - 1}")
    lin = [i for k, i in t.items() if is_qwen_fp8_target(k, i.shape)]
    weight_dtype = max({i.dtype for i in lin}, key=lambda d: sum(i.nbytes for i in lin if i.dtype == d))
    has_configs = "_quantization_metadata" in header.metadata or any(k.endswith(".comfy_quant") for k in t)
    layers = quant_layer_configs(header) if has_configs else {}
    if core_layouts(layers):
        fmt = "core_quant"
    elif has_configs:
        fmt = "comfy_quant"
    elif "scaled_fp8" in t:
        fmt = "comfy_fp8_scaled"
    elif weight_dtype in FP8_DTYPES:
        fmt = "fp8_plain"
    else:
        fmt = "high_precision"
    return QwenImageInfo(header.path, prefix, len(blocks), fmt, weight_dtype, qwen_image_widths(header, prefix),
                         layers)


QWEN_ROPE_HEAD_DIM = 128  # ComfyUI's rotary axes (16, 56, 56) add up to this attention head size
QWEN_PATCH = 2  # 2x2 latent pixels per token (ComfyUI's patch_size default)


def qwen_image_widths(header: SafetensorsHeader, prefix: str = "") -> dict[str, int]:
    """Widths of a Qwen-Image transformer read from its shapes, in ComfyUI's ``QwenImageTransformer2DModel`` names.

    ComfyUI's detection reads only ``in_channels`` and the block count and builds everything else at the 20B
    defaults (24 heads of 128, joint_attention_dim 3584, 16 output channels); these values, handed to its model
    config, let a file of the same architecture at other widths load. For the released file they equal the
    defaults. Biases and norms are read, never quantized weights (a packed format changes a weight's shape).
    """
    t = {n[len(prefix):]: i for n, i in header.tensors.items() if n.startswith(prefix)}

    def rows(*names: str) -> int:
        for n in names:
            if n in t and len(t[n].shape) >= 1:
                return int(t[n].shape[0])
        raise CheckpointError(f"{header.path.name}: a Qwen-Image transformer without {names[0]}; the file is "
                              "damaged or not Qwen-Image")

    inner = rows("img_in.bias", "img_in.weight")
    head_dim = rows("transformer_blocks.0.attn.norm_q.weight")
    out = rows("proj_out.bias", "proj_out.weight")
    if head_dim != QWEN_ROPE_HEAD_DIM or inner % head_dim or out % QWEN_PATCH**2:
        raise CheckpointError(f"{header.path.name}: Qwen-Image widths ComfyUI cannot build (attention heads of "
                              f"{head_dim}, width {inner}, {out} output features); it needs heads of "
                              f"{QWEN_ROPE_HEAD_DIM} and a width that is a multiple of it")
    return {"num_attention_heads": inner // head_dim, "attention_head_dim": head_dim,
            "joint_attention_dim": rows("txt_norm.weight"), "out_channels": out // QWEN_PATCH**2}


def load_qwen_image_state_dict(
    path: str | Path,
    mode: QuantMode = "blockwise",
    block_size: int = 128,
    *,
    device: str | torch.device | None = None,
    progress: ProgressFn | None = None,
    mmap: bool = False,
    on_map: MapHook | None = None,
) -> tuple[dict[str, torch.Tensor], QwenImageInfo, QuantMode]:
    """Read a Qwen-Image file tensor by tensor into the in-memory fp8 form (checkpoints/fp8_state.py).

    High-precision files: block Linear weights are quantized to ``mode`` while streaming (on ``device``,
    e.g. the GPU), everything else is kept. fp8 files keep their per-tensor quantization; files in ComfyUI's other
    quantized layouts are read as stored (checkpoints/core_quant.py) for ComfyUI's own layers. Returns (state dict
    without the key prefix, file info, the quantization now in the dict). ``mmap``: an fp8 file's tensors are
    zero-copy views of the file (page cache, not RSS); a file quantized here is read as usual. ``on_map`` sees each
    such view with its place in the file.
    """
    if mode not in ("none", "per_tensor", "blockwise"):
        raise ValueError(f"quantization mode must be none, per_tensor or blockwise, got {mode!r}")
    header = read_header(path)
    info = inspect_qwen_image(header)
    if info.format == "core_quant":  # ComfyUI's own layers build it: every tensor as stored
        return (read_core_state_dict(header, info.prefix, info.layers, mmap=mmap, progress=progress, on_map=on_map),
                info, "none")
    plan = Fp8Plan(info.format, info.prefix, is_qwen_fp8_target, mode, block_size)
    sd, notes = read_fp8_state_dict(header, plan, device=device, mmap=mmap, progress=progress, on_map=on_map)
    for note in notes:
        log.info("lowvram_dit: %s", note)
    out_mode: QuantMode = mode if plan.quantizes_here else (
        "per_tensor" if info.format != "high_precision" else "none")
    return sd, info, out_mode
