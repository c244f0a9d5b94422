"""Scenarios ``wan14b_480p81``/``_480p17``/``_720p81``/``block_swap``: Block Swap vs native partial loading on
Wan 2.2 14B under VRAM caps (README).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from comfyui_lowvram_dit.benchmarks import harness

TARGET = "comfyui_lowvram_dit.benchmarks.bench_block_swap:swap_forward"
MODEL = "wan22_t2v_14B"
RESOLUTIONS = {"480p81": (832, 480, 81), "480p17": (832, 480, 17),  # compute-bound / transfer-bound
               "720p81": (1280, 720, 81)}  # 75,600 tokens: attention-dominated
CAPS = (None, 16, 12, 8, 6)  # GiB
KINDS = ("native", "native_bf16", "swap", "swap_b2")
SMOKE_RESOLUTION = (64, 64, 5)
# keep every variant well under a minute (forward times: benchmarks/results/block_swap*.md)
TIMING = {"480p81": (3, 1), "480p17": (10, 3), "720p81": (2, 1)}  # (repeats, warmup)


def swap_forward(ctx: harness.BenchContext, kind: str = "swap", model: str = MODEL, size: str = "full",
                 width: int = 832, height: int = 480, frames: int = 81, vram_cap_gb: float | None = None,
                 prefetch: int = 1, blocks_to_swap: int = -1) -> dict:
    """Harness target: build the MODEL (native fp8, or our fp8 layers), add Block Swap unless native, time it."""
    import torch

    from . import comfy_native
    from ..offload.plan import SwapConfig
    from ..offload.engine import format_stats
    from ..synthetic.checkpoints import synthetic_state_dict

    comfy = comfy_native.import_comfy(cpu=ctx.device.type == "cpu")
    mm = comfy.model_management
    sd = synthetic_state_dict(model, size=size, device=ctx.device.type)
    out_dim = sd["head.head.weight"].shape[0] // 4
    latent_shape = comfy_native.wan_latent_shape(out_dim, width, height, frames)
    if kind in ("native", "native_bf16"):
        weight_dtype = "fp8_e4m3fn" if kind == "native" else "default"
        patcher = comfy_native.load_native_model(sd, weight_dtype, None, vram_cap_gb=vram_cap_gb,
                                                 latent_shape=latent_shape)
        metrics: dict = {}
    else:
        from ..nodes.block_swap import SWAP_KEY, apply_block_swap

        if kind == "swap_b2":
            from ..checkpoints.wan import quantize_state_dict
            from ..host.fp8_ops import Fp8OpsConfig, make_fp8_ops

            sd = quantize_state_dict(sd, "per_tensor")
            options = {"custom_operations": make_fp8_ops(Fp8OpsConfig()), "dtype": torch.bfloat16}
        else:
            options = comfy_native.unet_model_options("fp8_e4m3fn")
        plain = comfy.sd.load_diffusion_model_state_dict(sd, model_options=options)
        sd.clear()
        mm.soft_empty_cache(force=True)
        if vram_cap_gb is not None:
            comfy_native.apply_vram_cap(vram_cap_gb)
        patcher = apply_block_swap(plain, SwapConfig(blocks_to_swap=blocks_to_swap, prefetch=prefetch))
        ctl = patcher.attachments[SWAP_KEY]
        b, rest = latent_shape[0], list(latent_shape[1:])
        need = plain.model.memory_required([2 * b, *rest])  # what KSampler's estimate_memory reserves (CFG batch)
        ctl.activation_bytes = int(need)
        mm.load_models_gpu([patcher], memory_required=need,
                           minimum_memory_required=plain.model.memory_required([b, *rest]))
        metrics = {"streamed_blocks": len(ctl.plan.streamed) if ctl.plan else 0,
                   "ring_slots": ctl.plan.ring if ctl.plan else 0,
                   "ring_gib": (ctl.plan.ring_bytes if ctl.plan else 0) / comfy_native.GIB}
    del sd
    inputs = comfy_native.wan_inputs(patcher, width, height, frames)
    out = comfy_native.forward(patcher, inputs, via="apply_model")
    if tuple(out.shape) != tuple(inputs["x"].shape) or not torch.isfinite(out).all():
        raise RuntimeError(f"forward gave shape {tuple(out.shape)} or non-finite values")
    del out
    if not kind.startswith("native") and ctl.streamer is not None and ctl.active and ctl.plan.streamed:
        ctl.streamer.debug = True  # one instrumented forward (one sync at its end), then timing without it
        comfy_native.forward(patcher, inputs, via="apply_model")
        stats = ctl.streamer.stats
        ctl.streamer.debug = False
        metrics.update(transfer_ms=round(stats.transfer_ms, 2), stall_ms=round(stats.stall_ms, 2),
                       streamed_compute_ms=round(stats.compute_ms, 2), overlap_pct=round(100 * stats.overlap, 1),
                       on_demand_loads=stats.on_demand)
        print(format_stats(stats), file=sys.stderr)
    return {"fn": lambda: comfy_native.forward(patcher, inputs, via="apply_model"), "tokens": inputs["tokens"], "kind": kind,
            "vram_cap_gib": vram_cap_gb, "resolution": f"{width}x{height}x{frames}", **metrics,
            **comfy_native.describe(patcher)}


def variants(resolutions: list[str], caps: list[float | None], kinds: list[str], smoke: bool = False) -> list:
    """One variant per (resolution, cap, kind)."""
    out = []
    for res in resolutions:
        width, height, frames = SMOKE_RESOLUTION if smoke else RESOLUTIONS[res]
        for cap in caps:
            for kind in kinds:
                kwargs = {"kind": kind, "size": "tiny" if smoke else "full", "width": width, "height": height,
                          "frames": frames, "vram_cap_gb": cap}
                if smoke and not kind.startswith("native"):
                    kwargs["blocks_to_swap"] = 2  # no VRAM on CPU: stream explicitly to exercise the path
                label = "smoke" if smoke else res
                out.append(harness.Variant(f"{label} cap={cap or 'none'} {kind}", TARGET, kwargs, timeout_s=300))
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--res", nargs="+", default=list(RESOLUTIONS), choices=list(RESOLUTIONS))
    p.add_argument("--caps", nargs="+", default=["none", "16", "12", "8", "6"], help="GiB caps, 'none' = no cap")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, no caps (checks the flow only)")
    p.add_argument("--tag", default="", help="suffix for the result files (keeps an earlier run's files)")
    p.add_argument("--out-dir", "--out", type=Path, default=harness.RESULTS)
    args = p.parse_args(argv)
    caps = [None if c == "none" else float(c) for c in args.caps]
    results = []
    for res in args.res:
        repeats, warmup = (2, 1) if args.smoke else TIMING[res]
        vs = variants([res], [None] if args.smoke else caps, args.kinds, smoke=args.smoke)
        bench = f"block_swap_{'smoke' if args.smoke else res}{'_' + args.tag if args.tag else ''}"
        results += harness.run_benchmark(bench, vs, repeats=repeats, warmup=warmup, plot="time_ms",
                                         out_dir=args.out_dir)
    failed = [r for r in results if r.get("status") != "ok"]
    for r in failed:
        print(f"{r['name']}: {r['status']}: {r.get('error', '')[:500]}", file=sys.stderr)
    return 1 if failed and args.smoke else 0

