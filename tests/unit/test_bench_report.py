"""The suite's one reporter (benchmarks/report.py): recorded commands and text name no machine path, the environment
is the common format's, and the json + md pair carries the environment header, the command and the tables."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

from comfyui_lowvram_dit.benchmarks import report


def test_recorded_commands_name_no_machine_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Results are committed: the interpreter, the repository, $OUT and the home folder are written generically."""
    out = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    monkeypatch.setattr(sys, "argv", ["x"])  # not run through the suite: the module and argv are recorded
    argv = ["--out", str(out / "x"), "--work", str(Path.home() / "w"), "--py", sys.executable, "--comfyui",
            "/srv/ComfyUI", "--script", str(report.PACK_ROOT / "benchmarks" / "server.py")]
    command = report.environment("bench_x", argv)["command"]
    assert command == ("python3 -m bench_x --out $OUT/x --work ~/w --py python3 --comfyui /srv/ComfyUI "
                       "--script benchmarks/server.py")
    # ComfyUI's folder (wherever it lies: here in the temporary folder) and temporary folders become placeholders.
    tmp = Path(tempfile.gettempdir())
    monkeypatch.setenv("COMFYUI_PATH", str(tmp / "kit" / "ComfyUI"))
    argv = ["--comfyui", str(tmp / "kit" / "ComfyUI" / "models"), "--files", str(tmp / "qfiles")]
    env = report.environment("bench", argv)
    assert env["command"] == "COMFYUI_PATH=<ComfyUI> python3 -m bench --comfyui <ComfyUI>/models --files <tmp>/qfiles"
    text = report.public_text(f"File {tmp}/kit/ComfyUI/comfy/sd.py, {tmp}/spec.json, /var{tmp}/x")
    assert text == f"File ComfyUI/comfy/sd.py, <tmp>/spec.json, /var{tmp}/x"


def test_environment_is_the_common_format_with_the_device() -> None:
    import torch

    env = report.environment("bench_x", ["--quick"], torch.device("cpu"))
    assert {"device", "gpu", "torch", "comfyui", "comfy_kitchen", "commit", "date", "command"} <= set(env)
    assert env["device"] == "cpu" and env["gpu"] is None and env["cpu"].endswith(" cores")
    assert env["torch"] == torch.__version__ and "triton" in env  # a version, or None where not installed
    assert report.environment("bench_x", [])["device"] is None  # no device given: the caller says which


def test_write_gives_the_json_and_the_markdown_with_header_and_table(tmp_path: Path) -> None:
    env = {"device": "cuda", "gpu": "planted GPU", "torch": "2.11", "triton": "3.6", "comfyui": "0.33.0",
           "commit": "abc1234", "date": "2026-11-28", "command": "python3 -m x --quick", "vram_total_gib": 79.6}
    rows = [[report.cell("a | b"), report.cell(1.23456, "{:.2f}"), report.cell(None), report.cell(0.0123, "{:.1%}")]]
    md = [*report.header("x: planted", env, ["timing: median"]), *report.table(["name", "ms", "err", "share"], rows)]
    paths = report.write(tmp_path / "out", "x", {"env": env, "rows": [1]}, md)
    assert [p.name for p in paths] == ["x.json", "x.md"]
    assert json.loads(paths[0].read_text())["env"]["gpu"] == "planted GPU"
    text = paths[1].read_text()
    assert text.startswith("# x: planted\n\n- device: planted GPU (79.6 GiB)\n- torch 2.11, Triton 3.6, ComfyUI 0.33.0")
    assert "- command: `python3 -m x --quick`" in text and "- timing: median" in text
    assert "| name | ms | err | share |\n|---|---|---|---|\n| a \\| b | 1.23 | — | 1.2% |" in text


def test_the_commit_comes_from_git_unless_the_copied_tree_names_its_own(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU machine gets a copy of the working tree whose git data may be another commit's: LOWVRAM_BENCH_COMMIT
    names the right one for every benchmark's header; outside git and without it there is none."""
    monkeypatch.delenv(report.COMMIT_ENV, raising=False)
    here = report.git_sha()
    assert here is None or len(here.removesuffix("-dirty")) == 40
    assert report.git_sha(tmp_path) is None  # not a git checkout
    monkeypatch.setenv(report.COMMIT_ENV, "611950a")
    assert report.git_sha() == "611950a" and report.git_sha(tmp_path) == "611950a"
    assert report.environment("x", []).get("commit") == "611950a"
