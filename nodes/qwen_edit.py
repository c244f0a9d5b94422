"""Qwen-Image-Edit Staged Loader and Qwen-Image-Edit Text Encode nodes: the schemas; the image-conditioned text stage
is host/qwen_edit.py."""

from __future__ import annotations

import torch
from comfy_api.latest import io

from ..host import text_encoders
from ..host.files import file_fingerprint
from ..host.names import CATEGORY_LOADERS, display_name, node_id
from ..host.qwen_cfg_batch import batched_conditioning
from ..host.qwen_edit import MAX_IMAGES, QWEN25_VL_EDIT, encode_edit_prompts
from ..host.model_loading import COMPUTE
from ..host.qwen_stages import QUANTIZATION, load_staged_model, load_vae, prepare_files, text_encoder_file
from . import qwen_staged


class QwenImageEditStagedLoader(io.ComfyNode):
    """Qwen-Image-Edit from three files in stages: VAE, streamed text + vision encode (cached), fp8 transformer + swap.

    A loader (nothing to pass through): without its seams it is left out with one warning; UNETLoader / CLIPLoader /
    VAELoader + TextEncodeQwenImageEditPlus remain the way to run Qwen-Image-Edit.
    """

    COMFY_SEAMS = (*qwen_staged.QwenImageStagedLoader.COMFY_SEAMS, "text_encoder.qwen_image_edit")
    IF_SEAMS_MISSING = qwen_staged.QwenImageStagedLoader.IF_SEAMS_MISSING
    STRICT_BOOLEANS = qwen_staged.QwenImageStagedLoader.STRICT_BOOLEANS

    @classmethod
    def define_schema(cls) -> io.Schema:
        base = {i.id: i for i in qwen_staged.QwenImageStagedLoader.define_schema().inputs}
        images = [io.Image.Input(f"image{n}", optional=True,
                                 tooltip=f"Reference image {n} (as TextEncodeQwenImageEditPlus image{n}); seen by the "
                                         "vision tower and VAE-encoded as a reference latent.")
                  for n in range(1, MAX_IMAGES + 1)]
        return io.Schema(
            node_id=node_id("QwenImageEditStagedLoader"),
            display_name=display_name("Qwen-Image-Edit Staged Loader"),
            category=CATEGORY_LOADERS,
            description=(
                "Runs Qwen-Image-Edit (2509 / 2511) on small machines: the prompts and up to three reference images "
                "go through ComfyUI's TextEncodeQwenImageEditPlus with a streamed Qwen2.5-VL encoder (vision tower "
                "included; never two copies in RAM) run where text_encoder_device says, by default where ComfyUI "
                "runs text encoders, kept for the next prompt under DynamicVRAM (as CLIPLoader's is) and freed "
                "afterwards otherwise (embeddings cached on disk by prompt, image content and encoder); the "
                "reference latents are VAE-encoded; then the transformer loads as fp8 with block swap under a VRAM "
                "budget. Outputs native MODEL / CONDITIONING / VAE for KSampler."),
            inputs=[
                base["unet_name"], base["clip_name"], base["vae_name"],
                io.String.Input("positive", multiline=True, default="",
                                tooltip="Edit instruction (TextEncodeQwenImageEditPlus prompt)."),
                io.String.Input("negative", multiline=True, default="",
                                tooltip="Negative prompt, encoded with the same images (used when KSampler cfg > 1)."),
                base["quantization"], base["vram_budget_gb"], base["blocks_to_swap"],
                io.Boolean.Input("cache_embeddings", default=True,
                                 tooltip="Keep the embeddings on disk (user directory); an unchanged prompt with "
                                         "unchanged images skips loading the encoder. Keyed by prompt, image "
                                         "content, encoder file content and device type."),
                base["compute"], *images,
                io.Combo.Input("text_encoder_device", options=list(text_encoders.DEVICES), default="auto",
                               optional=True,
                               tooltip="Where Qwen2.5-VL and its vision tower run. "
                                       "auto: where ComfyUI runs text encoders (the GPU on NVIDIA, the CPU under "
                                       "--cpu or a low-VRAM mode). cpu: least VRAM, but each new prompt or image "
                                       "is a CPU encode through the 7B encoder and its vision tower. gpu: the GPU "
                                       "always."),
                base["batch_cfg"],
            ],
            outputs=[io.Model.Output(), io.Conditioning.Output("positive"), io.Conditioning.Output("negative"),
                     io.Vae.Output()],
        )

    @classmethod
    def fingerprint_inputs(cls, unet_name: str, clip_name: str, vae_name: str, **kwargs) -> str:
        """Re-run when a selected file changes on disk under the same name (as the text-only loader)."""
        return qwen_staged.QwenImageStagedLoader.fingerprint_inputs(unet_name, clip_name, vae_name)

    @classmethod
    def validate_inputs(cls, vram_budget_gb: float) -> bool | str:
        """Refuse a NaN / infinite / out-of-range budget by name when the prompt is queued."""
        return qwen_staged.QwenImageStagedLoader.validate_inputs(vram_budget_gb)

    @classmethod
    def execute(cls, unet_name: str, clip_name: str, vae_name: str, positive: str, negative: str,
                quantization: str, vram_budget_gb: float, blocks_to_swap: int, cache_embeddings: bool,
                compute: str = "auto", image1: torch.Tensor | None = None, image2: torch.Tensor | None = None,
                image3: torch.Tensor | None = None, text_encoder_device: str = "auto",
                batch_cfg: bool = True) -> io.NodeOutput:
        where = text_encoders.resolve_device(text_encoder_device,
                                             f"{display_name('Qwen-Image-Edit Staged Loader')}, text_encoder_device")
        unet, te, vae_path = prepare_files(unet_name, clip_name, vae_name, vram_budget_gb,
                                                       "Qwen-Image-Edit Staged Loader", QWEN25_VL_EDIT)
        vae = load_vae(vae_path)
        (pos, neg), _ = encode_edit_prompts(te, [positive, negative], [image1, image2, image3], vae,
                                            use_cache=cache_embeddings, device=where)
        if batch_cfg:
            pos, neg = batched_conditioning(pos, neg)
        model, _ = load_staged_model(unet, QUANTIZATION[quantization], vram_budget_gb, blocks_to_swap,
                                     COMPUTE[compute])
        return io.NodeOutput(model, pos, neg, vae)


