"""Scenario ``attention_int8``: the 8-bit attention kernel vs cuDNN, flash, comfy-kitchen int8 and fp8 SDPA (README)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from comfyui_lowvram_dit.benchmarks import report as reports
from comfyui_lowvram_dit.benchmarks.timing import time_fn
from comfyui_lowvram_dit.kernels import attention_int8 as A

# (B, H, Lq, Lk, D): the token counts of Wan 2.2 and Qwen-Image at these resolutions
SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "wan14b_480p_self": (1, 40, 32760, 32760, 128),  # 832x480x81 -> 21 x 60 x 104 / (1x2x2) patches
    "wan14b_480p_cross": (1, 40, 32760, 512, 128),  # umT5 text context, 512 tokens
    "qwen_image_1328_joint": (1, 24, 6889 + 128, 6889 + 128, 128),  # 83x83 patches + text
    "wan14b_720p_self": (1, 40, 75600, 75600, 128),  # 1280x720x81 -> 21 x 90 x 160 / 4
    "wan14b_720p_cross": (1, 40, 75600, 512, 128),
}
QUICK_SHAPES = ("wan14b_480p_self", "wan14b_480p_cross")
# ours: (Q·Kᵀ format, P·V format, hi_keys). "int8_fp8" is what "auto" runs on sm89+ ("int8_fp16" on sm80/86 and
# the selectable precise scheme; "int8_int8" the int8 P·V); "int8_fp8_old" the scheme before the 16-bit keys (the speed baseline); hi_keys
# None = hi_key_count(Lk), 0 = none.
OURS = {"int8_fp16": ("int8", "fp16", None), "int8_fp8": ("int8", "fp8", None), "int8_fp8_old": ("int8", "fp8", 0),
        "fp8_fp8": ("fp8", "fp8", None), "int8_int8": ("int8", "int8", None)}
FAMILY_BACKENDS = ("sdpa_cudnn", "int8_fp16", "int8_fp8", "int8_int8", "int8_fp8_old", "comfy_kitchen_int8")
FAMILY_HEADS = 2
ERROR_BUDGET = 0.02
FAMILIES_FILE = Path(__file__).resolve().parents[1] / "tests" / "unit" / "attention_families.py"
# comfy-kitchen's INT8 attention (as ComfyUI's --use-ck-attention runs it) and torch's experimental fp8 SDPA
RIVALS = ("comfy_kitchen_int8", "sdpa_fp8")
BACKENDS = ("sdpa_cudnn", "sdpa_flash", *OURS, *RIVALS, "prologue", "prologue_old")
ERR_HEADS = 2


class BackendUnavailable(RuntimeError):
    """A backend that cannot run in this environment; its rows carry the reason instead of numbers."""


def say(msg: str) -> None:
    print(msg, flush=True)


def make_inputs(b: int, h: int, lq: int, lk: int, d: int, kind: str, seed: int = 0):
    """bf16 [B, H, L, D] on the GPU; "outlier": 4 channels 20-50x, K channel bias, per-token RMSNorm."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, h, lq, d, device="cuda", generator=g)
    k = torch.randn(b, h, lk, d, device="cuda", generator=g)
    v = torch.randn(b, h, lk, d, device="cuda", generator=g)
    if kind == "outlier":
        ch = torch.randperm(d, device="cuda", generator=g)[:4]
        mult = torch.tensor([20.0, 30.0, 40.0, 50.0], device="cuda")
        q[..., ch] *= mult
        k[..., ch] = k[..., ch] * mult + 2 * mult
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True))
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True))
        v = v + 0.5 * torch.randn(d, device="cuda", generator=g)
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def _comfy_kitchen_int8():
    """comfy_kitchen.int8_attention on [B, H, L, D] (last dim contiguous), default scale 1/sqrt(D)."""
    try:
        import comfy_kitchen
    except Exception as exc:  # ImportError, or its CUDA extension failing to load
        raise BackendUnavailable(f"comfy_kitchen does not import: {type(exc).__name__}: {exc}"[:300]) from exc
    if not hasattr(comfy_kitchen, "int8_attention"):
        raise BackendUnavailable(f"comfy_kitchen {getattr(comfy_kitchen, '__version__', '?')} has no int8_attention")
    if not comfy_kitchen.int8_attention_is_available():
        raise BackendUnavailable("comfy_kitchen.int8_attention_is_available() is False on this GPU")
    return lambda q, k, v: comfy_kitchen.int8_attention(q, k, v)


