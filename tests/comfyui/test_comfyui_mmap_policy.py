"""Model files are mapped only where ComfyUI moves weights off the mapping at load: with --novram / --lowvram every
step reads host memory, and a mapping whose file is cut short meanwhile kills the server with SIGBUS."""

from __future__ import annotations

from typing import Any

import pytest
from comfy_server import comfyui_in_process_or_skip

pytestmark = pytest.mark.comfyui


@pytest.fixture
def comfy() -> Any:
    comfyui_in_process_or_skip()


@pytest.mark.parametrize("state,mapped", [("NORMAL_VRAM", True), ("HIGH_VRAM", True), ("NO_VRAM", False),
                                          ("LOW_VRAM", False)])
def test_map_only_where_weights_leave_the_mapping(comfy, monkeypatch, state: str, mapped: bool) -> None:
    import comfy.model_management as mm
    import comfy.utils

    from comfyui_lowvram_dit.host.files import use_mmap

    monkeypatch.setattr(comfy.utils, "DISABLE_MMAP", False, raising=False)
    monkeypatch.setattr(mm, "vram_state", mm.VRAMState[state])
    assert use_mmap() is mapped


def test_disable_mmap_wins(comfy, monkeypatch) -> None:
    import comfy.model_management as mm
    import comfy.utils

    from comfyui_lowvram_dit.host.files import use_mmap

    monkeypatch.setattr(comfy.utils, "DISABLE_MMAP", True, raising=False)
    monkeypatch.setattr(mm, "vram_state", mm.VRAMState.NORMAL_VRAM)
    assert use_mmap() is False
