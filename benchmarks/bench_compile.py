"""torch.compile on Wan 2.2 14B at 832x480x81: our Torch Compile node's modes vs eager vs ComfyUI's TorchCompileModel.

Variants (fresh process each, synthetic bf16 weights generated on the GPU, ComfyUI's default attention):
- block_*: one WanAttentionBlock (a 1-layer 14B model) with the inputs a real forward hands block 0;
- model_*: the whole 40-block model through ``apply_model`` (APPLY_MODEL wrappers apply, as in KSampler):
  eager, ours in default / max-autotune-no-cudagraphs / reduce-overhead / max-autotune (regional), ours
  whole-model default, and ComfyUI's native TorchCompileModel (set_torch_compile_wrapper + its guard filter);
- oom_fallback: reduce-overhead under a VRAM cap (``--cap-gb``, default: eager peak + 1 GiB) to show the
  fallback chain at work; the mode in use and the log line are recorded (if the cap does not bite, it says so).
Metrics: steady time (harness, CUDA events), first call incl. compile (s), peak VRAM, mode in use; the summary adds
speedup vs eager and extra VRAM vs eager. H200 reference (measured-h200-2026-11-21.md): eager 2.742 s,
per-block default 2.695 s (first call 20.8 s), max-autotune-no-cudagraphs 2.689 s (first call 74 s).

GPU (the lead runs this on an H100/H200 with torch 2.11; ~20-30 min because max-autotune compiles for minutes):
    COMFYUI_PATH=/path/to/ComfyUI python -m comfyui_lowvram_dit.benchmarks.bench_compile
    ... --variants model_eager model_ours_default native_torchcompilemodel      (a subset)
CPU smoke test of the flow (tiny model, 64x64x5, eager/cudagraphs backends only):
    COMFYUI_PATH=/path/to/ComfyUI python -m comfyui_lowvram_dit.benchmarks.bench_compile --smoke
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

try:
    from . import harness
except ImportError:  # run as a file
    import harness  # type: ignore[no-redef]

MODULE = "comfyui_lowvram_dit.benchmarks.bench_compile"
MODEL = "wan22_t2v_14B"
RESOLUTION = (832, 480, 81)
SMOKE_RESOLUTION = (64, 64, 5)
# name -> (target, kwargs)
VARIANTS: dict[str, tuple[str, dict]] = {
    "block_eager": ("block", {"how": "eager"}),
    "block_ours_default": ("block", {"how": "ours", "mode": "default"}),
    "block_ours_max-autotune-no-cudagraphs": ("block", {"how": "ours", "mode": "max-autotune-no-cudagraphs"}),
    "model_eager": ("model", {"how": "eager"}),
    "model_ours_default": ("model", {"how": "ours", "mode": "default"}),
    "model_ours_max-autotune-no-cudagraphs": ("model", {"how": "ours", "mode": "max-autotune-no-cudagraphs"}),
    "model_ours_reduce-overhead": ("model", {"how": "ours", "mode": "reduce-overhead"}),
    "model_ours_max-autotune": ("model", {"how": "ours", "mode": "max-autotune"}),
    "model_ours_whole_default": ("model", {"how": "ours", "mode": "default", "scope": "whole model"}),
    "native_torchcompilemodel": ("model", {"how": "native"}),
    # the whole stack: our fp8 layers (per-tensor) eager vs regionally compiled (activation quantization fused)
    "model_fp8_eager": ("model", {"how": "eager", "fp8": "per_tensor"}),
    "model_fp8_ours_default": ("model", {"how": "ours", "mode": "default", "fp8": "per_tensor"}),
    "oom_fallback": ("model", {"how": "ours", "mode": "reduce-overhead", "cap": True}),
}


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _build(ctx: harness.BenchContext, size: str, num_layers: int | None, width: int, height: int, frames: int,
           fp8: str | None = None):
    import torch

    from ..kernels.synth import synthetic_state_dict
    from . import comfy_native

    comfy_native.import_comfy(cpu=ctx.device.type == "cpu")
    sd = synthetic_state_dict(MODEL, size=size, device=ctx.device.type, num_layers=num_layers)
    options: dict = {"dtype": torch.bfloat16}
    if fp8:  # our fp8 layers (per_tensor / blockwise), built as the Wan loader node builds them
        from .bench_wan_fp8 import quantize_for_ours

        options = quantize_for_ours(sd, fp8, 128)
    out_dim = sd["head.head.weight"].shape[0] // 4
    latent_shape = comfy_native.wan_latent_shape(out_dim, width, height, frames)
    patcher = comfy_native.load_native_model(sd, "default", options, latent_shape=latent_shape)
    return patcher, comfy_native.wan_inputs(patcher, width, height, frames)


def _compiled(patcher: Any, how: str, mode: str, scope: str, backend: str) -> Any:
    if how == "eager":
        return patcher
    if how == "native":  # exactly what comfy_extras/nodes_torch_compile.py TorchCompileModel.execute does
        from comfy_api.torch_helpers import set_torch_compile_wrapper
        from comfy_extras.nodes_torch_compile import skip_torch_compile_dict

        m = patcher.clone()
        set_torch_compile_wrapper(model=m, backend=backend, options={"guard_filter_fn": skip_torch_compile_dict})
        return m
    from ..kernels.compile import CompileConfig
    from ..nodes.compile import apply_compile

    return apply_compile(patcher, CompileConfig(mode=mode, backend=backend), scope)


def model_case(ctx: harness.BenchContext, how: str, mode: str = "default", scope: str = "blocks",
               size: str = "full", width: int = 832, height: int = 480, frames: int = 81, cap: bool = False,
               cap_gb: float | None = None, backend: str = "inductor", fp8: str | None = None) -> dict:
    """Harness target: the whole model through apply_model, eager or compiled; first call timed here."""
    import torch

    from . import comfy_native

    patcher, inputs = _build(ctx, size, None, width, height, frames, fp8)
    cuda = ctx.device.type == "cuda"
    extra: dict = {}
    if cap:
        if not cuda:
            return {"skipped": "the VRAM cap needs a GPU"}
        torch.cuda.reset_peak_memory_stats()
        comfy_native.forward(patcher, inputs, via="apply_model")  # eager peak sets the cap
        eager_peak = torch.cuda.max_memory_allocated() / harness.GIB
        cap_total = cap_gb if cap_gb is not None else eager_peak + 1.0
        total = torch.cuda.get_device_properties(ctx.device).total_memory / harness.GIB
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_total / total), ctx.device)
        extra.update(eager_peak_gib=round(eager_peak, 2), cap_gib=round(cap_total, 2))
    model = _compiled(patcher, how, mode, scope, backend)
    capture = _Capture()
    logging.getLogger("comfyui_lowvram_dit").addHandler(capture)
    logging.getLogger("comfyui_lowvram_dit").setLevel(logging.INFO)
    t0 = time.perf_counter()
    out = comfy_native.forward(model, inputs, via="apply_model")
    ctx.sync()
    extra["first_call_s"] = round(time.perf_counter() - t0, 2)
    if not torch.isfinite(out).all():
        raise RuntimeError("compiled forward gave non-finite values")
    regions = model.attachments.get("lowvram_dit.torch_compile") if how == "ours" else None
    if regions is not None:
        extra["mode_in_use"] = regions.status()
    extra["log"] = [line for line in capture.lines if "compile" in line][-4:]
    if cap and regions is not None and regions.current is not None and regions.current.mode == mode:
        extra["note"] = "the cap did not force a fallback: lower --cap-gb to see the chain"
    del out
    return {"fn": lambda: comfy_native.forward(model, inputs, via="apply_model"), "tokens": inputs["tokens"],
            **extra}


def block_case(ctx: harness.BenchContext, how: str, mode: str = "default", size: str = "full", width: int = 832,
               height: int = 480, frames: int = 81, backend: str = "inductor") -> dict:
    """Harness target: one WanAttentionBlock with real block-0 inputs (captured from a 1-layer forward)."""
    import torch

    from ..kernels.compile import CompileConfig, CompiledRegions, transformer_options_guard_filter
    from . import comfy_native

    patcher, inputs = _build(ctx, size, 1, width, height, frames)
    dm = patcher.model.diffusion_model
    captured: dict = {}

    def grab(module: Any, args: tuple, kwargs: dict) -> None:
        captured.update(args=args, kwargs=kwargs)

    handle = dm.blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
    comfy_native.forward(patcher, inputs)
    handle.remove()
    args, kwargs = captured["args"], captured["kwargs"]
    holder = torch.nn.Module()
    holder.blocks = torch.nn.ModuleList([dm.blocks[0]])

    def run() -> torch.Tensor:
        with torch.inference_mode():
            return holder.blocks[0](*args, **kwargs)

    if how == "eager":
        call = run
        extra: dict = {}
    else:
        regions = CompiledRegions(CompileConfig(mode=mode, backend=backend), ["blocks.0"],
                                  guard_filter_fn=transformer_options_guard_filter)
        t0 = time.perf_counter()
        regions.run(holder, run)
        ctx.sync()
        extra = {"first_call_s": round(time.perf_counter() - t0, 2), "mode_in_use": regions.status()}

        def call() -> torch.Tensor:
            return regions.run(holder, run)
    return {"fn": call, "tokens": inputs["tokens"], **extra}


def variants(names: list[str], smoke: bool, cap_gb: float | None) -> list[harness.Variant]:
    """The selected variants with the resolution and model size for a full or smoke run."""
    width, height, frames = SMOKE_RESOLUTION if smoke else RESOLUTION
    out = []
    for name in names:
        kind, opts = VARIANTS[name]
        kwargs = {"size": "tiny" if smoke else "full", "width": width, "height": height, "frames": frames, **opts}
        if smoke and kwargs.get("how") != "eager":
            kwargs["backend"] = "cudagraphs"  # inductor on 2 CPU cores takes minutes; this checks the plumbing
        if kind == "model" and opts.get("cap"):
            kwargs["cap_gb"] = cap_gb
        out.append(harness.Variant(name, f"{MODULE}:{kind}_case", kwargs, timeout_s=1800))
    return out


def summary(results: list[dict]) -> str:
    """Markdown: time, speedup vs eager of the same scope, first call, extra VRAM, mode in use."""
    base = {r["name"].split("_")[0]: r for r in results if r["name"] in ("block_eager", "model_eager")}
    lines = ["| variant | ms | speedup vs eager | first call s | peak GiB | extra GiB vs eager | mode in use |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        m = r.get("metrics", {})
        if r.get("status") != "ok" or "skipped" in m:
            lines.append(f"| {r['name']} | {r.get('status')} | | | | | {m.get('skipped') or r.get('error', '')[:150]} |")
            continue
        ref = base.get("block" if r["name"].startswith("block") else "model")
        t, peak = r.get("time_ms"), r.get("peak_allocated_gib")
        speed = f"{ref['time_ms'] / t:.3f}x" if ref and ref.get("time_ms") and t else ""
        extra = f"{peak - ref['peak_allocated_gib']:+.2f}" if ref and peak is not None and \
            ref.get("peak_allocated_gib") is not None else ""
        peak_s = f"{peak:.2f}" if peak is not None else ""
        lines.append(f"| {r['name']} | {t:.1f} | {speed} | {m.get('first_call_s', '')} | {peak_s} | {extra} | "
                     f"{m.get('mode_in_use', 'eager' if 'eager' in r['name'] else 'native')} {m.get('note', '')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the summary table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--cap-gb", type=float, default=None, help="VRAM cap for oom_fallback (GiB)")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 64x64x5, on the CPU")
    parser.add_argument("--out-dir", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    bench = "bench_compile_smoke" if args.smoke else "bench_compile"
    if not args.smoke and args.variants != list(VARIANTS):
        bench += "_partial"
    names = [n for n in args.variants if not (args.smoke and n == "oom_fallback")]
    results = harness.run_benchmark(bench, variants(names, args.smoke, args.cap_gb), repeats=args.repeats,
                                    warmup=args.warmup, out_dir=args.out_dir, force_cpu=args.smoke,
                                    argv=["-m", MODULE, *(sys.argv[1:] if argv is None else argv)])
    text = summary(results)
    (Path(args.out_dir) / f"{bench}_summary.md").write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0 if any(r.get("status") == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
