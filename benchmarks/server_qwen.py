"""Scenarios ``server_qwen_t2i`` and ``server_qwen_edit``: Qwen-Image and Qwen-Image-Edit through a real server.

``server_qwen_t2i`` (1328x1328, 4 steps, cfg 1, euler/simple, ModelSamplingAuraFlow shift 3.1, 8 GB card):
- native rows: the official image_qwen_image template's nodes (UNETLoader fp8_e4m3fn_fast, CLIPLoader qwen_image,
  CLIPTextEncode x2, EmptySD3LatentImage, KSampler) with ``--use-ck-attention``: native's best; the LoRA row adds
  Qwen-Image-Lightning-4steps-V1.0 through LoraLoaderModelOnly after the UNETLoader;
- pack rows: workflows/qwen_image_t2i_4step.json's graph: the Qwen-Image Staged Loader (text encoder streamed on
  the CPU and freed, fp8 transformer with Block Swap at the card), the LoRA after it (merged once per load);
  ``pack_staged_attn_8gb_lora4`` (group ``all`` only) adds the Attention node (auto).
``server_qwen_edit`` (the image_qwen_image_edit_2509 / 2511 template: UNETLoader default, CLIPLoader on the CPU,
FluxKontextImageScale, TextEncodeQwenImageEditPlus x2, VAEEncode start latent, ModelSamplingAuraFlow, CFGNorm,
KSampler) vs LowVRAM_QwenImageEditStagedLoader in place of the loaders and encoders. Goals: the pack's peak RSS
<= 24 GB with a bf16 encoder, >= 1.4x native per step.
Each row has its own user directory (the staged loaders' embedding caches start empty). Smoke (CPU): tiny files,
64 px, 2 steps, no cap; the native rows are skipped (stock loaders build the encoders at their full widths).
"""

from __future__ import annotations

import argparse
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from comfyui_lowvram_dit.benchmarks.server import CARD_GIB, RESULTS, Row, ServerScenario, node
from comfyui_lowvram_dit.checkpoints.safe_write import same_content, write_atomic

UNET = "qwen_image_fp8_e4m3fn.safetensors"  # the official template's files, as the shipped workflows name them
TEXT_ENCODER = "qwen_2.5_vl_7b_fp8_scaled.safetensors"
VAE = "qwen_image_vae.safetensors"
LORA = "Qwen-Image-Lightning-4steps-V1.0.safetensors"  # lightx2v/Qwen-Image-Lightning, models/loras
# workflows/qwen_image_t2i_4step.json's settings (a unit test keeps them equal).
POSITIVE = ('A cozy bookshop on a rainy evening, warm light spilling onto the wet cobblestones, a hand-painted sign '
            'reading "LOW VRAM BOOKS" above the door, photorealistic, 35mm.')
NEGATIVE = "blurry, low quality, watermark, distorted text"
SHIFT, CFG, SEED, STEPS, SIZE = 3.1, 1.0, 42, 4, 1328
SAMPLER = "3"  # the KSampler's id in the templates
SMOKE_NATIVE = ("stock UNETLoader and CLIPLoader build Qwen-Image and Qwen2.5-VL at their full widths, which the tiny "
                "smoke files do not fill; the native rows need the full-size files")


def QwenRow(name: str, graph: str, **kw: Any) -> Row:  # noqa: N802 - the row type of this scenario
    """A t2i row: native rows run fp8_e4m3fn_fast, every row is at the 8 GB card unless told otherwise."""
    kw.setdefault("weight_dtype", "fp8_e4m3fn_fast")
    kw.setdefault("card_gib", CARD_GIB)
    return Row(name, graph, **kw)


