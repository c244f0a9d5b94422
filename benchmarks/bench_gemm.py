"""Scenarios ``fp8_gemm`` and ``int8_gemm``, named by the first argument (benchmarks/README.md: what each measures)."""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from comfyui_lowvram_dit.benchmarks import report
from comfyui_lowvram_dit.benchmarks.report import say
from comfyui_lowvram_dit.benchmarks.timing import time_fn, time_interleaved
from comfyui_lowvram_dit.kernels import fp8, fp8_triton, int8, int8_comfy_kitchen, int8_triton
from comfyui_lowvram_dit.kernels.attention_int8 import relative_error

ERR_ROWS = 2048  # error is measured on the first rows only (an fp32 GEMM per variant otherwise dominates)
# (name, input, N out, K in): the block's linears that see every video token, in call order
# (comfy/ldm/wan/model.py WanAttentionBlock). cross_attn.k/v see the 512 text tokens only and are left out.
BLOCK_LINEARS: tuple[tuple[str, str, int, int], ...] = (
    ("self_attn.q", "x_self", 5120, 5120), ("self_attn.k", "x_self", 5120, 5120),
    ("self_attn.v", "x_self", 5120, 5120), ("self_attn.o", "x_attn", 5120, 5120),
    ("cross_attn.q", "x_cross", 5120, 5120), ("cross_attn.o", "x_attn", 5120, 5120),
    ("ffn.0", "x_ffn", 13824, 5120), ("ffn.2", "x_gelu", 5120, 13824))
SIX = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "ffn.0", "ffn.2")  # block6: no cross-attention
BLOCK_TOKENS = 32760  # Wan 14B 832x480x81
FAMILIES = ("ln_mod", "gaussian", "massive")
DRY_DIV = 40  # --dry: widths / 40 (rounded to 16), 64 tokens, on the CPU
NATIVE = "native fp8_e4m3fn_fast"
VERDICT = "## Verdict (target: >= 1.05x native per block at equal or lower error, every family)"
# int8_gemm's (M tokens, K in, N out): Wan 14B 832x480x81 -> 21x30x52 = 32,760 tokens; Qwen-Image 1328x1328 -> 6,889.
SHAPES: dict[str, tuple[int, int, int]] = {
    "wan14b_qkvo": (32760, 5120, 5120), "wan14b_ffn_up": (32760, 5120, 13824), "wan14b_ffn_down": (32760, 13824, 5120),
    "qwen_attn": (6889, 3072, 3072), "qwen_mlp_up": (6889, 3072, 12288), "qwen_mlp_down": (6889, 12288, 3072)}
QUICK = ("wan14b_qkvo", "wan14b_ffn_up", "wan14b_ffn_down")
TINY: dict[str, tuple[int, int, int]] = {"tiny_qkvo": (96, 256, 256), "tiny_ffn_up": (96, 256, 640),
                                         "tiny_ffn_down": (96, 640, 256)}
BLOCK_ROWS = 512  # tokens through the Wan block chain
WAN_BLOCK = (5120, 13824)  # model width, FFN width
TINY_BLOCK = (256, 640)


def block_inputs(family: str, m: int, width: int, ffn: int, device: torch.device, seed: int = 0) -> dict:
    """Activations with the structure each input of a Wan block has (``FAMILIES``)."""
    # ln_mod: LayerNorm output modulated per channel as adaLN, 4 outlier channels (20-50x), 0.2% outlier tokens (8x);
    # attention outputs milder; the FFN's second input GELU(tanh) of a projection with outlier channels. massive:
    # ln_mod plus 2 channels of 1000-3000, past the +-448 that native fp8_e4m3fn_fast clamps to.
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


