"""Wan text encoding without a second copy of umT5-XXL in RAM, with an on-disk embedding cache.

``LowVRAM_WanTextEncode`` gives the positive and negative CONDITIONING that stock ``CLIPLoader(type=wan)`` +
``CLIPTextEncode`` give (bit-equal on the CPU for the released file: same ComfyUI classes, same dtype, same
tokenizer), but streamed into RAM with one copy, run where the node's ``device`` says (by default where ComfyUI
runs text encoders, the GPU on NVIDIA), kept for the next prompt where ComfyUI's DynamicVRAM manages it and freed
after encoding otherwise, with its embeddings cached on disk (host/text_encoders.py). The layer count and widths are read from the file, so reduced-layer files of the same
architecture load too.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from ..checkpoints.safetensors_io import CheckpointError, SafetensorsHeader
from ..checkpoints.streaming import ProgressFn
from ..checkpoints.text_encoders import umt5_config_from_header
from ..offload.stage_meter import StageReport
from . import text_encoders

log = logging.getLogger("comfyui_lowvram_dit")

WAN_TEXT_DIM = 4096  # Wan's text_embedding input width (ComfyUI wan detection fixes text_dim = 4096)
_TOKENIZER_KEY = "spiece_model"  # the umT5 sentencepiece model ComfyUI's Wan tokenizer reads from the file


@functools.cache
def _tokenizer_id() -> str:
    """The tokenizer class (part of the cache key; its sentencepiece model is covered by the file hash)."""
    from comfy.text_encoders import wan

    return f"{wan.WanT5Tokenizer.__module__}.{wan.WanT5Tokenizer.__qualname__}"


def _check_umt5(header: SafetensorsHeader, cfg: dict[str, int]) -> None:
    name = header.path.name
    if cfg["d_model"] != WAN_TEXT_DIM:
        raise CheckpointError(f"{name}: d_model {cfg['d_model']}, but Wan needs a {WAN_TEXT_DIM}-wide "
                              "umT5-XXL (umt5_xxl_fp16 / umt5_xxl_fp8_e4m3fn_scaled)")
    if _TOKENIZER_KEY not in header.tensors:
        raise CheckpointError(f"{name}: no '{_TOKENIZER_KEY}' tensor (the tokenizer); use ComfyUI's "
                              "repackaged umt5_xxl_*.safetensors, which carry it")


def _umt5_target(probe: dict, name: str):  # noqa: ANN202 - what load_text_encoder_state_dicts builds
    """What load_text_encoder_state_dicts(clip_type=WAN) builds for T5_XXL (t5xxl_detect reads dtype and
    quantization metadata from the probe)."""
    from comfy.text_encoders import sd3_clip, wan

    return text_encoders.clip_target(wan.te(**sd3_clip.t5_xxl_detect(probe)), wan.WanT5Tokenizer)


UMT5_XXL = text_encoders.StreamedTextEncoder(
    label="Wan text encoder", kind="umT5-XXL", norm_key="encoder.final_layer_norm.weight", width_key="d_model",
    layers_key="num_layers", config_option="umt5xxl_model_config", config_from_header=umt5_config_from_header,
    build_target=_umt5_target, cache_context=_tokenizer_id, tokenizer_key=_TOKENIZER_KEY, check=_check_umt5)


def encoder_identity(te_path: str | Path) -> dict:
    """Everything about the encoder that changes embeddings, readable without loading it (cache key part)."""
    return text_encoders.encoder_identity(UMT5_XXL, te_path)


def build_umt5_streaming(te_path: str | Path, progress: ProgressFn | None = None):  # noqa: ANN201 - comfy.sd.CLIP
    """A CPU ``comfy.sd.CLIP`` for a umT5 file (what CLIPLoader(type=wan) builds), weights streamed in."""
    return text_encoders.build_streaming(UMT5_XXL, te_path, progress)


def encode_wan_prompts(te_path: str | Path, prompts: list[str], use_cache: bool = True,
                       device: torch.device = text_encoders.CPU) -> tuple[list[list], StageReport]:
    """CONDITIONING (as CLIPTextEncode returns it) per prompt: from the cache or a streamed encoder on ``device``."""
    out, report = text_encoders.encode_prompts(UMT5_XXL, te_path, prompts, stage=f"Wan text encoder ({device})",
                                               use_cache=use_cache, device=device)
    log.info("lowvram_dit %s", report.format())
    return out, report
