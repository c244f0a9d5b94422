"""Building a native MODEL from a state dict with ComfyUI's loader, as checkpoints/build_recipe.py says."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, get_args

from ..checkpoints.build_recipe import BuildRecipe
from ..checkpoints.fp8_state import QuantMode
from ..kernels.int8_choice import COMPUTE as COMPUTE_MODES, Compute

# The loader nodes' compute labels -> the compute mode the loading functions take
COMPUTE: dict[str, Compute] = {"auto": "auto", "fp8 matmul": "fp8", "int8 matmul": "int8", "dequantize": "dequantize"}

_DETECTION_LOCK = threading.Lock()


@contextmanager
def detected_config_defaults(values: dict[str, Any]) -> Iterator[None]:
    """While active, ComfyUI's model detection (``comfy.model_detection.detect_unet_config``) adds ``values`` to
    the config it detects, for keys it did not set itself; the model is then built with them.

    ComfyUI's loaders take no model config, and its detection reads some architectures' sizes from the weights
    but builds others (Qwen-Image's width, heads, joint dimension) at fixed defaults. What it detects itself always
    wins. The module attribute is swapped only for the call (one loader at a time) and restored after.
    """
    if not values:
        yield
        return
    import comfy.model_detection as md

    with _DETECTION_LOCK:
        original = md.detect_unet_config

        def detect(*args: Any, **kwargs: Any) -> Any:
            config = original(*args, **kwargs)
            if isinstance(config, dict):
                for key, value in values.items():
                    config.setdefault(key, value)
            return config

        md.detect_unet_config = detect
        try:
            yield
        finally:
            md.detect_unet_config = original


def check_load_options(loader: str, mode: str, compute: str) -> None:
    """ValueError naming ``loader`` unless ``mode`` is a quantization mode and ``compute`` a compute mode (the
    pack's vocabulary, not the nodes' labels)."""
    if mode not in get_args(QuantMode) or compute not in COMPUTE_MODES:
        raise ValueError(f"{loader}: quantization must be one of {sorted(get_args(QuantMode))} and compute one of "
                         f"{sorted(COMPUTE_MODES)}, got {mode!r} and {compute!r}")


def build_model(state_dict: dict, recipe: BuildRecipe, compute: str, reload: tuple[Callable, tuple],
                disable_dynamic: bool = False, unet_config: dict[str, Any] | None = None) -> Any:
    """A native MODEL from ``state_dict`` as ``recipe`` says: the pack's fp8 layers (running ``compute``) or
    ComfyUI's own, exactly as UNETLoader builds them; DynamicVRAM off where ``disable_dynamic`` or the recipe says so.
    ``reload`` = (loader, args) is registered as ``cached_patcher_init``, which ComfyUI calls with
    ``disable_dynamic=True`` for a fresh copy. ``unet_config``: model-config values read from the file that ComfyUI's
    detection leaves at its defaults (see ``detected_config_defaults``)."""
    import comfy.sd

    from .fp8_ops import Fp8OpsConfig, make_fp8_ops  # imports ComfyUI's ops

    options: dict[str, Any] = {}
    if recipe.fp8_block_size is not None:
        options["custom_operations"] = make_fp8_ops(Fp8OpsConfig(block_size=recipe.fp8_block_size, compute=compute))
    if recipe.dtype is not None:
        options["dtype"] = recipe.dtype
    kwargs = {}
    if "disable_dynamic" in inspect.signature(comfy.sd.load_diffusion_model_state_dict).parameters:
        kwargs["disable_dynamic"] = disable_dynamic or not recipe.dynamic_vram
    with detected_config_defaults(unet_config or {}):
        model = comfy.sd.load_diffusion_model_state_dict(state_dict, model_options=options, **kwargs)
    if model is not None and hasattr(model, "cached_patcher_init"):
        model.cached_patcher_init = reload
    return model
