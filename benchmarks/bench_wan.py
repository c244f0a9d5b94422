"""Wan 2.2 14B in process, one forward through ``apply_model`` per call, each row in a fresh process (README).

One target (``wan_case``) builds every row: weights (native UNETLoader modes or our fp8 layers), then the nodes a
user wires before KSampler (Block Swap, Attention, NaN Guard, Torch Compile), under an optional VRAM cap. A
preset is data: its rows and the rows its ratios are against. Scenarios ``wan14b_480p81`` / ``wan14b_720p81`` /
``block_swap`` (preset ``block_swap``), ``wan14b_fp8`` (``fp8``), ``wan14b_stack`` (``stack``), ``nan_guard``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from comfyui_lowvram_dit.benchmarks import harness
from comfyui_lowvram_dit.checkpoints.safe_write import TORCH_ARCHIVE, starts_with, write_atomic, write_report

MODULE = "comfyui_lowvram_dit.benchmarks.bench_wan"
MODEL = "wan22_t2v_14B"
RESOLUTIONS = {"480p81": (832, 480, 81), "480p17": (832, 480, 17),  # compute-bound / transfer-bound
               "720p81": (1280, 720, 81)}  # 75,600 tokens: attention-dominated
SMOKE_RESOLUTION = (64, 64, 5)
DEFAULT_LOAD_FILE = Path("/tmp/lowvram_dit_bench/wan22_t2v_14B_full_bf16.safetensors")
# weights -> (synthetic file format, UNETLoader weight_dtype); "per_tensor" / "blockwise" are our fp8 layers
WEIGHTS = {"bf16": ("bf16", "default"), "fp8_e4m3fn": ("bf16", "fp8_e4m3fn"),
           "fp8_e4m3fn_fast": ("bf16", "fp8_e4m3fn_fast"), "fp8_scaled": ("fp8_scaled", "default"),
           "per_tensor": ("bf16", "default"), "blockwise": ("bf16", "default"), "gguf_q8": ("bf16", "default")}


@dataclass(frozen=True)
class Preset:
    """Rows (name -> wan_case kwargs), the row names ratios are taken against (within a row's group: its name
    before the last space), the result file's stem, (repeats, warmup), resolutions and VRAM caps."""

    rows: dict[str, dict]
    bases: tuple[str, ...]
    stem: str
    timing: tuple[int, int] = (3, 1)
    res: tuple[str, ...] = ("480p81",)
    caps: tuple[float | None, ...] = (None,)
    timing_per_res: dict[str, tuple[int, int]] = field(default_factory=dict)
    reference: bool = False  # rows compare their output with the first row's (saved by save_ref)


