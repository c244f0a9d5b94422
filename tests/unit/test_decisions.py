"""``decisions.FastestPerKey`` on the CPU: planted candidates and a planted timer (``time_call``) check that it
keeps the fastest, decides once per key, follows its failure rule, and that a second thread asking for a key being
decided waits on ``DECIDING`` and gets the same answer."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import pytest
import torch

from comfyui_lowvram_dit.kernels import decisions

CPU = torch.device("cpu")


def _said(key: tuple, best: str, times: dict[str, float]) -> str:
    return f"{key}: " + ", ".join(f"{n} {t:.1f}" for n, t in times.items()) + f" -> {best}"


def _failed(key: tuple, name: str, exc: Exception) -> str:
    return f"{key}: {name} failed ({exc})"


class Planted:
    """Candidates whose timed milliseconds are planted: ``time_call`` is replaced by a lookup of the name the
    candidate returns; a name in ``failing`` raises. Counts every candidate built and every time taken."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, ms: dict[str, float], failing: tuple[str, ...] = ()) -> None:
        self.ms, self.failing, self.built, self.timed = ms, failing, 0, []
        monkeypatch.setattr(decisions, "time_call", self._time_call)

    def _time_call(self, fn: Callable[[], str], device: torch.device) -> float:
        name = fn()
        self.timed.append(name)
        return self.ms[name]

    def candidates(self) -> dict[str, Callable[[], str]]:
        self.built += 1
        return {name: self._candidate(name) for name in self.ms}

    def _candidate(self, name: str) -> Callable[[], str]:
        def run() -> str:
            if name in self.failing:
                raise RuntimeError("planted")
            return name
        return run


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "comfyui_lowvram_dit"]


def test_keeps_the_fastest_once_per_key(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    planted = Planted(monkeypatch, {"a": 3.0, "b": 1.0, "c": 2.0})
    fastest = decisions.FastestPerKey(_said, _failed)
    caplog.set_level(logging.INFO, logger="comfyui_lowvram_dit")
    assert fastest.decide(("k", 1), planted.candidates, CPU) == "b"
    assert fastest.decisions == {("k", 1): "b"} and fastest.timings == {("k", 1): planted.ms}
    assert planted.built == 1 and planted.timed == ["a", "b", "c"]
    assert _messages(caplog) == ["('k', 1): a 3.0, b 1.0, c 2.0 -> b"]

    planted.ms["a"] = 0.5  # a decided key is never timed again, nor are its candidates built
    assert fastest.decide(("k", 1), planted.candidates, CPU) == "b" and planted.built == 1
    assert fastest.decide(("k", 2), planted.candidates, CPU) == "a" and planted.built == 2  # another key: timed
    assert len(_messages(caplog)) == 2
    fastest.clear()
    assert fastest.decisions == {} and fastest.timings == {}
    assert fastest.decide(("k", 1), planted.candidates, CPU) == "a" and planted.built == 3


@pytest.mark.parametrize("failing", ["a", "b"])
def test_a_failing_candidate_is_never_chosen(failing: str, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """The failing one is left out (even the fastest, even the first); the others are timed and the fastest wins."""
    planted = Planted(monkeypatch, {"a": 0.5, "b": 1.0, "c": 2.0}, failing=(failing,))
    fastest = decisions.FastestPerKey(_said, _failed)
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        best = fastest.decide(("k",), planted.candidates, CPU)
    rest = [n for n in "abc" if n != failing]
    times = {n: {"a": 0.5, "b": 1.0, "c": 2.0}[n] for n in rest}
    assert best == rest[0] and planted.timed == rest
    assert fastest.decisions == {("k",): best} and fastest.timings == {("k",): times}
    assert _messages(caplog) == [f"('k',): {failing} failed (planted)",
                                 f"('k',): {rest[0]} {times[rest[0]]}, {rest[1]} {times[rest[1]]} -> {best}"]


def test_with_none_timed_the_first_candidate_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    planted = Planted(monkeypatch, {"a": 3.0, "b": 1.0}, failing=("a", "b"))
    fastest = decisions.FastestPerKey(_said, _failed)
    assert fastest.decide(("k",), planted.candidates, CPU) == "a"
    assert fastest.decisions == {("k",): "a"} and fastest.timings == {("k",): {}}



def test_a_second_thread_waits_for_the_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first caller times while holding DECIDING; a second caller of the same key (another GPU) waits on it,
    then returns the first caller's answer without building or timing anything."""
    planted = Planted(monkeypatch, {"a": 3.0, "b": 1.0})
    timing, go = threading.Event(), threading.Event()
    planted_time_call = decisions.time_call

    def held_time_call(fn: Callable[[], str], device: torch.device) -> float:
        timing.set()
        assert go.wait(10)
        return planted_time_call(fn, device)

    monkeypatch.setattr(decisions, "time_call", held_time_call)
    fastest = decisions.FastestPerKey(_said, _failed)
    answers: dict[str, str] = {}

    def ask(who: str) -> None:
        answers[who] = fastest.decide(("k",), planted.candidates, CPU)

    first = threading.Thread(target=ask, args=("first",))
    first.start()
    assert timing.wait(10)  # the first caller holds DECIDING and is timing
    second = threading.Thread(target=ask, args=("second",))
    try:
        second.start()
        second.join(0.2)
        assert second.is_alive() and "second" not in answers  # waiting on DECIDING
    finally:
        go.set()  # never leave the first caller holding DECIDING
    first.join(10)
    second.join(10)
    assert answers == {"first": "b", "second": "b"}
    assert planted.built == 1 and planted.timed == ["a", "b"]


def test_kept_choices_is_the_one_protocol(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``KeptChoices``: ``fresh`` runs once per key and is handed what an earlier process kept; a timed winner is
    kept under the topic, an untimed one is not; the fp8 / int8 choosers and attention ``auto`` all decide through it."""
    from comfyui_lowvram_dit.kernels import attention, decision_store, fp8_choice, int8_choice

    decision_store.keep_in(tmp_path / "decisions.json")
    try:
        seen: list[str | None] = []
        choices = decisions.KeptChoices("topic")
        assert choices.decide(("a",), lambda kept: (seen.append(kept) or "x", True)) == "x"
        assert choices.decide(("a",), lambda kept: pytest.fail("decided twice")) == "x"
        assert choices.decide(("b",), lambda kept: (seen.append(kept) or "y", False)) == "y"
        assert seen == [None, None] and choices.winners == {("a",): "x", ("b",): "y"}
        assert decision_store.kept("topic", ("a",)) == "x" and decision_store.kept("topic", ("b",)) is None
        later = decisions.KeptChoices("topic")  # another process reading the same file
        assert later.decide(("a",), lambda kept: (seen.append(kept) or kept, False)) == "x" and seen[-1] == "x"
    finally:
        decision_store.keep_in(None)
    assert isinstance(attention.AttentionSelector()._choices, decisions.KeptChoices)
    assert isinstance(fp8_choice.ScaleChooser()._fastest._choices, decisions.KeptChoices)
    assert isinstance(int8_choice.GemmChooser()._fastest._choices, decisions.KeptChoices)
