"""Fuzz the header readers: a corrupt checkpoint must give a CheckpointError that names the file, nothing else.

Covers ``checkpoint_io.read_header`` and everything the loaders run on a header before touching tensor data:
``wan_checkpoint.inspect_checkpoint``, ``qwen_image.inspect_qwen_image``, ``text_encoders.text_encoder_format``,
``text_encoders.umt5_config_from_header`` and ``text_encoders.qwen25_vl_config_from_header``. The seeds are real key layouts
(tools.synth.file_layout), written as sparse files (header + ``truncate``), so a 15 GB text-encoder layout costs
a few kB on disk. A seeded ``random.Random`` drives the mutations: same cases on every run.
"""

from __future__ import annotations

import json
import math
import random
import re
import signal
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from comfyui_lowvram_dit.checkpoints import qwen_image, text_encoders
from comfyui_lowvram_dit.synthetic import checkpoints as synth
from comfyui_lowvram_dit.checkpoints import wan as wc
from comfyui_lowvram_dit.checkpoints.safetensors_io import TORCH_TO_SAFETENSORS, CheckpointError, read_header

SEED_MODELS = ("wan22_t2v_14B", "wan22_ti2v_5B", "qwen_image", "umt5_xxl_enc", "qwen25_vl_7b")
CASES_PER_KIND = 30  # x 12 kinds = 360 files; ~5 s on 2 CPU cores
CALL_LIMIT_S = 5  # a header read is milliseconds; anything near this is a hang


def _layout(model: str) -> list[tuple[str, list[int], str]]:
    """(name, shape, safetensors dtype) of a real layout; text encoders reduced to 2 layers to keep headers small."""
    deep = re.compile(r"(encoder\.block|model\.layers|visual\.blocks)\.([2-9]|\d\d+)\.")
    return [(n, list(s), TORCH_TO_SAFETENSORS[d]) for n, s, d in synth.file_layout(model, "tiny", "bf16")
            if not deep.search(n)]


_LAYOUTS = {m: _layout(m) for m in SEED_MODELS}
_ITEMSIZE = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "F16": 2, "BF16": 2, "I16": 2}


