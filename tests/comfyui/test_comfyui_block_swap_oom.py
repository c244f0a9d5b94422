"""An out-of-memory error inside a Block Swap forward says what was on the GPU and the setting that would fit, keeps
its type (so ComfyUI's own OOM handling still unloads and reports), and leaves the model usable.
In process, tiny Wan on the CPU; needs COMFYUI_PATH."""

from __future__ import annotations

import pytest
import torch
from comfy_server import comfyui_in_process_or_skip, sample_wan

pytestmark = pytest.mark.comfyui

NUM_LAYERS = 6
TORCH_OOM = ("CUDA out of memory. Tried to allocate 1.95 GiB. GPU 0 has a total capacity of 23.55 GiB of which "
             "0.40 GiB is free. Including non-PyTorch memory, this process has 22.61 GiB memory in use.")


class _OomOnce:
    """A ``("double_block", i)`` patch that raises torch's OOM on its n-th call (then runs the block)."""

    def __init__(self, on_call: int) -> None:
        self.on_call, self.calls = on_call, 0

    def __deepcopy__(self, memo: dict) -> _OomOnce:
        return self

    def __call__(self, args: dict, extra: dict) -> dict:
        self.calls += 1
        if self.calls == self.on_call:
            raise torch.OutOfMemoryError(TORCH_OOM)
        return extra["original_block"](args)




def test_oom_in_a_swapped_forward_names_a_setting_that_fits(caplog: pytest.LogCaptureFixture) -> None:
    comfyui_in_process_or_skip()
    import comfy.model_management as mm
    import comfy.sd

    from comfyui_lowvram_dit.synthetic import checkpoints as synth
    from comfyui_lowvram_dit.offload.plan import SwapConfig
    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY, apply_block_swap

    sd = synth.synthetic_state_dict("wan21_t2v_1_3B", size="tiny", fmt="bf16", seed=1, num_layers=NUM_LAYERS)
    plain = comfy.sd.load_diffusion_model_state_dict(sd, {"dtype": torch.bfloat16})
    ref = sample_wan(plain, seed=3)
    oom = _OomOnce(on_call=2)
    plain.set_model_patch_replace(oom, "dit", "double_block", 3)
    model = apply_block_swap(plain, SwapConfig(blocks_to_swap=3))
    with caplog.at_level("ERROR", logger="comfyui_lowvram_dit"), pytest.raises(mm.OOM_EXCEPTION) as err:
        sample_wan(model, seed=3)
    msg = str(err.value)
    assert "Block Swap ran out of GPU memory during sampling" in msg and "3 of 6 blocks streamed" in msg
    assert "blocks_to_swap=" in msg and "should fit" in msg and "1.95 GiB with 0.40 GiB free" in msg
    assert TORCH_OOM in msg  # torch's own numbers stay in the message
    assert any("Block Swap ran out of GPU memory" in r.getMessage() for r in caplog.records)
    ctl = model.attachments[SWAP_KEY]
    assert not ctl.streamer._bound, "a ring slot stayed bound after the OOM"
    out = sample_wan(model, seed=3)  # still usable: the next run completes with the reference answer
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    mm.unload_all_models()
