"""The first-step benchmark's CPU-side parts: path switch, decision timing, Dynamo split, caches, report."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from comfyui_lowvram_dit.benchmarks import bench_first_step as bfs
from comfyui_lowvram_dit.kernels import attention as attn
from comfyui_lowvram_dit.kernels import compile as cmp
from comfyui_lowvram_dit.kernels import opaque_ops


def test_public_text_keeps_no_machine_path() -> None:
    assert bfs.public_text("break at /home/u/ComfyUI/comfy/ldm/wan/model.py:84 in forward") == \
        "break at model.py:84 in forward"
    assert bfs.public_text("C:\\Users\\u\\ComfyUI\\model.py:3") == "model.py:3"
    assert bfs.public_text("unsupported GPU/dtype/head size") == "unsupported GPU/dtype/head size"


def test_old_path_switches_both_changes_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(opaque_ops, "OPAQUE_UNDER_COMPILE", True)
    monkeypatch.setattr(cmp, "contiguous_hidden_states", cmp.contiguous_hidden_states)
    bfs.use_path("new")
    assert opaque_ops.OPAQUE_UNDER_COMPILE
    bfs.use_path("old")
    assert not opaque_ops.OPAQUE_UNDER_COMPILE
    assert cmp.contiguous_hidden_states(None, (torch.ones(3, 2).t(),)) is None
    with pytest.raises(ValueError, match="path 'older'"):
        bfs.use_path("older")


def test_nowarm_path_turns_the_8bit_warmup_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from comfyui_lowvram_dit.kernels import attention_int8

    real = attention_int8.start_warmup
    monkeypatch.setattr(attention_int8, "start_warmup", real)
    monkeypatch.setattr(attention_int8, "is_supported", lambda *args: True)
    monkeypatch.setattr(attention_int8, "_WARMUPS", {})
    bfs.use_path("new_nowarm")
    assert attention_int8.start_warmup is not real
    assert attention_int8.start_warmup("cpu", torch.bfloat16, 40, 128) is None and attention_int8._WARMUPS == {}
    assert bfs.VARIANTS["nowarm_cold"] == ("new_nowarm", True, "nowarm")


def test_decision_timer_counts_the_selectors_first_decision_only(monkeypatch: pytest.MonkeyPatch) -> None:
    with attn.isolated_selector() as sel:
        timer = bfs.DecisionTimer(cuda=False)
        timer.wrap(sel, "_decide_and_run", "attention")
        q = torch.randn(1, 2, 16, 8)
        for _ in range(3):
            sel.run(q, q, q, None, "auto")
        snap = timer.snapshot()
    assert snap["attention_calls"] == 1 and snap["attention_s"] >= 0
    assert "triton_jit_s" in snap and snap["not_measured"] == []


def test_dynamo_split_counts_graphs_breaks_and_frames() -> None:
    torch._dynamo.reset()
    import torch._dynamo.utils as du

    du.clear_compilation_metrics()
    du.counters.clear()

    @torch.compiler.disable
    def opaque(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    fn = torch.compile(lambda x: opaque(x + 1) - 1, backend="eager")
    fn(torch.ones(4))
    split = bfs.dynamo_split()
    assert split["graphs"] == 2 and split["graph_breaks"] == 1 and split["frames"] >= 2
    assert split["dynamo_s"] >= 0 and any("disable" in r for r in split["break_reasons"])


def test_warm_variants_reuse_their_groups_caches(tmp_path: Path) -> None:
    used: set[str] = set()
    env_old, state_old = bfs._cache_env("old", tmp_path, used)
    env_new, state_new = bfs._cache_env("new", tmp_path, used)
    env_again, state_again = bfs._cache_env("new", tmp_path, used)
    assert (state_old, state_new, state_again) == ("cold", "cold", "warm")
    assert env_again == env_new != env_old and set(env_new) == {"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"}


def test_summary_lists_every_variant_and_the_split() -> None:
    ok = {"name": "new_cold", "status": "ok", "metrics": {
        "caches": "cold", "first_step_s": 20.5, "dynamo_s": 3.0, "backend_s": 9.0, "inductor_s": 8.0,
        "attention_s": 4.0, "autotune_s": 3.5, "fp8_choice_s": 0.4, "triton_jit_s": 2.0, "rest_s": 4.1,
        "graphs": 1, "graph_breaks": 0, "steady_median_s": 4.3, "new_graphs_in_steady_steps": 0,
        "vs_eager": {"max_abs": 0.01, "rel_error": 0.002}, "mode_in_use": "inductor/default",
        "per_frame": [{"frame": "forward (model.py:226)", "compile_s": 12.0, "dynamo_s": 3.0, "backend_s": 9.0,
                       "ops": 300, "recompile_reason": "", "fail": ""}]}}
    skipped = {"name": "eager", "status": "skipped", "error": "time budget", "metrics": {"skipped": "time budget"}}
    text = bfs.summary([ok, skipped], {"device_name": "NVIDIA H100", "torch": "2.11", "command": "python3 -m x"})
    row = next(line for line in text.splitlines() if line.startswith("| new_cold"))
    assert "| 20.5 | 3.0 | 9.0 | 8.0 | 4.0 | 3.5 | 0.4 | 2.0 | 4.1 | 1 | 0 | 4.300 | 0 | 2.00e-03 |" in row
    assert "| eager | skipped: time budget |" in text and "forward (model.py:226) | 12.0" in text
    assert "NVIDIA H100" in text and "`python3 -m x`" in text


def test_variants_carry_size_resolution_and_output_file(tmp_path: Path) -> None:
    full, = bfs.variants(["old_cold"], smoke=False, outputs=tmp_path, steps=3)
    smoke, = bfs.variants(["new_warm"], smoke=True, outputs=tmp_path, steps=2)
    assert full.kwargs["size"] == "full" and (full.kwargs["width"], full.kwargs["frames"]) == (832, 81)
    assert full.kwargs["path"] == "old" and "backend" not in full.kwargs
    assert smoke.kwargs["size"] == "tiny" and smoke.kwargs["backend"] == "cudagraphs"
    assert smoke.kwargs["save_output"] == str(tmp_path / "new_warm.pt")
