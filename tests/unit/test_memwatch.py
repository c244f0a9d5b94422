"""memwatch (the runner's --report memory sampling) and the runner's API-format pass-through, on CPU."""

from __future__ import annotations

import mmap
import os
import sys
import time

import pytest

from comfyui_lowvram_dit.cli import memwatch, workflow


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_watch_sees_an_allocation_in_this_process() -> None:
    with memwatch.MemoryWatch(os.getpid(), interval=0.05) as watch:
        time.sleep(0.15)
        # 256 MiB of fresh private anonymous pages, touched so they are resident (a bytearray may reuse heap
        # memory a long-running process already holds, and then RSS does not move)
        block = mmap.mmap(-1, 256 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        for offset in range(0, len(block), 4096):
            block[offset] = 1
        # Wait for two samples taken after the pages were touched (a loaded machine can delay the sampler
        # thread far past any fixed sleep); the second one started after the allocation for sure.
        seen, deadline = len(watch.samples), time.monotonic() + 30
        while len(watch.samples) < seen + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    s = watch.summary()
    base = watch.samples[0]["anon"]
    assert max(x["anon"] for x in watch.samples) - base >= 200 << 20, watch.samples
    assert s["peak_rss_hwm_gib"] >= s["peak_rss_sampled_gib"] > 0
    assert s["peak_gpu_gib"] is None or s["peak_gpu_gib"] >= 0
    block.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="reads /proc/<pid>/io")
def test_watch_counts_what_the_process_read_from_storage(tmp_path) -> None:
    """A file written with O_DIRECT-free writes, dropped from the page cache, then read: the read reaches storage."""
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(32 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the pages leave the cache (written back first)
        with memwatch.MemoryWatch(os.getpid(), interval=0.05, gpu=False) as watch:
            time.sleep(0.1)
            while os.read(fd, 1 << 20):
                pass
    finally:
        os.close(fd)
    read = watch.summary()["disk_read_gib"]
    if read == 0.0:
        pytest.skip("this filesystem serves the file without storage reads (tmpfs or a cache that kept it)")
    assert read >= 16 / 1024, watch.samples  # at least half of the 32 MiB came from storage
    assert memwatch.disk_read_bytes(os.getpid()) >= int(read * memwatch.GIB)


def test_proc_status_of_a_missing_pid_is_empty() -> None:
    assert memwatch.proc_status(2**31 - 1) == {}
    assert memwatch.disk_read_bytes(2**31 - 1) is None
    assert memwatch.gpu_used_bytes(os.getpid(), None) is None


def test_api_workflows_pass_through_without_comfy_cli() -> None:
    api = {"3": {"class_type": "KSampler", "inputs": {"seed": 1}}}
    assert workflow.is_api_workflow(api)
    assert workflow.to_api(api, {}) is api
    assert not workflow.is_api_workflow({"nodes": [], "links": []})
    assert not workflow.is_api_workflow({})
