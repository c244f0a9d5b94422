"""Scenarios ``attention_int8`` and ``attention_kitchen`` (``--kitchen``): 8-bit attention vs cuDNN and comfy-kitchen.

attention_kitchen runs each comfy-kitchen version in a child process with only that version on its path (two versions
of one package cannot share a process); inputs come from fixed seeds, so every process sees the same values."""

from __future__ import annotations

import argparse
import functools
import json
import os
import runpy
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from comfyui_lowvram_dit.benchmarks import report as reports
from comfyui_lowvram_dit.benchmarks.report import say
from comfyui_lowvram_dit.benchmarks.timing import time_fn
from comfyui_lowvram_dit.kernels import attention_int8 as A
from comfyui_lowvram_dit.kernels.attention_backends import BackendUnavailable

# (B, H, Lq, Lk, D): the token counts of Wan 2.2 and Qwen-Image at these resolutions
SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "wan14b_480p_self": (1, 40, 32760, 32760, 128),  # 832x480x81 -> 21 x 60 x 104 / (1x2x2) patches
    "wan14b_480p_cross": (1, 40, 32760, 512, 128),  # umT5 text context, 512 tokens
    "wan14b_720p_self": (1, 40, 75600, 75600, 128),  # 1280x720x81 -> 21 x 90 x 160 / 4
    "wan14b_720p_cross": (1, 40, 75600, 512, 128)}
# ours: (Q·Kᵀ format, P·V format, hi_keys). "auto" runs "int8_fp16" on sm90 with Gluon (the warp-specialized loop)
# and sm80/86, "int8_fp8" on other sm89+ GPUs; "int8_int8" is the int8 P·V choice, "int8_fp8_old" the scheme before
# the 16-bit keys (the speed baseline). hi_keys None = hi_key_count(Lk), 0 = none.
OURS = {"int8_fp16": ("int8", "fp16", None), "int8_fp8": ("int8", "fp8", None), "int8_fp8_old": ("int8", "fp8", 0),
        "int8_int8": ("int8", "int8", None)}
RIVALS = ("comfy_kitchen_int8",)  # comfy-kitchen's INT8 attention, as ComfyUI's --use-ck-attention runs it
BACKENDS = ("sdpa_cudnn", *OURS, *RIVALS, "prologue", "prologue_old")
KITCHEN_BACKENDS = ("sdpa_cudnn", "int8_fp16", "int8_int8", "int8_fp8")
FAMILY_BACKENDS = ("sdpa_cudnn", "int8_fp16", "int8_fp8", "int8_int8", "int8_fp8_old", "comfy_kitchen_int8")
FAMILY_HEADS = ERR_HEADS = 2
ERROR_BUDGET = 0.02
FAMILIES_FILE = reports.PACK_ROOT / "tests" / "unit" / "attention_families.py"
CHECK_SHAPES = ((1, 2, 77, 513, 64), (1, 2, 1000, 512, 128), (2, 2, 4097, 4097, 128))
CHECK_FAMILIES = ("gauss", "k_token_outliers", "token_outliers", "attention_sinks", "heavy_tailed_v")
WORKER_TIMEOUT_S = 240
KITCHEN_STEM = "bench_attention_kitchen"


