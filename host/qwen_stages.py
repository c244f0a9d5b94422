"""Qwen-Image in stages on small machines: streamed text encoder, fp8 transformer with block swap, GPU VAE decode.

The Staged Loader returns native MODEL, positive/negative CONDITIONING and VAE (stock KSampler, LoRA and
ModelSampling nodes work on them):
- Stage 1, text: the Qwen2.5-VL encoder that ``load_text_encoder_state_dicts(clip_type=QWEN_IMAGE)`` builds,
  streamed into RAM, run on the device the node's ``text_encoder_device`` names (by default where ComfyUI runs text
  encoders), kept for the next run under DynamicVRAM and freed after encoding otherwise, embeddings cached on disk
  (host/text_encoders.py); the embeddings end on the compute device.
- Stage 2, transformer: read tensor by tensor, block Linear weights quantized to fp8 (block-wise or per-tensor)
  while streaming (on the GPU when there is one), built with host/fp8_ops.py's custom operations, then
  wrapped by the Block Swap node's ``apply_block_swap`` under the VRAM budget, its blocks replayed from CUDA graphs
  where they may (host/block_graphs.py).
- VAE: loaded as VAELoader does.

The Decode node (stage 3) unloads every other model from the GPU, then decodes on the GPU, tiled when ComfyUI's own
memory estimate does not fit the free VRAM or the budget. It refuses a CPU decode when a GPU exists.
"""

from __future__ import annotations

import functools
import logging
import math
from pathlib import Path
from typing import Any

import torch

from ..checkpoints import qwen_image
from ..checkpoints.build_recipe import qwen_image_recipe
from ..checkpoints.fp8_state import QuantMode
from ..checkpoints.safetensors_io import CheckpointError, check_quantization, read_header
from ..checkpoints.text_encoders import qwen25_vl_config_from_header
from ..kernels.int8_choice import Compute
from ..offload import stage_meter
from ..offload.plan import SwapConfig, check_budget
from ..offload.stage_meter import StageReport
from . import text_encoders
from .block_graphs import apply_block_graphs, release_block_graphs
from .block_swap import apply_block_swap
from .core_quant import announce, check_host_reads
from .file_slices import file_slice_hook
from .files import checked_input, use_mmap
from .graph_checks import WAN_VAE_KEY
from .mapped_weights import keep_file_backed
from .model_loading import build_model, check_load_options
from .names import display_name
from .qwen_cfg_batch import skip_unneeded_masks

log = logging.getLogger("comfyui_lowvram_dit")

# The nodes' quantization labels -> what load_transformer / load_staged_model take (compute: model_loading.COMPUTE)
QUANTIZATION: dict[str, QuantMode] = {"fp8 per-tensor": "per_tensor", "fp8 block-wise": "blockwise", "none": "none"}
LOADER = "Qwen-Image staged loader"  # the Staged and the Edit Staged Loader share this transformer load


def _log_stage(report: StageReport) -> None:
    log.info("lowvram_dit Qwen-Image %s", report.format())


def _compute_device() -> torch.device:
    import comfy.model_management as mm

    return mm.get_torch_device()


def _bar(total: int):  # noqa: ANN202 - comfy.utils.ProgressBar
    import comfy.utils

    return comfy.utils.ProgressBar(total)


# ----------------------------------------------------------------------------------------------------------
# Stage 1: text


@functools.cache
def _prompt_template() -> str:
    """The template ComfyUI's QwenImageTokenizer wraps prompts in (part of the cache key)."""
    import comfy.text_encoders.qwen_image as qi

    tok = qi.QwenImageTokenizer()
    return f"{type(tok).__module__}.{type(tok).__qualname__}|{tok.llama_template}"


def _qwen25_vl_target(probe: dict, name: str):  # noqa: ANN202 - what load_text_encoder_state_dicts builds
    """What load_text_encoder_state_dicts(clip_type=QWEN_IMAGE) builds for QWEN25_7B, after ComfyUI's own
    detection agrees the file is one."""
    import comfy.sd
    import comfy.text_encoders.qwen_image as qi

    kind = comfy.sd.detect_te_model(probe)
    if kind != comfy.sd.TEModel.QWEN25_7B:
        raise CheckpointError(f"{name}: ComfyUI detects this text encoder as {kind}, not Qwen2.5-VL 7B; "
                              "Qwen-Image needs qwen_2.5_vl_7b(.safetensors | _fp8_scaled.safetensors)")
    return text_encoders.clip_target(qi.te(**comfy.sd.llama_detect([probe])), qi.QwenImageTokenizer)


