"""Text encoders kept between prompts where ComfyUI's DynamicVRAM manages them (host/kept_text_encoders.py).

In process, ComfyUI's classes, the tiny Qwen2.5-VL file of tests/unit/test_staged.py. DynamicVRAM needs an NVIDIA
GPU and comfy-aimdo, so on the CPU its two parts are planted: the hook that tags mapped weights for aimdo's file
reader (a recording one), and the patcher's verdict that DynamicVRAM manages the encoder. What is checked is ours:
the mapped build takes the file's views without copying them and encodes bit for bit as the streamed copy does, a
kept encoder serves the next prompt and is let go when the file, the device or the verdict changes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from comfy_server import comfyui_in_process_or_skip
from test_staged import write_small_text_encoder

pytestmark = pytest.mark.comfyui
PROMPT = "a red cat on a blue chair, photo"


def _plant_dynamic_vram(monkeypatch: pytest.MonkeyPatch) -> list:
    """Build encoders as under DynamicVRAM (mapped, tagged, no ``disable_dynamic``); returns the tagged views. The
    mapped build is for a GPU, where CLIP.__init__ does not load the model: on the CPU its load (a no-op there) is
    skipped."""
    import comfy.model_management as mm
    from comfyui_lowvram_dit.host import text_encoders

    real_load = mm.load_models_gpu
    monkeypatch.setattr(mm, "load_models_gpu", lambda models, *a, force_full_load=False, **k:
                        None if force_full_load else real_load(models, *a, **k))
    tagged: list = []
    monkeypatch.setattr(text_encoders, "_dynamic_vram_hook",
                        lambda te_path, device: (lambda t, offset, size: tagged.append(t), {}))
    return tagged


def _storages(clip) -> set[int]:  # noqa: ANN001 - comfy.sd.CLIP
    """Data pointers of every parameter's storage (a quantized weight's fp8 data included)."""
    ptrs = set()
    for p in clip.cond_stage_model.parameters():
        inner = getattr(p, "_qdata", p)
        ptrs.add(inner.untyped_storage().data_ptr())
    return ptrs


def _encode(clip) -> object:  # noqa: ANN001 - comfy.sd.CLIP
    return clip.encode_from_tokens_scheduled(clip.tokenize(PROMPT))[0][0]


@pytest.mark.parametrize("fmt", ["bf16", "fp8_scaled"])
def test_the_mapped_build_keeps_the_files_views_and_encodes_as_the_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    comfyui_in_process_or_skip()
    import torch
    from comfyui_lowvram_dit.checkpoints import streaming
    from comfyui_lowvram_dit.host import qwen_stages, text_encoders

    monkeypatch.setattr(streaming, "SMALL_TENSOR_BYTES", 0)  # the tiny file's weights streamed as a real file's are
    te = write_small_text_encoder(tmp_path / "te.safetensors", fmt, seed=3)
    with torch.inference_mode():
        copied = _encode(text_encoders.build_streaming(qwen_stages.QWEN25_VL, te))
    tagged = _plant_dynamic_vram(monkeypatch)
    with torch.inference_mode():
        clip = text_encoders.build_streaming(qwen_stages.QWEN25_VL, te)
        mapped = _encode(clip)
    # every mapped Linear weight (fp8 ones inside ComfyUI's QuantizedTensor) is the model's own, not a copy of it
    linear = [t for t in tagged if t.dim() == 2 and t.shape[0] != t.shape[1] or t.dtype == torch.float8_e4m3fn]
    assert len(linear) > 10 and {t.untyped_storage().data_ptr() for t in linear} <= _storages(clip)
    assert torch.equal(mapped, copied)


def test_a_kept_encoder_serves_the_next_prompt_and_is_let_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kept where DynamicVRAM manages it: built once for two prompts, with a fresh one's embeddings; a rewritten file
    or another device builds a new one (the old one let go); where DynamicVRAM does not manage it, freed."""
    comfyui_in_process_or_skip()
    import torch
    from comfyui_lowvram_dit.host import kept_text_encoders, qwen_stages, text_encoders

    _plant_dynamic_vram(monkeypatch)
    managed = [True]
    monkeypatch.setattr(text_encoders, "dynamic_vram_manages", lambda patcher: managed[0])
    real, built = text_encoders.build_streaming, []
    monkeypatch.setattr(text_encoders, "build_streaming", lambda *a, **k: built.append(a[1]) or real(*a, **k))
    monkeypatch.setattr(qwen_stages, "_compute_device", lambda: torch.device("cpu"))
    te = write_small_text_encoder(tmp_path / "te.safetensors", "fp8_scaled", seed=4)
    label = qwen_stages.QWEN25_VL.label

    def encode(prompt: str, device: torch.device = text_encoders.CPU) -> tuple[torch.Tensor, str]:
        (cond,), report = qwen_stages.encode_prompts(te, [prompt], use_cache=False, device=device)
        return cond[0][0], report.notes[0]

    try:
        encode("a red cat")
        kept, notes = encode("a blue dog")
        assert built == [te] and notes.endswith("encoder kept from an earlier prompt"), notes
        first = kept_text_encoders._KEPT[label][1]
        os.utime(te, ns=(1, 1))  # the file changed since: a new encoder, the kept one let go
        again, notes = encode("a blue dog")
        assert built == [te, te] and "encoder kept for the next prompt" in notes, notes
        assert kept_text_encoders._KEPT[label][1] is not first and torch.equal(again, kept)
        encode("a blue dog", torch.device("cpu", 1))  # another device key
        assert len(built) == 3
        managed[0] = False
        kept_text_encoders.release(label)
        fresh, notes = encode("a blue dog")
        assert len(built) == 4 and notes.endswith("encoder freed") and label not in kept_text_encoders._KEPT, notes
        assert torch.equal(fresh, kept)
    finally:
        kept_text_encoders.release(label)


