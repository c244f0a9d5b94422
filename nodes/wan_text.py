"""Wan Text Encode node: the schema; the streamed CPU encoder is host/wan_text.py."""

from __future__ import annotations

from comfy_api.latest import io

from ..host import text_encoders
from ..host.files import checked_input, file_fingerprint
from ..host.names import CATEGORY_LOADERS, display_name, node_id
from ..host.seams import DISABLE
from ..host.wan_text import UMT5_XXL, encode_wan_prompts


class WanTextEncode(io.ComfyNode):
    """umT5-XXL prompts, streamed (one copy in RAM), on the GPU or the CPU, kept under DynamicVRAM, embeddings cached.

    Produces CONDITIONING from text (nothing to pass through): without its seams it is left out with one
    warning, and CLIPLoader(type=wan) + CLIPTextEncode remain the way to encode.
    """

    COMFY_SEAMS = ("folder_paths", "text_encoder.umt5", "model_management")
    IF_SEAMS_MISSING = DISABLE
    STRICT_BOOLEANS = ("cache_embeddings",)  # writes the embedding cache: only a real boolean (host/prompt_inputs.py)

    @classmethod
    def define_schema(cls) -> io.Schema:
        import folder_paths

        return io.Schema(
            node_id=node_id("WanTextEncode"),
            display_name=display_name("Wan Text Encode"),
            category=CATEGORY_LOADERS,
            description=(
                "Encodes the positive and negative prompts for Wan 2.1/2.2 with umT5-XXL: the same CONDITIONING as "
                "Load CLIP (type wan) + CLIP Text Encode, but the encoder is streamed from its file (never two "
                "copies in RAM), is kept for the next prompt where ComfyUI's DynamicVRAM manages it (as CLIPLoader's "
                "is) and freed after encoding otherwise, and embeddings are cached on disk so an unchanged prompt "
                "skips the encoder."),
            inputs=[
                io.Combo.Input("clip_name", options=folder_paths.get_filename_list("text_encoders"),
                               tooltip="umT5-XXL text encoder (text_encoders): umt5_xxl_fp16 (bf16/fp16) or "
                                       "umt5_xxl_fp8_e4m3fn_scaled. Needs about its file size in RAM while "
                                       "encoding."),
                io.String.Input("positive", multiline=True, default="",
                                tooltip="Prompt (what to show)."),
                io.String.Input("negative", multiline=True, default="",
                                tooltip="Negative prompt (used when the sampler's cfg > 1)."),
                io.Boolean.Input("cache_embeddings", default=True,
                                 tooltip="Keep prompt embeddings on disk (user directory); an unchanged prompt "
                                         "skips loading the encoder. Keyed by prompt + encoder file content."),
                io.Combo.Input("device", options=list(text_encoders.DEVICES), default="auto", optional=True,
                               tooltip="Where umT5 runs. auto: where ComfyUI runs text encoders (the GPU on "
                                       "NVIDIA; ComfyUI moves it off the GPU for the sampler, as it does CLIP Text "
                                       "Encode's): a first encode in seconds. cpu: no VRAM at all, but a first "
                                       "encode of about half a minute. gpu: the GPU always."),
            ],
            outputs=[io.Conditioning.Output("positive"), io.Conditioning.Output("negative")],
        )

    @classmethod
    def fingerprint_inputs(cls, clip_name: str, **kwargs) -> str:
        """Re-run when the selected file changes on disk under the same name (size/mtime)."""
        return file_fingerprint("text_encoders", clip_name)

    @classmethod
    def execute(cls, clip_name: str, positive: str, negative: str, cache_embeddings: bool = True,
                device: str = "auto") -> io.NodeOutput:
        import folder_paths

        te = folder_paths.get_full_path_or_raise("text_encoders", clip_name)
        with checked_input(display_name("Wan Text Encode"), "clip_name"):
            text_encoders.check_file(UMT5_XXL, te)  # the same message with the cache on or off
        where = text_encoders.resolve_device(device, f"{display_name('Wan Text Encode')}, device")
        (pos, neg), _ = encode_wan_prompts(te, [positive, negative], use_cache=cache_embeddings, device=where)
        return io.NodeOutput(pos, neg)


NODES = [WanTextEncode]
