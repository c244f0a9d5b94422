"""host/block_graphs.py inside ComfyUI (CPU): the reasons a model call runs its blocks eagerly, the graphs installed
beside the other hooks, and dropped only when the weights leave the GPU. The graphs themselves:
tests/unit/test_block_graphs.py (CPU stand-in) and tests/comfyui/test_block_graphs_cuda.py (GPU). Needs COMFYUI_PATH."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from comfy_server import comfyui_in_process_or_skip

pytestmark = pytest.mark.comfyui


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny Qwen-Image through the loaders' own path (fp8, Block Swap, block graphs)."""
    comfyui_in_process_or_skip()
    from comfyui_lowvram_dit.host.qwen_stages import load_staged_model
    from comfyui_lowvram_dit.synthetic.checkpoints import write_synthetic

    path = tmp_path_factory.mktemp("graphs") / "qwen.safetensors"
    write_synthetic("qwen_image", path, size="tiny", fmt="bf16", seed=1, num_layers=2)
    return load_staged_model(path, "per_tensor")[0]


def _reason(model: Any, **changes: Any) -> str | None:
    from comfyui_lowvram_dit.host.block_graphs import why_eager
    from comfyui_lowvram_dit.host.hooks import hook_registry

    options = dict(model.model_options["transformer_options"])
    options.update(changes.pop("options", {}))
    kwargs = {"transformer_options": options, **changes}
    return why_eager(model.model, hook_registry(model), ((torch.zeros(1),), kwargs))


def test_why_eager_names_each_reason_and_none_for_a_plain_call(qwen: Any) -> None:
    from comfyui_lowvram_dit.host.attention import apply_attention

    model = apply_attention(qwen, "auto")
    assert _reason(model) is None
    assert _reason(model, control={"input": []}) == "a ControlNet is attached"
    assert _reason(model, attention_mask=torch.ones(1, 4)) == "the text has an attention mask"
    assert "another node's patches (attn1_patch)" == _reason(model, options={"patches": {"attn1_patch": [print]}})
    foreign = {"patches_replace": {"dit": {("double_block", 0): print}}}
    assert "another node's replace patches" in _reason(model, options=foreign)
    assert _reason(model, options={"optimized_attention_override": print}) == "another node's attention override"


def test_comfyui_flag_and_torch_compile_leave_blocks_eager(qwen: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from comfy.cli_args import args

    from comfyui_lowvram_dit.host.hooks import register_hook
    from comfyui_lowvram_dit.host.torch_compile import COMPILE_KEY
    from comfyui_lowvram_dit.kernels.hooks import ModelHook

    model = qwen
    monkeypatch.setattr(args, "disable_cuda_graphs", True, raising=False)
    assert _reason(model) == "ComfyUI runs with --disable-cuda-graphs"
    monkeypatch.setattr(args, "disable_cuda_graphs", False, raising=False)
    compiled = model.clone()
    register_hook(compiled, COMPILE_KEY, ModelHook())
    assert _reason(compiled) == "Torch Compile is on this model"


def test_graphs_are_dropped_only_when_the_weights_leave(qwen: Any) -> None:
    import comfy.patcher_extension as pe

    from comfyui_lowvram_dit.host.block_graphs import block_graphs_of

    model = qwen.clone()
    graphs = block_graphs_of(model)
    assert graphs is not None
    graphs._devices[torch.device("cpu")] = "kept"  # what a capture leaves behind
    for callback in model.get_all_callbacks(pe.CallbacksMP.ON_DETACH):
        callback(model, False)  # ComfyUI hands the loaded weights to the next sampling run
    assert graphs._devices
    model.detach(unpatch_all=True)  # unloaded: the weights leave the GPU
    assert not graphs._devices


def test_the_qwen_image_loader_installs_the_graphs(qwen: Any) -> None:
    from comfyui_lowvram_dit.host.block_graphs import block_graphs_of

    assert block_graphs_of(qwen) is not None
