"""Scenarios ``wan14b_stack``, ``compile``, ``compile_modes``, ``compile_graphs``: eager vs our Torch Compile node vs
ComfyUI's TorchCompileModel, per model, with the 8-bit attention and with Block Swap (README).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from comfyui_lowvram_dit.checkpoints.safe_write import starts_with, write_atomic, write_report

from comfyui_lowvram_dit.benchmarks import harness

MODULE = "comfyui_lowvram_dit.benchmarks.bench_compile"
MODEL = "wan22_t2v_14B"
MODEL_5B = "wan22_ti2v_5B"
MODEL_QWEN = "qwen_image"
RESOLUTION = (832, 480, 81)  # Wan 14B and 5B: 32,760 / 8,190 tokens
QWEN_RESOLUTION = (1024, 1024, 1)  # 4,096 image tokens
QWEN_TEXT_LEN = 100  # prompt tokens after the template prefix is dropped (model-facts §2 FLOP table: "+100")
QWEN_TEXT_DIM = 3584  # Qwen2.5-VL hidden size = the transformer's joint_attention_dim (model-facts §3.1)
SMOKE_RESOLUTION = (64, 64, 5)
SWAP_CAP_GB = 8.0
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
    # small token counts: Wan 2.2 TI2V-5B at 480p81 and Qwen-Image at 1024x1024, our fp8 layers
    "wan5b_fp8_eager": ("model", {"how": "eager", "fp8": "per_tensor", "model": MODEL_5B}),
    "wan5b_fp8_ours_default": ("model", {"how": "ours", "mode": "default", "fp8": "per_tensor", "model": MODEL_5B}),
    "wan5b_fp8_ours_reduce-overhead": ("model", {"how": "ours", "mode": "reduce-overhead", "fp8": "per_tensor",
                                                 "model": MODEL_5B}),
    "wan5b_fp8_ours_max-autotune-no-cudagraphs": ("model", {"how": "ours", "mode": "max-autotune-no-cudagraphs",
                                                            "fp8": "per_tensor", "model": MODEL_5B}),
    "qwen_fp8_eager": ("model", {"how": "eager", "fp8": "per_tensor", "model": MODEL_QWEN}),
    "qwen_fp8_ours_default": ("model", {"how": "ours", "mode": "default", "fp8": "per_tensor",
                                        "model": MODEL_QWEN}),
    # compile composed with Block Swap (our fp8 layers) under a VRAM cap
    "swap_fp8_eager": ("swap", {"how": "eager"}),
    "swap_fp8_ours_default": ("swap", {"how": "ours", "mode": "default"}),
    "oom_fallback": ("model", {"how": "ours", "mode": "reduce-overhead", "cap": True}),
    # the whole stack: native fp8_e4m3fn_fast (UNETLoader) as the second baseline, and our fp8 layers with the
    # 8-bit attention kernel (Attention node "lowvram 8-bit"), eager and regionally compiled
    "model_native_fp8fast": ("model", {"how": "eager", "weight_dtype": "fp8_e4m3fn_fast"}),
    "model_fp8_int8attn_eager": ("model", {"how": "eager", "fp8": "per_tensor", "attention": "lowvram 8-bit"}),
    "model_fp8_int8attn_ours_default": ("model", {"how": "ours", "mode": "default", "fp8": "per_tensor",
                                                  "attention": "lowvram 8-bit"}),
}
# name -> (group, baselines): speedups in the summary are against each baseline that ran ok
GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    **{n: ("block", ("block_eager",)) for n in VARIANTS if n.startswith("block_")},
    **{n: ("14B bf16", ("model_eager",)) for n in VARIANTS if n.startswith("model_ours") or n == "model_eager"},
    "native_torchcompilemodel": ("14B bf16", ("model_eager",)),
    "oom_fallback": ("14B bf16", ("model_eager",)),
    "model_fp8_eager": ("14B stack", ("model_eager",)),
    "model_fp8_ours_default": ("14B stack", ("model_fp8_eager", "model_eager")),
    "wan5b_fp8_eager": ("5B 480p81", ()),
    "wan5b_fp8_ours_default": ("5B 480p81", ("wan5b_fp8_eager",)),
    "wan5b_fp8_ours_reduce-overhead": ("5B 480p81", ("wan5b_fp8_eager",)),
    "wan5b_fp8_ours_max-autotune-no-cudagraphs": ("5B 480p81", ("wan5b_fp8_eager",)),
    "qwen_fp8_eager": ("Qwen 1024", ()),
    "qwen_fp8_ours_default": ("Qwen 1024", ("qwen_fp8_eager",)),
    "swap_fp8_eager": ("14B swap", ("model_fp8_eager",)),  # the cost of streaming vs resident
    "swap_fp8_ours_default": ("14B swap", ("swap_fp8_eager", "model_fp8_ours_default")),
    "model_native_fp8fast": ("14B stack", ("model_eager",)),
    "model_fp8_int8attn_eager": ("14B stack", ("model_fp8_eager", "model_eager", "model_native_fp8fast")),
    "model_fp8_int8attn_ours_default": ("14B stack", ("model_fp8_int8attn_eager", "model_eager",
                                                      "model_native_fp8fast")),
}
PRESETS: dict[str, list[str]] = {
    "session2": ["wan5b_fp8_eager", "wan5b_fp8_ours_default", "qwen_fp8_eager", "qwen_fp8_ours_default",
                 "model_eager", "model_fp8_eager", "model_fp8_ours_default", "swap_fp8_eager",
                 "swap_fp8_ours_default", "oom_fallback"],
    "stack14b": ["model_eager", "model_fp8_eager", "model_fp8_ours_default"],
    "stack_int8": ["model_eager", "model_native_fp8fast", "model_fp8_eager", "model_fp8_int8attn_eager",
                   "model_fp8_int8attn_ours_default"],
    "modes": ["wan5b_fp8_eager", "wan5b_fp8_ours_reduce-overhead", "wan5b_fp8_ours_max-autotune-no-cudagraphs",
              "model_eager", "oom_fallback", "model_ours_reduce-overhead", "model_ours_max-autotune-no-cudagraphs"],
    # CUDA-graph mode next to default mode in the same run
    "graphs": ["wan5b_fp8_eager", "wan5b_fp8_ours_default", "wan5b_fp8_ours_reduce-overhead", "model_eager",
               "model_ours_default", "model_ours_reduce-overhead"],
}
# (repeats, warmup): every target makes one untimed forward first (the compiling one for compiled variants; swap
# variants add an instrumented one), so it is the warm-up and the harness adds none; medians of 3 hide the one
# graph-recording call of reduce-overhead in oom_fallback.
PRESET_TIMING = {"session2": (3, 0), "stack14b": (3, 0), "stack_int8": (3, 0), "modes": (3, 0),
                 "graphs": (3, 0)}
PRESET_BUDGET_S = 560.0  # the GPU tool stops a command at 600 s: leave room for the last report
# Wall seconds per variant on an H200 (child start + setup + first call + 3 timed calls, from results/*.md), for
# the budget check and the printed estimate.
EST_WALL_S: dict[str, float] = {
    "wan5b_fp8_eager": 20, "wan5b_fp8_ours_default": 35, "qwen_fp8_eager": 42, "qwen_fp8_ours_default": 62,
    "model_eager": 48, "model_fp8_eager": 38, "model_fp8_ours_default": 55, "swap_fp8_eager": 36,
    "swap_fp8_ours_default": 55, "oom_fallback": 75, "model_native_fp8fast": 45, "model_fp8_int8attn_eager": 45,
    "model_fp8_int8attn_ours_default": 65, "model_ours_reduce-overhead": 70,
    "model_ours_max-autotune-no-cudagraphs": 130, "wan5b_fp8_ours_reduce-overhead": 55,
    "model_ours_default": 70,
    "wan5b_fp8_ours_max-autotune-no-cudagraphs": 90,
}
DEFAULT_EST_S = 90.0


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class _GraphWatch:
    """Dynamo's graph count after every forward, written to ``path`` (the parent merges it into the report).

    The harness snapshots a target's metrics before timing, so counts taken during the timed calls travel in a
    side file: one small JSON write after each call, on the CPU while the GPU still runs the forward.
    """

    def __init__(self, path: str | None, untimed_calls: int) -> None:
        self.path = Path(path) if path else None
        from ..kernels.compile import unique_graphs

        self.count = unique_graphs
        self.graphs: list[int] = [self.count()]
        self.untimed = untimed_calls  # calls made by the target itself (the first, compiling one included)
        self._write()

    def mark(self) -> None:
        """Record the count after one more forward."""
        self.graphs.append(self.count())
        self._write()

    def wrap(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """``fn`` that records the graph count after each call."""
        def call() -> Any:
            out = fn()
            self.mark()
            return out
        return call

    def _write(self) -> None:
        if self.path is not None:
            write_atomic(self.path, json.dumps({"graphs": self.graphs, "untimed_calls": self.untimed}),
                         starts_with('{"graphs": ', 11))


def _fp8_options(model: str, sd: dict, mode: str) -> dict:
    """Quantize ``sd``'s block Linear weights in place (our fp8 format) and return the model_options for our ops."""
    if model != MODEL_QWEN:
        from .bench_wan_fp8 import quantize_for_ours

        return quantize_for_ours(sd, mode, 128)
    import torch

    from ..checkpoints import wan as wc
    from ..checkpoints.qwen_image import is_qwen_fp8_target
    from ..host.fp8_ops import Fp8OpsConfig, make_fp8_ops

    for k in [k for k, v in sd.items() if is_qwen_fp8_target(k, tuple(v.shape))]:
        q, s = wc.quantize_weight(sd.pop(k), mode, 128)  # bf16 freed as we go: peak ~ the bf16 model
        sd[k], sd[k[: -len("weight")] + "weight_scale"] = q, s
    return {"custom_operations": make_fp8_ops(Fp8OpsConfig(block_size=128)), "dtype": torch.bfloat16}


