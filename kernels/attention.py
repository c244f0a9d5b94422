"""Attention through one call: a requested backend with fallback, a first-use accuracy check, and ``auto``.

``AttentionSelector.run`` is what model code calls. The first time a backend meets a shape it runs once for
real and its output is compared with an fp32 reference (kernels/attention_check.py). NaN/Inf or a large error
means fall back to the next backend (kernels/attention_backends.py) and say so once. ``auto`` times every
candidate that passes on the real inputs, once per (per-sample shape, dtype, kind of GPU), and caches the
fastest: the ranking differs by GPU and torch version. With a decisions file set, auto's choice is kept there and
a later process runs it again (after the same first-use check) instead of timing a near tie anew. ``HostAttention``
adds the host's own backends to it.

Never imports ComfyUI; the ComfyUI call contract (layouts, heads, ``_inside_attn_wrapper``) lives in
host/attention.py.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from .attention_backends import (
    AUTO_CANDIDATES, AUTO_QUANTIZED, BACKENDS, FALLBACK_ORDER, AttentionBackend, AttentionFn, HostAttention,
    auto_quantized, unavailable_reason,
)
from .attention_check import check_output
from .decisions import KeptChoices, describe_kind, device_kind, time_call

log = logging.getLogger("comfyui_lowvram_dit")

Tensor = torch.Tensor
KEPT_AS = "attention auto"  # the topic of auto's choices in the decisions file (kernels/decision_store.py)


@dataclass
class Decision:
    """What the selector settled on for one (request, shape, dtype, device)."""

    backend: str
    requested: str
    timings_ms: dict[str, float] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    note: str = ""
    labels: dict[str, str] = field(default_factory=dict)  # labels of host backends, which are not in BACKENDS

    def label(self, name: str) -> str:
        """The human name of backend ``name`` (ours or the host's)."""
        if name in self.labels:
            return self.labels[name]
        return BACKENDS[name].label if name in BACKENDS else name

    def describe(self) -> str:
        """One log line: the choice, the timings behind it and what was rejected and why."""
        times = ", ".join(f"{self.label(n)} {t:.2f} ms" for n, t in sorted(self.timings_ms.items(),
                                                                           key=lambda kv: kv[1]))
        rej = "; ".join(f"{self.label(n)}: {r}" for n, r in self.rejected.items())
        text = self.label(self.backend)
        if times:
            text += f" [{times}]"
        if rej:
            text += f" (rejected: {rej})"
        if self.note:
            text += f"; {self.note}"
        return text

    def versus_host(self, host: HostAttention) -> str:
        """'core would use X; chose Y (ms vs ms)': the choice against what the host runs without us."""
        core, chosen, ms = host.default_label or str(host.default), self.label(self.backend), self.timings_ms
        if self.backend in ms and host.default in ms:
            return f"core would use {core}; chose {chosen} ({ms[self.backend]:.2f} ms vs {ms[host.default]:.2f} ms)"
        return f"core would use {core} ({self.rejected.get(host.default or '', 'not measured')}); chose {chosen}"


# Auto's quantized candidates are part of its key: a pack whose auto times other candidates decides again instead of
# running a winner an earlier version kept from fewer candidates (the decisions file holds auto's winners per key).
AUTO_FIELD = "q:" + ",".join(AUTO_QUANTIZED)


def _key(requested: str, q: Tensor, k: Tensor, mask: Optional[Tensor], host: Optional[HostAttention] = None) -> tuple:
    """Per-sample shape and device kind, never the batch size or the GPU's index (kernels/decisions.py)."""
    _, h, lq, d = q.shape
    mask_kind = "none" if mask is None else ("bool" if mask.dtype == torch.bool else "float")
    return (requested, h, lq, k.shape[2], d, q.dtype, device_kind(q.device), mask_kind,
            "" if host is None else host.tag, AUTO_FIELD if requested == "auto" else "")


def describe_key(key: tuple) -> str:
    """Human form of a cache key: 'H40 L32760/32760 D128 bfloat16 cuda NVIDIA H100 (SM 9.0)'."""
    _, h, lq, lk, d, dtype, kind, mask_kind = key[:8]
    masked = "" if mask_kind == "none" else f" {mask_kind}-mask"
    return f"H{h} L{lq}/{lk} D{d} {str(dtype).replace('torch.', '')} {describe_kind(kind)}{masked}"


class AttentionSelector:
    """Runs attention through a requested backend with fallback, first-use checks and cached auto choices."""

    def __init__(self) -> None:
        # key -> backend name. Plain str values so dynamo can guard on a hit and trace straight into the kernel;
        # auto's timed winners are kept in the decisions file under KEPT_AS.
        self._choices = KeptChoices(KEPT_AS)
        self.decisions: dict[tuple, str] = self._choices.winners
        self.details: dict[tuple, Decision] = {}
        self.host_backends: dict[str, AttentionBackend] = {}
        self._said: set[str] = set()

    def run(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None, backend: str = "auto",
            host: Optional[HostAttention] = None) -> Tensor:
        """Attention on [B, H, L, D] views with ``backend`` ("auto" or a registry name); never silently wrong.

        ``host`` adds the host application's backends to ``auto``'s candidates and names its own choice."""
        name = self.decisions.get(_key(backend, q, k, mask, host))
        if name is not None:
            return _call(self.backend(name), q, k, v, mask)
        return self._decide_and_run(q, k, v, mask, backend, host)

    def backend(self, name: str) -> AttentionBackend:
        """The pack's backend ``name``, else a host backend this selector has been given."""
        found = BACKENDS.get(name)
        return found if found is not None else self.host_backends[name]

    def say_once(self, message: str, level: int = logging.WARNING) -> None:
        """Log ``message`` the first time it is seen by this selector."""
        if message not in self._said:
            self._said.add(message)
            log.log(level, message)

    def report(self) -> list[str]:
        """Every cached decision as a log-ready line (for the doctor node and benchmarks)."""
        return [f"{describe_key(k)}: {d.describe()}" for k, d in self.details.items()]

    def clear(self) -> None:
        """Forget every cached choice (next call measures and checks again)."""
        self._choices.clear()
        self.details.clear()
        self.host_backends.clear()

    @torch.compiler.disable
    def _decide_and_run(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], backend: str,
                        host: Optional[HostAttention]) -> Tensor:
        key = _key(backend, q, k, mask, host)
        ran: list[Tensor] = []  # the output of the call that decided (the winner already ran on these inputs)

        def fresh(kept: Optional[str]) -> tuple[str, bool]:
            out, decision = self._decide(key, kept if backend == "auto" else None, q, k, v, mask, backend, host)
            ran.append(out)
            return decision.backend, backend == "auto" and decision.backend in decision.timings_ms  # timed: keep

        name = self._choices.decide(key, fresh)  # another GPU deciding the same key: wait, then use its choice
        return ran[0] if ran else self.backend(name).call(q, k, v, mask)

    def _decide(self, key: tuple, kept: Optional[str], q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                backend: str, host: Optional[HostAttention]) -> tuple[Tensor, Decision]:
        """Decide ``key`` (``kept``: auto's winner of an earlier process); the output and the decision."""
        decision = Decision(backend="sdpa_math", requested=backend)
        exact, quantized = self._candidates(backend, host, decision)
        result = self._kept(kept, [*exact, *quantized], q, k, v, mask, decision) if kept is not None else None
        if result is None:
            result = self._measure(key, exact, quantized, q, k, v, mask, decision)
        self.details[key] = decision
        if backend == "auto" and host is not None and host.default is not None:
            self.say_once(f"lowvram_dit attention auto for {describe_key(key)}: {decision.versus_host(host)}; "
                          f"measured: {decision.describe()}", logging.INFO)
        else:
            level = logging.INFO if decision.backend == backend or backend == "auto" or decision.note \
                else logging.WARNING
            self.say_once(f"lowvram_dit attention {backend} {describe_key(key)} -> {decision.describe()}", level)
        return result, decision

    def _measure(self, key: tuple, exact: list[str], quantized: list[str], q: Tensor, k: Tensor, v: Tensor,
                 mask: Optional[Tensor], decision: Decision) -> Tensor:
        """The request's decision by checking (and for auto, timing) its candidates; returns the chosen output."""
        backend = decision.requested
        result = self._first_or_fastest(exact, q, k, v, mask, decision, key)
        if result is None:  # every candidate failed: the math kernel runs everything torch runs
            decision.backend, result = "sdpa_math", BACKENDS["sdpa_math"].call(q, k, v, mask)
        elif backend == "auto":
            result = self._quantized_where_faster(quantized, q, k, v, mask, decision, result)
        elif decision.backend == backend and BACKENDS[backend].trades_accuracy:
            result = self._prefer_faster_exact(q, k, v, mask, decision, result)
        return result

    def _kept(self, name: str, names: list[str], q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
              decision: Decision) -> Optional[Tensor]:
        """Auto's backend ``name`` as an earlier process chose it (decisions file), when it is still a candidate,
        can run these inputs and passes the first-use check; its output, or None to decide afresh."""
        if name not in names or self._unavailable(name, q, mask) is not None:
            return None
        out, _ = self._try(name, q, k, v, mask, decision)
        if out is None:
            return None
        decision.backend, decision.note = name, "kept from an earlier run"
        return out

    def _candidates(self, backend: str, host: Optional[HostAttention],
                    decision: Decision) -> tuple[list[str], list[str]]:
        """(exact candidates in order, quantized host candidates) for this request."""
        if backend != "auto":
            return [backend] + [n for n in FALLBACK_ORDER if n != backend], []
        exact, quantized = list(AUTO_CANDIDATES), auto_quantized()
        for extra in host.backends if host is not None else ():
            self.host_backends[extra.name] = extra
            decision.labels[extra.name] = extra.label
            (quantized if extra.trades_accuracy else exact).append(extra.name)
        return exact, quantized

    def _unavailable(self, name: str, q: Tensor, mask: Optional[Tensor]) -> Optional[str]:
        if name in BACKENDS or name not in self.host_backends:
            return unavailable_reason(name, q.device, q.dtype, q.shape[-1], mask is not None)
        return self.host_backends[name].reason(q.device, q.dtype, q.shape[-1], mask is not None)

    def _first_or_fastest(self, order: list[str], q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                          decision: Decision, key: tuple) -> Optional[Tensor]:
        """A request: the first of ``order`` that passes. Auto: the fastest that passes. None if none does."""
        auto, result = decision.requested == "auto", None
        for name in order:
            reason = self._unavailable(name, q, mask)
            if reason is None:
                out, reason = self._try(name, q, k, v, mask, decision)
                if out is not None and not auto:
                    decision.backend = name
                    return out
                if out is not None:
                    self._time(decision, name, q, k, v, mask)
                    if result is None or decision.timings_ms[name] < decision.timings_ms[decision.backend]:
                        decision.backend, result = name, out
                    continue
            decision.rejected[name] = reason
            if not auto and name == decision.requested:
                self.say_once(f"lowvram_dit attention: {decision.label(name)} cannot run {describe_key(key)}: "
                              f"{reason}; falling back")
        return result

    def _quantized_where_faster(self, names: list[str], q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                                decision: Decision, result: Tensor) -> Tensor:
        """Auto's quantized host candidates: each that passes the check wins only where faster than the
        current choice (the fastest exact one), the rule an 8-bit request follows."""
        for name in names:
            reason = self._unavailable(name, q, mask)
            out = None
            if reason is None:
                out, reason = self._try(name, q, k, v, mask, decision)
            if out is None:
                decision.rejected[name] = reason
            elif self._keeps_quantized(decision, name, decision.backend, q, k, v, mask):
                decision.note = f"{decision.label(name)} is faster than {decision.label(decision.backend)} here"
                decision.backend, result = name, out
        return result

    def _keeps_quantized(self, decision: Decision, quantized: str, exact: str, q: Tensor, k: Tensor, v: Tensor,
                         mask: Optional[Tensor]) -> bool:
        """True where ``quantized`` is faster than ``exact`` on these inputs; else the note says why not."""
        if self._time(decision, quantized, q, k, v, mask) < self._time(decision, exact, q, k, v, mask):
            return True
        decision.note = (f"{decision.label(quantized)} is slower than {decision.label(exact)} at this shape, "
                         f"so {decision.label(exact)} runs it")
        return False

    def _prefer_faster_exact(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], decision: Decision,
                             result: Tensor) -> Tensor:
        """An 8-bit kernel only pays on long sequences (it loses on short cross-attention). Time it once against
        the first exact backend that passes and keep the faster: slower and less accurate is never the right trade."""
        quantized = decision.backend
        for name in FALLBACK_ORDER:
            if name == quantized or BACKENDS[name].trades_accuracy or name == "sdpa_math":
                continue
            if unavailable_reason(name, q.device, q.dtype, q.shape[-1], mask is not None) is not None:
                continue
            out, reason = self._try(name, q, k, v, mask, decision)
            if out is None:
                decision.rejected[name] = reason
                continue
            if self._keeps_quantized(decision, quantized, name, q, k, v, mask):
                return result
            decision.backend = name
            return out
        return result

    def _try(self, name: str, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
             decision: Decision) -> tuple[Optional[Tensor], str]:
        backend = self.backend(name)
        try:
            out = backend.call(q, k, v, mask)
        except Exception as exc:  # "cannot run" is learnt here as often as from the static check
            return None, f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if not isinstance(out, Tensor) or tuple(out.shape) != (*q.shape[:3], v.shape[-1]):
            return None, f"returned shape {tuple(getattr(out, 'shape', ()))}"
        finite, err, note = check_output(q, k, v, mask, out)
        decision.errors[name] = err
        if not finite:
            return None, note
        if err > backend.tolerance:
            return None, f"relative error {err:.3g} > {backend.tolerance:g} vs fp32 reference"
        return out, ""

    def _time(self, decision: Decision, name: str, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> float:
        """Milliseconds of backend ``name`` on these inputs, measured once per decision (``timings_ms``)."""
        if name not in decision.timings_ms:
            fn = self.backend(name).call
            decision.timings_ms[name] = time_call(lambda: fn(q, k, v, mask), q.device)
        return decision.timings_ms[name]


def _call(backend: AttentionBackend, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
    if backend.compile_safe:
        return backend.call(q, k, v, mask)
    return _eager_call(backend.call, q, k, v, mask)


@torch.compiler.disable
def _eager_call(fn: AttentionFn, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
    return fn(q, k, v, mask)


SELECTOR = AttentionSelector()  # process-wide: "once per (shape, dtype, GPU)" means once per process


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None, backend: str = "auto") -> Tensor:
    """Attention on [B, H, L, D] through the process-wide selector."""
    return SELECTOR.run(q, k, v, mask, backend)


@contextlib.contextmanager
def isolated_selector():  # noqa: ANN201 - yields AttentionSelector
    """Swap in a fresh process-wide selector (tests, benchmarks); restores the old one on exit."""
    global SELECTOR
    old, SELECTOR = SELECTOR, AttentionSelector()
    try:
        yield SELECTOR
    finally:
        SELECTOR = old
