"""The emulated machine of less RAM for server_render --ram-gib (benchmarks/ram_limit.py): the balloon's size, the
servers' psutil view, the balloon process itself (a few KiB locked, so it runs anywhere) and the rows it names."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from comfyui_lowvram_dit.benchmarks import ram_limit
from comfyui_lowvram_dit.benchmarks import server_render as sr
from comfyui_lowvram_dit.benchmarks import server_render_report as rr

GIB = ram_limit.GIB
MEMINFO = "MemTotal:       131961868 kB\nMemFree:        128437740 kB\nMemAvailable:   131421924 kB\n"


def test_the_balloon_locks_what_is_available_beyond_the_emulated_machine() -> None:
    assert ram_limit.meminfo_bytes("MemAvailable", MEMINFO) == 131421924 * 1024
    assert ram_limit.balloon_bytes(32, 100 * GIB) == 68 * GIB
    with pytest.raises(ValueError, match="--ram-gib 128: this machine has only 100.0 GiB available"):
        ram_limit.balloon_bytes(128, 100 * GIB)
    with pytest.raises(ValueError, match="--ram-gib 0"):
        ram_limit.balloon_bytes(0, 100 * GIB)
    with pytest.raises(RuntimeError, match="no SwapFree line"):
        ram_limit.meminfo_bytes("SwapFree", MEMINFO)


def _psutil_view(env: dict[str, str]) -> list[int]:
    code = "import psutil; m = psutil.virtual_memory(); print(m.total, m.available, m.free, m.used)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return [int(x) for x in out.stdout.split()]


def test_a_server_sees_the_emulated_total_and_never_more_available() -> None:
    pytest.importorskip("psutil")
    real = _psutil_view(dict(os.environ))
    env = ram_limit.server_env({**os.environ, "PYTHONPATH": os.pathsep.join(["/elsewhere", str(ram_limit.SITE)])},
                               0.5)
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [str(ram_limit.SITE), "/elsewhere"]  # first, once
    total, available, free, used = _psutil_view(env)
    assert total == GIB // 2 < real[0]
    assert 0 < available <= total and free <= available and used == total - available


def test_the_balloon_process_holds_its_memory_until_released(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole context with a 16 KiB balloon: it locks, reports, and exits when the block ends."""
    monkeypatch.setattr(ram_limit, "meminfo_bytes", lambda field, text=None: int(1.5 * GIB) + (16 << 10))
    with ram_limit.emulated(1.5) as facts:
        assert facts["ram_gib"] == 1.5 and facts["locked_gib"] == 0.0 and facts["lock_s"] >= 0
    assert "a machine of 1.5 GiB RAM (emulated: 0.0 of this machine's" in rr._ram_text([{"ram_emulation": facts}])
    assert rr._ram_text([{}]) == ""


def test_a_balloon_that_cannot_lock_names_the_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ram_limit, "meminfo_bytes", lambda field, text=None: 2 * GIB + (16 << 10))
    real_popen = subprocess.Popen

    def failing(args: list[str], **kw: object) -> subprocess.Popen:  # asked for more than exists: refused unlocked
        return real_popen([*args[:-1], str(1 << 62)], **kw)

    monkeypatch.setattr(ram_limit.subprocess, "Popen", failing)
    with pytest.raises(RuntimeError, match="--ram-gib 2: the balloon could not lock .*available: the balloon keeps"):
        with ram_limit.emulated(2):
            pass


def test_rows_on_an_emulated_machine_say_so_in_their_names() -> None:
    opts = argparse.Namespace(rows="wan_t2v_4step_native_best_12gb,wan_t2v_4step_pack_stream_12gb", cards=None,
                              setups="native_best", formats=None, memory="on", ram_gib=32.0)
    rows = sr.pick_rows(opts)
    assert [r.name for r in rows] == ["wan_t2v_4step_native_best_12gb_ram32gb",
                                      "wan_t2v_4step_pack_stream_12gb_ram32gb"]
    assert all(r.ram_gib == 32.0 for r in rows)
    assert sr.describe(rows[1]).endswith("12 GB card, a machine of 32 GiB RAM (emulated)")
    assert sr.head(rows[0])["ram_gib"] == 32.0
    assert sr.pick_rows(argparse.Namespace(**{**vars(opts), "ram_gib": None}))[0].ram_gib is None
