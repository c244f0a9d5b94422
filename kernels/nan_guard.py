"""NaN guard: find the first transformer block whose output is not finite, without a CPU sync per block.

Plain torch. Each checked tensor costs one fused ``torch.isfinite(x).all()`` reduction that stays on the device
(a 0-d bool); the flags are stacked and read once at the end of the forward (one sync per model call instead of
one per block). NaN/inf propagate through every later block, so the first flag that is False names the culprit.
The reduction reads each activation once (docs/benchmarks.md has its cost).
``NanGuardHook`` attaches the tracker to a model through kernels/hooks.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .hooks import HookRegistry, ModelHook, PerModel

log = logging.getLogger("comfyui_lowvram_dit")

ACTIONS = ("warn", "raise")
BEFORE_BLOCKS = -1  # position of the input check (embeddings / latent went bad before block 0)
AFTER_BLOCKS = 1 << 30  # position of the output check (the head produced it)


@dataclass(frozen=True)
class NanReport:
    """Where non-finite values first appeared in one forward, and the likely cause."""

    position: int  # block index, BEFORE_BLOCKS or AFTER_BLOCKS
    where: str  # human words: "transformer block 3 (blocks.3)"
    cause: str
    sigma: float | None

    def message(self) -> str:
        """The line shown to the user (log or execution error)."""
        at = f" at sigma {self.sigma:.4g}" if self.sigma is not None else ""
        return f"NaN Guard: non-finite values (NaN/inf) first appeared in {self.where}{at}. Likely cause: {self.cause}"


class NanTracker:
    """Per-forward record of device-side finiteness flags; ``begin`` / ``record`` per block / ``finish``."""

    def __init__(self, list_name: str = "blocks") -> None:
        self.list_name = list_name
        self._flags: list[torch.Tensor] = []
        self._positions: list[int] = []
        self.compute_dtype: torch.dtype | None = None
        self.sigma: torch.Tensor | None = None

    def begin(self) -> None:
        """Start a forward: drop the previous forward's flags."""
        self._flags.clear()
        self._positions.clear()
        self.compute_dtype = None
        self.sigma = None

    def record(self, position: int, *tensors: torch.Tensor | None) -> None:
        """Queue one device flag that is True iff every given floating tensor is finite (no sync)."""
        flags = [torch.isfinite(t).all() for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not flags:
            return
        if self.compute_dtype is None:
            self.compute_dtype = next(t.dtype for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point())
        flag = flags[0] if len(flags) == 1 else torch.stack(flags).all()
        self._flags.append(flag)
        self._positions.append(position)

    @property
    def pending(self) -> int:
        """Flags recorded in this forward (a test hook; reading them is ``first_bad``)."""
        return len(self._flags)

    def first_bad(self) -> int | None:
        """The first recorded position whose flag is False (one device->host read), or None if all finite."""
        if not self._flags:
            return None
        ok = torch.stack([f.to(self._flags[0].device) for f in self._flags]).cpu()  # the one sync per forward
        bad = (~ok).nonzero()
        return self._positions[int(bad[0, 0])] if bad.numel() else None

    def describe(self, position: int) -> str:
        """Human words for a position."""
        if position == BEFORE_BLOCKS:
            return f"the input to {self.list_name}.0 (latent, text conditioning or embeddings)"
        if position == AFTER_BLOCKS:
            return "the output head (every transformer block was finite)"
        return f"transformer block {position} ({self.list_name}.{position})"

    def finish(self, *, attention_override: bool = False, fp8_weights: bool = False) -> NanReport | None:
        """End a forward: a report if any recorded tensor was not finite, else None."""
        pos = self.first_bad()
        if pos is None:
            return None
        sigma = float(self.sigma.flatten()[0]) if isinstance(self.sigma, torch.Tensor) and self.sigma.numel() else None
        cause = likely_cause(self.compute_dtype, attention_override=attention_override, fp8_weights=fp8_weights,
                             position=pos)
        return NanReport(pos, self.describe(pos), cause, sigma)


def likely_cause(compute_dtype: torch.dtype | None, *, attention_override: bool, fp8_weights: bool,
                 position: int = 0) -> str:
    """The most likely reason for non-finite activations, with the fix, from what the guard can see."""
    if position == BEFORE_BLOCKS:
        return ("the model's input was already non-finite: check the latent (VAE encode / previous sampler), "
                "the conditioning and the text encoder file")
    if compute_dtype == torch.float16:
        return ("fp16 overflow (activations above 65504): these models are trained in bf16; set the loader's "
                "compute dtype to bf16 (or fp32 on GPUs without bf16)")
    if attention_override:
        weights = "fp8 weights + " if fp8_weights else ""
        return (f"{weights}SageAttention / 8-bit attention: quantized attention can overflow on outlier "
                "activations; set the attention backend to 'sdpa' (LowVRAM Attention node or no --use-sage-attention) "
                "and run again to confirm")
    return ("check the LoRA / model file: a LoRA with inf/NaN weights or too high a strength, or a damaged or "
            "wrongly converted checkpoint (bypass the LoRA to tell which; re-download the file)")


class NonFiniteError(RuntimeError):
    """Raised by the guard with action=raise; the message is the report."""


def _block_tensors(x: Any) -> tuple[Any, ...]:
    """The hidden states of a block's inputs or outputs: a ``{"img", "txt"}`` dict (ComfyUI DiTs) or a tensor."""
    if isinstance(x, dict):
        return (x.get("img"), x.get("txt"))
    return (x,)


class NanGuardHook(ModelHook):
    """Per block: queue one finiteness flag; per forward: read the flags once, then warn or raise."""

    ORDER = 20
    PER_BLOCK = True

    def __init__(self, list_name: str, action: str, *, fp8_weights: bool = False, global_sage: bool = False,
                 attention_override: Callable[[Any], bool] = lambda inputs: False) -> None:
        if action not in ACTIONS:
            raise ValueError(f"NaN Guard: action must be one of {ACTIONS}, got {action!r}")
        self.tracker = NanTracker(list_name)
        self.action = action
        self.fp8_weights = fp8_weights
        self.global_sage = global_sage
        self.attention_override_of = attention_override  # reads a per-model attention override off block 0's inputs
        self.attention_override = False
        self.warned: set[int] = set()
        self.last: NanReport | None = None
        self.models = PerModel()

    def for_model(self, module: Any) -> NanGuardHook:
        """Each model keeps its own record: MultiGPU clones run their forwards at the same time."""
        return self.models.get(module, self, lambda: NanGuardHook(
            self.tracker.list_name, self.action, fp8_weights=self.fp8_weights, global_sage=self.global_sage,
            attention_override=self.attention_override_of))

    def pre_block(self, index: int, inputs: Any) -> None:
        """Block 0 also records the model's input and the sigma of this step."""
        if index != 0:
            return
        opts = (inputs.get("transformer_options") or {}) if isinstance(inputs, dict) else {}
        self.attention_override = bool(self.attention_override_of(inputs))
        self.tracker.sigma = opts.get("sigmas")
        self.tracker.record(BEFORE_BLOCKS, *_block_tensors(inputs))

    def post_block(self, index: int, outputs: Any) -> Any:
        """Queue the block output's flag (no sync)."""
        self.tracker.record(index, *_block_tensors(outputs))
        return outputs

    def wrap_forward(self, module: Any, call: Callable[[], Any], registry: HookRegistry) -> Any:
        """Start the record, check the output, read every flag once, warn or raise."""
        tracker = self.tracker
        tracker.begin()
        out = call()
        tracker.record(AFTER_BLOCKS, out if isinstance(out, torch.Tensor) else None)
        report = tracker.finish(attention_override=self.attention_override or self.global_sage,
                                fp8_weights=self.fp8_weights)
        tracker.begin()  # drop references to this forward's tensors
        if report is None:
            return out
        self.last = report
        if self.action == "raise":
            raise NonFiniteError(report.message())
        if report.position not in self.warned:  # once per culprit, not once per step
            self.warned.add(report.position)
            log.warning("lowvram_dit %s", report.message())
        return out
