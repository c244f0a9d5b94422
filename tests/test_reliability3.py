"""Hostile inputs, third round (CPU): writes that never follow a link nor replace a file the pack did not write,
header errors that never echo a file's bytes, a Doctor that survives an optional dependency raising SystemExit,
and embedding-cache write failures warned once per kind.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from comfyui_lowvram_dit.kernels import embedding_cache as ec
from comfyui_lowvram_dit.kernels.checkpoint_io import CheckpointError, read_header
from comfyui_lowvram_dit.tools import doctor

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
    from comfyui_lowvram_dit.kernels import attention

    monkeypatch.syspath_prepend(str(_exiting_module(tmp_path / "fake", "exiting_attention_lib")))
    assert attention._optional_module("exiting_attention_lib") is None


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
