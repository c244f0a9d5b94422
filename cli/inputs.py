"""What the command line reads from the user: JSON files and values, and numeric options, each checked where it is
parsed so a bad one is an InputError naming it (cli/errors.py), never an exception from deep inside a command.

JSON is read strictly: a regular file (a link to one is fine; a folder, FIFO or device is refused before it is
opened for reading), at most MAX_JSON_BYTES, UTF-8, no NaN / Infinity (JSON has neither; ComfyUI would reject the
graph), no number Python cannot hold, nesting at most MAX_JSON_DEPTH deep (recursive readers downstream, comfy-cli's
converter and json.dumps among them, then never overflow the stack).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..checkpoints.safe_read import NotRegularFileError, read_text
from .errors import InputError

MAX_JSON_BYTES = 256 << 20  # a workflow with images embedded in it can be tens of MB
MAX_JSON_DEPTH = 64  # ComfyUI's workflows nest about 8 deep


class NotJSONError(InputError):
    """The text is not JSON at all (a syntax error), as opposed to JSON holding a value the tools refuse."""


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"holds {name}, which JSON does not have (ComfyUI would refuse it); write a number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"holds the number {text[:40]}, too large for a float; write a smaller one")
    return value


def _depth(value: Any) -> int:
    """How deep lists and dicts nest in ``value`` (0 for a scalar), counted without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if level <= MAX_JSON_DEPTH:
            todo.extend((child, level + 1) for child in children)
    return deepest


def loads(text: str, source: str) -> Any:
    """``text`` parsed as strict JSON; NotJSONError for a syntax error, InputError naming ``source`` for a value
    the tools refuse (NaN, a number Python cannot hold, nesting deeper than MAX_JSON_DEPTH)."""
    too_deep = f"{source}: nested deeper than {MAX_JSON_DEPTH} levels, which no ComfyUI workflow is; check the file"
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise NotJSONError(f"{source}: not a JSON file ({exc})") from None
    except RecursionError:
        raise InputError(too_deep) from None
    except ValueError as exc:  # ours above, or an integer of more digits than Python converts
        reason = str(exc) if str(exc).startswith("holds") else (
            "holds an integer of more digits than Python reads; write a shorter number")
        raise InputError(f"{source}: {reason}") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise InputError(too_deep)
    return value


def read_json_file(path: Path, what: str = "workflow") -> Any:
    """The JSON in the file at ``path`` (see the module docstring); InputError naming the file otherwise."""
    try:
        text = read_text(path, MAX_JSON_BYTES, follow_links=True)
    except (FileNotFoundError, NotADirectoryError):
        raise InputError(f"{path}: no such file; give the path of a {what} .json file") from None
    except NotRegularFileError as exc:
        raise InputError(f"{exc}; give the path of a {what} .json file") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot be read ({exc.strerror or exc}); check its permissions") from None
    except UnicodeDecodeError:
        raise NotJSONError(f"{path}: not a JSON file (not UTF-8 text); give a {what} .json file") from None
    return loads(text, str(path))


def check_number(value: float, option: str, low: float, high: float, what: str) -> float:
    """``value`` when finite and in (low, high]; InputError naming ``option`` otherwise (argparse takes nan and inf
    as floats)."""
    if not math.isfinite(value) or not low < value <= high:
        raise InputError(f"{option} {value:g}: give {what}, a number above {low:g} and at most {high:g}")
    return value
