"""GGUF models (ComfyUI-GGUF's ``UnetLoaderGGUF``) through the pack's nodes. Needs COMFYUI_PATH and ``gguf``.

In process: tiny Wan 2.2 14B-shaped, TI2V 5B and Qwen-Image files, Q8_0 and Q4_K (tests/gguf_files.py), loaded as
``UnetLoaderGGUF`` loads them (the vendored ComfyUI-GGUF in tests/vendor); Block Swap streams their blocks and samples
exactly what the GGUF model samples alone, with a LoRA before or after it too. On the real server (ComfyUI-GGUF
linked into its ``custom_nodes``): ``UnetLoaderGGUF -> [LoraLoaderModelOnly] -> Block Swap -> KSampler`` equals the
same graph without Block Swap, exactly (the tolerance of the pack's own Block Swap server test); NaN Guard on the
GGUF model samples exactly what it samples alone, Attention auto and Torch Compile the same up to float rounding
(another SDPA kernel, another op order).
"""

from __future__ import annotations

import functools
import gc
import logging
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from comfy_server import comfyui_in_process_or_skip, sample_wan
from gguf_files import gguf_or_skip, load_gguf_in_process, tiny_lora, write_tiny_gguf

pytestmark = pytest.mark.comfyui

_sample = functools.partial(sample_wan, cfg=2.0, frames=3)
QWEN_WIDTHS = {"num_attention_heads": 2, "attention_head_dim": 128, "joint_attention_dim": 128, "out_channels": 16}


