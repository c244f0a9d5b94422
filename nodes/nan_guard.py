"""NaN Guard node: name the first transformer block that produced NaN/inf, and the likely cause.

Hooks (ComfyUI v0.8.0): ``patches_replace["dit"][("double_block", i)]`` records one device flag per block output
(wrapping any replace patch already there, e.g. Block Swap's), and a DIFFUSION_MODEL wrapper starts each forward
and reads the flags once at its end (kernels/nan_guard.py). Wan (``blocks``) and Qwen-Image
(``transformer_blocks``: both its image and text streams are checked).
"""

from __future__ import annotations

import logging

import torch
from comfy_api.latest import io

from ..kernels.nan_guard import AFTER_BLOCKS, BEFORE_BLOCKS, NanReport, NanTracker
from .glue.common import CATEGORY_PATCHES, display_name, node_id, wrap_block_patches
from .glue.seams import PASS_THROUGH

log = logging.getLogger("comfyui_lowvram_dit")

GUARD_KEY = "lowvram_dit_nan_guard"
BLOCK_LISTS = ("blocks", "transformer_blocks")  # Wan (comfy/ldm/wan/model.py), Qwen-Image (qwen_image/model.py)
ACTIONS = ("warn", "raise")


class NonFiniteError(RuntimeError):
    """Raised by the guard with action=raise; the message is the report."""


class _Guard:
    """State shared by the block patches and the forward wrapper of one guarded MODEL."""

    def __init__(self, list_name: str, action: str, fp8_weights: bool, global_sage: bool) -> None:
        self.tracker = NanTracker(list_name)
        self.action = action
        self.fp8_weights = fp8_weights
        self.global_sage = global_sage
        self.attention_override = False
        self.warned: set[int] = set()
        self.last: NanReport | None = None

    def __deepcopy__(self, memo: dict) -> _Guard:
        return self  # model_options are deep-copied on clone: patches and wrapper must keep sharing one state


class _GuardBlock:
    """``("double_block", i)`` replace patch: run the block (or the patch it wraps), queue a finiteness flag."""

    def __init__(self, guard: _Guard, index: int, inner=None) -> None:
        self.guard, self.index, self.inner = guard, index, inner

    def __deepcopy__(self, memo: dict) -> _GuardBlock:
        return self

    def __call__(self, args: dict, extra: dict) -> dict:
        tr = self.guard.tracker
        if self.index == 0:
            opts = args.get("transformer_options") or {}
            self.guard.attention_override = "optimized_attention_override" in opts
            tr.sigma = opts.get("sigmas")
            tr.record(BEFORE_BLOCKS, args.get("img"), args.get("txt"))
        out = self.inner(args, extra) if self.inner is not None else extra["original_block"](args)
        tr.record(self.index, out.get("img"), out.get("txt") if "txt" in out else None)
        return out


class _GuardForward:
    """DIFFUSION_MODEL wrapper: start the record, check the output, read every flag once, warn or raise."""

    def __init__(self, guard: _Guard) -> None:
        self.guard = guard

    def __deepcopy__(self, memo: dict) -> _GuardForward:
        return self

    def __call__(self, executor, *args, **kwargs):
        g = self.guard
        g.tracker.begin()
        out = executor(*args, **kwargs)
        g.tracker.record(AFTER_BLOCKS, out if isinstance(out, torch.Tensor) else None)
        report = g.tracker.finish(attention_override=g.attention_override or g.global_sage,
                                  fp8_weights=g.fp8_weights)
        g.tracker.begin()  # drop references to this forward's tensors
        if report is None:
            return out
        g.last = report
        if g.action == "raise":
            raise NonFiniteError(report.message())
        if report.position not in g.warned:  # once per culprit, not once per step
            g.warned.add(report.position)
            log.warning("lowvram_dit %s", report.message())
        return out


def _find_list(diffusion_model: torch.nn.Module) -> tuple[str, int]:
    for name in BLOCK_LISTS:
        blocks = getattr(diffusion_model, name, None)
        if isinstance(blocks, torch.nn.ModuleList) and len(blocks) > 0:
            return name, len(blocks)
    raise ValueError(f"NaN Guard: {type(diffusion_model).__name__} has no `blocks`/`transformer_blocks` list; "
                     "it supports Wan 2.1/2.2 and Qwen-Image models (connect one of those)")


def apply_nan_guard(model, action: str = "warn"):
    """Return a clone of ``model`` whose every forward checks each block output for NaN/inf."""
    import comfy.model_management as mm
    import comfy.patcher_extension as pe

    if action not in ACTIONS:
        raise ValueError(f"NaN Guard: action must be one of {ACTIONS}, got {action!r}")
    dm = model.model.diffusion_model
    list_name, n = _find_list(dm)
    fp8 = any(p.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for p in dm.parameters())
    m = model.clone()
    m.remove_wrappers_with_key(pe.WrappersMP.DIFFUSION_MODEL, GUARD_KEY)  # applied twice: the last one wins
    guard = _Guard(list_name, action, fp8, bool(mm.sage_attention_enabled()))
    wrap_block_patches(m, n, lambda i, inner: _GuardBlock(guard, i, inner), _GuardBlock)
    m.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, GUARD_KEY, _GuardForward(guard))
    m.set_attachments(GUARD_KEY, guard)
    return m


class NanGuard(io.ComfyNode):
    """Check every transformer block's output for NaN/inf and name the first block that produced them.

    Without its hooks (per-block replace patches, DIFFUSION_MODEL wrapper) the node passes the model through:
    sampling works, nothing is checked, and the log says so once.
    """

    COMFY_SEAMS = ("wrappers.diffusion_model", "model_patcher.wrappers", "dit.block_replace", "model_management")
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
