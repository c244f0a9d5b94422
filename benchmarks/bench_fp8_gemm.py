"""Scenario ``fp8_gemm``: the fp8 linears of one Wan 14B block in call order (kernels/fp8.py), native
fp8_e4m3fn_fast (ComfyUI's own Linear when COMFYUI_PATH imports, else its steps replicated) vs bf16 and the pack's
default and forced paths, on three activation families: time per block interleaved, error vs fp32, each linear and
each quantizer alone (README). ``--dry`` runs it on the CPU at tiny widths to exercise the code.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from comfyui_lowvram_dit.benchmarks import report
from comfyui_lowvram_dit.benchmarks.report import say
from comfyui_lowvram_dit.benchmarks.timing import time_interleaved
from comfyui_lowvram_dit.kernels import fp8, fp8_triton

ERR_ROWS = 2048  # error is measured on the first rows only (an fp32 GEMM per variant otherwise dominates)


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


def outlier_weight(n: int, k: int, device: torch.device, g: torch.Generator) -> torch.Tensor:
    """A bf16 weight [N, K] with outlier input channels (8-20x, one per 512 inputs, as synthetic/checkpoints.py)."""
    w = torch.randn(n, k, device=device, generator=g) / k**0.5
    cols = torch.randperm(k, device=device, generator=g)[: max(1, k // 512)]
    w[:, cols] *= 8 + 12 * torch.rand(cols.numel(), device=device, generator=g)
    return w.bfloat16()


def block_weights(linears: list, device: torch.device, seed: int = 1) -> dict:
    """Per linear: bf16 weight with outlier input channels (synthetic/checkpoints.py's kind), its per-tensor fp8
    (the pack's files), the plain cast native fp8_e4m3fn_fast makes, and a bf16 bias."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, _, n, k in linears:
        w = outlier_weight(n, k, device, g)
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
        how = f"ComfyUI {report.comfyui_version(root)} comfy.ops.fp8_ops.Linear"
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


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref||."""
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
            out[vname] = {n: relative_error(ys[n], refs[n]) for n in names}
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


def block_markdown(rows: list[dict], env: dict, m: int, native_how: str, repeats: int, warmup: int) -> list[str]:
    """Per family: the block table (vs native), then each linear and each quantizer."""
    lines = report.header("fp8_gemm: one Wan 14B block's fp8 linears", env, [
        f"native fp8_e4m3fn_fast: {native_how}",
        f"{m} tokens; block = {', '.join(n for n, *_ in BLOCK_LINEARS)} (cross_attn.k/v: text tokens, left out); "
        f"block6 = {', '.join(SIX)}",
        f"timing: CUDA events, {warmup} warm-up rounds then {repeats} rounds, every variant once per round (order "
        f"rotating), median; error: rel. Frobenius error vs fp32 on the first {ERR_ROWS} tokens, after one warm call"])
    for fam in dict.fromkeys(r["family"] for r in rows):
        fr = [r for r in rows if r["family"] == fam]
        by = {(r["kind"], r["variant"]): r for r in fr}
        nat8, nat6 = (by.get((k, "native fp8_e4m3fn_fast"), {}).get("time_ms") for k in ("block8", "block6"))
        nat_err = by.get(("block8", "native fp8_e4m3fn_fast"), {}).get("err_mean")
        block = []
        for r in (r for r in fr if r["kind"] == "block8"):
            r6 = by.get(("block6", r["variant"]), {})
            block.append([r["variant"], f"{r['status']}: {report.cell(r.get('error'))[:100]}", "", "", "", "", "", ""]
                         if r["status"] != "ok" else
                         [r["variant"], f"{r['time_ms']:.3f}", _x(nat8, r["time_ms"]), f"{r6.get('time_ms') or 0:.3f}",
                          _x(nat6, r6.get("time_ms")), f"{r['err_mean']:.3%}", f"{r['err_max']:.3%}",
                          _x(r["err_mean"], nat_err)])
        names = list(dict.fromkeys(r["linear"] for r in fr if r["kind"] == "linear"))
        per = {(r["variant"], r["linear"]): r.get("time_ms") for r in fr if r["kind"] == "linear"}
        linears = [[v, *(report.cell(per.get((v, n)), "{:.3f}") for n in names)]
                   for v in dict.fromkeys(r["variant"] for r in fr if r["kind"] == "linear")]
        quant = [[r["variant"], report.cell(r["time_ms"], "{:.3f}")] for r in fr if r["kind"] == "quant"]
        lines += [f"## {fam}", "", *report.table(["variant", "ms / block (8)", "vs native", "ms (6)", "vs native",
                                                  "mean rel. err", "max rel. err", "err vs native"], block), "",
                  *report.table(["variant", *names], linears), "", *report.table(["quantizer alone", "ms"], quant), ""]
    return lines + block_summary(rows)


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


def main(argv: list[str] | None = None) -> int:
    """Every variant on every family; ``<out>/bench_fp8_gemm_block.json`` and ``.md`` (``_dry`` with ``--dry``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out-dir", "--out", type=Path, default=report.RESULTS)
    parser.add_argument("--block", action="store_true", help="(the only mode; kept so recorded commands still run)")
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES),
                        help="activation families (default: all)")
    parser.add_argument("--dry", action="store_true",
                        help="on the CPU at tiny widths, 2 rounds: exercises every code path, times nothing")
    args = parser.parse_args(argv)
    if args.dry:
        args.repeats, args.warmup = min(args.repeats, 2), min(args.warmup, 1)
    elif not torch.cuda.is_available():
        say("fp8_gemm needs a CUDA GPU (--dry runs on the CPU)")
        return 2
    device = torch.device("cpu" if args.dry else "cuda")
    env = report.environment(f"{report.SUITE}.bench_fp8_gemm", argv, device)
    m, linears = _dims(args.dry)
    weights = block_weights(linears, device)
    native, how = native_linears(weights, device)
    say(f"{env['gpu'] or env['cpu']} torch {env['torch']} triton {env['triton']}; native: {how}")
    setup = {"device": device, "linears": linears, "m": m, "weights": weights, "native": native}
    rows: list[dict] = []
    for fam in args.families:
        rows += bench_block_family(fam, setup, args.repeats, args.warmup)
        for r in rows:
            if r["family"] == fam and r["kind"] == "block8":
                say(f"  {fam:9s} {r['variant']:44s} " + (f"{r['time_ms']:8.3f} ms err {r['err_mean']:.3%}"
                                                        if r["status"] == "ok" else f"ERROR {r.get('error')!s:.100}"))
    say("\n".join(block_summary(rows)))
    stem = "bench_fp8_gemm_block" + ("_dry" if args.dry else "")
    report.write(args.out_dir, stem, {"env": env, "native": how, "tokens": m, "rows": rows},
                 block_markdown(rows, env, m, how, args.repeats, args.warmup))
    say(f"wrote {args.out_dir / stem}.json and .md")
    return 0
