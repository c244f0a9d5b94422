"""4-step (Lightning / distilled) LoRAs on the pack's fp8 weights inside ComfyUI, in-process on tiny models.

LoRA files are built here with the key names the public distillation LoRAs use, as comfy/lora.py maps them:
Kijai-style lightx2v extracts (``diffusion_model.blocks.N.<layer>.lora_down/lora_up/alpha``, ``.diff_b`` on biases,
``.diff`` on norm weights), the official Wan 2.2 lightx2v files (``...lora_A.weight`` / ``...lora_B.weight``) and
Qwen-Image-Lightning (``transformer_blocks.N.attn.to_q.lora_A.weight``, ComfyUI's Qwen-Image direct mapping).

What is checked: with Block Swap, patches on streamed blocks are merged once per load into the host arena (no
per-step ``calculate_weight``), bit-identical to ComfyUI's own merge of resident layers; unpatching restores the
original bytes exactly (the checkpoint file is never written); another strength re-merges; and the fp8 merge's
error against merging the same LoRA into the bf16 weights is not above ComfyUI's fp8_e4m3fn path's.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from comfy_server import comfyui_in_process_or_skip, sample_wan
from safetensors.torch import save_file

from comfyui_lowvram_dit.checkpoints import wan as wc
from comfyui_lowvram_dit.synthetic import checkpoints as synth

pytestmark = pytest.mark.comfyui
MODEL = "wan22_t2v_14B"
MODES = ["per_tensor", "blockwise"]


def wan_lora(sd: dict[str, torch.Tensor], style: str = "kijai", rank: int = 8, ratio: float = 0.1,
             seed: int = 7) -> dict[str, torch.Tensor]:
    """A rank-``rank`` LoRA on every block Linear whose delta is ``ratio`` of the weight's norm (distillation LoRAs
    are small next to the weights); ``kijai`` also carries bias (``diff_b``) and norm (``diff``) differences."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if not wc.is_fp8_target(k, tuple(v.shape)):
            continue
        n, kk = v.shape
        base = f"diffusion_model.{k[: -len('.weight')]}"
        up, down = torch.randn(n, rank, generator=g), torch.randn(rank, kk, generator=g)
        c = (ratio * v.float().norm() / (up @ down).norm()).sqrt()
        if style == "kijai":
            out[f"{base}.lora_up.weight"], out[f"{base}.lora_down.weight"] = (up * c).bfloat16(), (down * c).bfloat16()
            out[f"{base}.alpha"] = torch.tensor(float(rank))
            if k.replace(".weight", ".bias") in sd:
                out[f"{base}.diff_b"] = (torch.randn(n, generator=g) * 0.01).bfloat16()
        else:  # official lightx2v Wan 2.2 files
            out[f"{base}.lora_B.weight"], out[f"{base}.lora_A.weight"] = (up * c).bfloat16(), (down * c).bfloat16()
    for k, v in sd.items():
        if k.endswith("norm3.weight") and style == "kijai":
            out[f"diffusion_model.{k[: -len('.weight')]}.diff"] = (torch.randn(v.shape, generator=g) * 0.01).bfloat16()
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    comfyui_in_process_or_skip()
    d = tmp_path_factory.mktemp("lora_fp8")
    sd = synth.synthetic_state_dict(MODEL, size="tiny", fmt="bf16", seed=11)
    bf16 = d / "wan_bf16.safetensors"
    save_file(sd, str(bf16))
    scaled = d / "wan_fp8_scaled.safetensors"  # kept as stored and mapped: file-backed weights
    synth.write_synthetic(MODEL, scaled, size="tiny", fmt="fp8_scaled", seed=11)
    yield {"sd": sd, "bf16": bf16, "fp8_scaled": scaled}
    shutil.rmtree(d, ignore_errors=True)


def _load(path: Path, quantization: str) -> Any:
    from comfyui_lowvram_dit.host.wan_loader import load_wan_model

    return load_wan_model(path, quantization, 128, "auto")


