"""Mapped (pre-quantized) weights stay file-backed through ComfyUI's partial load, offload and unload (the idle
model costs page cache, not RSS; pinned memory is never freed while registered). In process, tiny Wan on the CPU, ComfyUI's real ModelPatcher code;
``torch.cuda.cudart()`` is replaced by a registration table (tests/fake_cudart.py) and ComfyUI's pinned-memory
limit is raised, so its pinning path runs as it does on a GPU. Needs COMFYUI_PATH."""

from __future__ import annotations

import dataclasses
import re
import gc
from pathlib import Path

import pytest
import torch
from comfy_server import comfyui_in_process_or_skip, sample_wan
from fake_cudart import FakeCudart, install_comfy_pinning

pytestmark = pytest.mark.comfyui

MODEL = "wan22_t2v_14B"
KEY = "diffusion_model.blocks.1.ffn.0.weight"


@pytest.fixture
def comfy_pinning(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    """ComfyUI's pin_memory/unpin_memory enabled on the CPU, registering into a fake table."""
    comfyui_in_process_or_skip()
    return install_comfy_pinning(monkeypatch)


def _load(tmp_path: Path, fmt: str, seed: int = 1):  # noqa: ANN202 - ModelPatcher
    from comfyui_lowvram_dit.synthetic import checkpoints as synth
    from comfyui_lowvram_dit.host.wan_loader import load_wan_model

    path = synth.write_synthetic(MODEL, tmp_path / f"m_{fmt}_{seed}.safetensors", size="tiny", fmt=fmt, seed=seed,
                                 num_layers=4)
    return load_wan_model(path, "per_tensor")


def _mapped_registered(cudart: FakeCudart) -> int:
    """Bytes registered inside file mappings (each one a copy-on-write copy into anonymous RAM on Linux)."""
    from comfyui_lowvram_dit.offload.host_memory import file_backed_ranges

    maps = file_backed_ranges()
    return sum(s for p, s in cudart.registered.items() if any(lo <= p < hi for lo, hi in maps))


def _weight(patcher, key: str = KEY) -> torch.Tensor:  # noqa: ANN001
    import comfy.model_patcher as mp

    return mp.get_key_weight(patcher.model, key)[0]


def test_partial_load_never_pins_mapped_weights(tmp_path: Path, comfy_pinning: FakeCudart) -> None:
    from comfyui_lowvram_dit.offload.host_memory import is_file_backed
    from comfyui_lowvram_dit.host.mapped_weights import MappedWeightsMixin, file_views

    patcher = _load(tmp_path, "fp8_scaled")
    ref = sample_wan(patcher, seed=3)
    # what load_models_gpu does on a GPU short of memory: most modules stay offloaded, ComfyUI pins them
    patcher.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=1 << 20)
    assert patcher.model.model_lowvram, "the partial-load path did not run"
    assert _mapped_registered(comfy_pinning) == 0, "ComfyUI pinned weights that live in the file mapping"
    assert isinstance(patcher, MappedWeightsMixin) and KEY in file_views(patcher.model)
    assert is_file_backed(_weight(patcher))
    patcher.unpatch_model(torch.device("cpu"))
    torch.testing.assert_close(sample_wan(patcher, seed=3), ref, rtol=0, atol=0)
    del patcher
    gc.collect()
    assert comfy_pinning.registered == {}


def test_offloaded_copies_go_back_to_the_file(tmp_path: Path, comfy_pinning: FakeCudart) -> None:
    """A weight that comes back from the GPU (an anonymous copy) is pointed at its file view, not pinned; a weight
    with a LoRA patch is left to ComfyUI (pinned as usual)."""
    import comfy.utils

    from comfyui_lowvram_dit.offload.host_memory import is_file_backed

    patcher = _load(tmp_path, "fp8_scaled")
    view = _weight(patcher)
    comfy.utils.set_attr_param(patcher.model, KEY, view.clone())  # as module.to("cpu") leaves it after the GPU
    assert not is_file_backed(_weight(patcher))
    patcher.pin_weight_to_device(KEY)
    assert _weight(patcher).data_ptr() == view.data_ptr() and KEY not in patcher.pinned
    assert comfy_pinning.registered == {}

    other = "diffusion_model.blocks.2.ffn.0.weight"
    comfy.utils.set_attr_param(patcher.model, other, _weight(patcher, other).clone())
    patcher.patches[other] = [(1.0, (torch.zeros(1),), 1.0, None, None)]  # any patch: ComfyUI owns the weight
    patcher.pin_weight_to_device(other)
    assert other in patcher.pinned and comfy_pinning.registered
    patcher.unpin_all_weights()
    assert comfy_pinning.registered == {}


