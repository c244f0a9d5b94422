"""``python -m comfyui_lowvram_dit selftest``: the verdict logic, a deliberately broken node, and the whole run
against the ComfyUI at ``COMFYUI_PATH`` (what makes CI run the selftest on every host).

Broken nodes are made by wrapping a node's own function so that its model adds noise to every prediction: the
selftest must then print FAIL for that node and exit non-zero.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from comfyui_lowvram_dit.doctor import selftest
from comfyui_lowvram_dit.doctor.selftest_env import FAIL, PASS, SKIP, Check, Verdict, compare

VERDICT = re.compile(r"^(PASS|FAIL|SKIP)  ([^:\[]+?)(?: \[[^\]]*\])?: (.+)$")
NODES = {"Wan Loader", "Attention", "Block Swap", "NaN Guard", "LoRA merge", "Wan Text Encode",
         "Qwen-Image Staged Loader", "Qwen-Image-Edit Staged Loader", "Torch Compile"}


def test_compare_passes_within_tolerance_and_fails_outside() -> None:
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(2, 16, 8, 8, generator=g)
    noisy = ref + 0.05 * ref.norm() / ref.numel() ** 0.5 * torch.randn(ref.shape, generator=g)
    assert compare("n", ref.clone(), ref, 0.0, "stock").status == PASS
    assert compare("n", noisy, ref, 0.0, "stock").status == FAIL
    ok, bad = compare("n", noisy, ref, 0.1, "stock"), compare("n", noisy, ref, 0.01, "stock")
    assert ok.status == PASS and "<= tolerance 0.1" in ok.detail
    assert bad.status == FAIL and "> tolerance 0.01" in bad.detail
    assert 0.04 < float(re.search(r"relative difference ([\d.e-]+)", bad.detail).group(1)) < 0.06, bad.detail
    assert compare("n", ref.double(), ref, 0.0, "stock").status == FAIL  # same values, other dtype: not identical
    nan = ref.clone()
    nan[0, 0, 0, 0] = float("nan")
    assert compare("n", nan, ref, 1.0, "stock").status == FAIL
    assert compare("n", ref[:1], ref, 1.0, "stock").status == FAIL


def test_a_raising_check_is_a_fail_and_the_exit_code_says_so(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture) -> None:
    def broken(env: Any) -> Any:
        yield Verdict("Good [a]", PASS, "identical")
        raise RuntimeError("boom\nsecond line")

    def skipped(env: Any) -> Any:
        yield Verdict("Other", SKIP, "needs a CUDA GPU")

    checks = [Check("broken", "Broken", ("x", "X"), broken), Check("other", "Other", ("x", "X"), skipped)]
    monkeypatch.setattr(selftest, "_seam_skip", lambda check: None)
    got = [v for c in checks for v in selftest.run_check(c, None)]
    assert [(v.node, v.status) for v in got] == [("Good [a]", PASS), ("Broken", FAIL), ("Other", SKIP)]
    assert got[1].detail == "raised RuntimeError: boom second line"
    assert selftest.summary(got) == "1 PASS, 1 FAIL, 1 SKIP"

    monkeypatch.setattr(selftest, "import_comfyui", lambda path, cpu: None)
    monkeypatch.setattr(selftest, "run_selftest", lambda only, emit: [emit(v.line()) or v for v in got])
    assert selftest.cli(["--comfyui", "/nowhere"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  Broken: raised RuntimeError" in out and out.rstrip().endswith("-- FAILED")
    monkeypatch.setattr(selftest, "run_selftest", lambda only, emit: [got[0], got[2]])
    assert selftest.cli(["--comfyui", "/nowhere"]) == 0


def _noisy(fn: Any, scale: float) -> Any:
    """``fn`` (a node function returning a MODEL) whose model adds noise of ``scale`` x its output's std."""
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        model = fn(*args, **kwargs).clone()

        def add_noise(apply_model: Any, p: dict) -> torch.Tensor:
            out = apply_model(p["input"], p["timestep"], **p["c"])
            return out + scale * out.std() * torch.randn(out.shape, generator=torch.Generator().manual_seed(1))

        model.set_model_unet_function_wrapper(add_noise)
        return model

    return wrapped


