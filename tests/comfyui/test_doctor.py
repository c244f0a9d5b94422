"""The Doctor: a complete report without a GPU, strict JSON, sourced known issues, swap advice, the node."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from comfy_server import comfyui_in_process_or_skip

import comfyui_lowvram_dit
from comfyui_lowvram_dit.doctor import advice, report as doctor
from comfyui_lowvram_dit.host.version import comfyui_version

SECTIONS = ("versions", "gpu", "memory", "fp8", "attention", "known_issues", "recommendation", "skipped")


@pytest.fixture(scope="module")
def cpu_report() -> dict:
    """The report as a machine without a GPU sees it (CUDA hidden even where a GPU exists)."""
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "is_available", lambda: False)
    try:
        return doctor.collect()
    finally:
        mp.undo()


def test_report_without_gpu_is_complete_and_says_what_was_skipped(cpu_report: dict) -> None:
    r = cpu_report
    assert all(k in r for k in SECTIONS)
    v = r["versions"]
    assert v["torch"] == torch.__version__ and v["python"] and v["numpy"] and v["safetensors"]
    assert v["pack"] == comfyui_lowvram_dit.__version__ != ""
    assert r["gpu"]["available"] is False and "is_available" in r["gpu"]["reason"]
    assert r["memory"]["ram_total_gib"] > 0 and r["memory"]["pin_test"]["status"] == "skip"
    assert any(s.startswith("GPU probes") for s in r["skipped"])
    fp8 = {p["path"]: p for p in r["fp8"]["probes"]}
    assert fp8["dequantize"]["status"] == "ok"  # dequantize + matmul runs on any device
    assert all(p["status"] == "skip" for name, p in fp8.items() if name != "dequantize")
    attn = {p["backend"]: p for p in r["attention"]["probes"]}
    assert attn["sdpa_math"]["status"] == "ok" and attn["sdpa_math"]["rel_err"] < 0.03
    assert r["recommendation"]["fp8"]["path"] == "dequantize"
    assert r["recommendation"]["swap"] == {"skipped": "no CUDA GPU"}
    text = doctor.format_report(r)
    for heading in ("Versions", "GPU", "Memory", "fp8 matmul paths", "Attention backends", "Known issues",
                    "Recommendation"):
        assert f"\n{heading}" in text, heading
    # Each skip is said once: on its probe's line (GPU-only ones share one), never again in a "Skipped" list.
    assert "\nSkipped" not in text
    assert text.count("[skip] GPU only:") == 2 and "no CUDA GPU" not in text.split("\nRecommendation")[0]
    assert text.count("scaled_mm_rowwise") == 1


def test_memory_names_a_container_limit_and_comfyuis_cap_from_the_machine(monkeypatch: pytest.MonkeyPatch,
                                                                        cpu_report: dict) -> None:
    """In a container of 48 GiB on a 512 GiB machine: RAM is the limit, ComfyUI's pin cap is what it reads (the
    machine's), and the report says both."""
    import types

    import psutil

    from comfyui_lowvram_dit.host import system_ram
    from comfyui_lowvram_dit.offload import machine_ram

    if system_ram.comfyui_reads_the_limit():
        pytest.skip("this ComfyUI reads the limit itself (the next test)")

    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(total=512 << 30, available=500 << 30))
    monkeypatch.setattr(machine_ram, "cgroup_memory", lambda: machine_ram.CgroupMemory(48 << 30, 8 << 30))
    mem = doctor.collect_memory({"available": False}, pin_test=False)
    assert (mem["ram_total_gib"], mem["ram_available_gib"], mem["ram_machine_gib"]) == (48.0, 40.0, 512.0)
    assert mem["comfyui_pin_cap_gib"] > 48
    text = doctor.format_report({**cpu_report, "memory": mem})
    assert "RAM 48.0 GiB total (this container's memory limit; the machine has 512.0 GiB" in text
    monkeypatch.setattr(machine_ram, "cgroup_memory", lambda: None)
    mem = doctor.collect_memory({"available": False}, pin_test=False)
    assert mem["ram_machine_gib"] is None and "container" not in doctor.format_report({**cpu_report, "memory": mem})


