"""Synthetic checkpoints: layouts against the measured manifests, values, formats, streaming, CLI (CPU, fast)."""

from __future__ import annotations

import json
import re
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from comfyui_lowvram_dit.synthetic import gguf_checkpoints as gguf_synth
from comfyui_lowvram_dit.synthetic import specs as model_specs, checkpoints as synth
from comfyui_lowvram_dit.checkpoints.safetensors_io import iter_tensors, read_header
from comfyui_lowvram_dit.synthetic.tiny import tiny_text_encoder_config
from comfyui_lowvram_dit.synthetic.specs import MODEL_FOLDER, MODELS, is_linear_weight, model_spec

SHAPES = Path(__file__).parents[1] / "shapes"
DITS = [m for m in MODELS if m.startswith("wan2") and MODEL_FOLDER[m] == "diffusion_models"] + ["qwen_image"]
WAN_DITS = [m for m in DITS if m.startswith("wan")]
BLOCK_RE = re.compile(r"^(blocks|transformer_blocks)\.(\d+)\.")


def _manifest(model: str) -> list[tuple[str, tuple[int, ...], str]]:
    data = json.loads((SHAPES / f"{model}.json").read_text())
    return [(name, tuple(shape), dtype) for name, (shape, dtype) in data.items()]


@pytest.mark.parametrize("model", MODELS)
def test_full_spec_equals_manifest(model: str) -> None:
    """Code-generated layout == layout measured from ComfyUI's modules: names, order, shapes, dtypes."""
    got = [(n, s, str(d).removeprefix("torch.")) for n, s, d in model_spec(model, "full")]
    assert got == _manifest(model)


def test_linear_weight_counts_match_real_fp8_files() -> None:
    """Quantized-layer counts of the Comfy-Org fp8_scaled releases (model-facts section 4.1)."""
    counts = {m: sum(is_linear_weight(m, n, s) for n, s, _ in model_spec(m)) for m in MODELS}
    assert counts["wan22_t2v_14B"] == counts["wan22_i2v_14B"] == 406
    assert counts["umt5_xxl_enc"] == 168 and counts["qwen25_vl_7b"] == 358 and counts["qwen_image"] == 846
    assert counts["wan21_vae"] == counts["wan22_vae"] == counts["wan21_tae"] == counts["wan22_tae"] == 0
    assert len(synth.file_layout("wan22_i2v_14B", "full", "fp8_scaled")) == 1908  # 1095 + 2 x 406 + marker
    assert len(synth.file_layout("umt5_xxl_enc", "full", "fp8_scaled")) == 412  # 242 + 168 + marker + spiece


def _pattern(name: str) -> str:
    return BLOCK_RE.sub(r"\1.N.", name)


@pytest.mark.parametrize("model", DITS)
def test_tiny_dit_keeps_key_patterns(model: str) -> None:
    full, tiny = model_spec(model, "full"), model_spec(model, "tiny")
    assert {_pattern(n) for n, _, _ in tiny} == {_pattern(n) for n, _, _ in full}
    blocks = {int(m.group(2)) for n, _, _ in tiny if (m := BLOCK_RE.match(n))}
    assert blocks == set(range(len(blocks))) and 1 <= len(blocks) < 5
    assert {d for _, _, d in tiny} == {d for _, _, d in full}
    assert model_specs.spec_nbytes(tiny) < model_specs.spec_nbytes(full) / 20


@pytest.mark.parametrize("model", WAN_DITS)
def test_tiny_wan_respects_comfyui_detection(model: str) -> None:
    """ComfyUI: num_heads = dim // 128, text_dim 4096 and freq_dim 256 fixed, in/out channels from weights."""
    full, tiny = dict((n, s) for n, s, _ in model_spec(model)), dict((n, s) for n, s, _ in model_spec(model, "tiny"))
    dim = tiny["head.modulation"][-1]
    assert dim % 128 == 0 and dim < full["head.modulation"][-1]
    assert tiny["text_embedding.0.weight"][1] == 4096 and tiny["time_embedding.0.weight"][1] == 256
    assert tiny["patch_embedding.weight"][1:] == full["patch_embedding.weight"][1:]
    assert tiny["head.head.weight"][0] == full["head.head.weight"][0]
    assert ("img_emb.proj.0.bias" in tiny) == (model == "wan21_i2v_14B")


