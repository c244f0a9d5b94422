"""Whether Torch Compile pays on a model: a compiled call timed against an eager one, decided once, kept.

Compiled regions are faster only where the GPU spends its time on elementwise work that Inductor fuses. Where a
model call is bound by the GPU's GEMMs and attention, or by the CPU issuing it (Qwen-Image at 1328x1328 through a
server), compiling gains nothing per call and costs its compile on every fresh server. So, per model, input
shapes, device kind and compile config, a compiled call and an eager call are timed back to back once both are warm
(``SCHEDULE``; CUDA events, read once the GPU has passed them: never waited on between calls, only where a
sampling run ends, ``CompilePays.settle``) and compile is kept where the
compiled call is at least ``MIN_GAIN`` faster; otherwise the model runs eager from then on. The winner goes to the
decisions file (kernels/decision_store.py) under ``TOPIC``: a later process neither measures again nor, where eager
won, compiles. Only GPUs are measured; elsewhere compile always runs (nothing to keep).

Plain torch, no ComfyUI import.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from . import decision_store
from .decisions import KeptChoices, describe_kind

log = logging.getLogger("comfyui_lowvram_dit")

TOPIC = "torch compile pays"
MIN_GAIN = 0.05  # the compiled call must be at least 5 % faster than the eager one
EAGER, COMPILED = "eager", "compiled"
# How the calls of one key run until a decision: two eager warm-ups, a compiled call that compiles, one in which a
# CUDA-graph mode records its graphs, then one compiled and one eager call timed back to back. The eager call is
# timed last, once everything is warm: the early calls of a fresh server can be slower (kernel choices timed once,
# memory still growing), and timing one of them makes compiling look faster per call than it is per step
# (docs/benchmarks.md, Qwen-Image with Torch Compile).
# A timed call must also be warm for the model that makes it: the key is shared by models of one class (Wan 2.2's
# two experts), and a model's first compiled call traces its own blocks (docs/benchmarks.md, Torch Compile in a Wan
# render), so a timed call of a model that has not yet run that way runs untimed and the timing waits for the next.
SCHEDULE = (EAGER, EAGER, COMPILED, COMPILED, COMPILED, EAGER)
TIMED_CALLS = (4, 5)


def call_device(args: tuple, kwargs: dict) -> Optional[torch.device]:
    """The GPU a model call runs on: the device of its first top-level CUDA tensor (None without one)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.device.type == "cuda":
            return value.device
    return None


class CallTimer:
    """Milliseconds of one call as ``device`` ran it (CUDA events on its current stream), read without waiting;
    perf_counter where ``device`` is None."""

    def __init__(self, device: Optional[torch.device]) -> None:
        self._device = device
        self._events = None
        if device is not None:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        self._t0 = self._ms = None
        self.failed = False  # the call raised: its time means nothing, and its end event was never recorded

    def start(self) -> None:
        if self._events is None:
            self._t0 = time.perf_counter()
        else:
            self._events[0].record(torch.cuda.current_stream(self._device))

    def stop(self) -> None:
        if self._events is None:
            self._ms = (time.perf_counter() - self._t0) * 1e3
        else:
            self._events[1].record(torch.cuda.current_stream(self._device))

    def wait(self) -> None:
        """Block until the GPU has passed the call (for a caller that reads the result next anyway)."""
        if self._events is not None:
            self._events[1].synchronize()

    def ms(self) -> Optional[float]:
        """The call's milliseconds, or None while the GPU has not finished it."""
        if self._ms is None and self._events is not None and self._events[1].query():
            self._ms = self._events[0].elapsed_time(self._events[1])
        return self._ms


@dataclass
class _Measure:
    calls: int = 0
    timers: dict[str, CallTimer] = field(default_factory=dict)


