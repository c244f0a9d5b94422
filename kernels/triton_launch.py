"""Launch the pack's Triton kernels while a CUDA graph is being captured.

Triton's launcher checks every tensor argument's pointer with ``cuPointerGetAttribute`` and refuses one the driver
does not know yet ("Pointer argument ... cannot be accessed from Triton (cpu tensor?)"). Under torch's
cudaMallocAsync backend, which ComfyUI turns on where the GPU supports it, memory allocated inside a capture is
mapped only when the graph runs, so every kernel whose input was made inside the captured block fails that check.
The launcher takes a plain integer as a pointer without checking it: ``launcher`` passes tensors that way while
``capturing()`` is on in this thread (kernels/block_graphs.py turns it on around a capture), after the compiled kernel
for the same arguments was looked up the usual way (the eager call before the capture compiled it).

Plain torch and Triton, no ComfyUI import.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

_STATE = threading.local()


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """Within: kernels launched through ``launcher`` in this thread get raw device pointers."""
    outer = getattr(_STATE, "on", False)
    _STATE.on = True
    try:
        yield
    finally:
        _STATE.on = outer


def is_capturing() -> bool:
    """Whether ``capturing()`` is on in this thread."""
    return getattr(_STATE, "on", False)


def launcher(kernel: Any) -> Any:
    """``kernel`` (a ``triton.jit`` function) as eager calls launch it: itself, or, while ``capturing()``, an object
    whose ``[grid](*args, **kwargs)`` launches it with tensors passed as raw pointers."""
    if not getattr(_STATE, "on", False) or not hasattr(kernel, "signature"):  # an autotuner launches as it does
        return kernel
    return _RawPointers(kernel)


class _RawPointers:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __getitem__(self, grid: tuple) -> Callable[..., None]:
        return lambda *args, **kwargs: launch_raw(self.fn, grid, args, kwargs)


def launch_raw(fn: Any, grid: tuple, args: tuple, kwargs: dict) -> None:
    """Launch ``fn[grid](*args, **kwargs)`` on the current stream with every tensor argument given as its
    ``data_ptr()``; the compiled kernel is the one Triton's own launch would use for these arguments."""
    from triton.runtime import driver

    compiled = fn.run(*args, grid=grid, warmup=True, **kwargs)  # compiles only when no call compiled it before
    if hasattr(compiled, "result"):  # an asynchronous compile's future
        compiled = compiled.result()
    bound = fn.signature.bind(*args, **kwargs)
    bound.apply_defaults()
    values = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in bound.arguments.values()]
    device = driver.active.get_current_device()
    stream = driver.active.get_current_stream(device)
    g = tuple(grid) + (1,) * (3 - len(grid))
    enter, leave = _hooks(compiled)
    compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata,
                 compiled.launch_metadata(g, stream, *values), enter, leave, *values)


def _hooks(compiled: Any) -> tuple[Any, Any]:
    """Triton's launch enter / exit hooks (``knobs.runtime`` since Triton 3.4, ``CompiledKernel`` before)."""
    try:
        from triton import knobs

        return knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    except (ImportError, AttributeError):
        return getattr(type(compiled), "launch_enter_hook", None), getattr(type(compiled), "launch_exit_hook", None)
