"""Filling a streamed model's host arena beside its first forward instead of before it.

An expert switch (two-expert Wan 2.2 with Block Swap streaming) copies the new expert's streamed blocks into the arena
memory the idle expert left, already pinned, and merges the LoRA there: about a second per switch with the GPU idle
when it is done before the model runs. When the arena's memory is already what it will stay (pinned, or never to be
pinned), nothing has to wait for the whole copy: a thread copies the blocks in the order the forward streams them,
hands each to the fill (the LoRA merge, in its own worker) and marks it ready, and the engine's load of a block waits
for that block only. The first forward then runs while the rest is copied.

Plain torch and threads, no ComfyUI import.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Protocol

import torch


class BlockFill(Protocol):
    """Work on each streamed block's arena bytes right after they are copied (Block Swap's LoRA merge), so it can
    run while the next block is copied; ``wait`` returns once all of it is done (raising what it raised)."""

    def block(self, b: int) -> Future | None:
        """Start the work on block ``b``; its future (None: nothing to do, or done already)."""

    def settle(self, job: Future) -> None:
        """Wait for one block's work and finish, on the calling thread, what it left; raise what it raised."""

    def wait(self) -> None:
        """Return once every handed-over block's work is done (settled); raise the first error."""


class BackgroundFill:
    """Copies blocks with ``copy_block`` in a thread, in ``order``, handing each to ``fill``; ``ready(b)`` waits for
    block ``b`` alone, ``join()`` for all of it, both finishing on the calling thread what the fill's work on a block
    left (a LoRA merge that found no GPU memory beside the forward). The thread computes in the starting thread's
    inference / grad mode (torch keeps them per thread): the tensors it writes are the kind that thread would write."""

    def __init__(self, order: Sequence[int], copy_block: Callable[[int], None], fill: BlockFill | None) -> None:
        self.order = list(order)
        self._copy, self._fill = copy_block, fill
        self._copied = {b: threading.Event() for b in self.order}
        self._jobs: dict[int, Future | None] = {}
        self._error: BaseException | None = None
        self._inference = torch.is_inference_mode_enabled()
        self.started = time.perf_counter()
        self.seconds = 0.0  # from start to the last block copied and handed to the fill
        self._thread = threading.Thread(target=self._run, name="lowvram_dit_arena_fill", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with torch.inference_mode(self._inference), torch.no_grad():
                for b in self.order:
                    self._copy(b)
                    self._jobs[b] = self._fill.block(b) if self._fill is not None else None
                    self._copied[b].set()
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits for a block
            self._error = exc
        finally:
            for event in self._copied.values():  # after an error nothing more comes: no waiter may hang
                event.set()
            self.seconds = time.perf_counter() - self.started

    def ready(self, b: int) -> None:
        """Return once block ``b`` is copied and its fill work is done; raise what stopped the fill."""
        self._copied[b].wait()
        if b not in self._jobs:  # an error stopped the copy before this block
            raise self._error or RuntimeError(f"block swap: block {b} was never copied into the host arena")
        job = self._jobs[b]
        if job is not None:
            self._fill.settle(job)

    def join(self) -> None:
        """Return once the thread and the fill's work on every block are done; raise what stopped either."""
        self._thread.join()
        try:
            if self._error is not None:
                raise self._error
        finally:
            if self._fill is not None:
                self._fill.wait()

    def copied(self, b: int) -> bool:
        """True once block ``b`` is in the arena (its fill work may still run)."""
        return b in self._jobs
