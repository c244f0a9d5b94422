"""ComfyUI ``custom_operations`` whose Linear runs fp8 weights (per-tensor or block-wise) through kernels.fp8.

The model is built by ComfyUI itself (``comfy.sd.load_diffusion_model_state_dict(sd, {"custom_operations":
make_fp8_ops(cfg), ...})``), so it stays a native MODEL. ``LowVramFp8Ops`` is a module-level
``comfy.ops.manual_cast`` subclass configured by class attributes (as ComfyUI-GGUF's ``GGMLOps``);
``make_fp8_ops`` returns its subclass with the config. Every op except Linear is ``manual_cast``'s. This module
imports ComfyUI at import time: loaders import it inside their load functions.
The Linear keeps the CastWeightBiasOp contract:
- resident, no LoRA functions: ``kernels.fp8.fp8_linear`` on the fp8 weight (fp8 matmul where the GPU has it),
  or, where the compute mode is int8 (kernels/int8_choice.py: "auto" on GPUs with int8 but no fp8 tensor cores),
  ``kernels.int8.int8_linear`` on a per-channel int8 copy of the weight made once per weight and device and kept
  on the module (``_derived``, beside the GEMM path picked per device). The copy is dropped whenever the weight
  may have changed: ``set_weight`` (LoRA merges), a state-dict load, a move (``_apply``), and any new weight
  Parameter (ComfyUI's unpatching re-binds the original). A weight updated in place
  (``set_weight(inplace_update=True)``) could later be restored in place without this layer seeing it
  (``comfy.utils.copy_to_param``), so from then on its int8 copy is made per call;
  so is that of a weight that is a view into a larger buffer (Block Swap's GPU ring slots: caching those would keep
  every streamed block's copy on the GPU), and of every weight while torch.compile traces;
- lowvram-offloaded: the fp8 weight + its scale are copied on ComfyUI's offload stream (``uncast_bias_weight``
  afterwards), then the same fp8 matmul, so streamed layers keep fp8 compute (native dequantizes them);
- ``weight_function`` LoRA patches (lowvram): dequantize, apply the patches, bf16/fp16 matmul;
- merged LoRA (resident): ``convert_weight`` dequantizes, ComfyUI adds the LoRA, ``set_weight`` re-quantizes
  with the layer's existing scale. The scale is never changed by patching, because ModelPatcher backs up and
  restores only ``<layer>.weight``; a new scale would survive unpatching and corrupt the restored weight.
Weights are plain tensors (float8 ``weight``, fp32 ``weight_scale``), so block swap moves them like any other. A
state dict in another file convention is brought to that form by ``checkpoints.fp8_state.pop_fp8_layer``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import comfy.float
import comfy.model_management as mm
import comfy.ops
import torch

from ..kernels import fp8 as fp8_math
from ..kernels import fp8_requantize
from ..kernels import int8 as int8_math
from ..kernels import int8_choice, opaque_ops
from ..checkpoints.fp8_state import pop_fp8_layer

log = logging.getLogger("comfyui_lowvram_dit")

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class Fp8OpsConfig:
    """How the fp8 Linear layers of one model compute."""

    block_size: int = 128  # for block-wise weight scales (2-D weight_scale); per-tensor scales are 0-d
    compute: int8_choice.Compute = "auto"  # "auto" | "fp8" (fp8 matmul or error) | "int8" | "dequantize"


class LowVramFp8Ops(comfy.ops.manual_cast):
    """Every op is ``manual_cast``'s except Linear, which computes fp8 weights through kernels.fp8."""

    fp8_config: ClassVar[Fp8OpsConfig] = Fp8OpsConfig()

    class Linear(comfy.ops.manual_cast.Linear):
        """Linear that holds either a high-precision weight or an fp8 weight + ``weight_scale``."""

        fp8_config: ClassVar[Fp8OpsConfig] = Fp8OpsConfig()

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.register_parameter("weight_scale", None)
            self._derived = _Derived()  # what calls derive from the weight and keep (see the module doc)

        @property
        def is_fp8(self) -> bool:
            return self.weight is not None and self.weight.dtype in FP8_DTYPES

        @property
        def _full_precision_mm(self) -> bool:
            """True while the weight is fp8: ComfyUI's fused paths that bypass ``forward`` (the fp16-accumulation
            GEMM in ``comfy.ops.linear_input_act``) would take the raw fp8 codes from ``cast_bias_weight``
            without this layer's scale; this flag makes them call the layer instead."""
            return self.is_fp8 or self.__dict__.get("_full_precision_mm_requested", False)

        @_full_precision_mm.setter
        def _full_precision_mm(self, value: bool) -> None:
            # a host that switches the flag per layer may turn it on; an fp8 weight keeps it on regardless
            self.__dict__["_full_precision_mm_requested"] = bool(value)

        def _block_size(self) -> int | None:
            return None if self.weight_scale is None or self.weight_scale.ndim == 0 else self.fp8_config.block_size

        # ---- loading -----------------------------------------------------------------------------
        def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                                  unexpected_keys, error_msgs) -> None:  # noqa: ANN001 - torch signature
            found = pop_fp8_layer(state_dict, prefix, self.fp8_config.block_size)
            if found is not None:
                w, scale = found
                if tuple(w.shape) != (self.out_features, self.in_features):
                    raise ValueError(f"{prefix}weight has shape {list(w.shape)}, the model expects "
                                     f"{[self.out_features, self.in_features]}")
                device = self.weight.device if self.weight is not None and self.weight.device.type != "meta" else w.device
                self.weight = torch.nn.Parameter(w.to(device), requires_grad=False)
                self.weight_scale = torch.nn.Parameter(scale.to(device), requires_grad=False)
                # ComfyUI recorded the dtype the layer was built with (bf16); DynamicVRAM casts to the recorded one
                self.weight_comfy_model_dtype = w.dtype
            self._derived.invalidate()
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                          unexpected_keys, error_msgs)
            for k in (prefix + "weight", prefix + "weight_scale"):
                if k in missing_keys and self.is_fp8:
                    missing_keys.remove(k)

        # ---- forward -----------------------------------------------------------------------------
        def _path(self, device: torch.device) -> str:
            cached = self._derived.path
            if cached is not None and cached[0] == device:
                return cached[1]
            n, k = self.weight.shape
            mode = int8_choice.compute_mode(device, self.fp8_config.compute)
            if mode == "int8":  # odd-sized layers (K or N not a multiple of 8) dequantize
                path = "int8" if int8_math.int_mm_ok(1, n, k) else "dequantize"
            else:
                path = fp8_math.select_path(device, self._block_size(), n, k, mode)
            if not torch.compiler.is_compiling():  # no module mutation inside a compiled region
                self._derived.path = (device, path)
            return path

        def forward(self, input, *args, **kwargs):  # noqa: ANN001, ANN201 - ComfyUI op signature
            comfy.ops.run_every_op()
            if not self.is_fp8:
                return super().forward_comfy_cast_weights(input, *args, **kwargs)
            if (self.weight.device == input.device and not self.weight_function and not self.bias_function
                    and getattr(self, "_v", None) is None):  # a DynamicVRAM slot: weights come through its cast
                path = self._path(input.device)
                if path == "int8":
                    return self._int8_linear(input, self.weight, self.weight_scale, self.bias, self._cacheable())
                return opaque_ops.fp8_linear(input, self.weight, self.weight_scale, self.bias, self._block_size(),
                                             path)
            return self.forward_comfy_cast_weights(input)

        def forward_comfy_cast_weights(self, input):  # noqa: ANN001, ANN201
            if not self.is_fp8:
                return super().forward_comfy_cast_weights(input)
            if getattr(self, "_v", None) is not None and not self.weight_function:
                return self._forward_dynamic(input)
            # comfy.ops.cast_bias_weight would apply LoRA weight_functions to the raw fp8 codes (ignoring
            # the scale), so the copy is done here with the same offload-stream protocol.
            device = input.device
            moving = self.weight.device != device or (self.bias is not None and self.bias.device != device)
            stream = mm.get_offload_stream(device) if moving else None
            nb = mm.device_supports_non_blocking(device)
            w = mm.cast_to(self.weight, None, device, non_blocking=nb, stream=stream)
            s = mm.cast_to(self.weight_scale, None, device, non_blocking=nb, stream=stream)
            b = None
            if self.bias is not None:
                b = mm.cast_to(self.bias, input.dtype, device, non_blocking=nb, copy=bool(self.bias_function),
                               stream=stream)
            mm.sync_stream(device, stream)
            for f in self.bias_function:
                b = f(b)
            if self.weight_function:
                wd = fp8_math.dequantize(w, s, self._block_size(), input.dtype)
                for f in self.weight_function:
                    wd = f(wd)
                out = torch.nn.functional.linear(input, wd.to(input.dtype), b)
            elif (path := self._path(device)) == "int8":  # a copied weight: its int8 copy lives for this call
                out = self._int8_linear(input, w, s, b, cacheable=False)
            else:
                out = opaque_ops.fp8_linear(input, w, s, b, self._block_size(), path)
            comfy.ops.uncast_bias_weight(self, w, b, (stream, w, b))
            return out

        def _forward_dynamic(self, input):  # noqa: ANN001, ANN201
            """DynamicVRAM (``ModelPatcherDynamic`` gave this layer a slot ``_v`` in its VRAM cache): the fp8 codes
            come through ComfyUI's own ``cast_bias_weight`` (resident in the cache, or faulted in from its pinned
            copy), LoRA patches applied there in this layer's scale (``weight_lowvram_function``), then the same
            fp8 GEMM. The scale is a small parameter DynamicVRAM loads to the GPU with the model."""
            device = input.device
            w, b, offload = comfy.ops.cast_bias_weight(self, input, dtype=self.weight.dtype, bias_dtype=input.dtype,
                                                       offloadable=True, compute_dtype=torch.float32,
                                                       want_requant=True)
            try:
                s = self.weight_scale if self.weight_scale.device == device else self.weight_scale.to(device)
                if (path := self._path(device)) == "int8":
                    return self._int8_linear(input, w, s, b, cacheable=False)
                return opaque_ops.fp8_linear(input, w, s, b, self._block_size(), path)
            finally:
                comfy.ops.uncast_bias_weight(self, w, b, offload)

        @property
        def weight_lowvram_function(self):  # noqa: ANN201 - comfy.model_patcher.LowVramPatch | _ScaledPatch | None
            """The LoRA patch DynamicVRAM applies to this layer's weight as it casts it. ComfyUI hands it the raw fp8
            codes; patches are deltas of real weight values, so an fp8 layer serves them through its scale."""
            patch = self.__dict__.get("_weight_lowvram_patch")
            if patch is None or not self.is_fp8:
                return patch
            # One wrapper per patch, kept: ComfyUI pins a patch's data once and finds that pin again by the object
            # it is handed (comfy.pinned_memory keeps it in the object's own __dict__), so a new wrapper per cast
            # would pin the patch again at every step and grow the pinned buffer.
            scaled = self.__dict__.get("_weight_lowvram_scaled")  # the setter drops it when the patch changes
            if scaled is None:
                scaled = self.__dict__["_weight_lowvram_scaled"] = _ScaledPatch(patch, self)
            return scaled

        @weight_lowvram_function.setter
        def weight_lowvram_function(self, patch) -> None:  # noqa: ANN001 - LowVramPatch | None
            self.__dict__["_weight_lowvram_patch"] = patch
            if getattr(self.__dict__.get("_weight_lowvram_scaled"), "patch", None) is not patch:
                self.__dict__.pop("_weight_lowvram_scaled", None)

        # ---- int8 compute ------------------------------------------------------------------------------
        def _cacheable(self) -> bool:
            """Whether this layer's int8 copy may be kept (see the module doc for when it is made per call)."""
            w = self.weight
            return (not self._derived.updated_in_place and not torch.compiler.is_compiling()
                    and w.untyped_storage().nbytes() == w.numel() * w.element_size())

        def _int8_linear(self, input, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                         cacheable: bool) -> torch.Tensor:  # noqa: ANN001 - ComfyUI op signature
            rotate = int8_choice.rotate_for(weight.shape[1])
            found = self._derived.int8
            if found is not None and cacheable and found.matches(weight, rotate):
                wq, ws = found.q, found.scale
            else:
                wq, ws = int8_math.weight_from_fp8(weight, scale, self._block_size(), rotate)
                if cacheable:  # never set while torch.compile traces (no module mutation in a compiled region)
                    self._derived.int8 = _Int8Copy.of(weight, rotate, wq, ws)
            return int8_choice.linear(input, wq, ws, bias, rotate)

        # ---- LoRA (merged into resident weights by ModelPatcher.patch_weight_to_device) ------------
        def _full_scale(self, weight: torch.Tensor) -> torch.Tensor:
            return fp8_math.expand_scale(self.weight_scale, tuple(weight.shape), self.fp8_config.block_size,
                                         weight.device)

        def convert_weight(self, weight, inplace=False, **kwargs):  # noqa: ANN001, ANN201
            """Raw fp8 codes (already cast to the LoRA dtype by ComfyUI) -> real weight values."""
            if not self.is_fp8:
                return weight
            scale = self._full_scale(weight)
            return weight.mul_(scale) if inplace else weight * scale

        def _count_clipped(self, weight: torch.Tensor) -> int:
            """How many values of a patched weight divided by this layer's scale are past fp8's range."""
            return int(((weight.float() / self._full_scale(weight)).abs() > fp8_math.FP8_MAX).sum())

        def set_weight(self, weight, inplace_update=False, seed=None, return_weight=False, **kwargs):  # noqa: ANN001, ANN201
            """Store a patched weight: re-quantized with this layer's scale (fp8) or rounded (others)."""
            if self.is_fp8:
                # one kernel on the GPU: the scale's division, the clip check's peak, the clamp and the cast
                new, peak = fp8_requantize.requantize(weight, self.weight_scale, self._block_size(), self.weight.dtype)
                _warn_if_clipped(peak, tuple(self.weight.shape), lambda: self._count_clipped(weight))
            else:
                new = comfy.float.stochastic_rounding(weight, self.weight.dtype, seed=seed or 0)
            if return_weight:
                return new
            self._derived.invalidate()  # the int8 copy follows the weight: made again at the next call
            self._derived.updated_in_place |= bool(inplace_update)
            if inplace_update:
                self.weight.data.copy_(new)
            else:
                self.weight = torch.nn.Parameter(new, requires_grad=False)

        # ---- moving ------------------------------------------------------------------------------
        def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN201
            """Like nn.Module._apply, but fp8 weights stay fp8 and scales stay fp32 (only devices move)."""
            for key, param in self._parameters.items():
                if param is None:
                    continue
                new = fn(param)
                if (param.dtype in FP8_DTYPES or key == "weight_scale") and new.dtype != param.dtype:
                    new = param.to(device=new.device)
                self.register_parameter(key, torch.nn.Parameter(new, requires_grad=False))
            for key, buf in self._buffers.items():
                if buf is not None:
                    self._buffers[key] = fn(buf)
            self._derived.invalidate()
            return self


