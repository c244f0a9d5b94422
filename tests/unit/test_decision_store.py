"""The decisions file (kernels/decision_store.py) and ``FastestPerKey`` reading it, on the CPU.

A "restarted process" is a second ``FastestPerKey`` over the same file: it must return the winner the first one
timed, even where its own (planted) timer would pick the other candidate.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from comfyui_lowvram_dit.kernels import decision_store, decisions
from test_decisions import Planted

CPU = torch.device("cpu")
KEY = (("cuda", "Some GPU", 9, 0), 4096, 5120, 5120, torch.bfloat16)


@pytest.fixture(autouse=True)
def no_store() -> Iterator[None]:
    """Every test starts without a store and leaves none behind."""
    decision_store.keep_in(None)
    yield
    decision_store.keep_in(None)


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "comfyui_lowvram_dit"]


def _said(key: tuple, best: str, times: dict[str, float]) -> str:
    return f"timed {best}"


def _failed(key: tuple, name: str, exc: Exception) -> str:
    return f"{name} failed"


def _fastest() -> decisions.FastestPerKey:
    return decisions.FastestPerKey(_said, _failed, kept_as="test", describe_kept=lambda key, w: f"{w} (kept from "
                                   "an earlier run)")


# --- the store -----------------------------------------------------------------------------------------------------


def test_round_trip_through_the_file(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "decisions.json"  # the folder is made on the first write
    store = decision_store.DecisionStore(path, decision_store.current_header("1.2"))
    assert store.get("fp8", KEY) is None
    store.put("fp8", KEY, "scaled_mm_tensorwise")
    store.put("int8", KEY[:4], "triton")
    again = decision_store.DecisionStore(path, decision_store.current_header("1.2"))  # a new process
    assert again.get("fp8", KEY) == "scaled_mm_tensorwise" and again.get("int8", KEY[:4]) == "triton"
    assert again.get("int8", KEY) is None  # topics keep equal keys apart
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["header"] == {"format": decision_store.FORMAT, "torch": torch.__version__, "pack": "1.2",
                              **{k: data["header"][k] for k in ("triton", "comfy_kitchen") if k in data["header"]}}
    assert "torch.bfloat16" in next(iter(data["decisions"]))  # dtypes written as their str
    assert [p.name for p in path.parent.iterdir()] == ["decisions.json"]  # no temp file left


def test_the_keys_of_a_topic_are_read_back_as_tuples(tmp_path: Path) -> None:
    """``under`` (``kept_under``): every key of one topic as the plain tuple it was written from (a dtype as its str),
    another process's entries included; other topics' keys and entries that are no key of this pack are left out."""
    path = tmp_path / "decisions.json"
    decision_store.DecisionStore(path, decision_store.current_header()).put("fp8", KEY, "scaled_mm_tensorwise")
    decision_store.keep_in(path)
    decision_store.keep("int8", KEY[:4], "triton")
    decision_store.keep("fp8", KEY[:2], "scaled_mm_rowwise")
    data = json.loads(path.read_text(encoding="utf-8"))
    data["decisions"]["not a tuple ("] = "x"
    path.write_text(json.dumps(data), encoding="utf-8")
    decision_store.keep_in(None)
    decision_store.keep_in(path)  # a new process reads the file
    assert decision_store.kept_under("fp8") == {(*KEY[:4], "torch.bfloat16"): "scaled_mm_tensorwise",
                                                KEY[:2]: "scaled_mm_rowwise"}
    assert decision_store.kept_under("int8") == {KEY[:4]: "triton"} and decision_store.kept_under("attention") == {}
    decision_store.keep_in(None)
    assert decision_store.kept_under("fp8") == {}


def test_installing_or_updating_comfy_kitchen_retimes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its kernels are candidates (attention auto, the int8 GEMM): a winner timed without it, or with another
    version, is not this machine's decision any more."""
    import importlib.metadata

    def version(installed: str | None):  # noqa: ANN202
        def read(name: str) -> str:
            if name != "comfy-kitchen" or installed is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return installed
        return read

    path = tmp_path / "decisions.json"
    monkeypatch.setattr(decision_store.importlib.metadata, "version", version(None))
    assert "comfy_kitchen" not in decision_store.current_header("1.2")
    decision_store.DecisionStore(path, decision_store.current_header("1.2")).put("attention auto", KEY, "sdpa_cudnn")
    for release in ("0.2.40", "0.2.41"):
        monkeypatch.setattr(decision_store.importlib.metadata, "version", version(release))
        assert decision_store.current_header("1.2")["comfy_kitchen"] == release
        store = decision_store.DecisionStore(path, decision_store.current_header("1.2"))
        assert store.get("attention auto", KEY) is None  # timed again
        store.put("attention auto", KEY, "ck_int8")
        assert decision_store.DecisionStore(path, decision_store.current_header("1.2")).get("attention auto",
                                                                                           KEY) == "ck_int8"


