"""Where a Wan 14B block's fp8 linears spend their time, against native ComfyUI's `fp8_e4m3fn_fast`.

    python -m comfyui_lowvram_dit.benchmarks.profile_fp8_linear [--out-dir DIR] [--repeats N]

One Wan 2.2 14B block at 832x480x81 (32,760 tokens): self-attention q/k/v (one shared input) and o, cross-attention
q and o, FFN up and down (cross-attention k/v run on 512 text tokens and are left out). For each variant the whole
set of linears runs back to back; reported per block and split into the GEMM and the activation quantization:

- native `fp8_e4m3fn_fast` as ComfyUI 0.33 runs it (comfy/ops.py fp8_linear + comfy-kitchen's handler): the input
  clamped in place to +-448 and cast, the bf16 weight cast to fp8 without a scale, unit scales, `torch._scaled_mm`;
- the pack's per-token (row-wise) and per-call (tensor-wise) activation scales (`kernels/fp8.py`);
- a candidate measured here only: delayed per-tensor activation scaling (the scale of a call is the largest amax of
  the earlier calls, the current amax is recorded in the same pass; Transformer Engine's recipe), with q/k/v
  quantizing their shared input once;
- the GEMM alone on each variant's operands, with the SM clock and board power sampled by nvidia-smi while it
  runs, because the same cuBLASLt kernel runs at different speeds on different data.
Errors are relative Frobenius errors against an fp32 GEMM of the bf16 operands on the first 2,048 rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

try:  # CUDA torch ships Triton; the report code below also imports on CPU-only installs
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

from comfyui_lowvram_dit.benchmarks import harness
from comfyui_lowvram_dit.benchmarks.bench_fp8_gemm import make_operands
from comfyui_lowvram_dit.kernels import fp8
from comfyui_lowvram_dit.checkpoints.safe_write import write_report

TOKENS = 32_760  # Wan 14B, 832x480x81: 21 latent frames x 30 x 52 patches
# (name, in_features, out_features, linears sharing one input)
BLOCK = (("self_attn.q/k/v", 5120, 5120, 3), ("self_attn.o", 5120, 5120, 1), ("cross_attn.q", 5120, 5120, 1),
         ("cross_attn.o", 5120, 5120, 1), ("ffn.0", 5120, 13824, 1), ("ffn.2", 13824, 5120, 1))
ERR_ROWS = 2048
FP8 = torch.float8_e4m3fn


def say(msg: str) -> None:
    print(msg, flush=True)


# ---- the delayed-scaling candidate (measured here, not used by the pack) -------------------------------------
def _jit(fn):  # noqa: ANN001, ANN202 - triton.jit where Triton is installed
    return triton.jit(fn) if triton is not None else fn


@_jit
def _quant_delayed_kernel(x_ptr, q_ptr, state_ptr, s_ptr, N, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Cast with the scale from state[0] (largest amax so far; 0 = none yet -> scale 1), atomically record this
    call's amax in state[1]. Grid-stride over ITERS blocks per program to keep the atomics few."""
    pid = tl.program_id(0)
    prev = tl.load(state_ptr)
    scale = tl.where(prev > 0, tl.maximum(tl.math.div_rn(prev, 448.0), 1.1754943508222875e-38), 1.0)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        offs = (pid.to(tl.int64) * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
        q = tl.clamp(tl.math.div_rn(v, scale), -448.0, 448.0)
        tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=offs < N)
    tl.atomic_max(state_ptr + 1, tl.max(amax, axis=0))
    if pid == 0:
        tl.store(s_ptr, scale)


@_jit
def _fold_kernel(state_ptr):
    """state[0] = max(state[0], state[1]): the next call scales with every amax seen so far."""
    tl.store(state_ptr, tl.maximum(tl.load(state_ptr), tl.load(state_ptr + 1)))


