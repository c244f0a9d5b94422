"""host/block_graphs.py inside ComfyUI (CPU): the reasons a model call runs its blocks eagerly, the graphs installed
beside the other hooks, and dropped only when the weights leave the GPU. The graphs themselves:
tests/unit/test_block_graphs.py (CPU stand-in) and tests/comfyui/test_block_graphs_cuda.py (GPU). Needs COMFYUI_PATH."""

from __future__ import annotations

from pathlib import Path
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


class _Memory:
    """ComfyUI's free-memory reading, which an emptied cache raises by what the dropped graphs held."""

    def __init__(self, free: int, graphs_hold: int) -> None:
        self.free, self.graphs_hold, self.emptied = free, graphs_hold, 0

    def get_free_memory(self, dev: Any = None, torch_free_too: bool = False) -> int:
        return self.free

    def soft_empty_cache(self, *args: Any, **kwargs: Any) -> None:
        self.emptied += 1
        self.free += self.graphs_hold
        self.graphs_hold = 0


def _holding(model: Any, monkeypatch: pytest.MonkeyPatch, free: int, graphs_hold: int) -> tuple[Any, _Memory]:
    """``model``'s graphs as a capture on the CPU leaves them, and a free-memory reading that their release raises."""
    import comfy.model_management as mm

    from comfyui_lowvram_dit.host.block_graphs import block_graphs_of

    graphs = block_graphs_of(model)
    graphs.drop()
    graphs._devices[torch.device("cpu")] = "kept"
    memory = _Memory(free, graphs_hold)
    monkeypatch.setattr(mm, "get_free_memory", memory.get_free_memory)
    monkeypatch.setattr(mm, "soft_empty_cache", memory.soft_empty_cache)
    return graphs, memory


def test_graphs_give_their_memory_back_and_the_model_runs_eagerly(qwen: Any, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    import comfy.model_management as mm

    from comfyui_lowvram_dit.host.block_graphs import release_block_graphs

    graphs, memory = _holding(qwen, monkeypatch, 2**30, 2**28)
    assert release_block_graphs(torch.device("cuda", 0), [qwen]) == 0 and graphs._devices  # other device's
    assert memory.emptied == 0
    loaded = type("Loaded", (), {"model": qwen})()  # what mm.current_loaded_models holds
    monkeypatch.setattr(mm, "current_loaded_models", [type("Dead", (), {"model": None})(), loaded])
    with caplog.at_level("INFO", logger="comfyui_lowvram_dit"):
        assert release_block_graphs(torch.device("cpu")) == 2**28
    assert not graphs._devices and graphs.given_back and memory.emptied == 1
    assert "gave back 0.25 GiB on cpu" in caplog.text
    assert release_block_graphs(torch.device("cpu")) == 0 and memory.emptied == 1  # nothing held: no cache emptied
    qwen.detach(unpatch_all=True)  # the weights left: a later load captures again
    assert not graphs.given_back


@pytest.mark.parametrize("graphs_hold, weights_moved", [(2**28, 0), (2**26, 2**28 - 2**26)])
def test_a_partial_unload_takes_the_graphs_memory_before_any_weight(
        graphs_hold: int, weights_moved: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ComfyUI makes room beside a loaded model with ``partially_unload(memory_to_free)``: Block Swap's gives the
    block graphs' memory first and moves weights (parked for the next load) only for the rest."""
    import comfy.model_patcher

    from comfyui_lowvram_dit.host.qwen_stages import load_staged_model
    from comfyui_lowvram_dit.synthetic.checkpoints import write_synthetic

    path = write_synthetic("qwen_image", tmp_path / "qwen.safetensors", size="tiny", fmt="bf16", seed=1, num_layers=2)
    swapped = load_staged_model(path, "per_tensor", blocks_to_swap=1)[0]
    asked: list[int] = []
    monkeypatch.setattr(comfy.model_patcher.ModelPatcher, "partially_unload",
                        lambda self, device_to, memory_to_free=0, force_patch_weights=False: asked.append(
                            memory_to_free) or memory_to_free)
    graphs, _ = _holding(swapped, monkeypatch, 0, graphs_hold)
    assert swapped.partially_unload(swapped.offload_device, 2**28) == 2**28
    assert asked == ([weights_moved] if weights_moved else []) and graphs.given_back


def test_the_qwen_image_loader_installs_the_graphs(qwen: Any) -> None:
    from comfyui_lowvram_dit.host.block_graphs import block_graphs_of

    assert block_graphs_of(qwen) is not None
