"""checkpoints.fp8_state.pop_fp8_layer: one Linear's fp8 tensors from a state dict in any file convention, in the
form the fp8 ops hold (float8_e4m3fn + fp32 scale, 0-d or the block grid). Plain torch, CPU."""

from __future__ import annotations

import json

import pytest
import torch

from comfyui_lowvram_dit.checkpoints.fp8_state import pop_fp8_layer
from comfyui_lowvram_dit.kernels import fp8 as fp8_math

P = "blocks.0.ffn.0."


def _weight(seed: int = 0) -> torch.Tensor:
    return torch.randn(64, 96, generator=torch.Generator().manual_seed(seed))


def _quant(fmt: str) -> torch.Tensor:
    return torch.tensor(list(json.dumps({"format": fmt}).encode()), dtype=torch.uint8)


@pytest.mark.parametrize("scale_key", ["weight_scale", "scale_weight"])  # ComfyUI v0.8 / ComfyUI's legacy name
def test_per_tensor_names_give_one_form_and_drop_the_file_only_keys(scale_key: str) -> None:
    q, s = fp8_math.quantize_per_tensor(_weight())
    sd = {P + "weight": q, P + scale_key: s.reshape(1), P + "comfy_quant": _quant("float8_e4m3fn"),
          P + "input_scale": torch.ones(()), P + "bias": torch.zeros(64), "other.weight": torch.ones(2)}
    w, scale = pop_fp8_layer(sd, P, 128)
    assert w is q and scale.shape == () and scale.dtype == torch.float32 and float(scale) == float(s)
    assert set(sd) == {P + "bias", "other.weight"}


def test_e5m2_is_requantized_to_e4m3fn_and_a_missing_scale_is_one() -> None:
    w0 = _weight(1)
    sd = {P + "weight": w0.to(torch.float8_e5m2)}
    w, scale = pop_fp8_layer(sd, P, 128)
    assert w.dtype == torch.float8_e4m3fn and scale.shape == ()
    back = w.float() * scale
    assert ((back - w0).norm() / w0.norm()) < 0.08  # e5m2's own rounding (2 mantissa bits) dominates


def test_block_scales_keep_their_grid_and_a_wrong_grid_is_named() -> None:
    q, s = fp8_math.quantize_blockwise(_weight(2), 32)
    w, scale = pop_fp8_layer({P + "weight": q, P + "weight_scale": s}, P, 32)
    assert w is q and torch.equal(scale, s.float())
    with pytest.raises(ValueError, match=r"blocks\.0\.ffn\.0\.weight_scale has shape \[2, 3\].*block size 128"):
        pop_fp8_layer({P + "weight": q, P + "weight_scale": s}, P, 128)


def test_other_quant_formats_are_refused_by_layer_and_plain_weights_pass() -> None:
    with pytest.raises(ValueError, match=r"blocks\.0\.ffn\.0: ComfyUI quant format 'nvfp4'.*UNETLoader"):
        pop_fp8_layer({P + "weight": torch.zeros(4, 4, dtype=torch.uint8), P + "comfy_quant": _quant("nvfp4")},
                      P, 128)
    plain = {P + "weight": _weight(), P + "scale_input": torch.ones(())}
    assert pop_fp8_layer(plain, P, 128) is None and set(plain) == {P + "weight"}
