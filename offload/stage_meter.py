"""Per-stage time and memory accounting: wall time, RSS (start, end, sampled peak) and CUDA memory.

Plain torch, no ComfyUI. The staged loaders report each stage with it (log lines and benchmark results).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

GIB = float(1 << 30)


def current_rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc; psutil elsewhere; 0 if neither works)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001 - accounting must never break a load
        return 0


def release_host_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc malloc_trim), so RSS really falls."""
    gc.collect()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, Windows, musl): the allocator decides
        pass


@dataclass
class StageReport:
    """Time and memory of one stage. VRAM peaks are None when CUDA was not used."""

    name: str
    seconds: float = 0.0
    rss_start: int = 0
    rss_end: int = 0
    rss_peak: int = 0  # sampled every ``interval`` s, so a spike shorter than that can be missed
    vram_peak: int | None = None  # torch.cuda.max_memory_allocated at the end (process peak unless reset)
    vram_end: int | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict (bytes as GiB, rounded)."""
        g = lambda b: None if b is None else round(b / GIB, 3)  # noqa: E731
        return {"stage": self.name, "seconds": round(self.seconds, 3), "rss_start_gib": g(self.rss_start),
                "rss_end_gib": g(self.rss_end), "rss_peak_gib": g(self.rss_peak), "vram_peak_gib": g(self.vram_peak),
                "vram_end_gib": g(self.vram_end), "notes": list(self.notes)}

    def format(self) -> str:
        """One log line: time, RSS start -> end (peak), VRAM peak/end."""
        s = (f"{self.name}: {self.seconds:.2f} s, RSS {self.rss_start / GIB:.2f} -> {self.rss_end / GIB:.2f} GiB "
             f"(peak {self.rss_peak / GIB:.2f} GiB)")
        if self.vram_peak is not None:
            s += f", VRAM peak {self.vram_peak / GIB:.2f} GiB, now {self.vram_end / GIB:.2f} GiB"
        if self.notes:
            s += "; " + "; ".join(self.notes)
        return s


class StageMeter:
    """Context manager measuring one stage: wall time, RSS (start, end, sampled peak) and CUDA memory.

    ``reset_cuda_peak`` resets torch's peak counters at the start (benchmarks do; nodes don't, because that
    would hide an earlier peak from whoever else reads the counters in this process).
    """

    def __init__(self, name: str, *, interval: float = 0.01, reset_cuda_peak: bool = False,
                 device: torch.device | None = None) -> None:
        self.report = StageReport(name)
        self._interval = interval
        self._reset = reset_cuda_peak
        self._device = device
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def _cuda(self) -> bool:
        dev = self._device
        return torch.cuda.is_available() and torch.cuda.is_initialized() and (dev is None or dev.type == "cuda")

    def _sample(self) -> None:
        while not self._stop.wait(self._interval):
            self.report.rss_peak = max(self.report.rss_peak, current_rss_bytes())

    def __enter__(self) -> StageMeter:
        if self._reset and self._cuda():
            torch.cuda.reset_peak_memory_stats(self._device)
        self.report.rss_start = self.report.rss_peak = current_rss_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="lowvram-dit-rss")
        self._thread.start()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._cuda():
            torch.cuda.synchronize(self._device)
        self.report.seconds = time.perf_counter() - self._t0
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.report.rss_end = current_rss_bytes()
        self.report.rss_peak = max(self.report.rss_peak, self.report.rss_end)
        if self._cuda():
            self.report.vram_peak = int(torch.cuda.max_memory_allocated(self._device))
            self.report.vram_end = int(torch.cuda.memory_allocated(self._device))
