"""Filling a streamed model's host arena beside its first forward instead of before it.

An expert switch (two-expert Wan 2.2 with Block Swap streaming) copies the new expert's streamed blocks into the arena
memory the idle expert left, already pinned: about half a second per switch with the GPU idle when it is done before
the model runs. When the arena's memory is already what it will stay (pinned, or never to be pinned), nothing has to
wait for the whole copy: a thread copies the blocks in the order the forward streams them and marks each ready, and
the engine's load of a block waits for that block only. The first forward then runs while the rest is copied (and
merges the LoRA into each block in the ring, offload/engine.py ``RingFill``).

Plain torch and threads, no ComfyUI import.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch


class BackgroundFill:
    """Copies blocks with ``copy_block`` in a thread, in ``order``; ``ready(b)`` waits for block ``b`` alone, ``join()``
    for all of it. The thread computes in the starting thread's inference / grad mode (torch keeps them per thread):
    the tensors it makes are the kind that thread would make."""

    def __init__(self, order: Sequence[int], copy_block: Callable[[int], None]) -> None:
        self.order = list(order)
        self._copy = copy_block
        self._copied = {b: threading.Event() for b in self.order}
        self._done: set[int] = set()
        self._error: BaseException | None = None
        self._inference = torch.is_inference_mode_enabled()
        self.started = time.perf_counter()
        self.seconds = 0.0  # from start to the last block copied
        self._thread = threading.Thread(target=self._run, name="lowvram_dit_arena_fill", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with torch.inference_mode(self._inference), torch.no_grad():
                for b in self.order:
                    self._copy(b)
                    self._done.add(b)
                    self._copied[b].set()
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits for a block
            self._error = exc
        finally:
            for event in self._copied.values():  # after an error nothing more comes: no waiter may hang
                event.set()
            self.seconds = time.perf_counter() - self.started

    def ready(self, b: int) -> None:
        """Return once block ``b`` is copied; raise what stopped the copy before it."""
        self._copied[b].wait()
        if b not in self._done:  # an error stopped the copy before this block
            raise self._error or RuntimeError(f"block swap: block {b} was never copied into the host arena")

    def join(self) -> None:
        """Return once the thread is done; raise what stopped it."""
        self._thread.join()
        if self._error is not None:
            raise self._error

    def copied(self, b: int) -> bool:
        """True once block ``b`` is in the arena."""
        return b in self._done
