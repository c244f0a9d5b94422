"""``selftest``: each node of the pack next to its stock ComfyUI equivalent, inside a given ComfyUI.

Tiny synthetic models (real key names, random weights) are written to a temporary folder; every check loads them
through a pack node's own entry point and through the stock node it stands in for, runs one sampler step (or one
encode) of each on ComfyUI's device and compares the outputs within the node's tolerance. One verdict line per
node and variant: PASS / FAIL with the measured relative difference and the tolerance, or SKIP with the reason.
The exit code is 1 when any check failed, so a ComfyUI version nobody here ran gets checked in about a minute::

    python -m comfyui_lowvram_dit selftest --comfyui /path/to/ComfyUI

The Doctor node runs the same checks inside a running server (``run_selftest``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from .checkout import POINT_AT, checkout_problem, package_problem
from .selftest_env import FAIL, PASS, SKIP, Check, SelfTestEnv, Verdict


def all_checks() -> list[Check]:
    """Every check, cheapest first (torch.compile last: it compiles for tens of seconds on a CPU)."""
    from . import selftest_text, selftest_wan

    return [*selftest_wan.CHECKS, *selftest_text.CHECKS, *selftest_wan.SLOW_CHECKS]


def _seam_skip(check: Check) -> Verdict | None:
    """SKIP when this ComfyUI lacks a seam of the node: the node is then left out or passes its model through."""
    import importlib

    from ..host.seams import seam_problem

    module = importlib.import_module(f"..nodes.{check.node_class[0]}", __package__)
    cls = getattr(module, check.node_class[1])
    problem = seam_problem(check.node, getattr(cls, "COMFY_SEAMS", ()), "is left out or passes through")
    return None if problem is None else Verdict(check.node, SKIP, problem)


def run_check(check: Check, env: object) -> Iterator[Verdict]:
    """The check's verdicts, each timed; an exception becomes a FAIL naming it (a node that raises is broken)."""
    start = time.perf_counter()
    try:
        skipped = _seam_skip(check)
        if skipped is not None:
            yield skipped
            return
        for verdict in check.run(env):
            now = time.perf_counter()
            yield Verdict(verdict.node, verdict.status, verdict.detail, now - start)
            start = now
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the node's failure (a library's exit too); the rest go on
        message = " ".join(str(exc).split())[:400]
        yield Verdict(check.node, FAIL, f"raised {type(exc).__name__}: {message}", time.perf_counter() - start)


def run_selftest(only: Iterable[str] = (), emit: Callable[[str], None] = print,
                 workdir: Path | None = None) -> list[Verdict]:
    """Run the checks (``only``: their keys) in this process, where ComfyUI is importable; emits each line."""
    checks = all_checks()
    wanted = set(only)
    unknown = wanted - {c.key for c in checks}
    if unknown:
        raise ValueError(f"selftest --only: unknown check(s) {sorted(unknown)}; known: {[c.key for c in checks]}")
    verdicts: list[Verdict] = []
    with tempfile.TemporaryDirectory(prefix="lowvram_dit_selftest_", dir=workdir) as tmp, SelfTestEnv(Path(tmp)) as env:
        emit(f"selftest on {env.describe()}; synthetic models in {tmp}")
        for check in checks:
            if wanted and check.key not in wanted:
                continue
            for verdict in run_check(check, env):
                verdicts.append(verdict)
                emit(verdict.line())
    return verdicts


def summary(verdicts: list[Verdict]) -> str:
    """``12 PASS, 0 FAIL, 3 SKIP``."""
    return ", ".join(f"{sum(v.status == s for v in verdicts)} {s}" for s in (PASS, FAIL, SKIP))


def _gpu_visible() -> bool:
    """Whether torch sees a device ComfyUI would run on without --cpu (CUDA / ROCm, Intel XPU, Apple MPS)."""
    import torch

    xpu, mps = getattr(torch, "xpu", None), getattr(torch.backends, "mps", None)
    return bool(torch.cuda.is_available() or (xpu is not None and xpu.is_available())
                or (mps is not None and mps.is_available()))


def import_comfyui(path: Path, cpu: bool) -> None:
    """Make the ComfyUI checkout at ``path`` importable in this process and import its device setup (``cpu``: run it
    as with ``--cpu``). A path that is no ComfyUI, or no GPU without ``cpu``, is an InputError; a checkout that
    does not import (a syntax error, a module that raises or exits) a CommandError naming the file."""
    from ..cli.errors import CommandError, InputError, one_line, raised_at

    if problem := checkout_problem(path):
        raise InputError(f"selftest --comfyui {path}: {problem}; {POINT_AT}")
    if problem := package_problem(path):
        raise CommandError(f"selftest --comfyui {path}: this ComfyUI is broken: {problem}; restore the checkout "
                           "(git status / git checkout in it) or reinstall ComfyUI")
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))  # first, as when ComfyUI runs: its top-level modules (nodes, utils) win
    try:
        from comfy.cli_args import args

        if cpu:
            args.cpu = True  # read when comfy.model_management is first imported
        import comfy.model_management  # noqa: F401 - picks ComfyUI's device here, where a failure is named
        import folder_paths  # noqa: F401 - the model folders the checks register their files in
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - an import that raises or calls sys.exit() is a broken checkout
        if not cpu and not _gpu_visible():
            first = one_line(exc).split(". ")[0][:200]  # torch's "Found no NVIDIA driver on your system"
            raise InputError(f"selftest: torch sees no GPU here ({first}); pass --cpu to run the checks on the CPU"
                             ) from None
        raise CommandError(f"selftest --comfyui {path}: importing ComfyUI failed at {raised_at(exc.__traceback__)} "
                           f"({one_line(exc)}); fix or reinstall that ComfyUI (or the package that file belongs to)"
                           ) from None


def cli(argv: list[str]) -> int:
    """``selftest --comfyui PATH [--cpu] [--only KEY ...]``: exit 0 when nothing failed, 1 otherwise (a ComfyUI that
    cannot be used raises an error cli/main.py prints)."""
    parser = argparse.ArgumentParser(prog="python -m comfyui_lowvram_dit selftest", description=__doc__.split("\n")[0])
    parser.add_argument("--comfyui", type=Path, required=True, help="the ComfyUI folder (the one with main.py)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even where ComfyUI would use a GPU")
    parser.add_argument("--only", action="append", default=[], metavar="KEY",
                        help="run only this check (repeatable): " + ", ".join(c.key for c in all_checks()))
    args = parser.parse_args(argv)
    unknown = sorted(set(args.only) - {c.key for c in all_checks()})
    if unknown:
        parser.error(f"--only {', '.join(unknown)}: no such check")
    import_comfyui(args.comfyui.expanduser().resolve(), args.cpu)
    t0 = time.perf_counter()
    verdicts = run_selftest(args.only, emit=lambda line: print(line, flush=True))
    failed = any(v.status == FAIL for v in verdicts)
    print(f"selftest: {summary(verdicts)} in {time.perf_counter() - t0:.0f} s"
          + (" -- FAILED" if failed else ""), flush=True)
    return 1 if failed else 0