ROWS: dict[str, Row] = {r.name: r for r in (
    QwenRow("native_fp8fast_ck_8gb_4step", "native", ck_attention=True, baseline=True),
    QwenRow("native_fp8fast_ck_8gb_lora4", "native", lora=True, ck_attention=True, baseline=True),
    QwenRow("pack_staged_8gb_4step", "pack"),
    QwenRow("pack_staged_8gb_lora4", "pack", lora=True),
    QwenRow("pack_staged_attn_8gb_lora4", "pack", lora=True, attention="auto"),
)}
DEFAULT_ROWS = [n for n in ROWS if ROWS[n].attention is None]
GROUPS = {"default": DEFAULT_ROWS, "native": [n for n in ROWS if ROWS[n].graph == "native"],
          "pack": [n for n in ROWS if ROWS[n].graph == "pack"], "all": list(ROWS)}


def describe(row: Row) -> str:
    """One line saying what a t2i row runs."""
    if row.graph == "native":
        parts = [f"UNETLoader {row.weight_dtype}", "CLIPLoader", "ck attention" if row.ck_attention else
                 "default attention"]
    else:
        budget = "ComfyUI's free VRAM" if row.card_gib is None else f"{row.card_gib:g} GB"
        parts = [f"Qwen-Image Staged Loader fp8, Block Swap {budget}"]
        parts += [f"Attention {row.attention}"] if row.attention is not None else []
    parts.append("4-step LoRA" if row.lora else "4 steps without the LoRA")
    parts.append("whole GPU" if row.card_gib is None else f"{row.card_gib:g} GB card")
    return ", ".join(parts)


def _loaders(row: Row, g: dict[str, dict], unet: str, te: str, vae: str) -> tuple[list, list, list, list | None]:
    """The row's loader and text nodes into ``g``; the MODEL, positive, negative and VAE links (None: native)."""
    if row.graph == "native":
        g["37"] = node("UNETLoader", "Load Diffusion Model", unet_name=unet, weight_dtype=row.weight_dtype)
        g["38"] = node("CLIPLoader", "Load CLIP", clip_name=te, type="qwen_image", device="default")
        g["6"] = node("CLIPTextEncode", "CLIP Text Encode (Positive Prompt)", text=POSITIVE, clip=["38", 0])
        g["7"] = node("CLIPTextEncode", "CLIP Text Encode (Negative Prompt)", text=NEGATIVE, clip=["38", 0])
        return ["37", 0], ["6", 0], ["7", 0], None
    if row.graph == "pack":
        g["2"] = node("LowVRAM_QwenImageStagedLoader", "Qwen-Image Staged Loader (LowVRAM)", unet_name=unet,
                      clip_name=te, vae_name=vae, positive=POSITIVE, negative=NEGATIVE, quantization="fp8 per-tensor",
                      vram_budget_gb=row.card_gib or 0.0, blocks_to_swap=-1, cache_embeddings=True, compute="auto")
        return ["2", 0], ["2", 1], ["2", 2], ["2", 3]
    raise ValueError(f"row {row.name}: graph must be 'native' or 'pack', not {row.graph!r}")


