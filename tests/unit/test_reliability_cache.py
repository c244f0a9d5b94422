"""The embedding cache never fails a prompt, never leaks a handle or a temp file, and names each damaged entry.

Seeded fuzz over the classes of damage a hostile user (or a dying disk) can cause: corrupt metadata of every JSON
type, absurd nesting, wrong shapes/dtypes/non-finite values, an entry replaced by a directory, a link or a FIFO,
a cache folder that is a file, a disk that fills at a random byte, a failing rename, and unencodable prompts.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pathlib
import random
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from comfyui_lowvram_dit.checkpoints import embedding_cache as ec
from comfyui_lowvram_dit.checkpoints import safe_write
from comfyui_lowvram_dit.checkpoints.safetensors_io import StreamingSafetensorsWriter

ENC = {"sha256": "a" * 64, "format": "bfloat16", "dtype": "bfloat16", "config": {"hidden_size": 64}}
DIM = 64
SEED = 1234
TIME_LIMIT_S = 60.0


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ec, "_WARNED", set())


def _cond(rng: random.Random, tokens: int | None = None) -> list:
    t = torch.randn(1, tokens or rng.randint(1, 9), DIM, generator=torch.Generator().manual_seed(rng.randint(0, 1 << 30)))
    return [[t, {"pooled_output": None, "attention_mask": torch.ones(1, t.shape[1], dtype=torch.int64)}]]


def open_fds_under(root: Path) -> list[str]:
    """Paths under ``root`` this process holds open (Linux), deleted files included."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(root)):
            out.append(target)
    return out


