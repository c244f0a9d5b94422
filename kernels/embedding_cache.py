"""On-disk cache of prompt embeddings (CONDITIONING lists) for the staged text encoders, keyed by file identity.

Plain torch, no ComfyUI. Used by nodes/wan_text.py and nodes/qwen_staged.py through nodes/glue/common.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import uuid
from pathlib import Path
from typing import Any

import torch

from .checkpoint_io import CheckpointError, StreamingSafetensorsWriter, iter_tensors, read_header
from .wan_checkpoint import source_fingerprint

log = logging.getLogger("comfyui_lowvram_dit")

_FINGERPRINTS: dict[tuple[str, int, int], str] = {}


def file_identity(path: str | Path) -> str:
    """Content fingerprint of a safetensors file (kernels.wan_checkpoint.source_fingerprint), memoised by
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
    stale embeddings after an encoder swap.
    """
    blob = json.dumps({"v": CACHE_VERSION, "prompt": prompt, "template": template, "encoder": encoder},
                      sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


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


class EmbeddingCache:
    """On-disk cache of CONDITIONING lists, one safetensors file per key, named by the key's hash.

    Writes are atomic (temp file in the same folder + fsync + ``os.replace``), so a crash or a second
    process never leaves a half-written entry under a real name; unreadable entries count as misses and
    are removed. ``max_entries`` bounds the folder (oldest by mtime go first).
    """

    def __init__(self, root: str | Path, max_entries: int = 512) -> None:
        self.root = Path(root)
        self.max_entries = max_entries

    def path_for(self, key: str) -> Path:
        """Where the entry for ``key`` lives (two-level fan-out keeps folders small)."""
        if not re.fullmatch(r"[0-9a-f]{64}", key):
            raise ValueError(f"cache key must be a sha256 hex digest, got {key!r}")
        return self.root / key[:2] / f"{key}.safetensors"

    def get(self, key: str) -> list | None:
        """The cached CONDITIONING for ``key`` (CPU tensors), or None."""
        path = self.path_for(key)
        if not path.is_file():
            return None
        try:
            header = read_header(path)
            meta = json.loads(header.metadata[_META_KEY])
            if meta.get("key") != key or meta.get("version") != CACHE_VERSION:
                raise CheckpointError(f"{path.name}: written for another key/version")
            tensors = dict(iter_tensors(header))
            out = []
            for i, desc in enumerate(meta["entries"]):
                extra: dict[str, Any] = dict(desc["values"])
                for k in desc["tensors"]:
                    extra[k] = tensors[f"{i}.{k}"]
                out.append([tensors[f"{i}.cond"], extra])
        except (CheckpointError, KeyError, ValueError, TypeError, OSError) as exc:
            log.warning("lowvram_dit: dropping unreadable embedding cache entry %s (%s)", path, exc)
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)  # recently used entries survive pruning
        except OSError:
            pass
        return out

    def put(self, key: str, conditioning: list, info: dict[str, Any] | None = None) -> Path | None:
        """Store ``conditioning`` atomically; returns the path, or None when it cannot be cached."""
        try:
            tensors, entries = _split_conditioning(conditioning)
        except ValueError as exc:
            log.info("lowvram_dit: embeddings not cached: %s", exc)
            return None
        path = self.path_for(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {_META_KEY: json.dumps({"version": CACHE_VERSION, "key": key, "entries": entries,
                                        "info": info or {}}, default=str)}
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        layout = [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
        try:
            writer = StreamingSafetensorsWriter(tmp, layout, meta)
            for k, v in tensors.items():
                writer.write(k, v)
            writer.close()  # writes <tmp>.partial, renames it to tmp
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            for junk in (tmp, tmp.with_name(tmp.name + ".partial")):
                junk.unlink(missing_ok=True)
            raise
        self.prune()
        return path

    def entries(self) -> list[Path]:
        """Every complete entry file."""
        return sorted(self.root.glob("??/*.safetensors")) if self.root.is_dir() else []

    def prune(self) -> int:
        """Delete the least recently used entries beyond ``max_entries``; returns how many went."""
        files = self.entries()
        if len(files) <= self.max_entries:
            return 0
        files.sort(key=lambda p: p.stat().st_mtime)
        gone = files[: len(files) - self.max_entries]
        for p in gone:
            p.unlink(missing_ok=True)
        return len(gone)
