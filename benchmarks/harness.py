"""What the scenarios share: the environment a result records (no machine paths), CUDA-event timing, and a child
process that imports this checkout. Only the standard library at module level (torch inside functions).
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from comfyui_lowvram_dit.host.version import comfyui_version

PACKAGE = "comfyui_lowvram_dit"
PACK_ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
GIB = float(1 << 30)


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
