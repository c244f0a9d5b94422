"""Timed kernel decisions kept across restarts: one JSON file of key -> winner per machine.

Where two candidates nearly tie, timing them again in a new process can pick the other one, and candidates that
round differently then give a different picture after a restart. So a process that has a store (``keep_in``)
looks a decision up here before timing, and writes each timed winner here. The file holds a header naming what
invalidates the decisions (file format, torch and Triton versions, the pack's version); a file with another
header is ignored and rewritten. The file is written through checkpoints/safe_write.py: a file there that the pack
did not write is never replaced. Keys are the deciders' tuples under a topic, written as the ``repr`` of plain
values (a dtype as its str). A read or write problem is logged once per file and never raised: the process then
times as it would without a store. Without ``keep_in`` nothing is read or written.

Plain torch, no ComfyUI import, no work at import time.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import torch

from ..checkpoints.safe_write import write_report

log = logging.getLogger("comfyui_lowvram_dit")

FORMAT = "1"  # bumped when the file's layout or the key recipe changes
KEPT_BY = "comfyui-lowvram-dit kernel decisions"  # the file's first value: proof the pack wrote it


def current_header(pack_version: str = "") -> dict[str, str]:
    """What the decisions depend on besides their keys: the file format, torch (with its CUDA), Triton, the pack."""
    header = {"format": FORMAT, "torch": torch.__version__}
    try:
        import triton

        header["triton"] = str(triton.__version__)
    except Exception:  # noqa: BLE001 - no (or a broken) Triton: its kernels are never candidates
        pass
    if pack_version:
        header["pack"] = pack_version
    return header


def _plain(value: Any) -> Any:
    """``value`` with tuples of str/int/float/bool/None and dtypes (as their str); TypeError for anything else."""
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, torch.dtype):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"a decision key holds a {type(value).__name__}")


def key_text(topic: str, key: tuple) -> str | None:
    """The file's name of ``key`` under ``topic``: repr of the plain tuple; None for a key that cannot be kept."""
    try:
        return repr((topic, *_plain(tuple(key))))
    except TypeError:
        return None


class DecisionStore:
    """One decisions file: read once when first asked, rewritten whole and atomically per new winner."""

    def __init__(self, path: Path, header: dict[str, str]) -> None:
        self.path, self.header = Path(path), dict(header)
        self._entries: dict[str, str] | None = None  # the file's decisions and this process's, once read
        self._lock = threading.Lock()
        self._said: set[str] = set()

    def get(self, topic: str, key: tuple) -> str | None:
        """The kept winner of ``key`` under ``topic``, None when none is kept."""
        text = key_text(topic, key)
        if text is None:
            return None
        with self._lock:
            if self._entries is None:
                self._entries = self._read()
            return self._entries.get(text)

    def put(self, topic: str, key: tuple, winner: str) -> None:
        """Keep ``winner`` for ``key``; the file also keeps what another process wrote there meanwhile."""
        text = key_text(topic, key)
        if text is None:
            return
        with self._lock:
            mine = self._entries if self._entries is not None else {}
            self._entries = {**self._read(), **mine, text: str(winner)}
            self._write(self._entries)

    def _read(self) -> dict[str, str]:
        """The file's decisions; {} for no file, another header, or a file that cannot be read (logged once)."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except Exception as exc:  # noqa: BLE001 - unreadable or not JSON: time again, never fail a model call
            self._say("read", f"lowvram_dit: cannot read the kept kernel decisions in {self.path} ({exc}); timing "
                      "them again and rewriting the file (delete it if this message comes back)")
            return {}
        if not isinstance(data, dict) or not isinstance(data.get("decisions"), dict) \
                or not all(isinstance(k, str) and isinstance(v, str) for k, v in data["decisions"].items()):
            self._say("read", f"lowvram_dit: the kept kernel decisions in {self.path} are not in the expected "
                      "form; timing them again and rewriting the file (delete it if this message comes back)")
            return {}
        if data.get("header") != self.header:
            self._say("header", f"lowvram_dit: the kept kernel decisions in {self.path} were made under "
                      f"{data.get('header')}, not {self.header}; timing them again", logging.INFO)
            return {}
        return dict(data["decisions"])

    def _write(self, entries: dict[str, str]) -> None:
        """Replace the file atomically (checkpoints/safe_write.py: only a file that starts as this one does, never
        through a link); a failure is logged once and leaves the decisions in memory only."""
        text = json.dumps({"kept_by": KEPT_BY, "header": self.header, "decisions": dict(sorted(entries.items()))},
                          indent=1)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_report(self.path, text + "\n")
        except Exception as exc:  # noqa: BLE001 - never fail a model call over the file
            self._say("write", f"lowvram_dit: cannot keep kernel decisions in {self.path} ({exc}); they are timed "
                      "again after a restart, so near ties may change the picture (make the folder writable, or "
                      "delete the file if the pack did not write it)")

    def _say(self, what: str, message: str, level: int = logging.WARNING) -> None:
        if what not in self._said:
            self._said.add(what)
            log.log(level, message)


_STORE: DecisionStore | None = None


def keep_in(path: Path | None, pack_version: str = "") -> None:
    """Keep decisions in the file ``path`` from now on (None: in memory only, the default). Setting the path the
    store already uses keeps it (and what it has read)."""
    global _STORE
    if path is None:
        _STORE = None
    elif _STORE is None or _STORE.path != Path(path) or _STORE.header != current_header(pack_version):
        _STORE = DecisionStore(Path(path), current_header(pack_version))


def kept_in() -> Path | None:
    """The decisions file in use, None when decisions are kept in memory only."""
    return None if _STORE is None else _STORE.path


def kept(topic: str, key: tuple) -> str | None:
    """The winner kept for ``key`` under ``topic`` by this or an earlier process; None without a store."""
    store = _STORE
    return None if store is None or not topic else store.get(topic, key)


def keep(topic: str, key: tuple, winner: str) -> None:
    """Keep ``winner`` for ``key`` under ``topic`` (nothing without a store or topic)."""
    store = _STORE
    if store is not None and topic:
        store.put(topic, key, winner)
