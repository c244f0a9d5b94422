"""Watch one process's memory from outside: peak RSS (anonymous vs file-backed) and GPU memory, sampled.

The runner uses it to report what a ComfyUI run really took, as the user's system monitor would show it:
``VmHWM`` from ``/proc/<pid>/status`` (the kernel's own peak RSS), ``RssAnon``/``RssFile`` samples (pinned and
heap memory vs mmapped model files that the kernel can drop), and the process's GPU memory from ``nvidia-smi``
(CUDA context + everything the caching allocator holds), and the bytes the process made the kernel read from the
storage (``read_bytes`` of ``/proc/<pid>/io``: page-cache hits are not counted, so a model file that the page cache
lost shows up there). Linux only for RSS and reads; without ``nvidia-smi`` the GPU columns stay empty. Sampling runs
on a daemon thread and never raises into the caller.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from pathlib import Path

KIB = 1024
GIB = float(1 << 30)


def proc_fields(pid: int, name: str) -> dict[str, str] | None:
    """``key: value`` lines of ``/proc/<pid>/<name>`` (status, io), values stripped; None where unreadable."""
    try:
        text = Path(f"/proc/{pid}/{name}").read_text()
    except OSError:
        return None
    return {key: value.strip() for key, _, value in (line.partition(":") for line in text.splitlines())}


def proc_status(pid: int) -> dict[str, int]:
    """The byte-valued fields of ``/proc/<pid>/status`` (VmRSS, VmHWM, RssAnon, RssFile, RssShmem ...)."""
    out: dict[str, int] = {}
    for key, value in (proc_fields(pid, "status") or {}).items():
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            out[key] = int(parts[0]) * KIB
    return out


def disk_read_bytes(pid: int) -> int | None:
    """Bytes ``pid`` (all its threads, living and ended) made the kernel fetch from storage; None where unreadable."""
    value = (proc_fields(pid, "io") or {}).get("read_bytes", "")
    return int(value) if value.isdigit() else None


def gpu_used_bytes(pid: int, nvidia_smi: str | None, timeout: float = 5.0) -> int | None:
    """GPU memory ``pid`` holds according to nvidia-smi (None when unknown, e.g. another pid namespace)."""
    if not nvidia_smi:
        return None
    try:
        res = subprocess.run([nvidia_smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    total = None
    for line in res.stdout.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid) and fields[1].isdigit():
            total = (total or 0) + int(fields[1]) * (1 << 20)  # MiB
    return total


class MemoryWatch:
    """Samples ``pid`` every ``interval`` seconds until ``stop()``; ``summary()`` gives the peaks in GiB.

    ``gpu=False`` skips nvidia-smi (a subprocess per sample) when the GPU side is measured some other way.
    """

    def __init__(self, pid: int, interval: float = 0.5, gpu: bool = True) -> None:
        self.pid = pid
        self.interval = interval
        self.samples: list[dict] = []  # {"t": s, "rss": B, "anon": B, "file": B, "gpu": B | None, "disk": B | None}
        self.marks: list[tuple[float, str]] = []
        self._nvidia_smi = shutil.which("nvidia-smi") if gpu else None
        self._stop = threading.Event()
        self.t0 = time.monotonic()  # a sample's "t" counts from here
        self._thread = threading.Thread(target=self._run, name="lowvram-memwatch", daemon=True)
        self._hwm = 0

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def mark(self, label: str) -> None:
        """Note a phase boundary (e.g. 'queued', 'finished') at the current time."""
        self.marks.append((round(time.monotonic() - self.t0, 2), label))

    def _sample(self) -> None:
        st = proc_status(self.pid)
        if not st:
            return
        self._hwm = max(self._hwm, st.get("VmHWM", 0))
        self.samples.append({"t": round(time.monotonic() - self.t0, 2), "rss": st.get("VmRSS", 0),
                             "anon": st.get("RssAnon", 0), "file": st.get("RssFile", 0),
                             "shmem": st.get("RssShmem", 0), "gpu": gpu_used_bytes(self.pid, self._nvidia_smi),
                             "disk": disk_read_bytes(self.pid)})

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._sample()
            except Exception:  # noqa: BLE001 - a monitor must never break the run it watches
                pass
            self._stop.wait(self.interval)

    def stop(self) -> None:
        """Stop sampling (takes one last sample first)."""
        if not self._stop.is_set():
            try:
                self._sample()
            except Exception:  # noqa: BLE001
                pass
            self._stop.set()
            if self._thread.is_alive():
                self._thread.join(timeout=10)

    def summary(self) -> dict:
        """Peaks in GiB: VmHWM (kernel peak RSS), sampled RSS/anon/file, GPU (None without nvidia-smi); the GiB read
        from storage between the first and the last sample (None where ``/proc/<pid>/io`` was unreadable)."""
        def peak(key: str) -> float | None:
            vals = [s[key] for s in self.samples if s.get(key) is not None]
            return round(max(vals) / GIB, 3) if vals else None

        reads = [s["disk"] for s in self.samples if s.get("disk") is not None]
        return {"peak_rss_hwm_gib": round(self._hwm / GIB, 3) if self._hwm else None,
                "peak_rss_sampled_gib": peak("rss"), "peak_rss_anon_gib": peak("anon"),
                "peak_rss_file_gib": peak("file"), "peak_gpu_gib": peak("gpu"),
                "disk_read_gib": round((reads[-1] - reads[0]) / GIB, 3) if reads else None,
                "samples": len(self.samples), "interval_s": self.interval}
