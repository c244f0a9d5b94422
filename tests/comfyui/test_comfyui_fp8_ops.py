"""host/fp8_ops.py inside ComfyUI: one module-level ``manual_cast`` subclass, configured per model by class
attributes, loads and runs block-wise fp8 weights with the block size it was given. Needs COMFYUI_PATH."""

from __future__ import annotations

import pytest
import torch
from comfy_server import comfyui_in_process_or_skip

pytestmark = pytest.mark.comfyui


def test_configured_ops_are_manual_cast_subclasses_that_read_their_config() -> None:
    comfyui_in_process_or_skip()
    import comfy.ops

    from comfyui_lowvram_dit.kernels import fp8
    from comfyui_lowvram_dit.host.fp8_ops import LowVramFp8Ops
    from comfyui_lowvram_dit.host.fp8_ops import Fp8OpsConfig, make_fp8_ops

    ops64, ops128 = make_fp8_ops(Fp8OpsConfig(block_size=64)), make_fp8_ops(Fp8OpsConfig(block_size=128))
    assert make_fp8_ops(Fp8OpsConfig(block_size=64)) is ops64 and ops64 is not ops128
    assert issubclass(ops64, LowVramFp8Ops) and issubclass(ops64, comfy.ops.manual_cast)
    assert issubclass(ops64.Linear, LowVramFp8Ops.Linear) and ops64.Linear.__qualname__ == "LowVramFp8Ops.Linear"
    assert ops64.fp8_config.block_size == ops64.Linear.fp8_config.block_size == 64
    assert ops64.Conv2d is comfy.ops.manual_cast.Conv2d  # every other op is manual_cast's

    g = torch.Generator().manual_seed(0)
    w = torch.randn(128, 192, generator=g)
    q, scale = fp8.quantize_blockwise(w, 64)
    layer = ops64.Linear(192, 128, bias=False, device="meta")
    layer.load_state_dict({"weight": q, "weight_scale": scale}, assign=True)
    assert layer.is_fp8 and tuple(layer.weight_scale.shape) == (2, 3)
    x = torch.randn(4, 192, generator=g, dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x.float(), fp8.dequantize(q, scale, 64, torch.float32))
    torch.testing.assert_close(layer(x).float(), ref, rtol=0.05, atol=0.05)
    with pytest.raises(ValueError, match="weight_scale has shape"):  # the other config expects 128-wide blocks
        ops128.Linear(192, 128, bias=False, device="meta").load_state_dict({"weight": q, "weight_scale": scale},
                                                                           assign=True)
