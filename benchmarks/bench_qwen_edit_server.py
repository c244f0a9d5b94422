"""Qwen-Image-Edit through a real ComfyUI server at an 8 GB card: native template vs the pack's staged Edit path.

Variants, each one API graph in a fresh server (benchmarks/bench_server_run.py, shared with bench_server:
``--reserve-vram`` = the GPU's total minus the card, websocket step timing, ``tools.memwatch`` peaks of the server
process, the pack-import check):
- ``native_edit_8gb``: the official image_qwen_image_edit_2509 / 2511 template's nodes: UNETLoader (default),
  CLIPLoader (qwen_image, device=cpu), VAELoader, FluxKontextImageScale, TextEncodeQwenImageEditPlus x2 (positive,
  empty negative, both with the image), VAEEncode of the image as the start latent, ModelSamplingAuraFlow, CFGNorm,
  KSampler (and FluxKontextMultiReferenceLatentMethod index_timestep_zero for ``--edit 2511``).
- ``pack_edit_blockswap_8gb``: the same graph with LowVRAM_QwenImageEditStagedLoader (CPU text + vision encoder
  streamed and freed, fp8 transformer + Block Swap at 8 GB) in place of the three loaders and the two encode nodes.
Goals: the pack's peak RSS <= 24 GB with a bf16 encoder, and >= 1.4x native per step (median of the steps after
the first). Both runs start with an empty embedding cache (a fresh user directory per variant).

GPU (lead), real or full-size synthetic files under ``--models`` (diffusion_models/, text_encoders/, vae/)::

    python -m comfyui_lowvram_dit.benchmarks.bench_qwen_edit_server --comfyui PATH --models DIR \\
        --unet qwen_image_edit_2509_fp8_e4m3fn.safetensors --te qwen_2.5_vl_7b.safetensors --out DIR
CPU check of the flow (tiny synthetic files written into ``--models``, a 64x48 image not scaled up, 2 steps, no cap;
the native row is skipped there: stock CLIPLoader needs the full-size encoder)::

    python -m comfyui_lowvram_dit.benchmarks.bench_qwen_edit_server --comfyui PATH --models /tmp/m --smoke
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import bench_server as bs
from . import bench_server_run as run
from . import harness
from .bench_server_env import gpu_facts, software_facts
from ..checkpoints.safe_write import same_content, write_atomic, write_report

UNET = "qwen_image_edit_2509_fp8_e4m3fn.safetensors"  # the 2509 template's file
TEXT_ENCODER = "qwen_2.5_vl_7b.safetensors"  # bf16: the RSS goal is stated for it
VAE = "qwen_image_vae.safetensors"
IMAGE = "lowvram_edit_bench.png"
PROMPT = "Replace the cat with a dalmatian, keeping the environment and scene consistent"
SHIFT, CFG, SEED = 3.0, 2.5, 42  # the 2509 template's ModelSamplingAuraFlow shift; its non-LoRA cfg
VARIANTS = {"native_edit_8gb": "native", "pack_edit_blockswap_8gb": "pack"}
SAMPLER = bs.SAMPLER_NODES[0]
SMOKE_NATIVE = ("CLIPLoader builds ComfyUI's fixed 28-layer 7B config, which the 2-layer smoke encoder does not fill; "
                "the native row needs the full-size encoder")


def build_graph(kind: str, unet: str, te: str, vae: str, steps: int, edit: str, card_gib: float | None,
                decode: bool = False, scale: bool = True, empty_image: tuple[int, int] | None = None) -> dict:
    """The API graph of one variant ("native" or "pack"); the sampler is node ``SAMPLER``. ``scale``: the image goes
    through FluxKontextImageScale (about 1 MP) as in the templates; off, the start latent keeps the image's size.
    ``empty_image`` (width, height): a stock EmptyImage of one colour instead of LoadImage (ComfyUI 0.33 decodes
    every loaded image through PyAV; the compute is the same for any picture of that size)."""
    n = bs._node
    g: dict[str, dict] = {"1": n("LoadImage", "Load Image", image=IMAGE) if empty_image is None else
                          n("EmptyImage", "Reference image", width=empty_image[0], height=empty_image[1],
                            batch_size=1, color=0x5A7D9A)}
    if scale:
        g["2"] = n("FluxKontextImageScale", "FluxKontextImageScale", image=["1", 0])
    else:
        g["2"] = n("ImageScaleBy", "Image as loaded", image=["1", 0], upscale_method="nearest-exact", scale_by=1.0)
    if kind == "native":
        g["3"] = n("UNETLoader", "Load Diffusion Model", unet_name=unet, weight_dtype="default")
        g["4"] = n("CLIPLoader", "Load CLIP", clip_name=te, type="qwen_image", device="cpu")
        g["5"] = n("VAELoader", "Load VAE", vae_name=vae)
        for nid, text in (("6", PROMPT), ("7", "")):
            g[nid] = n("TextEncodeQwenImageEditPlus", "TextEncodeQwenImageEditPlus", clip=["4", 0], prompt=text,
                       vae=["5", 0], image1=["2", 0])
        model, pos, neg, vae_out = ["3", 0], ["6", 0], ["7", 0], ["5", 0]
    elif kind == "pack":
        g["3"] = n("LowVRAM_QwenImageEditStagedLoader", "Qwen-Image-Edit Staged Loader (LowVRAM)", unet_name=unet,
                   clip_name=te, vae_name=vae, positive=PROMPT, negative="", quantization="fp8 per-tensor",
                   vram_budget_gb=card_gib or 0.0, blocks_to_swap=-1, cache_embeddings=True, compute="auto",
                   image1=["2", 0])
        model, pos, neg, vae_out = ["3", 0], ["3", 1], ["3", 2], ["3", 3]
    else:
        raise ValueError(f"graph kind must be 'native' or 'pack', not {kind!r}")
    if edit == "2511":
        g["8"] = n("FluxKontextMultiReferenceLatentMethod", "Edit Model Reference Method (positive)",
                   conditioning=pos, reference_latents_method="index_timestep_zero")
        g["9"] = n("FluxKontextMultiReferenceLatentMethod", "Edit Model Reference Method (negative)",
                   conditioning=neg, reference_latents_method="index_timestep_zero")
        pos, neg = ["8", 0], ["9", 0]
    g["10"] = n("ModelSamplingAuraFlow", "ModelSamplingAuraFlow", model=model, shift=SHIFT)
    g["11"] = n("CFGNorm", "CFGNorm", model=["10", 0], strength=1.0)
    g["12"] = n("VAEEncode", "VAE Encode", pixels=["2", 0], vae=vae_out)
    g[SAMPLER] = n("KSampler", "KSampler", model=["11", 0], positive=pos, negative=neg, latent_image=["12", 0],
                   seed=SEED, steps=steps, cfg=CFG, sampler_name="euler", scheduler="simple", denoise=1.0)
    if decode:
        g["17"] = n("VAEDecode", "VAE Decode", samples=[SAMPLER, 0], vae=vae_out)
        g["19"] = n("SaveImage", "Save", images=["17", 0], filename_prefix=f"bench/{kind}_edit")
    else:
        g["19"] = n("SaveLatent", "Save latent", samples=[SAMPLER, 0], filename_prefix=f"bench/{kind}_edit")
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


def write_smoke_models(models: Path) -> None:
    """Tiny synthetic files under the default names (the small encoder keeps ComfyUI's widths and vision tower, so
    the tiny transformer takes the encoder's width as its joint dim: the vision merger projects to it)."""
    from dataclasses import replace

    from ..synthetic import checkpoints as synth
    from ..synthetic.specs import Qwen25VLConfig, model_config
    from .bench_qwen_staged import _write_small_te

    dit = replace(model_config("qwen_image", "tiny"), joint_dim=Qwen25VLConfig().hidden)
    jobs = [("diffusion_models", UNET, lambda p: synth.write_synthetic("qwen_image", p, "tiny", "bf16", seed=0,
                                                                     config=dit)),
            ("text_encoders", TEXT_ENCODER, lambda p: _write_small_te(p, "bf16")),
            ("vae", VAE, lambda p: synth.write_synthetic("wan21_vae", p, "tiny", "bf16", seed=0))]
    for folder, name, write in jobs:
        path = models / folder / name
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            write(path)


def run_variant(name: str, opts: argparse.Namespace, total_vram_gib: float) -> dict:
    """One fresh server (own user directory: cold embedding cache), one graph; failures are recorded, not raised."""
    card = None if opts.smoke else opts.card_gib
    variant = bs.ServerVariant(name, VARIANTS[name], card_gib=card, baseline=VARIANTS[name] == "native")
    graph = build_graph(variant.graph, opts.unet, opts.te, opts.vae, opts.steps, opts.edit, card, opts.decode,
                        scale=not opts.smoke, empty_image=tuple(opts.image_size) if opts.empty_image else None)
    setup = run.ServerSetup(opts.comfyui, opts.models, opts.work, timeout=opts.timeout, cpu=opts.smoke,
                            keep_logs=opts.keep_logs)
    record = run.run_row(setup, variant, graph, total_vram_gib, {"name": name, "graph": variant.graph,
                                                                 "card_gib": card},
                         sampler_nodes=(SAMPLER,), own_user_dir=True,
                         prepare_input=lambda folder: write_input_image(folder, *opts.image_size))
    record.pop("timeline", None)
    return record


def summary(rows: list[dict]) -> dict:
    """The two goals from the rows: pack peak RSS (GiB) and native / pack seconds per step."""
    by = {r["graph"]: r for r in rows if r.get("status") == "ok"}
    out: dict[str, Any] = {}
    if "pack" in by:
        out["pack_peak_rss_gib"] = by["pack"].get("peak_rss_hwm_gib")
    if {"pack", "native"} <= set(by) and by["pack"].get("s_per_step") and by["native"].get("s_per_step"):
        out["speedup_per_step"] = round(by["native"]["s_per_step"] / by["pack"]["s_per_step"], 3)
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--comfyui", type=Path, required=True, help="ComfyUI checkout (main.py there)")
    p.add_argument("--models", type=Path, required=True, help="folder with diffusion_models/ text_encoders/ vae/")
    p.add_argument("--unet", default=UNET)
    p.add_argument("--te", default=TEXT_ENCODER)
    p.add_argument("--vae", default=VAE)
    p.add_argument("--edit", choices=["2509", "2511"], default="2509", help="2511 adds the reference method nodes")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--image-size", type=int, nargs=2, default=[1024, 1024], metavar=("W", "H"))
    p.add_argument("--card-gib", type=float, default=bs.CARD_GIB)
    p.add_argument("--decode", action="store_true", help="VAEDecode + SaveImage instead of SaveLatent")
    p.add_argument("--empty-image", action="store_true",
                   help="a one-colour EmptyImage of --image-size instead of LoadImage (servers without PyAV)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny files written into --models, 64 px, 2 steps")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp dir, removed)")
    p.add_argument("--keep-logs", action="store_true",
                   help="keep each server log as <row>.log in the work folder (a default temp one is then kept)")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the variants one fresh server each, print and optionally write the rows and the goal numbers."""
    opts = _parser().parse_args(argv)
    if opts.smoke:
        write_smoke_models(opts.models)
        opts.steps, opts.image_size = 2, [64, 48]
    names = [s.strip() for s in opts.variants.split(",") if s.strip()]
    unknown = [s for s in names if s not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    own_work = opts.work is None
    opts.work = (opts.work or Path(tempfile.mkdtemp(prefix="bench_edit_"))).resolve()
    env = {**harness.parent_environment(), **gpu_facts(), **software_facts(),
           "comfyui_version": harness.comfyui_version(opts.comfyui)}
    rows = []
    for name in names:
        if opts.smoke and VARIANTS[name] == "native":
            rows.append({"name": name, "graph": "native", "status": "skipped", "error": SMOKE_NATIVE})
            print(f"{name}: skipped ({SMOKE_NATIVE})", flush=True)
            continue
        t0 = time.monotonic()
        rows.append(run_variant(name, opts, env.get("vram_total_gib") or 0.0))
        r = rows[-1]
        print(f"{name}: {r['status']} s/step={r.get('s_per_step')} rss={r.get('peak_rss_hwm_gib')} "
              f"gpu={r.get('peak_gpu_gib')} ({time.monotonic() - t0:.0f} s) {r.get('error', '')[:300]}", flush=True)
    result = {"env": env, "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items()
                                       if k not in ("comfyui", "models", "work", "out")},
              "rows": rows, "goals": summary(rows)}
    print(json.dumps(result["goals"]))
    if opts.out is not None:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        write_report(opts.out, json.dumps(result, indent=1, default=str))
    if own_work and not opts.keep_logs:
        shutil.rmtree(opts.work, ignore_errors=True)
    return 0 if rows and all(r["status"] in ("ok", "skipped") for r in rows) and any(r["status"] == "ok" for r in rows) \
        else 1


if __name__ == "__main__":
    sys.exit(main())
