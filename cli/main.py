"""Command line: ``python -m comfyui_lowvram_dit <command> ...``.

Each command lives with its capability; this file only dispatches, importing the command's module
when it is asked for so ``doctor`` works on a machine without Triton, CUDA or ComfyUI.
"""

from __future__ import annotations

import importlib
import sys

# command -> (module relative to the pack, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "doctor": ("..doctor.report", "report versions, GPU, working fp8/attention paths and a recommendation"),
    "synth": ("..synthetic.checkpoints", "write synthetic checkpoints (real key names and shapes, random weights)"),
    "run": (".runner", "run a shipped workflow headless in ComfyUI"),
    "convert": (".convert", "rewrite a workflow (e.g. an official template) to use this pack's nodes"),
    "selftest": ("..doctor.selftest", "check each node against its stock ComfyUI equivalent inside a given ComfyUI"),
}


def _usage() -> str:
    lines = ["usage: python -m comfyui_lowvram_dit <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'python -m comfyui_lowvram_dit <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the command's ``cli(argv)`` and return its exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0], __package__)
    return int(module.cli(rest) or 0)
