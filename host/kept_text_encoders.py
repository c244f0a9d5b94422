"""Text encoders kept between prompts where ComfyUI's DynamicVRAM manages them, as it keeps CLIPLoader's.

Under DynamicVRAM (comfy-aimdo) a streamed encoder is built on views of its file, tagged for aimdo's file reader
(host/text_encoders.py ``build_streaming``): its weights cost page cache, aimdo reads them into its pinned buffers
and the GPU on demand, and evicts their GPU copies without copying anything back. Kept, such an encoder serves the
next prompt without being built again; the RAM it holds is what aimdo pins for it, within aimdo's pinned budget,
which aimdo gives back when another model needs it. Anywhere else (the CPU, DynamicVRAM off) an encoder holds its
weights in RAM and is freed after each prompt.

One is kept per kind of encoder (its ``label``), for one file and device; asking for another file or device, or a
file changed since (size, mtime, inode), lets it go and builds a new one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

_KEPT: dict[str, tuple[tuple, Any]] = {}  # encoder label -> (key_of(...), comfy.sd.CLIP)


def key_of(te_path: str | Path, device: Any) -> tuple:
    """What a kept encoder must match: the file (path, size, mtime, inode) and the device it encodes on."""
    st = os.stat(te_path)
    return (str(te_path), st.st_size, st.st_mtime_ns, st.st_ino, str(device))


def take(label: str, key: tuple) -> Any | None:
    """The kept ``label`` encoder if it matches ``key`` (it stays kept); otherwise None, after letting go of one kept
    for another file, device or version of the file."""
    kept = _KEPT.get(label)
    if kept is not None and kept[0] == key:
        return kept[1]
    release(label)
    return None


def keep(label: str, key: tuple, clip: Any) -> None:
    """Keep ``clip`` as the ``label`` encoder for ``key``."""
    _KEPT[label] = (key, clip)


def release(label: str) -> bool:
    """Let the kept ``label`` encoder go (freed once nothing else holds it); whether one was kept."""
    return _KEPT.pop(label, None) is not None
