"""The in-process scenarios' runner: each variant in a fresh process, honest peaks, one report (README.md).

A variant's target ``"module:function"`` is imported in the child and called as ``target(ctx, **kwargs)``; it
returns ``{"fn": callable, ...metrics}`` (``fn`` is timed: ``warmup`` calls, then the median of ``repeats``) or a
plain metrics dict. Child: ``python -m comfyui_lowvram_dit.benchmarks.harness --child SPEC.json RESULT.json``.
Only the standard library at module level (torch inside functions).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable
from comfyui_lowvram_dit.checkpoints.safe_write import write_report
from comfyui_lowvram_dit.host.version import comfyui_version

log = logging.getLogger("comfyui_lowvram_dit")

PACKAGE = "comfyui_lowvram_dit"
PACK_ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
CHILD_MODULE = f"{PACKAGE}.benchmarks.harness"
GIB = float(1 << 30)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One measured configuration: ``target`` is ``"module:function"``, called as ``target(ctx, **kwargs)``.

    ``timeout_s`` overrides ``run_benchmark``'s per-variant time limit for this variant.
    """

    name: str
    target: str
    kwargs: dict = dataclasses.field(default_factory=dict)
    timeout_s: float | None = None


@dataclasses.dataclass
class BenchContext:
    """What a target gets as ``ctx``: the device to run on and the timing settings."""

    variant: str
    device: Any  # torch.device: "cuda" when available (and not forced off), else "cpu"
    repeats: int
    warmup: int

    def sync(self) -> None:
        """Wait for queued GPU work (no-op on CPU)."""
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)


# --------------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------------


def git_sha(repo: Path = PACK_ROOT) -> str | None:
    """``HEAD`` of the pack checkout, with ``-dirty`` when tracked files differ; None outside git."""
    try:
        sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{sha}-dirty" if dirty else sha


def public_path(arg: str) -> str:
    """A command-line word as results may show it: no path of the machine that ran the benchmark.

    The output folder becomes ``$OUT``, ComfyUI's folder ``<ComfyUI>``, the repository's own files repo-relative,
    the home folder ``~``, the temporary folder ``<tmp>`` and the interpreter ``python3``; other words are kept.
    """
    if arg == sys.executable:
        return "python3"
    repo = Path(__file__).resolve().parent.parent
    # In this order, so that the more telling name wins where one folder lies in another: $OUT or ComfyUI in the
    # home or temporary folder, the repository (or a link to it) there too.
    roots = ((os.environ.get("OUT"), "$OUT"), (os.environ.get("COMFYUI_PATH"), "<ComfyUI>"), (str(repo), None),
             (str(Path.home()), "~"), (tempfile.gettempdir(), "<tmp>"))
    for root, name in roots:
        if not root or not arg.startswith("/"):
            continue
        for candidate in (Path(arg), Path(arg).resolve()):
            try:
                rel = candidate.relative_to(root)
                break
            except ValueError:
                rel = None
        if rel is None:
            continue
        if name is None:
            return str(rel)
        return name if str(rel) == "." else f"{name}/{rel}"
    return arg


PLACEHOLDERS = ("$OUT", "~", "<ComfyUI>", "<tmp>")


def public_command(words: list[str]) -> str:
    """A command line as results may show it: each word through ``public_path``, shell-quoted unless it starts with
    a placeholder (quotes would only hide that ``$OUT`` and ``~`` stand for folders)."""
    return " ".join(w if w.startswith(PLACEHOLDERS) else shlex.quote(w) for w in map(public_path, words))


ENV_KEYS = ("device_name", "compute_capability", "torch", "torch_cuda", "triton", "git_sha", "timestamp", "command")


def env_bullets(env: dict, keys: tuple[str, ...] = ENV_KEYS) -> list[str]:
    """A report's environment as markdown bullets (command and git sha as code), skipping facts not recorded."""
    return [f"- {key}: `{env[key]}`" if key in ("command", "git_sha") else f"- {key}: {env[key]}"
            for key in keys if env.get(key) is not None]


