"""ComfyUI's official Wan 2.2 and Qwen-Image templates end to end in a real ComfyUI server, tiny synthetic models.

Converted (``convert``) templates run through ``python -m comfyui_lowvram_dit run`` itself (``cli.main(["run",
...])``): it writes the tiny models, the synthetic 4-step / 8-step LoRAs under the official names the templates
wire, starts ComfyUI, converts subgraphs to an API prompt with comfy-cli and queues it. The Wan 14B ones also run
with the template's "enable turbo mode" switch on, so the 4-step LoRAs patch the pack's fp8 weights. The converted
Qwen-Image-Edit ones run with it on (4 steps instead of 40 for 2511); their encoder carries the full-size vision
tower ComfyUI builds, with zero (sparse) blocks: its CPU run over each reference image and the first sampler step
over the 1024x1024 reference latents (Attention auto timing its candidates) are the slow part.

The text encoder problem, and what these tests do about it: a template that keeps ComfyUI's stock ``CLIPLoader``
(every unconverted template) builds umT5-XXL / Qwen2.5-VL-7B from ComfyUI's fixed full-size configs, so a tiny
encoder file does not load and a full-size one is 6.7 / 8.3 GB (over the suite's 2 GB disk budget, and minutes per
encode on CI's 2 cores). Those runs swap each ``CLIPLoader`` for ``LowVRAMTest_StreamedCLIPLoader``
(tests/fixture_nodes: same inputs and CLIP output, ComfyUI's own encoder classes sized from the file by the pack's
streaming builder) and keep every other node of the template as shipped. So they test the template's graph, LoRAs,
samplers, switches and VAE with the stock nodes, and the converted graph around the stock text encoder, but not
CLIPLoader itself.

A template that needs a node the host lacks (``ComfyMathExpression`` is newer than ComfyUI 0.8.0) makes the
runner stop before queueing with a message naming the node and the host's version; the test skips with it.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from comfy_server import ComfyServer
from comfyui_lowvram_dit.cli import convert, runner, workflow_models
from comfyui_lowvram_dit.cli import main as cli_main
from comfyui_lowvram_dit.cli.server import RunError
from comfyui_lowvram_dit.cli.workflow import ensure_input_images
from comfyui_lowvram_dit.synthetic import lora as synth_lora
from comfyui_lowvram_dit.synthetic.tiny import TINY_TE_LAYERS
from comfyui_lowvram_dit.synthetic.lora import KNOWN_LORA_FILES
from comfyui_lowvram_dit.cli.ui_graph import all_nodes
from template_files import load_template

pytestmark = pytest.mark.comfyui
STAND_IN = "LowVRAMTest_StreamedCLIPLoader"
TURBO = "PrimitiveBoolean.value=true"  # the Wan 14B templates' "enable turbo mode" (4-step LoRAs)
# The 4-step LoRA switch off for T2V and on for I2V in CI, the other two in the slow tier
RUNNER_TEMPLATES = [("video_wan2_2_14B_t2v", []), pytest.param("video_wan2_2_14B_t2v", [TURBO], marks=pytest.mark.slow),
                    pytest.param("video_wan2_2_14B_i2v", [], marks=pytest.mark.slow), ("video_wan2_2_14B_i2v", [TURBO]),
                    ("video_wan2_2_5B_ti2v", []), ("image_qwen_image", [TURBO])]
# The slow tier (three to five minutes each on CI's two cores): in CI the Edit loader runs through a server in
# test_comfyui_qwen_edit.py, which also checks both markers reach ComfyUI's detection; test_convert.py converts both
EDIT_TEMPLATES = [pytest.param(name, marks=pytest.mark.slow)
                  for name in ("image_qwen_image_edit_2509", "image_qwen_image_edit_2511")]
# The Edit encoder's vision tower (ComfyUI's fixed 32 blocks of width 1280) on the CPU: in fp32 about twice as fast as
# ComfyUI's default fp16 text encoder on CPUs without native half-precision matmul, such as CI's.
EDIT_RUN_ARGS = ["--comfyui-arg=--fp32-text-enc"]
STOCK_TEXT_TEMPLATES = [("video_wan2_2_14B_t2v", False), ("video_wan2_2_14B_i2v", False),
                        ("video_wan2_2_5B_ti2v", False)]
# Templates whose Qwen-Image transformer stays on stock UNETLoader (the unconverted Qwen-Image ones): ComfyUI builds it
# at full width, the tiny synthetic file is narrow.
STOCK_QWEN_TEMPLATES = [("image_qwen_image", False), ("image_qwen_image_edit_2509", False),
                        ("image_qwen_image_edit_2511", False)]


@pytest.fixture(scope="module")
def synthetic_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The runner's cache (synthetic models, user folder) for this module; removed afterwards."""
    path = tmp_path_factory.mktemp("templates_cache")
    yield path
    shutil.rmtree(path, ignore_errors=True)


