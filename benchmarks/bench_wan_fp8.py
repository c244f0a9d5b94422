"""Scenario ``wan14b_fp8``: Wan 2.2 14B, one forward: native bf16 / fp8 vs our fp8 layers, error vs bf16 (README)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from comfyui_lowvram_dit.checkpoints.safe_write import TORCH_ARCHIVE, starts_with, write_atomic

try:
    from . import harness
except ImportError:  # run as a file: python benchmarks/bench_wan_fp8.py
    import harness  # type: ignore[no-redef]

MODULE = "comfyui_lowvram_dit.benchmarks.bench_wan_fp8"
MODEL = "wan22_t2v_14B"
RESOLUTION = (832, 480, 81)
SMOKE_RESOLUTION = (64, 64, 5)
DEFAULT_LOAD_FILE = Path("/tmp/lowvram_dit_bench/wan22_t2v_14B_full_bf16.safetensors")
# name -> (kind, options)
VARIANTS: dict[str, tuple[str, dict]] = {
    "native_bf16": ("native", {"weight_dtype": "default", "dtype": "bfloat16"}),
    "native_fp8_e4m3fn": ("native", {"weight_dtype": "fp8_e4m3fn"}),
    "native_fp8_e4m3fn_fast": ("native", {"weight_dtype": "fp8_e4m3fn_fast"}),
    "native_fp8_scaled": ("native", {"weight_dtype": "default", "fmt": "fp8_scaled"}),
    "ours_per_tensor": ("ours", {"mode": "per_tensor", "block_size": 128}),
    "ours_blockwise128": ("ours", {"mode": "blockwise", "block_size": 128}),
    "ours_blockwise64": ("ours", {"mode": "blockwise", "block_size": 64}),
    "quantize_on_load": ("load", {"mode": "blockwise", "block_size": 128}),
}


def _rel_error(out, ref_path: Path | None, save: bool) -> dict:  # noqa: ANN001 - torch.Tensor
    """Save the reference output, or compare with it: ||out - ref|| / ||ref|| in fp32."""
    import torch

    if ref_path is None:
        return {}
    if save:
        ref_path.parent.mkdir(parents=True, exist_ok=True)
        ref = out.detach().to("cpu", torch.bfloat16)
        write_atomic(ref_path, lambda f: torch.save(ref, f), starts_with(TORCH_ARCHIVE, 4))
        return {"rel_error_vs_bf16": 0.0}
    if not ref_path.is_file():
        return {"rel_error_vs_bf16": None, "note": f"no reference output {ref_path.name}: run native_bf16 first"}
    ref = torch.load(ref_path).float().to(out.device)
    return {"rel_error_vs_bf16": ((out.float() - ref).norm() / ref.norm()).item()}


def quantize_for_ours(sd: dict, mode: str, block_size: int, compute: str = "auto") -> dict:
    """Quantize ``sd``'s block Linear weights in place (our fp8 format); returns the model_options for our ops."""
    import torch

    from ..checkpoints import wan as wc
    from ..host.fp8_ops import Fp8OpsConfig, make_fp8_ops

    for k in [k for k, v in sd.items() if wc.is_fp8_target(k, tuple(v.shape))]:
        q, s = wc.quantize_weight(sd.pop(k), mode, block_size)  # bf16 freed as we go: peak ~ bf16 model
        sd[k], sd[k[: -len("weight")] + "weight_scale"] = q, s
    ops = make_fp8_ops(Fp8OpsConfig(block_size=block_size, compute=compute))
    return {"custom_operations": ops, "dtype": torch.bfloat16}