# Q4_K (a k-quant: super-blocks, 6-bit sub-scales) here in CI; Q8_0 here in the slow tier (the Qwen-Image and server
# tests below stream Q8_0 in CI)
@pytest.fixture(scope="module", params=[pytest.param("Q8_0", marks=pytest.mark.slow), "Q4_K"])
def wan_gguf(request: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    comfyui_in_process_or_skip()
    gguf_or_skip()
    path = tmp_path_factory.mktemp("gguf") / f"wan22_tiny_{request.param}.gguf"
    types = write_tiny_gguf(path, "wan22_t2v_14B", request.param, num_layers=6)
    assert request.param in set(types.values())
    return path


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_comfyui_gguf_reads_the_synthetic_file_with_its_types_and_shapes(tmp_path: Path, qtype: str) -> None:
    """What the render benchmark writes full-size (synthetic/gguf_checkpoints.py), read by ComfyUI-GGUF's loader."""
    comfyui_in_process_or_skip()
    from comfyui_lowvram_dit.synthetic.checkpoints import file_layout
    from gguf_files import import_vendored_gguf

    types = write_tiny_gguf(tmp_path / "m.gguf", "wan22_t2v_14B", qtype, num_layers=2)
    sd = import_vendored_gguf().loader.gguf_sd_loader(str(tmp_path / "m.gguf"))
    assert {k: tuple(t.tensor_shape) for k, t in sd.items()} == {n: s for n, s, _ in file_layout(
        "wan22_t2v_14B", "tiny", "bf16", 2)}
    assert {k: t.tensor_type.name for k, t in sd.items()} == types and qtype in types.values()


def _swapped(model: Any, blocks: int = 3, **options: Any) -> Any:
    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY, apply_block_swap
    from comfyui_lowvram_dit.offload.plan import SwapConfig

    out = apply_block_swap(model, SwapConfig(blocks_to_swap=blocks, prefetch=1, **options))
    assert SWAP_KEY in out.attachments, "Block Swap passed the GGUF model through"
    return out


def _with_lora(model: Any, strength: float = 1.0, seed: int = 0) -> Any:
    import comfy.sd

    lora, _ = comfy.sd.load_lora_for_models(model, None, tiny_lora(seed=seed), strength, 0)
    return lora


def test_block_swap_on_a_gguf_model_equals_it_alone(wan_gguf: Path) -> None:
    import comfy.model_management as mm

    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY
    from comfyui_lowvram_dit.offload import ggml_tensors as ggml

    model = load_gguf_in_process(wan_gguf)
    ref = _sample(model)
    swapped = _swapped(model)
    ctl = swapped.attachments[SWAP_KEY]
    assert torch.equal(_sample(swapped), ref)
    assert ctl.plan.streamed == (1, 3, 5) and ctl.streamer.stats.loads > 0
    weight = swapped.model.diffusion_model.blocks[1].self_attn.q.weight  # between calls: the host arena's copy
    assert ggml.is_quantized(weight) and ctl.streamer.arena.contains(weight)
    # a slot carries the file's bytes: smaller than the block's weights dequantized to 16 bits
    dequantized = sum(2 * t.shape.numel() for t in model.model.diffusion_model.blocks[1].parameters())
    assert ctl.block_bytes[1] < dequantized * (0.6 if "Q4_K" in wan_gguf.name else 0.7)
    assert type(swapped.clone()) is type(swapped)  # ComfyUI-GGUF's clone resets the class: Block Swap stays
    assert torch.equal(_sample(swapped.clone(), seed=0), ref)
    assert torch.equal(_sample(_swapped(model, offload_embeddings=True)), ref)
    # a budget the whole model fits: nothing streams, ComfyUI-GGUF's own load runs (it takes its options by keyword)
    roomy = _swapped(model, blocks=-1, vram_budget_gb=8.0)
    assert torch.equal(_sample(roomy), ref) and not roomy.attachments[SWAP_KEY].plan.streamed
    mm.unload_all_models()
    assert torch.equal(_sample(model), ref)  # the GGUF model is intact after Block Swap unloaded


def test_block_swap_copies_a_gguf_model_s_streamed_blocks_from_its_file(wan_gguf: Path, monkeypatch: Any) -> None:
    """ComfyUI-GGUF's first load would detach the weights left on the CPU from the file (a copy through the GPU;
    on this CPU device it copies nothing, so its flag is what is checked): Block Swap turns that off for a model it
    streams, so the arena is filled from the file and an idle model goes back to its file pages."""
    import comfy.model_management as mm

    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY
    from comfyui_lowvram_dit.offload.host_memory import is_file_backed
    from gguf_files import import_vendored_gguf

    patcher_cls = import_vendored_gguf().nodes.GGUFModelPatcher
    released_at_load: list[bool] = []
    stock_load = patcher_cls.load

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        released_at_load.append(self.mmap_released)
        return stock_load(self, *args, **kwargs)

    monkeypatch.setattr(patcher_cls, "load", spy)
    model = load_gguf_in_process(wan_gguf)
    ref = _sample(model)
    assert released_at_load == [False]  # alone, ComfyUI-GGUF releases the mapping at its first load
    swapped = _swapped(load_gguf_in_process(wan_gguf))
    assert torch.equal(_sample(swapped), ref)
    assert released_at_load[1:] == [True]
    ctl = swapped.attachments[SWAP_KEY]
    assert ctl.streamer.drops_arena_on_release()
    mm.unload_all_models()
    assert ctl.streamer.arena is None
    assert all(is_file_backed(p) for p in swapped.model.diffusion_model.blocks[1].parameters() if p.ndim == 2)


def test_a_lora_before_or_after_block_swap_on_a_gguf_model_equals_it_without(wan_gguf: Path) -> None:
    """LoRA patches on quantized weights ride on the streamed tensors (applied on dequantization, as ComfyUI-GGUF
    applies them); the F32 biases' patches merge into the arena and come back out on unload."""
    import comfy.model_management as mm

    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY

    model = load_gguf_in_process(wan_gguf)
    ref, ref_lora = _sample(model), _sample(_with_lora(model))
    assert not torch.equal(ref, ref_lora)
    lora_first = _swapped(_with_lora(model))
    assert torch.equal(_sample(lora_first), ref_lora)
    ctl = lora_first.attachments[SWAP_KEY]
    assert ctl.lora.merged and ctl.lora._attached and ctl.lora._backups  # both kinds on the streamed blocks
    swap_first = _swapped(model, blocks=2)
    assert torch.equal(_sample(_with_lora(swap_first)), ref_lora)
    half = _sample(_with_lora(model, strength=0.5))
    assert torch.equal(_sample(_with_lora(swap_first, strength=0.5)), half)  # another strength: restored first
    assert torch.equal(_sample(swap_first), ref)
    mm.unload_all_models()
    assert torch.equal(_sample(model), ref)


def _sample_latent(patcher: Any, latent_shape: tuple[int, ...], text_shape: tuple[int, ...]) -> torch.Tensor:
    """KSampler's path on a zero latent of ``latent_shape`` with random conditioning of ``text_shape`` (2 steps)."""
    import comfy.sample

    g = torch.Generator().manual_seed(0)
    latent = torch.zeros(latent_shape)
    pos, neg = ([[torch.randn(text_shape, generator=g), {}]] for _ in range(2))
    return comfy.sample.sample(patcher, torch.randn(latent.shape, generator=g), 2, 2.0, "euler", "simple", pos, neg,
                               latent, seed=0, disable_pbar=True)


def _swap_equals_alone(model: Any, arch: str, latent_shape: tuple[int, ...],
                       text_shape: tuple[int, ...]) -> tuple[Any, torch.Tensor]:
    """Block Swap streaming 2 blocks of ``model`` samples exactly what it samples alone, and so with a tiny LoRA of
    ``arch`` before it; returns the swapped model (no LoRA) and its latent."""
    import comfy.sd

    sample = functools.partial(_sample_latent, latent_shape=latent_shape, text_shape=text_shape)
    ref = sample(model)
    assert torch.isfinite(ref).all()
    swapped = _swapped(model, blocks=2)
    assert torch.equal(sample(swapped), ref)
    lora = tiny_lora(arch, num_layers=4)
    ref_lora = sample(comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0)[0])
    with_lora = _swapped(comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0)[0], blocks=2)
    assert torch.equal(sample(with_lora), ref_lora) and not torch.equal(ref_lora, ref)
    return swapped, ref


