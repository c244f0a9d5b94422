"""Broken caches, disks and files in a real ComfyUI server: no prompt fails for the cache, no user file is lost, every
error names its culprit, and the server keeps serving. One test per class (seeded); needs COMFYUI_PATH.

Classes: embedding cache (1), writes that replace files (2), quantization scales (3), late failures (4),
numbers (5), files changing underneath a loaded model (6).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from comfy_server import ComfyServer, comfyui_in_process_or_skip, sample_wan
from comfyui_lowvram_dit.host.graph_checks import WAN_VAE_KEY
from comfyui_lowvram_dit.synthetic import checkpoints as synth
from comfyui_lowvram_dit.synthetic.specs import model_spec
from safetensors.torch import load_file, save_file
from test_staged import write_small_text_encoder

pytestmark = pytest.mark.comfyui
SEED = 99


def _tag() -> str:
    return uuid.uuid4().hex[:8]


def _wan(server: ComfyServer, fmt: str, name: str | None = None) -> Path:
    path = server.base_dir / "models" / "diffusion_models" / (name or f"rel2_{fmt}_{_tag()}.safetensors")
    return synth.write_synthetic("wan21_t2v_1_3B", path, size="tiny", fmt=fmt, seed=5, num_layers=2)


def _wan_graph(unet: str, seed: int, *, save: bool = False, quantization: str = "fp8 per-tensor") -> dict:
    return {
        "1": {"class_type": "LowVRAM_WanLoader", "inputs": {
            "unet_name": unet, "quantization": quantization, "block_size": "128", "compute": "auto",
            "save_quantized": save}},
        "3": {"class_type": "LowVRAMTest_RandomConditioning", "inputs": {"seed": 1, "length": 8, "dim": 4096,
                                                                         "std": 1.0}},
        "5": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 32, "height": 32, "length": 1,
                                                                   "batch_size": 1}},
        "6": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "seed": seed, "steps": 1, "cfg": 1.0,
                                                    "sampler_name": "euler", "scheduler": "simple",
                                                    "positive": ["3", 0], "negative": ["3", 0],
                                                    "latent_image": ["5", 0], "denoise": 1.0}},
        "7": {"class_type": "LowVRAMTest_LatentStats", "inputs": {"latent": ["6", 0]}},
    }


def _fails_with(server: ComfyServer, graph: dict, *needles: str) -> str:
    with pytest.raises(AssertionError) as err:
        server.run(graph, timeout=300)
    text = str(err.value)
    for n in needles:
        assert n in text, f"{n!r} not in the error: {text[:1500]}"
    return text


def _still_serving(server: ComfyServer, unet: str) -> None:
    entry = server.run(_wan_graph(unet, random.randrange(1 << 30)), timeout=300)
    assert entry["outputs"]["7"]["latent_stats"][0]


@pytest.fixture(scope="module")
def good_wan(comfy_server: ComfyServer) -> str:
    return _wan(comfy_server, "fp8_scaled").name


# ------------------------------------------------------------------------------------------------------------- 1


def _wan22_vae_header(path: Path) -> Path:
    """The Wan 2.2 VAE keys the checks read (real names and shapes, tools.model_specs), not its 1.4 GB of weights:
    both checks stop the prompt before any VAE is built."""
    keep = (WAN_VAE_KEY, "decoder.upsamples.0.upsamples.0.residual.2.weight", "conv2.weight", "conv2.bias")
    spec = {n: (s, d) for n, s, d in model_spec("wan22_vae")}
    save_file({n: torch.zeros(spec[n][0], dtype=spec[n][1]) for n in keep}, str(path))
    return path


@pytest.fixture(scope="module")
def qwen_files(comfy_server: ComfyServer) -> Iterator[dict[str, str]]:
    tag = _tag()
    models = comfy_server.base_dir / "models"
    names = {"unet": f"rel2_qwen_{tag}.safetensors", "te": f"rel2_te_{tag}.safetensors",
             "vae": f"rel2_vae_{tag}.safetensors", "vae22": f"rel2_vae22_{tag}.safetensors"}
    synth.write_synthetic("qwen_image", models / "diffusion_models" / names["unet"], "tiny", "bf16", seed=3)
    write_small_text_encoder(models / "text_encoders" / names["te"], "bf16", seed=0)
    synth.write_synthetic("wan21_vae", models / "vae" / names["vae"], "tiny", "bf16", seed=3)
    _wan22_vae_header(models / "vae" / names["vae22"])
    yield names
    for folder, key in (("diffusion_models", "unet"), ("text_encoders", "te"), ("vae", "vae"), ("vae", "vae22")):
        (models / folder / names[key]).unlink(missing_ok=True)  # the server outlives this module


def _qwen_graph(files: dict[str, str], prompt: str, *, vae: str | None = None, budget: float = 0.0,
                compute: str = "auto") -> dict:
    return {
        "1": {"class_type": "LowVRAM_QwenImageStagedLoader", "inputs": {
            "unet_name": files["unet"], "clip_name": files["te"], "vae_name": vae or files["vae"],
            "positive": prompt, "negative": " ", "quantization": "fp8 per-tensor", "vram_budget_gb": budget,
            "blocks_to_swap": -1, "cache_embeddings": True, "compute": compute}},
        "6": {"class_type": "LowVRAMTest_ConditioningStats", "inputs": {"conditioning": ["1", 1]}},
    }


def test_broken_embedding_cache_never_fails_a_prompt(comfy_server: ComfyServer, qwen_files: dict[str, str]) -> None:
    root = comfy_server.base_dir / "user" / "comfyui-lowvram-dit" / "embeddings"
    rng = random.Random(SEED)
    prompt = f"a lighthouse {_tag()}"
    old = set(root.rglob("*.safetensors"))
    first = comfy_server.run(_qwen_graph(qwen_files, prompt), timeout=600)["outputs"]["6"]
    mine = sorted(set(root.rglob("*.safetensors")) - old)
    assert mine, "the first run cached nothing"
    for n, entry in enumerate(mine):  # damage every fresh entry, each in another way
        kind = rng.choice(["dir", "meta", "shape"])
        entry.unlink()
        if kind == "dir":
            entry.mkdir()
        else:
            meta = "[[[[" * 5000 if kind == "meta" else json.dumps({"version": "qwen-embed-v1", "key": entry.stem,
                                                                  "entries": [{"tensors": [], "values": {}}]})
            save_file({"0.cond": torch.randn(1, 3, 7)}, str(entry), metadata={"lowvram_dit.embedding": meta})
    # Another compute option (no part of the embedding key; on the CPU both dequantize) makes ComfyUI run the loader
    # again, which reads the damaged entries: /free alone drops ComfyUI's output cache only after its next prompt.
    comfy_server.free()
    before = len(comfy_server.log_text())
    again = comfy_server.run(_qwen_graph(qwen_files, prompt, compute="dequantize"), timeout=600)["outputs"]["6"]
    assert again == first
    log = comfy_server.log_text()[before:]
    for entry in mine:
        assert log.count(entry.name) == 1, log[-3000:]  # each damaged entry named once
    # An unwritable cache (a file where its folder should be): the prompt runs uncached.
    moved = root.with_name("embeddings.moved")
    root.rename(moved)
    try:
        root.write_text("not a folder")
        fresh = comfy_server.run(_qwen_graph(qwen_files, f"a harbour {_tag()}"), timeout=600)
        assert fresh["outputs"]["6"]
        assert "cannot write the embedding cache" in comfy_server.log_text()
    finally:
        root.unlink()
        moved.rename(root)


# ------------------------------------------------------------------------------------------------------------- 2


def test_save_quantized_never_replaces_a_users_file(comfy_server: ComfyServer, good_wan: str) -> None:
    src = _wan(comfy_server, "bf16")
    target = src.with_name(f"{src.stem}.lowvram-fp8-per-tensor.safetensors")
    target.write_bytes(b"my own fine-tune, not a copy made by the pack")
    try:
        before = len(comfy_server.log_text())
        entry = comfy_server.run(_wan_graph(src.name, 1, save=True), timeout=300)
        assert entry["outputs"]["7"]["latent_stats"][0]  # the load works; only the save is refused
        assert target.read_bytes() == b"my own fine-tune, not a copy made by the pack"
        assert "not written by this pack" in comfy_server.log_text()[before:]
        assert not list(src.parent.glob("*.partial"))
    finally:
        target.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------------------------- 3


def test_bad_scales_are_named_and_the_server_keeps_serving(comfy_server: ComfyServer, good_wan: str) -> None:
    rng = random.Random(SEED + 3)
    path = _wan(comfy_server, "fp8_scaled")
    sd = load_file(str(path))
    key = rng.choice(sorted(k for k in sd if k.endswith(".scale_weight")))
    sd[key] = torch.tensor(rng.choice([float("nan"), float("inf"), 0.0, -1.0]), dtype=sd[key].dtype)
    save_file(sd, str(path))
    _fails_with(comfy_server, _wan_graph(path.name, 2), "CheckpointError", path.name, key)
    _still_serving(comfy_server, good_wan)


# ------------------------------------------------------------------------------------------------------------- 4


def test_wrong_vae_fails_before_the_text_stage(comfy_server: ComfyServer, qwen_files: dict[str, str]) -> None:
    before = len(comfy_server.log_text())
    _fails_with(comfy_server, _qwen_graph(qwen_files, f"a boat {_tag()}", vae=qwen_files["vae22"]),
                qwen_files["vae22"], qwen_files["unet"], "Wan 2.2 VAE")
    assert "stage 1" not in comfy_server.log_text()[before:], "the text stage ran before the VAE was checked"


def _wan_decode_graph(unet: str, vae: str) -> dict:
    graph = _wan_graph(unet, 1)
    del graph["7"]
    graph["8"] = {"class_type": "VAELoader", "inputs": {"vae_name": vae}}
    graph["9"] = {"class_type": "VAEDecode", "inputs": {"samples": ["6", 0], "vae": ["8", 0]}}
    graph["10"] = {"class_type": "PreviewImage", "inputs": {"images": ["9", 0]}}
    return graph


def test_wan_file_and_vae_that_do_not_fit_fail_before_loading(comfy_server: ComfyServer, good_wan: str,
                                                               qwen_files: dict[str, str]) -> None:
    # Files no earlier prompt loaded: ComfyUI reuses a loader's cached output without running it (and its check)
    five_b = synth.write_synthetic("wan22_ti2v_5B", comfy_server.base_dir / "models" / "diffusion_models" /
                                   f"rel2_5b_{_tag()}.safetensors", size="tiny", fmt="bf16", seed=2, num_layers=1)
    fresh = _wan(comfy_server, "fp8_scaled")
    cases = [(fresh.name, qwen_files["vae22"], "16-channel latents", "wan_2.1_vae"),
             (five_b.name, qwen_files["vae"], "48-channel latents", "wan2.2_vae")]
    try:
        for unet, vae, channels, fix in cases:
            before = len(comfy_server.log_text())
            _fails_with(comfy_server, _wan_decode_graph(unet, vae), unet, vae, channels, fix, "node 1", "node 9")
            assert f"read {unet}" not in comfy_server.log_text()[before:], "the model was read before the check"
        _still_serving(comfy_server, good_wan)
    finally:
        five_b.unlink(missing_ok=True)
        fresh.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------------------------- 5


def test_nan_budget_is_refused_by_name(comfy_server: ComfyServer, good_wan: str,
                                       qwen_files: dict[str, str]) -> None:
    for bad in (float("nan"), float("inf")):
        swap = _wan_graph(good_wan, 3)
        swap["2"] = {"class_type": "LowVRAM_BlockSwap", "inputs": {
            "model": ["1", 0], "vram_budget_gb": bad, "blocks_to_swap": -1, "prefetch": 1, "pinned": True,
            "offload_embeddings": False, "debug": False}}
        swap["6"]["inputs"]["model"] = ["2", 0]
        for graph in (swap, _qwen_graph(qwen_files, "x", budget=bad)):
            status, body = comfy_server.post_prompt(graph)
            assert status == 400 and "vram_budget_gb" in json.dumps(body), (status, json.dumps(body)[:800])
    _still_serving(comfy_server, good_wan)


# ------------------------------------------------------------------------------------------------------------- 6


def test_file_truncated_between_prompts_is_named(comfy_server: ComfyServer, good_wan: str) -> None:
    path = _wan(comfy_server, "fp8_scaled")
    keep = path.with_name(path.name + ".orig")
    shutil.copyfile(path, keep)
    try:
        comfy_server.run(_wan_graph(path.name, 4), timeout=300)  # loaded: its weights are views of the file
        with path.open("r+b") as f:  # truncated in place (same inode), as a failed copy or download does
            f.truncate(path.stat().st_size // 2)
        _fails_with(comfy_server, _wan_graph(path.name, 5), path.name)  # a named error, not a SIGBUS
        assert comfy_server.proc.poll() is None
        _still_serving(comfy_server, good_wan)
    finally:
        os.replace(keep, path)


def test_mapped_file_changed_in_place_stops_sampling_by_name(tmp_path: Path) -> None:
    """In process: the check runs at every sampling start (an idle expert's file may change between its runs)."""
    comfyui_in_process_or_skip()
    import comfy.model_management as mm
    from comfyui_lowvram_dit.checkpoints.safetensors_io import CheckpointError
    from comfyui_lowvram_dit.host.wan_loader import load_wan_model

    path = synth.write_synthetic("wan21_t2v_1_3B", tmp_path / "mapped.safetensors", size="tiny", fmt="fp8_scaled",
                                 seed=1, num_layers=2)
    model = load_wan_model(path, "per_tensor")
    ref = sample_wan(model, seed=2)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rewritten in place: same inode, new mtime
    with pytest.raises(CheckpointError, match="mapped.safetensors changed on disk"):
        sample_wan(model, seed=2)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    torch.testing.assert_close(sample_wan(model, seed=2), ref, rtol=0, atol=0)
    # Replaced by a new file (rename): the mapping still reads the old inode, so sampling goes on.
    shutil.copyfile(path, tmp_path / "new.safetensors")
    os.replace(tmp_path / "new.safetensors", path)
    torch.testing.assert_close(sample_wan(model, seed=2), ref, rtol=0, atol=0)
    mm.unload_all_models()
