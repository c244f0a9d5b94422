"""Synthetic checkpoints in ComfyUI's own quantized layouts, written with comfy-kitchen's layout classes.

Each selected Linear weight of a tiny synthetic model (synthetic/checkpoints.py) is quantized by comfy-kitchen
(``QuantizedTensor.from_float`` with the layout's class, as ComfyUI's own quantizers do) and stored under the
names ``QuantizedTensor.state_dict`` gives it, next to a ``<layer>.comfy_quant`` config with the fields ComfyUI's
layer loader reads (``comfy/ops.py`` ``_quantized_weight_state_dict``). Needs comfy-kitchen (ComfyUI's
requirement).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

# layout name (kernels/core_quant.layout_name) -> (format, comfy-kitchen layout class, from_float arguments); the
# class names are comfy-kitchen's registry names, so files can be written on a host whose ComfyUI lacks the format
LAYOUTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "int8_tensorwise": ("int8_tensorwise", "TensorWiseINT8Layout", {}),
    "int8_tensorwise+convrot": ("int8_tensorwise", "TensorWiseINT8Layout", {"convrot": True, "per_channel": True}),
    "mxfp8": ("mxfp8", "TensorCoreMXFP8Layout", {}),
    "nvfp4": ("nvfp4", "TensorCoreNVFP4Layout", {}),
    "convrot_w4a4": ("convrot_w4a4", "TensorCoreConvRotW4A4Layout", {}),
    "asym_w4a8_int8": ("asym_w4a8_int8", "AsymW4A8Int8Layout", {}),
}


def layer_config(fmt: str, params: Any) -> dict[str, Any]:
    """The ``comfy_quant`` config ComfyUI writes for a layer of ``fmt`` with these layout params."""
    conf: dict[str, Any] = {"format": fmt}
    if fmt == "int8_tensorwise" and getattr(params, "convrot", False):
        conf.update(convrot=True, convrot_groupsize=params.convrot_groupsize)
    elif fmt == "convrot_w4a4":
        conf["convrot_groupsize"] = params.convrot_groupsize
    elif fmt == "asym_w4a8_int8":
        conf.update(group_size=params.group_size, convrot_groupsize=params.convrot_groupsize)
    return conf


def quantize_state_dict(sd: dict[str, torch.Tensor], layout: str, is_target: Callable[[str, tuple], bool],
                        prefix: str = "", as_metadata: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(state dict, safetensors metadata): ``sd``'s target weights in ``layout``, every key under ``prefix``.

    ``as_metadata``: the configs go into the file's ``_quantization_metadata`` instead of ``comfy_quant`` tensors."""
    from comfy_kitchen.tensor import QuantizedTensor

    fmt, cls_name, kwargs = LAYOUTS[layout]
    out: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[str, Any]] = {}
    for key, value in sd.items():
        if not is_target(key, tuple(value.shape)):
            out[prefix + key] = value
            continue
        qt = QuantizedTensor.from_float(value.to(torch.bfloat16), cls_name, **kwargs)
        for name, t in qt.state_dict(prefix + key).items():
            out[name] = t.detach().contiguous().clone()
        layer = prefix + key[: -len(".weight")]
        layers[layer] = layer_config(fmt, qt._params)
    if as_metadata:
        return out, {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}
    for layer, conf in layers.items():
        out[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)
    return out, {}


def write_quantized(sd: dict[str, torch.Tensor], path: Path, layout: str, is_target: Callable[[str, tuple], bool],
                    prefix: str = "", as_metadata: bool = False) -> Path:
    """Write ``sd`` with its target weights in ``layout`` to ``path`` (see ``quantize_state_dict``)."""
    tensors, metadata = quantize_state_dict(sd, layout, is_target, prefix, as_metadata)
    save_file(tensors, str(path), metadata=metadata or None)
    return path