class _Derived:
    """What an fp8 Linear derives from its weight and keeps between calls: the GEMM path picked for a device and the
    int8 copy of the weight (one device). ``invalidate()`` drops both wherever the weight may have changed (a state
    dict load, ``set_weight``, a move); an int8 copy also checks the very Parameter and its version it was made from.
    ``updated_in_place``: once set, int8 copies are made per call (see the module doc)."""

    def __init__(self) -> None:
        self.path: tuple[torch.device, str] | None = None
        self.int8: _Int8Copy | None = None
        self.updated_in_place = False

    def invalidate(self) -> None:
        self.path = None
        self.int8 = None


@dataclass(frozen=True)
class _Int8Copy:
    """A weight's per-channel int8 copy and what it was made from (the Parameter, by weak reference, and its
    version counter, which in-place updates through the Parameter itself bump)."""

    source: weakref.ref
    version: int
    rotate: bool
    q: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor, rotate: bool, q: torch.Tensor, scale: torch.Tensor) -> "_Int8Copy":
        return cls(weakref.ref(weight), _version_of(weight), rotate, q, scale)

    def matches(self, weight: torch.Tensor, rotate: bool) -> bool:
        """Made from this very weight, unchanged since, on its device, with the same rotation."""
        return (self.source() is weight and self.version == _version_of(weight) and self.rotate == rotate
                and self.q.device == weight.device)


