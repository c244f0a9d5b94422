"""A machine with less RAM than this one, for the render scenario (``server_render --ram-gib N``).

Users run the 14B experts on machines of 32-64 GB, where the page cache cannot keep every model file and pinned
memory competes with everything else. A GPU machine of 128 GiB hides that. Two parts emulate the smaller machine:
- a balloon process locks (``mlock``) what this machine has available beyond N GiB, so whatever the servers, their
  pinned buffers and the page cache need comes out of N GiB for real (the kernel evicts file pages and, past that,
  kills), and
- each ComfyUI server starts with ``ram_limit_site`` first on its ``PYTHONPATH``: its ``sitecustomize`` makes
  ``psutil.virtual_memory()`` report N GiB as the total (available as it is, never above N), so ComfyUI's pinned
  memory budget and the pack's RAM rules see the machine a user has. Native and pack servers get the same.
Linux only; ``mlock`` of that much needs root or CAP_IPC_LOCK with a large enough RLIMIT_MEMLOCK.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from comfyui_lowvram_dit.offload.machine_ram import meminfo_bytes

GIB = 1 << 30
SITE = Path(__file__).with_name("ram_limit_site")  # holds the servers' sitecustomize
TOTAL_ENV = "LOWVRAM_BENCH_RAM_TOTAL"  # bytes the servers' psutil reports as the machine's total
CHUNK = GIB  # the balloon locks its memory a chunk at a time
SAFETY = GIB  # what the balloon always leaves available besides the emulated machine's RAM
EXIT_S = 900.0  # how long a balloon that did not report "locked" gets to exit before its error is read


def balloon_bytes(ram_gib: float, available: int) -> int:
    """What the balloon locks so that ``ram_gib`` of ``available`` bytes stay for everything else."""
    want = int(ram_gib * GIB)
    if want <= 0:
        raise ValueError(f"--ram-gib {ram_gib:g}: give the emulated machine's RAM in GiB, more than 0")
    if want >= available:
        raise ValueError(f"--ram-gib {ram_gib:g}: this machine has only {available / GIB:.1f} GiB available, so a "
                         "smaller machine cannot be emulated here")
    return available - want


def server_env(env: dict[str, str], ram_gib: float) -> dict[str, str]:
    """``env`` for a ComfyUI server that sees a machine of ``ram_gib`` (the site folder first on its path)."""
    path = [str(SITE), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SITE)]]
    return {**env, "PYTHONPATH": os.pathsep.join(path), TOTAL_ENV: str(int(ram_gib * GIB))}


@contextmanager
def emulated(ram_gib: float) -> Iterator[dict]:
    """A balloon holding this machine's RAM beyond ``ram_gib`` while the block runs; yields what it holds (for the
    report). Raises RuntimeError, naming --ram-gib, when the memory cannot be locked."""
    locked = balloon_bytes(ram_gib, meminfo_bytes("MemAvailable"))
    proc = subprocess.Popen([sys.executable, "-m", "comfyui_lowvram_dit.benchmarks.ram_limit", str(locked)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        started = time.monotonic()
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("locked"):
            proc.wait(timeout=EXIT_S)
            err = proc.stderr.read().strip() if proc.stderr else ""
            raise RuntimeError(f"--ram-gib {ram_gib:g}: the balloon could not lock {locked / GIB:.1f} GiB "
                               f"({err or 'it exited with ' + str(proc.returncode)})")
        yield {"ram_gib": ram_gib, "locked_gib": round(locked / GIB, 1),
               "machine_gib": round(meminfo_bytes("MemTotal") / GIB, 1),
               "lock_s": round(time.monotonic() - started, 1)}
    finally:
        if proc.stdin:
            proc.stdin.close()  # the balloon exits when its stdin closes
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _hold(nbytes: int) -> int:
    """The balloon: lock ``nbytes`` of anonymous memory, say so on stdout, keep it until stdin closes. Refuses, before
    locking anything, more than leaves SAFETY available (locking past it would bring the kernel's OOM killer)."""
    if nbytes > (available := meminfo_bytes("MemAvailable")) - SAFETY:
        print(f"{nbytes / GIB:.1f} GiB asked, {available / GIB:.1f} GiB available: the balloon keeps "
              f"{SAFETY / GIB:.0f} GiB free", file=sys.stderr, flush=True)
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    held = []
    while (done := sum(len(m) for m in held)) < nbytes:
        chunk = mmap.mmap(-1, min(CHUNK, nbytes - done))
        address = ctypes.addressof(ctypes.c_char.from_buffer(chunk))
        if libc.mlock(address, len(chunk)) != 0:
            err = ctypes.get_errno()
            print(f"mlock failed after {done / GIB:.1f} GiB: {os.strerror(err)} (needs root or CAP_IPC_LOCK and "
                  "RLIMIT_MEMLOCK)", file=sys.stderr, flush=True)
            return 2
        held.append(chunk)
    print(f"locked {nbytes}", flush=True)
    sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(_hold(int(sys.argv[1])))
