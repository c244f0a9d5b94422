"""On-disk cache of prompt embeddings (CONDITIONING lists) for the staged text encoders, keyed by file identity.

Plain torch, no ComfyUI. Used by host/wan_text.py, host/qwen_stages.py and host/qwen_edit.py through host/files.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any

import torch

from .safetensors_io import StreamingSafetensorsWriter, iter_tensors, read_header, written_with
from .wan import source_fingerprint

log = logging.getLogger("comfyui_lowvram_dit")

_FINGERPRINTS: dict[tuple[str, int, int], str] = {}


def file_identity(path: str | Path) -> str:
    """Content fingerprint of a safetensors file (checkpoints/wan.py source_fingerprint), memoised by
    (path, size, mtime) so a cache lookup does not re-read 16 MiB every run."""
    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_size, st.st_mtime_ns)
    if key not in _FINGERPRINTS:
        _FINGERPRINTS[key] = source_fingerprint(p)
    return _FINGERPRINTS[key]


# ----------------------------------------------------------------------------------------------------------
# Embedding cache

CACHE_VERSION = "qwen-embed-v1"
_META_KEY = "lowvram_dit.embedding"


def embedding_cache_key(prompt: str, template: str, encoder: dict[str, Any]) -> str:
    """sha256 over the prompt, the prompt template and the encoder identity (fingerprint, dtype, format, ...).

    Everything that changes the embedding must be in ``encoder``: a cache keyed by the prompt alone serves
    stale embeddings after an encoder swap. Lone surrogates (valid in a JSON prompt, not in UTF-8) are
    encoded losslessly ("surrogatepass"), so every prompt has a key.
    """
    blob = json.dumps({"v": CACHE_VERSION, "prompt": prompt, "template": template, "encoder": encoder},
                      sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 over a tensor's dtype, shape and bytes (an input image's content, as a cache key part)."""
    c = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{c.dtype}|{list(c.shape)}|".encode())
    if c.numel():
        h.update(c.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _split_conditioning(cond: list) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """CONDITIONING ``[[tensor, {extras}], ...]`` -> (tensors by name, JSON description); ValueError if an
    extra is neither a tensor nor a JSON scalar (such conditionings are not cached)."""
    tensors: dict[str, torch.Tensor] = {}
    entries: list[dict[str, Any]] = []
    for i, (t, extra) in enumerate(cond):
        tensors[f"{i}.cond"] = t.detach().to("cpu").contiguous()
        desc: dict[str, Any] = {"tensors": [], "values": {}}
        for k, v in extra.items():
            if isinstance(v, torch.Tensor):
                tensors[f"{i}.{k}"] = v.detach().to("cpu").contiguous()
                desc["tensors"].append(k)
            elif v is None or isinstance(v, (bool, int, float, str)):
                desc["values"][k] = v
            else:
                raise ValueError(f"conditioning extra {k!r} of type {type(v).__name__} is not cacheable")
        entries.append(desc)
    return tensors, entries


_SCALAR = (type(None), bool, int, float, str)
_MAX_ENTRIES_PER_FILE = 64  # a CONDITIONING list from one prompt has a handful; more means a damaged entry


def _check_tensor(name: str, t: torch.Tensor, expect_dim: int | None) -> None:
    """ValueError unless ``t`` can be served: a finite float [batch, tokens, expect_dim] embedding for ``cond``,
    any finite tensor of rank <= 4 for an extra (masks, pooled outputs)."""
    if name.endswith(".cond"):
        if not t.is_floating_point() or t.ndim != 3 or 0 in t.shape:
            raise ValueError(f"tensor {name!r} is {t.dtype} {list(t.shape)}, not a [batch, tokens, dim] embedding")
        if expect_dim is not None and t.shape[-1] != expect_dim:
            raise ValueError(f"tensor {name!r} has width {t.shape[-1]}, the text encoder gives {expect_dim}")
    elif t.ndim > 4:
        raise ValueError(f"tensor {name!r} has {t.ndim} dimensions")
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"tensor {name!r} holds NaN or infinite values")


def _conditioning_from(path: Path, key: str, expect_dim: int | None) -> list:
    """The CONDITIONING stored in entry ``path`` for ``key``, every part validated; ValueError/CheckpointError else."""
    header = read_header(path)
    meta = json.loads(header.metadata[_META_KEY])
    if not isinstance(meta, dict) or meta.get("key") != key or meta.get("version") != CACHE_VERSION:
        raise ValueError("written for another key or cache version")
    entries = meta.get("entries")
    if not isinstance(entries, list) or not 1 <= len(entries) <= _MAX_ENTRIES_PER_FILE:
        raise ValueError("no list of conditioning entries in its metadata")
    names: list[str] = []
    for i, desc in enumerate(entries):
        ok = isinstance(desc, dict) and isinstance(desc.get("tensors"), list) and isinstance(desc.get("values"), dict)
        if not ok or not all(isinstance(k, str) for k in desc["tensors"]) \
                or not all(isinstance(v, _SCALAR) for v in desc["values"].values()):
            raise ValueError(f"conditioning entry {i} of its metadata is malformed")
        names += [f"{i}.cond", *(f"{i}.{k}" for k in desc["tensors"])]
    missing = [n for n in names if n not in header.tensors]
    if missing:
        raise ValueError(f"tensors {missing[:3]} are missing")
    tensors = dict(iter_tensors(header, names))
    for name, t in tensors.items():
        _check_tensor(name, t, expect_dim)
    return [[tensors[f"{i}.cond"], {**desc["values"], **{k: tensors[f"{i}.{k}"] for k in desc["tensors"]}}]
            for i, desc in enumerate(entries)]


