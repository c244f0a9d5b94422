"""The Wan Loader's fp8 layers under ComfyUI's DynamicVRAM: weights through ComfyUI's own cast, LoRA in their scale.

DynamicVRAM only starts on a CUDA device, so its cast is re-created here on the CPU from ComfyUI's real pieces: the
layer's weight and bias gathered into one byte buffer as ``cast_modules_with_vbar`` does, then ComfyUI's own
``resolve_cast_module_with_vbar`` (which applies a LoRA patch to the weight it casts, then re-quantizes it). What is
checked: without a LoRA the output is bit-identical to the resident path; with one it matches the legacy merge (the
LoRA applied to real values, not fp8 codes) up to the stochastic rounding DynamicVRAM re-quantizes with.
In process, tiny Wan on the CPU; needs COMFYUI_PATH, and skips on hosts without DynamicVRAM (0.8.0)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from comfy_server import comfyui_in_process_or_skip

pytestmark = pytest.mark.comfyui
MODES = ["per_tensor", "blockwise"]


def _dynamic_cast_or_skip() -> Any:
    import comfy.ops

    resolve = getattr(comfy.ops, "resolve_cast_module_with_vbar", None)
    if resolve is None:
        pytest.skip("this ComfyUI has no DynamicVRAM cast (comfy.ops.resolve_cast_module_with_vbar)")
    return resolve


def _emulated_cast(resolve: Any, casts: list[str]) -> Any:
    """``comfy.ops.cast_bias_weight`` for a layer with a DynamicVRAM slot, on the CPU: one gathered copy, then
    ComfyUI's own resolve step (LoRA patch, re-quantization); every other layer takes the real function."""
    import comfy.memory_management as mem
    import comfy.ops

    real = comfy.ops.cast_bias_weight

    def cast(s: Any, input: Any = None, dtype: Any = None, device: Any = None, bias_dtype: Any = None,
             offloadable: bool = False, compute_dtype: Any = None, want_requant: bool = False) -> Any:
        if getattr(s, "_v", None) is None:
            return real(s, input, dtype, device, bias_dtype, offloadable, compute_dtype, want_requant)
        casts.append(s.seed_key)
        tensors = [s.weight, s.bias]
        gathered = torch.empty(mem.vram_aligned_size(tensors), dtype=torch.uint8)
        for src, view in zip(tensors, mem.interpret_gathered_like(tensors, gathered)):
            if src is not None:
                view.copy_(src)
        s._prefetch = {"signature": None, "resident": False, "xfer_dest": gathered, "cast_dest": None,
                       "cast_geometry": mem.tensors_to_geometries(tensors), "needs_cast": False}
        try:
            w, b = resolve(s, dtype, input.device, bias_dtype, compute_dtype, want_requant)
        finally:
            del s._prefetch
        return w, b, (None, None, None)

    return cast


def _give_slots(patcher: Any, patches: dict) -> int:
    """What ``ModelPatcherDynamic.load`` sets on each cast layer: a slot, its seed key and its LoRA patch."""
    import comfy.model_patcher as mp

    from comfyui_lowvram_dit.host.fp8_ops import LowVramFp8Ops

    n = 0
    for name, m in patcher.model.named_modules():
        if isinstance(m, LowVramFp8Ops.Linear) and m.is_fp8:
            key = f"{name}.weight"
            m._v, m.seed_key = object(), name
            # the dtype DynamicVRAM casts the weight to: the one ComfyUI recorded for the layer (setup_param)
            m.weight._model_dtype = getattr(m, "weight_comfy_model_dtype", None) or m.weight.dtype
            m.weight_lowvram_function = mp.LowVramPatch(key, patches) if key in patches else None
            n += 1
    return n


def _forward(patcher: Any) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    x, ctx = torch.randn(1, 16, 3, 8, 8, generator=g), torch.randn(1, 12, 4096, generator=g)
    with torch.inference_mode():
        return patcher.model.diffusion_model(x, torch.tensor([600.0]), ctx)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("mode", MODES)
