"""The command line's expected failures: one line each (the input, what is wrong, the fix) and an exit code.

Commands raise these; ``cli/main.py`` is the one place that prints them and turns them into the exit code (2 for
bad input, 1 for a check or run that failed). Plain Python: ``doctor`` and ``selftest`` raise them too.
"""

from __future__ import annotations

import os
from types import TracebackType

BAD_INPUT = 2  # the command was given something it cannot use: a file, a path, an option value, a URL
FAILED = 1  # the input was fine, but a check or a run failed


class CommandError(Exception):
    """A command cannot go on; the message names the input, what is wrong and the fix."""

    exit_code = FAILED


class InputError(CommandError):
    """The command was given something it cannot use (exit code 2)."""

    exit_code = BAD_INPUT


def raised_at(tb: TracebackType | None) -> str:
    """``file:line`` of the innermost frame of a traceback: where an exception (or a library's exit) came from."""
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return "an unknown place"
    return f"{os.path.normpath(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno}"


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line, at most ``limit`` characters of message."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:limit]}" if text else type(exc).__name__
