"""Positive and negative Qwen-Image conditioning that ComfyUI can sample as one batch of two.

ComfyUI runs cond and uncond in one model call only when their conditioning tensors have one shape
(``comfy.conds.CONDRegular.can_concat``); a Qwen-Image prompt and its negative almost never have the same token count,
so every step makes two calls. One call of two samples costs the CPU's issuing once, where a step is bound by it
(docs/benchmarks.md, Qwen-Image), and copies each streamed block once. The shorter
prompts' text tokens are zero-padded to the longest and masked by ``attention_mask`` (1 = token, 0 = padding), which
ComfyUI's Qwen-Image turns into -inf on those keys in every block: no token attends to the padding, so the output is
that of the unpadded prompt (``TEXT_MASK`` checks exactly that on a tiny model).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from . import behaviour
from .log import say_once
from .seams import Probe

log = logging.getLogger("comfyui_lowvram_dit")

MASK = "attention_mask"
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
