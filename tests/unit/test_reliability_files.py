"""Files written and read by the pack, fuzzed (seeded, time-bounded):

- writes that replace files: ``save_quantized`` never replaces a file the pack did not write, and no ``.partial``
  or open handle survives a disk that fills at any byte;
- quantization metadata and scales: malformed ``_quantization_metadata`` / ``.comfy_quant`` (wrong JSON types,
  deep nesting, undecodable bytes), absurd shapes, overlapping ``data_offsets`` and missing / NaN / infinite /
  non-positive weight scales are each a CheckpointError naming the file (and the tensor), raised before any weight
  is read.
"""

from __future__ import annotations

import json
import os
import random
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_reliability_cache import _FullDisk, full_disk, open_fds_under  # noqa: F401 - full_disk is a fixture

from comfyui_lowvram_dit.checkpoints import safetensors_io as checkpoint_io, fp8_state
from comfyui_lowvram_dit.checkpoints import wan as wc
from comfyui_lowvram_dit.checkpoints.safetensors_io import CheckpointError, read_header
from comfyui_lowvram_dit.synthetic import checkpoints as synth

SEED = 4321
TIME_LIMIT_S = 120.0
WEIGHT = "blocks.0.ffn.0"  # a quantized block Linear of the tiny Wan file


@pytest.fixture(scope="module")
def wan_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wanfiles")
    out = {}
    for fmt in ("bf16", "fp8_scaled"):
        out[fmt] = synth.write_synthetic("wan21_t2v_1_3B", root / f"wan_{fmt}.safetensors", size="tiny", fmt=fmt,
                                         seed=3, num_layers=2)
    return out


