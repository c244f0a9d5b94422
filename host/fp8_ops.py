"""ComfyUI ``custom_operations`` whose Linear runs fp8 weights (per-tensor or block-wise) through kernels.fp8.

The model is built by ComfyUI itself (``comfy.sd.load_diffusion_model_state_dict(sd, {"custom_operations":
make_fp8_ops(cfg), ...})``), so it stays a native MODEL. The class is host/fp8_layers.py's module-level
``LowVramFp8Ops`` (a ``comfy.ops.manual_cast`` subclass); ``make_fp8_ops`` returns its subclass with the
config as class attributes. Every op except Linear is ``manual_cast``'s.
The Linear keeps the CastWeightBiasOp contract:
- resident, no LoRA functions: ``kernels.fp8.fp8_linear`` on the fp8 weight (fp8 matmul where the GPU has it);
- lowvram-offloaded: the fp8 weight + its scale are copied on ComfyUI's offload stream (``uncast_bias_weight``
  afterwards), then the same fp8 matmul, so streamed layers keep fp8 compute (native dequantizes them);
- ``weight_function`` LoRA patches (lowvram): dequantize, apply the patches, bf16/fp16 matmul;
- merged LoRA (resident): ``convert_weight`` dequantizes, ComfyUI adds the LoRA, ``set_weight`` re-quantizes
  with the layer's existing scale. The scale is never changed by patching, because ModelPatcher backs up and
  restores only ``<layer>.weight``; a new scale would survive unpatching and corrupt the restored weight.
Weights are plain tensors (float8 ``weight``, fp32 ``weight_scale``), so block swap moves them like any other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import fp8 as fp8_math

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Keys ComfyUI / musubi files carry next to a weight; accepted here too, in case a state dict was not
# converted by kernels.wan_checkpoint first (passing custom_operations disables convert_old_quants).
IGNORED_KEYS = ("comfy_quant", "input_scale", "scale_input", "scale_weight_tensor")


@dataclass(frozen=True)
class Fp8OpsConfig:
    """How the fp8 Linear layers of one model compute."""

    block_size: int = 128  # for block-wise weight scales (2-D weight_scale); per-tensor scales are 0-d
    compute: fp8_math.Fp8Compute = "auto"  # "auto" | "fp8" (fp8 matmul or error) | "dequantize"


_CONFIGURED: dict[Fp8OpsConfig, type] = {}


def make_fp8_ops(config: Fp8OpsConfig | None = None) -> type:
    """The ``custom_operations`` class for ``config``: ``LowVramFp8Ops`` with the config as class attributes
    (one class per config, so models loaded with the same settings share it)."""
    from .fp8_layers import LowVramFp8Ops

    cfg = config or Fp8OpsConfig()
    if cfg not in _CONFIGURED:
        linear = type("Linear", (LowVramFp8Ops.Linear,), {
            "fp8_config": cfg, "__module__": LowVramFp8Ops.__module__, "__qualname__": "LowVramFp8Ops.Linear"})
        _CONFIGURED[cfg] = type("LowVramFp8Ops", (LowVramFp8Ops,), {
            "fp8_config": cfg, "Linear": linear, "__module__": LowVramFp8Ops.__module__})
    return _CONFIGURED[cfg]
