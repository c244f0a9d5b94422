"""Checkpoint I/O: streaming writer round-trips, and every kind of broken file gets a clear error."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from comfyui_lowvram_dit.kernels.checkpoint_io import (
    CheckpointError,
    StreamingSafetensorsWriter,
    iter_tensors,
    read_header,
)


def _write(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = {
        "a.weight": torch.randn(4, 8, dtype=torch.bfloat16),
        "b.bias": torch.randn(3, dtype=torch.float32),
        "c.q": torch.randn(2, 16).to(torch.float8_e4m3fn),
    }
    layout = [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    path = tmp_path / "m.safetensors"
    with StreamingSafetensorsWriter(path, layout, {"format": "pt", "k": "v"}) as w:
        for k, v in tensors.items():
            w.write(k, v)
    return path, tensors


def test_streaming_writer_roundtrips_through_safetensors(tmp_path: Path) -> None:
    path, tensors = _write(tmp_path)
    loaded = load_file(str(path))
    assert set(loaded) == set(tensors)
    for k, v in tensors.items():
        assert loaded[k].dtype == v.dtype
        assert torch.equal(loaded[k].view(torch.uint8), v.view(torch.uint8))
    header = read_header(path)
    assert header.metadata == {"format": "pt", "k": "v"}
    streamed = dict(iter_tensors(header))
    for k, v in tensors.items():
        assert torch.equal(streamed[k].view(torch.uint8), v.view(torch.uint8))


def test_writer_rejects_out_of_order_and_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    w = StreamingSafetensorsWriter(path, [("a", (2,), torch.float32), ("b", (2,), torch.float32)])
    with pytest.raises(ValueError, match="expected 'a'"):
        w.write("b", torch.zeros(2))
    w.abort()
    assert not path.exists() and not path.with_name("x.safetensors.partial").exists()


def test_truncated_file_is_named(tmp_path: Path) -> None:
    path, _ = _write(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match=r"m\.safetensors: truncated file"):
        read_header(path)


@pytest.mark.parametrize(
    "payload, match",
    [
        (b"\x00" * 4, "too small"),
        (struct.pack("<Q", 10**12) + b"{}", "corrupt safetensors header"),
        (struct.pack("<Q", 5) + b"{nope", "corrupt safetensors header"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
    ],
)
def test_corrupt_headers(tmp_path: Path, payload: bytes, match: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(payload)
    with pytest.raises(CheckpointError, match=match):
        read_header(path)


def test_shape_and_byte_range_must_agree(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 8]}}).encode()
    path = tmp_path / "lie.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x00" * 8)
    with pytest.raises(CheckpointError, match="declares shape"):
        read_header(path)


def test_pickle_and_missing_files_are_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes(b"whatever")
    with pytest.raises(CheckpointError, match="pickle checkpoints"):
        read_header(ckpt)
    with pytest.raises(CheckpointError, match="file not found"):
        read_header(tmp_path / "nope.safetensors")


def test_safetensors_library_files_are_read(tmp_path: Path) -> None:
    path = tmp_path / "lib.safetensors"
    save_file({"x": torch.arange(6, dtype=torch.int64).reshape(2, 3)}, str(path), metadata={"m": "1"})
    header = read_header(path)
    assert header.tensors["x"].shape == (2, 3)
    assert torch.equal(dict(iter_tensors(header))["x"], torch.arange(6).reshape(2, 3))
