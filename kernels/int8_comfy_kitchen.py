"""comfy-kitchen's kernels as optional candidates: its INT8 attention, its Sol-Attn sparse attention, its int8 linear.

ComfyUI ships comfy-kitchen (pip ``comfy-kitchen``). From MIN_VERSION on its ``int8_attention`` rotates Q and K
with a block Hadamard transform before quantizing, keeps the softmax in fp32 and quantizes P unsigned, and
``int8_linear`` quantizes activations per row. Where it is installed at MIN_VERSION or newer,
kernels/attention_backends.py registers its attention (a candidate of ``auto``, and a named choice) and Sol-Attn
(an explicit, approximate choice), and kernels/int8_choice.py times its int8 linear against the pack's GEMMs. A
missing, older or broken comfy-kitchen changes nothing and says so in one log line.

Never imports ComfyUI; comfy-kitchen itself is imported on first use only.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import re
from types import ModuleType
from typing import Optional

import torch

log = logging.getLogger("comfyui_lowvram_dit")

MIN_VERSION = (0, 2, 40)
DISTRIBUTION = "comfy-kitchen"
SOL_ATTN_LABEL = "comfy-kitchen sol_attn (approximate)"
# For the node's tooltip and docs: measured with comfy-kitchen 0.2.40's eager reference at its default threshold,
# 4,096 tokens, vs fp32 attention (tests/unit/test_int8_comfy_kitchen.py checks both ends).
SOL_ATTN_NOTE = ("comfy-kitchen's Sol-Attn attends a routed subset of key blocks exactly and pools the rest: about "
                 "0.2 % error on locally smooth inputs, 17-93 % on unstructured ones (the synthetic test families); "
                 "self-attention only (cross-attention falls back), and dropped when the first call's error is over "
                 "15 %")


def parse_version(text: str) -> tuple[int, ...]:
    """'0.2.40' -> (0, 2, 40); a suffix ('0.2.41rc1', '0.2.40+cu130') ends the number it is on."""
    return tuple(int(m.group(1)) for m in (re.match(r"(\d+)", part) for part in text.split(".")[:3]) if m)


def installed_version() -> Optional[str]:
    """The installed comfy-kitchen version, or None where it is not installed."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def _load() -> tuple[Optional[ModuleType], str]:
    """(comfy_kitchen, "") when a new enough one imports, else (None, why not); says why once in the log."""
    version = installed_version()
    if version is None:
        why = f"{DISTRIBUTION} is not installed"
    elif parse_version(version) < MIN_VERSION:
        why = f"{DISTRIBUTION} {version} is older than {'.'.join(map(str, MIN_VERSION))}"
    else:
        try:
            return importlib.import_module("comfy_kitchen"), ""
        except (Exception, SystemExit) as exc:  # a broken install (ABI mismatch) is as good as missing
            why = f"{DISTRIBUTION} {version} does not import ({type(exc).__name__}: {exc})"
    log.info("lowvram_dit: %s; its INT8 attention, Sol-Attn and int8 linear are not candidates "
             "(pip install -U '%s>=%s' to add them)", why, DISTRIBUTION, ".".join(map(str, MIN_VERSION)))
    return None, why


def module() -> Optional[ModuleType]:
    """comfy_kitchen where MIN_VERSION or newer imports, else None (the reason is logged once)."""
    return _load()[0]


def missing_reason() -> Optional[str]:
    """Why comfy-kitchen's kernels cannot be used here, or None when they can."""
    return _load()[1] or None


def forget() -> None:
    """Look for comfy-kitchen again on the next call (tests, and after an install)."""
    _load.cache_clear()


def attention_reason(device: torch.device, dtype: torch.dtype, head_dim: int, sparse: bool = False) -> Optional[str]:
    """Why comfy-kitchen's INT8 attention (or Sol-Attn with ``sparse``) cannot run these inputs, or None."""
    ck = module()
    if ck is None:
        return missing_reason()
    if device.type != "cuda":
        return "needs a CUDA GPU"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"needs fp16/bf16, got {dtype}"
    if sparse:
        if head_dim != 128:
            return f"Sol-Attn takes head dim 128 only, got {head_dim}"
        return None if ck.sol_attn_is_available(device) else "comfy_kitchen.sol_attn_is_available() is False here"
    if head_dim > 256:
        return f"head size {head_dim} unsupported (<= 256)"
    return None if ck.int8_attention_is_available(device) else \
        "comfy_kitchen.int8_attention_is_available() is False here"


def int8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """comfy_kitchen.int8_attention on [B, H, L, D] views (it needs the last dim contiguous)."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return module().int8_attention(q, k, v, attn_mask=mask)


def sol_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """comfy_kitchen.sol_attn (self-attention only: q, k, v of one shape) on [B, H, L, D] views."""
    if q.shape != k.shape or k.shape != v.shape:
        raise ValueError(f"comfy-kitchen sol_attn takes self-attention only (q, k, v of one shape), got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}; use another backend for cross-attention")
    if mask is not None:
        raise ValueError("comfy-kitchen sol_attn takes no attention mask here; use another backend")
    out = module().sol_attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def int8_linear(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor],
                out_dtype: torch.dtype, rotate: bool) -> torch.Tensor:
    """The pack's int8 linear (kernels/int8.py: per-token int8 activations, per-channel int8 weight) through
    comfy_kitchen.int8_linear: with ``rotate`` the activation is rotated as the pack's weight was first, so both
    quantize the same numbers."""
    from . import int8

    k = weight_q.shape[1]
    x2 = x.reshape(-1, k)
    if rotate:  # the pack's block Hadamard (ConvRot's is another matrix), in fp32 as the pack's quantizer keeps it
        x2 = int8.rotate_blocks(x2)
    out = module().int8_linear(x2, weight_q, weight_scale.float().reshape(-1), bias, out_dtype=out_dtype)
    return out.reshape(*x.shape[:-1], weight_q.shape[0])