def test_block_swap_on_a_gguf_qwen_image_equals_it_alone(tmp_path: Path) -> None:
    comfyui_in_process_or_skip()
    gguf_or_skip()
    path = tmp_path / "qwen_image_tiny_Q8_0.gguf"
    write_tiny_gguf(path, "qwen_image", "Q8_0", num_layers=4)
    _swap_equals_alone(load_gguf_in_process(path, QWEN_WIDTHS), "qwen_image", (1, 16, 1, 8, 8), (1, 7, 128))


def test_block_swap_on_a_gguf_wan22_ti2v_5b_equals_it_alone(tmp_path: Path) -> None:
    """Wan 2.2 TI2V 5B (48-channel latents) as a Q4_K GGUF file: Block Swap streams its quantized blocks and samples
    exactly what the model samples alone, with a LoRA too."""
    comfyui_in_process_or_skip()
    gguf_or_skip()
    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY

    path = tmp_path / "wan22_ti2v_5b_tiny_Q4_K.gguf"
    assert "Q4_K" in set(write_tiny_gguf(path, "wan22_ti2v_5B", "Q4_K", num_layers=4).values())
    swapped, ref = _swap_equals_alone(load_gguf_in_process(path), "wan22_ti2v_5B", (1, 48, 3, 8, 8), (1, 12, 4096))
    assert ref.shape[1] == 48
    ctl = swapped.attachments[SWAP_KEY]
    assert len(ctl.plan.streamed) == 2 and ctl.streamer.stats.loads > 0  # its blocks streamed, not passed through


