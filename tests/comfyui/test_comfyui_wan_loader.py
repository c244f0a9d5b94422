"""The Wan loader inside ComfyUI v0.8.0: fp8 ops in-process (forward, LoRA merged and lowvram, moves), and the
node in a real server with the stock KSampler / LoraLoaderModelOnly on tiny synthetic Wan models.

Metric for "stays close to bf16": relative L2 error ||a - b|| / ||b|| of the SaveLatent output of a 3-step
euler KSampler run (cfg 3) against the same graph with the stock UNETLoader on the bf16 file.
"""

from __future__ import annotations

import itertools
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from comfy_server import ComfyServer, comfyui_in_process_or_skip
from safetensors.torch import load_file, save_file

from comfyui_lowvram_dit.synthetic import checkpoints as synth
from comfyui_lowvram_dit.checkpoints import wan as wc

pytestmark = pytest.mark.comfyui
MODEL = "wan22_t2v_14B"
MODES = ["fp8 per-tensor", "fp8 block-wise"]
_counter = itertools.count()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _lora_sd(sd: dict[str, torch.Tensor], rank: int = 4, seed: int = 7, scale: float = 0.5) -> dict[str, torch.Tensor]:
    """A LoRA in ComfyUI's lora_up/lora_down naming on every block Linear and on text_embedding.0 (high precision)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    keys = [k for k, v in sd.items() if wc.is_fp8_target(k, tuple(v.shape))] + ["text_embedding.0.weight"]
    for k in keys:
        n, kk = sd[k].shape
        base = f"diffusion_model.{k[: -len('.weight')]}"
        std = sd[k].float().std().item()
        out[f"{base}.lora_up.weight"] = (torch.randn(n, rank, generator=g) * (scale * std) ** 0.5).to(torch.bfloat16)
        out[f"{base}.lora_down.weight"] = (torch.randn(rank, kk, generator=g) * (scale * std) ** 0.5 / rank**0.5).to(torch.bfloat16)
        out[f"{base}.alpha"] = torch.tensor(float(rank))
    return out


def _merge_lora(sd: dict[str, torch.Tensor], lora: dict[str, torch.Tensor], strength: float) -> dict[str, torch.Tensor]:
    merged = dict(sd)
    for k in lora:
        if k.endswith(".lora_up.weight"):
            base = k[: -len(".lora_up.weight")]
            key = base[len("diffusion_model.") :] + ".weight"
            delta = lora[k].float() @ lora[base + ".lora_down.weight"].float()
            merged[key] = (sd[key].float() + strength * delta).to(sd[key].dtype)
    return merged


# ---------------------------------------------------------------------------------------------------------
# in-process: the ops class on a ComfyUI-built model


@pytest.fixture(scope="module")
def comfy_in_process() -> None:
    comfyui_in_process_or_skip()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, comfy_in_process: None) -> Iterator[dict[str, Any]]:
    d = tmp_path_factory.mktemp("wan")
    sd = synth.synthetic_state_dict(MODEL, size="tiny", fmt="bf16", seed=11)
    path = d / "tiny_bf16.safetensors"
    save_file(sd, str(path))
    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(1, 16, 2, 8, 8, generator=g), torch.tensor([700.0]), torch.randn(1, 12, 4096, generator=g))
    yield {"sd": sd, "path": path, "inputs": inputs}
    shutil.rmtree(d, ignore_errors=True)


def _forward(patcher: Any, inputs: tuple) -> torch.Tensor:
    x, t, ctx = inputs
    dtype = patcher.model.manual_cast_dtype or patcher.model.get_dtype()
    with torch.no_grad():
        return patcher.model.diffusion_model(x.to(dtype), t, ctx.to(dtype)).float()


def _native(sd: dict[str, torch.Tensor]) -> Any:
    import comfy.sd

    return comfy.sd.load_diffusion_model_state_dict(dict(sd), model_options={})


@pytest.mark.parametrize("quantization", MODES)
@pytest.mark.parametrize("block_size", [128, 64])
def test_fp8_model_is_native_and_close_to_bf16(tiny: dict, quantization: str, block_size: int) -> None:
    import comfy.model_patcher

    from comfyui_lowvram_dit.host.wan_loader import QUANTIZATION, load_wan_model

    if quantization == "fp8 per-tensor" and block_size == 64:
        pytest.skip("block_size only matters for block-wise")
    ref = _forward(_native(tiny["sd"]), tiny["inputs"])
    m = load_wan_model(tiny["path"], QUANTIZATION[quantization], block_size, "auto")
    assert isinstance(m, comfy.model_patcher.ModelPatcher) and type(m.model).__name__ == "WAN21"
    lin = m.model.diffusion_model.blocks[1].ffn[2]
    assert lin.weight.dtype == torch.float8_e4m3fn and lin.weight_scale.dtype == torch.float32
    assert lin.weight_scale.ndim == (0 if quantization == "fp8 per-tensor" else 2)
    assert m.model.diffusion_model.text_embedding[0].weight.dtype == torch.bfloat16  # kept high precision
    sd = m.model.state_dict()
    assert sd["diffusion_model.blocks.1.ffn.2.weight"].dtype == torch.float8_e4m3fn
    assert "diffusion_model.blocks.1.ffn.2.weight_scale" in sd
    # Real fp8 bytes are reported: the bf16 model's size, less 1 byte per fp8 weight element, plus the scales.
    import comfy.sd

    bf16_model = comfy.sd.load_diffusion_model_state_dict(dict(tiny["sd"]), model_options={"dtype": torch.bfloat16})
    fp8_keys = [k for k, v in sd.items() if v.dtype == torch.float8_e4m3fn]
    saved = sum(sd[k].numel() for k in fp8_keys) - sum(sd[k + "_scale"].numel() * 4 for k in fp8_keys)
    assert len(fp8_keys) == 20 and m.model_size() == bf16_model.model_size() - saved
    err = _rel(_forward(m, tiny["inputs"]), ref)
    assert err < 0.02, err  # measured ~0.003-0.006 on CPU (weights-only quantization error)


def test_none_mode_is_exactly_native(tiny: dict) -> None:
    from comfyui_lowvram_dit.host.wan_loader import load_wan_model

    m = load_wan_model(tiny["path"], "none", 128, "auto")
    assert torch.equal(_forward(m, tiny["inputs"]), _forward(_native(tiny["sd"]), tiny["inputs"]))


def test_to_keeps_fp8_and_fp32_scales(tiny: dict) -> None:
    from comfyui_lowvram_dit.host.wan_loader import load_wan_model

    m = load_wan_model(tiny["path"], "blockwise", 128, "auto")
    lin = m.model.diffusion_model.blocks[0].self_attn.q
    before = lin.weight.clone()
    m.model.to(torch.bfloat16)
    assert lin.weight.dtype == torch.float8_e4m3fn and lin.weight_scale.dtype == torch.float32
    assert torch.equal(lin.weight.view(torch.uint8), before.view(torch.uint8))
    assert not lin.weight.requires_grad and not lin.weight_scale.requires_grad


@pytest.mark.parametrize("quantization", MODES)
@pytest.mark.parametrize("lowvram", [False, True])
def test_lora_on_fp8_layers_matches_bf16_with_merged_lora(tiny: dict, quantization: str, lowvram: bool) -> None:
    import comfy.sd

    from comfyui_lowvram_dit.host.wan_loader import QUANTIZATION, load_wan_model

    strength = 0.8
    lora = _lora_sd(tiny["sd"])
    merged_ref = _forward(_native(_merge_lora(tiny["sd"], lora, strength)), tiny["inputs"])
    plain_ref = _forward(_native(tiny["sd"]), tiny["inputs"])
    assert _rel(merged_ref, plain_ref) > 0.05  # the LoRA matters

    m = load_wan_model(tiny["path"], QUANTIZATION[quantization], 128, "auto")
    lin = m.model.diffusion_model.blocks[0].ffn[0]
    w0, s0 = lin.weight.clone(), lin.weight_scale.clone()
    patched, _ = comfy.sd.load_lora_for_models(m, None, lora, strength, 0)
    assert len(patched.patches) == 21
    # lowvram=True: every layer offloaded, LoRA applied per call through weight_function (LowVramPatch);
    # lowvram=False: LoRA merged into the fp8 weights by patch_weight_to_device (convert_weight/set_weight).
    patched.load(torch.device("cpu"), lowvram_model_memory=1 if lowvram else 0, full_load=not lowvram)
    try:
        layer = patched.model.diffusion_model.blocks[0].ffn[0]
        assert bool(layer.weight_function) == lowvram
        out = _forward(patched, tiny["inputs"])
    finally:
        patched.unpatch_model(torch.device("cpu"))
    err = _rel(out, merged_ref)
    assert err < 0.02, err  # same order as fp8 vs bf16 without a LoRA
    lin = m.model.diffusion_model.blocks[0].ffn[0]
    assert torch.equal(lin.weight.view(torch.uint8), w0.view(torch.uint8)) and torch.equal(lin.weight_scale, s0)


def _apply_model(patcher: Any, inputs: tuple) -> torch.Tensor:
    """One model call through ``BaseModel.apply_model``, with the patcher's APPLY_MODEL wrappers (the pack's hooks)."""
    x, t, ctx = inputs
    options = {**patcher.model_options["transformer_options"], "wrappers": patcher.wrappers}  # as the sampler does
    with torch.no_grad():
        return patcher.model.apply_model(x, t, c_crossattn=ctx, transformer_options=options).float()


def test_compile_runs_eager_while_the_host_streams_single_layers(tiny: dict) -> None:
    """A card too small for the model under the legacy loading (partial load) with a LoRA: every offloaded fp8 layer
    copies its weight and applies its own LoRA patch per call. Compiled, each such layer was a graph break and each
    patch's key a guarded constant: recompiles per layer and per shape until dynamo's limit sent the blocks back to
    eager, one compile at a time (docs/investigations/2026-11-29-compile-12gb.md). Torch Compile runs such a model
    eager and says why."""
    import comfy.sd

    from comfyui_lowvram_dit.host.torch_compile import COMPILE_KEY, apply_compile
    from comfyui_lowvram_dit.host.wan_loader import QUANTIZATION, load_wan_model
    from comfyui_lowvram_dit.kernels.compile import CompileConfig

    m = load_wan_model(tiny["path"], QUANTIZATION["fp8 per-tensor"], 128, "auto")
    patched, _ = comfy.sd.load_lora_for_models(m, None, _lora_sd(tiny["sd"]), 0.8, 0)
    graphs: list = []

    def compile_fn(module: torch.nn.Module, **kw: Any) -> Any:
        def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
            graphs.append(gm)
            return gm.forward

        return torch.compile(module, backend=backend, options={"guard_filter_fn": kw["options"]["guard_filter_fn"]},
                             dynamic=kw["dynamic"], fullgraph=kw["fullgraph"])

    torch._dynamo.reset()
    compiled = apply_compile(patched, CompileConfig(), "blocks", compile_fn=compile_fn)
    outs = []
    for lowvram in (True, False):
        compiled.load(torch.device("cpu"), lowvram_model_memory=1 if lowvram else 0, full_load=not lowvram)
        try:
            assert bool(compiled.model.diffusion_model.blocks[0].ffn[0].weight_function) == lowvram
            outs.append(_apply_model(compiled, tiny["inputs"]))
            status = compiled.attachments[COMPILE_KEY].status()
        finally:
            compiled.unpatch_model(torch.device("cpu"))
        if lowvram:
            assert "eager (the host loaded this model partially" in status and not graphs, (status, len(graphs))
        else:  # loaded whole (the LoRA merged): compiled as before
            assert "running inductor/default" in status and graphs, status
    torch._dynamo.reset()
    assert _rel(outs[0], outs[1]) < 0.02  # the LoRA per call vs merged into the fp8 codes, as in the test above


# ---------------------------------------------------------------------------------------------------------
# the node in a real ComfyUI server with stock nodes


def _model_file(server: ComfyServer, fmt: str = "bf16", seed: int = 5) -> tuple[str, Path]:
    name = f"b2_wan_{fmt}_{next(_counter)}_{uuid.uuid4().hex[:6]}.safetensors"
    path = server.base_dir / "models" / "diffusion_models" / name
    synth.write_synthetic(MODEL, path, size="tiny", fmt=fmt, seed=seed)
    return name, path


def _graph(loader: dict, prefix: str, lora: str | None = None) -> dict:
    api: dict[str, Any] = {
        "1": loader,
        "2": {"class_type": "LowVRAMTest_RandomConditioning", "inputs": {"seed": 1, "length": 12, "dim": 4096, "std": 1.0}},
        "3": {"class_type": "LowVRAMTest_RandomConditioning", "inputs": {"seed": 2, "length": 12, "dim": 4096, "std": 1.0}},
        "4": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 5, "batch_size": 1}},
        "5": {"class_type": "KSampler", "inputs": {
            "model": ["1", 0], "seed": 42, "steps": 3, "cfg": 3.0, "sampler_name": "euler", "scheduler": "simple",
            "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}},
        "6": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": f"b2/{prefix}"}},
    }
    if lora is not None:
        api["7"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name": lora, "strength_model": 0.8}}
        api["5"]["inputs"]["model"] = ["7", 0]
    return api


def _run_latent(server: ComfyServer, api: dict) -> torch.Tensor:
    entry = server.run(api)
    (saved,) = entry["outputs"]["6"]["latents"]
    return load_file(str(server.base_dir / "output" / saved["subfolder"] / saved["filename"]))["latent_tensor"]


def _unet(name: str) -> dict:
    return {"class_type": "UNETLoader", "inputs": {"unet_name": name, "weight_dtype": "default"}}


def _ours(name: str, quantization: str, save: bool = False, block_size: str = "128") -> dict:
    return {"class_type": "LowVRAM_WanLoader", "inputs": {
        "unet_name": name, "quantization": quantization, "block_size": block_size, "compute": "auto",
        "save_quantized": save}}


@pytest.mark.slow
def test_node_modes_and_fp8_scaled_input_stay_close_to_bf16(comfy_server: ComfyServer) -> None:
    name, _ = _model_file(comfy_server)
    ref = _run_latent(comfy_server, _graph(_unet(name), "ref"))
    errors = {}
    for q in ["none", *MODES]:
        errors[q] = _rel(_run_latent(comfy_server, _graph(_ours(name, q), q.replace(" ", "_"))), ref)
    scaled, _ = _model_file(comfy_server, "fp8_scaled")
    errors["fp8_scaled file"] = _rel(_run_latent(comfy_server, _graph(_ours(scaled, "fp8 block-wise"), "scaled")), ref)
    native_scaled = _rel(_run_latent(comfy_server, _graph(_unet(scaled), "native_scaled")), ref)
    print(f"\nSaveLatent rel. L2 error vs stock UNETLoader bf16 (3 euler steps): {errors}; "
          f"stock UNETLoader on the fp8_scaled file: {native_scaled:.4f}")
    assert errors["none"] < 1e-6
    for k, v in errors.items():
        assert v < 0.05, (k, v)


@pytest.mark.slow
def test_save_quantized_then_reload_picks_the_saved_file(comfy_server: ComfyServer) -> None:
    name, path = _model_file(comfy_server)
    first = _run_latent(comfy_server, _graph(_ours(name, "fp8 block-wise", save=True, block_size="64"), "save1"))
    saved = wc.quantized_path_for(path, "blockwise", 64)
    assert saved.is_file() and wc.find_quantized(path, "blockwise", 64) == saved
    comfy_server.free()
    # save_quantized=False differs from the first prompt, so ComfyUI re-executes the loader.
    second = _run_latent(comfy_server, _graph(_ours(name, "fp8 block-wise", save=False, block_size="64"), "save2"))
    assert f"using saved quantized {saved.name}" in comfy_server.log_text()
    assert torch.equal(first, second)


@pytest.mark.slow
def test_lora_via_stock_loader_matches_bf16_with_merged_lora(comfy_server: ComfyServer) -> None:
    name, path = _model_file(comfy_server, seed=9)
    sd = load_file(str(path))
    lora = _lora_sd(sd)
    lora_name = f"b2_lora_{uuid.uuid4().hex[:6]}.safetensors"
    save_file(lora, str(comfy_server.base_dir / "models" / "loras" / lora_name))
    merged_name = f"b2_merged_{uuid.uuid4().hex[:6]}.safetensors"
    save_file(_merge_lora(sd, lora, 0.8), str(comfy_server.base_dir / "models" / "diffusion_models" / merged_name))
    ref = _run_latent(comfy_server, _graph(_unet(merged_name), "merged"))
    no_lora = _run_latent(comfy_server, _graph(_unet(name), "nolora"))
    for q in MODES:
        got = _run_latent(comfy_server, _graph(_ours(name, q), f"lora_{q.replace(' ', '_')}", lora=lora_name))
        err = _rel(got, ref)
        print(f"\n{q} + LoRA vs bf16 merged: {err:.4f} (LoRA effect {_rel(no_lora, ref):.3f})")
        assert err < 0.05 and err < 0.5 * _rel(no_lora, ref)


# ---------------------------------------------------------------------------------------------------------
# GPU: the fp8 matmul fast path (resident) and the offload-stream path (lowvram), against native bf16


@pytest.mark.cuda
@pytest.mark.parametrize("quantization", MODES)
@pytest.mark.parametrize("lowvram", [False, True])
def test_gpu_fast_and_offloaded_paths_match_bf16(tmp_path: Path, comfy_on_gpu: None, quantization: str,
                                                 lowvram: bool) -> None:
    import comfy.model_management as mm
    import comfy.sd

    from comfyui_lowvram_dit.kernels import fp8
    from comfyui_lowvram_dit.host.wan_loader import QUANTIZATION, load_wan_model

    sd = synth.synthetic_state_dict(MODEL, size="tiny", fmt="bf16", seed=13)
    path = tmp_path / "gpu_bf16.safetensors"
    save_file(sd, str(path))
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(1)
    x, t, ctx = torch.randn(1, 16, 3, 16, 16, generator=g), torch.tensor([600.0]), torch.randn(1, 16, 4096, generator=g)

    def run(patcher: Any) -> torch.Tensor:
        with torch.no_grad():
            return patcher.model.diffusion_model(x.to(dev, torch.bfloat16), t.to(dev), ctx.to(dev, torch.bfloat16)).float()

    ref_model = comfy.sd.load_diffusion_model_state_dict(dict(sd), model_options={"dtype": torch.bfloat16})
    mm.load_models_gpu([ref_model], force_full_load=True)
    ref = run(ref_model)
    m = load_wan_model(path, QUANTIZATION[quantization], 128, "auto")
    mm.unload_all_models()
    m.load(dev, lowvram_model_memory=1 if lowvram else 0, full_load=not lowvram)
    lin = m.model.diffusion_model.blocks[0].ffn[0]
    assert (lin.weight.device.type == "cuda") != lowvram
    expected = fp8.select_path(dev, lin._block_size(), *lin.weight.shape)
    assert lin._path(dev) == expected
    err = _rel(run(m), ref)
    m.unpatch_model(torch.device("cpu"))
    print(f"\n{quantization} lowvram={lowvram} path={expected}: rel err vs bf16 {err:.4f}")
    assert err < 0.03, err  # activations are fp8 too on the fast paths


@pytest.mark.parametrize("disable_mmap", [False, True])
def test_prequantized_file_is_mapped_unless_comfyui_disables_mmap(tiny: dict, tmp_path: Path, monkeypatch: Any,
                                                                  disable_mmap: bool) -> None:
    """fp8_scaled experts stay file-backed (idle-expert RAM), and ComfyUI's --disable-mmap is honoured."""
    import comfy.utils

    from comfyui_lowvram_dit.offload.host_memory import is_file_backed
    from comfyui_lowvram_dit.host.wan_loader import load_wan_model

    path = synth.write_synthetic(MODEL, tmp_path / "scaled.safetensors", size="tiny", fmt="fp8_scaled", seed=11)
    monkeypatch.setattr(comfy.utils, "DISABLE_MMAP", disable_mmap)
    patcher = load_wan_model(path, "per_tensor")
    w = patcher.model.diffusion_model.blocks[0].ffn[0].weight
    assert w.dtype == torch.float8_e4m3fn
    assert is_file_backed(w) is (not disable_mmap)
    out = _forward(patcher, tiny["inputs"])
    assert torch.isfinite(out).all()
