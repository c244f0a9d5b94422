"""One fp8 state-dict normaliser for every diffusion-model loader (Wan, Qwen-Image).

Plain torch; no ComfyUI. It reads a safetensors file tensor by tensor into the in-memory form that
host/fp8_ops.py loads: ``<layer>.weight`` float8_e4m3fn + ``<layer>.weight_scale`` fp32 for quantized
Linear layers (a 0-d scalar for per-tensor, ``[ceil(N/bs), ceil(K/bs)]`` for block-wise), every other key as in
the file without its prefix. High-precision weights that the model's rule selects are quantized while they
stream; pre-quantized files keep their own per-tensor quantization (re-quantizing fp8 codes only adds error),
except conventions no fp8 GEMM takes (musubi row groups, e5m2), which are re-quantized.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from ..kernels import fp8 as fp8_math
from .safetensors_io import (
    CheckpointError, MapHook, SafetensorsHeader, check_weight_scales, quant_layer_configs, read_tensors,
    to_device_or_cpu,
)
from .streaming import SCALE_SUFFIXES, ProgressFn, small_tensor_names

QuantMode = Literal["none", "per_tensor", "blockwise"]
SourceFormat = Literal[
    "high_precision",  # bf16 / fp16 / fp32 release files
    "comfy_fp8_scaled",  # ComfyUI legacy: <layer>.scale_weight + top-level scaled_fp8 marker
    "comfy_quant",  # ComfyUI v0.8: <layer>.weight_scale + <layer>.comfy_quant or _quantization_metadata
    "fp8_plain",  # fp8 cast without any scale
    "musubi_fp8",  # musubi-tuner: <layer>.scale_weight [1] / [N,1] / [N,K/bs,1] (+ .scale_weight_tensor)
    "lowvram_fp8",  # this pack's own saved files
    "core_quant",  # comfy_quant with a layout other than fp8 e4m3/e5m2: ComfyUI's own layers build it (core_quant.py)
]
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_FORMATS = ("float8_e4m3fn", "float8_e5m2")  # ComfyUI per-layer quant formats this normaliser reads


# Keys ComfyUI / musubi files carry next to a layer's weight that the fp8 Linear does not use.
LAYER_EXTRA_KEYS = ("comfy_quant", "input_scale", "scale_input", "scale_weight_tensor")


def comfy_quant_format(raw: torch.Tensor) -> str | None:
    """The ``format`` field of a ``<layer>.comfy_quant`` uint8 JSON tensor (None if unreadable)."""
    try:
        return json.loads(bytes(raw.to(torch.uint8).tolist()).decode("utf-8")).get("format")
    except (ValueError, AttributeError):
        return None


def pop_fp8_layer(state_dict: dict[str, torch.Tensor], prefix: str,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Take one Linear's fp8 weight and scale out of ``state_dict`` in the form the fp8 ops hold (float8_e4m3fn,
    fp32 scale: 0-d per-tensor or the block grid), whatever file convention named them; the layer's other
    file-only keys are dropped. None when the weight is not fp8 (its weight left in place, those keys and any scale
    dropped all the same).

    For state dicts that did not come through ``read_fp8_state_dict`` (which already gives this form)."""
    conf = state_dict.get(prefix + "comfy_quant")
    if conf is not None and comfy_quant_format(conf) not in FP8_FORMATS:
        raise ValueError(f"{prefix[:-1]}: ComfyUI quant format {comfy_quant_format(conf)!r} is not "
                         "supported by the LowVRAM fp8 ops; load this file with UNETLoader")
    for k in LAYER_EXTRA_KEYS:
        state_dict.pop(prefix + k, None)
    w = state_dict.get(prefix + "weight")
    scale = state_dict.pop(prefix + "weight_scale", None)
    legacy = state_dict.pop(prefix + "scale_weight", None)  # ComfyUI's legacy scaled fp8 name
    scale = scale if scale is not None else legacy
    if w is None or w.dtype not in FP8_DTYPES:
        return None
    state_dict.pop(prefix + "weight")
    if w.dtype != torch.float8_e4m3fn:  # e5m2: re-quantized to the e4m3fn the GEMMs take
        s = scale.float() if scale is not None else torch.ones(())
        w, scale = fp8_math.quantize_per_tensor(
            w.float() * fp8_math.expand_scale(s, tuple(w.shape), block_size, w.device))
    scale = torch.ones((), dtype=torch.float32) if scale is None else scale.float()
    if scale.numel() == 1:
        return w, scale.reshape(())
    if tuple(scale.shape) != fp8_math.blockwise_scale_shape(*w.shape, block_size):
        raise ValueError(f"{prefix}weight_scale has shape {list(scale.shape)}, expected a scalar or "
                         f"{list(fp8_math.blockwise_scale_shape(*w.shape, block_size))} for block size {block_size}; "
                         "load the file through the LowVRAM Wan loader")
    return w, scale


