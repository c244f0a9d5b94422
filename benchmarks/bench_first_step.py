"""Scenario ``first_step``: the first compiled sampler step of Wan 14B split into its parts (README).

``dynamo_s`` is Dynamo's tracing (``entire_frame_compile_time_s - backend_compile_time_s`` per frame);
``backend_s`` AOTAutograd + Inductor, of it ``inductor_s``; ``attention_s`` the selector's first decisions, of it
``autotune_s``; ``fp8_choice_s`` the fp8 scale chooser; ``triton_jit_s`` Triton compiles in this process (it
overlaps the two before, so it is not added into ``rest_s``); ``rest_s`` the first step minus the others.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any
from comfyui_lowvram_dit.checkpoints.safe_write import TORCH_ARCHIVE, starts_with, write_atomic, write_report

from comfyui_lowvram_dit.benchmarks import harness

MODULE = "comfyui_lowvram_dit.benchmarks.bench_first_step"
BENCH = "bench_first_step"
RESOLUTION = (832, 480, 81)
SMOKE_RESOLUTION = (64, 64, 5)
FIRST_TIMESTEP = 999.0
STEADY_TIMESTEPS = (937.5, 833.3, 666.7, 500.0, 375.0, 250.0)  # a new sigma on every step
# name -> (path, compiled, cache group): warm variants reuse the caches their group's earlier variant left
VARIANTS: dict[str, tuple[str, bool, str]] = {
    "old_cold": ("old", True, "old"),
    "new_cold": ("new", True, "new"),
    "new_warm": ("new", True, "new"),
    "eager": ("new", False, "eager"),
    "old_warm": ("old", True, "old"),
    "nowarm_cold": ("new_nowarm", True, "nowarm"),
}
DEFAULT_VARIANTS = ["old_cold", "new_cold", "new_warm", "eager"]
# Wall seconds per variant on an H100 (child start, model build ~35 s, first step, steady steps): the budget check.
EST_WALL_S = {"old_cold": 150.0, "new_cold": 115.0, "new_warm": 80.0, "eager": 75.0, "old_warm": 100.0,
              "nowarm_cold": 120.0}
BUDGET_S = 450.0  # the default set must end inside 8 minutes
# an absolute path (two or more components, not glued to a word: 'GPU/dtype/head' stays)
_PATH_RE = re.compile(r"(?<![\w.])(?:[A-Za-z]:)?(?:[\\/][^\s\\/:'\"()<>]+)+[\\/]([^\s\\/:'\"()<>]+)")


def public_text(text: str) -> str:
    """``text`` without machine paths: every absolute path shortened to its last component."""
    return _PATH_RE.sub(r"\1", text)


# ------------------------------------------------------------------------------------------------- child side


def use_path(path: str) -> None:
    """'old': Dynamo traces the selector and the fp8 linear, block 0 keeps its transposed input; 'new': as shipped;
    'new_nowarm': as shipped without the 8-bit kernels compiled ahead (kernels.attention_int8.start_warmup)."""
    from ..kernels import compile as cmp
    from ..kernels import opaque_ops

    if path == "old":
        opaque_ops.OPAQUE_UNDER_COMPILE = False
        cmp.contiguous_hidden_states = lambda module, args: None
    elif path == "new_nowarm":  # as shipped, but the Attention node compiles nothing ahead
        from ..kernels import attention_int8

        attention_int8.start_warmup = lambda *args, **kwargs: None
    elif path != "new":
        raise ValueError(f"bench_first_step: path {path!r} is not 'old', 'new' or 'new_nowarm'")


class DecisionTimer:
    """Seconds spent inside the pack's run-time decisions and in Triton compiles of this process, by name."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: Counter = Counter()
        self.triton: dict[str, list[float]] = {}  # kernel name -> [compiles, cache hits, compile seconds]
        self.missing: list[str] = []

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        """Time ``owner.attr`` (an instance attribute shadows the method); Dynamo never traces the wrapper."""
        import torch

        fn = getattr(owner, attr)
        self.seconds[name] += 0.0  # reported as 0 when never called

        @torch.compiler.disable
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.cuda:
                    torch.cuda.synchronize()
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1

        setattr(owner, attr, timed)

    def install(self) -> None:
        """Wrap the selector's decisions, the scale chooser's timing, the 8-bit kernel's autotuner; listen to Triton."""
        from ..kernels import attention, attention_int8, fp8_choice

        self.wrap(attention.SELECTOR, "_decide_and_run", "attention")
        self.wrap(fp8_choice.CHOOSER, "_decide", "fp8_choice")
        tuner = attention_int8._autotuned_kernel() if attention_int8._triton_module() is not None else None
        if tuner is not None and hasattr(tuner, "_bench"):
            self.wrap(tuner, "_bench", "autotune")
        else:
            self.missing.append("autotune (no Triton autotuner with _bench here)")
        try:
            from triton import knobs

            knobs.compilation.listener = self._triton_compiled
        except (ImportError, AttributeError):  # Triton < 3.4 has no compilation listener
            self.missing.append("triton_jit (no triton.knobs.compilation.listener)")

    def _triton_compiled(self, *, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool) -> None:
        name = str(metadata.get("name", "?")) if isinstance(metadata, dict) else "?"
        entry = self.triton.setdefault(name, [0, 0, 0.0])
        if cache_hit:
            entry[1] += 1
        else:
            entry[0] += 1
            entry[2] += float(getattr(times, "total", 0)) / 1e6

    def snapshot(self) -> dict:
        """Seconds and calls so far, plus Triton compiles (totals and the costliest kernels)."""
        top = sorted(self.triton.items(), key=lambda kv: -kv[1][2])[:8]
        return {**{f"{k}_s": round(v, 3) for k, v in self.seconds.items()},
                **{f"{k}_calls": v for k, v in self.calls.items()},
                "triton_jit_s": round(sum(e[2] for e in self.triton.values()), 3),
                "triton_compiles": int(sum(e[0] for e in self.triton.values())),
                "triton_cache_hits": int(sum(e[1] for e in self.triton.values())),
                "triton_top": {k: {"compiles": int(e[0]), "s": round(e[2], 3)} for k, e in top},
                "not_measured": list(self.missing)}


