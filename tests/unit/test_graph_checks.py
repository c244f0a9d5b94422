"""host/graph_checks.py: the Wan Loader finds, in the queued graph, a VAE Decode whose Wan VAE cannot decode
its model's latents (CPU, headers only; the server test is in tests/comfyui/test_comfyui_reliability2.py)."""

from __future__ import annotations

import copy
import random
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from comfyui_lowvram_dit.host import graph_checks as gc


def _vae(path: Path, channels: int) -> Path:
    """A header-true stand-in for a Wan VAE: the detection key and conv2 with the latent channels."""
    save_file({gc.WAN_VAE_KEY: torch.ones(4), "conv2.weight": torch.zeros(channels, channels, 1, 1, 1)}, str(path))
    return path


@pytest.fixture
def vaes(tmp_path: Path) -> dict[str, Path]:
    sd_vae = tmp_path / "sd_vae.safetensors"
    save_file({"decoder.conv_in.weight": torch.zeros(4, 4, 3, 3)}, str(sd_vae))
    return {"wan_2.1_vae.safetensors": _vae(tmp_path / "v21.safetensors", 16),
            "wan2.2_vae.safetensors": _vae(tmp_path / "v22.safetensors", 48), "sd_vae.safetensors": sd_vae}


def _two_expert_graph(vae_name: str) -> dict:
    """The T2V-A14B shape: two loaders, two chained samplers, one decode at the end."""
    return {
        "37": {"class_type": "LowVRAM_WanLoader", "inputs": {"unet_name": "high.safetensors"}},
        "56": {"class_type": "LowVRAM_WanLoader", "inputs": {"unet_name": "low.safetensors"}},
        "54": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["37", 0], "shift": 8.0}},
        "55": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["56", 0], "shift": 8.0}},
        "39": {"class_type": "VAELoader", "inputs": {"vae_name": vae_name}},
        "59": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64}},
        "57": {"class_type": "KSamplerAdvanced", "inputs": {"model": ["54", 0], "latent_image": ["59", 0]}},
        "58": {"class_type": "KSamplerAdvanced", "inputs": {"model": ["55", 0], "latent_image": ["57", 0]}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["58", 0], "vae": ["39", 0]}},
        "60": {"class_type": "SaveVideo", "inputs": {"images": ["8", 0]}},
    }


def test_channels_are_read_from_the_header(vaes: dict[str, Path], tmp_path: Path) -> None:
    assert gc.wan_vae_latent_channels(vaes["wan_2.1_vae.safetensors"]) == 16
    assert gc.wan_vae_latent_channels(vaes["wan2.2_vae.safetensors"]) == 48
    assert gc.wan_vae_latent_channels(vaes["sd_vae.safetensors"]) is None  # not a Wan VAE: not ours to judge
    assert gc.wan_vae_latent_channels(tmp_path / "missing.safetensors") is None
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 3)
    assert gc.wan_vae_latent_channels(tmp_path / "junk.safetensors") is None


def test_both_experts_see_the_decode_and_its_wrong_vae(vaes: dict[str, Path]) -> None:
    graph = _two_expert_graph("wan2.2_vae.safetensors")
    for loader in ("37", "56"):  # the high-noise expert reaches the decode through both samplers
        found = gc.mismatched_vaes(graph, loader, 16, vaes.get)
        assert found == [gc.VaeMismatch("8", "VAEDecode", "39", "wan2.2_vae.safetensors", 48)]
    msg = gc.vae_mismatch_message("wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors", "37", 16, found)
    for needle in ("wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors", "node 37", "16-channel latents",
                   "VAEDecode (node 8)", "wan2.2_vae.safetensors", "node 39", "48-channel", "wan_2.1_vae"):
        assert needle in msg, (needle, msg)
    assert gc.mismatched_vaes(_two_expert_graph("wan_2.1_vae.safetensors"), "37", 16, vaes.get) == []


def test_five_b_with_the_2_1_vae_names_the_2_2_vae(vaes: dict[str, Path]) -> None:
    graph = _two_expert_graph("wan_2.1_vae.safetensors")
    graph["8"]["class_type"] = "VAEDecodeTiled"
    found = gc.mismatched_vaes(graph, 37, 48, vaes.get)  # an int unique_id works too
    assert [m.vae_channels for m in found] == [16]
    assert "wan2.2_vae.safetensors" in gc.vae_mismatch_message("wan2.2_ti2v_5B_fp16.safetensors", 37, 48, found)


