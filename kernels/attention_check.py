"""Attention accuracy check: the output against an fp32 reference on a slice of query rows.

Attention rows are independent, so the check needs the full K/V but only a few queries.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

Tensor = torch.Tensor
_CHECK_QUERY_ROWS = 256  # query rows compared per head: enough to catch a broken kernel, cheap at long sequences
_CHECK_HEADS = 2


def reference_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None) -> Tensor:
    """fp32 softmax(q k^T / sqrt(D)) v on [B, H, L, D] inputs: the accuracy reference."""
    q, k, v = q.float(), k.float(), v.float()
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    return torch.softmax(scores, dim=-1) @ v


def _slice_mask(mask: Optional[Tensor], heads: list[int], rows: Tensor) -> Optional[Tensor]:
    if mask is None:
        return None
    m = mask[:1]
    m = m[:, heads] if m.shape[1] > 1 else m
    return m[:, :, rows] if m.shape[2] > 1 else m


def check_output(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], out: Tensor) -> tuple[bool, float, str]:
    """Compare ``out`` with the fp32 reference on a slice: (finite, relative error, note)."""
    if not bool(torch.isfinite(out).all()):
        return False, float("inf"), "output has NaN/Inf"
    lq = q.shape[2]
    heads = sorted({0, q.shape[1] - 1})[:_CHECK_HEADS]
    rows = torch.linspace(0, lq - 1, min(lq, _CHECK_QUERY_ROWS), device=q.device).long().unique()
    ref = reference_attention(q[:1, heads][:, :, rows], k[:1, heads], v[:1, heads], _slice_mask(mask, heads, rows))
    if not bool(torch.isfinite(ref).all()):
        return True, 0.0, "reference not finite (inputs carry NaN/Inf); check skipped"
    got = out[:1, heads][:, :, rows].float()
    err = float((got - ref).norm() / ref.norm().clamp_min(1e-12))
    return True, err, ""
