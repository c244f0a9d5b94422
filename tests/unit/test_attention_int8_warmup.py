"""kernels.attention_int8.start_warmup: the 8-bit kernels compiled in a background thread ahead of the first
sampler step (CPU: the thread's plumbing with the kernels replaced by recorders; CUDA: a real warm-up leaves
nothing for the first real call to compile)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from comfyui_lowvram_dit.kernels import attention_int8 as ai


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """No warm-up threads from other tests."""
    monkeypatch.setattr(ai, "_WARMUPS", {})


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch, fresh: None) -> list:
    """Warm-ups run on CPU with the kernels replaced by recorders (each main-loop compile takes 0.2 s)."""
    calls: list = []
    monkeypatch.setattr(ai, "is_supported", lambda device, dtype, head_dim: True)
    monkeypatch.setattr(ai, "resolve_formats", lambda device, qk_format="auto", pv_format="auto": (
        "int8", "fp8" if pv_format == "auto" else pv_format))

    def quantize(q, k, v, *, qk_format, pv_format):  # noqa: ANN001, ANN202
        calls.append(("quantize", tuple(q.shape), q.stride(), q.dtype, qk_format, pv_format,
                      threading.current_thread().name))
        return "qq"

    def main_loop(qq, out, lq, lk, config=None, compile_only=False):  # noqa: ANN001, ANN202
        calls.append(("main", tuple(out.shape), lq, lk, compile_only))
        time.sleep(0.2)
        return out

    monkeypatch.setattr(ai, "quantize_qkv", quantize)
    monkeypatch.setattr(ai, "attention_from_quantized", main_loop)
    return calls


def test_no_warmup_where_the_kernel_cannot_run(fresh: None) -> None:
    assert ai.start_warmup("cpu", torch.bfloat16, 40, 128) is None  # no CUDA GPU: not supported
    ai.wait_for_warmup()  # nothing to wait for


def test_warmup_compiles_both_length_kinds_in_a_thread(recorder: list) -> None:
    thread = ai.start_warmup("cpu", torch.float16, 40, 128)
    assert thread is not None and thread is not threading.current_thread()
    assert ai.start_warmup("cpu", torch.float16, 24, 128) is thread  # 24 and 40 specialise alike: no second one
    ai.wait_for_warmup()
    assert not thread.is_alive()
    quant = [c for c in recorder if c[0] == "quantize"]
    main = [c for c in recorder if c[0] == "main"]
    # one length of each divisibility-by-16 kind, Wan's video kind (32,760 % 16 == 8) first
    assert [c[1] for c in quant] == [(1, 40, 264, 128), (1, 40, 256, 128)]
    # [B, H, L, D] views of [B, L, H, D] memory, as Wan calls it, so the strides specialise like a real call
    assert quant[0][2] == (264 * 40 * 128, 128, 40 * 128, 1)
    assert all(c[3] == torch.float16 and c[4:6] == ("int8", "fp8") for c in quant)
    assert all(c[6] == thread.name for c in quant)
    # the main loop compiled (never run or timed) for the autotuner's long-sequence config set
    assert [(c[2], c[3], c[4]) for c in main] == [(32768, 32768, True)] * 2


def test_heads_divisible_by_16_get_their_own_warmup(recorder: list) -> None:
    a = ai.start_warmup("cpu", torch.bfloat16, 40, 128)
    b = ai.start_warmup("cpu", torch.bfloat16, 48, 128)
    c = ai.start_warmup("cpu", torch.bfloat16, 40, 64)
    assert len({id(a), id(b), id(c)}) == 3
    ai.wait_for_warmup()
    assert sorted({c[1][1] for c in recorder if c[0] == "quantize"}) == [40, 48]


def test_where_the_gluon_loop_runs_the_warmup_compiles_it_not_the_autotuner(recorder: list,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """sm90 with Gluon: one real call per length kind compiles the Gluon loop (it has no autotuner); Triton's
    autotuned loop, only its fallback, is not compiled ahead."""
    monkeypatch.setattr(ai, "_gluon_loop_fits", lambda qq, out: True)
    ai.start_warmup("cpu", torch.bfloat16, 40, 128, pv_format="fp16").join()
    assert [c[2:] for c in recorder if c[0] == "main"] == [(264, 264, False), (256, 256, False)]


def test_each_pv_format_gets_its_own_warmup(recorder: list) -> None:
    """The int8 P·V backend is another kernel (a compile-time flag): its warm-up compiles that one."""
    a = ai.start_warmup("cpu", torch.bfloat16, 40, 128)
    b = ai.start_warmup("cpu", torch.bfloat16, 40, 128, pv_format="int8")
    assert a is not b and ai.start_warmup("cpu", torch.bfloat16, 40, 128, pv_format="int8") is b
    ai.wait_for_warmup()
    assert sorted({c[5] for c in recorder if c[0] == "quantize"}) == ["fp8", "int8"]


def test_first_call_waits_for_a_running_warmup(recorder: list) -> None:
    thread = ai.start_warmup("cpu", torch.bfloat16, 40, 128)
    t0 = time.perf_counter()
    ai.wait_for_warmup()
    assert time.perf_counter() - t0 >= 0.2 and not thread.is_alive()  # two 0.2 s compiles were still running


def test_failed_warmup_is_logged_not_raised(recorder: list, monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("ptxas died")

    monkeypatch.setattr(ai, "quantize_qkv", broken)
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        ai.start_warmup("cpu", torch.bfloat16, 40, 128)
        ai.wait_for_warmup()
    assert "compiling ahead failed (RuntimeError: ptxas died); the first call compiles instead" in caplog.text


def test_the_quantizers_take_the_length_unspecialised() -> None:
    """Triton would build each quantizer twice (Wan's 32,760 video tokens and 512 text tokens differ in divisibility
    by 16), a second build in a first render's wait for the warm-up; the length only bounds their masks."""
    tk = pytest.importorskip("comfyui_lowvram_dit.kernels.attention_int8_triton", reason="needs triton")
    for kernel in (tk.quantize_q_kernel, tk.quantize_k_kernel, tk.quantize_v_kernel, tk.quantize_v_int8_kernel,
                   tk.key_norm_kernel):
        assert "L" in kernel.arg_names and kernel.arg_names.index("L") in _unspecialised(kernel), kernel.fn.__name__


