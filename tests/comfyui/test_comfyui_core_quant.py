"""Files in ComfyUI's own quantized layouts (int8, int8 ConvRot, mxfp8, nvfp4, convrot_w4a4, asym_w4a8_int8)
through the pack's Wan Loader and Qwen-Image staged loader, in process on the host's CPU.

Each layout the host builds: the loader's model is ComfyUI's own (QuantizedTensor layers, no pack ops), one log
line names the layout, and one forward equals the model UNETLoader builds from the same file bit for bit (the same
layers from the same bytes). Block Swap passes such a model through with a line naming the layout; Attention,
Torch Compile (real dynamo, eager backend) and a LoRA give what they give on UNETLoader's model. A layout the host
cannot build (most of them on ComfyUI 0.8.0) is refused before any weight is read, naming the file, the layout and
the stock node that reads it.

Run: COMFYUI_PATH=/path/to/ComfyUI python -m pytest tests/comfyui/test_comfyui_core_quant.py
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from comfy_server import comfyui_in_process_or_skip, sample_wan
from core_quant_files import LAYOUTS, write_quantized
from comfyui_lowvram_dit.kernels.hooks import ModelHook

pytestmark = pytest.mark.comfyui
WAN = "wan22_t2v_14B"
PREFIX = "model.diffusion_model."  # as Comfy-Org's repackaged files


@pytest.fixture(scope="module")
def comfy() -> Any:
    """ComfyUI importable in this process, on CPU."""
    return comfyui_in_process_or_skip()


def _builds(layout: str) -> bool:
    from comfyui_lowvram_dit.host.core_quant import host_builds

    fmt, _, kwargs = LAYOUTS[layout]
    return host_builds({"format": fmt, "convrot": bool(kwargs.get("convrot"))})


@functools.cache
def _wan_sd() -> dict[str, torch.Tensor]:
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    return synth.synthetic_state_dict(WAN, size="tiny", fmt="bf16", seed=11)


def _wan_file(tmp: Path, layout: str, as_metadata: bool = False) -> Path:
    from comfyui_lowvram_dit.checkpoints import wan as wc

    return write_quantized(_wan_sd(), tmp / f"wan_{layout}.safetensors", layout, wc.is_fp8_target, PREFIX, as_metadata)


def _wan_forward(patcher: Any) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x, t, ctx = torch.randn(1, 16, 2, 8, 8, generator=g), torch.tensor([700.0]), torch.randn(1, 12, 4096, generator=g)
    dtype = patcher.model.manual_cast_dtype or patcher.model.get_dtype()
    with torch.no_grad():
        return patcher.model.diffusion_model(x.to(dtype), t, ctx.to(dtype)).float()


def _quantized_layouts(patcher: Any) -> set[str]:
    from comfyui_lowvram_dit.host.core_quant import model_layouts

    return set(model_layouts(patcher))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_wan_loader_builds_core_layers_like_unetloader(comfy: Any, tmp_path: Path, layout: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    import comfy.sd

    from comfyui_lowvram_dit.host.wan_loader import load_wan_model

    if not _builds(layout):
        pytest.skip(f"this ComfyUI does not build {layout} (its refusal is tested below)")
    path = _wan_file(tmp_path, layout)
    stock = comfy.sd.load_diffusion_model(str(path))  # what UNETLoader(weight_dtype="default") builds
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        ours = load_wan_model(path, "per_tensor", 128, "auto")
    lines = [r.getMessage() for r in caplog.records if "ComfyUI's own quantized layers" in r.getMessage()]
    assert len(lines) == 1 and layout in lines[0] and path.name in lines[0], lines
    assert _quantized_layouts(ours) == _quantized_layouts(stock) == {layout}
    assert "custom_operations" not in ours.model_options and type(ours.model).__name__ == "WAN21"
    assert not any("LowVramFp8" in type(m).__name__ for m in ours.model.modules())
    if hasattr(stock, "cached_patcher_init"):  # ComfyUI's reload protocol (not in 0.8.0)
        assert ours.cached_patcher_init == (load_wan_model, (path, "per_tensor", 128, "auto"))
    assert torch.equal(_wan_forward(ours), _wan_forward(stock))


def test_wan_loader_reads_quantization_metadata(comfy: Any, tmp_path: Path) -> None:
    """Configs in the file's ``_quantization_metadata`` instead of per-layer tensors (ComfyUI converts them)."""
    import comfy.sd

    from comfyui_lowvram_dit.host.wan_loader import load_wan_model

    if not _builds("int8_tensorwise+convrot"):
        pytest.skip("this ComfyUI does not build int8 ConvRot")
    path = _wan_file(tmp_path, "int8_tensorwise+convrot", as_metadata=True)
    stock = comfy.sd.load_diffusion_model(str(path))
    ours = load_wan_model(path, "none", 128, "auto")
    assert _quantized_layouts(ours) == {"int8_tensorwise+convrot"}
    assert torch.equal(_wan_forward(ours), _wan_forward(stock))


