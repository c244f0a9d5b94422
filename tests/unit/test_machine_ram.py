"""The RAM the pack plans by: the machine's, or a container's smaller cgroup memory limit (offload/machine_ram.py)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from comfyui_lowvram_dit.offload import machine_ram
from comfyui_lowvram_dit.offload.machine_ram import GIB, CgroupMemory, Ram, cgroup_memory, usable_ram

V1_NONE = str(9223372036854771712)  # what cgroup v1 writes for no limit


def _files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")


def _proc(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "proc_self_cgroup"
    path.write_text(text)
    return path


def test_cgroup_v2_takes_the_lowest_limit_up_the_tree_and_its_working_set(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _files(root, {"cgroup.controllers": "cpu memory",
                  "pod/memory.max": str(48 * GIB), "pod/memory.current": str(40 * GIB),
                  "pod/memory.stat": f"anon {30 * GIB}\ninactive_file {12 * GIB}\nactive_file {GIB}",
                  "pod/app/memory.max": "max", "pod/app/memory.current": str(39 * GIB)})
    mem = cgroup_memory(_proc(tmp_path, "0::/pod/app\n"), root)
    assert mem == CgroupMemory(limit=48 * GIB, used=28 * GIB)  # charged 40, of it 12 reclaimable page cache
    _files(root, {"pod/app/memory.max": str(32 * GIB), "pod/app/memory.current": str(4 * GIB)})
    # the lower limit further in is the total; the pod, shared with siblings, leaves 20 free, the app 28: 20
    assert cgroup_memory(_proc(tmp_path, "0::/pod/app\n"), root) == CgroupMemory(32 * GIB, 12 * GIB)
    _files(root, {"pod/memory.max": "0", "pod/app/memory.max": "-1"})  # unusable values mean no limit
    assert cgroup_memory(_proc(tmp_path, "0::/pod/app\n"), root) is None


def test_cgroup_v2_inside_a_namespace_reads_the_root_and_max_is_no_limit(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _files(root, {"cgroup.controllers": "memory", "memory.max": str(16 * GIB), "memory.current": str(GIB)})
    assert cgroup_memory(_proc(tmp_path, "0::/\n"), root) == CgroupMemory(16 * GIB, GIB)
    assert cgroup_memory(_proc(tmp_path, "0::/docker/abc\n"), root).limit == 16 * GIB  # path not visible: the root
    _files(root, {"memory.max": "max"})
    assert cgroup_memory(_proc(tmp_path, "0::/\n"), root) is None


def test_cgroup_v1_memory_controller_and_its_no_limit_number(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    proc = _proc(tmp_path, "9:name=systemd:/\n4:memory:/docker/abc\n3:cpuset:/\n0::/\n")
    _files(root, {"memory/memory.limit_in_bytes": V1_NONE, "memory/docker/abc/memory.limit_in_bytes": V1_NONE})
    assert cgroup_memory(proc, root) is None  # this is what a machine without a limit shows
    _files(root, {"memory/docker/abc/memory.limit_in_bytes": str(24 * GIB),
                  "memory/docker/abc/memory.usage_in_bytes": str(10 * GIB),
                  "memory/docker/abc/memory.stat": f"cache {5 * GIB}\ntotal_inactive_file {4 * GIB}"})
    assert cgroup_memory(proc, root) == CgroupMemory(24 * GIB, 6 * GIB)


def test_hybrid_layout_reads_v1_memory_beside_an_unlimited_unified_tree(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _files(root, {"unified/cgroup.controllers": "", "memory/memory.limit_in_bytes": str(20 * GIB)})
    assert cgroup_memory(_proc(tmp_path, "4:memory:/\n0::/\n"), root) == CgroupMemory(20 * GIB, 0)


def test_no_cgroup_files_means_no_limit(tmp_path: Path) -> None:
    assert cgroup_memory(tmp_path / "missing", tmp_path) is None
    assert cgroup_memory(_proc(tmp_path, "garbage\n\n"), tmp_path / "cg") is None


def _psutil(monkeypatch: pytest.MonkeyPatch, total: int, available: int) -> None:
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(total=total, available=available))


def test_usable_ram_is_capped_by_a_smaller_container_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    _psutil(monkeypatch, 512 * GIB, 400 * GIB)
    monkeypatch.setattr(machine_ram, "cgroup_memory", lambda: CgroupMemory(48 * GIB, 30 * GIB))
    ram = usable_ram()
    assert ram == Ram(48 * GIB, 18 * GIB, True, 512 * GIB)
    assert ram.label() == "this container's 48 GiB memory limit"
    monkeypatch.setattr(machine_ram, "cgroup_memory", lambda: CgroupMemory(48 * GIB, 60 * GIB))  # over its limit
    assert usable_ram().available == 0
    monkeypatch.setattr(machine_ram, "cgroup_memory", lambda: CgroupMemory(1024 * GIB, 0))  # above the machine
    assert usable_ram() == Ram(512 * GIB, 400 * GIB, False, 512 * GIB)
    monkeypatch.setattr(machine_ram, "cgroup_memory", lambda: None)
    assert usable_ram().label() == "this machine's 512 GiB of RAM"


def test_this_process_reads_its_own_cgroup_without_error() -> None:
    """Whatever this machine has: a limit is a positive number below 2**60 and the working set is not negative."""
    mem = cgroup_memory()
    assert mem is None or (0 < mem.limit < machine_ram.UNLIMITED and mem.used >= 0)
    ram = usable_ram()
    assert 0 < ram.total <= ram.machine_total and 0 <= ram.available <= ram.machine_total
