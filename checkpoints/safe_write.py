"""Every file the pack writes: created exclusively beside its destination, then renamed into place atomically.

Plain Python, no torch, no ComfyUI; kernels, nodes, tools and benchmarks all write through here.

The rule, for a destination ``dest``:

- The content goes to a new, uniquely named hidden temp file in ``dest``'s folder, opened with
  ``O_CREAT | O_EXCL | O_NOFOLLOW``: never an existing file, never the file a link points to. It is flushed and
  fsynced, then renamed onto ``dest`` with ``os.replace`` (atomic: readers see the old file or the whole new one).
  On any failure the temp file is deleted.
- ``dest`` absent: it is created.
- ``dest`` a symbolic link, a folder or anything but a regular file: never replaced (UnsafeTargetError naming it).
- ``dest`` a regular file: replaced only when the caller's ``owned(dest)`` proves the pack wrote it (a metadata tag
  in a safetensors header, the marker or title a report starts with); without such proof it is left untouched
  (UnsafeTargetError). ``dest`` is checked before the content is produced and again just before the rename; a
  link put there between that check and the rename is itself replaced, never written through.
"""

from __future__ import annotations

import contextlib
import os
import stat
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

Owned = Callable[[Path], bool]
TORCH_ARCHIVE = b"PK\x03\x04"  # torch.save's zip format: proof for a tensor file a benchmark rewrites
_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
          | getattr(os, "O_BINARY", 0))


class UnsafeTargetError(FileExistsError):
    """The destination holds something the pack may not replace; the message names it and the fix."""


def _open_exclusive(path: Path) -> BinaryIO:
    """A new empty file at exactly ``path``, open for writing; FileExistsError when anything (a link too) is there."""
    fd = os.open(path, _FLAGS, 0o666)
    try:
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


def refuse_unowned(dest: str | os.PathLike[str], owned: Owned | None = None) -> None:
    """UnsafeTargetError unless ``dest`` is absent or a regular file that ``owned`` proves the pack wrote."""
    dest = Path(dest)
    try:
        mode = os.lstat(dest).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        what = "is a symbolic link"
    elif not stat.S_ISREG(mode):
        what = "is not a regular file"
    elif owned is not None and _proven(owned, dest):
        return
    else:
        what = "exists and was not written by this pack"
    raise UnsafeTargetError(f"{dest}: {what}; it is left untouched and nothing was written there (move or rename "
                            "it, or choose another output name)")


def _proven(owned: Owned, dest: Path) -> bool:
    """``owned(dest)``, False when the check itself fails (an unreadable file proves nothing)."""
    try:
        return bool(owned(dest))
    except Exception:  # noqa: BLE001 - a file that cannot be read is not proven the pack's
        return False


def temp_beside(dest: str | os.PathLike[str]) -> tuple[Path, BinaryIO]:
    """A new hidden temp file in ``dest``'s folder (unique name, created exclusively) and its open handle."""
    dest = Path(dest)
    for _ in range(8):
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
        try:
            return tmp, _open_exclusive(tmp)
        except FileExistsError:
            continue
    raise FileExistsError(f"{dest.parent}: no free temp file name beside {dest.name}; remove stale .tmp files there")


def commit(tmp: Path, dest: str | os.PathLike[str], owned: Owned | None = None) -> Path:
    """Rename the finished ``tmp`` onto ``dest`` (os.replace) when refuse_unowned allows it; ``tmp`` is deleted
    when it does not."""
    dest = Path(dest)
    try:
        refuse_unowned(dest, owned)
        os.replace(tmp, dest)
    except BaseException:
        discard(tmp)
        raise
    return dest


def discard(tmp: Path) -> None:
    """Delete a temp file; never raises (it runs while another error propagates)."""
    with contextlib.suppress(OSError):
        os.unlink(tmp)


def write_atomic(dest: str | os.PathLike[str], content: bytes | str | Callable[[BinaryIO], object],
                 owned: Owned | None = None) -> Path:
    """Write ``content`` (bytes, UTF-8 text, or a function that writes to the handle) to ``dest`` by the rule in the
    module docstring; returns ``dest``."""
    dest = Path(dest)
    refuse_unowned(dest, owned)  # before any work: a refusal costs nothing
    tmp, f = temp_beside(dest)
    try:
        with f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode("utf-8", "replace") if isinstance(content, str) else content)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        discard(tmp)
        raise
    return commit(tmp, dest, owned)


def starts_with(prefix: bytes | str, length: int = 16) -> Owned:
    """Proof for a report a rerun rewrites: the file begins with the first ``length`` bytes of ``prefix`` (the
    title, marker or first key the tool always writes). A prefix shorter than ``length`` proves nothing."""
    head = (prefix.encode("utf-8") if isinstance(prefix, str) else prefix)[:length]

    def owned(path: Path) -> bool:
        with open(path, "rb") as f:
            return len(head) == length and f.read(length) == head

    return owned


def same_content(data: bytes) -> Owned:
    """Proof for a file a tool writes the same way every time (a drawn test image): replacing a file that already
    holds exactly ``data`` loses nothing."""

    def owned(path: Path) -> bool:
        return os.path.getsize(path) == len(data) and Path(path).read_bytes() == data

    return owned


def write_report(dest: str | os.PathLike[str], text: str) -> Path:
    """Write a tool's text report (JSON, Markdown, a log); an existing file is replaced only when it starts like
    ``text`` does (starts_with): an earlier report of the same tool."""
    return write_atomic(dest, text, starts_with(text))
