"""The two-expert RAM design through ComfyUI's real load/unload path: a pre-quantized Wan file is mapped,
Block Swap copies the streamed blocks into its host buffer while the model is loaded, and when ComfyUI unloads the
model the weights point back at the file (the idle expert costs page cache, not RSS) and the buffer's memory is the
next expert's buffer (one allocation between the two).
In process, tiny Wan on the CPU; needs COMFYUI_PATH."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from comfy_server import comfyui_in_process_or_skip, sample_wan

pytestmark = pytest.mark.comfyui

MODEL = "wan22_t2v_14B"
STREAMED = 3




def _weight(model: Any, block: int) -> torch.Tensor:
    return model.model.diffusion_model.blocks[block].ffn[0].weight


def test_unloaded_expert_goes_back_to_its_file(tmp_path: Path) -> None:
    comfyui_in_process_or_skip()
    import comfy.model_management as mm

    from comfyui_lowvram_dit.synthetic import checkpoints as synth
    from comfyui_lowvram_dit.offload.plan import SwapConfig
    from comfyui_lowvram_dit.offload.host_memory import HostArena, SpareArena, is_file_backed
    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY, apply_block_swap
    from comfyui_lowvram_dit.host.wan_loader import load_wan_model

    experts, paths = [], []
    for seed in (1, 2):  # high- and low-noise stand-ins
        path = synth.write_synthetic(MODEL, tmp_path / f"expert{seed}.safetensors", size="tiny", fmt="fp8_scaled",
                                     seed=seed, num_layers=6)
        paths.append(path)
        experts.append(apply_block_swap(load_wan_model(path, "per_tensor"), SwapConfig(blocks_to_swap=STREAMED)))
    high, low = experts
    ctl = high.attachments[SWAP_KEY]
    assert all(is_file_backed(_weight(high, b)) for b in range(6)), "the loader copied a pre-quantized file"

    ref_high = sample_wan(high, seed=5)
    streamed = list(ctl.plan.streamed)
    assert len(streamed) == STREAMED
    assert ctl.streamer.arena is not None and ctl.streamer.arena.contains(_weight(high, streamed[0]))

    memory = ctl.streamer.arena.buffer.data_ptr()
    mm.unload_all_models()  # what ComfyUI does to the idle expert when the other one needs the memory
    assert ctl.streamer.arena is None, "the unloaded expert kept its host buffer"
    assert all(is_file_backed(_weight(high, b)) for b in streamed)

    out_low = sample_wan(low, seed=5)  # the other expert runs while the first is back on its file
    assert torch.isfinite(out_low).all() and not torch.equal(out_low, ref_high)
    low_streamer = low.attachments[SWAP_KEY].streamer
    assert low_streamer.arena.buffer.data_ptr() == memory and low_streamer.took["reused"]
    mm.unload_all_models()
    again = sample_wan(high, seed=5)  # and the first comes back with the same answer
    torch.testing.assert_close(again, ref_high, rtol=0, atol=0)
    assert ctl.streamer.arena is not None and ctl.streamer.arena.buffer.data_ptr() == memory

    # memory no arena takes is not kept: at the end of a streamed model's load, or when nothing streams
    stray = SpareArena(HostArena(4096, pin=False), torch.device("cpu"))
    torch.testing.assert_close(sample_wan(high, seed=5), ref_high, rtol=0, atol=0)  # loaded already: no arena built
    assert stray.arena is None
    mm.unload_all_models()
    assert ctl.streamer.spare.arena is not None  # offered to the next expert
    whole = apply_block_swap(load_wan_model(paths[0], "per_tensor"), SwapConfig(blocks_to_swap=0))
    sample_wan(whole, seed=5)
    assert ctl.streamer.spare.arena is None
    mm.unload_all_models()