def make_inputs(b: int, h: int, lq: int, lk: int, d: int, kind: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """bf16 [B, H, L, D] on the GPU; "outlier": 4 channels 20-50x, K channel bias, per-token RMSNorm."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=g) for n in (lq, lk, lk))
    if kind == "outlier":
        ch = torch.randperm(d, device="cuda", generator=g)[:4]
        mult = torch.tensor([20.0, 30.0, 40.0, 50.0], device="cuda")
        q[..., ch] *= mult
        k[..., ch] = k[..., ch] * mult + 2 * mult
        q, k = (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True)) for t in (q, k))  # per-token RMSNorm
        v = v + 0.5 * torch.randn(d, device="cuda", generator=g)
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def backend_fn(name: str) -> Callable[..., torch.Tensor] | str:
    """callable(q, k, v) -> out for a backend name, or why it cannot run here (a string)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "comfy_kitchen_int8":  # as ComfyUI runs it: [B, H, L, D] (last dim contiguous), scale 1/sqrt(D)
        try:
            import comfy_kitchen
        except Exception as exc:  # noqa: BLE001 - ImportError, or its CUDA extension failing to load
            return f"comfy_kitchen does not import: {reports.error_text(exc, 280)}"
        if not hasattr(comfy_kitchen, "int8_attention"):
            return f"comfy_kitchen {getattr(comfy_kitchen, '__version__', '?')} has no int8_attention"
        if not comfy_kitchen.int8_attention_is_available():
            return "comfy_kitchen.int8_attention_is_available() is False on this GPU"
        return comfy_kitchen.int8_attention
    if name == "sdpa_cudnn":  # SDPA with only its cuDNN backend allowed (sdpa_kernel used as a decorator)
        return sdpa_kernel(SDPBackend.CUDNN_ATTENTION)(F.scaled_dot_product_attention)
    if name in ("prologue", "prologue_old"):  # the auto formats' prologue; _old: without the key sort (hi_keys=0)
        qk, pv = A.resolve_formats(torch.device("cuda"))
        hi = 0 if name == "prologue_old" else None
        return lambda q, k, v: A.quantize_qkv(q, k, v, qk_format=qk, pv_format=pv, hi_keys=hi)
    qk, pv, hi = OURS[name]
    ours = A.attention_int8 if torch.cuda.is_available() else A.attention_int8_reference  # CPU smoke: fp32 emulation
    return lambda q, k, v: ours(q, k, v, qk_format=qk, pv_format=pv, hi_keys=hi)


def time_shapes(shape_names: list[str], fns: dict, repeats: int, errors: bool) -> list[dict]:
    """Every backend of ``fns`` timed at every shape (Gaussian inputs, all heads), its errors (ERR_HEADS) or why not."""
    rows = []
    for shape_name in shape_names:
        b, h, lq, lk, d = shape = SHAPES[shape_name]
        say(f"{shape_name} {shape}:")
        reps = repeats if lq * lk < 2e9 else max(3, repeats // 2)
        for name, fn in fns.items():
            row: dict = {"backend": name, "shape": list(shape)}
            try:
                if isinstance(fn, str):
                    raise BackendUnavailable(fn)
                q, k, v = make_inputs(b, h, lq, lk, d, "gauss")
                t0 = time.perf_counter()
                fn(q, k, v)  # first call: compile + autotune for ours
                torch.cuda.synchronize()
                row["first_call_s"] = round(time.perf_counter() - t0, 2)
                row["time_ms"] = time_fn(functools.partial(fn, q, k, v), q.device, reps, 2)
                if not name.startswith("prologue"):
                    row["tflops"] = 4 * b * h * lq * lk * d / (row["time_ms"] * 1e-3) / 1e12
                    for kind in ("gauss", "outlier") if errors else ():  # vs fp32 math, Gaussian and outlier-heavy
                        q, k, v = make_inputs(b, min(h, ERR_HEADS), lq, lk, d, kind, seed=1)
                        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
                        row[f"err_{kind}"] = A.relative_error(fn(q, k, v), ref)
                q = k = v = ref = None  # free the inputs before empty_cache (the timed partial is done with them)
            except BackendUnavailable as exc:
                row["skipped"] = str(exc)
            except Exception as exc:  # out of memory, an unsupported shape: a result, not a crash
                row["error"] = reports.error_text(exc, 500)
            torch.cuda.empty_cache()
            row["shape_name"] = shape_name
            say(f"  {name:10s} " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in row.items() if k not in ("shape", "shape_name", "backend")))
            rows.append(row)
    return rows


def check_kernel(names: list[str]) -> list[dict]:
    """The Triton kernel against its fp32 emulation and fp32 attention on small shapes, per family and format."""
    families, rows = families_module(), []
    for shape in CHECK_SHAPES:
        for family in CHECK_FAMILIES:
            for name in names:
                qk, pv, hi = OURS[name]
                row = {"shape": list(shape), "family": family, "backend": name}
                try:
                    q, k, v = families.make_family(family, *shape, seed=3, device="cuda")
                    out = A.attention_int8(q, k, v, qk_format=qk, pv_format=pv, hi_keys=hi)
                    emu = A.attention_int8_reference(q, k, v, qk_format=qk, pv_format=pv, block_n=128, hi_keys=hi)
                    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
                    row.update(err_vs_emulation=A.relative_error(out, emu), err_vs_fp32=A.relative_error(out, ref),
                               emulation_vs_fp32=A.relative_error(emu, ref))
                except Exception as exc:  # a failing check is a result
                    row["error"] = reports.error_text(exc, 400)
                rows.append(row)
        say(f"  checked {shape}: worst kernel vs emulation "
            f"{max((r.get('err_vs_emulation', 1.0) for r in rows if r['shape'] == list(shape)), default=1.0):.4f}")
    return rows


def families_module() -> SimpleNamespace:
    """tests/unit/attention_families.py, run by path (the tests are not a package)."""
    return SimpleNamespace(**runpy.run_path(str(FAMILIES_FILE)))


def family_errors(shape_name: str, shape: tuple[int, ...], fns: dict, families: list[str],
                  device: str = "cuda") -> list[dict]:
    """Error vs fp32 of each backend of ``fns`` on each input family at a shape's lengths, FAMILY_HEADS heads."""
    af = families_module()
    skipped = {n: why for n, why in fns.items() if isinstance(why, str)}
    b, _, lq, lk, d = shape
    rows = []
    for family in families:
        row: dict = {"shape_name": shape_name, "family": family, "errors": {}, "notes": dict(skipped)}
        try:
            q, k, v = af.make_family(family, b, FAMILY_HEADS, lq, lk, d, seed=7, device=device)
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
            row["logit_std"] = [round(x, 2) for x in af.logit_std(q, k).flatten().tolist()]
            for name, fn in ((n, f) for n, f in fns.items() if n not in skipped):
                try:
                    row["errors"][name] = A.relative_error(fn(q, k, v), ref)
                except Exception as exc:  # one backend failing on one family is a result
                    row["notes"][name] = reports.error_text(exc, 300)
            del ref
        except Exception as exc:  # e.g. out of memory building a family: record it, keep going
            row["notes"]["family"] = reports.error_text(exc, 300)
        say(f"  {shape_name} {family:40s} " + " ".join(f"{n}={e:.4f}" for n, e in row["errors"].items()))
        rows.append(row)
    return rows


# comfy-kitchen versions, each in its own process (the --worker child: main)
def install_wheels(dirs: list[Path], into: Path) -> list[dict]:
    """Each comfy-kitchen wheel in ``dirs`` unzipped into its own folder: [{wheel, site} or {wheel, error}]."""
    sites = []  # a wheel is a zip of its installed files, which is what ``pip install --target`` puts there
    for wheel in sorted(w for d in dirs for w in d.glob("comfy_kitchen-*.whl")):
        site = into / wheel.name.split("-")[1]
        try:
            with zipfile.ZipFile(wheel) as whl:
                whl.extractall(site)
            sites.append({"wheel": wheel.name, "site": str(site)})
        except (OSError, zipfile.BadZipFile) as exc:
            sites.append({"wheel": wheel.name, "error": f"unzip: {exc}"})
    return sites + [{"wheel": str(d), "error": "no such folder"} for d in dirs if not d.is_dir()]


def run_worker(site: str, args: argparse.Namespace) -> dict:
    """This script as a child with ``site`` ("" = the installed comfy-kitchen) first on its path."""
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", f"{reports.SUITE}.bench_attention_int8", "--kitchen", "--worker", site or "installed",
           "--repeats", str(args.repeats), "--shapes", *args.shapes, "--families", *args.families]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=WORKER_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return {"site": site, "error": f"timed out after {WORKER_TIMEOUT_S} s"}
    if "RESULT" not in proc.stdout:
        return {"site": site, "error": f"exit {proc.returncode}: {proc.stderr[-400:]}"}
    return json.loads(proc.stdout.split("RESULT", 1)[1])