def outlier_weight(n: int, k: int, device: torch.device, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 weight [N, K] with outlier input channels (8-20x, one per 512 inputs) and a bf16 bias [N]."""
    w = torch.randn(n, k, device=device, generator=g) / k**0.5
    cols = torch.randperm(k, device=device, generator=g)[: max(1, k // 512)]
    w[:, cols] *= 8 + 12 * torch.rand(cols.numel(), device=device, generator=g)
    return w.bfloat16(), (0.02 * torch.randn(n, device=device, generator=g)).bfloat16()


def native_linears(weights: dict, device: torch.device) -> tuple[dict, str]:
    """name -> ComfyUI's fp8_e4m3fn_fast Linear (else its steps replicated), and how it runs."""
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
            mods[name] = comfy.ops.fp8_ops.Linear(k, n, bias=True, device="meta", dtype=torch.bfloat16)
            mods[name].weight = torch.nn.Parameter(wd["native"], requires_grad=False)  # the plain cast UNETLoader makes
            mods[name].bias = torch.nn.Parameter(wd["b"], requires_grad=False)
        probe = next(iter(mods.values()))
        with mock.patch.object(comfy.ops, "fp8_linear", wraps=comfy.ops.fp8_linear) as spy:
            probe(torch.zeros(1, 16, probe.in_features, device=device, dtype=torch.bfloat16))
        if not spy.called:
            raise RuntimeError("comfy.ops.fp8_ops.Linear did not reach comfy.ops.fp8_linear")
        return mods, f"ComfyUI {report.comfyui_version(root)} comfy.ops.fp8_ops.Linear"
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


def bench_block_family(family: str, setup: dict, repeats: int, warmup: int) -> list[dict]:
    """One family: errors, the block (8 linears, and 6), each linear and each quantizer alone, timed interleaved."""
    device, linears, weights = setup["device"], setup["linears"], setup["weights"]
    names, keys = tuple(n for n, *_ in linears), {n: key for n, key, _, _ in linears}
    raw = block_inputs(family, setup["m"], linears[0][3], linears[6][2], device)
    inputs = {k: v.unsqueeze(0) for k, v in raw.items()}  # [1, tokens, C], as the model calls them
    native_inputs = {k: v.clone() for k, v in inputs.items()}  # native clamps its input in place
    refs = {n: F.linear(inputs[key].reshape(-1, k)[:ERR_ROWS].float(), weights[n]["w"].float(),
                        weights[n]["b"].float()) for n, key, _, k in linears}
    from comfyui_lowvram_dit.kernels import opaque_ops

    def pack(path: str | None, act: fp8.ActQuant | None, n: str, x: torch.Tensor) -> torch.Tensor:
        q, s, b = (weights[n][k] for k in "qsb")  # fp8_linear on path; None: what the pack runs (the scale chooser's)
        if path is None:
            return opaque_ops.fp8_linear(x, q, s, b, None, fp8.select_path(x.device, None, *q.shape))
        return fp8.fp8_linear(x, q, s, b, path=path, act=act)

    # variant -> fn(linear's name, its input); one this GPU cannot run fails when timed
    w, tw, rw = weights, "scaled_mm_tensorwise", "scaled_mm_rowwise"
    variants = {"bf16 F.linear": lambda n, x: F.linear(x, w[n]["w"], w[n]["b"]),
                NATIVE: lambda n, x: setup["native"][n](x),
                "pack today (scale chooser, fast accum)": functools.partial(pack, None, None),
                "pack row-wise, no fast accum": functools.partial(pack, rw, fp8.ActQuant()),
                "pack tensor-wise (amax pass), no fast accum": functools.partial(pack, tw, fp8.ActQuant()),
                "pack row-wise + fast accum": functools.partial(pack, rw, None)}

    def run(v: str, subset: tuple[str, ...]) -> dict[str, torch.Tensor]:  # variant v's outputs of the linears
        x = native_inputs if v == NATIVE else inputs
        return {n: variants[v](n, x[keys[n]]) for n in subset}

    errs: dict[str, dict | str] = {}  # variant -> {linear: rel. error vs fp32}, after one warm call as in later steps
    for v in variants:
        try:
            run(v, names)
            errs[v] = {n: relative_error(y.reshape(-1, y.shape[-1])[:ERR_ROWS].float(), refs[n])
                       for n, y in run(v, names).items()}
        except Exception as exc:  # noqa: BLE001 - reported as the variant's result
            errs[v] = report.error_text(exc)
    quant: dict[str, Callable] = {}  # the activation quantizers alone per distinct input: what a path pays first
    for key in sorted(inputs):
        x2, xn = inputs[key].reshape(-1, inputs[key].shape[-1]), native_inputs[key].reshape(-1, inputs[key].shape[-1])
        tag = f"{key} K={x2.shape[1]}"
        quant[f"{tag}: native clamp_ + cast"] = lambda xn=xn: torch.clamp(xn, -448, 448, out=xn).to(fp8.FP8_DTYPE)
        if device.type == "cuda" and fp8_triton.TRITON_AVAILABLE:
            quant[f"{tag}: row (Triton)"] = lambda x2=x2: fp8_triton.quantize_rowwise(x2)
            quant[f"{tag}: tensor (norm + Triton)"] = lambda x2=x2: fp8_triton.quantize_tensorwise(x2)
        else:
            quant[f"{tag}: row (torch)"] = lambda x2=x2: fp8.quantize_rowwise_torch(x2)
    rows: list[dict] = []  # the block (8 linears, then 6), each linear alone, the quantizers alone
    for kind, subset in (("block8", names), ("block6", SIX), *(("linear", (n,)) for n in names), ("quant", ())):
        fns = quant if kind == "quant" else {v: functools.partial(run, v, subset) for v in variants}
        for v, t in time_interleaved(fns, device, repeats, warmup).items():
            row = {"kind": kind, "family": family, "variant": v, **({"linear": subset[0]} if kind == "linear" else {}),
                   "time_ms": t if isinstance(t, float) else None}
            e = {n: errs[v][n] for n in subset} if kind != "quant" and isinstance(errs[v], dict) else {}
            if kind == "linear":
                row["err"] = e.get(subset[0])
            elif kind != "quant":
                row.update(status="ok" if row["time_ms"] is not None and e else "error",
                           error=t if isinstance(t, str) else (errs[v] if isinstance(errs[v], str) else None),
                           err_mean=statistics.mean(e.values()) if e else None, err_max=max(e.values(), default=None),
                           errors=e)
            rows.append(row)
    return rows


def block_markdown(rows: list[dict], env: dict, m: int, native_how: str, repeats: int, warmup: int) -> list[str]:
    """Per family: the block table (vs native), each linear and each quantizer; last the verdict per pack variant."""
    lines = report.header("fp8_gemm: one Wan 14B block's fp8 linears", env, [
        f"native fp8_e4m3fn_fast: {native_how}",
        f"{m} tokens; block = {', '.join(n for n, *_ in BLOCK_LINEARS)} (cross_attn.k/v: text tokens, left out); "
        f"block6 = {', '.join(SIX)}",
        f"timing: CUDA events, {warmup} warm-up rounds then {repeats} rounds, every variant once per round (order "
        f"rotating), median; error: rel. Frobenius error vs fp32 on the first {ERR_ROWS} tokens, after one warm call"])
    x = lambda a, b: f"{a / b:.3f}x" if a and b else ""  # a ratio cell, empty without both
    families = list(dict.fromkeys(r["family"] for r in rows))
    for fam in families:
        fr = [r for r in rows if r["family"] == fam]
        by = {(r["kind"], r["variant"]): r for r in fr}
        n8, n6 = by.get(("block8", NATIVE), {}), by.get(("block6", NATIVE), {})
        block = []
        for r in (r for r in fr if r["kind"] == "block8"):
            r6 = by.get(("block6", r["variant"]), {})
            block.append([r["variant"], f"{r['status']}: {report.cell(r.get('error'))[:100]}", *[""] * 6]
                         if r["status"] != "ok" else
                         [r["variant"], f"{r['time_ms']:.3f}", x(n8.get("time_ms"), r["time_ms"]),
                          f"{r6.get('time_ms') or 0:.3f}", x(n6.get("time_ms"), r6.get("time_ms")),
                          f"{r['err_mean']:.3%}", f"{r['err_max']:.3%}", x(r["err_mean"], n8.get("err_mean"))])
        per = {(r["variant"], r["linear"]): r.get("time_ms") for r in fr if r["kind"] == "linear"}
        names = list(dict.fromkeys(n for _, n in per))
        linears = [[v, *(report.cell(per.get((v, n)), "{:.3f}") for n in names)]
                   for v in dict.fromkeys(v for v, _ in per)]
        quant = [[r["variant"], report.cell(r["time_ms"], "{:.3f}")] for r in fr if r["kind"] == "quant"]
        lines += [f"## {fam}", "", *report.table(["variant", "ms / block (8)", "vs native", "ms (6)", "vs native",
                                                  "mean rel. err", "max rel. err", "err vs native"], block), "",
                  *report.table(["variant", *names], linears), "", *report.table(["quantizer alone", "ms"], quant), ""]
    lines += [VERDICT, ""]
    b8 = {(r["family"], r["variant"]): r for r in rows if r["kind"] == "block8" and r["status"] == "ok"}
    for v in dict.fromkeys(r["variant"] for r in rows if r["kind"] == "block8" and r["variant"].startswith("pack")):
        pairs = {f: (b8.get((f, v)), b8.get((f, NATIVE))) for f in families}  # (this variant, native) per family
        ok = all(r and n and n["time_ms"] / r["time_ms"] >= 1.05 and r["err_mean"] <= n["err_mean"]
                 for r, n in pairs.values())
        parts = [f"{f} {n['time_ms'] / r['time_ms']:.3f}x, err {r['err_mean']:.3%} vs {n['err_mean']:.3%}"
                 if r and n else f"{f}: n/a" for f, (r, n) in pairs.items()]
        lines.append(f"- {v}: {'; '.join(parts)} -> {'MEETS' if ok else 'does not meet'} the target")
    return lines


def make_operands(m: int, k: int, n: int, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """bf16 activations [M, K] with 4 outlier channels (20-50x), an ``outlier_weight`` [N, K] and its bias."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, device=device, generator=g)
    x[:, torch.randperm(k, device=device, generator=g)[:4]] *= torch.tensor([20.0, 30.0, 40.0, 50.0], device=device)
    return x.bfloat16(), *outlier_weight(n, k, device, g)


def variants(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> dict[str, object]:
    """Every row at one shape, name -> zero-arg callable or why it cannot run here: bf16, the fp8 rows, then the int8
    ones (quantize + GEMM and GEMM alone, per GEMM and with / without rotation)."""
    cap = torch.cuda.get_device_capability(x.device) if x.device.type == "cuda" else None
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
        out[f"{kitchen_name()} {tag}"] = (lambda r=rotate, q=wq, s=ws: int8_comfy_kitchen.int8_linear(
            x, q, s, b, x.dtype, r)) if int8_comfy_kitchen.module() is not None else kitchen_missing()
    return out


def kitchen_name() -> str:
    """The comfy-kitchen rows' name: its int8_linear, with the version installed here (the Linear candidate of
    kernels/int8_choice.py, on the pack's int8 weight; rotated: the activation rotated as the pack's weight was)."""
    return f"comfy-kitchen {int8_comfy_kitchen.installed_version() or '(none)'} int8_linear"


def kitchen_missing() -> str:
    """Why the comfy-kitchen rows cannot run here (its version, or its absence)."""
    return f"{int8_comfy_kitchen.missing_reason()} (its int8_linear is a candidate from " \
           f"{'.'.join(map(str, int8_comfy_kitchen.MIN_VERSION))})"


def bench_shape(name: str, shape: tuple[int, int, int], device: torch.device, repeats: int, warmup: int) -> list[dict]:
    """Every variant at one shape: its time; a GEMM's error vs fp32 math on the same operands, TFLOP/s and ratio to
    the first variant (bf16); a path this torch / GPU rejects is a row saying why."""
    (m, k, n), (x, w, b) = shape, make_operands(*shape, device)
    rows, bf16_ms = [], None
    for vname, fn in variants(x, w, b).items():
        r = {"shape": name, "M": m, "K": k, "N": n, "variant": vname}
        rows.append(r)
        if isinstance(fn, str):
            r.update(status="skipped", error=fn)
        else:
            try:
                out = fn()
                err = relative_error(out[:ERR_ROWS].float(), F.linear(x[:ERR_ROWS].float(), w.float(), b.float())) \
                    if isinstance(out, torch.Tensor) else None  # an activation quantizer alone: no FLOPs or error
                del out
                ms = time_fn(fn, device, repeats, warmup)
                r.update(status="ok", time_ms=ms, rel_err=err)
                if err is not None:
                    r.update(tflops=2 * m * n * k / ms / 1e9, vs_bf16=(bf16_ms / ms) if bf16_ms else 1.0)
            except Exception as exc:  # noqa: BLE001 - a result, not a crash
                r.update(status="error", error=report.error_text(exc))
        bf16_ms = bf16_ms or r.get("time_ms")
        done = f"{r['time_ms']:8.3f} ms" if r["status"] == "ok" else f"{r['status']}: {r['error'][:100]}"
        gemm = f" {r['tflops']:7.1f} TFLOP/s {r['vs_bf16']:5.2f}x err {r['rel_err']:.4%}" if "tflops" in r else ""
        say(f"  {name:16s} {vname:42s} {done}{gemm}")
    del x, w, b
    torch.cuda.empty_cache()  # a no-op where CUDA never started
    return rows


def chain_errors(device: torch.device, tiny: bool) -> list[dict]:
    """Error of the block chain against fp32 math on the bf16 weights, per compute path."""
    width, ffn = TINY_BLOCK if tiny else WAN_BLOCK
    shapes = {**dict.fromkeys(("q", "k", "v", "o"), (width, width)), "ffn_up": (width, ffn), "ffn_down": (ffn, width)}
    lins = {n: make_operands(1, kin, kout, device, seed=10 + i)[1:]
            for i, (n, (kin, kout)) in enumerate(shapes.items())}
    x = make_operands(BLOCK_ROWS, width, 8, device, seed=99)[0]
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    fp8_real = cap in ((8, 9), (9, 0))
    rowwise = fp8.fp8_linear if fp8_real else fp8.fp8_linear_reference  # fp32 emulation without the matmul
    q8 = {n: fp8.quantize_per_tensor(w) for n, (w, _) in lins.items()}
    i8 = {r: {n: int8.weight_from_fp8(*q8[n], None, rotate=r) for n in lins} for r in (True, False)}
    paths = {"bf16 F.linear": lambda n, t: F.linear(t, *lins[n]),
             "fp8 dequantize": lambda n, t: fp8.fp8_linear(t, *q8[n], lins[n][1], path="dequantize"),
             "fp8 row-wise" + ("" if fp8_real else " (emulated)"):
                 lambda n, t: rowwise(t, *q8[n], lins[n][1], path="scaled_mm_rowwise"),
             "int8 rotated": lambda n, t: int8.int8_linear(t, *i8[True][n], lins[n][1], rotate=True),
             "int8 plain": lambda n, t: int8.int8_linear(t, *i8[False][n], lins[n][1], rotate=False)}
    if int8_comfy_kitchen.module() is not None:
        paths[f"{kitchen_name()} rotated"] = lambda n, t: int8_comfy_kitchen.int8_linear(
            t, *i8[True][n], lins[n][1], t.dtype, True)

    def block(lin: Callable) -> torch.Tensor:  # the linears in order, attention replaced by a gate: their error shows
        h = lin("o", lin("q", x) * torch.sigmoid(lin("k", x).float()).to(x.dtype) + lin("v", x)) + x
        return lin("ffn_down", F.gelu(lin("ffn_up", h).float(), approximate="tanh").to(x.dtype)) + h

    ref = block(lambda n, t: F.linear(t.float(), lins[n][0].float(), lins[n][1].float()).to(t.dtype)).float()
    rows = []
    for name, lin in paths.items():
        rows.append({"path": name, "block_rel_err": relative_error(block(lin).float(), ref), "width": width,
                     "ffn": ffn, "tokens": BLOCK_ROWS})
        say(f"  block {name:28s} rel. err {rows[-1]['block_rel_err']:.4%}")
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command line: the scenario, then its options (an option of the other scenario is an error)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=("fp8_gemm", "int8_gemm"))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out-dir", "--out", type=Path, default=report.RESULTS)
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=None,
                        help="fp8_gemm: activation families (default: all)")
    parser.add_argument("--dry", action="store_true",
                        help="fp8_gemm on the CPU at tiny widths, 2 rounds: exercises every code path, times nothing")
    parser.add_argument("--block", action="store_true", help=argparse.SUPPRESS)  # fp8_gemm's only mode: recorded
    parser.add_argument("--quick", action="store_true", help="int8_gemm: Wan 14B shapes only")
    parser.add_argument("--tiny", action="store_true", help="int8_gemm: scaled-down shapes, runs on the CPU too")
    parser.add_argument("--stem", default=None,
                        help="the result files' name (default by scenario and options), e.g. one per comfy-kitchen")
    args = parser.parse_args(argv)
    if (args.families or args.dry or args.block) if args.scenario == "int8_gemm" else (args.quick or args.tiny):
        parser.error("--families, --dry, --block are fp8_gemm's options, --quick, --tiny int8_gemm's")
    args.families = args.families or list(FAMILIES)
    return args


def run_fp8(args: argparse.Namespace, env: dict, device: torch.device) -> tuple[str, dict, list[str]]:
    """fp8_gemm: every variant on every family; the report's stem, JSON and markdown."""
    m, linears = BLOCK_TOKENS, list(BLOCK_LINEARS)
    if args.dry:
        shrink = lambda d: max(16, (d // DRY_DIV) // 16 * 16)  # noqa: E731
        m, linears = 64, [(n, key, shrink(o), shrink(i)) for n, key, o, i in BLOCK_LINEARS]
    g, weights = torch.Generator(device=device).manual_seed(1), {}
    for name, _, n, k in linears:  # bf16 weight and bias, its per-tensor fp8 (the pack's files), native's fp8 cast
        w, b = outlier_weight(n, k, device, g)
        q, s = fp8.quantize_per_tensor(w)
        weights[name] = {"w": w, "q": q, "s": s, "native": w.to(fp8.FP8_DTYPE), "b": b}
    native, how = native_linears(weights, device)
    say(f"native: {how}")
    setup = {"device": device, "linears": linears, "m": m, "weights": weights, "native": native}
    rows: list[dict] = []
    for fam in args.families:
        rows += bench_block_family(fam, setup, args.repeats, args.warmup)
        for r in (r for r in rows if r["family"] == fam and r["kind"] == "block8"):
            say(f"  {fam:9s} {r['variant']:44s} " + (f"{r['time_ms']:8.3f} ms err {r['err_mean']:.3%}"
                                                    if r["status"] == "ok" else f"ERROR {r.get('error')!s:.100}"))
    markdown = block_markdown(rows, env, m, how, args.repeats, args.warmup)
    say("\n".join(markdown[markdown.index(VERDICT):]))
    doc = {"env": env, "native": how, "tokens": m, "rows": rows}
    return "bench_fp8_gemm_block" + ("_dry" if args.dry else ""), doc, markdown


def run_int8(args: argparse.Namespace, env: dict, device: torch.device) -> tuple[str, dict, list[str]]:
    """int8_gemm: every variant at every shape, the block chain's error; the report's stem, JSON and markdown."""
    shapes = TINY if args.tiny else {n: SHAPES[n] for n in (QUICK if args.quick else SHAPES)}
    rows: list[dict] = []
    with torch.no_grad():
        for name, shape in shapes.items():
            rows += bench_shape(name, shape, device, args.repeats, args.warmup)
        blocks = chain_errors(device, args.tiny)
    ok = [r for r in rows if r["status"] == "ok" and "vs_bf16" in r]  # the summary: GEMMs that ran, per variant
    by = {v: [r for r in ok if r["variant"] == v] for v in dict.fromkeys(r["variant"] for r in ok)}
    summary = ["## Summary (geometric mean over shapes)", ""]
    summary += [f"- {v}: {statistics.geometric_mean(r['vs_bf16'] for r in rs):.2f}x vs bf16, mean rel. err "
                f"{statistics.mean(r['rel_err'] for r in rs):.3%}" for v, rs in by.items()]
    summary += ["", "## One Wan block's linears in a chain (error vs fp32)", ""]
    summary += [f"- {b['path']}: {b['block_rel_err']:.3%}" for b in blocks]
    err = {b["path"].split(" (")[0]: b["block_rel_err"] for b in blocks}
    if "int8 rotated" in err and "fp8 row-wise" in err:  # the goal's verdict
        summary.append(f"- int8 rotated block error {'<=' if err['int8 rotated'] <= err['fp8 row-wise'] else '>'} "
                       "the fp8 row-wise path's")
    say("\n".join(summary))
    table = [[f"{r['shape']} ({r['M']}, {r['K']} -> {r['N']})", r["variant"], *(
        [f"{r['status']}: {report.cell(r.get('error'))[:120]}", "", "", ""] if r["status"] != "ok" else
        [f"{r['time_ms']:.3f}", *(report.cell(r.get(k), f) for k, f in (("tflops", "{:.1f}"), ("vs_bf16", "{:.2f}x"),
                                                                          ("rel_err", "{:.3%}")))])] for r in rows]
    markdown = [*report.header("int8_gemm: int8 W8A8 GEMMs vs bf16, native fp8, the pack's fp8 and comfy-kitchen's "
                               "int8_linear", env, [
        "timing: CUDA events (perf_counter on the CPU), median; bf16 activations with 4 outlier channels, weights "
        f"with outlier input channels, bias; error vs fp32 on the first {ERR_ROWS} rows"]),
        *report.table(["shape (M, K -> N)", "variant", "ms", "TFLOP/s", "vs bf16", "rel. err"], table), "", *summary]
    return ("bench_int8_gemm" + ("_tiny" if args.tiny else "_quick" if args.quick else ""),
            {"env": env, "rows": rows, "block": blocks}, markdown)


def main(argv: list[str] | None = None) -> int:
    """Run the scenario named first in ``argv``; ``<out>/<stem>.json`` and ``.md``."""
    args = parse_args(argv)
    if args.dry:
        args.repeats, args.warmup = min(args.repeats, 2), min(args.warmup, 1)
    elif not (torch.cuda.is_available() or args.tiny):
        say(f"{args.scenario} needs a CUDA GPU (--{'dry' if args.scenario == 'fp8_gemm' else 'tiny'} runs on the CPU)")
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry else "cpu")
    env = report.environment(f"{report.SUITE}.bench_gemm", argv, device)
    say(f"{env['gpu'] or env['cpu']} torch {env['torch']} triton {env['triton']}")
    stem, doc, markdown = (run_fp8 if args.scenario == "fp8_gemm" else run_int8)(args, env, device)
    stem = args.stem or stem
    report.write(args.out_dir, stem, doc, markdown)
    say(f"wrote {args.out_dir / stem}.json and .md")
    return 0
