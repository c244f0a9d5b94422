"""Attention registry, fallback (failing / NaN / wrong backends), the auto cache, and tracing under compile."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from comfyui_lowvram_dit.kernels import attention as attn

from comfyui_lowvram_dit.kernels import attention_backends, attention_check
from comfyui_lowvram_dit.kernels.attention_backends import AttentionBackend
from comfyui_lowvram_dit.kernels.attention import AttentionSelector

CPU = torch.device("cpu")


def _qkv(b: int = 1, h: int = 4, lq: int = 64, lk: int = 64, d: int = 32, dtype: torch.dtype = torch.float32,
         seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Wan-style [B, L, H*D] projections viewed as [B, H, L, D] (non-contiguous), as the node passes them.
    q, k, v = (torch.randn(b, n, h * d, generator=g).to(dtype).view(b, n, h, d).transpose(1, 2)
               for n in (lq, lk, lk))
    return q, k, v


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201 - yields a register function
    """Register throw-away backends; the registry and candidate lists are restored afterwards."""
    registry = dict(attn.BACKENDS)  # one copy for the registry module and the selector that reads it
    monkeypatch.setattr(attention_backends, "BACKENDS", registry)
    monkeypatch.setattr(attn, "BACKENDS", registry)

    def add(name: str, fn, *, auto: bool = False, first: bool = True, tolerance: float = attention_backends.EXACT_TOLERANCE,
            trades_accuracy: bool = False):
        attention_backends.register_backend(AttentionBackend(name, name.upper(), fn, lambda *a: None, tolerance=tolerance,
                                               trades_accuracy=trades_accuracy))
        if first:
            monkeypatch.setattr(attn, "FALLBACK_ORDER", (name, *attn.FALLBACK_ORDER))
        if auto:
            monkeypatch.setattr(attn, "AUTO_CANDIDATES", (*attn.AUTO_CANDIDATES, name))

    return add


def test_registry_reports_what_cpu_can_run() -> None:
    names = attention_backends.available_backends(CPU, torch.float32, 128)
    assert {"sdpa_math", "sdpa", "sdpa_flash"} <= set(names)
    for gpu_only in ("sdpa_cudnn", "sdpa_efficient", "flash_attn2", "flash_attn3", "sage", "xformers"):
        assert gpu_only not in names
        assert attn.unavailable_reason(gpu_only, CPU, torch.float32, 128)
    assert "unknown attention backend" in attn.unavailable_reason("nope", CPU, torch.float32, 128)
    # the 8-bit and comfy-kitchen backends are optional: absent or unsupported on CPU, never a crash
    for optional in ("int8", "int8_pv8", "int8_pvfp8", "ck_int8", "ck_sol"):
        assert optional not in names and attn.unavailable_reason(optional, CPU, torch.bfloat16, 128)


def test_every_node_choice_is_a_backend_logged_by_its_label() -> None:
    """The Attention node's labels name registered backends whose log label is the label the user picked."""
    from comfyui_lowvram_dit.host.attention import BACKEND_CHOICES

    named = {label: name for label, name in BACKEND_CHOICES.items() if name not in (None, "auto")}
    assert {"int8_pv8", "int8_pvfp8", "ck_int8", "ck_sol"} <= set(named.values())
    assert {label: attn.BACKENDS[name].label for label, name in named.items()} == {label: label for label in named}
    assert "approximate" in next(label for label, name in named.items() if name == "ck_sol")


@pytest.mark.parametrize("backend", ["sdpa_math", "sdpa", "sdpa_flash", "auto"])
def test_backends_match_reference(backend: str) -> None:
    q, k, v = _qkv(lq=48, lk=80)
    out = AttentionSelector().run(q, k, v, None, backend)
    assert out.shape == (1, 4, 48, 32)
    torch.testing.assert_close(out, attention_check.reference_attention(q, k, v), rtol=1e-4, atol=1e-5)


def test_masked_call_matches_reference() -> None:
    q, k, v = _qkv(lq=40, lk=40)
    mask = torch.ones(1, 1, 40, 40, dtype=torch.bool)
    mask[..., 30:] = False  # padded text tokens, as a Qwen-Image joint mask would mark them
    out = AttentionSelector().run(q, k, v, mask, "auto")
    ref = attention_check.reference_attention(q, k, v, mask)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(out, attention_check.reference_attention(q, k, v), atol=1e-3)


