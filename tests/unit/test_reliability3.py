"""Hostile inputs, third round (CPU): writes that never follow a link nor replace a file the pack did not write,
header errors that never echo a file's bytes, a Doctor that survives an optional dependency raising SystemExit,
and embedding-cache write failures warned once per kind.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from comfyui_lowvram_dit.checkpoints import embedding_cache as ec
from comfyui_lowvram_dit.checkpoints import safe_write
from comfyui_lowvram_dit.checkpoints import wan as wc
from comfyui_lowvram_dit.checkpoints.safetensors_io import CheckpointError, read_header
from comfyui_lowvram_dit.doctor import report as doctor
from comfyui_lowvram_dit.synthetic import checkpoints as synth

ROOT = Path(__file__).resolve().parents[2]

ENC = {"sha256": "b" * 64, "format": "bfloat16", "dtype": "bfloat16", "config": {"hidden_size": 8}}


def _cond() -> list:
    return [[torch.randn(1, 3, 8), {"pooled_output": None}]]


# ----------------------------------------------------------------------------------------------------------
# header errors never echo the file's bytes


@pytest.mark.parametrize("content", [b"hello, this is a text file and not a model\n", b"#!/bin/sh\necho hi\n" * 3,
                                     b"\x00" * 8 + b"{}", struct.pack("<Q", 6) + b"\xff\xfe\xfdsec"])
def test_a_file_that_is_not_safetensors_is_named_without_its_bytes(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as info:
        read_header(path)
    msg = str(info.value)
    assert msg.startswith("model.safetensors: ") and "not a safetensors file" in msg
    (declared,) = struct.unpack("<Q", content[:8])
    assert str(declared) not in msg.replace(f"{len(content)} bytes", "")
    assert "0xff" not in msg and "sec" not in msg and "hello" not in msg


def test_a_truncated_safetensors_file_still_says_truncated(tmp_path: Path) -> None:
    path = tmp_path / "cut.safetensors"
    path.write_bytes(struct.pack("<Q", 4096) + b'{"a": {"dtype": "F32", ')
    with pytest.raises(CheckpointError, match="truncated"):
        read_header(path)


# ----------------------------------------------------------------------------------------------------------
# the Doctor and an optional dependency that raises SystemExit


def _exiting_module(root: Path, name: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{name}.py").write_text("raise SystemExit(3)\n", encoding="utf-8")
    return root


def test_doctor_reports_a_dependency_that_raises_system_exit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(_exiting_module(tmp_path / "fake", "triton")))
    monkeypatch.delitem(sys.modules, "triton", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    report = doctor.collect()
    assert report["versions"]["triton_import_error"].startswith("SystemExit")
    assert "Recommendation" in doctor.format_report(report)


def test_doctor_cli_survives_a_dependency_that_raises_system_exit(tmp_path: Path) -> None:
    fake = _exiting_module(tmp_path / "fake", "triton")
    pack_parent = Path(__import__("comfyui_lowvram_dit").__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), str(pack_parent)]), "CUDA_VISIBLE_DEVICES": ""}
    run = [sys.executable, "-m", "comfyui_lowvram_dit", "doctor", "--no-gpu-probes", "--json"]
    proc = subprocess.run(run, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["versions"]["triton_import_error"].startswith("SystemExit")
    assert "Recommendation" in doctor.format_report(report)


def test_an_attention_library_that_raises_system_exit_counts_as_missing(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from comfyui_lowvram_dit.kernels import attention_backends

    monkeypatch.syspath_prepend(str(_exiting_module(tmp_path / "fake", "exiting_attention_lib")))
    assert attention_backends._optional_module("exiting_attention_lib") is None


# ----------------------------------------------------------------------------------------------------------
# embedding-cache write failures: one warning per kind of failure


def test_each_kind_of_cache_write_failure_is_warned_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(ec, "_WARNED", set())
    failure = [OSError(errno.EROFS, "Read-only file system")]

    def failing_writer(*args: object, **kwargs: object) -> None:
        raise failure[0]

    monkeypatch.setattr(ec, "StreamingSafetensorsWriter", failing_writer)
    cache = ec.EmbeddingCache(tmp_path / "cache")
    with caplog.at_level(logging.DEBUG, logger="comfyui_lowvram_dit"):
        for n, exc in enumerate([OSError(errno.EROFS, "Read-only file system")] * 2
                                + [OSError(errno.ENOSPC, "No space left on device")] * 2):
            failure[0] = exc
            assert cache.put(ec.embedding_cache_key(f"p{n}", "t", ENC), _cond()) is None
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2, warned
    assert "Read-only" in warned[0] and "No space left" in warned[1]
    assert all(str(tmp_path / "cache") in w for w in warned)


# ----------------------------------------------------------------------------------------------------------
# no write follows a link or replaces a file the pack did not write


@pytest.fixture(scope="module")
def wan_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wan")
    return synth.write_synthetic("wan21_t2v_1_3B", root / "wan.safetensors", size="tiny", fmt="bf16", seed=3)


def _plant(path: Path, kind: str, outside: Path) -> None:
    """Something of the user's at ``path``: a link to ``outside``, a dangling link, or a regular file."""
    if kind == "link":
        path.symlink_to(outside)
    elif kind == "dangling":
        path.symlink_to(outside.with_name("nowhere"))
    else:
        path.write_bytes(b"the user's own file")


