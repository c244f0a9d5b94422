"""Block Swap's ``_load_list`` override takes whatever the host's ``ModelPatcher._load_list`` takes (newer ComfyUI
passes ``for_dynamic`` / ``default_device``, which put a second sort key in front of each entry) and still leaves
the streamed blocks out; its class adds no constructor, so new ``ModelPatcher.__init__`` keywords (``fast_disk``)
pass through. Needs COMFYUI_PATH."""

from __future__ import annotations

import inspect

import pytest
import torch
from comfy_server import comfyui_in_process_or_skip

pytestmark = pytest.mark.comfyui


def _swapped():  # noqa: ANN202 - ModelPatcher
    import comfy.sd

    from comfyui_lowvram_dit.offload.plan import SwapConfig
    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY, apply_block_swap
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    sd = synth.synthetic_state_dict("wan21_t2v_1_3B", size="tiny", fmt="bf16", seed=0, num_layers=4)
    plain = comfy.sd.load_diffusion_model_state_dict(sd, {"dtype": torch.bfloat16})
    swapped = apply_block_swap(plain, SwapConfig(blocks_to_swap=2, prefetch=1))
    ctl = swapped.attachments[SWAP_KEY]
    ctl.plan = ctl.make_plan(None)
    assert ctl.plan.streamed
    return plain, swapped, ctl


def test_load_list_forwards_the_host_arguments_and_leaves_streamed_blocks_out() -> None:
    comfyui_in_process_or_skip()
    import comfy.model_patcher as mp

    params = inspect.signature(mp.ModelPatcher._load_list).parameters
    if "for_dynamic" not in params:
        pytest.skip("this ComfyUI's ModelPatcher._load_list takes no arguments")
    plain, swapped, ctl = _swapped()
    for kwargs in ({}, {"for_dynamic": False, "default_device": None}, {"for_dynamic": True}):
        names = [x[-3] for x in swapped._load_list(**kwargs)]
        every = [x[-3] for x in mp.ModelPatcher._load_list(swapped, **kwargs)]
        assert names == [n for n in every if not ctl.is_swapped_module(n)]
        assert len(names) < len(every) and all(isinstance(n, str) for n in names)


def test_block_swap_class_adds_no_constructor() -> None:
    comfyui_in_process_or_skip()
    plain, swapped, _ = _swapped()
    assert "__init__" not in vars(type(swapped)) and type(swapped).__init__ is type(plain).__init__