def test_tiny_sizes_fixed_by_comfyui() -> None:
    """Where ComfyUI hard-codes the architecture, tiny == full; Qwen-Image (widths read by the staged loader) is
    narrow: 2 heads of 128, joint dim = the runner's tiny Qwen2.5-VL hidden size."""
    for model in ("umt5_xxl_enc", "qwen25_vl_7b", "wan22_vae", "wan21_tae", "wan22_tae"):
        assert model_spec(model, "tiny") == model_spec(model, "full")
    tiny = dict((n, s) for n, s, _ in model_spec("qwen_image", "tiny"))
    joint = tiny_text_encoder_config("qwen25_vl_7b").hidden
    assert tiny["img_in.weight"] == (256, 64) and tiny["txt_in.weight"] == (256, joint)
    assert tiny["transformer_blocks.0.attn.norm_q.weight"] == (128,) and tiny["proj_out.weight"] == (64, 256)
    vae_full, vae_tiny = model_spec("wan21_vae"), model_spec("wan21_vae", "tiny")
    assert [n for n, _, _ in vae_full] == [n for n, _, _ in vae_tiny]
    assert dict((n, s) for n, s, _ in vae_tiny)["decoder.head.0.gamma"] == (16, 1, 1, 1)
    assert model_specs.spec_nbytes(vae_tiny) < 20e6


def test_num_layers_override() -> None:
    spec = model_spec("wan22_t2v_14B", "full", num_layers=2)
    assert sum(n.endswith(".modulation") and n.startswith("blocks.") for n, _, _ in spec) == 2
    assert dict((n, s) for n, s, _ in spec)["blocks.1.ffn.0.weight"] == (13824, 5120)
    with pytest.raises(ValueError, match="num_layers"):
        model_spec("umt5_xxl_enc", num_layers=2)
    with pytest.raises(ValueError, match="unknown model"):
        model_spec("wan3")


def test_values_deterministic_and_name_dependent() -> None:
    a = synth.synthetic_tensor("blocks.0.self_attn.q.weight", (256, 256), torch.bfloat16, seed=3)
    b = synth.synthetic_tensor("blocks.0.self_attn.q.weight", (256, 256), torch.bfloat16, seed=3)
    c = synth.synthetic_tensor("blocks.0.self_attn.k.weight", (256, 256), torch.bfloat16, seed=3)
    d = synth.synthetic_tensor("blocks.0.self_attn.q.weight", (256, 256), torch.bfloat16, seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, d)
    # the state dict (any order, with other tensors around it) holds the same values
    sd = synth.synthetic_state_dict("wan22_t2v_14B", "tiny", seed=3)
    assert torch.equal(sd["blocks.0.self_attn.q.weight"], a)


def test_chunking_and_threads_do_not_change_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(synth, "CHUNK_ELEMS", 1000)  # 300 rows of 1000 -> many chunks
    serial = synth.synthetic_tensor("ffn.0.weight", (300, 1000), torch.float32, seed=1)
    with ThreadPoolExecutor(3) as pool:
        threaded = synth.synthetic_tensor("ffn.0.weight", (300, 1000), torch.float32, seed=1, pool=pool)
    assert torch.equal(serial, threaded)


