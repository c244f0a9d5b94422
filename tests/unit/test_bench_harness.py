"""What the scenarios share (benchmarks/harness.py): recorded commands and text name no machine path, and a GPU
script's environment names the script, its device and the versions."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

from comfyui_lowvram_dit.benchmarks import harness


def test_recorded_commands_name_no_machine_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Results are committed: the interpreter, the repository, $OUT and the home folder are written generically."""
    out = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    repo = Path(harness.__file__).resolve().parent.parent
    argv = [str(repo / "benchmarks" / "server.py"), "--out", str(out / "x"), "--work", str(Path.home() / "w"),
            "--py", sys.executable, "--comfyui", "/srv/ComfyUI"]
    command = harness.parent_environment(argv)["command"]
    assert command == "python3 benchmarks/server.py --out $OUT/x --work ~/w --py python3 --comfyui /srv/ComfyUI"
    assert "cwd" not in harness.parent_environment(argv)
    # ComfyUI's folder (wherever it lies: here in the temporary folder) and temporary folders become placeholders.
    tmp = Path(tempfile.gettempdir())
    monkeypatch.setenv("COMFYUI_PATH", str(tmp / "kit" / "ComfyUI"))
    argv = ["-m", "bench", "--comfyui", str(tmp / "kit" / "ComfyUI" / "models"), "--files", str(tmp / "qfiles")]
    env = harness.parent_environment(argv)
    assert env["command"] == "COMFYUI_PATH=<ComfyUI> python3 -m bench --comfyui <ComfyUI>/models --files <tmp>/qfiles"
    assert env["comfyui_path"] == "<ComfyUI>"
    text = harness.public_text(f"File {tmp}/kit/ComfyUI/comfy/sd.py, {tmp}/spec.json, /var{tmp}/x")
    assert text == f"File ComfyUI/comfy/sd.py, <tmp>/spec.json, /var{tmp}/x"


def test_gpu_script_environment_names_script_device_and_triton() -> None:
    import torch

    env = harness.gpu_script_environment("bench_x", ["--quick", "--out-dir", "$OUT"], torch.device("cpu"))
    assert env["command"].endswith("python3 -m bench_x --quick --out-dir $OUT")
    assert env["device_type"] == "cpu" and env["device_name"].startswith("CPU (")
    assert env["torch"] == torch.__version__
    assert "triton" in env and "comfy_kitchen" in env  # a version, or None where not installed
