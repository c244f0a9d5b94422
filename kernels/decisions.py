"""Per-shape decisions that change numerics are made once per kind of device, never per GPU or per batch size.

Several kernels choose between implementations that compute the same thing with different rounding: per-token or
per-call fp8 activation scales, cuDNN or FlashAttention, an autotuned tile shape of the 8-bit attention. Such a
choice must not depend on which GPU of a machine runs the call, nor on how many samples the call batches: ComfyUI's
MultiGPU CFG split runs cond and uncond on two GPUs, one sample each, and has to give the picture that one GPU gives
with both in one batch. So decision keys name the device kind (type, name, compute capability) and per-sample
shapes, and the first call of a key decides while holding ``DECIDING``: a call of the same key on another GPU waits
and then uses that decision (``KeptChoices``, the one protocol of every timed choice). ``time_call`` times a
candidate; ``FastestPerKey`` keeps the fastest of a few named candidates per key, timed once.

Near ties must not flip between processes either: with a decisions file set (``keep_in``, kernels/decision_store.py)
a winner timed once on this machine is written there and read back by the next process instead of timing again.

Plain torch, no ComfyUI import.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping

import torch

from . import decision_store

log = logging.getLogger("comfyui_lowvram_dit")

# Held while a decision is made (timing candidates, autotuning); re-entrant because one decision may time a
# backend that makes its own (the attention selector timing the autotuned 8-bit kernel).
DECIDING = threading.RLock()
_made = 0  # decisions made and candidates timed in this process (``made``)


def made() -> int:
    """How many decisions this process has made and timings it has run so far: a caller that sees the count
    unchanged across a call knows the call decided nothing (kernels/block_graphs.py captures only such calls)."""
    return _made


def _count() -> None:
    global _made
    _made += 1


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


def autotune_keeping_results(autotune: Callable) -> dict[str, bool]:
    """Keyword arguments for ``autotune`` (``triton.autotune``) that keep its tile choice in Triton's own on-disk
    cache (``cache_results``, Triton >= 3.3): a restarted process then runs the tile the first one timed instead of
    timing again, where a near tie could pick another. {} for a Triton without it."""
    try:
        import inspect

        return {"cache_results": True} if "cache_results" in inspect.signature(autotune).parameters else {}
    except (TypeError, ValueError):  # no signature to read
        return {}


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
    _count()
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


class KeptChoices:
    """The winners of one topic's decisions, per key: read lock-free, decided once, kept across processes.

    The one protocol every timed choice goes through (the fp8 activation scales, the int8 GEMM, attention ``auto``):
    a caller reads ``winners`` itself (plain str values, so a compiled caller's read of a hit is guarded on) and calls
    ``decide`` on a miss. ``decide`` holds ``DECIDING``, so the same key met on another GPU waits and then gets this
    winner, and a winner timed here goes to the decisions file under ``topic`` (when one is set: ``keep_in``)."""

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self.winners: dict[tuple, str] = {}

    def decide(self, key: tuple, fresh: Callable[[str | None], tuple[str, bool]]) -> str:
        """The winner for ``key``: the one already decided, else ``fresh(kept)``'s, where ``kept`` is the winner an
        earlier process kept (None when none) and ``fresh`` returns (winner, whether it was timed here: kept then)."""
        with DECIDING:
            if (known := self.winners.get(key)) is not None:  # also a graph traced before the decision landed
                return known
            _count()
            winner, timed = fresh(decision_store.kept(self.topic, key))
            self.winners[key] = winner
            if timed:  # a fallback for want of timings is not kept: the next process times again
                decision_store.keep(self.topic, key, winner)
            return winner

    def clear(self) -> None:
        """Forget every winner (the next call of each key decides again)."""
        self.winners.clear()


class FastestPerKey:
    """The fastest of a few named candidates, timed once per key and then looked up.

    ``decisions`` maps a key to the winner's name (plain str values, so a compiled caller's read of a hit is guarded
    on), ``timings`` a timed key to each candidate's milliseconds. A caller reads ``decisions`` itself and calls
    ``decide`` on a miss. ``describe_decision(key, winner, timings)`` and ``describe_failure(key, name, error)``
    write the log lines. A candidate that raises is never chosen: the others are timed without it. With none timed,
    the first candidate is the decision (not kept in the decisions file). ``decide`` runs the candidates, so a
    compiled caller reaches it through a function under ``torch.compiler.disable``.

    ``kept_as`` names the topic under which timed winners go to the decisions file, when one is set (``keep_in``):
    a winner kept there by an earlier process that is one of the candidates' names is used without timing, and
    ``describe_kept(key, winner)`` writes its log line. Without ``kept_as`` decisions live in memory only.
    """

    def __init__(self, describe_decision: Callable[[tuple, str, dict[str, float]], str],
                 describe_failure: Callable[[tuple, str, Exception], str],
                 kept_as: str = "",
                 describe_kept: Callable[[tuple, str], str] | None = None) -> None:
        self._choices = KeptChoices(kept_as)
        self.decisions: dict[tuple, str] = self._choices.winners
        self.timings: dict[tuple, dict[str, float]] = {}
        self._describe_decision = describe_decision
        self._describe_failure = describe_failure
        self._describe_kept = describe_kept or (lambda key, winner: f"lowvram_dit {kept_as} {key}: {winner} "
                                                                    "(kept from an earlier run)")

    def decide(self, key: tuple, candidates: Callable[[], Mapping[str, Callable[[], torch.Tensor]]],
               device: torch.device) -> str:
        """The winner for ``key``: its decision if one exists, else the fastest of ``candidates()`` on ``device``.

        ``candidates`` builds the name -> callable mapping (in order, the first being the fallback) only when this
        call decides, so a call that finds the decision made builds nothing. A winner an earlier process kept
        (``kept_as``) is used when it is one of the candidates' names; a timed winner is kept."""
        def fresh(kept: str | None) -> tuple[str, bool]:
            built = candidates()
            if kept is not None and kept in built:
                log.info(self._describe_kept(key, kept))
                return kept, False
            return self._time(key, built, device)

        return self._choices.decide(key, fresh)

    def _time(self, key: tuple, candidates: Mapping[str, Callable[[], torch.Tensor]],
              device: torch.device) -> tuple[str, bool]:
        first = next(iter(candidates))
        times: dict[str, float] = {}
        for name, fn in candidates.items():
            try:
                times[name] = time_call(fn, device)
            except (RuntimeError, torch.OutOfMemoryError) as exc:  # a candidate that cannot run is never chosen
                log.info(self._describe_failure(key, name, exc))
        best = min(times, key=times.get) if times else first
        self.timings[key] = times
        log.info(self._describe_decision(key, best, times))
        return best, bool(times)

    def clear(self) -> None:
        """Forget every decision and its timings (the next call of each key times again)."""
        self._choices.clear()
        self.timings.clear()
