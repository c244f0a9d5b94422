"""The suite's one reporter: a result's ``env`` (benchmarks/README.md, no machine paths), markdown header, cells and
tables, and every scenario's ``<stem>.json`` + ``<stem>.md``. Only the standard library at module level."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from comfyui_lowvram_dit.checkpoints.safe_write import write_report
from comfyui_lowvram_dit.host.version import comfyui_version

PACKAGE = "comfyui_lowvram_dit"
SUITE = f"{PACKAGE}.benchmarks"
PACK_ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
GIB = float(1 << 30)
PLACEHOLDERS = ("$OUT", "~", "<ComfyUI>", "<tmp>")
COMMIT_ENV = "LOWVRAM_BENCH_COMMIT"  # the commit a copied tree was made from, where its own git cannot say


def git_sha(repo: Path = PACK_ROOT) -> str | None:
    """``HEAD`` of the pack checkout, with ``-dirty`` when tracked files differ; None outside git. ``COMMIT_ENV``, where
    set, wins: a GPU machine that gets a copy of the working tree may hold another commit's git data."""
    if commit := os.environ.get(COMMIT_ENV):
        return commit
    try:  # every tag excluded: the full sha, never a tag's name
        return subprocess.run(["git", "-C", str(repo), "describe", "--always", "--dirty", "--abbrev=40", "--exclude=*"],
                              capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def public_text(text: str, comfyui: str = "ComfyUI") -> str:
    """Text (a command word, a child's stderr, a traceback) with no path of the machine that ran the benchmark."""
    repo = Path(__file__).parent.parent
    roots = {os.environ.get("COMFYUI_PATH"): comfyui, os.environ.get("OUT"): "$OUT", str(repo): "",
             str(repo.resolve()): "", str(Path.home()): "~", tempfile.gettempdir(): "<tmp>"}
    names = {str(Path(root)): name for root, name in roots.items() if root and os.path.isabs(root)}
    # Longest first, so that a folder inside another one wins; a folder only where a path starts and ends, so that
    # the temporary folder /tmp is not found inside /var/tmp or /tmpx. The repository's own files: repo-relative.
    pattern = "|".join(map(re.escape, sorted(names, key=len, reverse=True)))
    return re.sub(rf"(?<![\w.~/-])({pattern})(/|(?![\w.~-]))",
                  lambda m: names[m[1]] + m[2] if names[m[1]] else "" if m[2] else ".", text)


def public_command(words: list[str]) -> str:
    """A command line as results may show it (``public_text``; ComfyUI's folder ``<ComfyUI>``, Python ``python3``)."""
    # no quotes around a word that starts with a placeholder: they would only hide that $OUT and ~ are folders
    public = ["python3" if w == sys.executable else public_text(w, "<ComfyUI>") for w in words]
    return " ".join(w if w.startswith(PLACEHOLDERS) else shlex.quote(w) for w in public)


def environment(module: str, argv: list[str] | None, device: Any = None, comfyui: str | Path | None = None) -> dict:
    """The ``env`` of a run of ``module`` with ``argv``: what torch knows of ``device``, ``comfyui``'s version, the
    command as typed (the suite's, else ``-m module`` and ``argv`` when ``main`` was called)."""
    from importlib import metadata

    soft = dict.fromkeys(("torch", "triton", "comfy_kitchen", "comfy_aimdo"))  # read without importing them
    for key in soft:
        with contextlib.suppress(metadata.PackageNotFoundError):
            soft[key] = metadata.version(key.replace("_", "-"))
    words = sys.argv if sys.argv[:2] == ["-m", SUITE] else ["-m", module, *(sys.argv[1:] if argv is None else argv)]
    comfy = os.environ.get("COMFYUI_PATH")
    prefix = f"COMFYUI_PATH={public_command([comfy])} " if comfy else ""
    env = {"device": None, "gpu": None, "torch": soft["torch"], "comfyui": comfyui_version(comfyui or comfy),
           "comfy_kitchen": soft["comfy_kitchen"], "commit": git_sha(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": prefix + public_command(["python3", *words]), "triton": soft["triton"],
           "comfy_aimdo": soft["comfy_aimdo"], "python": platform.python_version()}
    if device is not None:
        import torch

        env.update(device=device.type, torch=torch.__version__, torch_cuda=torch.version.cuda)
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            env.update(gpu=props.name, compute_capability=f"{props.major}.{props.minor}",
                       vram_total_gib=round(props.total_memory / GIB, 2))
        else:
            env["cpu"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    return env


def error_text(exc: BaseException, limit: int = 300) -> str:
    """An exception as a result records it: its type and message, cut to ``limit`` characters."""
    return f"{type(exc).__name__}: {exc}"[:limit]


def say(msg: str) -> None:
    """A progress line, flushed at once (a scenario's output is often piped to a log)."""
    print(msg, flush=True)


def header(title: str, env: dict, notes: Iterable[str] = ()) -> list[str]:
    """A report's first lines: its title, the device and versions, the commit, date and command, then ``notes``."""
    device = env.get("gpu") or (f"CPU ({env['cpu']})" if env.get("cpu") else env.get("device") or "not recorded")
    facts = (("compute capability {}", "compute_capability"), ("{} GiB", "vram_total_gib"), ("driver {}", "driver"))
    names = (("torch {}", "torch"), ("CUDA {}", "torch_cuda"), ("Triton {}", "triton"), ("ComfyUI {}", "comfyui"),
             ("comfy-kitchen {}", "comfy_kitchen"), ("comfy-aimdo {}", "comfy_aimdo"))
    extra = ", ".join(text.format(env[key]) for text, key in facts if env.get(key))
    versions = ", ".join(text.format(env[key]) for text, key in names if env.get(key))
    return [f"# {title}", "", f"- device: {device}" + (f" ({extra})" if extra else ""), f"- {versions}",
            f"- pack: `{env.get('commit')}`, {env.get('date')}", f"- command: `{env.get('command')}`",
            *(f"- {note}" for note in notes), ""]


def cell(value: Any, fmt: str = "") -> str:
    """One table cell: ``fmt`` applied to a number (``{:.2f}``, ``{:.1%}``), "—" for None, ``|`` escaped."""
    if value is None:
        return "—"
    text = fmt.format(value) if fmt and isinstance(value, (int, float)) else str(value)
    return " ".join(text.split()).replace("|", "\\|")


def table(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A markdown table of already formatted cells (see ``cell``)."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)]


def write(out_dir: Path, stem: str, doc: dict, markdown: Sequence[str]) -> list[Path]:
    """``<stem>.json`` (``doc``) and ``<stem>.md`` (``markdown``) into ``out_dir``, after every stage of a run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    write_report(paths[0], json.dumps(doc, indent=1, default=str))
    write_report(paths[1], "\n".join(markdown).rstrip() + "\n")
    return paths
