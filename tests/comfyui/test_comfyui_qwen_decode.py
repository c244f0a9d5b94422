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


@pytest.mark.parametrize("free_gib, budget_gib, expected", [
    (40.0, 0.0, (True, None)),  # the whole decode fits beside the loaded models: nothing is freed
    (4.8, 0.0, (True, 512)),  # a 24 GB card with the transformer loaded: tiles of the node's size fit beside it
    (1.0, 0.0, (False, None)),  # not even the node's tiles fit: free what a whole decode needs, as before
    (40.0, 1.0, (False, None)),  # the node's VRAM budget (1 GiB < a tile + the VAE) forbids it whatever is free
])
def test_decode_beside_the_loaded_models(free_gib: float, budget_gib: float, expected: tuple,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen-Image at 1328x1328: ComfyUI's Wan-VAE estimate of a whole decode is ~7.2 GiB (2200 x 166 x 166 x 64 x 2
    bytes), a 512 px tile's share ~1.1 GiB. The decode runs beside the loaded models (so the transformer is not
    reloaded by the next render) exactly when ComfyUI's own VAE load would free nothing: VAE x 1.1 + max(inference
    reserve, estimate + extra reserve) within what is free."""
    comfyui_in_process_or_skip()
    import comfy.model_management as mm
    from comfyui_lowvram_dit.host.qwen_stages import decode_beside_models

    gib = 2**30
    monkeypatch.setattr(mm, "EXTRA_RESERVED_VRAM", int(0.5 * gib))
    need, vae = 7.2 * gib, 0.25 * gib
    budget = budget_gib * gib if budget_gib else float("inf")
    assert decode_beside_models(need, vae, free_gib * gib, 1328, 1328, 512, budget) == expected
    tile_share = need * 512 * 512 / (1328 * 1328)
    edge = vae * 1.1 + max(mm.minimum_inference_memory(), tile_share + mm.extra_reserved_memory())
    assert decode_beside_models(need, vae, edge, 1328, 1328, 512) == (True, 512)  # the boundary is ComfyUI's
    assert decode_beside_models(need, vae, edge - 1, 1328, 1328, 512) == (False, None)


@pytest.mark.parametrize("given_gib, unloads", [(0.5, False), (0.1, True)])
def test_block_graphs_give_their_memory_back_before_the_transformer_is_unloaded(
        given_gib: float, unloads: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """An 8 GB card: the 512 px tiles fit beside the loaded transformer only without its block graphs' memory. The
    graphs give it back (the transformer then runs eagerly, still loaded); when that is not enough, the decode frees
    memory as before."""
    comfyui_in_process_or_skip()
    import comfy.model_management as mm
    import torch
    from comfyui_lowvram_dit.host import qwen_stages

    gib = 2**30
    free = {"now": 1.2 * gib}
    released: list = []

    def release(device: Any) -> int:
        released.append(device)
        free["now"] += given_gib * gib
        return int(given_gib * gib)

    freed: list = []
    monkeypatch.setattr(mm, "EXTRA_RESERVED_VRAM", int(0.5 * gib))
    monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False: free["now"])
    monkeypatch.setattr(mm, "free_memory", lambda required, device, keep_loaded=(), **kw: freed.append(required))
    monkeypatch.setattr(mm, "soft_empty_cache", lambda *a, **k: None)
    monkeypatch.setattr(qwen_stages, "release_block_graphs", release)
    vae = StandInVae()
    vae.device = torch.device("cuda", 0)  # decode_staged reads the device; the stand-in decodes on the CPU anyway
    vae.memory_used_decode = lambda shape, dtype: 7.2 * gib  # ComfyUI's estimate of a whole 1328x1328 decode
    vae.decode_tiled = lambda latent, **kw: torch.zeros(1, 1328, 1328, 3)
    monkeypatch.setattr(mm, "get_torch_device", lambda: torch.device("cuda", 0))
    _, report = qwen_stages.decode_staged(torch.zeros(1, 16, 1, 166, 166), vae)
    assert released == [torch.device("cuda", 0)]
    assert bool(freed) == unloads
    assert any(f"block graphs gave back {given_gib:.2f} GiB" in n for n in report.notes), report.notes
    assert any(("beside the loaded models" in n) != unloads for n in report.notes if n.startswith("tiled")), report.notes