def test_without_psutil_the_doctor_reads_the_machines_ram_from_proc_meminfo(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    """psutil missing (a broken environment the Doctor is run to diagnose): RAM comes from /proc/meminfo, through the
    same reader the benchmarks use; where that file is missing too, the report has no RAM figures instead of an
    error."""
    import sys

    from comfyui_lowvram_dit.offload import machine_ram

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       33554432 kB\nMemFree:  1 kB\nMemAvailable:   25165824 kB\n", encoding="ascii")
    read = machine_ram.meminfo_bytes
    monkeypatch.setattr(machine_ram, "meminfo_bytes",
                        lambda field, text=None: read(field, meminfo.read_text("ascii")))
    monkeypatch.setitem(sys.modules, "psutil", None)  # `import psutil` raises ImportError
    mem = doctor.collect_memory({"available": False}, pin_test=False)
    assert (mem["ram_total_gib"], mem["ram_available_gib"], mem["ram_machine_gib"]) == (32.0, 24.0, None)
    meminfo.unlink()
    mem = doctor.collect_memory({"available": False}, pin_test=False)
    assert (mem["ram_total_gib"], mem["ram_available_gib"]) == (None, None)


def test_on_a_comfyui_that_reads_the_limit_the_pack_takes_its_figures(monkeypatch: pytest.MonkeyPatch,
                                                                     cpu_report: dict) -> None:
    """Newer ComfyUI caps its RAM figures at the container's limit itself (comfy.system_memory): the pack plans by
    those same figures, and the Doctor no longer says ComfyUI reads the machine's RAM."""
    comfyui_in_process_or_skip()
    import types

    import psutil

    from comfyui_lowvram_dit.host import system_ram
    from comfyui_lowvram_dit.offload import machine_ram
    from newer_comfyui import cgroup_aware_system_memory

    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(total=512 << 30, available=500 << 30))
    monkeypatch.setattr(machine_ram, "cgroup_memory", lambda: pytest.fail("the pack's own cgroup reading was used"))
    assert not system_ram.comfyui_reads_the_limit() or pytest.skip("this ComfyUI has comfy.system_memory")
    with cgroup_aware_system_memory(total=48 << 30, available=30 << 30, limit=48 << 30):
        assert system_ram.comfyui_reads_the_limit()
        assert system_ram.usable_ram() == machine_ram.Ram(48 << 30, 30 << 30, True, 512 << 30)
        mem = doctor.collect_memory({"available": False}, pin_test=False)
    assert (mem["ram_total_gib"], mem["ram_available_gib"], mem["ram_machine_gib"]) == (48.0, 30.0, None)
    assert mem["comfyui_pin_cap_gib"] < 48  # taken from the limit, as this ComfyUI does
    assert "the machine has" not in doctor.format_report({**cpu_report, "memory": mem})
    with cgroup_aware_system_memory(total=512 << 30, available=500 << 30, limit=None):  # no limit in effect
        assert system_ram.usable_ram() == machine_ram.Ram(512 << 30, 500 << 30, False, 512 << 30)


def test_no_gpu_probes_is_listed_as_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "collect_gpu", lambda: {"available": True, "index": 0, "name": "fake",
                                                        "capability": [9, 0], "vram_total_gib": 80.0,
                                                        "vram_free_gib": 79.0})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = doctor.collect(gpu_probes=False)
    assert "\nSkipped\n  GPU fp8/attention/pinned-memory probes: disabled" in doctor.format_report(r)


def _fake_comfyui(root: Path) -> Path:
    (root / "comfy").mkdir(parents=True)
    (root / "main.py").write_text("", encoding="utf-8")
    (root / "comfyui_version.py").write_text('__version__ = "0.8.0"\n', encoding="utf-8")
    pack = root / "custom_nodes" / "comfyui-lowvram-dit"
    pack.mkdir(parents=True)
    return pack