HOST_LACKS: dict[str, str] = {}  # node type -> the runner's line saying this host lacks it, from a first run


def _skip_if_host_lacks_a_node(text: str, name: str) -> None:
    line = next((ln for ln in text.splitlines() if "has no node" in ln), "")
    if line:
        line = line.removeprefix("error: ")
        for kind in line.split("has no node ", 1)[1].split(":", 1)[0].split(", "):
            HOST_LACKS[kind] = line
        pytest.skip(f"{name}: {line}")


def _skip_if_known_to_lack_a_node(workflow: dict, name: str) -> None:
    """A template needing a node an earlier run found missing here skips at once (the runner's check itself ran
    once, in that earlier run); a server start per template only to learn the same is minutes of CI."""
    line = next((HOST_LACKS[n.get("type")] for n in all_nodes(workflow) if n.get("type") in HOST_LACKS), None)
    if line:
        pytest.skip(f"{name}: {line}")


def _outputs(text: str) -> list[Path]:
    return [Path(ln.removeprefix("output: ")) for ln in text.splitlines() if ln.startswith("output: ")]


def _run_converted(name: str, args: list[str], cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                   capsys: pytest.CaptureFixture[str], timeout: int = 600) -> tuple[dict, Path]:
    """Convert template ``name`` and run it through ``python -m comfyui_lowvram_dit run`` on tiny models;
    (converted workflow, output)."""
    workflow = load_template(name)
    convert.convert_workflow(workflow, convert.ConvertOptions(vram_gb=8), name)
    _skip_if_known_to_lack_a_node(workflow, name)
    path = tmp_path / f"{name}_lowvram.json"
    path.write_text(json.dumps(workflow))
    monkeypatch.setenv("LOWVRAM_DIT_CACHE", str(cache))
    rc = cli_main.main(["run", str(path), "--synthetic", "tiny", "--cpu", "--comfyui", os.environ["COMFYUI_PATH"],
                     "--output", str(tmp_path / "out"), "--timeout", str(timeout), *args])
    text = capsys.readouterr()
    _skip_if_host_lacks_a_node(text.err, name)
    assert rc == 0, text.out[-3000:] + text.err[-3000:]
    files = _outputs(text.out)
    assert len(files) == 1 and files[0].is_file() and files[0].stat().st_size > 0, text.out
    return workflow, files[0]