_WARNED: set[str] = set()


def _warn_once(topic: str, msg: str, *args: object) -> None:
    """Log ``msg`` as a warning the first time ``topic`` comes up in this process, at debug level after that."""
    level = logging.DEBUG if topic in _WARNED else logging.WARNING
    _WARNED.add(topic)
    log.log(level, msg, *args)


def _failure_kind(exc: BaseException) -> str:
    """What kind of failure ``exc`` is (its type and errno): a read-only folder and, later, a full disk are two
    kinds, each warned about once."""
    return f"{type(exc).__name__}:{getattr(exc, 'errno', None)}"


def _remove(path: Path) -> None:
    """Delete a cache entry of any kind (file, link, directory); a failure to delete is not an error."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


class EmbeddingCache:
    """On-disk cache of CONDITIONING lists, one safetensors file per key, named by the key's hash.

    The cache is an optimisation only: it never fails a prompt. An entry that cannot be read or does not
    validate (dtype, shape, finite values, metadata types) is dropped and counts as a miss; a write that fails
    (read-only or full disk, a directory in the way) leaves no temp file and no open handle behind, and the
    prompt runs uncached. Each problem is logged as a warning once (a write failure once per folder and kind of
    failure), naming the file or folder. Writes are
    atomic and never follow a link (checkpoints/safe_write.py). ``max_entries`` bounds the folder (oldest
    by mtime go first).
    """

    def __init__(self, root: str | Path, max_entries: int = 512) -> None:
        self.root = Path(root)
        self.max_entries = max_entries

    def path_for(self, key: str) -> Path:
        """Where the entry for ``key`` lives (two-level fan-out keeps folders small)."""
        if not re.fullmatch(r"[0-9a-f]{64}", key):
            raise ValueError(f"cache key must be a sha256 hex digest, got {key!r}")
        return self.root / key[:2] / f"{key}.safetensors"

    def get(self, key: str, expect_dim: int | None = None) -> list | None:
        """The cached CONDITIONING for ``key`` (CPU tensors), or None; ``expect_dim``: the encoder's width."""
        path = self.path_for(key)
        try:
            mode = path.lstat().st_mode
        except OSError:  # absent, or a parent that is not a folder (then put() says so)
            return None
        try:
            if not stat.S_ISREG(mode):  # a directory, link or FIFO (reading a FIFO would block the prompt)
                raise ValueError("not a regular file")
            out = _conditioning_from(path, key, expect_dim)
        except Exception as exc:  # noqa: BLE001 - an entry can be damaged in any way; the cache is only an optimisation
            _warn_once(f"read:{path}", "lowvram_dit: dropping damaged embedding cache entry %s (%s: %s); the prompt "
                       "is encoded again", path, type(exc).__name__, exc)
            _remove(path)
            return None
        try:
            os.utime(path)  # recently used entries survive pruning
        except OSError:
            pass
        return out

    def put(self, key: str, conditioning: list, info: dict[str, Any] | None = None) -> Path | None:
        """Store ``conditioning`` atomically; returns the path, or None when it is not cached (never raises)."""
        try:
            tensors, entries = _split_conditioning(conditioning)
        except ValueError as exc:
            log.info("lowvram_dit: embeddings not cached: %s", exc)
            return None
        path = self.path_for(key)
        meta = {_META_KEY: json.dumps({"version": CACHE_VERSION, "key": key, "entries": entries,
                                        "info": info or {}}, default=str)}
        layout = [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
        writer: StreamingSafetensorsWriter | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # an entry is replaced only when it is one (its metadata key); a link or a user's file is not
            writer = StreamingSafetensorsWriter(path, layout, meta, owned=written_with(_META_KEY))
            for k, v in tensors.items():
                writer.write(k, v)
            writer.close()  # a hidden temp file beside the entry, fsynced, renamed onto it
        except BaseException as exc:
            if writer is not None:
                writer.abort()  # closes the handle: an open deleted file would keep a full disk full
            if not isinstance(exc, Exception):
                raise
            _warn_once(f"write:{self.root}:{_failure_kind(exc)}", "lowvram_dit: cannot write the embedding cache in "
                       "%s (%s: %s); prompts run without caching", self.root, type(exc).__name__, exc)
            return None
        self.prune()
        return path

    def entries(self) -> list[Path]:
        """Every complete entry file."""
        try:
            return sorted(self.root.glob("??/*.safetensors")) if self.root.is_dir() else []
        except OSError:
            return []

    def prune(self) -> int:
        """Delete the least recently used entries beyond ``max_entries``; returns how many went."""
        files = self.entries()
        if len(files) <= self.max_entries:
            return 0
        stamped = []
        for p in files:
            try:
                stamped.append((p.lstat().st_mtime, p))
            except OSError:  # removed by another process meanwhile
                pass
        stamped.sort()
        gone = [p for _, p in stamped[: len(stamped) - self.max_entries]]
        for p in gone:
            _remove(p)
        return len(gone)
