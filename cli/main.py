"""Command line: ``python -m comfyui_lowvram_dit <command> ...``.

Each command lives with its capability; this file dispatches, importing the command's module when it is asked for
so ``doctor`` works on a machine without Triton, CUDA or ComfyUI. It is also the one place where a command's
failure becomes a message: every expected failure (cli/errors.py, a file the pack will not replace, an OS error on
a path, a library that is missing or ends the process while imported) is printed as one ``error:`` line on stderr
with exit code 2 for bad input and 1 for a failed check or run; nothing reaches the user as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from ..checkpoints.safe_write import UnsafeTargetError
from .errors import BAD_INPUT, FAILED, CommandError, one_line, raised_at

# command -> (module relative to the pack, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "doctor": ("..doctor.report", "report versions, GPU, working fp8/attention paths and a recommendation"),
    "synth": ("..synthetic.checkpoints", "write synthetic checkpoints (real key names and shapes, random weights)"),
    "run": (".runner", "run a shipped workflow headless in ComfyUI"),
    "convert": (".convert", "rewrite a workflow (e.g. an official template) to use this pack's nodes"),
    "selftest": ("..doctor.selftest", "check each node against its stock ComfyUI equivalent inside a given ComfyUI"),
}
TRACEBACK_ENV = "LOWVRAM_DIT_TRACEBACK"  # set to 1: an unexpected error also prints its traceback (for a bug report)
INTERRUPTED = 130


def _usage() -> str:
    lines = ["usage: python -m comfyui_lowvram_dit <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'python -m comfyui_lowvram_dit <command> --help' for a command's options."]
    return "\n".join(lines)


def _fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def _from_argparse(exc: SystemExit) -> bool:
    """Whether argparse raised this exit (it has printed its usage or help already)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == argparse.__file__:
            return True
        tb = tb.tb_next
    return False


def _os_error(name: str, exc: OSError) -> str:
    where = f"{exc.filename}: " if exc.filename else ""
    return (f"{name}: {where}{exc.strerror or one_line(exc)} (check that path: it must be a folder or file you can "
            "write, on a disk with free space)")


def main(argv: list[str] | None = None) -> int:
    """Run the command's ``cli(argv)`` and return its exit code; an expected failure is one line on stderr."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return BAD_INPUT
    try:
        module = importlib.import_module(COMMANDS[name][0], __package__)
        return int(module.cli(rest) or 0)
    except CommandError as err:
        return _fail(str(err), err.exit_code)
    except UnsafeTargetError as err:  # an output name holding a link, a folder or a file the pack did not write
        return _fail(str(err), BAD_INPUT)
    except SystemExit as exc:
        if _from_argparse(exc):
            raise
        return _fail(f"{name}: {raised_at(exc.__traceback__)} ended the process (exit code {exc.code!r}) while it "
                     "was imported or run; the package that file belongs to is broken: reinstall or remove it",
                     FAILED)
    except KeyboardInterrupt:
        return _fail(f"{name}: interrupted", INTERRUPTED)
    except ImportError as exc:
        return _fail(f"{name}: cannot import {exc.name or 'a module'} ({one_line(exc)}); install the pack's "
                     "requirements in this Python (pip install -e .) or reinstall the package named", FAILED)
    except OSError as exc:  # with a file name: a path the user gave cannot be used; without: the system failed
        return _fail(_os_error(name, exc), BAD_INPUT if exc.filename else FAILED)
    except Exception as exc:  # noqa: BLE001 - a bug of the pack: still one line, the traceback on request
        if os.environ.get(TRACEBACK_ENV) == "1":
            traceback.print_exc()
        return _fail(f"{name}: unexpected {one_line(exc)} at {raised_at(exc.__traceback__)}; this is a bug of the "
                     f"pack: please report it with the command line (set {TRACEBACK_ENV}=1 for the traceback)",
                     FAILED)
