"""Scenario ``fp8_gemm``: our fp8 linears (kernels/fp8.py) vs bf16 and native fp8 at Wan 2.2 / Qwen-Image GEMM
shapes, in one process (README). ``--block``: one Wan 14B block's linears in call order, native fp8_e4m3fn_fast
(ComfyUI's own Linear when COMFYUI_PATH imports) vs the pack's default and forced paths, on three activation
families; ``--dry`` runs that on the CPU at tiny widths to exercise the code.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from comfyui_lowvram_dit.benchmarks import harness
from comfyui_lowvram_dit.kernels import fp8, fp8_triton
from comfyui_lowvram_dit.checkpoints.safe_write import write_report

# (M tokens, K in, N out). Tokens: Wan 14B 832x480x81 -> 21x30x52 = 32,760; Wan 5B 1280x704x121 -> 31x22x40 =
# 27,280; Qwen-Image 1328x1328 -> 83x83 = 6,889 image tokens.
SHAPES: dict[str, tuple[int, int, int]] = {
    "wan14b_qkvo": (32760, 5120, 5120),
    "wan14b_ffn_up": (32760, 5120, 13824),
    "wan14b_ffn_down": (32760, 13824, 5120),
    "wan5b_qkvo": (27280, 3072, 3072),
    "wan5b_ffn_up": (27280, 3072, 14336),
    "wan5b_ffn_down": (27280, 14336, 3072),
    "qwen_attn": (6889, 3072, 3072),
    "qwen_mlp_up": (6889, 3072, 12288),
    "qwen_mlp_down": (6889, 12288, 3072),
}
QUICK = ("wan14b_qkvo", "wan14b_ffn_up", "wan14b_ffn_down")
ERR_ROWS = 2048  # error is measured on the first rows only (an fp32 GEMM per variant otherwise dominates)


def say(msg: str) -> None:
    print(msg, flush=True)


def make_operands(m: int, k: int, n: int, seed: int = 0):
    """bf16 activations [M, K] with 4 outlier channels (20-50x), bf16 weight [N, K] with outlier input
    channels (8-20x, one per 512 inputs, as synthetic/checkpoints.py), bf16 bias."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g)
    x[:, torch.randperm(k, device="cuda", generator=g)[:4]] *= torch.tensor([20.0, 30.0, 40.0, 50.0], device="cuda")
    w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
    cols = torch.randperm(k, device="cuda", generator=g)[: max(1, k // 512)]
    w[:, cols] *= 8 + 12 * torch.rand(cols.numel(), device="cuda", generator=g)
    b = 0.02 * torch.randn(n, device="cuda", generator=g)
    return x.bfloat16(), w.bfloat16(), b.bfloat16()


def variants(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> dict[str, object]:
    """name -> zero-arg callable computing x @ w.T + b; a string instead when the GPU/torch cannot run it."""
    cap = torch.cuda.get_device_capability()
    out: dict[str, object] = {"bf16 F.linear": lambda: F.linear(x, w, b)}
    # ComfyUI v0.8 `fp8_e4m3fn_fast` (comfy/ops.py fp8_linear): weight plainly cast, input clamped to ±448 and cast,
    # unit scales, torch._scaled_mm.
    w_cast = w.to(fp8.FP8_DTYPE)
    one = torch.ones((), device="cuda")
    if cap >= (8, 9):
        out["comfy fp8_e4m3fn_fast"] = lambda: torch._scaled_mm(
            x.clamp(-448, 448).to(fp8.FP8_DTYPE), w_cast.t(), scale_a=one, scale_b=one, bias=b, out_dtype=x.dtype)
    else:
        out["comfy fp8_e4m3fn_fast"] = f"needs compute capability >= 8.9, have {cap}"
    qt, st = fp8.quantize_per_tensor(w)
    qb, sb = fp8.quantize_blockwise(w, 128)
    out["weight-only dequant + bf16"] = lambda: fp8.fp8_linear(x, qt, st, b, path="dequantize")
    for name, path, q, s, bs in (("ours per-tensor, row-wise act", "scaled_mm_rowwise", qt, st, None),
                                 ("ours per-tensor, tensor-wise act", "scaled_mm_tensorwise", qt, st, None),
                                 ("ours block-wise 128", "scaled_mm_blockwise", qb, sb, 128)):
        ok = {"scaled_mm_rowwise": cap in ((8, 9), (9, 0)), "scaled_mm_tensorwise": cap >= (8, 9),
              "scaled_mm_blockwise": cap[0] == 9 and fp8.has_blockwise_scaled_mm()}[path]
        if ok:
            out[name] = (lambda q=q, s=s, bs=bs, path=path:
                         fp8.fp8_linear(x, q, s, b, block_size=bs, path=path))
        else:
            out[name] = f"{path} is not available on compute capability {cap} / torch {torch.__version__}"
    return out


def quant_only(x: torch.Tensor) -> dict[str, object]:
    """The fused activation quantizers alone (the part an eager implementation makes expensive)."""
    if not fp8_triton.TRITON_AVAILABLE:
        return {"act quant (torch fallback, row)": lambda: fp8.quantize_rowwise_torch(x)}
    return {"act quant row (Triton)": lambda: fp8_triton.quantize_rowwise(x),
            "act quant 1x128 (Triton)": lambda: fp8_triton.quantize_groupwise(x, 128, 4),
            "act quant tensor (norm + Triton)": lambda: fp8_triton.quantize_tensorwise(x),
            "act quant row (eager torch)": lambda: fp8.quantize_rowwise_torch(x)}


def rel_error(fn, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, full_out: torch.Tensor | None) -> float:
    ref = F.linear(x[:ERR_ROWS].float(), w.float(), b.float())
    y = full_out[:ERR_ROWS] if full_out is not None else fn()[:ERR_ROWS]
    return ((y.float() - ref).norm() / ref.norm()).item()


def bench_shape(name: str, shape: tuple[int, int, int], repeats: int, warmup: int) -> list[dict]:
    m, k, n = shape
    x, w, b = make_operands(m, k, n)
    rows: list[dict] = []
    bf16_ms = None
    for vname, fn in variants(x, w, b).items():
        row = {"shape": name, "M": m, "K": k, "N": n, "variant": vname}
        if isinstance(fn, str):
            rows.append({**row, "status": "skipped", "error": fn})
            continue
        try:
            out = fn()
            err = rel_error(fn, x, w, b, out)
            del out
            times = harness.time_fn(fn, torch.device("cuda"), repeats, warmup)
        except Exception as exc:  # a path this torch/GPU rejects is a result, not a crash
            rows.append({**row, "status": "error", "error": f"{type(exc).__name__}: {exc}"[:300]})
            say(f"  {name:16s} {vname:34s} ERROR {exc!s:.120}")
            continue
        ms = statistics.median(times)
        bf16_ms = bf16_ms or ms
        row.update(status="ok", time_ms=ms, tflops=2 * m * n * k / ms / 1e9, speedup_vs_bf16=bf16_ms / ms,
                   rel_err_vs_fp32=err)
        rows.append(row)
        say(f"  {name:16s} {vname:34s} {ms:8.3f} ms {row['tflops']:7.0f} TFLOP/s {bf16_ms / ms:5.2f}x "
            f"err {err:.4%}")
    for vname, fn in quant_only(x).items():
        times = harness.time_fn(fn, torch.device("cuda"), repeats, warmup)
        rows.append({"shape": name, "M": m, "K": k, "N": n, "variant": vname, "status": "ok",
                     "time_ms": statistics.median(times), "quant_only": True})
        say(f"  {name:16s} {vname:34s} {rows[-1]['time_ms']:8.3f} ms")
    del x, w, b
    torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict], env: dict, summary: list[str]) -> str:
    lines = ["# bench_fp8_gemm", ""]
    lines += harness.env_bullets(env)
    lines += ["- timing: CUDA events, median; bf16 activations with 4 outlier channels, weights with outlier input "
              f"channels, bias; error vs fp32 on the first {ERR_ROWS} rows", "",
              "| shape (M, K -> N) | variant | ms | TFLOP/s | vs bf16 | rel. err vs fp32 |", "|---|---|---|---|---|---|"]
    for r in rows:
        shape = f"{r['shape']} ({r['M']}, {r['K']} -> {r['N']})"
        if r["status"] != "ok":
            lines.append(f"| {shape} | {r['variant']} | {r['status']}: {r.get('error', '')[:120]} | | | |")
        elif r.get("quant_only"):
            lines.append(f"| {shape} | {r['variant']} | {r['time_ms']:.3f} | | | |")
        else:
            lines.append(f"| {shape} | {r['variant']} | {r['time_ms']:.3f} | {r['tflops']:.0f} | "
                         f"{r['speedup_vs_bf16']:.2f}x | {r['rel_err_vs_fp32']:.3%} |")
    return "\n".join(lines + [""] + summary) + "\n"


def summarize(rows: list[dict]) -> list[str]:
    """Geometric-mean speedups per variant and the row-wise vs tensor-wise verdict for PER_TENSOR_DEFAULT_PATH."""
    import math

    by: dict[str, list[dict]] = {}
    for r in rows:
        if r["status"] == "ok" and not r.get("quant_only"):
            by.setdefault(r["variant"], []).append(r)
    out = ["## Summary (geometric mean over shapes)", ""]
    for v, rs in by.items():
        gm = math.exp(sum(math.log(r["speedup_vs_bf16"]) for r in rs) / len(rs))
        err = statistics.mean(r["rel_err_vs_fp32"] for r in rs)
        out.append(f"- {v}: {gm:.2f}x vs bf16, mean rel. err {err:.3%}")
    row, ten = by.get("ours per-tensor, row-wise act"), by.get("ours per-tensor, tensor-wise act")
    if row and ten:
        t_row = sum(r["time_ms"] for r in row)
        t_ten = sum(r["time_ms"] for r in ten)
        faster = "row-wise" if t_row <= t_ten else "tensor-wise"
        out += ["", f"- per-tensor weights: row-wise total {t_row:.2f} ms vs tensor-wise {t_ten:.2f} ms -> "
                f"{faster} is faster; current PER_TENSOR_DEFAULT_PATH = {fp8.PER_TENSOR_DEFAULT_PATH!r}"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Wan 14B shapes only")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out-dir", "--out", type=Path, default=harness.RESULTS)
    parser.add_argument("--block", action="store_true",
                        help="one Wan 14B block's linears: native fp8_e4m3fn_fast vs the pack's paths")
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES),
                        help="--block: activation families (default: all)")
    parser.add_argument("--dry", action="store_true",
                        help="--block on the CPU at tiny widths, 2 rounds: exercises every code path, times nothing")
    args = parser.parse_args(argv)
    if args.dry:
        args.block, args.repeats, args.warmup = True, min(args.repeats, 2), min(args.warmup, 1)
    if args.block:
        return main_block(args, argv)
    if not torch.cuda.is_available():
        say("bench_fp8_gemm needs a CUDA GPU")
        return 2
    env = harness.gpu_script_environment(f"{harness.SUITE}.bench_fp8_gemm", argv, torch.device("cuda"))
    say(f"{env.get('device_name')} torch {torch.__version__} triton {env['triton']}")
    rows: list[dict] = []
    for name in QUICK if args.quick else SHAPES:
        rows += bench_shape(name, SHAPES[name], args.repeats, args.warmup)
    summary = summarize(rows)
    for line in summary:
        say(line)
    stem = "bench_fp8_gemm_quick" if args.quick else "bench_fp8_gemm"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_report((args.out_dir / f"{stem}.json"), json.dumps({"env": env, "rows": rows}, indent=1, default=str))
    write_report((args.out_dir / f"{stem}.md"), markdown(rows, env, summary))
    say(f"wrote {args.out_dir / stem}.json and .md")
    return 0