def public_text(text: str) -> str:
    """Free text (a child's stderr, a traceback) as results may show it: ComfyUI's folder as ``ComfyUI/``, the
    output folder as ``$OUT/``, the repository's files repo-relative (through a link to it too), home as ``~/``,
    the temporary folder as ``<tmp>/``."""
    repo = Path(__file__).parent.parent
    roots = {os.environ.get("COMFYUI_PATH"): "ComfyUI/", os.environ.get("OUT"): "$OUT/", str(repo): "",
             str(repo.resolve()): "", str(Path.home()): "~/", tempfile.gettempdir(): "<tmp>/"}
    names = {str(Path(root)) + os.sep: name for root, name in roots.items() if root}
    # Longest first, so that a folder inside another one wins; a folder only where a path starts, so that the
    # temporary folder /tmp is not found inside /var/tmp.
    pattern = "|".join(map(re.escape, sorted(names, key=len, reverse=True)))
    return re.sub(rf"(?<![\w.~/-])(?:{pattern})", lambda m: names[m.group(0)], text)


SUITE = f"{PACKAGE}.benchmarks"


def command_argv(module: str, argv: list[str] | None) -> list[str]:
    """The command line a report records: the suite's as typed (``-m PKG SCENARIO ...``) when run through it, else
    ``-m module`` plus ``argv`` (a scenario's ``main`` called directly)."""
    if sys.argv[:2] == ["-m", SUITE]:
        return list(sys.argv)
    return ["-m", module, *(sys.argv[1:] if argv is None else argv)]


def parent_environment(argv: list[str] | None = None) -> dict:
    """Facts the parent knows without touching the GPU: command, git sha, Python, ComfyUI."""
    argv = list(sys.argv if argv is None else argv)
    comfy = os.environ.get("COMFYUI_PATH")
    prefix = f"COMFYUI_PATH={public_command([comfy])} " if comfy else ""
    return {
        "command": prefix + public_command(["python3", *argv]),
        "git_sha": git_sha(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "comfyui_path": public_path(comfy) if comfy else None,
        "comfyui_version": comfyui_version(os.environ.get("COMFYUI_PATH")),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def child_environment(device: Any) -> dict:
    """Facts only the child knows: torch, CUDA, the device it ran on."""
    import torch

    env = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "device_type": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, compute_capability=f"{props.major}.{props.minor}",
                   vram_total_gib=round(props.total_memory / GIB, 2))
    else:
        env.update(device_name=f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    return env


def gpu_script_environment(module: str, argv: list[str] | None, device: Any) -> dict:
    """The environment of a scenario that runs on the GPU in its own process: ``parent_environment`` (its command
    as ``command_argv`` records it), the facts of ``device`` and the versions of ``software_facts``."""
    env = parent_environment(command_argv(module, argv))
    env.update({k: v for k, v in child_environment(device).items() if k not in env})
    return {**software_facts(), **env}  # the imported torch's own version string wins


def software_facts() -> dict:
    """Versions of torch, Triton, comfy-kitchen and comfy-aimdo in this Python (read without importing them)."""
    from importlib import metadata

    out = {}
    for dist in ("torch", "triton", "comfy-kitchen", "comfy-aimdo"):
        try:
            out[dist.replace("-", "_")] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist.replace("-", "_")] = None
    return out


# --------------------------------------------------------------------------------------------------
# Child side
# --------------------------------------------------------------------------------------------------


def resolve_target(target: str) -> Callable[..., Any]:
    """Import ``"module:function"`` and return the function."""
    module_name, sep, func_name = target.partition(":")
    if not sep or not module_name or not func_name:
        raise ValueError(f"Variant target {target!r} must look like 'package.module:function'")
    return getattr(importlib.import_module(module_name), func_name)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far.

    Linux: ``VmHWM`` of ``/proc/self/status``, the high-water mark of this address space. Not ``ru_maxrss``: Linux
    carries that across fork + exec, so a child started by a parent holding 6 GB would report the parent's 6 GB.
    Elsewhere ``ru_maxrss`` (bytes on macOS), or psutil's peak working set on Windows."""
    if sys.platform.startswith("linux"):
        from comfyui_lowvram_dit.cli.memwatch import proc_status

        hwm = proc_status(os.getpid()).get("VmHWM")
        if hwm:
            return hwm
    try:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)
    except ImportError:  # Windows: psutil's peak working set is the same idea
        import psutil

        return int(getattr(psutil.Process().memory_info(), "peak_wset", psutil.Process().memory_info().rss))