def merge(report: dict, result: dict, label: str) -> None:
    """A worker's rows into the report (its timed rows, and its errors beside ours per shape and family)."""
    report["kitchen"].append({label: result.get("versions") or result.get("error")})
    report["rows"] += result.get("rows", [])
    by_key = {(r["shape_name"], r["family"]): r for r in report["families"]}
    for row in result.get("families", []):
        if (mine := by_key.get((row["shape_name"], row["family"]))) is None:
            report["families"].append(row)
        else:
            mine["errors"].update(row["errors"])
            mine["notes"].update(row["notes"])


def families_markdown(rows: list[dict]) -> list[str]:
    """One table per shape: family x backend error, over-budget cells in bold."""
    lines = [f"## Error vs fp32 per input family ({FAMILY_HEADS} heads; budget {ERROR_BUDGET:.0%}; "
             "families: tests/unit/attention_families.py)", ""]
    backends = list(dict.fromkeys(n for r in rows for n in r["errors"]))
    bold = lambda e: "—" if e is None else f"**{e:.2%}**" if e > ERROR_BUDGET else f"{e:.2%}"  # noqa: E731
    for shape_name in dict.fromkeys(r["shape_name"] for r in rows):
        mine = [r for r in rows if r["shape_name"] == shape_name]
        table = [[r["family"], r.get("logit_std", "—"), *(bold(r["errors"].get(n)) for n in backends)] for r in mine]
        notes = {k: v for r in mine for k, v in r["notes"].items()}
        lines += [f"### {shape_name}", "", *reports.table(["family", "logit std per head", *backends], table), "",
                  *[f"- {k}: {v}" for k, v in notes.items()], ""]
    return lines


