"""Qwen-Image-Edit (2509 / 2511) in stages: the image-conditioned text encode, then the staged transformer.

The Edit Staged Loader returns native MODEL, positive / negative CONDITIONING (with ``reference_latents`` as
ComfyUI's TextEncodeQwenImageEditPlus sets them) and VAE, so the official templates' nodes work on them:
- VAE: loaded as VAELoader does (the reference latents need it before the transformer).
- Stage 1, text + images: ComfyUI's own ``TextEncodeQwenImageEditPlus.execute`` runs for each prompt (image resizing,
  "Picture N:" prefix, edit template, VAE-encoded reference latents, ``conditioning_set_values``). Its ``clip`` is a
  stand-in: ``tokenize`` records the request, ``encode_from_tokens_scheduled`` answers it from the embedding cache
  or from the Qwen2.5-VL encoder streamed into RAM (vision tower included; host/text_encoders.py), built on the
  first miss and run on the device the node's ``text_encoder_device`` names (ComfyUI's model management loads it
  onto a GPU as it loads CLIPLoader's; the encoder moves the reference images to its device itself). The node runs
  twice per prompt: without the VAE first (text + vision only), then the encoder is let go (text_encoders.encoder_for:
  freed, or kept for the next prompt under DynamicVRAM, whose GPU copy aimdo evicts on demand), then with the VAE, its
  encodes answered from the first pass, so the encoder and the VAE encode never hold memory at the same time. The
  prompts share their images, so the vision tower runs once per distinct image and the VAE encodes each reference
  image once (both deterministic: the same result as a run per prompt). The cache key holds the full text, the
  tokenizer arguments, a content hash of every image and the encoder identity (device type included). The
  embeddings and reference latents end on the compute device.
- Stage 2: the fp8 transformer with Block Swap (host/qwen_stages.py). A 2511 file's ``__index_timestep_zero__``
  marker is kept, so ComfyUI picks that reference method as it does for UNETLoader.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch

from ..checkpoints.embedding_cache import embedding_cache_key, tensor_digest
from ..offload import stage_meter
from ..offload.stage_meter import StageReport
from . import text_encoders
from .files import embedding_cache
from .qwen_stages import QWEN25_VL, conditioning_to

log = logging.getLogger("comfyui_lowvram_dit")

# The edit encoder is the Qwen-Image one with its vision tower required: image prompts run it.
QWEN25_VL_EDIT = dataclasses.replace(QWEN25_VL, label="Qwen-Image-Edit text encoder",
                                     optional_prefixes=())
MAX_IMAGES = 3  # TextEncodeQwenImageEditPlus takes image1..image3


@dataclasses.dataclass
class EncodeRequest:
    """What TextEncodeQwenImageEditPlus asked ``clip.tokenize`` for: text and tokenizer arguments (images too)."""

    text: str
    kwargs: dict[str, Any]


def _key_part(value: Any) -> Any:
    """A JSON-able stand-in for a tokenizer argument: tensors by content hash, containers element-wise."""
    if isinstance(value, torch.Tensor):
        return {"tensor": tensor_digest(value)}
    if isinstance(value, (list, tuple)):
        return [_key_part(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _key_part(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)


def request_key(request: EncodeRequest, identity: dict) -> str:
    """Cache key: the full text, every tokenizer argument (the edit template; images by content) and the encoder."""
    template = json.dumps({"tokenizer": QWEN25_VL_EDIT.cache_context(), "node": "TextEncodeQwenImageEditPlus",
                           "kwargs": _key_part(request.kwargs)}, sort_keys=True)
    return embedding_cache_key(request.text, template, identity)


def _call_once(memo: dict[str, Any], fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, computed once per distinct arguments (tensors by content) and kept in ``memo``; a
    tensor result is cloned, so each caller owns its copy, as with a new run."""
    key = json.dumps(_key_part([list(args), kwargs]), sort_keys=True)
    if key not in memo:
        memo[key] = fn(*args, **kwargs)
    out = memo[key]
    return out.clone() if isinstance(out, torch.Tensor) else out


MEMO_ATTR = "lowvram_dit_vision_memo"  # reuse_vision_features' memo on the vision tower it wrapped