def _header_dict(entries: list[tuple[str, list[int], str]], metadata: dict | None = None) -> tuple[dict, int]:
    """A consistent header for ``entries`` (offsets packed in order) and the data size it declares."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata is not None else {}
    off = 0
    for name, shape, dt in entries:
        n = math.prod(shape) * _ITEMSIZE.get(dt, 1)
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    return header, off


def _write(path: Path, raw_header: bytes, data_size: int, declared_len: int | None = None) -> Path:
    """Header bytes then a sparse data section of ``data_size`` bytes."""
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw_header) if declared_len is None else declared_len))
        f.write(raw_header)
        f.truncate(8 + len(raw_header) + max(data_size, 0))
    return path


def _dump(header: Any) -> bytes:
    return json.dumps(header, separators=(",", ":")).encode()


# ---------------------------------------------------------------------------------------------------------
# mutations: each returns (raw header bytes, data size, declared header length or None)

Mutation = Callable[[random.Random, list], tuple[bytes, int, int | None]]
_JUNK = [None, True, -1, 0, 1.5, -(2**70), 2**70, "x", "", [], {}, [1, 2, 3], {"a": 1}, [[1]], "F16", [-5, 3]]


def _m_random_bytes(r: random.Random, entries: list) -> tuple[bytes, int, int | None]:
    return bytes(r.getrandbits(8) for _ in range(r.randint(1, 400))), r.randint(0, 100), None


def _m_flip_bytes(r: random.Random, entries: list) -> tuple[bytes, int, int | None]:
    header, size = _header_dict(entries)
    raw = bytearray(_dump(header))
    for _ in range(r.randint(1, 8)):
        raw[r.randrange(len(raw))] = r.getrandbits(8)
    return bytes(raw), size, None


def _m_header_len(r: random.Random, entries: list) -> tuple[bytes, int, int | None]:
    header, size = _header_dict(entries)
    raw = _dump(header)
    declared = r.choice([0, 1, len(raw) - 1, len(raw) + 1, 2**63, 2**64 - 1, 100 * 2**20 + 1, r.getrandbits(64)])
    return raw, size, declared


def _m_wrong_types(r: random.Random, entries: list) -> tuple[bytes, int, int | None]:
    header, size = _header_dict(entries)
    for name in r.sample(list(header), k=min(len(header), r.randint(1, 4))):
        field = r.choice(["dtype", "shape", "data_offsets", "entry"])
        if field == "entry":
            header[name] = r.choice(_JUNK)
        else:
            header[name][field] = r.choice(_JUNK)
    if r.random() < 0.3:
        header["__metadata__"] = r.choice(_JUNK)
    return _dump(header), size, None


def _m_offsets(r: random.Random, entries: list) -> tuple[bytes, int, int | None]:
    header, size = _header_dict(entries)
    names = list(header)
    for name in r.sample(names, k=min(len(names), r.randint(1, 3))):
        b, e = header[name]["data_offsets"]
        other = header[r.choice(names)]["data_offsets"]
        header[name]["data_offsets"] = r.choice([
            [-b - 1, e], [b, -1], [e, b], [b + 1, e + 1], list(other), [b, e + size + 1],
            [size + 1, size + 1 + e - b], [b, e, e], [b], [2**64, 2**64 + e - b], [b - 0.5, e],
        ])
    return _dump(header), size, None


def _m_dtype(r: random.Random, entries: list) -> tuple[bytes, int, int | None]:
    bad = ["F4", "fp8", "f16", "BF8", "U16", "U32", "U64", "C64", "F8_E8M0", "", "float16"]
    entries = [(n, s, r.choice(bad) if r.random() < 0.2 else d) for n, s, d in entries]
    header, size = _header_dict(entries)
    return _dump(header), size, None


def _m_huge_shapes(r: random.Random, entries: list) -> tuple[bytes, int, int | None]:
    entries = [(n, [r.choice([2**31, 2**40, 2**62, 10**30]) for _ in s] if r.random() < 0.2 else s, d)
               for n, s, d in entries]
    header, size = _header_dict(entries)  # consistent offsets: only the file size can refuse it
    return _dump(header), min(size, 2**20), None


def _m_rank(r: random.Random, entries: list) -> tuple[bytes, int, int | None]:
    """Consistent file (read_header passes) whose tensors have the wrong rank/extent: the inspectors must cope."""
    def mutate(s: list[int]) -> list[int]:
        op = r.choice(["drop", "add", "zero", "scalar", "one"])
        if op == "drop":
            return s[1:]
        if op == "add":
            return [*s, r.randint(1, 3)]
        if op == "zero":
            return [0 if i == 0 else d for i, d in enumerate(s)]
        return [] if op == "scalar" else [1] * len(s)

    entries = [(n, mutate(s) if r.random() < 0.3 else s, d) for n, s, d in entries]
    header, size = _header_dict(entries)
    return _dump(header), size, None


def _m_drop_keys(r: random.Random, entries: list) -> tuple[bytes, int, int | None]:
    """Consistent file with keys missing or block indices renumbered."""
    out = []
    for n, s, d in entries:
        if r.random() < 0.15:
            continue
        if r.random() < 0.1:
            n = n.replace(".0.", f".{r.choice([7, 99, -1])}.", 1)
        out.append((n, s, d))
    header, size = _header_dict(out)
    return _dump(header), size, None


def _m_json_edge(r: random.Random, entries: list) -> tuple[bytes, int, int | None]:
    header, size = _header_dict(entries)
    name = r.choice(list(header))
    choice = r.randrange(6)
    if choice == 0:
        raw = b"[" * 100_000 + b"]" * 100_000  # deep nesting: the JSON parser's recursion limit
    elif choice == 1:
        raw = _dump(header).replace(f'"{name}":{{"dtype"'.encode(), f'"{name}":{{"shape":[Infinity],"dtype"'.encode())
    elif choice == 2:
        raw = _dump(header).replace(b'"data_offsets":[0,', b'"data_offsets":[1e400,', 1)
    elif choice == 3:
        raw = _dump(header).replace(b'"shape":[', b'"shape":[NaN,', 1)
    elif choice == 4:
        raw = r.choice([b"null", b"[]", b"1", b'"x"', b"{}", b'{"__metadata__":null}', b"\xff\xfe{}", b"{" * 5])
    else:
        raw = _dump(header).replace(b'"shape":[', b'"shape":{"a":', 1)
    return raw, size, None


def _m_truncate(r: random.Random, entries: list) -> tuple[bytes, int, int | None]:
    header, size = _header_dict(entries)
    raw = _dump(header)
    if r.random() < 0.5:  # cut inside the header
        return raw[: r.randrange(len(raw))], 0, len(raw)
    return raw, r.randrange(size) if size else 0, None  # cut inside the data


def _m_metadata(r: random.Random, entries: list) -> tuple[bytes, int, int | None]:
    meta = r.choice([
        {wc.META_FORMAT: r.choice([wc.FORMAT_TAG, "999", ""]), wc.META_BLOCK: r.choice(["notanint", "0", "-128", ""]),
         wc.META_MODE: r.choice(["blockwise", "per_tensor", "nonsense"])},
        {"_quantization_metadata": r.choice(["{", "[]", "null", '{"layers": 5}'])},
        {str(i): "v" * r.randint(0, 50) for i in range(r.randint(0, 20))},
    ])
    header, size = _header_dict(entries, meta)
    return _dump(header), size, None


MUTATIONS: list[Mutation] = [_m_random_bytes, _m_flip_bytes, _m_header_len, _m_wrong_types, _m_offsets, _m_dtype,
                             _m_huge_shapes, _m_rank, _m_drop_keys, _m_json_edge, _m_truncate, _m_metadata]


# ---------------------------------------------------------------------------------------------------------
# the readers under test


@contextmanager
def _deadline(seconds: int) -> Iterator[None]:
    """Fail instead of hanging the suite (SIGALRM: POSIX main thread only; elsewhere no guard)."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def _raise(signum: int, frame: object) -> None:
        raise TimeoutError(f"header reader took over {seconds} s")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _readers(path: Path) -> list[tuple[str, Callable[[], object]]]:
    """Every header consumer, each given a fresh header (so one failure never hides the next)."""
    return [
        ("inspect_checkpoint", lambda: wc.inspect_checkpoint(path)),
        ("inspect_qwen_image", lambda: qwen_image.inspect_qwen_image(read_header(path))),
        ("text_encoder_format", lambda: text_encoders.text_encoder_format(read_header(path))),
        ("umt5_config_from_header", lambda: text_encoders.umt5_config_from_header(read_header(path))),
        ("qwen25_vl_config_from_header", lambda: text_encoders.qwen25_vl_config_from_header(read_header(path))),
        ("source_fingerprint", lambda: wc.source_fingerprint(path)),
    ]


