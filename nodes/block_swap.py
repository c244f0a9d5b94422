"""Block Swap node: the schema; the controller and patcher mixin are host/block_swap.py."""

from __future__ import annotations

from comfy_api.latest import io

from ..host.block_swap import apply_block_swap
from ..host.names import CATEGORY_PATCHES, display_name, node_id
from ..host.seams import BLOCK_SWAP_SEAMS, PASS_THROUGH
from ..offload import dynamic_vram_policy
from ..offload import plan as swap_plan
from ..offload.plan import SwapConfig, budget_problem, check_budget


class BlockSwap(io.ComfyNode):
    """Keep some transformer blocks in (pinned) RAM and stream them to the GPU just before they run.

    Without its seams the node passes the model through: ComfyUI's own partial loading still streams weights
    (no block prefetch), logged once.
    """

    COMFY_SEAMS = BLOCK_SWAP_SEAMS
    IF_SEAMS_MISSING = PASS_THROUGH

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=node_id("BlockSwap"),
            display_name=display_name("Block Swap"),
            category=CATEGORY_PATCHES,
            description="Streams whole transformer blocks (fp8 or not) from RAM to the GPU one step ahead of "
                        "compute, inside ComfyUI's memory management. Wan 2.1/2.2 and Qwen-Image.",
            inputs=[
                io.Model.Input("model", tooltip="A Wan 2.1/2.2 or Qwen-Image diffusion model."),
                io.Float.Input("vram_budget_gb", default=0.0, min=0.0, max=1024.0, step=0.5,
                               tooltip="GPU memory this model may use (weights + ring + activations at the "
                                       "current resolution). 0 = whatever ComfyUI has free."),
                io.Int.Input("blocks_to_swap", default=-1, min=-1, max=200,
                             tooltip="Blocks to keep in RAM and stream. -1 = the fewest that fit the budget."),
                io.Int.Input("prefetch", default=1, min=1, max=swap_plan.MAX_PREFETCH,
                             tooltip="Streamed blocks loading ahead of the one computing (GPU ring = prefetch + 1 "
                                     "blocks). Raise it when transfers are slower than compute."),
                io.Boolean.Input("pinned", default=True,
                                 tooltip="Page-lock the RAM copy of streamed blocks (fast async copies), and keep "
                                         "the resident part there, LoRA merged, between unloads (fast Wan 2.2 "
                                         "expert switches). Off saves pinned memory (Windows shows it as shared GPU "
                                         "memory) but copies block and each load reads the files again."),
                io.Boolean.Input("offload_embeddings", default=False,
                                 tooltip="Also keep embeddings and the output head in RAM (cast per call)."),
                io.Boolean.Input("debug", default=False,
                                 tooltip="Log per-block transfer vs compute time and the overlap achieved "
                                         "(adds one GPU sync per forward)."),
                io.Combo.Input("dynamic_vram", options=list(dynamic_vram_policy.CHOICES), default="auto",
                               optional=True,
                               tooltip="When ComfyUI's DynamicVRAM manages the model (its default on NVIDIA). "
                                       "step aside: let it; renders faster, but it keeps every model's weights in "
                                       "RAM. stream: Block Swap streams (the model is rebuilt once for ComfyUI's "
                                       "legacy loading); less RAM. auto: step aside where RAM holds this model + "
                                       "16 GB (a Wan 14B expert: 32 GB machines), else stream. Without DynamicVRAM "
                                       "Block Swap always streams."),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def validate_inputs(cls, vram_budget_gb: float) -> bool | str:
        """Refuse a NaN / infinite / out-of-range budget by name when the prompt is queued."""
        return budget_problem(vram_budget_gb) or True

    @classmethod
    def execute(cls, model, vram_budget_gb: float, blocks_to_swap: int, prefetch: int,  # noqa: ANN001
                pinned: bool, offload_embeddings: bool, debug: bool = False,
                dynamic_vram: str = "auto") -> io.NodeOutput:
        check_budget(vram_budget_gb)
        config = SwapConfig(vram_budget_gb=vram_budget_gb, blocks_to_swap=blocks_to_swap, prefetch=prefetch,
                            pinned=pinned, offload_embeddings=offload_embeddings, debug=debug,
                            dynamic_vram=dynamic_vram)
        return io.NodeOutput(apply_block_swap(model, config))


NODES = [BlockSwap]
