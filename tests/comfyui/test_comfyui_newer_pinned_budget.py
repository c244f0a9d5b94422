"""Block Swap's pinned host arena counts in ComfyUI's pinned-memory account (``TOTAL_PINNED_MEMORY`` against
``MAX_PINNED_MEMORY``), so page-locked RAM stays within ComfyUI's cap when newer ComfyUI refuses its own pins past
it; with no room, or pinning off in ComfyUI, the arena stays pageable. CPU only: registrations go to a fake
``cudart`` table (tests/fake_cudart.py). Needs COMFYUI_PATH."""

from __future__ import annotations

import logging

import pytest
import torch
from comfy_server import comfyui_in_process_or_skip
from fake_cudart import FakeCudart

pytestmark = pytest.mark.comfyui

CAP = 1 << 20


@pytest.fixture
def account(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    """ComfyUI's account with a 1 MiB cap, its pin_memory as newer ComfyUI runs it, a fake registration table."""
    comfyui_in_process_or_skip()
    import comfy.model_management as mm
    import comfy.sd  # noqa: F401 - imported before CUDA is faked: its import probes the real device
    from newer_comfyui import budgeted_pin_memory

    cudart = FakeCudart.install(monkeypatch)
    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", CAP)
    monkeypatch.setattr(mm, "TOTAL_PINNED_MEMORY", 0)
    monkeypatch.setattr(mm, "PINNED_MEMORY", {})
    monkeypatch.setattr(mm, "discard_cuda_async_error", lambda: None)
    monkeypatch.setattr(mm, "pin_memory", budgeted_pin_memory)
    return cudart


def _activated_swap():  # noqa: ANN202 - (ModelPatcher, SwapController)
    import comfy.sd

    from comfyui_lowvram_dit.offload.plan import SwapConfig
    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY, apply_block_swap
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    sd = synth.synthetic_state_dict("wan21_t2v_1_3B", size="tiny", fmt="bf16", seed=0, num_layers=4)
    plain = comfy.sd.load_diffusion_model_state_dict(sd, {"dtype": torch.bfloat16})
    swapped = apply_block_swap(plain, SwapConfig(blocks_to_swap=2, prefetch=1))
    swapped.load(torch.device("cpu"))  # a CPU "ring": the arena is built, not pinned (no CUDA device)
    return swapped, swapped.attachments[SWAP_KEY]


def test_core_pins_and_the_arena_together_stay_within_comfyuis_cap(account: FakeCudart) -> None:
    import comfy.model_management as mm

    from comfyui_lowvram_dit.host.pin_budget import pinned_by_pack

    swapped, ctl = _activated_swap()
    arena = ctl.streamer.arena
    cap = mm.MAX_PINNED_MEMORY = 2 * arena.buffer.numel()
    assert arena.pin() and mm.TOTAL_PINNED_MEMORY == arena.buffer.numel() == pinned_by_pack()
    while mm.pin_memory(torch.empty(cap // 16, dtype=torch.uint8)):  # ComfyUI pins until its account is full
        pass
    assert cap // 2 <= sum(account.registered.values()) <= cap
    swapped.detach()  # unload: the arena is unregistered and leaves the account
    assert not arena.pinned and mm.TOTAL_PINNED_MEMORY == sum(account.registered.values())
    assert pinned_by_pack() == 0


def test_no_room_leaves_the_arena_pageable_with_one_warning(account: FakeCudart,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    import comfy.model_management as mm

    from comfyui_lowvram_dit.offload.host_memory import HostArena
    from comfyui_lowvram_dit.host.pin_budget import ComfyPinBudget

    mm.TOTAL_PINNED_MEMORY = CAP - 4096  # ComfyUI's own pins fill its account
    arena = HostArena(1 << 16, pin=False, budget=ComfyPinBudget())
    with caplog.at_level(logging.WARNING, logger="comfyui_lowvram_dit"):
        assert not arena.pin() and not arena.pin()
    assert account.registered == {} and mm.TOTAL_PINNED_MEMORY == CAP - 4096
    assert sum("pinned-memory budget has no room" in r.getMessage() for r in caplog.records) == 1
    mm.TOTAL_PINNED_MEMORY = 0  # room again (ComfyUI unloaded something): the next load pins
    assert arena.pin() and mm.TOTAL_PINNED_MEMORY == 1 << 16
    arena.unpin()
    assert mm.TOTAL_PINNED_MEMORY == 0


def test_pinning_off_in_comfyui_keeps_the_arena_pageable(account: FakeCudart) -> None:
    import comfy.model_management as mm

    from comfyui_lowvram_dit.offload.host_memory import HostArena
    from comfyui_lowvram_dit.host.pin_budget import ComfyPinBudget

    mm.MAX_PINNED_MEMORY = -1  # --disable-pinned-memory
    assert not HostArena(1 << 16, pin=True, budget=ComfyPinBudget()).pinned and account.registered == {}


def test_a_host_without_an_account_does_not_limit_the_arena(account: FakeCudart,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import comfy.model_management as mm

    from comfyui_lowvram_dit.offload.host_memory import HostArena
    from comfyui_lowvram_dit.host.pin_budget import ComfyPinBudget

    monkeypatch.delattr(mm, "TOTAL_PINNED_MEMORY")
    arena = HostArena(1 << 16, pin=True, budget=ComfyPinBudget())
    assert arena.pinned
    arena.unpin()
    assert account.registered == {}
