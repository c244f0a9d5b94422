"""host/hooks.py inside ComfyUI: one registry per MODEL (one APPLY_MODEL wrapper, one replace patch per
block), Block Swap + NaN Guard + Torch Compile share it, another pack's block patch keeps running inside it, and
removing the hooks restores the MODEL's patches. Needs COMFYUI_PATH."""

from __future__ import annotations

import functools

import pytest
import torch
from comfy_server import comfyui_in_process_or_skip, sample_wan

pytestmark = pytest.mark.comfyui

_sample = functools.partial(sample_wan, cfg=2.0, steps=1, frames=1)


def _tiny_wan():  # noqa: ANN202
    comfyui_in_process_or_skip()
    import comfy.sd

    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    sd = synth.synthetic_state_dict("wan21_t2v_1_3B", size="tiny", fmt="bf16", seed=4, num_layers=4)
    return comfy.sd.load_diffusion_model_state_dict(sd, {"dtype": torch.bfloat16})


class ForeignPatch:
    """A replace patch another pack put on block 1 before ours: counts its calls and runs the block."""

    def __init__(self) -> None:
        self.calls = 0

    def __deepcopy__(self, memo: dict) -> ForeignPatch:
        return self  # clones deep-copy model options: keep one counter

    def __call__(self, args: dict, extra: dict) -> dict:
        self.calls += 1
        return extra["original_block"](args)


def _replace(patcher) -> dict:  # noqa: ANN001
    return patcher.model_options["transformer_options"].get("patches_replace", {}).get("dit", {})


def test_three_capabilities_share_one_chain_and_removing_restores_the_model() -> None:
    plain = _tiny_wan()
    import comfy.model_management as mm
    from comfy.patcher_extension import WrappersMP

    from comfyui_lowvram_dit.kernels.compile import CompileConfig
    from comfyui_lowvram_dit.offload.plan import SwapConfig
    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY, apply_block_swap
    from comfyui_lowvram_dit.host.torch_compile import COMPILE_KEY, apply_compile
    from comfyui_lowvram_dit.host.hooks import HOOKS_KEY, hook_registry, remove_hook
    from comfyui_lowvram_dit.host.nan_guard import GUARD_KEY, apply_nan_guard

    ref = _sample(plain)
    foreign = ForeignPatch()
    base = plain.clone()
    base.set_model_patch_replace(foreign, "dit", "double_block", 1)
    guarded = apply_nan_guard(base, "raise")
    swapped = apply_block_swap(guarded, SwapConfig(blocks_to_swap=2, prefetch=1))
    model = apply_compile(swapped, CompileConfig(), compile_fn=lambda module, **kw: module)
    # one chain, compile outermost (its retries re-run the others), the streamer innermost
    assert hook_registry(model).names() == [COMPILE_KEY, GUARD_KEY, SWAP_KEY]
    assert len(model.get_wrappers(WrappersMP.APPLY_MODEL, HOOKS_KEY)) == 1
    assert hook_registry(guarded).names() == [GUARD_KEY]  # the earlier MODEL keeps what it had
    assert hook_registry(plain).names() == [] and _replace(plain) == {}
    out = _sample(model)  # compile runs cond and uncond one at a time, the plain model as a batch of 2:
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) <= 1e-5  # CPU GEMM rounding only
    assert foreign.calls > 0 and model.attachments[SWAP_KEY].streamer.stats.loads > 0
    assert model.attachments[GUARD_KEY].tracker.pending == 0  # flags read once at the end of every forward
    mm.unload_all_models()
    for key in (COMPILE_KEY, GUARD_KEY, SWAP_KEY):
        assert remove_hook(model, key) is not None
    assert _replace(model) == {("double_block", 1): foreign}  # another pack's patch is back where it was
    assert not model.get_wrappers(WrappersMP.APPLY_MODEL, HOOKS_KEY)


class BatchRecorder(torch.nn.Module):
    """What a fake compile_fn returns: the block itself, recording the batch of every call."""

    def __init__(self, block: torch.nn.Module, batches: list) -> None:
        super().__init__()
        self.__dict__["block"], self.batches = block, batches  # outside _modules: no new state_dict keys

    def forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> object:
        self.batches.append(x.shape[0])
        return self.block(x, *args, **kwargs)


def test_compiled_model_runs_every_sample_alone_with_cfg() -> None:
    """Batch-invariance for ComfyUI's MultiGPU split: with Torch Compile attached, cond + uncond (a batch of 2 on
    one device) reach the compiled blocks one sample at a time, and sampling gives what the plain model gives."""
    plain = _tiny_wan()
    from comfyui_lowvram_dit.kernels.compile import CompileConfig
    from comfyui_lowvram_dit.host.torch_compile import apply_compile

    batches: list[int] = []
    model = apply_compile(plain, CompileConfig(), compile_fn=lambda module, **kw: BatchRecorder(module, batches))
    out, ref = _sample(model), _sample(plain)
    assert len(batches) == 2 * 4 and set(batches) == {1}  # 1 step, cond + uncond, 4 blocks
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) <= 1e-5  # CPU GEMM rounding only
