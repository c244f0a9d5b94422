"""Positive and negative Qwen-Image conditioning that ComfyUI can sample as one batch of two.

ComfyUI runs cond and uncond in one model call only when their conditioning tensors have one shape
(``comfy.conds.CONDRegular.can_concat``); a Qwen-Image prompt and its negative almost never have the same token count,
so every step makes two calls. One call of two samples costs the CPU's issuing once, where a step is bound by it
(docs/benchmarks.md, Qwen-Image), and copies each streamed block once. The shorter
prompts' text tokens are zero-padded to the longest and masked by ``attention_mask`` (1 = token, 0 = padding), which
ComfyUI's Qwen-Image turns into -inf on those keys in every block: no token attends to the padding, so the output is
that of the unpadded prompt (``TEXT_MASK`` checks exactly that on a tiny model).

A mask costs every call that carries it: ComfyUI's Qwen-Image builds the joint mask in each block, and attention
takes its masked path (no FlashAttention, no 8-bit kernel). Where a sampler call holds only prompts that lost no token
(cfg 1 samples the positive alone, and the positive is usually the longer prompt), ``SkipUnneededMask`` hands the
call its conditioning without the mask: the same attention, unmasked.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from . import behaviour
from .log import say_once
from .seams import Probe

log = logging.getLogger("comfyui_lowvram_dit")

MASK = "attention_mask"
SKIP_KEY = "lowvram_dit_qwen_unneeded_mask"
_ALL_VALID: dict[int, bool] = {}  # id of a live mask tensor -> it masks nothing (read once per tensor)
# What makes padded prompts exact; an option's own probes, not a node's seams (0.8.0 lacks them: batch_cfg stays off)
TEXT_MASK = (Probe("comfy.ldm.qwen_image.model:QwenImageTransformer2DModel", behaviour.qwen_image_text_mask),
             Probe("comfy.model_base:QwenImage", behaviour.qwen_image_mask_cond))


def text_lengths(*conds: list) -> list[int]:
    """The text token count of every entry of each CONDITIONING, in order."""
    return [int(emb.shape[1]) for cond in conds for emb, _ in cond]


def padded(cond: list, length: int) -> list:
    """``cond`` with each entry's text tokens zero-padded to ``length`` and masked; its dicts copied, never changed."""
    out = []
    for emb, extras in cond:
        n = int(emb.shape[1])
        if n > length:
            raise ValueError(f"padded: a prompt of {n} text tokens does not fit {length}")
        mask = extras.get(MASK)
        if mask is None:
            mask = torch.ones(emb.shape[0], n, dtype=torch.long, device=emb.device)
        masked_out = torch.finfo(mask.dtype).min if mask.is_floating_point() else 0  # additive or 1/0 masks
        extra: dict[str, Any] = {**extras, MASK: torch.nn.functional.pad(mask, (0, length - n), value=masked_out)}
        out.append([torch.nn.functional.pad(emb, (0, 0, 0, length - n)), extra])
    return out


def one_batch(positive: list, negative: list) -> tuple[list, list]:
    """``positive`` and ``negative`` padded to one text length (unchanged where they already share one)."""
    lengths = text_lengths(positive, negative)
    if len(set(lengths)) <= 1:
        return positive, negative
    return padded(positive, max(lengths)), padded(negative, max(lengths))


def batched_conditioning(positive: list, negative: list) -> tuple[list, list]:
    """``one_batch`` where this ComfyUI masks Qwen-Image text tokens; elsewhere both unchanged, said once."""
    if missing := [p.describe() for p in TEXT_MASK if not p.ok()]:
        say_once(log, "lowvram_dit Qwen-Image: batch_cfg not applied (each prompt runs its own model call): this "
                      f"ComfyUI's Qwen-Image has no text mask ({'; '.join(missing)})")
        return positive, negative
    if len(set(lengths := text_lengths(positive, negative))) > 1:
        log.info("lowvram_dit Qwen-Image: prompts of %s text tokens padded to %d (masked) so that cond and uncond "
                 "can run as one batch", " / ".join(map(str, lengths)), max(lengths))
    return one_batch(positive, negative)


def masks_nothing(mask: torch.Tensor) -> bool:
    """True where ``mask`` keeps every text token: a 1/0 mask of ones, or an additive mask of zeros. Read once per
    tensor (a sampler's conditioning keeps its tensors across steps), so a GPU mask syncs once, not every step."""
    known = _ALL_VALID.get(id(mask))
    if known is None:
        known = _ALL_VALID[id(mask)] = bool((mask == 0).all() if mask.is_floating_point() else mask.bool().all())
        weakref.finalize(mask, _ALL_VALID.pop, id(mask), None)  # its id may name another tensor later
    return known


def without_unneeded_masks(conds: list) -> list:
    """``conds`` (calc_cond_batch's [cond, uncond] lists of entries) without their text masks where every mask among
    them keeps every token; else ``conds`` itself (a padded prompt needs its mask, and the others keep theirs so that
    they still batch with it)."""
    masks = [x["model_conds"][MASK].cond for cond in conds if cond is not None for x in cond
             if MASK in x.get("model_conds", {})]
    if not masks or not all(masks_nothing(m) for m in masks):
        return conds
    return [None if cond is None else [{**x, "model_conds": {k: v for k, v in x.get("model_conds", {}).items()
                                                             if k != MASK}} for x in cond] for cond in conds]


class SkipUnneededMask:
    """CALC_COND_BATCH wrapper: the sampler call's conditioning without text masks that mask nothing."""

    def __deepcopy__(self, memo: dict) -> SkipUnneededMask:
        return self  # stateless

    def __call__(self, executor, model, conds, x_in, timestep, model_options):  # noqa: ANN001, ANN204
        return executor(model, without_unneeded_masks(conds), x_in, timestep, model_options)


def skip_unneeded_masks(patcher: Any) -> Any:
    """Give ``patcher`` (a Qwen-Image ModelPatcher) the ``SkipUnneededMask`` wrapper, once; returns it."""
    import comfy.patcher_extension as pe

    patcher.remove_wrappers_with_key(pe.WrappersMP.CALC_COND_BATCH, SKIP_KEY)
    patcher.add_wrapper_with_key(pe.WrappersMP.CALC_COND_BATCH, SKIP_KEY, SkipUnneededMask())
    return patcher