# ==============================================================================================================
# --block: one Wan 14B block's fp8 linears, native fp8_e4m3fn_fast vs the pack's paths
# ==============================================================================================================

# (name, input, N out, K in): the block's linears that see every video token, in call order
# (comfy/ldm/wan/model.py WanAttentionBlock). cross_attn.k/v see the 512 text tokens only and are left out.
BLOCK_LINEARS: tuple[tuple[str, str, int, int], ...] = (
    ("self_attn.q", "x_self", 5120, 5120), ("self_attn.k", "x_self", 5120, 5120),
    ("self_attn.v", "x_self", 5120, 5120), ("self_attn.o", "x_attn", 5120, 5120),
    ("cross_attn.q", "x_cross", 5120, 5120), ("cross_attn.o", "x_attn", 5120, 5120),
    ("ffn.0", "x_ffn", 13824, 5120), ("ffn.2", "x_gelu", 5120, 13824),
)
SIX = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "ffn.0", "ffn.2")  # the brief's 6-linear subset
BLOCK_TOKENS = 32760  # Wan 14B 832x480x81
FAMILIES = ("ln_mod", "gaussian", "massive")
DRY_DIV = 40  # --dry: widths / 40 (rounded to 16), 64 tokens, on the CPU


def _dims(dry: bool) -> tuple[int, list[tuple[str, str, int, int]]]:
    if not dry:
        return BLOCK_TOKENS, list(BLOCK_LINEARS)
    shrink = lambda d: max(16, (d // DRY_DIV) // 16 * 16)  # noqa: E731
    return 64, [(n, key, shrink(o), shrink(i)) for n, key, o, i in BLOCK_LINEARS]


def block_inputs(family: str, m: int, width: int, ffn: int, device: torch.device, seed: int = 0) -> dict:
    """Activations with the structure each input of a Wan block has.

    ln_mod: LayerNorm output modulated per channel (1 + scale, shift, as adaLN), 4 outlier channels (20-50x) and
    0.2% outlier tokens (8x); attention outputs milder; the FFN's second input is GELU(tanh) of a projection
    with outlier channels. gaussian: plain N(0, 1) everywhere. massive: ln_mod plus 2 channels of 1000-3000, past
    the +-448 that native fp8_e4m3fn_fast clamps to."""
    g = torch.Generator(device=device).manual_seed(seed)
    rn = lambda *s: torch.randn(*s, device=device, generator=g)  # noqa: E731
    if family == "gaussian":
        return {k: rn(m, d).bfloat16() for k, d in (("x_self", width), ("x_attn", width), ("x_cross", width),
                                                       ("x_ffn", width), ("x_gelu", ffn))}

    def ln_mod() -> torch.Tensor:
        x = F.layer_norm(rn(m, width), (width,)) * (1 + 0.5 * rn(width)) + 0.3 * rn(width)
        x[:, torch.randperm(width, device=device, generator=g)[:4]] *= torch.tensor([20., 30., 40., 50.], device=device)
        x[torch.randperm(m, device=device, generator=g)[: max(1, m // 500)]] *= 8
        if family == "massive":
            x[:, torch.randperm(width, device=device, generator=g)[:2]] = torch.tensor([1000., -3000.], device=device)
        return x.bfloat16()

    attn = 0.6 * rn(m, width)
    attn[torch.randperm(m, device=device, generator=g)[: max(1, m // 500)]] *= 8
    h = 1.5 * rn(m, ffn)
    h[:, torch.randperm(ffn, device=device, generator=g)[:8]] *= 10
    return {"x_self": ln_mod(), "x_attn": attn.bfloat16(), "x_cross": ln_mod(), "x_ffn": ln_mod(),
            "x_gelu": F.gelu(h, approximate="tanh").bfloat16()}


def block_weights(linears: list, device: torch.device, seed: int = 1) -> dict:
    """Per linear: bf16 weight with outlier input channels (synthetic/checkpoints.py's kind), its per-tensor fp8
    (the pack's files), the plain cast native fp8_e4m3fn_fast makes, and a bf16 bias."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, _, n, k in linears:
        w = torch.randn(n, k, device=device, generator=g) / k**0.5
        cols = torch.randperm(k, device=device, generator=g)[: max(1, k // 512)]
        w[:, cols] *= 8 + 12 * torch.rand(cols.numel(), device=device, generator=g)
        w = w.bfloat16()
        qt, st = fp8.quantize_per_tensor(w)
        out[name] = {"w": w, "q": qt, "s": st, "native": w.to(fp8.FP8_DTYPE),
                     "b": (0.02 * torch.randn(n, device=device, generator=g)).bfloat16()}
    return out


def native_linears(weights: dict, device: torch.device) -> tuple[dict, str]:
    """name -> callable(x) running ComfyUI's own fp8_e4m3fn_fast Linear (comfy.ops.fp8_ops, imported from
    COMFYUI_PATH), checked to reach comfy.ops.fp8_linear; without ComfyUI, its steps replicated (said so)."""
    try:
        root = os.environ["COMFYUI_PATH"]
        if root not in sys.path:
            sys.path.insert(0, root)
        from comfy.cli_args import args  # before comfy.model_management picks the device

        args.cpu = args.cpu or device.type == "cpu"
        import comfy.ops

        mods = {}
        for name, wd in weights.items():
            n, k = wd["native"].shape
            mod = comfy.ops.fp8_ops.Linear(k, n, bias=True, device="meta", dtype=torch.bfloat16)
            mod.weight = torch.nn.Parameter(wd["native"], requires_grad=False)  # the plain cast UNETLoader makes
            mod.bias = torch.nn.Parameter(wd["b"], requires_grad=False)
            mods[name] = mod
        calls, orig = [], comfy.ops.fp8_linear
        comfy.ops.fp8_linear = lambda self, inp: calls.append(1) or orig(self, inp)
        try:
            probe = next(iter(mods.values()))
            probe(torch.zeros(1, 16, probe.in_features, device=device, dtype=torch.bfloat16))
        finally:
            comfy.ops.fp8_linear = orig
        if not calls:
            raise RuntimeError("comfy.ops.fp8_ops.Linear did not reach comfy.ops.fp8_linear")
        how = f"ComfyUI {harness.comfyui_version(os.environ.get('COMFYUI_PATH'))} comfy.ops.fp8_ops.Linear"
        return {name: (lambda x, m=m: m(x)) for name, m in mods.items()}, how
    except Exception as exc:  # noqa: BLE001 - no ComfyUI here: the same steps, replicated
        one = torch.ones((), device=device)

        def replicated(x: torch.Tensor, wd: dict) -> torch.Tensor:
            x2 = x.reshape(-1, x.shape[-1])
            xq = torch.clamp(x2, min=-448, max=448, out=x2).to(fp8.FP8_DTYPE).contiguous()
            y = torch._scaled_mm(xq, wd["native"].t(), scale_a=one, scale_b=one, bias=wd["b"], out_dtype=x.dtype)
            return y.reshape(*x.shape[:-1], -1)

        how = (f"replicated (ComfyUI not importable: {type(exc).__name__}: {str(exc)[:120]}): clamp_(+-448) in place, "
               "cast, torch._scaled_mm with unit scales and the bias")
        return {name: (lambda x, wd=wd: replicated(x, wd)) for name, wd in weights.items()}, how


def _pack(path: str | None, act: fp8.ActQuant | None = None):
    """A pack variant: fp8_linear on ``path`` with ``act`` (None: fp8.DEFAULT_ACT); path None: what the pack runs,
    the scale chooser's pick."""
    from comfyui_lowvram_dit.kernels import opaque_ops

    def run(x: torch.Tensor, wd: dict) -> torch.Tensor:
        if path is None:
            auto = fp8.select_path(x.device, None, *wd["q"].shape)
            return opaque_ops.fp8_linear(x, wd["q"], wd["s"], wd["b"], None, auto)
        return fp8.fp8_linear(x, wd["q"], wd["s"], wd["b"], path=path, act=act)
    return run


def block_variants(device: torch.device) -> dict[str, dict]:
    """name -> {run(x, weights of one linear)} or {native: True}. A variant this GPU / torch cannot run errors
    when timed and is reported so."""
    tw, rw = "scaled_mm_tensorwise", "scaled_mm_rowwise"
    return {"bf16 F.linear": {"run": lambda x, wd: F.linear(x, wd["w"], wd["b"])},
            "native fp8_e4m3fn_fast": {"native": True},
            "pack today (scale chooser, fast accum)": {"run": _pack(None)},
            "pack row-wise, no fast accum": {"run": _pack(rw, fp8.ActQuant())},
            "pack tensor-wise (amax pass), no fast accum": {"run": _pack(tw, fp8.ActQuant())},
            "pack row-wise + fast accum": {"run": _pack(rw)}}


def block_runner(spec: dict, weights: dict, linears: list, native: dict) -> Callable[..., dict | None]:
    """run(inputs, names, keep) -> {name: first ERR_ROWS output rows} or None."""
    keys = {name: key for name, key, _, _ in linears}

    def run(inputs: dict, names: tuple[str, ...], keep: bool = False) -> dict | None:
        outs: dict[str, torch.Tensor] = {}
        for n in names:
            x = inputs[keys[n]]
            outs[n] = native[n](x) if spec.get("native") else spec["run"](x, weights[n])
        if not keep:
            return None
        return {n: y.reshape(-1, y.shape[-1])[:ERR_ROWS].float() for n, y in outs.items()}
    return run


def time_interleaved(fns: dict, device: torch.device, repeats: int, warmup: int) -> dict[str, list[float] | str]:
    """Milliseconds per call of each fn, in rounds that run every fn once (rotating the order), so clock and
    power drift hit all alike (the H100 runs these GEMMs at its power limit); CUDA events on a GPU."""
    out: dict[str, list[float] | str] = {}
    live = {}
    for name, fn in fns.items():
        try:
            for _ in range(warmup):
                fn()
            live[name] = fn
            out[name] = []
        except Exception as exc:  # noqa: BLE001 - a path this GPU / torch cannot run is a result
            out[name] = f"{type(exc).__name__}: {exc}"[:300]
    names = list(live)
    for r in range(repeats):
        order = names[r % len(names):] + names[: r % len(names)] if names else []
        marks = {}
        for name in order:
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                live[name]()
                end.record()
                marks[name] = (start, end)
            else:
                t0 = time.perf_counter()
                live[name]()
                out[name].append((time.perf_counter() - t0) * 1e3)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            for name, (start, end) in marks.items():
                out[name].append(float(start.elapsed_time(end)))
    return out


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).norm() / ref.norm()).item()


def block_errors(runners: dict, inputs: dict, native_inputs: dict, refs: dict, names: tuple) -> dict:
    """variant -> {linear: rel. error vs fp32 on the first ERR_ROWS rows} (or an error string), each variant
    called once before (as in a run's later steps)."""
    out: dict[str, dict | str] = {}
    for vname, (run, spec) in runners.items():
        src = native_inputs if spec.get("native") else inputs
        try:
            run(src, names)
            ys = run(src, names, keep=True)
            out[vname] = {n: _rel(ys[n], refs[n]) for n in names}
        except Exception as exc:  # noqa: BLE001 - reported as the variant's result
            out[vname] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def quant_fns(inputs: dict, native_inputs: dict, device: torch.device) -> dict[str, object]:
    """Activation quantizers alone on each distinct block input: what each path pays before its GEMM."""
    fns: dict[str, object] = {}
    for key in sorted(inputs):
        x2, xn = inputs[key].reshape(-1, inputs[key].shape[-1]), native_inputs[key].reshape(-1, inputs[key].shape[-1])
        tag = f"{key} K={x2.shape[1]}"
        fns[f"{tag}: native clamp_ + cast"] = lambda xn=xn: torch.clamp(xn, -448, 448, out=xn).to(fp8.FP8_DTYPE)
        if device.type == "cuda" and fp8_triton.TRITON_AVAILABLE:
            fns[f"{tag}: row (Triton)"] = lambda x2=x2: fp8_triton.quantize_rowwise(x2)
            fns[f"{tag}: tensor (norm + Triton)"] = lambda x2=x2: fp8_triton.quantize_tensorwise(x2)
        else:
            fns[f"{tag}: row (torch)"] = lambda x2=x2: fp8.quantize_rowwise_torch(x2)
    return fns


def _med(t: list[float] | str) -> float | None:
    return statistics.median(t) if isinstance(t, list) and t else None


def bench_block_family(family: str, setup: dict, repeats: int, warmup: int) -> list[dict]:
    """Every variant on one input family: errors, the block (8 linears and the 6 of self-attention + FFN) timed
    interleaved, each linear alone and each quantizer alone."""
    device, linears, m, weights = setup["device"], setup["linears"], setup["m"], setup["weights"]
    names = tuple(n for n, _, _, _ in linears)
    raw = block_inputs(family, m, linears[0][3], linears[6][2], device)
    inputs = {k: v.unsqueeze(0) for k, v in raw.items()}  # [1, tokens, C], as the model calls them
    native_inputs = {k: v.clone() for k, v in inputs.items()}  # native clamps its input in place
    refs = {n: F.linear(inputs[key].reshape(-1, k)[:ERR_ROWS].float(), weights[n]["w"].float(),
                        weights[n]["b"].float()) for n, key, _, k in linears}
    runners = {v: (block_runner(spec, weights, linears, setup["native"]), spec)
               for v, spec in block_variants(device).items()}
    errs = block_errors(runners, inputs, native_inputs, refs, names)
    rows: list[dict] = []
    for kind, subset in (("block8", names), ("block6", SIX)):
        fns = {v: (lambda r=r, sp=sp: r(native_inputs if sp.get("native") else inputs, subset))
               for v, (r, sp) in runners.items()}
        for v, t in time_interleaved(fns, device, repeats, warmup).items():
            e = errs[v] if isinstance(errs[v], dict) else {}
            sub = [e[n] for n in subset if n in e]
            rows.append({"kind": kind, "family": family, "variant": v, "time_ms": _med(t),
                         "status": "ok" if _med(t) is not None and e else "error",
                         "error": t if isinstance(t, str) else (errs[v] if isinstance(errs[v], str) else None),
                         "err_mean": statistics.mean(sub) if sub else None, "err_max": max(sub) if sub else None,
                         "errors": {n: e[n] for n in subset if n in e}})
    for n in names:
        fns = {v: (lambda r=r, sp=sp: r(native_inputs if sp.get("native") else inputs, (n,)))
               for v, (r, sp) in runners.items()}
        for v, t in time_interleaved(fns, device, repeats, warmup).items():
            rows.append({"kind": "linear", "family": family, "variant": v, "linear": n, "time_ms": _med(t),
                         "err": (errs[v] or {}).get(n) if isinstance(errs[v], dict) else None})
    for q, t in time_interleaved(quant_fns(inputs, native_inputs, device), device, repeats, warmup).items():
        rows.append({"kind": "quant", "family": family, "variant": q, "time_ms": _med(t)})
    return rows


def _x(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}x" if a and b else ""


def block_markdown(rows: list[dict], env: dict, m: int, native_how: str, repeats: int, warmup: int) -> str:
    """Per family: the block table (vs native), then each linear and each quantizer."""
    lines = ["# bench_fp8_gemm --block: one Wan 14B block's fp8 linears", ""]
    lines += harness.env_bullets(env, ("device_name", "compute_capability", "torch", "torch_cuda", "triton",
                                       "comfyui_version", "git_sha", "timestamp", "command"))
    lines += [f"- native fp8_e4m3fn_fast: {native_how}",
              f"- {m} tokens; block = {', '.join(n for n, *_ in BLOCK_LINEARS)} (cross_attn.k/v: text tokens, "
              f"left out); block6 = {', '.join(SIX)}",
              f"- timing: CUDA events, {warmup} warm-up rounds then {repeats} rounds, every variant once per round "
              f"(order rotating), median; error: rel. Frobenius error vs fp32 on the first {ERR_ROWS} tokens, "
              "after one warm call", ""]
    for fam in dict.fromkeys(r["family"] for r in rows):
        fr = [r for r in rows if r["family"] == fam]
        by = {(r["kind"], r["variant"]): r for r in fr}
        nat8, nat6 = (by.get((k, "native fp8_e4m3fn_fast"), {}).get("time_ms") for k in ("block8", "block6"))
        nat_err = by.get(("block8", "native fp8_e4m3fn_fast"), {}).get("err_mean")
        lines += [f"## {fam}", "", "| variant | ms / block (8) | vs native | ms (6) | vs native | mean rel. err | "
                  "max rel. err | err vs native |", "|---|---|---|---|---|---|---|---|"]
        for r in (r for r in fr if r["kind"] == "block8"):
            r6 = by.get(("block6", r["variant"]), {})
            if r["status"] != "ok":
                lines.append(f"| {r['variant']} | {r['status']}: {str(r.get('error'))[:100]} | | | | | | |")
                continue
            lines.append(f"| {r['variant']} | {r['time_ms']:.3f} | {_x(nat8, r['time_ms'])} | "
                         f"{r6.get('time_ms') or 0:.3f} | {_x(nat6, r6.get('time_ms'))} | {r['err_mean']:.3%} | "
                         f"{r['err_max']:.3%} | {_x(r['err_mean'], nat_err)} |")
        names = list(dict.fromkeys(r["linear"] for r in fr if r["kind"] == "linear"))
        variants = list(dict.fromkeys(r["variant"] for r in fr if r["kind"] == "linear"))
        lines += ["", "| variant | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for v in variants:
            cells = [by_l.get("time_ms") for by_l in (next((r for r in fr if r["kind"] == "linear" and
                                                             r["variant"] == v and r["linear"] == n), {})
                                                       for n in names)]
            lines.append(f"| {v} | " + " | ".join(f"{c:.3f}" if c else "error" for c in cells) + " |")
        lines += ["", "| quantizer alone | ms |", "|---|---|"]
        lines += [f"| {r['variant']} | {r['time_ms']:.3f} |" if r["time_ms"] else f"| {r['variant']} | error |"
                  for r in fr if r["kind"] == "quant"]
        lines.append("")
    return "\n".join(lines + block_summary(rows)) + "\n"


def block_summary(rows: list[dict]) -> list[str]:
    """Per pack variant: speed vs native per family and whether it meets >= 1.05x at <= native's error in all."""
    out = ["## Verdict (target: >= 1.05x native per block at equal or lower error, every family)", ""]
    fams = list(dict.fromkeys(r["family"] for r in rows))
    b8 = {(r["family"], r["variant"]): r for r in rows if r["kind"] == "block8" and r["status"] == "ok"}
    for v in dict.fromkeys(r["variant"] for r in rows if r["kind"] == "block8"):
        if v in ("bf16 F.linear", "native fp8_e4m3fn_fast"):
            continue
        parts, ok = [], True
        for f in fams:
            r, n = b8.get((f, v)), b8.get((f, "native fp8_e4m3fn_fast"))
            if not r or not n:
                parts.append(f"{f}: n/a")
                ok = False
                continue
            sp = n["time_ms"] / r["time_ms"]
            ok &= sp >= 1.05 and r["err_mean"] <= n["err_mean"]
            parts.append(f"{f} {sp:.3f}x, err {r['err_mean']:.3%} vs {n['err_mean']:.3%}")
        out.append(f"- {v}: {'; '.join(parts)} -> {'MEETS' if ok else 'does not meet'} the target")
    return out


def main_block(args: argparse.Namespace, argv: list[str] | None) -> int:
    device = torch.device("cpu" if args.dry else "cuda")
    env = harness.gpu_script_environment(f"{harness.SUITE}.bench_fp8_gemm", argv, device)
    m, linears = _dims(args.dry)
    weights = block_weights(linears, device)
    native, how = native_linears(weights, device)
    say(f"{env.get('device_name')} torch {torch.__version__} triton {env.get('triton')}; native: {how}")
    setup = {"device": device, "linears": linears, "m": m, "weights": weights, "native": native}
    rows: list[dict] = []
    for fam in args.families:
        rows += bench_block_family(fam, setup, args.repeats, args.warmup)
        for r in rows:
            if r["family"] == fam and r["kind"] == "block8":
                say(f"  {fam:9s} {r['variant']:44s} " + (f"{r['time_ms']:8.3f} ms err {r['err_mean']:.3%}"
                                                        if r["status"] == "ok" else f"ERROR {r.get('error')!s:.100}"))
    for line in block_summary(rows):
        say(line)
    stem = "bench_fp8_gemm_block" + ("_dry" if args.dry else "")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"env": env, "native": how, "tokens": m, "rows": rows}
    write_report(args.out_dir / f"{stem}.json", json.dumps(payload, indent=1, default=str))
    write_report(args.out_dir / f"{stem}.md", block_markdown(rows, env, m, how, args.repeats, args.warmup))
    say(f"wrote {args.out_dir / stem}.json and .md")
    return 0
