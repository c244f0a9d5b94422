"""Torch Compile node: regional compile of the transformer blocks, with an OOM-safe fallback chain.

Built on the same seam as ComfyUI's ``set_torch_compile_wrapper`` (comfy_api/torch_helpers/torch_compile.py):
the pack's ``APPLY_MODEL`` hook chain (host/hooks.py) runs a ``CompileHook`` that puts compiled modules
into the BaseModel only while ``apply_model`` runs, so weight patching, LoRA and saving see the original
modules (no ``_orig_mod.`` keys). Differences: mode,
dynamic, fullgraph and a per-model recompile limit; blocks compiled as regions (one trace serves all blocks);
failures (compile errors, OOM during compile or the first run) step down the chain and retry the same step;
CUDA-graph modes are replaced when weights stream (our block swap, ComfyUI partial loading).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
from comfy_api.latest import io

from ..kernels.compile import (
    MODES, CompileConfig, CompiledRegions, CompileHook, find_block_lists, transformer_options_guard_filter,
)
from ..host.common import CATEGORY_PATCHES, display_name, node_id
from ..host.hooks import register_hook
from ..host.seams import PASS_THROUGH

log = logging.getLogger("comfyui_lowvram_dit")

COMPILE_KEY = "lowvram_dit.torch_compile"
CORE_COMPILE_KEY = "torch.compile"  # comfy_api.torch_helpers.torch_compile.COMPILE_KEY
DYNAMIC_CHOICES: dict[str, Optional[bool]] = {"auto": None, "true": True, "false": False}
SCOPES = ("blocks", "whole model")


def partially_loaded(base_model: Any) -> bool:
    """True when ComfyUI loaded the model partially (lowvram): its weights move between calls."""
    return bool(getattr(base_model, "model_lowvram", False))


def apply_compile(model: Any, config: CompileConfig, scope: str = "blocks",
                  compile_fn: Callable[..., Any] = torch.compile) -> Any:
    """A clone of ``model`` (ModelPatcher) that runs compiled; ``compile_fn`` is injectable for tests."""
    if scope not in SCOPES:
        raise ValueError(f"nodes/compile.py: scope '{scope}' is not one of {SCOPES}")
    m = model.clone()
    from comfy.patcher_extension import WrappersMP

    if m.get_wrappers(WrappersMP.APPLY_MODEL, CORE_COMPILE_KEY):
        log.warning("lowvram_dit compile: removed ComfyUI's TorchCompileModel wrapper from this model; "
                    "compiling twice would nest the compiled modules")
        m.remove_wrappers_with_key(WrappersMP.APPLY_MODEL, CORE_COMPILE_KEY)
    diffusion_model = m.get_model_object("diffusion_model")
    paths = find_block_lists(diffusion_model, prefix="diffusion_model") if scope == "blocks" else []
    if not paths:
        if scope == "blocks":
            log.warning("lowvram_dit compile: no repeated block list found in %s; compiling the whole model",
                        type(diffusion_model).__name__)
        paths = ["diffusion_model"]
    regions = CompiledRegions(config, paths, guard_filter_fn=transformer_options_guard_filter,
                              compile_fn=compile_fn)
    register_hook(m, COMPILE_KEY, CompileHook(regions, partial_load=partially_loaded))  # twice: the last one wins
    m.set_attachments(COMPILE_KEY, regions)  # read by the doctor node / tests: regions.status()
    log.info("lowvram_dit compile: %s over %d region(s) (%s), first run compiles",
             config.describe(), len(paths), "one per block" if scope == "blocks" else "whole model")
    return m


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
                        "the same step; the log names the mode in use.",
            inputs=[
                io.Model.Input("model", tooltip="Diffusion model to compile (works after Block Swap and fp8 "
                                                "loaders; LoRA and saving keep seeing the plain model)."),
                io.Combo.Input("mode", options=list(MODES), default="default",
                               tooltip="torch.compile mode. reduce-overhead and max-autotune record CUDA graphs: "
                                       "not possible while weights stream (block swap, partial loading), so "
                                       "their no-cudagraphs twin is used then. max-autotune compiles for minutes."),
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
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model: Any, mode: str, backend: str, dynamic: str, fullgraph: bool, cache_size_limit: int,
                fallback: bool, scope: str = "blocks") -> io.NodeOutput:
        config = CompileConfig(mode=mode, backend=backend, dynamic=DYNAMIC_CHOICES[dynamic], fullgraph=fullgraph,
                               cache_size_limit=cache_size_limit, fallback=fallback)
        return io.NodeOutput(apply_compile(model, config, scope))


NODES = [TorchCompile]
