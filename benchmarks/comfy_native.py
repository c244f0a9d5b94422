"""ComfyUI's native path, imported from ``COMFYUI_PATH``, so benchmarks compare against it in the same run.

``load_native_model`` builds a MODEL from a state dict exactly as ``nodes.UNETLoader`` does (same
``model_options`` per ``weight_dtype``, then ``comfy.sd.load_diffusion_model_state_dict``) and places it
with ``comfy.model_management.load_models_gpu``, the call KSampler makes (optionally under a VRAM cap
applied as a user would: ComfyUI's reserved VRAM set so only the cap is free, plus a hard
``torch.cuda.set_per_process_memory_fraction``).
``wan_inputs`` + ``forward`` run one forward of the Wan diffusion model.

Benchmark-only code: ComfyUI global state (the VRAM cap, loaded models) is changed for the whole
process, which is why the harness runs each variant in a fresh process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch

GIB = float(1 << 30)
WEIGHT_DTYPES = ("default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2")
TEXT_DIM = 4096  # umt5-xxl hidden size: Wan's text_embedding input (comfy/ldm/wan/model.py text_dim)


def comfyui_path() -> Path:
    """The ComfyUI checkout named by ``COMFYUI_PATH`` (must contain comfy/ and nodes.py)."""
    root = os.environ.get("COMFYUI_PATH")
    if not root:
        raise RuntimeError("COMFYUI_PATH is not set: export COMFYUI_PATH=/path/to/ComfyUI (a v0.8.0+ checkout)")
    path = Path(root).expanduser().resolve()
    if not (path / "comfy" / "sd.py").is_file() or not (path / "nodes.py").is_file():
        raise RuntimeError(f"COMFYUI_PATH={root} is not a ComfyUI checkout (no comfy/sd.py or nodes.py there)")
    return path


def import_comfy(cpu: bool = False) -> Any:
    """Put ``COMFYUI_PATH`` on ``sys.path`` (once) and import ``comfy``; ``cpu`` sets ComfyUI's ``--cpu``."""
    root = str(comfyui_path())
    if root not in sys.path:
        sys.path.insert(0, root)
    if "comfy.model_management" not in sys.modules:
        from comfy.cli_args import args  # args parsing is off outside main.py: defaults apply

        if cpu:
            args.cpu = True  # must precede comfy.model_management, which picks the device at import
    import comfy
    import comfy.model_management
    import comfy.model_patcher
    import comfy.patcher_extension
    import comfy.sd

    return comfy


