"""ComfyUI's own quantized layouts in the pack's loaders and patch nodes: can this ComfyUI build them, and say so.

A file whose layers use a layout other than fp8 e4m3 / e5m2 (``int8_tensorwise``, int8 ConvRot, ``mxfp8``,
``nvfp4``, ``convrot_w4a4``, ``asym_w4a8_int8``, ...) is built by ComfyUI's ``mixed_precision_ops`` as
``QuantizedTensor`` weights, exactly as UNETLoader builds it. What builds a layout is the host's
``comfy.quant_ops.QUANT_ALGOS`` entry and its registered layout class: a host without them would fail deep inside
model construction (or, for int8 ConvRot on a host that ignores the rotation, compute something else), so the
loaders refuse such a file up front, naming the layout and the stock node that reads it.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any

from ..checkpoints.safetensors_io import quant_layer_configs, read_header
from ..checkpoints.core_quant import core_layouts, describe_layouts, layout_name

from .version import comfyui_version

log = logging.getLogger("comfyui_lowvram_dit")

# What ComfyUI 0.33 reads besides fp8 (its comfy/quant_ops.py QUANT_ALGOS), named in refusals on older hosts.
READ_BY_0_33 = ("int8_tensorwise", "int8_tensorwise+convrot", "mxfp8", "nvfp4", "convrot_w4a4", "asym_w4a8_int8")


def _ops_reads_convrot() -> bool:
    """Whether this host's layer loader passes ``convrot`` on to the int8 layout (else it would drop the rotation)."""
    import comfy.ops

    try:
        return "convrot" in inspect.getsource(comfy.ops)
    except (OSError, TypeError):
        return False


def host_builds(conf: dict[str, Any]) -> bool:
    """Whether the running ComfyUI builds a layer of this ``comfy_quant`` config as its quantized layout."""
    import comfy.quant_ops as qo

    algo = getattr(qo, "QUANT_ALGOS", {}).get(conf.get("format"))
    if algo is None or not getattr(qo, "_CK_AVAILABLE", False) or not hasattr(qo, "get_layout_class"):
        return False
    cls = qo.get_layout_class(algo.get("comfy_tensor_layout"))
    if cls is None:
        return False
    if layout_name(conf) == "int8_tensorwise+convrot":
        return "convrot" in getattr(getattr(cls, "Params", None), "__dataclass_fields__", {}) and _ops_reads_convrot()
    return True


def unreadable_layouts(layers: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Layout name -> layers, for the non-fp8 layouts among ``layers`` that this ComfyUI cannot build."""
    return {name: names for name, names in core_layouts(layers).items()
            if not host_builds(layers[names[0]])}


def refusal(file_name: str, loader: str, missing: dict[str, list[str]]) -> str:
    """The ValueError text for a file in layouts this ComfyUI cannot build: the layouts, the node that reads it."""
    names = sorted(missing)
    newer = all(n in READ_BY_0_33 for n in names)
    where = ("on ComfyUI 0.33 or newer (its comfy/quant_ops.py reads " + ", ".join(READ_BY_0_33) + ")") if newer \
        else "on a ComfyUI whose comfy/quant_ops.py lists " + " and ".join(names)
    return (f"{file_name}: {describe_layouts(missing)} in ComfyUI's quantized layout{'s' * (len(names) > 1)} "
            f"{', '.join(names)}, which this ComfyUI ({comfyui_version() or 'unknown'}) cannot build, so the {loader} does not "
            f"take this file here. Load it with the stock UNETLoader (Load Diffusion Model) {where}, or pick a "
            "bf16 / fp8 file of the model for this loader")


def check_host_reads(path: str | Path, loader: str) -> dict[str, dict[str, Any]]:
    """Before any weight is read: ValueError naming the file when it uses layouts this ComfyUI cannot build;
    returns the file's per-layer quant configs (empty for files without them)."""
    header = read_header(path)
    if "_quantization_metadata" not in header.metadata and not any(n.endswith(".comfy_quant") for n in header.tensors):
        return {}
    layers = quant_layer_configs(header)
    missing = unreadable_layouts(layers)
    if missing:
        raise ValueError(refusal(Path(path).name, loader, missing))
    return layers


def announce(file_name: str, layers: dict[str, dict[str, Any]], loader: str) -> None:
    """The one log line of a load that ComfyUI's own layers compute."""
    log.info("lowvram_dit %s: %s holds %s; ComfyUI's own quantized layers (mixed_precision_ops, QuantizedTensor) "
             "build and run it, as UNETLoader would; the quantization / block_size / compute options do not apply",
             loader, file_name, describe_layouts(core_layouts(layers)))


def model_layouts(model: Any) -> list[str]:
    """The quantized layouts of ComfyUI's own layers in a MODEL (a ModelPatcher), e.g. ["nvfp4"]; [] for none."""
    import comfy.quant_ops as qo

    qt = getattr(qo, "QuantizedTensor", None)
    found: set[str] = set()
    root = getattr(getattr(model, "model", None), "diffusion_model", None)
    if qt is None or root is None:
        return []
    for module in root.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, qt) or isinstance(getattr(weight, "data", None), qt):
            params = getattr(weight, "_params", None)
            conf = {"format": getattr(module, "quant_format", None), "convrot": getattr(params, "convrot", False)}
            found.add(layout_name(conf))
    return sorted(found)
