"""Timing on the device a scenario measures: CUDA events on a GPU (``time.perf_counter`` on the CPU)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def time_fn(fn: Callable[[], Any], device: Any, repeats: int, warmup: int) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``fn`` after ``warmup`` calls (CUDA events on GPU)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    times: list[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(float(start.elapsed_time(end)))
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def time_interleaved(fns: dict, device: torch.device, repeats: int, warmup: int) -> dict[str, list[float] | str]:
    """Milliseconds per call of each fn, in rounds that run every fn once (rotating the order), so clock and
    power drift hit all alike (the H100 runs these GEMMs at its power limit); CUDA events on a GPU."""
    out: dict[str, list[float] | str] = {}
    live = {}
    for name, fn in fns.items():
        try:
            for _ in range(warmup):
                fn()
            live[name] = fn
            out[name] = []
        except Exception as exc:  # noqa: BLE001 - a path this GPU / torch cannot run is a result
            out[name] = f"{type(exc).__name__}: {exc}"[:300]
    names = list(live)
    for r in range(repeats):
        order = names[r % len(names):] + names[: r % len(names)] if names else []
        marks = {}
        for name in order:
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                live[name]()
                end.record()
                marks[name] = (start, end)
            else:
                t0 = time.perf_counter()
                live[name]()
                out[name].append((time.perf_counter() - t0) * 1e3)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            for name, (start, end) in marks.items():
                out[name].append(float(start.elapsed_time(end)))
    return out