def quantize_delayed(x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (q, scale 0-dim) with the delayed scale in ``state`` (2 fp32: history amax, this call's amax)."""
    q = torch.empty_like(x, dtype=FP8)
    s = torch.empty((), dtype=torch.float32, device=x.device)
    n, block, iters = x.numel(), 4096, 8
    _quant_delayed_kernel[(triton.cdiv(n, block * iters),)](x, q, state, s, n, BLOCK=block, ITERS=iters)
    _fold_kernel[(1,)](state)
    return q, s


# ---- operands and variants ----------------------------------------------------------------------------------
def make_block(device: torch.device) -> list[dict]:
    """Per input group: bf16 activation, bf16 weights and biases, and each variant's prepared weights."""
    groups = []
    for i, (name, k, n, count) in enumerate(BLOCK):
        x, _, _ = make_operands(TOKENS, k, n, seed=100 + i)
        ws, bs = [], []
        for j in range(count):
            _, w, b = make_operands(8, k, n, seed=200 + 10 * i + j)
            ws.append(w)
            bs.append(b)
        groups.append({"name": name, "x": x, "w": ws, "b": bs,
                       "native_w": [w.to(FP8) for w in ws],  # ComfyUI casts the bf16 weight without a scale
                       "ours_w": [fp8.quantize_per_tensor(w) for w in ws],
                       "state": torch.zeros(2, dtype=torch.float32, device=device)})
    return groups


def native_linear(g: dict, j: int, one: torch.Tensor) -> torch.Tensor:
    x = torch.clamp(g["x"], min=-448, max=448, out=g["x"])  # in place, as comfy/ops.py fp8_linear
    xq = x.to(FP8).contiguous()
    return torch._scaled_mm(xq, g["native_w"][j].t(), scale_a=one, scale_b=one, bias=g["b"][j],
                            out_dtype=torch.bfloat16)


def ours_linear(g: dict, j: int, path: str) -> torch.Tensor:
    q, s = g["ours_w"][j]
    return fp8.fp8_linear(g["x"], q, s, g["b"][j], path=path)


def delayed_group(g: dict, shared: bool) -> list[torch.Tensor]:
    outs, xq, xs = [], None, None
    for j, (q, s) in enumerate(g["ours_w"]):
        if xq is None or not shared:
            xq, xs = quantize_delayed(g["x"], g["state"])
        outs.append(torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s, bias=g["b"][j], out_dtype=torch.bfloat16))
    return outs


def block_variants(groups: list[dict], device: torch.device) -> dict[str, Callable[[], list[torch.Tensor]]]:
    one = torch.ones((), device=device)
    every = [(g, j) for g in groups for j in range(len(g["w"]))]
    return {
        "bf16 F.linear": lambda: [F.linear(g["x"], g["w"][j], g["b"][j]) for g, j in every],
        "native fp8_e4m3fn_fast": lambda: [native_linear(g, j, one) for g, j in every],
        "pack per-token scales (row-wise)": lambda: [ours_linear(g, j, "scaled_mm_rowwise") for g, j in every],
        "pack per-call scale (tensor-wise)": lambda: [ours_linear(g, j, "scaled_mm_tensorwise") for g, j in every],
        "candidate delayed scale": lambda: [y for g in groups for y in delayed_group(g, shared=False)],
        "candidate delayed scale, q/k/v quantized once": lambda: [y for g in groups for y in delayed_group(g, True)],
    }


def gemm_only_variants(groups: list[dict], device: torch.device) -> dict[str, Callable[[], list[torch.Tensor]]]:
    """The GEMMs alone, on operands quantized beforehand the way each variant quantizes them."""
    one = torch.ones((), device=device)
    native_x = [g["x"].clamp(-448, 448).to(FP8) for g in groups]
    tensor_x = [fp8.quantize_activation(g["x"], "tensor") for g in groups]
    row_x = [fp8.quantize_activation(g["x"], "row") for g in groups]

    def native() -> list[torch.Tensor]:
        return [torch._scaled_mm(native_x[i], w.t(), scale_a=one, scale_b=one, bias=g["b"][j],
                                 out_dtype=torch.bfloat16)
                for i, g in enumerate(groups) for j, w in enumerate(g["native_w"])]

    def scaled(xs: list) -> Callable[[], list[torch.Tensor]]:
        def run() -> list[torch.Tensor]:
            outs = []
            for i, g in enumerate(groups):
                for j, (q, s) in enumerate(g["ours_w"]):
                    sb = s if xs[i][1].dim() == 0 else s.reshape(1, 1).expand(1, q.shape[0]).contiguous()
                    outs.append(torch._scaled_mm(xs[i][0], q.t(), scale_a=xs[i][1], scale_b=sb, bias=g["b"][j],
                                                 out_dtype=torch.bfloat16))
            return outs
        return run

    return {"GEMMs only, native operands (unscaled weight)": native,
            "GEMMs only, pack operands, per-tensor scales": scaled(tensor_x),
            "GEMMs only, pack operands, row-wise scales": scaled(row_x)}


def operand_ab(groups: list[dict], device: torch.device, rounds: int, seconds: float) -> list[dict]:
    """The same tensor-wise GEMMs on the four mixes of native / pack weights and activations, in alternating
    rounds (so clock drift and heat fall on every mix alike): which operand makes a GEMM slower."""
    one = torch.ones((), device=device)
    acts = {"native": [(g["x"].clamp(-448, 448).to(FP8), one) for g in groups],
            "pack": [fp8.quantize_activation(g["x"], "tensor") for g in groups]}
    weights = {"native": [[(w, one) for w in g["native_w"]] for g in groups],
               "pack": [list(g["ours_w"]) for g in groups]}

    def run(a: str, w: str) -> Callable[[], list[torch.Tensor]]:
        return lambda: [torch._scaled_mm(acts[a][i][0], q.t(), scale_a=acts[a][i][1], scale_b=s, bias=g["b"][j],
                                         out_dtype=torch.bfloat16)
                        for i, g in enumerate(groups) for j, (q, s) in enumerate(weights[w][i])]

    mixes = [(a, w) for w in ("native", "pack") for a in ("native", "pack")]
    seen: dict[tuple[str, str], list[dict]] = {m: [] for m in mixes}
    for _ in range(rounds):
        for m in mixes:
            seen[m].append(sustained(run(*m), seconds))
    rows = []
    for (a, w), runs in seen.items():
        row = {"activations": a, "weights": w, "rounds": rounds,
               "ms": statistics.median(r["sustained_ms"] for r in runs),
               "sm_clock_mhz": statistics.median(r.get("sm_clock_mhz", 0.0) for r in runs),
               "power_w": statistics.median(r.get("power_w", 0.0) for r in runs)}
        rows.append(row)
        say(f"  GEMMs, {a} activations x {w} weights: {row['ms']:.3f} ms, {row['sm_clock_mhz']} MHz, "
            f"{row['power_w']} W (median of {rounds} alternating rounds)")
    return rows


def quant_only_variants(groups: list[dict]) -> dict[str, Callable[[], object]]:
    """One activation quantization per input group as each variant runs it (q/k/v: native and the pack's paths
    quantize the shared input three times, which the block times include)."""
    return {
        "quantize: native clamp_ + cast": lambda: [torch.clamp(g["x"], -448, 448, out=g["x"]).to(FP8) for g in groups],
        "quantize: pack row-wise (Triton)": lambda: [fp8.quantize_activation(g["x"], "row") for g in groups],
        "quantize: pack tensor-wise (norm + Triton)": lambda: [fp8.quantize_activation(g["x"], "tensor")
                                                               for g in groups],
        "quantize: candidate delayed (Triton)": lambda: [quantize_delayed(g["x"], g["state"]) for g in groups],
    }


# ---- measurements ---------------------------------------------------------------------------------------------
def block_error(groups: list[dict], outs: list[torch.Tensor]) -> float:
    """Relative error of all the block's outputs together against fp32, first ERR_ROWS rows."""
    num = den = 0.0
    it = iter(outs)
    for g in groups:
        for w, b in zip(g["w"], g["b"]):
            ref = F.linear(g["x"][:ERR_ROWS].float(), w.float(), b.float())
            y = next(it)[:ERR_ROWS].float()
            num += float((y - ref).square().sum())
            den += float(ref.square().sum())
    return (num / den) ** 0.5


class SmiSampler:
    """nvidia-smi sampling SM clock (MHz) and board power (W) every 50 ms while a loop runs."""

    def __enter__(self) -> "SmiSampler":
        try:
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                          "-lms", "50"], stdout=subprocess.PIPE, text=True)
        except OSError:
            self.proc = None
        return self

    def __exit__(self, *exc: object) -> None:
        self.samples: list[tuple[float, float]] = []
        if self.proc is None:
            return
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=10)
        for line in out.splitlines():
            try:
                clock, power = (float(v) for v in line.split(","))
                self.samples.append((clock, power))
            except ValueError:
                continue

    def summary(self) -> dict:
        if not self.samples:
            return {}
        tail = self.samples[len(self.samples) // 4:] or self.samples  # skip the ramp-up
        return {"sm_clock_mhz": statistics.median(c for c, _ in tail),
                "power_w": statistics.median(p for _, p in tail), "smi_samples": len(tail)}


def sustained(fn: Callable[[], object], seconds: float) -> dict:
    """Run ``fn`` back to back for ``seconds`` under nvidia-smi sampling; ms per call over that stretch."""
    torch.cuda.synchronize()
    with SmiSampler() as smi:
        t0, calls = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            fn()
            calls += 1
            if calls % 8 == 0:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    return {"sustained_ms": elapsed * 1e3 / calls, **smi.summary()}


def kernel_split(fn: Callable[[], object]) -> dict:
    """CUDA kernel time of one call, by kind: GEMM kernels, everything else (quantization, clamp, fold)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    gemm = other = 0.0
    names: dict[str, float] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if not us or ev.key.startswith(("aten::", "cuda", "Memcpy", "Memset")) and "gemm" not in ev.key.lower():
            continue
        names[ev.key[:90]] = round(us / 1e3, 3)
        if any(t in ev.key.lower() for t in ("gemm", "sm90", "cutlass", "nvjet", "xmma")):
            gemm += us / 1e3
        else:
            other += us / 1e3
    return {"gemm_kernel_ms": round(gemm, 3), "other_kernel_ms": round(other, 3), "kernels": names}


def measure(name: str, fn: Callable[[], object], groups: list[dict] | None, args: argparse.Namespace) -> dict:
    row: dict = {"variant": name}
    out = fn()
    if groups is not None and isinstance(out, list) and len(out) == sum(len(g["w"]) for g in groups):
        row["rel_err_vs_fp32"] = block_error(groups, out)
    del out
    row["time_ms"] = statistics.median(harness.time_fn(fn, torch.device("cuda"), args.repeats, args.warmup))
    row.update(kernel_split(fn))
    row.update(sustained(fn, args.sustain_s))
    say(f"  {name:50s} {row['time_ms']:8.3f} ms  gemm {row['gemm_kernel_ms']:7.3f}  other {row['other_kernel_ms']:6.3f}"
        f"  clock {row.get('sm_clock_mhz', '?')} MHz  {row.get('power_w', '?')} W"
        + (f"  err {row['rel_err_vs_fp32']:.3%}" if "rel_err_vs_fp32" in row else ""))
    return row


def growth_error(groups: list[dict]) -> list[dict]:
    """Delayed scaling's weak spot: a call whose amax exceeds every earlier one saturates. Calibrate on x, then run
    on 1.25 x (and 2 x); error against fp32 next to the per-call (tensor-wise) scale on the same input."""
    rows = []
    for factor in (1.25, 2.0):
        num = {"delayed": 0.0, "tensorwise": 0.0}
        den, saturated, total = 0.0, 0, 0
        for g in groups:
            state = torch.zeros(2, dtype=torch.float32, device=g["x"].device)
            quantize_delayed(g["x"], state)  # calibration call
            x2 = g["x"][:ERR_ROWS] * factor
            xq, xs = quantize_delayed(x2, state)
            saturated += int((xq.float().abs() >= 448).sum())
            total += xq.numel()
            for w, b, (q, s) in zip(g["w"], g["b"], g["ours_w"]):
                ref = F.linear(x2.float(), w.float(), b.float())
                y_d = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s, bias=b, out_dtype=torch.bfloat16)
                y_t = fp8.fp8_linear(x2, q, s, b, path="scaled_mm_tensorwise")
                num["delayed"] += float((y_d.float() - ref).square().sum())
                num["tensorwise"] += float((y_t.float() - ref).square().sum())
                den += float(ref.square().sum())
        rows.append({"amax_growth": factor, "delayed_rel_err": (num["delayed"] / den) ** 0.5,
                     "tensorwise_rel_err": (num["tensorwise"] / den) ** 0.5,
                     "saturated_fraction": saturated / total})
        say(f"  input grown {factor}x after calibration: delayed err {rows[-1]['delayed_rel_err']:.3%}, per-call "
            f"scale {rows[-1]['tensorwise_rel_err']:.3%}, saturated {rows[-1]['saturated_fraction']:.2e}")
    return rows


def summarize(rows: list[dict]) -> list[str]:
    by = {r["variant"]: r for r in rows}
    native = by["native fp8_e4m3fn_fast"]["time_ms"]
    lines = [f"{name}: {r['time_ms']:.3f} ms per block = {native / r['time_ms']:.3f}x against the native "
             f"fp8_e4m3fn_fast row ({native:.3f} ms)" for name, r in by.items() if not name.startswith("quantize")]
    gn = by.get("GEMMs only, native operands (unscaled weight)")
    gp = by.get("GEMMs only, pack operands, per-tensor scales")
    if gn and gp:
        lines.append(f"same GEMMs, native's unscaled operands vs the pack's scaled ones: {gn['time_ms']:.3f} vs "
                     f"{gp['time_ms']:.3f} ms ({gp['time_ms'] / gn['time_ms']:.3f}x); sustained SM clock "
                     f"{gn.get('sm_clock_mhz')} vs {gp.get('sm_clock_mhz')} MHz, power {gn.get('power_w')} vs "
                     f"{gp.get('power_w')} W")
    return lines


def markdown(rows: list[dict], growth: list[dict], ab: list[dict], env: dict, summary: list[str]) -> str:
    head = ["# profile_fp8_linear: a Wan 14B block's fp8 linears against native fp8_e4m3fn_fast", ""]
    head += [f"- {k}: {env.get(k)}" for k in ("device_name", "torch", "triton", "comfyui_version", "git_sha",
                                               "timestamp")]
    head += [f"- command: `{env.get('command')}`",
             f"- one block = {', '.join(f'{n} {k}->{o}' + (f' x{c}' if c > 1 else '') for n, k, o, c in BLOCK)} "
             f"at {TOKENS} tokens; ms = median CUDA-event time of one block; gemm / other = CUDA kernel time by "
             "kind from torch.profiler; clock and power = nvidia-smi medians while the variant runs back to back", ""]
    head += ["| variant | ms / block | vs native fp8_fast | GEMM kernels ms | other kernels ms | sustained ms | "
             "SM clock MHz | power W | rel. err vs fp32 |", "|---|---|---|---|---|---|---|---|---|"]
    native = next(r["time_ms"] for r in rows if r["variant"] == "native fp8_e4m3fn_fast")
    for r in rows:
        err = f"{r['rel_err_vs_fp32']:.3%}" if "rel_err_vs_fp32" in r else ""
        head.append(f"| {r['variant']} | {r['time_ms']:.3f} | {native / r['time_ms']:.3f}x | {r['gemm_kernel_ms']} | "
                    f"{r['other_kernel_ms']} | {r['sustained_ms']:.3f} | {r.get('sm_clock_mhz', '')} | "
                    f"{r.get('power_w', '')} | {err} |")
    head += ["", "## Delayed scaling when a call's amax grows past every earlier call", "",
             "| amax growth | delayed rel. err | per-call scale rel. err | saturated fraction |", "|---|---|---|---|"]
    head += [f"| {g['amax_growth']}x | {g['delayed_rel_err']:.3%} | {g['tensorwise_rel_err']:.3%} | "
             f"{g['saturated_fraction']:.2e} |" for g in growth]
    head += ["", "## Same GEMMs, operands mixed (alternating rounds, sustained)", "",
             "| activations | weights | ms / block | vs native x native | SM clock MHz | power W |", "|---|---|---|---|---|---|"]
    base = next((r["ms"] for r in ab if r["activations"] == r["weights"] == "native"), None)
    head += [f"| {r['activations']} | {r['weights']} | {r['ms']:.3f} | {r['ms'] / base:.3f}x | {r['sm_clock_mhz']} | "
             f"{r['power_w']} |" for r in ab if base]
    return "\n".join(head + ["", "## Summary", ""] + [f"- {s}" for s in summary]) + "\n"


def write_plot(path: Path, rows: list[dict], env: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in rows if not r["variant"].startswith("quantize")]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(rows) + 1.5))
    names = [r["variant"] for r in rows]
    ax.barh(names, [r["gemm_kernel_ms"] for r in rows], label="GEMM kernels")
    ax.barh(names, [r["other_kernel_ms"] for r in rows], left=[r["gemm_kernel_ms"] for r in rows],
            label="other kernels (quantization)")
    ax.invert_yaxis()
    ax.set_xlabel("ms per Wan 14B block (32,760 tokens), profiler kernel time")
    ax.set_title(f"fp8 linears vs native fp8_e4m3fn_fast — {env.get('device_name')}, torch {env.get('torch')}",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--sustain-s", type=float, default=3.0, help="seconds of back-to-back calls per variant")
    parser.add_argument("--ab-rounds", type=int, default=4, help="alternating rounds of the operand mixes")
    parser.add_argument("--out-dir", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or triton is None:
        say("profile_fp8_linear needs a CUDA GPU and Triton")
        return 2
    device = torch.device("cuda")
    env = harness.gpu_script_environment("profile_fp8_linear", argv, device)
    say(f"{env.get('device_name')} torch {torch.__version__} triton {env['triton']}")
    groups = make_block(device)
    for g in groups:  # the delayed candidate runs in its steady state: one calibration call first
        quantize_delayed(g["x"], g["state"])
    rows = [measure(n, fn, groups, args) for n, fn in block_variants(groups, device).items()]
    rows += [measure(n, fn, None, args) for n, fn in gemm_only_variants(groups, device).items()]
    rows += [measure(n, fn, None, args) for n, fn in quant_only_variants(groups).items()]
    growth = growth_error(groups)
    ab = operand_ab(groups, device, args.ab_rounds, args.sustain_s / 2)
    summary = summarize(rows)
    for line in summary:
        say(line)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / "profile_fp8_linear"
    write_report(stem.with_suffix(".json"), json.dumps({"env": env, "rows": rows, "growth": growth, "operand_ab": ab,
                                                     "summary": summary}, indent=1, default=str))
    write_report(stem.with_suffix(".md"), markdown(rows, growth, ab, env, summary))
    write_plot(stem.with_suffix(".png"), rows, env)
    say(f"wrote {stem}.json, .md and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
