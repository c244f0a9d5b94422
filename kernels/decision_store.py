"""Timed kernel decisions kept across restarts: one JSON file of key -> winner per machine.

Where two candidates nearly tie, timing them again in a new process can pick the other one, and candidates that
round differently then give a different picture after a restart. So a process that has a store (``keep_in``)
looks a decision up here before timing, and writes each timed winner here. The file holds a header naming what
invalidates the decisions (file format, torch, Triton and comfy-kitchen versions, the pack's version); a file with
another header is ignored and rewritten. Keys are the deciders' tuples under a topic, written as the ``repr`` of
plain values (a dtype as its str).

Whatever sits at the file's name is read only as checkpoints/safe_read.py allows: a regular file, never through a
link, never blocking (a FIFO or a device is not opened for reading), at most MAX_FILE_BYTES. Anything there that is
not a decisions file this pack wrote (a link, FIFO, folder, an oversized, cut-off or foreign file) is renamed aside
to a new name beside it, never deleted (a link is renamed itself, never followed), said once with both names, and
the choices are kept in a new file. The file is written through checkpoints/safe_write.py, replacing only a file
that reads as this pack's. A read or write problem is logged once per file and never raised: the process then times
as it would without a store. Without ``keep_in`` nothing is read or written.

Plain torch, no ComfyUI import, no work at import time.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from ..checkpoints.safe_read import NotRegularFileError, read_regular
from ..checkpoints.safe_write import write_atomic

log = logging.getLogger("comfyui_lowvram_dit")

FORMAT = "1"  # bumped when the file's layout or the key recipe changes
KEPT_BY = "comfyui-lowvram-dit kernel decisions"  # the file's first value: proof the pack wrote it
MAX_FILE_BYTES = 16 << 20  # far above any real file (about 150 bytes per timed shape)


class Unreadable(ValueError):
    """What sits at the decisions file's name is not a decisions file this pack can read; the message says why."""


def current_header(pack_version: str = "") -> dict[str, str]:
    """What the decisions depend on besides their keys: the file format, torch (with its CUDA), Triton,
    comfy-kitchen (its kernels are candidates: installing or updating it re-times), the pack."""
    header = {"format": FORMAT, "torch": torch.__version__}
    try:
        import triton

        header["triton"] = str(triton.__version__)
    except Exception:  # noqa: BLE001 - no (or a broken) Triton: its kernels are never candidates
        pass
    try:  # package metadata only: comfy-kitchen itself is not imported
        header["comfy_kitchen"] = importlib.metadata.version("comfy-kitchen")
    except importlib.metadata.PackageNotFoundError:
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
        self._blocked = False  # something unreadable sits at the name and cannot be moved: memory only

    def get(self, topic: str, key: tuple) -> str | None:
        """The kept winner of ``key`` under ``topic``, None when none is kept."""
        text = key_text(topic, key)
        if text is None:
            return None
        return self._known().get(text)

    def under(self, topic: str) -> dict[tuple, str]:
        """Every kept key of ``topic`` (as the plain tuple it was written from) and its winner."""
        found = {}
        for text, winner in self._known().items():
            try:
                parsed = ast.literal_eval(text)
            except (ValueError, SyntaxError, MemoryError, RecursionError):  # not a key this pack wrote
                continue
            if isinstance(parsed, tuple) and parsed[:1] == (topic,):
                found[parsed[1:]] = winner
        return found

    def _known(self) -> dict[str, str]:
        """The file's decisions and this process's, the file read on first use (``put`` replaces the dict, never
        changes it, so the caller may read it after the lock is released)."""
        with self._lock:
            if self._entries is None:
                self._entries = self._read()
            return self._entries

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
        """The file's decisions; {} for no file or another header. Anything else at the name is moved aside."""
        if self._blocked:
            return {}
        try:
            data = load(self.path)
        except (FileNotFoundError, NotADirectoryError):  # no file (or no folder) yet: the first write makes it
            return {}
        except Unreadable as exc:
            self._set_aside(str(exc))
            return {}
        if data.get("header") != self.header:
            self._say("header", f"lowvram_dit: the kept kernel decisions in {self.path} were made under "
                      f"{str(data.get('header'))[:300]}, not {self.header}; timing them again", logging.INFO)
            return {}
        return dict(data["decisions"])

    def _set_aside(self, why: str) -> None:
        """Rename what sits at the file's name (a link itself, never its target) to a new name beside it."""
        aside = self.path.with_name(f"{self.path.name}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}-"
                                    f"{uuid.uuid4().hex[:6]}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:  # another process moved it meanwhile
            return
        except OSError as exc:
            self._blocked = True
            self._say("aside", f"lowvram_dit: {self.path} {why}, and it cannot be moved aside ({exc.strerror or exc}); "
                      "kernel choices stay in memory and are timed again after a restart (move or delete that "
                      "file, or make its folder writable)")
            return
        self._say("aside", f"lowvram_dit: {self.path} {why}; moved it aside to {aside} (nothing was deleted) and "
                  f"keeping kernel choices in a new {self.path.name}")

    def _write(self, entries: dict[str, str]) -> None:
        """Replace the file atomically (checkpoints/safe_write.py: only a file that reads as this pack's, never
        through a link); a failure is logged once and leaves the decisions in memory only."""
        if self._blocked:
            return
        text = json.dumps({"kept_by": KEPT_BY, "header": self.header, "decisions": dict(sorted(entries.items()))},
                          indent=1)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, text + "\n", owned=is_decisions_file)
        except Exception as exc:  # noqa: BLE001 - never fail a model call over the file
            self._say("write", f"lowvram_dit: cannot keep kernel decisions in {self.path} ({exc}); they are timed "
                      "again after a restart, so near ties may change the picture (make the folder writable)")

    def _say(self, what: str, message: str, level: int = logging.WARNING) -> None:
        if what not in self._said:
            self._said.add(what)
            log.log(level, message)


def load(path: Path) -> dict[str, Any]:
    """The decisions file at ``path`` as written by this pack; Unreadable naming why for anything else there,
    FileNotFoundError (NotADirectoryError) when nothing is."""
    try:
        raw = read_regular(path, MAX_FILE_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        raise
    except NotRegularFileError as exc:
        raise Unreadable(str(exc.strerror)) from None
    except OSError as exc:
        raise Unreadable(f"cannot be read ({exc.strerror or exc})") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise Unreadable("is not UTF-8 text, so not a decisions file") from None
    except json.JSONDecodeError as exc:
        raise Unreadable(f"is not JSON ({exc})") from None
    except (ValueError, RecursionError):  # a number of thousands of digits, nesting deeper than the parser goes
        raise Unreadable("is not JSON this pack can read") from None
    if not isinstance(data, dict) or data.get("kept_by") != KEPT_BY:
        raise Unreadable("was not written by this pack (no kept_by marker)")
    if not isinstance(data.get("decisions"), dict) \
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in data["decisions"].items()):
        raise Unreadable("is not in the expected form")
    return data


def is_decisions_file(path: Path) -> bool:
    """Whether ``path`` reads as a decisions file of this pack: the proof that lets a write replace it."""
    try:
        load(path)
    except (OSError, Unreadable):
        return False
    return True


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


def kept_under(topic: str) -> dict[tuple, str]:
    """Every key kept under ``topic`` by this or an earlier process, with its winner; {} without a store."""
    store = _STORE
    return {} if store is None or not topic else store.under(topic)


def keep(topic: str, key: tuple, winner: str) -> None:
    """Keep ``winner`` for ``key`` under ``topic`` (nothing without a store or topic)."""
    store = _STORE
    if store is not None and topic:
        store.put(topic, key, winner)