def test_value_statistics_and_outlier_channels() -> None:
    shape = (1024, 2048)
    w = synth.synthetic_tensor("blocks.3.ffn.2.weight", shape, torch.float32, seed=0)
    idx, mult = synth.outlier_channels("blocks.3.ffn.2.weight", shape, seed=0)
    assert len(idx) == 4 and bool((mult >= 8).all())  # 2048 // 512 outlier input channels
    col_amax = w.abs().amax(dim=0)
    normal = torch.ones(shape[1], dtype=torch.bool)
    normal[idx] = False
    assert col_amax[idx].min() > 3 * col_amax[normal].max()
    assert abs(w[:, normal].std().item() - 0.02) < 0.001 and abs(w.mean().item()) < 1e-3
    norm = synth.synthetic_tensor("blocks.0.norm3.weight", (4096,), torch.float32)
    bias = synth.synthetic_tensor("blocks.0.norm3.bias", (4096,), torch.float32)
    assert abs(norm.mean().item() - 1) < 0.01 and abs(bias.mean().item()) < 0.01 and bias.std() < 0.02
    assert len(synth.outlier_channels("blocks.0.norm3.weight", (4096,))[0]) == 0


def test_fp8_formats_round_trip() -> None:
    model = "wan22_t2v_14B"
    ref = synth.synthetic_state_dict(model, "tiny", "bf16")
    plain = synth.synthetic_state_dict(model, "tiny", "fp8")
    scaled = synth.synthetic_state_dict(model, "tiny", "fp8_scaled")
    assert scaled["scaled_fp8"].dtype == torch.float8_e4m3fn and scaled["scaled_fp8"].numel() == 0
    for name, w in ref.items():
        if not is_linear_weight(model, name, tuple(w.shape)):
            assert plain[name].dtype == w.dtype and torch.equal(plain[name], w)
            assert scaled[name].dtype == torch.float16 and f"{name[:-7]}.scale_weight" not in scaled
            continue
        assert torch.equal(plain[name].view(torch.uint8), w.to(torch.float8_e4m3fn).view(torch.uint8))
        q, scale = scaled[name], scaled[f"{name[:-7]}.scale_weight"]
        assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == ()
        assert scaled[f"{name[:-7]}.scale_input"].item() == 1.0
        w32 = w.float()
        assert scale.item() == pytest.approx(w32.abs().max().item() / 448, rel=1e-6)
        deq = q.float() * scale
        # e4m3: 3 mantissa bits -> round-to-nearest error <= 2^-4 relative; subnormal step 2^-9 absolute
        assert bool(((deq - w32).abs() <= w32.abs() * 2**-4 + scale * 2**-10).all()), name
        assert (deq - w32).abs().max() < 0.07 * w32.abs().max()


def test_text_encoder_fp8_scaled_has_no_input_scale() -> None:
    layout = synth.file_layout("qwen25_vl_7b", "tiny", "fp8_scaled")
    names = [n for n, _, _ in layout]
    assert sum(n.endswith(".scale_weight") for n in names) == 358
    assert not any(n.endswith(".scale_input") for n in names) and names[-1] == "scaled_fp8"
    assert dict((n, d) for n, _, d in layout)["model.embed_tokens.weight"] == torch.float16


def test_vae_rejects_fp8() -> None:
    with pytest.raises(ValueError, match="fp8.*VAE"):
        synth.file_layout("wan21_vae", "tiny", "fp8")


def test_umt5_file_carries_tokenizer() -> None:
    layout = synth.file_layout("umt5_xxl_enc", "tiny", "bf16")
    assert layout[-1][0] == "spiece_model" and layout[-1][2] == torch.uint8
    spm = pytest.importorskip("sentencepiece")
    proc = spm.SentencePieceProcessor(model_proto=synth.umt5_tokenizer_bytes(), add_bos=False, add_eos=True)
    ids = proc.encode("a cat, sitting on the mat")
    assert ids[-1] == 1 and proc.pad_id() == 0 and max(ids) < 256384
    assert proc.decode(ids) == "a cat, sitting on the mat"