class _ScaledPatch:
    """A DynamicVRAM LoRA patch (``comfy.model_patcher.LowVramPatch``) seen through an fp8 layer's scale: codes in,
    codes out, the patch applied to the real values in between (fp32). Everything else is the patch's own."""

    def __init__(self, patch: object, layer: torch.nn.Module) -> None:
        self.patch = patch
        self.layer = layer

    def __getattr__(self, name: str) -> object:
        return getattr(self.patch, name)

    def __call__(self, codes: torch.Tensor) -> torch.Tensor:
        scale = self.layer._full_scale(codes)
        patched = self.patch(codes.float() * scale)
        return patched.float() / scale


def _version_of(t: torch.Tensor) -> int:
    """The version counter of ``t``; -1 for inference tensors (ComfyUI loads under inference mode), which have
    none: for them only the identity of the Parameter and ``set_weight`` tell that the weight changed."""
    return -1 if t.is_inference() else t._version


_CONFIGURED: dict[Fp8OpsConfig, type] = {}


def make_fp8_ops(config: Fp8OpsConfig | None = None) -> type:
    """The ``custom_operations`` class for ``config``: ``LowVramFp8Ops`` with the config as class attributes
    (one class per config, so models loaded with the same settings share it)."""
    cfg = config or Fp8OpsConfig()
    if cfg not in _CONFIGURED:
        linear = type("Linear", (LowVramFp8Ops.Linear,), {
            "fp8_config": cfg, "__module__": LowVramFp8Ops.__module__, "__qualname__": "LowVramFp8Ops.Linear"})
        _CONFIGURED[cfg] = type("LowVramFp8Ops", (LowVramFp8Ops,), {
            "fp8_config": cfg, "Linear": linear, "__module__": LowVramFp8Ops.__module__})
    return _CONFIGURED[cfg]