@pytest.mark.parametrize("kind", ["link", "dangling", "file"])
def test_save_quantized_never_writes_through_what_sits_at_its_temp_name(wan_source: Path, tmp_path: Path,
                                                                       kind: str) -> None:
    models = tmp_path / "models"
    models.mkdir()
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"a file outside the models folder")
    dest = wc.quantized_path_for(models / wan_source.name, "per_tensor")
    planted = dest.with_name(dest.name + ".partial")  # the temp name earlier versions used
    _plant(planted, kind, outside)
    wc.save_quantized(wc.load_wan_state_dict(wan_source, "per_tensor"), dest, wan_source)
    assert outside.read_bytes() == b"a file outside the models folder"
    assert not dest.is_symlink() and read_header(dest).metadata[wc.META_FORMAT] == wc.FORMAT_TAG
    assert planted.is_symlink() == (kind != "file")
    assert kind != "file" or planted.read_bytes() == b"the user's own file"
    assert [p.name for p in models.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize("kind", ["link", "dangling", "file"])
def test_synthetic_models_never_replace_a_users_file_or_link(tmp_path: Path, kind: str) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"keep me")
    dest = tmp_path / "synth.safetensors"
    _plant(dest, kind, outside)
    before = os.readlink(dest) if dest.is_symlink() else dest.read_bytes()
    with pytest.raises(safe_write.UnsafeTargetError, match="synth.safetensors"):
        synth.write_synthetic("wan21_t2v_1_3B", dest, size="tiny", fmt="bf16")
    assert (os.readlink(dest) if dest.is_symlink() else dest.read_bytes()) == before
    assert outside.read_bytes() == b"keep me" and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["outside.txt", "synth.safetensors"])


def test_a_synthetic_model_is_rewritten_over_its_own_earlier_copy(tmp_path: Path) -> None:
    dest = tmp_path / "synth.safetensors"
    synth.write_synthetic("wan21_t2v_1_3B", dest, size="tiny", fmt="bf16", seed=1)
    synth.write_synthetic("wan21_t2v_1_3B", dest, size="tiny", fmt="bf16", seed=2)
    assert read_header(dest).metadata["seed"] == "2"


def test_the_cache_never_replaces_a_link_in_place_of_an_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ec, "_WARNED", set())
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"keep me")
    cache = ec.EmbeddingCache(tmp_path / "cache")
    key = ec.embedding_cache_key("p", "t", ENC)
    cache.path_for(key).parent.mkdir(parents=True)
    cache.path_for(key).symlink_to(outside)
    assert cache.put(key, _cond()) is None
    assert cache.path_for(key).is_symlink() and outside.read_bytes() == b"keep me"


