"""Scenario ``attention_kitchen``: the 8-bit attention vs cuDNN and comfy-kitchen versions, error per family and speed.

At Wan 2.2 14B 480p and 720p self- and cross-attention: the Triton kernel against its fp32 emulation (small
shapes, every P·V format), the error vs fp32 of each backend on every input family of
tests/unit/attention_families.py, and the time of each backend on Gaussian inputs at the full head count. The pack
and cuDNN run in this process; each comfy-kitchen version runs in a child process of this script with only that
version on its path (two versions of one package cannot share a process): the installed one, if any, and each
wheel found in ``--wheels DIR...``, installed with ``pip install --no-index --no-deps --target``. Inputs are made on
the GPU from fixed seeds, so every process sees the same values. A version that does not install or import, a
backend that raises or a shape that runs out of memory is a row of the result, never the end of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F

from comfyui_lowvram_dit.benchmarks import bench_attention_int8 as B
from comfyui_lowvram_dit.benchmarks import report as reports
from comfyui_lowvram_dit.benchmarks.timing import time_fn
from comfyui_lowvram_dit.kernels import attention_int8 as A

SHAPES = {name: B.SHAPES[name] for name in ("wan14b_480p_self", "wan14b_480p_cross", "wan14b_720p_self",
                                             "wan14b_720p_cross")}
# ours: (Q·Kᵀ format, P·V format); "int8_int8" is what "auto" runs, "int8_fp8" the P·V before it
OURS = {"int8_int8": ("int8", "int8"), "int8_fp8": ("int8", "fp8")}
CHECK_SHAPES = ((1, 2, 77, 513, 64), (1, 2, 1000, 512, 128), (2, 2, 4097, 4097, 128))
CHECK_FAMILIES = ("gauss", "k_token_outliers", "token_outliers", "attention_sinks", "heavy_tailed_v")
WORKER_TIMEOUT_S = 240
STEM = "bench_attention_kitchen"


def say(msg: str) -> None:
    print(msg, flush=True)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:400]


def pack_backends() -> dict:
    """{name: fn(q, k, v)} of cuDNN and our formats (this process)."""
    fns = {"sdpa_cudnn": B.backend_fn("sdpa_cudnn")}
    for name, (qk, pv) in OURS.items():
        fns[name] = (lambda qk_, pv_: lambda q, k, v: A.attention_int8(q, k, v, qk_format=qk_, pv_format=pv_))(qk, pv)
    return fns


def check_kernel(families) -> list[dict]:  # noqa: ANN001 - the attention_families module
    """The Triton kernel against its fp32 emulation and fp32 attention, per P·V format, on small shapes."""
    rows = []
    for shape in CHECK_SHAPES:
        for family in CHECK_FAMILIES:
            for name, (qk, pv) in OURS.items():
                row = {"shape": list(shape), "family": family, "backend": name}
                try:
                    q, k, v = families.make_family(family, *shape, seed=3, device="cuda")
                    out = A.attention_int8(q, k, v, qk_format=qk, pv_format=pv)
                    emu = A.attention_int8_reference(q, k, v, qk_format=qk, pv_format=pv, block_n=128)
                    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
                    row.update(err_vs_emulation=A.relative_error(out, emu), err_vs_fp32=A.relative_error(out, ref),
                               emulation_vs_fp32=A.relative_error(emu, ref))
                except Exception as exc:  # a failing check is a result
                    row["error"] = _error_text(exc)
                rows.append(row)
        say(f"  checked {shape}: worst kernel vs emulation "
            f"{max((r.get('err_vs_emulation', 1.0) for r in rows if r['shape'] == list(shape)), default=1.0):.4f}")
    return rows


def measure(fns: dict, shape_names: list[str], family_names: list[str], repeats: int) -> dict:
    """{"speed": rows, "errors": rows} for every backend in fns at every shape (each failure a row)."""
    families = B.families_module()
    speed, errors = [], []
    for shape_name in shape_names:
        b, h, lq, lk, d = SHAPES[shape_name]
        for name, fn in fns.items():
            row = {"shape_name": shape_name, "backend": name}
            try:
                q, k, v = B.make_inputs(b, h, lq, lk, d, "gauss")
                t0 = time.perf_counter()
                fn(q, k, v)
                torch.cuda.synchronize()
                row["first_call_s"] = round(time.perf_counter() - t0, 2)
                times = time_fn(lambda: fn(q, k, v), q.device, repeats, 2)
                row["time_ms"] = sorted(times)[len(times) // 2]
                del q, k, v
            except Exception as exc:  # out of memory, an unsupported shape: a result
                row["error"] = _error_text(exc)
            torch.cuda.empty_cache()
            speed.append(row)
        errors += B.family_errors(shape_name, SHAPES[shape_name], fns, {}, family_names)
    return {"speed": speed, "errors": errors}


def kitchen_fns() -> dict:
    """{"comfy_kitchen <version>": fn} in this process, or {} with the reason printed as a note."""
    from importlib import metadata

    fn = B.backend_fn("comfy_kitchen_int8")
    return {f"comfy_kitchen {metadata.version('comfy-kitchen')}": fn}


def worker(args: argparse.Namespace) -> int:
    """--worker: measure the comfy-kitchen importable here (its site dir first on sys.path); JSON on stdout."""
    out: dict = {"site": args.worker}
    try:
        fns = kitchen_fns()
        out["versions"] = list(fns)
        out.update(measure(fns, args.shapes, args.families, args.repeats))
    except Exception as exc:  # not installed, too old for int8 attention, extension not loading
        out["error"] = _error_text(exc)
    print("RESULT" + json.dumps(out, default=str), flush=True)
    return 0


def install_wheels(dirs: list[Path], into: Path) -> list[dict]:
    """Each comfy-kitchen wheel in dirs installed into its own --target folder: [{wheel, site} or {wheel, error}]."""
    sites = []
    for wheel in sorted(w for d in dirs for w in d.glob("comfy_kitchen-*.whl")):
        site = into / wheel.name.split("-")[1]
        entry = {"wheel": wheel.name, "site": str(site)}
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--target",
                               str(site), str(wheel)], capture_output=True, text=True, check=False)
        if proc.returncode:  # no pip in this Python: a wheel is a zip of the installed files
            try:
                with zipfile.ZipFile(wheel) as whl:
                    whl.extractall(site)
                entry["note"] = f"unzipped (pip failed: {(proc.stderr or proc.stdout)[-200:]})"
            except (OSError, zipfile.BadZipFile) as exc:
                entry = {"wheel": wheel.name, "error": f"pip: {(proc.stderr or proc.stdout)[-200:]}; unzip: {exc}"}
        sites.append(entry)
    for d in dirs:
        if not d.is_dir():
            sites.append({"wheel": str(d), "error": "no such folder"})
    return sites


def run_worker(site: str, args: argparse.Namespace) -> dict:
    """This script as a child with ``site`` ("" = the installed comfy-kitchen) first on its path."""
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", f"{reports.SUITE}.{STEM}", "--worker", site or "installed", "--repeats",
           str(args.repeats), "--shapes", *args.shapes, "--families", *args.families]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=WORKER_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return {"site": site, "error": f"timed out after {WORKER_TIMEOUT_S} s"}
    if "RESULT" not in proc.stdout:
        return {"site": site, "error": f"exit {proc.returncode}: {proc.stderr[-400:]}"}
    return json.loads(proc.stdout.split("RESULT", 1)[1])


def _speed_table(rows: list[dict]) -> list[str]:
    cudnn = {r["shape_name"]: r["time_ms"] for r in rows if r["backend"] == "sdpa_cudnn" and "time_ms" in r}
    lines = ["| shape | backend | ms | vs cuDNN | first call s | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        ms, base = r.get("time_ms"), cudnn.get(r["shape_name"])
        lines.append(f"| {r['shape_name']} | {r['backend']} | {'—' if ms is None else f'{ms:.2f}'} | "
                     f"{f'{base / ms:.2f}x' if ms and base else '—'} | {r.get('first_call_s', '—')} | "
                     f"{r.get('error', '')[:120]} |")
    return lines


def _error_table(rows: list[dict]) -> list[str]:
    names = list(dict.fromkeys(n for r in rows for n in r["errors"]))
    lines = ["| shape | family | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for r in rows:
        cells = [f"{r['errors'][n]:.2%}" if n in r["errors"] else r["notes"].get(n, "—")[:40] for n in names]
        lines.append(f"| {r['shape_name']} | {r['family']} | " + " | ".join(cells) + " |")
    return lines


def to_markdown(report: dict) -> str:
    """The report as markdown: environment, kernel checks, speed, error per family and shape."""
    env = report["env"]
    lines = [*reports.header("attention_kitchen: the 8-bit attention vs cuDNN and comfy-kitchen versions", env,
                             [f"comfy-kitchen versions measured: {report['kitchen']}"]), "## Kernel vs its emulation", "",
             "| shape | family | backend | vs emulation | vs fp32 | emulation vs fp32 | note |", "|---|---|---|---|---|---|---|"]
    for r in report["checks"]:
        f = lambda key: f"{r[key]:.4f}" if key in r else "—"  # noqa: E731
        lines.append(f"| {r['shape']} | {r['family']} | {r['backend']} | {f('err_vs_emulation')} | "
                     f"{f('err_vs_fp32')} | {f('emulation_vs_fp32')} | {r.get('error', '')[:100]} |")
    lines += ["", "## Speed (Gaussian inputs, all heads; median of CUDA-event timings)", "",
              *_speed_table(report["speed"]), "", f"## Error vs fp32 per input family ({B.FAMILY_HEADS} heads)", "",
              *_error_table(report["errors"]), ""]
    return "\n".join(lines)


def merge(report: dict, result: dict, label: str) -> None:
    """A worker's rows into the report (its speed rows, and its errors beside ours per shape and family)."""
    report["kitchen"].append({label: result.get("versions") or result.get("error")})
    report["speed"] += result.get("speed", [])
    by_key = {(r["shape_name"], r["family"]): r for r in report["errors"]}
    for row in result.get("errors", []):
        mine = by_key.get((row["shape_name"], row["family"]))
        if mine is None:
            report["errors"].append(row)
        else:
            mine["errors"].update(row["errors"])
            mine["notes"].update(row["notes"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--families", nargs="+", default=None, help="default: every family and combination")
    parser.add_argument("--wheels", nargs="*", type=Path, default=[],
                        help="folders holding comfy-kitchen wheels, each version measured in its own process")
    parser.add_argument("--no-installed", action="store_true", help="skip the comfy-kitchen installed here")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=reports.RESULTS)
    args = parser.parse_args(argv)
    args.families = args.families or list(B.families_module().ALL_FAMILIES)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker(args)
    if not torch.cuda.is_available():
        say(f"{STEM}: needs a CUDA GPU")
        return 2
    env = reports.environment(f"{reports.SUITE}.{STEM}", argv, torch.device("cuda"))
    report: dict = {"bench": STEM, "env": env, "kitchen": [], "checks": [], "speed": [], "errors": []}

    def write() -> None:  # after every stage: a run cut short keeps what it measured
        reports.write(args.out, STEM, report, [to_markdown(report)])

    say("kernel vs emulation:")
    report["checks"] = check_kernel(B.families_module())
    write()
    say("pack and cuDNN:")
    report.update(measure(pack_backends(), args.shapes, args.families, args.repeats))
    write()
    with tempfile.TemporaryDirectory(prefix="ck_sites_") as tmp:
        sites = [] if args.no_installed else [{"wheel": "installed", "site": ""}]
        sites += install_wheels(args.wheels, Path(tmp))
        for entry in sites:
            say(f"comfy-kitchen {entry['wheel']}:")
            result = run_worker(entry["site"], args) if "site" in entry else {"error": entry["error"]}
            merge(report, result, entry["wheel"])
            write()
    say(f"wrote {args.out / STEM}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