def test_what_the_check_cannot_judge_passes(vaes: dict[str, Path]) -> None:
    base = _two_expert_graph("wan2.2_vae.safetensors")
    cases = []
    g = copy.deepcopy(base)  # the decode's latent comes from another model's branch
    g["70"] = {"class_type": "UNETLoader", "inputs": {}}
    g["71"] = {"class_type": "KSampler", "inputs": {"model": ["70", 0]}}
    g["8"]["inputs"]["samples"] = ["71", 0]
    cases.append(g)
    g = copy.deepcopy(base)  # the VAE comes from a checkpoint loader, not a VAE Loader
    g["39"] = {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "x"}}
    cases.append(g)
    g = copy.deepcopy(base)  # vae_name is itself a link (a primitive node)
    g["39"]["inputs"]["vae_name"] = ["90", 0]
    cases.append(g)
    g = copy.deepcopy(base)  # a non-Wan VAE file, and a name the folder does not know
    g["39"]["inputs"]["vae_name"] = "sd_vae.safetensors"
    cases.append(g)
    g = copy.deepcopy(base)
    g["39"]["inputs"]["vae_name"] = "not_there.safetensors"
    cases.append(g)
    for graph in cases:
        assert gc.mismatched_vaes(graph, "37", 16, vaes.get) == []
    assert gc.mismatched_vaes(base, None, 16, vaes.get) == [] and gc.mismatched_vaes(None, "37", 16, vaes.get) == []

    def refuses(name: str) -> Path:
        raise ValueError(f"bad name {name}")

    assert gc.mismatched_vaes(base, "37", 16, refuses) == []


def _garbage(rng: random.Random, depth: int = 0) -> object:
    kinds = [None, True, 3, -1, 2.5, float("nan"), "8", "", ["37", 0], [0, "x"], [None, 0], [[], 0], ["37"],
             {"class_type": 5}, {"inputs": []}, ("39", 0), b"\xff"]
    if depth < 4 and rng.random() < 0.4:
        return [_garbage(rng, depth + 1) for _ in range(rng.randint(0, 3))] if rng.random() < 0.5 else \
            {str(rng.randint(0, 99)): _garbage(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    return rng.choice(kinds)


def test_odd_prompt_content_never_raises(vaes: dict[str, Path]) -> None:
    rng = random.Random(1123)
    t0 = time.monotonic()
    for _ in range(400):
        graph = copy.deepcopy(_two_expert_graph("wan2.2_vae.safetensors"))
        for _ in range(rng.randint(1, 6)):
            nid = rng.choice([*graph, "999"])
            target = rng.choice(["node", "inputs", "input", "class"])
            if target == "node":
                graph[nid] = _garbage(rng)
            elif isinstance(graph.get(nid), dict) and target == "class":
                graph[nid]["class_type"] = _garbage(rng)
            elif isinstance(graph.get(nid), dict) and isinstance(graph[nid].get("inputs"), dict):
                graph[nid]["inputs"][rng.choice(["samples", "vae", "vae_name", "model", "x"])] = _garbage(rng)
        found = gc.mismatched_vaes(graph, rng.choice(["37", "56", 37, None, "999", ["37"]]), 16, vaes.get)
        assert all(isinstance(m, gc.VaeMismatch) for m in found)
    ring = {str(i): {"class_type": "X", "inputs": {"a": [str((i + 1) % 50), 0]}} for i in range(50)}
    assert gc.mismatched_vaes(ring, "0", 16, vaes.get) == []  # a cycle ends
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize(("model", "channels"), [("wan22_tae", 48), ("wan21_tae", 16)])
def test_tiny_autoencoders_are_judged_by_their_latent_channels(tmp_path: Path, model: str, channels: int) -> None:
    """A TAEHV (lighttaew2_2 / lighttaew2_1 layout, as cli/synth writes it) gives its latent channels: the right
    one passes, the other is named."""
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    tae = synth.write_synthetic(model, tmp_path / f"{model}.safetensors", "tiny", "fp16")
    assert gc.wan_vae_latent_channels(tae) == channels
    graph = _two_expert_graph("tae.safetensors")
    assert gc.mismatched_vaes(graph, "37", channels, {"tae.safetensors": tae}.get) == []
    other = 16 if channels == 48 else 48
    found = gc.mismatched_vaes(graph, "37", other, {"tae.safetensors": tae}.get)
    assert found == [gc.VaeMismatch("8", "VAEDecode", "39", "tae.safetensors", channels)]