class CompilePays:
    """Per key (model, input shapes, device kind, compile config): which way a call runs, and its timing."""

    def __init__(self, timer: Callable[[Optional[torch.device]], CallTimer] = CallTimer) -> None:
        self._choices = KeptChoices(TOPIC)
        self.winners = self._choices.winners
        self._measures: dict[tuple, _Measure] = {}
        self._lock = threading.Lock()
        self._timer = timer  # injectable: tests plant timings

    def plan(self, key: tuple, device: Optional[torch.device] = None,
             warm: frozenset[str] = frozenset((EAGER, COMPILED))) -> tuple[str, Optional[CallTimer]]:
        """(EAGER or COMPILED for this call of ``key`` on ``device``, a timer to start and stop around it or None).

        ``warm``: the ways the calling model has already run with these inputs; a timed call it is not warm for
        runs untimed, and the schedule stays where it is."""
        if (winner := self.winners.get(key)) is not None:
            return winner, None
        with self._lock:
            m = self._measures.setdefault(key, _Measure())
            if m.calls == 0 and (kept := self._kept(key)) is not None:
                return kept, None
            if (winner := self._decide_if_timed(key, m)) is not None:
                return winner, None
            call = m.calls
            how = SCHEDULE[call] if call < len(SCHEDULE) else COMPILED  # compiled until the timed calls are read
            if call in TIMED_CALLS and how not in warm:
                return how, None  # this model's first call that way: it warms up, the next one is timed
            m.calls += 1
        if call in TIMED_CALLS:
            m.timers[how] = timer = self._timer(device)
            return how, timer
        return how, None

    def _kept(self, key: tuple) -> Optional[str]:
        """The winner an earlier process kept for ``key`` (None when none: then this process measures)."""
        kept = decision_store.kept(TOPIC, key)
        if kept not in (EAGER, COMPILED):
            return None
        self._choices.decide(key, lambda _: (kept, False))
        log.info("lowvram_dit compile: %s: %s (kept from an earlier run)", describe(key), _verdict(kept))
        return kept

    def _decide_if_timed(self, key: tuple, m: _Measure) -> Optional[str]:
        if any(t.failed for t in m.timers.values()):
            del self._measures[key]  # a timed call raised (an OOM, an interrupt): the schedule starts over
            return None
        times = {how: t.ms() for how, t in m.timers.items()}
        if len(times) < 2 or None in times.values():
            return None
        winner = COMPILED if times[COMPILED] <= (1 - MIN_GAIN) * times[EAGER] else EAGER
        self._choices.decide(key, lambda kept: (winner, True))
        del self._measures[key]
        log.info("lowvram_dit compile: %s: compiled call %.1f ms, eager %.1f ms: %s", describe(key),
                 times[COMPILED], times[EAGER], _verdict(winner, fresh=True))
        return winner

    def settle(self) -> None:
        """Decide every key whose timed calls have all run, waiting for the GPU to pass them. Called when a sampling
        run ends (its output is read next anyway): the run that timed the calls keeps the verdict, instead of the next
        call of that key, which a restarted server never makes (a 4-step two-expert render times in its second
        render, and without this the verdict waited for a third)."""
        with self._lock:
            for key, m in list(self._measures.items()):
                if len(m.timers) == len(TIMED_CALLS):
                    for timer in m.timers.values():
                        if not timer.failed:
                            timer.wait()
                    self._decide_if_timed(key, m)

    def model_verdict(self, model: str, kind: tuple, config: str) -> tuple[Optional[str], int]:
        """What was decided for ``model`` (its class name) on GPUs of ``kind`` with ``config``, over every input shape
        this or an earlier process timed: (COMPILED where any shape kept compile, EAGER where all kept eager, None
        where none was timed; how many shapes)."""
        # one entry per key however it is held (a dtype here, its str in the file)
        found = {decision_store.key_text(TOPIC, key): (key, w)
                 for key, w in (*decision_store.kept_under(TOPIC).items(), *self.winners.items())}
        mine = [w for key, w in found.values() if len(key) == 4 and (key[0], key[2], key[3]) == (model, kind, config)]
        if not mine:
            return None, 0
        return (COMPILED if COMPILED in mine else EAGER), len(mine)

    def clear(self) -> None:
        """Forget every decision and measurement (the next calls measure again)."""
        self._choices.clear()
        self._measures.clear()


def describe(key: tuple) -> str:
    """A key as a log phrase: the model, its input shapes, the device kind and the compile config."""
    model, signature, kind, config = key
    shapes = ", ".join("x".join(map(str, s[0])) for s in signature) or "no tensors"
    return f"{model} ({shapes}) on {describe_kind(kind)}, {config}"


def _verdict(winner: str, fresh: bool = False) -> str:
    if winner == COMPILED:
        return "compiling pays, compiled from now on" if fresh else "compiling paid, compiled"
    return ("compiling does not pay here, runs eager from now on (no compile in later runs either)" if fresh
            else "compiling did not pay, runs eager without compiling")
