"""Scenario ``fp8_gemm``: our fp8 linears (kernels/fp8.py) vs bf16 and native fp8 at Wan 2.2 / Qwen-Image GEMM
shapes, in one process (README).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

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
    for key in ("device_name", "compute_capability", "torch", "torch_cuda", "triton", "git_sha", "timestamp",
                "command"):
        if env.get(key) is not None:
            lines.append(f"- {key}: `{env[key]}`" if key in ("command", "git_sha") else f"- {key}: {env[key]}")
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
    args = parser.parse_args(argv)
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

