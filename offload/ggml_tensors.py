"""GGML tensors (GGUF files, as ComfyUI-GGUF loads them) in the Block Swap engine: their bytes and their identity.

ComfyUI-GGUF keeps each weight of a GGUF file as a ``GGMLTensor``: a ``torch.Tensor`` subclass over the file's raw
bytes (``uint8`` for quantized types such as Q8_0 or Q4_K, ``float16``/``float32`` for F16/F32) carrying two Python
attributes, ``tensor_type`` (the GGML type) and ``tensor_shape`` (the weight's real shape); its layers dequantize
on use, and apply LoRA patches found in the tensor's ``patches`` attribute at that moment. The engine streams such a
tensor as it is: the raw bytes travel through the host arena and the ring like any other, and every view the engine
binds (host or GPU) is re-made a tensor of the same class carrying the same two attributes, so ComfyUI-GGUF's layers
dequantize exactly the bytes they would have read from the file. Recognised by those attributes, never imported.
"""

from __future__ import annotations

from typing import Any

import torch

CARRIED = ("tensor_type", "tensor_shape")  # what makes raw bytes a GGML tensor; LoRA patches are the host's to set
TORCH_COMPATIBLE = (None, 0, 1)  # GGML types F32 (0) and F16 (1): ComfyUI-GGUF computes with them as they are


def is_ggml(t: torch.Tensor | None) -> bool:
    """True for a GGML tensor: a tensor subclass carrying a GGML type and a real shape (False for None)."""
    return isinstance(t, torch.Tensor) and type(t) not in (torch.Tensor, torch.nn.Parameter) \
        and all(hasattr(t, a) for a in CARRIED)


def is_quantized(t: torch.Tensor) -> bool:
    """True for a GGML tensor its layer dequantizes on use (every GGML type but F32 and F16)."""
    return is_ggml(t) and getattr(t, "tensor_type", None) not in TORCH_COMPATIBLE


def stored(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor over its own bytes: for a GGML tensor its raw data in its stored shape and dtype."""
    return t.as_subclass(torch.Tensor) if is_ggml(t) else t.detach()


def identity(t: torch.Tensor) -> tuple[type, dict[str, Any]] | None:
    """(class, carried attributes) that make ``t``'s bytes a GGML tensor again; None for a plain tensor."""
    if not is_ggml(t):
        return None
    return type(t), {a: getattr(t, a) for a in CARRIED}


def as_ggml(raw: torch.Tensor, kind: tuple[type, dict[str, Any]]) -> torch.Tensor:
    """The plain tensor ``raw`` (same bytes, no copy) as a tensor of ``kind`` = ``identity(...)``."""
    cls, attrs = kind
    t = raw.as_subclass(cls)
    t.__dict__.update(attrs)
    return t
