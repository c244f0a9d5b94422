"""Wan checkpoints: format detection, streaming fp8 quantization, our saved format, conversions, errors.

Tiny Wan files (real key names, dim 256, 2 blocks) come from tools.synth; the ComfyUI / musubi-tuner
fp8 variants are built here the way those tools write them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from comfyui_lowvram_dit.kernels import fp8
from comfyui_lowvram_dit.synthetic import checkpoints as synth
from comfyui_lowvram_dit.checkpoints import wan as wc
from comfyui_lowvram_dit.checkpoints.safetensors_io import CheckpointError

MODEL = "wan22_t2v_14B"


@pytest.fixture(scope="module")
def bf16_sd() -> dict[str, torch.Tensor]:
    return synth.synthetic_state_dict(MODEL, size="tiny", fmt="bf16", seed=3)


def _save(path: Path, sd: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path), metadata=metadata)
    return path


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _linear_keys(sd: dict[str, torch.Tensor]) -> list[str]:
    return [k for k, v in sd.items() if wc.is_fp8_target(k, tuple(v.shape))]


def _comfy_quant_sd(bf16_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI v0.8 layout: <layer>.weight fp8 + <layer>.weight_scale + <layer>.comfy_quant JSON bytes."""
    out = dict(bf16_sd)
    conf = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)
    for k in _linear_keys(bf16_sd):
        q, s = fp8.quantize_per_tensor(bf16_sd[k])
        out[k], out[k[:-6] + "weight_scale"], out[k[:-6] + "comfy_quant"] = q, s, conf.clone()
    return out


def _musubi_sd(bf16_sd: dict[str, torch.Tensor], mode: str, block: int = 64, two_level: bool = True) -> dict:
    """musubi-tuner fp8_optimization_utils.quantize_weight: scale_weight [1]/[N,1]/[N,K/bs,1] (+ tensor scale)."""
    out = dict(bf16_sd)
    for k in _linear_keys(bf16_sd):
        w = bf16_sd[k].float()
        n, kk = w.shape
        if mode == "tensor":
            scale, ts = (w.abs().max() / 448.0).clamp(min=1e-8), None
            q = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        elif mode == "channel":
            scale, ts = (w.abs().amax(1, keepdim=True) / 448.0).clamp(min=1e-8), None
            q = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        else:
            wb = w.view(n, kk // block, block)
            total = (wb.abs().amax(2, keepdim=True) / 448.0).clamp(min=1e-8)
            q = (wb / total).clamp(-448, 448).to(torch.float8_e4m3fn).view(n, kk)
            if two_level:
                ts = total.max()
                scale = (total / ts).clamp(min=1e-8)
            else:  # older musubi: total block scale stored in the model dtype, no tensor scale
                scale, ts = total.to(torch.bfloat16), None
        out[k], out[k[:-6] + "scale_weight"] = q, scale
        if ts is not None:
            out[k[:-6] + "scale_weight_tensor"] = ts.reshape(1)
    return out


# ---------------------------------------------------------------------------------------------------------
# detection


@pytest.mark.parametrize(
    ("kind", "expected_format", "expected_mode"),
    [
        ("bf16", "high_precision", "none"),
        ("fp16", "high_precision", "none"),
        ("fp32", "high_precision", "none"),
        ("fp8", "fp8_plain", "per_tensor"),
        ("fp8_scaled", "comfy_fp8_scaled", "per_tensor"),
        ("comfy_quant", "comfy_quant", "per_tensor"),
        ("comfy_quant_metadata", "comfy_quant", "per_tensor"),
        ("musubi_block", "musubi_fp8", "blockwise"),
        ("musubi_channel", "musubi_fp8", "blockwise"),
        ("musubi_tensor", "musubi_fp8", "per_tensor"),
        ("prefixed", "high_precision", "none"),
    ],
)
def test_detects_each_input_kind(tmp_path: Path, bf16_sd: dict, kind: str, expected_format: str, expected_mode: str) -> None:
    path = tmp_path / f"{kind}.safetensors"
    meta = None
    if kind in ("bf16", "fp16", "fp8", "fp8_scaled"):
        synth.write_synthetic(MODEL, path, size="tiny", fmt=kind, seed=3)
    elif kind == "fp32":
        _save(path, {k: v.float() for k, v in bf16_sd.items()})
    elif kind == "comfy_quant":
        _save(path, _comfy_quant_sd(bf16_sd))
    elif kind == "comfy_quant_metadata":
        sd = {k: v for k, v in _comfy_quant_sd(bf16_sd).items() if not k.endswith(".comfy_quant")}
        layers = {k[:-7]: {"format": "float8_e4m3fn"} for k in _linear_keys(bf16_sd)}
        meta = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}
        _save(path, sd, meta)
    elif kind.startswith("musubi"):
        _save(path, _musubi_sd(bf16_sd, kind.split("_")[1]))
    elif kind == "prefixed":
        _save(path, {f"model.diffusion_model.{k}": v for k, v in bf16_sd.items()})
    info = wc.inspect_checkpoint(path)
    assert (info.format, info.mode) == (expected_format, expected_mode)
    assert (info.dim, info.ffn_dim, info.num_layers, info.in_dim, info.out_dim) == (256, 512, 2, 16, 16)
    assert info.prefix == ("model.diffusion_model." if kind == "prefixed" else "")
    loaded = wc.load_wan_state_dict(path, "blockwise", 128)
    assert all(not k.startswith("model.") for k in loaded.state_dict)
    assert not any(k.endswith((".scale_weight", ".comfy_quant", ".scale_input", "scaled_fp8")) for k in loaded.state_dict)


