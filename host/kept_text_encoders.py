"""The streamed text encoders, kept between prompts where the machine has the RAM for it.

A new prompt otherwise builds the encoder again from its file: 3.3 s of a 7.5 s Qwen-Image 4-step render at 24 GB,
where native's CLIPTextEncode, whose CLIPLoader output ComfyUI keeps, spent 0.4 s encoding. A kept encoder is a
``comfy.sd.CLIP`` as CLIPLoader's is: ComfyUI's memory manager moves it off the GPU when a model needs the room,
and it waits in RAM (its file size) for the next prompt. One is kept per kind of encoder (umT5-XXL, Qwen2.5-VL),
for one file and device; asking for another file or device, or running with ``keep_encoder`` = free, lets it go.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("comfyui_lowvram_dit")

CHOICES = ("auto", "keep", "free")
GIB = 1 << 30
KEEP_RAM = 48 * GIB  # auto keeps on machines with this much RAM: the diffusion models, the encoder and the system fit


@dataclass
class _Kept:
    key: tuple
    clip: Any  # comfy.sd.CLIP


_KEPT: dict[str, _Kept] = {}  # encoder label -> the one kept


def keeps(choice: str, ram_total: int) -> tuple[bool, str]:
    """(keep the encoder after encoding?, why, for the log line) on a machine of ``ram_total`` RAM bytes."""
    if choice not in CHOICES:
        raise ValueError(f"keep_encoder: {choice!r} is not one of {list(CHOICES)}")
    if choice != "auto":
        return choice == "keep", f"keep_encoder = {choice}"
    verdict = "keeps" if ram_total >= KEEP_RAM else "frees"
    return ram_total >= KEEP_RAM, (f"auto {verdict} it: this machine has {ram_total / GIB:.0f} GiB of RAM "
                                   f"(kept from {KEEP_RAM / GIB:.0f} GiB)")


def key_of(te_path: str | Path, device: Any) -> tuple:
    """What a kept encoder must match: the file (path, size, mtime, inode) and the device it encodes on."""
    st = os.stat(te_path)
    return (str(te_path), st.st_size, st.st_mtime_ns, st.st_ino, str(device))


def take(label: str, key: tuple) -> Any | None:
    """The kept ``label`` encoder if it matches ``key`` (it stays kept); otherwise None, and one kept for another
    file or device is let go first, so that two never share RAM."""
    kept = _KEPT.get(label)
    if kept is not None and kept.key == key:
        return kept.clip
    release(label)
    return None


def keep(label: str, key: tuple, clip: Any) -> None:
    """Keep ``clip`` as the ``label`` encoder for ``key``."""
    _KEPT[label] = _Kept(key, clip)


def release(label: str) -> bool:
    """Let the kept ``label`` encoder go (its memory is freed once nothing else holds it); whether one was kept."""
    return _KEPT.pop(label, None) is not None


def ram_total() -> int:
    """This machine's RAM in bytes."""
    import psutil

    return psutil.virtual_memory().total
