"""Qwen-Image Staged Loader and Qwen-Image Decode nodes: schemas; the stages are host/qwen_stages.py."""

from __future__ import annotations

from comfy_api.latest import io

from ..host import text_encoders
from ..host.files import file_fingerprint
from ..host.names import CATEGORY_LOADERS, CATEGORY_UTILS, display_name, node_id
from ..host.model_loading import COMPUTE
from ..host.qwen_cfg_batch import batched_conditioning
from ..host.qwen_stages import (
    QUANTIZATION, decode_staged, encode_prompts, load_staged_model, load_vae, prepare_files,
)
from ..host.seams import BLOCK_SWAP_SEAMS, DISABLE
from ..offload.plan import budget_problem, check_budget


class QwenImageStagedLoader(io.ComfyNode):
    """Qwen-Image from three files in stages: streamed text encode (cached), fp8 transformer + block swap, VAE.

    A loader (nothing to pass through): without its seams, Block Swap's included, it is left out with one
    warning; ComfyUI's UNETLoader / CLIPLoader / VAELoader remain the way to load Qwen-Image.
    """

    COMFY_SEAMS = ("folder_paths", "text_encoder.qwen25_vl", "diffusion_model_loading", "model_detection",
                   "ops.custom_operations", "ops.manual_cast", "model_management", "vae", *BLOCK_SWAP_SEAMS)
    IF_SEAMS_MISSING = DISABLE
    STRICT_BOOLEANS = ("cache_embeddings",)  # writes the embedding cache: only a real boolean (host/prompt_inputs.py)

    @classmethod
    def define_schema(cls) -> io.Schema:
        import folder_paths

        return io.Schema(
            node_id=node_id("QwenImageStagedLoader"),
            display_name=display_name("Qwen-Image Staged Loader"),
            category=CATEGORY_LOADERS,
            description=(
                "Runs Qwen-Image on small machines: encodes the prompts with a streamed text encoder (never two "
                "copies in RAM) where text_encoder_device says, by default where ComfyUI runs text encoders, keeps "
                "it under DynamicVRAM and frees it otherwise (embeddings cached on disk), then loads the transformer "
                "as fp8 with block swap under a VRAM budget. Outputs native MODEL / CONDITIONING / VAE for "
                "KSampler; decode with 'Qwen-Image Decode (LowVRAM)'."),
            inputs=[
                io.Combo.Input("unet_name", options=folder_paths.get_filename_list("diffusion_models"),
                               tooltip="Qwen-Image transformer (diffusion_models): bf16, fp8_e4m3fn or fp8 scaled."),
                io.Combo.Input("clip_name", options=folder_paths.get_filename_list("text_encoders"),
                               tooltip="Qwen2.5-VL 7B text encoder (text_encoders), bf16 or *_fp8_scaled. It is "
                                       "streamed from its file; kept for the next run under DynamicVRAM (as "
                                       "CLIPLoader's is), freed after encoding otherwise."),
                io.Combo.Input("vae_name", options=folder_paths.get_filename_list("vae"),
                               tooltip="Qwen-Image VAE (vae folder)."),
                io.String.Input("positive", multiline=True, default="",
                                tooltip="Prompt. Encoded with ComfyUI's Qwen-Image template."),
                io.String.Input("negative", multiline=True, default=" ",
                                tooltip="Negative prompt (used when KSampler cfg > 1)."),
                io.Combo.Input("quantization", options=list(QUANTIZATION), default="fp8 per-tensor",
                               tooltip="Transformer weights when the file is bf16. fp8 per-tensor: one scale per "
                                       "weight (the fp8 matmul every fp8 GPU has; fastest). fp8 block-wise: one "
                                       "scale per 128x128 tile (slightly lower error). none: as stored (bf16 needs "
                                       "~41 GB RAM). fp8 files are always used as stored."),
                io.Float.Input("vram_budget_gb", default=0.0, min=0.0, max=1024.0, step=0.5,
                               tooltip="GPU memory the transformer may use (weights + swap ring + activations). "
                                       "0 = what ComfyUI has free. E.g. 7 on an 8 GB card."),
                io.Int.Input("blocks_to_swap", default=-1, min=-1, max=60,
                             tooltip="Transformer blocks kept in RAM and streamed to the GPU. -1 = the fewest "
                                     "that fit the budget."),
                io.Boolean.Input("cache_embeddings", default=True,
                                 tooltip="Keep prompt embeddings on disk (user directory); an unchanged prompt "
                                         "skips loading the text encoder. Keyed by prompt + encoder file content."),
                io.Combo.Input("compute", options=list(COMPUTE), default="auto",
                               tooltip="auto: fp8 matmul where the GPU has it (RTX 40xx/50xx, H100), int8 matmul "
                                       "on RTX 20xx/30xx and A-series, else dequantize. fp8 matmul: require it. int8 "
                                       "matmul: int8 weights and activations on the int8 tensor cores; pick it on "
                                       "RTX 20xx/30xx/A-series GPUs (what auto does there). dequantize: bf16 matmul."),
                io.Combo.Input("text_encoder_device", options=list(text_encoders.DEVICES), default="auto",
                               optional=True,
                               tooltip="Where Qwen2.5-VL runs. auto: where "
                                       "ComfyUI runs text encoders (the GPU on NVIDIA, the CPU under --cpu or a "
                                       "low-VRAM mode). cpu: least VRAM, but a first encode of about half a "
                                       "minute. gpu: the GPU always."),
                io.Boolean.Input("batch_cfg", default=True, optional=True,
                                 tooltip="Pad the shorter prompt's text tokens (masked, so the picture is the same) "
                                         "so that KSampler runs positive and negative as one batch: one model call "
                                         "per step instead of two where VRAM allows, and each streamed block "
                                         "copied once per step instead of twice. Leave it on: it helps whenever "
                                         "cfg > 1, most on cards that stream blocks (cfg 1 runs no negative). "
                                         "Needs ComfyUI's Qwen-Image text mask (0.33 has it; elsewhere it stays "
                                         "off with one log line)."),
            ],
            outputs=[io.Model.Output(), io.Conditioning.Output("positive"), io.Conditioning.Output("negative"),
                     io.Vae.Output()],
        )

    @classmethod
    def fingerprint_inputs(cls, unet_name: str, clip_name: str, vae_name: str, **kwargs) -> str:
        """Re-run when a selected file changes on disk under the same name (size/mtime)."""
        return "|".join(file_fingerprint(folder, name) for folder, name in
                        (("diffusion_models", unet_name), ("text_encoders", clip_name), ("vae", vae_name)))

    @classmethod
    def validate_inputs(cls, vram_budget_gb: float) -> bool | str:
        """Refuse a NaN / infinite / out-of-range budget by name when the prompt is queued."""
        return budget_problem(vram_budget_gb) or True

    @classmethod
    def execute(cls, unet_name: str, clip_name: str, vae_name: str, positive: str, negative: str,
                quantization: str, vram_budget_gb: float, blocks_to_swap: int, cache_embeddings: bool,
                compute: str = "auto", text_encoder_device: str = "auto", batch_cfg: bool = True) -> io.NodeOutput:
        where = text_encoders.resolve_device(text_encoder_device,
                                             f"{display_name('Qwen-Image Staged Loader')}, text_encoder_device")
        unet, te, vae_path = prepare_files(unet_name, clip_name, vae_name, vram_budget_gb)
        (pos, neg), _ = encode_prompts(te, [positive, negative], use_cache=cache_embeddings, device=where)
        if batch_cfg:
            pos, neg = batched_conditioning(pos, neg)
        model, _ = load_staged_model(unet, QUANTIZATION[quantization], vram_budget_gb, blocks_to_swap,
                                     COMPUTE[compute])
        vae = load_vae(vae_path)
        return io.NodeOutput(model, pos, neg, vae)