def unet_model_options(weight_dtype: str = "default") -> dict:
    """``model_options`` that ``nodes.UNETLoader.load_unet`` (v0.8.0) builds for ``weight_dtype``."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype {weight_dtype!r} is not one of UNETLoader's {WEIGHT_DTYPES}")
    options: dict = {}
    if weight_dtype == "fp8_e4m3fn":
        options["dtype"] = torch.float8_e4m3fn
    elif weight_dtype == "fp8_e4m3fn_fast":
        options["dtype"] = torch.float8_e4m3fn
        options["fp8_optimizations"] = True
    elif weight_dtype == "fp8_e5m2":
        options["dtype"] = torch.float8_e5m2
    return options


def apply_vram_cap(vram_cap_gb: float) -> dict:
    """Make only ``vram_cap_gb`` usable, as a user with that card would see it (process-wide, irreversible)."""
    comfy = import_comfy()
    mm = comfy.model_management
    device = mm.get_torch_device()
    if device.type != "cuda":
        raise RuntimeError("vram_cap_gb needs a CUDA device (ComfyUI is running on the CPU here)")
    mm.soft_empty_cache(force=True)
    cap = int(vram_cap_gb * GIB)
    free = mm.get_free_memory(device)
    if cap > free:
        raise RuntimeError(f"vram_cap_gb={vram_cap_gb} is more than the {free / GIB:.1f} GiB free on {device}")
    # ComfyUI budgets weights as free - reserved - 0.8 GiB (model_management.minimum_inference_memory).
    mm.EXTRA_RESERVED_VRAM = free - cap
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, (torch.cuda.memory_reserved(device) + cap) / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return {"vram_cap_gb": vram_cap_gb, "reserved_vram_gib": (free - cap) / GIB, "memory_fraction": fraction}


def load_native_model(state_dict: dict, weight_dtype: str = "default", model_options: dict | None = None,
                      vram_cap_gb: float | None = None, latent_shape: tuple[int, ...] | None = None,
                      wrap: Callable[[Any, int], Any] | None = None) -> Any:
    """A ModelPatcher built as UNETLoader would and placed by ``load_models_gpu`` (as KSampler would).

    ``wrap(patcher, memory_required)`` stands for the nodes a user wires between the loader and KSampler (Block
    Swap, Attention, Torch Compile): it returns the patcher that is loaded; the one place every in-process row
    builds its model.

    ``state_dict`` is consumed (ComfyUI pops the keys it loads). ``model_options`` are merged over
    UNETLoader's (e.g. ``{"dtype": torch.bfloat16}`` = ``--bf16-unet``, or ``custom_operations``).
    ``latent_shape`` [B, C, T, H, W] makes ``load_models_gpu`` reserve what KSampler's
    ``estimate_memory`` would (cond + uncond batch); without it nothing is reserved for activations.
    """
    comfy = import_comfy()
    mm = comfy.model_management
    options = {**unet_model_options(weight_dtype), **(model_options or {})}
    patcher = comfy.sd.load_diffusion_model_state_dict(state_dict, model_options=options)
    if patcher is None:
        raise RuntimeError("ComfyUI could not detect the model type of this state dict "
                           "(comfy.sd.load_diffusion_model_state_dict returned None): check its key names")
    state_dict.clear()  # drop what ComfyUI did not pop (e.g. on-GPU synthetic tensors) before measuring
    mm.soft_empty_cache(force=True)
    if vram_cap_gb is not None:
        apply_vram_cap(vram_cap_gb)
    memory_required = minimum_required = 0
    if latent_shape is not None:
        b, rest = int(latent_shape[0]), list(latent_shape[1:])
        memory_required = patcher.model.memory_required([2 * b, *rest])  # sampler_helpers.estimate_memory
        minimum_required = patcher.model.memory_required([b, *rest])
    if wrap is not None:
        patcher = wrap(patcher, int(memory_required))
    mm.load_models_gpu([patcher], memory_required=memory_required,
                       minimum_memory_required=minimum_required if latent_shape is not None else None)
    return patcher


def describe(patcher: Any) -> dict:
    """What ComfyUI decided for this model: dtypes, op class, resident vs offloaded bytes."""
    base = patcher.model
    linear = next((m for m in base.diffusion_model.modules() if isinstance(m, torch.nn.Linear)), None)
    return {
        "model_class": type(base).__name__,
        "weight_dtype": str(base.get_dtype()).replace("torch.", ""),
        "compute_dtype": str(base.manual_cast_dtype or base.get_dtype()).replace("torch.", ""),
        "linear_op": f"{type(linear).__module__}.{type(linear).__qualname__}" if linear is not None else None,
        "model_size_gib": round(patcher.model_size() / GIB, 3),
        "loaded_gib": round(patcher.loaded_size() / GIB, 3),
        "lowvram": bool(getattr(base, "model_lowvram", False)),
    }


def wan_latent_shape(latent_channels: int, width: int, height: int, frames: int, batch: int = 1) -> tuple:
    """Wan latent [B, C, (F-1)/4+1, H/s, W/s]; s = 16 for the 48-channel Wan 2.2 VAE, else 8."""
    spatial = 16 if latent_channels == 48 else 8
    if (frames - 1) % 4:
        raise ValueError(f"frames={frames}: Wan needs 4k+1 frames (e.g. 81, 121)")
    if width % (2 * spatial) or height % (2 * spatial):
        raise ValueError(f"{width}x{height}: width and height must be multiples of {2 * spatial} for this "
                         "model (VAE stride x patch size 2)")
    return (batch, latent_channels, (frames - 1) // 4 + 1, height // spatial, width // spatial)


def wan_tokens(latent_shape: tuple) -> int:
    """Transformer tokens per sample for a Wan latent (patch 1x2x2)."""
    return latent_shape[2] * (latent_shape[3] // 2) * (latent_shape[4] // 2)


def wan_inputs(model_patcher: Any, width: int, height: int, frames: int, batch: int = 1,
               text_len: int = 512, seed: int = 0, timestep: float = 500.0) -> dict:
    """x, timestep and context for one Wan forward, on the model's device in its compute dtype."""
    base = model_patcher.model
    shape = wan_latent_shape(base.latent_format.latent_channels, width, height, frames, batch)
    dtype = base.manual_cast_dtype or base.get_dtype()  # what BaseModel._apply_model casts inputs to
    device = model_patcher.load_device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return {
        "x": torch.randn(shape, generator=gen).to(device, dtype),
        "timestep": torch.full((batch,), float(timestep), device=device),  # float32, as _apply_model passes
        "context": torch.randn((batch, text_len, TEXT_DIM), generator=gen).to(device, dtype),
        "tokens": wan_tokens(shape),
    }


def transformer_options(model_patcher: Any) -> dict:
    """The patcher's transformer_options with its wrappers/callbacks merged in, as sampling does."""
    comfy = import_comfy()
    merge = comfy.patcher_extension.merge_nested_dicts
    options = merge({}, model_patcher.model_options.get("transformer_options", {}))
    options["wrappers"] = merge(options.get("wrappers", {}), model_patcher.wrappers)
    options["callbacks"] = merge(options.get("callbacks", {}), model_patcher.callbacks)
    return options


def forward(model_patcher: Any, inputs: dict, via: str = "diffusion_model") -> torch.Tensor:
    """One forward under inference_mode: ``diffusion_model(x, t, context)`` or the full ``apply_model``."""
    base = model_patcher.model
    options = transformer_options(model_patcher)
    with torch.inference_mode():
        if via == "diffusion_model":
            return base.diffusion_model(inputs["x"], inputs["timestep"], context=inputs["context"],
                                        transformer_options=options)
        if via == "apply_model":  # adds APPLY_MODEL wrappers (e.g. torch.compile) and input scaling
            sigma = inputs["timestep"] / 1000.0  # ModelSamplingDiscreteFlow multiplier 1000
            return base.apply_model(inputs["x"], sigma, c_crossattn=inputs["context"],
                                    transformer_options=options)
    raise ValueError(f"via={via!r}: use 'diffusion_model' or 'apply_model'")
