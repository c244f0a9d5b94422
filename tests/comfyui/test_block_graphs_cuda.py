"""The Qwen-Image blocks replayed from CUDA graphs give the latent the eager blocks give, with and without a LoRA merged
into the weights, with two of the blocks streamed by Block Swap; the memory they hold comes back when they are given
back, and the model then samples eagerly, to the same latent.

Runs ``block_graphs_rows.py`` (beside this file) in a fresh process on a full-width Qwen-Image of 6 blocks at
1328x1328, 4 steps at cfg 1. Needs a CUDA GPU and COMFYUI_PATH (a ComfyUI with ``--disable-cuda-graphs``, 0.30+).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cuda, pytest.mark.comfyui]
HERE = Path(__file__).parent
# Replay launches the kernels the capture recorded, with the same inputs: the same latent, bit for bit, is expected;
# the bound allows for a library that picks another kernel under capture (then the record says `identical: false`).
GRAPH_TOLERANCE = 1e-3


# ComfyUI runs torch's cudaMallocAsync backend where the GPU supports it (its cuda_malloc.py); torch's own caching
# allocator otherwise (--disable-cuda-malloc). Graphs allocate differently under each.
ALLOCATOR = {"cudaMallocAsync": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
             "native": {"PYTORCH_CUDA_ALLOC_CONF": "backend:native"}}


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    comfy = os.environ.get("COMFYUI_PATH")
    if not comfy or "--disable-cuda-graphs" not in (Path(comfy) / "comfy" / "cli_args.py").read_text():
        pytest.skip("needs COMFYUI_PATH pointing at a ComfyUI with --disable-cuda-graphs")
    from comfyui_lowvram_dit.synthetic.checkpoints import write_synthetic

    path = tmp_path_factory.mktemp("graphs") / "qwen_image_6l.safetensors"
    write_synthetic("qwen_image", path, size="full", fmt="bf16", device="cuda", num_layers=6, seed=2)
    yield path
    path.unlink()


@pytest.fixture(scope="module", params=list(ALLOCATOR))
def record(request: pytest.FixtureRequest, model_file: Path) -> dict:
    proc = subprocess.run([sys.executable, str(HERE / "block_graphs_rows.py"), "--model", str(model_file)],
                          capture_output=True, text=True, cwd=HERE, env={**os.environ, **ALLOCATOR[request.param]})
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            print(request.param, json.dumps(result, indent=1))  # the step times: the host's share of a step, with -s
            return result
    pytest.fail(f"block_graphs_rows.py failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")


@pytest.mark.parametrize("case", ["plain", "lora"])
def test_graphs_give_the_eager_latent(record: dict, case: str) -> None:
    r = record[case]
    assert r["stats"]["failed"] == 0, (r, record["log"])  # the log names each failed capture's error
    assert r["stats"]["captured"] >= 4, r  # the 4 resident blocks at least (the 2 streamed ones may recapture)
    assert r["stats"]["replays"] >= 4 * 4, r
    assert r["graphs_vs_eager_rel"] <= GRAPH_TOLERANCE, r


def test_lora_changes_the_picture(record: dict) -> None:
    """The merged LoRA moves the latent far beyond the tolerance, so a graph that kept reading the plain weights
    would fail the ``lora`` case above."""
    assert record["lora_vs_plain_rel"] > 10 * GRAPH_TOLERANCE, record


def test_graphs_given_back_free_their_memory_and_leave_the_model_eager(record: dict) -> None:
    r = record["given_back"]
    assert r["stats_after"]["captured"] == 0 and r["stats_after"]["replays"] == 0, r
    assert r["vs_eager_rel"] <= GRAPH_TOLERANCE, r
    # what the graphs took (free device memory with them against eager, at their first capture) comes back: as
    # ComfyUI reads free memory under cudaMallocAsync (its default); the native allocator's private pool is counted
    # free by that reading while the graphs live, so there the device's own reading
    held = record["plain"]["graph_memory_gib"]
    gain = r["comfyui_free_gain_gib" if record["plain"]["allocator"] == "cudaMallocAsync" else "device_free_gain_gib"]
    assert gain >= 0.5 * held > 0, (r, held)