PER_TENSOR = {"weights": "per_tensor"}
PRESETS: dict[str, Preset] = {
    # native partial loading vs Block Swap on native fp8 ("swap") and on our fp8 layers ("swap_b2")
    "block_swap": Preset({"native": {"weights": "fp8_e4m3fn"}, "native_bf16": {"weights": "bf16"},
                          "swap": {"weights": "fp8_e4m3fn", "swap": True},
                          "swap_b2": {**PER_TENSOR, "swap": True}}, ("native",), "block_swap_{res}",
                         res=tuple(RESOLUTIONS), caps=(None, 16, 12, 8, 6),
                         timing_per_res={"480p81": (3, 1), "480p17": (10, 3), "720p81": (2, 1)}),
    # a Q8_0 GGUF model as ComfyUI-GGUF's UnetLoaderGGUF builds it, alone (ComfyUI places it: its patcher is never
    # DynamicVRAM's) vs through Block Swap; needs the gguf package (tests/vendor holds ComfyUI-GGUF)
    "block_swap_gguf": Preset({"gguf": {"weights": "gguf_q8"}, "gguf_swap": {"weights": "gguf_q8", "swap": True}},
                              ("gguf",), "block_swap_gguf_{res}", caps=(12, 8)),
    # one forward: native bf16 / fp8 vs our fp8 layers; native_bf16 runs first and saves the reference output
    "fp8": Preset({"native_bf16": {"weights": "bf16", "save_ref": True},
                   "native_fp8_e4m3fn": {"weights": "fp8_e4m3fn"},
                   "native_fp8_e4m3fn_fast": {"weights": "fp8_e4m3fn_fast"},
                   "native_fp8_scaled": {"weights": "fp8_scaled"}, "ours_per_tensor": PER_TENSOR,
                   "ours_blockwise128": {"weights": "blockwise"},
                   "ours_blockwise64": {"weights": "blockwise", "block_size": 64},
                   "quantize_on_load": {"load": True}}, ("native_bf16",), "wan_fp8", reference=True),
    # the whole stack; every target call makes one untimed forward (the compiling one), so no harness warm-up
    "stack": Preset({"model_eager": {"weights": "bf16"}, "model_native_fp8fast": {"weights": "fp8_e4m3fn_fast"},
                     "model_fp8_eager": PER_TENSOR,
                     "model_fp8_int8attn_eager": {**PER_TENSOR, "attention": "lowvram 8-bit"},
                     "model_fp8_int8attn_ours_default": {**PER_TENSOR, "attention": "lowvram 8-bit",
                                                         "compile": "default"}},
                    ("model_eager", "model_native_fp8fast"), "bench_compile_stack_int8", timing=(3, 0)),
    # Block Swap where everything fits (budget 0, no cap): it must cost nothing next to the same stack without it
    "swap_budget0": Preset({"native_fp8fast": {"weights": "fp8_e4m3fn_fast"},
                            "ours_auto": {**PER_TENSOR, "attention": "auto"},
                            "ours_auto_swap0": {**PER_TENSOR, "attention": "auto", "swap": True}},
                           ("native_fp8fast", "ours_auto"), "wan_swap_budget0", timing=(3, 1)),
    "nan_guard": Preset({"plain": PER_TENSOR, "guard": {**PER_TENSOR, "guard": True}}, ("plain",), "nan_guard",
                        timing=(5, 2), res=("480p81", "480p17")),
}


def quantize_for_ours(sd: dict, mode: str, block_size: int = 128, compute: str = "auto") -> dict:
    """Quantize ``sd``'s block Linear weights in place (our fp8 format); returns the model_options for our ops."""
    import torch

    from ..checkpoints import wan as wc
    from ..host.fp8_ops import Fp8OpsConfig, make_fp8_ops

    for k in [k for k, v in sd.items() if wc.is_fp8_target(k, tuple(v.shape))]:
        q, s = wc.quantize_weight(sd.pop(k), mode, block_size)  # bf16 freed as we go: peak ~ bf16 model
        sd[k], sd[k[: -len("weight")] + "weight_scale"] = q, s
    return {"custom_operations": make_fp8_ops(Fp8OpsConfig(block_size=block_size, compute=compute)),
            "dtype": torch.bfloat16}


