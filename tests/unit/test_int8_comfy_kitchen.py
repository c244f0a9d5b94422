"""comfy-kitchen as an optional candidate (kernels/int8_comfy_kitchen.py): the version gate and its one log line,
its INT8 attention in ``auto`` and its int8 linear in the GEMM choice with planted timings, and, where comfy-kitchen
>= 0.2.40 is installed, its CPU (eager) int8 linear and Sol-Attn against the pack's error."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from comfyui_lowvram_dit.kernels import attention as attn
from comfyui_lowvram_dit.kernels import attention_backends, attention_check, decisions, int8, int8_choice
from comfyui_lowvram_dit.kernels import int8_comfy_kitchen as K
from comfyui_lowvram_dit.kernels.attention import AttentionSelector
from comfyui_lowvram_dit.kernels.attention_backends import AttentionBackend

import attention_families as AF  # tests/unit/attention_families.py

CPU = torch.device("cpu")
NEW_ENOUGH = (K.installed_version() is not None and K.parse_version(K.installed_version()) >= K.MIN_VERSION)
NEEDS_KITCHEN = pytest.mark.skipif(not NEW_ENOUGH, reason=f"comfy-kitchen >= 0.2.40 is not installed here "
                                                          f"(found {K.installed_version()})")


@pytest.fixture(autouse=True)
def fresh_gate():  # noqa: ANN201 - yields nothing
    """Each test looks for comfy-kitchen anew (the gate caches what it found)."""
    K.forget()
    yield
    K.forget()


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "comfyui_lowvram_dit"]


def test_parse_version() -> None:
    assert K.parse_version("0.2.40") == (0, 2, 40) and K.parse_version("0.2.41rc1") == (0, 2, 41)
    assert K.parse_version("0.2.40+cu130") == (0, 2, 40) and K.parse_version("1.0") == (1, 0)
    assert K.parse_version("0.2.31") < K.MIN_VERSION <= K.parse_version("0.3.0")


@pytest.mark.parametrize("version, said", [(None, "comfy-kitchen is not installed"),
                                           ("0.2.31", "comfy-kitchen 0.2.31 is older than 0.2.40")])
def test_missing_or_old_changes_nothing_and_says_so_once(version: str | None, said: str,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(K, "installed_version", lambda: version)
    imported = []
    monkeypatch.setattr(K.importlib, "import_module", lambda name: imported.append(name))
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        for _ in range(3):
            assert K.module() is None and K.missing_reason() == said
            assert "ck_int8" not in attention_backends.auto_quantized()
            assert attention_backends.unavailable_reason("ck_int8", CPU, torch.bfloat16, 128) == said
    assert imported == []  # an old one is never imported
    (line,) = _messages(caplog)
    assert line.startswith(f"lowvram_dit: {said}; its INT8 attention, Sol-Attn and int8 linear are not candidates")
    # auto without it runs exactly as before
    q, k, v = (torch.randn(1, 2, 16, 32) for _ in range(3))
    out = AttentionSelector().run(q, k, v, None, "auto")
    torch.testing.assert_close(out, attention_check.reference_attention(q, k, v), rtol=1e-4, atol=1e-5)


def test_a_broken_install_is_as_good_as_missing(monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(K, "installed_version", lambda: "0.2.40")

    def broken(name: str) -> None:
        raise ImportError("undefined symbol: planted")

    monkeypatch.setattr(K.importlib, "import_module", broken)
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        assert K.module() is None
    assert "does not import (ImportError: undefined symbol: planted)" in K.missing_reason()
    assert len(_messages(caplog)) == 1


# ---- selection with planted timings -------------------------------------------------------------------------------


@pytest.fixture
def planted_attention(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201 - yields (register, ran)
    """Backends that record their name when called and a planted ``time_call`` that reads it back."""
    registry = dict(attn.BACKENDS)
    monkeypatch.setattr(attention_backends, "BACKENDS", registry)
    monkeypatch.setattr(attn, "BACKENDS", registry)
    ran: list[str] = []
    ms: dict[str, float] = {}

    def planted_time(fn, device):  # noqa: ANN001, ANN202
        fn()
        return ms[ran[-1]]

    monkeypatch.setattr(attn, "time_call", planted_time)

    def register(name: str, millis: float, quantized: bool) -> None:
        def call(q, k, v, m):  # noqa: ANN001, ANN202
            ran.append(name)
            return attention_check.reference_attention(q, k, v).to(q.dtype)

        ms[name] = millis
        attention_backends.register_backend(AttentionBackend(
            name, name.upper(), call, lambda *a: None, tolerance=attention_backends.QUANTIZED_TOLERANCE,
            trades_accuracy=quantized))

    return register, ran


@pytest.mark.parametrize("quantized", ["ck_int8", "int8_pv16"])  # comfy-kitchen's kernel, the pack's sm90 one
@pytest.mark.parametrize("quantized_ms, wins", [(1.0, True), (3.0, False)])
def test_auto_keeps_a_quantized_candidate_only_where_faster(quantized: str, quantized_ms: float, wins: bool,
                                                           planted_attention, monkeypatch: pytest.MonkeyPatch) -> None:
    register, ran = planted_attention
    chosen = quantized if wins else "exact"
    register("exact", 2.0, quantized=False)
    register(quantized, quantized_ms, quantized=True)  # stands in for the GPU-only kernel
    monkeypatch.setattr(attn, "AUTO_CANDIDATES", ("exact",))
    monkeypatch.setattr(attn, "auto_quantized", lambda: [quantized])
    sel = AttentionSelector()
    q, k, v = (torch.randn(1, 2, 16, 32) for _ in range(3))
    sel.run(q, k, v, None, "auto")
    (detail,) = sel.details.values()
    assert detail.backend == chosen and detail.timings_ms == {"exact": 2.0, quantized: quantized_ms}
    assert (f"{quantized.upper()} is slower than EXACT" in detail.note) is (chosen == "exact")
    ran.clear()
    sel.run(q, k, v, None, "auto")
    assert ran == [chosen]  # decided once: the next call runs the winner only


def test_kitchen_backends_are_registered_with_their_labels() -> None:
    assert attention_backends.BACKENDS["ck_int8"].trades_accuracy
    sol = attention_backends.BACKENDS["ck_sol"]
    assert sol.label == K.SOL_ATTN_LABEL and "approximate" in sol.label and "17-93 %" in K.SOL_ATTN_NOTE
    assert sol.tolerance == attention_backends.APPROXIMATE_TOLERANCE and "ck_sol" not in attention_backends.AUTO_QUANTIZED
    assert "ck_sol" not in attention_backends.AUTO_CANDIDATES and "ck_int8" in attention_backends.AUTO_QUANTIZED


_GEMM_KEY = (("cuda", "planted", 8, 6), 64, 48, 128)


def _plant_gemms(monkeypatch: pytest.MonkeyPatch, ms: dict[str, float], errors: tuple[float, float]) -> list[str]:
    """Planted GEMM timings (pack GEMMs and comfy-kitchen's linear) and planted (pack, kitchen) errors."""
    ran: list[str] = []

    def pack_gemm(gemm, xq, xs, wq, ws, bias, out_dtype):  # noqa: ANN001, ANN202
        ran.append(gemm)

    monkeypatch.setattr(int8, "_run_gemm", pack_gemm)
    monkeypatch.setattr(K, "int8_linear", lambda *a, **kw: ran.append(int8_choice.KITCHEN))
    monkeypatch.setattr(K, "module", types.SimpleNamespace)
    monkeypatch.setattr(int8_choice, "kitchen_errors", lambda *a: errors)

    def planted_time(fn, device):  # noqa: ANN001, ANN202
        fn()
        return ms[ran[-1]]

    monkeypatch.setattr(decisions, "time_call", planted_time)
    return ran


@pytest.mark.parametrize("kitchen_ms, errors, best, timed", [
    (0.5, (0.0120, 0.0121), "comfy_kitchen", True),  # within the slack of the pack's error, and fastest
    (2.0, (0.0120, 0.0121), "triton", True),  # equal error but slower
    (0.5, (0.0120, 0.0500), "triton", False),  # faster but less accurate: not even timed
])
def test_kitchen_linear_kept_only_when_faster_at_equal_error(kitchen_ms: float, errors: tuple[float, float],
                                                             best: str, timed: bool, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    ran = _plant_gemms(monkeypatch, {"int_mm": 1.5, "triton": 1.0, "comfy_kitchen": kitchen_ms}, errors)
    chooser = int8_choice.GemmChooser()
    x2 = torch.randn(40, 128, dtype=torch.bfloat16)
    weight = (torch.ones(48, 128, dtype=torch.int8), torch.ones(48), True)
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        assert chooser._decide(_GEMM_KEY, x2, 48, weight) == best
    assert ("comfy_kitchen" in chooser.timings[_GEMM_KEY]) is timed
    assert ("its error 5.00 % is above the pack's 1.20 %" in caplog.text) is (not timed)
    ran.clear()
    assert chooser._decide(_GEMM_KEY, x2, 48, weight) == best and ran == []  # decided once


def test_kitchen_linear_not_a_candidate_when_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    ran = _plant_gemms(monkeypatch, {"int_mm": 1.5, "triton": 1.0}, (0.01, 0.01))
    monkeypatch.setattr(K, "module", lambda: None)
    chooser = int8_choice.GemmChooser()
    weight = (torch.ones(48, 128, dtype=torch.int8), torch.ones(48), True)
    assert chooser._decide(_GEMM_KEY, torch.randn(40, 128), 48, weight) == "triton"
    assert set(chooser.timings[_GEMM_KEY]) == {"int_mm", "triton"} and "comfy_kitchen" not in ran


# ---- the real comfy-kitchen on the CPU (its eager backend) --------------------------------------------------------


@NEEDS_KITCHEN
@pytest.mark.parametrize("rotate", [False, True])
def test_kitchen_linear_error_equals_the_packs_on_cpu(rotate: bool) -> None:
    """Same scheme (per-token int8 of the same, possibly rotated, activation): the same error within the slack."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 256, generator=g)
    x[:, 5] *= 40  # an outlier channel
    wq, ws = int8.quantize_weight(torch.randn(80, 256, generator=g), rotate=rotate)
    ours, theirs = int8_choice.kitchen_errors(x.bfloat16(), wq, ws, rotate)
    assert 0 < theirs <= ours * (1 + int8_choice.KITCHEN_ERROR_SLACK)
    assert (ours < 0.01) is rotate  # the rotation is what makes the outlier cheap


def _smooth_qkv(length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k varying smoothly along the sequence (neighbours attend to neighbours, as in video), v noise."""
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(length).float()[:, None]
    freqs = torch.rand(64, generator=g) * 0.05
    x = 2 * torch.cat([torch.sin(pos * freqs), torch.cos(pos * freqs)], -1).expand(1, 2, length, 128)
    q, k = (x + 0.3 * torch.randn(x.shape, generator=g) for _ in range(2))
    return q.bfloat16(), k.bfloat16(), torch.randn(1, 2, length, 128, generator=g).bfloat16()


def _error(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    return float((out.float() - ref).norm() / ref.norm())


@NEEDS_KITCHEN
def test_sol_attn_is_an_approximation_and_self_attention_only() -> None:
    """Sol-Attn's eager reference at its default threshold: close on smooth inputs, far off on unstructured ones
    (SOL_ATTN_NOTE's two ends), which is why it is a labelled explicit choice and not an auto candidate."""
    smooth = _smooth_qkv(2048)
    assert _error(K.sol_attn(*smooth, None), *smooth) < 0.01
    q, k, v = AF.make_family("attention_sinks", 1, 2, 2048, 2048, 128)
    assert _error(K.sol_attn(q, k, v, None), q, k, v) > 0.10
    with pytest.raises(ValueError, match="self-attention only"):
        K.sol_attn(q, k[:, :, :512], v[:, :, :512], None)
    assert "comfy_kitchen" in sys.modules
