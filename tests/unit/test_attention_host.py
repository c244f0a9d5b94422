"""The selector with a host's own backends (``HostAttention``): measured with ours in auto, quantized ones only
where faster than the best exact one, broken ones never chosen, one "core would use" line per shape."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from comfyui_lowvram_dit.kernels import attention as attn

from comfyui_lowvram_dit.kernels import attention_backends, attention_check
from comfyui_lowvram_dit.kernels.attention_backends import AttentionBackend, HostAttention
from comfyui_lowvram_dit.kernels.attention import AttentionSelector


def _qkv(lq: int = 64, lk: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 4, n, 32, generator=g) for n in (lq, lk, lk))


def _exact(delay: float, calls: list | None = None):  # noqa: ANN202 - an AttentionFn
    def fn(q, k, v, mask):
        if calls is not None:
            calls.append(1)
        time.sleep(delay)
        return attention_check.reference_attention(q, k, v, mask).to(q.dtype)
    return fn


def _noisy(delay: float, rel: float):  # noqa: ANN202 - a quantized-looking AttentionFn
    def fn(q, k, v, mask):
        time.sleep(delay)
        out = attention_check.reference_attention(q, k, v, mask).to(q.dtype)
        return out + rel * out.norm() / out.numel() ** 0.5 * torch.randn_like(out)
    return fn


def _host(*backends: AttentionBackend, default: str | None = None) -> HostAttention:
    return HostAttention(tuple(backends), default, f"core's {default}" if default else "")


def _backend(name: str, fn, quantized: bool = False) -> AttentionBackend:
    return AttentionBackend(name, name.upper(), fn, lambda *a: None,
                            tolerance=attention_backends.QUANTIZED_TOLERANCE if quantized else attention_backends.EXACT_TOLERANCE,
                            trades_accuracy=quantized)


@pytest.fixture
def ours(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201 - a function that sets auto's own candidates
    """Replace auto's own candidates with fakes of known speed (real CPU kernels take microseconds)."""
    registry = dict(attn.BACKENDS)  # one copy for the registry module and the selector that reads it
    monkeypatch.setattr(attention_backends, "BACKENDS", registry)
    monkeypatch.setattr(attn, "BACKENDS", registry)

    def set_ours(**delays: float) -> None:
        for name, delay in delays.items():
            attention_backends.register_backend(_backend(name, _exact(delay)))
        monkeypatch.setattr(attn, "AUTO_CANDIDATES", tuple(delays))

    return set_ours


@pytest.mark.parametrize("core_faster", [True, False])
def test_auto_measures_host_backends_with_ours(ours, core_faster: bool, caplog: pytest.LogCaptureFixture) -> None:
    ours(mine=0.06 if core_faster else 0.0)
    host = _host(_backend("core:pytorch", _exact(0.0 if core_faster else 0.06)), default="core:pytorch")
    sel, (q, k, v) = AttentionSelector(), _qkv()
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        out = sel.run(q, k, v, None, "auto", host)
        sel.run(q, k, v, None, "auto", host)
    torch.testing.assert_close(out, attention_check.reference_attention(q, k, v), rtol=1e-4, atol=1e-5)
    (detail,) = sel.details.values()
    assert set(detail.timings_ms) == {"mine", "core:pytorch"}
    assert detail.backend == ("core:pytorch" if core_faster else "mine")
    lines = [r.getMessage() for r in caplog.records if "core would use" in r.getMessage()]
    assert len(lines) == 1, lines  # once per shape, not per call
    chosen = "CORE:PYTORCH" if core_faster else "MINE"
    assert lines[0].startswith("lowvram_dit attention auto for H4 L64/64 D32 float32 cpu: "
                               f"core would use core's core:pytorch; chose {chosen} (")
    fast, slow = sorted(detail.timings_ms.values())
    core_ms = fast if core_faster else slow  # the second number is always what core's own choice took
    assert f"({fast:.2f} ms vs {core_ms:.2f} ms)" in lines[0], lines[0]