def test_a_model_block_swap_cannot_stream_passes_through_in_one_line_and_leaves_no_clone_behind(
        wan_gguf: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """One log line, the model itself back, and nothing half-built whose ``__del__`` raises later."""
    from comfyui_lowvram_dit.host import block_swap

    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    model = load_gguf_in_process(wan_gguf)

    class Wrapped(torch.Tensor):  # a tensor kind the engine does not know
        pass

    linear = model.model.diffusion_model.blocks[2].ffn[0]
    kept = linear.bias
    linear.bias = torch.nn.Parameter(torch.zeros(linear.bias.shape).as_subclass(Wrapped), requires_grad=False)
    try:
        with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
            out = block_swap.apply_block_swap(model, block_swap.SwapConfig(blocks_to_swap=3))
    finally:
        linear.bias = kept
    lines = [r.getMessage() for r in caplog.records if "Block Swap" in r.getMessage()]
    assert out is model and len(lines) == 1, lines
    assert "passes this model through unchanged" in lines[0] and "ffn.0.bias holds a Wrapped" in lines[0]
    # a failure after the clone exists (here: installing the hook) leaves a plain clone, never a Block Swap one
    monkeypatch.setattr(block_swap, "register_hook", _raise)
    with pytest.raises(RuntimeError, match="hook installation failed"):
        block_swap.apply_block_swap(model, block_swap.SwapConfig(blocks_to_swap=3))
    gc.collect()
    assert not unraisable, [u.exc_value for u in unraisable]


def _raise(*args: Any) -> None:
    raise RuntimeError("hook installation failed")


# ------------------------------------------------------------------------------------------------ server


def _gguf_nodes_or_skip(server: Any) -> None:
    if "UnetLoaderGGUF" not in server.object_info():
        reason = "the gguf package is missing in the server's Python (pip install -e '.[test]')"
        if "ComfyUI-GGUF" in server.log_text():
            reason = "ComfyUI-GGUF did not import on this host (see the server log)"
        pytest.skip(f"UnetLoaderGGUF is not registered: {reason}")


def _graph(unet: str, seed: int, model_chain: list[tuple[str, dict]], lora: str | None = None) -> dict:
    """UnetLoaderGGUF -> [LoraLoaderModelOnly] -> each (class, inputs) of ``model_chain`` -> KSampler -> stats."""
    g: dict[str, dict] = {"1": {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": unet}}}
    last = ["1", 0]
    if lora is not None:
        g["2"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": last, "lora_name": lora,
                                                                  "strength_model": 1.0}}
        last = ["2", 0]
    for n, (cls, inputs) in enumerate(model_chain):
        g[f"m{n}"] = {"class_type": cls, "inputs": {"model": last, **inputs}}
        last = [f"m{n}", 0]
    g.update({
        "4": {"class_type": "LowVRAMTest_RandomConditioning", "inputs": {"seed": 1, "length": 12, "dim": 4096,
                                                                         "std": 1.0}},
        "5": {"class_type": "LowVRAMTest_RandomConditioning", "inputs": {"seed": 2, "length": 12, "dim": 4096,
                                                                         "std": 1.0}},
        "6": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 5,
                                                                   "batch_size": 1}},
        "7": {"class_type": "KSampler", "inputs": {"model": last, "seed": seed, "steps": 3, "cfg": 3.0,
                                                    "sampler_name": "euler", "scheduler": "simple",
                                                    "positive": ["4", 0], "negative": ["5", 0],
                                                    "latent_image": ["6", 0], "denoise": 1.0}},
        "8": {"class_type": "LowVRAMTest_LatentStats", "inputs": {"latent": ["7", 0]}},
    })
    return g


SWAP = ("LowVRAM_BlockSwap", {"vram_budget_gb": 0.0, "blocks_to_swap": 3, "prefetch": 1, "pinned": True,
                              "offload_embeddings": False, "debug": False})
ATTENTION = ("LowVRAM_Attention", {"backend": "auto"})
NAN_GUARD = ("LowVRAM_NanGuard", {"action": "warn"})
# backend cudagraphs on CPU tensors runs the AOT graph without recording (inductor would take minutes here)
COMPILE = ("LowVRAM_TorchCompile", {"mode": "default", "backend": "cudagraphs", "dynamic": "auto",
                                    "fullgraph": False, "cache_size_limit": 16, "fallback": True, "scope": "blocks"})


def _close(stats: dict, ref: dict) -> None:
    """Equal up to float rounding (attention auto picks another SDPA kernel; a compiled graph another op order)."""
    assert stats["finite"] and stats["shape"] == ref["shape"]
    for key in ("mean", "std", "min", "max"):
        assert stats[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-5), key


