"""Building a native MODEL from a state dict with ComfyUI's loader (DynamicVRAM rule, detected-config defaults)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

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


def load_diffusion_model(state_dict: dict, model_options: dict, reload: tuple[Callable, tuple],
                         disable_dynamic: bool = False, unet_config: dict[str, Any] | None = None,
                         dynamic_ops: bool = False) -> Any:
    """``comfy.sd.load_diffusion_model_state_dict``, with the pack's rule for ComfyUI's DynamicVRAM.

    A model built with ComfyUI's own layers stays as UNETLoader builds it. A model built with the pack's ops
    (``model_options["custom_operations"]``) gets DynamicVRAM only where its layers take their weights through
    ComfyUI's ``cast_bias_weight`` (``dynamic_ops``: the Wan Loader's fp8 layers do); otherwise the legacy patcher
    (ComfyUI's own torch.compile node does the same), and Block Swap and the file-backed offload manage it.
    ``reload`` = (loader, args) is registered as ``cached_patcher_init``, which ComfyUI calls with
    ``disable_dynamic=True`` for a fresh copy.
    ``unet_config``: model-config values read from the file that ComfyUI's detection leaves at its defaults
    (see ``detected_config_defaults``)."""
    import inspect

    import comfy.sd

    kwargs = {}
    if "disable_dynamic" in inspect.signature(comfy.sd.load_diffusion_model_state_dict).parameters:
        kwargs["disable_dynamic"] = disable_dynamic or ("custom_operations" in model_options and not dynamic_ops)
    with detected_config_defaults(unet_config or {}):
        model = comfy.sd.load_diffusion_model_state_dict(state_dict, model_options=model_options, **kwargs)
    if model is not None and hasattr(model, "cached_patcher_init"):
        model.cached_patcher_init = reload
    return model