def test_real_model_variants_are_named() -> None:
    assert "TI2V 5B" in wc._variant(3072, 48, 48, False, 30)
    assert "I2V A14B" in wc._variant(5120, 36, 16, False, 40)
    assert "2.1 I2V" in wc._variant(5120, 36, 16, True, 40)


# ---------------------------------------------------------------------------------------------------------
# the streaming quantizer and the high-precision policy


@pytest.mark.parametrize(("mode", "block"), [("per_tensor", 128), ("blockwise", 128), ("blockwise", 64)])
def test_streaming_quantization_equals_in_memory(tmp_path: Path, bf16_sd: dict, mode: str, block: int) -> None:
    path = _save(tmp_path / "m.safetensors", bf16_sd)
    seen: list[tuple[int, int]] = []
    streamed = wc.load_wan_state_dict(path, mode, block, progress=lambda d, t: seen.append((d, t)))
    in_memory = wc.quantize_state_dict(bf16_sd, mode, block)
    assert set(streamed.state_dict) == set(in_memory)
    assert all(_same(streamed.state_dict[k], in_memory[k]) for k in in_memory)
    assert streamed.quantized_here and streamed.mode == mode
    assert streamed.block_size == (block if mode == "blockwise" else None)
    assert seen and seen[-1][0] == seen[-1][1] == path.stat().st_size - wc.read_header(path).data_offset


def test_only_block_linear_weights_become_fp8(bf16_sd: dict) -> None:
    q = wc.quantize_state_dict(bf16_sd, "blockwise", 128)
    fp8_keys = {k for k, v in q.items() if v.dtype == torch.float8_e4m3fn}
    # 2 blocks x (self q,k,v,o + cross q,k,v,o + ffn.0 + ffn.2)
    assert len(fp8_keys) == 20 and all(k.startswith("blocks.") for k in fp8_keys)
    for keep in ("text_embedding.0.weight", "time_embedding.0.weight", "time_projection.1.weight", "head.head.weight",
                 "patch_embedding.weight", "blocks.0.modulation", "head.modulation", "blocks.0.norm3.weight",
                 "blocks.0.self_attn.norm_q.weight", "blocks.1.cross_attn.norm_k.weight"):
        assert _same(q[keep], bf16_sd[keep]), keep
    s = q["blocks.0.ffn.0.weight_scale"]
    assert s.dtype == torch.float32 and tuple(s.shape) == (4, 2)  # ffn.0 is [512, 256] -> [512/128, 256/128]
    assert q["blocks.0.ffn.0.weight_scale"].shape == fp8.blockwise_scale_shape(512, 256, 128)
    assert wc.quantize_state_dict(bf16_sd, "per_tensor")["blocks.1.ffn.2.weight_scale"].shape == ()


# ---------------------------------------------------------------------------------------------------------
# conversion of other tools' fp8 files


