"""Behaviours of ComfyUI releases after 0.33 that cannot run here, re-created on the ComfyUI under test.

Each helper reproduces one behaviour read from the newer source (written here from its description, not copied),
so a test can show what the pack does when it meets it. Import inside a test, after ComfyUI is imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

_EAGER_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
}


def fp16_accumulation_linear_input_act(linear: Any, x: torch.Tensor, input_act: str, *args: Any,
                                       **kwargs: Any) -> torch.Tensor:
    """``comfy.ops.linear_input_act`` as newer ComfyUI runs it with ``--fast fp16_accumulation`` and fp16
    activations (the condition is taken as met, so it runs on the CPU in any dtype).

    A layer whose weight is not a ``QuantizedTensor`` and that does not set ``_full_precision_mm`` is not called:
    its weight comes from ``comfy.ops.cast_bias_weight`` (cast to the activation dtype) and goes into a plain
    GEMM. Every other layer is called as ``linear(act(x))``.
    """
    import comfy.model_management as mm
    import comfy.ops

    act = _EAGER_ACTS[input_act]
    quantized = type(linear.weight).__name__ == "QuantizedTensor"
    if getattr(mm, "in_training", False) or quantized or getattr(linear, "_full_precision_mm", False):
        return linear(act(x))
    weight, bias, stream = comfy.ops.cast_bias_weight(linear, x, offloadable=True)
    try:
        return torch.nn.functional.linear(act(x), weight, bias)
    finally:
        comfy.ops.uncast_bias_weight(linear, weight, bias, stream)


class FakeMallocGraph:
    """Newer ComfyUI's allocation-graph recorder (``comfy.model_prefetch``) as far as custom code sees it:
    ``pause_malloc_graph(sync)`` returns a context inside which allocations are not recorded. ``paused`` counts
    the pauses open now, so a probe can tell where an allocation would have gone."""

    def __init__(self) -> None:
        self.paused = 0

    @contextlib.contextmanager
    def pause(self, sync: bool = False) -> Iterator[None]:
        """What ``comfy.model_prefetch.pause_malloc_graph(sync)`` returns."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


def budgeted_pin_memory(tensor: torch.Tensor, evict_active: bool = True) -> bool:
    """``comfy.model_management.pin_memory`` as newer ComfyUI runs it: False, pinning nothing, when its
    pinned-memory account has no room for the tensor even after evicting what it may evict."""
    import comfy.model_management as mm

    if mm.MAX_PINNED_MEMORY <= 0 or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return False
    size = tensor.nbytes
    ensure = getattr(mm, "ensure_pin_registerable", None)
    room = ensure(size, evict_active=evict_active) if callable(ensure) else \
        mm.TOTAL_PINNED_MEMORY + size <= mm.MAX_PINNED_MEMORY
    if not room or torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), size, 1) != 0:
        return False
    mm.PINNED_MEMORY[tensor.data_ptr()] = size
    mm.TOTAL_PINNED_MEMORY += size
    return True