@pytest.mark.parametrize("fmt", synth.FORMATS)
def test_write_matches_state_dict(tmp_path: Path, fmt: str) -> None:
    path = synth.write_synthetic("wan22_ti2v_5B", tmp_path / "x.safetensors", "tiny", fmt, seed=7, threads=2)
    header = read_header(path)
    assert [(i.name, i.shape, i.dtype) for i in header.tensors.values()] == [
        (n, tuple(s), d) for n, s, d in synth.file_layout("wan22_ti2v_5B", "tiny", fmt)
    ]
    assert header.metadata["format"] == fmt and header.metadata["seed"] == "7"
    ref = synth.synthetic_state_dict("wan22_ti2v_5B", "tiny", fmt, seed=7)
    got = dict(iter_tensors(header))
    assert got.keys() == ref.keys()
    for name, t in ref.items():
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def test_write_streams_tensor_by_tensor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At most a few generated tensors are alive at any time, never the whole model."""
    alive = {"bytes": 0, "peak": 0, "largest": 0}
    real = synth.synthetic_tensor

    def tracked(*args, **kwargs) -> torch.Tensor:  # noqa: ANN002, ANN003
        t = real(*args, **kwargs)
        n = t.numel() * t.element_size()
        alive["bytes"] += n
        alive["peak"] = max(alive["peak"], alive["bytes"])
        alive["largest"] = max(alive["largest"], n)
        weakref.finalize(t, lambda: alive.__setitem__("bytes", alive["bytes"] - n))
        return t

    monkeypatch.setattr(synth, "synthetic_tensor", tracked)
    path = synth.write_synthetic("wan22_t2v_14B", tmp_path / "m.safetensors", "tiny", "bf16", num_layers=16)
    total = path.stat().st_size
    assert total > 25e6
    assert alive["peak"] <= 5 * alive["largest"] and alive["peak"] < total / 3


def test_write_failure_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    real_write = synth.StreamingSafetensorsWriter.write

    def failing(self, name, tensor):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("disk full (simulated)")
        return real_write(self, name, tensor)

    monkeypatch.setattr(synth.StreamingSafetensorsWriter, "write", failing)
    with pytest.raises(OSError, match="disk full"):
        synth.write_synthetic("wan22_t2v_14B", tmp_path / "f.safetensors", "tiny")
    assert list(tmp_path.iterdir()) == []


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert synth.cli(["--list"]) == 0
    assert "wan22_t2v_14B" in capsys.readouterr().out
    assert synth.cli(["wan21_vae", "wan22_t2v_14B", "--out", str(tmp_path), "--comfy-layout", "--no-progress"]) == 0
    assert (tmp_path / "vae" / "synth_wan21_vae_tiny_bf16.safetensors").is_file()
    assert (tmp_path / "diffusion_models" / "synth_wan22_t2v_14B_tiny_bf16.safetensors").is_file()
    out = tmp_path / "one.safetensors"
    assert synth.cli(["wan22_i2v_14B", "--format", "fp8_scaled", "--output", str(out), "--no-progress"]) == 0
    assert "scaled_fp8" in read_header(out).tensors
    assert synth.cli(["wan21_vae", "--format", "fp8", "--out", str(tmp_path), "--no-progress"]) == 1
    assert synth.cli(["wan21_vae", "wan22_vae", "--output", str(out)]) == 2
    with pytest.raises(SystemExit):
        synth.cli(["nope-model-format", "--format", "int3"])


# GGUF (synthetic/gguf_checkpoints.py)


def test_gguf_q8_0_bytes_are_gguf_own_quantization() -> None:
    """Q8_0 computed with torch, chunk by chunk, is byte for byte gguf's (its rounding half away from zero, a zero
    block's scale 0)."""
    gguf = pytest.importorskip("gguf", reason="the gguf package is missing: pip install -e '.[test]' adds it")
    w = synth.synthetic_tensor("blocks.0.ffn.2.weight", (1030, 4096), torch.bfloat16).float()  # two row chunks
    w[0, :32] = 0
    w[1, :32] = torch.arange(32) - 15.5  # with the 127 below, d = 1: every value a half, where rounding differs
    w[1, 0] = 127
    ours = gguf_synth.quantize_q8_0(w)
    assert ours.dtype == torch.uint8 and torch.equal(ours, torch.from_numpy(
        gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_gguf_file_has_the_layout_types_and_mark(tmp_path: Path, qtype: str) -> None:
    """Every tensor of the synthetic model in file order with its shape, quantized by the layout rule (2-D Linear
    weights; Q4_K where the width fits its super-blocks), Q8_0 = the bf16 file's weights quantized; the synthetic
    mark a runner deletes by, and a user's file at the name left alone."""
    gguf = pytest.importorskip("gguf", reason="the gguf package is missing: pip install -e '.[test]' adds it")
    path = tmp_path / "m.gguf"
    types = gguf_synth.write_synthetic_gguf("wan22_t2v_14B", path, qtype, "tiny", seed=3, num_layers=2)
    layout = synth.file_layout("wan22_t2v_14B", "tiny", "bf16", 2)
    reader = gguf.GGUFReader(path)
    assert [(t.name, tuple(int(d) for d in reversed(t.shape))) for t in reader.tensors] == [(n, s) for n, s, _ in layout]
    assert {t.name: t.tensor_type.name for t in reader.tensors} == types
    assert {n: types[n] for n, s, _ in layout if len(s) != 2} == {n: "F32" for n, s, _ in layout if len(s) != 2}
    assert set(types.values()) == {"F32", qtype}
    q = next(t for t in reader.tensors if t.name == "blocks.1.ffn.0.weight")
    if qtype == "Q8_0":
        w = synth.synthetic_tensor(q.name, tuple(reversed([int(d) for d in q.shape])), torch.bfloat16, seed=3)
        assert np.array_equal(np.asarray(q.data), gguf_synth.quantize_q8_0(w).numpy())
    assert np.isfinite(gguf.quants.dequantize(np.asarray(q.data), q.tensor_type)).all()
    assert gguf_synth.is_synthetic(path) and reader.get_field("general.architecture") is not None
    theirs = tmp_path / "theirs.gguf"
    theirs.write_bytes(b"GGUF not ours")
    with pytest.raises(FileExistsError, match="not written by this pack"):
        gguf_synth.write_synthetic_gguf("wan22_t2v_14B", theirs, qtype, "tiny", num_layers=2)
    assert theirs.read_bytes() == b"GGUF not ours" and not gguf_synth.is_synthetic(theirs)
    assert list(tmp_path.glob(".*.tmp")) == []


@pytest.mark.cuda
def test_cuda_generation(tmp_path: Path) -> None:
    """CUDA generator path: same layout and outlier channels as on CPU, file == in-memory state dict."""
    sd = synth.synthetic_state_dict("wan22_t2v_14B", "tiny", "fp8_scaled", seed=2, device="cuda")
    assert all(t.device.type == "cuda" for t in sd.values())
    assert [(n, tuple(t.shape), t.dtype) for n, t in sd.items()] == [
        (n, tuple(s), d) for n, s, d in synth.file_layout("wan22_t2v_14B", "tiny", "fp8_scaled")
    ]
    w = synth.synthetic_tensor("blocks.0.ffn.2.weight", (256, 2048), torch.float32, seed=2, device="cuda")
    idx, _ = synth.outlier_channels("blocks.0.ffn.2.weight", (256, 2048), seed=2)
    col_amax = w.abs().amax(dim=0).cpu()
    assert set(col_amax.topk(len(idx)).indices.tolist()) == set(idx.tolist())
    path = synth.write_synthetic("wan22_t2v_14B", tmp_path / "c.safetensors", "tiny", "fp8_scaled", seed=2,
                                 device="cuda")
    for name, t in iter_tensors(read_header(path)):
        assert torch.equal(t.reshape(-1).view(torch.uint8), sd[name].cpu().reshape(-1).view(torch.uint8)), name
