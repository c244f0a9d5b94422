"""Timing on the device a scenario measures: CUDA events on a GPU (``time.perf_counter`` on the CPU)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from comfyui_lowvram_dit.benchmarks.report import error_text


def time_fn(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int) -> float:
    """Median milliseconds of ``repeats`` calls of ``fn`` after ``warmup`` calls; an error in any call is raised."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    return time_interleaved({"fn": fn}, device, repeats, 0)["fn"]


def time_interleaved(fns: dict, device: torch.device, repeats: int, warmup: int) -> dict[str, float | str | None]:
    """Median ms per call of each fn, in rounds running each once (order rotating); a failed warm-up: its error."""
    # rounds, so that clock and power drift hit all alike (the H100 runs these GEMMs at its power limit)
    out: dict[str, list[float] | str] = {}
    for name, fn in fns.items():
        try:
            for _ in range(warmup):
                fn()
            out[name] = []
        except Exception as exc:  # noqa: BLE001 - a path this GPU / torch cannot run is a result
            out[name] = error_text(exc)
    names = [name for name, times in out.items() if isinstance(times, list)]
    for r in range(repeats):
        marks = {}
        for name in names[r % len(names):] + names[: r % len(names)] if names else []:
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fns[name]()
                end.record()
                marks[name] = (start, end)
            else:
                t0 = time.perf_counter()
                fns[name]()
                out[name].append((time.perf_counter() - t0) * 1e3)
        if marks:
            torch.cuda.synchronize(device)
        for name, (start, end) in marks.items():
            out[name].append(float(start.elapsed_time(end)))
    return {name: t if isinstance(t, str) else statistics.median(t) if t else None  # None: no rounds
            for name, t in out.items()}
