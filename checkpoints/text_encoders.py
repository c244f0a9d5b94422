"""Text encoders read from their files: sizes in ComfyUI's config field names, and the storage format.

Plain torch, no ComfyUI. Qwen2.5-VL (Qwen-Image) and umT5-XXL (Wan): the released files give ComfyUI's fixed
configs; reading the shapes lets reduced-layer files of the same architecture load with the right sizes.
"""

from __future__ import annotations

import re

from .safetensors_io import CheckpointError, SafetensorsHeader, check_ranks
from .fp8_state import FP8_DTYPES

TE_HEAD_DIM = 128  # Qwen2.5-VL-7B head_dim (HF config; ComfyUI llama.Qwen25_7BVLI_Config.head_dim)
_TE_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def qwen25_vl_config_from_header(header: SafetensorsHeader) -> dict[str, int]:
    """Language-model sizes read from the file's shapes, in ComfyUI's ``Qwen25_7BVLI_Config`` field names.

    For the released 7B file these equal ComfyUI's defaults; passing them lets smaller files of the same
    architecture (the tests' synthetic encoder) load with the right shapes instead of half-initialised.
    """
    t = header.tensors
    need = ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.bias",
            "model.layers.0.mlp.gate_proj.weight")
    missing = [k for k in need if k not in t]
    if missing:
        raise CheckpointError(
            f"{header.path.name}: not a Qwen2.5-VL text encoder (missing {', '.join(missing)}); Qwen-Image needs "
            "qwen_2.5_vl_7b.safetensors or qwen_2.5_vl_7b_fp8_scaled.safetensors in models/text_encoders")
    check_ranks(header, dict(zip(need, (2, 1, 2, 2, 1, 2))), "Qwen2.5-VL text encoder")
    layers = sorted({int(m.group(1)) for k in t if (m := _TE_LAYER.match(k))})
    return {
        "vocab_size": t["model.embed_tokens.weight"].shape[0],
        "hidden_size": t["model.norm.weight"].shape[0],
        "intermediate_size": t["model.layers.0.mlp.gate_proj.weight"].shape[0],
        "num_hidden_layers": len(layers),
        "num_attention_heads": t["model.layers.0.self_attn.q_proj.weight"].shape[0] // TE_HEAD_DIM,
        "num_key_value_heads": t["model.layers.0.self_attn.k_proj.weight"].shape[0] // TE_HEAD_DIM,
    }


def text_encoder_format(header: SafetensorsHeader) -> str:
    """"comfy_quant", "fp8_scaled" (legacy ComfyUI marker), "fp8" (plain cast) or the norm dtype ("bfloat16")."""
    if "_quantization_metadata" in header.metadata or any(k.endswith(".comfy_quant") for k in header.tensors):
        return "comfy_quant"
    if "scaled_fp8" in header.tensors:
        return "fp8_scaled"
    if any(i.dtype in FP8_DTYPES for i in header.tensors.values()):
        return "fp8"
    norm = header.tensors.get("model.norm.weight", header.tensors.get("encoder.final_layer_norm.weight"))
    return str(norm.dtype).removeprefix("torch.") if norm is not None else "unknown"


# ----------------------------------------------------------------------------------------------------------
# umT5-XXL text encoder (Wan): config from the file

_UMT5_BLOCK = re.compile(r"encoder\.block\.(\d+)\.")


def umt5_config_from_header(header: SafetensorsHeader) -> dict[str, int]:
    """Encoder sizes read from the file's shapes, in ComfyUI's ``umt5_config_xxl.json`` field names.

    For the released umT5-XXL file these equal ComfyUI's fixed config (24 layers, d_model 4096, d_ff 10240,
    64 heads x 64, vocab 256384); reading them lets reduced-layer files of the same architecture load.
    """
    t = header.tensors
    need = ("shared.weight", "encoder.final_layer_norm.weight", "encoder.block.0.layer.0.SelfAttention.q.weight",
            "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            "encoder.block.0.layer.1.DenseReluDense.wi_0.weight", "encoder.block.0.layer.1.DenseReluDense.wi_1.weight")
    missing = [k for k in need if k not in t]
    if missing:
        raise CheckpointError(
            f"{header.path.name}: not a umT5 text encoder (missing {', '.join(missing)}); Wan needs "
            "umt5_xxl_fp16.safetensors or umt5_xxl_fp8_e4m3fn_scaled.safetensors in models/text_encoders")
    check_ranks(header, dict.fromkeys(need, 2) | {"encoder.final_layer_norm.weight": 1}, "umT5 text encoder")
    layers = sorted({int(m.group(1)) for k in t if (m := _UMT5_BLOCK.match(k))})
    if layers != list(range(len(layers))):
        raise CheckpointError(f"{header.path.name}: encoder blocks are not numbered 0..{len(layers) - 1}")
    if len(layers) > 1 and "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight" not in t:
        raise CheckpointError(f"{header.path.name}: a T5 encoder (one shared position bias), not umT5 (one per "
                              "layer); Wan needs umT5-XXL")
    heads = t["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"].shape[1]
    return {
        "num_layers": len(layers),
        "d_model": t["shared.weight"].shape[1],
        "d_ff": t["encoder.block.0.layer.1.DenseReluDense.wi_0.weight"].shape[0],
        "num_heads": heads,
        "d_kv": t["encoder.block.0.layer.0.SelfAttention.q.weight"].shape[0] // heads,
        "vocab_size": t["shared.weight"].shape[0],
    }