def to_markdown(report: dict) -> list[str]:
    """The report: environment, timings, error per input family, the kernel vs its emulation, autotuner picks."""
    env, kitchen = report["env"], report["bench"] == KITCHEN_STEM
    title = ("attention_kitchen: the 8-bit attention vs cuDNN and comfy-kitchen versions" if kitchen else
             "attention_int8: the 8-bit attention kernel vs cuDNN and comfy-kitchen")
    lines = reports.header(title, env, [
        f"auto formats: {env.get('formats_auto')}; fp16 P·V loop: {env.get('fp16_pv_loop', 'triton')}; "
        f"comfy-kitchen versions measured: {report['kitchen'] or '—'}",
        "time: median of CUDA-event timings, Gaussian inputs, all heads; TFLOP/s = 4·B·H·Lq·Lk·D / t; errors: "
        f"‖out − fp32‖ / ‖fp32‖ on {ERR_HEADS} heads"])
    cudnn = {r["shape_name"]: r["time_ms"] for r in report["rows"] if r["backend"] == "sdpa_cudnn" and "time_ms" in r}
    timings = []  # per shape and backend: ms, TFLOP/s, speed-up over the shape's cuDNN row, errors
    for r in report["rows"]:
        base, ms = cudnn.get(r["shape_name"]), r.get("time_ms")
        vs = f"{base / ms:.2f}x" if base and ms and not r["backend"].startswith("prologue") else "—"
        note = r.get("error") or (f"skipped: {r['skipped']}" if r.get("skipped") else "")
        num = [reports.cell(r.get(k), f) for k, f in (("time_ms", "{:.2f}"), ("tflops", "{:.0f}"),
               ("err_gauss", "{:.4f}"), ("err_outlier", "{:.4f}"), ("first_call_s", "{:.1f}"))]
        timings.append([r["shape_name"], r["backend"], *num[:2], vs, *num[2:], reports.cell(note[:160])])
    lines += [*reports.table(["shape", "backend", "ms", "TFLOP/s", "vs cuDNN", "err gauss", "err outlier",
                              "first call s", "note"], timings), ""]
    if report["families"]:
        lines += families_markdown(report["families"])
    checks = [[r["shape"], r["family"], r["backend"], *(reports.cell(r.get(k), "{:.4f}") for k in (
        "err_vs_emulation", "err_vs_fp32", "emulation_vs_fp32")), reports.cell(r.get("error", "")[:100])]
        for r in report["checks"]]
    lines += ["## Kernel vs its emulation", "", *reports.table(["shape", "family", "backend", "vs emulation", "vs fp32",
                                                                "emulation vs fp32", "note"], checks)]
    return [*lines, "", "## Autotuner picks", "", "```", json.dumps(report["autotune"], indent=1), "```", ""]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command line; --shapes and --backends names are checked against the known ones."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kitchen", action="store_true", help="the attention_kitchen scenario (module docstring)")
    parser.add_argument("--no-sweep", action="store_true", help=argparse.SUPPRESS)  # recorded commands pass it
    parser.add_argument("--repeats", type=int, default=None, help="timed calls (default 10; 6 with --kitchen)")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), help="time these shapes (default: all)")
    parser.add_argument("--backends", nargs="+", choices=list(BACKENDS), default=None,
                        help="timed rows per shape (default: all; --kitchen: cuDNN and our fp8 / int8 P·V)")
    parser.add_argument("--families", nargs="*", default=None, metavar="FAMILY",
                        help="also measure the error per input family (no name: every family and combination; "
                             "always on with --kitchen)")
    parser.add_argument("--wheels", nargs="*", type=Path, default=[],
                        help="--kitchen: folders of comfy-kitchen wheels, each version measured in its own process")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true",
                        help="CPU: the family errors of ours (fp32 emulation) at a tiny shape; no timing")
    parser.add_argument("--out", type=Path, default=reports.RESULTS)
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (6 if args.kitchen else 10)
    args.shapes = args.shapes or list(SHAPES)
    args.backends = args.backends or list(KITCHEN_BACKENDS if args.kitchen else BACKENDS)
    if args.families == [] or (args.families is None and (args.kitchen or args.smoke)):
        args.families = list(families_module().ALL_FAMILIES)
    return args


