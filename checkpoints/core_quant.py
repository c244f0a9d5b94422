"""Files whose layers use ComfyUI's own quantized layouts (int8, int8 ConvRot, mxfp8, nvfp4, w4a8, ...).

Plain torch; no ComfyUI. ComfyUI marks each quantized layer with a ``<layer>.comfy_quant`` JSON config (or the
file's ``_quantization_metadata``) and builds it as a ``QuantizedTensor`` of that layout. The pack's fp8 layers
compute fp8 e4m3 / e5m2 only; a file with any other layout is handed to ComfyUI's layers unchanged, so it loads
exactly as UNETLoader would load it: every tensor as stored (packed weights, their scales, codebooks, input
scales), without the file's key prefix, plus one ``comfy_quant`` tensor per configured layer.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from .safetensors_io import CheckpointError, MapHook, SafetensorsHeader, check_weight_scales, read_tensors
from .fp8_state import FP8_FORMATS  # the layer formats the pack's own fp8 layers compute
from .streaming import ProgressFn


def layout_name(conf: dict[str, Any]) -> str:
    """A layer config's layout as users know it (``int8_tensorwise`` with ``convrot`` is "int8 ConvRot")."""
    fmt = str(conf.get("format"))
    params = conf.get("params") if isinstance(conf.get("params"), dict) else {}
    if fmt == "int8_tensorwise" and (conf.get("convrot") or params.get("convrot")):
        return "int8_tensorwise+convrot"
    return fmt


def core_layouts(layers: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Layout name -> the layers that use it, for layers in a layout other than fp8 e4m3 / e5m2."""
    found: dict[str, list[str]] = {}
    for layer, conf in layers.items():
        if conf.get("format") not in FP8_FORMATS:
            found.setdefault(layout_name(conf), []).append(layer)
    return found


def describe_layouts(layouts: dict[str, list[str]]) -> str:
    """``"int8_tensorwise+convrot (20 layers), nvfp4 (2 layers)"`` for a log line or an error."""
    return ", ".join(f"{name} ({len(layers)} layer{'s' * (len(layers) != 1)})" for name, layers in
                     sorted(layouts.items()))


def config_tensor(conf: dict[str, Any]) -> torch.Tensor:
    """A layer config as ComfyUI stores it in a state dict: uint8 bytes of its JSON."""
    return torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)


def check_core_scales(header: SafetensorsHeader, tensors: dict[str, torch.Tensor], core_layers: set[str]) -> None:
    """CheckpointError naming the file and tensor for a NaN or infinite scale of a core-quantized layer.

    Block scales of these layouts are fp8 / e8m0 and may be zero (an all-zero block), so only finiteness is
    checked; their shapes and packing are ComfyUI's to check when it builds the layer."""
    for name, t in tensors.items():
        layer, _, attr = name.rpartition(".")
        if layer not in core_layers or attr == "comfy_quant" or attr == "weight" or not t.is_floating_point():
            continue
        if t.numel() and not bool(torch.isfinite(t.float()).all()):
            raise CheckpointError(f"{header.path.name}: scale {name!r} of a quantized layer holds NaN or infinite "
                                  "values; the file is damaged, download it again")


def read_core_state_dict(header: SafetensorsHeader, prefix: str, layers: dict[str, dict[str, Any]], *,
                         mmap: bool = False, progress: ProgressFn | None = None,
                         on_map: MapHook | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the file as stored, without ``prefix``, plus ``<layer>.comfy_quant`` for each of ``layers``
    (full layer names, as ``safetensors_io.quant_layer_configs`` returns them); ``mmap``: zero-copy file views,
    each shown to ``on_map``."""
    names = [n for n in header.tensors if n.startswith(prefix)]  # as UNETLoader: the model's keys only
    layers = {layer[len(prefix):]: conf for layer, conf in layers.items() if layer.startswith(prefix)}
    sd: dict[str, torch.Tensor] = {}
    total = sum(header.tensors[n].nbytes for n in names)
    done = 0
    for raw, v in read_tensors(header, names, mmap=mmap, prefetch=not mmap, on_map=on_map):
        sd[raw[len(prefix):]] = v
        done += header.tensors[raw].nbytes
        if progress:
            progress(done, total)
    for layer, conf in layers.items():
        sd[f"{layer}.comfy_quant"] = config_tensor(conf)
    core = {layer for layer, conf in layers.items() if conf.get("format") not in FP8_FORMATS}
    check_core_scales(header, sd, core)
    check_weight_scales(header, ((n, t) for n, t in sd.items() if n.rpartition(".")[0] not in core))
    return sd