class QwenImageEditTextEncode(io.ComfyNode):
    """The Edit Staged Loader's text stage as its own node, beside Qwen-Image Loader: a new instruction re-runs only it.

    Produces CONDITIONING (nothing to pass through): without its seams it is left out with one warning, and CLIPLoader
    + TextEncodeQwenImageEditPlus remain the way to encode.
    """

    COMFY_SEAMS = ("folder_paths", "text_encoder.qwen25_vl", "text_encoder.qwen_image_edit", "model_management", "vae")
    IF_SEAMS_MISSING = QwenImageEditStagedLoader.IF_SEAMS_MISSING
    STRICT_BOOLEANS = QwenImageEditStagedLoader.STRICT_BOOLEANS

    @classmethod
    def define_schema(cls) -> io.Schema:
        base = {i.id: i for i in QwenImageEditStagedLoader.define_schema().inputs}
        return io.Schema(
            node_id=node_id("QwenImageEditTextEncode"),
            display_name=display_name("Qwen-Image-Edit Text Encode"),
            category=CATEGORY_LOADERS,
            description=(
                "The prompts and up to three reference images through ComfyUI's TextEncodeQwenImageEditPlus with a "
                "streamed Qwen2.5-VL encoder (vision tower included), kept for the next instruction under DynamicVRAM "
                "(as CLIPLoader's is) and freed after encoding otherwise, embeddings cached on disk; the reference "
                "latents come from the VAE. With Qwen-Image Loader for the transformer, a new instruction re-runs "
                "only this node: the transformer stays loaded."),
            inputs=[base["clip_name"], io.Vae.Input("vae", tooltip="The Qwen-Image VAE (from Qwen-Image Loader): it "
                                                                   "encodes the reference latents."),
                    *(base[k] for k in ("positive", "negative", "cache_embeddings", "image1", "image2", "image3",
                                        "text_encoder_device", "batch_cfg"))],
            outputs=[io.Conditioning.Output("positive"), io.Conditioning.Output("negative")],
        )

    @classmethod
    def fingerprint_inputs(cls, clip_name: str, **kwargs) -> str:
        """Re-run when the selected file changes on disk under the same name (size/mtime)."""
        return file_fingerprint("text_encoders", clip_name)

    @classmethod
    def execute(cls, clip_name: str, vae, positive: str, negative: str, cache_embeddings: bool = True,  # noqa: ANN001
                image1: torch.Tensor | None = None, image2: torch.Tensor | None = None,
                image3: torch.Tensor | None = None, text_encoder_device: str = "auto",
                batch_cfg: bool = True) -> io.NodeOutput:
        node = "Qwen-Image-Edit Text Encode"
        where = text_encoders.resolve_device(text_encoder_device, f"{display_name(node)}, text_encoder_device")
        te = text_encoder_file(clip_name, node, QWEN25_VL_EDIT)
        (pos, neg), _ = encode_edit_prompts(te, [positive, negative], [image1, image2, image3], vae,
                                            use_cache=cache_embeddings, device=where)
        if batch_cfg:
            pos, neg = batched_conditioning(pos, neg)
        return io.NodeOutput(pos, neg)


NODES = [QwenImageEditStagedLoader, QwenImageEditTextEncode]