def gguf_q8_model(sd: dict) -> tuple[dict, Any]:
    """``sd`` as ComfyUI-GGUF's loader returns a Q8_0 file (2-D weights Q8_0, the rest F32 GGML tensors, on the
    CPU) and the ``wrap`` that turns ComfyUI's patcher into ``UnetLoaderGGUF``'s; ComfyUI-GGUF from tests/vendor."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from gguf_files import import_vendored_gguf  # needs the gguf package

    vendored = import_vendored_gguf()
    GGMLTensor, Q = vendored.ops.GGMLTensor, vendored.dequant.gguf.GGMLQuantizationType
    out = {}
    for key in list(sd):
        w = sd.pop(key)
        if w.ndim == 2 and w.numel() >= 1024 and w.shape[1] % 32 == 0:
            blocks = w.float().reshape(-1, 32)  # Q8_0: per 32 weights an fp16 scale and 32 int8, as gguf writes it
            d = blocks.abs().amax(1, keepdim=True) / 127
            q = torch.where(d > 0, blocks / d, 0).round().clamp(-127, 127).to(torch.int8)
            raw = torch.cat([d.half().view(torch.uint8), q.view(torch.uint8)], 1).reshape(w.shape[0], -1).cpu()
            out[key] = GGMLTensor(raw, tensor_type=Q.Q8_0, tensor_shape=w.shape)
        else:
            out[key] = GGMLTensor(w.float().cpu(), tensor_type=Q.F32, tensor_shape=w.shape)
    return out, vendored


def _rel_error(out: Any, ref_path: str | None, save: bool) -> dict:
    """Save the reference output, or compare with it: ||out - ref|| / ||ref|| in fp32."""
    import torch

    if ref_path is None:
        return {}
    path = Path(ref_path)
    if save:
        path.parent.mkdir(parents=True, exist_ok=True)
        ref = out.detach().to("cpu", torch.bfloat16)
        write_atomic(path, lambda f: torch.save(ref, f), starts_with(TORCH_ARCHIVE, 4))
        return {"rel_error_vs_bf16": 0.0}
    if not path.is_file():
        return {"rel_error_vs_bf16": None, "note": f"no reference output {path.name}: run native_bf16 first"}
    ref = torch.load(path).float().to(out.device)
    return {"rel_error_vs_bf16": ((out.float() - ref).norm() / ref.norm()).item()}


def _nodes(swap: bool, blocks_to_swap: int, prefetch: int, attention: str | None, guard: bool,
           compile_mode: str | None, backend: str) -> Any:
    """``wrap`` for comfy_native.load_native_model: the nodes in the order a user wires them."""
    def wrap(patcher: Any, memory_required: int) -> Any:
        if swap:  # nodes.* import comfy_api at module level: only after import_comfy put ComfyUI on sys.path
            from ..host.block_swap import SWAP_KEY, apply_block_swap
            from ..offload.plan import SwapConfig

            patcher = apply_block_swap(patcher, SwapConfig(blocks_to_swap=blocks_to_swap, prefetch=prefetch))
            patcher.attachments[SWAP_KEY].activation_bytes = memory_required  # KSampler's estimate (CFG batch)
        if attention is not None:
            from ..host.attention import apply_attention

            patcher = apply_attention(patcher, attention)
        if guard:
            from ..host.nan_guard import apply_nan_guard

            patcher = apply_nan_guard(patcher, "warn")
        if compile_mode is not None:
            from ..kernels.compile import CompileConfig
            from ..host.torch_compile import apply_compile

            patcher = apply_compile(patcher, CompileConfig(mode=compile_mode, backend=backend), "blocks")
        return patcher
    return wrap


def _swap_stats(patcher: Any, inputs: dict, forward: Any) -> dict:
    """The Block Swap plan and one instrumented forward's transfer / stall figures (empty without Block Swap)."""
    from ..host.block_swap import SWAP_KEY
    from ..offload.engine import format_stats

    ctl = patcher.attachments.get(SWAP_KEY)
    if ctl is None:
        return {}
    plan = ctl.plan
    out = {"streamed_blocks": len(plan.streamed) if plan else 0, "ring_slots": plan.ring if plan else 0,
           "ring_gib": round((plan.ring_bytes if plan else 0) / harness.GIB, 3)}
    if ctl.streamer is not None and ctl.active and plan is not None and plan.streamed:
        ctl.streamer.debug = True  # one instrumented forward (one sync at its end), then timing without it
        forward()
        stats = ctl.streamer.stats
        ctl.streamer.debug = False
        out.update(transfer_ms=round(stats.transfer_ms, 2), stall_ms=round(stats.stall_ms, 2),
                   streamed_compute_ms=round(stats.compute_ms, 2), overlap_pct=round(100 * stats.overlap, 1),
                   on_demand_loads=stats.on_demand)
        print(format_stats(stats), file=sys.stderr)
    return out


