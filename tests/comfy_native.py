"""ComfyUI's native Wan model driven in this process on a GPU, for the CUDA tests: import ComfyUI from COMFYUI_PATH,
Wan inputs of one model call, and that call through ``BaseModel.apply_model`` with the patcher's wrappers and
callbacks, as a sampler makes it (the pack's forward hooks, Block Swap's prefetch among them, are an APPLY_MODEL
wrapper)."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

TEXT_DIM = 4096  # umt5-xxl hidden size: Wan's text_embedding input (comfy/ldm/wan/model.py text_dim)


def import_comfy(cpu: bool = False) -> Any:
    """Put ``COMFYUI_PATH`` on ``sys.path`` (once) and import ``comfy``; ``cpu`` sets ComfyUI's ``--cpu``."""
    root = os.environ["COMFYUI_PATH"]
    if root not in sys.path:
        sys.path.insert(0, root)
    if "comfy.model_management" not in sys.modules:
        from comfy.cli_args import args  # args parsing is off outside main.py: defaults apply

        args.cpu = cpu  # must precede comfy.model_management, which picks the device at import
    import comfy
    import comfy.model_management
    import comfy.patcher_extension
    import comfy.sd

    return comfy


def wan_inputs(model_patcher: Any, width: int, height: int, frames: int, seed: int = 0) -> dict:
    """x, sigma and context for one Wan 2.1 / 2.2 model call (16-channel latent, stride 8), on the model's device in
    its compute dtype."""
    base = model_patcher.model
    shape = (1, base.latent_format.latent_channels, (frames - 1) // 4 + 1, height // 8, width // 8)
    dtype = base.manual_cast_dtype or base.get_dtype()  # what BaseModel._apply_model casts inputs to
    device = model_patcher.load_device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return {"x": torch.randn(shape, generator=gen).to(device, dtype),
            "sigma": torch.full((1,), 0.5, device=device),  # float32, as a sampler passes it
            "context": torch.randn((1, 512, TEXT_DIM), generator=gen).to(device, dtype)}


def forward(model_patcher: Any, inputs: dict) -> torch.Tensor:
    """``apply_model(x, sigma, c_crossattn=context)`` under inference_mode, with the patcher's wrappers and callbacks
    merged into transformer_options as sampling does; the denoised output."""
    merge = import_comfy().patcher_extension.merge_nested_dicts
    options = merge({}, model_patcher.model_options.get("transformer_options", {}))
    options["wrappers"] = merge(options.get("wrappers", {}), model_patcher.wrappers)
    options["callbacks"] = merge(options.get("callbacks", {}), model_patcher.callbacks)
    with torch.inference_mode():
        return model_patcher.model.apply_model(inputs["x"], inputs["sigma"], c_crossattn=inputs["context"],
                                               transformer_options=options)
