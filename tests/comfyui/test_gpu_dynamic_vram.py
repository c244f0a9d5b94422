"""The Wan Loader's fp8 model under ComfyUI's real DynamicVRAM (a GPU server, DynamicVRAM on as ComfyUI starts it).

Four full-width Wan 2.2 14B blocks (``*_fp8_scaled`` layout, so every Linear is large enough for DynamicVRAM's VRAM
cache) with and without a LoRA, each sampled twice: straight from the loader (DynamicVRAM casts the weights, the
LoRA applied as it casts them) and through Block Swap (the model rebuilt for the legacy patcher, the LoRA merged
into the weights); one step at cfg 1, so the latent is one forward's output (random weights amplify any
difference over steps). The two are not bit-identical: under DynamicVRAM ComfyUI also casts the model's other
parameters (modulation, norms) to the model dtype as it loads them. Measured on an H200 with ComfyUI 0.33.0: 3.6 %
apart without a LoRA, 8.0 % with one whose effect is 47 %. A layer that read its fp8 codes as numbers, or applied the
LoRA to the codes instead of the real values, lands as far off as the LoRA's whole effect.
``COMFYUI_PATH=<ComfyUI 0.33.0> python -m pytest tests/comfyui/test_gpu_dynamic_vram.py -m cuda -q`` (about a minute).
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator

import pytest
import torch
from comfy_server import ComfyServer, comfy_server_session, comfyui_path_or_reason, loader_swap_nodes

pytestmark = [pytest.mark.comfyui, pytest.mark.cuda]
NUM_LAYERS = 4


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComfyServer]:
    comfy, reason = comfyui_path_or_reason()
    if comfy is None:
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("comfyui_dynamic")
    try:
        with comfy_server_session(comfy, base, gpu=True) as server:
            yield server
    finally:
        shutil.rmtree(base / "models", ignore_errors=True)


def _write(server: ComfyServer) -> tuple[str, str]:
    from safetensors.torch import save_file
    from test_comfyui_lora_fp8 import wan_lora

    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    unet = server.base_dir / "models" / "diffusion_models" / "dyn_fp8_scaled.safetensors"
    synth.write_synthetic("wan22_t2v_14B", unet, size="full", fmt="fp8_scaled", seed=0, device="cuda",
                          num_layers=NUM_LAYERS)
    bf16 = synth.synthetic_state_dict("wan22_t2v_14B", size="full", fmt="bf16", seed=0, num_layers=NUM_LAYERS)
    lora = server.base_dir / "models" / "loras" / "dyn_lora.safetensors"
    lora.parent.mkdir(parents=True, exist_ok=True)
    save_file(wan_lora(bf16, style="official", ratio=0.3), str(lora))
    del bf16
    return unet.name, lora.name


def _graph(unet: str, lora: str | None, swap: bool, prefix: str) -> dict:
    nodes = loader_swap_nodes(unet, blocks_to_swap=2)
    model = ["1", 0]
    if lora:
        nodes["9"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": model, "lora_name": lora,
                                                                      "strength_model": 1.0}}
        model = ["9", 0]
    if swap:
        nodes["2"]["inputs"]["model"] = model
        model = ["2", 0]
    else:
        del nodes["2"]
    cond = {"class_type": "LowVRAMTest_RandomConditioning", "inputs": {"seed": 1, "length": 24, "dim": 4096,
                                                                        "std": 1.0}}
    return {**nodes, "4": cond, "5": {**cond, "inputs": {**cond["inputs"], "seed": 2}},
            "6": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 256, "height": 256, "length": 5,
                                                                       "batch_size": 1}},
            "7": {"class_type": "KSampler", "inputs": {
                "model": model, "seed": 3, "steps": 1, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
                "positive": ["4", 0], "negative": ["5", 0], "latent_image": ["6", 0], "denoise": 1.0}},
            "8": {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0], "filename_prefix": prefix}}}


def _latent(server: ComfyServer, api: dict) -> torch.Tensor:
    from safetensors.torch import load_file

    prefix = api["8"]["inputs"]["filename_prefix"]
    server.run(api, timeout=600)
    found = sorted((server.base_dir / "output").glob(f"{prefix}*.latent"))
    assert found, f"SaveLatent wrote no {prefix}*.latent"
    return load_file(str(found[-1]))["latent_tensor"].float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_dynamic_vram_path_equals_the_legacy_path(gpu_server: ComfyServer) -> None:
    server = gpu_server
    unet, lora = _write(server)
    # the process's first sampling run makes the timed choices (fp8 activation scales per shape); it is compared
    # with a later run of the same graph (identical on the H200)
    first = _latent(server, _graph(unet, None, False, f"dyn_{uuid.uuid4().hex[:8]}"))
    start = len(server.log_text())
    out = {(with_lora, swap): _latent(server, _graph(unet, lora if with_lora else None, swap,
                                                     f"dyn_{uuid.uuid4().hex[:8]}"))
           for with_lora in (False, True) for swap in (False, True)}
    log = server.log_text()[start:]
    assert "prepared for dynamic VRAM loading" in log, log[-3000:]  # the loader's model: DynamicVRAM's
    assert "leaves ComfyUI's DynamicVRAM" in log, log[-3000:]  # Block Swap's: rebuilt for the legacy patcher
    assert all(torch.isfinite(t).all() for t in out.values())
    plain = _rel(out[(False, False)], out[(False, True)])
    effect = _rel(out[(True, True)], out[(False, True)])
    lora_gap = _rel(out[(True, False)], out[(True, True)])
    print(f"\nfirst run vs later {_rel(first, out[(False, False)]):.2e}; no LoRA dynamic vs legacy {plain:.2e}; "
          f"LoRA effect {effect:.3f}; with LoRA dynamic vs legacy {lora_gap:.2e}")
    assert _rel(first, out[(False, False)]) < 1e-3  # timing the choices did not change what the first run drew
    assert effect > 0.05 and plain < 0.15 * effect and lora_gap < 0.3 * effect, (plain, effect, lora_gap)