def test_the_vision_memo_is_one_per_tower() -> None:
    """A kept Edit encoder's vision tower is wrapped once; each run clears the memo it gets back."""
    comfyui_in_process_or_skip()
    import torch
    from comfyui_lowvram_dit.host import qwen_edit

    tower = torch.nn.Linear(2, 2)
    memo = qwen_edit.reuse_vision_features(tower)
    wrapped = tower.forward
    assert qwen_edit.reuse_vision_features(tower) is memo and tower.forward is wrapped


# Runs in a fresh process: comfy-aimdo must be set up before CUDA is, as ComfyUI's main.py does it.
_DYNAMIC_VRAM_CHILD = r'''
import sys, tempfile
from pathlib import Path
sys.path.append(sys.argv[1])
from comfy.cli_args import args
import comfy_aimdo.control
try:
    comfy_aimdo.control.init()
except TypeError:
    comfy_aimdo.control.init(simple_vram_headroom=None)
import comfy.memory_management, comfy.model_management as mm, comfy.model_patcher, comfy.sd, torch
try:
    ok = comfy_aimdo.control.init_devices((d.index, 0) for d in mm.get_all_torch_devices())
except TypeError:
    ok = comfy_aimdo.control.init_devices(d.index for d in mm.get_all_torch_devices())
if not ok:
    print("SKIP comfy-aimdo did not start"); sys.exit(0)
comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
comfy.memory_management.aimdo_enabled = True
from comfyui_lowvram_dit.checkpoints import safetensors_io, streaming, text_encoders as te_files
from comfyui_lowvram_dit.host import kept_text_encoders, text_encoders, wan_text
from comfyui_lowvram_dit.synthetic import checkpoints as synth
from comfyui_lowvram_dit.synthetic.specs import UMT5Config
streaming.SMALL_TENSOR_BYTES = 0  # the tiny file's weights mapped as a real file's are
prompts = ["a red fox runs through fresh snow, golden hour", "a boat"]
te = synth.write_synthetic("umt5_xxl_enc", Path(tempfile.mkdtemp()) / "umt5.safetensors", fmt="fp8_scaled", seed=5,
                           config=UMT5Config(num_layers=24, d_ff=64, num_heads=2, vocab_size=512))
gpu = mm.get_torch_device()
first, r1 = wan_text.encode_wan_prompts(te, prompts[:1], use_cache=False, device=gpu)
second, r2 = wan_text.encode_wan_prompts(te, prompts[1:], use_cache=False, device=gpu)
clip = kept_text_encoders._KEPT[wan_text.UMT5_XXL.label][1]
assert clip.patcher.is_dynamic(), type(clip.patcher)
assert "encoder kept for the next prompt" in r1.notes[0] and "kept from an earlier prompt" in r2.notes[0], (r1, r2)
cfg = te_files.umt5_config_from_header(safetensors_io.read_header(te))
comfy.sd.detect_te_model = lambda sd: comfy.sd.TEModel.T5_XXL
with torch.inference_mode():
    stock = comfy.sd.load_clip([str(te)], clip_type=comfy.sd.CLIPType.WAN, model_options={
        "load_device": gpu, "offload_device": torch.device("cpu"), "umt5xxl_model_config": cfg})
    assert stock.patcher.is_dynamic()
    want = [stock.encode_from_tokens_scheduled(stock.tokenize(p)) for p in prompts]
for ours, ref in zip([first[0], second[0]], want):
    assert torch.equal(ours[0][0].cpu(), ref[0][0].cpu()), (ours[0][0] - ref[0][0]).abs().max()
# the encoder held in RAM under the legacy patcher (DynamicVRAM off) gives what the embedding cache may hold: the same
kept_text_encoders.release(wan_text.UMT5_XXL.label)
text_encoders._dynamic_vram_hook = lambda te_path, device: (None, {"disable_dynamic": True})
legacy, r3 = wan_text.encode_wan_prompts(te, prompts[:1], use_cache=False, device=gpu)
assert r3.notes[0].endswith("encoder freed"), r3.notes
assert torch.equal(legacy[0][0][0].cpu(), first[0][0][0].cpu())
print("OK")
'''


@pytest.mark.cuda
def test_under_dynamic_vram_on_the_gpu_equals_stock_and_is_kept(tmp_path: Path) -> None:
    """The real thing, in a process set up as ComfyUI's main.py sets up comfy-aimdo: the Wan encoder is built under
    ComfyUI's dynamic patcher, kept for the second prompt, and both prompts' CONDITIONING equals stock load_clip +
    CLIPTextEncode under DynamicVRAM on that GPU, bit for bit, and the legacy (freed) encoder's."""
    import subprocess
    import sys

    from comfy_server import comfyui_path_or_reason

    comfy, reason = comfyui_path_or_reason()
    if comfy is None:
        pytest.skip(reason)
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    proc = subprocess.run([sys.executable, "-c", _DYNAMIC_VRAM_CHILD, str(comfy)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout.strip().splitlines()
    if out and out[-1].startswith("SKIP"):
        pytest.skip(out[-1])
    assert proc.returncode == 0 and out and out[-1] == "OK", (proc.stdout[-2000:], proc.stderr[-4000:])
