"""The command line's hostile inputs, each a class: every command ends in one ``error:`` line naming the input, what
is wrong and the fix, with exit code 2 for bad input and 1 for a failed check, never a traceback, and nothing is
opened but http(s) URLs. No ComfyUI needed (fake checkouts stand in; tests/comfyui/test_selftest.py has the ones
that need a real one). A FIFO given as input runs under a timeout, so a regression fails instead of hanging.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from comfyui_lowvram_dit.cli import convert, workflow
from comfyui_lowvram_dit.cli.errors import InputError
from comfyui_lowvram_dit.cli.main import main

HANG_LIMIT_S = 30.0
PACK_PARENT = Path(convert.__file__).parents[2]
WAN_FILE = "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors"


def _ui(nodes: list, links: list | None = None, **extra: object) -> dict:
    return {"nodes": nodes, "links": links if links is not None else [], **extra}


def _loader(**extra: object) -> dict:
    return {"id": 1, "type": "UNETLoader", "mode": 0, "widgets_values": [WAN_FILE, "default"],
            "outputs": [{"name": "MODEL", "type": "MODEL", "links": None}], **extra}


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str], code: int, *needles: str) -> str:
    """Run the CLI entry point; it must return ``code`` with one ``error:`` line holding every needle."""
    rc = main(argv)
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert rc == code and len(lines) == 1 and "Traceback" not in out + err, (rc, out[-1500:], err[-3000:])
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def _in_thread(fn: object, *args: object) -> list:
    """``fn(*args)`` in a thread, failing the test (not hanging it) past HANG_LIMIT_S."""
    got: list = []
    runner = threading.Thread(target=lambda: got.append(fn(*args)), daemon=True)
    runner.start()
    runner.join(HANG_LIMIT_S)
    return got if not runner.is_alive() else pytest.fail(f"{fn} blocked for {HANG_LIMIT_S:.0f} s")


# --- JSON files given to convert and run ------------------------------------------------------------------------


BAD_JSON = {
    "deep": ("[" * 100_000 + "]" * 100_000, "nested deeper"),
    "deep_but_parsable": ("[" * 900 + "]" * 900, "nested deeper"),
    "digits": ('{"nodes": [], "links": [], "last_node_id": ' + "9" * 5000 + "}", "more digits"),
    "nan": ('{"nodes": [], "links": [], "extra": {"x": NaN}}', "NaN"),
    "infinity": ('{"nodes": [], "links": [], "extra": {"x": -Infinity}}', "Infinity"),
    "huge_float": ('{"nodes": [], "links": [], "extra": {"x": 1e400}}', "too large"),
    "not_json": ("root:x:0:0:root:/root:/bin/bash\n", "not a JSON file"),
    "not_utf8": (b"\xff\xfe{}".decode("latin-1"), "not a JSON file"),
}


@pytest.mark.parametrize("command", ["convert", "run"])
@pytest.mark.parametrize("case", sorted(BAD_JSON))
def test_json_that_no_tool_can_read_is_named(case: str, command: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    text, words = BAD_JSON[case]
    src = tmp_path / f"{case}.json"
    src.write_bytes(text.encode("latin-1") if case == "not_utf8" else text.encode())
    _fails([command, str(src), "--url", "http://127.0.0.1:9"][: 2 if command == "convert" else 4], capsys, 2,
           str(src), words)
    assert not (tmp_path / f"{case}_lowvram.json").exists()


GRAPH_SHAPES = {
    "links_of_strings": (_ui([_loader()], ["abc", "def"]), "links[0]"),
    "link_too_short": (_ui([_loader()], [[1, 1, 0, 2, 0]]), "links[0]"),
    "link_negative_slot": (_ui([_loader()], [[1, 1, -1, 2, 0, "MODEL"]]), "links[0]"),
    "link_object_missing_id": (_ui([_loader()], [{"origin_id": 1}]), "links[0]"),
    "nodes_of_strings": (_ui(["UNETLoader"]), "nodes[0]"),
    "node_without_type": (_ui([{"id": 1}]), "nodes[0].type"),
    "node_id_a_list": (_ui([_loader(id=[1])]), "nodes[0].id"),
    "inputs_not_a_list": (_ui([_loader(inputs={"model": 1})]), "inputs"),
    "input_link_a_string": (_ui([_loader(inputs=[{"name": "x", "link": "7"}])]), "inputs[0].link"),
    "output_links_a_number": (_ui([_loader(outputs=[{"name": "MODEL", "links": 5}])]), "outputs[0].links"),
    "widgets_a_number": (_ui([_loader(widgets_values=5)]), "widgets_values"),
    "mode_a_string": (_ui([_loader(mode="bypass")]), "mode"),
    "properties_a_list": (_ui([_loader(properties=[1])]), "properties"),
    "last_node_id_a_string": (_ui([_loader()], last_node_id="nine"), "last_node_id"),
    "subgraphs_not_a_list": (_ui([_loader()], definitions={"subgraphs": {"a": 1}}), "subgraphs"),
    "subgraph_without_nodes": (_ui([_loader()], definitions={"subgraphs": [{"id": "x"}]}), "subgraph 0"),
    "subgraph_state_a_list": (_ui([_loader()], definitions={"subgraphs": [
        {"id": "x", "nodes": [], "links": [], "state": [1]}]}), "state"),
    "subgraph_link_ids_strings": (_ui([_loader()], definitions={"subgraphs": [
        {"id": "x", "nodes": [], "links": [], "inputs": [{"linkIds": ["a"]}]}]}), "linkIds"),
}


@pytest.mark.parametrize("case", sorted(GRAPH_SHAPES))
def test_a_workflow_of_the_wrong_shape_is_named_by_field(case: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    data, field = GRAPH_SHAPES[case]
    src = tmp_path / "wf.json"
    src.write_text(json.dumps(data), encoding="utf-8")
    _fails(["convert", str(src)], capsys, 2, str(src), field, "save it again")
    _fails(["run", str(src), "--url", "http://127.0.0.1:9"], capsys, 2, str(src), field)
    assert not (tmp_path / "wf_lowvram.json").exists()


@pytest.mark.parametrize("api", [{"1": "KSampler"}, {"1": {"inputs": {}}}, {"1": {"class_type": "X", "inputs": [1]}},
                                 {"1": {"class_type": "X", "_meta": "t"}}, [1, 2], {}, "text"])
def test_run_refuses_what_is_no_workflow(api: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "api.json"
    src.write_text(json.dumps(api), encoding="utf-8")
    _fails(["run", str(src), "--url", "http://127.0.0.1:9"], capsys, 2, str(src))


def test_an_old_object_position_converts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "old.json"
    src.write_text(json.dumps(_ui([_loader(pos={"0": 10, "1": 20})])), encoding="utf-8")
    assert main(["convert", str(src)]) == 0
    out = json.loads((tmp_path / "old_lowvram.json").read_text(encoding="utf-8"))
    assert [n["type"] for n in out["nodes"]] == ["LowVRAM_WanLoader", "LowVRAM_BlockSwap", "LowVRAM_Attention"]


# --- what sits at an input path ----------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["convert", "run"])
def test_a_folder_a_fifo_a_device_or_nothing_is_named_for_what_it_is(command: str, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    link = tmp_path / "zero.json"
    link.symlink_to("/dev/zero")
    cases = {tmp_path: "is a folder", fifo: "FIFO", link: "character device", tmp_path / "gone.json": "no such file",
             tmp_path / "pipe.json" / "x.json": "no such file"}
    for path, words in cases.items():
        extra = ["--url", "http://127.0.0.1:9"] if command == "run" else []
        _in_thread(_fails, [command, str(path), *extra], capsys, 2, str(path), words)


# --- options -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vram", ["nan", "inf", "-inf", "1e308", "0", "-4", "1027"])
def test_vram_takes_only_a_card_size(vram: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "wf.json"
    src.write_text(json.dumps(_ui([_loader()])), encoding="utf-8")
    _fails(["convert", str(src), f"--vram={vram}"], capsys, 2, "--vram", "VRAM in GB")
    assert not (tmp_path / "wf_lowvram.json").exists()
    with pytest.raises(convert.ConvertError, match="--vram"):
        convert.convert_workflow(_ui([_loader()]), convert.ConvertOptions(vram_gb=float(vram)))


def test_the_largest_vram_gives_a_budget_the_nodes_accept(tmp_path: Path) -> None:
    from comfyui_lowvram_dit.offload.plan import budget_problem

    assert budget_problem(convert.ConvertOptions(vram_gb=convert.VRAM_MAX_GB).budget_gb) is None
    src = tmp_path / "wf.json"
    src.write_text(json.dumps(_ui([_loader()])), encoding="utf-8")
    assert main(["convert", str(src), "--vram", str(convert.VRAM_MAX_GB)]) == 0
    text = (tmp_path / "wf_lowvram.json").read_text(encoding="utf-8")
    assert "NaN" not in text and "Infinity" not in text


@pytest.mark.parametrize("timeout", ["nan", "inf", "0", "-1"])
def test_run_timeout_takes_only_a_finite_wait(timeout: str, capsys: pytest.CaptureFixture[str]) -> None:
    _fails(["run", "wan22_t2v_a14b", "--url", "http://127.0.0.1:9", f"--timeout={timeout}"], capsys, 2, "--timeout")


@pytest.mark.parametrize("value", ["NaN", "Infinity", "1e400", "[" * 5000 + "]" * 5000, "7" * 5000])
def test_set_values_that_are_no_usable_json_are_named(value: str) -> None:
    api = {"1": {"class_type": "KSampler", "inputs": {"cfg": 1.0}}}
    with pytest.raises(InputError, match="--set"):
        workflow.apply_overrides(api, [f"1.cfg={value}"])
    assert workflow.apply_overrides(api, ["1.cfg=not json"])["1"]["inputs"]["cfg"] == "not json"  # text stays text
    for item in ("no-equals", "nodot=1", "9.cfg=1"):
        with pytest.raises(InputError, match="--set"):
            workflow.apply_overrides(api, [item])


@pytest.mark.parametrize("name", ["../escape.png", "/etc/escape.png", "a/../../escape.png", "", 7, "C:\\x.png",
                                  "x\x00.png"])
def test_load_image_names_never_leave_the_input_folder(name: object, tmp_path: Path) -> None:
    api = {"1": {"class_type": "LoadImage", "inputs": {"image": name}}}
    with pytest.raises(InputError, match="LoadImage"):
        workflow.ensure_input_images(api, tmp_path / "base" / "input", True, [tmp_path])
    assert sorted(p.name for p in tmp_path.rglob("*")) == []


def test_an_output_path_that_cannot_be_used_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "wf.json"
    src.write_text(json.dumps(_ui([_loader()])), encoding="utf-8")
    (tmp_path / "a_file").write_text("x", encoding="utf-8")
    _fails(["convert", str(src), "-o", str(tmp_path / "a_file" / "out.json")], capsys, 2, str(tmp_path / "a_file"))
    loop = tmp_path / "loop.json"
    loop.symlink_to(loop)
    _fails(["convert", str(src), "-o", str(loop)], capsys, 2, str(loop))
    _fails(["run", str(src), "--url", "http://127.0.0.1:9", "--output", str(tmp_path / "a_file")], capsys, 2,
           str(tmp_path / "a_file"))


def test_run_comfyui_and_python_paths_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("x", encoding="utf-8")
    for path, words in ((tmp_path / "file", "is a file"), (tmp_path / "none", "does not exist"),
                        (tmp_path, "not a ComfyUI checkout")):
        _fails(["run", "wan22_t2v_a14b", "--comfyui", str(path)], capsys, 2, "--comfyui", str(path), words)
    comfy = _fake_comfyui(tmp_path / "ComfyUI")
    _fails(["run", "wan22_t2v_a14b", "--comfyui", str(comfy), "--python", str(tmp_path / "nope")], capsys, 2,
           "--python", "no such program")


@pytest.mark.parametrize("args, words", [(["nope"], "unknown model"), (["wan21_t2v_1_3B", "--layers=-3"], "--layers"),
                                         (["wan21_t2v_1_3B", "--threads=0"], "--threads"),
                                         (["wan21_t2v_1_3B", "--device", "bogus"], "--device")])
def test_synth_refuses_what_it_cannot_write(args: list[str], words: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:  # argparse's usage error: the usage line and one error line
        main(["synth", *args, "--out", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and words in err and "Traceback" not in err and not list(tmp_path.iterdir())


# --- URLs --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://127.0.0.1/x", "data:,hello", "http://", "127.0.0.1:8188",
                                 "http://127.0.0.1:99999", "javascript:alert(1)", "//127.0.0.1:8188"])
def test_only_http_urls_are_opened(url: str, capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import urllib.request

    monkeypatch.setattr(urllib.request.OpenerDirector, "open", lambda *a, **k: pytest.fail(f"{url} was opened"))
    _fails(["run", "wan22_t2v_a14b", "--url", url], capsys, 2, "--url", "http(s)")


def test_a_url_with_nothing_listening_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _fails(["run", "wan22_t2v_a14b", "--url", f"http://127.0.0.1:{port}"], capsys, 2, f"127.0.0.1:{port}",
           "no ComfyUI answered")


class _Redirect(http.server.BaseHTTPRequestHandler):
    target = "ftp://127.0.0.1/secret"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/html":
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html>" + b"x" * 5000 + b"</html>")
            return
        self.send_response(302)
        self.send_header("Location", self.target)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def redirecting_server() -> Iterator[str]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Redirect)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("target", ["ftp://127.0.0.1/secret", "file:///etc/passwd"])
def test_a_redirect_away_from_http_is_not_followed(target: str, redirecting_server: str,
                                                   capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import urllib.request

    monkeypatch.setattr(_Redirect, "target", target)
    for handler in (urllib.request.FTPHandler, urllib.request.FileHandler):
        monkeypatch.setattr(handler, handler.__name__.replace("Handler", "").lower() + "_open",
                            lambda *a, **k: pytest.fail(f"the redirect to {target} was followed"), raising=False)
    _fails(["run", "wan22_t2v_a14b", "--url", redirecting_server], capsys, 2, "--url", "302")


# --- selftest and doctor given a path that is no (working) ComfyUI ---------------------------------------------


def _fake_comfyui(root: Path, files: dict[str, str] | None = None) -> Path:
    """A folder shaped like a ComfyUI checkout whose modules are ``files`` (default: empty but valid)."""
    files = {"main.py": "", "comfyui_version.py": '__version__ = "0.8.0"\n',
             "comfy/cli_args.py": "import types\nargs = types.SimpleNamespace(cpu=False)\n",
             "comfy/model_management.py": "", "folder_paths.py": "", **(files or {})}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    return root


@pytest.mark.parametrize("command", ["doctor", "selftest"])
def test_a_path_that_is_no_comfyui_is_bad_input(command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    flag = "--comfyui-path" if command == "doctor" else "--comfyui"
    (tmp_path / "a_file").write_text("", encoding="utf-8")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "main.py").write_text("", encoding="utf-8")
    for path, words in ((tmp_path / "missing", "does not exist"), (tmp_path / "a_file", "is a file"),
                        (tmp_path, "no main.py"), (tmp_path / "half", "no comfy/model_management.py")):
        _fails([command, flag, str(path), *(["--cpu"] if command == "selftest" else ["--no-gpu-probes"])], capsys,
               2, str(path), words, "ComfyUI folder")


def test_doctor_names_a_comfyui_path_from_the_environment(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMFYUI_PATH", str(tmp_path / "missing"))
    _fails(["doctor", "--no-gpu-probes"], capsys, 2, "COMFYUI_PATH", "does not exist")


@pytest.mark.parametrize("broken", [{"comfy/model_management.py": "def (:\n"}, {"comfy/sd.py": "x = (\n"},
                                    {"main.py": "\x00"}])
def test_doctor_reports_a_broken_comfy_package_and_fails(broken: dict[str, str], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    comfy = _fake_comfyui(tmp_path / "ComfyUI", broken)
    rc = main(["doctor", "--comfyui-path", str(comfy), "--no-gpu-probes"])
    out, err = capsys.readouterr()
    culprit = next(iter(broken))
    assert rc == 1 and f"comfyui BROKEN {comfy}: {culprit}" in out and "Traceback" not in err, (out, err)
    assert f"broken: {comfy}: {culprit}" in err


def test_doctor_says_when_the_version_cannot_be_read(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    comfy = _fake_comfyui(tmp_path / "ComfyUI")
    (comfy / "comfyui_version.py").unlink()
    os.mkfifo(comfy / "comfyui_version.py")  # never waited on
    assert _in_thread(main, ["doctor", "--comfyui-path", str(comfy), "--no-gpu-probes"]) == [1]
    assert "its version cannot be read" in capsys.readouterr().out


def _selftest(comfy: Path, tmp_path: Path, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    """``selftest --cpu`` in its own process (a fake ComfyUI must not meet the real one this process imported)."""
    paths = [str(p) for p in (extra_path, PACK_PARENT) if p is not None]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "comfyui_lowvram_dit", "selftest", "--comfyui", str(comfy), "--cpu",
                           "--only", "nan_guard"], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)


def _one_error(run: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    lines = [ln for ln in run.stderr.splitlines() if ln.startswith("error: ")]
    assert run.returncode == code and len(lines) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_selftest_names_a_comfy_package_that_cannot_be_compiled(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # a refused checkout never reaches sys.path anyway
    comfy = _fake_comfyui(tmp_path / "ComfyUI", {"comfy/model_management.py": "def (:\n"})
    _fails(["selftest", "--comfyui", str(comfy), "--cpu"], capsys, 1, str(comfy), "comfy/model_management.py line 1")
    (comfy / "comfy" / "model_management.py").write_text("", encoding="utf-8")
    os.mkfifo(comfy / "comfy" / "ops.py")  # unreadable as source (and never waited on)
    _in_thread(_fails, ["selftest", "--comfyui", str(comfy), "--cpu"], capsys, 1, "comfy/ops.py cannot be read")
    assert str(comfy) not in sys.path


@pytest.mark.parametrize("files, culprit", [
    ({"comfy/cli_args.py": "raise SystemExit(7)\n"}, "comfy/cli_args.py:1"),
    ({"comfy/model_management.py": "import comfy_missing_dependency\n"}, "comfy_missing_dependency"),
])
def test_selftest_names_a_comfyui_that_does_not_import(files: dict[str, str], culprit: str, tmp_path: Path) -> None:
    _one_error(_selftest(_fake_comfyui(tmp_path / "ComfyUI", files), tmp_path), 1, culprit, str(tmp_path / "ComfyUI"))


def test_selftest_names_a_library_that_exits_the_process(tmp_path: Path) -> None:
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "triton.py").write_text("raise SystemExit(3)\n", encoding="utf-8")
    _one_error(_selftest(_fake_comfyui(tmp_path / "ComfyUI"), tmp_path, fake), 1, str(fake / "triton.py"),
               "reinstall or remove")


# --- the entry point itself --------------------------------------------------------------------------------------


def test_argparse_usage_errors_and_help_still_pass_through(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["convert", "--vram", "lots", "x.json"])
    assert exc.value.code == 2 and "--vram" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["run", "--help"])
    assert exc.value.code == 0


def test_an_unexpected_error_is_one_line_naming_where(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise KeyError("surprise")

    monkeypatch.setattr(convert, "convert_file", boom)
    line = _fails(["convert", "x.json"], capsys, 1, "KeyError", "test_reliability_cli.py", "bug")
    monkeypatch.setenv("LOWVRAM_DIT_TRACEBACK", "1")
    main(["convert", "x.json"])
    assert "Traceback" in capsys.readouterr().err and line
