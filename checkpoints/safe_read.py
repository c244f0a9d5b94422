"""Small files the pack reads whole (kept decisions, workflows, version files): only a regular file, never blocking.

Plain Python, no torch, no ComfyUI; the read-side twin of checkpoints/safe_write.py.

``read_regular(path, limit)`` opens ``path`` with ``O_NONBLOCK`` (a FIFO or a device opens at once instead of waiting
for a writer) and, unless ``follow_links``, ``O_NOFOLLOW`` (a symbolic link is refused, never read through). It
reads only when ``fstat`` of what it opened says regular file, and at most ``limit`` bytes: a FIFO, a device, a
socket, a folder or a file over ``limit`` raise NotRegularFileError naming the path and what sits there, before
anything is read. A missing file raises FileNotFoundError (NotADirectoryError when a folder of the path is a file),
as ``open`` would.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_FLAGS = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
          | getattr(os, "O_BINARY", 0))
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class NotRegularFileError(OSError):
    """What sits at the path is not a regular file the pack may read (a link, FIFO, device, folder, or too large)."""

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


def describe(mode: int) -> str:
    """What an ``st_mode`` is, as a phrase: 'a folder', 'a FIFO (named pipe)', ... ('a regular file')."""
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def _open(path: Path, follow_links: bool) -> int:
    try:
        return os.open(path, _FLAGS | (0 if follow_links else _NOFOLLOW))
    except OSError as exc:
        # O_NOFOLLOW on a link: ELOOP (Linux), EMLINK (FreeBSD), EFTYPE (NetBSD)
        if not follow_links and exc.errno in (errno.ELOOP, errno.EMLINK, getattr(errno, "EFTYPE", -1)):
            raise NotRegularFileError(exc.errno, "is a symbolic link; it is never followed", str(path)) from None
        raise


def read_regular(path: str | os.PathLike[str], limit: int, follow_links: bool = False) -> bytes:
    """The bytes of the regular file at ``path`` (at most ``limit``); NotRegularFileError for anything else."""
    path = Path(path)
    fd = _open(path, follow_links)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFileError(errno.EINVAL, f"is {describe(info.st_mode)}, not a regular file", str(path))
        if info.st_size > limit:
            raise NotRegularFileError(errno.EFBIG, f"is {info.st_size} bytes, more than the {limit} such a file "
                                      "can hold", str(path))
        chunks, size = [], 0
        while size <= limit:  # a file that grows while it is read still stops at limit + 1 bytes
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise NotRegularFileError(errno.EFBIG, f"grew past the {limit} bytes such a file can hold while it was "
                                      "read", str(path))
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: str | os.PathLike[str], limit: int, follow_links: bool = False) -> str:
    """``read_regular`` decoded as UTF-8 (a BOM is dropped); UnicodeDecodeError for other bytes."""
    return read_regular(path, limit, follow_links).decode("utf-8-sig")
