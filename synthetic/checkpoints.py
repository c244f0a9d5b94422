"""Synthetic checkpoints: files with the exact key names, shapes and dtypes of the real releases, random values.

Values are shaped for quantization studies: 2-D+ weights are a small Gaussian (std min(0.02, fan_in**-0.5))
with a few input channels scaled 8-20x (the outlier columns that make per-tensor fp8 scales coarse), norms
are ~1, biases ~0, Wan modulation randn/sqrt(dim) as Wan initialises it. Every tensor is generated in
chunks of rows, each from its own generator seeded by (seed, tensor name, chunk index), so values do not
depend on the order tensors are made in or on the thread count; they do depend on the device type (CPU and
CUDA generators differ). Outlier channels are always drawn on the CPU, so they are the same on both.

Formats (as the Comfy-Org repackaged files store them):
- "bf16": the dtypes of `model_spec` (bf16; Wan patch_embedding and VAEs fp32).
- "fp16": every floating tensor fp16 (the `_fp16` releases).
- "fp8": nn.Linear weights plainly cast to float8_e4m3fn, no scales (like `qwen_image_fp8_e4m3fn`); the rest
  as in "bf16".
- "fp8_scaled": ComfyUI's legacy scaled fp8: `<layer>.weight` float8_e4m3fn = w / scale, `<layer>.scale_weight`
  fp32 scalar (amax / 448), for diffusion models also `<layer>.scale_input` = 1.0, a `scaled_fp8` marker
  tensor (empty, float8_e4m3fn) that comfy/utils.py convert_old_quants looks for; the rest fp16.
umT5 files also carry `spiece_model` (uint8 sentencepiece proto), which ComfyUI's Wan CLIP loader requires:
a small character-level unigram model built here (real umT5 ids differ; the embedding rows exist for any id).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import queue
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..checkpoints.safetensors_io import StreamingSafetensorsWriter, written_with
from .specs import (
    MODEL_FOLDER, MODELS, SIZES, Qwen25VLConfig, QwenImageConfig, Spec, UMT5Config, config_spec, is_linear_weight,
    model_config, model_spec, spec_nbytes,
)

ModelConfig = UMT5Config | Qwen25VLConfig | QwenImageConfig  # explicit configs write files of other sizes
FORMATS: tuple[str, ...] = ("bf16", "fp16", "fp8", "fp8_scaled")
SYNTHETIC_KEY, SYNTHETIC_MARK = "synthetic", "comfyui_lowvram_dit"  # header entry of a file written here (deletable)
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
CHUNK_ELEMS = 1 << 22  # rows per generator chunk ~ 4M values (16 MB fp32 temp per worker)
WEIGHT_STD = 0.02
OUTLIER_RANGE = (8.0, 20.0)
MAX_OUTLIERS = 8
_DIFFUSION = {m for m, folder in MODEL_FOLDER.items() if folder == "diffusion_models"}

Group = list[tuple[str, torch.Tensor]]


# values


def _derive_seed(seed: int, name: str, salt: str) -> int:
    digest = hashlib.blake2b(f"{seed}\x00{name}\x00{salt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _kind(name: str, shape: tuple[int, ...]) -> str:
    if name.endswith("modulation"):
        return "modulation"
    if "gamma" in name or (len(shape) == 1 and name.endswith(".weight")):
        return "norm"
    if name.endswith(".bias"):
        return "bias"
    if name.endswith(("shared.weight", "embed_tokens.weight", "relative_attention_bias.weight")):
        return "embedding"
    return "weight"


def outlier_channels(name: str, shape: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Input channels (dim 1) that `synthetic_tensor` scales up in a weight, and their multipliers.

    About one channel per 512 inputs, 1 to 8 of them; empty for tensors that are not 2-D+ weights.
    """
    if len(shape) < 2 or _kind(name, shape) != "weight":
        return torch.empty(0, dtype=torch.long), torch.empty(0)
    n_in = shape[1]
    count = min(MAX_OUTLIERS, max(1, n_in // 512), n_in)
    g = torch.Generator().manual_seed(_derive_seed(seed, name, "outliers"))
    idx = torch.randperm(n_in, generator=g)[:count].sort().values
    lo, hi = OUTLIER_RANGE
    mult = lo + (hi - lo) * torch.rand(count, generator=g)
    return idx, mult


def _chunk_fn(name: str, shape: tuple[int, ...], seed: int, out: torch.Tensor) -> tuple[int, Callable[[int], None]]:
    """(number of chunks, fill(chunk_index)) writing `out` row-chunk by row-chunk."""
    kind = _kind(name, shape)
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    rows_per = max(1, CHUNK_ELEMS // max(row, 1))
    n_rows = shape[0] if shape else 1
    n_chunks = max(1, math.ceil(n_rows / rows_per))
    device = out.device
    if kind == "weight":
        std = min(WEIGHT_STD, (math.prod(shape[1:]) if len(shape) > 1 else 1) ** -0.5)
    elif kind == "modulation":
        std = shape[-1] ** -0.5
    elif kind == "bias":
        std = 0.01
    elif kind == "embedding" and "relative_attention_bias" in name:
        std = 0.1
    else:
        std = WEIGHT_STD
    idx, mult = outlier_channels(name, shape, seed)
    if idx.numel():
        idx = idx.to(device)
        mult = mult.to(device).reshape(-1, *([1] * (len(shape) - 2)))
    flat_out = out.reshape(1) if not shape else out

    def fill(i: int) -> None:
        r0, r1 = i * rows_per, min(n_rows, (i + 1) * rows_per)
        g = torch.Generator(device=device).manual_seed(_derive_seed(seed, name, f"chunk{i}"))
        tmp = torch.randn((r1 - r0, *shape[1:]) if shape else (1,), generator=g, device=device)
        tmp.mul_(std)
        if kind == "norm":
            tmp.add_(1.0)
        if idx.numel():
            tmp[:, idx] *= mult
        flat_out[r0:r1].copy_(tmp)

    return n_chunks, fill


def synthetic_tensor(
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    seed: int = 0,
    device: str | torch.device = "cpu",
    pool: ThreadPoolExecutor | None = None,
) -> torch.Tensor:
    """Deterministic random tensor for (name, seed, device type): Gaussian weights with outlier input channels."""
    out = torch.empty(shape, dtype=dtype, device=device)
    n_chunks, fill = _chunk_fn(name, tuple(shape), seed, out)
    if pool is None or n_chunks == 1:
        for i in range(n_chunks):
            fill(i)
    else:
        list(pool.map(fill, range(n_chunks)))
    return out


# fp8 helpers and the umT5 tokenizer


def quantize_fp8_scaled(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor scaled fp8 as ComfyUI's legacy files store it: (w / scale) in e4m3fn, scale = amax / 448 (fp32)."""
    scale = (w.abs().amax().float() / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.empty(w.shape, dtype=FP8, device=w.device)
    rows = max(1, CHUNK_ELEMS // max(1, w[0].numel())) if w.dim() > 1 else w.shape[0]
    for r0 in range(0, w.shape[0], rows):  # chunked so no full fp32 copy of a large matrix is held
        q[r0 : r0 + rows] = (w[r0 : r0 + rows].float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.reshape(())


def _pb_varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _pb_bytes(field: int, data: bytes) -> bytes:
    return _pb_varint(field << 3 | 2) + _pb_varint(len(data)) + data


def _pb_int(field: int, value: int) -> bytes:
    return _pb_varint(field << 3) + _pb_varint(value)


def umt5_tokenizer_bytes() -> bytes:
    """A small sentencepiece ModelProto (unigram, characters + '▁x' pieces) with umT5's special ids.

    ids 0 <pad>, 1 </s> (ComfyUI's umT5 tokenizer pads with 0 and ends with 1), 2 <unk>.
    Field numbers from sentencepiece_model.proto: ModelProto.pieces=1 {piece=1, score=2, type=3},
    trainer_spec=2 {model_type=3 (UNIGRAM=1), vocab_size=4, unk_id=40, bos_id=41, eos_id=42, pad_id=43},
    normalizer_spec=3 {name=1, add_dummy_prefix=3, remove_extra_whitespaces=4, escape_whitespaces=5}.
    """
    normal, unknown, control = 1, 2, 3
    pieces = [("<pad>", 0.0, control), ("</s>", 0.0, control), ("<unk>", 0.0, unknown)]
    pieces += [(ch, -5.0, normal) for ch in "▁" + "".join(chr(c) for c in range(33, 127))]
    pieces += [("▁" + ch, -3.0, normal) for ch in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"]
    body = b"".join(
        _pb_bytes(1, _pb_bytes(1, p.encode()) + _pb_varint(2 << 3 | 5) + struct.pack("<f", s) + _pb_int(3, t))
        for p, s, t in pieces
    )
    trainer = _pb_int(3, 1) + _pb_int(4, len(pieces)) + _pb_int(40, 2) + _pb_int(41, -1) + _pb_int(42, 1)
    trainer += _pb_int(43, 0)
    normalizer = _pb_bytes(1, b"identity") + _pb_int(3, 1) + _pb_int(4, 1) + _pb_int(5, 1)
    return body + _pb_bytes(2, trainer) + _pb_bytes(3, normalizer)


# file layouts


def _check_args(model: str, size: str, fmt: str) -> None:
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt.startswith("fp8") and MODEL_FOLDER[model] in ("vae", "vae_approx"):
        raise ValueError(f"format {fmt!r} is not available for the VAE {model!r} (ComfyUI has no fp8 VAE path); "
                         "use bf16 or fp16")


def _spec(model: str, size: str, num_layers: int | None, config: ModelConfig | None) -> Spec:
    """model_spec, or the layout of an explicit (e.g. reduced-layer) config."""
    if config is None:
        return model_spec(model, size, num_layers)
    if isinstance(config, type(model_config(model))):
        return config_spec(config)
    raise ValueError(f"config {type(config).__name__} does not apply to {model!r}")


def _entries(model: str, fmt: str, name: str, shape: tuple, dtype: torch.dtype) -> Spec:
    """The file entries (name, shape, dtype) of one source tensor in format ``fmt``."""
    linear = is_linear_weight(model, name, shape)
    if fmt == "bf16":
        return [(name, shape, dtype)]
    if fmt == "fp8":
        return [(name, shape, FP8 if linear else dtype)]
    if fmt == "fp16" or not linear:
        return [(name, shape, torch.float16)]
    layer = name[: -len(".weight")]
    entries = [(name, shape, FP8), (f"{layer}.scale_weight", (), torch.float32)]
    if model in _DIFFUSION:
        entries.append((f"{layer}.scale_input", (), torch.float32))
    return entries


def _plan(model: str, size: str, fmt: str, num_layers: int | None,
          config: ModelConfig | None = None) -> tuple[Spec, Spec]:
    """(file layout, source tensors): each source tensor becomes one or more file entries (_entries)."""
    _check_args(model, size, fmt)
    sources = list(_spec(model, size, num_layers, config))
    layout = [e for name, shape, dtype in sources for e in _entries(model, fmt, name, shape, dtype)]
    extras: Spec = [("scaled_fp8", (0,), FP8)] if fmt == "fp8_scaled" else []
    if model == "umt5_xxl_enc":
        extras.append(("spiece_model", (len(umt5_tokenizer_bytes()),), torch.uint8))
    return layout + extras, sources + extras


def file_layout(model: str, size: str = "tiny", fmt: str = "bf16", num_layers: int | None = None) -> Spec:
    """(name, shape, dtype) of every tensor `write_synthetic` puts in the file, in file order."""
    return _plan(model, size, fmt, num_layers)[0]


def _make_group(model: str, fmt: str, src: tuple[str, tuple, torch.dtype], seed: int, device: torch.device,
                pool: ThreadPoolExecutor | None, zeros: tuple[str, ...] = ()) -> Group:
    """The file entries of one source tensor; a tensor named by ``zeros`` is a meta tensor (shape and dtype, no
    data) that the writer stores as zeros without writing them."""
    name, shape, dtype = src
    if name == "scaled_fp8":
        return [(name, torch.empty(0, dtype=FP8, device=device))]
    if name == "spiece_model":
        return [(name, torch.frombuffer(bytearray(umt5_tokenizer_bytes()), dtype=torch.uint8).to(device))]
    if zeros and name.startswith(zeros):
        w = torch.empty(shape, dtype=dtype, device="meta")
    else:
        w = synthetic_tensor(name, shape, dtype, seed, device, pool)
    entries = _entries(model, fmt, name, shape, dtype)
    if len(entries) == 1:
        return [(name, w.to(entries[0][2]))]
    one = torch.ones((), dtype=torch.float32, device=device)
    # zeros: any scale dequantizes them to zeros; 1 keeps the layer's arithmetic ordinary
    q, scale = (w.to(FP8), one) if w.is_meta else quantize_fp8_scaled(w)
    return [(name, q), (entries[1][0], scale), *((e[0], one) for e in entries[2:])]


def _iter_groups(
    model: str, size: str, fmt: str, seed: int, device: str | torch.device, num_layers: int | None,
    pool: ThreadPoolExecutor | None, config: ModelConfig | None = None, zeros: tuple[str, ...] = (),
) -> Iterator[Group]:
    _, sources = _plan(model, size, fmt, num_layers, config)
    dev = torch.device(device)
    for src in sources:
        yield _make_group(model, fmt, src, seed, dev, pool, zeros)


def synthetic_state_dict(
    model: str,
    size: str = "tiny",
    fmt: str = "bf16",
    seed: int = 0,
    device: str | torch.device = "cpu",
    num_layers: int | None = None,
) -> dict[str, torch.Tensor]:
    """The whole synthetic checkpoint in memory (same tensors `write_synthetic` writes), on `device`."""
    sd: dict[str, torch.Tensor] = {}
    for group in _iter_groups(model, size, fmt, seed, device, num_layers, None):
        sd.update(group)
    return sd


# streaming writer


class _Progress:
    """tqdm when installed, else a one-line stderr meter updated at most once a second."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.total, self.desc, self.enabled, self.done = total, desc, enabled, 0
        self._bar = None
        self._t0 = self._last = time.monotonic()
        self._finished = False
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024)
            except ImportError:
                pass

    def update(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last >= 1.0 or (self.done >= self.total and not self._finished):
            self._finished = self.done >= self.total
            self._last = now
            rate = self.done / max(now - self._t0, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else 0.0
            print(f"\r{self.desc}: {self.done / 1e9:7.2f}/{self.total / 1e9:.2f} GB  {rate / 1e9:5.2f} GB/s  "
                  f"ETA {eta:5.0f} s", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            print(file=sys.stderr, flush=True)


def default_filename(model: str, size: str = "tiny", fmt: str = "bf16") -> str:
    """File name `write_synthetic` callers use by default: `synth_<model>_<size>_<fmt>.safetensors`."""
    return f"synth_{model}_{size}_{fmt}.safetensors"


def write_synthetic(
    model: str,
    path: str | Path,
    size: str = "tiny",
    fmt: str = "bf16",
    seed: int = 0,
    device: str | torch.device = "cpu",
    progress: bool = False,
    num_layers: int | None = None,
    threads: int | None = None,
    config: ModelConfig | None = None,
    metadata: dict[str, str] | None = None,
    zeros: tuple[str, ...] = (),
) -> Path:
    """Write a synthetic checkpoint tensor by tensor (RAM ~ a few tensors, never the model); returns the path.

    Generation runs on `device` ("cuda" is fastest) with `threads` CPU workers per tensor (default: all
    cores) while a writer thread drains finished tensors to disk, at most two tensors ahead. `config` (a
    UMT5Config / Qwen25VLConfig / QwenImageConfig) writes a file with other sizes, e.g. 2 layers for fast tests.
    ``metadata``: more header metadata entries (the runner stamps its tiny layout version). ``zeros``: name
    prefixes of tensors that are all zeros, skipped over rather than written (a sparse file: no disk space).
    """
    layout, _ = _plan(model, size, fmt, num_layers, config)
    metadata = {**(metadata or {}), SYNTHETIC_KEY: SYNTHETIC_MARK, "model": model, "size": size, "format": fmt,
                "seed": str(seed)}
    dev = torch.device(device)
    n_threads = threads or (torch.get_num_threads() if dev.type == "cpu" else 1)
    bar = _Progress(spec_nbytes(layout), f"{model} {size} {fmt}", progress)
    todo: queue.Queue[Group | None] = queue.Queue(maxsize=2)
    failure: list[BaseException] = []

    def drain(writer: StreamingSafetensorsWriter) -> None:
        try:
            while (group := todo.get()) is not None:
                for name, t in group:
                    if t.is_meta:
                        writer.write_zeros(name)
                    else:
                        writer.write(name, t)
                    bar.update(t.numel() * t.element_size())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the producer
            failure.append(exc)
            while todo.get() is not None:  # unblock the producer
                pass

    # an earlier synthetic file is replaced; a user's file or a link at that name is not
    writer = StreamingSafetensorsWriter(path, layout, metadata, owned=written_with(SYNTHETIC_KEY, SYNTHETIC_MARK))
    thread = threading.Thread(target=drain, args=(writer,), name="synth-writer", daemon=True)
    thread.start()
    ok = False
    try:
        with ThreadPoolExecutor(max_workers=n_threads) if n_threads > 1 else contextlib.nullcontext() as pool:
            for group in _iter_groups(model, size, fmt, seed, dev, num_layers, pool, config, zeros):
                if failure:
                    break
                todo.put([(n, t if t.is_meta else t.to("cpu")) for n, t in group])
        ok = not failure
    finally:
        todo.put(None)
        thread.join()
        bar.close()
        if ok and not failure:
            out = writer.close()
        else:
            writer.abort()
    if failure:
        raise failure[0]
    return out


# CLI


def _describe() -> str:
    lines = [f"{'model':16} {'folder':17} {'full GB (bf16)':>15} {'tiny MB (bf16)':>15}"]
    for m in MODELS:
        full = spec_nbytes(file_layout(m, "full", "bf16")) / 1e9
        tiny = spec_nbytes(file_layout(m, "tiny", "bf16")) / 1e6
        lines.append(f"{m:16} {MODEL_FOLDER[m]:17} {full:15.2f} {tiny:15.1f}")
    from .tiny import tiny_text_encoder_config

    reduced = []
    for m in ("umt5_xxl_enc", "qwen25_vl_7b"):
        config = tiny_text_encoder_config(m)
        reduced.append(f"{m} {spec_nbytes(_plan(m, 'tiny', 'bf16', None, config)[0]) / 1e6:.1f} MB")
    lines.append("(`run --synthetic tiny` writes 2-layer encoders for the pack's streaming text nodes, which read "
                 f"their sizes from the file: {', '.join(reduced)} bf16; the Wan 2.2 VAE becomes wan22_tae)")
    return "\n".join(lines)


def _check_options(p: argparse.ArgumentParser, args: argparse.Namespace, models: list[str]) -> None:
    """Refuse (argparse's usage error, exit code 2) what no write could use: unknown names, counts below 1, a device
    torch cannot name."""
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"unknown model {', '.join(map(repr, unknown))}; choose from {', '.join(MODELS)} (or 'all')")
    for option, value in (("--layers", args.layers), ("--threads", args.threads)):
        if value is not None and value < 1:
            p.error(f"{option} {value}: give a count of 1 or more")
    try:
        torch.device(args.device)
    except (RuntimeError, ValueError):
        p.error(f"--device {args.device!r}: not a device torch knows; give cpu or cuda (cuda:N)")


def cli(argv: list[str]) -> int:
    """`python -m comfyui_lowvram_dit synth ...`: write synthetic checkpoints; returns the exit code."""
    p = argparse.ArgumentParser(
        prog="python -m comfyui_lowvram_dit synth",
        description="Write synthetic checkpoints with the exact keys/shapes of the real releases.",
    )
    p.add_argument("models", nargs="*", help=f"model names or 'all': {', '.join(MODELS)}")
    p.add_argument("--size", choices=SIZES, default="tiny", help="full = real size; tiny = few blocks, small width")
    p.add_argument("--format", dest="fmt", choices=FORMATS, default="bf16", help="weight format of the file")
    p.add_argument("--out", default=".", help="output folder (file names synth_<model>_<size>_<format>.safetensors)")
    p.add_argument("--output", help="exact output file (one model only)")
    p.add_argument("--comfy-layout", action="store_true",
                   help="write into <out>/<folder> (diffusion_models, text_encoders, vae) like ComfyUI's models dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda generates much faster)")
    p.add_argument("--layers", type=int, default=None, help="override the number of DiT blocks")
    p.add_argument("--threads", type=int, default=None, help="CPU generator threads (default: torch threads)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--list", action="store_true", help="list the models and their sizes, then exit")
    args = p.parse_args(argv)
    if args.list:
        print(_describe())
        return 0
    models = list(MODELS) if args.models == ["all"] else args.models
    if not models:
        p.print_usage(sys.stderr)
        print("error: name at least one model (or 'all'; --list shows them)", file=sys.stderr)
        return 2
    if args.output and len(models) != 1:
        print("error: --output takes exactly one model; use --out DIR for several", file=sys.stderr)
        return 2
    _check_options(p, args, models)
    try:
        for m in models:
            if args.output:
                path = Path(args.output)
            else:
                folder = Path(args.out) / MODEL_FOLDER[m] if args.comfy_layout and m in MODEL_FOLDER else Path(args.out)
                path = folder / default_filename(m, args.size, args.fmt)
            t0 = time.monotonic()
            out = write_synthetic(m, path, args.size, args.fmt, args.seed, args.device, not args.no_progress,
                                  args.layers, args.threads)
            dt = time.monotonic() - t0
            size = out.stat().st_size
            print(f"{out}  {size / 1e9:.3f} GB  {dt:.1f} s  {size / 1e9 / max(dt, 1e-9):.2f} GB/s")
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
