"""Tensor layouts (name, shape, dtype, file order) of the models this pack serves, generated from each config.

The layouts are built from the architecture configs below, never read from a manifest, so a test can compare them
with the manifests measured from ComfyUI's own modules (`tests/shapes/`). Dtypes are those of the bf16 releases as
ComfyUI instantiates them: bf16 everywhere, Wan `patch_embedding` fp32, VAEs fp32.

"tiny" layouts keep every key pattern and every size that ComfyUI (0.8.0 to 0.33.0) hard-codes, and shrink the rest:
- Wan DiTs: dim 256 (ComfyUI derives num_heads = dim // 128), ffn 512, 2 blocks; text_dim 4096, freq_dim 256,
  in/out channels and the CLIP-image width 1280 stay (comfy/model_detection.py, comfy/ldm/wan/model.py).
- Qwen-Image: 1 block, 2 heads of 128, joint dim 128. ComfyUI's detection reads only in_channels and the block
  count, so stock UNETLoader needs the full width; the pack's Staged Loader reads the widths from the file
  (checkpoints/qwen_image.py), which is what the tiny file is for. Its head size stays 128 (ComfyUI's rotary axes).
- Wan 2.1 VAE: ComfyUI reads `dim` from `decoder.head.0.gamma` -> tiny dim 16. Wan 2.2 VAE, TAEHV, umT5-XXL and
  Qwen2.5-VL-7B: ComfyUI builds them at fixed sizes -> tiny == full (`run --synthetic tiny` swaps the Wan 2.2 VAE
  for TAEHV and writes 2-layer encoders for the pack's streaming text nodes: synthetic/tiny.py).
`python -m comfyui_lowvram_dit synth --list` prints every file size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

Spec = list[tuple[str, tuple[int, ...], torch.dtype]]

SIZES: tuple[str, ...] = ("full", "tiny")

# Which ComfyUI model folder each model's file belongs in (the stock loader that reads it).
MODEL_FOLDER: dict[str, str] = {
    "wan22_t2v_14B": "diffusion_models",
    "wan22_i2v_14B": "diffusion_models",
    "wan22_ti2v_5B": "diffusion_models",
    "wan21_t2v_1_3B": "diffusion_models",
    "wan21_i2v_14B": "diffusion_models",
    "qwen_image": "diffusion_models",
    "umt5_xxl_enc": "text_encoders",
    "qwen25_vl_7b": "text_encoders",
    "wan21_vae": "vae",
    "wan22_vae": "vae",
    "wan21_tae": "vae_approx",  # stock VAELoader looks for lighttaew2_1 / lighttaew2_2 there
    "wan22_tae": "vae_approx",
}
MODELS: tuple[str, ...] = tuple(MODEL_FOLDER)

BF16 = torch.bfloat16
F32 = torch.float32


# Wan 2.1 / 2.2 DiT (original Wan key names, as ComfyUI loads them prefix-less)


@dataclass(frozen=True)
class WanConfig:
    """Wan DiT config (Wan-Video/Wan2.2 wan/configs; ComfyUI comfy/ldm/wan/model.py WanModel)."""

    dim: int
    ffn_dim: int
    num_layers: int
    in_dim: int
    out_dim: int
    clip_image: bool = False  # Wan 2.1 I2V: img_emb + k_img/v_img cross-attention branch
    text_dim: int = 4096  # fixed in ComfyUI detection
    freq_dim: int = 256  # fixed in ComfyUI detection
    patch: tuple[int, int, int] = (1, 2, 2)
    clip_dim: int = 1280  # CLIP-H vision width, fixed in ComfyUI's MLPProj


WAN_CONFIGS: dict[str, WanConfig] = {
    "wan22_t2v_14B": WanConfig(dim=5120, ffn_dim=13824, num_layers=40, in_dim=16, out_dim=16),
    # Wan 2.2 I2V: 16 noise + 4 mask + 16 image-latent input channels, no CLIP branch.
    "wan22_i2v_14B": WanConfig(dim=5120, ffn_dim=13824, num_layers=40, in_dim=36, out_dim=16),
    "wan22_ti2v_5B": WanConfig(dim=3072, ffn_dim=14336, num_layers=30, in_dim=48, out_dim=48),
    "wan21_t2v_1_3B": WanConfig(dim=1536, ffn_dim=8960, num_layers=30, in_dim=16, out_dim=16),
    "wan21_i2v_14B": WanConfig(dim=5120, ffn_dim=13824, num_layers=40, in_dim=36, out_dim=16, clip_image=True),
}
# dim must be a multiple of 128 (ComfyUI: num_heads = dim // 128); 256 -> 2 heads.
WAN_TINY = {"dim": 256, "ffn_dim": 512, "num_layers": 2}


def _linear(name: str, out_f: int, in_f: int, bias: bool = True, dtype: torch.dtype = BF16) -> Spec:
    spec: Spec = [(f"{name}.weight", (out_f, in_f), dtype)]
    if bias:
        spec.append((f"{name}.bias", (out_f,), dtype))
    return spec


def wan_spec(c: WanConfig) -> Spec:
    """Layout of a Wan DiT state dict in module order."""
    d = c.dim
    pt, ph, pw = c.patch
    spec: Spec = [
        ("patch_embedding.weight", (d, c.in_dim, pt, ph, pw), F32),  # ComfyUI keeps the Conv3d in fp32
        ("patch_embedding.bias", (d,), F32),
    ]
    spec += _linear("text_embedding.0", d, c.text_dim) + _linear("text_embedding.2", d, d)
    spec += _linear("time_embedding.0", d, c.freq_dim) + _linear("time_embedding.2", d, d)
    spec += _linear("time_projection.1", 6 * d, d)
    for i in range(c.num_layers):
        b = f"blocks.{i}"
        spec.append((f"{b}.modulation", (1, 6, d), BF16))
        for p in "qkvo":
            spec += _linear(f"{b}.self_attn.{p}", d, d)
        spec += [(f"{b}.self_attn.norm_q.weight", (d,), BF16), (f"{b}.self_attn.norm_k.weight", (d,), BF16)]
        spec += [(f"{b}.norm3.weight", (d,), BF16), (f"{b}.norm3.bias", (d,), BF16)]
        for p in "qkvo":
            spec += _linear(f"{b}.cross_attn.{p}", d, d)
        spec += [(f"{b}.cross_attn.norm_q.weight", (d,), BF16), (f"{b}.cross_attn.norm_k.weight", (d,), BF16)]
        if c.clip_image:
            spec += _linear(f"{b}.cross_attn.k_img", d, d) + _linear(f"{b}.cross_attn.v_img", d, d)
            spec.append((f"{b}.cross_attn.norm_k_img.weight", (d,), BF16))
        spec += _linear(f"{b}.ffn.0", c.ffn_dim, d) + _linear(f"{b}.ffn.2", d, c.ffn_dim)
    spec.append(("head.modulation", (1, 2, d), BF16))
    spec += _linear("head.head", c.out_dim * pt * ph * pw, d)
    if c.clip_image:
        k = c.clip_dim
        spec += [("img_emb.proj.0.weight", (k,), BF16), ("img_emb.proj.0.bias", (k,), BF16)]
        spec += _linear("img_emb.proj.1", k, k) + _linear("img_emb.proj.3", d, k)
        spec += [("img_emb.proj.4.weight", (d,), BF16), ("img_emb.proj.4.bias", (d,), BF16)]
    return spec


# Qwen-Image 20B MMDiT (diffusers == ComfyUI key names)


@dataclass(frozen=True)
class QwenImageConfig:
    """Qwen-Image config (diffusers QwenImageTransformer2DModel; ComfyUI comfy/ldm/qwen_image/model.py)."""

    num_layers: int = 60
    dim: int = 3072  # 24 heads x 128, hard-coded in ComfyUI
    head_dim: int = 128
    joint_dim: int = 3584  # Qwen2.5-VL hidden size
    in_channels: int = 64  # 16 latent channels x 2x2 patch
    out_channels: int = 16
    patch: int = 2
    mlp_ratio: int = 4
    freq_dim: int = 256


# The staged loader reads heads, joint dim and output channels from the file (checkpoints/qwen_image.py), so tiny is
# narrow: 2 heads of 128 (ComfyUI's rotary axes need 128) and a joint dim equal to the hidden size of the tiny
# Qwen2.5-VL written for it (synthetic/tiny.py).
QWEN_TINY_JOINT_DIM = 128
QWEN_IMAGE_TINY = {"num_layers": 1, "dim": 256, "joint_dim": QWEN_TINY_JOINT_DIM}


def qwen_image_spec(c: QwenImageConfig) -> Spec:
    """Layout of the Qwen-Image DiT state dict in module order."""
    d, hd = c.dim, c.head_dim
    spec = _linear("time_text_embed.timestep_embedder.linear_1", d, c.freq_dim)
    spec += _linear("time_text_embed.timestep_embedder.linear_2", d, d)
    spec.append(("txt_norm.weight", (c.joint_dim,), BF16))
    spec += _linear("img_in", d, c.in_channels) + _linear("txt_in", d, c.joint_dim)
    for i in range(c.num_layers):
        b = f"transformer_blocks.{i}"
        for stream in ("img", "txt"):
            spec += _linear(f"{b}.{stream}_mod.1", 6 * d, d)
            spec += _linear(f"{b}.{stream}_mlp.net.0.proj", c.mlp_ratio * d, d)
            spec += _linear(f"{b}.{stream}_mlp.net.2", d, c.mlp_ratio * d)
        for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            spec.append((f"{b}.attn.{n}.weight", (hd,), BF16))
        for n in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"):
            spec += _linear(f"{b}.attn.{n}", d, d)
    spec += _linear("norm_out.linear", 2 * d, d)
    spec += _linear("proj_out", c.patch * c.patch * c.out_channels, d)
    return spec


# umT5-XXL encoder (HF T5 key names, as ComfyUI's umt5_config_xxl.json builds it)


@dataclass(frozen=True)
class UMT5Config:
    """umT5-XXL encoder config (ComfyUI comfy/text_encoders/umt5_config_xxl.json)."""

    num_layers: int = 24
    d_model: int = 4096
    d_ff: int = 10240
    num_heads: int = 64
    d_kv: int = 64
    vocab_size: int = 256384
    relative_attention_num_buckets: int = 32


def umt5_spec(c: UMT5Config) -> Spec:
    """Layout of the umT5 encoder state dict (per-layer relative bias: umT5, unlike T5)."""
    d, inner = c.d_model, c.num_heads * c.d_kv
    spec: Spec = []
    for i in range(c.num_layers):
        b = f"encoder.block.{i}.layer"
        for p in "qkv":
            spec += _linear(f"{b}.0.SelfAttention.{p}", inner, d, bias=False)
        spec += _linear(f"{b}.0.SelfAttention.o", d, inner, bias=False)
        spec.append((f"{b}.0.SelfAttention.relative_attention_bias.weight",
                     (c.relative_attention_num_buckets, c.num_heads), BF16))
        spec.append((f"{b}.0.layer_norm.weight", (d,), BF16))
        spec += _linear(f"{b}.1.DenseReluDense.wi_0", c.d_ff, d, bias=False)
        spec += _linear(f"{b}.1.DenseReluDense.wi_1", c.d_ff, d, bias=False)
        spec += _linear(f"{b}.1.DenseReluDense.wo", d, c.d_ff, bias=False)
        spec.append((f"{b}.1.layer_norm.weight", (d,), BF16))
    spec.append(("encoder.final_layer_norm.weight", (d,), BF16))
    spec.append(("shared.weight", (c.vocab_size, d), BF16))
    return spec


# Qwen2.5-VL-7B (LM + vision tower, no lm_head; ComfyUI comfy/text_encoders/llama.py Qwen25_7BVLI_Config)


@dataclass(frozen=True)
class Qwen25VLConfig:
    """Qwen2.5-VL-7B-Instruct config (HF config.json; ComfyUI llama.Qwen25_7BVLI_Config + qwen_vl.py)."""

    num_layers: int = 28
    hidden: int = 3584
    intermediate: int = 18944
    num_heads: int = 28
    num_kv_heads: int = 4
    head_dim: int = 128
    vocab_size: int = 152064
    vision_layers: int = 32
    vision_hidden: int = 1280
    vision_intermediate: int = 3420
    vision_patch: tuple[int, int, int] = (2, 14, 14)  # temporal, h, w
    spatial_merge: int = 2
    vision_tower: bool = True  # False: the language model only (text prompts never run the vision tower)


def qwen25_vl_spec(c: Qwen25VLConfig) -> Spec:
    """Layout of the Qwen2.5-VL-7B text encoder file (LM then vision tower)."""
    h, kv = c.hidden, c.num_kv_heads * c.head_dim
    spec: Spec = [("model.embed_tokens.weight", (c.vocab_size, h), BF16)]
    for i in range(c.num_layers):
        b = f"model.layers.{i}"
        spec += _linear(f"{b}.self_attn.q_proj", c.num_heads * c.head_dim, h)
        spec += _linear(f"{b}.self_attn.k_proj", kv, h) + _linear(f"{b}.self_attn.v_proj", kv, h)
        spec += _linear(f"{b}.self_attn.o_proj", h, c.num_heads * c.head_dim, bias=False)
        spec += _linear(f"{b}.mlp.gate_proj", c.intermediate, h, bias=False)
        spec += _linear(f"{b}.mlp.up_proj", c.intermediate, h, bias=False)
        spec += _linear(f"{b}.mlp.down_proj", h, c.intermediate, bias=False)
        spec += [(f"{b}.input_layernorm.weight", (h,), BF16), (f"{b}.post_attention_layernorm.weight", (h,), BF16)]
    spec.append(("model.norm.weight", (h,), BF16))
    if not c.vision_tower:
        return spec
    v, vi = c.vision_hidden, c.vision_intermediate
    spec.append(("visual.patch_embed.proj.weight", (v, 3, *c.vision_patch), BF16))
    for i in range(c.vision_layers):
        b = f"visual.blocks.{i}"
        spec += [(f"{b}.norm1.weight", (v,), BF16), (f"{b}.norm2.weight", (v,), BF16)]
        spec += _linear(f"{b}.attn.qkv", 3 * v, v) + _linear(f"{b}.attn.proj", v, v)
        spec += _linear(f"{b}.mlp.gate_proj", vi, v) + _linear(f"{b}.mlp.up_proj", vi, v)
        spec += _linear(f"{b}.mlp.down_proj", v, vi)
    merged = v * c.spatial_merge**2
    spec.append(("visual.merger.ln_q.weight", (v,), BF16))
    spec += _linear("visual.merger.mlp.0", merged, merged) + _linear("visual.merger.mlp.2", h, merged)
    return spec


# Wan VAEs (ComfyUI comfy/ldm/wan/vae.py and vae2_2.py; all fp32)


@dataclass(frozen=True)
class WanVAEConfig:
    """Wan VAE config; version 2.1 (vae.py) or 2.2 (vae2_2.py, patchified 2x2, separate decoder width)."""

    version: str  # "2.1" or "2.2"
    dim: int
    dec_dim: int
    z_dim: int
    image_channels: int = 3
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    temporal_downsample: tuple[bool, ...] = (False, True, True)


VAE_CONFIGS: dict[str, WanVAEConfig] = {
    "wan21_vae": WanVAEConfig("2.1", dim=96, dec_dim=96, z_dim=16),
    "wan22_vae": WanVAEConfig("2.2", dim=160, dec_dim=256, z_dim=48, image_channels=12),  # 3 ch x 2x2 patch
}


def _conv(name: str, out_c: int, in_c: int, kernel: tuple[int, ...]) -> Spec:
    return [(f"{name}.weight", (out_c, in_c, *kernel), F32), (f"{name}.bias", (out_c,), F32)]


def _vae_residual(name: str, in_c: int, out_c: int) -> Spec:
    spec: Spec = [(f"{name}.residual.0.gamma", (in_c, 1, 1, 1), F32)]
    spec += _conv(f"{name}.residual.2", out_c, in_c, (3, 3, 3))
    spec.append((f"{name}.residual.3.gamma", (out_c, 1, 1, 1), F32))
    spec += _conv(f"{name}.residual.6", out_c, out_c, (3, 3, 3))
    if in_c != out_c:
        spec += _conv(f"{name}.shortcut", out_c, in_c, (1, 1, 1))
    return spec


def _vae_resample(name: str, dim: int, mode: str, version: str) -> Spec:
    if mode.startswith("down"):
        spec = _conv(f"{name}.resample.1", dim, dim, (3, 3))
        if mode == "downsample3d":
            spec += _conv(f"{name}.time_conv", dim, dim, (3, 1, 1))
        return spec
    # Wan 2.1 upsampling halves the channels in the 2-D conv; Wan 2.2 keeps them.
    spec = _conv(f"{name}.resample.1", dim // 2 if version == "2.1" else dim, dim, (3, 3))
    if mode == "upsample3d":
        spec += _conv(f"{name}.time_conv", dim * 2, dim, (3, 1, 1))
    return spec


def _vae_middle(name: str, dim: int) -> Spec:
    spec = _vae_residual(f"{name}.0", dim, dim)
    spec.append((f"{name}.1.norm.gamma", (dim, 1, 1), F32))
    spec += _conv(f"{name}.1.to_qkv", 3 * dim, dim, (1, 1)) + _conv(f"{name}.1.proj", dim, dim, (1, 1))
    return spec + _vae_residual(f"{name}.2", dim, dim)


def wan_vae_spec(c: WanVAEConfig) -> Spec:
    """Layout of a Wan 2.1 or 2.2 VAE state dict in module order."""
    last = len(c.dim_mult) - 1
    # encoder
    dims = [c.dim * u for u in (1, *c.dim_mult)]
    spec = _conv("encoder.conv1", dims[0], c.image_channels, (3, 3, 3))
    flat = 0
    for i, (in_c, out_c) in enumerate(zip(dims[:-1], dims[1:])):
        mode = ("downsample3d" if c.temporal_downsample[i] else "downsample2d") if i != last else None
        for j in range(c.num_res_blocks):
            name = f"encoder.downsamples.{i}.downsamples.{j}" if c.version == "2.2" else f"encoder.downsamples.{flat}"
            spec += _vae_residual(name, in_c, out_c)
            in_c, flat = out_c, flat + 1
        if mode:
            name = (f"encoder.downsamples.{i}.downsamples.{c.num_res_blocks}" if c.version == "2.2"
                    else f"encoder.downsamples.{flat}")
            spec += _vae_resample(name, out_c, mode, c.version)
            flat += 1
    spec += _vae_middle("encoder.middle", dims[-1])
    spec.append(("encoder.head.0.gamma", (dims[-1], 1, 1, 1), F32))
    spec += _conv("encoder.head.2", 2 * c.z_dim, dims[-1], (3, 3, 3))
    spec += _conv("conv1", 2 * c.z_dim, 2 * c.z_dim, (1, 1, 1)) + _conv("conv2", c.z_dim, c.z_dim, (1, 1, 1))
    # decoder
    temporal_up = c.temporal_downsample[::-1]
    dims = [c.dec_dim * u for u in (c.dim_mult[-1], *c.dim_mult[::-1])]
    spec += _conv("decoder.conv1", dims[0], c.z_dim, (3, 3, 3))
    spec += _vae_middle("decoder.middle", dims[0])
    flat = 0
    for i, (in_c, out_c) in enumerate(zip(dims[:-1], dims[1:])):
        if c.version == "2.1" and i in (1, 2, 3):
            in_c //= 2  # the previous 2.1 upsample halved the channels
        mode = ("upsample3d" if temporal_up[i] else "upsample2d") if i != last else None
        for j in range(c.num_res_blocks + 1):
            name = f"decoder.upsamples.{i}.upsamples.{j}" if c.version == "2.2" else f"decoder.upsamples.{flat}"
            spec += _vae_residual(name, in_c, out_c)
            in_c, flat = out_c, flat + 1
        if mode:
            name = (f"decoder.upsamples.{i}.upsamples.{c.num_res_blocks + 1}" if c.version == "2.2"
                    else f"decoder.upsamples.{flat}")
            spec += _vae_resample(name, out_c, mode, c.version)
            flat += 1
    spec.append(("decoder.head.0.gamma", (dims[-1], 1, 1, 1), F32))
    spec += _conv("decoder.head.2", c.image_channels, dims[-1], (3, 3, 3))
    return spec


# Tiny video autoencoders (TAEHV / lighttae: madebyollin/taehv; ComfyUI comfy/taesd/taehv.py, hard-coded widths)


@dataclass(frozen=True)
class TAEHVConfig:
    """TAEHV config: only the latent channels vary (48: Wan 2.2, patchified 2x2; 16: Wan 2.1)."""

    latent_channels: int
    encoder_width: int = 64
    decoder_widths: tuple[int, int, int, int] = (256, 128, 64, 64)
    encoder_time_pool: tuple[int, int, int] = (2, 2, 1)  # TPool strides
    decoder_time_grow: tuple[int, int, int] = (1, 2, 2)  # TGrow strides

    @property
    def patch(self) -> int:
        return 2 if self.latent_channels == 48 else 1


TAE_CONFIGS: dict[str, TAEHVConfig] = {"wan21_tae": TAEHVConfig(16), "wan22_tae": TAEHVConfig(48)}


def _tae_conv(name: str, out_c: int, in_c: int, k: int = 3, bias: bool = True) -> Spec:
    spec: Spec = [(f"{name}.weight", (out_c, in_c, k, k), F32)]
    return spec + [(f"{name}.bias", (out_c,), F32)] if bias else spec


def _tae_memblocks(name: str, first: int, n: int) -> Spec:
    """Three MemBlocks at one width from Sequential index ``first`` (skip is an Identity: no weights)."""
    spec: Spec = []
    for i in range(first, first + 3):
        spec += _tae_conv(f"{name}.{i}.conv.0", n, 2 * n) + _tae_conv(f"{name}.{i}.conv.2", n, n)
        spec += _tae_conv(f"{name}.{i}.conv.4", n, n)
    return spec


def taehv_spec(c: TAEHVConfig) -> Spec:
    """Layout of a TAEHV state dict (nn.Sequential indices as ComfyUI's TAEHV numbers them)."""
    e, image = c.encoder_width, 3 * c.patch**2
    spec = _tae_conv("encoder.0", e, image)
    for stage, stride in enumerate(c.encoder_time_pool):
        first = 2 + 5 * stage  # TPool, strided conv, three MemBlocks
        spec += _tae_conv(f"encoder.{first}.conv", e, e * stride, k=1, bias=False)
        spec += _tae_conv(f"encoder.{first + 1}", e, e, bias=False) + _tae_memblocks("encoder", first + 2, e)
    spec += _tae_conv("encoder.17", c.latent_channels, e)
    n = c.decoder_widths
    spec += _tae_conv("decoder.1", n[0], c.latent_channels)
    for stage, stride in enumerate(c.decoder_time_grow):
        first = 3 + 6 * stage  # three MemBlocks, Upsample, TGrow, conv to the next width
        spec += _tae_memblocks("decoder", first, n[stage])
        spec += _tae_conv(f"decoder.{first + 4}.conv", n[stage] * stride, n[stage], k=1, bias=False)
        spec += _tae_conv(f"decoder.{first + 5}", n[stage + 1], n[stage], bias=False)
    return spec + _tae_conv("decoder.22", image, n[3])


# Public entry points


def model_config(model: str, size: str = "full", num_layers: int | None = None) -> object:
    """The config dataclass behind `model_spec(model, size)`; num_layers overrides the block count (DiTs)."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose 'full' or 'tiny'")
    if model in WAN_CONFIGS:
        cfg: object = WAN_CONFIGS[model]
        if size == "tiny":
            cfg = replace(cfg, **WAN_TINY)
    elif model == "qwen_image":
        cfg = replace(QwenImageConfig(), **QWEN_IMAGE_TINY) if size == "tiny" else QwenImageConfig()
    elif model in TAE_CONFIGS:
        cfg = TAE_CONFIGS[model]
    elif model == "umt5_xxl_enc":
        cfg = UMT5Config()
    elif model == "qwen25_vl_7b":
        cfg = Qwen25VLConfig()
    else:
        cfg = VAE_CONFIGS[model]
        if size == "tiny" and model == "wan21_vae":
            cfg = replace(cfg, dim=16, dec_dim=16)  # ComfyUI reads dim from decoder.head.0.gamma
    if num_layers is not None:
        if not isinstance(cfg, WanConfig | QwenImageConfig):
            raise ValueError(f"num_layers applies to the DiTs only, not {model!r} (its layer count is fixed "
                             "by ComfyUI's config)")
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        cfg = replace(cfg, num_layers=num_layers)
    return cfg


def config_spec(cfg: object) -> Spec:
    """The layout a config describes (any config dataclass of this module)."""
    spec_fn = {WanConfig: wan_spec, QwenImageConfig: qwen_image_spec, UMT5Config: umt5_spec,
               Qwen25VLConfig: qwen25_vl_spec, TAEHVConfig: taehv_spec, WanVAEConfig: wan_vae_spec}[type(cfg)]
    return spec_fn(cfg)


def model_spec(model: str, size: str = "full", num_layers: int | None = None) -> Spec:
    """(name, shape, dtype) of every tensor of `model` in file order; size "full" or "tiny" (see module doc)."""
    return config_spec(model_config(model, size, num_layers))


# Embedding tables and relative-position tables are lookups, not matmuls: never quantized.
_NOT_LINEAR = ("shared.weight", "model.embed_tokens.weight", "relative_attention_bias.weight")


def is_linear_weight(model: str, name: str, shape: tuple[int, ...]) -> bool:
    """True for the weight of an nn.Linear (what fp8 checkpoints quantize): 2-D, not an embedding table."""
    if MODEL_FOLDER.get(model) in ("vae", "vae_approx") or len(shape) != 2 or not name.endswith(".weight"):
        return False
    return not name.endswith(_NOT_LINEAR)


def spec_nbytes(spec: Spec) -> int:
    """Total bytes of the tensors in a spec."""
    return sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in spec)
