"""The GPU kit's wheel slimmer keeps one SM's machine code, zeroes the rest in place and rewrites RECORD."""
from __future__ import annotations

import struct
import zipfile

from comfyui_lowvram_dit.benchmarks import gpu_slim_wheel as slim


def entry(kind: int, arch: int, payload: bytes) -> bytes:
    """One fatbin entry: a 64-byte header (kind, header size, payload size, arch at 28) and its payload."""
    head = bytearray(64)
    struct.pack_into("<HHIQ", head, 0, kind, 1, 64, len(payload))
    struct.pack_into("<I", head, 28, arch)
    return bytes(head) + payload


def container(*entries: bytes) -> bytes:
    """A fatbin container: magic, version, header size, body size, then the entries."""
    body = b"".join(entries)
    return struct.pack("<IHHQ", slim.FATBIN_MAGIC, 1, 16, len(body)) + body


def elf(fatbin: bytes) -> bytes:
    """A minimal ELF64 with a section-name table and a .nv_fatbin section."""
    names = b"\0.shstrtab\0.nv_fatbin\0"
    data_off = 64
    names_off = data_off + len(fatbin)
    shoff = names_off + len(names) + (-(names_off + len(names)) % 8)
    head = bytearray(64)
    head[:4] = b"\x7fELF"
    struct.pack_into("<Q", head, 0x28, shoff)
    struct.pack_into("<HHH", head, 0x3A, 64, 3, 1)
    sections = [bytes(64),
                struct.pack("<IIQQQQIIQQ", 1, 3, 0, 0, names_off, len(names), 0, 0, 1, 0),
                struct.pack("<IIQQQQIIQQ", 11, 1, 2, 0, data_off, len(fatbin), 0, 0, 8, 0)]
    pad = bytes(shoff - names_off - len(names))
    return bytes(head) + fatbin + names + pad + b"".join(sections)


def test_prune_keeps_only_the_sm_and_leaves_a_container_without_it_whole() -> None:
    keep = entry(2, 90, b"S" * 32)
    first = container(entry(2, 80, b"A" * 48), keep, entry(1, 90, b"P" * 16))
    second = container(entry(2, 120, b"B" * 24))
    lib = elf(first + second)
    out, freed = slim.prune_library(lib, 90)
    assert len(out) == len(lib) and freed == len(first) - 16 - len(keep)
    body, size = struct.unpack_from("<Q", out, 64 + 8)[0], len(first) - 16
    assert body == len(keep) and out[64 + 16:64 + 16 + len(keep)] == keep
    assert out[64 + 16 + len(keep):64 + len(first)] == bytes(size - len(keep))
    assert out[64 + len(first):64 + len(first) + len(second)] == second  # no sm_90 entry: untouched


def test_slim_rewrites_the_wheel_and_its_record(tmp_path) -> None:
    wheel = tmp_path / "pkg-1.0-cp312-abi3-linux_x86_64.whl"
    lib = elf(container(entry(2, 75, b"A" * 40), entry(2, 90, b"S" * 8)))
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("pkg/_C.abi3.so", lib)
        z.writestr("pkg/hip/_C.abi3.so", b"rocm")
        z.writestr("pkg-1.0.dist-info/RECORD", "stale\n")
    slim.slim(wheel, 90, ["pkg/hip/_C*"])
    with zipfile.ZipFile(wheel) as z:
        names, record = z.namelist(), z.read("pkg-1.0.dist-info/RECORD").decode()
        pruned = z.read("pkg/_C.abi3.so")
    assert "pkg/hip/_C.abi3.so" not in names and pruned != lib and len(pruned) == len(lib)
    assert slim.record_line("pkg/_C.abi3.so", pruned) in record.splitlines()
    assert "stale" not in record and "hip" not in record
