"""Wan Text Encode (LowVRAM) in process against stock ComfyUI v0.8.0: bit-equal CONDITIONING.

Stock = ``comfy.sd.load_clip(clip_type=WAN)`` (what CLIPLoader(type=wan) calls) + ``encode_from_tokens_scheduled``
(what CLIPTextEncode calls), on the CPU. Two files:
- 24 layers (the real count: ComfyUI's T5_XXL detection keys on block 23) but narrow (d_ff 64, 2 heads, vocab 512):
  stock load_clip itself, given the same ``umt5xxl_model_config`` override our loader reads from the file;
- 2 layers at the real widths (d_model 4096, d_ff 10240, 64 x 64 heads, vocab 256384): stock's WAN branch of
  ``load_text_encoder_state_dicts`` built the same way ComfyUI does (its detection needs block 23, so the branch
  is selected by hand), loading the whole state dict with ComfyUI's ``load_sd``.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
from comfy_server import comfyui_in_process_or_skip, stock_conditioning
from comfyui_lowvram_dit.synthetic import checkpoints as synth
from comfyui_lowvram_dit.synthetic.specs import UMT5Config

pytestmark = pytest.mark.comfyui
PROMPTS = ["a red fox runs through fresh snow, golden hour", ""]


@pytest.fixture(scope="module")
def comfy() -> types.ModuleType:
    """ComfyUI imported in this process (CPU)."""
    comfyui_in_process_or_skip()
    import comfy.sd

    return comfy


def _ours(te: Path, rss: list | None = None) -> list[list]:
    """Our streamed encoder's CONDITIONING per prompt; appends the build's StageReport to ``rss`` if given."""
    import torch
    from comfyui_lowvram_dit.offload import stage_meter
    from comfyui_lowvram_dit.host import wan_text

    with torch.inference_mode():
        stage_meter.release_host_memory()
        with stage_meter.StageMeter("build") as meter:
            clip = wan_text.build_umt5_streaming(te)
        if rss is not None:
            rss.append(meter.report)
        return [clip.encode_from_tokens_scheduled(clip.tokenize(p)) for p in PROMPTS]


def _assert_same(ours: list[list], stock: list[list]) -> None:
    import torch

    for a, b in zip(ours, stock, strict=True):
        assert len(a) == len(b) == 1
        assert a[0][0].shape == b[0][0].shape and a[0][0].shape[-1] == 4096, (a[0][0].shape, b[0][0].shape)
        assert a[0][0].dtype == b[0][0].dtype and torch.equal(a[0][0], b[0][0])
        assert a[0][1].keys() == b[0][1].keys()
        assert bool(a[0][0].abs().sum() > 0)


# fp8_scaled (the file users download, through ComfyUI's scaled-fp8 conversion) in CI; bf16 in the slow tier
@pytest.mark.parametrize("fmt", [pytest.param("bf16", marks=pytest.mark.slow), "fp8_scaled"])
def test_narrow_24_layers_equals_stock_load_clip(comfy: types.ModuleType, tmp_path: Path, fmt: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """24 narrow layers: ours == comfy.sd.load_clip(WAN) + encode, bit for bit (bf16 and legacy fp8_scaled).

    Newer ComfyUI tells umT5-XXL from other T5s by its 10240-wide FFN, which the narrow test encoder lacks, so the
    stock detection is pinned to T5_XXL (what it answers for the real file); the rest of the stock path runs."""
    import torch
    from comfyui_lowvram_dit.checkpoints import safetensors_io as checkpoint_io, text_encoders

    cfg = UMT5Config(num_layers=24, d_ff=64, num_heads=2, vocab_size=512)
    te = synth.write_synthetic("umt5_xxl_enc", tmp_path / f"umt5_{fmt}.safetensors", fmt=fmt, seed=5, config=cfg)
    ours = _ours(te)
    read = text_encoders.umt5_config_from_header(checkpoint_io.read_header(te))
    assert read == {"num_layers": 24, "d_model": 4096, "d_ff": 64, "num_heads": 2, "d_kv": 64, "vocab_size": 512}
    cpu = torch.device("cpu")
    monkeypatch.setattr(comfy.sd, "detect_te_model", lambda sd: comfy.sd.TEModel.T5_XXL)
    with torch.inference_mode():
        clip = comfy.sd.load_clip([str(te)], clip_type=comfy.sd.CLIPType.WAN, model_options={
            "load_device": cpu, "offload_device": cpu, "umt5xxl_model_config": read})
        stock = [clip.encode_from_tokens_scheduled(clip.tokenize(p)) for p in PROMPTS]
    _assert_same(ours, stock)


@pytest.mark.slow
def test_full_width_2_layers_equals_stock_wan_branch(comfy: types.ModuleType, tmp_path: Path) -> None:
    """2 layers at umT5-XXL's real widths (2.9 GB fp16): ours == ComfyUI's WAN CLIP built from the full state dict."""
    import comfy.utils
    import torch
    from comfy.text_encoders import sd3_clip, wan
    from comfyui_lowvram_dit.checkpoints import safetensors_io as checkpoint_io

    te = synth.write_synthetic("umt5_xxl_enc", tmp_path / "umt5_2l_fp16.safetensors", fmt="fp16", seed=6,
                               config=UMT5Config(num_layers=2))
    reports: list = []
    ours = _ours(te, reports)
    # Never two copies: building costs the model (~ the file) plus at most its largest module in flight (here
    # the 2.1 GB embedding table, 73 % of this 2-layer file but 18 % of the real 24-layer one), not the file
    # twice as load_clip's full state dict + model (5.7 GB here, 23 GB for umt5_xxl_fp16).
    largest = max(i.nbytes for i in checkpoint_io.read_header(te).tensors.values())
    grew = reports[0].rss_peak - reports[0].rss_start
    assert grew < te.stat().st_size + largest + 0.3e9, (grew / 1e9, te.stat().st_size / 1e9, largest / 1e9)
    sd = comfy.utils.load_torch_file(str(te), safe_load=True)
    cpu = torch.device("cpu")
    # comfy.sd.load_text_encoder_state_dicts, CLIPType.WAN / TEModel.T5_XXL branch, verbatim but for detection.
    target = types.SimpleNamespace(params={}, clip=wan.te(**sd3_clip.t5_xxl_detect(sd)), tokenizer=wan.WanT5Tokenizer)
    with torch.inference_mode():
        clip = comfy.sd.CLIP(target, tokenizer_data={"spiece_model": sd.get("spiece_model")}, state_dict=[sd],
                             model_options={"load_device": cpu, "offload_device": cpu,
                                            "umt5xxl_model_config": {"num_layers": 2}})
        del sd
        stock = [clip.encode_from_tokens_scheduled(clip.tokenize(p)) for p in PROMPTS]
    _assert_same(ours, stock)


def test_embedding_cache_hit_miss_and_encoder_swap(comfy: types.ModuleType, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Second encode of the same prompts: from the cache, encoder not loaded; a replaced file: a miss."""
    import folder_paths
    import torch
    from comfyui_lowvram_dit.host import wan_text
    from comfyui_lowvram_dit.host import files

    monkeypatch.setattr(folder_paths, "get_user_directory", lambda: str(tmp_path / "user"))
    cfg = UMT5Config(num_layers=2, d_ff=64, num_heads=2, vocab_size=512)
    te = synth.write_synthetic("umt5_xxl_enc", tmp_path / "umt5.safetensors", fmt="fp8_scaled", seed=1, config=cfg)
    first, r1 = wan_text.encode_wan_prompts(te, PROMPTS)
    assert "0 of 2 prompts from the embedding cache, encoder freed" in r1.notes
    assert len(files.embedding_cache().entries()) == 2
    second, r2 = wan_text.encode_wan_prompts(te, PROMPTS)
    assert "2 of 2 prompts from the embedding cache, encoder not loaded" in r2.notes
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a[0][0], b[0][0]) and a[0][1] == b[0][1]
    _assert_same(second, _ours(te))
    synth.write_synthetic("umt5_xxl_enc", te, fmt="fp8_scaled", seed=2, config=cfg)  # same name, new weights
    third, r3 = wan_text.encode_wan_prompts(te, PROMPTS)
    assert "0 of 2 prompts from the embedding cache, encoder freed" in r3.notes
    assert not torch.equal(third[0][0][0], first[0][0][0])
    uncached, r4 = wan_text.encode_wan_prompts(te, PROMPTS[:1], use_cache=False)
    assert "0 of 1 prompts from the embedding cache, encoder freed" in r4.notes
    assert torch.equal(uncached[0][0][0], third[0][0][0])


