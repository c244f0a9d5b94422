"""Wan Text Encode (LowVRAM) in process against stock ComfyUI v0.8.0: bit-equal CONDITIONING.

Stock = ``comfy.sd.load_clip(clip_type=WAN)`` (what CLIPLoader(type=wan) calls) + ``encode_from_tokens_scheduled``
(what CLIPTextEncode calls), on the CPU. Two files:
- 24 layers (the real count: ComfyUI's T5_XXL detection keys on block 23) but narrow (d_ff 64, 2 heads, vocab 512):
  stock load_clip itself, given the same ``umt5xxl_model_config`` override our loader reads from the file;
- 2 layers at the real widths (d_model 4096, d_ff 10240, 64 x 64 heads, vocab 256384): stock's WAN branch of
  ``load_text_encoder_state_dicts`` built the same way ComfyUI does (its detection needs block 23, so the branch
  is selected by hand), loading the whole state dict with ComfyUI's ``load_sd``.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
from comfy_server import comfyui_path_or_reason, import_comfyui_in_process

from comfyui_lowvram_dit.kernels import synth
from comfyui_lowvram_dit.kernels.model_specs import UMT5Config

pytestmark = pytest.mark.comfyui
PROMPTS = ["a red fox runs through fresh snow, golden hour", ""]


@pytest.fixture(scope="module")
def comfy() -> types.ModuleType:
    """ComfyUI imported in this process (CPU)."""
    path, reason = comfyui_path_or_reason()
    if path is None:
        pytest.skip(reason)
    import_comfyui_in_process(path)
    import comfy.sd

    return comfy


def _ours(te: Path) -> list[list]:
    import torch

    from comfyui_lowvram_dit.nodes import wan_text

    with torch.inference_mode():
        clip = wan_text.build_umt5_streaming(te)
        return [clip.encode_from_tokens_scheduled(clip.tokenize(p)) for p in PROMPTS]


def _assert_same(ours: list[list], stock: list[list]) -> None:
    import torch

    for a, b in zip(ours, stock, strict=True):
        assert len(a) == len(b) == 1
        assert a[0][0].shape == b[0][0].shape and a[0][0].shape[-1] == 4096, (a[0][0].shape, b[0][0].shape)
        assert a[0][0].dtype == b[0][0].dtype and torch.equal(a[0][0], b[0][0])
        assert a[0][1].keys() == b[0][1].keys()
        assert bool(a[0][0].abs().sum() > 0)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_scaled"])
def test_narrow_24_layers_equals_stock_load_clip(comfy: types.ModuleType, tmp_path: Path, fmt: str) -> None:
    """24 narrow layers: ours == comfy.sd.load_clip(WAN) + encode, bit for bit (bf16 and legacy fp8_scaled)."""
    import torch

    from comfyui_lowvram_dit.kernels import staged

    cfg = UMT5Config(num_layers=24, d_ff=64, num_heads=2, vocab_size=512)
    te = synth.write_synthetic("umt5_xxl_enc", tmp_path / f"umt5_{fmt}.safetensors", fmt=fmt, seed=5, config=cfg)
    ours = _ours(te)
    read = staged.umt5_config_from_header(staged.read_header(te))
    assert read == {"num_layers": 24, "d_model": 4096, "d_ff": 64, "num_heads": 2, "d_kv": 64, "vocab_size": 512}
    cpu = torch.device("cpu")
    with torch.inference_mode():
        clip = comfy.sd.load_clip([str(te)], clip_type=comfy.sd.CLIPType.WAN, model_options={
            "load_device": cpu, "offload_device": cpu, "umt5xxl_model_config": read})
        stock = [clip.encode_from_tokens_scheduled(clip.tokenize(p)) for p in PROMPTS]
    _assert_same(ours, stock)


@pytest.mark.slow
def test_full_width_2_layers_equals_stock_wan_branch(comfy: types.ModuleType, tmp_path: Path) -> None:
    """2 layers at umT5-XXL's real widths (2.9 GB fp16): ours == ComfyUI's WAN CLIP built from the full state dict."""
    import comfy.text_encoders.sd3_clip as sd3_clip
    import comfy.text_encoders.wan as wan
    import comfy.utils
    import torch

    te = synth.write_synthetic("umt5_xxl_enc", tmp_path / "umt5_2l_fp16.safetensors", fmt="fp16", seed=6,
                               config=UMT5Config(num_layers=2))
    ours = _ours(te)
    sd = comfy.utils.load_torch_file(str(te), safe_load=True)
    cpu = torch.device("cpu")
    # comfy.sd.load_text_encoder_state_dicts, CLIPType.WAN / TEModel.T5_XXL branch, verbatim but for detection.
    target = types.SimpleNamespace(params={}, clip=wan.te(**sd3_clip.t5_xxl_detect(sd)), tokenizer=wan.WanT5Tokenizer)
    with torch.inference_mode():
        clip = comfy.sd.CLIP(target, tokenizer_data={"spiece_model": sd.get("spiece_model")}, state_dict=[sd],
                             model_options={"load_device": cpu, "offload_device": cpu,
                                            "umt5xxl_model_config": {"num_layers": 2}})
        del sd
        stock = [clip.encode_from_tokens_scheduled(clip.tokenize(p)) for p in PROMPTS]
    _assert_same(ours, stock)
