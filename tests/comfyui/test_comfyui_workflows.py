"""Every shipped workflow end to end in real ComfyUI v0.8.0 on the CPU, through the runner's own code path.

``cli.main(["run", "WORKFLOW", "--synthetic", "tiny", ...])`` is exactly ``python -m comfyui_lowvram_dit run``: it
writes the tiny synthetic models under the official file names (2-layer text encoders for the staged text nodes), starts
ComfyUI, converts the UI workflow with comfy-cli against the server's /object_info, shrinks it (64 px, 5 frames,
2 steps), queues it and waits. Synthetic files go to a per-session cache, so the first workflow pays for writing
them. Also: tests/pack_object_info.json (used offline by tests/unit/test_workflows.py) still matches the live
/object_info.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from comfy_server import ComfyServer
from comfyui_lowvram_dit.cli import main as cli_main
from comfyui_lowvram_dit.cli import runner, workflow_models
from comfyui_lowvram_dit.synthetic import tiny

pytestmark = pytest.mark.comfyui
TESTS = Path(__file__).resolve().parents[1]
FILE_INPUTS = ("unet_name", "clip_name", "vae_name")
VIDEO_FRAMES = 5  # workflow.TINY_OVERRIDES length
UPDATE_SNAPSHOT = "LOWVRAM_DIT_UPDATE_SNAPSHOT"  # =1: the snapshot test rewrites tests/pack_object_info.json


@pytest.fixture(scope="module")
def synthetic_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The runner's cache (synthetic models, user folder) for this module; removed afterwards."""
    path = tmp_path_factory.mktemp("lowvram_dit_cache")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _normalized(info: dict) -> dict:
    """A node's /object_info without the file lists (they depend on the server's model folders)."""
    info = json.loads(json.dumps(info))
    for section in info["input"].values():
        for name, spec in section.items():
            if name in FILE_INPUTS and len(spec) > 1 and isinstance(spec[1], dict):
                spec[1]["options"] = []
    return info


REGENERATE = (f"regenerate it on the oldest host: {UPDATE_SNAPSHOT}=1 COMFYUI_PATH=<ComfyUI 0.8.0> python -m pytest "
              "tests/comfyui/test_comfyui_workflows.py -k snapshot")


def test_pack_object_info_snapshot_matches_live(comfy_server: ComfyServer) -> None:
    snapshot = TESTS / "pack_object_info.json"
    live = {k: _normalized(v) for k, v in comfy_server.object_info().items() if k.startswith("LowVRAM_")}
    if os.environ.get(UPDATE_SNAPSHOT) == "1":  # newer hosts add fields of their own: write it from 0.8.0
        snapshot.write_text(json.dumps(live, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    stored = {k: _normalized(v) for k, v in json.loads(snapshot.read_text()).items()}
    assert live.keys() == stored.keys(), f"tests/pack_object_info.json lists other nodes: {REGENERATE}"
    for k, info in live.items():
        # newer ComfyUI adds fields of its own to every node (dev_only, essentials_category, ...): compare ours
        ours = {key: info.get(key) for key in stored[k]}
        assert ours == stored[k], f"{k} changed: {REGENERATE}"


def _frames_and_size(path: Path) -> tuple[int, tuple[int, int]]:
    """Frame count and (width, height) of a saved picture or an mp4 (decoded with PyAV, as SaveVideo wrote it)."""
    if path.suffix == ".mp4":
        import av

        with av.open(str(path)) as container:
            frames = list(container.decode(video=0))
        return len(frames), (frames[0].width, frames[0].height)
    from PIL import Image

    with Image.open(path) as img:
        return getattr(img, "n_frames", 1), img.size


# qwen_image_t2i is qwen_image_t2i_4step's graph with 20 steps and no LoRA: the slow tier
@pytest.mark.parametrize("name, suffix", [("wan22_t2v_a14b", ".mp4"), ("wan22_i2v_a14b", ".mp4"),
                                          ("wan22_ti2v_5b", ".mp4"),
                                          pytest.param("qwen_image_t2i", ".png", marks=pytest.mark.slow),
                                          ("wan22_t2v_a14b_4step", ".mp4"), ("qwen_image_t2i_4step", ".png"),
                                          ("wan22_t2v_a14b_2gpu", ".mp4")])
def test_workflow_runs_with_synthetic_tiny_models(name: str, suffix: str, synthetic_cache: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    comfy = os.environ.get("COMFYUI_PATH")
    if name.endswith("_2gpu") and not (Path(str(comfy)) / "comfy_extras" / "nodes_multigpu.py").is_file():
        pytest.skip("Select Model Device is in ComfyUI 0.23+; on one device it passes the model through")
    monkeypatch.setenv("LOWVRAM_DIT_CACHE", str(synthetic_cache))
    out = tmp_path / "out"
    rc = cli_main.main(["run", name, "--synthetic", "tiny", "--cpu", "--comfyui", str(comfy), "--output", str(out),
                     "--timeout", "600"])
    text = capsys.readouterr()
    assert rc == 0, text.out[-3000:] + text.err[-3000:]
    files = [Path(line.removeprefix("output: ")) for line in text.out.splitlines() if line.startswith("output: ")]
    assert len(files) == 1 and files[0].suffix == suffix and files[0].is_file(), text.out
    assert _frames_and_size(files[0]) == ((1 if suffix == ".png" else VIDEO_FRAMES), (64, 64))
    assert "--synthetic tiny:" in text.out
    assert "ComfyUI ready in" in text.out  # the start is shown, not seconds of silence
    assert text.out.splitlines()[-1] == runner.SYNTHETIC_NOTE  # last word: the output is noise
    tes = [p for p in (synthetic_cache / "synthetic" / "tiny" / "text_encoders").iterdir()]
    assert tes and all(workflow_models._layer_count(p) == tiny.TINY_TE_LAYERS for p in tes)