def test_device_choice_follows_comfyui_and_keys_the_cache(comfy: types.ModuleType, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """auto = where ComfyUI runs text encoders; gpu on a CPU-only ComfyUI is a named error; the embedding cache keeps
    a GPU's and the CPU's embeddings apart (their kernels round differently)."""
    import comfy.model_management as mm
    import torch
    from comfyui_lowvram_dit.host import text_encoders, wan_text

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(mm, "text_encoder_device", lambda: gpu)
    monkeypatch.setattr(mm, "get_torch_device", lambda: gpu)
    assert text_encoders.resolve_device("auto") == gpu and text_encoders.resolve_device("gpu") == gpu
    assert text_encoders.resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(mm, "text_encoder_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(mm, "get_torch_device", lambda: torch.device("cpu"))
    assert text_encoders.resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="Wan Text Encode, device = gpu"):
        text_encoders.resolve_device("gpu", "Wan Text Encode, device")
    with pytest.raises(ValueError, match="'tpu' is not one of"):
        text_encoders.resolve_device("tpu")
    cfg = UMT5Config(num_layers=24, d_ff=64, num_heads=2, vocab_size=512)
    te = synth.write_synthetic("umt5_xxl_enc", tmp_path / "umt5.safetensors", fmt="bf16", seed=5, config=cfg)
    on_cpu = wan_text.UMT5_XXL
    assert text_encoders.encoder_identity(on_cpu, te)["device"] == "cpu"
    assert text_encoders.encoder_identity(on_cpu, te, gpu)["device"] == "cuda"



@pytest.mark.cuda
def test_on_the_gpu_equals_stock_load_clip_on_the_gpu(comfy_on_gpu: None, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """device = gpu: ComfyUI's model management loads the streamed encoder onto the GPU to encode, as it loads
    CLIPLoader's: the same CONDITIONING as stock load_clip + CLIPTextEncode on that GPU, bit for bit."""
    import comfy.sd
    import torch
    from comfyui_lowvram_dit.checkpoints import safetensors_io as checkpoint_io, text_encoders
    from comfyui_lowvram_dit.host import text_encoders as host_te, wan_text

    cfg = UMT5Config(num_layers=24, d_ff=64, num_heads=2, vocab_size=512)
    te = synth.write_synthetic("umt5_xxl_enc", tmp_path / "umt5_fp8.safetensors", fmt="fp8_scaled", seed=5, config=cfg)
    gpu = host_te.resolve_device("gpu")
    (pos, neg), report = wan_text.encode_wan_prompts(te, PROMPTS, use_cache=False, device=gpu)
    assert "cuda" in report.name, report.name
    read = text_encoders.umt5_config_from_header(checkpoint_io.read_header(te))
    monkeypatch.setattr(comfy.sd, "detect_te_model", lambda sd: comfy.sd.TEModel.T5_XXL)
    stock = stock_conditioning(te, "WAN", {"load_device": gpu, "offload_device": torch.device("cpu"),
                                           "umt5xxl_model_config": read}, PROMPTS)
    _assert_same([pos, neg], stock)


def test_the_streamed_encoder_keeps_comfyuis_legacy_patcher(comfy: types.ModuleType, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the streamed encoder holds its weights in RAM (here the CPU; a GPU with DynamicVRAM off) it asks for
    ComfyUI's legacy patcher, also on a ComfyUI with DynamicVRAM, whose pinned copy would hold its weights twice in
    RAM (on a GPU under DynamicVRAM it is mapped and dynamic: test_comfyui_kept_text_encoders.py)."""
    import inspect

    import comfy.model_patcher
    from comfyui_lowvram_dit.host import wan_text

    if "disable_dynamic" not in inspect.signature(comfy.sd.CLIP).parameters:
        pytest.skip("this ComfyUI has no DynamicVRAM (comfy.sd.CLIP(disable_dynamic=...))")

    class DynamicStandIn(comfy.model_patcher.ModelPatcher):
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise AssertionError("the streamed encoder asked for ComfyUI's dynamic patcher")

    monkeypatch.setattr(comfy.model_patcher, "CoreModelPatcher", DynamicStandIn)  # what main.py sets under aimdo
    cfg = UMT5Config(num_layers=24, d_ff=64, num_heads=2, vocab_size=512)
    te = synth.write_synthetic("umt5_xxl_enc", tmp_path / "umt5.safetensors", fmt="bf16", seed=5, config=cfg)
    clip = wan_text.build_umt5_streaming(te)
    assert type(clip.patcher) is comfy.model_patcher.ModelPatcher
