"""The kept kernel decisions file under ComfyUI's user directory, set when a model node runs (in-process, CPU)."""

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


def test_the_attention_node_keeps_decisions_under_the_user_directory(user_dir: Path) -> None:
    import comfy.model_patcher
    import torch

    from comfyui_lowvram_dit.host.attention import apply_attention
    from comfyui_lowvram_dit.kernels import decision_store

    assert decision_store.kept_in() is None  # nothing is set at import
    model: Any = comfy.model_patcher.ModelPatcher(torch.nn.Linear(2, 2), torch.device("cpu"), torch.device("cpu"))
    apply_attention(model, "ComfyUI default")
    assert decision_store.kept_in() == user_dir / "comfyui-lowvram-dit" / "decisions.json"
    decision_store.keep("t", ("k",), "w")
    assert decision_store.kept_in().is_file()


def test_a_model_load_keeps_decisions_there_too(user_dir: Path) -> None:
    from comfyui_lowvram_dit.host import files
    from comfyui_lowvram_dit.kernels import decision_store

    import comfyui_lowvram_dit

    files.keep_decisions()
    assert decision_store.kept_in() == user_dir.joinpath(*files.DECISIONS_FILE)
    decision_store.keep("t", ("k",), "w")  # the header names this pack version: an update times afresh
    kept = json.loads(decision_store.kept_in().read_text(encoding="utf-8"))
    assert kept["header"]["pack"] == comfyui_lowvram_dit.__version__ != ""
