"""Readers of the result JSON layouts under benchmarks/results/: each turns one file into rows of the common format.

The common format (benchmarks/README.md, "The common format") is what a new scenario writes: ``{"env": {...}, "rows":
[...]}``. Older scenarios wrote four other layouts: in-process harness runs (``bench``, ``settings``, ``variants``
with a ``target``), server runs (``variants`` with a ``variant`` graph description), per-row server files and the
MultiGPU script's ``environment`` + ``rows``; and one whole-workflow run report. ``read`` picks the layout's
adapter; a file no adapter claims as setups (a kernel or correctness benchmark) comes back as a component entry.
Plain JSON in, plain dicts out: no ComfyUI, no torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

# Fields of a common-format row (benchmarks/README.md); `side`, `how`, `cfg`, `gpus`, `lora`, `status` are optional.
ROW_FIELDS = ("name", "model", "resolution", "frames", "steps", "card_gib", "file_format", "setup", "memory_manager",
              "s_per_step", "render_s", "peak_vram_gib", "peak_rss_gib", "against", "ratio")
ENV_FIELDS = ("device", "gpu", "torch", "comfyui", "comfy_kitchen", "commit", "date", "command")
WAN14B, WAN5B, QWEN, QWEN_EDIT = "Wan 2.2 T2V-A14B", "Wan 2.2 TI2V-5B", "Qwen-Image", "Qwen-Image-Edit"
# Who keeps the weights: ComfyUI's DynamicVRAM, its older partial loading (0.8.0, or a model DynamicVRAM does not
# manage), load_models_gpu placing an in-process model (the benchmark's stand-in for KSampler), or Block Swap.
DYNAMIC_VRAM, LEGACY, LOAD_MODELS_GPU = "DynamicVRAM", "ComfyUI legacy loading", "load_models_gpu"
IN_PROCESS = "in process"  # one forward through apply_model (cfg 1), each row in a fresh process
SERVER = "server"  # a real ComfyUI server, s/step from its websocket progress messages


def file_format(file_name: str) -> str:
    """The checkpoint format a model file name says: fp8_scaled, fp8_e4m3fn, bf16, fp16 or gguf."""
    name = file_name.lower()
    for marker, fmt in (("fp8_scaled", "fp8_scaled"), (".gguf", "gguf"), ("fp8_e4m3fn", "fp8_e4m3fn"),
                        ("bf16", "bf16"), ("fp16", "fp16")):
        if marker in name:
            return fmt
    return "bf16"  # the synthetic writers' default


def run_env(env: dict) -> dict:
    """The index's environment fields from any layout's env / environment block."""
    gpus = env.get("gpus") or []
    gpu = env.get("gpu") or env.get("device_name") or (gpus[0] if gpus else None)
    stamp = env.get("date") or env.get("timestamp") or ""
    commit = env.get("commit") or env.get("git_sha")
    if commit:  # short sha, keeping the mark of a tree that differed from it
        commit = commit[:7] + ("-dirty" if commit.endswith("-dirty") else "")
    return {"device": env.get("device") or ("cuda" if gpu else None),
            "gpu": gpu.removeprefix("NVIDIA ") if gpu else None,
            "torch": env.get("torch"), "comfyui": env.get("comfyui") or env.get("comfyui_version"),
            "comfy_kitchen": env.get("comfy_kitchen"), "commit": commit, "date": stamp[:10] or None,
            "command": env.get("command")}


def _row(**fields: Any) -> dict:
    """A row with every common field (missing ones None) and the optional ones given."""
    return {**{k: None for k in ROW_FIELDS}, "side": "pack", "how": IN_PROCESS, "cfg": None, "gpus": 1,
            "lora": None, "status": "ok", **fields}


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else round(ms / 1000, 4)


def _res(kwargs: dict) -> tuple[str | None, int | None]:
    width, height = kwargs.get("width"), kwargs.get("height")
    return (f"{width}x{height}" if width and height else None), kwargs.get("frames")


# ---- in-process harness runs: one interpretation per target function ----

BLOCK_SWAP_KINDS = {"native": ("native", "UNETLoader fp8_e4m3fn"),
                    "native_bf16": ("native", "UNETLoader default (bf16)"),
                    "swap": ("pack", "UNETLoader fp8_e4m3fn + Block Swap"),
                    "swap_b2": ("pack", "Wan Loader fp8 per-tensor + Block Swap")}


def _wan_case(module: str, kw: dict) -> tuple[str, str]:
    """(side, setup) of a Wan 14B harness row (bench_block_swap, bench_wan_fp8, bench_wan) from its kwargs."""
    if module == "bench_block_swap":
        return BLOCK_SWAP_KINDS[kw["kind"]]
    weights = kw.get("weights") or kw.get("weight_dtype") or "default"
    if kw.get("kind") == "native" or weights.startswith("fp8_e4m3fn"):
        file_note = f" ({kw['fmt']} file)" if kw.get("fmt") else " (bf16)" if kw.get("dtype") == "bfloat16" else ""
        return "native", f"UNETLoader {weights}{file_note}"
    mode = kw.get("mode") or weights
    block = f" {kw.get('block_size', 128)}" if mode == "blockwise" else ""
    setup = f"Wan Loader fp8 {mode.replace('_', '-')}{block}"
    if kw.get("swap"):
        setup += " + Block Swap (budget 0)"
    return "pack", setup + (f" + Attention {kw['attention']}" if kw.get("attention") else "")


def _compile_case(kw: dict) -> tuple[str, str]:
    """(side, setup) of a Torch Compile harness row (bench_compile model_case)."""
    if not kw.get("fp8"):
        return "native", "UNETLoader " + (kw.get("weight_dtype") or "default (bf16)")
    setup = f"Wan Loader fp8 {kw['fp8'].replace('_', '-')}"
    if kw.get("attention"):
        setup += f" + Attention {kw['attention']}"
    if kw.get("how") == "ours":
        setup += f" + Torch Compile ({kw.get('mode', 'default')})"
    return "pack", setup


def _qwen_case(func: str, kw: dict, name: str) -> tuple[str, str]:
    """(side, setup) of a Qwen-Image harness row (bench_qwen_staged)."""
    if func == "native_step":
        return "native", "UNETLoader fp8_e4m3fn_fast" + (" + --use-ck-attention" if kw.get("ck_attention") else "")
    if func == "native":
        return "native", "CLIPLoader (cpu) + UNETLoader default, VAEDecode"
    if func == "ours_step":
        return "pack", "Staged Loader transformer (fp8 per-tensor, Block Swap at the cap) + Attention auto"
    cache = "cold embedding cache" if kw.get("clear_cache") else "cached prompt"
    return "pack", "Qwen-Image Staged Loader" + (" + Block Swap" if kw.get("vram_cap_gb") else "") + \
        (", resident" if "resident" in name else f", {cache}")


def _harness_setup(target: str, kw: dict, name: str) -> tuple[str, str, str, str] | None:
    """(model, side, setup, file format) of a harness row, or None when the target is not a whole-model setup."""
    module, func = target.rsplit(".", 1)[-1].split(":")
    if module in ("bench_block_swap", "bench_wan_fp8", "bench_wan"):
        return (WAN14B, *_wan_case(module, kw), kw.get("fmt") or "bf16")
    if module == "bench_compile" and func == "model_case" and kw.get("size") == "full" and kw.get("frames"):
        return (WAN14B, *_compile_case(kw), "bf16")
    if module == "bench_nan_guard":
        return WAN14B, "pack", "Wan Loader fp8 per-tensor" + (" + NaN Guard" if kw.get("guard") else ""), "bf16"
    if module == "bench_wan5b_native":
        dtype = (kw.get("model_options") or {}).get("dtype")
        setup = "UNETLoader " + (f"default ({dtype})" if dtype else kw.get("weight_dtype", "default"))
        return WAN5B, "native", setup, "bf16"
    if module == "bench_qwen_staged":  # the *_step rows read a bf16 file, the staged pipeline an fp8 one
        fmt = file_format(kw["file"]) if "file" in kw else "fp8_e4m3fn"
        return (QWEN_EDIT if kw.get("edit") else QWEN, *_qwen_case(func, kw, name), fmt)
    return None


def _harness_rows(data: dict) -> list[dict]:
    rows = []
    for v in data["variants"]:
        kw, metrics = v.get("kwargs") or {}, v.get("metrics") if isinstance(v.get("metrics"), dict) else {}
        found = _harness_setup(v.get("target", ""), kw, v["name"])
        if found is None:
            return []  # a kernel benchmark: a component, not setups
        model, side, setup, fmt = found
        resolution, frames = _res(kw)
        cap = kw.get("vram_cap_gb")
        rows.append(_row(
            name=v["name"], model=model, resolution=resolution or metrics.get("resolution"), frames=frames,
            card_gib=cap, file_format=fmt, setup=setup,
            memory_manager="Block Swap" if "Block Swap" in setup else LOAD_MODELS_GPU,
            s_per_step=_seconds(v.get("time_ms")), peak_vram_gib=v.get("peak_reserved_gib"),
            peak_rss_gib=v.get("peak_rss_gib"), side=side, cfg=1.0, status=v.get("status", "ok")))
    return rows


# ---- server runs ----

def _server_steps(settings: dict, variant: dict) -> tuple[int | None, float | None]:
    """(sampler steps of the whole graph, cfg) of a server row: Wan rows sample two experts."""
    if "frames" not in settings:
        return settings.get("steps"), settings.get("cfg")
    if variant.get("four_step"):
        return 4, settings.get("cfg_4step", 1.0)
    per_expert = settings.get("steps_per_expert") or settings.get("steps")
    return (2 * per_expert if per_expert else None), settings.get("cfg")


def _drop_columns(what: str) -> str:
    """A server row's description without what other columns say (the card, DynamicVRAM)."""
    return re.sub(r", (DynamicVRAM|\d+ GB card|whole GPU)\b", "", what)


