"""The RAM this process can use: the machine's, or a container's memory limit where one is smaller.

psutil (and ComfyUI with it) reads ``/proc/meminfo``, which inside a container (Docker ``--memory``, a Kubernetes or
cloud pod) shows the host's RAM, not the container's limit; a process that plans by it is killed by the kernel's OOM
killer at the limit instead. The limit is the cgroup's: ``memory.max`` (cgroup v2) or ``memory.limit_in_bytes`` (v1)
of this process's cgroup and its ancestors, and what the cgroup uses is its charge less the inactive page cache the
kernel reclaims first (what ``docker stats`` and Kubernetes call the working set).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63; any limit above this is none
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class CgroupMemory:
    """A cgroup memory limit and what counts as used against it (the limit less the least headroom), in bytes."""

    limit: int
    used: int


@dataclass(frozen=True)
class Ram:
    """RAM as this process can use it (bytes), whether a container limit set it, and the machine's own total (what
    psutil reads)."""

    total: int
    available: int
    container_limit: bool
    machine_total: int

    def label(self) -> str:
        """'this machine's 32 GiB of RAM' or 'this container's 48 GiB memory limit', for log lines."""
        if self.container_limit:
            return f"this container's {self.total / GIB:.0f} GiB memory limit"
        return f"this machine's {self.total / GIB:.0f} GiB of RAM"


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _limit(path: Path) -> int | None:
    """A usable limit: a positive number below UNLIMITED ("max", 0, -1 and empty mean none)."""
    value = _read_int(path)
    return value if value and value < UNLIMITED else None


def _inactive_file(stat: Path, key: str) -> int:
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _chain(root: Path, path: str) -> list[Path]:
    """The cgroup's folder and its ancestors up to ``root``, innermost first; ``root`` alone where the path is not
    there (a container whose cgroup namespace shows its own cgroup as the root)."""
    inner = root / path.strip("/")
    if not inner.is_dir():
        return [root]
    chain = [inner]
    while chain[-1] != root and root in chain[-1].parents:
        chain.append(chain[-1].parent)
    return chain


def _lowest(chain: list[Path], limit_file: str, used_file: str, stat_key: str) -> CgroupMemory | None:
    """The lowest limit along ``chain`` and the least headroom any limited folder leaves (a parent shared with
    siblings can leave less than this cgroup's own limit), as (limit, limit - headroom)."""
    limit, headroom = None, None
    for folder in chain:
        if (mine := _limit(folder / limit_file)) is None:
            continue
        charged = _read_int(folder / used_file) or 0  # unreadable: the whole limit is free
        free = max(mine - max(charged - _inactive_file(folder / "memory.stat", stat_key), 0), 0)
        limit = mine if limit is None else min(limit, mine)
        headroom = free if headroom is None else min(headroom, free)
    return None if limit is None else CgroupMemory(limit, limit - min(headroom, limit))


def cgroup_memory(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> CgroupMemory | None:
    """The lowest memory limit on this process's cgroup and its ancestors (v2, else v1), with what counts as used
    against it; None where no limit applies or no cgroup file is readable (not Linux)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    found: list[CgroupMemory] = []
    for line in lines:
        _hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "" and (root / "cgroup.controllers").is_file():  # v2, mounted at the root
            mem = _lowest(_chain(root, path), "memory.max", "memory.current", "inactive_file")
        elif controllers == "" and (root / "unified" / "cgroup.controllers").is_file():  # v2 beside v1 (hybrid)
            mem = _lowest(_chain(root / "unified", path), "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1
            mem = _lowest(_chain(root / "memory", path), "memory.limit_in_bytes", "memory.usage_in_bytes",
                          "total_inactive_file")
        else:
            continue
        if mem is not None:
            found.append(mem)
    return min(found, key=lambda m: m.limit, default=None)


def meminfo_bytes(field: str, text: str | None = None) -> int:
    """A ``/proc/meminfo`` field in bytes (``MemAvailable``, ``MemTotal``): the machine's figures, what psutil reads."""
    text = Path("/proc/meminfo").read_text(encoding="ascii") if text is None else text
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name == field:
            return int(rest.split()[0]) * 1024
    raise RuntimeError(f"/proc/meminfo has no {field} line")


def usable_ram() -> Ram:
    """Total and available RAM for this process: psutil's, each capped by a smaller container limit."""
    import psutil

    vm = psutil.virtual_memory()
    total, available = int(vm.total), int(vm.available)
    return ram_from(total, available, cgroup_memory())


def ram_from(total: int, available: int, mem: CgroupMemory | None) -> Ram:
    """psutil's total and available capped by a cgroup limit below the machine's RAM."""
    if mem is None or mem.limit >= total:
        return Ram(total, available, False, total)
    return Ram(mem.limit, min(available, max(mem.limit - mem.used, 0)), True, total)
