"""Checkpoint I/O: streaming writer round-trips, and every kind of broken file gets a clear error."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from comfyui_lowvram_dit.checkpoints.safetensors_io import (
    CheckpointError, StreamingSafetensorsWriter, iter_tensors, read_header,
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


def test_write_zeros_reads_back_as_zeros_and_takes_no_disk(tmp_path: Path) -> None:
    """Zero tensors skipped in the middle and at the end: same bytes as written zeros, a sparse file on Linux."""
    big = (1024, 2048)  # 8 MiB of fp32 zeros
    layout = [("z.first", big, torch.float32), ("a.weight", (4, 8), torch.bfloat16), ("z.last", big, torch.float32)]
    path = tmp_path / "sparse.safetensors"
    a = torch.randn(4, 8, dtype=torch.bfloat16)
    with StreamingSafetensorsWriter(path, layout) as w:
        w.write_zeros("z.first")
        w.write("a.weight", a)
        with pytest.raises(ValueError, match="expected 'z.last', got zeros for 'nope'"):
            w.write_zeros("nope")
        w.write_zeros("z.last")
    loaded = load_file(str(path))
    assert torch.equal(loaded["a.weight"], a)
    assert all(torch.equal(loaded[k], torch.zeros(big)) for k in ("z.first", "z.last"))
    dense = tmp_path / "dense.safetensors"
    with StreamingSafetensorsWriter(dense, layout) as w:
        for name, shape, dtype in layout:
            w.write(name, a if name == "a.weight" else torch.zeros(shape, dtype=dtype))
    assert path.stat().st_size == dense.stat().st_size and path.read_bytes() == dense.read_bytes()
    if sys.platform.startswith("linux"):
        assert path.stat().st_blocks * 512 < 1 << 20 < dense.stat().st_blocks * 512


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


def test_map_tensors_are_zero_copy_views_of_the_file(tmp_path):
    from safetensors.torch import save_file

    from comfyui_lowvram_dit.checkpoints.safetensors_io import iter_tensors, map_tensors, read_header
    from comfyui_lowvram_dit.offload.host_memory import is_file_backed

    sd = {"a.weight": torch.randn(64, 96).to(torch.float8_e4m3fn), "a.scale_weight": torch.tensor(0.5),
          "b.bias": torch.randn(33, dtype=torch.bfloat16), "empty": torch.zeros(0)}
    path = tmp_path / "m.safetensors"
    save_file(sd, path)
    header = read_header(path)
    mapped = dict(map_tensors(header))
    read = dict(iter_tensors(header))
    for k, v in sd.items():
        assert mapped[k].dtype == v.dtype and mapped[k].shape == v.shape
        assert torch.equal(mapped[k].reshape(-1).view(torch.uint8), read[k].reshape(-1).view(torch.uint8))
    assert is_file_backed(mapped["a.weight"]) and not is_file_backed(read["a.weight"])
    assert set(dict(map_tensors(header, ["b.bias"]))) == {"b.bias"}


def test_map_tensors_show_each_view_with_its_place_in_the_file(tmp_path):
    from comfyui_lowvram_dit.checkpoints.safetensors_io import map_tensors, read_header

    sd = {"a.weight": torch.randn(64, 96).to(torch.float8_e4m3fn), "b.bias": torch.randn(33, dtype=torch.bfloat16),
          "empty": torch.zeros(0)}
    path = tmp_path / "m.safetensors"
    save_file(sd, path)
    seen = {}

    def on_map(t, offset, size):
        seen[t.data_ptr()] = (offset, size)

    mapped = dict(map_tensors(read_header(path), on_map=on_map))
    raw = path.read_bytes()
    assert len(seen) == 2  # the empty tensor is no view of the file
    for name in ("a.weight", "b.bias"):
        t = mapped[name]
        offset, size = seen[t.data_ptr()]
        # what a reader by file handle needs: the storage is exactly these bytes of the file, nothing around them
        assert t.storage_offset() == 0 and t.untyped_storage().nbytes() == size == t.numel() * t.element_size()
        assert raw[offset:offset + size] == bytes(t.reshape(-1).view(torch.uint8).tolist())


def test_map_tensors_refuses_a_truncated_file(tmp_path):
    from safetensors.torch import save_file

    from comfyui_lowvram_dit.checkpoints.safetensors_io import CheckpointError, map_tensors, read_header

    path = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(256, 256)}, path)
    header = read_header(path)
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 1000)
    with pytest.raises(CheckpointError, match="m.safetensors"):
        list(map_tensors(header))


def test_to_device_or_cpu_keeps_a_tensor_on_the_cpu_when_the_copy_fails(monkeypatch, caplog):
    from comfyui_lowvram_dit.checkpoints import safetensors_io as checkpoint_io

    t = torch.randn(4, 4)
    assert checkpoint_io.to_device_or_cpu(t, torch.device("cpu")) is t

    def broken_to(self, *args, **kwargs):
        raise RuntimeError("CUDA error: invalid argument\nmore")

    monkeypatch.setattr(torch.Tensor, "to", broken_to)
    monkeypatch.setattr(checkpoint_io, "_FALLBACK_SAID", [])
    with caplog.at_level("WARNING", logger="comfyui_lowvram_dit"):
        assert checkpoint_io.to_device_or_cpu(t, torch.device("cuda", 0)) is t
        assert checkpoint_io.to_device_or_cpu(t, torch.device("cuda", 0)) is t
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "quantizing on the CPU" in said[0] and "invalid argument" in said[0]


def test_iter_tensors_are_owned_by_torch(tmp_path):
    from comfyui_lowvram_dit.checkpoints.safetensors_io import iter_tensors, read_header

    save_file({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, tmp_path / "m.safetensors")
    (name, t), = iter_tensors(read_header(tmp_path / "m.safetensors"))
    assert name == "w" and torch.equal(t, torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert t.data_ptr() % 64 == 0  # torch's CPU allocator, not a bytearray
