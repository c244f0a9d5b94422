"""The kept kernel decisions file under ComfyUI's user directory, set when ComfyUI loads the pack's nodes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from comfy_server import comfyui_in_process_or_skip

pytestmark = pytest.mark.comfyui


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    comfyui_in_process_or_skip()
    import folder_paths

    from comfyui_lowvram_dit.host import files

    monkeypatch.setattr(folder_paths, "get_user_directory", lambda: str(tmp_path / "user"))
    monkeypatch.setattr(files, "KEEP_DECISIONS", True)
    return tmp_path / "user"


def test_loading_the_nodes_keeps_decisions_under_the_user_directory(user_dir: Path) -> None:
    """The decisions file is set once, when ComfyUI loads the pack's nodes; running a node sets nothing."""
    import asyncio

    import comfy.model_patcher
    import torch

    from comfyui_lowvram_dit.host.attention import apply_attention
    from comfyui_lowvram_dit.kernels import decision_store
    from comfyui_lowvram_dit.nodes import make_extension

    assert decision_store.kept_in() is None  # nothing is set at import
    model: Any = comfy.model_patcher.ModelPatcher(torch.nn.Linear(2, 2), torch.device("cpu"), torch.device("cpu"))
    apply_attention(model, "ComfyUI default")
    assert decision_store.kept_in() is None
    assert asyncio.run(make_extension().get_node_list())
    assert decision_store.kept_in() == user_dir / "comfyui-lowvram-dit" / "decisions.json"
    decision_store.keep("t", ("k",), "w")
    assert decision_store.kept_in().is_file()


def test_the_decisions_file_names_the_pack_version(user_dir: Path) -> None:
    from comfyui_lowvram_dit.host import files
    from comfyui_lowvram_dit.kernels import decision_store

    import comfyui_lowvram_dit

    files.keep_decisions()
    assert decision_store.kept_in() == user_dir.joinpath(*files.DECISIONS_FILE)
    decision_store.keep("t", ("k",), "w")  # the header names this pack version: an update times afresh
    kept = json.loads(decision_store.kept_in().read_text(encoding="utf-8"))
    assert kept["header"]["pack"] == comfyui_lowvram_dit.__version__ != ""


def _attention_graph(unet: str, width: int) -> dict:
    """A stock Wan graph with Attention auto: a latent width no earlier prompt used makes auto time (and keep) a new
    shape, so the server reads the decisions file again."""
    cond = {"class_type": "LowVRAMTest_RandomConditioning", "inputs": {"seed": 1, "length": 8, "dim": 4096, "std": 1.0}}
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": "default"}},
        "2": {"class_type": "LowVRAM_Attention", "inputs": {"model": ["1", 0], "backend": "auto"}},
        "3": cond,
        "4": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": width, "height": 16, "length": 1,
                                                                   "batch_size": 1}},
        "5": {"class_type": "KSampler", "inputs": {
            "model": ["2", 0], "seed": 0, "steps": 1, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
            "positive": ["3", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}},
        "6": {"class_type": "LowVRAMTest_LatentStats", "inputs": {"latent": ["5", 0]}},
    }


def test_a_fifo_at_the_decisions_file_never_blocks_the_server(comfy_server: Any) -> None:
    """A FIFO where the server keeps its decisions: the prompt that times a new shape finishes (the FIFO is moved
    aside, said once), and the next prompt runs too. A regression would block the prompt worker for good, so the
    test releases it (opens the FIFO for writing) before it fails."""
    import os
    import random
    import uuid

    from comfyui_lowvram_dit.host import files
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    name = f"tiny_wan_fifo_{uuid.uuid4().hex[:8]}.safetensors"
    synth.write_synthetic("wan21_t2v_1_3B", comfy_server.base_dir / "models" / "diffusion_models" / name,
                          size="tiny", num_layers=1)
    path = comfy_server.base_dir.joinpath("user", *files.DECISIONS_FILE)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.rename(path.with_name(f"{path.name}.before-fifo-test"))
    os.mkfifo(path)
    widths = random.Random(uuid.uuid4().int).sample(range(208, 400, 16), 2)  # shapes no other test uses
    try:
        before = len(comfy_server.log_text())
        comfy_server.run(_attention_graph(name, widths[0]), timeout=300)
        comfy_server.run(_attention_graph(name, widths[1]), timeout=300)
    finally:
        if path.is_fifo():  # a blocked reader: let it go, so the server serves the rest of the suite
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    moved = [p for p in path.parent.iterdir() if p.name.startswith(f"{path.name}.unreadable-") and p.is_fifo()]
    said = [ln for ln in comfy_server.log_text()[before:].splitlines() if "moved it aside" in ln]
    assert len(moved) == 1 and path.is_file() and len(said) == 1 and str(moved[0]) in said[0], said
