"""Block Swap and the file-backed weights step aside while ComfyUI's DynamicVRAM manages a model, with one log line
each, and stay active under the legacy patcher. DynamicVRAM only starts on a CUDA device (``ModelPatcherDynamic``
falls back to ``ModelPatcher`` for CPU load devices), so the dynamic patcher is stood in by the real patcher whose
``is_dynamic()`` answers True, the only thing the pack asks. In process, tiny Wan on the CPU; needs COMFYUI_PATH."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from comfy_server import comfyui_in_process_or_skip, sample_wan

pytestmark = pytest.mark.comfyui
LOGGER = "comfyui_lowvram_dit"


def _as_dynamic(patcher: Any) -> Any:
    patcher.is_dynamic = lambda: True
    return patcher


def _tiny_wan(tmp_path: Path, name: str, fmt: str = "fp8_scaled") -> Path:
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    return synth.write_synthetic("wan22_t2v_14B", tmp_path / name, size="tiny", fmt=fmt, seed=3, num_layers=4)


def _dynamic_wan(tmp_path: Path, name: str, caplog: pytest.LogCaptureFixture) -> Any:
    """A tiny fp8 Wan as DynamicVRAM would hold it, with the said-once log lines forgotten and INFO captured; skips
    where this ComfyUI has no DynamicVRAM (its ModelPatcher.clone takes no disable_dynamic)."""
    comfyui_in_process_or_skip()
    import inspect

    import comfy.model_patcher

    from comfyui_lowvram_dit.host import log
    from comfyui_lowvram_dit.host.wan_loader import load_wan_model

    if "disable_dynamic" not in inspect.signature(comfy.model_patcher.ModelPatcher.clone).parameters:
        pytest.skip("this ComfyUI has no DynamicVRAM (ModelPatcher.clone takes no disable_dynamic)")
    log._SAID_ONCE.clear()
    caplog.set_level(logging.INFO, logger=LOGGER)
    return _as_dynamic(load_wan_model(_tiny_wan(tmp_path, name), "per_tensor"))


def test_block_swap_under_dynamic_vram(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """dynamic_vram = stream: Block Swap takes a model it can rebuild off DynamicVRAM (ComfyUI's own protocol) and
    streams it; one it cannot rebuild (no ``cached_patcher_init``) it leaves to DynamicVRAM, saying so once."""
    comfyui_in_process_or_skip()
    import inspect

    import comfy.model_patcher

    from comfyui_lowvram_dit.offload.plan import SwapConfig
    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY, apply_block_swap
    from comfyui_lowvram_dit.host import log
    from comfyui_lowvram_dit.host.wan_loader import load_wan_model

    log._SAID_ONCE.clear()
    caplog.set_level(logging.INFO, logger=LOGGER)
    path = _tiny_wan(tmp_path, "dyn.safetensors")
    legacy = load_wan_model(path, "per_tensor")
    swapped = apply_block_swap(legacy, SwapConfig(blocks_to_swap=2))
    assert swapped is not legacy and SWAP_KEY in swapped.attachments  # the legacy patcher gets Block Swap

    if "disable_dynamic" in inspect.signature(comfy.model_patcher.ModelPatcher.clone).parameters:
        dynamic = _as_dynamic(load_wan_model(path, "per_tensor"))
        rebuilt = apply_block_swap(dynamic, SwapConfig(blocks_to_swap=2, dynamic_vram="stream"))
        assert rebuilt.model is not dynamic.model and not rebuilt.is_dynamic() and SWAP_KEY in rebuilt.attachments
        assert sum("leaves ComfyUI's DynamicVRAM" in r.getMessage() for r in caplog.records) == 1
        assert torch.isfinite(sample_wan(rebuilt, seed=2)).all()

    unbuildable = _as_dynamic(load_wan_model(path, "per_tensor"))
    unbuildable.cached_patcher_init = None
    for _ in range(2):
        assert apply_block_swap(unbuildable, SwapConfig(blocks_to_swap=2, dynamic_vram="stream")) is unbuildable
    said = [r.getMessage() for r in caplog.records if "Block Swap steps aside" in r.getMessage()]
    assert len(said) == 1 and "--disable-dynamic-vram" in said[0] and "cannot rebuild" in said[0]
    assert torch.isfinite(sample_wan(unbuildable, seed=2)).all()  # the model it passed on still samples


def _dynamic_wan_wanting_21_gib(tmp_path: Path, name: str) -> Any:
    """A tiny Wan model under ComfyUI's DynamicVRAM that says it is 5 GiB (Block Swap auto wants model + 16 GiB of
    RAM to leave it there); skips where this ComfyUI has no DynamicVRAM."""
    import inspect

    import comfy.model_patcher

    from comfyui_lowvram_dit.host.wan_loader import load_wan_model

    if "disable_dynamic" not in inspect.signature(comfy.model_patcher.ModelPatcher.clone).parameters:
        pytest.skip("this ComfyUI has no DynamicVRAM (ModelPatcher.clone(disable_dynamic=...))")
    dynamic = _as_dynamic(load_wan_model(_tiny_wan(tmp_path, name), "per_tensor"))
    dynamic.model_size = lambda: 5 << 30
    return dynamic


@pytest.mark.parametrize(("ram_gib", "container_gib"), [(16, None), (64, None), (64, 16)])
def test_block_swap_auto_under_dynamic_vram_follows_the_ram(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch, ram_gib: int,
                                                            container_gib: int | None) -> None:
    """dynamic_vram = auto (the default): a machine whose RAM holds the model + 16 GiB leaves the model to DynamicVRAM
    (faster on the render tables), one with less streams it (less RAM), and so does a container whose memory limit
    is less, whatever the machine has; each says why once."""
    comfyui_in_process_or_skip()
    import types

    import psutil

    from comfyui_lowvram_dit.host import log
    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY, apply_block_swap
    from comfyui_lowvram_dit.offload import machine_ram
    from comfyui_lowvram_dit.offload.machine_ram import CgroupMemory
    from comfyui_lowvram_dit.offload.plan import SwapConfig

    dynamic = _dynamic_wan_wanting_21_gib(tmp_path, "auto.safetensors")  # 16 GiB are too few, 64 enough
    log._SAID_ONCE.clear()
    caplog.set_level(logging.INFO, logger=LOGGER)
    monkeypatch.setattr(psutil, "virtual_memory",
                        lambda: types.SimpleNamespace(total=ram_gib << 30, available=(ram_gib << 30) // 2))
    limit = container_gib and CgroupMemory(container_gib << 30, 1 << 30)
    monkeypatch.setattr(machine_ram, "cgroup_memory", lambda: limit or None)  # the test machine's own cgroup aside
    out = apply_block_swap(dynamic, SwapConfig(blocks_to_swap=2))
    said = " ".join(r.getMessage() for r in caplog.records)
    if (container_gib or ram_gib) == 16:
        assert out is not dynamic and SWAP_KEY in out.attachments and "leaves ComfyUI's DynamicVRAM" in said
        where = "this container's 16 GiB memory limit" if container_gib else "this machine's 16 GiB of RAM"
        assert f"auto: {where} is less than 21 GiB" in said
    else:
        assert out is dynamic and "steps aside (auto: this machine's 64 GiB of RAM holds" in said


def test_block_swap_auto_plans_by_a_newer_comfyuis_container_figures(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """On a ComfyUI that caps its RAM figures at the container's limit itself (comfy.system_memory, after 0.33),
    Block Swap auto plans by those figures, not by the pack's own cgroup reading: a 16 GiB container on a 64 GiB
    machine streams, and the same ComfyUI without a limit in effect leaves the model to DynamicVRAM."""
    comfyui_in_process_or_skip()
    import types

    import psutil

    from comfyui_lowvram_dit.host import log
    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY, apply_block_swap
    from comfyui_lowvram_dit.offload import machine_ram
    from comfyui_lowvram_dit.offload.plan import SwapConfig
    from newer_comfyui import cgroup_aware_system_memory

    dynamic = _dynamic_wan_wanting_21_gib(tmp_path, "newer.safetensors")
    caplog.set_level(logging.INFO, logger=LOGGER)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(total=64 << 30, available=60 << 30))
    monkeypatch.setattr(machine_ram, "cgroup_memory", lambda: pytest.fail("the pack's own cgroup reading was used"))
    log._SAID_ONCE.clear()
    with cgroup_aware_system_memory(total=16 << 30, available=12 << 30, limit=16 << 30):
        out = apply_block_swap(dynamic, SwapConfig(blocks_to_swap=2))
    said = " ".join(r.getMessage() for r in caplog.records)
    assert out is not dynamic and SWAP_KEY in out.attachments
    assert "auto: this container's 16 GiB memory limit is less than 21 GiB" in said
    log._SAID_ONCE.clear()
    caplog.clear()
    with cgroup_aware_system_memory(total=64 << 30, available=60 << 30, limit=None):
        out = apply_block_swap(dynamic, SwapConfig(blocks_to_swap=2))
    assert out is dynamic and "steps aside (auto: this machine's 64 GiB of RAM holds" in caplog.text


def test_file_backed_offload_steps_aside_under_dynamic_vram(tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    comfyui_in_process_or_skip()
    from comfyui_lowvram_dit.host import log
    from comfyui_lowvram_dit.host.mapped_weights import MappedWeightsMixin, keep_file_backed
    from comfyui_lowvram_dit.host.wan_loader import load_wan_model

    log._SAID_ONCE.clear()
    caplog.set_level(logging.WARNING, logger=LOGGER)
    patcher = load_wan_model(_tiny_wan(tmp_path, "mapped.safetensors"), "per_tensor")
    assert isinstance(patcher, MappedWeightsMixin)  # the loader keeps mapped weights file-backed by default

    dynamic = _as_dynamic(patcher.clone())
    # the patcher class without the mixin, as a fresh load gives
    dynamic.__class__ = next(c for c in type(patcher).__mro__ if not issubclass(c, MappedWeightsMixin))
    assert not isinstance(dynamic, MappedWeightsMixin)
    assert keep_file_backed(dynamic) is dynamic and not isinstance(dynamic, MappedWeightsMixin)
    assert sum("file-backed offload steps aside" in r.getMessage() for r in caplog.records) == 1


def test_fp8_models_are_built_as_unetloader_builds_and_keep_a_reload_factory(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    comfyui_in_process_or_skip()
    import functools
    import inspect

    import comfy.sd

    from comfyui_lowvram_dit.host.wan_loader import load_wan_model

    real = comfy.sd.load_diffusion_model_state_dict
    asked: list[object] = []

    @functools.wraps(real)
    def spy(*args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs.get("disable_dynamic"))
        return real(*args, **kwargs)

    monkeypatch.setattr(comfy.sd, "load_diffusion_model_state_dict", spy)
    fp8 = load_wan_model(_tiny_wan(tmp_path, "legacy.safetensors"), "per_tensor")
    plain = load_wan_model(_tiny_wan(tmp_path, "plain.safetensors", "bf16"), "none")
    if "disable_dynamic" not in inspect.signature(real).parameters:  # a host without DynamicVRAM
        assert asked == [None, None] and not hasattr(fp8, "cached_patcher_init")
        return
    # fp8 layers take their weights through ComfyUI's cast (test_comfyui_fp8_dynamic.py), so DynamicVRAM may
    # manage them exactly as it manages UNETLoader's models
    assert asked == [False, False]
    factory, args = fp8.cached_patcher_init
    again = factory(*args, disable_dynamic=True)  # what ComfyUI calls for a non-dynamic copy
    assert type(again).__name__ == type(fp8).__name__ and plain.cached_patcher_init[0] is load_wan_model
    assert fp8.clone(disable_dynamic=True).model is fp8.model


def test_seams_hold_with_dynamic_vram_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under DynamicVRAM ComfyUI's layers start without weight tensors; the behaviour probes must still pass."""
    comfyui_in_process_or_skip()
    from comfyui_lowvram_dit.host import seams

    memory = pytest.importorskip("comfy.memory_management", reason="this ComfyUI has no DynamicVRAM")
    if not hasattr(memory, "aimdo_enabled"):
        pytest.skip("this ComfyUI has no DynamicVRAM")
    monkeypatch.setattr(memory, "aimdo_enabled", True)
    seams.forget_probe_results()
    try:
        status = seams.seam_status()
    finally:
        seams.forget_probe_results()
    assert {k: v for k, v in status.items() if v != "ok"} == {}