def _write_entry(path: Path, meta: object, tensors: dict[str, torch.Tensor], raw_meta: str | None = None) -> None:
    """An entry file with arbitrary (possibly wrong) metadata and tensors, as a hostile user would write it."""
    text = raw_meta if raw_meta is not None else json.dumps(meta)
    layout = [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    with StreamingSafetensorsWriter(path, layout, {ec._META_KEY: text}) as w:
        for k, v in tensors.items():
            w.write(k, v)


def _valid_meta(key: str, extras: list[str] | None = None) -> dict:
    return {"version": ec.CACHE_VERSION, "key": key, "info": {},
            "entries": [{"tensors": extras or [], "values": {"pooled_output": None}}]}


def _damage(kind: str, path: Path, key: str, rng: random.Random, outside: Path) -> None:
    """Replace the entry at ``path`` by one damaged in the way ``kind`` names."""
    good = {"0.cond": torch.randn(1, 3, DIM)}
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "meta_type":
        meta = rng.choice([[1, 2], 7, "text", None, True, {"entries": "x", "key": key, "version": ec.CACHE_VERSION},
                           {**_valid_meta(key), "entries": [[1], 2]},
                           {**_valid_meta(key), "entries": [{"tensors": [3], "values": {}}]},
                           {**_valid_meta(key), "entries": [{"tensors": [], "values": {"a": [1]}}]},
                           {**_valid_meta(key), "entries": [{"tensors": "cond", "values": []}]}])
        _write_entry(path, meta, good)
    elif kind == "nesting":
        depth = rng.randint(5_000, 200_000)
        _write_entry(path, None, good, raw_meta="[" * depth + "]" * depth)
    elif kind == "not_json":
        _write_entry(path, None, good, raw_meta=rng.choice(["{", "\x00\x01", "NaN-ish", '{"key": 1']))
    elif kind == "shape":
        bad = rng.choice([torch.randn(1, 3, DIM + 1), torch.randn(3, DIM), torch.randn(1, 0, DIM),
                          torch.randn(1, 1, 1, DIM), torch.ones(1, 3, DIM, dtype=torch.int32),
                          torch.ones(1, 3, DIM, dtype=torch.bool)])
        _write_entry(path, _valid_meta(key), {"0.cond": bad})
    elif kind == "nonfinite":
        t = torch.randn(1, 3, DIM)
        t[0, rng.randrange(3), rng.randrange(DIM)] = rng.choice([float("nan"), float("inf"), -float("inf")])
        target = rng.choice(["cond", "extra"])
        if target == "cond":
            _write_entry(path, _valid_meta(key), {"0.cond": t})
        else:
            _write_entry(path, _valid_meta(key, ["mask"]), {"0.cond": torch.randn(1, 3, DIM), "0.mask": t})
    elif kind == "missing_tensor":
        _write_entry(path, _valid_meta(key, ["attention_mask"]), good)
    elif kind == "directory":
        path.mkdir()
        (path / "inside.txt").write_text("x")
    elif kind == "symlink":
        path.symlink_to(outside)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "garbage":
        n = rng.randint(0, 300)
        path.write_bytes(struct.pack("<Q", rng.randint(0, 1 << 40)) + os.urandom(n))
    else:
        raise AssertionError(kind)


READ_DAMAGE = ["meta_type", "nesting", "not_json", "shape", "nonfinite", "missing_tensor", "directory", "symlink",
               "fifo", "garbage"]


def test_damaged_entries_are_dropped_named_once_and_recomputed(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(SEED)
    cache = ec.EmbeddingCache(tmp_path / "cache")
    outside = tmp_path / "users_model.safetensors"  # a link may point at a user's file: only the link goes
    outside.write_bytes(b"precious")
    t0 = time.monotonic()
    cases = [k for k in READ_DAMAGE for _ in range(3)]
    rng.shuffle(cases)
    for n, kind in enumerate(cases):
        assert time.monotonic() - t0 < TIME_LIMIT_S, "fuzz ran out of its time budget"
        key = ec.embedding_cache_key(f"prompt {n}", "t", ENC)
        path = cache.path_for(key)
        _damage(kind, path, key, rng, outside)
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="comfyui_lowvram_dit"):
            assert cache.get(key, expect_dim=DIM) is None, kind  # a miss, not an exception, not a wrong embedding
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and str(path) in warnings[0], (kind, warnings)
        assert not os.path.lexists(path), f"{kind}: the damaged entry was not removed"
        cond = _cond(rng)  # the prompt is encoded again and cached again
        assert cache.put(key, cond) is not None, kind
        got = cache.get(key, expect_dim=DIM)
        assert got is not None and torch.equal(got[0][0], cond[0][0]), kind
    assert outside.read_bytes() == b"precious"
    assert open_fds_under(tmp_path) == []


def test_entry_of_another_width_is_not_served(tmp_path: Path) -> None:
    cache = ec.EmbeddingCache(tmp_path)
    key = ec.embedding_cache_key("p", "t", ENC)
    assert cache.put(key, [[torch.randn(1, 4, DIM), {}]]) is not None
    assert cache.get(key, expect_dim=DIM + 8) is None and cache.entries() == []


class _FullDisk:
    """A file that accepts ``budget`` bytes, then fails every write with ENOSPC (and its flush on close)."""

    def __init__(self, f, budget: int) -> None:  # noqa: ANN001
        self._f, self._budget, self._written = f, budget, 0

    def write(self, data) -> int:  # noqa: ANN001
        n = memoryview(data).nbytes
        if self._written + n > self._budget:
            raise OSError(errno.ENOSPC, "No space left on device")
        self._written += n
        return self._f.write(data)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._f, name)

    def __enter__(self) -> _FullDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