def _latent_shape(model: str, sd: dict, width: int, height: int, frames: int) -> tuple:
    from . import comfy_native

    if model == MODEL_QWEN:  # Wan 2.1 VAE latent, one frame (bench_qwen_staged._forward_fn)
        if width % 16 or height % 16:
            raise ValueError(f"{width}x{height}: Qwen-Image needs multiples of 16 (VAE stride 8 x patch 2)")
        return (1, 16, 1, height // 8, width // 8)
    out_dim = sd["head.head.weight"].shape[0] // 4  # latent channels, as comfy/model_detection.py derives them
    return comfy_native.wan_latent_shape(out_dim, width, height, frames)


def _inputs(model: str, patcher: Any, latent_shape: tuple, width: int, height: int, frames: int) -> dict:
    """x, timestep, context (and the token count) for one forward of ``model``."""
    import torch

    from . import comfy_native

    if model != MODEL_QWEN:
        return comfy_native.wan_inputs(patcher, width, height, frames)
    base = patcher.model
    dtype = base.manual_cast_dtype or base.get_dtype()
    gen = torch.Generator(device="cpu").manual_seed(0)
    device = patcher.load_device
    return {"x": torch.randn(latent_shape, generator=gen).to(device, dtype),
            "timestep": torch.full((1,), 500.0, device=device),
            "context": torch.randn((1, QWEN_TEXT_LEN, QWEN_TEXT_DIM), generator=gen).to(device, dtype),
            "tokens": (latent_shape[3] // 2) * (latent_shape[4] // 2) + QWEN_TEXT_LEN}


def _build(ctx: harness.BenchContext, size: str, num_layers: int | None, width: int, height: int, frames: int,
           fp8: str | None = None, model: str = MODEL, weight_dtype: str = "default", attention: str | None = None):
    import torch

    from ..synthetic.checkpoints import synthetic_state_dict
    from . import comfy_native

    comfy_native.import_comfy(cpu=ctx.device.type == "cpu")
    sd = synthetic_state_dict(model, size=size, device=ctx.device.type, num_layers=num_layers)
    options: dict = {"dtype": torch.bfloat16} if weight_dtype == "default" else {}  # UNETLoader's own fp8 modes
    if fp8:  # our fp8 layers (per_tensor / blockwise), built as the loader nodes build them
        options = _fp8_options(model, sd, fp8)
    latent_shape = _latent_shape(model, sd, width, height, frames)
    patcher = comfy_native.load_native_model(sd, weight_dtype, options, latent_shape=latent_shape)
    if attention is not None:  # what the Attention node does (its backend label)
        from ..nodes.attention import apply_attention

        patcher = apply_attention(patcher, attention)
    return patcher, _inputs(model, patcher, latent_shape, width, height, frames)


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


def _first_call(ctx: harness.BenchContext, model: Any, inputs: dict, how: str) -> tuple[dict, Any]:
    """Run (and time) the first forward, which compiles; returns (metrics, the compiled regions or None)."""
    import torch

    from . import comfy_native

    capture = _Capture()
    logger = logging.getLogger("comfyui_lowvram_dit")
    logger.addHandler(capture)
    logger.setLevel(logging.INFO)
    try:
        t0 = time.perf_counter()
        out = comfy_native.forward(model, inputs, via="apply_model")
        ctx.sync()
        extra: dict = {"first_call_s": round(time.perf_counter() - t0, 2)}
    finally:
        logger.removeHandler(capture)
    if tuple(out.shape) != tuple(inputs["x"].shape) or not torch.isfinite(out).all():
        raise RuntimeError(f"forward gave shape {tuple(out.shape)} (expected {tuple(inputs['x'].shape)}) "
                           "or non-finite values")
    del out
    regions = model.attachments.get("lowvram_dit.torch_compile") if how == "ours" else None
    if regions is not None:
        extra["mode_in_use"] = regions.status()
    extra["log"] = [line for line in capture.lines if "compile" in line or "Block Swap" in line][-4:]
    return extra, regions


def model_case(ctx: harness.BenchContext, how: str, mode: str = "default", scope: str = "blocks",
               size: str = "full", width: int = 832, height: int = 480, frames: int = 81, cap: bool = False,
               cap_gb: float | None = None, backend: str = "inductor", fp8: str | None = None,
               model: str = MODEL, watch: str | None = None, weight_dtype: str = "default",
               attention: str | None = None) -> dict:
    """Harness target: the whole model through apply_model, eager or compiled; first call timed here."""
    import torch

    from . import comfy_native

    patcher, inputs = _build(ctx, size, None, width, height, frames, fp8, model, weight_dtype, attention)
    cuda = ctx.device.type == "cuda"
    extra: dict = {"resolution": f"{width}x{height}" + (f"x{frames}" if model != MODEL_QWEN else "")}
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
    compiled = _compiled(patcher, how, mode, scope, backend)
    first, regions = _first_call(ctx, compiled, inputs, how)
    extra.update(first)
    if cap and regions is not None and regions.current is not None and regions.current.mode == mode:
        extra["note"] = "the cap did not force a fallback: lower --cap-gb to see the chain"
    graphs = _GraphWatch(watch, untimed_calls=1)
    fn = graphs.wrap(lambda: comfy_native.forward(compiled, inputs, via="apply_model"))
    return {"fn": fn, "tokens": inputs["tokens"], **extra}


def swap_case(ctx: harness.BenchContext, how: str, mode: str = "default", size: str = "full", width: int = 832,
              height: int = 480, frames: int = 81, vram_cap_gb: float | None = SWAP_CAP_GB, blocks_to_swap: int = -1,
              prefetch: int = 1, backend: str = "inductor", watch: str | None = None) -> dict:
    """Harness target: Wan 14B, our fp8 layers + Block Swap under a VRAM cap, then (how="ours") our compile node.

    Graph order as a user wires it: loader -> Block Swap -> Torch Compile; loaded by ``load_models_gpu`` with
    KSampler's memory estimate (as bench_block_swap.swap_forward does), run through ``apply_model``.
    """
    from ..offload.plan import SwapConfig
    from ..offload.engine import format_stats
    from ..synthetic.checkpoints import synthetic_state_dict
    from . import comfy_native

    comfy = comfy_native.import_comfy(cpu=ctx.device.type == "cpu")
    # nodes.block_swap imports comfy_api at module level: only after import_comfy put COMFYUI_PATH on sys.path
    from ..nodes.block_swap import SWAP_KEY, apply_block_swap
    mm = comfy.model_management
    sd = synthetic_state_dict(MODEL, size=size, device=ctx.device.type)
    latent_shape = _latent_shape(MODEL, sd, width, height, frames)
    options = _fp8_options(MODEL, sd, "per_tensor")
    plain = comfy.sd.load_diffusion_model_state_dict(sd, model_options=options)
    sd.clear()
    mm.soft_empty_cache(force=True)
    extra: dict = {"resolution": f"{width}x{height}x{frames}", "vram_cap_gib": vram_cap_gb}
    if vram_cap_gb is not None:
        if ctx.device.type != "cuda":
            return {"skipped": "the VRAM cap needs a GPU"}
        comfy_native.apply_vram_cap(vram_cap_gb)
    swapped = apply_block_swap(plain, SwapConfig(blocks_to_swap=blocks_to_swap, prefetch=prefetch))
    ctl = swapped.attachments[SWAP_KEY]
    model = _compiled(swapped, how, mode, "blocks", backend)
    b, rest = latent_shape[0], list(latent_shape[1:])
    need = plain.model.memory_required([2 * b, *rest])  # what KSampler's estimate_memory reserves (CFG batch)
    ctl.activation_bytes = int(need)
    mm.load_models_gpu([model], memory_required=need, minimum_memory_required=plain.model.memory_required([b, *rest]))
    inputs = _inputs(MODEL, model, latent_shape, width, height, frames)
    extra.update(_first_call(ctx, model, inputs, how)[0])
    plan = ctl.plan
    extra.update(streamed_blocks=len(plan.streamed) if plan else 0, ring_slots=plan.ring if plan else 0,
                 ring_gib=round((plan.ring_bytes if plan else 0) / harness.GIB, 3))
    untimed = 1
    graphs = _GraphWatch(watch, untimed_calls=untimed)
    if ctl.streamer is not None and ctl.active and plan is not None and plan.streamed:
        ctl.streamer.debug = True  # one instrumented forward (one sync at its end), then timing without it
        comfy_native.forward(model, inputs, via="apply_model")
        stats = ctl.streamer.stats
        ctl.streamer.debug = False
        graphs.untimed = untimed = 2
        graphs.mark()
        extra.update(transfer_ms=round(stats.transfer_ms, 2), stall_ms=round(stats.stall_ms, 2),
                     streamed_compute_ms=round(stats.compute_ms, 2), overlap_pct=round(100 * stats.overlap, 1),
                     on_demand_loads=stats.on_demand)
        print(format_stats(stats), file=sys.stderr)
    fn = graphs.wrap(lambda: comfy_native.forward(model, inputs, via="apply_model"))
    return {"fn": fn, "tokens": inputs["tokens"], **extra, **comfy_native.describe(model)}


def block_case(ctx: harness.BenchContext, how: str, mode: str = "default", size: str = "full", width: int = 832,
               height: int = 480, frames: int = 81, backend: str = "inductor", watch: str | None = None) -> dict:
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
    return {"fn": _GraphWatch(watch, untimed_calls=1).wrap(call), "tokens": inputs["tokens"], **extra}


def variants(names: list[str], smoke: bool, cap_gb: float | None, watch_dir: Path | None = None,
             timeout_s: float = 1800) -> list[harness.Variant]:
    """The selected variants with the resolution and model size for a full or smoke run."""
    out = []
    for name in names:
        kind, opts = VARIANTS[name]
        res = QWEN_RESOLUTION if opts.get("model") == MODEL_QWEN else RESOLUTION
        width, height, frames = SMOKE_RESOLUTION if smoke else res
        kwargs = {"size": "tiny" if smoke else "full", "width": width, "height": height, "frames": frames, **opts}
        if smoke and kwargs.get("how") != "eager":
            kwargs["backend"] = "cudagraphs"  # inductor on 2 CPU cores takes minutes; this checks the plumbing
        if kind == "model" and opts.get("cap"):
            kwargs["cap_gb"] = cap_gb
        if kind == "swap" and smoke:
            kwargs.update(vram_cap_gb=None, blocks_to_swap=2)  # no VRAM on CPU: stream explicitly (CPU ring)
        if watch_dir is not None:
            kwargs["watch"] = str(watch_dir / f"{name}.json")
        out.append(harness.Variant(name, f"{MODULE}:{kind}_case", kwargs, timeout_s=timeout_s))
    return out


def merge_graph_counts(results: list[dict], watch_dir: Path, warmup: int) -> None:
    """Add each variant's graph counts (side file written by its child) to its metrics, in place."""
    for r in results:
        path = watch_dir / f"{r['name']}.json"
        if r.get("status") != "ok" or not path.is_file():
            continue
        data = json.loads(path.read_text(encoding="utf-8"))
        g, untimed = data["graphs"], int(data["untimed_calls"])
        steady = g[min(len(g) - 1, untimed - 1 + warmup)]  # after the target's own calls and the warm-up calls
        r.setdefault("metrics", {}).update(
            graphs_per_call=g, graphs_first_call=g[0], graphs_last_call=g[-1],
            new_graphs_after_first_call=g[-1] - g[0], new_graphs_after_warmup=g[-1] - steady)


def _speedups(r: dict, ok: dict[str, dict]) -> str:
    t = r.get("time_ms")
    cells = [f"{ok[b]['time_ms'] / t:.3f}x vs {b}" for b in GROUPS.get(r["name"], ("", ()))[1]
             if b != r["name"] and b in ok and ok[b].get("time_ms") and t]
    return "; ".join(cells)


def summary(results: list[dict]) -> str:
    """Markdown: group, time, speedup vs the group's baseline(s), first call, VRAM, graph counts, mode in use."""
    ok = {r["name"]: r for r in results if r.get("status") == "ok" and "skipped" not in r.get("metrics", {})}
    header = ("| group | variant | ms | speedup | first call s | peak GiB | extra GiB vs first baseline | "
              "graphs first->last | mode in use |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        m = r.get("metrics", {})
        group, bases = GROUPS.get(r["name"], ("", ()))
        if r["name"] not in ok:
            why = m.get("skipped") or (r.get("error") or "")[:150]
            lines.append(f"| {group} | {r['name']} | {r.get('status')} | | | | | | {why} |")
            continue
        t, peak = r.get("time_ms"), r.get("peak_allocated_gib")
        ref = next((ok[b] for b in bases if b in ok), None)
        extra = f"{peak - ref['peak_allocated_gib']:+.2f}" if ref and peak is not None and \
            ref.get("peak_allocated_gib") is not None else ""
        peak_s = f"{peak:.2f}" if peak is not None else ""
        graphs = f"{m['graphs_first_call']}->{m['graphs_last_call']}" if "graphs_first_call" in m else ""
        mode = m.get("mode_in_use", "eager" if "eager" in r["name"] else "native")
        lines.append(f"| {group} | {r['name']} | {t:.1f} | {_speedups(r, ok)} | {m.get('first_call_s', '')} | "
                     f"{peak_s} | {extra} | {graphs} | {mode} {m.get('note', '')} |")
    return "\n".join(lines)


def _skipped(variant: harness.Variant, why: str) -> dict:
    return {"name": variant.name, "target": variant.target, "kwargs": variant.kwargs, "status": "skipped",
            "error": why, "metrics": {"skipped": why}}


def run(bench: str, vs: list[harness.Variant], *, repeats: int, warmup: int, out_dir: Path, smoke: bool,
        argv: list[str], watch_dir: Path, budget_s: float | None) -> list[dict]:
    """Each variant as its own harness run; the combined ``<bench>`` report is rewritten after every variant."""
    results: list[dict] = []
    env: dict = {}
    settings = {"repeats": repeats, "warmup": warmup, "fresh_process": True}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_compile_parts_") as parts:
        for i, v in enumerate(vs):
            elapsed = time.perf_counter() - start
            est = EST_WALL_S.get(v.name, DEFAULT_EST_S)
            if budget_s is not None and elapsed + est > budget_s:
                results.append(_skipped(v, f"time budget: {elapsed:.0f} s used + ~{est:.0f} s > {budget_s:.0f} s"))
            else:
                if budget_s is not None:  # an overrunning variant ends as "timeout" before the 600 s device limit
                    v = dataclasses.replace(v, timeout_s=min(v.timeout_s or 1e9, max(60.0, budget_s + 25 - elapsed)))
                results += harness.run_benchmark(f"part{i}", [v], repeats=repeats, warmup=warmup, out_dir=Path(parts),
                                                 force_cpu=smoke, plot=None, argv=argv)
                env = env or json.loads((Path(parts) / f"part{i}.json").read_text(encoding="utf-8"))["env"]
            merge_graph_counts(results, watch_dir, warmup)
            last = i == len(vs) - 1
            harness.write_reports(bench, results, env, out_dir=out_dir, plot="time_ms" if last else None,
                                  settings=settings)
            write_report((out_dir / f"{bench}_summary.md"), summary(results) + "\n")
            print(f"[{time.perf_counter() - start:.0f} s] {v.name}: {results[-1].get('status')} "
                  f"{results[-1].get('time_ms') or ''}", file=sys.stderr, flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the summary table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="a fixed variant set with its own repeats and time budget (see above)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=None)
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per variant (default 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls before timing (default 1)")
    parser.add_argument("--cap-gb", type=float, default=None, help="VRAM cap for oom_fallback (GiB)")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help=f"skip variants that would end past this (presets: {PRESET_BUDGET_S:g}; 0 = no limit)")
    parser.add_argument("--smoke", action="store_true", help="tiny models, 64x64(x5), on the CPU")
    parser.add_argument("--out-dir", "--out", type=Path, default=None,
                        help="report folder (default benchmarks/results, or a temp folder with --smoke)")
    args = parser.parse_args(argv)
    if args.preset and args.variants:
        parser.error("--preset and --variants are exclusive")
    names = PRESETS[args.preset] if args.preset else (args.variants or list(VARIANTS))
    if args.preset:
        bench = f"bench_compile_{args.preset}"
    else:
        bench = "bench_compile" if names == list(VARIANTS) else "bench_compile_partial"
    if args.smoke:
        bench += "_smoke"
        names = [n for n in names if n != "oom_fallback"]  # needs a GPU
    repeats, warmup = PRESET_TIMING.get(args.preset or "", (3, 1))
    repeats = args.repeats if args.repeats is not None else repeats
    warmup = args.warmup if args.warmup is not None else warmup
    budget = args.time_budget_s if args.time_budget_s is not None else \
        (PRESET_BUDGET_S if args.preset and not args.smoke else 0)  # the estimates are GPU seconds
    out_dir = args.out_dir or (Path(tempfile.gettempdir()) / "lowvram_dit_bench_smoke" if args.smoke
                               else harness.RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.preset and not args.smoke:
        print(f"{bench}: {len(names)} variants, estimated {sum(EST_WALL_S.get(n, DEFAULT_EST_S) for n in names):.0f} s"
              f" on an H200; reports in {out_dir}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_compile_graphs_") as watch:
        results = run(bench, variants(names, args.smoke, args.cap_gb, Path(watch),
                                      timeout_s=300 if args.preset else 1800),
                      repeats=repeats, warmup=warmup, out_dir=out_dir, smoke=args.smoke,
                      argv=harness.command_argv(MODULE, argv), watch_dir=Path(watch),
                      budget_s=budget or None)
    print(summary(results))
    print(f"reports: {out_dir / bench}.md, {bench}_summary.md", file=sys.stderr)
    return 0 if any(r.get("status") == "ok" for r in results) else 1

