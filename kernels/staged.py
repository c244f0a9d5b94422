"""Staged loading helpers (plain torch, no ComfyUI): streaming state-dict loading, Qwen-Image transformer reading
with fp8 quantization, and per-stage time/memory accounting (the embedding cache is kernels/embedding_cache.py).

Used by nodes/qwen_staged.py, which runs a Qwen-Image pipeline in three stages so that no two of its large
parts are in RAM at once: (1) the Qwen2.5-VL text encoder on the CPU, streamed from its file into the model
one module at a time and freed after encoding (only the embeddings survive; they are cached on disk),
(2) the 20B transformer as fp8 with block swap, (3) the VAE decode on the GPU after the transformer left it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from .checkpoint_io import (MADV_DONTNEED, CheckpointError, SafetensorsHeader, advise_mapped, check_ranks,
                            read_header, read_tensors, to_device_or_cpu)
from .wan_checkpoint import FP8_DTYPES, quantize_weight

log = logging.getLogger("comfyui_lowvram_dit")

ProgressFn = Callable[[int, int], None]
QuantMode = Literal["none", "per_tensor", "blockwise"]
GIB = float(1 << 30)

# ----------------------------------------------------------------------------------------------------------
# Stage accounting


def current_rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc; psutil elsewhere; 0 if neither works)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001 - accounting must never break a load
        return 0


def release_host_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc malloc_trim), so RSS really falls."""
    gc.collect()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, Windows, musl): the allocator decides
        pass


