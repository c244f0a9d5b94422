"""The reduced text encoders of ``run --synthetic tiny`` and the selftest, for the pack's streaming text nodes.

Those nodes read an encoder's layer count and widths from the file, so a 2-layer encoder (seconds to write and
encode) stands in for the full one that stock CLIPLoader needs. Torch-free: a cached run checks its files without
importing torch.
"""

from __future__ import annotations

TINY_TE_LAYERS = 2
# The Qwen2.5-VL vision tower is written at the size ComfyUI always builds (32 blocks of width 1280), its blocks as
# zeros (a sparse file): a residual block with zero weights passes its input through, so an image still reaches the
# language model through the random patch embedding and merger.
TINY_ZERO_PREFIXES = ("visual.blocks.",)


def tiny_text_encoder_config(model: str, vision: bool = False) -> object | None:
    """The reduced config of a text encoder loaded by a staged node (None: ``model`` is not a text encoder).

    umT5: 2 layers, d_model 4096 (Wan's text_dim), 2 heads, d_ff 256, vocab 512 (the synthetic tokenizer's ids
    are < 200). Qwen2.5-VL: 2 layers, hidden 128 (the tiny Qwen-Image's joint dim: the staged loader reads both
    from the files), 4 query and 4 key/value heads of 128 (ComfyUI detects a 7B by its 512-wide k_proj bias),
    narrow MLP, the full vocabulary (ComfyUI's bundled tokenizer emits ids up to 151k) and no vision tower: text
    prompts never run it, and the staged loader only warns that its weights are missing (load_clip does too).
    ``vision``: with the full-size vision tower, for the Edit loader (its merger projects to the file's hidden
    size, so the language model stays as narrow).
    """
    from .specs import QWEN_TINY_JOINT_DIM, Qwen25VLConfig, UMT5Config

    if model == "umt5_xxl_enc":
        return UMT5Config(num_layers=TINY_TE_LAYERS, d_ff=256, num_heads=2, vocab_size=512)
    if model == "qwen25_vl_7b":
        return Qwen25VLConfig(num_layers=TINY_TE_LAYERS, hidden=QWEN_TINY_JOINT_DIM, num_heads=4, intermediate=256,
                              vision_tower=vision)
    return None
