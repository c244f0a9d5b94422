"""The Doctor's lines for the running ComfyUI's compiler, CUDA-graph, ``--fast`` and pinned-memory settings
(doctor/host.py): read from whatever the host has, "not in this ComfyUI" for what it lacks."""

from __future__ import annotations

import enum
from types import SimpleNamespace

import pytest
from comfy_server import comfyui_in_process_or_skip

from comfyui_lowvram_dit.doctor import host as dh


class Feature(enum.Enum):  # what comfy.cli_args.PerformanceFeature values look like
    Fp16Accumulation = "fp16_accumulation"
    AutoTune = "autotune"


NEWER_ARGS = dict(disable_comfy_compiler=False, disable_cuda_graphs=False, assert_graph_breaks=False,
                  fast={Feature.Fp16Accumulation, Feature.AutoTune}, disable_pinned_memory=False, fast_disk=False)


def test_a_newer_comfyui_with_everything_on() -> None:
    args = SimpleNamespace(**NEWER_ARGS)
    mm = SimpleNamespace(MAX_PINNED_MEMORY=40 * 2**30, TOTAL_PINNED_MEMORY=3 * 2**30)
    prefetch = SimpleNamespace(malloc_graph_enabled=lambda device: device == "cuda:0")
    out = dh.engine_settings(args, mm, prefetch, "cuda:0", pack_pinned_bytes=2**30)
    assert out["comfy_compiler"].startswith("on (") and out["cuda_graphs"].startswith("allowed")
    assert out["fast"].startswith("autotune, fp16_accumulation; fp16 accumulation on")
    assert out["pinned_memory"] == "cap 40.0 GiB, 3.00 GiB pinned now (1.00 GiB of it Block Swap arenas)"
    assert out["assert_graph_breaks"] == "off" and out["fast_disk"] == "off"
    assert dh.compiler_setting(args, prefetch, "cpu") == "off (needs DynamicVRAM on a CUDA device)"


def test_switches_that_turn_things_off_are_named() -> None:
    args = SimpleNamespace(**{**NEWER_ARGS, "disable_comfy_compiler": True, "disable_pinned_memory": True,
                              "fast": set()})
    mm = SimpleNamespace(MAX_PINNED_MEMORY=-1, TOTAL_PINNED_MEMORY=0)
    out = dh.engine_settings(args, mm)
    assert out["comfy_compiler"] == out["cuda_graphs"] == "off (--disable-comfy-compiler)"
    assert out["fast"] == "none" and out["pinned_memory"].startswith("off (--disable-pinned-memory")
    assert dh.cuda_graphs_setting(SimpleNamespace(disable_cuda_graphs=True)) == "off (--disable-cuda-graphs)"
    assert dh.pinned_setting(SimpleNamespace(), mm) == "off (no CUDA / ROCm device)"


def test_an_older_comfyui_reads_not_in_this_comfyui() -> None:
    out = dh.engine_settings(SimpleNamespace(fast=set()), SimpleNamespace())
    assert out == {"comfy_compiler": dh.MISSING, "cuda_graphs": dh.MISSING, "assert_graph_breaks": dh.MISSING,
                   "fast": "none", "pinned_memory": dh.MISSING, "fast_disk": dh.MISSING}


def test_a_failing_host_probe_is_a_line_not_an_error() -> None:
    def broken(device: object) -> bool:
        raise RuntimeError("moved")

    line = dh.compiler_setting(SimpleNamespace(**NEWER_ARGS), SimpleNamespace(malloc_graph_enabled=broken), None)
    assert line == "unknown (RuntimeError: moved)"


@pytest.mark.comfyui
def test_the_node_reports_the_running_comfyuis_settings() -> None:
    comfyui_in_process_or_skip()
    from comfy.cli_args import args

    from comfyui_lowvram_dit.doctor.comfyui_info import comfyui_host_info

    _, host = comfyui_host_info()
    for key, flag in (("comfy_compiler", "disable_comfy_compiler"), ("cuda_graphs", "disable_cuda_graphs"),
                      ("assert_graph_breaks", "assert_graph_breaks"), ("fast_disk", "fast_disk")):
        assert (host[key] == dh.MISSING) == (not hasattr(args, flag)), key
    assert host["fast"] == "none" and host["pinned_memory"] != ""
    assert "engine_settings_error" not in host


@pytest.mark.comfyui
def test_the_node_reads_block_swaps_verdicts_from_the_loaded_host_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Doctor finds Block Swap's module under the pack's own name (read from sys.modules, never imported)."""
    comfyui_in_process_or_skip()
    import sys

    from comfyui_lowvram_dit.doctor import comfyui_info
    from comfyui_lowvram_dit.host import block_swap

    monkeypatch.setattr(block_swap, "_measured", {"m": "Block Swap measured (WanModel): copies are hidden"})
    assert comfyui_info.block_swap_verdicts() == ["Block Swap measured (WanModel): copies are hidden"]
    monkeypatch.delitem(sys.modules, block_swap.__name__)
    assert comfyui_info.block_swap_verdicts() is None
