"""selftest checks of the loaders that encode text: Wan Text Encode and the Qwen-Image (Edit) Staged Loaders.

Stock ComfyUI builds its text encoders and Qwen-Image at fixed full sizes, and the tiny files are narrow, so the
stock side gets the file's sizes the one way ComfyUI takes them: ``load_clip`` (what CLIPLoader calls) with the
config override read from the file, on the CPU where the pack's encoders run, and UNETLoader with the widths
added to what its model detection finds (``detected_config_defaults``). Everything else is the stock path.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .selftest_env import QWEN_LATENT, SEED, Check, SelfTestEnv, Verdict, comfy_nodes, compare, compare_conditioning
from .selftest_wan import fp8_tolerance

PROMPTS = ("a red fox runs through fresh snow, golden hour", "blurry, low quality")
EDIT_PROMPTS = ("Replace the fox with a dalmatian", "")
QWEN_FILE = "lowvram_selftest_qwen_image_tiny_bf16.safetensors"
QWEN_TE_FILE = "lowvram_selftest_qwen25_vl_2layer_bf16.safetensors"
EDIT_TE_FILE = "lowvram_selftest_qwen25_vl_2layer_vision_bf16.safetensors"
VAE_FILE = "lowvram_selftest_wan21_vae_tiny_bf16.safetensors"
UMT5_FILE = "lowvram_selftest_umt5_24layer_narrow_bf16.safetensors"
STOCK_TEXT = "CLIPLoader on the CPU + CLIPTextEncode"
# batch_cfg's padded, masked prompts against the unbatched stock ones: the mask keeps the output, to rounding
BATCH_TOLERANCE = 1e-4


def _write_umt5(path: Path) -> None:
    from ..synthetic.specs import UMT5Config
    from ..synthetic.checkpoints import write_synthetic

    # 24 layers: ComfyUI recognises umT5-XXL by its 24th block; narrow everywhere else, so it loads in a second.
    write_synthetic("umt5_xxl_enc", path, fmt="bf16", seed=SEED,
                    config=UMT5Config(num_layers=24, d_ff=64, num_heads=2, vocab_size=512))


def _write_qwen_te(path: Path, vision: bool) -> None:
    from ..synthetic.tiny import TINY_ZERO_PREFIXES, tiny_text_encoder_config
    from ..synthetic.checkpoints import write_synthetic

    write_synthetic("qwen25_vl_7b", path, "tiny", "bf16", seed=SEED,
                    config=tiny_text_encoder_config("qwen25_vl_7b", vision),
                    zeros=TINY_ZERO_PREFIXES if vision else ())


def _qwen_files(env: SelfTestEnv, vision: bool) -> tuple[str, str, str]:
    """(transformer, text encoder, VAE) names: the tiny Qwen-Image, a 2-layer Qwen2.5-VL, the tiny Wan 2.1 VAE."""
    from ..synthetic.checkpoints import write_synthetic

    unet = env.file("diffusion_models", QWEN_FILE,
                    lambda p: write_synthetic("qwen_image", p, "tiny", "bf16", seed=SEED))
    te = env.file("text_encoders", EDIT_TE_FILE if vision else QWEN_TE_FILE, lambda p: _write_qwen_te(p, vision))
    vae = env.file("vae", VAE_FILE, lambda p: write_synthetic("wan21_vae", p, "tiny", "bf16", seed=SEED))
    return unet, te, vae


def _path(folder: str, name: str) -> str:
    import folder_paths

    return folder_paths.get_full_path_or_raise(folder, name)


def stock_clip(name: str, clip_type: str, config_key: str, config: dict) -> Any:
    """``comfy.sd.load_clip`` (CLIPLoader's call) on the CPU with the file's sizes as its config override."""
    import comfy.sd

    cpu = torch.device("cpu")
    return comfy.sd.load_clip([_path("text_encoders", name)], clip_type=getattr(comfy.sd.CLIPType, clip_type),
                              model_options={"load_device": cpu, "offload_device": cpu, config_key: config})


def check_wan_text(env: SelfTestEnv) -> Iterator[Verdict]:
    """Streamed umT5 CONDITIONING vs CLIPLoader(type wan) + CLIPTextEncode: bit-identical on the CPU."""
    import comfy.sd

    from ..checkpoints.safetensors_io import read_header
    from ..checkpoints.text_encoders import umt5_config_from_header
    from ..nodes.wan_text import WanTextEncode

    name = env.file("text_encoders", UMT5_FILE, _write_umt5)
    ours = WanTextEncode.execute(clip_name=name, positive=PROMPTS[0], negative=PROMPTS[1],
                                 cache_embeddings=False, device="cpu").args  # where stock_clip encodes
    config = umt5_config_from_header(read_header(_path("text_encoders", name)))
    detect = comfy.sd.detect_te_model
    # Newer ComfyUI tells umT5-XXL from other T5s by its 10240-wide FFN, which the narrow file lacks; it answers
    # T5_XXL for the released file, so it is told that answer here, for this call only.
    comfy.sd.detect_te_model = lambda sd: comfy.sd.TEModel.T5_XXL
    try:
        clip = stock_clip(name, "WAN", "umt5xxl_model_config", config)
    finally:
        comfy.sd.detect_te_model = detect
    for label, prompt, got in zip(("positive", "negative"), PROMPTS, ours):
        stock = clip.encode_from_tokens_scheduled(clip.tokenize(prompt))
        yield compare_conditioning(f"Wan Text Encode [{label}]", got, stock, STOCK_TEXT + " (type wan)")


def stock_qwen_model(unet: str, dtype: torch.dtype | None = None) -> Any:
    """UNETLoader (default) on the tiny Qwen-Image, or ComfyUI's model in ``dtype``; built at the file's widths."""
    import comfy.sd
    from ..checkpoints.safetensors_io import read_header
    from ..checkpoints.qwen_image import qwen_image_widths
    from ..host.model_loading import detected_config_defaults

    with detected_config_defaults(qwen_image_widths(read_header(_path("diffusion_models", unet)))):
        if dtype is None:
            return comfy_nodes().UNETLoader().load_unet(unet, "default")[0]
        return comfy.sd.load_diffusion_model(_path("diffusion_models", unet), model_options={"dtype": dtype})


def _qwen_te_config(te: str) -> dict:
    from ..checkpoints.safetensors_io import read_header
    from ..checkpoints.text_encoders import qwen25_vl_config_from_header

    return qwen25_vl_config_from_header(read_header(_path("text_encoders", te)))


def check_qwen_staged(env: SelfTestEnv) -> Iterator[Verdict]:
    """Text stage vs CLIPLoader + CLIPTextEncode (identical); the transformer vs UNETLoader for "none"
    (identical) and vs the fp32 model for fp8 (fp8 tolerance), one sampler step each."""
    from ..nodes.qwen_staged import QwenImageStagedLoader

    unet, te, vae = _qwen_files(env, vision=False)
    clip = stock_clip(te, "QWEN_IMAGE", "qwen25_7b_model_config", _qwen_te_config(te))
    stock = [clip.encode_from_tokens_scheduled(clip.tokenize(p)) for p in PROMPTS]
    ref = {"none": env.sample(stock_qwen_model(unet), *stock, latent=QWEN_LATENT)}
    for mode, versus in (("none", "UNETLoader (default)"), ("fp8 per-tensor", "fp32")):
        model, pos, neg, _ = QwenImageStagedLoader.execute(
            unet_name=unet, clip_name=te, vae_name=vae, positive=PROMPTS[0], negative=PROMPTS[1],
            quantization=mode, vram_budget_gb=0.0, blocks_to_swap=-1, cache_embeddings=False, compute="auto",
            text_encoder_device="cpu", batch_cfg=False).args  # where stock_clip encodes: bit-identical there
        tolerance, label = 0.0, mode
        if mode == "none":
            for which, got, want in (("positive", pos, stock[0]), ("negative", neg, stock[1])):
                yield compare_conditioning(f"Qwen-Image Staged Loader [{which}]", got, want, STOCK_TEXT)
        else:
            ref[mode] = env.sample(stock_qwen_model(unet, torch.float32), *stock, latent=QWEN_LATENT)
            tolerance, path = fp8_tolerance(env, model, mode)
            label = f"{mode}, {path}"
        yield compare(f"Qwen-Image Staged Loader [{label}, one step]", env.sample(model, pos, neg, latent=QWEN_LATENT),
                      ref[mode], tolerance, f"ComfyUI's {versus} model with the stock conditioning")
        if mode == "none":
            yield _batched("Qwen-Image Staged Loader", env, model, pos, neg, ref[mode])


def _batched(node: str, env: SelfTestEnv, model: Any, pos: list, neg: list, ref: torch.Tensor) -> Verdict:
    """batch_cfg (on by default): the prompts padded to one length and masked sample as the unbatched ones."""
    from ..host.qwen_cfg_batch import batched_conditioning

    return compare(f"{node} [batch_cfg, one step]", env.sample(model, *batched_conditioning(pos, neg),
                                                                latent=QWEN_LATENT),
                   ref, BATCH_TOLERANCE, "the unbatched prompts on UNETLoader's model")


def check_qwen_edit(env: SelfTestEnv) -> Iterator[Verdict]:
    """Prompts with a reference image vs CLIPLoader + TextEncodeQwenImageEditPlus (identical, reference latents
    included), then one sampler step on them vs UNETLoader's model (identical)."""
    from comfy_extras.nodes_qwen import TextEncodeQwenImageEditPlus

    from ..nodes.qwen_edit import QwenImageEditStagedLoader

    unet, te, vae_name = _qwen_files(env, vision=True)
    # A reference image costs a 32-block vision tower pass (on the CPU, where both encoders run) and a 1024x1024
    # VAE encode per prompt and side: far past the selftest's minute where the VAE has no GPU either.
    image = torch.rand(1, 40, 56, 3, generator=torch.Generator().manual_seed(SEED)) \
        if env.device.type == "cuda" else None
    what = "+ image" if image is not None else "text only: image prompts take minutes on a CPU-only ComfyUI"
    model, pos, neg, _ = QwenImageEditStagedLoader.execute(
        unet_name=unet, clip_name=te, vae_name=vae_name, positive=EDIT_PROMPTS[0], negative=EDIT_PROMPTS[1],
        quantization="none", vram_budget_gb=0.0, blocks_to_swap=-1, cache_embeddings=False, compute="auto",
        image1=image, text_encoder_device="cpu", batch_cfg=False).args  # where stock_clip encodes: bit-identical
    clip = stock_clip(te, "QWEN_IMAGE", "qwen25_7b_model_config", _qwen_te_config(te))
    vae = comfy_nodes().VAELoader().load_vae(vae_name)[0]
    stock = [TextEncodeQwenImageEditPlus.execute(clip, p, vae, image, None, None).args[0] for p in EDIT_PROMPTS]
    del clip
    versus = STOCK_TEXT.replace("CLIPTextEncode", "TextEncodeQwenImageEditPlus")
    for label, got, want in (("positive", pos, stock[0]), ("negative", neg, stock[1])):
        yield compare_conditioning(f"Qwen-Image-Edit Staged Loader [{label}, {what}]", got, want, versus)
    ref = env.sample(stock_qwen_model(unet), *stock, latent=QWEN_LATENT)
    yield compare("Qwen-Image-Edit Staged Loader [none, one step]", env.sample(model, pos, neg, latent=QWEN_LATENT),
                  ref, 0.0, "UNETLoader (default) with the stock conditioning")
    yield _batched("Qwen-Image-Edit Staged Loader", env, model, pos, neg, ref)


CHECKS = [
    Check("wan_text", "Wan Text Encode", ("wan_text", "WanTextEncode"), check_wan_text),
    Check("qwen_staged", "Qwen-Image Staged Loader", ("qwen_staged", "QwenImageStagedLoader"), check_qwen_staged),
    Check("qwen_edit", "Qwen-Image-Edit Staged Loader", ("qwen_edit", "QwenImageEditStagedLoader"), check_qwen_edit),
]