def test_dynamic_cast_with_and_without_lora(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    comfyui_in_process_or_skip()
    resolve = _dynamic_cast_or_skip()
    import comfy.lora
    import comfy.ops
    from safetensors.torch import load_file
    from test_comfyui_lora_fp8 import wan_lora

    from comfyui_lowvram_dit.host.wan_loader import load_wan_model
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    path = synth.write_synthetic("wan22_t2v_14B", tmp_path / "wan.safetensors", size="tiny", fmt="bf16", seed=4,
                                 num_layers=2)
    base = load_wan_model(path, mode)
    resident = _forward(base)
    lora = comfy.lora.load_lora(wan_lora(load_file(str(path)), style="official", ratio=0.3),
                                comfy.lora.model_lora_keys_unet(base.model, {}))
    merged = base.clone()
    merged.add_patches(lora, 1.0)
    merged.patch_model()  # the legacy patcher's merge: the layer's set_weight re-quantizes with its scale
    try:
        legacy_lora = _forward(merged)
    finally:
        merged.unpatch_model()
    assert torch.equal(_forward(base), resident)  # unpatched exactly

    casts: list[str] = []
    monkeypatch.setattr(comfy.ops, "cast_bias_weight", _emulated_cast(resolve, casts))
    dynamic = load_wan_model(path, mode)
    layers = _give_slots(dynamic, {})
    assert torch.equal(_forward(dynamic), resident) and len(casts) == layers > 0  # every fp8 layer cast once

    with_lora = load_wan_model(path, mode)
    _give_slots(with_lora, merged.patches)
    dynamic_lora = _forward(with_lora)
    reference = load_wan_model(path, "none")  # bf16 weights, the LoRA merged in full precision
    reference.add_patches(lora, 1.0)
    reference.patch_model()
    truth = _forward(reference)
    errors = {"legacy": _rel(legacy_lora, truth), "dynamic": _rel(dynamic_lora, truth), "none": _rel(resident, truth)}
    # the LoRA lands: far closer to the truth than without it, and about as close as the legacy merge (DynamicVRAM
    # re-quantizes stochastically, whose rounding error is about 1.4x that of the merge's round-to-nearest; a delta
    # applied to the fp8 codes instead of the real values would be off by the layer's scale)
    assert errors["dynamic"] < 0.25 * errors["none"] and errors["dynamic"] < 2.0 * errors["legacy"], errors


def _load_wan(path: Path) -> Any:
    from comfyui_lowvram_dit.host import wan_loader

    return wan_loader.load_wan_model(path, "per_tensor")


def _load_qwen_image(path: Path) -> Any:
    from comfyui_lowvram_dit.host import qwen_stages

    return qwen_stages.load_transformer(path, "per_tensor")


LOADERS = {"wan": ("wan22_t2v_14B", "wan_loader", _load_wan),
           "qwen_image": ("qwen_image", "qwen_stages", _load_qwen_image)}


@pytest.mark.parametrize("loader", list(LOADERS))
def test_mapped_weights_are_read_by_comfyui_from_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          loader: str) -> None:
    """An fp8_scaled file's weights, served as views of the loader's mapping, carry ComfyUI's file-slice record, so
    DynamicVRAM reads them from the file by handle (as it reads UNETLoader's) instead of through the mapping, whose
    pages would otherwise stay resident. The Wan Loader and the Qwen-Image transformer load."""
    comfyui_in_process_or_skip()
    cmm = pytest.importorskip("comfy.memory_management", reason="ComfyUI before DynamicVRAM")
    if not hasattr(cmm, "read_tensor_file_slice_into"):
        pytest.skip("this ComfyUI has no file-slice reader (comfy.memory_management.read_tensor_file_slice_into)")
    import importlib

    from comfyui_lowvram_dit.host import file_slices
    from comfyui_lowvram_dit.host.fp8_ops import LowVramFp8Ops
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    arch, module, load = LOADERS[loader]
    path = synth.write_synthetic(arch, tmp_path / f"{loader}_fp8_scaled.safetensors", size="tiny", fmt="fp8_scaled",
                                 seed=4, num_layers=2)
    handle = open(path, "rb")  # noqa: SIM115 - what aimdo's handle is on a GPU: the reader seeks and reads it
    tagged: list[Path] = []

    def hook(p: Path) -> Any:
        tagged.append(Path(p))
        return file_slices.tag_with(cmm.TensorFileSlice, handle, handle)

    monkeypatch.setattr(importlib.import_module(f"comfyui_lowvram_dit.host.{module}"), "file_slice_hook", hook)
    try:
        model = load(path)
        weights = [m.weight for m in model.model.modules() if isinstance(m, LowVramFp8Ops.Linear) and m.is_fp8]
        assert weights and tagged == [path]
        for w in weights:
            dest = torch.empty_like(w)
            assert cmm.read_tensor_file_slice_into(w, dest)  # ComfyUI's own reader took it from the file
            assert torch.equal(dest.view(torch.uint8), w.view(torch.uint8))
    finally:
        handle.close()