@pytest.mark.parametrize("name, extra", RUNNER_TEMPLATES)
def test_converted_template_runs_through_the_runner(name: str, extra: list[str], synthetic_cache: Path,
                                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    args = [a for x in extra for a in ("--set", x)]
    workflow, _ = _run_converted(name, args, synthetic_cache, tmp_path, monkeypatch, capsys)
    loras = workflow_models.referenced_model_files(workflow) & KNOWN_LORA_FILES.keys()
    assert bool(loras) == (name != "video_wan2_2_5B_ti2v")  # the TI2V-5B template wires no LoRA
    assert all((synthetic_cache / "synthetic" / "tiny" / "loras" / n).is_file() for n in loras)
    tes = list((synthetic_cache / "synthetic" / "tiny" / "text_encoders").iterdir())
    assert tes and all(workflow_models._layer_count(p) == TINY_TE_LAYERS for p in tes)  # staged text: 2 layers


@pytest.mark.parametrize("name", EDIT_TEMPLATES)
def test_converted_edit_template_runs_through_the_runner(name: str, synthetic_cache: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The Edit Staged Loader in the template's graph: LoadImage -> FluxKontextImageScale -> the loader's image
    inputs (vision tower on the CPU, reference latents from its VAE), its VAE -> VAEEncode / VAEDecode, the 4-step
    LoRA on (fewer steps, LoRA used). The picture varies: not a constant from a dead conditioning or model path."""
    from PIL import Image

    workflow, out = _run_converted(name, ["--set", TURBO, *EDIT_RUN_ARGS], synthetic_cache, tmp_path, monkeypatch,
                                   capsys, timeout=1800)
    te = synthetic_cache / "synthetic" / "tiny" / "text_encoders" / "qwen_2.5_vl_7b_fp8_scaled.safetensors"
    assert workflow_models.vision_text_encoder_files(workflow) == {te.name} and workflow_models._has_vision_tower(te)
    assert workflow_models._layer_count(te) == TINY_TE_LAYERS
    extrema = Image.open(out).convert("RGB").getextrema()
    assert any(lo < hi for lo, hi in extrema), extrema


def _stand_in_text_encoders(workflow: dict) -> int:
    """Swap every CLIPLoader for the test stand-in (same widgets); returns how many."""
    count = 0
    for node in all_nodes(workflow):
        if node.get("type") == "CLIPLoader":
            node["type"] = STAND_IN
            count += 1
    return count


def _link_models(cache: Path, server: ComfyServer) -> list[Path]:
    """Symlink the cached synthetic files into the server's model folders; returns the links made."""
    made = []
    for src in (cache / "synthetic" / "tiny").glob("*/*.safetensors"):
        dst = server.base_dir / "models" / src.parent.name / src.name
        if not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.symlink_to(src)
            made.append(dst)
    return made


@pytest.mark.parametrize("name, converted", STOCK_TEXT_TEMPLATES)
def test_template_with_stock_text_encoder_runs(name: str, converted: bool, synthetic_cache: Path,
                                               comfy_server: ComfyServer, monkeypatch: pytest.MonkeyPatch) -> None:
    workflow = copy.deepcopy(load_template(name))
    if converted:
        convert.convert_workflow(workflow, convert.ConvertOptions(vram_gb=8), name)
    _skip_if_known_to_lack_a_node(workflow, name)
    assert _stand_in_text_encoders(workflow) == 1
    monkeypatch.setattr(workflow_models, "STAGED_TEXT_NODES", (*workflow_models.STAGED_TEXT_NODES, STAND_IN))
    models = synthetic_cache / "synthetic" / "tiny"
    workflow_models.write_synthetic_models(workflow_models.referenced_model_files(workflow), models, "tiny",
                                      workflow_models.staged_text_encoder_files(workflow))
    links = _link_models(synthetic_cache, comfy_server)
    placed = ensure_input_images(workflow, comfy_server.base_dir / "input", True, [])
    try:
        server = ComfyServer(comfy_server.url)
        turbo = [] if name == "video_wan2_2_5B_ti2v" else [TURBO]  # 4-step LoRAs on: fewer steps, LoRAs used
        files = runner.run_workflow(server, workflow, turbo, comfy_server.base_dir / "output", 1800, tiny=True)
    except RunError as err:
        _skip_if_host_lacks_a_node(str(err), name)
        raise AssertionError(f"{name}: {err}\n{comfy_server.log_text()[-3000:]}") from None
    finally:
        for p in links + placed:
            p.unlink(missing_ok=True)
    assert files and all(f.is_file() and f.stat().st_size > 0 for f in files)
    for f in files:
        f.unlink()


@pytest.mark.parametrize("name, converted", STOCK_QWEN_TEMPLATES)
def test_tiny_run_refuses_a_stock_loaded_qwen_image(name: str, converted: bool, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The runner stops before writing any model, naming the file and the two ways out (convert, --models)."""
    workflow = load_template(name)
    if converted:
        convert.convert_workflow(workflow, convert.ConvertOptions(vram_gb=8), name)
    stock = workflow_models.stock_loaded_qwen_image_files(workflow)
    assert stock and all(workflow_models.KNOWN_MODEL_FILES[f][1] == "qwen_image" for f in stock)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(workflow))
    monkeypatch.setenv("LOWVRAM_DIT_CACHE", str(tmp_path / "cache"))
    rc = cli_main.main(["run", str(path), "--synthetic", "tiny", "--cpu", "--comfyui", os.environ["COMFYUI_PATH"],
                     "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    _skip_if_host_lacks_a_node(err, name)
    assert rc != 0 and "cannot serve" in err and "convert" in err and "--models" in err, err[-2000:]
    assert not list((tmp_path / "cache").rglob("*.safetensors"))  # refused before writing anything


@pytest.mark.parametrize("lora", ["wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors",
                                  "wan2.2_i2v_lightx2v_4steps_lora_v1_low_noise.safetensors",
                                  "Qwen-Image-Lightning-8steps-V1.0.safetensors"])
def test_synthetic_lora_keys_all_reach_the_model(lora: str, tmp_path: Path) -> None:
    """ComfyUI's own key map (comfy/lora.py) places every key of the synthetic LoRA on the tiny model's weights."""
    from comfy_server import comfyui_in_process_or_skip
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    comfyui_in_process_or_skip()
    import comfy.lora
    import comfy.sd
    import comfy.utils
    from comfyui_lowvram_dit.checkpoints.safetensors_io import read_header
    from comfyui_lowvram_dit.checkpoints.qwen_image import qwen_image_widths
    from comfyui_lowvram_dit.host.model_loading import detected_config_defaults

    model_name = KNOWN_LORA_FILES[lora][0]
    path = synth.write_synthetic(model_name, tmp_path / "model.safetensors", "tiny", "bf16")
    # the tiny Qwen-Image is narrow: built at the file's widths, as the pack's Qwen-Image loaders build it
    widths = qwen_image_widths(read_header(path)) if model_name == "qwen_image" else {}
    with detected_config_defaults(widths):
        patcher = comfy.sd.load_diffusion_model(str(path))
    key_map = comfy.lora.model_lora_keys_unet(patcher.model, {})
    lora_sd = synth_lora.synthetic_lora(lora)
    patches = comfy.lora.load_lora(lora_sd, key_map, log_missing=False)
    modules = {k.rsplit(".lora_", 1)[0] for k in lora_sd if ".lora_down." in k}
    assert len(patches) == len(modules) > 0
    assert set(patches) <= set(patcher.model.state_dict())
