"""Slim a CUDA wheel for one GPU architecture so it fits the GPU machine's 64 MiB transfer (used by gpu_kit.sh).

Each ``.nv_fatbin`` container keeps only its ELF entries for the SM (one with none is kept whole), the rest zeroed in
place; ``--drop GLOB`` removes files; RECORD is rewritten."""
from __future__ import annotations

import argparse
import base64
import fnmatch
import hashlib
import struct
import zipfile
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
ELF_KIND = 2


def prune_container(buf: bytearray, start: int, sm: int) -> tuple[int, int]:
    """Keep one container's ELF entries for ``sm``; returns (the container's end, bytes zeroed)."""
    _, _, head, size = struct.unpack_from("<IHHQ", buf, start)
    body, end = start + head, start + head + size
    kept, pos = bytearray(), body
    while pos < end:
        kind, _, entry_head, payload = struct.unpack_from("<HHIQ", buf, pos)
        arch, = struct.unpack_from("<I", buf, pos + 28)
        if kind == ELF_KIND and arch == sm:
            kept += buf[pos:pos + entry_head + payload]
        pos += entry_head + payload
    if not kept:  # nothing for this SM: a partial container could only fail later, so leave it whole
        return end, 0
    struct.pack_into("<Q", buf, start + 8, len(kept))
    buf[body:end] = kept + bytes(size - len(kept))
    return end, size - len(kept)


def prune_library(lib: bytes, sm: int) -> tuple[bytes, int]:
    """The library with each fatbin container of its ELF section ``.nv_fatbin`` pruned to ``sm``; the bytes zeroed."""
    shoff, = struct.unpack_from("<Q", lib, 0x28)
    entsize, count, strndx = struct.unpack_from("<HHH", lib, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", lib, shoff + i * entsize) for i in range(count)]
    names = heads[strndx][4]  # where the section names start: a section's name is at names + its first field
    where = next((h[4:6] for h in heads if lib[names + h[0]:].split(b"\0", 1)[0] == b".nv_fatbin"), None)
    if where is None:
        return lib, 0
    buf, (pos, size) = bytearray(lib), where
    end, freed = pos + size, 0
    while pos + 16 <= end:
        if struct.unpack_from("<I", buf, pos)[0] != FATBIN_MAGIC:
            pos += 8  # containers are 8-byte aligned with padding between them
            continue
        pos, zeroed = prune_container(buf, pos, sm)
        freed += zeroed
    return bytes(buf), freed


def record_line(name: str, data: bytes) -> str:
    """One RECORD row: path, urlsafe sha256 without padding, size."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def slim(wheel: Path, sm: int, drop: list[str]) -> None:
    """Rewrite ``wheel`` in place: pruned shared objects, dropped files, fresh RECORD."""
    with zipfile.ZipFile(wheel) as src:
        files = {i.filename: src.read(i) for i in src.infolist() if not i.is_dir()}
    record = next(n for n in files if n.endswith(".dist-info/RECORD"))
    freed = 0
    for name in list(files):
        if any(fnmatch.fnmatch(name, g) for g in drop):
            del files[name]
        elif name.endswith(".so") or ".so." in name:
            files[name], zeroed = prune_library(files[name], sm)
            freed += zeroed
    rows = [record_line(n, d) for n, d in files.items() if n != record] + [f"{record},,"]
    files[record] = ("\n".join(rows) + "\n").encode()
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
        for name, data in files.items():
            out.writestr(name, data)
    tmp.replace(wheel)
    print(f"{wheel.name}: sm_{sm} machine code kept, {freed / 2**20:.0f} MiB of other code zeroed, "
          f"{wheel.stat().st_size / 2**20:.1f} MiB now")


def main() -> None:
    """Command line: WHEEL --sm N [--drop GLOB ...]."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("wheel", type=Path)
    p.add_argument("--sm", type=int, required=True, help="SM to keep, e.g. 90 for H100/H200")
    p.add_argument("--drop", action="append", default=[], help="glob of wheel paths to remove")
    slim(**vars(p.parse_args()))  # wheel, sm, drop


if __name__ == "__main__":
    main()
