"""Synthetic LoRAs under the official 4-step / 8-step LoRA names the Wan 2.2 and Qwen-Image templates wire.

Key formats, as ComfyUI's ``comfy/lora.py`` reads them (``model_lora_keys_unet``: a LoRA key is the model's
weight name without ``.weight``; ``comfy/weight_adapter/lora.py``: ``<key>.lora_up.weight`` [out, rank],
``<key>.lora_down.weight`` [rank, in], optional ``<key>.alpha`` scaling by alpha / rank):
- Wan 2.2 lightx2v LoRAs (Comfy-Org repackaged, from lightx2v/Wan2.2-Lightning): original Wan module names with
  the ``diffusion_model.`` prefix, e.g. ``diffusion_model.blocks.0.self_attn.q.lora_down.weight``, on every
  Linear inside the blocks (self/cross attention q k v o, I2V's k_img/v_img, ffn.0/ffn.2), fp32.
- Qwen-Image(-Edit) Lightning LoRAs (lightx2v/Qwen-Image-Lightning): diffusers module names without a prefix,
  e.g. ``transformer_blocks.0.attn.to_q.lora_down.weight``, on every Linear inside the blocks, bf16.
Ranks are tiny and the shapes come from ``synthetic/specs.py`` for the same size as the synthetic models, so a
LoRA patches exactly the model the runner wrote. The weights are small random numbers: they change the output,
not make it good.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..checkpoints.safe_write import write_atomic

# Official LoRA file name -> (synthetic model it patches, key prefix, dtype name).
KNOWN_LORA_FILES: dict[str, tuple[str, str, str]] = {
    "wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors": ("wan22_t2v_14B", "diffusion_model.", "float32"),
    "wan2.2_t2v_lightx2v_4steps_lora_v1.1_low_noise.safetensors": ("wan22_t2v_14B", "diffusion_model.", "float32"),
    "wan2.2_i2v_lightx2v_4steps_lora_v1_high_noise.safetensors": ("wan22_i2v_14B", "diffusion_model.", "float32"),
    "wan2.2_i2v_lightx2v_4steps_lora_v1_low_noise.safetensors": ("wan22_i2v_14B", "diffusion_model.", "float32"),
    "Qwen-Image-Lightning-8steps-V1.0.safetensors": ("qwen_image", "", "bfloat16"),
    "Qwen-Image-Lightning-4steps-V1.0.safetensors": ("qwen_image", "", "bfloat16"),
    "Qwen-Image-Edit-2509-Lightning-4steps-V1.0-bf16.safetensors": ("qwen_image", "", "bfloat16"),
    "Qwen-Image-Edit-2511-Lightning-4steps-V1.0-bf16.safetensors": ("qwen_image", "", "bfloat16"),
}
LORA_RANK = 4
FULL_RANK = 64  # full-size stand-ins: the rank of the released lightx2v / Lightning 4-step LoRAs
LORA_ALPHA = 4.0
LORA_STD = 0.01  # small: a patched weight stays close to the synthetic one
_BLOCK_LINEAR = re.compile(r"^(?:blocks|transformer_blocks)\.\d+\.")


def lora_layout(model: str, size: str = "tiny") -> list[tuple[str, tuple[int, ...]]]:
    """(module name, (out, in)) of every Linear inside the transformer blocks of ``model`` at ``size``."""
    from .specs import model_spec

    layout = []
    for name, shape, _ in model_spec(model, size):
        if name.endswith(".weight") and len(shape) == 2 and _BLOCK_LINEAR.match(name):
            layout.append((name[: -len(".weight")], (int(shape[0]), int(shape[1]))))
    if not layout:
        raise ValueError(f"{model}: no Linear layers in its blocks to put a LoRA on")
    return layout


def synthetic_lora(name: str, size: str = "tiny", rank: int = LORA_RANK, seed: int = 0) -> dict:
    """The state dict of the synthetic LoRA written under the official file ``name``."""
    import torch

    if name not in KNOWN_LORA_FILES:
        raise ValueError(f"{name}: not an official LoRA name this runner knows ({', '.join(sorted(KNOWN_LORA_FILES))})")
    model, prefix, dtype_name = KNOWN_LORA_FILES[name]
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for module, (out_f, in_f) in lora_layout(model, size):
        key = prefix + module
        sd[f"{key}.lora_down.weight"] = (torch.randn(rank, in_f, generator=gen) * LORA_STD).to(dtype)
        sd[f"{key}.lora_up.weight"] = (torch.randn(out_f, rank, generator=gen) * LORA_STD).to(dtype)
        sd[f"{key}.alpha"] = torch.tensor(LORA_ALPHA, dtype=dtype)
    return sd


def write_synthetic_loras(names: set[str], models_dir: Path, size: str = "tiny") -> list[Path]:
    """Write each known LoRA name under ``models_dir/loras`` (cached: an existing file is kept); returns paths."""
    paths = []
    for name in sorted(names):
        path = models_dir / "loras" / name
        if not path.exists():  # a dangling link there is refused by write_atomic, never written through
            from safetensors.torch import save

            path.parent.mkdir(parents=True, exist_ok=True)
            print(f"  synthetic LoRA ({KNOWN_LORA_FILES[name][0]} {size}) -> loras/{name}", flush=True)
            rank = FULL_RANK if size == "full" else LORA_RANK
            write_atomic(path, save(synthetic_lora(name, size, rank), metadata={"synthetic": "comfyui_lowvram_dit"}))
        paths.append(path)
    return paths