def _unspecialised(kernel) -> set[int]:  # noqa: ANN001 - a triton JITFunction
    """Argument indices the kernel does not specialise (Triton keeps names or indices, by version)."""
    return {kernel.arg_names.index(a) if isinstance(a, str) else a for a in kernel.do_not_specialize}


def warmup_probe(warm: bool) -> dict:
    """In a fresh interpreter with an empty Triton cache: optionally warm up, then one Wan-shaped self-attention
    (8,200 tokens: long, and not a multiple of 16) and one cross-attention (512 text tokens) call; Triton compiles
    counted."""
    import triton

    compiled: list[str] = []
    triton.knobs.compilation.listener = (
        lambda *, src, metadata, metadata_group, times, cache_hit: compiled.append(getattr(src, "name", "?")))
    t0 = time.perf_counter()
    if warm:
        ai.start_warmup("cuda", torch.bfloat16, 40, 128).join()
    warm_compiles, t1 = len(compiled), time.perf_counter()
    x = torch.randn(2, 8200, 40, 128, device="cuda", dtype=torch.bfloat16)
    ctx = torch.randn(2, 512, 40, 128, device="cuda", dtype=torch.bfloat16)
    for k in (x, ctx):
        ai.attention_int8(x, k, k, layout="BLHD")
    torch.cuda.synchronize()
    return {"warmup_compiles": warm_compiles, "call_compiles": len(compiled) - warm_compiles,
            "warmup_s": t1 - t0, "first_calls_s": time.perf_counter() - t1, "compiled": compiled}


_PROBE = ("import json, sys; sys.path.insert(0, sys.argv[1]); import test_attention_int8_warmup as t; "
          "print(json.dumps(t.warmup_probe(sys.argv[2] == 'warm')))")


@pytest.mark.cuda
def test_warmup_leaves_nothing_to_compile(tmp_path: Path) -> None:
    if not ai.is_supported("cuda", torch.bfloat16, 128):
        pytest.skip("8-bit attention needs sm80+ and Triton")
    import triton

    if not hasattr(getattr(triton, "knobs", None), "compilation"):
        pytest.skip("this Triton has no compilation listener")
    runs = {}
    for mode in ("cold", "warm"):
        env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / mode)}  # an empty disk cache each time
        out = subprocess.run([sys.executable, "-c", _PROBE, str(Path(__file__).parent), mode], env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    assert runs["cold"]["call_compiles"] >= 4  # three quantizers and at least one main-loop config
    assert runs["warm"]["warmup_compiles"] >= runs["cold"]["call_compiles"]
    assert runs["warm"]["call_compiles"] == 0, runs
    # the quantizers take the length unspecialised: one build each serves both length kinds
    prologue = [n for n in runs["warm"]["compiled"] if n.startswith(("quantize_", "key_norm"))]
    assert prologue and len(prologue) == len(set(prologue)), runs
