"""Torch Compile: regional compile of the transformer blocks, with an OOM-safe fallback chain.

Built on the same seam as ComfyUI's ``set_torch_compile_wrapper`` (comfy_api/torch_helpers/torch_compile.py):
the pack's ``APPLY_MODEL`` hook chain (host/hooks.py) runs a ``CompileHook`` that puts compiled modules
into the BaseModel only while ``apply_model`` runs, so weight patching, LoRA and saving see the original
modules (no ``_orig_mod.`` keys). Differences: mode,
dynamic, fullgraph and a per-model recompile limit; blocks compiled as regions (one trace serves all blocks);
failures (compile errors, OOM during compile or the first run) step down the chain and retry the same step;
CUDA-graph modes are replaced when Block Swap streams whole blocks. Where ComfyUI streams single layers (its
partial loading; DynamicVRAM on a card smaller than the model) compiled blocks would break at every streamed layer:
such a model is passed through under DynamicVRAM (``too_big_for_card``) and runs eager under partial loading.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from ..kernels.compile import (
    CompileConfig, CompiledRegions, CompileHook, find_block_lists, transformer_options_guard_filter,
)
from ..kernels.compile_pays import EAGER, MIN_GAIN, CompilePays
from ..kernels.decisions import describe_kind, device_kind
from .dynamic_vram import legacy_clone
from .hooks import call_arguments, register_hook
from .log import say_once
from .patchers import dynamic_vram_manages

log = logging.getLogger("comfyui_lowvram_dit")

COMPILE_KEY = "lowvram_dit.torch_compile"
CORE_COMPILE_KEY = "torch.compile"  # comfy_api.torch_helpers.torch_compile.COMPILE_KEY
DYNAMIC_CHOICES: dict[str, Optional[bool]] = {"auto": None, "true": True, "false": False}
SCOPES = ("blocks", "whole model")
WHEN = ("it pays", "always")
PAYS = CompilePays()  # every compiled model's timed verdicts, keyed by model, shapes, GPU kind and config


def partially_loaded(base_model: Any) -> bool:
    """True when ComfyUI loaded the model partially (lowvram): its weights move between calls."""
    return bool(getattr(base_model, "model_lowvram", False))


def traced_wrappers(inputs: tuple) -> Optional[str]:
    """Why a whole-model graph changes between steps when ``apply_model``'s call ``inputs`` carry
    DIFFUSION_MODEL wrappers (EasyCache's): they run inside the compiled forward; None without any."""
    import comfy.patcher_extension as pe

    opts = call_arguments(*inputs).get("transformer_options")
    if not isinstance(opts, dict):
        return None
    wrappers = opts.get("wrappers", {}).get(pe.WrappersMP.DIFFUSION_MODEL, {})
    keys = sorted(str(key) for key, found in wrappers.items() if found)
    if not keys:
        return None
    return (f"scope 'whole model' compiles this model's diffusion-model wrappers ({', '.join(keys)}) with it, and "
            "their state changes between steps (a step cache starting to skip); scope 'blocks' keeps them outside "
            "the compiled code")


def too_big_for_card(model: Any) -> Optional[str]:
    """Why ``model``'s weights cannot all stay on its GPU beside ComfyUI's reserves (None when they fit)."""
    import comfy.model_management as mm

    device = model.load_device
    card = mm.get_total_memory(device) - mm.minimum_inference_memory()  # 0.8 GiB + --reserve-vram
    size = model.model_size()
    if size <= card:
        return None
    return f"its weights ({size / 2**30:.1f} GiB) do not fit the {card / 2**30:.1f} GiB of {device} left beside " \
           "ComfyUI's reserves"


def did_not_pay(model: Any, config: CompileConfig) -> Optional[str]:
    """Why compiling ``model`` with ``config`` on its GPU is known not to pay (every input shape timed there, in this
    or an earlier run, kept eager), None where it paid somewhere or was never timed."""
    device = torch.device(model.load_device)
    if device.type != "cuda":
        return None
    name, kind = type(model.model).__name__, device_kind(device)
    verdict, shapes = PAYS.model_verdict(name, kind, config.describe())
    if verdict != EAGER:
        return None
    return f"compiling {name} with {config.describe()} did not pay on {describe_kind(kind)} at the {shapes} input " \
           f"shape(s) timed (kept from the run that timed it)"


class SettleAfterSampling:
    """OUTER_SAMPLE wrapper: once a sampling run ends, decide the keys it finished timing (``CompilePays.settle``)."""

    def __init__(self, pays: CompilePays) -> None:
        self.pays = pays

    def __deepcopy__(self, memo: dict) -> SettleAfterSampling:
        return self  # one process-wide account of the timings

    def __call__(self, executor, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN204
        out = executor(*args, **kwargs)
        self.pays.settle()
        return out


def apply_compile(model: Any, config: CompileConfig, scope: str = "blocks",
                  compile_fn: Callable[..., Any] = torch.compile, when: str = "it pays") -> Any:
    """A clone of ``model`` (ModelPatcher) that runs compiled (``when`` 'it pays': only where a timed call on the GPU
    says so, kernels/compile_pays.py); ``compile_fn`` is injectable for tests."""
    if scope not in SCOPES:
        raise ValueError(f"Torch Compile: scope '{scope}' is not one of {SCOPES}")
    if when not in WHEN:
        raise ValueError(f"Torch Compile: when '{when}' is not one of {WHEN}")
    if dynamic_vram_manages(model) and (why := too_big_for_card(model)):
        say_once(log, f"lowvram_dit Torch Compile passes this model through: {why}, so ComfyUI's DynamicVRAM keeps "
                      "streaming it (leaving it for the legacy loading would stream it slower, layer by layer, and "
                      "break every compiled block at each streamed layer)")
        return model
    if when == "it pays" and dynamic_vram_manages(model) and (why := did_not_pay(model, config)):
        say_once(log, f"lowvram_dit Torch Compile passes this model through, uncompiled: {why}, so it stays on "
                      "ComfyUI's DynamicVRAM (no rebuild for the legacy loading); set when = always to compile anyway")
        return model
    m = legacy_clone(model, "Torch Compile") or model.clone()  # compiled regions must not hold DynamicVRAM casts
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
                              compile_fn=compile_fn, pays=PAYS if when == "it pays" else None)
    cause = traced_wrappers if paths == ["diffusion_model"] else (lambda inputs: None)
    register_hook(m, COMPILE_KEY, CompileHook(regions, partial_load=partially_loaded,
                                              recompile_cause=cause))  # twice: the last one wins
    m.remove_wrappers_with_key(WrappersMP.OUTER_SAMPLE, COMPILE_KEY)
    if when == "it pays":
        m.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, COMPILE_KEY, SettleAfterSampling(PAYS))
    m.set_attachments(COMPILE_KEY, regions)  # read by the doctor node / tests: regions.status()
    log.info("lowvram_dit compile: %s over %d region(s) (%s), %s", config.describe(), len(paths),
             "one per block" if scope == "blocks" else "whole model",
             "first run compiles" if when == "always" else
             f"kept where a compiled call on the GPU is {MIN_GAIN * 100:g} % faster than an eager one (timed once, "
             "then kept)")
    return m
