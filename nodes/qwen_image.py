"""Qwen-Image Loader and Qwen-Image Text Encode nodes: the Staged Loader's two halves as separate nodes.

ComfyUI caches a node's outputs by all of its inputs. The Staged Loader takes the prompts and the transformer in one
node, so a new prompt re-runs all of it: the 20 GB transformer is built and loaded to the GPU again, and the LoRA
and model nodes after it run again. Split, a new prompt re-runs only the text node, as CLIPTextEncode does for
native. The inputs, tooltips and stages are the Staged Loader's (nodes/qwen_staged.py, host/qwen_stages.py).
"""

from __future__ import annotations

from comfy_api.latest import io

from ..host import text_encoders
from ..host.files import file_fingerprint
from ..host.model_loading import COMPUTE
from ..host.names import CATEGORY_LOADERS, display_name, node_id
from ..host.qwen_cfg_batch import batched_conditioning
from ..host.qwen_stages import (
    QUANTIZATION, encode_prompts, load_staged_model, load_vae, prepare_model_files, text_encoder_file,
)
from ..offload.plan import budget_problem
from . import qwen_staged


class QwenImageLoader(io.ComfyNode):
    """The Qwen-Image transformer as fp8 with Block Swap, and its VAE; prompts go through Qwen-Image Text Encode.

    A loader (nothing to pass through): without its seams it is left out with one warning; UNETLoader and
    VAELoader remain the way to load Qwen-Image.
    """

    COMFY_SEAMS = tuple(s for s in qwen_staged.QwenImageStagedLoader.COMFY_SEAMS if s != "text_encoder.qwen25_vl")
    IF_SEAMS_MISSING = qwen_staged.QwenImageStagedLoader.IF_SEAMS_MISSING

    @classmethod
    def define_schema(cls) -> io.Schema:
        base = {i.id: i for i in qwen_staged.QwenImageStagedLoader.define_schema().inputs}
        return io.Schema(
            node_id=node_id("QwenImageLoader"),
            display_name=display_name("Qwen-Image Loader"),
            category=CATEGORY_LOADERS,
            description=(
                "Loads the Qwen-Image transformer as fp8 with block swap under a VRAM budget, and its VAE. With "
                "Qwen-Image Text Encode beside it, a new prompt re-encodes only the prompt: the transformer stays "
                "loaded, as with Load Diffusion Model. Outputs native MODEL / VAE; decode with 'Qwen-Image Decode "
                "(LowVRAM)'."),
            inputs=[base[k] for k in ("unet_name", "vae_name", "quantization", "vram_budget_gb", "blocks_to_swap",
                                      "compute")],
            outputs=[io.Model.Output(), io.Vae.Output()],
        )

    @classmethod
    def fingerprint_inputs(cls, unet_name: str, vae_name: str, **kwargs) -> str:
        """Re-run when a selected file changes on disk under the same name (size/mtime)."""
        return "|".join(file_fingerprint(folder, name) for folder, name in
                        (("diffusion_models", unet_name), ("vae", vae_name)))

    @classmethod
    def validate_inputs(cls, vram_budget_gb: float) -> bool | str:
        """Refuse a NaN / infinite / out-of-range budget by name when the prompt is queued."""
        return budget_problem(vram_budget_gb) or True

    @classmethod
    def execute(cls, unet_name: str, vae_name: str, quantization: str, vram_budget_gb: float, blocks_to_swap: int,
                compute: str = "auto") -> io.NodeOutput:
        unet, vae_path = prepare_model_files(unet_name, vae_name, vram_budget_gb)
        model, _ = load_staged_model(unet, QUANTIZATION[quantization], vram_budget_gb, blocks_to_swap,
                                     COMPUTE[compute])
        return io.NodeOutput(model, load_vae(vae_path))


class QwenImageTextEncode(io.ComfyNode):
    """Qwen-Image prompts with a streamed Qwen2.5-VL, kept under DynamicVRAM, embeddings cached on disk.

    Produces CONDITIONING from text (nothing to pass through): without its seams it is left out with one
    warning, and CLIPLoader(type=qwen_image) + CLIPTextEncode remain the way to encode.
    """

    COMFY_SEAMS = ("folder_paths", "text_encoder.qwen25_vl", "model_management")
    IF_SEAMS_MISSING = qwen_staged.QwenImageStagedLoader.IF_SEAMS_MISSING
    STRICT_BOOLEANS = qwen_staged.QwenImageStagedLoader.STRICT_BOOLEANS

    @classmethod
    def define_schema(cls) -> io.Schema:
        base = {i.id: i for i in qwen_staged.QwenImageStagedLoader.define_schema().inputs}
        return io.Schema(
            node_id=node_id("QwenImageTextEncode"),
            display_name=display_name("Qwen-Image Text Encode"),
            category=CATEGORY_LOADERS,
            description=(
                "Encodes the positive and negative prompts for Qwen-Image with Qwen2.5-VL: the same CONDITIONING as "
                "Load CLIP (type qwen_image) + CLIP Text Encode, but the encoder is streamed from its file (never two "
                "copies in RAM), kept for the next prompt where ComfyUI's DynamicVRAM manages it (as CLIPLoader's "
                "is) and freed after encoding otherwise, and embeddings are cached on disk so an unchanged prompt "
                "skips the encoder."),
            inputs=[base[k] for k in ("clip_name", "positive", "negative", "cache_embeddings", "text_encoder_device",
                                      "batch_cfg")],
            outputs=[io.Conditioning.Output("positive"), io.Conditioning.Output("negative")],
        )

    @classmethod
    def fingerprint_inputs(cls, clip_name: str, **kwargs) -> str:
        """Re-run when the selected file changes on disk under the same name (size/mtime)."""
        return file_fingerprint("text_encoders", clip_name)

    @classmethod
    def execute(cls, clip_name: str, positive: str, negative: str, cache_embeddings: bool = True,
                text_encoder_device: str = "auto", batch_cfg: bool = True) -> io.NodeOutput:
        node = "Qwen-Image Text Encode"
        where = text_encoders.resolve_device(text_encoder_device, f"{display_name(node)}, text_encoder_device")
        te = text_encoder_file(clip_name, node)
        (pos, neg), _ = encode_prompts(te, [positive, negative], use_cache=cache_embeddings, device=where)
        if batch_cfg:
            pos, neg = batched_conditioning(pos, neg)
        return io.NodeOutput(pos, neg)


NODES = [QwenImageLoader, QwenImageTextEncode]