def build_graph(row: Row, steps: int = STEPS, width: int = SIZE, height: int = SIZE, decode: bool = False,
                unet: str = UNET, te: str = TEXT_ENCODER, vae: str = VAE) -> dict:
    """The t2i API graph of ``row``: loaders, [LoRA], [Attention], ModelSamplingAuraFlow, KSampler, then SaveLatent,
    or with ``decode`` VAEDecode (native) / Qwen-Image Decode (pack) + SaveImage."""
    if steps < 2:
        raise ValueError("steps must be >= 2: the first step holds loading, so at least one later step is needed "
                         "for a per-step time")
    g: dict[str, dict] = {"58": node("EmptySD3LatentImage", "EmptySD3LatentImage", width=width, height=height,
                                     batch_size=1)}
    model, pos, neg, vae_out = _loaders(row, g, unet, te, vae)
    if row.lora:
        g["73"] = node("LoraLoaderModelOnly", "LoRA 4-step", model=model, lora_name=LORA, strength_model=1.0)
        model = ["73", 0]
    if row.attention is not None:
        g["74"] = node("LowVRAM_Attention", "Attention (LowVRAM)", model=model, backend=row.attention)
        model = ["74", 0]
    g["66"] = node("ModelSamplingAuraFlow", "ModelSamplingAuraFlow", model=model, shift=SHIFT)
    g[SAMPLER] = node("KSampler", "KSampler", model=["66", 0], positive=pos, negative=neg, latent_image=["58", 0],
                      seed=SEED, steps=steps, cfg=CFG, sampler_name="euler", scheduler="simple", denoise=1.0)
    if not decode:
        g["60"] = node("SaveLatent", "Save latent", samples=[SAMPLER, 0], filename_prefix=f"bench/{row.name}")
        return g
    if vae_out is None:
        g["39"] = node("VAELoader", "Load VAE", vae_name=vae)
        g["8"] = node("VAEDecode", "VAE Decode", samples=[SAMPLER, 0], vae=["39", 0])
    else:
        g["8"] = node("LowVRAM_QwenImageDecode", "Qwen-Image Decode (LowVRAM)", samples=[SAMPLER, 0], vae=vae_out,
                      vram_budget_gb=row.card_gib or 0.0, tile_size=512, overlap=64, allow_cpu=False)
    g["60"] = node("SaveImage", "Save Image", images=["8", 0], filename_prefix=f"bench/{row.name}")
    return g


def model_files(rows: Sequence[Row], unet: str = UNET, te: str = TEXT_ENCODER, vae: str = VAE) -> tuple[str, ...]:
    """The files ``rows`` load: transformer, text encoder, VAE, and the LoRA when a row uses it."""
    return (unet, te, vae, *((LORA,) if any(r.lora for r in rows) else ()))


def write_smoke_models(models: Path, names: tuple[str, ...], te: str) -> None:
    """Tiny synthetic files under ``names`` (the runner's: the encoder 2 layers deep, as the staged loader reads it)."""
    from comfyui_lowvram_dit.cli import workflow_models

    workflow_models.write_synthetic_models(set(names), models, "tiny", reduced_text_encoders={te})


def _t2i_smoke(opts: argparse.Namespace, files: tuple[str, ...]) -> None:
    opts.steps, opts.width, opts.height = 2, 64, 64
    write_smoke_models(opts.models, files, opts.te)


# ----------------------------------------------------------------------------------------------------------
# Qwen-Image-Edit

EDIT_UNET = "qwen_image_edit_2509_fp8_e4m3fn.safetensors"  # the 2509 template's file
EDIT_TEXT_ENCODER = "qwen_2.5_vl_7b.safetensors"  # bf16: the RSS goal is stated for it
IMAGE = "lowvram_edit_bench.png"
PROMPT = "Replace the cat with a dalmatian, keeping the environment and scene consistent"
EDIT_SHIFT, EDIT_CFG = 3.0, 2.5  # the 2509 template's ModelSamplingAuraFlow shift; its non-LoRA cfg
EDIT_SAMPLER = "15"
EDIT_ROWS = {"native_edit_8gb": Row("native_edit_8gb", "native", card_gib=CARD_GIB, baseline=True),
             "pack_edit_blockswap_8gb": Row("pack_edit_blockswap_8gb", "pack", card_gib=CARD_GIB)}
EDIT_SMOKE_NATIVE = ("CLIPLoader builds ComfyUI's fixed 28-layer 7B config, which the 2-layer smoke encoder does not "
                     "fill; the native row needs the full-size encoder")


