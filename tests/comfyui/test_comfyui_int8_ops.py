"""The int8 compute of host/fp8_ops.py inside ComfyUI (in process, CPU, capabilities forced): "auto" picks int8 on
GPUs with int8 but no fp8 tensor cores and fp8 matmul from 8.9 on, says so once per device, and a LoRA merged by
ComfyUI's ModelPatcher (and unpatched again) is what the int8 layer computes with. Needs COMFYUI_PATH."""

from __future__ import annotations

import logging

import pytest
import torch
from comfy_server import comfyui_in_process_or_skip

pytestmark = pytest.mark.comfyui


def _layer(compute: str = "auto", n: int = 64, k: int = 256, seed: int = 0):  # noqa: ANN202 - LowVramFp8Ops.Linear
    from comfyui_lowvram_dit.host.fp8_ops import Fp8OpsConfig, make_fp8_ops
    from comfyui_lowvram_dit.kernels import fp8

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5
    q, s = fp8.quantize_per_tensor(w)
    layer = make_fp8_ops(Fp8OpsConfig(compute=compute)).Linear(k, n, bias=True, device="meta")
    layer.load_state_dict({"weight": q, "weight_scale": s, "bias": 0.01 * torch.randn(n, generator=g)}, assign=True)
    return layer


@pytest.fixture
def forced_capability(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """Set the capability the compute choice sees (for every device, the CPU included); the log memory is fresh."""
    from comfyui_lowvram_dit.kernels import int8_choice

    monkeypatch.setattr(int8_choice, "_SAID", set())

    def force(cap: tuple[int, int]) -> None:
        monkeypatch.setattr(int8_choice, "device_capability", lambda device: cap)

    return force


@pytest.mark.parametrize("cap, int8_path", [((7, 5), True), ((8, 0), True), ((8, 6), True), ((8, 9), False),
                                            ((9, 0), False)])
def test_auto_compute_by_capability_logged_once(cap, int8_path, forced_capability,
                                                caplog: pytest.LogCaptureFixture) -> None:
    comfyui_in_process_or_skip()
    from comfyui_lowvram_dit.kernels import int8_choice

    forced_capability(cap)
    cpu = torch.device("cpu")
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        layers = [_layer(seed=i) for i in range(3)]
        paths = {layer._path(cpu) for layer in layers}
        if int8_path:
            x = torch.randn(2, 20, 256, dtype=torch.bfloat16)
            y = layers[0](x)
            assert y.shape == (2, 20, 64) and y.dtype == torch.bfloat16
    assert paths == ({"int8"} if int8_path else {"dequantize"})  # on the CPU, fp8 matmul itself dequantizes
    assert int8_choice.compute_mode(cpu, "auto") == ("int8" if int8_path else "auto")
    lines = [r.getMessage() for r in caplog.records if "fp8 layers on cpu" in r.getMessage()]
    assert len(lines) == 1, lines
    assert ("int8 matmul" in lines[0]) == int8_path and ".".join(map(str, cap)) in lines[0]


@pytest.mark.parametrize("inplace", [False, True])
def test_lora_patch_and_unpatch_change_the_int8_output(inplace: bool, forced_capability) -> None:
    """ComfyUI merges a patch through ``set_weight`` and restores the backup by re-binding the Parameter (or, for an
    in-place patcher, by copying into it behind the layer's back): the int8 output follows both ways."""
    comfyui_in_process_or_skip()
    import comfy.model_patcher

    from comfyui_lowvram_dit.kernels import fp8, int8

    forced_capability((8, 6))
    model = torch.nn.Module()
    model.lin = _layer("auto")
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"),
                                               offload_device=torch.device("cpu"), weight_inplace_update=inplace)
    x = torch.randn(1, 24, 256, dtype=torch.bfloat16)

    def expected() -> torch.Tensor:
        wq, ws = int8.weight_from_fp8(model.lin.weight, model.lin.weight_scale, None, rotate=True)
        return int8.int8_linear_reference(x, wq, ws, model.lin.bias, rotate=True)

    before = model.lin(x)
    assert model.lin._path(torch.device("cpu")) == "int8" and torch.equal(before, expected())
    delta = 0.05 * torch.randn(64, 256, generator=torch.Generator().manual_seed(9))
    patcher.add_patches({"lin.weight": (delta,)}, 1.0)
    patcher.patch_weight_to_device("lin.weight", device_to=torch.device("cpu"))
    patched = model.lin(x)
    assert not torch.equal(patched, before) and torch.equal(patched, expected())
    ref = torch.nn.functional.linear(x.float(), fp8.dequantize(model.lin.weight, model.lin.weight_scale, None,
                                                               torch.float32), model.lin.bias.float())
    assert ((patched.float() - ref).norm() / ref.norm()) < 0.05
    patcher.unpatch_model()
    assert torch.equal(model.lin(x), before)