def test_unload_points_gpu_weights_back_at_the_file(tmp_path: Path, comfy_pinning: FakeCudart) -> None:
    """``unpatch_model(cpu)`` after a load: weights that were on the device come back as file views (``meta``
    stands in for the GPU here; ComfyUI's ``model.to(cpu)`` would have to copy them, and cannot copy meta)."""
    import comfy.utils

    from comfyui_lowvram_dit.offload.host_memory import is_file_backed
    from comfyui_lowvram_dit.host.mapped_weights import file_views

    patcher = _load(tmp_path, "fp8_scaled")
    ref = sample_wan(patcher, seed=4)
    keys = [k for k in file_views(patcher.model) if ".ffn." in k]
    assert keys
    for k in keys:
        w = _weight(patcher, k)
        comfy.utils.set_attr_param(patcher.model, k, torch.empty(w.shape, dtype=w.dtype, device="meta"))
    patcher.unpatch_model(torch.device("cpu"))
    assert all(is_file_backed(_weight(patcher, k)) for k in keys)
    torch.testing.assert_close(sample_wan(patcher, seed=4), ref, rtol=0, atol=0)


def test_quantized_on_load_models_are_left_alone(tmp_path: Path, comfy_pinning: FakeCudart) -> None:
    """bf16 source quantized while loading: nothing is mapped, the patcher stays stock and pins as usual."""
    from comfyui_lowvram_dit.host.mapped_weights import MappedWeightsMixin

    patcher = _load(tmp_path, "bf16")
    assert not isinstance(patcher, MappedWeightsMixin)
    patcher.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=1 << 20)
    assert comfy_pinning.registered, "ComfyUI's own pinning path did not run (the test would prove nothing)"
    patcher.unpatch_model(torch.device("cpu"))
    assert comfy_pinning.registered == {}


def test_block_swap_on_a_mapped_model_keeps_both_behaviours(tmp_path: Path, comfy_pinning: FakeCudart) -> None:
    from comfyui_lowvram_dit.offload.plan import SwapConfig
    from comfyui_lowvram_dit.host.block_swap import BlockSwapMixin, apply_block_swap
    from comfyui_lowvram_dit.host.mapped_weights import MappedWeightsMixin

    base = _load(tmp_path, "fp8_scaled")
    ref = sample_wan(base, seed=5)
    swapped = apply_block_swap(base, SwapConfig(blocks_to_swap=2))
    torch.testing.assert_close(sample_wan(swapped, seed=5), ref, rtol=0, atol=0)
    swapped.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=1 << 20)
    assert _mapped_registered(comfy_pinning) == 0
    assert isinstance(swapped, BlockSwapMixin) and isinstance(swapped, MappedWeightsMixin)
    swapped.unpatch_model(torch.device("cpu"))
    del swapped, base
    gc.collect()
    assert comfy_pinning.registered == {}


def _set(patcher, key: str, t: torch.Tensor) -> None:  # noqa: ANN001
    import comfy.utils

    comfy.utils.set_attr_param(patcher.model, key, t)


def test_a_lora_patched_file_view_is_not_pinned(tmp_path: Path, comfy_pinning: FakeCudart) -> None:
    """A weight with a patch is left to ComfyUI, but while it is still the file view itself it is not pinned."""
    patcher = _load(tmp_path, "fp8_scaled")
    w = _weight(patcher)
    patcher.add_patches({KEY: (torch.randn(w.shape) * 0.1,)}, 1.0)
    patcher.pin_weight_to_device(KEY)
    assert comfy_pinning.registered == {} and KEY not in patcher.pinned


def test_real_partially_unload_with_a_lora(tmp_path: Path, comfy_pinning: FakeCudart) -> None:
    """ComfyUI's own partially_unload after a full load (other weights stand in as GPU copies): the LoRA weight comes
    back through ComfyUI's backup, the rest go back to the file, nothing mapped is pinned, same output."""
    from comfyui_lowvram_dit.offload.host_memory import is_file_backed
    from comfyui_lowvram_dit.host.mapped_weights import file_views

    base = _load(tmp_path, "fp8_scaled")
    lora = base.clone()
    w = _weight(lora)
    lora.add_patches({KEY: (torch.randn(w.shape) * 0.5,)}, 1.0)
    lora.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=0)
    ref = sample_wan(lora, seed=7)
    others = [k for k in file_views(lora.model) if k != KEY]
    for k in others:
        _set(lora, k, _weight(lora, k).clone())  # as module.to(cuda) would leave them
    lora.partially_unload(torch.device("cpu"), memory_to_free=1 << 40)
    assert all(is_file_backed(_weight(lora, k)) for k in others)
    assert _mapped_registered(comfy_pinning) == 0
    torch.testing.assert_close(sample_wan(lora, seed=7), ref, rtol=0, atol=0)