def _sdpa_fp8():
    """torch's experimental fp8 SDPA (per-head descales; the quantization to e4m3 in torch is timed with it)."""
    try:
        from torch.nn.attention.experimental._scaled_dot_product_attention_quantized import (
            _scaled_dot_product_attention_quantized as sdpa_quantized,
        )
    except ImportError as exc:
        raise BackendUnavailable(f"torch {torch.__version__} has no fp8 SDPA API: {exc}"[:300]) from exc

    def to_fp8(x):
        descale = x.abs().amax(dim=(2, 3)).float().clamp_min(1e-6) / 448.0  # [B, H]
        return (x / descale[:, :, None, None].to(x.dtype)).to(torch.float8_e4m3fn), descale

    def run(q, k, v):
        (q8, qd), (k8, kd), (v8, vd) = to_fp8(q), to_fp8(k), to_fp8(v)
        return sdpa_quantized(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)

    try:  # probe once: the API exists in torch builds whose fp8 kernels (FA3 / cuDNN) are not there
        run(*(torch.randn(1, 1, 128, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)))
        torch.cuda.synchronize()
    except Exception as exc:  # any failure of the probe is the reason this row is skipped
        raise BackendUnavailable(f"fp8 SDPA does not run here: {type(exc).__name__}: {exc}"[:300]) from exc
    return run


