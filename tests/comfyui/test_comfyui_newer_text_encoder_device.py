"""Newer ComfyUI sends text encoders to the GPU by default under DynamicVRAM; the pack's staged text encoders
name the CPU as their load device, which ComfyUI's CLIP honours over its default, so they stay a plain CPU
patcher and encode the same. The newer default is re-created by pointing ``text_encoder_device`` at a GPU (never
used: nothing may load there). Needs COMFYUI_PATH."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from comfy_server import comfyui_in_process_or_skip

pytestmark = pytest.mark.comfyui


def _encode(te: Path) -> tuple[object, list]:
    from comfyui_lowvram_dit.host import wan_text

    with torch.inference_mode():
        clip = wan_text.build_umt5_streaming(te)
        return clip, [clip.encode_from_tokens_scheduled(clip.tokenize(p)) for p in ("a fox in the snow", "")]


def test_staged_text_encoder_stays_on_the_cpu_when_the_default_is_the_gpu(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    comfyui_in_process_or_skip()
    import comfy.model_management as mm

    from comfyui_lowvram_dit.synthetic import checkpoints as synth
    from comfyui_lowvram_dit.synthetic.specs import UMT5Config

    te = synth.write_synthetic("umt5_xxl_enc", tmp_path / "umt5.safetensors", fmt="bf16", seed=3,
                               config=UMT5Config(num_layers=2, d_ff=64, num_heads=2, vocab_size=512))
    _, ref = _encode(te)
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(mm, "text_encoder_device", lambda *a, **k: gpu)
    monkeypatch.setattr(mm, "text_encoder_initial_device", lambda *a, **k: gpu)
    clip, out = _encode(te)
    assert clip.patcher.load_device == torch.device("cpu")
    assert not (callable(getattr(clip.patcher, "is_dynamic", None)) and clip.patcher.is_dynamic())
    for (c_ref, d_ref), (c_out, d_out) in zip((r[0] for r in ref), (o[0] for o in out)):
        assert torch.equal(c_ref, c_out) and d_ref.keys() == d_out.keys()