def _swapped(model: Any, blocks: int = 2) -> Any:
    from comfyui_lowvram_dit.offload.plan import SwapConfig
    from comfyui_lowvram_dit.host.block_swap import apply_block_swap

    return apply_block_swap(model, SwapConfig(blocks_to_swap=blocks, prefetch=1))


def _with_lora(model: Any, lora: dict, strength: float = 1.0) -> Any:
    import comfy.sd

    patched, _ = comfy.sd.load_lora_for_models(model, None, lora, strength, 0)
    return patched


def _block_weights(patcher: Any, block: int) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in patcher.model.diffusion_model.blocks[block].state_dict().items()}


class _CountCalculate:
    """Counts comfy.lora.calculate_weight calls (every LoRA application, merged or per call)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import comfy.lora

        self.n = 0
        orig = comfy.lora.calculate_weight

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.n += 1
            return orig(*args, **kwargs)

        monkeypatch.setattr(comfy.lora, "calculate_weight", counting)


@pytest.mark.parametrize("quantization", MODES)
def test_block_swap_lora_equals_resident_merge_and_merges_once(files: dict, quantization: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import comfy.model_management as mm

    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY

    lora = wan_lora(files["sd"])
    resident = _with_lora(_load(files["bf16"], quantization), lora)
    ref = sample_wan(resident, steps=3)
    mm.unload_all_models()
    plain = sample_wan(_load(files["bf16"], quantization), steps=3)
    mm.unload_all_models()
    assert _rel(plain, ref) > 0.01  # the LoRA matters

    model = _with_lora(_swapped(_load(files["bf16"], quantization)), lora)
    ctl = model.attachments[SWAP_KEY]
    calls = _CountCalculate(monkeypatch)
    out = sample_wan(model, steps=3)
    streamed_keys = [k for k in model.patches if any(k.startswith(f"{ctl.prefix}{b}.") for b in ctl.plan.streamed)]
    assert len(streamed_keys) == 2 * 21  # per streamed block: 10 Linear weights, their 10 biases, norm3
    assert calls.n == len(model.patches)  # each patch applied once (resident by ComfyUI, streamed by Block Swap)
    assert torch.equal(out, ref)  # bit-identical to ComfyUI merging every layer itself
    assert ctl.lora.in_ring  # each block merged in its ring slot as the first forward reached it
    # the op class's shared default list was never appended to (it would patch every layer of the class)
    lin = model.model.diffusion_model.blocks[ctl.plan.streamed[0]].ffn[0]
    assert type(lin).weight_function == [] and lin.weight_function == []
    calls.n = 0
    assert torch.equal(sample_wan(model, steps=3), ref)  # a second run of the same patcher merges nothing
    assert calls.n == 0 and ctl.lora.is_current(model)
    mm.unload_all_models()


# fp8_scaled (the files users download) in CI; bf16 (quantized on load: the same merge and restore) in the slow tier
@pytest.mark.parametrize("source", [pytest.param("bf16", marks=pytest.mark.slow), "fp8_scaled"])
def test_unpatch_restores_bytes_and_strength_change_remerges(files: dict, source: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import comfy.model_management as mm

    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY

    digest = _sha(files[source])
    lora = wan_lora(files["sd"], style="lightx2v")
    base = _swapped(_load(files[source], "per_tensor"))
    ctl = base.attachments[SWAP_KEY]
    no_lora = sample_wan(base, steps=2)
    b = ctl.plan.streamed[0]
    before = _block_weights(base, b)
    calls = _CountCalculate(monkeypatch)
    strong = sample_wan(_with_lora(base, lora, 1.0), steps=2)
    first = calls.n
    merged = _block_weights(base, b)
    assert first > 0 and not _same_bytes(merged["ffn.0.weight"], before["ffn.0.weight"])
    weak_patcher = _with_lora(base, lora, 0.5)
    weak = sample_wan(weak_patcher, steps=2)
    assert calls.n == 2 * first and ctl.lora.is_current(weak_patcher)  # another strength: merged again, once
    assert _rel(weak, no_lora) < _rel(strong, no_lora)
    assert torch.equal(sample_wan(base, steps=2), no_lora)  # back to the plain clone: original weights
    after = _block_weights(base, b)
    assert all(_same_bytes(after[k], before[k]) for k in before)
    assert not ctl.lora.merged
    mm.unload_all_models()
    assert _sha(files[source]) == digest  # the checkpoint file is never written


def test_unload_of_a_file_backed_arena_does_not_read_the_file_back(files: dict,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle expert goes back to its file mapping: the merged arena is dropped without copying the file into it."""
    import comfy.model_management as mm

    from comfyui_lowvram_dit.offload.host_memory import file_backed_ranges, is_file_backed
    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY

    lora = wan_lora(files["sd"], style="lightx2v")
    base = _swapped(_load(files["fp8_scaled"], "per_tensor"))
    ctl = base.attachments[SWAP_KEY]
    no_lora = sample_wan(base, steps=2)
    b = ctl.plan.streamed[0]
    before = _block_weights(base, b)
    patched = _with_lora(base, lora)
    strong = sample_wan(patched, steps=2)
    assert ctl.lora.merged and ctl.streamer.drops_arena_on_release()
    maps = file_backed_ranges()
    read_from_file = []
    copy = torch.Tensor.copy_

    def watching(self: torch.Tensor, src: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(src, torch.Tensor) and src.device.type == "cpu" and is_file_backed(src, maps):
            read_from_file.append(tuple(src.shape))
        return copy(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", watching)
    mm.unload_all_models()
    monkeypatch.setattr(torch.Tensor, "copy_", copy)
    assert read_from_file == []  # the file-backed originals were rebound, not copied into the dying arena
    assert not ctl.lora.merged
    lin = base.model.diffusion_model.blocks[b].ffn[0]
    assert is_file_backed(lin.weight, file_backed_ranges())  # the idle block is the file mapping again
    after = _block_weights(base, b)
    assert all(_same_bytes(after[k], before[k]) for k in before)  # private copies (biases, norms) restored too
    assert torch.equal(sample_wan(patched, steps=2), strong)  # re-loaded: merged again from the original bytes
    assert torch.equal(sample_wan(base, steps=2), no_lora)
    mm.unload_all_models()


def test_merge_in_the_ring_under_inference_mode_equals_it_outside(files: dict) -> None:
    """ComfyUI runs a prompt under inference mode, so the arena is an inference tensor that the ring's write-back of
    the merged weights writes: same output as a load outside inference mode."""
    import comfy.model_management as mm

    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY

    lora = wan_lora(files["sd"], style="lightx2v")
    ref = sample_wan(_with_lora(_swapped(_load(files["fp8_scaled"], "per_tensor")), lora), steps=2)
    mm.unload_all_models()
    model = _with_lora(_swapped(_load(files["fp8_scaled"], "per_tensor")), lora)
    with torch.inference_mode():
        out = sample_wan(model, steps=2)
    ctl = model.attachments[SWAP_KEY]
    assert ctl.lora.in_ring and ctl.streamer.arena.buffer.is_inference()
    assert torch.equal(out, ref)
    mm.unload_all_models()


def test_a_merge_error_reaches_the_caller(files: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block whose merge fails fails the render with that error (no silent unmerged block)."""
    import comfy.model_management as mm

    from comfyui_lowvram_dit.host import lora_merge

    lora = wan_lora(files["sd"], style="lightx2v")
    model = _with_lora(_swapped(_load(files["fp8_scaled"], "per_tensor")), lora)
    merged = _plant_merge_failure(monkeypatch, "blocks.1.ffn.2.weight")
    with pytest.raises(TypeError, match="blocks.1.ffn.2.weight: planted merge failure"):
        sample_wan(model, steps=1)
    monkeypatch.setattr(lora_merge, "merged_weight", merged)
    mm.unload_all_models()


def _plant_merge_failure(monkeypatch: pytest.MonkeyPatch, suffix: str) -> Callable[..., torch.Tensor]:
    """Make Block Swap's merge of the weight whose key ends with ``suffix`` raise; returns the real merge."""
    from comfyui_lowvram_dit.host import lora_merge

    merged = lora_merge.merged_weight

    def failing(patcher: Any, key: str, device: torch.device, **kwargs: Any) -> torch.Tensor:
        if key.endswith(suffix):
            raise TypeError(f"{key}: planted merge failure")
        return merged(patcher, key, device, **kwargs)

    monkeypatch.setattr(lora_merge, "merged_weight", failing)
    return merged


def test_two_experts_filled_beside_their_first_forward_equal_the_fill_at_load(files: dict,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """What a GPU does at an expert switch (the arena's memory already final: it is copied beside the first forward,
    offload/arena_fill.py, which merges the LoRA in the ring), run on the CPU: two LoRA'd experts of one layout, twice
    each in turn, under inference mode as ComfyUI samples. Every render equals the one whose arena was filled at load,
    bit for bit; the second expert copies into the memory the first dropped; after each first forward the merge is
    complete and every streamed weight is the arena's. A load for reading the weights (``force_patch_weights``) fills
    and merges before it returns."""
    import comfy.model_management as mm

    from comfyui_lowvram_dit.host import block_swap
    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY

    d = files["fp8_scaled"].parent
    other = d / "wan_fp8_scaled_seed12.safetensors"
    synth.write_synthetic(MODEL, other, size="tiny", fmt="fp8_scaled", seed=12)
    lora = wan_lora(files["sd"], style="lightx2v")

    def experts() -> list[Any]:
        return [_with_lora(_swapped(_load(path, "per_tensor")), lora) for path in (files["fp8_scaled"], other)]

    refs = []
    for model in experts():
        refs.append(sample_wan(model, steps=2))
        mm.unload_all_models()
    assert not torch.equal(*refs)
    monkeypatch.setattr(block_swap, "fills_beside_forward", lambda device: True)
    models = experts()
    for render in range(2):
        for i, (model, ref) in enumerate(zip(models, refs)):
            with torch.inference_mode():
                assert torch.equal(sample_wan(model, steps=2), ref)
            ctl = model.attachments[SWAP_KEY]
            took = ctl.streamer.took
            assert took["background"] and took["reused"] == (render + i > 0)
            assert ctl.lora.is_current(model) and ctl.lora.in_ring
            assert all(ctl.streamer.arena.contains(model.model.diffusion_model.blocks[b].ffn[0].weight)
                       for b in ctl.plan.streamed)
            mm.unload_all_models()  # the expert goes idle: its arena's memory is offered to the other
    model = models[0]
    mm.load_models_gpu([model], force_patch_weights=True)
    ctl = model.attachments[SWAP_KEY]
    assert not ctl.streamer.took["background"] and ctl.lora.is_current(model)
    mm.unload_all_models()
    other.unlink()


def test_a_merge_error_beside_the_first_forward_fails_the_render_and_the_next_one_merges(
        files: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block whose merge fails while the arena fills beside the forward fails that render with the error; the
    unload after it does not raise, and the next render of the same model merges again and is right."""
    import comfy.model_management as mm

    from comfyui_lowvram_dit.host import block_swap, lora_merge

    lora = wan_lora(files["sd"], style="lightx2v")
    ref = sample_wan(_with_lora(_swapped(_load(files["fp8_scaled"], "per_tensor")), lora), steps=1)
    mm.unload_all_models()
    monkeypatch.setattr(block_swap, "fills_beside_forward", lambda device: True)
    model = _with_lora(_swapped(_load(files["fp8_scaled"], "per_tensor")), lora)
    merged = _plant_merge_failure(monkeypatch, "blocks.1.ffn.2.weight")
    with pytest.raises(TypeError, match="blocks.1.ffn.2.weight: planted merge failure"):
        sample_wan(model, steps=1)
    mm.unload_all_models()
    monkeypatch.setattr(lora_merge, "merged_weight", merged)
    assert torch.equal(sample_wan(model, steps=1), ref)
    mm.unload_all_models()


def test_a_merge_short_of_gpu_memory_in_the_ring_is_done_on_the_cpu(
        files: dict, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A weight whose merge in the ring runs out of memory (the merge's temporaries beside the forward's activations)
    is merged on the CPU from the slot's bytes, with one warning: same render."""
    import comfy.model_management as mm

    from comfyui_lowvram_dit.host import lora_merge

    lora = wan_lora(files["sd"], style="lightx2v")
    ref = sample_wan(_with_lora(_swapped(_load(files["fp8_scaled"], "per_tensor")), lora), steps=1)
    mm.unload_all_models()
    model = _with_lora(_swapped(_load(files["fp8_scaled"], "per_tensor")), lora)
    merged, devices = lora_merge.merged_weight, []  # the ring's device is the CPU here: the first try is planted

    def short_there(patcher: Any, key: str, device: torch.device, **kwargs: Any) -> torch.Tensor:
        if key.endswith("blocks.1.ffn.2.weight"):
            devices.append(device.type)
            if device.type == "cpu" and len(devices) == 1:
                raise torch.OutOfMemoryError("planted: no memory beside the forward")
        return merged(patcher, key, device, **kwargs)

    monkeypatch.setattr(lora_merge, "merged_weight", short_there)
    assert torch.equal(sample_wan(model, steps=1), ref)
    assert devices == ["cpu", "cpu"]
    assert "LoRA merge beside the forward at diffusion_model.blocks.1.ffn.2.weight" in caplog.text
    mm.unload_all_models()


def _native_fp8_merge(sd: dict, lora: dict, keys: list[str]) -> dict[str, torch.Tensor]:
    """ComfyUI's own fp8 path: UNETLoader weight_dtype fp8_e4m3fn (plain fp8 cast) + LoRA merged by ModelPatcher
    (stochastic rounding back to fp8)."""
    import comfy.sd

    native = comfy.sd.load_diffusion_model_state_dict(dict(sd), model_options={"dtype": torch.float8_e4m3fn})
    patched = _with_lora(native, lora)
    with torch.no_grad():  # as ComfyUI loads models
        for k in keys:
            patched.patch_weight_to_device(k)
    out = {k: patched.model.state_dict()[k].float() for k in keys}
    patched.unpatch_model()
    return out


@pytest.mark.parametrize("quantization", MODES)
def test_fp8_merge_error_is_not_above_native_fp8(files: dict, quantization: str) -> None:
    import comfy.lora
    import comfy.model_management as mm

    from comfyui_lowvram_dit.kernels import fp8 as fp8_math
    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY

    sd, lora = files["sd"], wan_lora(files["sd"])
    model = _with_lora(_swapped(_load(files["bf16"], quantization), blocks=1), lora)
    sample_wan(model, steps=1)  # CPU: resident blocks merged by ComfyUI at load, streamed ones by its first forward
    ctl = model.attachments[SWAP_KEY]
    keys = [k for k in model.patches if k.endswith(".weight") and model.model.state_dict()[k].dtype
            == torch.float8_e4m3fn]
    assert len(keys) == 20 and len(ctl.plan.streamed) == 1  # one block merged by ComfyUI, one by Block Swap
    msd = model.model.state_dict()
    native = _native_fp8_merge(sd, lora, keys)
    err = {"pack": 0.0, "native": 0.0, "ref": 0.0}
    for k in keys:
        bk = k[len("diffusion_model."):]
        ref = comfy.lora.calculate_weight(model.patches[k], sd[bk].float(), k)  # the bf16 weights' merge, fp32
        scale = msd[k + "_scale"]
        pack = fp8_math.dequantize(msd[k], scale, None if scale.ndim == 0 else 128, torch.float32)
        err["pack"] += (pack - ref).pow(2).sum().item()
        err["native"] += (native[k] - ref).pow(2).sum().item()
        err["ref"] += ref.pow(2).sum().item()
    pack_err, native_err = (err["pack"] / err["ref"]) ** 0.5, (err["native"] / err["ref"]) ** 0.5
    print(f"\n{quantization} + LoRA vs the bf16 merge: pack {pack_err:.5f}, native fp8_e4m3fn {native_err:.5f}")
    assert pack_err <= native_err
    mm.unload_all_models()


def qwen_lora(sd: dict[str, torch.Tensor], rank: int = 8, ratio: float = 0.1) -> dict[str, torch.Tensor]:
    """Qwen-Image-Lightning-style LoRA (diffusers names, ComfyUI's Qwen-Image direct mapping) on block Linears."""
    g = torch.Generator().manual_seed(3)
    out = {}
    for k, v in sd.items():
        if k.startswith("transformer_blocks.") and k.endswith(".weight") and v.ndim == 2:
            up, down = torch.randn(v.shape[0], rank, generator=g), torch.randn(rank, v.shape[1], generator=g)
            c = (ratio * v.float().norm() / (up @ down).norm()).sqrt()
            out[f"{k[: -len('.weight')]}.lora_B.weight"] = (up * c).bfloat16()
            out[f"{k[: -len('.weight')]}.lora_A.weight"] = (down * c).bfloat16()
    return out


def test_qwen_image_streamed_blocks_hold_comfyui_merge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    comfyui_in_process_or_skip()
    import comfy.model_management as mm
    from safetensors.torch import load_file

    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY
    from comfyui_lowvram_dit.host.qwen_stages import load_transformer

    path = tmp_path / "qwen_bf16.safetensors"
    synth.write_synthetic("qwen_image", path, "tiny", "bf16", seed=3)
    lora = qwen_lora(load_file(str(path)))
    resident = _with_lora(load_transformer(path, "per_tensor", 128, "auto"), lora)
    assert len(resident.patches) == len(lora) // 2
    mm.load_models_gpu([resident])
    ref = {k: v.clone() for k, v in resident.model.state_dict().items()}
    mm.unload_all_models()
    model = _with_lora(_swapped(load_transformer(path, "per_tensor", 128, "auto"), blocks=1), lora)
    calls = _CountCalculate(monkeypatch)
    mm.load_models_gpu([model], force_patch_weights=True)  # as a save node reads them: merged before it returns
    ctl = model.attachments[SWAP_KEY]
    assert calls.n == len(model.patches) and ctl.lora.merged and ctl.plan.streamed
    got = model.model.state_dict()
    assert all(_same_bytes(got[k], ref[k]) for k in model.patches)
    mm.unload_all_models()


class _LinearCalls:
    """Per fp8 Linear of ``patcher``: what each call did (per-call patch/cast state, fp8 path and weight layout)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, patcher: Any) -> None:
        from comfyui_lowvram_dit.kernels import opaque_ops
        from comfyui_lowvram_dit.host.fp8_ops import LowVramFp8Ops

        self.calls: dict[str, set[tuple]] = {}
        names = {id(m): n for n, m in patcher.model.named_modules()}
        linear, fp8_linear, current = LowVramFp8Ops.Linear, opaque_ops.fp8_linear, [""]
        forward, cast_forward = linear.forward, linear.forward_comfy_cast_weights

        def spy_forward(mod: Any, x: torch.Tensor, *a: Any, **k: Any) -> Any:
            current[0] = names[id(mod)]
            self._add(("on input device", mod.weight.device == x.device, "functions", len(mod.weight_function),
                       len(mod.bias_function), "lowvram", hasattr(mod, "prev_comfy_cast_weights")))
            return forward(mod, x, *a, **k)

        def spy_cast(mod: Any, x: torch.Tensor) -> Any:
            self._add(("per-call cast",))
            return cast_forward(mod, x)

        def spy_fp8(x: Any, w: torch.Tensor, s: torch.Tensor, b: Any, block_size: Any, path: str) -> Any:
            self._add(("fp8", path, block_size, w.dtype, tuple(w.shape), tuple(s.shape), s.dtype))
            return fp8_linear(x, w, s, b, block_size, path)

        self._current = current
        monkeypatch.setattr(linear, "forward", spy_forward)
        monkeypatch.setattr(linear, "forward_comfy_cast_weights", spy_cast)
        monkeypatch.setattr(opaque_ops, "fp8_linear", spy_fp8)

    def _add(self, what: tuple) -> None:
        self.calls.setdefault(self._current[0], set()).add(what)


def _offer_exactly_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """ComfyUI offers (as on a GPU) exactly the VRAM Block Swap's plan needs: no slack for its offload reserve."""
    import comfy.model_management as mm

    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY

    model_load = mm.LoadedModel.model_load

    def tight(self: Any, lowvram_model_memory: float = 0, force_patch_weights: bool = False) -> Any:
        ctl = self.model.attachments[SWAP_KEY]
        return model_load(self, ctl.gpu_bytes(ctl.make_plan(None)), force_patch_weights)

    monkeypatch.setattr(mm.LoadedModel, "model_load", tight)


def test_qwen_image_lora_adds_no_per_call_work_on_streamed_or_resident_layers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain fp8 Qwen-Image (kept as stored, scale 1) under a budget that fits the plan exactly: with a merged LoRA
    every resident and streamed fp8 Linear takes the same fp8 path on its own device as without one, with no per-call
    patch or cast, and each LoRA patch is applied exactly once (ComfyUI's offload reserve, larger for patched
    weights, left resident layers on the CPU with a per-call LowVramPatch)."""
    comfyui_in_process_or_skip()
    import comfy.model_management as mm
    import comfy.sample
    from comfy_extras.nodes_model_advanced import ModelSamplingAuraFlow
    from safetensors.torch import load_file

    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY
    from comfyui_lowvram_dit.host.qwen_stages import load_transformer

    path = tmp_path / "qwen_image_fp8_e4m3fn.safetensors"
    synth.write_synthetic("qwen_image", path, "tiny", "fp8", seed=3, num_layers=4)
    lora = qwen_lora(load_file(str(path)))
    _offer_exactly_the_plan(monkeypatch)
    seen = {}
    for with_lora in (False, True):
        model = _swapped(load_transformer(path, "per_tensor", 128, "auto"), blocks=2)
        model.model.manual_cast_dtype = torch.bfloat16  # what a GPU gets: every fp8 weight costs a bf16 cast
        if with_lora:
            model = _with_lora(model, lora)
        model = ModelSamplingAuraFlow().patch_aura(model, 3.1)[0]
        g = torch.Generator().manual_seed(0)
        latent = torch.zeros(1, 16, 1, 8, 8)
        cond = [[torch.randn(1, 7, 128, generator=g), {}]]
        with pytest.MonkeyPatch.context() as spies:
            spy, calculated = _LinearCalls(spies, model), _CountCalculate(spies)
            comfy.sample.sample(model, torch.randn(latent.shape, generator=g), 2, 1.0, "euler", "simple", cond, cond,
                                latent, seed=0, disable_pbar=True)
        ctl = model.attachments[SWAP_KEY]
        assert ctl.plan.streamed and not model.model.model_lowvram, "the plan fits: nothing may load partially"
        assert calculated.n == len(model.patches) == (len(lora) // 2 if with_lora else 0)
        seen[with_lora], streamed = spy.calls, [f"diffusion_model.transformer_blocks.{i}." for i in ctl.plan.streamed]
        mm.unload_all_models()
    assert seen[True] == seen[False]
    assert any(n.startswith(tuple(streamed)) for n in seen[True]) and len(seen[True]) > 4 * 14
    for name, calls in seen[True].items():
        assert ("per-call cast",) not in calls, name
        assert ("on input device", True, "functions", 0, 0, "lowvram", False) in calls and len(calls) == 2, (name, calls)
