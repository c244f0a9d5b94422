"""benchmarks/bench_attention_int8.py on CPU: arguments, unavailable rival backends."""

from __future__ import annotations

import pytest
import torch
from comfyui_lowvram_dit.benchmarks import bench_attention_int8 as B


def test_arguments_name_known_shapes_and_backends() -> None:
    args = B.parse_args(["--shapes", "wan14b_480p_self", "wan14b_720p_self", "--no-sweep"])
    assert args.shapes == ["wan14b_480p_self", "wan14b_720p_self"] and args.no_sweep
    assert args.backends == list(B.BACKENDS) and "comfy_kitchen_int8" in args.backends
    for bad in (["--shapes", "wan_1080p"], ["--backends", "sage"]):
        with pytest.raises(SystemExit):
            B.parse_args(bad)


def test_rivals_without_a_gpu_are_skipped_with_a_reason() -> None:
    if torch.cuda.is_available():
        pytest.skip("on a GPU the rivals may run")
    for name in B.RIVALS:
        with pytest.raises(B.BackendUnavailable) as info:
            B.backend_fn(name)
        assert str(info.value)
    row = B.measure("comfy_kitchen_int8", (1, 1, 128, 128, 64), 1, 0)
    assert row["skipped"] and "error" not in row and "time_ms" not in row
