"""Whether a folder is a ComfyUI checkout, and whether its ``comfy`` package is whole, read without importing it.

``checkout_problem`` is the shape (a folder with ``main.py`` and ``comfy/model_management.py``): what ``doctor
--comfyui-path``, ``selftest --comfyui`` and ``run --comfyui`` refuse as bad input. ``package_problem`` reads every
``comfy/**/*.py`` and compiles it (under a second for ComfyUI 0.33): a file that cannot be read or has a syntax
error is a broken checkout, which ``doctor`` reports and ``selftest`` names before importing anything. Plain Python.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..checkpoints.safe_read import read_regular

SOURCE_FILE_BYTES = 8 << 20  # ComfyUI's largest source file is a few hundred kB
POINT_AT = "point it at the ComfyUI folder (the one with main.py)"


def checkout_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` is not a ComfyUI checkout, as a phrase ('does not exist', ...); None when it is one."""
    path = Path(path)
    try:
        if not path.exists():
            return "is a link to nothing" if path.is_symlink() else "does not exist"
        if not path.is_dir():
            return "is a file, not a folder"
        for need in ("main.py", "comfy/model_management.py"):
            if not (path / need).is_file():
                return f"is not a ComfyUI checkout (no {need} there)"
    except OSError as exc:  # a folder on the way that cannot be searched
        return f"cannot be read ({exc.strerror or exc})"
    return None


def package_problem(path: str | os.PathLike[str]) -> str | None:
    """The first source file of ``path``'s ``comfy`` package (and ``main.py``) that cannot be read or compiled, as
    'comfy/x.py line 3: invalid syntax'; None when all compile."""
    root = Path(path)
    files = [root / "main.py", *sorted((root / "comfy").rglob("*.py"))]
    for file in files:
        rel = file.relative_to(root).as_posix()
        try:
            source = read_regular(file, SOURCE_FILE_BYTES, follow_links=True)
            compile(source, str(file), "exec", dont_inherit=True)
        except SyntaxError as exc:
            return f"{rel} line {exc.lineno}: {exc.msg}"
        except (OSError, ValueError) as exc:  # unreadable, not a regular file, a NUL byte in the source
            return f"{rel} cannot be read ({getattr(exc, 'strerror', None) or exc})"
    return None