def _edit_loaders(g: dict, kind: str, unet: str, te: str, vae: str, card_gib: float | None) -> tuple[list, ...]:
    """The template's three loaders and two encoders (native) or the Edit Staged Loader (pack)."""
    if kind == "native":
        g["3"] = node("UNETLoader", "Load Diffusion Model", unet_name=unet, weight_dtype="default")
        g["4"] = node("CLIPLoader", "Load CLIP", clip_name=te, type="qwen_image", device="cpu")
        g["5"] = node("VAELoader", "Load VAE", vae_name=vae)
        for nid, text in (("6", PROMPT), ("7", "")):
            g[nid] = node("TextEncodeQwenImageEditPlus", "TextEncodeQwenImageEditPlus", clip=["4", 0], prompt=text,
                          vae=["5", 0], image1=["2", 0])
        return ["3", 0], ["6", 0], ["7", 0], ["5", 0]
    if kind == "pack":
        g["3"] = node("LowVRAM_QwenImageEditStagedLoader", "Qwen-Image-Edit Staged Loader (LowVRAM)", unet_name=unet,
                      clip_name=te, vae_name=vae, positive=PROMPT, negative="", quantization="fp8 per-tensor",
                      vram_budget_gb=card_gib or 0.0, blocks_to_swap=-1, cache_embeddings=True, compute="auto",
                      image1=["2", 0])
        return ["3", 0], ["3", 1], ["3", 2], ["3", 3]
    raise ValueError(f"graph kind must be 'native' or 'pack', not {kind!r}")


def build_edit_graph(kind: str, unet: str, te: str, vae: str, steps: int, edit: str, card_gib: float | None,
                     decode: bool = False, scale: bool = True, empty_image: tuple[int, int] | None = None) -> dict:
    """The Edit API graph of one kind ("native" or "pack"). ``scale``: the image goes through FluxKontextImageScale
    (about 1 MP) as in the templates; ``empty_image`` (w, h): a one-colour EmptyImage instead of LoadImage (ComfyUI
    0.33 decodes every loaded image through PyAV; the compute is the same for any picture of that size)."""
    g: dict[str, dict] = {"1": node("LoadImage", "Load Image", image=IMAGE) if empty_image is None else
                          node("EmptyImage", "Reference image", width=empty_image[0], height=empty_image[1],
                               batch_size=1, color=0x5A7D9A)}
    g["2"] = (node("FluxKontextImageScale", "FluxKontextImageScale", image=["1", 0]) if scale else
              node("ImageScaleBy", "Image as loaded", image=["1", 0], upscale_method="nearest-exact", scale_by=1.0))
    model, pos, neg, vae_out = _edit_loaders(g, kind, unet, te, vae, card_gib)
    if edit == "2511":
        g["8"] = node("FluxKontextMultiReferenceLatentMethod", "Edit Model Reference Method (positive)",
                      conditioning=pos, reference_latents_method="index_timestep_zero")
        g["9"] = node("FluxKontextMultiReferenceLatentMethod", "Edit Model Reference Method (negative)",
                      conditioning=neg, reference_latents_method="index_timestep_zero")
        pos, neg = ["8", 0], ["9", 0]
    g["10"] = node("ModelSamplingAuraFlow", "ModelSamplingAuraFlow", model=model, shift=EDIT_SHIFT)
    g["11"] = node("CFGNorm", "CFGNorm", model=["10", 0], strength=1.0)
    g["12"] = node("VAEEncode", "VAE Encode", pixels=["2", 0], vae=vae_out)
    g[EDIT_SAMPLER] = node("KSampler", "KSampler", model=["11", 0], positive=pos, negative=neg, latent_image=["12", 0],
                      seed=SEED, steps=steps, cfg=EDIT_CFG, sampler_name="euler", scheduler="simple", denoise=1.0)
    if decode:
        g["17"] = node("VAEDecode", "VAE Decode", samples=[EDIT_SAMPLER, 0], vae=vae_out)
        g["19"] = node("SaveImage", "Save", images=["17", 0], filename_prefix=f"bench/{kind}_edit")
    else:
        g["19"] = node("SaveLatent", "Save latent", samples=[EDIT_SAMPLER, 0], filename_prefix=f"bench/{kind}_edit")
    return g