def _dequant(sd: dict, key: str, block: int | None) -> torch.Tensor:
    return fp8.dequantize(sd[key], sd[key[:-6] + "weight_scale"], block, torch.float32)


def test_comfy_legacy_fp8_scaled_keeps_codes_and_scales(tmp_path: Path) -> None:
    path = synth.write_synthetic(MODEL, tmp_path / "s.safetensors", size="tiny", fmt="fp8_scaled", seed=3)
    raw = synth.synthetic_state_dict(MODEL, size="tiny", fmt="fp8_scaled", seed=3)
    loaded = wc.load_wan_state_dict(path, "blockwise", 128)  # already per-tensor fp8: kept as is
    assert loaded.mode == "per_tensor" and loaded.block_size is None and not loaded.quantized_here
    for k in (k for k in raw if k.endswith(".scale_weight")):
        layer = k[: -len("scale_weight")]
        assert _same(loaded.state_dict[layer + "weight"], raw[layer + "weight"])
        assert torch.equal(loaded.state_dict[layer + "weight_scale"], raw[k].float().reshape(()))
    assert "scaled_fp8" not in loaded.state_dict


@pytest.mark.parametrize("metadata_form", [False, True])
def test_comfy_quant_files_keep_codes_and_scales(tmp_path: Path, bf16_sd: dict, metadata_form: bool) -> None:
    sd = _comfy_quant_sd(bf16_sd)
    meta = None
    if metadata_form:
        layers = {k[:-7]: {"format": "float8_e4m3fn"} for k in _linear_keys(bf16_sd)}
        meta = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}
        sd = {k: v for k, v in sd.items() if not k.endswith(".comfy_quant")}
    loaded = wc.load_wan_state_dict(_save(tmp_path / "q.safetensors", sd, meta), "per_tensor")
    for k in _linear_keys(bf16_sd):
        assert _same(loaded.state_dict[k], sd[k])
        assert torch.equal(loaded.state_dict[k[:-6] + "weight_scale"], sd[k[:-6] + "weight_scale"])