def _stats(server: Any, graph: dict) -> dict:
    return server.run(graph, timeout=600)["outputs"]["8"]["latent_stats"][0]


def test_server_gguf_model_through_block_swap_lora_and_the_other_nodes(comfy_server: Any) -> None:
    from safetensors.torch import save_file

    _gguf_nodes_or_skip(comfy_server)
    tag = uuid.uuid4().hex[:8]
    unet = f"wan22_tiny_{tag}_Q8_0.gguf"
    write_tiny_gguf(comfy_server.base_dir / "models" / "diffusion_models" / unet, "wan22_t2v_14B", "Q8_0", seed=3)
    lora = f"gguf_lora_{tag}.safetensors"
    (comfy_server.base_dir / "models" / "loras").mkdir(parents=True, exist_ok=True)
    save_file(tiny_lora(seed=4), str(comfy_server.base_dir / "models" / "loras" / lora))
    mark = len(comfy_server.log_text())

    alone = _stats(comfy_server, _graph(unet, 11, []))
    assert alone["finite"]
    assert _stats(comfy_server, _graph(unet, 11, [SWAP])) == alone  # exact on CPU: same bytes, same dequant
    with_lora = _stats(comfy_server, _graph(unet, 11, [], lora))
    assert with_lora != alone
    assert _stats(comfy_server, _graph(unet, 11, [SWAP], lora)) == with_lora
    _close(_stats(comfy_server, _graph(unet, 11, [ATTENTION])), alone)  # another SDPA kernel: rounding apart
    assert _stats(comfy_server, _graph(unet, 11, [NAN_GUARD])) == alone
    _close(_stats(comfy_server, _graph(unet, 11, [COMPILE])), alone)
    _close(_stats(comfy_server, _graph(unet, 11, [ATTENTION, NAN_GUARD, SWAP], lora)), with_lora)
    log_text = comfy_server.log_text()[mark:]
    assert "Block Swap: 3 of 6 blocks streamed" in log_text
    assert "LoRA on 30 streamed GGUF-quantized weights applies when they are dequantized" in log_text
    assert "passes this model through" not in log_text and "KeyError" not in log_text


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc/self/smaps")
def test_block_swap_drops_the_file_pages_of_resident_gguf_weights_as_they_move(
        wan_gguf: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Block Swap keeps ComfyUI-GGUF's weights in their file mapping (above), so ComfyUI's copy of each resident
    module to the GPU reads file pages that would then only raise RSS: they leave it as each module moves (``meta``
    stands in for the GPU), as the streamed blocks' pages leave it once copied into the arena, and the weights still
    read the file."""
    from comfyui_lowvram_dit.host.block_swap import resident_file_views
    from comfyui_lowvram_dit.offload import ggml_tensors as ggml
    from test_comfyui_mapped_weights import _mapping_rss_kb

    model = load_gguf_in_process(wan_gguf)
    assert resident_file_views(model) == []  # not Block Swap's: ComfyUI-GGUF releases the mapping itself
    swapped = _swapped(model)
    quantized = {k: ggml.stored(p) for k, p in swapped.model.named_parameters() if ggml.is_quantized(p)}
    values = {k: v.clone() for k, v in quantized.items()}  # reads every page
    before = _mapping_rss_kb(wan_gguf)
    with caplog.at_level("INFO", logger="comfyui_lowvram_dit"):
        swapped.load(device_to=torch.device("meta"), lowvram_model_memory=0, full_load=False)
    after = _mapping_rss_kb(wan_gguf)
    assert before > 1024 and after < 0.2 * before, (before, after)  # without: the resident half stays
    assert "file pages under the GGUF weights now on the GPU left this process's RSS" in caplog.text
    assert resident_file_views(swapped) == []  # on the device now: nothing left to drop at the next load
    assert all(torch.equal(v, values[k]) for k, v in quantized.items())  # re-read from the file
    assert not any("_apply" in m.__dict__ for m in swapped.model.modules())
