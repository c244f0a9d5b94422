"""NaN Guard node: the schema; the guard is host/nan_guard.py."""

from __future__ import annotations

from comfy_api.latest import io

from ..host.names import CATEGORY_PATCHES, display_name, node_id
from ..host.nan_guard import apply_nan_guard
from ..host.seams import PASS_THROUGH
from ..kernels.nan_guard import ACTIONS


class NanGuard(io.ComfyNode):
    """Check every transformer block's output for NaN/inf and name the first block that produced them.

    Without its hooks (per-block replace patches, APPLY_MODEL wrapper) the node passes the model through:
    sampling works, nothing is checked, and the log says so once.
    """

    COMFY_SEAMS = ("wrappers.apply_model", "model_patcher.wrappers", "dit.block_replace", "model_management")
    IF_SEAMS_MISSING = PASS_THROUGH

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=node_id("NanGuard"),
            display_name=display_name("NaN Guard"),
            category=CATEGORY_PATCHES,
            description="Finds the first transformer block whose output holds NaN/inf (black or noise frames) and "
                        "names the likely cause (fp16 overflow, quantized attention, a LoRA or a damaged file). "
                        "One reduction per block, read once per step. Wan 2.1/2.2 and Qwen-Image.",
            inputs=[
                io.Model.Input("model", tooltip="A Wan 2.1/2.2 or Qwen-Image diffusion model."),
                io.Combo.Input("action", options=list(ACTIONS), default="warn",
                               tooltip="warn: log the first bad block once and keep sampling. raise: stop the "
                                       "prompt with that message (the server keeps running)."),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, action: str = "warn") -> io.NodeOutput:
        return io.NodeOutput(apply_nan_guard(model, action))


NODES = [NanGuard]
