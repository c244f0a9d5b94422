"""Text encoders built with ComfyUI's own classes and streamed from their files, with an embedding cache.

One ``StreamedTextEncoder`` describes an encoder (umT5-XXL for Wan in host/wan_text.py, Qwen2.5-VL for Qwen-Image
in host/qwen_stages.py): how ComfyUI detects and builds it, where its tokenizer comes from, which model option
takes the sizes read from the file, and which weights a text prompt never needs. ``build_streaming`` makes the
``comfy.sd.CLIP`` that CLIPLoader would make, with an empty state dict, then streams the weights in one module at
a time (checkpoints/streaming.py): ``load_clip`` maps the whole file and copies it, so RSS briefly holds two copies.
``encode_prompts`` encodes as CLIPTextEncode does, from the cache where it can; the encoder is kept for the next
prompt where ComfyUI's DynamicVRAM manages it, as CLIPLoader's is (mapped from its file, host/kept_text_encoders.py),
and freed after otherwise.
Cache keys hold the prompt, the template or tokenizer, and the encoder's identity (content fingerprint, format,
dtype, config, ComfyUI version).
"""

from __future__ import annotations

import inspect
import logging
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoints import streaming
from ..checkpoints.embedding_cache import embedding_cache_key, file_identity
from ..checkpoints.safetensors_io import (
    CheckpointError, MapHook, SafetensorsHeader, check_quantization, iter_tensors, read_header,
)
from ..checkpoints.text_encoders import text_encoder_format
from ..offload import stage_meter
from . import kept_text_encoders
from .file_slices import file_slice_hook
from .files import embedding_cache, use_mmap
from .patchers import dynamic_vram_manages
from .version import comfyui_version

log = logging.getLogger("comfyui_lowvram_dit")


@dataclass(frozen=True)
class StreamedTextEncoder:
    """What differs between the text encoders the pack streams; everything else is shared."""

    label: str  # log lines: "Wan text encoder"
    kind: str  # error messages: "umT5-XXL"
    norm_key: str  # a norm weight whose dtype is the file's precision (cache key)
    width_key: str  # config key of the embedding width (cached entries are checked against it)
    layers_key: str  # config key of the layer count (log line)
    config_option: str  # model_options key ComfyUI's encoder reads the sizes from
    config_from_header: Callable[[SafetensorsHeader], dict[str, int]]
    build_target: Callable[[dict[str, torch.Tensor], str], Any]  # (meta/small probe, file name) -> CLIP target
    cache_context: Callable[[], str]  # tokenizer class / prompt template: part of the cache key
    tokenizer_key: str | None = None  # a tensor of the file that is tokenizer data, not a weight
    optional_prefixes: tuple[str, ...] = ()  # weights text prompts never run: missing ones only warn
    check: Callable[[SafetensorsHeader, dict[str, int]], None] | None = None  # encoder-specific file checks


def check_file(enc: StreamedTextEncoder, te_path: str | Path) -> tuple[SafetensorsHeader, dict[str, int]]:
    """The encoder file's header and sizes, checked before any stage runs (a file of another architecture, bad
    ranks, encoder-specific checks); CheckpointError naming the file otherwise."""
    header = read_header(te_path)
    cfg = enc.config_from_header(header)
    if enc.check is not None:
        enc.check(header, cfg)
    if enc.norm_key not in header.tensors:
        raise CheckpointError(f"{header.path.name}: not a {enc.kind} text encoder (missing {enc.norm_key})")
    return header, cfg


DEVICES = ("auto", "cpu", "gpu")  # the text encoder nodes' device choices (resolve_device)
CPU = torch.device("cpu")
FREED = "encoder freed"  # the stage report: encoder_for built an encoder the caller frees after encoding
NOT_LOADED = "encoder not loaded"  # the stage report: every prompt came from the embedding cache


def resolve_device(choice: str, option: str = "device") -> torch.device:
    """Where a text encoder runs: ``auto`` = where ComfyUI runs text encoders (its CLIPTextEncode: the GPU unless
    launched with --cpu or a low-VRAM mode, the CPU then); ``cpu``; ``gpu`` = ComfyUI's torch device."""
    import comfy.model_management as mm

    if choice not in DEVICES:
        raise ValueError(f"{option}: {choice!r} is not one of {list(DEVICES)}")
    if choice == "cpu":
        return CPU
    device = mm.text_encoder_device() if choice == "auto" else mm.get_torch_device()
    if choice == "gpu" and device.type == "cpu":
        raise ValueError(f"{option} = gpu, but ComfyUI runs on the CPU here (no GPU, or --cpu): pick auto or cpu")
    return device


def encoder_identity(enc: StreamedTextEncoder, te_path: str | Path, device: torch.device = CPU) -> dict:
    """Everything about the encoder file that changes embeddings, readable without loading it (cache key part):
    the device type too, as a GPU's kernels round differently from the CPU's."""
    header, cfg = check_file(enc, te_path)
    return {"sha256": file_identity(te_path), "format": text_encoder_format(header),
            "dtype": str(header.tensors[enc.norm_key].dtype).removeprefix("torch."),
            "config": cfg, "device": device.type, "comfyui": (comfyui_version() or "unknown"),
            "file": Path(te_path).name}