def test_torch_compile_takes_the_model_off_dynamic_vram(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """As ComfyUI's TorchCompileModel: a rebuilt legacy copy (compiled regions must not hold DynamicVRAM's casts),
    with the pack's file-backed offload given back to it; a legacy model is compiled as it is."""
    comfyui_in_process_or_skip()
    import inspect

    import comfy.model_patcher

    if "disable_dynamic" not in inspect.signature(comfy.model_patcher.ModelPatcher.clone).parameters:
        pytest.skip("this ComfyUI has no DynamicVRAM (ModelPatcher.clone takes no disable_dynamic)")
    from comfyui_lowvram_dit.host import log
    from comfyui_lowvram_dit.host.mapped_weights import MappedWeightsMixin
    from comfyui_lowvram_dit.host.torch_compile import COMPILE_KEY, apply_compile
    from comfyui_lowvram_dit.host.wan_loader import load_wan_model
    from comfyui_lowvram_dit.kernels.compile import CompileConfig

    log._SAID_ONCE.clear()
    caplog.set_level(logging.INFO, logger=LOGGER)
    path = _tiny_wan(tmp_path, "compile.safetensors")
    dynamic = _as_dynamic(load_wan_model(path, "per_tensor"))
    compiled = apply_compile(dynamic, CompileConfig(), compile_fn=lambda module, **_: module)
    assert compiled.model is not dynamic.model and not compiled.is_dynamic()
    assert isinstance(compiled, MappedWeightsMixin) and COMPILE_KEY in compiled.attachments
    assert sum("leaves ComfyUI's DynamicVRAM" in r.getMessage() for r in caplog.records) == 1
    legacy = load_wan_model(path, "per_tensor")
    assert apply_compile(legacy, CompileConfig(), compile_fn=lambda module, **_: module).model is legacy.model


def test_torch_compile_passes_through_a_model_larger_than_the_card(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Under DynamicVRAM, a model whose weights do not fit the card stays with DynamicVRAM, uncompiled, with one log
    line: the legacy loading would stream it layer by layer (slower), and each streamed layer breaks a compiled
    block. One that fits is taken off DynamicVRAM and compiled as before."""
    dynamic = _dynamic_wan(tmp_path, "big.safetensors", caplog)
    import comfy.model_management as mm

    from comfyui_lowvram_dit.host.torch_compile import COMPILE_KEY, apply_compile
    from comfyui_lowvram_dit.kernels.compile import CompileConfig

    gib = 1 << 30
    dynamic.model_size = lambda: 14.3 * gib  # a Wan 2.2 14B expert in fp8
    monkeypatch.setattr(mm, "get_total_memory", lambda *a, **k: 140 * gib)  # an H200
    for card, passes in ((12, True), (16, False), (24, False)):  # a smaller card as a server's --reserve-vram makes it
        monkeypatch.setattr(mm, "EXTRA_RESERVED_VRAM", (140 - card) * gib)
        out = apply_compile(dynamic, CompileConfig(), compile_fn=lambda module, **_: module)
        assert (out is dynamic) == passes and (COMPILE_KEY in out.attachments) != passes, card
    said = [r.getMessage() for r in caplog.records if "passes this model through" in r.getMessage()]
    assert len(said) == 1 and "(14.3 GiB) do not fit the 11.2 GiB" in said[0] and "DynamicVRAM keeps" in said[0], said


def test_torch_compile_passes_through_a_model_whose_compile_did_not_pay(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """With `when` = it pays, a model whose every timed input shape on this kind of GPU kept eager (in an earlier
    run: the decisions file) stays with DynamicVRAM, uncompiled, with one log line, instead of being rebuilt for the
    legacy loading only to run eager. Where one shape kept compile, or nothing was timed, or `when` = always, or for
    another config, the node takes the model off DynamicVRAM and compiles as before."""
    dynamic = _dynamic_wan(tmp_path, "paid.safetensors", caplog)
    import comfy.model_management as mm
    import torch

    from comfyui_lowvram_dit.host import torch_compile
    from comfyui_lowvram_dit.host.torch_compile import COMPILE_KEY, PAYS, apply_compile
    from comfyui_lowvram_dit.kernels import compile_pays, decision_store
    from comfyui_lowvram_dit.kernels.compile import CompileConfig

    kind = ("cuda", "NVIDIA H200", 9, 0)
    gib = 1 << 30
    dynamic.load_device = torch.device("cuda", 0)  # as on a GPU; nothing runs on it here
    monkeypatch.setattr(mm, "get_total_memory", lambda *a, **k: 140 * gib)
    monkeypatch.setattr(torch_compile, "device_kind", lambda device: kind)
    name, sig = type(dynamic.model).__name__, (((1, 16, 21, 60, 104), "torch.bfloat16", "cuda"),)
    PAYS.clear()
    decision_store.keep_in(tmp_path / "decisions.json")
    try:
        def compiles(config: CompileConfig = CompileConfig(), when: str = "it pays") -> bool:
            out = apply_compile(dynamic, config, when=when, compile_fn=lambda module, **_: module)
            return out is not dynamic and COMPILE_KEY in out.attachments

        assert compiles()  # nothing timed yet
        decision_store.keep(compile_pays.TOPIC, (name, sig, kind, "inductor/default"), "eager")
        decision_store.keep(compile_pays.TOPIC, (name, sig, ("cuda", "NVIDIA H100", 9, 0), "inductor/default"),
                            "compiled")  # another kind of GPU: not this one's verdict
        assert not compiles() and compiles(when="always")
        assert compiles(CompileConfig(mode="max-autotune-no-cudagraphs"))  # another config: never timed
        said = [r.getMessage() for r in caplog.records if "passes this model through, uncompiled" in r.getMessage()]
        assert len(said) == 1 and "did not pay on cuda NVIDIA H200 (SM 9.0) at the 1 input shape(s)" in said[0], said
        decision_store.keep(compile_pays.TOPIC, (name, (((1, 16, 21, 90, 160), "torch.bfloat16", "cuda"),), kind,
                                                 "inductor/default"), "compiled")  # 720p paid
        assert compiles()
    finally:
        decision_store.keep_in(None)
        PAYS.clear()
