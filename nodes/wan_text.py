"""Wan text encoding on the CPU without a second copy of umT5-XXL in RAM, with an on-disk embedding cache.

``LowVRAM_WanTextEncode`` gives the positive and negative CONDITIONING that stock ``CLIPLoader(type=wan)`` +
``CLIPTextEncode`` give (bit-equal on the CPU for the released file: same ComfyUI classes, same dtype, same
tokenizer), but:
- the encoder is built with ComfyUI's own classes (``comfy.text_encoders.wan.te``, ``WanT5Tokenizer``,
  ``sd3_clip.t5_xxl_detect``, ``convert_old_quants``, ``comfy.sd.CLIP``) with an empty state dict, and its weights
  are streamed from the file one module at a time (kernels.staged): ``load_clip`` maps the whole file and
  copies it into the model, so the fp16 encoder (11.4 GB) briefly costs twice that in RSS;
- it runs on the CPU and never takes VRAM; it is freed as soon as the prompts are encoded;
- embeddings are cached on disk (user directory), keyed by prompt, tokenizer and encoder identity (content
  fingerprint, format, dtype, config, ComfyUI version): an unchanged prompt does not load the encoder at all.
The layer count and widths are read from the file, so reduced-layer files of the same architecture load too.
"""

from __future__ import annotations

import functools
import logging
import types
from pathlib import Path

import torch
from comfy_api.latest import io

from ..kernels import staged
from ..kernels.embedding_cache import embedding_cache_key
from ..kernels.checkpoint_io import CheckpointError, check_quantization, iter_tensors, read_header
from .glue.common import (CATEGORY_LOADERS, display_name, embedding_cache, file_fingerprint, node_id,
                      text_encoder_identity, use_mmap)
from .glue.seams import DISABLE

log = logging.getLogger("comfyui_lowvram_dit")

WAN_TEXT_DIM = 4096  # Wan's text_embedding input width (ComfyUI wan detection fixes text_dim = 4096)
_TOKENIZER_KEY = "spiece_model"  # the umT5 sentencepiece model ComfyUI's Wan tokenizer reads from the file


@functools.cache
def _tokenizer_id() -> str:
    """The tokenizer class (part of the cache key; its sentencepiece model is covered by the file hash)."""
    from comfy.text_encoders import wan

    return f"{wan.WanT5Tokenizer.__module__}.{wan.WanT5Tokenizer.__qualname__}"


def encoder_identity(te_path: str | Path) -> dict:
    """Everything about the encoder that changes embeddings, readable without loading it (cache key part)."""
    header = read_header(te_path)
    return text_encoder_identity(te_path, header, "encoder.final_layer_norm.weight",
                                 staged.umt5_config_from_header(header))


def build_umt5_streaming(te_path: str | Path, progress: staged.ProgressFn | None = None):
    """A CPU ``comfy.sd.CLIP`` for a umT5 file (what CLIPLoader(type=wan) builds), weights streamed in."""
    import comfy.sd
    import comfy.utils
    import folder_paths
    from comfy.text_encoders import sd3_clip, wan

    header = read_header(te_path)
    check_quantization(header)  # ComfyUI would parse it later, without naming the file
    cfg = staged.umt5_config_from_header(header)
    if cfg["d_model"] != WAN_TEXT_DIM:
        raise CheckpointError(f"{Path(te_path).name}: d_model {cfg['d_model']}, but Wan needs a {WAN_TEXT_DIM}-wide "
                              "umT5-XXL (umt5_xxl_fp16 / umt5_xxl_fp8_e4m3fn_scaled)")
    if _TOKENIZER_KEY not in header.tensors:
        raise CheckpointError(f"{Path(te_path).name}: no '{_TOKENIZER_KEY}' tensor (the tokenizer); use ComfyUI's "
                              "repackaged umt5_xxl_*.safetensors, which carry it")
    small_names = [n for n in staged.small_tensor_names(header) if n != _TOKENIZER_KEY]
    small = dict(iter_tensors(header, small_names))
    # ComfyUI's own legacy scaled-fp8 conversion (scale_weight -> weight_scale + comfy_quant), on small tensors only.
    small, _ = comfy.utils.convert_old_quants(small, "", header.metadata)
    spiece = dict(iter_tensors(header, [_TOKENIZER_KEY]))[_TOKENIZER_KEY]
    raw_small = set(small_names)
    probe = {n: torch.empty(i.shape, dtype=i.dtype, device="meta") for n, i in header.tensors.items()
             if n not in raw_small and n != _TOKENIZER_KEY}
    probe.update(small)
    # What load_text_encoder_state_dicts(clip_type=WAN) builds for T5_XXL (t5xxl_detect needs block 23, so the
    # per-file part, dtype + quantization metadata, is read with the function it delegates to).
    target = types.SimpleNamespace(params={}, clip=wan.te(**sd3_clip.t5_xxl_detect(probe)),
                                   tokenizer=wan.WanT5Tokenizer)
    del probe
    cpu = torch.device("cpu")
    # initial_device "cpu:0": built on the CPU but unequal to load_device, so CLIP.__init__ skips load_models_gpu
    # (it sizes the model through state_dict(), which an fp8 mixed-precision Linear cannot give before loading).
    options = {"load_device": cpu, "offload_device": cpu, "initial_device": torch.device("cpu", 0),
               "umt5xxl_model_config": cfg}
    clip = comfy.sd.CLIP(target, embedding_directory=folder_paths.get_folder_paths("embeddings"),
                         tokenizer_data={_TOKENIZER_KEY: spiece}, parameters=0, state_dict=[], model_options=options)
    transformer = clip.cond_stage_model.umt5xxl.transformer
    stats = staged.StreamStats()
    groups = staged.iter_owner_groups(header, small, skip=lambda n: n == _TOKENIZER_KEY, progress=progress,
                                      stats=stats, already_read=raw_small, mmap=use_mmap())
    with torch.no_grad():
        loaded = set(staged.load_streaming(transformer, groups))
    missing = [n for n, _ in transformer.named_parameters() if n not in loaded]
    if missing:
        raise CheckpointError(f"{Path(te_path).name}: the file lacks {len(missing)} umT5 weights ({missing[:3]}...); "
                              "it is damaged or not umT5-XXL")
    log.info("lowvram_dit Wan text encoder %s streamed to the CPU: %.2f GB read in %d modules, at most %.2f GB held "
             "besides the model (format %s, %d layers)", Path(te_path).name, stats.bytes_read / 1e9, stats.groups,
             stats.max_held_bytes / 1e9, staged.text_encoder_format(header), cfg["num_layers"])
    return clip


