"""The benchmark harness on CPU: process isolation, report files, failures recorded, median timing."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from comfyui_lowvram_dit.benchmarks import harness
from comfyui_lowvram_dit.benchmarks.harness import Variant

TARGETS = textwrap.dedent('''
    import os, time

    CALLS = 0

    def counting(ctx):
        global CALLS
        CALLS += 1
        return {"pid": os.getpid(), "calls": CALLS, "device": str(ctx.device)}

    def big_alloc(ctx, mb):
        global CALLS
        CALLS += 1
        buf = bytearray(mb << 20)
        for i in range(0, len(buf), 4096):  # touch every page so it is resident
            buf[i] = 1
        return {"fn": lambda: None, "pid": os.getpid(), "calls": CALLS}

    def raises(ctx, files=None):
        raise ValueError("planted failure")

    def crashes(ctx):
        os._exit(3)

    def oom(ctx):
        import torch
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def sleeps(ctx, seconds):
        time.sleep(seconds)
        return {}

    def timed(ctx, clock, durations):
        it = iter(durations)
        def fn():
            clock[0] += next(it)
        return {"fn": fn}

    def counted_after(ctx):
        calls = []
        return {"fn": lambda: calls.append(1), "before": len(calls), "after": lambda: {"calls_timed": len(calls)}}
''')


@pytest.fixture
def targets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module of benchmark targets importable by the parent and by child processes; returns its name."""
    name = f"bench_targets_{os.getpid()}_{tmp_path.name}".replace("-", "_")
    (tmp_path / f"{name}.py").write_text(TARGETS, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    return name


@pytest.mark.slow  # two child processes, each importing torch
def test_each_variant_runs_in_its_own_process_with_honest_peak_rss(targets: str, tmp_path: Path) -> None:
    # 1 GiB: well above the transient import peak (~0.45 GiB when torch's bytecode is compiled at import, as in a
    # --no-compile venv), which ru_maxrss also records for the small variant.
    variants = [Variant("alloc 1024MB", f"{targets}:big_alloc", {"mb": 1024}),
                Variant("alloc 0MB", f"{targets}:big_alloc", {"mb": 0})]
    res = harness.run_benchmark("iso", variants, repeats=2, warmup=1, out_dir=tmp_path / "out", force_cpu=True,
                                plot=None)
    assert [r["status"] for r in res] == ["ok"] * 2, res
    big, small = res
    # A module global would read 2 in the second variant if both ran in one interpreter.
    assert big["metrics"]["calls"] == small["metrics"]["calls"] == 1
    pids = {r["metrics"]["pid"] for r in res}
    assert len(pids) == 2 and os.getpid() not in pids
    # ru_maxrss is per process: the small variant must not inherit the big one's peak.
    assert big["peak_rss_gib"] - small["peak_rss_gib"] > 0.5
    assert "--child" in big["child_command"] and harness.CHILD_MODULE in big["child_command"]


@pytest.mark.slow  # five child processes, each importing torch
def test_failures_are_recorded_and_reports_carry_the_environment(targets: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    comfy = tmp_path / "ComfyUI"
    comfy.mkdir()
    (comfy / "comfyui_version.py").write_text('__version__ = "0.8.0"\n', encoding="utf-8")
    monkeypatch.setenv("COMFYUI_PATH", str(comfy))
    variants = [Variant("ok", f"{targets}:big_alloc", {"mb": 0}),
                Variant("raises", f"{targets}:raises", {"files": str(tmp_path / "files")}),
                Variant("crashes", f"{targets}:crashes"),
                Variant("hangs", f"{targets}:sleeps", {"seconds": 600}, timeout_s=3),
                Variant("after", f"{targets}:counting")]
    out = tmp_path / "out"
    res = harness.run_benchmark("fail", variants, repeats=3, warmup=1, out_dir=out, force_cpu=True,
                                argv=["bench.py", "--flag"])
    status = {r["name"]: r["status"] for r in res}
    assert status == {"ok": "ok", "raises": "error", "crashes": "crashed", "hangs": "timeout", "after": "ok"}
    by_name = {r["name"]: r for r in res}
    assert "planted failure" in by_name["raises"]["error"] and "ValueError" in by_name["raises"]["error"]
    assert "code 3" in by_name["crashes"]["error"]
    assert len(by_name["ok"]["times_ms"]) == 3 and by_name["ok"]["timer"] == "perf_counter"

    data = json.loads((out / "fail.json").read_text())
    env = data["env"]
    for key in ("device_name", "torch", "python", "git_sha", "command", "comfyui_version", "timestamp"):
        assert env.get(key), key
    assert env["comfyui_version"] == "0.8.0"
    # ComfyUI's folder and the children's temporary spec files are written as placeholders: results are committed.
    assert env["command"] == "COMFYUI_PATH=<ComfyUI> python3 bench.py --flag" and env["comfyui_path"] == "<ComfyUI>"
    for record in data["variants"]:
        assert record["child_command"].startswith(f"python3 -m {harness.CHILD_MODULE} --child <tmp>/bench_fail_")
    assert by_name["raises"]["kwargs"]["files"].startswith("<tmp>/") and "<tmp>/" in by_name["raises"]["traceback"]
    for shown in ((out / "fail.json").read_text(), (out / "fail.md").read_text()):
        assert str(tmp_path) not in shown and tempfile.gettempdir() + os.sep not in shown, shown
        assert sys.executable not in shown
    assert [v["name"] for v in data["variants"]] == [v.name for v in variants]
    md = (out / "fail.md").read_text()
    assert "| raises | error |" in md and "planted failure" in md and "comfyui_version: 0.8.0" in md
    assert "1.000x" in md  # ratio column, relative to the first successful variant
    pytest.importorskip("matplotlib")
    assert (out / "fail.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_is_skipped_with_a_note_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    results = [{"name": "a", "status": "ok", "time_ms": 2.0}]
    paths = harness.write_reports("noplot", results, {"device_name": "x"}, out_dir=tmp_path)
    assert "png" not in paths and not (tmp_path / "noplot.png").exists()
    assert "plot skipped: matplotlib is not installed" in (tmp_path / "noplot.md").read_text()
    assert json.loads((tmp_path / "noplot.json").read_text())["notes"]


def test_time_is_the_median_after_warmup(targets: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(harness.time, "perf_counter", lambda: clock[0])
    # 2 warm-up calls (huge, must be ignored), then 5 timed calls: median 0.003 s.
    durations = [9.0, 9.0, 0.010, 0.001, 0.003, 0.002, 0.050]
    res = harness.run_benchmark("median", [Variant("m", f"{targets}:timed", {"clock": clock, "durations": durations})],
                                repeats=5, warmup=2, out_dir=tmp_path, fresh_process=False, force_cpu=True, plot=None)
    (r,) = res
    assert r["status"] == "ok", r
    assert r["times_ms"] == pytest.approx([10.0, 1.0, 3.0, 2.0, 50.0])
    assert r["time_ms"] == pytest.approx(3.0) and r["time_ms_min"] == pytest.approx(1.0)


def test_after_metrics_are_read_once_the_timed_calls_are_done(targets: str, tmp_path: Path) -> None:
    (r,) = harness.run_benchmark("after", [Variant("a", f"{targets}:counted_after")], repeats=3, warmup=1,
                                 out_dir=tmp_path, fresh_process=False, force_cpu=True, plot=None)
    assert r["status"] == "ok", r
    assert r["metrics"] == {"before": 0, "calls_timed": 4}


def test_oom_and_import_errors_are_recorded_in_process(targets: str, tmp_path: Path) -> None:
    variants = [Variant("oom", f"{targets}:oom"), Variant("bad target", "no_such_module_xyz:fn"),
                Variant("ok", f"{targets}:counting")]
    res = harness.run_benchmark("inproc", variants, repeats=1, warmup=0, out_dir=tmp_path, fresh_process=False,
                                force_cpu=True, plot=None)
    assert [r["status"] for r in res] == ["oom", "error", "ok"]
    assert "OutOfMemoryError during setup" in res[0]["error"]
    assert "no_such_module_xyz" in res[1]["error"]


def test_invalid_inputs_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unique"):
        harness.run_benchmark("dup", [Variant("a", "m:f"), Variant("a", "m:f")], out_dir=tmp_path)
    with pytest.raises(ValueError, match="file stem"):
        harness.run_benchmark("../escape", [Variant("a", "m:f")], out_dir=tmp_path)
    with pytest.raises(ValueError, match="module:function"):
        harness.resolve_target("no_colon")


@pytest.mark.comfyui
@pytest.mark.parametrize("weight_dtype,stored", [("default", None), ("fp8_e4m3fn", "float8_e4m3fn"),
                                                 ("fp8_e4m3fn_fast", "float8_e4m3fn")])
def test_native_wan_model_loads_as_unetloader_would_and_runs_a_forward(weight_dtype: str, stored: str | None) -> None:
    from comfy_server import comfyui_path_or_reason, import_comfyui_in_process

    comfy, reason = comfyui_path_or_reason()
    assert comfy is not None, reason
    import_comfyui_in_process(comfy)
    from comfyui_lowvram_dit.benchmarks import comfy_native as cn
    from comfyui_lowvram_dit.synthetic.checkpoints import synthetic_state_dict

    cn.import_comfy(cpu=True)
    sd = synthetic_state_dict("wan22_ti2v_5B", size="tiny")
    shape = cn.wan_latent_shape(sd["head.head.weight"].shape[0] // 4, 64, 64, 5)
    assert shape == (1, 48, 2, 4, 4) and cn.wan_tokens(shape) == 8
    wrapped: list = []

    def wrap(model, memory_required):  # noqa: ANN001, ANN202 - the nodes a user wires before KSampler
        wrapped.append(memory_required)
        return model.clone()

    patcher = cn.load_native_model(sd, weight_dtype, latent_shape=shape, wrap=wrap)
    assert len(wrapped) == 1 and wrapped[0] > 0  # KSampler's estimate for the cond + uncond batch
    assert not sd  # consumed, so on-GPU synthetic tensors are freed before measuring
    info = cn.describe(patcher)
    assert info["model_class"] == "WAN22"
    if stored:
        assert info["weight_dtype"] == stored and info["linear_op"].endswith("manual_cast.Linear")  # CPU: no fp8 compute
    inputs = cn.wan_inputs(patcher, 64, 64, 5)
    assert inputs["context"].shape == (1, 512, 4096)
    for via in ("diffusion_model", "apply_model"):
        out = cn.forward(patcher, inputs, via=via)
        assert out.shape == inputs["x"].shape and bool(out.float().isfinite().all())
    with pytest.raises(ValueError, match="4k\\+1"):
        cn.wan_latent_shape(48, 64, 64, 6)
    with pytest.raises(ValueError, match="UNETLoader"):
        cn.unet_model_options("fp4")


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
