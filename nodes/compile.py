"""Torch Compile node: the schema; the regional compile is host/torch_compile.py."""

from __future__ import annotations

from typing import Any

from comfy_api.latest import io

from ..host.names import CATEGORY_PATCHES, display_name, node_id
from ..host.seams import PASS_THROUGH
from ..host.torch_compile import DYNAMIC_CHOICES, SCOPES, WHEN, apply_compile
from ..kernels.compile import MODES, CompileConfig
from ..kernels.compile_pays import MIN_GAIN


class TorchCompile(io.ComfyNode):
    """MODEL in, MODEL out: compiled transformer blocks that fall back instead of failing.

    Without the APPLY_MODEL wrapper seam the node passes the model through (it runs eager, as its own fallback
    chain would end), logged once.
    """

    COMFY_SEAMS = ("wrappers.apply_model", "model_patcher.wrappers")
    IF_SEAMS_MISSING = PASS_THROUGH

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=node_id("TorchCompile"),
            display_name=display_name("Torch Compile"),
            category=CATEGORY_PATCHES,
            description="torch.compile for this model, block by block (one compile serves every block). "
                        "If compiling or the first compiled step runs out of memory or the compiler fails, "
                        "it frees the memory, steps down (reduce-overhead -> default -> eager) and retries "
                        "the same step; the log names the mode in use. Measured in whole renders, it does not pay "
                        "on Wan 2.2 14B or Qwen-Image (their steps are bound by attention and GEMMs, or by the CPU): "
                        "leave it out there.",
            inputs=[
                io.Model.Input("model", tooltip="Diffusion model to compile (works after Block Swap and fp8 "
                                                "loaders; LoRA and saving keep seeing the plain model). A model "
                                                "larger than the card is passed through, uncompiled."),
                io.Combo.Input("mode", options=list(MODES), default="default",
                               tooltip="torch.compile mode. reduce-overhead and max-autotune record CUDA graphs: "
                                       "not possible while Block Swap streams weights, so their no-cudagraphs "
                                       "twin is used then. max-autotune compiles for minutes."),
                io.Combo.Input("backend", options=["inductor", "cudagraphs"], default="inductor",
                               tooltip="inductor generates fused Triton kernels; cudagraphs only records graphs."),
                io.Combo.Input("dynamic", options=list(DYNAMIC_CHOICES), default="auto",
                               tooltip="auto: specialise on the first shape, go dynamic after a change. true: "
                                       "one graph for all resolutions (a bit slower). false: one graph per shape."),
                io.Boolean.Input("fullgraph", default=False,
                                 tooltip="Fail instead of splitting a block at unsupported code (then the "
                                         "fallback steps down)."),
                io.Int.Input("cache_size_limit", default=64, min=1, max=4096,
                             tooltip="Recompiles allowed per block for this model (torch's default is 8: too "
                                     "few for cond/uncond batches x resolutions). Applied only while this "
                                     "model runs."),
                io.Boolean.Input("fallback", default=True,
                                 tooltip="On out-of-memory or a compiler error, step down to a lighter mode and "
                                         "finally eager, retrying the same step. Off: the error stops the run."),
                io.Combo.Input("scope", options=list(SCOPES), default="blocks",
                               tooltip="blocks: compile the repeated transformer block (fast first compile, "
                                       "block swap stays outside). whole model: one graph for everything."),
                io.Combo.Input("when", options=list(WHEN), default="it pays", optional=True,
                               tooltip="it pays: on a GPU, one eager and one compiled call are timed per model and "
                                       f"resolution; compile stays only if it is {MIN_GAIN * 100:g} % faster, else "
                                       "the model runs eager (the log says which; kept, so later runs skip the "
                                       "compile, and where it never paid for this model on this GPU, also the "
                                       "rebuild off DynamicVRAM). always: compile regardless."),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model: Any, mode: str, backend: str, dynamic: str, fullgraph: bool, cache_size_limit: int,
                fallback: bool, scope: str = "blocks", when: str = "it pays") -> io.NodeOutput:
        config = CompileConfig(mode=mode, backend=backend, dynamic=DYNAMIC_CHOICES[dynamic], fullgraph=fullgraph,
                               cache_size_limit=cache_size_limit, fallback=fallback)
        return io.NodeOutput(apply_compile(model, config, scope, when=when))


NODES = [TorchCompile]
