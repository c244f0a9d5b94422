"""The one place the pack learns ComfyUI's version."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

_VERSION = re.compile(r"""__version__\s*=\s*["']([^"']+)["']""")


def comfyui_version(comfyui_path: str | os.PathLike | None = None) -> str | None:
    """ComfyUI's version, or None when no ComfyUI is found.

    With ``comfyui_path`` (or, inside no ComfyUI, ``COMFYUI_PATH``) it reads that checkout's ``comfyui_version.py``
    as text, never importing ComfyUI. Without a path it asks the ComfyUI this process runs in.
    """
    if comfyui_path is None:
        running = sys.modules.get("comfyui_version")
        if running is None and "comfy" in sys.modules:  # inside ComfyUI: its top-level module is importable
            try:
                import comfyui_version as running
            except ImportError:
                running = None
        if running is not None:
            return str(running.__version__)
        comfyui_path = os.environ.get("COMFYUI_PATH")
    if not comfyui_path:
        return None
    try:
        text = (Path(comfyui_path) / "comfyui_version.py").read_text(encoding="utf-8")
    except OSError:
        return None
    match = _VERSION.search(text)
    return match.group(1) if match else None