def test_an_object_patched_module_is_never_rebound(tmp_path: Path, comfy_pinning: FakeCudart) -> None:
    """add_object_patch swaps in another module at the same path: its weights must not become the original's."""
    import copy

    from comfyui_lowvram_dit.offload.host_memory import is_file_backed

    patcher = _load(tmp_path, "fp8_scaled")
    original = patcher.model.diffusion_model.blocks[1]
    replacement = copy.deepcopy(original)
    for p in replacement.parameters():
        p.data = p.data.clone()
    patcher.add_object_patch("diffusion_model.blocks.1", replacement)
    patcher.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=0)
    assert patcher.model.diffusion_model.blocks[1] is replacement
    w = _weight(patcher)
    _set(patcher, KEY, torch.empty(w.shape, dtype=w.dtype, device="meta"))  # the replacement "on the GPU"
    patcher.rebind_to_file(lambda t: t.device.type != "cpu")
    assert _weight(patcher).device.type == "meta", "the replacement got the original block's file view"
    patcher.pin_weight_to_device(KEY.replace("ffn.0", "ffn.2"))  # an offloaded replacement weight: pinned as usual
    assert not is_file_backed(replacement.ffn[2].weight)


def test_in_place_patching_turns_file_rebinding_off(tmp_path: Path, comfy_pinning: FakeCudart) -> None:
    """weight_inplace_update writes LoRA results into the mapped pages: afterwards no weight may be pointed back at
    them, or a plain clone would silently run with the LoRA baked in."""
    from comfyui_lowvram_dit.host.mapped_weights import file_views

    base = _load(tmp_path, "fp8_scaled")
    ref = sample_wan(base, seed=9)
    base.unpatch_model(torch.device("cpu"))
    inplace = base.clone()
    inplace.weight_inplace_update = True
    view = file_views(inplace.model)[KEY].tensor
    inplace.add_patches({KEY: (torch.randn(view.shape) * 2.0,)}, 1.0)
    inplace.load(torch.device("cpu"), lowvram_model_memory=1e32, full_load=False)  # patches the view in place
    assert file_views(base.model) == {}
    _set(inplace, KEY, _weight(inplace).clone())  # as module.to(cuda) would leave it
    inplace.unpatch_model(torch.device("cpu"))
    base.pin_weight_to_device(KEY)  # e.g. a partial unload of the plain model
    torch.testing.assert_close(sample_wan(base, seed=9), ref, rtol=0, atol=0)