@pytest.mark.comfyui
@pytest.mark.parametrize(("key", "module", "function", "failing"), [
    ("nan_guard", "nan_guard", "apply_nan_guard", "NaN Guard: differs from"),
    ("wan_loader", "wan_loader", "load_wan_model", "Wan Loader [fp8 per-tensor, dequantize]: relative difference"),
])
def test_a_broken_node_fails_and_exits_non_zero(key: str, module: str, function: str, failing: str,
                                                monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                                tmp_path: Path) -> None:
    from comfy_server import comfyui_in_process_or_skip

    comfy = comfyui_in_process_or_skip()
    import importlib

    target = importlib.import_module(f"comfyui_lowvram_dit.nodes.{module}")
    monkeypatch.setattr(target, function, _noisy(getattr(target, function), 0.1))
    assert selftest.cli(["--comfyui", str(comfy), "--cpu", "--only", key]) == 1
    out = capsys.readouterr().out
    assert f"FAIL  {failing}" in out, out
    assert "> tolerance" in out or "must be identical" in out, out


@pytest.mark.comfyui
def test_doctor_node_appends_the_selftest(monkeypatch: pytest.MonkeyPatch) -> None:
    from comfy_server import comfyui_in_process_or_skip

    comfyui_in_process_or_skip()
    from comfyui_lowvram_dit.nodes import doctor as doctor_node

    only_nan_guard = [c for c in selftest.all_checks() if c.key == "nan_guard"]
    monkeypatch.setattr(selftest, "all_checks", lambda: only_nan_guard)
    text = doctor_node.Doctor.execute(gpu_probes=False, run_selftest=True).result[0]
    assert "\nSelf-test (each node vs its stock ComfyUI equivalent" in text
    assert "\nPASS  NaN Guard: identical to the same model without NaN Guard" in text and "1 PASS, 0 FAIL" in text
    assert "Self-test" not in doctor_node.Doctor.execute(gpu_probes=False).result[0]


@pytest.mark.comfyui
def test_selftest_passes_on_this_comfyui(tmp_path: Path) -> None:
    """The whole selftest in its own process, as a user runs it: every line PASS or SKIP with a reason."""
    from comfy_server import comfyui_path_or_reason

    comfy, reason = comfyui_path_or_reason()
    if comfy is None:
        pytest.skip(reason)
    cmd = [sys.executable, "-m", "comfyui_lowvram_dit", "selftest", "--comfyui", str(comfy)]
    if os.environ.get("COMFYUI_GPU") != "1":
        cmd.append("--cpu")
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    lines = [m for line in run.stdout.splitlines() if (m := VERDICT.match(line))]
    report = run.stdout[-6000:] + run.stderr[-3000:]
    assert run.returncode == 0 and lines, report
    assert all(m.group(1) in (PASS, SKIP) for m in lines), report
    assert all(len(m.group(3).strip()) > 10 for m in lines if m.group(1) == SKIP), report  # a reason, not a blank
    assert {m.group(2) for m in lines} == NODES, report
    assert {m.group(2) for m in lines if m.group(1) == PASS} >= NODES - {"Torch Compile"}, report
    assert re.search(r"^selftest: \d+ PASS, 0 FAIL, \d+ SKIP in \d+ s$", run.stdout, re.M), report


def test_unknown_check_is_refused_by_name(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        selftest.cli(["--comfyui", "/nowhere", "--only", "nan_guard", "--only", "warp_drive"])
    assert exc.value.code == 2 and "--only warp_drive: no such check" in capsys.readouterr().err


@pytest.mark.comfyui
def test_no_gpu_without_cpu_says_the_flag(tmp_path: Path) -> None:
    """A machine whose torch sees no GPU, selftest run without --cpu: one line naming --cpu, exit code 2 (not
    torch's "Found no NVIDIA driver" traceback). CUDA is hidden, so this runs the same on a GPU machine."""
    from comfy_server import comfyui_path_or_reason

    comfy, reason = comfyui_path_or_reason()
    if comfy is None:
        pytest.skip(reason)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "comfyui_lowvram_dit", "selftest", "--comfyui", str(comfy), "--only", "nan_guard"]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert len(errors) == 1 and "no GPU" in errors[0] and "--cpu" in errors[0], errors