def test_comfy_quant_file_with_another_layout_is_read_as_stored(tmp_path: Path, bf16_sd: dict) -> None:
    """A layer in a layout other than fp8 (here nvfp4, packed to half width) makes the file ComfyUI's to build:
    every tensor as stored, each layer's config kept, nothing quantized or re-scaled."""
    sd = _comfy_quant_sd(bf16_sd)
    n, k = sd["blocks.0.ffn.0.weight"].shape
    sd["blocks.0.ffn.0.weight"] = torch.zeros(n, k // 2, dtype=torch.uint8)
    sd["blocks.0.ffn.0.weight_scale"] = torch.ones(n, k // 16).to(torch.float8_e4m3fn)
    sd["blocks.0.ffn.0.weight_scale_2"] = torch.tensor(0.5)
    sd["blocks.0.ffn.0.comfy_quant"] = torch.tensor(list(b'{"format": "nvfp4"}'), dtype=torch.uint8)
    loaded = wc.load_wan_state_dict(_save(tmp_path / "nv.safetensors", sd), "per_tensor")
    assert loaded.info.format == "core_quant" and loaded.fp8_layers == 0 and not loaded.quantized_here
    assert sorted(loaded.state_dict) == sorted(sd)
    assert all(_same(loaded.state_dict[key], v) for key, v in sd.items())


def test_comfy_quant_other_layout_with_nan_scale_is_refused(tmp_path: Path, bf16_sd: dict) -> None:
    sd = _comfy_quant_sd(bf16_sd)
    sd["blocks.0.ffn.0.weight"] = sd["blocks.0.ffn.0.weight"].view(torch.int8)
    sd["blocks.0.ffn.0.weight_scale"] = torch.tensor(float("nan"))
    sd["blocks.0.ffn.0.comfy_quant"] = torch.tensor(list(b'{"format": "int8_tensorwise"}'), dtype=torch.uint8)
    with pytest.raises(CheckpointError, match=r"bad\.safetensors.*blocks\.0\.ffn\.0\.weight_scale.*NaN"):
        wc.load_wan_state_dict(_save(tmp_path / "bad.safetensors", sd), "per_tensor")


def test_plain_fp8_cast_gets_unit_scales(tmp_path: Path) -> None:
    path = synth.write_synthetic(MODEL, tmp_path / "p.safetensors", size="tiny", fmt="fp8", seed=3)
    loaded = wc.load_wan_state_dict(path, "none")
    assert loaded.mode == "per_tensor"
    assert torch.equal(loaded.state_dict["blocks.0.ffn.0.weight_scale"], torch.ones(()))


@pytest.mark.parametrize(("mode", "two_level"), [("block", True), ("block", False), ("channel", True), ("tensor", True)])
def test_musubi_files_convert_to_our_layout(tmp_path: Path, bf16_sd: dict, mode: str, two_level: bool) -> None:
    sd = _musubi_sd(bf16_sd, mode, two_level=two_level)
    loaded = wc.load_wan_state_dict(_save(tmp_path / "mu.safetensors", sd), "none", 128)
    key = "blocks.1.ffn.2.weight"
    if mode == "tensor":  # one scale per weight: taken over exactly
        assert loaded.mode == "per_tensor" and _same(loaded.state_dict[key], sd[key])
        got = _dequant(loaded.state_dict, key, None)
    else:  # 1x64 groups / channels have no fp8 GEMM: re-quantized to 128x128 blocks ("none" -> block-wise)
        assert loaded.mode == "blockwise" and loaded.block_size == 128
        got = _dequant(loaded.state_dict, key, 128)
    ref = bf16_sd[key].float()
    assert ((got - ref).norm() / ref.norm()).item() < 0.06  # fp8 e4m3 twice: ~2 x 2.6 % worst case
    assert not any(k.endswith(("scale_weight", "scale_weight_tensor")) for k in loaded.state_dict)


# ---------------------------------------------------------------------------------------------------------
# our saved format and its automatic pick-up


def test_save_load_round_trip_and_auto_pickup(tmp_path: Path, bf16_sd: dict) -> None:
    src = _save(tmp_path / "wan_expert.safetensors", bf16_sd)
    first = wc.load_wan_state_dict(src, "blockwise", 64)
    assert wc.find_quantized(src, "blockwise", 64) is None
    dest = wc.quantized_path_for(src, "blockwise", 64)
    assert dest.parent == src.parent and "blockwise-bs64" in dest.name
    wc.save_quantized(first, dest, src)
    meta = wc.read_header(dest).metadata
    assert meta[wc.META_FORMAT] == wc.FORMAT_TAG and meta[wc.META_MODE] == "blockwise" and meta[wc.META_BLOCK] == "64"
    assert meta[wc.META_SOURCE] == wc.source_fingerprint(src) and meta[wc.META_SOURCE_NAME] == src.name
    assert wc.find_quantized(src, "blockwise", 64) == dest
    assert wc.find_quantized(src, "blockwise", 128) is None and wc.find_quantized(src, "per_tensor") is None
    again = wc.load_wan_state_dict(dest, "blockwise", 64)
    assert again.info.format == "lowvram_fp8" and again.mode == "blockwise" and again.block_size == 64
    assert not again.quantized_here
    assert set(again.state_dict) == set(first.state_dict)
    assert all(_same(again.state_dict[k], first.state_dict[k]) for k in first.state_dict)
    # A changed source invalidates the saved copy.
    changed = dict(bf16_sd)
    changed["blocks.0.ffn.0.weight"] = bf16_sd["blocks.0.ffn.0.weight"] * 2
    _save(src, changed)
    assert wc.find_quantized(src, "blockwise", 64) is None


def test_per_tensor_save_round_trip(tmp_path: Path, bf16_sd: dict) -> None:
    src = _save(tmp_path / "w.safetensors", bf16_sd)
    first = wc.load_wan_state_dict(src, "per_tensor")
    dest = wc.save_quantized(first, wc.quantized_path_for(src, "per_tensor"), src)
    assert wc.find_quantized(src, "per_tensor") == dest
    again = wc.load_wan_state_dict(dest, "blockwise")  # saved mode wins over the option
    assert again.mode == "per_tensor" and again.notes
    assert all(_same(again.state_dict[k], first.state_dict[k]) for k in first.state_dict)


def test_fingerprint_sees_data_changes(tmp_path: Path, bf16_sd: dict) -> None:
    path = _save(tmp_path / "f.safetensors", bf16_sd)
    before = wc.source_fingerprint(path)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert wc.source_fingerprint(path) != before


# ---------------------------------------------------------------------------------------------------------
# errors name the file and what was expected


def test_non_wan_file_is_refused(tmp_path: Path) -> None:
    sd = {"transformer_blocks.0.attn.to_q.weight": torch.zeros(64, 64), "txt_norm.weight": torch.zeros(64)}
    with pytest.raises(CheckpointError, match=r"qwen\.safetensors: not a Wan 2\.1/2\.2.*head\.modulation.*Qwen-Image"):
        wc.load_wan_state_dict(_save(tmp_path / "qwen.safetensors", sd), "per_tensor")


def test_truncated_file_is_refused(tmp_path: Path, bf16_sd: dict) -> None:
    path = _save(tmp_path / "cut.safetensors", bf16_sd)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"cut\.safetensors: truncated"):
        wc.load_wan_state_dict(path, "blockwise")


def test_shape_mismatch_is_refused(tmp_path: Path, bf16_sd: dict) -> None:
    sd = dict(bf16_sd)
    sd["blocks.1.ffn.2.weight"] = torch.zeros(256, 500, dtype=torch.bfloat16)
    with pytest.raises(CheckpointError, match=r"bad\.safetensors: tensor 'blocks\.1\.ffn\.2\.weight' has shape \[256, 500\], expected \[256, 512\]"):
        wc.inspect_checkpoint(_save(tmp_path / "bad.safetensors", sd))


def test_incomplete_block_is_refused(tmp_path: Path, bf16_sd: dict) -> None:
    sd = {k: v for k, v in bf16_sd.items() if k != "blocks.1.cross_attn.o.weight"}
    with pytest.raises(CheckpointError, match=r"gap\.safetensors: Wan block 1 is incomplete.*cross_attn\.o\.weight"):
        wc.inspect_checkpoint(_save(tmp_path / "gap.safetensors", sd))


def test_saved_file_with_wrong_block_scale_is_refused(tmp_path: Path, bf16_sd: dict) -> None:
    src = _save(tmp_path / "x.safetensors", bf16_sd)
    loaded = wc.load_wan_state_dict(src, "blockwise", 128)
    loaded.state_dict["blocks.0.ffn.0.weight_scale"] = torch.ones(2, 2)
    dest = wc.save_quantized(loaded, tmp_path / "x.lowvram-fp8-blockwise-bs128.safetensors", src)
    with pytest.raises(CheckpointError, match=r"blockwise-bs128\.safetensors: blocks\.0\.ffn\.0\.weight_scale has shape \[2, 2\], expected \[4, 2\]"):
        wc.load_wan_state_dict(dest, "blockwise", 128)


@pytest.mark.parametrize("fmt", ["fp8_scaled", "fp8"])
def test_mmap_load_equals_a_copying_load_and_stays_file_backed(tmp_path: Path, fmt: str) -> None:
    """Pre-quantized files map their fp8 weights (the idle-expert RSS design); values equal a normal read."""
    from comfyui_lowvram_dit.offload.host_memory import is_file_backed

    path = synth.write_synthetic(MODEL, tmp_path / "s.safetensors", size="tiny", fmt=fmt, seed=3)
    copied = wc.load_wan_state_dict(path, "per_tensor")
    mapped = wc.load_wan_state_dict(path, "per_tensor", mmap=True)
    assert copied.state_dict.keys() == mapped.state_dict.keys() and copied.mode == mapped.mode
    for k, v in copied.state_dict.items():
        m = mapped.state_dict[k]
        assert m.dtype == v.dtype and torch.equal(m.float(), v.float()), k
    w = mapped.state_dict["blocks.0.ffn.0.weight"]
    assert w.dtype == torch.float8_e4m3fn and is_file_backed(w)
    assert not is_file_backed(copied.state_dict["blocks.0.ffn.0.weight"])


def test_mmap_is_ignored_when_quantizing_on_load(tmp_path: Path) -> None:
    from comfyui_lowvram_dit.offload.host_memory import is_file_backed

    path = synth.write_synthetic(MODEL, tmp_path / "b.safetensors", size="tiny", fmt="bf16", seed=3)
    loaded = wc.load_wan_state_dict(path, "per_tensor", mmap=True)
    assert loaded.quantized_here and not is_file_backed(loaded.state_dict["blocks.0.ffn.0.weight"])