def _check(path: Path, what: str, fn: Callable[[], object]) -> str:
    """'ok' or 'error'; any other exception type, or an error not naming the file, fails the test."""
    try:
        with _deadline(CALL_LIMIT_S):
            fn()
    except CheckpointError as exc:
        assert path.name in str(exc), f"{what}: error does not name the file: {exc}"
        return "error"
    except Exception as exc:  # noqa: BLE001 - the bug this test exists to catch
        pytest.fail(f"{what} on {path.name} raised {type(exc).__name__} (not CheckpointError): {exc!r}")
    return "ok"


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.__name__[3:])
def test_corrupt_headers_give_checkpoint_errors(mutation: Mutation, tmp_path: Path) -> None:
    """CASES_PER_KIND corrupt files of one kind: every reader succeeds or raises CheckpointError naming the file."""
    r = random.Random(f"lowvram-fuzz-{mutation.__name__}")
    outcomes: dict[str, int] = {}
    for i in range(CASES_PER_KIND):
        model = SEED_MODELS[i % len(SEED_MODELS)]
        raw, size, declared = mutation(r, list(_LAYOUTS[model]))
        path = _write(tmp_path / f"fuzz_{mutation.__name__[3:]}_{i:03d}.safetensors", raw, size, declared)
        for what, fn in _readers(path):
            outcome = _check(path, what, fn)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert outcomes.get("error", 0) > 0, f"{mutation.__name__} never produced a corrupt file: {outcomes}"


@pytest.mark.parametrize("model", SEED_MODELS)
def test_seed_layouts_are_valid(model: str, tmp_path: Path) -> None:
    """The unmutated seeds pass read_header and their own inspector (else the fuzz only tests the first check)."""
    header, size = _header_dict(_LAYOUTS[model])
    path = _write(tmp_path / f"{model}.safetensors", _dump(header), size)
    h = read_header(path)
    assert len(h.tensors) == len(_LAYOUTS[model])
    if model.startswith("wan"):
        assert wc.inspect_checkpoint(path, h).num_layers > 0
    elif model == "qwen_image":
        assert qwen_image.inspect_qwen_image(h).num_blocks > 0
    elif model == "umt5_xxl_enc":
        assert text_encoders.umt5_config_from_header(h)["num_layers"] == 2
    else:
        assert text_encoders.qwen25_vl_config_from_header(h)["num_hidden_layers"] == 2


def test_pickle_and_missing_files_are_refused(tmp_path: Path) -> None:
    """The two non-fuzz refusals: a pickle suffix and a missing path, each naming the file."""
    pkl = tmp_path / "model.ckpt"
    pkl.write_bytes(b"\x80\x04K\x01.")
    with pytest.raises(CheckpointError, match=r"model\.ckpt.*pickle"):
        read_header(pkl)
    with pytest.raises(CheckpointError, match="nothere.safetensors"):
        read_header(tmp_path / "nothere.safetensors")