def quantize_weight(w: torch.Tensor, mode: QuantMode, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize one 2-D weight (any float dtype/device) -> (fp8 e4m3fn, fp32 scale) on the same device."""
    if mode == "per_tensor":
        q, s = fp8_math.quantize_per_tensor(w)
        return q, s.float().reshape(())
    if mode == "blockwise":
        q, s = fp8_math.quantize_blockwise(w, block_size)
        return q, s.float()
    raise ValueError(f"quantize_weight: mode must be 'per_tensor' or 'blockwise', got {mode!r}")


def dequantize_musubi(q: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor | None) -> torch.Tensor:
    """musubi-tuner fp8 -> fp32: scale is [1] (tensor), [N,1] (channel) or [N, K/bs, 1] (1 x bs blocks along K)."""
    w = q.float()
    s = scale.float().to(w.device)
    if tensor_scale is not None:
        s = s * tensor_scale.float().to(w.device)
    if s.ndim == 3:
        n, nb, _ = s.shape
        return (w.view(n, nb, -1) * s).view(q.shape)
    return w * s


@dataclass(frozen=True)
class Fp8Plan:
    """What to do with one file: its convention, its key prefix, which weights are quantized, to what."""

    source_format: SourceFormat
    prefix: str
    is_target: Callable[[str, tuple[int, ...]], bool]  # 2-D Linear weights that may be fp8 (keys without prefix)
    mode: QuantMode  # quantization of weights converted here (high precision, musubi row groups)
    block_size: int = 128
    saved_block: int | None = None  # this pack's block-wise files: the block size they were saved with

    @property
    def quantizes_here(self) -> bool:
        """True when a high-precision file is quantized while it streams."""
        return self.source_format == "high_precision" and self.mode != "none"


class Fp8Normaliser:
    """Converts one file's tensors, as they arrive, into ``sd`` (the in-memory fp8 form)."""

    def __init__(self, name: str, plan: Fp8Plan, small: dict[str, torch.Tensor], layer_conf: dict[str, dict],
                 device: torch.device) -> None:
        self.name, self.plan, self.small, self.layer_conf, self.device = name, plan, small, layer_conf, device
        marker = small.get("scaled_fp8")
        self.legacy_e5m2 = marker is not None and marker.dtype == torch.float8_e5m2
        self.sd: dict[str, torch.Tensor] = {}

    def add_small(self) -> None:
        """The small tensors that are not scales or markers (those go with their weights)."""
        for key, v in self.small.items():
            if key != "scaled_fp8" and not key.endswith(SCALE_SUFFIXES):
                self.add(key, v)

    def add(self, key: str, v: torch.Tensor) -> None:
        """Convert one tensor (key without the file prefix) and store the result."""
        plan = self.plan
        base = key[: -len("weight")] if key.endswith(".weight") else None
        if plan.source_format == "high_precision":
            if plan.quantizes_here and plan.is_target(key, tuple(v.shape)):
                self._quantized(key, to_device_or_cpu(v, self.device), plan.mode)
            else:
                self.sd[key] = v
            return
        if v.dtype not in FP8_DTYPES or base is None:
            self.sd[key] = v
            return
        scale, tensor_scale = self._scale(key, base)
        if plan.source_format == "musubi_fp8" and not (math.prod(scale.shape) == 1 and tensor_scale is None):
            self._quantized(key, dequantize_musubi(to_device_or_cpu(v, self.device), scale, tensor_scale), plan.mode)
        elif plan.source_format == "lowvram_fp8" and plan.saved_block is not None:
            self._check_block_scale(base, v, scale)
            self.sd[key], self.sd[base + "weight_scale"] = v, scale.float()
        elif v.dtype == torch.float8_e5m2 or self.legacy_e5m2:
            # e5m2 has one mantissa bit less than the e4m3fn our GEMMs take: re-quantize per tensor.
            v = to_device_or_cpu(v, self.device)
            self._quantized(key, v.float() * scale.float().to(v.device), "per_tensor")
        else:
            self.sd[key], self.sd[base + "weight_scale"] = v, scale.float().reshape(())

    def _quantized(self, key: str, w: torch.Tensor, mode: QuantMode) -> None:
        q, s = quantize_weight(w, mode, self.plan.block_size)
        s = s.cpu()
        # A NaN or inf in the weight makes its scale NaN / inf (amax propagates both): refuse it here, as
        # check_weight_scales refuses such a scale read from a pre-quantized file (one isfinite on the small scale).
        if not bool(torch.isfinite(s).all()):
            raise CheckpointError(f"{self.name}: weight {self.plan.prefix + key!r} holds NaN or infinite values; the "
                                  "file is damaged (download it again) or was converted wrongly")
        self.sd[key], self.sd[key[: -len("weight")] + "weight_scale"] = q.cpu(), s

    def _scale(self, key: str, base: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """An fp8 weight's scale in whichever convention the file uses (and musubi's extra tensor scale)."""
        fmt, small = self.plan.source_format, self.small
        if fmt == "comfy_quant":
            layer_fmt = self.layer_conf.get(base[:-1], {}).get("format", "float8_e4m3fn")
            if layer_fmt not in FP8_FORMATS:
                raise CheckpointError(
                    f"{self.name}: layer {base[:-1]!r} uses ComfyUI quant format {layer_fmt!r}, which this loader "
                    "does not read; load the file with ComfyUI's UNETLoader instead")
        if fmt in ("lowvram_fp8", "comfy_quant"):
            scale = small.get(base + "weight_scale")
        elif fmt in ("comfy_fp8_scaled", "musubi_fp8"):
            scale = small.get(base + "scale_weight")
        else:  # fp8_plain
            scale = torch.ones((), dtype=torch.float32)
        if scale is None:
            if fmt not in ("comfy_fp8_scaled", "comfy_quant"):
                raise CheckpointError(f"{self.name}: fp8 weight {self.plan.prefix + key!r} has no scale tensor; "
                                      "the file is damaged")
            scale = torch.ones((), dtype=torch.float32)  # an unscaled fp8 layer inside a scaled file
        return scale, small.get(base + "scale_weight_tensor")

    def _check_block_scale(self, base: str, v: torch.Tensor, scale: torch.Tensor) -> None:
        bs = self.plan.saved_block
        want = (math.ceil(v.shape[0] / bs), math.ceil(v.shape[1] / bs))
        if tuple(scale.shape) != want:
            raise CheckpointError(f"{self.name}: {self.plan.prefix + base}weight_scale has shape {list(scale.shape)}, "
                                  f"expected {list(want)} for block size {bs}; the file is damaged")


def check_scales(header: SafetensorsHeader, plan: Fp8Plan, small: dict[str, torch.Tensor],
                 layer_conf: dict[str, dict]) -> None:
    """Before any weight is read: every scale finite and positive, and every fp8 weight of a scaled file
    (ComfyUI fp8_scaled, a comfy_quant layer, this pack's own files) has its scale."""
    check_weight_scales(header, small.items())
    if plan.source_format not in ("comfy_fp8_scaled", "comfy_quant", "lowvram_fp8"):
        return
    suffix = "weight_scale" if plan.source_format != "comfy_fp8_scaled" else "scale_weight"
    for raw, i in header.tensors.items():
        key = raw[len(plan.prefix):] if raw.startswith(plan.prefix) else raw
        # Every fp8 weight of a scaled file, block layer or not: an embedding or head read without its scale
        # would silently act as scale 1.0. comfy_quant files mark their scaled layers, so only those are checked.
        if i.dtype not in FP8_DTYPES or not key.endswith("weight"):
            continue
        base = key[: -len("weight")]
        if plan.source_format == "comfy_quant" and base[:-1] not in layer_conf:
            continue  # an fp8 layer without a config is a plain fp8 cast (as ComfyUI loads it)
        if base + suffix not in small:
            raise CheckpointError(f"{header.path.name}: fp8 weight {raw!r} has no scale ({plan.prefix}{base}{suffix}); "
                                  "the file is damaged or incomplete, download it again")


def read_fp8_state_dict(
    header: SafetensorsHeader,
    plan: Fp8Plan,
    *,
    device: str | torch.device | None = None,
    mmap: bool = False,
    progress: ProgressFn | None = None,
    on_map: MapHook | None = None,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Stream ``header``'s file into the in-memory fp8 form per ``plan``; returns (state dict, notes for the log).

    Scales, markers and small tensors come first, so each weight converts as it streams. ``mmap``: tensors of a
    pre-quantized file that pass through unchanged are zero-copy views of the file (page cache, not RSS), each
    shown to ``on_map``.
    """
    strip = lambda n: n[len(plan.prefix):] if n.startswith(plan.prefix) else n  # noqa: E731
    small_names = small_tensor_names(header)
    mapped = mmap and plan.source_format != "high_precision"  # a file quantized here is read as copies
    small = {strip(n): v for n, v in read_tensors(header, small_names, mmap=mapped, on_map=on_map)}
    layer_conf = {strip(k): v for k, v in quant_layer_configs(header).items()} \
        if plan.source_format == "comfy_quant" else {}
    check_scales(header, plan, small, layer_conf)
    norm = Fp8Normaliser(header.path.name, plan, small, layer_conf, torch.device(device or "cpu"))
    norm.add_small()
    small_set = set(small_names)
    total = sum(i.nbytes for i in header.tensors.values())
    done = sum(header.tensors[n].nbytes for n in small_names)
    if progress:
        progress(done, total)
    for raw, v in read_tensors(header, [n for n in header.tensors if n not in small_set], mmap=mapped,
                               prefetch=True, on_map=on_map):
        norm.add(strip(raw), v)
        done += header.tensors[raw].nbytes
        if progress:
            progress(done, total)
    notes = []
    if any(k.endswith((".scale_input", ".input_scale")) and bool((v.float() != 1.0).any()) for k, v in small.items()):
        notes.append(f"{header.path.name}: static activation scales ignored; activations are quantized per call")
    return norm.sd, notes
