"""checkpoints/streaming.py, text_encoders.py, qwen_image.py and stage_meter.py on the CPU: embedding cache keying and
atomic writes, streaming loads (one module held at a time, RSS falls back after freeing), Qwen2.5-VL config and
format detection, Qwen-Image reading/quantization, stage accounting. ``write_small_text_encoder`` is shared with tests/comfyui/test_comfyui_qwen_staged.py.
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from comfyui_lowvram_dit.checkpoints import embedding_cache, qwen_image, streaming, text_encoders
from comfyui_lowvram_dit.offload import stage_meter
from comfyui_lowvram_dit.synthetic import checkpoints as synth
from comfyui_lowvram_dit.checkpoints.safetensors_io import (
    CheckpointError, StreamingSafetensorsWriter, iter_tensors, read_header,
)
from comfyui_lowvram_dit.kernels.fp8 import dequantize_blockwise
from comfyui_lowvram_dit.synthetic.specs import (
    Qwen25VLConfig, QwenImageConfig, is_linear_weight, model_spec, qwen25_vl_spec, qwen_image_spec,
)
from comfyui_lowvram_dit.synthetic.tiny import tiny_text_encoder_config

# The Qwen2.5-VL `run --synthetic tiny` writes: 2 layers, hidden 128 (= the tiny Qwen-Image's joint dim), ComfyUI's
# 152k vocabulary for the real tokenizer's ids, no vision tower (39 MB bf16). WITH_VISION adds the full 32-block
# vision tower ComfyUI always builds (0.67 B parameters: 0.7 GB even as fp8).
SMALL_TE = tiny_text_encoder_config("qwen25_vl_7b")
WITH_VISION = replace(SMALL_TE, vision_tower=True)


def write_small_text_encoder(path: Path, fmt: str = "bf16", seed: int = 0, cfg: Qwen25VLConfig = SMALL_TE) -> Path:
    """A Qwen2.5-VL file with the real key names (tools.model_specs) and random weights; bf16 or ComfyUI's
    legacy fp8_scaled (fp8 Linear weights + ``scale_weight``, fp16 rest, ``scaled_fp8`` marker)."""
    spec = qwen25_vl_spec(cfg)
    gen = torch.Generator().manual_seed(seed)
    layout: list = []
    for name, shape, dtype in spec:
        if fmt == "fp8_scaled" and is_linear_weight("qwen25_vl_7b", name, shape):
            layout += [(name, shape, torch.float8_e4m3fn), (name[: -len("weight")] + "scale_weight", (), torch.float32)]
        else:
            layout.append((name, shape, torch.float16 if fmt == "fp8_scaled" else dtype))
    if fmt == "fp8_scaled":
        layout.append(("scaled_fp8", (0,), torch.float8_e4m3fn))
    # tests swap the encoder in place under the same name: this helper's own earlier file is replaced
    with StreamingSafetensorsWriter(path, layout, owned=lambda _p: True) as w:
        for name, shape, dtype in spec:
            if name.endswith("norm.weight") or ".norm" in name:
                t = 1.0 + 0.05 * torch.randn(shape, generator=gen)
            else:
                t = torch.randn(shape, generator=gen) * (0.5 if "embed_tokens" in name else 0.02)
            if fmt == "fp8_scaled" and is_linear_weight("qwen25_vl_7b", name, shape):
                q, s = synth.quantize_fp8_scaled(t)
                w.write(name, q)
                w.write(name[: -len("weight")] + "scale_weight", s)
            else:
                w.write(name, t.to(torch.float16 if fmt == "fp8_scaled" else dtype))
        if fmt == "fp8_scaled":
            w.write("scaled_fp8", torch.empty(0, dtype=torch.float8_e4m3fn))
    return path


# ---------------------------------------------------------------------------------------------------------
# Embedding cache


ENC = {"sha256": "a" * 64, "format": "bfloat16", "dtype": "bfloat16", "config": {"hidden_size": 3584}}


def test_cache_key_depends_on_prompt_template_and_encoder_identity() -> None:
    base = embedding_cache.embedding_cache_key("a red cat", "tmpl {}", ENC)
    assert base == embedding_cache.embedding_cache_key("a red cat", "tmpl {}", dict(reversed(list(ENC.items()))))
    variants = [
        embedding_cache.embedding_cache_key("a red cat ", "tmpl {}", ENC),
        embedding_cache.embedding_cache_key("a red cat", "other {}", ENC),
        embedding_cache.embedding_cache_key("a red cat", "tmpl {}", {**ENC, "sha256": "b" * 64}),
        embedding_cache.embedding_cache_key("a red cat", "tmpl {}", {**ENC, "dtype": "float16"}),
        embedding_cache.embedding_cache_key("a red cat", "tmpl {}", {**ENC, "format": "fp8_scaled"}),
        embedding_cache.embedding_cache_key("a red cat", "tmpl {}", {**ENC, "config": {"hidden_size": 4096}}),
    ]
    assert len({base, *variants}) == len(variants) + 1


def _cond(length: int = 5, mask: bool = False) -> list:
    extra: dict = {"pooled_output": None}
    if mask:
        extra["attention_mask"] = torch.tensor([[1] * (length - 1) + [0]])
    return [[torch.randn(1, length, 3584), extra]]


def test_cache_round_trip_hashed_names_and_miss(tmp_path: Path) -> None:
    cache = embedding_cache.EmbeddingCache(tmp_path)
    key = embedding_cache.embedding_cache_key("secret prompt", "t", ENC)
    assert cache.get(key) is None
    cond = _cond(mask=True)
    path = cache.put(key, cond, info={"encoder": "x.safetensors"})
    assert path is not None and path.name == f"{key}.safetensors"
    assert "secret" not in "".join(str(p) for p in tmp_path.rglob("*"))
    got = cache.get(key)
    assert torch.equal(got[0][0], cond[0][0]) and got[0][0].dtype == torch.float32
    assert torch.equal(got[0][1]["attention_mask"], cond[0][1]["attention_mask"])
    assert got[0][1]["pooled_output"] is None
    other = embedding_cache.embedding_cache_key("secret prompt", "t", {**ENC, "sha256": "c" * 64})
    assert cache.get(other) is None


def test_cache_write_is_atomic_when_replace_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = embedding_cache.EmbeddingCache(tmp_path)
    key = embedding_cache.embedding_cache_key("p", "t", ENC)

    def boom(src: object, dst: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(embedding_cache.os, "replace", boom)
    assert cache.put(key, _cond()) is None  # the cache is an optimisation: a failed write only skips caching
    monkeypatch.undo()
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []  # no entry, no temp file left behind
    assert cache.get(key) is None
    assert cache.put(key, _cond()) is not None and cache.get(key) is not None


def test_cache_drops_corrupt_and_foreign_entries(tmp_path: Path) -> None:
    cache = embedding_cache.EmbeddingCache(tmp_path)
    key = embedding_cache.embedding_cache_key("p", "t", ENC)
    path = cache.put(key, _cond())
    path.write_bytes(path.read_bytes()[:-7])  # truncated
    assert cache.get(key) is None and not path.exists()
    # An entry copied under another key's name (e.g. a bad manual copy) is not served.
    other = embedding_cache.embedding_cache_key("q", "t", ENC)
    good = cache.put(key, _cond())
    cache.path_for(other).parent.mkdir(parents=True, exist_ok=True)
    cache.path_for(other).write_bytes(good.read_bytes())
    assert cache.get(other) is None


def test_cache_prunes_least_recently_used(tmp_path: Path) -> None:
    cache = embedding_cache.EmbeddingCache(tmp_path, max_entries=2)
    keys = [embedding_cache.embedding_cache_key(str(i), "t", ENC) for i in range(3)]
    for i, k in enumerate(keys[:2]):
        cache.put(k, _cond())
        os.utime(cache.path_for(k), (1000 + i, 1000 + i))
    cache.put(keys[2], _cond())
    assert cache.get(keys[0]) is None and cache.get(keys[1]) is not None and cache.get(keys[2]) is not None


def test_uncacheable_extras_are_skipped(tmp_path: Path) -> None:
    cache = embedding_cache.EmbeddingCache(tmp_path)
    key = embedding_cache.embedding_cache_key("p", "t", ENC)
    assert cache.put(key, [[torch.zeros(1, 2, 3), {"hooks": object()}]]) is None
    assert cache.entries() == []


# ---------------------------------------------------------------------------------------------------------
# Streaming loads


class _Net(torch.nn.Module):
    """Tiny model with a non-contiguous file order in mind: embed, two layers, norm."""

    def __init__(self, width: int = 256, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(1000, width)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)


def _write(path: Path, sd: dict[str, torch.Tensor], order: list[str] | None = None) -> Path:
    names = order or list(sd)
    with StreamingSafetensorsWriter(path, [(n, tuple(sd[n].shape), sd[n].dtype) for n in names]) as w:
        for n in names:
            w.write(n, sd[n])
    return path


def test_streaming_load_matches_state_dict_and_holds_one_module(tmp_path: Path) -> None:
    src = _Net()
    sd = {k: v.clone() for k, v in src.state_dict().items()}
    # Biases stored far from their weights: a group must wait until it is complete.
    order = sorted(sd, key=lambda k: (k.endswith("bias"), k))
    header = read_header(_write(tmp_path / "m.safetensors", sd, order))
    small = dict(iter_tensors(header, streaming.small_tensor_names(header)))
    dst = _Net()
    stats = streaming.StreamStats()
    seen: list[int] = []
    loaded = streaming.load_streaming(dst, streaming.iter_owner_groups(
        header, small, stats=stats, progress=lambda d, t: seen.append(d)))
    assert sorted(loaded) == sorted(sd)
    for k, v in dst.state_dict().items():
        assert torch.equal(v, sd[k]), k
    biggest = max(v.numel() * v.element_size() for v in sd.values())
    assert stats.max_held_bytes <= biggest  # never more than one module's streamed tensors at once
    assert seen == sorted(seen) and seen[-1] == stats.bytes_read


def test_streaming_skip_and_errors(tmp_path: Path) -> None:
    sd = _Net().state_dict()
    header = read_header(_write(tmp_path / "m.safetensors", sd))
    groups = list(streaming.iter_owner_groups(header, {}, skip=lambda n: n.startswith("embed.")))
    assert "embed" not in {o for o, _ in groups} and {o for o, _ in groups} == {"layers.0", "layers.1", "norm"}

    class Other(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(256)

    with pytest.raises(CheckpointError, match="does not have"):
        streaming.load_streaming(Other(), streaming.iter_owner_groups(header, {}))


def streaming_rss_probe(folder: Path, mmap: bool = False) -> dict[str, float]:
    """Stream a ~200 MB fp32 model from a file written in ``folder`` (copies, or mapped views with ``mmap``), then
    free it: RSS (bytes) at the start, once loaded, at the sampled peak and after freeing, plus the model's size.
    Run in a fresh interpreter (``_rss_probe``)."""
    width, layers = 1024, 48  # 4 MB layers: what streaming holds besides the model (a few layers) stays small
    sd = _Net(width, layers).state_dict()
    nbytes = sum(v.numel() * v.element_size() for v in sd.values())
    header = read_header(_write(folder / "m.safetensors", sd))
    del sd
    stage_meter.release_host_memory()
    with stage_meter.StageMeter("load+free", interval=0.005) as meter:
        model = _Net(width, layers)
        streaming.load_streaming(model, streaming.iter_owner_groups(header, {}, mmap=mmap))
        loaded = stage_meter.current_rss_bytes()
        del model
        stage_meter.release_host_memory()
    rep = meter.report
    assert "load+free" in rep.format() and rep.as_dict()["seconds"] >= 0
    return {"nbytes": nbytes, "start": rep.rss_start, "loaded": loaded, "peak": rep.rss_peak, "end": rep.rss_end}


_RSS_PROBE = ("import json, sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import test_staged; "
              "print(json.dumps(test_staged.streaming_rss_probe(Path(sys.argv[2]), sys.argv[3] == 'mmap')))")


def _rss_probe(folder: Path, mmap: bool) -> tuple[dict[str, float], float]:
    """streaming_rss_probe in a fresh interpreter: in the long test process, how much of a new allocation shows up
    as RSS growth depends on the heap pages and malloc thresholds earlier tests left behind. (results, model bytes)"""
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(Path(__file__).parent), str(folder),
                          "mmap" if mmap else "copy"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return r, r["nbytes"]


def test_rss_falls_back_after_streaming_load_and_release(tmp_path: Path) -> None:
    r, nbytes = _rss_probe(tmp_path, mmap=False)
    # The bounds leave room for the reader thread's malloc arena, whose freed read buffers glibc keeps for a while.
    assert r["loaded"] - r["start"] > 0.8 * nbytes  # the model really was resident (a lazy load would add ~0)...
    assert r["peak"] - r["start"] < 1.6 * nbytes  # ...never twice over (model + a few layers + allocator slack)
    assert r["end"] - r["start"] < 0.4 * nbytes  # and RSS fell back once it was freed


# ---------------------------------------------------------------------------------------------------------
# Qwen2.5-VL header helpers


def _header_from_spec(tmp_path: Path, spec: list) -> object:
    """A safetensors header with ``spec``'s layout (data never read: a sparse file of the right size)."""
    raw = {n: {"dtype": {torch.bfloat16: "BF16", torch.float32: "F32"}[d], "shape": list(s), "data_offsets": [0, 0]}
           for n, s, d in spec}
    off = 0
    for n, s, d in spec:
        size = d.itemsize
        for x in s:
            size *= x
        raw[n]["data_offsets"] = [off, off + size]
        off += size
    blob = json.dumps(raw).encode()
    p = tmp_path / "h.safetensors"
    with p.open("wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        f.truncate(8 + len(blob) + off)
    return read_header(p)


def test_te_config_of_the_real_7b_layout_is_comfyuis_default(tmp_path: Path) -> None:
    header = _header_from_spec(tmp_path, model_spec("qwen25_vl_7b", "full"))
    assert text_encoders.qwen25_vl_config_from_header(header) == {
        "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4}  # comfy/text_encoders/llama.py Qwen25_7BVLI_Config
    assert text_encoders.text_encoder_format(header) == "bfloat16"


def test_te_config_small_file_and_formats(tmp_path: Path) -> None:
    header = _header_from_spec(tmp_path, qwen25_vl_spec(Qwen25VLConfig(num_layers=3, intermediate=512)))
    cfg = text_encoders.qwen25_vl_config_from_header(header)
    assert cfg["num_hidden_layers"] == 3 and cfg["intermediate_size"] == 512 and cfg["num_key_value_heads"] == 4
    with pytest.raises(CheckpointError, match="not a Qwen2.5-VL"):
        text_encoders.qwen25_vl_config_from_header(_header_from_spec(tmp_path, model_spec("wan21_t2v_1_3B", "tiny")))


def test_small_text_encoder_writer_formats(tmp_path: Path) -> None:
    cfg = Qwen25VLConfig(num_layers=1, intermediate=128, vision_layers=0, vocab_size=1024)
    fp8 = read_header(write_small_text_encoder(tmp_path / "a.safetensors", "fp8_scaled", cfg=cfg))
    assert text_encoders.text_encoder_format(fp8) == "fp8_scaled"
    assert fp8.tensors["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert fp8.tensors["model.norm.weight"].dtype == torch.float16
    bf = read_header(write_small_text_encoder(tmp_path / "b.safetensors", "bf16", cfg=cfg))
    assert text_encoders.text_encoder_format(bf) == "bfloat16"
    id_a, id_b = embedding_cache.file_identity(tmp_path / "a.safetensors"), embedding_cache.file_identity(tmp_path / "b.safetensors")
    assert id_a != id_b and id_a == embedding_cache.file_identity(tmp_path / "a.safetensors")


# ---------------------------------------------------------------------------------------------------------
# Qwen-Image transformer


# Qwen-Image key names and block structure at a narrow width (the reader never looks at widths; ComfyUI's
# fixed-width tiny model is covered by the integration test).
NARROW_QWEN = QwenImageConfig(num_layers=2, dim=256, joint_dim=384)


def _write_qwen(path: Path, fmt: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """Narrow Qwen-Image as bf16, ComfyUI legacy fp8_scaled or plain fp8 (as tools.synth writes them)."""
    gen = torch.Generator().manual_seed(1)
    src = {n: (torch.randn(s, generator=gen) * 0.05).to(d) for n, s, d in qwen_image_spec(NARROW_QWEN)}
    out: dict[str, torch.Tensor] = {}
    for n, t in src.items():
        linear = is_linear_weight("qwen_image", n, tuple(t.shape))
        if fmt == "fp8_scaled" and linear:
            q, scale = synth.quantize_fp8_scaled(t)
            out.update({n: q, n[: -len("weight")] + "scale_weight": scale,
                        n[: -len("weight")] + "scale_input": torch.ones(())})
        elif fmt == "fp8" and linear:
            out[n] = t.to(torch.float8_e4m3fn)
        else:
            out[n] = t
    if fmt == "fp8_scaled":
        out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return _write(path, out), src


def test_qwen_image_blockwise_quantization_streams(tmp_path: Path) -> None:
    path, src = _write_qwen(tmp_path / "q.safetensors", "bf16")
    sd, info, mode = qwen_image.load_qwen_image_state_dict(path, "blockwise", 128)
    assert info.format == "high_precision" and info.num_blocks == 2 and mode == "blockwise"
    key = "transformer_blocks.1.img_mlp.net.0.proj.weight"  # [1024, 256]
    assert sd[key].dtype == torch.float8_e4m3fn and sd[key[: -len("weight")] + "weight_scale"].shape == (8, 2)
    back = dequantize_blockwise(sd[key], sd[key[: -len("weight")] + "weight_scale"], 128, torch.float32)
    err = (back - src[key].float()).abs().max() / src[key].float().abs().max()
    assert 0 < err < 0.07  # e4m3fn: 3 mantissa bits, per-128x128 scale
    for k in ("img_in.weight", "txt_norm.weight", "proj_out.weight", "transformer_blocks.0.attn.norm_q.weight",
              "transformer_blocks.0.img_mod.1.bias"):
        assert sd[k].dtype == torch.bfloat16 and torch.equal(sd[k], src[k]), k
    targets = [k for k, v in src.items() if qwen_image.is_qwen_fp8_target(k, tuple(v.shape))]
    assert len(targets) == 2 * 14  # img/txt mod, 8 attention projections, 2 x 2 MLP Linears per block
    assert sorted(k[: -len("_scale")] for k in sd if k.endswith(".weight_scale")) == sorted(targets)
    per_tensor, _, mode = qwen_image.load_qwen_image_state_dict(path, "per_tensor")
    assert mode == "per_tensor" and per_tensor[key[: -len("weight")] + "weight_scale"].shape == ()
    plain, _, mode = qwen_image.load_qwen_image_state_dict(path, "none")
    assert mode == "none" and all(torch.equal(plain[k], v) for k, v in src.items())


def test_qwen_image_fp8_files_kept_as_stored(tmp_path: Path) -> None:
    scaled, _ = _write_qwen(tmp_path / "s.safetensors", "fp8_scaled")
    sd, info, mode = qwen_image.load_qwen_image_state_dict(scaled, "blockwise")
    assert info.format == "comfy_fp8_scaled" and mode == "per_tensor"
    key = "transformer_blocks.0.attn.to_q"
    assert sd[f"{key}.weight"].dtype == torch.float8_e4m3fn and sd[f"{key}.weight_scale"].shape == ()
    assert not any(k.endswith((".scale_weight", ".scale_input")) or k == "scaled_fp8" for k in sd)
    plain, _ = _write_qwen(tmp_path / "p.safetensors", "fp8")
    sd, info, mode = qwen_image.load_qwen_image_state_dict(plain, "none")
    assert info.format == "fp8_plain" and mode == "per_tensor"
    unit = sd[f"{key}.weight_scale"]  # a plain fp8 cast gets a unit scale, as in the Wan loader (one normaliser)
    assert unit.shape == () and unit.dtype == torch.float32 and unit.item() == 1.0


COMFYUI_QWEN_IMAGE_DEFAULTS = {"num_attention_heads": 24, "attention_head_dim": 128, "joint_attention_dim": 3584,
                               "out_channels": 16}  # QwenImageTransformer2DModel's defaults (ComfyUI 0.8.0, 0.33.0)


def test_qwen_image_widths_of_the_release_are_comfyuis_defaults(tmp_path: Path) -> None:
    """The layout measured from ComfyUI's own 20B module (tests/shapes) reads back as ComfyUI's defaults."""
    data = json.loads((Path(__file__).parents[1] / "shapes" / "qwen_image.json").read_text())
    spec = [(n, tuple(shape), getattr(torch, dtype)) for n, (shape, dtype) in data.items()]
    header = _header_from_spec(tmp_path, spec)
    assert qwen_image.qwen_image_widths(header) == COMFYUI_QWEN_IMAGE_DEFAULTS


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_qwen_image_widths_of_a_narrow_file(tmp_path: Path, fmt: str) -> None:
    path, _ = _write_qwen(tmp_path / "q.safetensors", fmt)
    info = qwen_image.inspect_qwen_image(read_header(path))
    assert info.widths == {"num_attention_heads": 2, "attention_head_dim": 128, "joint_attention_dim": 384,
                           "out_channels": 16}
    tiny = _header_from_spec(tmp_path, model_spec("qwen_image", "tiny"))
    assert qwen_image.qwen_image_widths(tiny)["joint_attention_dim"] == SMALL_TE.hidden


def test_qwen_image_widths_comfyui_cannot_build_are_named(tmp_path: Path) -> None:
    header = _header_from_spec(tmp_path, qwen_image_spec(QwenImageConfig(num_layers=1, dim=256, head_dim=64)))
    with pytest.raises(CheckpointError, match="heads of 64"):
        qwen_image.inspect_qwen_image(header)


def test_qwen_image_rejects_other_models(tmp_path: Path) -> None:
    wan = synth.write_synthetic("wan21_t2v_1_3B", tmp_path / "w.safetensors", "tiny", "bf16")
    with pytest.raises(CheckpointError, match="not a Qwen-Image"):
        qwen_image.load_qwen_image_state_dict(wan)
    with pytest.raises(ValueError, match="quantization mode"):
        qwen_image.load_qwen_image_state_dict(wan, "int8")  # type: ignore[arg-type]


def test_stage_meter_sees_an_allocation() -> None:
    with stage_meter.StageMeter("alloc", interval=0.002) as meter:
        # A fresh anonymous mapping, every page written: new resident pages for certain. (A torch tensor can
        # land on pages the allocator kept from earlier tests, already counted in RSS: CI saw +4 KiB.)
        buf = mmap.mmap(-1, 64 << 20)
        for off in range(0, len(buf), mmap.PAGESIZE):
            buf[off] = 1
        time.sleep(0.05)  # a sampling meter sees what lives a few intervals (it was flaky when freed within 2 ms)
        buf.close()
    assert meter.report.rss_peak - meter.report.rss_start > 48 << 20
    assert meter.report.vram_peak is None


def test_mapped_streaming_loads_the_same_weights_without_piling_up_rss(tmp_path: Path) -> None:
    """iter_owner_groups(mmap=True): the consumer copies out of the page cache (one memory pass less), and each
    consumed group's mapped pages leave RSS, so a mapped load costs about the model, as a copying one does."""
    sd = _Net(512, layers=6).state_dict()
    header = read_header(_write(tmp_path / "small.safetensors", sd))
    ref, model = _Net(512, layers=6), _Net(512, layers=6)
    streaming.load_streaming(ref, streaming.iter_owner_groups(header, {}))
    loaded = streaming.load_streaming(model, streaming.iter_owner_groups(header, {}, mmap=True))
    assert set(loaded) == set(ref.state_dict()) == set(sd)
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v) and torch.equal(v, sd[k]), k
    r, nbytes = _rss_probe(tmp_path, mmap=True)  # ~200 MB, in a fresh interpreter
    assert r["loaded"] - r["start"] > 0.8 * nbytes  # the model is resident...
    assert r["loaded"] - r["start"] < 1.3 * nbytes  # ...not the model plus the mapped file
    assert r["peak"] - r["start"] < 1.5 * nbytes
