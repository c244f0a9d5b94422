"""Qwen-Image text-to-image in 4 steps through a real ComfyUI server at an 8 GB card: native's best vs the pack.

Rows, each one API graph in a fresh server (benchmarks/bench_server_run.py, shared with bench_server and the Edit
bench: ``--reserve-vram`` = the GPU's total minus the card, websocket step timing, ``tools.memwatch`` peaks of the
server process, the pack-import check); 1328x1328, 4 steps, cfg 1, euler/simple, ModelSamplingAuraFlow shift 3.1,
SaveLatent; each row with its own user directory (the staged loader's embedding cache starts empty):
- ``native_fp8fast_ck_8gb_4step`` / ``native_fp8fast_ck_8gb_lora4``: the official image_qwen_image template's nodes
  (UNETLoader ``qwen_image_fp8_e4m3fn`` with weight_dtype fp8_e4m3fn_fast, CLIPLoader ``qwen_2.5_vl_7b_fp8_scaled``
  type qwen_image device default, CLIPTextEncode x2, EmptySD3LatentImage, KSampler) on a server with
  ``--use-ck-attention``: native's best. The LoRA row adds Qwen-Image-Lightning-4steps-V1.0 through
  LoraLoaderModelOnly (strength 1) after the UNETLoader, where the template wires its 8-step LoRA. Both graphs
  encode the shipped workflow's prompt and negative prompt (cfg 1 ignores the negative; it is encoded all the same).
- ``pack_staged_8gb_4step`` / ``pack_staged_8gb_lora4``: workflows/qwen_image_t2i_4step.json's graph: the Qwen-Image
  Staged Loader (text encoder streamed on the CPU and freed, fp8 transformer with Block Swap under vram_budget_gb =
  the card), the LoRA after it (merged once per load into the swapped blocks).
- ``pack_staged_attn_8gb_lora4`` (group ``all`` only): the pack's row with the Attention node (auto) after the LoRA.
s/step: the median of the steps after the first; the first step (model load, LoRA merge or patching) apart.

GPU (lead), full-size synthetic files written into ``--models`` (about 30 GB; ``--write-models``)::

    python -m comfyui_lowvram_dit.benchmarks.bench_qwen_t2i_server --comfyui PATH --models DIR --write-models \\
        --out DIR --stem qwen_t2i_4step_8gb
CPU check of the flow (tiny synthetic files written into ``--models``, 64x64, 2 steps, no cap; the native rows are
skipped there: stock UNETLoader and CLIPLoader build Qwen-Image and Qwen2.5-VL at their full widths)::

    python -m comfyui_lowvram_dit.benchmarks.bench_qwen_t2i_server --comfyui PATH --models /tmp/m --smoke --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from . import bench_server_report as report
from . import bench_server_run as run
from . import harness
from .bench_server_env import gpu_facts, model_file_sizes, software_facts, write_models
from ..checkpoints import safe_write

RESULTS = run.PACK_ROOT / "benchmarks" / "results" / "qwen_image_0.33"
BENCH = "qwen_t2i_4step_8gb"
CARD_GIB = 8.0
# The official image_qwen_image template's files (comfyui-workflow-templates-json), as the shipped workflows name them.
UNET = "qwen_image_fp8_e4m3fn.safetensors"
TEXT_ENCODER = "qwen_2.5_vl_7b_fp8_scaled.safetensors"
VAE = "qwen_image_vae.safetensors"
LORA = "Qwen-Image-Lightning-4steps-V1.0.safetensors"  # lightx2v/Qwen-Image-Lightning, models/loras
# workflows/qwen_image_t2i_4step.json's settings (a unit test keeps them equal).
POSITIVE = ('A cozy bookshop on a rainy evening, warm light spilling onto the wet cobblestones, a hand-painted sign '
            'reading "LOW VRAM BOOKS" above the door, photorealistic, 35mm.')
NEGATIVE = "blurry, low quality, watermark, distorted text"
SHIFT, CFG, SEED, STEPS, SIZE = 3.1, 1.0, 42, 4, 1328
SAMPLER = "3"  # the KSampler's id in the template
SMOKE_NATIVE = ("stock UNETLoader and CLIPLoader build Qwen-Image and Qwen2.5-VL at their full widths, which the tiny "
                "smoke files do not fill; the native rows need the full-size files")


@dataclass(frozen=True)
class QwenRow:
    """One measured configuration: which graph, with or without the 4-step LoRA, which server flags and card."""

    name: str
    graph: str  # "native" or "pack"
    lora: bool = False  # Qwen-Image-Lightning-4steps after the loader (LoraLoaderModelOnly)
    ck_attention: bool = False  # server flag --use-ck-attention
    attention: str | None = None  # pack: the Attention node's backend (None: no Attention node)
    weight_dtype: str = "fp8_e4m3fn_fast"  # native UNETLoader
    card_gib: float | None = CARD_GIB  # None: the whole GPU; else --reserve-vram = total - card_gib
    baseline: bool = False  # a native row the others are compared against

    def server_args(self, total_vram_gib: float) -> list[str]:
        """ComfyUI command-line flags for this row on a GPU of ``total_vram_gib``."""
        return run.server_flags(self.name, total_vram_gib, self.card_gib, self.ck_attention)

    def describe(self) -> str:
        """One line saying what the row runs."""
        if self.graph == "native":
            parts = [f"UNETLoader {self.weight_dtype}", "CLIPLoader",
                     "ck attention" if self.ck_attention else "default attention"]
        else:
            budget = "ComfyUI's free VRAM" if self.card_gib is None else f"{self.card_gib:g} GB"
            parts = [f"Qwen-Image Staged Loader fp8, Block Swap {budget}"]
            parts += [f"Attention {self.attention}"] if self.attention is not None else []
        parts.append("4-step LoRA" if self.lora else "4 steps without the LoRA")
        parts.append("whole GPU" if self.card_gib is None else f"{self.card_gib:g} GB card")
        return ", ".join(parts)


ROWS: dict[str, QwenRow] = {r.name: r for r in (
    QwenRow("native_fp8fast_ck_8gb_4step", "native", ck_attention=True, baseline=True),
    QwenRow("native_fp8fast_ck_8gb_lora4", "native", lora=True, ck_attention=True, baseline=True),
    QwenRow("pack_staged_8gb_4step", "pack"),
    QwenRow("pack_staged_8gb_lora4", "pack", lora=True),
    QwenRow("pack_staged_attn_8gb_lora4", "pack", lora=True, attention="auto"),
)}
DEFAULT_ROWS = [n for n in ROWS if ROWS[n].attention is None]
GROUPS = {"default": DEFAULT_ROWS, "native": [n for n in ROWS if ROWS[n].graph == "native"],
          "pack": [n for n in ROWS if ROWS[n].graph == "pack"], "all": list(ROWS)}


def _node(class_type: str, title: str, **inputs: object) -> dict:
    return {"class_type": class_type, "inputs": inputs, "_meta": {"title": title}}


def _loaders(row: QwenRow, g: dict[str, dict], unet: str, te: str, vae: str) -> tuple[list, list, list, list | None]:
    """The row's loader and text nodes into ``g``; returns the MODEL, positive, negative and VAE links (None: the
    native graph loads its VAE only to decode)."""
    if row.graph == "native":
        g["37"] = _node("UNETLoader", "Load Diffusion Model", unet_name=unet, weight_dtype=row.weight_dtype)
        g["38"] = _node("CLIPLoader", "Load CLIP", clip_name=te, type="qwen_image", device="default")
        g["6"] = _node("CLIPTextEncode", "CLIP Text Encode (Positive Prompt)", text=POSITIVE, clip=["38", 0])
        g["7"] = _node("CLIPTextEncode", "CLIP Text Encode (Negative Prompt)", text=NEGATIVE, clip=["38", 0])
        return ["37", 0], ["6", 0], ["7", 0], None
    if row.graph == "pack":
        g["2"] = _node("LowVRAM_QwenImageStagedLoader", "Qwen-Image Staged Loader (LowVRAM)", unet_name=unet,
                       clip_name=te, vae_name=vae, positive=POSITIVE, negative=NEGATIVE, quantization="fp8 per-tensor",
                       vram_budget_gb=row.card_gib or 0.0, blocks_to_swap=-1, cache_embeddings=True, compute="auto")
        return ["2", 0], ["2", 1], ["2", 2], ["2", 3]
    raise ValueError(f"row {row.name}: graph must be 'native' or 'pack', not {row.graph!r}")


def build_graph(row: QwenRow, steps: int = STEPS, width: int = SIZE, height: int = SIZE, decode: bool = False,
                unet: str = UNET, te: str = TEXT_ENCODER, vae: str = VAE) -> dict:
    """The API graph of ``row``: loaders, [LoRA], [Attention], ModelSamplingAuraFlow, KSampler (node ``SAMPLER``),
    then SaveLatent, or with ``decode`` VAEDecode (native) / Qwen-Image Decode (pack) + SaveImage."""
    if steps < 2:
        raise ValueError("steps must be >= 2: the first step holds loading, so at least one later step is needed "
                         "for a per-step time")
    g: dict[str, dict] = {"58": _node("EmptySD3LatentImage", "EmptySD3LatentImage", width=width, height=height,
                                      batch_size=1)}
    model, pos, neg, vae_out = _loaders(row, g, unet, te, vae)
    if row.lora:
        g["73"] = _node("LoraLoaderModelOnly", "LoRA 4-step", model=model, lora_name=LORA, strength_model=1.0)
        model = ["73", 0]
    if row.attention is not None:
        g["74"] = _node("LowVRAM_Attention", "Attention (LowVRAM)", model=model, backend=row.attention)
        model = ["74", 0]
    g["66"] = _node("ModelSamplingAuraFlow", "ModelSamplingAuraFlow", model=model, shift=SHIFT)
    g[SAMPLER] = _node("KSampler", "KSampler", model=["66", 0], positive=pos, negative=neg, latent_image=["58", 0],
                       seed=SEED, steps=steps, cfg=CFG, sampler_name="euler", scheduler="simple", denoise=1.0)
    if not decode:
        g["60"] = _node("SaveLatent", "Save latent", samples=[SAMPLER, 0], filename_prefix=f"bench/{row.name}")
        return g
    if vae_out is None:
        g["39"] = _node("VAELoader", "Load VAE", vae_name=vae)
        g["8"] = _node("VAEDecode", "VAE Decode", samples=[SAMPLER, 0], vae=["39", 0])
    else:
        g["8"] = _node("LowVRAM_QwenImageDecode", "Qwen-Image Decode (LowVRAM)", samples=[SAMPLER, 0], vae=vae_out,
                       vram_budget_gb=row.card_gib or 0.0, tile_size=512, overlap=64, allow_cpu=False)
    g["60"] = _node("SaveImage", "Save Image", images=["8", 0], filename_prefix=f"bench/{row.name}")
    return g


def model_files(rows: list[QwenRow], unet: str = UNET, te: str = TEXT_ENCODER, vae: str = VAE) -> tuple[str, ...]:
    """The files ``rows`` load: transformer, text encoder, VAE, and the LoRA when a row uses it."""
    return (unet, te, vae, *((LORA,) if any(r.lora for r in rows) else ()))


def write_smoke_models(models: Path, names: tuple[str, ...], te: str) -> None:
    """Tiny synthetic files under ``names`` (the runner's: the encoder 2 layers deep, as the staged loader reads it)."""
    from ..cli import runner

    runner.write_synthetic_models(set(names), models, "tiny", reduced_text_encoders={te})


def run_row(row: QwenRow, opts: argparse.Namespace, total_vram_gib: float) -> dict:
    """One fresh server (own user directory: cold embedding cache), one graph; failures are recorded, not raised."""
    if opts.smoke:
        row = replace(row, card_gib=None)
    graph = build_graph(row, opts.steps, opts.width, opts.height, opts.decode, opts.unet, opts.te, opts.vae)
    setup = run.ServerSetup(opts.comfyui, opts.models, opts.work, timeout=opts.timeout, cpu=opts.smoke,
                            keep_logs=opts.keep_logs)
    record = run.run_row(setup, row, graph, total_vram_gib, _head(row), sampler_nodes=(SAMPLER,), own_user_dir=True)
    record.pop("timeline", None)
    return record


def _head(row: QwenRow) -> dict:
    return {"name": row.name, "what": row.describe(), "variant": asdict(row)}


def markdown(results: list[dict], env: dict, settings: dict) -> str:
    """The rows as markdown: environment, files, how it was measured, one table per card size with the ratios."""
    rat = report.ratios(results)
    lines = [(f"# Qwen-Image {settings['width']}x{settings['height']}, {settings['steps']} steps, through a "
              f"ComfyUI {env.get('comfyui_version', '?')} server"), "",
             (f"- device: {env.get('device_name', '?')} ({env.get('vram_total_gib', '?')} GiB), driver "
              f"{env.get('driver', '?')}; torch {env.get('torch', '?')}, comfy-kitchen {env.get('comfy_kitchen', '?')}, "
              f"comfy-aimdo {env.get('comfy_aimdo', '?')}, Python {env.get('python', '?')}"),
             f"- pack: git {env.get('git_sha', '?')}; status: {env.get('git_status') or 'clean'}",
             (f"- graph: cfg {settings['cfg']}, ModelSamplingAuraFlow shift {settings['shift']}, euler/simple, output "
              f"{'VAE decode + SaveImage' if settings['decode'] else 'SaveLatent (no VAE decode)'}; LoRA {LORA}"),
             "- files (GB): " + ", ".join(f"{k} {v}" for k, v in settings.get("model_files_gb", {}).items()),
             f"- command: `{env.get('command', '?')}`",
             ("- s/step: median of the steps after the first (websocket progress messages); the first step (model "
              "load, LoRA merge or patching) apart; tqdm avg: ComfyUI's own average over all steps; GPU: the server "
              "process per nvidia-smi (context + cache), whole run / from the sampler on; RSS: VmHWM and peak "
              "anonymous RSS of the server process; each row a fresh server with an empty embedding cache"), ""]
    for card in dict.fromkeys(r["variant"]["card_gib"] for r in results):
        rows = [r for r in results if r["variant"]["card_gib"] == card]
        title = "whole GPU" if card is None else f"{card:g} GB card (--reserve-vram = total - {card:g} GiB)"
        lines += [f"## {title}", "", *report.table_lines(rows, rat, first="first step s"), ""]
    return "\n".join(lines)


def write_report(out: Path, stem: str, results: list[dict], env: dict, settings: dict) -> list[Path]:
    """``<stem>.json`` (env, settings, ratios naming the native rows, rows), ``<stem>.md`` and ``<stem>.png``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    title = f"Qwen-Image {settings['width']}x{settings['height']} {settings['steps']} steps"
    note = report.plot(out / f"{stem}.png", results, env, title=title) if results else "no results"
    paths += [out / f"{stem}.png"] if note is None else []
    doc = {"bench": stem, "env": env, "settings": settings, "ratios": report.ratios(results),
           "notes": [note] if note else [], "variants": results}
    safe_write.write_report(paths[0], json.dumps(doc, indent=1, default=str))
    safe_write.write_report(paths[1], markdown(results, env, settings))
    return paths


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--comfyui", type=Path, required=True, help="ComfyUI checkout (main.py there)")
    p.add_argument("--models", type=Path, required=True, help="folder with diffusion_models/ text_encoders/ vae/ loras/")
    p.add_argument("--write-models", action="store_true", help="write missing full-size synthetic files first")
    p.add_argument("--variants", default="default", help=f"comma list of names or {', '.join(GROUPS)}")
    p.add_argument("--unet", default=UNET)
    p.add_argument("--te", default=TEXT_ENCODER)
    p.add_argument("--vae", default=VAE)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--width", type=int, default=SIZE)
    p.add_argument("--height", type=int, default=SIZE)
    p.add_argument("--decode", action="store_true", help="decode + SaveImage instead of SaveLatent")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, tiny files written into --models (a folder of their own), 64x64, 2 steps, no cap")
    p.add_argument("--out", type=Path, default=RESULTS, help="where the json/md/png go")
    p.add_argument("--stem", default=BENCH, help="result file name stem")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds one graph may take")
    p.add_argument("--deadline", type=float, default=0.0, help="seconds from start after which no new row starts")
    p.add_argument("--reserve-estimate", type=float, default=90.0,
                   help="seconds a row is assumed to take when checking --deadline")
    p.add_argument("--keep-logs", action="store_true", help="keep each server log in the work folder")
    p.add_argument("--git-sha", default=None, help="pack commit to record (default: git rev-parse here)")
    p.add_argument("--git-status", default=None, help="`git status --short` of the pack checkout to record")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the chosen rows one fresh server each and write the reports after every row."""
    opts = _parser().parse_args(argv)
    started = time.monotonic()
    rows = run.pick_rows(opts.variants, ROWS, GROUPS)
    if opts.smoke and opts.write_models:
        raise SystemExit("--smoke writes tiny files and --write-models full-size ones into --models: pick one")
    opts.work = (opts.work or Path(tempfile.mkdtemp(prefix="bench_qwen_t2i_"))).resolve()
    env = {**harness.parent_environment(), **gpu_facts(), **software_facts(),
           "comfyui_version": harness.comfyui_version(opts.comfyui)}
    env["git_sha"] = opts.git_sha or env.get("git_sha")
    env["git_status"] = opts.git_status
    files = model_files(rows, opts.unet, opts.te, opts.vae)
    if opts.smoke:
        opts.steps, opts.width, opts.height = 2, 64, 64
        write_smoke_models(opts.models, files, opts.te)
    settings = {"steps": opts.steps, "width": opts.width, "height": opts.height, "cfg": CFG, "shift": SHIFT,
                "decode": opts.decode, "smoke": opts.smoke, "variants": [r.name for r in rows]}
    if opts.write_models:
        settings["model_write_s"] = write_models(opts.models, files)
    settings["model_files_gb"] = model_file_sizes(opts.models, files)
    results: list[dict] = []
    if opts.smoke:
        for row in [r for r in rows if r.graph == "native"]:
            results.append({**_head(row), "status": "skipped", "error": SMOKE_NATIVE})
            print(f"skip {row.name}: {SMOKE_NATIVE}", flush=True)
        rows = [r for r in rows if r.graph != "native"]
    total = env.get("vram_total_gib") or 0.0
    run.run_rows(rows, lambda r: run_row(r, opts, total), _head,
                 lambda done: write_report(opts.out, opts.stem, done, env, settings), results, started,
                 opts.deadline, opts.reserve_estimate)
    paths = write_report(opts.out, opts.stem, results, env, settings)
    print(markdown(results, env, settings))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if any(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