# Values a little past the range are normal: a small LoRA delta on the layer's largest weight (its code is 448 by
# construction of a per-tensor scale) lands just beyond it and loses that sliver to the clamp, as it always did.
# Only a peak past CLIP_WARN_FACTOR x the range warns (an extreme alpha or strength).
CLIP_WARN_FACTOR = 1.25
# At most one clipping warning per this many seconds: ComfyUI merges every patched layer of a model in one go at
# load, so the other layers of the same merge are not listed one by one.
CLIP_WARNING_QUIET_S = 30.0
_clip_warned_at = [-math.inf]


# Set within ``clip_checks_deferred``: where a merge keeps its clip checks' peaks instead of reading each
_deferred_peaks: contextvars.ContextVar[list | None] = contextvars.ContextVar("lowvram_dit_clip_peaks", default=None)


@contextlib.contextmanager
def clip_checks_deferred(peaks: list) -> Iterator[None]:
    """Within: each merged fp8 layer's clip check keeps its peak on the GPU in ``peaks`` instead of reading it (a
    GPU->CPU sync per layer, which a merge inside a forward cannot afford); ``warn_if_clipped_any`` reads them all at
    once. The count of clipped values is not kept (it would cost every layer two more passes)."""
    token = _deferred_peaks.set(peaks)
    try:
        yield
    finally:
        _deferred_peaks.reset(token)