def dynamo_split() -> dict:
    """Dynamo and backend compile time over every frame compiled so far, per frame and summed; graphs and breaks."""
    import torch._dynamo.utils as du

    frames, sums = [], defaultdict(float)
    for m in du.get_compilation_metrics():
        d = dataclasses.asdict(m) if dataclasses.is_dataclass(m) else dict(vars(m))
        for key, value in d.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key.endswith(("_s", "_us", "_ms")) \
                    and not key.startswith(("start_time", "end_time")):
                sums[key] += float(value)
        entire, backend = d.get("entire_frame_compile_time_s") or 0.0, d.get("backend_compile_time_s") or 0.0
        frames.append({"frame": f"{d.get('co_name')} ({Path(str(d.get('co_filename'))).name}:"
                                f"{d.get('co_firstlineno')})",
                       "compile_s": round(entire, 3), "dynamo_s": round(entire - backend, 3),
                       "backend_s": round(backend, 3), "ops": d.get("graph_op_count"),
                       "recompile_reason": public_text(str(d.get("recompile_reason") or ""))[:300],
                       "fail": public_text(str(d.get("fail_type") or ""))[:200]})
    breaks = du.counters["graph_break"]
    return {"frames": len(frames), "dynamo_s": round(sum(f["dynamo_s"] for f in frames), 3),
            "backend_s": round(sum(f["backend_s"] for f in frames), 3),
            "inductor_s": round(sums.get("inductor_compile_time_s", 0.0), 3),
            "codegen_s": round(sums.get("code_gen_time_s", 0.0), 3),
            "graphs": int(du.counters["stats"]["unique_graphs"]), "graph_breaks": int(sum(breaks.values())),
            "break_reasons": {public_text(str(k))[:240]: int(v) for k, v in breaks.most_common(6)},
            "per_frame": frames[:40], "metric_sums": {k: round(v, 4) for k, v in sorted(sums.items())}}


def _step(ctx: harness.BenchContext, model: Any, inputs: dict, timestep: float) -> tuple[Any, float, float]:
    """One sampler step's forward at ``timestep``: (output, wall s, GPU ms by CUDA events or None on CPU)."""
    import torch

    from . import comfy_native

    inputs["timestep"] = torch.full_like(inputs["timestep"], timestep)
    ctx.sync()
    cuda = ctx.device.type == "cuda"
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    out = comfy_native.forward(model, inputs, via="apply_model")
    if cuda:
        end.record()
    ctx.sync()
    return out, time.perf_counter() - t0, start.elapsed_time(end) if cuda else None


