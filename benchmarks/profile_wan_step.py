"""Where one Wan 14B sampler step spends its GPU time: native ComfyUI vs the pack, kernel by kernel.

One expert of T2V-A14B (a full-size synthetic ``*_fp8_scaled`` file), one forward at batch 2 (cond + uncond, as
KSampler batches them at cfg > 1), 832x480x81 by default, in one process:
- ``native``: UNETLoader's default weight_dtype on that file (ComfyUI's mixed-precision fp8 ops) and its
  default attention;
- ``pack``: the Wan Loader (fp8 per-tensor, compute auto) + Attention auto;
- ``pack_int8``: the same with the 8-bit attention.
Each variant: two warm-up forwards (the first holds Attention auto's per-shape timing), then the median of
``--repeat`` timed forwards (CUDA events), then one forward under ``torch.profiler``. Kernels are grouped into
matmul, attention, quantize/cast, normalisation/elementwise and other by name; the table lists the top kernels.

Run on a GPU machine (the ComfyUI Python, the pack importable as ``comfyui_lowvram_dit``)::

    COMFYUI_PATH=/path/to/ComfyUI python -m comfyui_lowvram_dit.benchmarks.profile_wan_step \\
        --model /models/diffusion_models/wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors --out DIR
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from comfyui_lowvram_dit.checkpoints.safe_write import write_report

try:
    from . import comfy_native, harness
    from .kernel_groups import kernel_table
except ImportError:  # run as a file
    import comfy_native  # type: ignore[no-redef]
    import harness  # type: ignore[no-redef]
    from kernel_groups import kernel_table  # type: ignore[no-redef]

VARIANTS = ("native", "pack", "pack_int8")
def build(variant: str, model: Path) -> Any:
    """The ModelPatcher of ``variant``, resident on the GPU."""
    comfy = comfy_native.import_comfy()
    if variant == "native":
        import safetensors.torch

        return comfy_native.load_native_model(safetensors.torch.load_file(str(model)), "default")
    from comfyui_lowvram_dit.nodes.attention import apply_attention
    from comfyui_lowvram_dit.nodes.wan_loader import load_wan_model

    patcher = load_wan_model(model, "fp8 per-tensor", 128, "auto")
    patcher = apply_attention(patcher, "lowvram 8-bit" if variant == "pack_int8" else "auto")
    comfy.model_management.load_models_gpu([patcher])
    return patcher


def measure(variant: str, model: Path, size: tuple[int, int, int], repeat: int, top: int) -> dict:
    """Timed forwards and one profiled forward of ``variant`` at batch 2."""
    patcher = build(variant, model)
    inputs = comfy_native.wan_inputs(patcher, *size, batch=2)
    for _ in range(2):
        comfy_native.forward(patcher, inputs)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        comfy_native.forward(patcher, inputs)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        comfy_native.forward(patcher, inputs)
        torch.cuda.synchronize()
    row = {"name": variant, "forward_s": round(statistics.median(times), 3), "forwards_s": [round(t, 3) for t in times],
           "tokens_per_sample": inputs["tokens"], "batch": 2, "describe": comfy_native.describe(patcher),
           **kernel_table(prof, top)}
    del patcher, inputs, prof
    comfy_native.import_comfy().model_management.unload_all_models()
    gc.collect()
    torch.cuda.empty_cache()
    return row


def markdown(rows: list[dict], env: dict) -> str:
    """The report: forward times, group split per variant, top kernels per variant."""
    groups = sorted({g for r in rows for g in r.get("groups_ms", {})})
    out = ["# Wan 14B, one forward at batch 2: where the GPU time goes\n",
           (f"{env.get('device_name')}, torch {env.get('torch')}, ComfyUI {env.get('comfyui_version')}; "
           f"`{env.get('command')}`\n"),
           "| variant | forward s | " + " | ".join(f"{g} ms" for g in groups) + " |",
           "|---|---|" + "---|" * len(groups)]
    for r in rows:
        cells = [str(r.get("groups_ms", {}).get(g, 0.0)) for g in groups]
        out.append(f"| {r['name']} | {r.get('forward_s', r.get('error'))} | " + " | ".join(cells) + " |")
    for r in rows:
        out += ["", f"## {r['name']}", "", "| kernel | group | ms | calls |", "|---|---|---|---|"]
        out += [f"| `{k['kernel']}` | {k['group']} | {k['ms']} | {k['calls']} |" for k in r.get("top", [])]
    return "\n".join(out) + "\n"


def write_plot(rows: list[dict], env: dict, path: Path) -> str | None:
    """Stacked bars of GPU milliseconds per kernel group and variant; a note instead when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed"
    rows = [r for r in rows if "groups_ms" in r]
    groups = sorted({g for r in rows for g in r["groups_ms"]})
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(rows) + 1.8))
    left = [0.0] * len(rows)
    for g in groups:
        widths = [r["groups_ms"].get(g, 0.0) for r in rows]
        ax.barh([f"{r['name']} ({r['forward_s']} s)" for r in rows], widths, left=left, label=g)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("GPU time per forward by kernel group, ms (profiler; 'other' is mostly launch-queue waits)")
    ax.set_title(f"Wan 14B forward, batch 2 - {env.get('device_name', '?')}, torch {env.get('torch', '?')}, "
                 f"ComfyUI {env.get('comfyui_version', '?')}", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    """Profile the chosen variants and write JSON + markdown to ``--out``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="a Wan 2.2 14B *_fp8_scaled diffusion file")
    p.add_argument("--replot", type=Path, default=None, help="only redraw the plot of a written JSON report")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--size", default="832x480x81", help="WIDTHxHEIGHTxFRAMES")
    p.add_argument("--repeat", type=int, default=3, help="timed forwards per variant")
    p.add_argument("--top", type=int, default=15, help="kernels listed per variant")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--git-sha", default=None, help="pack commit to record (default: git rev-parse here)")
    opts = p.parse_args(argv)
    if opts.replot is not None:
        report = json.loads(opts.replot.read_text(encoding="utf-8"))
        note = write_plot(report["variants"], report["env"], opts.replot.with_suffix(".png"))
        print(note or f"wrote {opts.replot.with_suffix('.png')}")
        return 0
    if opts.model is None:
        raise SystemExit("--model is required (a Wan 2.2 14B *_fp8_scaled diffusion file)")
    if not torch.cuda.is_available():
        raise SystemExit("profile_wan_step needs a CUDA GPU")
    names = [n for n in opts.variants.split(",") if n]
    if unknown := [n for n in names if n not in VARIANTS]:
        raise SystemExit(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    size = tuple(int(x) for x in opts.size.lower().split("x"))
    env = {**harness.parent_environment(argv), **harness.child_environment(torch.device("cuda"))}
    env["git_sha"] = opts.git_sha or env.get("git_sha")
    env.pop("comfyui_path", None)  # a machine path; the version says which host
    rows = []
    for name in names:
        t0 = time.perf_counter()
        try:
            rows.append(measure(name, opts.model, size, opts.repeat, opts.top))
        except Exception as exc:  # noqa: BLE001 - one failed variant is a row of the report
            rows.append({"name": name, "error": f"{type(exc).__name__}: {exc}"[:500]})
        rows[-1]["wall_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "top"}), flush=True)
    opts.out.mkdir(parents=True, exist_ok=True)
    write_report((opts.out / "profile_wan_step.json"), json.dumps({"env": env, "variants": rows}, indent=1))
    write_report((opts.out / "profile_wan_step.md"), markdown(rows, env))
    note = write_plot(rows, env, opts.out / "profile_wan_step.png")
    if note:
        print(note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