def wan_case(ctx: harness.BenchContext, weights: str = "bf16", size: str = "full", width: int = 832,
             height: int = 480, frames: int = 81, vram_cap_gb: float | None = None, swap: bool = False,
             blocks_to_swap: int = -1, prefetch: int = 1, attention: str | None = None, guard: bool = False,
             compile: str | None = None, backend: str = "inductor", block_size: int = 128,
             ref_path: str | None = None, save_ref: bool = False) -> dict:
    """Harness target: build one row's MODEL from synthetic weights made on the device; the first forward (which
    compiles) is timed and checked here, the harness times the later ones."""
    import torch

    from ..kernels.compile import unique_graphs
    from ..synthetic.checkpoints import synthetic_state_dict
    from . import comfy_native

    if vram_cap_gb is not None and ctx.device.type != "cuda":
        return {"skipped": "the VRAM cap needs a GPU"}
    comfy_native.import_comfy(cpu=ctx.device.type == "cpu")
    fmt, weight_dtype = WEIGHTS[weights]
    sd = synthetic_state_dict(MODEL, size=size, fmt=fmt, device=ctx.device.type)
    extra: dict = {"weights": weights, "vram_cap_gib": vram_cap_gb, "resolution": f"{width}x{height}x{frames}"}
    options: dict = {"dtype": torch.bfloat16} if weights == "bf16" else {}
    if weights in ("per_tensor", "blockwise"):
        t0 = time.perf_counter()
        options = quantize_for_ours(sd, weights, block_size)
        ctx.sync()
        extra["quantize_s"] = round(time.perf_counter() - t0, 3)
    latent_shape = comfy_native.wan_latent_shape(sd["head.head.weight"].shape[0] // 4, width, height, frames)
    wrap = _nodes(swap, blocks_to_swap, prefetch, attention, guard, compile, backend)
    if weights == "gguf_q8":
        sd, vendored = gguf_q8_model(sd)
        options, nodes = {"custom_operations": vendored.ops.GGMLOps()}, wrap
        wrap = lambda p, mem: nodes(vendored.nodes.GGUFModelPatcher.clone(p), mem)  # noqa: E731 - UnetLoaderGGUF
    patcher = comfy_native.load_native_model(sd, weight_dtype, options, vram_cap_gb=vram_cap_gb,
                                             latent_shape=latent_shape, wrap=wrap)
    del sd
    inputs = comfy_native.wan_inputs(patcher, width, height, frames)

    def forward() -> torch.Tensor:
        return comfy_native.forward(patcher, inputs, via="apply_model")

    t0 = time.perf_counter()
    out = forward()
    ctx.sync()
    extra["first_call_s"] = round(time.perf_counter() - t0, 2)
    if tuple(out.shape) != tuple(inputs["x"].shape) or not torch.isfinite(out).all():
        raise RuntimeError(f"forward gave shape {tuple(out.shape)} or non-finite values")
    extra.update(_rel_error(out, ref_path, save_ref))
    del out
    if weights in ("per_tensor", "blockwise"):
        extra["fp8_path"] = patcher.model.diffusion_model.blocks[0].ffn[0]._path(inputs["x"].device)
    regions = patcher.attachments.get("lowvram_dit.torch_compile")
    if regions is not None:
        extra["mode_in_use"] = regions.status()
    extra.update(_swap_stats(patcher, inputs, forward))
    first = unique_graphs()  # Dynamo's graphs after the first call; growth during timing = recompiles
    return {"fn": forward, "tokens": inputs["tokens"], **extra, **comfy_native.describe(patcher),
            "after": lambda: {"graphs_first_call": first, "graphs_last_call": unique_graphs()}}


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
    gb, size_gb = 1e9, p.stat().st_size / 1e9
    return {"file_gb": size_gb, "seconds": round(seconds, 2), "gb_per_s": size_gb / seconds, "result_gb": held / gb,
            "peak_rss_before_load_gb": rss_before / gb, "peak_rss_gb": rss_after / gb,
            "peak_rss_minus_result_gb": (rss_after - held) / gb, "fp8_layers": loaded.fp8_layers,
            "quantize_device": str(ctx.device)}


def variants(preset: Preset, rows: list[str], res: str, caps: list[float | None], smoke: bool, out_dir: Path,
             load_file: Path) -> list[harness.Variant]:
    """One variant per (cap, row) at ``res``; names are '<res> cap=<cap> <row>', shorter where one value."""
    width, height, frames = SMOKE_RESOLUTION if smoke else RESOLUTIONS[res]
    size = "tiny" if smoke else "full"
    ref = str(out_dir / f"wan_fp8_ref_{'smoke' if smoke else res}.pt")
    out = []
    for cap in caps:
        for row in rows:
            kwargs = dict(preset.rows[row])
            prefix = " ".join(([res] if len(preset.res) > 1 else []) + ([f"cap={cap or 'none'}"]
                                                                         if len(preset.caps) > 1 else []))
            name = f"{prefix} {row}".strip()
            if kwargs.pop("load", False):
                path = load_file.with_name(load_file.stem + "_tiny.safetensors") if smoke else load_file
                out.append(harness.Variant(name, f"{MODULE}:quantize_on_load", {"path": str(path), "size": size}))
                continue
            kwargs.update(size=size, width=width, height=height, frames=frames, vram_cap_gb=cap)
            if preset.reference:
                kwargs["ref_path"] = ref
            if smoke and kwargs.get("swap"):
                kwargs["blocks_to_swap"] = 2  # no VRAM on the CPU: stream explicitly to exercise the path
            if smoke and kwargs.get("compile"):
                kwargs["backend"] = "cudagraphs"  # inductor on 2 CPU cores takes minutes; this checks the plumbing
            out.append(harness.Variant(name, f"{MODULE}:wan_case", kwargs, timeout_s=600))
    return out


def ratios(results: list[dict], bases: tuple[str, ...]) -> str:
    """Markdown: each row's time and its speed-up against the base rows of its group (its name's prefix)."""
    ok = {r["name"]: r["time_ms"] for r in results if r.get("status") == "ok" and r.get("time_ms")}
    lines = ["| variant | ms | speed-up |", "|---|---|---|"]
    for r in results:
        group = r["name"].rsplit(" ", 1)[0] + " " if " " in r["name"] else ""
        t = ok.get(r["name"])
        cells = [f"{ok[group + b] / t:.3f}x vs {group + b}" for b in bases
                 if t and group + b in ok and group + b != r["name"]]
        lines.append(f"| {r['name']} | {f'{t:.1f}' if t else r.get('status')} | {'; '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run a preset (see the module docstring) and print its ratios."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=list(PRESETS), default="block_swap")
    p.add_argument("--res", nargs="+", choices=list(RESOLUTIONS), default=None)
    p.add_argument("--caps", nargs="+", default=None, help="GiB caps, 'none' = no cap")
    p.add_argument("--kinds", "--variants", nargs="+", default=None, help="rows of the preset (default: all)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--smoke", action="store_true", help="tiny model, 64x64x5, on the CPU, no caps")
    p.add_argument("--tag", default="", help="suffix for the result files (keeps an earlier run's files)")
    p.add_argument("--load-file", type=Path, default=DEFAULT_LOAD_FILE,
                   help="bf16 file for quantize_on_load (written once if missing, 28.6 GB)")
    p.add_argument("--out-dir", "--out", type=Path, default=None,
                   help="default: benchmarks/results (smoke: a temp folder)")
    args = p.parse_args(argv)
    preset = PRESETS[args.preset]
    rows = args.kinds or list(preset.rows)
    if unknown := set(rows) - set(preset.rows):
        p.error(f"rows {sorted(unknown)} are not in preset {args.preset}: {list(preset.rows)}")
    caps = [None] if args.smoke else ([None if c == "none" else float(c) for c in args.caps] if args.caps
                                      else list(preset.caps))
    out_dir = args.out_dir or (Path("/tmp/lowvram_dit_bench_smoke") if args.smoke else harness.RESULTS)
    results: list[dict] = []
    resolutions = args.res or list(preset.res[:1] if args.smoke else preset.res)
    per_res = "{res}" in preset.stem
    for group in ([[r] for r in resolutions] if per_res else [resolutions]):
        stem = preset.stem.format(res="smoke" if args.smoke else group[0]) if per_res else preset.stem
        stem += ("_" + args.tag if args.tag else "") + ("_smoke" if args.smoke and not per_res else "")
        if not args.smoke and rows != list(preset.rows) and not per_res:
            stem += "_partial"  # a subset must not overwrite the full table
        repeats, warmup = (2, 1) if args.smoke else preset.timing_per_res.get(group[0], preset.timing)
        vs = [v for res in group for v in variants(preset, rows, res, caps, args.smoke, out_dir, args.load_file)]
        part = harness.run_benchmark(stem, vs, repeats=args.repeats or repeats,
                                     warmup=warmup if args.warmup is None else args.warmup, out_dir=out_dir,
                                     force_cpu=args.smoke, plot="time_ms", argv=harness.command_argv(MODULE, argv))
        write_report(out_dir / f"{stem}_summary.md", ratios(part, preset.bases))
        results += part
    print(ratios(results, preset.bases))
    failed = [r for r in results if r.get("status") != "ok"]
    for r in failed:
        print(f"{r['name']}: {r['status']}: {r.get('error', '')[:500]}", file=sys.stderr)
    return 1 if failed and args.smoke else 0