def build_streaming(enc: StreamedTextEncoder, te_path: str | Path, progress: streaming.ProgressFn | None = None,
                    device: torch.device = CPU) -> Any:  # comfy.sd.CLIP
    """A ``comfy.sd.CLIP`` for ``enc``'s file (what CLIPLoader builds), its weights streamed into RAM; it encodes on
    ``device`` (a GPU: ComfyUI's model management loads it there to encode, as it loads CLIPLoader's)."""
    import comfy.sd
    import comfy.utils
    import folder_paths

    name = Path(te_path).name
    header, cfg = check_file(enc, te_path)
    check_quantization(header)  # ComfyUI would parse it later, without naming the file
    is_tokenizer = lambda n: n == enc.tokenizer_key  # noqa: E731
    small_names = [n for n in streaming.small_tensor_names(header) if not is_tokenizer(n)]
    # ComfyUI's own legacy scaled-fp8 conversion (scale_weight -> weight_scale + comfy_quant), on small tensors only.
    small, _ = comfy.utils.convert_old_quants(dict(iter_tensors(header, small_names)), "", header.metadata)
    tokenizer_data = {} if enc.tokenizer_key is None else dict(iter_tensors(header, [enc.tokenizer_key]))
    raw_small = set(small_names)
    probe = {n: torch.empty(i.shape, dtype=i.dtype, device="meta") for n, i in header.tensors.items()
             if n not in raw_small and not is_tokenizer(n)}
    probe.update(small)
    target = enc.build_target(probe, name)
    del probe
    cpu = torch.device("cpu")
    hook, patcher_kind = _dynamic_vram_hook(te_path, device)
    # initial_device "cpu:0" builds the model on the CPU like "cpu" does, but compares unequal to a CPU load_device,
    # so CLIP.__init__ skips its load_models_gpu call: that call sizes the model through state_dict(), which an fp8
    # (mixed-precision) Linear cannot produce before its weight is loaded. Encoding loads it as usual. A mapped
    # encoder (it runs on a GPU) is built on "cpu": ComfyUI's ops then take each view as it is ("cpu:0" copies it).
    options = {"load_device": device, "offload_device": cpu, "initial_device": cpu if hook else torch.device("cpu", 0),
               enc.config_option: cfg}
    clip = comfy.sd.CLIP(target, embedding_directory=folder_paths.get_folder_paths("embeddings"),
                         tokenizer_data=tokenizer_data, parameters=0, state_dict=[], model_options=options,
                         **patcher_kind)
    csm = clip.cond_stage_model
    transformer = getattr(csm, csm.clip).transformer
    _leave_out_absent_parts(enc, name, header, transformer)
    stats = streaming.StreamStats()
    groups = streaming.iter_owner_groups(header, small, skip=is_tokenizer, progress=progress, stats=stats,
                                         already_read=raw_small, mmap=hook is not None or use_mmap(), on_map=hook)
    with torch.no_grad():  # mapped views are taken as they are (ComfyUI's assign for DynamicVRAM models), not copied
        loaded = set(streaming.load_streaming(transformer, groups, assign=hook is not None))
    _check_complete(enc, name, [n for n, _ in transformer.named_parameters() if n not in loaded])
    how = ("mapped from its file for DynamicVRAM" if hook is not None else
           f"streamed to the CPU: {stats.bytes_read / 1e9:.2f} GB read in {stats.groups} modules, at most "
           f"{stats.max_held_bytes / 1e9:.2f} GB held besides the model")
    log.info("lowvram_dit %s %s %s (format %s, %d layers); encodes on %s", enc.label, name, how,
             text_encoder_format(header), cfg[enc.layers_key], device)
    return clip


def _dynamic_vram_hook(te_path: str | Path, device: torch.device) -> tuple[MapHook | None, dict]:
    """How the encoder is held: where ComfyUI's DynamicVRAM would manage it (a GPU, comfy-aimdo on), as CLIPLoader's
    is, on views of its file tagged for aimdo's reader (the hook tags them) and ComfyUI's dynamic patcher; elsewhere
    in RAM under the legacy patcher (``disable_dynamic``, where this ComfyUI has it), which moves the weights to the
    GPU and back, as aimdo's pinned copies would be a second copy of RAM weights."""
    import comfy.sd

    if "disable_dynamic" not in inspect.signature(comfy.sd.CLIP).parameters:
        return None, {}  # ComfyUI before DynamicVRAM
    hook = file_slice_hook(te_path) if device.type != "cpu" else None
    return hook, ({} if hook is not None else {"disable_dynamic": True})


