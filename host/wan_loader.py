"""Wan 2.1 / 2.2 loading with fp8 quantization (per-tensor or block-wise) into a native MODEL."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from ..checkpoints import wan as wc
from ..checkpoints.build_recipe import wan_recipe
from ..checkpoints.fp8_state import QuantMode
from ..kernels.int8_choice import Compute
from . import graph_checks
from .core_quant import announce, check_host_reads
from .file_slices import file_slice_hook
from .files import use_mmap
from .mapped_weights import keep_file_backed
from .model_loading import build_model, check_load_options

log = logging.getLogger("comfyui_lowvram_dit")

# The node's quantization labels -> what load_wan_model takes (its compute labels: model_loading.COMPUTE)
QUANTIZATION: dict[str, QuantMode] = {"none": "none", "fp8 per-tensor": "per_tensor", "fp8 block-wise": "blockwise"}
LOADER = "Wan Loader"


def _quantize_device() -> torch.device:
    """Quantize on the GPU when there is one (>= 1 GB/s; one tensor at a time, so VRAM use stays small)."""
    import comfy.model_management as mm

    dev = mm.get_torch_device()
    return dev if dev.type == "cuda" else torch.device("cpu")


def load_wan_model(
    path: str | Path,
    mode: QuantMode = "per_tensor",
    block_size: int = 128,
    compute: Compute = "auto",
    save_quantized: bool = False,
    disable_dynamic: bool = False,
):  # noqa: ANN201 - comfy.model_patcher.ModelPatcher
    """Load a Wan file (quantizing while streaming to ``mode`` if it is high precision) and build a native ComfyUI
    MODEL from it whose fp8 layers run ``compute`` (the node maps its labels: ``QUANTIZATION``,
    model_loading ``COMPUTE``).

    ``disable_dynamic`` as in ComfyUI's loaders (its ``cached_patcher_init`` protocol); where DynamicVRAM is on,
    it manages the fp8 model as it manages UNETLoader's (checkpoints/build_recipe.py)."""
    import comfy.utils

    check_load_options(LOADER, mode, compute)
    source = Path(path)
    check_host_reads(source, LOADER)  # a layout this ComfyUI cannot build: refused before any weight is read
    saved = wc.find_quantized(source, mode, block_size)
    read_from = saved or source
    if saved is not None:
        log.info("lowvram_dit: using saved quantized %s for %s", saved.name, source.name)
    bar = comfy.utils.ProgressBar(1000)
    t0 = time.perf_counter()
    mmap = use_mmap()
    loaded = wc.load_wan_state_dict(
        read_from, mode, block_size, device=_quantize_device(), mmap=mmap,
        progress=lambda done, total: bar.update_absolute(int(1000 * done / max(total, 1)), 1000),
        on_map=None if disable_dynamic or not mmap else file_slice_hook(read_from),
    )
    for note in loaded.notes:
        log.info("lowvram_dit: %s", note)
    # ComfyUI widens an empty latent to any model silently: say what fits (the node checks the graph's stock VAE
    # Loaders before loading; a VAE from elsewhere can still mismatch at VAE Decode).
    vae = "the Wan 2.2 VAE (wan2.2_vae) and Wan22ImageToVideoLatent" if loaded.info.out_dim == 48 else "the Wan 2.1 VAE"
    log.info("lowvram_dit: %s (%s) makes %d-channel latents: decode them with %s", source.name, loaded.info.variant,
             loaded.info.out_dim, vae)
    size_gb = read_from.stat().st_size / 1e9
    log.info("lowvram_dit: read %s (%s, %s) in %.1f s (%.2f GB/s); %d fp8 layers, mode %s",
             read_from.name, loaded.info.variant, loaded.info.format, time.perf_counter() - t0,
             size_gb / max(time.perf_counter() - t0, 1e-9), loaded.fp8_layers, loaded.mode)
    if save_quantized and loaded.quantized_here:
        dest = wc.quantized_path_for(source, loaded.mode, block_size)
        try:
            wc.save_quantized(loaded, dest, source,
                              progress=lambda d, t: bar.update_absolute(int(1000 * d / max(t, 1)), 1000))
            log.info("lowvram_dit: saved %s (picked up automatically next time)", dest.name)
        except (OSError, wc.CheckpointError) as exc:  # a read-only folder or a user's file there must not fail the load
            log.warning("lowvram_dit: could not save %s: %s", dest.name, exc)

    if loaded.info.format == "core_quant":
        announce(source.name, loaded.info.layers, LOADER)
    recipe = wan_recipe(loaded.fp8_layers, loaded.block_size or block_size)
    model = build_model(loaded.state_dict, recipe, compute, (load_wan_model, (path, mode, block_size, compute)),
                        disable_dynamic)
    if model is None:
        raise RuntimeError(f"{source.name}: ComfyUI could not detect the model type of this Wan file")
    return keep_file_backed(model)


def _vae_file(name: str) -> str | None:
    """The file VAELoader loads for ``name``: its tiny video autoencoders (lighttaew2_2...) from vae_approx."""
    import folder_paths

    import nodes

    video_taes = getattr(getattr(nodes, "VAELoader", None), "video_taes", ())
    folder = "vae_approx" if Path(name).stem in video_taes else "vae"
    return folder_paths.get_full_path(folder, name)


def check_decoding_vae(path: str | Path, prompt: Any, loader_id: Any) -> None:
    """Before loading: ValueError when a VAE Decode of this model's latents uses a Wan VAE of other channels."""
    out_dim = wc.inspect_checkpoint(path).out_dim
    found = graph_checks.mismatched_vaes(prompt, loader_id, out_dim, _vae_file)
    if found:
        raise ValueError(graph_checks.vae_mismatch_message(Path(path).name, loader_id, out_dim, found))