def write_input_image(folder: Path, width: int, height: int) -> Path:
    """A deterministic RGB gradient PNG as the reference image (LoadImage reads it from the input folder)."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], -1)
    folder.mkdir(parents=True, exist_ok=True)
    png = io.BytesIO()
    Image.fromarray(rgb.astype(np.uint8)).save(png, format="PNG")
    write_atomic(folder / IMAGE, png.getvalue(), same_content(png.getvalue()))
    return folder / IMAGE


def write_edit_smoke_models(models: Path, unet: str, te: str, vae: str) -> None:
    """The runner's tiny files: a narrow transformer, and a 2-layer encoder of its width with the full-size vision
    tower (its merger projects to the encoder's width), as the runner writes them for the Edit loader."""
    from comfyui_lowvram_dit.cli import workflow_models

    workflow_models.write_synthetic_models({unet, te, vae}, models, "tiny", reduced_text_encoders={te},
                                  vision_text_encoders={te})


def summary(rows: list[dict]) -> dict:
    """The Edit goals from the rows: pack peak RSS (GiB) and native / pack seconds per step."""
    by = {r["variant"]["graph"]: r for r in rows if r.get("status") == "ok" and r.get("variant")}
    out: dict[str, Any] = {}
    if "pack" in by:
        out["pack_peak_rss_gib"] = by["pack"].get("peak_rss_hwm_gib")
    if {"pack", "native"} <= set(by) and by["pack"].get("s_per_step") and by["native"].get("s_per_step"):
        out["speedup_per_step"] = round(by["native"]["s_per_step"] / by["pack"]["s_per_step"], 3)
    return out


def _edit_smoke(opts: argparse.Namespace, files: tuple[str, ...]) -> None:
    opts.steps, opts.image_size = 2, [64, 48]
    write_edit_smoke_models(opts.models, opts.unet, opts.te, opts.vae)


def _edit_graph(row: Row, opts: argparse.Namespace) -> dict:
    return build_edit_graph(row.graph, opts.unet, opts.te, opts.vae, opts.steps, opts.edit, row.card_gib,
                            opts.decode, scale=not opts.smoke,
                            empty_image=tuple(opts.image_size) if opts.empty_image else None)


SCENARIO = ServerScenario(
    "server_qwen_t2i", "Qwen-Image 4 steps", ROWS, GROUPS,
    lambda row, o: build_graph(row, o.steps, o.width, o.height, o.decode, o.unet, o.te, o.vae), describe,
    lambda rows, o: model_files(rows, o.unet, o.te, o.vae), (SAMPLER,), RESULTS / "server_0.33",
    defaults={"variants": "default", "steps": STEPS, "width": SIZE, "height": SIZE, "unet": UNET, "te": TEXT_ENCODER,
              "vae": VAE, "cfg": CFG, "shift": SHIFT},
    smoke=lambda opts, files: _t2i_smoke(opts, files), smoke_native=SMOKE_NATIVE, own_user_dir=True,
    keep_timeline=False)
EDIT_SCENARIO = ServerScenario(
    "server_qwen_edit", "Qwen-Image-Edit", EDIT_ROWS, {"all": list(EDIT_ROWS)}, _edit_graph,
    lambda row: f"{'template loaders' if row.graph == 'native' else 'Edit Staged Loader + Block Swap'}, "
                f"{'whole GPU' if row.card_gib is None else f'{row.card_gib:g} GB card'}",
    lambda rows, o: (o.unet, o.te, o.vae), (EDIT_SAMPLER,), RESULTS / "qwen_edit_0.33",
    defaults={"variants": "all", "steps": 6, "unet": EDIT_UNET, "te": EDIT_TEXT_ENCODER, "vae": VAE, "timeout": 1800.0,
              "cfg": EDIT_CFG, "shift": EDIT_SHIFT},
    smoke=lambda opts, files: _edit_smoke(opts, files), smoke_native=EDIT_SMOKE_NATIVE, own_user_dir=True,
    keep_timeline=False, prepare_input=lambda folder, o: write_input_image(folder, *o.image_size),
    summary=summary)