def encode_wan_prompts(te_path: str | Path, prompts: list[str],
                       use_cache: bool = True) -> tuple[list[list], staged.StageReport]:
    """CONDITIONING (CPU tensors, as CLIPTextEncode returns) per prompt: from the cache or a streamed encoder."""
    import comfy.model_management as mm
    import comfy.utils

    cache = embedding_cache() if use_cache else None
    meter = staged.StageMeter("Wan text encoder (CPU)")
    with meter:
        keys: list[str | None] = [None] * len(prompts)
        out: list[list | None] = [None] * len(prompts)
        if cache is not None:
            ident = encoder_identity(te_path)
            for i, p in enumerate(prompts):
                keys[i] = embedding_cache_key(p, _tokenizer_id(), ident)
                out[i] = cache.get(keys[i], expect_dim=ident["config"]["d_model"])
        todo = [i for i, c in enumerate(out) if c is None]
        if todo:
            bar = comfy.utils.ProgressBar(1000 + 1000 * len(todo))
            clip = build_umt5_streaming(te_path, lambda d, t: bar.update_absolute(int(1000 * d / max(t, 1))))
            for n, i in enumerate(todo):
                out[i] = clip.encode_from_tokens_scheduled(clip.tokenize(prompts[i]))
                bar.update_absolute(1000 + 1000 * (n + 1))
                if cache is not None:
                    cache.put(keys[i], out[i], info={"encoder": Path(te_path).name})
            del clip
            mm.cleanup_models_gc()
            staged.release_host_memory()
        meter.report.notes.append(f"{len(prompts) - len(todo)} of {len(prompts)} prompts from the embedding cache"
                                  + (", encoder freed" if todo else ", encoder not loaded"))
    log.info("lowvram_dit %s", meter.report.format())
    return out, meter.report  # type: ignore[return-value]


class WanTextEncode(io.ComfyNode):
    """umT5-XXL prompts on the CPU, streamed (one copy in RAM), freed after encoding, embeddings cached.

    Produces CONDITIONING from text (nothing to pass through): without its seams it is left out with one
    warning, and CLIPLoader(type=wan) + CLIPTextEncode remain the way to encode.
    """

    COMFY_SEAMS = ("folder_paths", "text_encoder.umt5", "model_management")
    IF_SEAMS_MISSING = DISABLE

    @classmethod
    def define_schema(cls) -> io.Schema:
        import folder_paths

        return io.Schema(
            node_id=node_id("WanTextEncode"),
            display_name=display_name("Wan Text Encode"),
            category=CATEGORY_LOADERS,
            description=(
                "Encodes the positive and negative prompts for Wan 2.1/2.2 with umT5-XXL on the CPU: the same "
                "CONDITIONING as Load CLIP (type wan) + CLIP Text Encode, but the encoder is streamed from its "
                "file (never two copies in RAM), uses no VRAM, is freed after encoding, and embeddings are cached "
                "on disk so an unchanged prompt skips the encoder."),
            inputs=[
                io.Combo.Input("clip_name", options=folder_paths.get_filename_list("text_encoders"),
                               tooltip="umT5-XXL text encoder (text_encoders): umt5_xxl_fp16 (bf16/fp16) or "
                                       "umt5_xxl_fp8_e4m3fn_scaled. Runs on the CPU; needs about its file size "
                                       "in RAM while encoding."),
                io.String.Input("positive", multiline=True, default="",
                                tooltip="Prompt (what to show)."),
                io.String.Input("negative", multiline=True, default="",
                                tooltip="Negative prompt (used when the sampler's cfg > 1)."),
                io.Boolean.Input("cache_embeddings", default=True,
                                 tooltip="Keep prompt embeddings on disk (user directory); an unchanged prompt "
                                         "skips loading the encoder. Keyed by prompt + encoder file content."),
            ],
            outputs=[io.Conditioning.Output("positive"), io.Conditioning.Output("negative")],
        )

    @classmethod
    def fingerprint_inputs(cls, clip_name: str, **kwargs) -> str:
        """Re-run when the selected file changes on disk under the same name (size/mtime)."""
        return file_fingerprint("text_encoders", clip_name)

    @classmethod
    def execute(cls, clip_name: str, positive: str, negative: str, cache_embeddings: bool = True) -> io.NodeOutput:
        import folder_paths

        te = folder_paths.get_full_path_or_raise("text_encoders", clip_name)
        (pos, neg), _ = encode_wan_prompts(te, [positive, negative], use_cache=cache_embeddings)
        return io.NodeOutput(pos, neg)


NODES = [WanTextEncode]