def _raw_write(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _comfy_quant(sd: dict[str, torch.Tensor], how: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The legacy fp8_scaled dict converted to ComfyUI's v0.8 form (weight_scale + per-layer configs)."""
    out = {k[: -len("scale_weight")] + "weight_scale" if k.endswith(".scale_weight") else k: v
           for k, v in sd.items() if k != "scaled_fp8"}
    layers = [k[: -len(".weight_scale")] for k in out if k.endswith(".weight_scale")]
    if how == "metadata":
        return out, {"_quantization_metadata": json.dumps({"layers": {n: {"format": "float8_e4m3fn"} for n in layers}})}
    for n in layers:
        out[n + ".comfy_quant"] = torch.tensor(list(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8)
    return out, {}


def _no_weight_read(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names the loader streams after its small tensors (the weights); filled by a spy on fp8_state.read_tensors."""
    streamed: list[str] = []
    real = fp8_state.read_tensors

    def spy(header, names=None, *, mmap=False, prefetch=False, on_map=None):  # noqa: ANN001, ANN202
        if prefetch:
            streamed.extend(names or [])
        return real(header, names, mmap=mmap, prefetch=prefetch, on_map=on_map)

    monkeypatch.setattr(fp8_state, "read_tensors", spy)
    return streamed


def _damaged_quant(kind: str, rng: random.Random, sd: dict[str, torch.Tensor]) -> tuple[dict, dict, str]:
    """(tensors, metadata, the name the error must carry) for one kind of damage to quantization data."""
    deep = "[" * rng.randint(3_000, 100_000)
    if kind == "scale_value":
        key = f"{WEIGHT}.scale_weight"
        bad = rng.choice([float("nan"), float("inf"), -float("inf"), 0.0, -rng.random() - 1e-3])
        return {**sd, key: torch.tensor(bad, dtype=sd[key].dtype)}, {}, key
    if kind == "scale_missing":
        key = f"{WEIGHT}.scale_weight"
        return {k: v for k, v in sd.items() if k != key}, {}, f"{WEIGHT}.weight"
    if kind == "scale_dtype":
        key = f"{WEIGHT}.scale_weight"
        return {**sd, key: torch.ones((), dtype=rng.choice([torch.int32, torch.float8_e4m3fn]))}, {}, key
    if kind == "quant_metadata":
        tensors, _ = _comfy_quant(sd, "metadata")
        raw = rng.choice(["[1, 2]", "7", '"layers"', '{"layers": [1]}', '{"layers": "x"}',
                          json.dumps({"layers": {WEIGHT: rng.choice([3, "fp8", None, [1]])}}),
                          json.dumps({"layers": {WEIGHT: {"format": rng.choice([5, None, ["a"], {"x": 1}])}}}),
                          '{"layers": {', deep + "]" * len(deep)])
        return tensors, {"_quantization_metadata": raw}, "_quantization_metadata"
    if kind == "comfy_quant_tensor":
        tensors, _ = _comfy_quant(sd, "tensors")
        key = f"{WEIGHT}.comfy_quant"
        payload = rng.choice([b"\xff\xfe\x00garbage", b"[1, 2]", b'"text"', b'{"format": 3}', b"{",
                              (deep + "]" * len(deep)).encode()])
        t = torch.tensor(list(payload), dtype=torch.uint8)
        if rng.random() < 0.2:
            t = torch.zeros(4, dtype=torch.float32)
        return {**tensors, key: t}, {}, key
    raise AssertionError(kind)


QUANT_DAMAGE = ["scale_value", "scale_missing", "scale_dtype", "quant_metadata", "comfy_quant_tensor"]


def test_damaged_quantization_data_is_named_before_weights_are_read(wan_files: dict[str, Path], tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(SEED)
    sd = load_file(str(wan_files["fp8_scaled"]))
    streamed = _no_weight_read(monkeypatch)
    t0 = time.monotonic()
    cases = [k for k in QUANT_DAMAGE for _ in range(6)]
    rng.shuffle(cases)
    for n, kind in enumerate(cases):
        assert time.monotonic() - t0 < TIME_LIMIT_S
        tensors, meta, culprit = _damaged_quant(kind, rng, sd)
        path = tmp_path / f"damaged_{n}_{kind}.safetensors"
        save_file(tensors, str(path), metadata=meta or None)
        streamed.clear()
        with pytest.raises(CheckpointError) as err:
            wc.load_wan_state_dict(path, "per_tensor", mmap=rng.random() < 0.5)
        msg = str(err.value)
        assert path.name in msg and culprit in msg, (kind, msg)
        assert "download" in msg or "rename" in msg or "quantized wrongly" in msg, (kind, msg)  # says the fix
        assert streamed == [], f"{kind}: weights were read before the damage was reported"
        path.unlink()


def test_undamaged_quantized_forms_still_load(wan_files: dict[str, Path], tmp_path: Path) -> None:
    sd = load_file(str(wan_files["fp8_scaled"]))
    for how in ("metadata", "tensors"):
        tensors, meta = _comfy_quant(sd, how)
        path = tmp_path / f"ok_{how}.safetensors"
        save_file(tensors, str(path), metadata=meta or None)
        loaded = wc.load_wan_state_dict(path, "per_tensor")
        assert loaded.info.format == "comfy_quant" and loaded.fp8_layers > 0
    assert wc.load_wan_state_dict(wan_files["fp8_scaled"], "per_tensor").fp8_layers > 0


def _damaged_header(kind: str, rng: random.Random) -> tuple[dict, bytes, str]:
    """(header, data, the tensor name the error must carry) for a crafted header."""
    if kind == "overlap":
        a = rng.randint(8, 64) // 4 * 4
        start = rng.randrange(0, a, 4)
        length = rng.randint(1, 16) * 4
        hdr = {"a": {"dtype": "F32", "shape": [a // 4], "data_offsets": [0, a]},
               "b": {"dtype": "F32", "shape": [length // 4], "data_offsets": [start, start + length]}}
        return hdr, bytes(max(a, start + length)), "'a'"
    shape = rng.choice([[0, 1 << 62], [1 << 50, 0], [0] * 40, [1] * 70, [0, 2 ** 63 - 1]])
    return {"x": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}, b"", "'x'"


@pytest.mark.parametrize("kind", ["overlap", "absurd_shape"])
def test_crafted_headers_are_refused_by_name(tmp_path: Path, kind: str) -> None:
    rng = random.Random(f"{SEED}-{kind}")
    for n in range(20):
        hdr, data, culprit = _damaged_header(kind, rng)
        path = _raw_write(tmp_path / f"{kind}_{n}.safetensors", hdr, data)
        with pytest.raises(CheckpointError) as err:
            read_header(path)
        assert path.name in str(err.value) and culprit in str(err.value), str(err.value)


def test_quant_configs_of_text_encoders_and_qwen_are_checked_too(wan_files: dict[str, Path], tmp_path: Path) -> None:
    """check_quantization (what the text-encoder and Qwen-Image loaders call) refuses the same damage."""
    rng = random.Random(SEED + 7)
    sd = load_file(str(wan_files["fp8_scaled"]))
    for kind in QUANT_DAMAGE:
        if kind == "scale_missing":
            continue  # a per-format rule of the Wan loader
        tensors, meta, culprit = _damaged_quant(kind, rng, sd)
        path = tmp_path / f"te_{kind}.safetensors"
        save_file(tensors, str(path), metadata=meta or None)
        with pytest.raises(CheckpointError, match=path.name):
            checkpoint_io.check_quantization(read_header(path))


# ---------------------------------------------------------------------------------------------------------------
# Writes that replace files


def _quantized(wan_files: dict[str, Path]) -> wc.LoadedWan:
    return wc.load_wan_state_dict(wan_files["bf16"], "per_tensor")


def test_save_quantized_never_replaces_a_users_file(wan_files: dict[str, Path], tmp_path: Path) -> None:
    rng = random.Random(SEED + 1)
    loaded = _quantized(wan_files)
    dest = wc.quantized_path_for(tmp_path / "wan_bf16.safetensors", "per_tensor")
    users = [os.urandom(rng.randint(0, 200)), b"", None, "link"]  # None: a valid safetensors file of the user's
    for n, content in enumerate(users):
        other = tmp_path / f"users_target_{n}.safetensors"
        if content is None:
            save_file({"w": torch.randn(3)}, str(dest), metadata={"note": "my own model"})
        elif content == "link":
            save_file({"w": torch.randn(3)}, str(other))
            dest.symlink_to(other)
        else:
            dest.write_bytes(content)
        before = dest.read_bytes()
        with pytest.raises(CheckpointError, match="not written by this pack"):
            wc.save_quantized(loaded, dest, wan_files["bf16"])
        assert dest.read_bytes() == before and (content != "link" or dest.is_symlink())
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")) == []
        dest.unlink()
    wc.save_quantized(loaded, dest, wan_files["bf16"])  # absent: written
    wc.save_quantized(loaded, dest, wan_files["bf16"])  # the pack's own earlier copy: replaced
    assert read_header(dest).metadata[wc.META_FORMAT] == wc.FORMAT_TAG


def test_full_disk_leaves_no_partial_file(wan_files: dict[str, Path], tmp_path: Path, full_disk: dict) -> None:
    rng = random.Random(SEED + 2)
    loaded = _quantized(wan_files)
    size = sum(v.numel() * v.element_size() for v in loaded.state_dict.values())
    root = tmp_path / "models"
    root.mkdir()
    dest = root / "wan.lowvram-fp8-per-tensor.safetensors"
    wc.save_quantized(loaded, dest, wan_files["bf16"])
    before = dest.read_bytes()
    full_disk["root"] = root
    t0 = time.monotonic()
    for _ in range(25):
        assert time.monotonic() - t0 < TIME_LIMIT_S
        full_disk["budget"] = rng.choice([0, 7, rng.randint(8, 4000), rng.randint(4000, size)])
        with pytest.raises(OSError):
            wc.save_quantized(loaded, dest, wan_files["bf16"])
        assert sorted(p.name for p in root.iterdir()) == [dest.name], "a temp file survived the full disk"
        assert open_fds_under(root) == []
        assert dest.read_bytes() == before  # the previous copy is intact


@pytest.mark.parametrize("model", ["wan22_t2v_14B", "qwen_image"])
def test_every_fp8_weight_of_a_scaled_file_needs_its_scale(model: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Block layers and the rest (embeddings, heads): each fp8 weight whose scale is missing is named up front."""
    from comfyui_lowvram_dit.checkpoints import qwen_image

    def load(path: Path) -> object:
        if model == "qwen_image":
            return qwen_image.load_qwen_image_state_dict(path, "none", 128, device="cpu")
        return wc.load_wan_state_dict(path, "per_tensor", device="cpu")

    sd = synth.synthetic_state_dict(model, size="tiny", fmt="fp8_scaled")
    fp8 = [k for k, v in sd.items() if v.dtype == torch.float8_e4m3fn and k.endswith("weight")]
    outside_blocks = [k for k in fp8 if not k.startswith(("blocks.", "transformer_blocks."))]
    assert outside_blocks and len(fp8) > len(outside_blocks), fp8  # both kinds are covered
    streamed = _no_weight_read(monkeypatch)
    for victim in outside_blocks + fp8[-2:]:
        path = tmp_path / f"{model}_fp8_scaled.safetensors"
        save_file({k: v for k, v in sd.items() if k != victim[: -len("weight")] + "scale_weight"}, str(path))
        streamed.clear()
        with pytest.raises(CheckpointError) as err:
            load(path)
        assert path.name in str(err.value) and victim in str(err.value) and "download" in str(err.value)
        assert streamed == [], f"{victim}: weights were read before the missing scale was reported"
    save_file(sd, str(path))
    load(path)  # the undamaged file still loads
    path.unlink()
