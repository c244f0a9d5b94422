"""Wan 2.2 T2V-A14B through a real ComfyUI server: seconds per sampler step, peak VRAM and peak RSS per variant.

Each variant is one API graph run in a fresh ComfyUI server started as users start it (``main.py``; DynamicVRAM
on unless the variant turns it off; ``--front-end-root`` on an empty folder, since only the API is used). Native
graphs: UNETLoader (a weight_dtype) x2, CLIPLoader + CLIPTextEncode, KSamplerAdvanced x2. Pack graphs: the
shipped workflow's nodes (Wan Loader, Attention, optional Block Swap / Torch Compile, Wan Text Encode). An
"8 GB card" is ComfyUI's own ``--reserve-vram`` set to the card's total minus 8 GiB; nothing stops the process
from taking more, so the measured GPU peak says whether it would fit.

Step time and memory: benchmarks/bench_server_run.py (websocket ``progress`` messages, the first step of each
expert reported apart; ``tools.memwatch`` peaks of the server process), shared with the Qwen-Image benches.

4-step LoRA rows (``--variants lora``): the lightx2v 4-step LoRAs (stock LoraLoaderModelOnly after each loader), cfg 1,
shift 5 as workflows/wan22_t2v_a14b_4step.json, 8 GB cap, each next to the same graph without the LoRAs: native
fp8_e4m3fn_fast (with and without ``--use-ck-attention``), the pack with Block Swap (merged once per load) and under
ComfyUI's partial loading (per-call LoRA).
The LoRA files must be in ``--models``/loras (``--write-models`` writes them where the runner can).

Run (the ComfyUI Python, with the pack importable as ``comfyui_lowvram_dit``)::

    python -m comfyui_lowvram_dit.benchmarks.bench_server --comfyui PATH --models DIR \\
        --variants native_default,pack --out benchmarks/results/server_0.33
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import bench_server_run as run
from . import harness
from .bench_server_env import gpu_facts, merged_rows, model_file_sizes, software_facts, write_models
from .bench_server_run import PROBE_CALL, PROBE_NODE

RESULTS = run.PACK_ROOT / "benchmarks" / "results" / "server_0.33"
BENCH = "server_t2v_a14b"
CARD_GIB = 8.0

HIGH = "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors"
LOW = "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors"
TEXT_ENCODER = "umt5_xxl_fp8_e4m3fn_scaled.safetensors"
VAE = "wan_2.1_vae.safetensors"
MODEL_FILES = (HIGH, LOW, TEXT_ENCODER, VAE)
# The lightx2v 4-step LoRAs of workflows/wan22_t2v_a14b_4step.json (official template names, models/loras).
HIGH_LORA = "wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors"
LOW_LORA = "wan2.2_t2v_lightx2v_4steps_lora_v1.1_low_noise.safetensors"
LORA_FILES = (HIGH_LORA, LOW_LORA)
LORA_SHIFT, LORA_CFG = 5.0, 1.0  # the 4-step workflow's ModelSamplingSD3 shift and cfg

# The shipped workflow's settings (workflows/wan22_t2v_a14b.json; a unit test keeps them equal).
POSITIVE = ("A red fox trots through fresh snow in a birch forest at golden hour, its breath visible in the cold "
            "air; the camera tracks it at eye level, shallow depth of field, cinematic.")
NEGATIVE = ("blurry, low quality, jpeg artifacts, static, still image, overexposed, subtitles, watermark, deformed, "
            "extra limbs, worst quality")
SHIFT, CFG, SEED, SAMPLER, SCHEDULER = 8.0, 3.5, 42, "euler", "simple"
WIDTH, HEIGHT, FRAMES = 832, 480, 81


@dataclass(frozen=True)
class ServerVariant:
    """One measured configuration: which graph, which server flags, which card size."""

    name: str
    graph: str  # "native" or "pack"
    weight_dtype: str = "default"  # native UNETLoader
    attention: str = "auto"  # pack Attention backend
    compile: bool = False  # pack Torch Compile after Attention
    block_swap_gb: float | None = None  # pack Block Swap vram_budget_gb (None: no Block Swap node)
    ck_attention: bool = False  # server flag --use-ck-attention
    dynamic_vram: bool = True  # False: --disable-dynamic-vram (legacy partial loading)
    card_gib: float | None = None  # None: the whole GPU; else --reserve-vram = total - card_gib
    baseline: bool = False  # a native row other rows are compared against
    lora: bool = False  # the 4-step LoRAs after each expert's loader (LoraLoaderModelOnly)
    four_step: bool = False  # the 4-step workflow's sampling (cfg 1, shift 5), with or without the LoRAs
    fp8_path: str = "default"  # pack per-tensor fp8 GEMM path, set by the Kernel Profile node (needs --kernel-profile)

    @property
    def cfg(self) -> float:
        """The sampler's cfg: 1 for 4-step rows (one forward per step), the shipped workflow's otherwise."""
        return LORA_CFG if self.four_step else CFG

    @property
    def shift(self) -> float:
        """ModelSamplingSD3 shift of this row."""
        return LORA_SHIFT if self.four_step else SHIFT

    def server_args(self, total_vram_gib: float) -> list[str]:
        """ComfyUI command-line flags for this variant on a GPU of ``total_vram_gib``."""
        return run.server_flags(self.name, total_vram_gib, self.card_gib, self.ck_attention, self.dynamic_vram)

    def describe(self) -> str:
        """One line saying what the variant runs."""
        if self.graph == "native":
            parts = [f"UNETLoader {self.weight_dtype}", "ck attention" if self.ck_attention else "default attention"]
        else:
            parts = ["Wan Loader fp8 per-tensor", f"Attention {self.attention}"]
            if self.block_swap_gb is not None:
                parts.append(f"Block Swap {self.block_swap_gb:g} GB")
            if self.compile:
                parts.append("Torch Compile")
            parts += [f"fp8 path {self.fp8_path}"] if self.fp8_path != "default" else []
        if self.four_step:
            parts.append("4-step LoRAs" if self.lora else "4-step sampling without the LoRAs")
        parts.append("DynamicVRAM" if self.dynamic_vram else "legacy loading (--disable-dynamic-vram)")
        parts.append("whole GPU" if self.card_gib is None else f"{self.card_gib:g} GB card")
        return ", ".join(parts)


_8 = CARD_GIB
VARIANTS: dict[str, ServerVariant] = {v.name: v for v in (
    ServerVariant("native_default", "native", baseline=True),
    ServerVariant("native_fp8fast", "native", weight_dtype="fp8_e4m3fn_fast", baseline=True),
    ServerVariant("native_fp8fast_ck", "native", weight_dtype="fp8_e4m3fn_fast", ck_attention=True, baseline=True),
    ServerVariant("pack", "pack"),
    ServerVariant("pack_int8", "pack", attention="lowvram 8-bit"),
    ServerVariant("pack_int8_compile", "pack", attention="lowvram 8-bit", compile=True),
    ServerVariant("pack_tensorwise", "pack", fp8_path="scaled_mm_tensorwise"),
    ServerVariant("pack_int8_compile_tensorwise", "pack", attention="lowvram 8-bit", compile=True,
                  fp8_path="scaled_mm_tensorwise"),
    ServerVariant("native_default_8gb", "native", card_gib=_8, baseline=True),
    ServerVariant("native_fp8fast_8gb", "native", weight_dtype="fp8_e4m3fn_fast", card_gib=_8, baseline=True),
    ServerVariant("native_fp8fast_ck_8gb", "native", weight_dtype="fp8_e4m3fn_fast", ck_attention=True, card_gib=_8,
                  baseline=True),
    ServerVariant("native_fp8fast_legacy_8gb", "native", weight_dtype="fp8_e4m3fn_fast", dynamic_vram=False,
                  card_gib=_8, baseline=True),
    ServerVariant("pack_8gb", "pack", card_gib=_8),
    ServerVariant("pack_blockswap_8gb", "pack", block_swap_gb=_8, card_gib=_8),
    ServerVariant("pack_blockswap_int8_8gb", "pack", attention="lowvram 8-bit", block_swap_gb=_8, card_gib=_8),
    ServerVariant("pack_int8_compile_8gb", "pack", attention="lowvram 8-bit", compile=True, card_gib=_8),
    # 4-step LoRA rows (cfg 1, shift 5) at the 8 GB cap: each LoRA row next to the same graph without the LoRAs
    ServerVariant("native_fp8fast_8gb_4step", "native", weight_dtype="fp8_e4m3fn_fast", card_gib=_8, four_step=True,
                  baseline=True),
    ServerVariant("native_fp8fast_8gb_lora4", "native", weight_dtype="fp8_e4m3fn_fast", card_gib=_8, four_step=True,
                  lora=True, baseline=True),
    ServerVariant("native_fp8fast_ck_8gb_4step", "native", weight_dtype="fp8_e4m3fn_fast", ck_attention=True,
                  card_gib=_8, four_step=True, baseline=True),
    ServerVariant("native_fp8fast_ck_8gb_lora4", "native", weight_dtype="fp8_e4m3fn_fast", ck_attention=True,
                  card_gib=_8, four_step=True, lora=True, baseline=True),
    ServerVariant("pack_blockswap_8gb_4step", "pack", block_swap_gb=_8, card_gib=_8, four_step=True),
    ServerVariant("pack_blockswap_8gb_lora4", "pack", block_swap_gb=_8, card_gib=_8, four_step=True, lora=True),
    ServerVariant("pack_8gb_lora4", "pack", card_gib=_8, four_step=True, lora=True),
)}
LORA_ROWS = [n for n, v in VARIANTS.items() if v.four_step]
UNCAPPED = [n for n, v in VARIANTS.items() if v.card_gib is None]
CAPPED = [n for n, v in VARIANTS.items() if v.card_gib is not None]


# ----------------------------------------------------------------------------------------------------------
# graphs


def _node(class_type: str, title: str, **inputs: Any) -> dict:
    return {"class_type": class_type, "inputs": inputs, "_meta": {"title": title}}


def _samplers(high_model: list, low_model: list, pos: list, neg: list, steps_per_expert: int,
              cfg: float = CFG) -> dict:
    """The two KSamplerAdvanced nodes of the workflow: high-noise expert first, low-noise expert after."""
    steps = 2 * steps_per_expert
    common = {"steps": steps, "cfg": cfg, "sampler_name": SAMPLER, "scheduler": SCHEDULER,
              "positive": pos, "negative": neg}
    return {
        "15": _node("KSamplerAdvanced", "Sampler (high noise)", add_noise="enable", noise_seed=SEED,
                    start_at_step=0, end_at_step=steps_per_expert, return_with_leftover_noise="enable",
                    model=high_model, latent_image=["13", 0], **common),
        "16": _node("KSamplerAdvanced", "Sampler (low noise)", add_noise="disable", noise_seed=0,
                    start_at_step=steps_per_expert, end_at_step=10000, return_with_leftover_noise="disable",
                    model=low_model, latent_image=["15", 0], **common),
    }


def _pack_model_chain(graph: dict, first_id: int, unet: str, variant: ServerVariant, label: str) -> list:
    """Wan Loader -> [Block Swap] -> Attention -> [Torch Compile] -> ModelSamplingSD3; returns the output link."""
    nid = first_id
    graph[str(nid)] = _node("LowVRAM_WanLoader", f"Wan Loader ({label})", unet_name=unet,
                            quantization="fp8 per-tensor", block_size="128", compute="auto", save_quantized=False)
    link = [str(nid), 0]
    if variant.lora:
        nid += 1
        graph[str(nid)] = _lora(link, unet, label)
        link = [str(nid), 0]
    if variant.block_swap_gb is not None:
        nid += 1
        graph[str(nid)] = _node("LowVRAM_BlockSwap", f"Block Swap ({label})", model=link,
                                vram_budget_gb=variant.block_swap_gb, blocks_to_swap=-1, prefetch=1, pinned=True,
                                offload_embeddings=False, debug=False)
        link = [str(nid), 0]
    nid += 1
    graph[str(nid)] = _node("LowVRAM_Attention", f"Attention ({label})", model=link, backend=variant.attention)
    link = [str(nid), 0]
    if variant.compile:
        nid += 1
        graph[str(nid)] = _node("LowVRAM_TorchCompile", f"Torch Compile ({label})", model=link, mode="default",
                                backend="inductor", dynamic="auto", fullgraph=False, cache_size_limit=64,
                                fallback=True, scope="blocks")
        link = [str(nid), 0]
    nid += 1
    graph[str(nid)] = _node("ModelSamplingSD3", f"ModelSamplingSD3 ({label})", model=link, shift=variant.shift)
    return [str(nid), 0]


def _lora(model: list, unet: str, label: str) -> dict:
    """The stock LoraLoaderModelOnly with the expert's 4-step LoRA at the official template's strength 1."""
    return _node("LoraLoaderModelOnly", f"LoRA 4-step ({label})", model=model,
                 lora_name=HIGH_LORA if unet == HIGH else LOW_LORA, strength_model=1.0)


def build_graph(variant: ServerVariant, steps_per_expert: int = 3, width: int = WIDTH, height: int = HEIGHT,
                frames: int = FRAMES, decode: bool = False, probe: bool = False) -> dict:
    """The API graph of ``variant``: two experts, ``steps_per_expert`` steps each; decode+WEBP or SaveLatent.

    ``probe``: each expert's model goes through the benchmark's Kernel Profile node (benchmarks/server_probe),
    which times every model call and profiles the second (PROBE_CALL).
    """
    if steps_per_expert < 2:
        raise ValueError("steps_per_expert must be >= 2: the first step of each expert holds loading, so at least "
                         "one later step is needed for a per-step time")
    graph: dict[str, dict] = {"13": _node("EmptyHunyuanLatentVideo", "Video size", width=width, height=height,
                                          length=frames, batch_size=1)}
    if variant.graph == "native":
        graph["3"] = _node("UNETLoader", "Load Diffusion Model (high noise)", unet_name=HIGH,
                           weight_dtype=variant.weight_dtype)
        graph["7"] = _node("UNETLoader", "Load Diffusion Model (low noise)", unet_name=LOW,
                           weight_dtype=variant.weight_dtype)
        high_src, low_src = ["3", 0], ["7", 0]
        if variant.lora:
            graph["4"], graph["8"] = _lora(high_src, HIGH, "high noise"), _lora(low_src, LOW, "low noise")
            high_src, low_src = ["4", 0], ["8", 0]
        graph["6"] = _node("ModelSamplingSD3", "ModelSamplingSD3 (high noise)", model=high_src, shift=variant.shift)
        graph["10"] = _node("ModelSamplingSD3", "ModelSamplingSD3 (low noise)", model=low_src, shift=variant.shift)
        graph["11"] = _node("CLIPLoader", "Load CLIP", clip_name=TEXT_ENCODER, type="wan", device="default")
        graph["20"] = _node("CLIPTextEncode", "Positive", text=POSITIVE, clip=["11", 0])
        graph["21"] = _node("CLIPTextEncode", "Negative", text=NEGATIVE, clip=["11", 0])
        high, low, pos, neg = ["6", 0], ["10", 0], ["20", 0], ["21", 0]
    elif variant.graph == "pack":
        high = _pack_model_chain(graph, 30, HIGH, variant, "high noise")
        low = _pack_model_chain(graph, 40, LOW, variant, "low noise")
        graph["11"] = _node("LowVRAM_WanTextEncode", "Wan Text Encode (LowVRAM)", clip_name=TEXT_ENCODER,
                            positive=POSITIVE, negative=NEGATIVE, cache_embeddings=True)
        pos, neg = ["11", 0], ["11", 1]
    else:
        raise ValueError(f"variant {variant.name}: graph must be 'native' or 'pack', not {variant.graph!r}")
    if variant.fp8_path != "default" and not probe:
        raise ValueError(f"variant {variant.name}: an fp8 path is set by the Kernel Profile node; add --kernel-profile")
    if probe:
        for nid, label in (("50", "high"), ("51", "low")):
            src = high if label == "high" else low
            graph[nid] = _node(PROBE_NODE, f"Kernel Profile ({label} noise)", model=src, label=label,
                               profile_call=PROBE_CALL, fp8_path=variant.fp8_path)
        high, low = ["50", 0], ["51", 0]
    graph.update(_samplers(high, low, pos, neg, steps_per_expert, variant.cfg))
    if decode:
        graph["12"] = _node("VAELoader", "Load VAE", vae_name=VAE)
        graph["18"] = _node("VAEDecode", "VAE Decode", samples=["16", 0], vae=["12", 0])
        graph["19"] = _node("SaveAnimatedWEBP", "Save", images=["18", 0], filename_prefix=f"bench/{variant.name}",
                            fps=16.0, lossless=False, quality=85, method="default")
    else:
        graph["19"] = _node("SaveLatent", "Save latent", samples=["16", 0], filename_prefix=f"bench/{variant.name}")
    return graph


SAMPLER_NODES = ("15", "16")


def _head(variant: ServerVariant) -> dict:
    return {"name": variant.name, "what": variant.describe(), "variant": asdict(variant)}


def run_variant(variant: ServerVariant, opts: argparse.Namespace, total_vram_gib: float) -> dict:
    """One fresh server, one graph (bench_server_run.run_row); a failure is recorded with its reason and the log."""
    graph = build_graph(variant, opts.steps_per_expert, opts.width, opts.height, opts.frames, decode=opts.decode,
                        probe=opts.kernel_profile)
    setup = run.ServerSetup(opts.comfyui, opts.models, opts.work, timeout=opts.timeout, cpu=opts.cpu,
                            keep_logs=opts.keep_logs, list_nodes=opts.list_nodes)
    return run.run_row(setup, variant, graph, total_vram_gib, _head(variant), sampler_nodes=SAMPLER_NODES,
                       probe=opts.kernel_profile)


# ----------------------------------------------------------------------------------------------------------
# environment, synthetic files, main


def pick_variants(spec: str) -> list[ServerVariant]:
    """Variants from a comma list of names or the groups 'uncapped', 'capped', 'lora' (4-step rows), 'all'."""
    return run.pick_rows(spec, VARIANTS, {"uncapped": UNCAPPED, "capped": CAPPED, "lora": LORA_ROWS,
                                          "all": list(VARIANTS)})


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--comfyui", type=Path, required=True, help="ComfyUI checkout (main.py there)")
    p.add_argument("--models", type=Path, required=True, help="folder with diffusion_models/ text_encoders/ vae/")
    p.add_argument("--write-models", action="store_true", help="write missing full-size synthetic files first")
    p.add_argument("--variants", default="all", help="comma list of names or uncapped, capped, lora, all")
    p.add_argument("--steps-per-expert", type=int, default=3)
    p.add_argument("--width", type=int, default=WIDTH)
    p.add_argument("--height", type=int, default=HEIGHT)
    p.add_argument("--frames", type=int, default=FRAMES)
    p.add_argument("--cpu", action="store_true", help="run ComfyUI on the CPU (tests of this script only)")
    p.add_argument("--decode", action="store_true", help="VAE decode + SaveAnimatedWEBP instead of SaveLatent")
    p.add_argument("--out", type=Path, default=RESULTS, help="where the json/md/png go")
    p.add_argument("--stem", default=BENCH, help="result file name stem")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds one graph may take")
    p.add_argument("--deadline", type=float, default=0.0,
                   help="seconds from start after which no new variant starts (0: none)")
    p.add_argument("--reserve-estimate", type=float, default=90.0,
                   help="seconds a variant is assumed to take when checking --deadline")
    p.add_argument("--git-sha", default=None, help="pack commit to record (default: git rev-parse here)")
    p.add_argument("--git-status", default=None, help="`git status --short` of the pack checkout to record")
    p.add_argument("--keep-logs", action="store_true", help="keep each server log in the work folder")
    p.add_argument("--list-nodes", action="store_true", help="record the pack's nodes from /object_info")
    p.add_argument("--kernel-profile", action="store_true",
                   help="time every model call inside the server and profile each expert's second step "
                        "(benchmarks/server_probe); that step is left out of s/step")
    p.add_argument("--merge", type=Path, action="append", default=[], metavar="JSON",
                   help="rows of an earlier run of this script to report with (a row run now replaces its name)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the chosen variants one fresh server each and write the reports after every variant."""
    from . import bench_server_report as report

    opts = _parser().parse_args(argv)
    started = time.monotonic()
    opts.work = (opts.work or Path(tempfile.mkdtemp(prefix="bench_server_"))).resolve()
    variants = pick_variants(opts.variants)
    if not opts.kernel_profile and (need := [v.name for v in variants if v.fp8_path != "default"]):
        raise SystemExit(f"--variants {','.join(need)}: the Kernel Profile node sets their fp8 path; add --kernel-profile")
    env = {**harness.parent_environment(), **gpu_facts(), **software_facts(),
           "comfyui_version": harness.comfyui_version(opts.comfyui)}
    env["git_sha"] = opts.git_sha or env.get("git_sha")
    env["git_status"] = opts.git_status
    settings = {"steps_per_expert": opts.steps_per_expert, "width": opts.width, "height": opts.height, "frames": opts.frames,
                "kernel_profile": opts.kernel_profile,
                "cfg": CFG, "cfg_4step": LORA_CFG, "shift_4step": LORA_SHIFT, "decode": opts.decode,
                "variants": [v.name for v in variants]}
    files = MODEL_FILES + (LORA_FILES if any(v.lora for v in variants) else ())
    if opts.write_models:
        settings["model_write_s"] = write_models(opts.models, files)
    settings["model_files_gb"] = model_file_sizes(opts.models, files)
    total = env.get("vram_total_gib") or 0.0
    results = merged_rows(opts.merge, {v.name for v in variants})
    run.run_rows(variants, lambda v: run_variant(v, opts, total), _head,
                 lambda rows: report.write(opts.out, opts.stem, rows, env, settings), results, started,
                 opts.deadline, opts.reserve_estimate)
    paths = report.write(opts.out, opts.stem, results, env, settings)
    print(report.markdown(results, env, settings))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if any(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
