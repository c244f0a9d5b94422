"""A Block Swap model that ComfyUI unloads partially (to make room for a DynamicVRAM text encoder or VAE), or wholly
while it streams blocks (a Wan 2.2 expert switch), gets its weights back from pinned memory, LoRA already merged, and
samples bit for bit as before (host/parked_weights.py).

In process, tiny Wan 2.2 with a LoRA, ComfyUI's real ModelPatcher code: on the CPU with ``torch.cuda.cudart()``
replaced by a registration table (tests/fake_cudart.py), so the arena is pinned as on a GPU; the ``cuda`` test runs
the same lifecycle on a GPU (``pytest FILE -m cuda``). Two models: ComfyUI's own bf16 load and the pack's Wan Loader
on an ``fp8_scaled`` file (fp8 layers whose weights are the file's mapping). Needs COMFYUI_PATH.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from comfy_server import comfyui_in_process_or_skip, sample_wan
from fake_cudart import FakeCudart, install_comfy_pinning

pytestmark = pytest.mark.comfyui

LORA = "wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors"


def _model(kind: str, tmp_path: Path) -> Any:
    """A tiny Wan 2.2 14B patcher: ComfyUI's bf16 load (``stock``) or the pack's loader on a mapped fp8 file."""
    import comfy.sd

    from comfyui_lowvram_dit.host.wan_loader import load_wan_model
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    if kind == "stock":
        sd = synth.synthetic_state_dict("wan22_t2v_14B", size="tiny", fmt="bf16", seed=3, num_layers=4)
        return comfy.sd.load_diffusion_model_state_dict(sd, {"dtype": torch.bfloat16})
    path = synth.write_synthetic("wan22_t2v_14B", tmp_path / "wan.safetensors", size="tiny", fmt="fp8_scaled",
                                 seed=3, num_layers=4)
    return load_wan_model(path, "per_tensor")


def _with_lora(plain: Any, strength: float) -> Any:
    import comfy.sd

    from comfyui_lowvram_dit.synthetic.lora import synthetic_lora

    return comfy.sd.load_lora_for_models(plain, None, synthetic_lora(LORA, size="tiny"), strength, 0)[0]


def _merges(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys ComfyUI merges a LoRA into from now on (comfy.lora.calculate_weight's calls)."""
    import comfy.lora

    keys: list[str] = []
    real = comfy.lora.calculate_weight

    def counting(patches, weight, key, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        keys.append(key)
        return real(patches, weight, key, *args, **kwargs)

    monkeypatch.setattr(comfy.lora, "calculate_weight", counting)
    return keys


def regular_weights_keys(patcher: Any) -> list[str]:
    """Every weight key of the model's modules that ComfyUI casts (what a load may put on the device)."""
    return [f"{n}.{a}" for n, m in patcher.model.named_modules() if hasattr(m, "comfy_cast_weights")
            for a, _ in m.named_parameters(recurse=False)]


def _lifecycle(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sample, unload a third partially, sample again: the moved weights come back from the arena without a LoRA
    merge and the output is the same bit for bit; another LoRA strength afterwards gets its own weights; a full
    unload (a Wan 2.2 expert switch) parks the resident part in the same arena, and the next load of that model takes
    it back without a merge, while a model with other patches merges its own."""
    import comfy.model_management as mm

    from comfyui_lowvram_dit.host import block_swap
    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY, apply_block_swap
    from comfyui_lowvram_dit.offload.plan import SwapConfig

    # one block of four streams: the resident part counts as small here (the share rule has its own test)
    monkeypatch.setattr(block_swap, "PARK_SHARE", 1.0)
    plain = _model(kind, tmp_path)
    other = _with_lora(plain, 2.0)
    ref_other = sample_wan(other)
    swapped = apply_block_swap(_with_lora(plain, 1.0), SwapConfig(blocks_to_swap=1))
    ctl = swapped.attachments[SWAP_KEY]
    ref = sample_wan(swapped)
    assert not torch.equal(ref, ref_other)

    freed = swapped.partially_unload(swapped.offload_device, swapped.model.model_loaded_weight_memory // 3)
    parked, arena = dict(ctl.parked.slots), ctl.parked.arena
    assert freed > 0 and parked and arena is not None and arena.pinned
    patched = {k for k in parked if k in swapped.patches}
    assert patched, "no LoRA-patched weight among the parked ones"
    merges = _merges(monkeypatch)
    assert torch.equal(sample_wan(swapped), ref)
    assert not ctl.parked.slots, "the reload left parked weights unused"
    assert not patched & set(merges), "a parked weight was merged with its LoRA again"

    # the same Block Swap with other patches (same controller): nothing parked for the first reaches it
    swapped.partially_unload(swapped.offload_device, swapped.model.model_loaded_weight_memory // 3)
    assert ctl.parked.slots and ctl.parked.arena is arena, "the second park allocated another arena"
    stronger = swapped.clone()
    stronger.patches = {k: list(v) for k, v in other.patches.items()}  # the LoRA at 2.0, as `other` has it
    stronger.patches_uuid = uuid.uuid4()
    assert torch.equal(sample_wan(stronger), ref_other)

    mm.unload_all_models()  # a full unload (an expert switch): what the model held, LoRA merged, is parked
    parked, arena = set(ctl.parked.slots), ctl.parked.arena
    assert arena is not None and arena.pinned and patched & parked and parked <= set(regular_weights_keys(stronger))
    merges.clear()
    assert torch.equal(sample_wan(stronger), ref_other)
    assert not ctl.parked.slots and not parked & set(merges), "a weight parked at the full unload was merged again"
    mm.unload_all_models()
    assert ctl.parked.slots and ctl.parked.arena is arena, "the next switch pinned another arena"
    assert torch.equal(sample_wan(swapped), ref), "weights parked for other patches reached this model"
    assert patched <= set(merges), "the model with other patches did not merge its own"


@pytest.fixture
def comfy_pinning(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    """ComfyUI on the CPU with its pinned-memory account on and cudaHostRegister answered by a table (for the arena)."""
    comfyui_in_process_or_skip()
    import comfy.model_management as mm

    cudart = install_comfy_pinning(monkeypatch)
    monkeypatch.setattr(mm, "soft_empty_cache", lambda *args, **kwargs: None)  # it would ask the absent GPU
    # ComfyUI's own pins of the tiny model's CPU weights would share pages with the arena in the table (real weights
    # are page-sized); they are not what these tests check
    monkeypatch.setattr(mm, "pin_memory", lambda tensor: False)
    # free RAM is the test machine's (another test process may hold it): the refusal has its own test
    monkeypatch.setattr("comfyui_lowvram_dit.host.parked_weights.ram_allows", lambda nbytes: True)
    return cudart


@pytest.mark.parametrize("kind", ["stock", "mapped_fp8"])
def test_partially_unloaded_weights_come_back_from_pinned_memory(kind: str, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 comfy_pinning: FakeCudart) -> None:
    _lifecycle(kind, tmp_path, monkeypatch)
    assert comfy_pinning.registered == {}, "a registration outlived the arena"


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["stock", "mapped_fp8"])
def test_partially_unloaded_weights_come_back_on_the_gpu(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        comfy_on_gpu: None) -> None:
    _lifecycle(kind, tmp_path, monkeypatch)


def test_a_full_unload_parks_no_resident_part_larger_than_its_share(tmp_path: Path,
                                                                   comfy_pinning: FakeCudart) -> None:
    """Three of four blocks resident (more than PARK_SHARE of the model): a full unload keeps nothing pinned, the
    arena goes, and the next load reads and merges as ComfyUI does."""
    import comfy.model_management as mm

    from comfyui_lowvram_dit.host.block_swap import PARK_SHARE, SWAP_KEY, apply_block_swap
    from comfyui_lowvram_dit.offload.plan import SwapConfig

    swapped = apply_block_swap(_with_lora(_model("stock", tmp_path), 1.0), SwapConfig(blocks_to_swap=1))
    ctl = swapped.attachments[SWAP_KEY]
    ref = sample_wan(swapped)
    assert ctl.gpu_bytes(ctl.plan) > PARK_SHARE * ctl.full_bytes
    mm.unload_all_models()
    assert not ctl.parked.slots and ctl.parked.arena is None
    assert torch.equal(sample_wan(swapped), ref)
    mm.unload_all_models()
    assert comfy_pinning.registered == {}, "a registration outlived the unload"


def test_a_parked_weight_serves_only_the_patches_it_was_merged_with(tmp_path: Path,
                                                                    comfy_pinning: FakeCudart) -> None:
    """restore() for a patcher whose patches changed since the park puts nothing back and forgets the rest."""
    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY, apply_block_swap
    from comfyui_lowvram_dit.offload.plan import SwapConfig

    swapped = apply_block_swap(_with_lora(_model("stock", tmp_path), 1.0), SwapConfig(blocks_to_swap=1))
    ctl = swapped.attachments[SWAP_KEY]
    sample_wan(swapped)
    swapped.partially_unload(swapped.offload_device, swapped.model.model_loaded_weight_memory // 3)
    key = next(iter(ctl.parked.slots))
    swapped.patches_uuid = uuid.uuid4()
    assert not ctl.parked.restore(swapped, key, swapped.load_device)
    assert not ctl.parked.slots


def test_a_weight_newer_comfyui_patches_on_the_cpu_at_unload_comes_back_patched_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, comfy_pinning: FakeCudart) -> None:
    """Newer ComfyUI patches a weight whose patches change its shape on the CPU as it unloads it, keeping its backup
    of the original (tests/newer_comfyui.py; every LoRA key here): the GPU's weight is parked over that CPU weight,
    put back without a merge, the output stays the same bit for bit, and the full unload restores the originals."""
    import comfy.model_management as mm

    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY, apply_block_swap
    from comfyui_lowvram_dit.offload.plan import SwapConfig
    from newer_comfyui import cpu_patching_partial_unload

    plain = _model("stock", tmp_path)
    originals = {k: v.clone() for k, v in plain.model.state_dict().items()}
    swapped = apply_block_swap(_with_lora(plain, 1.0), SwapConfig(blocks_to_swap=1))
    ctl = swapped.attachments[SWAP_KEY]
    ref = sample_wan(swapped)
    with cpu_patching_partial_unload(set(swapped.patches)) as cpu_patched:
        swapped.partially_unload(swapped.offload_device, swapped.model.model_loaded_weight_memory // 3)
    assert cpu_patched and set(cpu_patched) <= set(ctl.parked.slots) and set(cpu_patched) <= set(swapped.backup)
    merges = _merges(monkeypatch)
    assert torch.equal(sample_wan(swapped), ref)
    assert not ctl.parked.slots and not set(cpu_patched) & set(merges), "merged again over the CPU-patched weight"
    mm.unload_all_models()
    assert all(torch.equal(v, originals[k]) for k, v in plain.model.state_dict().items())


def test_without_free_ram_nothing_is_parked_and_comfyui_reloads_as_usual(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          comfy_pinning: FakeCudart) -> None:
    """Where RAM has no room for the arena (ComfyUI's own check says no), the unload and reload are ComfyUI's."""
    import comfy.model_management as mm

    from comfyui_lowvram_dit.host import pin_budget
    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY, apply_block_swap
    from comfyui_lowvram_dit.offload.plan import SwapConfig

    asked: list[int] = []
    monkeypatch.setattr("comfyui_lowvram_dit.host.block_swap.PARK_SHARE", 1.0)  # the full unload would park
    monkeypatch.setattr(mm, "ensure_pin_budget", lambda size, **kw: asked.append(size) or False, raising=False)
    monkeypatch.setattr("comfyui_lowvram_dit.host.parked_weights.ram_allows", pin_budget.ram_allows)
    swapped = apply_block_swap(_with_lora(_model("stock", tmp_path), 1.0), SwapConfig(blocks_to_swap=1))
    ctl = swapped.attachments[SWAP_KEY]
    ref = sample_wan(swapped)
    assert swapped.partially_unload(swapped.offload_device, swapped.model.model_loaded_weight_memory // 3) > 0
    assert asked and not ctl.parked.slots and ctl.parked.arena is None
    assert torch.equal(sample_wan(swapped), ref)
    asked.clear()
    mm.unload_all_models()  # a full unload asks too, and parks nothing either
    assert asked and not ctl.parked.slots and ctl.parked.arena is None
    assert torch.equal(sample_wan(swapped), ref)


def test_without_comfyuis_ram_check_free_ram_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ComfyUI without ensure_pin_budget (0.8.0): new pinned RAM only with RAM_HEADROOM left free beside it (in a
    container, below its memory limit)."""
    comfyui_in_process_or_skip()
    import types

    import comfy.model_management as mm
    import psutil

    from comfyui_lowvram_dit.host import pin_budget
    from comfyui_lowvram_dit.offload import machine_ram
    from comfyui_lowvram_dit.offload.machine_ram import CgroupMemory

    monkeypatch.delattr(mm, "ensure_pin_budget", raising=False)
    free = 10 << 30
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(total=64 << 30, available=free))
    monkeypatch.setattr(machine_ram, "cgroup_memory", lambda: None)
    assert pin_budget.ram_allows(free - pin_budget.RAM_HEADROOM)
    assert not pin_budget.ram_allows(free - pin_budget.RAM_HEADROOM + 1)
    # in a container of a 16 GiB limit with 12 GiB used, 4 GiB are free whatever the machine has
    monkeypatch.setattr(machine_ram, "cgroup_memory", lambda: CgroupMemory(16 << 30, 12 << 30))
    assert not pin_budget.ram_allows(1)
    monkeypatch.setattr(machine_ram, "cgroup_memory", lambda: CgroupMemory(16 << 30, 9 << 30))  # 7 GiB free
    assert pin_budget.ram_allows(3 << 30) and not pin_budget.ram_allows((3 << 30) + 1)
