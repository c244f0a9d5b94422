"""Qwen-Image Decode frees what a whole decode needs, as ComfyUI's VAE Decode does, not every model: a transformer
that fits beside the decode stays loaded, so the next render does not load it again (measured on an H200: a warm
Qwen-Image 4-step render spent 6.6 s of 8.7 loading the 20 GB transformer that the decode had unloaded)."""

from __future__ import annotations

from typing import Any

import pytest
from comfy_server import comfyui_in_process_or_skip

pytestmark = pytest.mark.comfyui
NEED = 3 * 2**30  # the stand-in VAE's decode estimate


class StandInVae:
    """What decode_staged reads of a ComfyUI VAE: its device, size, memory estimate, compression and decode."""

    def __init__(self) -> None:
        import torch

        self.device = torch.device("cpu")
        self.vae_dtype = torch.float32
        self.first_stage_model = torch.nn.Linear(64, 64)
        self.patcher = object()
        self.decoded: list[tuple] = []

    def memory_used_decode(self, shape: Any, dtype: Any) -> float:
        return NEED

    def spacial_compression_decode(self) -> int:
        return 8

    def temporal_compression_decode(self) -> None:
        return None

    def decode(self, latent: Any) -> Any:
        import torch

        self.decoded.append(tuple(latent.shape))
        return torch.zeros(1, latent.shape[-2] * 8, latent.shape[-1] * 8, 3)


def test_decode_frees_what_it_needs_not_every_model(monkeypatch: pytest.MonkeyPatch) -> None:
    comfyui_in_process_or_skip()
    import comfy.model_management as mm
    import torch
    from comfyui_lowvram_dit.host.qwen_stages import decode_staged

    freed: list[tuple] = []
    monkeypatch.setattr(mm, "free_memory", lambda required, device, keep_loaded=(), **kw: freed.append(
        (required, device, list(keep_loaded))))
    vae = StandInVae()
    images, report = decode_staged(torch.zeros(1, 16, 1, 8, 8), vae)
    vae_bytes = mm.module_size(vae.first_stage_model)
    assert freed == [(NEED + vae_bytes + mm.minimum_inference_memory(), vae.device, [vae.patcher])]
    assert vae.decoded == [(1, 16, 1, 8, 8)] and images.shape == (1, 64, 64, 3)
    assert any("full decode" in n for n in report.notes), report.notes