def wan_forward(ctx: harness.BenchContext, kind: str, size: str = "full", width: int = 832, height: int = 480,
                frames: int = 81, ref_path: str | None = None, save_ref: bool = False, weight_dtype: str = "default",
                dtype: str | None = None, fmt: str = "bf16", mode: str = "blockwise", block_size: int = 128,
                compute: str = "auto") -> dict:
    """Harness target: build one variant's MODEL from synthetic weights generated on the device; time a forward."""
    import torch

    from ..synthetic.checkpoints import synthetic_state_dict
    from . import comfy_native

    comfy_native.import_comfy(cpu=ctx.device.type == "cpu")
    sd = synthetic_state_dict(MODEL, size=size, fmt=fmt if kind == "native" else "bf16", device=ctx.device.type)
    options: dict = {}
    extra: dict = {}
    if dtype:
        options["dtype"] = getattr(torch, dtype)
    if kind == "ours":
        t0 = time.perf_counter()
        options.update(quantize_for_ours(sd, mode, block_size, compute))
        ctx.sync()
        extra["quantize_s"] = round(time.perf_counter() - t0, 3)
    out_dim = sd["head.head.weight"].shape[0] // 4
    latent_shape = comfy_native.wan_latent_shape(out_dim, width, height, frames)
    patcher = comfy_native.load_native_model(sd, weight_dtype, options, latent_shape=latent_shape)
    del sd
    inputs = comfy_native.wan_inputs(patcher, width, height, frames)
    out = comfy_native.forward(patcher, inputs)
    if tuple(out.shape) != tuple(inputs["x"].shape) or not torch.isfinite(out).all():
        raise RuntimeError(f"forward gave shape {tuple(out.shape)} or non-finite values")
    extra.update(_rel_error(out, Path(ref_path) if ref_path else None, save_ref))
    if kind == "ours":
        lin = patcher.model.diffusion_model.blocks[0].ffn[0]
        extra["fp8_path"] = lin._path(inputs["x"].device)
    del out
    return {"fn": lambda: comfy_native.forward(patcher, inputs), "tokens": inputs["tokens"],
            "resolution": f"{width}x{height}x{frames}", **extra, **comfy_native.describe(patcher)}


def quantize_on_load(ctx: harness.BenchContext, path: str, size: str = "full", mode: str = "blockwise",
                     block_size: int = 128) -> dict:
    """Harness target: stream a bf16 Wan file into fp8 (quantized on ctx.device); GB/s and RSS (no ``fn``)."""
    import resource

    from ..checkpoints import wan as wc
    from ..synthetic.checkpoints import write_synthetic

    p = Path(path)
    if not p.is_file():
        write_synthetic(MODEL, p, size=size, fmt="bf16", device=ctx.device.type)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    loaded = wc.load_wan_state_dict(p, mode, block_size, device=ctx.device)  # type: ignore[arg-type]
    ctx.sync()
    seconds = time.perf_counter() - t0
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    held = sum(v.numel() * v.element_size() for v in loaded.state_dict.values())
    gb = 1e9
    return {"file_gb": p.stat().st_size / gb, "seconds": round(seconds, 2), "gb_per_s": p.stat().st_size / gb / seconds,
            "result_gb": held / gb, "peak_rss_before_load_gb": rss_before / gb, "peak_rss_gb": rss_after / gb,
            "peak_rss_minus_result_gb": (rss_after - held) / gb, "fp8_layers": loaded.fp8_layers,
            "quantize_device": str(ctx.device)}


def variants(names: list[str], smoke: bool, out_dir: Path, load_file: Path) -> list[harness.Variant]:
    """The selected variants, in order, sharing one reference-output file."""
    width, height, frames = SMOKE_RESOLUTION if smoke else RESOLUTION
    size = "tiny" if smoke else "full"
    ref = str(out_dir / f"wan_fp8_ref_{'smoke' if smoke else '480p'}.pt")
    out = []
    for name in names:
        kind, opts = VARIANTS[name]
        if kind == "load":
            path = load_file.with_name(load_file.stem + "_tiny.safetensors") if smoke else load_file
            out.append(harness.Variant(name, f"{MODULE}:quantize_on_load", {"path": str(path), "size": size, **opts}))
            continue
        kwargs = {"kind": kind, "size": size, "width": width, "height": height, "frames": frames, "ref_path": ref,
                  "save_ref": name == "native_bf16", **opts}
        out.append(harness.Variant(name, f"{MODULE}:wan_forward", kwargs))
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the markdown table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out-dir", "--out", type=Path, default=harness.RESULTS)
    parser.add_argument("--load-file", type=Path, default=DEFAULT_LOAD_FILE,
                        help="bf16 file for quantize_on_load (written once if missing, 28.6 GB)")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 64x64x5, on the CPU")
    args = parser.parse_args(argv)
    argv_used = harness.command_argv(MODULE, argv)
    bench = "wan_fp8_smoke" if args.smoke else "wan_fp8"
    if not args.smoke and args.variants != list(VARIANTS):
        bench += "_partial"  # a subset must not overwrite the full table
    results = harness.run_benchmark(bench, variants(args.variants, args.smoke, Path(args.out_dir), args.load_file),
                                    repeats=args.repeats, warmup=args.warmup, out_dir=args.out_dir,
                                    force_cpu=args.smoke, argv=argv_used, timeout_s=600)
    print((Path(args.out_dir) / f"{bench}.md").read_text(encoding="utf-8"))
    return 0 if any(r.get("status") == "ok" for r in results) else 1