def test_comfyui_is_found_from_custom_nodes_or_named_how_to_point_at_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pack = _fake_comfyui(tmp_path / "ComfyUI")
    assert doctor.find_comfyui(cwd=pack) == (tmp_path / "ComfyUI", f"found above {pack}")
    assert doctor.find_comfyui(cwd=tmp_path / "ComfyUI")[0] == tmp_path / "ComfyUI"
    monkeypatch.chdir(pack)
    assert doctor.collect(gpu_probes=False)["versions"]["comfyui"] == "0.8.0"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert doctor.find_comfyui(cwd=elsewhere) == (None, doctor.COMFYUI_HINT)
    monkeypatch.setenv("COMFYUI_PATH", str(tmp_path / "ComfyUI"))
    assert doctor.find_comfyui(cwd=elsewhere) == (tmp_path / "ComfyUI", "COMFYUI_PATH")
    monkeypatch.delenv("COMFYUI_PATH")
    assert doctor.cli(["--no-gpu-probes"]) == 0
    out = capsys.readouterr()
    assert "COMFYUI_PATH=/path/to/ComfyUI" in out.out and "comfyui        -" in out.out
    assert "Doctor: probing attention backends" in out.err  # progress while it probes, on stderr


def test_cli_json_is_strict_and_text_mode_prints_the_report(capsys: pytest.CaptureFixture,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert doctor.cli(["--json"]) == 0
    data = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert all(k in data for k in SECTIONS)
    assert doctor.cli([]) == 0
    assert "Recommendation" in capsys.readouterr().out
    bad = {"x": float("inf"), "y": [float("nan")]}
    assert json.loads(doctor.to_json(bad)) == {"x": "inf", "y": ["nan"]}


def test_comfyui_version_is_read_from_comfyui_path_without_importing(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "comfyui_version.py").write_text('# generated\n__version__ = "0.8.0"\n', encoding="utf-8")
    assert comfyui_version(tmp_path) == "0.8.0"
    assert comfyui_version(tmp_path / "missing") is None
    monkeypatch.setenv("COMFYUI_PATH", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert doctor.collect(gpu_probes=False)["versions"]["comfyui"] == "0.8.0"
    assert doctor.collect(comfyui_version="0.9.1", gpu_probes=False)["versions"]["comfyui"] == "0.9.1"


def test_a_crashing_probe_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> dict:
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(doctor, "collect_gpu", boom)
    monkeypatch.setattr(doctor, "_probe_attention_with_pack", lambda *a: 1 / 0)
    r = doctor.collect()
    assert r["gpu"]["available"] is False and "driver initialization failed" in r["gpu"]["reason"]
    assert "ZeroDivisionError" in r["attention"]["error"]
    assert "Recommendation" in doctor.format_report(r)


def _fake_report(cpu_report: dict, *, name: str, cap: tuple[int, int], vram: float, torch_v: str, cuda: str,
                 arch: list[str], **versions: str | None) -> dict:
    r = copy.deepcopy(cpu_report)
    r["versions"].update(torch=torch_v, torch_cuda=cuda, **{"triton_import_error": None, **versions})
    r["gpu"] = {"available": True, "index": 0, "name": name, "capability": list(cap), "vram_total_gib": vram,
                "vram_free_gib": vram - 0.5, "arch_list": arch}
    r["memory"]["comfyui_pin_cap_gib"] = 60.0
    return r


def _ids(report: dict) -> set[str]:
    return {i["id"] for i in advice.known_issues(report)}


def test_known_issues_fire_only_for_their_sourced_combinations(cpu_report: dict) -> None:
    good = _fake_report(cpu_report, name="NVIDIA H100", cap=(9, 0), vram=80, torch_v="2.11.0+cu130", cuda="13.0",
                        arch=["sm_80", "sm_90", "sm_100", "sm_120"], comfyui="0.8.0", sageattention=None,
                        triton="3.6.0")
    assert _ids(good) == {"fp8_e4m3fn_fast_quality"}
    cu128 = _fake_report(cpu_report, name="NVIDIA H100", cap=(9, 0), vram=80, torch_v="2.11.0+cu128", cuda="12.8",
                         arch=["sm_90"], comfyui="0.8.0", triton="3.6.0", sageattention="1.0.6")
    assert {"blockwise_fp8_needs_cuda_12_9", "sage_fp8_black_output"} <= _ids(cu128)
    rtx50 = _fake_report(cpu_report, name="NVIDIA GeForce RTX 5090", cap=(12, 0), vram=32, torch_v="2.5.1+cu124",
                         cuda="12.4", arch=["sm_50", "sm_80", "sm_90", "compute_90"], comfyui="0.3.64",
                         triton="3.1.0")
    ids = _ids(rtx50)
    assert "comfyui_too_old" not in _ids(good) and "comfyui_too_old" in ids
    # compute_90 PTX JIT-compiles for newer GPUs, so only a missing sm_ arch AND no usable PTX fires.
    assert "gpu_arch_not_in_torch_build" not in ids and "no_rowwise_scaled_mm" in ids
    rtx50["gpu"]["arch_list"] = ["sm_50", "sm_80", "sm_90"]
    assert "gpu_arch_not_in_torch_build" in _ids(rtx50)
    for issue in advice.known_issues(cu128) + advice.known_issues(rtx50):
        assert issue["severity"] in ("error", "warn", "info")
        assert issue["source"] == "" or all(u.startswith("https://") for u in issue["source"].split()), issue
    rtx50["known_issues"], cu128["known_issues"] = advice.known_issues(rtx50), advice.known_issues(cu128)
    text = doctor.format_report(rtx50) + doctor.format_report(cu128)
    assert "source: https://github.com/" in text and "/work/" not in text
    assert all(".md" not in line for line in text.splitlines() if "source:" in line)


def test_broken_triton_and_missing_seams_are_reported(cpu_report: dict) -> None:
    r = _fake_report(cpu_report, name="NVIDIA H100", cap=(9, 0), vram=80, torch_v="2.11.0+cu130", cuda="13.0",
                     arch=["sm_90"], comfyui="0.9.0", sageattention=None, triton="3.6.0")
    assert {"triton_broken", "comfyui_seams_missing"}.isdisjoint(_ids(r))
    r["versions"]["triton_import_error"] = "ImportError: libcuda.so.1: cannot open shared object file"
    r["seams"] = {"wrappers.apply_model": "ok",
                  "wrappers.diffusion_model": "missing: comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL"}
    issues = {i["id"]: i for i in advice.known_issues(r)}
    assert "Triton 3.6.0 is installed but does not import (ImportError: libcuda" in issues["triton_broken"]["message"]
    seams = issues["comfyui_seams_missing"]
    assert seams["severity"] == "error" and "ComfyUI (0.9.0) lacks 1 seam(s)" in seams["message"]
    assert "wrappers.diffusion_model" in seams["message"] and "wrappers.apply_model" not in seams["message"]
    text = doctor.format_report(r)
    assert "\nComfyUI seams (host/seams.py)\n" in text
    assert "wrappers.diffusion_model  missing: comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL" in text


def test_collect_keeps_the_seam_status_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = doctor.collect(gpu_probes=False, seams={"attention.override": "ok"})
    assert r["seams"] == {"attention.override": "ok"} and "comfyui_seams_missing" not in _ids(r)
    assert "seams" not in doctor.collect(gpu_probes=False)


def test_block_swap_verdicts_get_their_section_only_inside_comfyui(cpu_report: dict) -> None:
    """The node passes the server's measured Block Swap lines ([] when none yet); the CLI passes nothing."""
    assert "Block Swap in this server" not in doctor.format_report(cpu_report)
    none_yet = doctor.format_report({**cpu_report, "block_swap_measured": []})
    assert "\nBlock Swap in this server" in none_yet and "nothing measured yet" in none_yet
    line = "[12:00:00] Block Swap measured (WanModel, 37 of 40 blocks streamed, prefetch 1): copies are hidden"
    text = doctor.format_report({**cpu_report, "block_swap_measured": [line]})
    assert f"\n  {line}\n" in text and "nothing measured yet" not in text
    assert doctor.collect(gpu_probes=False, swap_measured=[line])["block_swap_measured"] == [line]


def test_swap_advice_follows_vram(cpu_report: dict) -> None:
    swaps = {}
    for vram in (8.0, 16.0, 24.0, 80.0):
        r = _fake_report(cpu_report, name="GPU", cap=(8, 9), vram=vram, torch_v="2.11.0+cu130", cuda="13.0",
                         arch=["sm_89"])
        models = advice.recommend(r)["swap"]["models"]
        swaps[vram] = {m: e["blocks_to_swap"] for m, e in models.items()}
        for m, e in models.items():
            block_gib = advice.SWAP_MODELS[m]["block_gb"]["fp8"] * 1e9 / 2**30
            assert e["pinned_needed_gib"] == pytest.approx(e["blocks_to_swap"] * block_gib, abs=0.01)
    wan14 = "wan22_14B (one expert), 832x480x81"
    assert swaps[8.0][wan14] > swaps[16.0][wan14] > swaps[24.0][wan14] >= swaps[80.0][wan14] == 0
    # 8 GiB: 8 - 0.37 reserve - 0.8 minimum - 2.6 activations - 0.43 non-block = 3.79 GiB -> 11 of 40 fp8 blocks.
    assert swaps[8.0][wan14] == 40 - math.floor(3.79 / (0.352e9 / 2**30))
    assert all(v == 0 for v in swaps[80.0].values())


def test_recommendation_prefers_a_passing_fp8_matmul(cpu_report: dict) -> None:
    r = _fake_report(cpu_report, name="NVIDIA H100", cap=(9, 0), vram=80, torch_v="2.11.0+cu128", cuda="12.8",
                     arch=["sm_90"])
    r["fp8"] = {"selected": {"blockwise_128": "scaled_mm_blockwise"}, "probes": [
        {"path": "scaled_mm_blockwise", "status": "fail", "detail": "NotImplementedError"},
        {"path": "scaled_mm_rowwise", "status": "ok"}, {"path": "dequantize", "status": "ok"}]}
    r["attention"] = {"probes": [{"backend": "sdpa_flash", "status": "ok"}, {"backend": "sdpa_cudnn", "status": "fail"}],
                      "preference": ["sdpa_cudnn", "sdpa_flash"]}
    rec = advice.recommend(r)
    assert rec["fp8"]["path"] == "scaled_mm_rowwise" and rec["attention"]["backend"] == "sdpa_flash"


@pytest.mark.cuda
def test_report_on_a_gpu_runs_the_probes() -> None:
    r = doctor.collect()
    assert r["gpu"]["available"] and r["gpu"]["vram_total_gib"] > 0
    assert r["memory"]["pin_test"]["status"] == "ok" and r["memory"]["pin_test"]["h2d_pinned_gbps"] > 1
    assert {p["path"]: p["status"] for p in r["fp8"]["probes"]}["dequantize"] == "ok"
    assert any(p["status"] == "ok" for p in r["attention"]["probes"] if p["backend"].startswith("sdpa"))
    if tuple(r["gpu"]["capability"]) >= (8, 9):
        assert r["recommendation"]["fp8"]["path"] != "dequantize", r["fp8"]
    assert r["recommendation"]["swap"]["models"]


@pytest.mark.comfyui
def test_node_schema_is_valid_and_execute_returns_text_and_ui() -> None:
    from comfy_server import comfyui_path_or_reason, import_comfyui_in_process

    comfy, reason = comfyui_path_or_reason()
    assert comfy is not None, reason
    import_comfyui_in_process(comfy)
    from comfyui_lowvram_dit.nodes import doctor as doctor_node

    schema = doctor_node.Doctor.define_schema()
    schema.validate()
    assert schema.node_id == "LowVRAM_Doctor" and schema.is_output_node
    assert schema.category.endswith("/utils") and [o.io_type for o in schema.outputs] == ["STRING"]
    assert all(getattr(i, "tooltip", None) for i in schema.inputs)
    out = doctor_node.Doctor.execute(gpu_probes=False)
    text = out.result[0]

    assert "Recommendation" in text and f"comfyui        {comfyui_version()}" in text
    assert "\nComfyUI seams (host/seams.py)\n" in text and "dit.block_replace         ok" in text
    assert "missing:" not in text
    assert out.ui.as_dict() == {"text": (text,)}


@pytest.mark.comfyui
def test_doctor_node_runs_through_prompt(comfy_server) -> None:  # noqa: ANN001 - ComfyServer fixture
    assert comfy_server.object_info("LowVRAM_Doctor"), "Doctor node not registered"
    entry = comfy_server.run({"1": {"class_type": "LowVRAM_Doctor", "inputs": {"gpu_probes": True}}}, timeout=300)
    (text,) = entry["outputs"]["1"]["text"]
    assert "Versions" in text and "Recommendation" in text and "ComfyUI (running)" in text