def _server_rows(data: dict) -> list[dict]:
    settings = data["settings"]
    wan = "frames" in settings
    files = settings.get("model_files_gb") or {}
    fmt = file_format(next(iter(files), "_fp8_scaled" if wan else "fp8_e4m3fn"))
    rows = []
    for v in data["variants"]:
        var = v.get("variant") or {}
        side = "native" if var.get("graph", v["name"]).startswith("native") else "pack"
        steps, cfg = _server_steps(settings, var)
        swap = var.get("block_swap_gb") or "Block Swap" in v.get("what", "")
        manager = "Block Swap" if swap else DYNAMIC_VRAM if side == "native" and var.get("dynamic_vram", True) \
            else LEGACY
        rows.append(_row(
            name=v["name"], model=WAN14B if wan else QWEN, resolution=f"{settings['width']}x{settings['height']}",
            frames=settings.get("frames"), steps=steps, card_gib=var.get("card_gib"), file_format=fmt,
            setup=_drop_columns(v.get("what") or v["name"]), memory_manager=manager, s_per_step=v.get("s_per_step"),
            peak_vram_gib=v.get("peak_gpu_gib"), peak_rss_gib=v.get("peak_rss_hwm_gib"), side=side, how=SERVER,
            cfg=cfg, gpus=var.get("gpus", 1), lora="4-step LoRA" if var.get("lora") else None,
            status=v.get("status", "ok")))
    return rows


