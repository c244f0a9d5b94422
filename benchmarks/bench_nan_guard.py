"""Scenario ``nan_guard``: our fp8 Wan 2.2 14B through ``apply_model`` with and without NaN Guard (README)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from comfyui_lowvram_dit.benchmarks import harness

TARGET = "comfyui_lowvram_dit.benchmarks.bench_nan_guard:guard_case"
RESOLUTIONS = {"480p81": (832, 480, 81), "480p17": (832, 480, 17)}
SMOKE_RESOLUTION = (64, 64, 5)


def guard_case(ctx: harness.BenchContext, guard: bool, size: str = "full", width: int = 832, height: int = 480,
               frames: int = 81) -> dict:
    """Harness target: our fp8 Wan 14B (per-tensor), optionally wrapped by NaN Guard, one checked forward."""
    import torch

    from . import comfy_native
    from .bench_compile import _build

    patcher, inputs = _build(ctx, size, None, width, height, frames, fp8="per_tensor")  # puts ComfyUI on the path
    from ..nodes.nan_guard import GUARD_KEY, apply_nan_guard
    model = apply_nan_guard(patcher, "warn") if guard else patcher
    out = comfy_native.forward(model, inputs, via="apply_model")
    if not torch.isfinite(out).all():
        raise RuntimeError("forward produced non-finite values")
    metrics = {"guard": guard, "resolution": f"{width}x{height}x{frames}", "tokens": inputs["tokens"]}
    if guard and GUARD_KEY not in model.attachments:
        raise RuntimeError("NaN Guard did not attach to the model")
    return {"fn": lambda: comfy_native.forward(model, inputs, via="apply_model"), **metrics}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--res", nargs="+", default=list(RESOLUTIONS), choices=list(RESOLUTIONS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU (checks the flow only)")
    p.add_argument("--out-dir", "--out", type=Path, default=None, help="default: benchmarks/results (smoke: a temp dir)")
    args = p.parse_args(argv)
    out_dir = args.out_dir or (Path("/tmp/lowvram_dit_bench_smoke") if args.smoke else harness.RESULTS)
    variants = []
    for res in (["smoke"] if args.smoke else args.res):
        width, height, frames = SMOKE_RESOLUTION if args.smoke else RESOLUTIONS[res]
        for guard in (False, True):
            kwargs = {"guard": guard, "size": "tiny" if args.smoke else "full", "width": width, "height": height,
                      "frames": frames}
            variants.append(harness.Variant(f"{res} {'guard' if guard else 'plain'}", TARGET, kwargs,
                                            timeout_s=600))
    bench = "nan_guard_smoke" if args.smoke else "nan_guard"
    results = harness.run_benchmark(bench, variants, repeats=2 if args.smoke else args.repeats,
                                    warmup=1 if args.smoke else args.warmup, out_dir=out_dir,
                                    force_cpu=args.smoke, plot="time_ms")
    by_name = {r["name"]: r for r in results}
    for res in (["smoke"] if args.smoke else args.res):
        plain, guard = by_name.get(f"{res} plain", {}), by_name.get(f"{res} guard", {})
        if plain.get("time_ms") and guard.get("time_ms"):
            print(f"{res}: guard {guard['time_ms']:.1f} ms vs plain {plain['time_ms']:.1f} ms "
                  f"= {guard['time_ms'] / plain['time_ms']:.3f}x")
    failed = [r for r in results if r.get("status") != "ok"]
    for r in failed:
        print(f"{r['name']}: {r['status']}: {r.get('error', '')[:500]}", file=sys.stderr)
    return 1 if failed else 0

