"""Mapped weights that ComfyUI's DynamicVRAM reads from the file itself, as it reads its own loaders' weights.

Under DynamicVRAM (comfy-aimdo) ComfyUI's loader tags each weight's storage with a ``TensorFileSlice`` (file handle,
offset, size): when a weight goes to the GPU or into aimdo's pinned buffers, ``read_tensor_file_slice_into`` reads
those bytes from the file by handle and never touches the mapping. Our loaders serve pre-quantized weights as views
of their own mapping (checkpoints/safetensors_io.py ``map_tensors``); untagged, aimdo copies them through that
mapping, every page of which then stays resident as file-backed RSS (docs/benchmarks.md, "How long does a whole
render take?"). Tagged with the same record, our views are read the way ComfyUI reads its own.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from ..checkpoints.safetensors_io import MapHook

log = logging.getLogger("comfyui_lowvram_dit")
FILE_SLICE_ATTR = "_comfy_tensor_file_slice"  # what comfy.memory_management.read_tensor_file_slice_into reads
_KEEP_ATTR = "_lowvram_dit_file_handle"  # holds the handle's owner for as long as the storage lives


def file_slice_hook(path: str | Path) -> MapHook | None:
    """A ``map_tensors`` hook tagging each mapped weight with its place in ``path`` for ComfyUI's file reader; None
    where ComfyUI has no such reader (before DynamicVRAM) or comfy-aimdo is off (``--disable-dynamic-vram``, no
    NVIDIA GPU)."""
    try:
        import comfy.memory_management as cmm
    except ImportError:  # ComfyUI before DynamicVRAM
        return None
    if not getattr(cmm, "aimdo_enabled", False) or not hasattr(cmm, "TensorFileSlice"):
        return None
    try:
        import comfy_aimdo.model_mmap

        handle_owner = comfy_aimdo.model_mmap.ModelMMAP(str(path))  # the file handle aimdo's readers take
        handle = handle_owner.get_file_handle()
    except (ImportError, OSError, RuntimeError) as exc:  # the weights then reach aimdo through the mapping, as before
        log.info("lowvram_dit: %s is read through its mapping (comfy-aimdo gave no file handle: %s)", Path(path).name,
                 exc)
        return None
    return tag_with(cmm.TensorFileSlice, handle, handle_owner)


def tag_with(record: type, file_ref: object, owner: object) -> MapHook:
    """The hook: ``record(file_ref, lock, offset, size)`` on each tensor's storage; one lock per file, as ComfyUI's
    loader uses; ``owner`` (whatever keeps ``file_ref`` open) stays alive with every tagged storage."""
    lock = threading.Lock()

    def tag(tensor: torch.Tensor, offset: int, size: int) -> None:
        storage = tensor.untyped_storage()
        setattr(storage, FILE_SLICE_ATTR, record(file_ref, lock, offset, size))
        setattr(storage, _KEEP_ATTR, owner)

    return tag