@pytest.mark.parametrize("kind", ["link", "dangling", "file", "folder"])
def test_write_atomic_refuses_what_it_cannot_prove_it_wrote(tmp_path: Path, kind: str) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"keep me")
    dest = tmp_path / "report.json"
    if kind == "folder":
        dest.mkdir()
    else:
        _plant(dest, kind, outside)
    with pytest.raises(safe_write.UnsafeTargetError, match="report.json"):
        safe_write.write_report(dest, '{"report": 1}')
    assert outside.read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside.txt", "report.json"]


def test_write_report_replaces_its_own_earlier_report_atomically(tmp_path: Path) -> None:
    dest = tmp_path / "bench.md"
    safe_write.write_report(dest, "# bench_attention: results\n\nold\n")
    safe_write.write_report(dest, "# bench_attention: results\n\nnew\n")
    assert dest.read_text() == "# bench_attention: results\n\nnew\n"

    def fail(f: object) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        safe_write.write_atomic(dest, fail, safe_write.starts_with("# bench_attention"))
    assert dest.read_text().endswith("new\n") and sorted(p.name for p in tmp_path.iterdir()) == ["bench.md"]


WRITE_CALLS = re.compile(r"""\.write_text\(|\.write_bytes\(|save_file\(|torch\.save\(|json\.dump\(|shutil\.copy"""
                         r"""|\bopen\([^)]*["'][wax]b?\+?["']|\.open\(["'][wax]|\.save\((?!.*format=)""")


def test_every_file_the_pack_writes_goes_through_safe_write() -> None:
    offenders = []
    for folder in sorted(p.parent for p in ROOT.glob("*/__init__.py")):  # every package of the pack
        for path in sorted(folder.rglob("*.py")):
            if path.name == "safe_write.py":
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                code = line.split("#")[0]
                if WRITE_CALLS.search(code) and "write_atomic(" not in code:  # a writer handed to write_atomic
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert offenders == [], "write these through checkpoints.safe_write:\n" + "\n".join(offenders)


def test_the_runner_log_never_follows_a_link_and_replaces_only_its_own_log(tmp_path: Path) -> None:
    from comfyui_lowvram_dit.cli import server

    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"keep me")
    log = tmp_path / "comfyui.log"
    log.symlink_to(outside)
    with pytest.raises(safe_write.UnsafeTargetError, match="comfyui.log"):
        server.open_log(log, ["python", "main.py"])
    log.unlink()
    for run in range(2):  # the second run replaces the first run's log
        with server.open_log(log, ["python", "main.py", f"--run={run}"]) as f:
            f.write(b"ComfyUI says hello\n")
        assert log.read_bytes().endswith(f"--run={run}\nComfyUI says hello\n".encode())
    assert outside.read_bytes() == b"keep me" and sorted(p.name for p in tmp_path.iterdir()) == [
        "comfyui.log", "outside.txt"]


def test_convert_force_replaces_a_file_but_never_a_link(tmp_path: Path) -> None:
    from comfyui_lowvram_dit.cli import convert

    src = tmp_path / "in.json"
    src.write_text('{"nodes": [], "links": []}', encoding="utf-8")
    outside = tmp_path / "outside.json"
    outside.write_text("keep me", encoding="utf-8")
    dst = tmp_path / "out.json"
    dst.symlink_to(outside)
    with pytest.raises(convert.ConvertError, match="symbolic link"):
        convert.convert_file(src, dst, force=True)
    assert dst.is_symlink() and outside.read_text(encoding="utf-8") == "keep me"
    dst.unlink()
    dst.write_text("an older output", encoding="utf-8")
    convert.convert_file(src, dst, force=True)
    assert not dst.is_symlink() and json.loads(dst.read_text(encoding="utf-8"))["nodes"] == []