def test_key_text_is_deterministic_and_refuses_other_values() -> None:
    assert decision_store.key_text("t", KEY) == decision_store.key_text("t", tuple(KEY))
    assert decision_store.key_text("t", (1, torch.float16)) == "('t', 1, 'torch.float16')"
    assert decision_store.key_text("t", (object(),)) is None


def test_another_header_is_ignored_and_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "decisions.json"
    old = decision_store.DecisionStore(path, {"format": decision_store.FORMAT, "torch": "0.0"})
    old.put("fp8", KEY, "scaled_mm_tensorwise")
    new = decision_store.DecisionStore(path, decision_store.current_header())
    assert new.get("fp8", KEY) is None
    new.put("fp8", KEY, "scaled_mm_rowwise")
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["header"] == decision_store.current_header() and list(data["decisions"].values()) == [
        "scaled_mm_rowwise"]


def test_a_corrupt_file_is_said_once_timed_again_and_moved_aside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "decisions.json"
    cut = f'{{\n "kept_by": "{decision_store.KEPT_BY}",\n "header": {{"form'  # cut off
    path.write_text(cut, encoding="utf-8")
    decision_store.keep_in(path)
    timer = Planted(monkeypatch, {"a": 2.0, "b": 1.0})
    fastest = _fastest()
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        assert fastest.decide(("k", 1), timer.candidates, CPU) == "b"
        assert fastest.decide(("k", 2), timer.candidates, CPU) == "b"
    assert timer.timed == ["a", "b", "a", "b"]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("decisions.json.unreadable-")]
    problems = [m for m in _messages(caplog) if "moved it aside" in m]
    assert len(problems) == 1 and str(path) in problems[0] and str(aside[0]) in problems[0]
    assert aside[0].read_text(encoding="utf-8") == cut  # kept under its new name
    assert len(json.loads(path.read_text(encoding="utf-8"))["decisions"]) == 2  # a new file, written whole


def test_an_unwritable_folder_is_said_once_and_never_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "not-a-folder"  # a file where the folder should be: no write can succeed, even as root
    folder.write_text("", encoding="utf-8")
    decision_store.keep_in(folder / "decisions.json")
    timer = Planted(monkeypatch, {"a": 2.0, "b": 1.0})
    fastest = _fastest()
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        assert fastest.decide(("k", 1), timer.candidates, CPU) == "b"
        assert fastest.decide(("k", 2), timer.candidates, CPU) == "b"
    problems = [m for m in _messages(caplog) if "cannot keep" in m]
    assert len(problems) == 1 and str(folder) in problems[0] and "writable" in problems[0]
    assert decision_store.kept("test", ("k", 1)) == "b"  # this process still has it in memory


def test_a_file_the_pack_did_not_write_is_moved_aside_never_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "decisions.json"
    path.write_text('{"someone": "else"}', encoding="utf-8")
    decision_store.keep_in(path)
    timer = Planted(monkeypatch, {"a": 2.0, "b": 1.0})
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        assert _fastest().decide(("k",), timer.candidates, CPU) == "b"
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("decisions.json.unreadable-")]
    assert len(aside) == 1 and aside[0].read_text(encoding="utf-8") == '{"someone": "else"}'
    assert len([m for m in _messages(caplog) if str(path) in m and str(aside[0]) in m]) == 1
    assert json.loads(path.read_text(encoding="utf-8"))["kept_by"] == decision_store.KEPT_BY