# The vision tower (0.67 B params) is loaded too although text prompts never run it: the encoder is then complete,
# exactly what load_clip builds; missing vision weights only warn, as load_clip does.
QWEN25_VL = text_encoders.StreamedTextEncoder(
    label="Qwen-Image text encoder", kind="Qwen2.5-VL", norm_key="model.norm.weight", width_key="hidden_size",
    layers_key="num_hidden_layers", config_option="qwen25_7b_model_config",
    config_from_header=qwen25_vl_config_from_header, build_target=_qwen25_vl_target,
    cache_context=_prompt_template, optional_prefixes=("visual.",))


def encoder_identity(te_path: str | Path) -> dict:
    """Everything about the encoder that changes embeddings, readable without loading it (cache key part)."""
    return text_encoders.encoder_identity(QWEN25_VL, te_path)


def build_text_encoder_streaming(te_path: str | Path, progress=None):  # noqa: ANN001, ANN201 - comfy.sd.CLIP
    """A CPU ``comfy.sd.CLIP`` for a Qwen2.5-VL file, its weights streamed in one module at a time."""
    return text_encoders.build_streaming(QWEN25_VL, te_path, progress)


def conditioning_to(cond: list, dev: torch.device) -> list:
    """CONDITIONING with its embeddings and (lists of) tensor extras, e.g. reference_latents, on ``dev``."""
    def move(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.to(dev)
        return [move(x) for x in v] if isinstance(v, list) else v

    return [[t.to(dev), {k: move(v) for k, v in extra.items()}] for t, extra in cond]


def encode_prompts(te_path: str | Path, prompts: list[str], use_cache: bool = True,
                   target_device: torch.device | None = None, reset_cuda_peak: bool = False,
                   device: torch.device = text_encoders.CPU) -> tuple[list[list], StageReport]:
    """Stage 1: CONDITIONING for each prompt on ``target_device`` (default the compute device), from the cache or a
    streamed encoder run on ``device`` (kept or freed after: text_encoders.encoder_for)."""
    out, report = text_encoders.encode_prompts(QWEN25_VL, te_path, prompts, stage=f"stage 1 (text encoder, {device})",
                                               use_cache=use_cache, reset_cuda_peak=reset_cuda_peak, device=device)
    dev = target_device or _compute_device()
    result = [conditioning_to(cond, dev) for cond in out]
    _log_stage(report)
    return result, report


# ----------------------------------------------------------------------------------------------------------
# Stage 2: transformer


def load_transformer(unet_path: str | Path, mode: QuantMode = "per_tensor", block_size: int = 128,
                     compute: Compute = "auto", disable_dynamic: bool = False):  # noqa: ANN201 - ModelPatcher
    """Read a Qwen-Image file (fp8-quantizing a high-precision one to ``mode`` while streaming) and build a native
    MODEL from it whose fp8 layers run ``compute`` (``disable_dynamic``: see wan_loader.load_wan_model)."""
    check_load_options(LOADER, mode, compute)
    check_quantization(read_header(unet_path))  # malformed configs / bad scales: named before any weight is read
    check_host_reads(unet_path, LOADER)  # layouts this ComfyUI cannot build, likewise
    dev = _compute_device()
    bar = _bar(1000)
    mmap = use_mmap()
    # under DynamicVRAM the mapped weights carry their place in the file, so ComfyUI reads them by file handle as it
    # reads UNETLoader's, and no page of the mapping stays resident (host/file_slices.py)
    sd, info, out_mode = qwen_image.load_qwen_image_state_dict(
        unet_path, mode, block_size, device=dev if dev.type == "cuda" else None, mmap=mmap,
        progress=lambda d, t: bar.update_absolute(int(1000 * d / max(t, 1))),
        on_map=None if disable_dynamic or not mmap else file_slice_hook(unet_path))
    if info.format == "core_quant":
        announce(Path(unet_path).name, info.layers, LOADER)
    elif mode != "none" and info.format != "high_precision":
        log.info("lowvram_dit: %s is already %s fp8; kept as stored", Path(unet_path).name, info.format)
    # ComfyUI reads only in_channels and the block count; the widths come from the file (its defaults for the
    # released 20B file), so same-architecture files of other widths load too.
    model = build_model(sd, qwen_image_recipe(out_mode, block_size), compute,
                        (load_transformer, (unet_path, mode, block_size, compute)), disable_dynamic,
                        unet_config=info.widths)
    del sd
    if model is None:
        raise RuntimeError(f"{Path(unet_path).name}: ComfyUI could not detect this Qwen-Image file")
    log.info("lowvram_dit Qwen-Image transformer %s: %d blocks, %s, weights %s", Path(unet_path).name,
             info.num_blocks, info.format, out_mode)
    return skip_unneeded_masks(keep_file_backed(model))


QWEN_PATCH = qwen_image.QWEN_PATCH  # 2x2 latent pixels per token: img_in takes 4x the VAE's latent channels


def check_vae_fits(vae_path: str | Path, unet_path: str | Path) -> None:
    """Before stage 1 (minutes of text encoding): the VAE file reads, is a Qwen-Image (Wan 2.1-style) VAE, and its
    latent channels are what the transformer takes; CheckpointError naming both files otherwise."""
    vae, unet = Path(vae_path), Path(unet_path)
    t = read_header(vae).tensors  # a pickle (.pt, .ckpt) VAE is refused here, by name
    if WAN_VAE_KEY not in t:
        raise CheckpointError(f"{vae.name}: not a Qwen-Image VAE (no decoder.middle.0.residual.0.gamma); select "
                              "qwen_image_vae.safetensors as vae_name")
    if "decoder.upsamples.0.upsamples.0.residual.2.weight" in t:
        raise CheckpointError(f"{vae.name} is a Wan 2.2 VAE (48 latent channels); {unet.name} needs the Qwen-Image "
                              "VAE (16 channels): select qwen_image_vae.safetensors as vae_name")
    header = read_header(unet)
    img_in = header.tensors.get(qwen_image.inspect_qwen_image(header).prefix + "img_in.weight")
    conv2 = t.get("conv2.weight")
    if img_in is not None and conv2 is not None and len(img_in.shape) == 2 and conv2.shape \
            and conv2.shape[0] * QWEN_PATCH ** 2 != img_in.shape[1]:
        raise CheckpointError(f"{vae.name} gives {conv2.shape[0]} latent channels but {unet.name} takes "
                              f"{img_in.shape[1] // QWEN_PATCH ** 2}; the two files do not belong together")


def load_vae(vae_path: str | Path):  # noqa: ANN201 - comfy.sd.VAE
    """The VAE exactly as VAELoader builds it."""
    import comfy.sd
    import comfy.utils

    vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(vae_path)))
    vae.throw_exception_if_invalid()
    return vae