class QwenImageDecode(io.ComfyNode):
    """VAE decode after the transformer left the GPU: on the GPU, tiled when the budget is small.

    LATENT in, IMAGE out (nothing to pass through): without its seams it is left out with one warning; ComfyUI's
    VAEDecode / VAEDecodeTiled do the same job.
    """

    COMFY_SEAMS = ("model_management", "vae")
    IF_SEAMS_MISSING = DISABLE

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=node_id("QwenImageDecode"),
            display_name=display_name("Qwen-Image Decode"),
            category=CATEGORY_UTILS,
            description=("Frees the GPU memory a whole decode needs (unloading the transformer only when it does "
                         "not fit beside the decode), then decodes on the GPU. Uses ComfyUI's tiled decode when "
                         "its memory estimate still does not fit the free VRAM or the budget. Never decodes on "
                         "the CPU silently."),
            inputs=[
                io.Latent.Input("samples", tooltip="Latents from KSampler."),
                io.Vae.Input("vae", tooltip="The Qwen-Image VAE."),
                io.Float.Input("vram_budget_gb", default=0.0, min=0.0, max=1024.0, step=0.5,
                               tooltip="GPU memory the decode may use. 0 = what is free beside the loaded models, "
                                       "or once the decode's estimate has been freed (models unloaded as far as "
                                       "needed)."),
                io.Int.Input("tile_size", default=512, min=128, max=4096, step=32,
                             tooltip="Tile (pixels) when the whole decode does not fit: tiles of this size that "
                                     "fit beside the loaded transformer keep it loaded; otherwise models are freed "
                                     "and the tile is halved until it fits."),
                io.Int.Input("overlap", default=64, min=0, max=512, step=32,
                             tooltip="Tile overlap in pixels (hides seams)."),
                io.Boolean.Input("allow_cpu", default=False,
                                 tooltip="Allow a CPU decode when a GPU exists (e.g. --cpu-vae). Takes many "
                                         "minutes at 1328x1328; off = error instead."),
            ],
            outputs=[io.Image.Output()],
        )

    @classmethod
    def validate_inputs(cls, vram_budget_gb: float) -> bool | str:
        """Refuse a NaN / infinite / out-of-range budget by name when the prompt is queued."""
        return budget_problem(vram_budget_gb) or True

    @classmethod
    def execute(cls, samples: dict, vae, vram_budget_gb: float, tile_size: int, overlap: int,  # noqa: ANN001
                allow_cpu: bool = False) -> io.NodeOutput:
        check_budget(vram_budget_gb)
        images, _ = decode_staged(samples["samples"], vae, vram_budget_gb, tile_size, overlap, allow_cpu)
        return io.NodeOutput(images)


NODES = [QwenImageStagedLoader, QwenImageDecode]
