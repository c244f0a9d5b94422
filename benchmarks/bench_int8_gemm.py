"""Scenario ``int8_gemm``: the int8 W8A8 linear (kernels/int8.py) vs bf16, native fp8 and the pack's fp8 paths at
Wan 2.2 14B / Qwen-Image GEMM shapes: time, TFLOP/s, ratio to bf16, error; and the error of one Wan block's linears
in a chain. ``--tiny`` runs scaled-down shapes on the CPU (a check of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from comfyui_lowvram_dit.benchmarks import report
from comfyui_lowvram_dit.benchmarks.bench_fp8_gemm import ERR_ROWS, outlier_weight, relative_error
from comfyui_lowvram_dit.benchmarks.report import say
from comfyui_lowvram_dit.benchmarks.timing import time_fn
from comfyui_lowvram_dit.kernels import fp8, int8, int8_triton

# (M tokens, K in, N out): Wan 14B 832x480x81 -> 21x30x52 = 32,760 tokens; Qwen-Image 1328x1328 -> 83x83 = 6,889.
SHAPES: dict[str, tuple[int, int, int]] = {
    "wan14b_qkvo": (32760, 5120, 5120), "wan14b_ffn_up": (32760, 5120, 13824), "wan14b_ffn_down": (32760, 13824, 5120),
    "qwen_attn": (6889, 3072, 3072), "qwen_mlp_up": (6889, 3072, 12288), "qwen_mlp_down": (6889, 12288, 3072)}
QUICK = ("wan14b_qkvo", "wan14b_ffn_up", "wan14b_ffn_down")
TINY: dict[str, tuple[int, int, int]] = {"tiny_qkvo": (96, 256, 256), "tiny_ffn_up": (96, 256, 640),
                                         "tiny_ffn_down": (96, 640, 256)}
BLOCK_ROWS = 512  # tokens through the Wan block chain
WAN_BLOCK = (5120, 13824)  # model width, FFN width
TINY_BLOCK = (256, 640)


def make_operands(m: int, k: int, n: int, device: torch.device, seed: int = 0):
    """bf16 activations [M, K] with 4 outlier channels (20-50x), bf16 weight [N, K] with outlier input channels
    (8-20x, one per 512 inputs, as synthetic/checkpoints.py), bf16 bias."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, device=device, generator=g)
    x[:, torch.randperm(k, device=device, generator=g)[:4]] *= torch.tensor([20.0, 30.0, 40.0, 50.0], device=device)
    w = outlier_weight(n, k, device, g)
    return x.bfloat16(), w, (0.02 * torch.randn(n, device=device, generator=g)).bfloat16()


