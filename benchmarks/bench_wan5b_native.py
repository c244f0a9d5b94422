"""ComfyUI v0.8.0 native Wan 2.2 TI2V-5B, one forward: bf16 vs fp8_e4m3fn vs fp8_e4m3fn_fast.

Full-size synthetic weights (tools.synth, real key names and shapes, random values: speed does not
depend on them), loaded exactly as UNETLoader would, placed by load_models_gpu, one forward of
``diffusion_model(x, t, context)`` at 1280x704x121 (27,280 tokens, the 5B template's size) and
832x480x81. Each variant runs in a fresh process (benchmarks/harness.py).

GPU (the lead runs this on an H100/H200):
    COMFYUI_PATH=/path/to/ComfyUI python -m comfyui_lowvram_dit.benchmarks.bench_wan5b_native
CPU smoke test of the whole flow (tiny model, tiny resolution):
    COMFYUI_PATH=/path/to/ComfyUI python -m comfyui_lowvram_dit.benchmarks.bench_wan5b_native --smoke
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    from . import harness
except ImportError:  # run as a file: python benchmarks/bench_wan5b_native.py
    import harness  # type: ignore[no-redef]

TARGET = "comfyui_lowvram_dit.benchmarks.bench_wan5b_native:native_forward"
MODEL = "wan22_ti2v_5B"
RESOLUTIONS = {"720p": (1280, 704, 121), "480p": (832, 480, 81)}
SMOKE_RESOLUTION = (64, 64, 5)  # 48-ch latent [1, 48, 2, 4, 4] -> 8 tokens
# name -> (UNETLoader weight_dtype, extra model_options). "default" lets ComfyUI pick the dtype (fp16 for Wan
# on SM >= 8.0: WAN22_T2V.supported_inference_dtypes starts with fp16); "bf16" forces it (= --bf16-unet).
DTYPE_VARIANTS = {
    "default": ("default", None),
    "bf16": ("default", {"dtype": "bfloat16"}),
    "fp8_e4m3fn": ("fp8_e4m3fn", None),
    "fp8_e4m3fn_fast": ("fp8_e4m3fn_fast", None),
}


def native_forward(ctx: harness.BenchContext, model: str = MODEL, size: str = "full", weight_dtype: str = "default",
                   model_options: dict | None = None, width: int = 1280, height: int = 704, frames: int = 121,
                   vram_cap_gb: float | None = None, via: str = "diffusion_model") -> dict:
    """Harness target: build the native MODEL from synthetic weights and return its forward as ``fn``."""
    import torch

    from . import comfy_native
    from ..synthetic.checkpoints import synthetic_state_dict

    comfy_native.import_comfy(cpu=ctx.device.type == "cpu")
    options = dict(model_options or {})
    if isinstance(options.get("dtype"), str):  # JSON-friendly variant kwargs: "bfloat16" -> torch.bfloat16
        options["dtype"] = getattr(torch, options["dtype"])
    # Generate on the GPU (fast; ComfyUI copies into its CPU-resident model and the dict is emptied).
    sd = synthetic_state_dict(model, size=size, device=ctx.device.type)
    out_dim = sd["head.head.weight"].shape[0] // 4  # latent channels, as comfy/model_detection.py derives it
    latent_shape = comfy_native.wan_latent_shape(out_dim, width, height, frames)
    patcher = comfy_native.load_native_model(sd, weight_dtype, options, vram_cap_gb=vram_cap_gb,
                                             latent_shape=latent_shape)
    del sd
    inputs = comfy_native.wan_inputs(patcher, width, height, frames)
    out = comfy_native.forward(patcher, inputs, via=via)
    if tuple(out.shape) != tuple(inputs["x"].shape) or not torch.isfinite(out).all():
        raise RuntimeError(f"native forward gave shape {tuple(out.shape)} (expected {tuple(inputs['x'].shape)}) "
                           f"or non-finite values")
    del out
    return {"fn": lambda: comfy_native.forward(patcher, inputs, via=via), "tokens": inputs["tokens"],
            "resolution": f"{width}x{height}x{frames}", **comfy_native.describe(patcher)}


def variants(resolutions: list[str], dtypes: list[str], smoke: bool = False,
             vram_cap_gb: float | None = None) -> list[harness.Variant]:
    """One variant per (resolution, dtype)."""
    out = []
    for res in resolutions:
        width, height, frames = SMOKE_RESOLUTION if smoke else RESOLUTIONS[res]
        for name in dtypes:
            weight_dtype, options = DTYPE_VARIANTS[name]
            kwargs = {"size": "tiny" if smoke else "full", "weight_dtype": weight_dtype, "model_options": options,
                      "width": width, "height": height, "frames": frames, "vram_cap_gb": vram_cap_gb}
            label = "smoke" if smoke else res
            out.append(harness.Variant(f"{label} {name}", TARGET, kwargs))
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the markdown table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--res", nargs="+", choices=sorted(RESOLUTIONS), default=["720p", "480p"])
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPE_VARIANTS), default=list(DTYPE_VARIANTS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--vram-cap-gb", type=float, default=None, help="simulate a smaller card (CUDA only)")
    parser.add_argument("--out-dir", type=Path, default=harness.RESULTS)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny synthetic model, 64x64x5, on the CPU: tests the whole flow without a GPU")
    args = parser.parse_args(argv)
    module = TARGET.split(":")[0]
    if argv is None:  # record "-m module" when run that way (python rewrites argv[0] to the file path)
        argv_used = (["-m", module] if __package__ else sys.argv[:1]) + sys.argv[1:]
    else:
        argv_used = ["-m", module, *argv]
    if args.smoke:
        res, bench, repeats, warmup = ["480p"], "wan5b_native_smoke", min(args.repeats, 2), min(args.warmup, 1)
    else:
        res, bench, repeats, warmup = args.res, "wan5b_native", args.repeats, args.warmup
        if sorted(res) != sorted(RESOLUTIONS):  # a partial run must not overwrite the full one
            bench += "_" + "_".join(res)
        if args.vram_cap_gb:
            bench += f"_cap{args.vram_cap_gb:g}gb"
    results = harness.run_benchmark(bench, variants(res, args.dtypes, args.smoke, args.vram_cap_gb),
                                    repeats=repeats, warmup=warmup, out_dir=args.out_dir,
                                    force_cpu=args.smoke, argv=argv_used)
    print((Path(args.out_dir) / f"{bench}.md").read_text(encoding="utf-8"))
    return 0 if any(r.get("status") == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