def _edit_row_file(data: dict) -> list[dict]:
    """A per-row Qwen-Image-Edit server file (one row per file, its native twin in the next file)."""
    s = data["settings"]
    rows = []
    for r in data["rows"]:
        native = r.get("graph") == "native"
        setup = (f"{s.get('edit', '')} template: UNETLoader default + CLIPLoader (cpu)" if native else
                 f"{s.get('edit', '')} Qwen-Image-Edit Staged Loader + Block Swap 8 GB").strip()
        width, height = s.get("image_size") or (None, None)
        rows.append(_row(
            name=r["name"], model=QWEN_EDIT, resolution=f"{width}x{height}",
            steps=s.get("steps"), card_gib=r.get("card_gib"), file_format=file_format(s.get("unet", "")),
            setup=setup, memory_manager=DYNAMIC_VRAM if native else "Block Swap", s_per_step=r.get("s_per_step"),
            peak_vram_gib=r.get("peak_gpu_gib"), peak_rss_gib=r.get("peak_rss_hwm_gib"),
            side="native" if native else "pack", how=SERVER, status=r.get("status", "ok")))
    return rows


# ---- the MultiGPU script and the whole-workflow runner ----

def _multigpu_rows(data: dict) -> list[dict]:
    env = data["environment"]
    if env.get("layers", 40) < 40:
        return []  # a few-block model: a correctness check (split == one GPU), not a setup
    width, height, frames = re.match(r"(\d+)x(\d+)x(\d+)", env["shape"]).groups()
    steps = int(re.search(r"(\d+) steps", env["shape"]).group(1))
    common = dict(model=WAN14B, resolution=f"{width}x{height}", frames=int(frames), steps=steps, file_format="bf16",
                  cfg=3.5)
    rows = []
    for r in data["rows"]:
        side = "native" if r["row"].startswith("native") else "pack"
        if "s_per_step_1gpu" in r:  # one expert: a 1-GPU run, then the same graph under the CFG split
            for suffix, gpus, label, key in (("", 1, "", "s_per_step_1gpu"),
                                             ("_split", 2, ", MultiGPU CFG Split", "s_per_step_split")):
                rows.append(_row(name=r["row"] + suffix, setup=f"one expert: {r['graph']}{label}",
                                 memory_manager=LOAD_MODELS_GPU, s_per_step=round(r[key], 3), side=side, gpus=gpus,
                                 **common))
        else:  # both experts, end to end (the second, warm run)
            rows.append(_row(name=r["row"], setup=r["graph"], render_s=round(r["second_run_s"], 1), side=side,
                             memory_manager="Block Swap" if "Block Swap" in r["graph"] else LOAD_MODELS_GPU,
                             gpus=2 if "gpu:1" in r["graph"] else 1, **common))
    return rows