def test_failing_backend_falls_back_and_says_so_once(registry, caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    def boom(q, k, v, mask):
        calls.append(1)
        raise RuntimeError("no kernel image is available for execution on the device")

    registry("boom", boom)
    sel = AttentionSelector()
    q, k, v = _qkv()
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        out1 = sel.run(q, k, v, None, "boom")
        out2 = sel.run(q, k, v, None, "boom")
    torch.testing.assert_close(out1, attention_check.reference_attention(q, k, v), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out1, out2)
    assert len(calls) == 1  # the failure is cached with the shape: not retried every call
    warnings = [r.getMessage() for r in caplog.records if "BOOM cannot run" in r.getMessage()]
    assert len(warnings) == 1 and "no kernel image" in warnings[0] and "falling back" in warnings[0]
    (detail,) = sel.details.values()
    assert detail.backend != "boom" and "boom" in detail.rejected


def test_nan_backend_is_rejected(registry, caplog: pytest.LogCaptureFixture) -> None:
    registry("nan", lambda q, k, v, m: torch.full(q.shape, float("nan")))
    sel = AttentionSelector()
    q, k, v = _qkv()
    with caplog.at_level(logging.WARNING, logger="comfyui_lowvram_dit"):
        out = sel.run(q, k, v, None, "nan")
    assert torch.isfinite(out).all()
    (detail,) = sel.details.values()
    assert detail.rejected["nan"] == "output has NaN/Inf"
    assert any("NaN/Inf" in r.getMessage() for r in caplog.records)


def test_wrong_backend_is_rejected_by_error_check(registry) -> None:
    # finite but wrong: averages V ignoring Q/K, the kind of bug a bad layout or stride handling produces
    registry("wrong", lambda q, k, v, m: v.mean(dim=2, keepdim=True).expand(*q.shape[:3], v.shape[-1]))
    sel = AttentionSelector()
    q, k, v = _qkv()
    sel.run(q, k, v, None, "wrong")
    (detail,) = sel.details.values()
    assert "relative error" in detail.rejected["wrong"] and detail.backend != "wrong"


def test_quantized_tolerance_accepts_small_error(registry) -> None:
    def noisy(q, k, v, m):  # ~5 % relative noise: inside the 8-bit tolerance, too much for an exact backend
        out = attention_check.reference_attention(q, k, v).to(q.dtype)
        return out + 0.05 * out.norm() / out.numel() ** 0.5 * torch.randn_like(out)

    registry("int8ish", noisy, tolerance=attention_backends.QUANTIZED_TOLERANCE)
    registry("exactish", noisy)
    q, k, v = _qkv()
    sel = AttentionSelector()
    sel.run(q, k, v, None, "int8ish")
    sel.run(q, k, v, None, "exactish")
    chosen = {d.requested: d.backend for d in sel.details.values()}
    assert chosen == {"int8ish": "int8ish", "exactish": chosen["exactish"]} and chosen["exactish"] != "exactish"


@pytest.mark.parametrize("quantized_faster", [True, False])
def test_quantized_backend_only_runs_where_it_is_faster(registry, quantized_faster: bool,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """8-bit kernels lose to cuDNN on short sequences (Wan cross-attention, Qwen-Image 1328²): the requested
    quantized backend is timed once per shape against the first exact one and the faster one is kept."""
    calls = {"q8": 0, "exact": 0}

    def make(name: str, delay: float):
        def fn(q, k, v, m):
            calls[name] += 1
            time.sleep(delay)
            return attention_check.reference_attention(q, k, v).to(q.dtype)
        return fn

    # 100x apart: a loaded 2-core CI machine oversleeps by tens of ms, never by 0.2 s on every timed call
    registry("q8", make("q8", 0.002 if quantized_faster else 0.2), tolerance=attention_backends.QUANTIZED_TOLERANCE,
             trades_accuracy=True, first=False)
    registry("exact", make("exact", 0.2 if quantized_faster else 0.002))  # first in the fallback order
    sel = AttentionSelector()
    q, k, v = _qkv()
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        sel.run(q, k, v, None, "q8")
    (detail,) = sel.details.values()
    assert set(detail.timings_ms) == {"q8", "exact"}
    assert detail.backend == ("q8" if quantized_faster else "exact")
    assert ("is slower than EXACT" in caplog.text) is not quantized_faster
    before = dict(calls)
    sel.run(q, k, v, None, "q8")  # cached: no second measurement
    chosen = "q8" if quantized_faster else "exact"
    assert calls[chosen] == before[chosen] + 1 and sum(calls.values()) == sum(before.values()) + 1


def test_auto_picks_fastest_passing_candidate_once_per_shape(registry) -> None:
    counts = {"slow": 0, "fast": 0, "fast_nan": 0}

    def make(name: str, delay: float, nan: bool = False):
        def fn(q, k, v, m):
            counts[name] += 1
            time.sleep(delay)
            out = attention_check.reference_attention(q, k, v).to(q.dtype)
            return out * float("nan") if nan else out
        return fn

    for name, delay, nan in (("slow", 0.2, False), ("fast", 0.005, False), ("fast_nan", 0.0, True)):
        registry(name, make(name, delay, nan), auto=True, first=False)
    sel = AttentionSelector()
    q, k, v = _qkv()
    out = sel.run(q, k, v, None, "auto")
    torch.testing.assert_close(out, attention_check.reference_attention(q, k, v), rtol=1e-4, atol=1e-5)
    (key, detail), = sel.details.items()
    # fake "fast" beats the real CPU kernels only if they take > 5 ms; compare among the fakes
    assert detail.timings_ms["fast"] < detail.timings_ms["slow"]
    assert "fast_nan" in detail.rejected and "fast_nan" not in detail.timings_ms
    assert detail.backend != "slow"
    before = dict(counts)
    sel.run(q, k, v, None, "auto")
    assert counts["slow"] == before["slow"] and counts["fast_nan"] == before["fast_nan"]  # cached, not re-measured
    q2, k2, v2 = _qkv(lq=32, lk=32)
    sel.run(q2, k2, v2, None, "auto")
    assert counts["slow"] > before["slow"]  # a new shape is measured again
    assert len(sel.report()) == 2 and "H4 L64/64 D32 float32 cpu" in sel.report()[0]


def test_selector_hit_traces_without_graph_breaks() -> None:
    """Once decided, the selector is plain traceable code: fullgraph compile must succeed (no graph break)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    sel = AttentionSelector()
    q, k, v = _qkv()
    eager = sel.run(q, k, v, None, "sdpa_math")
    counter = CompileCounter()
    fn = torch.compile(lambda q, k, v: sel.run(q, k, v, None, "sdpa_math") * 2, backend=counter, fullgraph=True)
    torch.testing.assert_close(fn(q, k, v), eager * 2)
    fn(q, k, v)
    assert counter.frame_count == 1


def test_first_decision_under_compile_works() -> None:
    """Undecided under compile: the decision runs eagerly behind a graph break, then later traces are clean."""
    torch._dynamo.reset()
    sel = AttentionSelector()
    q, k, v = _qkv()
    fn = torch.compile(lambda q, k, v: sel.run(q, k, v, None, "auto") + 1, backend="eager")
    torch.testing.assert_close(fn(q, k, v), attention_check.reference_attention(q, k, v) + 1, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fn(q, k, v), attention_check.reference_attention(q, k, v) + 1, rtol=1e-4, atol=1e-5)
    assert len(sel.decisions) == 1


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_backends_agree_with_reference(dtype: torch.dtype) -> None:
    """Every backend this GPU offers passes the check at a Wan-like head size; auto picks one of them."""
    dev = torch.device("cuda")
    q, k, v = (t.to(dev) for t in _qkv(b=1, h=8, lq=4096, lk=4096, d=128, dtype=dtype))
    sel = AttentionSelector()
    for name in attention_backends.available_backends(dev, dtype, 128):
        sel.run(q, k, v, None, name)
        decision = sel.details[attn._key(name, q, k, None)]
        assert name not in decision.rejected and decision.errors[name] <= attn.BACKENDS[name].tolerance, \
            f"{name} rejected: {decision.rejected}"
        # an 8-bit kernel that passes may still lose to an exact one at this short length; then the exact one runs
        assert decision.backend == name or (attn.BACKENDS[name].trades_accuracy and "slower" in decision.note)
    sel.run(q, k, v, None, "auto")
    assert sel.details[attn._key("auto", q, k, None)].backend in attn.AUTO_CANDIDATES


def test_int8_backend_names_a_missing_triton(monkeypatch):
    from comfyui_lowvram_dit.kernels import attention_int8

    monkeypatch.setattr(attention_int8, "is_supported", lambda *a: False)
    monkeypatch.setattr(attention_int8, "_triton_module", lambda: None)
    reason = attention_backends._int8_reason(torch.device("cuda", 0), torch.bfloat16, 128, False)
    assert reason is not None and "needs Triton" in reason
    assert "head dim" in attention_backends._int8_reason(torch.device("cpu"), torch.bfloat16, 128, False)


@pytest.fixture
def kept_in(tmp_path):  # noqa: ANN001, ANN201 - yields the decisions file
    """A decisions file for this test only (kernels/decision_store.py); none is left set afterwards."""
    from comfyui_lowvram_dit.kernels import decision_store

    decision_store.keep_in(tmp_path / "decisions.json")
    yield tmp_path / "decisions.json"
    decision_store.keep_in(None)


def test_auto_choice_is_kept_for_a_restarted_process(registry, kept_in, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A second selector (a restarted server) over the same decisions file runs the first one's auto choice after
    its first-use check, without timing anything."""
    from comfyui_lowvram_dit.kernels import decision_store

    registry("fakefast", lambda q, k, v, m: attention_check.reference_attention(q, k, v).to(q.dtype), auto=True,
             first=False)
    q, k, v = _qkv()
    first = AttentionSelector()
    first.run(q, k, v, None, "auto")
    (key, detail), = first.details.items()
    assert decision_store.kept(attn.KEPT_AS, key) == detail.backend and kept_in.exists()

    monkeypatch.setattr(attn, "time_call", lambda *a, **kw: pytest.fail("a kept auto choice must not be timed"))
    restarted = AttentionSelector()
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        out = restarted.run(q, k, v, None, "auto")
    torch.testing.assert_close(out, attention_check.reference_attention(q, k, v), rtol=1e-4, atol=1e-5)
    kept = restarted.details[key]
    assert restarted.decisions == {key: detail.backend} and kept.timings_ms == {}
    assert detail.backend in kept.errors  # the first-use check still ran
    assert "kept from an earlier run" in caplog.text


@pytest.mark.parametrize("kept", ["gone", "nowbroken"])
def test_a_kept_auto_choice_that_cannot_run_now_is_decided_afresh(registry, kept_in, kept: str) -> None:
    """A kept backend that is no candidate any more, or fails its first-use check now, is not used: auto times
    the candidates again and keeps the new winner."""
    from comfyui_lowvram_dit.kernels import decision_store

    registry("nowbroken", lambda q, k, v, m: attention_check.reference_attention(q, k, v).to(q.dtype) * float("nan"),
             auto=True, first=False)
    q, k, v = _qkv()
    key = attn._key("auto", q, k, None)
    decision_store.keep(attn.KEPT_AS, key, kept)
    sel = AttentionSelector()
    out = sel.run(q, k, v, None, "auto")
    torch.testing.assert_close(out, attention_check.reference_attention(q, k, v), rtol=1e-4, atol=1e-5)
    detail = sel.details[key]
    assert detail.backend not in (kept, "nowbroken") and detail.timings_ms and not detail.note
    assert decision_store.kept(attn.KEPT_AS, key) == detail.backend


def test_a_winner_kept_when_auto_had_other_quantized_candidates_is_not_reused(registry, kept_in,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The key names auto's quantized candidates: a decisions file written by a pack whose auto timed fewer (before
    the 8-bit fp16 P·V kernel joined) is not read as this pack's decision, so auto times the new field once."""
    from comfyui_lowvram_dit.kernels import decision_store

    q, k, v = _qkv()
    key = attn._key("auto", q, k, None)
    assert key[-1] == "q:" + ",".join(attn.AUTO_QUANTIZED) and "int8_pv16" in key[-1]
    assert attn._key("sdpa_math", q, k, None)[-1] == ""  # a named request: no field (never kept)
    older = (*key[:-1], "q:ck_int8")  # what a pack with comfy-kitchen int8 as its only quantized candidate wrote
    decision_store.keep(attn.KEPT_AS, older, "sdpa_math")
    sel = AttentionSelector()
    sel.run(q, k, v, None, "auto")
    detail = sel.details[key]
    assert detail.timings_ms and detail.note != "kept from an earlier run"
    assert decision_store.kept(attn.KEPT_AS, key) == detail.backend


def test_a_requested_backend_is_never_kept(registry, kept_in) -> None:
    """Only auto's timed choice goes to the decisions file; a named request decides as before."""
    q, k, v = _qkv()
    AttentionSelector().run(q, k, v, None, "sdpa_math")
    assert not kept_in.exists()