def prepare_files(unet_name: str, clip_name: str, vae_name: str, vram_budget_gb: float,
                  node: str = "Qwen-Image Staged Loader",
                  encoder: text_encoders.StreamedTextEncoder | None = None) -> tuple[str, str, str]:
    """The opening of a staged Qwen-Image loader: the budget checked, the three files' paths, each file checked
    (transformer, text encoder, the VAE against the transformer; a wrong file fails now, naming ``node``, the input
    and the file, not after the long text stage) and RAM freed."""
    unet, vae_path = prepare_model_files(unet_name, vae_name, vram_budget_gb, node)
    return unet, text_encoder_file(clip_name, node, encoder), vae_path


def prepare_model_files(unet_name: str, vae_name: str, vram_budget_gb: float,
                        node: str = "Qwen-Image Loader") -> tuple[str, str]:
    """The budget checked, the transformer's and the VAE's paths, both files checked (naming ``node``, the input
    and the file), and a previous run's transformer freed."""
    import comfy.model_management as mm
    import folder_paths

    check_budget(vram_budget_gb)
    unet = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
    vae_path = folder_paths.get_full_path_or_raise("vae", vae_name)
    node = display_name(node)
    with checked_input(node, "unet_name"):
        qwen_image.inspect_qwen_image(read_header(unet))
        check_host_reads(unet, LOADER)  # before the long text stage, as the VAE check
    with checked_input(node, "vae_name"):
        check_vae_fits(vae_path, unet)
    # A previous run's transformer (dropped from ComfyUI's cache when the inputs changed) must be gone before the
    # encoder or the next transformer loads: two do not fit in RAM together on the machines these nodes are for.
    mm.cleanup_models_gc()
    stage_meter.release_host_memory()
    return unet, vae_path


