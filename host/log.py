"""Warnings said once per process."""

from __future__ import annotations

from typing import Any

_SAID_ONCE: set[str] = set()


def say_once(logger: Any, message: str) -> None:
    """Log ``message`` as a warning the first time this process says it."""
    if message not in _SAID_ONCE:
        _SAID_ONCE.add(message)
        logger.warning(message)