def test_keep_in_the_same_path_keeps_the_store(tmp_path: Path) -> None:
    decision_store.keep_in(tmp_path / "d.json")
    first = decision_store._STORE
    decision_store.keep_in(tmp_path / "d.json")
    assert decision_store._STORE is first and decision_store.kept_in() == tmp_path / "d.json"
    decision_store.keep_in(None)
    assert decision_store.kept_in() is None


# --- FastestPerKey with a store ------------------------------------------------------------------------------------


def test_a_kept_winner_is_used_without_timing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    decision_store.keep_in(tmp_path / "decisions.json")
    decision_store.keep("test", ("k",), "a")  # "a" is the slower one for this process's timer
    timer = Planted(monkeypatch, {"a": 2.0, "b": 1.0})
    monkeypatch.setattr(decisions, "time_call", lambda *a, **k: pytest.fail("a kept winner must not be timed"))
    fastest = _fastest()
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        assert fastest.decide(("k",), timer.candidates, CPU) == "a"
        assert fastest.decide(("k",), timer.candidates, CPU) == "a"
    assert fastest.decisions == {("k",): "a"} and fastest.timings == {}
    assert _messages(caplog) == ["a (kept from an earlier run)"]  # said once


def test_a_kept_name_that_is_no_candidate_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    decision_store.keep_in(tmp_path / "decisions.json")
    decision_store.keep("test", ("k",), "gone")
    timer = Planted(monkeypatch, {"a": 2.0, "b": 1.0})
    fastest = _fastest()
    assert fastest.decide(("k",), timer.candidates, CPU) == "b" and timer.timed == ["a", "b"]
    assert decision_store.kept("test", ("k",)) == "b"  # the timed winner replaces it


def test_a_restarted_process_returns_the_first_winner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "decisions.json"
    decision_store.keep_in(path)
    first = Planted(monkeypatch, {"a": 1.00, "b": 1.01})  # a near tie
    assert _fastest().decide(KEY, first.candidates, CPU) == "a"

    decision_store.keep_in(None)  # the restart: a fresh store over the same file, a fresh chooser
    decision_store.keep_in(path)
    second = Planted(monkeypatch, {"a": 1.01, "b": 1.00})  # this process's timer would pick "b"
    assert _fastest().decide(KEY, second.candidates, CPU) == "a" and second.timed == []


def test_without_a_store_or_topic_nothing_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    timer = Planted(monkeypatch, {"a": 2.0, "b": 1.0})
    assert _fastest().decide(("k",), timer.candidates, CPU) == "b"  # no store: today's behaviour
    decision_store.keep_in(tmp_path / "decisions.json")
    assert decisions.FastestPerKey(_said, _failed).decide(("k",), timer.candidates, CPU) == "b"  # no topic
    assert not (tmp_path / "decisions.json").exists()


def test_a_fallback_for_want_of_timings_is_not_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    decision_store.keep_in(tmp_path / "decisions.json")

    def failing(fn: Callable[[], str], device: torch.device) -> float:
        raise RuntimeError("planted")

    monkeypatch.setattr(decisions, "time_call", failing)
    fastest = decisions.FastestPerKey(_said, _failed, kept_as="test")
    assert fastest.decide(("k",), lambda: {"a": lambda: "a", "b": lambda: "b"}, CPU) == "a"
    assert decision_store.kept("test", ("k",)) is None


def test_autotune_keeping_results_follows_the_signature() -> None:
    def new(configs: list, key: list, cache_results: bool = False) -> None: ...

    def old(configs: list, key: list) -> None: ...

    assert decisions.autotune_keeping_results(new) == {"cache_results": True}
    assert decisions.autotune_keeping_results(old) == {}
