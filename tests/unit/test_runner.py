"""`python -m comfyui_lowvram_dit run` without ComfyUI: where it finds workflows, what it says, what it writes.

The end-to-end runs (a real ComfyUI started by the runner) are in tests/comfyui/test_comfyui_workflows.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from comfyui_lowvram_dit.cli import runner, server, workflow, workflow_models
from comfyui_lowvram_dit.synthetic import checkpoints as synth, tiny
from comfyui_lowvram_dit.synthetic.specs import spec_nbytes
from test_workflows import OFFICIAL_LORAS

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p.stem for p in (REPO / "workflows").glob("*.json"))
TINY_BUDGET = 200e6  # bytes the tiny models of all four shipped workflows may take together


def test_shipped_workflows_resolve_by_name_from_the_pack_root() -> None:
    assert (server.PACK_DIR / "__init__.py").is_file() and (server.PACK_DIR / "workflows").is_dir()
    assert len(SHIPPED) == 7
    for name in SHIPPED:
        assert workflow.resolve_workflow(name) == REPO / "workflows" / f"{name}.json"
    with pytest.raises(server.RunError, match="shipped workflows: qwen_image_t2i, qwen_image_t2i_4step, wan22_i2v_a14b"):
        workflow.resolve_workflow("nope")


def _workflow_files() -> tuple[set[str], set[str]]:
    """Model names a --synthetic tiny run of the shipped workflows writes (VAEs swapped as the runner does)."""
    names: set[str] = set()
    staged: set[str] = set()
    for name in SHIPPED:
        wf = json.loads(workflow.resolve_workflow(name).read_text())
        workflow_models.swap_tiny_vaes(wf)
        names |= workflow_models.referenced_model_files(wf)
        staged |= workflow_models.staged_text_encoder_files(wf)
    # the 4-step workflows' LoRAs count once the runner writes synthetic LoRAs (test_workflows skips them until then)
    return {n for n in names if n in workflow_models.KNOWN_MODEL_FILES or n not in OFFICIAL_LORAS}, staged


def test_synthetic_tiny_files_of_all_shipped_workflows_stay_small() -> None:
    """Bytes `run --synthetic tiny` writes for the four workflows together (computed from the file layouts)."""
    names, staged = _workflow_files()
    assert "wan2.2_vae.safetensors" not in names and "lighttaew2_2.safetensors" in names
    sizes = {}
    for n in names:
        _, model, fmt = workflow_models.KNOWN_MODEL_FILES[n]
        config = tiny.tiny_text_encoder_config(model) if n in staged else None
        sizes[n] = spec_nbytes(synth._plan(model, "tiny", fmt, None, config)[0])
    # The largest: Qwen2.5-VL's 152k-row embedding at the tiny hidden width (ComfyUI's tokenizer ids reach 151k).
    assert max(sizes.values()) < 45e6, sizes
    assert sum(sizes.values()) < TINY_BUDGET, sizes


def test_written_tiny_models_of_all_shipped_workflows_fit_the_budget(tmp_path: Path) -> None:
    """The files themselves (headers, tokenizer data, metadata included), written into a fresh cache."""
    names, staged = _workflow_files()
    paths = workflow_models.write_synthetic_models(names, tmp_path, "tiny", staged)
    total = sum(p.stat().st_size for p in paths)
    assert len(paths) == len(names) and total <= TINY_BUDGET, {p.name: p.stat().st_size for p in paths}


def test_tiny_runs_swap_the_wan22_vae_for_its_tiny_autoencoder() -> None:
    ui = json.loads(workflow.resolve_workflow("wan22_ti2v_5b").read_text())
    assert workflow_models.swap_tiny_vaes(ui) == [("wan2.2_vae.safetensors", "lighttaew2_2.safetensors")]
    assert "lighttaew2_2.safetensors" in workflow_models.referenced_model_files(ui)
    assert workflow_models.swap_tiny_vaes(ui) == []  # nothing left to swap
    api = {"1": {"class_type": "VAELoader", "inputs": {"vae_name": "wan2.2_vae.safetensors"}},
           "2": {"class_type": "VAELoader", "inputs": {"vae_name": "wan_2.1_vae.safetensors"}},
           "3": {"class_type": "CheckpointLoaderSimple", "inputs": {"vae_name": "wan2.2_vae.safetensors"}}}
    assert workflow_models.swap_tiny_vaes(api) == [("wan2.2_vae.safetensors", "lighttaew2_2.safetensors")]
    assert [n["inputs"]["vae_name"] for n in api.values()] == [
        "lighttaew2_2.safetensors", "wan_2.1_vae.safetensors", "wan2.2_vae.safetensors"]
    t2v = json.loads(workflow.resolve_workflow("wan22_t2v_a14b").read_text())
    assert workflow_models.swap_tiny_vaes(t2v) == []
    # a VAE Loader inside a subgraph (official templates keep theirs there) is swapped too
    nested = {"nodes": [{"id": 1, "type": "sg-1", "widgets_values": []}],
              "definitions": {"subgraphs": [{"id": "sg-1", "nodes": [
                  {"id": 5, "type": "VAELoader", "widgets_values": ["wan2.2_vae.safetensors"]}]}]}}
    assert workflow_models.swap_tiny_vaes(nested) == [("wan2.2_vae.safetensors", "lighttaew2_2.safetensors")]
    assert workflow_models.referenced_model_files(nested) == {"lighttaew2_2.safetensors"}


def test_a_cached_tiny_file_of_another_layout_is_written_again(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    names = {"wan_2.1_vae.safetensors"}
    (path,) = workflow_models.write_synthetic_models(names, tmp_path, "tiny")
    assert workflow_models._header(path)["__metadata__"]["tiny_layout"] == workflow_models.TINY_LAYOUT
    synth.write_synthetic("wan21_vae", path, "tiny", "fp16", metadata={"tiny_layout": "0"})  # an older layout
    capsys.readouterr()
    workflow_models.write_synthetic_models(names, tmp_path, "tiny")
    assert "wan21_vae (fp16) -> vae/wan_2.1_vae.safetensors" in capsys.readouterr().out
    assert workflow_models._header(path)["__metadata__"]["tiny_layout"] == workflow_models.TINY_LAYOUT
    foreign = tmp_path / "vae" / "qwen_image_vae.safetensors"  # a file the runner did not write is never replaced
    save_file({"decoder.head.0.gamma": torch.ones(16, 1, 1, 1)}, str(foreign), metadata={"size": "tiny"})
    stamp = foreign.stat().st_mtime_ns
    workflow_models.write_synthetic_models({"qwen_image_vae.safetensors"}, tmp_path, "tiny")
    assert foreign.stat().st_mtime_ns == stamp


def test_cached_synthetic_models_are_kept_without_a_word(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    names = {"wan_2.1_vae.safetensors", "umt5_xxl_fp8_e4m3fn_scaled.safetensors"}
    staged = {"umt5_xxl_fp8_e4m3fn_scaled.safetensors"}
    paths = workflow_models.write_synthetic_models(names, tmp_path, "tiny", staged)
    out = capsys.readouterr().out
    assert out.startswith(f"writing 2 synthetic tiny model file(s) (random weights) to {tmp_path}")
    assert "2-layer umt5_xxl_enc (fp8_scaled) -> text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors" in out
    stamps = [p.stat().st_mtime_ns for p in paths]
    assert workflow_models.write_synthetic_models(names, tmp_path, "tiny", staged) == paths
    assert capsys.readouterr().out == ""
    assert [p.stat().st_mtime_ns for p in paths] == stamps
    assert workflow_models._layer_count(tmp_path / "text_encoders" / "umt5_xxl_fp8_e4m3fn_scaled.safetensors") == 2


def test_edit_templates_get_a_tiny_encoder_with_a_sparse_vision_tower(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    """A converted Qwen-Image-Edit template's encoder: 2 narrow layers plus the vision tower at ComfyUI's fixed size,
    its blocks zeros that take no disk; the same name for a text-only staged loader is written again without it."""
    from comfyui_lowvram_dit.checkpoints.safetensors_io import iter_tensors, read_header
    from comfyui_lowvram_dit.cli import convert
    from template_files import load_template

    workflow = load_template("image_qwen_image_edit_2511")
    convert.convert_workflow(workflow, convert.ConvertOptions(), "2511")
    te = "qwen_2.5_vl_7b_fp8_scaled.safetensors"
    assert workflow_models.vision_text_encoder_files(workflow) == {te} and te in workflow_models.staged_text_encoder_files(workflow)
    assert not workflow_models.stock_loaded_qwen_image_files(workflow)
    (path,) = workflow_models.write_synthetic_models({te}, tmp_path, "tiny", {te}, {te})
    assert "2-layer (vision tower blocks zero, sparse) qwen25_vl_7b" in capsys.readouterr().out
    header = read_header(path)
    assert workflow_models._layer_count(path) == tiny.TINY_TE_LAYERS
    assert len({k.split(".")[2] for k in header.tensors if k.startswith("visual.blocks.")}) == 32  # as ComfyUI builds
    assert header.tensors["visual.merger.mlp.2.weight"].shape == (tiny.tiny_text_encoder_config(
        "qwen25_vl_7b").hidden, 5120)  # the merger projects to the narrow language model
    block = [k for k in header.tensors if k.startswith("visual.blocks.31.") and not k.endswith(".scale_weight")]
    assert all(not t.float().any() for _, t in iter_tensors(header, block))
    rest = ["visual.patch_embed.proj.weight", "visual.merger.mlp.0.weight", "model.embed_tokens.weight"]
    assert all(t.float().abs().sum() > 0 for _, t in iter_tensors(header, rest))
    on_disk = path.stat().st_blocks * 512 if sys.platform.startswith("linux") else path.stat().st_size
    assert path.stat().st_size > 600e6 and on_disk < 100e6, (path.stat().st_size, on_disk)
    workflow_models.write_synthetic_models({te}, tmp_path, "tiny", {te})  # a text-only staged loader: no vision tower
    assert not workflow_models._has_vision_tower(path) and path.stat().st_size < 50e6


def test_a_cached_run_does_not_import_torch(tmp_path: Path) -> None:
    """The cache check and the GPU check of a CPU machine are header reads, not a torch import (seconds)."""
    names = {"wan_2.1_vae.safetensors", "umt5_xxl_fp8_e4m3fn_scaled.safetensors"}
    workflow_models.write_synthetic_models(names, tmp_path, "tiny", {"umt5_xxl_fp8_e4m3fn_scaled.safetensors"})
    code = (
        "import sys; from pathlib import Path; from comfyui_lowvram_dit.cli import workflow_models; "
        f"workflow_models.write_synthetic_models({sorted(names)!r}, Path({str(tmp_path)!r}), 'tiny', "
        "{'umt5_xxl_fp8_e4m3fn_scaled.safetensors'}); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_run_help_describes_every_option(capsys: pytest.CaptureFixture) -> None:
    parser = runner._parser()
    undocumented = [a.dest for a in parser._actions if not a.help]
    assert not undocumented
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "--set NODE.INPUT=VALUE" in text and "KSampler.steps=4" in text


def test_default_output_folder_is_ignored_by_git() -> None:
    default = runner._parser().get_default("output")
    assert f"{default}/" in (REPO / ".gitignore").read_text().splitlines()


# A stand-in for ComfyUI's main.py: binds --port and answers /system_stats with its argv, as ComfyUI does.
FAKE_MAIN = r'''
import http.server, json, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class Stats(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"system": {"argv": sys.argv}}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
try:
    http.server.HTTPServer(("127.0.0.1", port), Stats).serve_forever()
except OSError as exc:
    print(f"error while attempting to bind on address ('127.0.0.1', {port}): {exc}", flush=True)
    sys.exit(1)
'''


def test_a_server_that_took_the_chosen_port_is_not_taken_for_comfyui(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ComfyUIs started at once can pick the same free port: the one that binds it second must not talk to the
    first (its prompts would reach another server's folders). Another server holds the first port chosen here, so
    the start moves on to the next port and answers from its own process."""
    comfy = tmp_path / "ComfyUI"
    comfy.mkdir()
    (comfy / "main.py").write_text(FAKE_MAIN)
    other_base = tmp_path / "other"
    other_base.mkdir()
    taken = server.free_port()
    other = subprocess.Popen([sys.executable, str(comfy / "main.py"), "--base-directory", str(other_base),
                              "--port", str(taken)])
    try:
        probe, deadline = server.ComfyServer(f"http://127.0.0.1:{taken}"), time.monotonic() + 30
        while probe.request("GET", "/system_stats", timeout=2, quiet=True)[0] != 200:  # the other one is up
            assert time.monotonic() < deadline and other.poll() is None
            time.sleep(0.1)
        ports = iter([taken, server.free_port()])
        monkeypatch.setattr(server, "free_port", lambda: next(ports))
        lines: list[str] = []
        base = tmp_path / "mine"
        base.mkdir()
        with server.ComfyServer.start(comfy, base, timeout=30, progress=lines.append) as mine:
            assert not mine.url.endswith(f":{taken}"), mine.url
            assert str(base) in mine.get("/system_stats")["system"]["argv"]
        assert any("another server took port" in line for line in lines), lines
    finally:
        other.terminate()
        other.wait(timeout=30)
