"""benchmarks/bench_attention_int8.py on CPU: arguments, the per-family error table, unavailable rival backends."""

from __future__ import annotations

import pytest
import torch
from comfyui_lowvram_dit.benchmarks import bench_attention_int8 as B
from comfyui_lowvram_dit.kernels import attention_int8 as A


def test_arguments_name_known_shapes_backends_and_families() -> None:
    args = B.parse_args(["--shapes", "wan14b_480p_self", "wan14b_720p_self", "--families", "--no-sweep"])
    assert args.shapes == ["wan14b_480p_self", "wan14b_720p_self"] and args.families == []
    assert args.backends == list(B.BACKENDS) and "comfy_kitchen_int8" in args.backends
    assert B.parse_args(["--families", "wan_like", "gauss"]).families == ["wan_like", "gauss"]
    assert B.parse_args([]).families is None  # no family errors unless asked
    for bad in (["--families", "nope"], ["--shapes", "wan_1080p"], ["--backends", "sage"]):
        with pytest.raises(SystemExit):
            B.parse_args(bad)


def test_family_errors_and_their_table() -> None:
    """The emulation as a backend on a tiny shape: one row per family, failures and skips become notes."""
    def broken(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no kernel for this")

    fns = {"int8_fp8": A.attention_int8_reference, "int8_fp16": broken}
    skipped = {"comfy_kitchen_int8": "comfy_kitchen does not import: ModuleNotFoundError"}
    rows = B.family_errors("wan14b_480p_self", (1, 4, 256, 256, 128), fns, skipped,
                           ["q_channel_outliers", "k_token_outliers"], device="cpu")
    assert [r["family"] for r in rows] == ["q_channel_outliers", "k_token_outliers"]
    assert 0 < rows[0]["errors"]["int8_fp8"] < 0.03 < rows[1]["errors"]["int8_fp8"]
    assert "no kernel for this" in rows[0]["notes"]["int8_fp16"] and "int8_fp16" not in rows[0]["errors"]
    assert len(rows[0]["logit_std"]) == 4
    md = "\n".join(B.families_markdown(rows, ("sdpa_cudnn", "int8_fp8", "int8_fp16", "comfy_kitchen_int8")))
    assert "| family | logit std per head | int8_fp8 |" in md  # only backends with numbers get a column
    assert f"| k_token_outliers | {rows[1]['logit_std']} | **{rows[1]['errors']['int8_fp8']:.2%}** |" in md
    err = rows[0]["errors"]["int8_fp8"]
    cell = f"**{err:.2%}**" if err > B.ERROR_BUDGET else f"{err:.2%}"
    assert f"| q_channel_outliers | {rows[0]['logit_std']} | {cell} |" in md
    assert "- comfy_kitchen_int8: comfy_kitchen does not import" in md and "- int8_fp16: RuntimeError" in md


def test_rivals_without_a_gpu_are_skipped_with_a_reason() -> None:
    if torch.cuda.is_available():
        pytest.skip("on a GPU the rivals may run")
    for name in B.RIVALS:
        with pytest.raises(B.BackendUnavailable) as info:
            B.backend_fn(name)
        assert str(info.value)
    row = B.measure("comfy_kitchen_int8", (1, 1, 128, 128, 64), 1, 0)
    assert row["skipped"] and "error" not in row and "time_ms" not in row