@dataclass
class StageReport:
    """Time and memory of one stage. VRAM peaks are None when CUDA was not used."""

    name: str
    seconds: float = 0.0
    rss_start: int = 0
    rss_end: int = 0
    rss_peak: int = 0  # sampled every ``interval`` s, so a spike shorter than that can be missed
    vram_peak: int | None = None  # torch.cuda.max_memory_allocated at the end (process peak unless reset)
    vram_end: int | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict (bytes as GiB, rounded)."""
        g = lambda b: None if b is None else round(b / GIB, 3)  # noqa: E731
        return {"stage": self.name, "seconds": round(self.seconds, 3), "rss_start_gib": g(self.rss_start),
                "rss_end_gib": g(self.rss_end), "rss_peak_gib": g(self.rss_peak), "vram_peak_gib": g(self.vram_peak),
                "vram_end_gib": g(self.vram_end), "notes": list(self.notes)}

    def format(self) -> str:
        """One log line: time, RSS start -> end (peak), VRAM peak/end."""
        s = (f"{self.name}: {self.seconds:.2f} s, RSS {self.rss_start / GIB:.2f} -> {self.rss_end / GIB:.2f} GiB "
             f"(peak {self.rss_peak / GIB:.2f} GiB)")
        if self.vram_peak is not None:
            s += f", VRAM peak {self.vram_peak / GIB:.2f} GiB, now {self.vram_end / GIB:.2f} GiB"
        if self.notes:
            s += "; " + "; ".join(self.notes)
        return s


class StageMeter:
    """Context manager measuring one stage: wall time, RSS (start, end, sampled peak) and CUDA memory.

    ``reset_cuda_peak`` resets torch's peak counters at the start (benchmarks do; nodes don't, because that
    would hide an earlier peak from whoever else reads the counters in this process).
    """

    def __init__(self, name: str, *, interval: float = 0.01, reset_cuda_peak: bool = False,
                 device: torch.device | None = None) -> None:
        self.report = StageReport(name)
        self._interval = interval
        self._reset = reset_cuda_peak
        self._device = device
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def _cuda(self) -> bool:
        dev = self._device
        return torch.cuda.is_available() and torch.cuda.is_initialized() and (dev is None or dev.type == "cuda")

    def _sample(self) -> None:
        while not self._stop.wait(self._interval):
            self.report.rss_peak = max(self.report.rss_peak, current_rss_bytes())

    def __enter__(self) -> StageMeter:
        if self._reset and self._cuda():
            torch.cuda.reset_peak_memory_stats(self._device)
        self.report.rss_start = self.report.rss_peak = current_rss_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="lowvram-dit-rss")
        self._thread.start()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._cuda():
            torch.cuda.synchronize(self._device)
        self.report.seconds = time.perf_counter() - self._t0
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.report.rss_end = current_rss_bytes()
        self.report.rss_peak = max(self.report.rss_peak, self.report.rss_end)
        if self._cuda():
            self.report.vram_peak = int(torch.cuda.max_memory_allocated(self._device))
            self.report.vram_end = int(torch.cuda.memory_allocated(self._device))


# ----------------------------------------------------------------------------------------------------------
# Streaming a state dict into an existing module, one owning module at a time

SMALL_TENSOR_BYTES = 1 << 16  # scales, norms, biases: read up front (they are ~0.1 % of a text encoder)
_SCALE_SUFFIXES = (".scale_weight", ".weight_scale", ".scale_input", ".input_scale", ".comfy_quant",
                   ".scale_weight_tensor")


def owner_of(key: str) -> str:
    """The module path that owns parameter/buffer ``key`` ("model.layers.3.mlp.up_proj.weight" -> "...up_proj")."""
    return key.rpartition(".")[0]


def small_tensor_names(header: SafetensorsHeader) -> list[str]:
    """Names read before streaming: tensors <= 64 KiB, every scale/marker, in file order."""
    return [n for n, i in header.tensors.items() if i.nbytes <= SMALL_TENSOR_BYTES or n.endswith(_SCALE_SUFFIXES)]


@dataclass
class StreamStats:
    """What a streaming load read: bytes, tensors, and the most bytes it held at once (the RAM overhead)."""

    bytes_read: int = 0
    tensors: int = 0
    groups: int = 0
    max_held_bytes: int = 0


def iter_owner_groups(
    header: SafetensorsHeader,
    small: dict[str, torch.Tensor],
    *,
    skip: Callable[[str], bool] | None = None,
    progress: ProgressFn | None = None,
    stats: StreamStats | None = None,
    prefetch: bool = True,
    already_read: Iterable[str] = (),
    mmap: bool = False,
) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """Yield ``(owner, {param_name: tensor})`` for every owning module, as soon as all its tensors are read.

    ``small`` holds the already-read (and possibly renamed, e.g. by ComfyUI's ``convert_old_quants``) small
    tensors, keyed by full name; every other tensor in the file is read once, in file order, and released
    when its group is yielded, so the RAM overhead is about one module's weights (the largest is the
    embedding table). ``already_read`` names file tensors that ``small`` holds under other names (renamed
    scales); they are not read again. Keys for which ``skip`` is true are neither read nor yielded.

    ``mmap``: the streamed tensors are views of a file mapping instead of copies read into RAM (one memory
    pass less: the consumer copies straight out of the page cache). Once the consumer asks for the next group,
    the previous group's pages are dropped from this process (MADV_DONTNEED; the page cache stays warm), so
    they never add up in RSS. The consumer must copy, not keep, the tensors it is given.
    """
    stats = stats if stats is not None else StreamStats()
    keep = (lambda n: not skip(n)) if skip is not None else (lambda n: True)
    done = set(already_read)
    big = [n for n in header.tensors if n not in small and n not in done and keep(n)]
    expected: dict[str, set[str]] = {}
    for n in [*small, *big]:
        if keep(n):
            expected.setdefault(owner_of(n), set()).add(n)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    held = 0
    total = sum(header.tensors[n].nbytes for n in big)

    held_by: dict[str, int] = {}  # bytes of streamed (not small) tensors waiting in each pending group

    def add(name: str, t: torch.Tensor, streamed: bool) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        nonlocal held
        owner = owner_of(name)
        group = pending.setdefault(owner, {})
        group[name] = t
        if streamed:
            n = t.numel() * t.element_size()
            held += n
            held_by[owner] = held_by.get(owner, 0) + n
            stats.max_held_bytes = max(stats.max_held_bytes, held)
        if len(group) == len(expected[owner]):
            del pending[owner]
            held -= held_by.pop(owner, 0)
            stats.groups += 1
            prefix = len(owner) + 1 if owner else 0
            yield owner, {k[prefix:]: v for k, v in group.items()}
            if mmap:  # consumed: its mapped pages leave RSS (small tensors are private copies, never mapped)
                advise_mapped([v for k, v in group.items() if k not in small], MADV_DONTNEED)

    # Groups made only of small tensors (norms, biases of skipped weights...) go first.
    big_owners = {owner_of(n) for n in big}
    for name, t in small.items():
        if keep(name) and owner_of(name) not in big_owners:
            yield from add(name, t, streamed=False)
    for name, t in small.items():
        if keep(name) and owner_of(name) in big_owners:
            pending.setdefault(owner_of(name), {})[name] = t
    for name, t in read_tensors(header, big, mmap=mmap, prefetch=prefetch):
        stats.bytes_read += t.numel() * t.element_size()
        stats.tensors += 1
        yield from add(name, t, streamed=True)
        if progress:
            progress(stats.bytes_read, total)
    if pending:
        raise CheckpointError(f"{header.path.name}: incomplete module(s) {sorted(pending)[:4]} after reading the file")


def load_streaming(
    root: torch.nn.Module,
    groups: Iterable[tuple[str, dict[str, torch.Tensor]]],
) -> list[str]:
    """Load each ``(owner, tensors)`` group into ``root.get_submodule(owner)``; returns the full keys loaded.

    Each call goes through the module's own ``load_state_dict`` (so custom ops, e.g. ComfyUI's mixed-precision
    Linear, see exactly the keys they would in a full load). Unknown owners or unexpected keys raise.
    """
    loaded: list[str] = []
    for owner, tensors in groups:
        try:
            module = root.get_submodule(owner) if owner else root
        except AttributeError:
            raise CheckpointError(f"the file has tensors for {owner!r}, which this model does not have "
                                  f"({sorted(tensors)[:3]}); it is not the model the loader expects") from None
        result = module.load_state_dict(tensors, strict=False)
        if result.unexpected_keys:
            raise CheckpointError(f"{owner}: unexpected tensors {result.unexpected_keys} for "
                                  f"{type(module).__name__}; the file does not match the model")
        loaded += [f"{owner}.{k}" if owner else k for k in tensors]
    return loaded


# ----------------------------------------------------------------------------------------------------------
# Qwen2.5-VL text encoder: config from the file

TE_HEAD_DIM = 128  # Qwen2.5-VL-7B head_dim (HF config; ComfyUI llama.Qwen25_7BVLI_Config.head_dim)
_TE_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def qwen25_vl_config_from_header(header: SafetensorsHeader) -> dict[str, int]:
    """Language-model sizes read from the file's shapes, in ComfyUI's ``Qwen25_7BVLI_Config`` field names.

    For the released 7B file these equal ComfyUI's defaults; passing them lets smaller files of the same
    architecture (the tests' synthetic encoder) load with the right shapes instead of half-initialised.
    """
    t = header.tensors
    need = ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.bias",
            "model.layers.0.mlp.gate_proj.weight")
    missing = [k for k in need if k not in t]
    if missing:
        raise CheckpointError(
            f"{header.path.name}: not a Qwen2.5-VL text encoder (missing {', '.join(missing)}); Qwen-Image needs "
            "qwen_2.5_vl_7b.safetensors or qwen_2.5_vl_7b_fp8_scaled.safetensors in models/text_encoders")
    check_ranks(header, dict(zip(need, (2, 1, 2, 2, 1, 2))), "Qwen2.5-VL text encoder")
    layers = sorted({int(m.group(1)) for k in t if (m := _TE_LAYER.match(k))})
    return {
        "vocab_size": t["model.embed_tokens.weight"].shape[0],
        "hidden_size": t["model.norm.weight"].shape[0],
        "intermediate_size": t["model.layers.0.mlp.gate_proj.weight"].shape[0],
        "num_hidden_layers": len(layers),
        "num_attention_heads": t["model.layers.0.self_attn.q_proj.weight"].shape[0] // TE_HEAD_DIM,
        "num_key_value_heads": t["model.layers.0.self_attn.k_proj.weight"].shape[0] // TE_HEAD_DIM,
    }


def text_encoder_format(header: SafetensorsHeader) -> str:
    """"comfy_quant", "fp8_scaled" (legacy ComfyUI marker), "fp8" (plain cast) or the norm dtype ("bfloat16")."""
    if "_quantization_metadata" in header.metadata or any(k.endswith(".comfy_quant") for k in header.tensors):
        return "comfy_quant"
    if "scaled_fp8" in header.tensors:
        return "fp8_scaled"
    if any(i.dtype in FP8_DTYPES for i in header.tensors.values()):
        return "fp8"
    norm = header.tensors.get("model.norm.weight", header.tensors.get("encoder.final_layer_norm.weight"))
    return str(norm.dtype).removeprefix("torch.") if norm is not None else "unknown"


# ----------------------------------------------------------------------------------------------------------
# umT5-XXL text encoder (Wan): config from the file

_UMT5_BLOCK = re.compile(r"encoder\.block\.(\d+)\.")


def umt5_config_from_header(header: SafetensorsHeader) -> dict[str, int]:
    """Encoder sizes read from the file's shapes, in ComfyUI's ``umt5_config_xxl.json`` field names.

    For the released umT5-XXL file these equal ComfyUI's fixed config (24 layers, d_model 4096, d_ff 10240,
    64 heads x 64, vocab 256384); reading them lets reduced-layer files of the same architecture load.
    """
    t = header.tensors
    need = ("shared.weight", "encoder.final_layer_norm.weight", "encoder.block.0.layer.0.SelfAttention.q.weight",
            "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            "encoder.block.0.layer.1.DenseReluDense.wi_0.weight", "encoder.block.0.layer.1.DenseReluDense.wi_1.weight")
    missing = [k for k in need if k not in t]
    if missing:
        raise CheckpointError(
            f"{header.path.name}: not a umT5 text encoder (missing {', '.join(missing)}); Wan needs "
            "umt5_xxl_fp16.safetensors or umt5_xxl_fp8_e4m3fn_scaled.safetensors in models/text_encoders")
    check_ranks(header, dict.fromkeys(need, 2) | {"encoder.final_layer_norm.weight": 1}, "umT5 text encoder")
    layers = sorted({int(m.group(1)) for k in t if (m := _UMT5_BLOCK.match(k))})
    if layers != list(range(len(layers))):
        raise CheckpointError(f"{header.path.name}: encoder blocks are not numbered 0..{len(layers) - 1}")
    if len(layers) > 1 and "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight" not in t:
        raise CheckpointError(f"{header.path.name}: a T5 encoder (one shared position bias), not umT5 (one per "
                              "layer); Wan needs umT5-XXL")
    heads = t["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"].shape[1]
    return {
        "num_layers": len(layers),
        "d_model": t["shared.weight"].shape[1],
        "d_ff": t["encoder.block.0.layer.1.DenseReluDense.wi_0.weight"].shape[0],
        "num_heads": heads,
        "d_kv": t["encoder.block.0.layer.0.SelfAttention.q.weight"].shape[0] // heads,
        "vocab_size": t["shared.weight"].shape[0],
    }


# ----------------------------------------------------------------------------------------------------------
# Qwen-Image transformer: inspection and streaming read (fp8 quantization on the way)

_QWEN_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.", "")
_QWEN_BLOCK = re.compile(r"transformer_blocks\.(\d+)\.")


@dataclass(frozen=True)
class QwenImageInfo:
    """What a Qwen-Image transformer file is."""

    path: Path
    prefix: str
    num_blocks: int
    format: str  # "high_precision" | "fp8_plain" | "comfy_fp8_scaled" | "comfy_quant"
    weight_dtype: torch.dtype  # dtype of the block Linear weights in the file


def is_qwen_fp8_target(key: str, shape: tuple[int, ...]) -> bool:
    """Keys quantized from high precision: 2-D Linear weights inside ``transformer_blocks.N.`` (attention
    projections, MLPs and the img/txt modulation Linears, 99.8 % of the 20.4 B weights; embeddings, norms,
    the time embedder and the output projection stay bf16, as in the Wan loader)."""
    return len(shape) == 2 and key.endswith(".weight") and _QWEN_BLOCK.match(key) is not None


def inspect_qwen_image(header: SafetensorsHeader) -> QwenImageInfo:
    """Detect a Qwen-Image transformer (ComfyUI/diffusers key names); CheckpointError with a hint otherwise."""
    names = list(header.tensors)
    prefix = next((p for p in _QWEN_PREFIXES if f"{p}txt_norm.weight" in header.tensors), None)
    if prefix is None or f"{prefix}transformer_blocks.0.img_mod.1.weight" not in header.tensors:
        hint = ""
        if any(".self_attn." in n and "blocks." in n for n in names[:2000]):
            hint = " It looks like a Wan model; use the Wan loader."
        elif "model.embed_tokens.weight" in header.tensors:
            hint = " It is a text encoder; select it as clip_name."
        raise CheckpointError(f"{header.path.name}: not a Qwen-Image transformer (no txt_norm.weight / "
                              f"transformer_blocks.0.img_mod.1.weight).{hint}")
    check_ranks(header, {f"{prefix}transformer_blocks.0.img_mod.1.weight": 2}, "Qwen-Image transformer")
    t = {n[len(prefix):]: i for n, i in header.tensors.items() if n.startswith(prefix)}
    blocks = sorted({int(m.group(1)) for k in t if (m := _QWEN_BLOCK.match(k))})
    if blocks != list(range(len(blocks))):
        raise CheckpointError(f"{header.path.name}: transformer_blocks are not numbered 0..{len(blocks) - 1}")
    lin = [i for k, i in t.items() if is_qwen_fp8_target(k, i.shape)]
    weight_dtype = max({i.dtype for i in lin}, key=lambda d: sum(i.nbytes for i in lin if i.dtype == d))
    if "_quantization_metadata" in header.metadata or any(k.endswith(".comfy_quant") for k in t):
        fmt = "comfy_quant"
    elif "scaled_fp8" in t:
        fmt = "comfy_fp8_scaled"
    elif weight_dtype in FP8_DTYPES:
        fmt = "fp8_plain"
    else:
        fmt = "high_precision"
    return QwenImageInfo(header.path, prefix, len(blocks), fmt, weight_dtype)


def load_qwen_image_state_dict(
    path: str | Path,
    mode: QuantMode = "blockwise",
    block_size: int = 128,
    *,
    device: str | torch.device | None = None,
    progress: ProgressFn | None = None,
    mmap: bool = False,
) -> tuple[dict[str, torch.Tensor], QwenImageInfo, QuantMode]:
    """Read a Qwen-Image file tensor by tensor into the in-memory fp8 form nodes/glue/fp8_ops.py loads.

    High-precision files: block Linear weights are quantized to ``mode`` while streaming (on ``device``,
    e.g. the GPU), everything else is kept. fp8 files keep their per-tensor quantization (re-quantizing fp8
    codes only adds error): legacy ``scale_weight`` becomes ``weight_scale``, a missing scale means 1.0
    (nodes/glue/fp8_ops.py fills it), markers and unit input scales are dropped. Returns (state dict without the
    key prefix, file info, the quantization now in the dict). ``mmap``: an fp8 file's tensors are zero-copy
    views of the file (checkpoint_io.map_tensors: page cache, not RSS); a file quantized here is read as usual.
    """
    if mode not in ("none", "per_tensor", "blockwise"):
        raise ValueError(f"quantization mode must be none, per_tensor or blockwise, got {mode!r}")
    header = read_header(path)
    info = inspect_qwen_image(header)
    qdev = torch.device(device) if device is not None else torch.device("cpu")
    strip = len(info.prefix)
    small_names = small_tensor_names(header)
    mapped = mmap and info.format != "high_precision"  # a file quantized here is read as copies
    small = {n[strip:]: v for n, v in read_tensors(header, small_names, mmap=mapped)}
    small_set = set(small_names)
    big = [n for n in header.tensors if n not in small_set]
    sd: dict[str, torch.Tensor] = {}
    quantize = info.format == "high_precision" and mode != "none"
    out_mode: QuantMode = mode if quantize else ("per_tensor" if info.format != "high_precision" else "none")

    def put(key: str, v: torch.Tensor) -> None:
        if key == "scaled_fp8" or key.endswith((".comfy_quant", ".scale_weight_tensor")):
            return
        if key.endswith((".scale_input", ".input_scale")):
            if bool((v.float() != 1.0).any()):
                log.info("lowvram_dit: %s: static activation scale %s ignored (activations are quantized per call)",
                         header.path.name, key)
            return
        if key.endswith(".scale_weight"):
            key = key[: -len("scale_weight")] + "weight_scale"
        if quantize and is_qwen_fp8_target(key, tuple(v.shape)):
            q, s = quantize_weight(to_device_or_cpu(v, qdev), mode, block_size)
            sd[key], sd[key[: -len("weight")] + "weight_scale"] = q.cpu(), s.cpu()
            return
        sd[key] = v

    for k, v in small.items():
        put(k, v)
    total = sum(header.tensors[n].nbytes for n in big)
    done = 0
    for raw, v in read_tensors(header, big, mmap=mapped, prefetch=True):
        put(raw[strip:], v)
        done += header.tensors[raw].nbytes
        if progress:
            progress(done, total)
    return sd, info, out_mode
