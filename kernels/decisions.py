"""Per-shape decisions that change numerics are made once per kind of device, never per GPU or per batch size.

Several kernels choose between implementations that compute the same thing with different rounding: per-token or
per-call fp8 activation scales, cuDNN or FlashAttention, an autotuned tile shape of the 8-bit attention. Such a
choice must not depend on which GPU of a machine runs the call, nor on how many samples the call batches: ComfyUI's
MultiGPU CFG split runs cond and uncond on two GPUs, one sample each, and has to give the picture that one GPU gives
with both in one batch. So decision keys name the device kind (type, name, compute capability) and per-sample
shapes, and the first call of a key decides while holding ``DECIDING``: a call of the same key on another GPU waits
and then uses that decision. ``time_call`` times a candidate.

Plain torch, no ComfyUI import.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable

import torch

# Held while a decision is made (timing candidates, autotuning); re-entrant because one decision may time a
# backend that makes its own (the attention selector timing the autotuned 8-bit kernel).
DECIDING = threading.RLock()


def device_kind(device: torch.device) -> tuple:
    """What decides a device's kernels: ('cuda', name, major, minor) for a GPU, (type,) for anything else."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return (dev.type,)
    return _cuda_kind(torch.cuda.current_device() if dev.index is None else dev.index)


@functools.lru_cache(maxsize=None)
def _cuda_kind(index: int) -> tuple:
    props = torch.cuda.get_device_properties(index)
    return ("cuda", props.name, props.major, props.minor)


def describe_kind(kind: tuple) -> str:
    """A device kind as a log phrase: 'cuda NVIDIA H100 80GB HBM3 (SM 9.0)' or 'cpu'."""
    if kind and kind[0] == "cuda" and len(kind) == 4:
        return f"cuda {kind[1]} (SM {kind[2]}.{kind[3]})"
    return str(kind[0]) if kind else "?"


def samples_of(x: torch.Tensor) -> int:
    """The batch samples a call holds: the leading dimension of a [B, L, ...] input, 1 for a 2-D one."""
    return int(x.shape[0]) if x.ndim >= 3 and x.shape[0] > 0 else 1


def time_call(fn: Callable[[], torch.Tensor], device: torch.device, repeats: int = 3, warmup: int = 1) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on a GPU, perf_counter elsewhere)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]