@pytest.mark.parametrize("broken", ["raises", "nan", "wrong_shape", "none"])
def test_broken_host_backend_is_never_chosen(ours, broken: str, caplog: pytest.LogCaptureFixture) -> None:
    def bad(q, k, v, mask):
        if broken == "raises":
            raise RuntimeError("Comfy Kitchen attention kernel failed")
        if broken == "nan":
            return torch.full(q.shape, float("nan"))
        return None if broken == "none" else q[:, :, :1]

    ours(mine=0.01)
    host = _host(_backend("core:bad", bad), default="core:bad")
    sel, (q, k, v) = AttentionSelector(), _qkv()
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        out = sel.run(q, k, v, None, "auto", host)
    torch.testing.assert_close(out, attention_check.reference_attention(q, k, v), rtol=1e-4, atol=1e-5)
    (detail,) = sel.details.values()
    assert detail.backend == "mine" and "core:bad" in detail.rejected and "core:bad" not in detail.timings_ms
    (line,) = [r.getMessage() for r in caplog.records if "core would use" in r.getMessage()]
    assert f"core would use core's core:bad ({detail.rejected['core:bad']}); chose MINE" in line


@pytest.mark.parametrize("quantized_faster", [True, False])
def test_quantized_host_backend_only_where_faster_than_best_exact(ours, quantized_faster: bool) -> None:
    # 0.1 s between the quantized candidate and the best exact one: a loaded 2-core machine added 30 ms of noise
    ours(mine_slow=0.3, mine_fast=0.1)
    host = _host(_backend("core:pytorch", _exact(0.3)),
                 _backend("core:int8", _noisy(0.0 if quantized_faster else 0.2, 0.02), quantized=True),
                 default="core:int8")
    sel, (q, k, v) = AttentionSelector(), _qkv()
    sel.run(q, k, v, None, "auto", host)
    (detail,) = sel.details.values()
    assert detail.errors["core:int8"] > attention_backends.EXACT_TOLERANCE / 10  # it really is the noisy one that was checked
    assert detail.backend == ("core:int8" if quantized_faster else "mine_fast")
    if not quantized_faster:
        assert detail.note == "CORE:INT8 is slower than MINE_FAST at this shape, so MINE_FAST runs it"


def test_quantized_host_backend_outside_its_tolerance_is_rejected(ours) -> None:
    ours(mine=0.02)
    host = _host(_backend("core:sage", _noisy(0.0, 0.3), quantized=True), default="core:sage")
    sel, (q, k, v) = AttentionSelector(), _qkv()
    sel.run(q, k, v, None, "auto", host)
    (detail,) = sel.details.values()
    assert detail.backend == "mine" and "relative error" in detail.rejected["core:sage"]


def test_host_decisions_are_cached_apart_from_plain_auto(ours) -> None:
    calls: list = []
    ours(mine=0.08)
    host = _host(_backend("core:pytorch", _exact(0.0, calls)), default="core:pytorch")
    sel, (q, k, v) = AttentionSelector(), _qkv()
    sel.run(q, k, v, None, "auto")
    assert calls == [] and len(sel.decisions) == 1
    sel.run(q, k, v, None, "auto", host)
    measured = len(calls)
    assert measured > 1 and sorted(sel.decisions.values()) == ["core:pytorch", "mine"]
    sel.run(q, k, v, None, "auto", host)
    assert len(calls) == measured + 1  # cached: one plain call, no new measurement
    q2, k2, v2 = _qkv(lq=32)
    sel.run(q2, k2, v2, None, "auto", host)
    assert len(calls) > measured + 2 and len(sel.decisions) == 3


def test_host_names_must_not_clash_with_ours() -> None:
    with pytest.raises(ValueError, match="clash with the pack's own"):
        HostAttention((_backend("sdpa", _exact(0.0)),))


def test_explicit_request_ignores_host_candidates(ours) -> None:
    ours(mine=0.0)
    host = _host(_backend("core:pytorch", _exact(0.0)), default="core:pytorch")
    sel, (q, k, v) = AttentionSelector(), _qkv()
    sel.run(q, k, v, None, "sdpa_math", host)
    (detail,) = sel.details.values()
    assert detail.backend == "sdpa_math" and not detail.timings_ms


def test_host_backend_hit_under_compile(ours) -> None:
    """A chosen host backend that is not compile-safe runs behind a graph break, not a crash."""
    ours(mine=0.03)
    host = _host(_backend("core:fast", _exact(0.0)), default="core:fast")
    torch._dynamo.reset()
    sel, (q, k, v) = AttentionSelector(), _qkv()
    fn = torch.compile(lambda q, k, v: sel.run(q, k, v, None, "auto", host) + 1, backend="eager")
    for _ in range(2):
        torch.testing.assert_close(fn(q, k, v), attention_check.reference_attention(q, k, v) + 1, rtol=1e-4, atol=1e-5)
    assert list(sel.decisions.values()) == ["core:fast"]
