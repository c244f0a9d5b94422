"""ComfyUI launched with an attention flag (``--use-ck-attention``, ``--use-sage-attention``,
``--use-flash-attention``): its global attention is then a CUDA kernel that fails on the CPU tensors of the pack's
behaviour probes. The probes must still find every seam, or Block Swap, NaN Guard and Attention pass the model
through and the Qwen-Image loaders disappear on a ComfyUI that has all they need (seen on a GPU server launched
with ``--use-ck-attention``: "this ComfyUI (0.33.0) lacks comfy.ldm.wan.model.WanModel (behaviour: ...)").
"""

from __future__ import annotations

from typing import Any

import pytest
from comfy_server import comfyui_in_process_or_skip

pytestmark = pytest.mark.comfyui


def test_probes_pass_when_the_global_attention_is_a_cuda_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    comfyui_in_process_or_skip()
    import comfy.ldm.modules.attention as attention
    import comfy.ldm.qwen_image.model as qwen_model
    import comfy.ldm.wan.model as wan_model
    from comfyui_lowvram_dit.host import seams

    calls: list[str] = []

    @attention.wrap_attn
    def cuda_kernel(q: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(q.device.type)
        raise RuntimeError("CUDA kernel given CPU tensors")  # what comfy-kitchen's int8 attention does on a CPU

    # as ComfyUI binds it at import under the flag: the attention module's name and each model's imported name
    for module, name in ((attention, "optimized_attention"), (attention, "optimized_attention_masked"),
                         (wan_model, "optimized_attention"), (qwen_model, "optimized_attention_masked")):
        monkeypatch.setattr(module, name, cuda_kernel)
    seams.forget_probe_results()
    try:
        status = seams.seam_status()
        with pytest.raises(RuntimeError, match="CUDA kernel"):  # the stand-in really is what the models call
            import torch

            attention.optimized_attention(torch.zeros(1, 4, 32), torch.zeros(1, 4, 32), torch.zeros(1, 4, 32), 2)
    finally:
        seams.forget_probe_results()
    assert {k: v for k, v in status.items() if v != "ok"} == {}
    assert calls == ["cpu"]  # only the direct call above reached the kernel; the probes attended in plain torch