@pytest.fixture
def full_disk(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict]:
    """``state["budget"]`` bytes may be written to files opened for writing under ``state["root"]``."""
    state: dict = {"root": None, "budget": 0}
    real_open = pathlib.Path.open

    def fake_open(self: Path, mode: str = "r", *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        f = real_open(self, mode, *args, **kwargs)
        if state["root"] is not None and "w" in mode and str(self).startswith(str(state["root"])):
            return _FullDisk(f, state["budget"])
        return f

    real_exclusive = safe_write._open_exclusive

    def fake_exclusive(path: Path):  # noqa: ANN202 - the pack's writes open their temp files here
        f = real_exclusive(path)
        if state["root"] is not None and str(path).startswith(str(state["root"])):
            return _FullDisk(f, state["budget"])
        return f

    monkeypatch.setattr(pathlib.Path, "open", fake_open)
    monkeypatch.setattr(safe_write, "_open_exclusive", fake_exclusive)
    yield state


def test_full_disk_runs_uncached_and_leaves_no_file_or_handle(tmp_path: Path, full_disk: dict,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(SEED + 1)
    root = tmp_path / "cache"
    cache = ec.EmbeddingCache(root)
    full_disk["root"] = root
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="comfyui_lowvram_dit"):
        for n in range(25):
            assert time.monotonic() - t0 < TIME_LIMIT_S
            full_disk["budget"] = rng.choice([0, 4, 8, rng.randint(9, 400), rng.randint(400, 2200)])
            key = ec.embedding_cache_key(f"p{n}", "t", ENC)
            err = None
            try:
                result = cache.put(key, _cond(rng, tokens=9))  # 2.3 kB of tensors: more than the budget
            except Exception as exc:  # noqa: BLE001 - kept: its traceback would keep a leaked handle alive
                err = exc
                result = None
            assert err is None, f"a failed cache write failed the prompt: {err!r}"
            assert result is None
            assert open_fds_under(root) == [], "an open handle keeps the full disk full"
            assert [p for p in root.rglob("*") if not p.is_dir()] == [], "a temp file survived the failed write"
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and str(root) in warnings[0] and "No space left" in warnings[0], warnings
    full_disk["root"] = None  # space again: the cache works
    key = ec.embedding_cache_key("after", "t", ENC)
    assert cache.put(key, _cond(rng)) is not None and cache.get(key, expect_dim=DIM) is not None


@pytest.mark.parametrize("obstacle", ["root_is_file", "fanout_is_file", "entry_is_dir", "replace_fails"])
def test_unwritable_cache_never_fails_the_prompt(tmp_path: Path, obstacle: str, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "cache"
    cache = ec.EmbeddingCache(root)
    key = ec.embedding_cache_key("p", "t", ENC)
    if obstacle == "root_is_file":
        root.write_text("not a folder")
    elif obstacle == "fanout_is_file":
        root.mkdir()
        cache.path_for(key).parent.write_text("not a folder")
    elif obstacle == "entry_is_dir":
        cache.path_for(key).mkdir(parents=True)
    else:
        def refuse(src: object, dst: object) -> None:
            raise OSError(errno.EROFS, "Read-only file system")

        monkeypatch.setattr(ec.os, "replace", refuse)
    with caplog.at_level(logging.WARNING, logger="comfyui_lowvram_dit"):
        assert cache.put(key, _cond(random.Random(0))) is None
        assert cache.put(key, _cond(random.Random(1))) is None
    assert len(caplog.records) == 1 and str(root) in caplog.records[0].getMessage()  # once, naming the folder
    assert open_fds_under(tmp_path) == []
    junk = [p for p in tmp_path.rglob("*") if p.name.endswith((".tmp", ".partial"))]
    assert junk == []


def test_unencodable_prompts_have_keys_and_round_trip(tmp_path: Path) -> None:
    rng = random.Random(SEED + 2)
    cache = ec.EmbeddingCache(tmp_path)
    prompts = ["\ud800", "a\udfffb", "\udc80" * 3, "ok \U0001f600", "\x00", ""]
    prompts += ["".join(chr(rng.randint(0, 0x10FFFF)) for _ in range(rng.randint(1, 30))) for _ in range(20)]
    keys = [ec.embedding_cache_key(p, "t", ENC) for p in prompts]
    assert len(set(keys)) == len(set(prompts))
    for k in keys[:6]:
        cond = _cond(rng)
        assert cache.put(k, cond, info={"encoder": "\ud800.safetensors"}) is not None
        assert torch.equal(cache.get(k, expect_dim=DIM)[0][0], cond[0][0])
