"""Block Swap's choice for a model DynamicVRAM manages (offload/dynamic_vram_policy.py)."""

from __future__ import annotations

import pytest

from comfyui_lowvram_dit.offload.dynamic_vram_policy import GIB, steps_aside
from comfyui_lowvram_dit.offload.machine_ram import Ram


def _machine(total: float) -> Ram:
    return Ram(int(total), int(total) // 2, False, int(total))


def test_auto_steps_aside_where_ram_holds_the_model_and_16_gib() -> None:
    expert = int(14.3e9)  # one Wan 2.2 14B expert in fp8
    assert steps_aside("auto", _machine(64 * GIB), expert)[0]
    aside, why = steps_aside("auto", _machine(31.2 * GIB), expert)  # what a 32 GB machine reports
    assert aside and "this machine's 31 GiB of RAM" in why and "29 GiB (this model + 16)" in why
    aside, why = steps_aside("auto", _machine(24 * GIB), expert)
    assert not aside and "24 GiB" in why and "streaming keeps less" in why
    assert steps_aside("auto", _machine(24 * GIB), int(5e9))[0]  # the 5B model
    edge = expert + 16 * GIB
    assert steps_aside("auto", _machine(edge), expert)[0] and not steps_aside("auto", _machine(edge - 1), expert)[0]


def test_auto_reads_a_containers_memory_limit_not_the_machines_ram() -> None:
    expert = int(14.3e9)
    aside, why = steps_aside("auto", Ram(24 * GIB, 20 * GIB, True, 512 * GIB), expert)
    assert not aside and why.startswith("auto: this container's 24 GiB memory limit is less than 29 GiB")


def test_explicit_choices_and_a_bad_one() -> None:
    assert steps_aside("step aside", _machine(8 * GIB), 100 * GIB) == (True, "dynamic_vram = step aside")
    assert steps_aside("stream", _machine(1024 * GIB), 1) == (False, "dynamic_vram = stream")
    with pytest.raises(ValueError, match="Block Swap, dynamic_vram: 'sometimes'"):
        steps_aside("sometimes", _machine(GIB), GIB)