def text_encoder_file(clip_name: str, node: str = "Qwen-Image Text Encode",
                      encoder: text_encoders.StreamedTextEncoder | None = None) -> str:
    """The Qwen2.5-VL file's path, checked (CheckpointError naming ``node``, the input and the file)."""
    import folder_paths

    te = folder_paths.get_full_path_or_raise("text_encoders", clip_name)
    with checked_input(display_name(node), "clip_name"):
        text_encoders.check_file(encoder or QWEN25_VL, te)
    return te


def load_staged_model(unet_path: str | Path, mode: QuantMode = "per_tensor", vram_budget_gb: float = 0.0,
                      blocks_to_swap: int = -1, compute: Compute = "auto",
                      reset_cuda_peak: bool = False):  # noqa: ANN201 - (ModelPatcher, StageReport)
    """Stage 2: the fp8 transformer wrapped by Block Swap (the GPU load itself happens when sampling starts)."""
    with stage_meter.StageMeter("stage 2 (transformer load)", reset_cuda_peak=reset_cuda_peak) as meter:
        model = load_transformer(unet_path, mode, 128, compute)
        stage_meter.release_host_memory()
        model = apply_block_swap(model, SwapConfig(vram_budget_gb=vram_budget_gb, blocks_to_swap=blocks_to_swap))
        model = apply_block_graphs(model)  # each block's launches issued at once, not one by one
    meter.report.notes.append(f"block swap budget {vram_budget_gb:g} GB, blocks_to_swap {blocks_to_swap} "
                              "(the GPU load happens in KSampler)")
    _log_stage(meter.report)
    return model, meter.report


# ----------------------------------------------------------------------------------------------------------
# Stage 3: decode


def plan_decode(need_bytes: float, available_bytes: float, height_px: int, width_px: int,
                tile_px: int) -> int | None:
    """Tile size (px) for a decode that needs ``need_bytes`` at full size; None when the full decode fits.

    Halve from ``tile_px`` until a tile's share of the estimate (tile_need) fits (not below 128 px).
    """
    if need_bytes <= available_bytes:
        return None
    tile = min(tile_px, max(height_px, width_px))
    while tile > 128 and tile_need(need_bytes, tile, height_px, width_px) > available_bytes:
        tile //= 2
    return max(128, tile - tile % 32)


def tile_need(need_bytes: float, tile_px: int, height_px: int, width_px: int) -> float:
    """The decode estimate of one square tile of side ``tile_px`` (ComfyUI's estimate scales with the area)."""
    return need_bytes * min(tile_px, height_px) * min(tile_px, width_px) / (height_px * width_px)


def decode_beside_models(need_bytes: float, vae_bytes: float, free_bytes: float, height_px: int, width_px: int,
                         tile_px: int, budget_bytes: float = math.inf) -> tuple[bool, int | None]:
    """(fits, tile): whether the decode runs without unloading any model, whole (tile None) or in tiles of
    ``tile_px``.

    It fits when ComfyUI's own VAE load (load_models_gpu: the VAE's size x 1.1 plus the larger of the inference
    reserve and the decode estimate with the extra reserve) frees nothing, so a transformer loaded beside the
    decode stays loaded. Smaller tiles than the node's are not tried: those decodes free memory first as before."""
    import comfy.model_management as mm

    def fits(need: float) -> bool:
        wanted = vae_bytes * 1.1 + max(mm.minimum_inference_memory(), need + mm.extra_reserved_memory())
        return free_bytes >= wanted and need + vae_bytes <= budget_bytes

    if fits(need_bytes):
        return True, None
    tile = min(tile_px, max(height_px, width_px))
    tile -= tile % 32
    return (True, tile) if tile >= 128 and fits(tile_need(need_bytes, tile, height_px, width_px)) else (False, None)