def warn_if_clipped_any(peaks: list) -> None:
    """Read the peaks ``clip_checks_deferred`` kept (one sync) and warn for the worst layer, as a merge at load would;
    ``peaks`` is emptied."""
    if not peaks:
        return
    values = torch.stack([peak for peak, _ in peaks]).cpu()
    worst = int(values.argmax())
    shape = peaks[worst][1]
    peaks.clear()
    _report_clip(float(values[worst]), shape, None)


def _warn_if_clipped(peak: torch.Tensor, shape: tuple[int, ...], count: Callable[[], int]) -> None:
    """Warn when a patched weight, divided by the layer's own scale, goes far past fp8's range (it is clipped).

    Re-quantizing with the layer's scale keeps the merge exact for every LoRA that stays in range; one that does
    not (an extreme alpha or strength) is clipped to +-448 codes. ``peak`` (0-d, from the re-quantization) is the
    largest value past the range over 448, 0 where none is. Reading it costs one GPU->CPU sync per patched layer, at
    the LoRA merge (once per load), never per step (none within ``clip_checks_deferred``); ``count`` runs only for a
    layer that warns. NaN is not counted (the clamp keeps it NaN, and NaN Guard sees it at the next fp8 GEMM)."""
    deferred = _deferred_peaks.get()
    if deferred is not None:
        deferred.append((peak, shape))
        return
    _report_clip(float(peak), shape, count)


def _report_clip(peak: float, shape: tuple[int, ...], count: Callable[[], int] | None) -> None:
    """The clipping warning for a layer whose peak is ``peak`` x fp8's range (``count``: how many values are past it,
    where known), at most once per CLIP_WARNING_QUIET_S."""
    if not peak > CLIP_WARN_FACTOR:
        return
    now = time.monotonic()
    if now - _clip_warned_at[0] < CLIP_WARNING_QUIET_S:
        return
    _clip_warned_at[0] = now
    values = f"{count()} values" if count is not None else "values"
    log.warning("lowvram_dit: a LoRA pushes %s of an fp8 Linear %s up to %.3g times past its fp8 scale's range; they "
                "are clipped - check the LoRA's alpha/strength (other layers of this merge are not listed)",
                values, list(shape), peak)