def time_fn(fn: Callable[[], Any], device: Any, repeats: int, warmup: int) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``fn`` after ``warmup`` calls (CUDA events on GPU)."""
    import torch

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    times: list[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(float(start.elapsed_time(end)))
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def _jsonable(value: Any) -> Any:
    """Metrics as JSON: tensors/dtypes/devices become strings or numbers, unknown objects their repr."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and getattr(value, "numel", lambda: 2)() == 1:
        return _jsonable(value.item())
    return str(value)


def _pick_device(force_cpu: bool) -> Any:
    import torch

    if not force_cpu and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run_variant(spec: dict) -> dict:
    """Run one variant in this process and return its result record (never raises for the variant's errors)."""
    import torch

    device = _pick_device(bool(spec.get("force_cpu")))
    result: dict = {"name": spec["name"], "target": spec["target"], "kwargs": spec.get("kwargs", {}),
                    "status": "error", "env": child_environment(device)}
    ctx = BenchContext(variant=spec["name"], device=device, repeats=int(spec["repeats"]),
                       warmup=int(spec["warmup"]))
    cuda = device.type == "cuda"
    phase = "setup"
    watch = _self_watch()
    try:
        target = resolve_target(spec["target"])
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        out = target(ctx, **spec.get("kwargs", {}))
        result["setup_s"] = round(time.perf_counter() - t0, 4)
        if cuda:
            torch.cuda.synchronize(device)
            result["setup_peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
            result["setup_peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        if out is None:
            out = {}
        if not isinstance(out, dict):
            raise TypeError(f"target {spec['target']} returned {type(out).__name__}; expected a dict "
                            "({'fn': callable, ...metrics} or a metrics dict)")
        fn = out.pop("fn", None)
        after = out.pop("after", None)  # metrics read after the timed calls (e.g. recompiles during them)
        result["metrics"] = _jsonable(out)
        if fn is not None:
            phase = "run"
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            times = time_fn(fn, device, ctx.repeats, ctx.warmup)
            result.update(times_ms=times, time_ms=statistics.median(times), time_ms_min=min(times),
                          time_ms_max=max(times), timer="cuda_events" if cuda else "perf_counter")
            if cuda:
                result["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
                result["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        if after is not None:
            result["metrics"].update(_jsonable(after()))
        result["status"] = "ok"
    except Exception as exc:  # the variant's failure is data, not a crash of the benchmark
        oom = isinstance(exc, getattr(torch, "OutOfMemoryError", ())) or "out of memory" in str(exc).lower()
        result["status"] = "oom" if oom else "error"
        result["error"] = f"{type(exc).__name__} during {phase}: {exc}"[:2000]
        result["traceback"] = traceback.format_exc()[-4000:]
    result["peak_rss_gib"] = peak_rss_bytes() / GIB
    if watch is not None:  # ru_maxrss also counts resident pages of mapped files; anon is what the OOM killer weighs
        watch.stop()
        summary = watch.summary()
        result["peak_rss_anon_gib"] = summary["peak_rss_anon_gib"]
        result["peak_rss_file_gib"] = summary["peak_rss_file_gib"]
    return result


def _self_watch():  # noqa: ANN202 - memwatch.MemoryWatch | None
    """Sample this process's anonymous vs file-backed RSS (Linux; None elsewhere)."""
    if not sys.platform.startswith("linux"):
        return None
    from comfyui_lowvram_dit.cli.memwatch import MemoryWatch

    return MemoryWatch(os.getpid(), interval=0.1, gpu=False).__enter__()  # GPU memory: torch's own counters


def child_main(argv: list[str]) -> int:
    """``--child SPEC RESULT``: run the variant described in SPEC and write its record to RESULT."""
    parser = argparse.ArgumentParser(prog=f"python -m {CHILD_MODULE}")
    parser.add_argument("--child", nargs=2, metavar=("SPEC_JSON", "RESULT_JSON"), required=True)
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.child[0]).read_text(encoding="utf-8"))
    result = run_variant(spec)
    write_report(Path(args.child[1]), json.dumps(result, indent=1))
    return 0


# --------------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------------


def _package_shim() -> Path:
    """A temp dir holding ``comfyui_lowvram_dit -> <this checkout>`` so children import exactly this code."""
    shim = Path(tempfile.mkdtemp(prefix="lowvram_dit_shim_"))
    (shim / PACKAGE).symlink_to(PACK_ROOT, target_is_directory=True)
    return shim


def _child_env(shim: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(shim), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _run_in_child(spec: dict, shim: Path, workdir: Path, timeout_s: float | None) -> dict:
    spec_path, result_path = workdir / f"{spec['index']}_spec.json", workdir / f"{spec['index']}_result.json"
    write_report(spec_path, json.dumps(spec))
    cmd = [sys.executable, "-m", CHILD_MODULE, "--child", str(spec_path), str(result_path)]
    record: dict = {"name": spec["name"], "target": spec["target"], "kwargs": spec["kwargs"],
                    "child_command": public_command(cmd)}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=_child_env(shim), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        record.update(status="timeout", error=f"child exceeded {timeout_s} s",
                      stderr_tail=public_text((exc.stderr or b"")[-3000:].decode("utf-8", "replace")
                                              if isinstance(exc.stderr, bytes) else str(exc.stderr or "")[-3000:]))
        return record
    record["wall_s"] = round(time.perf_counter() - t0, 3)
    if result_path.exists():
        record.update(json.loads(result_path.read_text(encoding="utf-8")))
    else:  # killed (e.g. host OOM, segfault) before it could write its record
        record.update(status="crashed", error=f"child exited with code {proc.returncode} and wrote no result")
    record["returncode"] = proc.returncode
    if record.get("status") != "ok":
        record["stderr_tail"] = public_text(proc.stderr[-3000:])
    return record


def public_record(record: dict) -> dict:
    """A variant's record as results may show it: path words in its kwargs through ``public_path`` (the target
    was called with the real ones), its error and traceback through ``public_text``."""
    def shown(value: Any) -> Any:
        if isinstance(value, str):
            return public_path(value)
        if isinstance(value, dict):
            return {k: shown(v) for k, v in value.items()}
        return [shown(v) for v in value] if isinstance(value, (list, tuple)) else value

    texts = {key: public_text(record[key]) for key in ("error", "traceback") if isinstance(record.get(key), str)}
    return {**record, "kwargs": shown(record.get("kwargs", {})), **texts}


def run_benchmark(bench: str, variants: list[Variant], *, repeats: int = 10, warmup: int = 3,
                  out_dir: Path = RESULTS, fresh_process: bool = True, plot: str | None = "time_ms",
                  force_cpu: bool = False, timeout_s: float | None = 3600.0,
                  argv: list[str] | None = None) -> list[dict]:
    """Run every variant (each in a fresh process by default) and write ``<bench>.json/.md/.png``."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", bench):
        raise ValueError(f"bench name {bench!r} must be a plain file stem (letters, digits, _ . -)")
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"variant names must be unique, got {names}")
    env = parent_environment(argv)
    env["fresh_process"] = fresh_process
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix=f"bench_{bench}_") as tmp:
        shim = _package_shim() if fresh_process else None
        try:
            for index, variant in enumerate(variants):
                spec = {"index": index, "name": variant.name, "target": variant.target,
                        "kwargs": dict(variant.kwargs), "repeats": repeats, "warmup": warmup,
                        "force_cpu": force_cpu}
                log.info("bench %s: variant %d/%d %s", bench, index + 1, len(variants), variant.name)
                if fresh_process:
                    limit = variant.timeout_s if variant.timeout_s is not None else timeout_s
                    record = _run_in_child(spec, shim, Path(tmp), limit)
                else:
                    record = run_variant(spec)
                results.append(public_record(record))
                if index + 1 < len(variants):  # reports so far: a run cut short still leaves its numbers
                    _report(bench, results, env, out_dir, None, repeats, warmup, fresh_process)
        finally:
            if shim is not None:
                (shim / PACKAGE).unlink(missing_ok=True)
                shim.rmdir()
    _report(bench, results, env, out_dir, plot, repeats, warmup, fresh_process)
    return results


def _report(bench: str, results: list[dict], env: dict, out_dir: Path, plot: str | None, repeats: int,
            warmup: int, fresh_process: bool) -> None:
    for record in results:  # the child's view of the device is the environment's device
        if record.get("env"):
            env.update({k: v for k, v in record["env"].items() if k not in env})
            break
    write_reports(bench, results, env, out_dir=Path(out_dir), plot=plot,
                  settings={"repeats": repeats, "warmup": warmup, "fresh_process": fresh_process})


# --------------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------------


def _rss(r: dict) -> str:
    """Peak RSS cell: ru_maxrss, with the sampled anonymous peak when there is one."""
    anon = r.get("peak_rss_anon_gib")
    return _fmt(r.get("peak_rss_gib")) + (f" (anon {anon:.2f})" if anon is not None else "")


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(bench: str, results: list[dict], env: dict, settings: dict, notes: list[str]) -> str:
    """The markdown report: environment, then one row per variant (ratio vs the first successful one)."""
    base = next((r["time_ms"] for r in results if r.get("status") == "ok" and r.get("time_ms")), None)
    lines = [f"# {bench}", ""]
    lines += env_bullets(env, ("device_name", "compute_capability", "torch", "torch_cuda", "python",
                               "comfyui_version", "git_sha", "timestamp", "command"))
    lines.append(f"- timing: median of {settings['repeats']} after {settings['warmup']} warm-up calls"
                 f"{', each variant in a fresh process' if settings['fresh_process'] else ', in-process'}")
    lines += ["", "| variant | status | median ms | min ms | ratio vs first | peak alloc GiB | "
                  "peak reserved GiB | peak RSS GiB | setup s | metrics / error |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        t = r.get("time_ms")
        ratio = f"{base / t:.3f}x" if base and t else "—"
        if r.get("status") == "ok":
            extra = ", ".join(f"{k}={_fmt(v, 3)}" for k, v in (r.get("metrics") or {}).items()
                              if not isinstance(v, (dict, list)))
        else:
            extra = (r.get("error") or "").splitlines()[0][:200] if r.get("error") else ""
        extra = extra.replace("|", "\\|")
        lines.append(f"| {r['name']} | {r.get('status')} | {_fmt(t)} | {_fmt(r.get('time_ms_min'))} | {ratio} | "
                     f"{_fmt(r.get('peak_allocated_gib'))} | {_fmt(r.get('peak_reserved_gib'))} | "
                     f"{_rss(r)} | {_fmt(r.get('setup_s'), 1)} | {extra} |")
    if notes:
        lines += [""] + [f"Note: {n}" for n in notes]
    return "\n".join(lines) + "\n"


def write_plot(path: Path, bench: str, results: list[dict], metric: str, env: dict) -> str | None:
    """Bar chart of ``metric`` per variant; returns a note instead when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    names = [r["name"] for r in results]
    values = [float(r.get(metric) or 0.0) if r.get("status") == "ok" else 0.0 for r in results]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(names) + 1.5))
    bars = ax.barh(names, values, color=["tab:blue" if r.get("status") == "ok" else "tab:red" for r in results])
    for bar, r, v in zip(bars, results, values):
        label = f"{v:.1f}" if r.get("status") == "ok" else r.get("status", "error")
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {label}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(metric)
    ax.set_title(f"{bench} — {env.get('device_name', '?')}, torch {env.get('torch', '?')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_reports(bench: str, results: list[dict], env: dict, *, out_dir: Path = RESULTS,
                  plot: str | None = "time_ms", settings: dict | None = None) -> dict[str, Path]:
    """Write ``<bench>.json``, ``<bench>.md`` and (when ``plot``) ``<bench>.png``; return their paths."""
    settings = settings or {"repeats": None, "warmup": None, "fresh_process": None}
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{bench}.json", "md": out_dir / f"{bench}.md"}
    notes: list[str] = []
    if plot:
        png = out_dir / f"{bench}.png"
        note = write_plot(png, bench, results, plot, env)
        if note:
            notes.append(note)
        else:
            paths["png"] = png
    write_report(paths["json"], json.dumps({"bench": bench, "env": env, "settings": settings, "notes": notes,
                                         "variants": results}, indent=1))
    write_report(paths["md"], markdown_table(bench, results, env, settings, notes))
    return paths


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
