"""Attention node: the schema; the per-model override is host/attention.py."""

from __future__ import annotations

from typing import Any

from comfy_api.latest import io

from ..host.attention import BACKEND_CHOICES, apply_attention
from ..host.names import CATEGORY_PATCHES, display_name, node_id
from ..host.seams import PASS_THROUGH
from ..kernels.int8_comfy_kitchen import MIN_VERSION, SOL_ATTN_LABEL


class AttentionSelect(io.ComfyNode):
    """MODEL in, MODEL out: this model's attention runs through the chosen backend (with checked fallback).

    An attention override another node set (before or after this one) stays and runs first; the pack's backend runs
    the calls it passes on (host/attention.py, one log line says which runs where).

    Without ComfyUI's per-model attention override the node passes the model through (ComfyUI's own attention
    still runs; nothing breaks, the speed-up is lost), logged once.
    """

    COMFY_SEAMS = ("model_patcher.wrappers", "attention.override")
    IF_SEAMS_MISSING = PASS_THROUGH

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=node_id("Attention"),
            display_name=display_name("Attention"),
            category=CATEGORY_PATCHES,
            description="Choose the attention kernel for this model only. The first call of each shape is "
                        "checked against an fp32 reference; a backend that cannot run or is inaccurate falls "
                        "back to the best available one, and the log says so.",
            inputs=[
                io.Model.Input("model", tooltip="Diffusion model (Wan 2.1/2.2, Qwen-Image, or any model that "
                                                "uses ComfyUI's attention functions)."),
                io.Combo.Input(
                    "backend", options=list(BACKEND_CHOICES), default="auto",
                    tooltip="auto: time every available exact backend once per shape and keep the fastest "
                            "(recommended); where a quantized kernel at most comfy-kitchen int8's error is faster it "
                            "runs that shape (on an H100 / H200: lowvram 8-bit's fp16 P·V on Wan's self-attention). "
                            "SDPA cuDNN: exact everywhere. SageAttention and lowvram 8-bit quantize Q/K. lowvram "
                            "8-bit: on an H100 / H200 (with Triton >= 3.6) P·V in fp16, 1.19-1.21x cuDNN on Wan's "
                            "long self-attention "
                            "and at most comfy-kitchen int8's error on every tested input (0.9-1.2 % on "
                            "near-Gaussian ones); on RTX 40xx / 50xx P·V in fp8 (below). lowvram 8-bit, fp8 P·V: "
                            "1.18-1.25x cuDNN on an H200, 0.2-2.4 % error on outlier-heavy inputs, 4-7 % on "
                            "near-Gaussian ones. lowvram 8-bit, int8 P·V: 1.2-1.5 % on near-Gaussian inputs, but "
                            "0.84x cuDNN on an H200, so there the exact backend runs instead. comfy-kitchen int8 "
                            f"needs comfy-kitchen >= {'.'.join(map(str, MIN_VERSION))}. {SOL_ATTN_LABEL}: "
                            "block-sparse, self-attention only; about 0.2 % error on locally smooth inputs, 17-93 % "
                            "on unstructured ones (over 15 % it falls back). A quantized choice runs a shape only "
                            "where it is faster than the best exact backend. ComfyUI default: whatever ComfyUI's "
                            "launch flags chose."),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model: Any, backend: str) -> io.NodeOutput:
        return io.NodeOutput(apply_attention(model, backend))


NODES = [AttentionSelect]
