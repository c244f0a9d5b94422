"""Wan 2.1 / 2.2 diffusion checkpoints: format detection, streaming fp8 quantization, our fp8 file format.

Plain torch; no ComfyUI. Every input is converted to the in-memory fp8 form of checkpoints/fp8_state.py (what
host/fp8_ops.py loads). Only the 2-D Linear weights inside ``blocks.N.`` are quantized: embeddings, time
projection, head, norms and modulation stay in high precision (fp8 hurts them most; same exclusion list as
musubi-tuner's Wan fp8 loader).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import safe_write
from .safetensors_io import (
    CheckpointError, MapHook, SafetensorsHeader, StreamingSafetensorsWriter, check_ranks, quant_layer_configs,
    read_header,
)
from .core_quant import core_layouts, read_core_state_dict
from .fp8_state import FP8_DTYPES, Fp8Plan, QuantMode, SourceFormat, quantize_weight, read_fp8_state_dict
from .streaming import ProgressFn

log = logging.getLogger("comfyui_lowvram_dit")

FORMAT_TAG = "wan-fp8-v1"
META_FORMAT = "lowvram_dit.format"
META_MODE = "lowvram_dit.mode"
META_BLOCK = "lowvram_dit.block_size"
META_SOURCE = "lowvram_dit.source_sha256"
META_SOURCE_NAME = "lowvram_dit.source_name"
META_HASH_METHOD = "lowvram_dit.source_hash_method"
# Hashing a 28 GB file takes ~1-2 min even from page cache, so the fingerprint covers the header (every
# name, shape, dtype and offset), the file size and 16 evenly spaced 1 MiB samples of the data.
HASH_SAMPLES, HASH_CHUNK = 16, 1 << 20
HASH_METHOD = f"sha256(header + size + {HASH_SAMPLES} x 1 MiB samples)"

_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.model.", "model.", "net.")
_BLOCK_LINEAR = re.compile(r"blocks\.\d+\.(?:self_attn|cross_attn|ffn)\.[A-Za-z0-9_.]+\.weight")
_BLOCK_INDEX = re.compile(r"blocks\.(\d+)\.")


@dataclass(frozen=True)
class WanCheckpointInfo:
    """What a Wan file is: format, architecture numbers read from its shapes, and key prefix."""

    path: Path
    format: SourceFormat
    variant: str
    dim: int
    ffn_dim: int
    num_layers: int
    in_dim: int
    out_dim: int
    prefix: str
    weight_dtype: torch.dtype  # dtype of the block Linear weights in the file
    mode: QuantMode = "none"  # for pre-quantized files: how they are quantized
    block_size: int | None = None
    layers: dict[str, dict] = field(default_factory=dict, compare=False)  # ComfyUI per-layer quant configs


@dataclass
class LoadedWan:
    """A Wan state dict in the in-memory form (see module docstring) plus what was done to it."""

    state_dict: dict[str, torch.Tensor]
    info: WanCheckpointInfo
    mode: QuantMode  # quantization of the block Linear weights now in ``state_dict``
    block_size: int | None
    quantized_here: bool  # True when this load quantized high-precision weights (worth saving)
    notes: list[str] = field(default_factory=list)

    @property
    def fp8_layers(self) -> int:
        """Number of fp8 Linear weights in the state dict for the pack's fp8 layers (0 for ComfyUI's own layouts)."""
        if self.info.format == "core_quant":
            return 0
        return sum(1 for k in self.state_dict if k.endswith(".weight_scale"))


def _has_quant_configs(header: SafetensorsHeader) -> bool:
    return "_quantization_metadata" in header.metadata or any(k.endswith(".comfy_quant") for k in header.tensors)


def is_fp8_target(key: str, shape: tuple[int, ...]) -> bool:
    """True for the keys we quantize: 2-D Linear weights inside ``blocks.N.`` (not norms/modulation)."""
    return len(shape) == 2 and _BLOCK_LINEAR.fullmatch(key) is not None and ".norm" not in key


def _strip_prefix(names: list[str]) -> str:
    for p in _PREFIXES:
        if f"{p}head.modulation" in names:
            return p
    return ""


def _variant(dim: int, in_dim: int, out_dim: int, has_img_emb: bool, num_layers: int) -> str:
    known = {
        (5120, 16, 16, False): "Wan 14B T2V (2.1, or a 2.2 A14B expert)",
        (5120, 36, 16, False): "Wan 2.2 I2V A14B expert",
        (5120, 36, 16, True): "Wan 2.1 I2V 14B",
        (3072, 48, 48, False): "Wan 2.2 TI2V 5B",
        (1536, 16, 16, False): "Wan 2.1 T2V 1.3B",
    }
    return known.get((dim, in_dim, out_dim, has_img_emb), f"Wan (dim {dim}, {num_layers} blocks, in {in_dim})")


def _expected_shapes(dim: int, ffn: int, in_dim: int, out_dim: int) -> list[tuple[re.Pattern[str], tuple[int, ...]]]:
    d = dim
    table = {
        r"patch_embedding\.weight": (d, in_dim, 1, 2, 2),
        r"(patch_embedding|text_embedding\.[02]|time_embedding\.[02]|head\.head)\.bias": None,
        r"text_embedding\.0\.weight": (d, 4096),
        r"text_embedding\.2\.weight": (d, d),
        r"time_embedding\.0\.weight": (d, 256),
        r"time_embedding\.2\.weight": (d, d),
        r"time_projection\.1\.weight": (6 * d, d),
        r"time_projection\.1\.bias": (6 * d,),
        r"head\.modulation": (1, 2, d),
        r"head\.head\.weight": (out_dim * 4, d),
        r"blocks\.\d+\.modulation": (1, 6, d),
        r"blocks\.\d+\.(self_attn|cross_attn)\.(q|k|v|o|k_img|v_img)\.weight": (d, d),
        r"blocks\.\d+\.(self_attn|cross_attn)\.(q|k|v|o|k_img|v_img)\.bias": (d,),
        r"blocks\.\d+\.(self_attn|cross_attn)\.norm_(q|k|k_img)\.weight": (d,),
        r"blocks\.\d+\.norm3\.(weight|bias)": (d,),
        r"blocks\.\d+\.ffn\.0\.weight": (ffn, d),
        r"blocks\.\d+\.ffn\.0\.bias": (ffn,),
        r"blocks\.\d+\.ffn\.2\.weight": (d, ffn),
        r"blocks\.\d+\.ffn\.2\.bias": (d,),
    }
    return [(re.compile(k), v) for k, v in table.items() if v is not None]


_REQUIRED_BLOCK_KEYS = (
    "modulation",
    *(f"{a}.{p}.{w}" for a in ("self_attn", "cross_attn") for p in "qkvo" for w in ("weight", "bias")),
    "ffn.0.weight",
    "ffn.2.weight",
)


def inspect_checkpoint(path: str | Path, header: SafetensorsHeader | None = None) -> WanCheckpointInfo:
    """Detect the format and architecture of a Wan file from its header; CheckpointError if it is not one."""
    header = header or read_header(path)
    p = header.path
    names = list(header.tensors)
    prefix = _strip_prefix(names)
    t = {n[len(prefix) :]: header.tensors[n] for n in names if n.startswith(prefix)}
    needed = ("head.modulation", "patch_embedding.weight", "blocks.0.ffn.0.weight", "head.head.weight")
    missing = [k for k in needed if k not in t]
    if missing:
        hint = ""
        if any(k.startswith("transformer_blocks.") for k in t) or "txt_norm.weight" in t:
            hint = " It looks like a Qwen-Image/Flux-style model; load it with its own loader."
        elif any(".condition_embedder." in k or k.startswith("condition_embedder.") for k in t):
            hint = " It is a diffusers-format Wan; use the original Wan/Comfy-Org repackaged file."
        raise CheckpointError(
            f"{p.name}: not a Wan 2.1/2.2 diffusion model (missing {', '.join(missing)}); expected the original "
            f"Wan key names (patch_embedding, blocks.N.self_attn.q, head.modulation, ...).{hint}"
        )
    check_ranks(header, {prefix + k: r for k, r in zip(needed, (3, 5, 2, 2))}, "Wan 2.1/2.2 diffusion model")
    dim = t["head.modulation"].shape[-1]
    ffn = t["blocks.0.ffn.0.weight"].shape[0]
    in_dim = t["patch_embedding.weight"].shape[1]
    out_dim = t["head.head.weight"].shape[0] // 4
    blocks = sorted({int(m.group(1)) for k in t if (m := _BLOCK_INDEX.match(k))})
    num_layers = len(blocks)
    if blocks != list(range(num_layers)):
        raise CheckpointError(f"{p.name}: Wan blocks are not numbered 0..{num_layers - 1} (found {blocks[:8]}...)")
    for i in blocks:
        lost = [k for k in _REQUIRED_BLOCK_KEYS if f"blocks.{i}.{k}" not in t]
        if lost:
            raise CheckpointError(f"{p.name}: Wan block {i} is incomplete (missing blocks.{i}.{lost[0]}); the file is damaged")
    rules = _expected_shapes(dim, ffn, in_dim, out_dim)
    layers = quant_layer_configs(header) if _has_quant_configs(header) else {}
    packed = {layer[len(prefix):] + ".weight" for layer in itertools.chain(*core_layouts(layers).values())}
    for k, info in t.items():
        if k in packed:
            continue  # packed / padded by its layout (nvfp4, w4a8): ComfyUI checks it when it builds the layer
        for pat, shape in rules:
            if pat.fullmatch(k):
                if info.shape != shape:
                    raise CheckpointError(
                        f"{p.name}: tensor {prefix + k!r} has shape {list(info.shape)}, expected {list(shape)} for a Wan "
                        f"model with dim {dim}, ffn {ffn}, in_dim {in_dim}; the file is damaged or not a Wan 2.x model"
                    )
                break

    lin = [t[k] for k in t if is_fp8_target(k, t[k].shape)]
    weight_dtype = max({i.dtype for i in lin}, key=lambda d: sum(i.nbytes for i in lin if i.dtype == d))
    fmt, mode, block_size = _file_format(header, t, weight_dtype, layers)
    variant = _variant(dim, in_dim, out_dim, "img_emb.proj.0.bias" in t, num_layers)
    return WanCheckpointInfo(p, fmt, variant, dim, ffn, num_layers, in_dim, out_dim, prefix, weight_dtype, mode,
                             block_size, layers)


def _file_format(header: SafetensorsHeader, t: dict, weight_dtype: torch.dtype,
                 layers: dict[str, dict]) -> tuple[SourceFormat, QuantMode, int | None]:
    """(file convention, quantization, block size) of a Wan file from its metadata and key names."""
    p, meta = header.path, header.metadata
    mode: QuantMode = "none"
    block_size: int | None = None
    fmt: SourceFormat
    if core_layouts(layers):
        fmt = "core_quant"
    elif META_FORMAT in meta:
        if meta[META_FORMAT] != FORMAT_TAG:
            raise CheckpointError(f"{p.name}: saved by a newer version ({meta[META_FORMAT]}); update the pack")
        fmt, mode = "lowvram_fp8", meta.get(META_MODE, "per_tensor")  # type: ignore[assignment]
        if mode == "blockwise" and not (meta.get(META_BLOCK, "").isdigit() and int(meta[META_BLOCK]) > 0):
            raise CheckpointError(f"{p.name}: damaged metadata ({META_BLOCK}={meta.get(META_BLOCK)!r}); "
                                  "delete the file and quantize again")
        block_size = int(meta[META_BLOCK]) if mode == "blockwise" else None
    elif _has_quant_configs(header):
        fmt, mode = "comfy_quant", "per_tensor"
    elif "scaled_fp8" in t:
        fmt, mode = "comfy_fp8_scaled", "per_tensor"
    elif any(k.endswith(".scale_weight") for k in t):
        fmt = "musubi_fp8"
        scales = [t[k] for k in t if k.endswith(".scale_weight")]
        mode = "per_tensor" if all(math.prod(s.shape) == 1 for s in scales) else "blockwise"
    elif weight_dtype in FP8_DTYPES:
        fmt, mode = "fp8_plain", "per_tensor"
    else:
        fmt = "high_precision"
    return fmt, mode, block_size


def quantize_state_dict(
    sd: dict[str, torch.Tensor], mode: QuantMode, block_size: int = 128, *, device: str | torch.device | None = None
) -> dict[str, torch.Tensor]:
    """In-memory version of the streaming quantizer (benchmarks build weights on the GPU and call this)."""
    if mode == "none":
        return dict(sd)
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if is_fp8_target(k, tuple(v.shape)) and v.dtype not in FP8_DTYPES:
            q, s = quantize_weight(v if device is None else v.to(device), mode, block_size)
            out[k], out[k[: -len("weight")] + "weight_scale"] = q.to(v.device), s.to(v.device)
        else:
            out[k] = v
    return out


def _output_quantization(info: WanCheckpointInfo, mode: QuantMode, block_size: int) -> tuple[QuantMode, int | None,
                                                                                            list[str]]:
    """(quantization the loaded dict holds, its block size, notes) for a file of ``info`` asked to load as ``mode``."""
    name = info.path.name
    if info.format == "lowvram_fp8":
        notes = [f"{name} is already quantized ({info.mode}, block {info.block_size}); used as saved"] \
            if mode not in ("none", info.mode) or (mode == "blockwise" and block_size != info.block_size) else []
        return info.mode, info.block_size, notes
    if info.format in ("comfy_fp8_scaled", "comfy_quant", "fp8_plain"):
        notes = [f"{name} is already per-tensor fp8; kept as is (re-quantizing fp8 codes only adds error)"] \
            if mode == "blockwise" else []
        return "per_tensor", None, notes
    if info.format == "musubi_fp8":
        if info.mode == "per_tensor":
            return "per_tensor", None, []
        out: QuantMode = mode if mode != "none" else "blockwise"
        return out, block_size if out == "blockwise" else None, [
            f"{name}: musubi row-group fp8 scales re-quantized to {out} (no fp8 GEMM takes 1x64 groups)"]
    return mode, block_size if mode == "blockwise" else None, []


def load_wan_state_dict(
    path: str | Path,
    mode: QuantMode = "none",
    block_size: int = 128,
    *,
    device: str | torch.device | None = None,
    progress: ProgressFn | None = None,
    mmap: bool = False,
    on_map: MapHook | None = None,
) -> LoadedWan:
    """Read a Wan file one tensor at a time into the in-memory fp8 form (checkpoints/fp8_state.py), or, for a file
    in ComfyUI's other quantized layouts, as stored (checkpoints/core_quant.py; ``mode`` does not apply).

    High-precision files are quantized to ``mode`` while streaming (on ``device``, e.g. the GPU, when
    given). Pre-quantized files keep their own per-tensor quantization (re-quantizing fp8 codes only adds
    error); musubi row-group/channel files, which no fp8 GEMM takes, are re-quantized to ``mode``
    (block-wise when ``mode`` is "none"). Keys are returned without the checkpoint prefix.

    ``mmap``: tensors of a pre-quantized file that pass through unchanged are zero-copy views of the file
    (safetensors_io.map_tensors), so they cost page cache instead of RSS; files quantized here are read as usual.
    ``on_map`` sees each such view with its place in the file.
    """
    if mode not in ("none", "per_tensor", "blockwise"):
        raise ValueError(f"quantization mode must be none, per_tensor or blockwise, got {mode!r}")
    if block_size not in (64, 128):
        raise ValueError(f"block_size must be 64 or 128 (the GEMM scale granularities), got {block_size}")
    header = read_header(path)
    info = inspect_checkpoint(path, header)
    if info.format == "core_quant":  # ComfyUI's own layers build it: every tensor as stored
        sd = read_core_state_dict(header, info.prefix, info.layers, mmap=mmap, progress=progress, on_map=on_map)
        return LoadedWan(sd, info, "none", None, False)
    out_mode, out_bs, notes = _output_quantization(info, mode, block_size)
    plan = Fp8Plan(info.format, info.prefix, is_fp8_target, out_mode, block_size,
                   saved_block=out_bs if info.format == "lowvram_fp8" and out_mode == "blockwise" else None)
    sd, read_notes = read_fp8_state_dict(header, plan, device=device, mmap=mmap, progress=progress, on_map=on_map)
    if out_mode == "none" and any(k.endswith(".weight_scale") for k in sd):
        out_mode = "per_tensor"
    return LoadedWan(sd, info, out_mode, out_bs if out_mode == "blockwise" else None, plan.quantizes_here,
                     notes + read_notes)


def source_fingerprint(path: str | Path) -> str:
    """sha256 of the header, the size and 16 evenly spaced 1 MiB samples (see HASH_METHOD)."""
    header = read_header(path)
    h = hashlib.sha256()
    with header.path.open("rb") as f:
        h.update(f.read(header.data_offset))
        h.update(header.file_size.to_bytes(8, "little"))
        span = header.file_size - header.data_offset
        if span <= HASH_SAMPLES * HASH_CHUNK:
            h.update(f.read())
        else:
            step = (span - HASH_CHUNK) // (HASH_SAMPLES - 1)
            for i in range(HASH_SAMPLES):
                f.seek(header.data_offset + i * step)
                h.update(f.read(HASH_CHUNK))
    return h.hexdigest()


def quantized_path_for(source: str | Path, mode: QuantMode, block_size: int = 128) -> Path:
    """Where the quantized copy of ``source`` is saved: next to it, named by mode and block size."""
    src = Path(source)
    tag = "per-tensor" if mode == "per_tensor" else f"blockwise-bs{block_size}"
    return src.with_name(f"{src.stem}.lowvram-fp8-{tag}.safetensors")


def find_quantized(source: str | Path, mode: QuantMode, block_size: int = 128) -> Path | None:
    """The saved quantized copy of ``source`` if it exists and was made from this exact source file."""
    if mode == "none":
        return None
    cand = quantized_path_for(source, mode, block_size)
    if not cand.is_file():
        return None
    try:
        meta = read_header(cand).metadata
    except CheckpointError as exc:
        log.warning("lowvram_dit: ignoring saved quantized file: %s", exc)
        return None
    want_bs = str(block_size) if mode == "blockwise" else "0"
    if meta.get(META_FORMAT) != FORMAT_TAG or meta.get(META_MODE) != mode or meta.get(META_BLOCK) != want_bs:
        log.warning("lowvram_dit: %s does not match mode %s / block %s; re-quantizing", cand.name, mode, block_size)
        return None
    if meta.get(META_SOURCE) != source_fingerprint(source):
        log.warning("lowvram_dit: %s was made from a different %s; re-quantizing", cand.name, Path(source).name)
        return None
    return cand


def _ours(path: Path) -> bool:
    """Whether ``path`` is a quantized copy this pack wrote (its format tag)."""
    try:
        return read_header(path).metadata.get(META_FORMAT) == FORMAT_TAG
    except CheckpointError:
        return False


def _refuse_foreign(dest: Path) -> None:
    """CheckpointError unless ``dest`` is absent or a regular file this pack wrote (its format tag): a user's own
    file, a link or a folder that happens to have the target name is never replaced (checkpoints/safe_write.py)."""
    try:
        safe_write.refuse_unowned(dest, _ours)
    except safe_write.UnsafeTargetError:
        raise CheckpointError(f"{dest.name}: a file of that name exists and was not written by this pack; it is "
                              "left untouched and the quantized copy is not saved (rename or move that file to save "
                              "it)") from None


def save_quantized(loaded: LoadedWan, dest: str | Path, source: str | Path, progress: ProgressFn | None = None) -> Path:
    """Write ``loaded`` (fp8 + scales) as a safetensors file with the metadata that makes it auto-load.

    Replaces only a file this pack wrote (CheckpointError otherwise); on any failure no partial file remains.
    """
    if loaded.mode == "none":
        raise ValueError("save_quantized: nothing is quantized (mode none)")
    dest = Path(dest)
    _refuse_foreign(dest)
    sd = loaded.state_dict
    meta = {
        META_FORMAT: FORMAT_TAG,
        META_MODE: loaded.mode,
        META_BLOCK: str(loaded.block_size or 0),
        META_SOURCE: source_fingerprint(source),
        META_SOURCE_NAME: Path(source).name,
        META_HASH_METHOD: HASH_METHOD,
    }
    layout = [(k, tuple(v.shape), v.dtype) for k, v in sd.items()]
    total = sum(v.numel() * v.element_size() for v in sd.values())
    done = 0
    w = StreamingSafetensorsWriter(dest, layout, meta, owned=_ours)
    try:
        for k, v in sd.items():
            w.write(k, v)
            done += v.numel() * v.element_size()
            if progress:
                progress(done, total)
        _refuse_foreign(dest)  # a file put there while this one was written is not replaced either
        w.close()
    except BaseException:
        w.abort()
        raise
    return dest
