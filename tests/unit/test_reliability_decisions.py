"""Whatever sits at the kept-decisions file's name (kernels/decision_store.py), on the CPU.

A FIFO never blocks the reader and a link is never followed (each run under a timeout or a memory limit, so a
regression fails instead of hanging the suite or eating the machine's memory); a file over the size bound is not
read; anything the pack cannot read is renamed aside (never deleted, a link renamed itself), said once with both
names, and choices are kept in a new file from then on.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from comfyui_lowvram_dit.kernels import decision_store

KEY = ("cuda", "Some GPU", 9, 0, 4096)
HANG_LIMIT_S = 30.0


@pytest.fixture(autouse=True)
def no_store() -> Iterator[None]:
    decision_store.keep_in(None)
    yield
    decision_store.keep_in(None)


def _store(path: Path) -> decision_store.DecisionStore:
    return decision_store.DecisionStore(path, decision_store.current_header("9.9"))


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "comfyui_lowvram_dit" and r.levelno >= logging.WARNING]


def _aside(path: Path) -> list[Path]:
    return sorted(p for p in path.parent.iterdir() if p.name.startswith(f"{path.name}.unreadable-"))


def _kept_again(path: Path) -> None:
    """After a bad file was moved aside: a winner is written to a new regular file and a restart reads it."""
    _store(path).put("fp8", KEY, "rowwise")
    assert path.is_file() and not path.is_symlink()
    assert _store(path).get("fp8", KEY) == "rowwise"


def test_a_fifo_never_blocks_the_reader_and_is_moved_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "decisions.json"
    os.mkfifo(path)
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(_store(path).get("fp8", KEY)), daemon=True)
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        reader.start()
        reader.join(HANG_LIMIT_S)
        if reader.is_alive():  # release the blocked reader (a writer opens the FIFO), then fail
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            reader.join(HANG_LIMIT_S)
            pytest.fail(f"reading a FIFO at the decisions file's name blocked for {HANG_LIMIT_S:.0f} s")
    assert got == [None]
    moved = _aside(path)
    assert len(moved) == 1 and moved[0].is_fifo() and not path.exists()
    warned = _warnings(caplog)
    assert len(warned) == 1 and str(path) in warned[0] and str(moved[0]) in warned[0] and "FIFO" in warned[0]
    _kept_again(path)


_ENDLESS_CHILD = """
import logging, resource, sys
from pathlib import Path
from comfyui_lowvram_dit.kernels import decision_store
logging.getLogger("comfyui_lowvram_dit").addHandler(logging.StreamHandler(sys.stdout))
peak = lambda: int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) * 1024
soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
before = peak()
data = int(open('/proc/self/status').read().split('VmData:')[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_DATA, (data + (512 << 20), hard))  # a regression ends in MemoryError
store = decision_store.DecisionStore(Path(sys.argv[1]), {"format": "1"})
print("GOT", store.get("fp8", ("k",)))
print("GREW", peak() - before)
"""


def test_a_link_to_an_endless_device_is_never_read(tmp_path: Path) -> None:
    device = "/dev/zero"
    if not os.path.exists(device):
        pytest.skip(f"{device} is missing on this system")
    path = tmp_path / "decisions.json"
    path.symlink_to(device)
    pack_parent = Path(decision_store.__file__).parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pack_parent), os.environ.get("PYTHONPATH", "")])}
    try:
        run = subprocess.run([sys.executable, "-c", _ENDLESS_CHILD, str(path)], capture_output=True, text=True,
                             timeout=120, env=env, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail(f"reading a link to {device} did not end within 120 s")
    assert run.returncode == 0 and "GOT None" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
    grew = int(run.stdout.split("GREW")[1].split()[0])
    assert grew < 64 << 20, f"reading grew the process by {grew >> 20} MiB"
    moved = _aside(path)
    assert len(moved) == 1 and moved[0].is_symlink() and os.readlink(moved[0]) == device  # the link itself moved
    assert "symbolic link" in run.stdout and str(moved[0]) in run.stdout


def test_a_linked_file_is_never_read_or_echoed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    secret = tmp_path / "elsewhere.json"
    content = json.dumps({"kept_by": decision_store.KEPT_BY, "header": {"token": "s3cr3t-value"}, "decisions": {}})
    secret.write_text(content, encoding="utf-8")
    path = tmp_path / "decisions.json"
    path.symlink_to(secret)
    with caplog.at_level(logging.DEBUG, logger="comfyui_lowvram_dit"):
        assert _store(path).get("fp8", KEY) is None
        _kept_again(path)
    assert not any("s3cr3t" in r.getMessage() for r in caplog.records)
    assert secret.read_text(encoding="utf-8") == content  # the link's target is never written
    moved = _aside(path)
    assert len(moved) == 1 and moved[0].is_symlink() and moved[0].resolve() == secret


def test_a_file_over_the_size_bound_is_not_read(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "decisions.json"
    with open(path, "wb") as f:  # sparse: 1 GiB that costs no disk
        f.truncate(1 << 30)
    reads: list[int] = []
    real_read = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: reads.append(n) or real_read(fd, n))
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        assert _store(path).get("fp8", KEY) is None
    assert sum(reads) == 0  # refused from its size, before a byte is read
    moved = _aside(path)
    assert len(moved) == 1 and moved[0].stat().st_size == 1 << 30
    warned = _warnings(caplog)
    assert len(warned) == 1 and str(1 << 30) in warned[0] and str(moved[0]) in warned[0]


@pytest.mark.parametrize("content", [
    b'{"someone": "else"}',  # JSON, not the pack's
    b'{\n "kept_by": "comfyui-lowvram-dit kernel decisions",\n "header": {"form',  # the pack's, cut off
    b"[" * 100_000 + b"]" * 100_000,  # deeper than the parser goes
    b'{"kept_by": "comfyui-lowvram-dit kernel decisions", "decisions": {"a": ' + b"7" * 5000 + b"}}",
    b"\xff\xfe\x00garbage",  # not UTF-8
    b'{"kept_by": "comfyui-lowvram-dit kernel decisions", "header": {}, "decisions": {"k": 1}}',  # wrong form
])
def test_a_file_the_pack_cannot_read_is_moved_aside_and_choices_persist_again(
        tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "decisions.json"
    path.write_bytes(content)
    decision_store.keep_in(path, "9.9")
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        assert decision_store.kept("fp8", KEY) is None
        decision_store.keep("fp8", KEY, "rowwise")
        decision_store.keep("fp8", KEY[:4], "tensorwise")
    moved = _aside(path)
    assert len(moved) == 1 and moved[0].read_bytes() == content  # kept under the new name, never deleted
    warned = _warnings(caplog)
    assert len(warned) == 1, warned  # one message, no contradicting second one
    assert str(path) in warned[0] and str(moved[0]) in warned[0] and "moved it aside" in warned[0]
    assert len(json.loads(path.read_text(encoding="utf-8"))["decisions"]) == 2
    decision_store.keep_in(None)
    decision_store.keep_in(path, "9.9")  # a restart reads what this process kept
    assert decision_store.kept("fp8", KEY) == "rowwise"


def test_a_folder_at_the_name_is_moved_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "decisions.json"
    (path / "inside").mkdir(parents=True)
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        _kept_again(path)
    moved = _aside(path)
    assert len(moved) == 1 and (moved[0] / "inside").is_dir()
    assert len(_warnings(caplog)) == 1 and "folder" in _warnings(caplog)[0]


def test_a_bad_file_that_cannot_be_moved_is_said_once_and_left_alone(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "decisions.json"
    path.write_text('{"someone": "else"}', encoding="utf-8")

    def refuse(src: object, dst: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "rename", refuse)
    store = _store(path)
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        for n in range(3):
            store.put("fp8", (*KEY, n), "rowwise")
        assert store.get("fp8", (*KEY, 2)) == "rowwise"  # this process still has its choices in memory
    assert path.read_text(encoding="utf-8") == '{"someone": "else"}'
    warned = _warnings(caplog)
    assert len(warned) == 1 and str(path) in warned[0] and "cannot be moved aside" in warned[0], warned