def backend_fn(name: str, config: dict | None = None):
    """callable(q, k, v) -> out for a backend name (BackendUnavailable when it cannot run here)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "comfy_kitchen_int8":
        return _comfy_kitchen_int8()
    if name == "sdpa_fp8":
        return _sdpa_fp8()
    if name in ("sdpa_cudnn", "sdpa_flash"):
        which = SDPBackend.CUDNN_ATTENTION if name == "sdpa_cudnn" else SDPBackend.FLASH_ATTENTION

        def run(q, k, v):
            with sdpa_kernel(which):
                return F.scaled_dot_product_attention(q, k, v)
        return run
    if name in ("prologue", "prologue_old"):  # the auto formats' prologue; _old: without the key sort (hi_keys=0)
        qk, pv = A.resolve_formats(torch.device("cuda"))
        hi = 0 if name == "prologue_old" else None
        return lambda q, k, v: A.quantize_qkv(q, k, v, qk_format=qk, pv_format=pv, hi_keys=hi)
    qk, pv, hi = OURS[name]
    if not torch.cuda.is_available():  # the CPU smoke run: the fp32 emulation of the same scheme
        return lambda q, k, v: A.attention_int8_reference(q, k, v, qk_format=qk, pv_format=pv, hi_keys=hi)
    return lambda q, k, v: A.attention_int8(q, k, v, qk_format=qk, pv_format=pv, config=config, hi_keys=hi)


def rel_errors(fn, shape: tuple[int, ...]) -> dict[str, float]:
    """Relative error vs fp32 math on the first ERR_HEADS heads, Gaussian and outlier-heavy inputs."""
    b, h, lq, lk, d = shape
    out = {}
    for kind in ("gauss", "outlier"):
        q, k, v = make_inputs(b, min(h, ERR_HEADS), lq, lk, d, kind, seed=1)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        out[f"err_{kind}"] = A.relative_error(fn(q, k, v), ref)
        del ref
    return out


def measure(name: str, shape: tuple[int, ...], repeats: int, warmup: int, config: dict | None = None,
            errors: bool = True) -> dict:
    """One (backend, shape) row; failures become rows with an error."""
    b, h, lq, lk, d = shape
    row: dict = {"backend": name, "shape": list(shape), "config": config}
    try:
        fn = backend_fn(name, config)
        q, k, v = make_inputs(b, h, lq, lk, d, "gauss")
        t0 = time.perf_counter()
        fn(q, k, v)  # first call: compile + autotune for ours
        torch.cuda.synchronize()
        row["first_call_s"] = round(time.perf_counter() - t0, 2)
        times = time_fn(lambda: fn(q, k, v), q.device, repeats, warmup)
        row["time_ms"] = statistics.median(times)
        if not name.startswith("prologue"):
            row["tflops"] = 4 * b * h * lq * lk * d / (row["time_ms"] * 1e-3) / 1e12
            if errors:
                row.update(rel_errors(fn, shape))
        q = k = v = None  # free the inputs before empty_cache (the lambda above is done with them)
    except BackendUnavailable as exc:
        row["skipped"] = str(exc)
    except Exception as exc:  # a backend that cannot run here is a result, not a crash
        row["error"] = f"{type(exc).__name__}: {exc}"[:500]
    torch.cuda.empty_cache()
    return row


def check_correctness(names: list[str] | None = None) -> list[dict]:
    """Small shapes first, so a broken kernel shows up before the long timings (our formats among names)."""
    rows = []
    for shape in [(1, 2, 1, 1, 128), (2, 3, 77, 513, 64), (1, 4, 1000, 512, 128), (2, 2, 4097, 4097, 128)]:
        for name in (n for n in OURS if names is None or n in names):
            qk, pv, hi = OURS[name]
            row = {"shape": list(shape), "backend": name}
            try:
                q, k, v = make_inputs(*shape, "outlier", seed=3)
                out = A.attention_int8(q, k, v, qk_format=qk, pv_format=pv, hi_keys=hi)
                emu = A.attention_int8_reference(q, k, v, qk_format=qk, pv_format=pv, block_n=64, hi_keys=hi)
                ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
                row.update(err_vs_emulation=A.relative_error(out, emu), err_vs_fp32=A.relative_error(out, ref))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            say(f"  check {name:10s} {shape}: " + ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                                                            for k, v in row.items() if k not in ("shape", "backend")))
            rows.append(row)
    return rows


def sweep_configs(shape: tuple[int, ...], repeats: int) -> list[dict]:
    """Every tile config of the autotune set at one shape, both Q·Kᵀ formats, with errors."""
    from comfyui_lowvram_dit.kernels import attention_int8_triton as tk

    cases = [(f"tile {c.kwargs}", {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages})
             for c in tk.attn_configs()]
    rows = []
    for name in ("int8_fp16", "int8_fp8_old"):
        for label, cfg in cases:
            row = measure(name, shape, repeats, 2, config=cfg, errors=True)
            row["variant"] = label
            say(f"  sweep {name:8s} {label:26s}: " + (
                f"{row['time_ms']:.2f} ms, {row['tflops']:.0f} TFLOP/s, err outlier {row.get('err_outlier', float('nan')):.4f}, "
                f"gauss {row.get('err_gauss', float('nan')):.4f}" if "time_ms" in row else row.get("error", "")))
            rows.append(row)
    return rows


def families_module():  # noqa: ANN201 - a module
    """tests/unit/attention_families.py, loaded by path (the tests are not a package)."""
    spec = importlib.util.spec_from_file_location("attention_families", FAMILIES_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def family_backends(names: tuple[str, ...]) -> tuple[dict, dict[str, str]]:
    """{backend: fn} of the family table's backends that run here, and {backend: why not} for the others."""
    fns, skipped = {}, {}
    for name in names:
        try:
            fns[name] = backend_fn(name)
        except BackendUnavailable as exc:
            skipped[name] = str(exc)
    return fns, skipped


def family_errors(shape_name: str, shape: tuple[int, ...], fns: dict, skipped: dict[str, str],
                  families: list[str], device: str = "cuda") -> list[dict]:
    """Error vs fp32 of each backend on each input family at a shape's sequence lengths, FAMILY_HEADS heads."""
    af = families_module()
    b, _, lq, lk, d = shape
    rows = []
    for family in families:
        row: dict = {"shape_name": shape_name, "family": family, "errors": {}, "notes": dict(skipped)}
        try:
            q, k, v = af.make_family(family, b, FAMILY_HEADS, lq, lk, d, seed=7, device=device)
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
            row["logit_std"] = [round(x, 2) for x in af.logit_std(q, k).flatten().tolist()]
            for name, fn in fns.items():
                try:
                    row["errors"][name] = A.relative_error(fn(q, k, v), ref)
                except Exception as exc:  # one backend failing on one family is a result
                    row["notes"][name] = f"{type(exc).__name__}: {exc}"[:300]
            del ref
        except Exception as exc:  # e.g. out of memory building a family: record it, keep going
            row["notes"]["family"] = f"{type(exc).__name__}: {exc}"[:300]
        say(f"  {shape_name} {family:40s} " + " ".join(f"{n}={e:.4f}" for n, e in row["errors"].items()))
        rows.append(row)
    return rows


