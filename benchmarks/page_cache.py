"""Model files out of the page cache, for renders that read them from the disk as a machine without spare RAM does.

A machine with 128 GiB of RAM keeps every model file it has read in its page cache, so a render there never waits
for the disk. A 32 GB machine cannot: each expert's file is read again from the disk at every switch. ``evict``
asks the kernel to drop a folder's files from the page cache (``posix_fadvise(DONTNEED)``, no root needed); pages
a process has mapped in stay. ``resident_bytes`` says how much of a file is cached (``mincore``), so the eviction
can be checked, and ``cold_read_gbs`` how fast this disk serves a file once it is evicted.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from pathlib import Path

PAGE = mmap.PAGESIZE


def supported() -> bool:
    """True where the kernel takes page-cache advice (Linux)."""
    return hasattr(os, "posix_fadvise")


def model_files(folder: Path) -> list[Path]:
    """Every regular file under ``folder`` (links followed to their files), each once."""
    seen: dict[Path, None] = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            seen.setdefault(path.resolve(), None)
    return list(seen)


def _drop(fd: int) -> None:
    """Drop the open file's pages from the page cache (written back first: dirty pages are not dropped)."""
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def evict(folder: Path) -> int:
    """Drop the page-cache pages of every file under ``folder``; the bytes of the files advised."""
    if not supported():
        raise RuntimeError("dropping files from the page cache needs posix_fadvise (Linux)")
    done = 0
    for path in model_files(folder):
        fd = os.open(path, os.O_RDONLY)
        try:
            _drop(fd)
            done += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return done


def resident_bytes(path: Path) -> int:
    """How many bytes of ``path`` are in the page cache now (``mincore`` over a read-only mapping of it)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    pages = -(-size // PAGE)
    with path.open("rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"mmap of {path.name} failed")
    try:
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), f"mincore of {path.name} failed")
        return min(sum(b & 1 for b in vec) * PAGE, size)
    finally:
        libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))


def cold_read_gbs(folder: Path, nbytes: int = 1 << 30) -> float | None:
    """GB/s of reading the first ``nbytes`` of the largest file under ``folder`` right after evicting it (None: no
    file); the file is left evicted."""
    files = model_files(folder)
    if not files:
        return None
    path = max(files, key=lambda p: p.stat().st_size)
    fd = os.open(path, os.O_RDONLY)
    try:
        _drop(fd)
        buf = bytearray(16 << 20)
        view, done = memoryview(buf), 0
        t0 = time.perf_counter()
        while done < nbytes and (n := os.readv(fd, [view])) > 0:
            done += n
        seconds = time.perf_counter() - t0
        _drop(fd)
    finally:
        os.close(fd)
    return done / 1e9 / max(seconds, 1e-9)
