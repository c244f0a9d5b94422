"""Block Swap's plan when ComfyUI's activation estimate leaves no room for resident blocks: every block streams, and
the log says so once per shortfall, naming where the budget went (ComfyUI asks a model's size several times per load,
which used to repeat the warning each time)."""

from __future__ import annotations

import logging

import torch

from comfyui_lowvram_dit.host import block_swap
from comfyui_lowvram_dit.host import log as host_log
from comfyui_lowvram_dit.offload.plan import SwapConfig


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.diffusion_model = torch.nn.Module()
        self.diffusion_model.blocks = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(6))
        self.diffusion_model.head = torch.nn.Linear(256, 8)


def test_a_budget_eaten_by_activations_streams_every_block_and_says_why_once(monkeypatch, caplog) -> None:  # noqa: ANN001
    monkeypatch.setattr(host_log, "_SAID_ONCE", set())
    ctl = block_swap.SwapController(SwapConfig(vram_budget_gb=0.5, prefetch=1), _Tiny())
    ctl.activation_bytes = 700_000_000  # ComfyUI's estimate at this resolution: more than the whole budget
    with caplog.at_level(logging.WARNING, logger="comfyui_lowvram_dit"):
        plans = [ctl.make_plan(None) for _ in range(3)]
    assert all(p.streamed == tuple(range(6)) for p in plans)
    lines = [r.getMessage() for r in caplog.records if "Block Swap" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "vram_budget_gb 0.5 less ComfyUI's activation estimate (0.7 GB) leaves -0.2 GB for weights" in lines[0]
    with caplog.at_level(logging.WARNING, logger="comfyui_lowvram_dit"):
        ctl.make_plan(400_000)  # what ComfyUI offers varies per load; the budget above is the smaller one
    assert len([r for r in caplog.records if "Block Swap" in r.getMessage()]) == 1


def test_a_budget_with_room_plans_resident_blocks_and_says_nothing(monkeypatch, caplog) -> None:  # noqa: ANN001
    monkeypatch.setattr(host_log, "_SAID_ONCE", set())
    ctl = block_swap.SwapController(SwapConfig(vram_budget_gb=0.5, prefetch=1), _Tiny())
    ctl.activation_bytes = 0
    with caplog.at_level(logging.WARNING, logger="comfyui_lowvram_dit"):
        plan = ctl.make_plan(None)
    assert plan.streamed == ()
    assert not [r for r in caplog.records if "Block Swap" in r.getMessage()]


def test_the_budget_comfyui_offers_is_named_when_it_is_the_limit(monkeypatch, caplog) -> None:  # noqa: ANN001
    monkeypatch.setattr(host_log, "_SAID_ONCE", set())
    ctl = block_swap.SwapController(SwapConfig(prefetch=1), _Tiny())
    with caplog.at_level(logging.WARNING, logger="comfyui_lowvram_dit"):
        plan = ctl.make_plan(300_000)  # less than a ring of two 0.26 MB blocks
    assert plan.streamed == tuple(range(6))
    (line,) = [r.getMessage() for r in caplog.records if "Block Swap" in r.getMessage()]
    assert "the 0.0 GB ComfyUI offers for weights leaves 0.0 GB" in line
