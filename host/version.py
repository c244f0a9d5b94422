"""The one place the pack learns ComfyUI's version (and where host code reads the pack's own)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from ..checkpoints.safe_read import read_text

VERSION_FILE_BYTES = 1 << 20  # comfyui_version.py is a few lines
_VERSION = re.compile(r"""__version__\s*=\s*["']([^"']+)["']""")


def comfyui_version(comfyui_path: str | os.PathLike | None = None) -> str | None:
    """ComfyUI's version, None when unknown.

    With ``comfyui_path``: that checkout's ``comfyui_version.py``, read as text (ComfyUI is never imported).
    Without: the ComfyUI this process runs in (its top-level ``comfyui_version`` module).
    """
    if comfyui_path is None:
        try:
            import comfyui_version
        except ImportError:
            return None
        return str(comfyui_version.__version__)
    try:  # a FIFO or a device at that name is refused, never waited on or read without end
        text = read_text(Path(comfyui_path) / "comfyui_version.py", VERSION_FILE_BYTES, follow_links=True)
    except (OSError, UnicodeDecodeError):
        return None
    match = _VERSION.search(text)
    return match.group(1) if match else None


def pack_version() -> str:
    """The pack's ``__version__`` ("" when unknown). The package root is always imported before any of its
    submodules, so it is read from ``sys.modules``: an import of the root from host code would be an import circle
    (the root's entry point imports nodes/, which import host/)."""
    root = sys.modules.get((__package__ or "").rpartition(".")[0])
    return str(getattr(root, "__version__", ""))
