"""Newer ComfyUI's fp16-accumulation branch of ``comfy.ops.linear_input_act`` (Wan's FFN down-projection) must
give the pack's fp8 Linear the same output as without it: the layer opts out through ``_full_precision_mm``,
which that branch honours. Re-created on the ComfyUI under test (tests/newer_comfyui.py). Needs COMFYUI_PATH."""

from __future__ import annotations

import pytest
import torch
from comfy_server import comfyui_in_process_or_skip

pytestmark = pytest.mark.comfyui


def _fp8_ffn(block_size: int | None) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Up and down projections of a tiny Wan FFN built with the pack's fp8 ops (scales far from 1)."""
    from comfyui_lowvram_dit.kernels import fp8
    from comfyui_lowvram_dit.host.fp8_ops import Fp8OpsConfig, make_fp8_ops

    ops = make_fp8_ops(Fp8OpsConfig(block_size=block_size or 64))
    g = torch.Generator().manual_seed(0)
    layers = []
    for n, k in ((128, 64), (64, 128)):
        w = torch.randn(n, k, generator=g) * 0.01
        q, s = fp8.quantize_blockwise(w, block_size) if block_size else fp8.quantize_per_tensor(w)
        layer = ops.Linear(k, n, bias=True, device="meta")
        layer.load_state_dict({"weight": q, "weight_scale": s, "bias": torch.randn(n, generator=g) * 0.1},
                              assign=True)
        layers.append(layer)
    return layers[0], layers[1]


@pytest.mark.parametrize("block_size", [None, 64], ids=["per-tensor", "block-wise"])
def test_fp8_linear_output_is_the_same_under_the_fp16_accumulation_branch(block_size: int | None) -> None:
    comfyui_in_process_or_skip()
    from newer_comfyui import fp16_accumulation_linear_input_act

    up, down = _fp8_ffn(block_size)
    assert down.is_fp8 and float(down.weight_scale.max()) < 0.01  # raw fp8 codes would be far off
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1), dtype=torch.bfloat16)
    h = up(x)
    without = down(torch.nn.functional.gelu(h, approximate="tanh"))
    with_branch = fp16_accumulation_linear_input_act(down, h, "gelu_tanh")
    torch.testing.assert_close(with_branch, without, rtol=0, atol=0)


def test_high_precision_layers_keep_the_fp16_accumulation_branch() -> None:
    """Only fp8 weights opt out: a pack Linear holding a bf16 weight and a stock layer take the user's fp16 GEMM."""
    comfyui_in_process_or_skip()
    import comfy.ops

    from comfyui_lowvram_dit.host.fp8_ops import Fp8OpsConfig, make_fp8_ops

    pack = make_fp8_ops(Fp8OpsConfig(block_size=64)).Linear(8, 4, bias=False, device="meta")
    pack.load_state_dict({"weight": torch.randn(4, 8, dtype=torch.bfloat16)}, assign=True)
    stock = comfy.ops.manual_cast.Linear(8, 4, bias=False)
    assert not pack.is_fp8
    assert not getattr(pack, "_full_precision_mm", False) and not getattr(stock, "_full_precision_mm", False)


def test_wan_ffn_matches_with_the_newer_linear_input_act(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the host's own Wan FFN module (hosts whose Wan FFN calls comfy.ops.linear_input_act)."""
    comfyui_in_process_or_skip()
    import comfy.ldm.wan.model as wan
    import comfy.ops

    if not hasattr(wan, "WanFeedForward") or not hasattr(comfy.ops, "linear_input_act"):
        pytest.skip("this ComfyUI's Wan FFN is a plain Sequential (no linear_input_act to change)")
    from newer_comfyui import fp16_accumulation_linear_input_act

    up, down = _fp8_ffn(None)
    ffn = wan.WanFeedForward(up, torch.nn.GELU(approximate="tanh"), down)
    x = torch.randn(1, 7, 64, generator=torch.Generator().manual_seed(2), dtype=torch.bfloat16)
    expected = ffn(x)
    monkeypatch.setattr(comfy.ops, "linear_input_act", fp16_accumulation_linear_input_act)
    torch.testing.assert_close(ffn(x), expected, rtol=0, atol=0)