# ---------------------------------------------------------------------------------------------------------
# Qwen-Image: ComfyUI's detection builds the tiny file only at the widths the staged loader reads from it, so the
# reference is UNETLoader's build (comfy.sd.load_diffusion_model) with those widths added to the detected config.


def _qwen_file(tmp: Path, layout: str) -> Path:
    from comfyui_lowvram_dit.checkpoints.qwen_image import is_qwen_fp8_target
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    sd = synth.synthetic_state_dict("qwen_image", size="tiny", fmt="bf16", seed=3)
    return write_quantized(sd, tmp / f"qwen_{layout}.safetensors", layout, is_qwen_fp8_target)


def _qwen_forward(patcher: Any) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x, ctx = torch.randn(1, 16, 1, 8, 8, generator=g), torch.randn(1, 7, 128, generator=g)
    with torch.no_grad():
        return patcher.model.apply_model(x, torch.tensor([0.6]), c_crossattn=ctx).float()


@pytest.mark.parametrize("layout", ["int8_tensorwise+convrot", "nvfp4", "asym_w4a8_int8"])
def test_qwen_staged_loader_builds_core_layers_like_unetloader(comfy: Any, tmp_path: Path, layout: str,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    import comfy.sd

    from comfyui_lowvram_dit.checkpoints import safetensors_io as checkpoint_io, qwen_image
    from comfyui_lowvram_dit.host import qwen_stages
    from comfyui_lowvram_dit.host.model_loading import detected_config_defaults

    if not _builds(layout):
        pytest.skip(f"this ComfyUI does not build {layout} (its refusal is tested below)")
    path = _qwen_file(tmp_path, layout)
    widths = qwen_image.qwen_image_widths(checkpoint_io.read_header(path))
    with detected_config_defaults(widths):
        stock = comfy.sd.load_diffusion_model(str(path))
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        ours = qwen_stages.load_transformer(path, "blockwise")
    lines = [r.getMessage() for r in caplog.records if "ComfyUI's own quantized layers" in r.getMessage()]
    assert len(lines) == 1 and layout in lines[0] and "Qwen-Image" in lines[0], lines
    assert _quantized_layouts(ours) == _quantized_layouts(stock) == {layout}
    assert "custom_operations" not in ours.model_options
    assert torch.equal(_qwen_forward(ours), _qwen_forward(stock))


# ---------------------------------------------------------------------------------------------------------
# refusal where the host cannot build a layout (on 0.33, one layout is taken away from it to stand for an older host)


def _drop_from_host(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import comfy.quant_ops as qo

    fmt = LAYOUTS[layout][0]
    monkeypatch.setattr(qo, "QUANT_ALGOS", {k: v for k, v in qo.QUANT_ALGOS.items() if k != fmt})


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loaders_refuse_a_layout_the_host_cannot_build(comfy: Any, tmp_path: Path, layout: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from comfyui_lowvram_dit.checkpoints import safetensors_io as checkpoint_io, core_quant, wan as wan_checkpoint
    from comfyui_lowvram_dit.host import qwen_stages
    from comfyui_lowvram_dit.host.version import comfyui_version
    from comfyui_lowvram_dit.host.wan_loader import load_wan_model

    wan, qwen = _wan_file(tmp_path, layout), _qwen_file(tmp_path, layout)
    if _builds(layout):
        _drop_from_host(layout, monkeypatch)
    assert not _builds(layout)

    def no_weights(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("weights read before the refusal")

    for module in (core_quant, wan_checkpoint, checkpoint_io):
        monkeypatch.setattr(module, "read_tensors", no_weights, raising=False)
    for path, load, loader in ((wan, lambda: load_wan_model(wan, "per_tensor", 128, "auto"), "Wan Loader"),
                               (qwen, lambda: qwen_stages.load_transformer(qwen, "per_tensor"), "Qwen-Image")):
        with pytest.raises(ValueError) as info:
            load()
        msg = str(info.value)
        assert path.name in msg and layout in msg and loader in msg and "UNETLoader" in msg, msg
        assert comfyui_version() in msg and "0.33 or newer" in msg, msg


def test_qwen_refusal_comes_before_the_text_stage(comfy: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare_files (the opening of both staged loaders) refuses the transformer before any prompt is encoded."""
    import folder_paths

    from comfyui_lowvram_dit.host import qwen_stages
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    qwen = _qwen_file(tmp_path, "int8_tensorwise+convrot")
    vae = synth.write_synthetic("wan21_vae", tmp_path / "vae.safetensors", "tiny", "bf16", seed=3)
    if _builds("int8_tensorwise+convrot"):
        _drop_from_host("int8_tensorwise+convrot", monkeypatch)
    paths = {"diffusion_models": qwen, "text_encoders": tmp_path / "te.safetensors", "vae": vae}
    monkeypatch.setattr(folder_paths, "get_full_path_or_raise", lambda folder, name: str(paths[folder]))
    with pytest.raises(ValueError, match="int8_tensorwise\\+convrot"):
        qwen_stages.prepare_files(qwen.name, "te.safetensors", vae.name, 0.0)


# ---------------------------------------------------------------------------------------------------------
# the pack's patch nodes on such a model


@pytest.fixture(scope="module")
def core_wan(comfy: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, str]:
    """(the Wan Loader's model, UNETLoader's model, the layout) of the tiny Wan in int8 ConvRot (what Comfy-Org
    ships), or in nvfp4 on a host without int8 (ComfyUI 0.8.0)."""
    import comfy.sd

    from comfyui_lowvram_dit.host.wan_loader import load_wan_model

    layout = next((name for name in ("int8_tensorwise+convrot", "nvfp4") if _builds(name)), None)
    if layout is None:
        pytest.skip("this ComfyUI builds neither int8 ConvRot nor nvfp4")
    path = _wan_file(tmp_path_factory.mktemp("core"), layout)
    return load_wan_model(path, "per_tensor", 128, "auto"), comfy.sd.load_diffusion_model(str(path)), layout


_sample = functools.partial(sample_wan, frames=1)


def test_block_swap_passes_a_core_quantized_model_through(core_wan: tuple,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    from comfyui_lowvram_dit.offload.plan import SwapConfig
    from comfyui_lowvram_dit.host.block_swap import apply_block_swap

    ours, _, layout = core_wan
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        out = apply_block_swap(ours, SwapConfig(vram_budget_gb=1.0, blocks_to_swap=1))
    lines = [r.getMessage() for r in caplog.records if "Block Swap" in r.getMessage()]
    assert out is ours and len(lines) == 1 and layout in lines[0], lines


def test_attention_and_compile_on_a_core_quantized_model(core_wan: tuple) -> None:
    """Attention auto + Torch Compile (real dynamo, eager backend) sample what UNETLoader's model samples."""
    from comfyui_lowvram_dit.kernels.compile import CompileConfig
    from comfyui_lowvram_dit.host.attention import apply_attention
    from comfyui_lowvram_dit.host.torch_compile import COMPILE_KEY, apply_compile
    from comfyui_lowvram_dit.host.hooks import register_hook

    ours, stock, _ = core_wan
    base = _sample(stock, seed=5)
    torch._dynamo.reset()
    frames: list[int] = []

    def compile_fn(module: torch.nn.Module, **kw: Any) -> Any:
        def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
            frames.append(1)
            return gm.forward

        return torch.compile(module, backend=backend, options={"guard_filter_fn": kw["options"]["guard_filter_fn"]})

    attention = _sample(apply_attention(ours, "auto"), seed=5)
    assert torch.equal(attention, _sample(apply_attention(stock, "auto"), seed=5))
    assert ((attention - base).norm() / base.norm()).item() < 1e-3  # another SDPA kernel order, same attention
    compiled = apply_compile(apply_attention(ours, "auto"), CompileConfig(), "blocks", compile_fn=compile_fn)
    assert COMPILE_KEY in compiled.attachments
    # A compiled model runs one sample per call (the same graph on one GPU and under the MultiGPU split), and
    # ComfyUI's int8 layers scale activations per call: compare with the uncompiled model run per sample too.
    per_sample = apply_attention(ours, "auto")
    register_hook(per_sample, "one_sample_per_call", OneSamplePerCall())
    torch.testing.assert_close(_sample(compiled, seed=5), _sample(per_sample, seed=5), rtol=1e-4, atol=1e-4)
    assert frames, "nothing was compiled"


class OneSamplePerCall(ModelHook):
    """Does nothing but ask for one sample per model call, as Torch Compile does."""

    PER_SAMPLE = True


def test_lora_on_a_core_quantized_model_matches_unetloader(core_wan: tuple) -> None:
    """A LoRA merged by ComfyUI into the quantized layers (dequantize, add, requantize) gives UNETLoader's result
    exactly; the Wan Loader's weights are back as loaded afterwards."""
    import comfy.model_management as mm
    import comfy.sd
    from test_comfyui_wan_loader import _lora_sd

    ours, stock, _ = core_wan
    lora = _lora_sd(_wan_sd())
    outs = []
    for model in (ours, stock):
        patched, _ = comfy.sd.load_lora_for_models(model, None, lora, 0.8, 0)
        assert len(patched.patches) == 21
        mm.load_models_gpu([patched], force_full_load=True)  # as KSampler loads it (other clones unloaded first)
        try:
            outs.append(_wan_forward(patched))
        finally:
            mm.unload_all_models()
    plain = _wan_forward(ours)
    assert torch.equal(outs[0], outs[1])
    assert ((outs[0] - plain).norm() / plain.norm()).item() > 0.05  # the LoRA matters
    assert torch.equal(_wan_forward(ours), plain)
