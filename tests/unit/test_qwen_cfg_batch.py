"""The Staged Loader's batch_cfg padding: one text length for positive and negative, a mask on the padding."""

from __future__ import annotations

import torch

from comfyui_lowvram_dit.host.qwen_cfg_batch import one_batch, padded, text_lengths


def _cond(n: int, **extras: object) -> list:
    return [[torch.arange(n * 4, dtype=torch.float32).reshape(1, n, 4) + 1, {"pooled_output": None, **extras}]]


def test_the_shorter_prompt_is_padded_and_masked_the_longer_only_masked() -> None:
    pos, neg = _cond(5), _cond(2)
    p, n = one_batch(pos, neg)
    assert text_lengths(p, n) == [5, 5]
    assert torch.equal(p[0][0], pos[0][0]) and p[0][1]["attention_mask"].tolist() == [[1, 1, 1, 1, 1]]
    assert torch.equal(n[0][0][:, :2], neg[0][0]) and not n[0][0][:, 2:].any()
    assert n[0][1]["attention_mask"].tolist() == [[1, 1, 0, 0, 0]] and n[0][1]["pooled_output"] is None
    assert "attention_mask" not in neg[0][1] and neg[0][0].shape[1] == 2  # the inputs are left as they were


def test_equal_lengths_are_left_alone() -> None:
    pos, neg = _cond(3), _cond(3)
    assert one_batch(pos, neg) == (pos, neg)


def test_an_existing_mask_is_extended() -> None:
    """A 1/0 mask gains zeros; an additive float mask gains the most negative value (masked out either way)."""
    ints = padded(_cond(2, attention_mask=torch.tensor([[1, 0]])), 4)
    assert ints[0][1]["attention_mask"].tolist() == [[1, 0, 0, 0]]
    floats = padded(_cond(2, attention_mask=torch.zeros(1, 2)), 3)[0][1]["attention_mask"]
    assert floats[0, :2].tolist() == [0.0, 0.0] and floats[0, 2] == torch.finfo(torch.float32).min