class AbsentPart(torch.nn.Module):
    """Stands in for a part of the encoder the file does not have (no weights, so nothing to size or load); running
    it is an error that names the file."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise CheckpointError(self.message)


def _leave_out_absent_parts(enc: StreamedTextEncoder, name: str, header: SafetensorsHeader, transformer: Any) -> None:
    """Replace each ``optional_prefixes`` submodule the file has no weight of at all by an ``AbsentPart``.

    ComfyUI builds them anyway (Qwen2.5-VL's vision tower: 0.67 B parameters); left unloaded, an fp8 (mixed
    precision) Linear has no weight and ComfyUI cannot size the model for loading. Text prompts never run them."""
    for prefix in enc.optional_prefixes:
        attr = prefix.rstrip(".")
        if any(n.startswith(prefix) for n in header.tensors) or "." in attr or not hasattr(transformer, attr):
            continue
        setattr(transformer, attr, AbsentPart(f"{name} has no {attr} weights; this {enc.kind} file can encode text "
                                              "prompts only (image inputs need a file with them)"))
        log.info("lowvram_dit: %s has no %s weights: left out (text prompts do not use them)", name, attr)


def _check_complete(enc: StreamedTextEncoder, name: str, missing: list[str]) -> None:
    """CheckpointError for missing weights; weights of ``optional_prefixes`` only warn, as load_clip does."""
    optional = [n for n in missing if n.startswith(enc.optional_prefixes)] if enc.optional_prefixes else []
    if optional:
        log.warning("lowvram_dit: %s lacks %d weights text prompts do not use (%s...)", name, len(optional),
                    optional[0])
    missing = [n for n in missing if n not in set(optional)]
    if missing:
        raise CheckpointError(f"{name}: the file lacks {len(missing)} {enc.kind} weights ({missing[:3]}...); it is "
                              f"damaged or not {enc.kind}")


def encode_prompts(enc: StreamedTextEncoder, te_path: str | Path, prompts: list[str], *, stage: str,
                   use_cache: bool = True, reset_cuda_peak: bool = False,
                   device: torch.device = CPU) -> tuple[list[list], Any]:
    """CONDITIONING (as CLIPTextEncode returns it) per prompt, from the cache or an encoder run on ``device``
    (``encoder_for``: kept or freed after); and the stage's ``StageReport``."""
    import comfy.model_management as mm
    import comfy.utils

    cache = embedding_cache() if use_cache else None
    meter = stage_meter.StageMeter(stage, reset_cuda_peak=reset_cuda_peak)
    with meter:
        keys: list[str | None] = [None] * len(prompts)
        out: list[list | None] = [None] * len(prompts)
        if cache is not None:
            ident = encoder_identity(enc, te_path, device)
            context = enc.cache_context()
            for i, p in enumerate(prompts):
                keys[i] = embedding_cache_key(p, context, ident)
                out[i] = cache.get(keys[i], expect_dim=ident["config"][enc.width_key])
        todo = [i for i, c in enumerate(out) if c is None]
        fate = NOT_LOADED
        if todo:
            bar = comfy.utils.ProgressBar(1000 + 1000 * len(todo))
            clip, fate = encoder_for(enc, te_path, device,
                                     lambda d, t: bar.update_absolute(int(1000 * d / max(t, 1))))
            for n, i in enumerate(todo):
                out[i] = clip.encode_from_tokens_scheduled(clip.tokenize(prompts[i]))
                bar.update_absolute(1000 + 1000 * (n + 1))
                if cache is not None:
                    cache.put(keys[i], out[i], info={"encoder": Path(te_path).name})
            del clip
            if fate == FREED:
                mm.cleanup_models_gc()
                stage_meter.release_host_memory()
        meter.report.notes.append(f"{len(prompts) - len(todo)} of {len(prompts)} prompts from the embedding cache, "
                                  + fate)
    return out, meter.report  # type: ignore[return-value]


def encoder_for(enc: StreamedTextEncoder, te_path: str | Path, device: torch.device,
                progress: streaming.ProgressFn | None = None) -> tuple[Any, str]:
    """The ``comfy.sd.CLIP`` that encodes a prompt with ``enc``'s file on ``device``, and its fate for the stage
    report: the one kept from an earlier prompt, or one built now and kept where ComfyUI's DynamicVRAM manages it
    (host/kept_text_encoders.py), or one built now that the caller frees after encoding (``FREED``)."""
    key = kept_text_encoders.key_of(te_path, device)
    clip = kept_text_encoders.take(enc.label, key)
    if clip is not None:
        return clip, "encoder kept from an earlier prompt"
    clip = build_streaming(enc, te_path, progress, device)
    if not dynamic_vram_manages(clip.patcher):
        return clip, FREED
    kept_text_encoders.keep(enc.label, key, clip)
    return clip, "encoder kept for the next prompt (DynamicVRAM manages it, as CLIPLoader's)"


def clip_target(encoder_class: Any, tokenizer_class: Any) -> Any:
    """What ``load_text_encoder_state_dicts`` hands to ``comfy.sd.CLIP`` (params, encoder class, tokenizer)."""
    return types.SimpleNamespace(params={}, clip=encoder_class, tokenizer=tokenizer_class)