def main(argv: list[str] | None = None) -> int:
    """Either scenario (``--kitchen``), the ``--worker`` child or the CPU ``--smoke``, from ``argv``."""
    args = parse_args(argv)
    if args.worker is not None:  # the child timing the comfy-kitchen importable here (its site first on sys.path)
        out: dict = {"site": args.worker}
        try:
            label, fn = f"comfy_kitchen {metadata.version('comfy-kitchen')}", backend_fn("comfy_kitchen_int8")
            if isinstance(fn, str):  # not importable, too old for int8 attention, or not on this GPU
                raise BackendUnavailable(fn)
            out["versions"] = [label]
            out["rows"] = time_shapes(args.shapes, {label: fn}, args.repeats, errors=False)
            out["families"] = [r for s in args.shapes for r in family_errors(s, SHAPES[s], {label: fn}, args.families)]
        except Exception as exc:  # not installed, too old for int8 attention, extension not loading
            out["error"] = reports.error_text(exc, 400)
        print("RESULT" + json.dumps(out, default=str), flush=True)  # JSON on stdout, read by run_worker
        return 0
    if args.smoke:  # every family's error for ours (the emulation of the new and the old scheme), tiny shape
        fns = {n: backend_fn(n) for n in ("int8_fp16", "int8_fp8", "int8_fp8_old")}
        rows = family_errors("smoke", (1, FAMILY_HEADS, 256, 256, 128), fns, args.families, device="cpu")
        bad = [r["family"] for r in rows if r["errors"].get("int8_fp16", 1.0) > ERROR_BUDGET or r["notes"]]
        say("\n".join(families_markdown(rows)))
        say(f"smoke: {len(rows)} families, over budget with int8_fp16: {bad or 'none'}")
        return 1 if bad else 0
    if not torch.cuda.is_available():
        say("bench_attention_int8: needs a CUDA GPU (--smoke runs the family errors on the CPU)")
        return 2
    dev = torch.device("cuda")
    env = reports.environment(f"{reports.SUITE}.bench_attention_int8", argv, dev)
    env["formats_auto"] = list(A.resolve_formats(dev)) if A.is_supported(dev, torch.bfloat16, 128) else None
    loop = env["fp16_pv_loop"] = "gluon (warp-specialized)" if A.gluon_loop_usable(dev) else "triton"
    say(f"device {env['gpu']} (sm{env['compute_capability']}), torch {env['torch']}, "
        f"triton {env['triton']}, comfy_kitchen {env['comfy_kitchen']}, auto formats {env['formats_auto']}")
    stem = KITCHEN_STEM if args.kitchen else "bench_attention_int8"
    report = {"bench": stem, "env": env, "kitchen": [], "rows": [], "families": [], "autotune": {}, "checks": []}

    def write() -> None:  # after every stage, so a run cut short still leaves what it measured
        report["autotune"] = A.chosen_configs()
        failure = A.gluon_loop_failure()  # the Gluon loop failed mid-run: Triton's loop ran from then on
        env["fp16_pv_loop"] = f"{loop} (failed, then Triton's: {failure})" if failure else loop
        reports.write(args.out, stem, report, to_markdown(report))

    say("kernel vs emulation:")  # first, so that a broken kernel shows before the long timings
    report["checks"] = check_kernel([n for n in OURS if n in args.backends])
    fns = {n: backend_fn(n) for n in args.backends}
    report["rows"] = time_shapes(args.shapes, fns, args.repeats, errors=not args.kitchen)
    write()
    if args.families is not None:
        say(f"error per input family ({FAMILY_HEADS} heads):")
        names = [n for n in args.backends if not n.startswith("prologue")] if args.kitchen else FAMILY_BACKENDS
        fns = {n: backend_fn(n) for n in names}
        for shape_name in args.shapes:
            report["families"] += family_errors(shape_name, SHAPES[shape_name], fns, args.families)
            write()
    if args.kitchen:  # each comfy-kitchen version in its own process: the installed one, the wheels of --wheels
        with tempfile.TemporaryDirectory(prefix="ck_sites_") as tmp:
            for entry in [{"wheel": "installed", "site": ""}, *install_wheels(args.wheels, Path(tmp))]:
                say(f"comfy-kitchen {entry['wheel']}:")
                result = run_worker(entry["site"], args) if "site" in entry else {"error": entry["error"]}
                merge(report, result, entry["wheel"])
                write()
    say(f"wrote {args.out / stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