def families_markdown(rows: list[dict], backends: tuple[str, ...]) -> list[str]:
    """One table per shape: family x backend error, over-budget cells in bold."""
    lines = [f"## Error vs fp32 per input family ({FAMILY_HEADS} heads; budget {ERROR_BUDGET:.0%}; "
             "families: tests/unit/attention_families.py)", ""]
    for shape_name in dict.fromkeys(r["shape_name"] for r in rows):
        lines += [f"### {shape_name}", "", "| family | logit std per head | " + " | ".join(backends) + " |",
                  "|---|---|" + "---|" * len(backends)]
        for r in (r for r in rows if r["shape_name"] == shape_name):
            cells = []
            for name in backends:
                e = r["errors"].get(name)
                cells.append("—" if e is None else (f"**{e:.2%}**" if e > ERROR_BUDGET else f"{e:.2%}"))
            lines.append(f"| {r['family']} | {r.get('logit_std', '—')} | " + " | ".join(cells) + " |")
        notes = {k: v for r in rows if r["shape_name"] == shape_name for k, v in r["notes"].items()}
        lines += ["", *[f"- {k}: {v}" for k, v in notes.items()], ""]
    return lines


def to_markdown(report: dict) -> str:
    env = report["env"]
    lines = reports.header("attention_int8: the 8-bit attention kernel vs cuDNN, flash and comfy-kitchen", env, [
        f"auto formats: {env.get('formats_auto')}; time: median of CUDA-event timings; TFLOP/s = 4·B·H·Lq·Lk·D / t; "
        f"errors: ‖out − fp32‖ / ‖fp32‖ on {ERR_HEADS} heads"])
    lines += ["| shape | backend | ms | TFLOP/s | vs cuDNN | err gauss | err outlier | first call s | note |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        f = lambda key, fmt: (fmt.format(r[key]) if isinstance(r.get(key), (int, float)) else "—")  # noqa: E731
        note = r.get("error") or (f"skipped: {r['skipped']}" if r.get("skipped") else "")
        lines.append(f"| {r['shape_name']} | {r['backend']} | {f('time_ms', '{:.2f}')} | {f('tflops', '{:.0f}')} | "
                     f"{f('speedup_vs_cudnn', '{:.2f}x')} | {f('err_gauss', '{:.4f}')} | {f('err_outlier', '{:.4f}')} | "
                     f"{f('first_call_s', '{:.1f}')} | {note[:160]} |")
    if report.get("sweep"):
        cudnn = next((r.get("time_ms") for r in report["rows"]
                      if r["shape_name"] == "wan14b_480p_self" and r["backend"] == "sdpa_cudnn"), None)
        lines += ["", "## Kernel variants at Wan 480p self-attention", "",
                  "| backend | variant | config | ms | TFLOP/s | vs cuDNN | err outlier | err gauss | note |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in report["sweep"]:
            ms = r.get("time_ms", float("nan"))
            vs = f"{cudnn / ms:.2f}x" if cudnn and r.get("time_ms") else "—"
            lines.append(f"| {r['backend']} | {r.get('variant', '')} | {r['config']} | {ms:.2f} | "
                         f"{r.get('tflops', float('nan')):.0f} | {vs} | {r.get('err_outlier', float('nan')):.4f} | "
                         f"{r.get('err_gauss', float('nan')):.4f} | {r.get('error', '')[:100]} |")
    if report.get("families"):
        lines += ["", *families_markdown(report["families"], FAMILY_BACKENDS)]
    lines += ["", "## Autotuner picks", "", "```", json.dumps(report["autotune"], indent=1), "```", ""]
    lines += ["## Correctness checks (outlier inputs)", "", "```",
              *[json.dumps(r) for r in report["checks"]], "```", ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command line; --shapes and --backends names are checked against the known ones."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="correctness + Wan 480p self/cross only, no sweep")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile-config sweep")
    parser.add_argument("--no-checks", action="store_true", help="skip the small-shape correctness checks")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=None,
                        help="time these shapes (default: all, or the --quick ones)")
    parser.add_argument("--backends", nargs="+", choices=list(BACKENDS), default=list(BACKENDS),
                        help="timed rows per shape (default: all)")
    parser.add_argument("--families", nargs="*", default=None, metavar="FAMILY",
                        help="also measure the error of cuDNN, ours (new and old scheme) and comfy-kitchen's int8 on "
                             "these input families (default: every family and combination) at every timed shape")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU: the family errors of ours (fp32 emulation) at a tiny shape; no timing")
    parser.add_argument("--tag", default="", help="suffix of the result files' names")
    parser.add_argument("--out", type=Path, default=reports.RESULTS)
    return parser.parse_args(argv)


def time_shapes(shape_names: list[str], names: list[str], repeats: int) -> list[dict]:
    """The timed rows: every backend at every shape, with its speed-up over cuDNN."""
    rows = []
    for shape_name in shape_names:
        shape = SHAPES[shape_name]
        say(f"{shape_name} {shape}:")
        reps = repeats if shape[2] * shape[3] < 2e9 else max(3, repeats // 2)
        cudnn_ms = None
        for name in names:
            row = measure(name, shape, reps, 2)
            row["shape_name"] = shape_name
            if name == "sdpa_cudnn":
                cudnn_ms = row.get("time_ms")
            if cudnn_ms and row.get("time_ms") and not name.startswith("prologue"):
                row["speedup_vs_cudnn"] = cudnn_ms / row["time_ms"]
            say(f"  {name:10s} " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in row.items() if k not in ("shape", "shape_name", "backend")))
            rows.append(row)
    return rows


def smoke(args: argparse.Namespace) -> int:
    """--smoke: every family's error for ours (the emulation of the new and the old scheme) on the CPU, tiny shape."""
    names = ("int8_fp16", "int8_fp8", "int8_fp8_old")
    fns = {n: backend_fn(n) for n in names}
    families = args.families or list(families_module().ALL_FAMILIES)
    rows = family_errors("smoke", (1, FAMILY_HEADS, 256, 256, 128), fns, {}, families, device="cpu")
    bad = [r["family"] for r in rows if r["errors"].get("int8_fp16", 1.0) > ERROR_BUDGET or r["notes"]]
    say("\n".join(families_markdown(rows, names)))
    say(f"smoke: {len(rows)} families, over budget with int8_fp16: {bad or 'none'}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        return smoke(args)
    if not torch.cuda.is_available():
        say("bench_attention_int8: needs a CUDA GPU (--smoke runs the family errors on the CPU)")
        return 2
    dev = torch.device("cuda")
    env = reports.environment(f"{reports.SUITE}.bench_attention_int8", argv, dev)
    env["formats_auto"] = list(A.resolve_formats(dev)) if A.is_supported(dev, torch.bfloat16, 128) else None
    say(f"device {env['gpu']} (sm{env['compute_capability']}), torch {env['torch']}, "
        f"triton {env['triton']}, comfy_kitchen {env['comfy_kitchen']}, auto formats {env['formats_auto']}")

    stem = "bench_attention_int8" + ("_quick" if args.quick else "") + (f"_{args.tag}" if args.tag else "")
    report = {"bench": "bench_attention_int8", "env": env, "rows": [], "sweep": [], "families": [],
              "autotune": {}, "checks": []}

    def write() -> None:  # after every stage, so a run cut short still leaves what it measured
        report["autotune"] = A.chosen_configs()
        reports.write(args.out, stem, report, [to_markdown(report)])

    report["checks"] = [] if args.no_checks else (say("correctness:") or check_correctness(args.backends))
    shape_names = args.shapes or list(QUICK_SHAPES if args.quick else SHAPES)
    report["rows"] = time_shapes(shape_names, args.backends, args.repeats)
    write()
    if args.families is not None:
        say(f"error per input family ({FAMILY_HEADS} heads):")
        fns, skipped = family_backends(FAMILY_BACKENDS)
        families = args.families or list(families_module().ALL_FAMILIES)
        for shape_name in shape_names:
            report["families"] += family_errors(shape_name, SHAPES[shape_name], fns, skipped, families)
            write()
    if not (args.no_sweep or args.quick):
        say("kernel variants, Wan 480p self-attention:")
        report["sweep"] = sweep_configs(SHAPES["wan14b_480p_self"], max(3, args.repeats // 2))
    write()
    say(f"autotuner picks: {json.dumps(report['autotune'], indent=1)}")
    say(f"wrote {args.out / stem}.json and .md")
    return 0