def _workflow_rows(data: dict) -> list[dict]:
    card = data.get("env", {}).get("card_gib")
    return [_row(name="workflow", model=WAN14B, resolution="832x480", frames=81, steps=4, card_gib=card,
                 file_format="fp8_scaled", setup="shipped wan22_t2v_a14b workflow: Wan Loader fp8 + Block Swap 8 GB "
                 "+ Wan Text Encode, VAE decode", memory_manager="Block Swap", render_s=data["wall_s"],
                 peak_vram_gib=data.get("peak_gpu_gib"), peak_rss_gib=data.get("peak_rss_hwm_gib"), how="workflow",
                 cfg=3.5)]


def _common_rows(data: dict) -> list[dict]:
    return [_row(**{"how": SERVER, **r}) for r in data["rows"]]


Layout = tuple[str, Callable[[dict], bool], Callable[[dict], list[dict]], Callable[[dict], dict]]
LAYOUTS: tuple[Layout, ...] = (
    ("common", lambda d: isinstance(d.get("rows"), list) and bool(d["rows"]) and "setup" in d["rows"][0]
     and "env" in d, _common_rows, lambda d: d["env"]),
    ("server", lambda d: "variants" in d and any("variant" in v for v in d["variants"]), _server_rows,
     lambda d: d["env"]),
    ("harness", lambda d: "variants" in d and "settings" in d and "bench" in d, _harness_rows, lambda d: d["env"]),
    ("server row", lambda d: "rows" in d and "goals" in d and "settings" in d, _edit_row_file, lambda d: d["env"]),
    ("multigpu", lambda d: "environment" in d and d.get("rows") and "graph" in d["rows"][0], _multigpu_rows,
     lambda d: d["environment"]),
    ("workflow", lambda d: "workflow" in d and "wall_s" in d, _workflow_rows, lambda d: d.get("env", {})),
)


def read(data: Any, source: str) -> tuple[str, dict, list[dict]]:
    """(layout name, environment, rows) of one result file; rows are empty for a component (kernel) result."""
    if isinstance(data, dict):
        for name, matches, rows_of, env_of in LAYOUTS:
            if matches(data):
                return name, run_env(env_of(data)), rows_of(data)
        env = data.get("env") or data.get("environment")
        if isinstance(env, dict):
            return "component", run_env(env), []
    raise ValueError(f"{source}: no reader knows this result layout (top-level keys "
                     f"{sorted(data) if isinstance(data, dict) else type(data).__name__}); write it in the common "
                     "format of benchmarks/README.md, or move a superseded file out of benchmarks/results/")
