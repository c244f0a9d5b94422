"""The pack's block chain (Block Swap, NaN Guard, Torch Compile) and its attention override run outside newer
ComfyUI's allocation-graph recording (``comfy.model_prefetch.pause_malloc_graph``, the Comfy Compiler): what they
keep across steps must not be planned as per-step memory. Re-created on the ComfyUI under test with a fake
recorder (tests/newer_comfyui.py); hosts without it get a no-op. Needs COMFYUI_PATH."""

from __future__ import annotations

import sys

import pytest
import torch
from comfy_server import comfyui_in_process_or_skip, sample_wan

pytestmark = pytest.mark.comfyui


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201 - FakeMallocGraph
    comfyui_in_process_or_skip()
    pytest.importorskip("comfy.model_prefetch", reason="this ComfyUI has no comfy.model_prefetch (nothing records)")
    from newer_comfyui import FakeMallocGraph

    fake = FakeMallocGraph()
    monkeypatch.setattr(sys.modules["comfy.model_prefetch"], "pause_malloc_graph", fake.pause, raising=False)
    return fake


def _tiny_wan():  # noqa: ANN202 - ModelPatcher
    import comfy.sd

    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    sd = synth.synthetic_state_dict("wan21_t2v_1_3B", size="tiny", fmt="bf16", seed=0, num_layers=2)
    return comfy.sd.load_diffusion_model_state_dict(sd, {"dtype": torch.bfloat16})


def test_hooked_blocks_run_outside_the_recording(recorder) -> None:  # noqa: ANN001
    from comfyui_lowvram_dit.kernels.hooks import ModelHook
    from comfyui_lowvram_dit.host.hooks import register_hook

    seen: list[bool] = []

    class Probe(ModelHook):
        PER_BLOCK = True

        def pre_block(self, index: int, inputs: object) -> None:
            seen.append(recorder.paused > 0)

    model = _tiny_wan().clone()
    register_hook(model, "probe", Probe())
    sample_wan(model, steps=1)
    assert seen and all(seen)
    assert recorder.paused == 0


def test_attention_override_runs_outside_the_recording(recorder, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    from comfyui_lowvram_dit.kernels import opaque_ops
    from comfyui_lowvram_dit.host.attention import apply_attention

    seen: list[bool] = []
    real = opaque_ops.selected_attention

    def probe(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append(recorder.paused > 0)
        return real(*args, **kwargs)

    monkeypatch.setattr(opaque_ops, "selected_attention", probe)
    plain = _tiny_wan()
    ref = sample_wan(apply_attention(plain, "SDPA math"), steps=1)
    assert seen and all(seen)
    monkeypatch.delattr(sys.modules["comfy.model_prefetch"], "pause_malloc_graph")  # a host without it
    assert torch.equal(sample_wan(apply_attention(plain, "SDPA math"), steps=1), ref)