def first_step_case(ctx: harness.BenchContext, path: str, compiled: bool, size: str = "full", width: int = 832,
                    height: int = 480, frames: int = 81, batch: int = 2, steps: int = 3, mode: str = "default",
                    backend: str = "inductor", save_output: str | None = None, caches: str = "") -> dict:
    """Harness target: build the model, run and split its first step, then time ``steps`` steady steps."""
    import torch
    import torch._dynamo.utils as du

    from ..kernels import attention
    from ..kernels.compile import unique_graphs
    from . import comfy_native
    from .bench_compile import _build, _compiled

    use_path(path)
    if hasattr(du, "set_compilation_metrics_limit"):
        du.set_compilation_metrics_limit(4096)  # keep every frame of the first step (default 64)
    t0 = time.perf_counter()
    patcher, _ = _build(ctx, size, None, width, height, frames, fp8="per_tensor", attention="lowvram 8-bit")
    inputs = comfy_native.wan_inputs(patcher, width, height, frames, batch=batch, timestep=FIRST_TIMESTEP)
    model = _compiled(patcher, "ours", mode, "blocks", backend) if compiled else patcher
    build_s = time.perf_counter() - t0
    timer = DecisionTimer(ctx.device.type == "cuda")
    timer.install()
    du.clear_compilation_metrics()
    du.counters.clear()
    out, first_s, _ = _step(ctx, model, inputs, FIRST_TIMESTEP)
    if tuple(out.shape) != tuple(inputs["x"].shape) or not bool(torch.isfinite(out).all()):
        raise RuntimeError(f"first step gave shape {tuple(out.shape)} or non-finite values")
    if save_output:
        ref = out.detach().to("cpu", torch.bfloat16).clone()
        write_atomic(save_output, lambda f: torch.save(ref, f), starts_with(TORCH_ARCHIVE, 4))
    del out
    split, decided = dynamo_split(), timer.snapshot()
    accounted = split["dynamo_s"] + split["backend_s"] + decided.get("attention_s", 0.0) + \
        decided.get("fp8_choice_s", 0.0)
    graphs_after_first, steady = unique_graphs(), []
    for i in range(steps):
        _, wall, gpu_ms = _step(ctx, model, inputs, STEADY_TIMESTEPS[i % len(STEADY_TIMESTEPS)])
        steady.append(round(gpu_ms / 1e3 if gpu_ms is not None else wall, 3))
    regions = model.attachments.get("lowvram_dit.torch_compile") if compiled else None
    return {"path": path, "compiled": compiled, "caches": caches, "mode": mode if compiled else "eager",
            "backend": backend if compiled else "", "resolution": f"{width}x{height}x{frames}", "batch": batch,
            "tokens": inputs["tokens"], "build_s": round(build_s, 2), "first_step_s": round(first_s, 2),
            **split, **decided, "rest_s": round(first_s - accounted, 2),
            "steady_s": steady, "steady_median_s": sorted(steady)[len(steady) // 2] if steady else None,
            "new_graphs_in_steady_steps": unique_graphs() - graphs_after_first,
            "mode_in_use": regions.status() if regions is not None else "eager",
            "attention_choices": [public_text(line)[:300] for line in attention.SELECTOR.report()]}


# ------------------------------------------------------------------------------------------------ parent side


def variants(names: list[str], smoke: bool, outputs: Path, steps: int) -> list[harness.Variant]:
    """The selected variants with their model size, resolution and output file."""
    out = []
    for name in names:
        path, compiled, _ = VARIANTS[name]
        width, height, frames = SMOKE_RESOLUTION if smoke else RESOLUTION
        kwargs = {"path": path, "compiled": compiled, "size": "tiny" if smoke else "full", "width": width,
                  "height": height, "frames": frames, "steps": steps, "save_output": str(outputs / f"{name}.pt")}
        if smoke:
            kwargs["backend"] = "cudagraphs"  # inductor on 2 CPU cores takes minutes; this checks the plumbing
        out.append(harness.Variant(name, f"{MODULE}:first_step_case", kwargs))
    return out


def compare_outputs(results: list[dict], outputs: Path, reference: str = "eager") -> None:
    """Add each variant's first-step output error vs ``reference`` (and old vs new) to its metrics, in place."""
    import torch

    def load(name: str) -> Any:
        f = outputs / f"{name}.pt"
        return torch.load(f).float() if f.is_file() else None

    ref = load(reference)
    for r in results:
        out = load(r["name"]) if r.get("status") == "ok" else None
        if out is None:
            continue
        for label, other in ((reference, ref), ("old_cold", load("old_cold"))):
            if other is None or label == r["name"] or other.shape != out.shape:
                continue
            err = float((out - other).norm() / other.norm().clamp_min(1e-30))
            r["metrics"][f"vs_{label}"] = {"max_abs": float((out - other).abs().max()), "rel_error": err}


def _cell(m: dict, key: str, digits: int = 1) -> str:
    value = m.get(key)
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "—"


def summary(results: list[dict], env: dict) -> str:
    """Markdown: the split table, then per variant its breaks, recompiles and slowest frames."""
    lines = [f"# {BENCH}: the first compiled step, split", ""]
    lines += [f"- {k}: {env[k]}" for k in ("device_name", "torch", "comfyui_version", "git_sha", "timestamp")
              if env.get(k)]
    lines += [f"- command: `{env.get('command', '')}`", "- seconds unless named; decisions include their CUDA syncs; Triton JIT overlaps the "
              "decisions (the 8-bit kernel compiles while it autotunes); rest = first step - Dynamo - "
              "AOT+Inductor - attention decisions - fp8 choice",
              "", "| variant | caches | first step | Dynamo | AOT+Inductor | of it Inductor | attention decisions | "
              "of it autotune | fp8 choice | Triton JIT here | rest | graphs | breaks | steady s/step | new graphs "
              "in steady steps | rel. error vs eager |", "|" + "---|" * 16]
    for r in results:
        m = r.get("metrics") or {}
        if r.get("status") != "ok" or "first_step_s" not in m:
            why = m.get("skipped") or ((r.get("error") or "").splitlines() or [""])[0][:160]
            lines.append(f"| {r['name']} | {r.get('status')}: {why} |" + " |" * 14)
            continue
        err = (m.get("vs_eager") or {}).get("rel_error")
        lines.append(f"| {r['name']} | {m.get('caches')} | {_cell(m, 'first_step_s')} | {_cell(m, 'dynamo_s')} | "
                     f"{_cell(m, 'backend_s')} | {_cell(m, 'inductor_s')} | {_cell(m, 'attention_s')} | "
                     f"{_cell(m, 'autotune_s')} | {_cell(m, 'fp8_choice_s')} | {_cell(m, 'triton_jit_s')} | "
                     f"{_cell(m, 'rest_s')} | {m.get('graphs', '—')} | {m.get('graph_breaks', '—')} | "
                     f"{_cell(m, 'steady_median_s', 3)} | {m.get('new_graphs_in_steady_steps', '—')} | "
                     f"{f'{err:.2e}' if err is not None else '—'} |")
    for r in results:
        m = r.get("metrics") or {}
        if "first_step_s" in m:
            lines += ["", *_details(r["name"], m)]
    return "\n".join(lines) + "\n"


def _details(name: str, m: dict) -> list[str]:
    lines = [f"## {name}", "", f"- {m.get('mode_in_use')}; build {m.get('build_s')} s; steady steps {m.get('steady_s')}",
             f"- Triton compiles in this process: {m.get('triton_compiles')} ({m.get('triton_jit_s')} s), "
             f"cache hits {m.get('triton_cache_hits')}; costliest: {json.dumps(m.get('triton_top', {}))}"]
    if m.get("not_measured"):
        lines.append(f"- not measured here: {', '.join(m['not_measured'])}")
    for label in ("vs_eager", "vs_old_cold"):
        if m.get(label):
            lines.append(f"- first-step output {label}: max |diff| {m[label]['max_abs']:.3g}, "
                         f"relative error {m[label]['rel_error']:.3g}")
    for reason, n in (m.get("break_reasons") or {}).items():
        lines.append(f"- graph break x{n}: {reason.splitlines()[0] if reason else ''}")
    for choice in m.get("attention_choices") or []:
        lines.append(f"- attention: {choice}")
    frames = m.get("per_frame") or []
    if frames:
        lines += ["", "| frame | compile s | Dynamo s | backend s | ops | recompile reason |", "|---|---|---|---|---|---|"]
        for f in sorted(frames, key=lambda f: -f["compile_s"])[:15]:
            reason = (f["recompile_reason"] or f["fail"] or "").replace("|", "/").replace("\n", " ")[:160]
            lines.append(f"| {f['frame']} | {f['compile_s']} | {f['dynamo_s']} | {f['backend_s']} | {f['ops']} | "
                         f"{reason} |")
    return lines


def _cache_env(group: str, root: Path, used: set[str]) -> tuple[dict[str, str], str]:
    """Cache folders for a variant of ``group``: new ones (cold) the first time, the same ones (warm) later."""
    state = "warm" if group in used else "cold"
    used.add(group)
    return {"TORCHINDUCTOR_CACHE_DIR": str(root / group / "inductor"),
            "TRITON_CACHE_DIR": str(root / group / "triton")}, state


def run(vs: list[harness.Variant], *, out_dir: Path, smoke: bool, argv: list[str], budget_s: float | None,
        caches: Path, outputs: Path) -> list[dict]:
    """Each variant as its own harness run with its cache folders; the reports are rewritten after every variant."""
    results: list[dict] = []
    env: dict = harness.parent_environment(argv)
    used: set[str] = set()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_first_step_parts_") as parts:
        for i, v in enumerate(vs):
            elapsed, est = time.perf_counter() - start, EST_WALL_S.get(v.name, 120.0)
            if budget_s is not None and elapsed + est > budget_s:
                why = f"time budget: {elapsed:.0f} s used + ~{est:.0f} s > {budget_s:.0f} s"
                results.append({"name": v.name, "target": v.target, "kwargs": v.kwargs, "status": "skipped",
                                "error": why, "metrics": {"skipped": why}})
            else:
                cache_env, state = _cache_env(VARIANTS[v.name][2], caches, used)
                v = harness.Variant(v.name, v.target, {**v.kwargs, "caches": state},
                                    timeout_s=None if budget_s is None else max(60.0, budget_s + 25 - elapsed))
                saved = {k: os.environ.get(k) for k in cache_env}
                os.environ.update(cache_env)
                try:
                    results += harness.run_benchmark(f"part{i}", [v], repeats=1, warmup=0, out_dir=Path(parts),
                                                     force_cpu=smoke, plot=None, argv=argv)
                finally:
                    for k, old in saved.items():
                        if old is None:
                            os.environ.pop(k, None)
                        else:
                            os.environ[k] = old
                part_env = json.loads((Path(parts) / f"part{i}.json").read_text(encoding="utf-8"))["env"]
                env.update({k: val for k, val in part_env.items() if k not in env})
            last = results[-1]  # temp folders and the interpreter's path stay out of the report
            last["kwargs"] = {**last["kwargs"], "save_output": Path(last["kwargs"]["save_output"]).name}
            if "child_command" in last:
                last["child_command"] = public_text(last["child_command"])
            compare_outputs(results, outputs)
            for r in results:
                r["first_step_s"] = (r.get("metrics") or {}).get("first_step_s")
            harness.write_reports(BENCH, results, env, out_dir=out_dir, plot="first_step_s" if i == len(vs) - 1
                                  else None, settings={"repeats": 0, "warmup": 0, "fresh_process": True})
            write_report((out_dir / f"{BENCH}_summary.md"), summary(results, env))
            print(f"[{time.perf_counter() - start:.0f} s] {v.name}: {results[-1].get('status')} "
                  f"first step {results[-1].get('first_step_s')}", file=sys.stderr, flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    """Run the variants and print the summary."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=DEFAULT_VARIANTS)
    parser.add_argument("--steps", type=int, default=3, help="steady steps after the first (default 3)")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help=f"skip variants that would end past this (default {BUDGET_S:g}; 0 = no limit)")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 64x64x5, on the CPU")
    parser.add_argument("--out-dir", "--out", type=Path, default=None,
                        help="report folder (default benchmarks/results, or a temp folder with --smoke)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    out_dir = args.out_dir or (Path(tempfile.gettempdir()) / "lowvram_dit_bench_smoke" if args.smoke
                               else harness.RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    budget = args.time_budget_s if args.time_budget_s is not None else (0 if args.smoke else BUDGET_S)
    with tempfile.TemporaryDirectory(prefix="bench_first_step_") as tmp:
        caches, outputs = Path(tmp) / "caches", Path(tmp) / "outputs"
        outputs.mkdir(parents=True)
        results = run(variants(args.variants, args.smoke, outputs, args.steps), out_dir=out_dir, smoke=args.smoke,
                      argv=harness.command_argv(MODULE, argv), budget_s=budget or None,
                      caches=caches, outputs=outputs)
    print((out_dir / f"{BENCH}_summary.md").read_text(encoding="utf-8"))
    print(f"reports: {out_dir / BENCH}.md, {BENCH}_summary.md, {BENCH}.json", file=sys.stderr)
    return 0 if any(r.get("status") == "ok" for r in results) else 1