def test_file_slice_hook_only_where_comfy_aimdo_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    comfyui_in_process_or_skip()
    import importlib.util

    from comfyui_lowvram_dit.host.file_slices import file_slice_hook

    if importlib.util.find_spec("comfy.memory_management") is not None:
        import comfy.memory_management as cmm

        monkeypatch.setattr(cmm, "aimdo_enabled", False, raising=False)
    assert file_slice_hook(__file__) is None  # --disable-dynamic-vram, no NVIDIA GPU, or ComfyUI before it


def test_file_slice_hook_without_a_file_handle_reads_through_the_mapping(monkeypatch: pytest.MonkeyPatch,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """comfy-aimdo on but refusing the file (its ModelMMAP raises): no hook, one log line, the load goes on."""
    comfyui_in_process_or_skip()
    import logging

    cmm = pytest.importorskip("comfy.memory_management", reason="ComfyUI before DynamicVRAM")
    if not hasattr(cmm, "TensorFileSlice"):
        pytest.skip("this ComfyUI has no file-slice reader (comfy.memory_management.TensorFileSlice)")
    import comfy_aimdo.model_mmap

    from comfyui_lowvram_dit.host.file_slices import file_slice_hook

    def refuse(path: str) -> None:
        raise RuntimeError("comfy-aimdo is not initialized")

    monkeypatch.setattr(cmm, "aimdo_enabled", True, raising=False)
    monkeypatch.setattr(comfy_aimdo.model_mmap, "ModelMMAP", refuse)
    caplog.set_level(logging.INFO, logger="comfyui_lowvram_dit")
    assert file_slice_hook(__file__) is None
    assert "is read through its mapping (comfy-aimdo gave no file handle: comfy-aimdo is not initialized)" in caplog.text


def test_an_fp8_layer_hands_comfyui_the_same_lora_patch_object_so_its_pin_is_found_again(tmp_path: Path) -> None:
    """DynamicVRAM pins a streamed layer's LoRA patch once and looks the pin up on the object the layer hands it at
    each cast (``comfy.pinned_memory.get_pin`` reads that object's own ``__dict__``). A new object per cast made
    ComfyUI pin every streamed patch again at every step, growing its pinned buffer."""
    comfyui_in_process_or_skip()
    import comfy.model_patcher as mp

    from comfyui_lowvram_dit.host.fp8_ops import LowVramFp8Ops
    from comfyui_lowvram_dit.host.wan_loader import load_wan_model
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    path = synth.write_synthetic("wan22_t2v_14B", tmp_path / "wan.safetensors", size="tiny", fmt="bf16", seed=4,
                                 num_layers=1)
    layer = next(m for m in load_wan_model(path, "per_tensor").model.modules()
                 if isinstance(m, LowVramFp8Ops.Linear) and m.is_fp8)
    patch = mp.LowVramPatch("k", {})
    layer.weight_lowvram_function = patch
    handed = layer.weight_lowvram_function
    assert handed is layer.weight_lowvram_function and handed.patch is patch
    pin = torch.zeros(4)
    handed.__dict__.setdefault("_pins", {})["patches"] = {"pin": pin, "registered": True}  # as pin_memory leaves it
    try:
        import comfy.pinned_memory
    except ImportError:  # ComfyUI before DynamicVRAM: the identity above is what matters
        pass
    else:
        assert comfy.pinned_memory.get_pin(layer.weight_lowvram_function, subset="patches") is pin
    layer.weight_lowvram_function = mp.LowVramPatch("k", {})  # a reload's new patch: a new wrapper, no old pin
    assert layer.weight_lowvram_function is not handed and "_pins" not in layer.weight_lowvram_function.__dict__
    layer.weight_lowvram_function = None
    assert layer.weight_lowvram_function is None
