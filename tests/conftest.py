"""Shared pytest setup: marker skipping and the session-wide ``comfy_server`` fixture.

Markers (declared in pyproject.toml):
- ``comfyui``: needs ``COMFYUI_PATH`` (a ComfyUI >= 0.8.0 checkout); skipped without it. Tests that
  use the ``comfy_server`` fixture get this marker automatically, so ``-m comfyui`` selects them.
- ``cuda``: needs ``torch.cuda.is_available()``; skipped otherwise.

Unit tests: ``python -m pytest tests`` (what CI runs, see ``.ci/run``). Integration tests:
``COMFYUI_PATH=/path/to/ComfyUI python -m pytest tests -m comfyui``
(the pack must be pip-installed editable in that Python; details in ``tests/comfy_server.py``).
"""

from __future__ import annotations

import functools
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Tests of one tier import helpers defined beside tests of the other (tiny model writers, fake servers).
sys.path[:0] = [str(Path(__file__).parent / tier) for tier in ("unit", "comfyui")]

from comfy_server import ComfyServer, comfy_server_session, comfyui_path_or_reason  # noqa: E402


@functools.cache
def _cuda_missing_reason() -> str:
    """Why ``cuda`` tests must skip here ('' when a GPU is usable); imports torch only when asked."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"needs a CUDA GPU (torch {torch.__version__}, cuda available: False)"
    return ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``comfy_server`` users as ``comfyui``; skip ``comfyui``/``cuda`` tests this machine cannot run."""
    _, comfy_reason = comfyui_path_or_reason()
    for item in items:
        if "comfy_server" in getattr(item, "fixturenames", ()) and item.get_closest_marker("comfyui") is None:
            item.add_marker(pytest.mark.comfyui)
        if comfy_reason and item.get_closest_marker("comfyui") is not None:
            item.add_marker(pytest.mark.skip(reason=comfy_reason))
        if item.get_closest_marker("cuda") is not None and _cuda_missing_reason():
            item.add_marker(pytest.mark.skip(reason=_cuda_missing_reason()))


@pytest.fixture(scope="module")
def comfy_on_gpu() -> None:
    """ComfyUI importable in-process on the GPU (no --cpu); skips the test when an earlier test of this process
    imported it with --cpu (run the ``cuda`` tests alone: ``pytest FILE -m cuda``)."""
    comfy, reason = comfyui_path_or_reason()
    if comfy is None:
        pytest.skip(reason)
    if str(comfy) not in sys.path:
        sys.path.append(str(comfy))
    import comfy.model_management as mm

    if mm.get_torch_device().type != "cuda":
        pytest.skip("ComfyUI was imported with --cpu in this process: run these alone (pytest ... -m cuda)")


@pytest.fixture(scope="session")
def comfy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComfyServer]:
    """One ComfyUI for the whole run, with the pack and ``tests/fixture_nodes`` loaded (see comfy_server.py)."""
    comfy, reason = comfyui_path_or_reason()
    if comfy is None:
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("comfyui")
    try:
        with comfy_server_session(comfy, base) as server:
            yield server
    finally:  # the synthetic models tests placed there are large; the log and outputs stay for a failed run
        shutil.rmtree(base / "models", ignore_errors=True)


@pytest.fixture(autouse=True)
def _kernel_decisions_in_memory(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test times its kernel choices afresh and writes no decisions file (an in-process ComfyUI's user
    directory is its checkout's): a test of the decisions file turns ``KEEP_DECISIONS`` back on or sets its own."""
    from comfyui_lowvram_dit.host import files

    monkeypatch.setattr(files, "KEEP_DECISIONS", False)
    yield
    store = sys.modules.get("comfyui_lowvram_dit.kernels.decision_store")
    if store is not None:
        store.keep_in(None)