def decode_staged(latent: torch.Tensor, vae, vram_budget_gb: float = 0.0, tile_size: int = 512,  # noqa: ANN001
                  overlap: int = 64, allow_cpu: bool = False,
                  reset_cuda_peak: bool = False) -> tuple[torch.Tensor, StageReport]:
    """Stage 3: decode beside the loaded models when it fits (whole, or in tiles of tile_size), else free what a
    whole decode needs on the VAE's device and decode (tiled if it still does not fit); IMAGE [N, H, W, C]."""
    import comfy.model_management as mm

    gpu = mm.get_torch_device()
    dev = torch.device(vae.device)
    if dev.type == "cpu" and gpu.type != "cpu" and not allow_cpu:
        raise RuntimeError("Qwen-Image Decode: the VAE is on the CPU (ComfyUI started with --cpu-vae?) while a "
                           f"GPU ({gpu}) exists; a CPU decode of a 1328x1328 image takes tens of minutes. Remove "
                           "--cpu-vae, or set allow_cpu on this node to accept it.")
    with stage_meter.StageMeter("stage 3 (VAE decode)", device=dev, reset_cuda_peak=reset_cuda_peak) as meter:
        need = float(vae.memory_used_decode(latent.shape, vae.vae_dtype))
        vae_bytes = mm.module_size(vae.first_stage_model)
        comp = vae.spacial_compression_decode()
        h_px, w_px = latent.shape[-2] * comp, latent.shape[-1] * comp
        budget = vram_budget_gb * stage_meter.GIB if vram_budget_gb > 0 else math.inf
        # A transformer whose reload costs seconds stays loaded when the decode fits beside it (whole or in the
        # node's tiles), if need be once its block graphs gave their memory back; only otherwise free what a whole
        # decode needs, as ComfyUI's VAEDecode does.
        beside, tile = (False, None) if dev.type == "cpu" else decode_beside_models(
            need, vae_bytes, mm.get_free_memory(dev), h_px, w_px, tile_size, budget)
        if not beside and dev.type != "cpu" and (freed := release_block_graphs(dev)):
            beside, tile = decode_beside_models(need, vae_bytes, mm.get_free_memory(dev), h_px, w_px, tile_size,
                                                budget)
            meter.report.notes.append(f"block graphs gave back {freed / stage_meter.GIB:.2f} GiB")
        if not beside:
            mm.free_memory(need + vae_bytes + mm.minimum_inference_memory(), dev, keep_loaded=[vae.patcher])
            mm.soft_empty_cache()
            if dev.type == "cpu":
                log.info("lowvram_dit Qwen-Image Decode: decoding on the CPU (%s)",
                         "no GPU" if gpu.type == "cpu" else "allow_cpu is on")
            available = math.inf if dev.type == "cpu" else min(mm.get_free_memory(dev), budget) - vae_bytes
            tile = plan_decode(need, available, h_px, w_px, tile_size)
        if tile is None:
            bar = _bar(1)
            images = vae.decode(latent)
            bar.update(1)
            meter.report.notes.append(f"full decode (estimate {need / stage_meter.GIB:.2f} GiB fits"
                                      f"{' beside the loaded models' if beside else ''})")
        else:
            ov = min(overlap, tile // 4)
            t_comp = vae.temporal_compression_decode()
            tile_t, overlap_t = (None, None) if t_comp is None else (max(2, 64 // t_comp), 1)
            images = vae.decode_tiled(latent, tile_x=tile // comp, tile_y=tile // comp, overlap=ov // comp,
                                      tile_t=tile_t, overlap_t=overlap_t)
            meter.report.notes.append(f"tiled {tile}px/{ov}px (whole-decode estimate {need / stage_meter.GIB:.2f} "
                                      f"GiB does not fit {'beside the loaded models' if beside else 'in VRAM'})")
        if images.ndim == 5:  # video VAE output for a single-frame image: combine batches as VAEDecode does
            images = images.reshape(-1, *images.shape[-3:])
    meter.report.notes.append(f"on {dev}")
    _log_stage(meter.report)
    return images, meter.report