def reuse_vision_features(visual: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Make the vision tower run once per distinct input: the positive and negative prompts carry the same images,
    and its output depends on the pixels and the patch grid only. Returns the memo, which the caller clears after its
    run (a kept encoder's tower is wrapped once; its next run gets the same memo)."""
    memo = getattr(visual, MEMO_ATTR, None)
    if memo is not None:
        return memo
    forward = visual.forward
    memo = {}
    visual.forward = lambda *args, **kwargs: _call_once(memo, forward, *args, **kwargs)
    setattr(visual, MEMO_ATTR, memo)
    return memo


class ReusedVAEEncodes:
    """The VAE handed to TextEncodeQwenImageEditPlus's second pass: ``encode`` runs once per distinct image (both
    prompts carry the same reference images); every other attribute is the VAE's own."""

    def __init__(self, vae: Any) -> None:
        self._vae = vae
        self._done: dict[str, torch.Tensor] = {}

    def encode(self, pixels: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return _call_once(self._done, self._vae.encode, pixels, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._vae, name)


class StagedEditEncoder:
    """The encoding behind the stand-in ``clip``: cache first, else the streamed encoder (built once) on ``device``."""

    def __init__(self, te_path: str | Path, use_cache: bool = True, device: torch.device = text_encoders.CPU) -> None:
        self.te_path = Path(te_path)
        self.device = device
        self.cache = embedding_cache() if use_cache else None
        self.identity = text_encoders.encoder_identity(QWEN25_VL_EDIT, te_path, device)
        self.clip: Any = None
        self.fate = text_encoders.NOT_LOADED  # or text_encoders.encoder_for's, for the stage report
        self.memo: dict[str, torch.Tensor] = {}  # the vision tower's results of this run (reuse_vision_features)
        self.done: dict[str, list] = {}  # this run's results by key: the node's second (VAE) pass reads them
        self.hits = 0
        self.misses = 0

    def encode(self, request: EncodeRequest, **kwargs: Any) -> list:
        """CONDITIONING for ``request`` (on ComfyUI's intermediate device, as CLIP.encode_from_tokens_scheduled
        returns it)."""
        key = request_key(request, self.identity) if not kwargs else None
        if key in self.done:
            return self.done[key]
        cached = None
        if self.cache is not None and key is not None:
            cached = self.cache.get(key, expect_dim=self.identity["config"][QWEN25_VL_EDIT.width_key])
        if cached is not None:
            self.hits += 1
        else:
            self.misses += 1
            cached = self._encode(request, key, **kwargs)
        if key is not None:
            self.done[key] = cached
        return cached

    def _encode(self, request: EncodeRequest, key: str | None, **kwargs: Any) -> list:
        """Run the streamed encoder (built on the first call) and store the result in the cache."""
        if self.clip is None:
            import comfy.utils

            bar = comfy.utils.ProgressBar(1000)
            self.clip, self.fate = text_encoders.encoder_for(
                QWEN25_VL_EDIT, self.te_path, self.device, lambda d, t: bar.update_absolute(int(1000 * d / max(t, 1))))
            csm = self.clip.cond_stage_model
            visual = getattr(getattr(csm, csm.clip).transformer, "visual", None)
            if isinstance(visual, torch.nn.Module):
                self.memo = reuse_vision_features(visual)
        out = self.clip.encode_from_tokens_scheduled(self.clip.tokenize(request.text, **request.kwargs), **kwargs)
        if key is not None and self.cache is not None:
            self.cache.put(key, out, info={"encoder": self.te_path.name, "images": "edit"})
        return out

    def close(self) -> None:
        """Let go of the encoder: freed (RSS falls back to what it was before stage 1) unless it is kept."""
        import comfy.model_management as mm

        self.memo.clear()  # this run's vision features
        if self.clip is not None:
            self.clip = None
            if self.fate == text_encoders.FREED:
                mm.cleanup_models_gc()
                stage_meter.release_host_memory()


class ServedClip:
    """The ``clip`` handed to ComfyUI's TextEncodeQwenImageEditPlus: tokenize records, encode is served."""

    def __init__(self, encoder: StagedEditEncoder) -> None:
        self._encoder = encoder

    def tokenize(self, text: str, **kwargs: Any) -> EncodeRequest:
        return EncodeRequest(text, kwargs)

    def encode_from_tokens_scheduled(self, tokens: EncodeRequest, **kwargs: Any) -> list:
        return self._encoder.encode(tokens, **kwargs)


def _edit_node() -> Any:
    """ComfyUI's TextEncodeQwenImageEditPlus (comfy_extras/nodes_qwen.py)."""
    from comfy_extras.nodes_qwen import TextEncodeQwenImageEditPlus

    return TextEncodeQwenImageEditPlus


def encode_edit_prompts(te_path: str | Path, prompts: list[str], images: list[torch.Tensor | None], vae: Any,
                        use_cache: bool = True, target_device: torch.device | None = None,
                        reset_cuda_peak: bool = False,
                        device: torch.device = text_encoders.CPU) -> tuple[list[list], StageReport]:
    """Stage 1 for Edit: CONDITIONING per prompt on ``target_device`` (default the compute device) exactly as
    TextEncodeQwenImageEditPlus(clip, prompt, vae, image1..3) gives it with CLIPLoader's encoder on ``device``, from
    the cache or a streamed encoder run on ``device`` (kept or freed afterwards: text_encoders.encoder_for)."""
    if len(images) > MAX_IMAGES:
        raise ValueError(f"Qwen-Image-Edit takes at most {MAX_IMAGES} reference images, got {len(images)}")
    images = list(images) + [None] * (MAX_IMAGES - len(images))
    node = _edit_node()
    meter = stage_meter.StageMeter(f"stage 1 (text + vision encoder, {device})", reset_cuda_peak=reset_cuda_peak)
    with meter:
        encoder = StagedEditEncoder(te_path, use_cache, device)
        clip = ServedClip(encoder)
        try:  # text + vision first, without the VAE: the encoder is freed before any reference latent is made
            out = [node.execute(clip, p, None, *images).args[0] for p in prompts]
        finally:
            encoder.close()
        if vae is not None:  # the node again, its encodes served from this run's results: VAE + reference_latents
            once = ReusedVAEEncodes(vae)
            out = [node.execute(clip, p, once, *images).args[0] for p in prompts]
            stage_meter.release_host_memory()
        n_img = sum(i is not None for i in images)
        meter.report.notes.append(f"{encoder.hits} of {encoder.hits + encoder.misses} prompts from the embedding "
                                  f"cache, {n_img} reference image(s), {encoder.fate}")
    if target_device is None:
        import comfy.model_management as mm

        target_device = mm.get_torch_device()
    log.info("lowvram_dit Qwen-Image %s", meter.report.format())
    return [conditioning_to(c, target_device) for c in out], meter.report
