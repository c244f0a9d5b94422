"""A compiling call never overlaps another thread's model call.

While Dynamo and AOTAutograd trace a region they patch ``torch.nn.Module.__call__`` for the whole process (FX's
symbolic tracing), so a module call in another thread would be traced into that graph or fail ("using FX to
symbolically trace a dynamo-optimized function"). ComfyUI's MultiGPU split runs one model copy per GPU in threads
at once. So a compiled call that may compile (the first one of a model copy, or of new input shapes) runs alone;
calls whose graphs exist run side by side.

Plain torch, no ComfyUI import.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch


class CompileGate:
    """Readers (calls that reuse compiled graphs) share it; a writer (a call that may compile) has it alone."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self._compiling = False
        self._owner: int | None = None

    @contextlib.contextmanager
    def call(self, may_compile: bool) -> Iterator[None]:
        """Hold the gate for one model call: alone when ``may_compile``, else beside other such calls."""
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:  # a call nested in this thread's compiling call
                may_compile, nested = False, True
            else:
                nested = False
                if may_compile:
                    self._cond.wait_for(lambda: not self._compiling and self._running == 0)
                    self._compiling, self._owner = True, me
                else:
                    self._cond.wait_for(lambda: not self._compiling)
                    self._running += 1
        try:
            yield
        finally:
            with self._cond:
                if may_compile:
                    self._compiling, self._owner = False, None
                elif not nested:
                    self._running -= 1
                self._cond.notify_all()


GATE = CompileGate()


def input_signature(args: tuple, kwargs: dict) -> tuple:
    """Shapes and dtypes of a call's top-level tensors: a new signature may compile new graphs."""
    found: list[Any] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append((tuple(value.shape), value.dtype, value.device.type))
    return tuple(found)
