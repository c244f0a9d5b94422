"""The streamed text encoders, kept between prompts where the machine has the RAM for it.

A new prompt otherwise builds the encoder again from its file: 3.8 s of a 7.5 s Qwen-Image 4-step render at 24 GB
and 2.8 s of a 19.4 s Wan 4-step render at 12 GB, where native's CLIPTextEncode, whose CLIPLoader output ComfyUI
keeps, spent 0.3-0.4 s. A kept encoder is a ``comfy.sd.CLIP`` that ComfyUI loads to the GPU to encode and moves off
again when a model needs the room. Moving it off is where a plain kept encoder lost (10.7 s instead of 7.5 at 24
GB): ComfyUI copied its GPU weights back into new CPU memory, module by module. So the encoder's CPU weights (its
home) are kept beside it, and an unload points each weight back at them: nothing is copied, and it is never
unloaded in part. One is kept per kind of encoder (umT5-XXL, Qwen2.5-VL), for one file and device; asking for
another file or device, or running with ``keep_encoder`` = free, lets it go.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

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


HOME_ATTR = "_lowvram_dit_home"  # the patcher's {parameter key: its CPU tensor}


class HomeWeightsMixin:
    """ModelPatcher behaviour for a kept encoder: unloading points each weight back at its CPU tensor, no copy."""

    def partially_unload(self, *args: Any, **kwargs: Any) -> int:
        return 0  # frees nothing in part: ComfyUI then unloads it whole, through unpatch_model, without copies

    def unpatch_model(self, device_to=None, unpatch_weights=True):  # noqa: ANN001, ANN201 - ModelPatcher signature
        if unpatch_weights and device_to is not None and torch.device(device_to).type == "cpu":
            import comfy.utils

            for key, home in getattr(self, HOME_ATTR).items():
                comfy.utils.set_attr_param(self.model, key, home)
        return super().unpatch_model(device_to, unpatch_weights)  # type: ignore[misc]


def keep_home(clip: Any) -> Any:
    """Give ``clip``'s patcher HomeWeightsMixin, its weights' CPU tensors recorded (the streamed build left every
    weight on the CPU, and a text encoder's weights are never patched); ``clip`` back."""
    from .patchers import mixed_class

    patcher = clip.patcher
    home = {key: p.data for key, p in patcher.model.named_parameters() if p.device.type == "cpu"}
    setattr(patcher, HOME_ATTR, home)
    patcher.__class__ = mixed_class(HomeWeightsMixin, type(patcher), "KeptHome")
    return clip


def ram_total() -> int:
    """This machine's RAM in bytes."""
    import psutil

    return psutil.virtual_memory().total
