"""Synthetic GGUF diffusion models (ComfyUI-GGUF's format): the synthetic checkpoints' tensors, one at a time.

The layout is what ComfyUI-GGUF's converter stores for a diffusion model: ``general.architecture`` names the model
family, a 2-D weight of at least 1,024 values whose width fits its type's blocks is quantized, every other tensor is
F32. ``Q8_0`` is gguf's own quantization computed with torch (on the GPU for full-size files): per 32 weights an fp16
scale d = absmax / 127 and 32 int8 rounded half away from zero, stored as [d][32 x int8]. ``Q4_K``: gguf cannot
quantize K-quants, so its 144-byte super-blocks are random bytes with small finite scales, a valid Q4_K tensor of random
weights (a weight narrower than a 256-weight super-block is Q8_0). The header's ``synthetic`` key marks a file written
here, so a runner may delete it. Needs the ``gguf`` package.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from ..checkpoints.safe_write import commit, discard, refuse_unowned, temp_beside
from .checkpoints import CHUNK_ELEMS, SYNTHETIC_KEY, SYNTHETIC_MARK, file_layout, synthetic_tensor

QTYPES = ("Q8_0", "Q4_K")
Q4_K_BLOCK, Q4_K_BYTES = 256, 144


def arch_of(model: str) -> str:
    """``general.architecture`` ComfyUI-GGUF expects for a synthetic model (synthetic/specs.py)."""
    return "qwen_image" if model.startswith("qwen") else "wan"


def tensor_type(shape: Sequence[int], qtype: str) -> str:
    """The GGML type a tensor of ``shape`` is stored in when the file's Linear weights are ``qtype``."""
    if len(shape) != 2 or shape[0] * shape[1] < 1024 or shape[1] % 32:
        return "F32"
    return "Q4_K" if qtype == "Q4_K" and shape[1] % Q4_K_BLOCK == 0 else "Q8_0"


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """The Q8_0 bytes of a 2-D weight, (rows, cols / 32 * 34) uint8 on its device: what gguf.quants.quantize gives."""
    rows = max(1, CHUNK_ELEMS // w.shape[1])  # a few chunk-sized temporaries at a time, not ten of the whole matrix
    return torch.cat([_q8_0_rows(w[r:r + rows]) for r in range(0, w.shape[0], rows)])


def _q8_0_rows(w: torch.Tensor) -> torch.Tensor:
    blocks = w.float().reshape(-1, 32)
    d = blocks.abs().amax(1, keepdim=True) / 127
    x = blocks * torch.where(d == 0, 0.0, 1 / d)
    a = x.abs()
    q = torch.sign(x) * (a.floor() + (2 * (a - a.floor())).floor())  # gguf's np_roundf: half away from zero
    return torch.cat([d.half().view(torch.uint8), q.to(torch.int8).view(torch.uint8)], 1).reshape(w.shape[0], -1)


def q4_k_blocks(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """Random Q4_K super-blocks (256 weights in 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales, 128 of
    nibbles) on ``generator``'s device, with d and dmin small enough for a random Linear of width ``cols``."""
    device = generator.device
    blocks = torch.randint(0, 256, (rows, cols // Q4_K_BLOCK, Q4_K_BYTES), generator=generator, device=device,
                           dtype=torch.uint8)
    scale = torch.tensor([0.6 / (63 * 15 * math.sqrt(cols))], dtype=torch.float16, device=device)
    blocks[..., 0:2] = scale.view(torch.uint8)
    blocks[..., 2:4] = (scale * 4).view(torch.uint8)
    return blocks.reshape(rows, -1)


def _encode(t: torch.Tensor, kind: str, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Generator]:
    """A tensor's stored bytes (or F32 values) on the CPU, and the Q4_K generator (made on the tensor's device)."""
    if kind == "F32":
        return t.float().cpu(), generator
    if kind == "Q8_0":
        return quantize_q8_0(t).cpu(), generator
    generator = generator or torch.Generator(device=t.device).manual_seed(0)
    return q4_k_blocks(*t.shape, generator).cpu(), generator


def write_gguf(path: str | Path, layout: Sequence[tuple[str, Sequence[int]]], tensors: Iterable[torch.Tensor],
               arch: str, qtype: str = "Q8_0", metadata: dict[str, str] | None = None) -> dict[str, str]:
    """Write ``tensors`` (one per ``layout`` entry (name, shape), in its order, on any device) as a GGUF diffusion
    model whose Linear weights are ``qtype``, holding one tensor at a time; returns name -> GGML type name. A file
    at ``path`` is replaced only when this module wrote it."""
    import gguf
    import numpy as np

    if qtype not in QTYPES:
        raise ValueError(f"qtype {qtype!r}: choose one of {', '.join(QTYPES)}")
    Q = gguf.GGMLQuantizationType
    types = {name: tensor_type(shape, qtype) for name, shape in layout}
    refuse_unowned(path, is_synthetic)  # before any work: a refusal costs nothing
    tmp, f = temp_beside(path)
    f.close()
    try:
        writer = gguf.GGUFWriter(tmp, arch=arch)
        for key, value in {**(metadata or {}), SYNTHETIC_KEY: SYNTHETIC_MARK}.items():
            writer.add_string(key, value)
        for name, shape in layout:
            block, size = gguf.GGML_QUANT_SIZES[Q[types[name]]]
            writer.add_tensor_info(name, shape, np.float32, math.prod(shape) // block * size, Q[types[name]])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        generator = None
        for (name, _), t in zip(layout, tensors, strict=True):
            data, generator = _encode(t, types[name], generator)
            writer.write_tensor_data(data.numpy())
        writer.close()
    except BaseException:
        discard(tmp)
        raise
    commit(tmp, path, is_synthetic)
    return types


def write_synthetic_gguf(model: str, path: str | Path, qtype: str = "Q8_0", size: str = "tiny", seed: int = 0,
                         device: str | torch.device = "cpu", num_layers: int | None = None) -> dict[str, str]:
    """The synthetic ``model`` (synthetic/checkpoints.py, the weights of its bf16 file) as a GGUF file of ``qtype``,
    each tensor made on ``device`` when written; returns name -> GGML type name."""
    layout = file_layout(model, size, "bf16", num_layers)
    tensors = (synthetic_tensor(name, shape, dtype, seed, device) for name, shape, dtype in layout)
    metadata = {"model": model, "size": size, "format": qtype, "seed": str(seed)}
    return write_gguf(path, [(name, shape) for name, shape, _ in layout], tensors, arch_of(model), qtype, metadata)


def is_synthetic(path: str | Path) -> bool:
    """Whether ``path`` is a GGUF file this module wrote (its ``synthetic`` key); False for anything unreadable."""
    import gguf

    try:
        field = gguf.GGUFReader(path).get_field(SYNTHETIC_KEY)
        return field is not None and str(field.parts[field.data[-1]], encoding="utf-8") == SYNTHETIC_MARK
    except Exception:  # noqa: BLE001 - a file gguf cannot read is not one written here
        return False
