"""Hostile inputs, third round (CPU): writes that never follow a link nor replace a file the pack did not write,
header errors that never echo a file's bytes, a Doctor that survives an optional dependency raising SystemExit,
and embedding-cache write failures warned once per kind.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from comfyui_lowvram_dit.kernels.checkpoint_io import CheckpointError, read_header

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
