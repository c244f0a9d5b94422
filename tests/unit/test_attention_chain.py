"""The attention override composition without ComfyUI: another override runs first and falls back to the pack's,
which falls back to ComfyUI's function; the pack's own part is found and replaced, the other one kept."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from comfyui_lowvram_dit.host.attention import (
    AttentionOverride, ChainedOverride, describe_override, foreign_part, pack_owned,
)


def _comfy_func(calls: list) -> Any:
    """ComfyUI's attention function as an override receives it: [B, L, H*D] in and out, keyword heads."""
    def attention_pytorch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, mask: Any = None,
                          **kwargs: Any) -> torch.Tensor:
        calls.append(kwargs.get("_inside_attn_wrapper"))
        b, n, inner = q.shape
        qh, kh, vh = (t.view(b, -1, heads, inner // heads).transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(qh, kh, vh).transpose(1, 2).reshape(b, n, inner)
    return attention_pytorch


def test_the_other_override_runs_first_and_falls_back_to_the_pack() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 2 * 16, generator=g) for n in (24, 24, 8))
    seen: list = []

    def other(func: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, **kwargs: Any) -> Any:
        seen.append(getattr(func, "__name__", None))
        if q.shape[1] != k.shape[1]:  # takes self-attention only: cross-attention goes to its fallback
            return func(q, k, v, heads, **kwargs)
        return torch.zeros_like(q)

    comfy_calls: list = []
    chained = ChainedOverride(other, AttentionOverride("sdpa_math"))
    kwargs = {"heads": 2, "_inside_attn_wrapper": True, "transformer_options": {}}
    assert torch.equal(chained(_comfy_func(comfy_calls), q, k, k, **kwargs), torch.zeros_like(q))
    out = chained(_comfy_func(comfy_calls), q, k[:, :8], v, **kwargs)
    torch.testing.assert_close(out, _comfy_func([])(q, k[:, :8], v, 2), rtol=1e-5, atol=1e-5)
    assert seen == ["lowvram_dit sdpa_math"] * 2 and comfy_calls == []  # the pack ran it, not ComfyUI's function
    odd = chained(_comfy_func(comfy_calls), q, k[:, :8, :16], v[:, :, :16], **kwargs)  # a layout the pack leaves
    assert odd.shape == q.shape and comfy_calls == [True]  # ... to ComfyUI, still inside its wrapper


def test_foreign_part_and_description() -> None:
    def other(func: Any, *args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    ours = AttentionOverride("sdpa_math")
    assert foreign_part(None) is None and foreign_part(ours) is None
    assert foreign_part(other) is other and foreign_part(ChainedOverride(other, ours)) is other
    assert pack_owned(ours) and pack_owned(ChainedOverride(other, ours)) and not pack_owned(other)
    assert describe_override(other) == f"{__name__}.test_foreign_part_and_description"
    assert repr(ChainedOverride(other, ours)) == (f"ChainedOverride({__name__}.test_foreign_part_and_description -> "
                                                  "AttentionOverride('sdpa_math'))")