def _capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def fp8_variants(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> dict[str, object]:
    """bf16 and the fp8 rows: name -> zero-arg callable, or why it cannot run here."""
    cap = _capability(x.device)
    out: dict[str, object] = {"bf16 F.linear": lambda: F.linear(x, w, b)}
    qt, st = fp8.quantize_per_tensor(w)
    fp8_mm = cap is not None and cap >= (8, 9)
    # native-style fp8 (ComfyUI's fp8_e4m3fn_fast): per-tensor weight, input clamped and cast, one _scaled_mm
    one = torch.ones((), device=x.device)
    out["native fp8 _scaled_mm per-tensor"] = (
        (lambda: torch._scaled_mm(x.clamp(-448, 448).to(fp8.FP8_DTYPE), qt.t(), scale_a=one, scale_b=st.float(),
                                  bias=b, out_dtype=x.dtype)) if fp8_mm else f"needs fp8 matmul (8.9+), have {cap}")
    out["ours fp8 row-wise (scaled_mm_rowwise)"] = (
        (lambda: fp8.fp8_linear(x, qt, st, b, path="scaled_mm_rowwise")) if cap in ((8, 9), (9, 0))
        else f"row-wise scaled_mm needs compute capability 8.9 or 9.0, have {cap}")
    out["ours fp8 dequantize (today on 20xx/30xx)"] = lambda: fp8.fp8_linear(x, qt, st, b, path="dequantize")
    return out


def int8_variants(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> dict[str, object]:
    """The int8 rows: quantize + GEMM and GEMM alone, per GEMM and with / without rotation."""
    qt, st = fp8.quantize_per_tensor(w)
    out: dict[str, object] = {}
    triton_ok = int8_triton.gemm_available(x.device)
    for rotate in (True, False):
        wq, ws = int8.weight_from_fp8(qt, st, None, rotate=rotate)
        xq, xs = int8.quantize_activation(x, rotate)
        tag = "rotated" if rotate else "plain"
        for gemm in ("int_mm", "triton"):
            if gemm == "triton" and not triton_ok:
                out[f"int8 {gemm} {tag}"] = out[f"int8 {gemm} {tag}, GEMM only"] = \
                    "Triton GEMM needs Triton and compute capability 8.0+"
                continue
            out[f"int8 {gemm} {tag}"] = (lambda g=gemm, r=rotate, q=wq, s=ws:
                                         int8.int8_linear(x, q, s, b, gemm=g, rotate=r))
            out[f"int8 {gemm} {tag}, GEMM only"] = (lambda g=gemm, q=wq, s=ws, aq=xq, a_s=xs:
                                                     int8._run_gemm(g, aq, a_s, q, s, b, x.dtype))
        out[f"int8 act quant {tag} (alone)"] = lambda r=rotate: int8.quantize_activation(x, r)
    return out


def rel_error(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of ``out``'s first rows against fp32 math on the same bf16 operands."""
    return relative_error(out[:ERR_ROWS].float(), F.linear(x[:ERR_ROWS].float(), w.float(), b.float()))


def _row(name: str, shape: tuple[int, int, int], vname: str, fn, x, w, b, repeats: int, warmup: int,
         bf16_ms: float | None) -> dict:
    m, k, n = shape
    row = {"shape": name, "M": m, "K": k, "N": n, "variant": vname}
    if isinstance(fn, str):
        return {**row, "status": "skipped", "error": fn}
    try:
        out = fn()
        err = rel_error(out, x, w, b) if isinstance(out, torch.Tensor) else None
        del out
        ms = statistics.median(time_fn(fn, x.device, repeats, warmup))
    except Exception as exc:  # a path this torch/GPU rejects is a result, not a crash
        return {**row, "status": "error", "error": f"{type(exc).__name__}: {exc}"[:300]}
    row.update(status="ok", time_ms=ms, rel_err=err)
    if err is not None:  # a GEMM (the activation quantizer alone has no FLOPs or error)
        row.update(tflops=2 * m * n * k / ms / 1e9, vs_bf16=(bf16_ms / ms) if bf16_ms else 1.0)
    return row


def bench_shape(name: str, shape: tuple[int, int, int], device: torch.device, repeats: int, warmup: int) -> list[dict]:
    """Every variant at one shape; the first (bf16) sets the ratio."""
    x, w, b = make_operands(*shape, device)
    rows: list[dict] = []
    bf16_ms = None
    for vname, fn in {**fp8_variants(x, w, b), **int8_variants(x, w, b)}.items():
        row = _row(name, shape, vname, fn, x, w, b, repeats, warmup, bf16_ms)
        bf16_ms = bf16_ms or row.get("time_ms")
        rows.append(row)
        if row["status"] != "ok":
            say(f"  {name:16s} {vname:42s} {row['status']}: {row['error'][:100]}")
        elif "tflops" in row:
            say(f"  {name:16s} {vname:42s} {row['time_ms']:8.3f} ms {row['tflops']:7.1f} TFLOP/s "
                f"{row['vs_bf16']:5.2f}x err {row['rel_err']:.4%}")
        else:
            say(f"  {name:16s} {vname:42s} {row['time_ms']:8.3f} ms")
    del x, w, b
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _block_linears(device: torch.device, width: int, ffn: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    shapes = {"q": (width, width), "k": (width, width), "v": (width, width), "o": (width, width),
              "ffn_up": (width, ffn), "ffn_down": (ffn, width)}
    return {name: make_operands(1, kin, kout, device, seed=10 + i)[1:] for i, (name, (kin, kout)) in
            enumerate(shapes.items())}


def _run_block(lin, x: torch.Tensor) -> torch.Tensor:
    """One Wan block's linears in order, attention replaced by a gate (the linears' error is what is measured)."""
    h = lin("o", lin("q", x) * torch.sigmoid(lin("k", x).float()).to(x.dtype) + lin("v", x))
    h = h + x
    return lin("ffn_down", F.gelu(lin("ffn_up", h).float(), approximate="tanh").to(x.dtype)) + h


def block_errors(device: torch.device, tiny: bool) -> list[dict]:
    """Error of the block chain against fp32 math on the bf16 weights, per compute path."""
    width, ffn = TINY_BLOCK if tiny else WAN_BLOCK
    lins = _block_linears(device, width, ffn)
    x = make_operands(BLOCK_ROWS, width, 8, device, seed=99)[0]
    cap = _capability(device)
    fp8_real = cap in ((8, 9), (9, 0))
    q8 = {n: fp8.quantize_per_tensor(w) for n, (w, _) in lins.items()}
    i8 = {r: {n: int8.weight_from_fp8(*q8[n], None, rotate=r) for n in lins} for r in (True, False)}
    paths = {
        "fp32 (reference)": lambda n, t: F.linear(t.float(), lins[n][0].float(), lins[n][1].float()).to(t.dtype),
        "bf16 F.linear": lambda n, t: F.linear(t, *lins[n]),
        "fp8 dequantize": lambda n, t: fp8.fp8_linear(t, *q8[n], lins[n][1], path="dequantize"),
        "fp8 row-wise" + ("" if fp8_real else " (emulated)"): lambda n, t: (
            fp8.fp8_linear if fp8_real else fp8.fp8_linear_reference)(t, *q8[n], lins[n][1], path="scaled_mm_rowwise"),
        "int8 rotated": lambda n, t: int8.int8_linear(t, *i8[True][n], lins[n][1], rotate=True),
        "int8 plain": lambda n, t: int8.int8_linear(t, *i8[False][n], lins[n][1], rotate=False),
    }
    ref = _run_block(paths["fp32 (reference)"], x).float()
    rows = []
    for name, lin in list(paths.items())[1:]:
        y = _run_block(lin, x).float()
        rows.append({"path": name, "block_rel_err": relative_error(y, ref), "width": width,
                     "ffn": ffn, "tokens": BLOCK_ROWS})
        say(f"  block {name:28s} rel. err {rows[-1]['block_rel_err']:.4%}")
    return rows


def summarize(rows: list[dict], blocks: list[dict]) -> list[str]:
    """Geometric-mean ratio to bf16 and mean error per variant; the block errors; the goal's verdict."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        if r["status"] == "ok" and "vs_bf16" in r:
            by.setdefault(r["variant"], []).append(r)
    out = ["## Summary (geometric mean over shapes)", ""]
    for v, rs in by.items():
        gm = math.exp(sum(math.log(r["vs_bf16"]) for r in rs) / len(rs))
        out.append(f"- {v}: {gm:.2f}x vs bf16, mean rel. err {statistics.mean(r['rel_err'] for r in rs):.3%}")
    out += ["", "## One Wan block's linears in a chain (error vs fp32)", ""]
    out += [f"- {b['path']}: {b['block_rel_err']:.3%}" for b in blocks]
    err = {b["path"].split(" (")[0]: b["block_rel_err"] for b in blocks}
    if "int8 rotated" in err and "fp8 row-wise" in err:
        out.append(f"- int8 rotated block error {'<=' if err['int8 rotated'] <= err['fp8 row-wise'] else '>'} "
                   "the fp8 row-wise path's")
    return out


def markdown(rows: list[dict], env: dict, summary: list[str]) -> list[str]:
    """The report: environment, one row per shape and variant, the summary."""
    table = []
    for r in rows:
        head = [f"{r['shape']} ({r['M']}, {r['K']} -> {r['N']})", r["variant"]]
        if r["status"] != "ok":
            table.append([*head, f"{r['status']}: {report.cell(r.get('error'))[:120]}", "", "", ""])
        else:
            table.append([*head, f"{r['time_ms']:.3f}", report.cell(r.get("tflops"), "{:.1f}"),
                          report.cell(r.get("vs_bf16"), "{:.2f}x"), report.cell(r.get("rel_err"), "{:.3%}")])
    return [*report.header("int8_gemm: int8 W8A8 GEMMs vs bf16, native fp8 and the pack's fp8", env, [
        "timing: CUDA events (perf_counter on the CPU), median; bf16 activations with 4 outlier channels, weights "
        f"with outlier input channels, bias; error vs fp32 on the first {ERR_ROWS} rows"]),
        *report.table(["shape (M, K -> N)", "variant", "ms", "TFLOP/s", "vs bf16", "rel. err"], table), "", *summary]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Wan 14B shapes only")
    parser.add_argument("--tiny", action="store_true", help="scaled-down shapes, runs on the CPU too (a check)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out-dir", "--out", type=Path, default=report.RESULTS)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.tiny:
        say("bench_int8_gemm needs a CUDA GPU (--tiny runs scaled-down shapes on the CPU)")
        return 2
    env = report.environment(f"{report.SUITE}.bench_int8_gemm", argv, device)
    say(f"{env['gpu'] or env['cpu']} torch {env['torch']} triton {env['triton']}")
    shapes = TINY if args.tiny else {n: SHAPES[n] for n in (QUICK if args.quick else SHAPES)}
    rows: list[dict] = []
    with torch.no_grad():
        for name, shape in shapes.items():
            rows += bench_shape(name, shape, device, args.repeats, args.warmup)
        blocks = block_errors(device, args.tiny)
    summary = summarize(rows, blocks)
    say("\n".join(summary))
    stem = "bench_int8_gemm" + ("_tiny" if args.tiny else "_quick" if args.quick else "")
    report.write(args.out_dir, stem, {"env": env, "rows": rows, "block": blocks}, markdown(rows, env, summary))
    say(f"wrote {args.out_dir / stem}.json and .md")
    return 0