def test_a_new_swap_plan_builds_its_arena_from_the_file(tmp_path: Path, comfy_pinning: FakeCudart,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A different plan on re-activation (auto budget, other resolution): the old arena is released first, so the
    new one's masters are the file views again (not copies of the old arena) and the idle model stays file-backed."""
    from comfyui_lowvram_dit.offload.plan import SwapConfig
    from comfyui_lowvram_dit.offload.host_memory import is_file_backed
    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY, apply_block_swap

    swapped = apply_block_swap(_load(tmp_path, "fp8_scaled"), SwapConfig(blocks_to_swap=2))
    ref = sample_wan(swapped, seed=2)
    ctl = swapped.attachments[SWAP_KEY]
    ctl.detach(swapped)  # detach(unpatch_all=False): arena kept
    old = ctl.plan.streamed
    new = tuple(sorted({*old, 0}))  # overlaps the old plan: those blocks now point into the old arena
    ctl.plan = dataclasses.replace(ctl.plan, streamed=new)
    from comfyui_lowvram_dit.offload import engine, host_memory

    held_at_allocation: list[list] = []
    allocate = engine.HostArena
    monkeypatch.setattr(engine, "HostArena", lambda *a, **k: held_at_allocation.append(
        [s.arena for s in host_memory._SPARES if s.arena is not None]) or allocate(*a, **k))
    ctl.activate(swapped, torch.device("cpu"))
    assert all(ctl.streamer.originals.get(b) for b in new), "the new arena was copied from the old one"
    assert held_at_allocation == [[]]  # the old arena's memory (another size) was freed first, never held beside it
    ctl.unload(swapped)
    assert ctl.streamer.arena is None
    assert all(is_file_backed(_weight(swapped, f"diffusion_model.blocks.{b}.ffn.0.weight")) for b in new)
    torch.testing.assert_close(sample_wan(swapped, seed=2), ref, rtol=0, atol=0)


def _mapping_rss_kb(path: Path) -> int:
    """This process's resident kB inside mappings of ``path`` (Linux smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc/self/smaps")
def test_loading_drops_the_file_pages_of_moved_weights(tmp_path: Path, comfy_pinning: FakeCudart,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """ComfyUI's load copies each mapped weight to the device; the copy read its file pages, which then only raised
    RSS (peak RSS counted the loaded model twice beside the GPU copy). The pages leave as each module moves (``meta``
    stands in for the GPU), the views still read the file's values, and the modules lose their wrappers."""
    import comfy.utils

    from comfyui_lowvram_dit.host.mapped_weights import file_views

    patcher = _load(tmp_path, "fp8_scaled")
    sample_wan(patcher, seed=3)  # every weight read: its pages are resident
    path = next(tmp_path.glob("m_fp8_scaled_*.safetensors"))
    views = {k: fv.tensor for k, fv in file_views(patcher.model).items()}
    before_values = {k: v.clone() for k, v in views.items()}
    before = _mapping_rss_kb(path)
    with caplog.at_level("INFO", logger="comfyui_lowvram_dit"):
        patcher.load(device_to=torch.device("meta"), full_load=True)
    after = _mapping_rss_kb(path)
    assert before > 1024 and after < before * 0.3, (before, after)
    assert "left this process's RSS" in caplog.text
    assert all(torch.equal(v, before_values[k]) for k, v in views.items())  # re-read from the file
    assert not any("_apply" in m.__dict__ for m in patcher.model.modules())
    theirs = patcher.model.diffusion_model.blocks[0].ffn[0]
    theirs.__dict__["_apply"] = marker = theirs._apply  # another extension's instance override survives a load
    patcher.load(device_to=torch.device("meta"), full_load=True)
    assert theirs.__dict__["_apply"] is marker
    del theirs.__dict__["_apply"]
    for k, v in views.items():  # back on the CPU as the unload would leave them: the file views again
        comfy.utils.set_attr_param(patcher.model, k, v)


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc/self/smaps")
def test_a_lora_load_drops_each_merged_weight_at_once(tmp_path: Path, comfy_pinning: FakeCudart) -> None:
    """ComfyUI's load merges every LoRA-patched weight onto the device before it moves any module: the pages each
    merge reads must leave then, not at the modules' move, or the load's peak holds the whole mapped model."""
    import comfy.model_patcher as mp

    from comfyui_lowvram_dit.host.mapped_weights import file_views
    from comfyui_lowvram_dit.offload.host_memory import page_out

    patcher = _load(tmp_path, "fp8_scaled")
    views = {k: fv.tensor for k, fv in file_views(patcher.model).items() if fv.tensor.ndim == 2}
    g = torch.Generator().manual_seed(0)
    patcher.add_patches({k: (torch.randn(v.shape, generator=g) * 0.01,) for k, v in views.items()}, 1.0)
    path = next(tmp_path.glob("m_fp8_scaled_*.safetensors"))
    ref = sample_wan(patcher, seed=4)
    patcher.unpatch_model(device_to=torch.device("cpu"))
    assert all(_weight(patcher, k).data_ptr() == v.data_ptr() for k, v in views.items())
    _ = [float(v.float().sum()) for v in views.values()]
    whole = _mapping_rss_kb(path)  # every weight's pages resident
    page_out(views.values())  # as a fresh process has them: the merges read them in
    during = []
    merge = patcher.patch_weight_to_device

    def measured(key: str, *args: object, **kwargs: object) -> object:
        out = merge(key, *args, **kwargs)
        during.append(_mapping_rss_kb(path))
        return out

    patcher.patch_weight_to_device = measured  # the stock load calls it for every weight it loads
    try:
        patcher.load(device_to=torch.device("cpu"), full_load=True)
    finally:
        del patcher.patch_weight_to_device
    assert whole > 1024 and len(during) >= len(views), (whole, len(during))
    assert max(during) < whole * 0.5, (whole, max(during))
    assert all(mp.get_key_weight(patcher.model, k)[0].data_ptr() != v.data_ptr() for k, v in views.items())
    torch.testing.assert_close(sample_wan(patcher, seed=4), ref, rtol=0, atol=0)


def test_a_cpu_load_drops_nothing(tmp_path: Path, comfy_pinning: FakeCudart) -> None:
    """Weights that stay on the CPU are the views themselves and are read every step: their pages stay."""
    patcher = _load(tmp_path, "fp8_scaled")
    ref = sample_wan(patcher, seed=5)
    path = next(tmp_path.glob("m_fp8_scaled_*.safetensors"))
    before = _mapping_rss_kb(path)
    patcher.load(device_to=torch.device("cpu"), full_load=True)
    assert _mapping_rss_kb(path) >= before * 0.95
    torch.testing.assert_close(sample_wan(patcher, seed=5), ref, rtol=0, atol=0)
