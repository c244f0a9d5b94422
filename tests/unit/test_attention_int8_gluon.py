"""The warp-specialized sm90 loop of the 8-bit attention (kernels/attention_int8_gluon.py): its build for sm90 without
a GPU (where the installed Triton has the Gluon API it is written in), when it is chosen and how a failing one falls
back (CPU, planted), and its output against Triton's fp16 P·V loop on the same quantized operands (`cuda`)."""

from __future__ import annotations

import logging
import types

import pytest
import torch
import torch.nn.functional as F

from attention_families import make_family
from comfyui_lowvram_dit.kernels import attention_int8 as A

GLUON = A._gluon_module()


@pytest.mark.skipif(GLUON is None, reason="this Triton has no Gluon with the API the sm90 loop is written in (>= 3.6)")
def test_gluon_loop_builds_for_sm90_with_its_registers_and_no_spills() -> None:
    import sass_attention_int8 as sass

    try:
        kernel = sass.compile_gluon_kernel(90)
    except ImportError as exc:  # a Triton without native_specialize_impl to build the launch signature with
        pytest.skip(f"cannot build the launch signature here: {exc}")
    p = sass.profile(kernel, 12, gluon=True)
    ops, loop = p["kernel_ops"], p["loop_mix"]
    assert p["stack_bytes"] == 0 and ops["LDL"] == 0 and ops["STL"] == 0, p
    # TMA loads, and the partitions' register split (setmaxnreg: the consumers get 240, the loader the rest)
    assert ops["UTMALDG"] and ops["USETMAXREG"], ops
    # the pipelined loop: one tile's int8 Q·Kᵀ and fp16 P·V, and ptxas kept the wgmmas asynchronous (serialised, its
    # C7513, every wgmma gets its own WARPGROUP.ARRIVE and DEPBAR, two per wgmma; kept asynchronous, one pair per
    # group of wgmmas)
    assert loop["IGMMA"] and loop["HGMMA"] and loop.get("WARPGROUP", 0) < (loop["IGMMA"] + loop["HGMMA"]) / 2, loop
    assert ops["WARPGROUP"] < (ops["IGMMA"] + ops["HGMMA"]) / 2, ops
    assert p["shared_bytes"] <= 227 * 1024


def test_auto_pv_format_on_sm90_is_fp16_where_the_gluon_loop_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(A, "gluon_loop_usable", lambda device: True)
    assert A.resolve_formats(cuda) == ("int8", "fp16")
    assert A.resolve_formats(cuda, "fp8") == ("fp8", A.DEFAULT_PV_FORMAT)  # the loop takes int8 Q·Kᵀ only
    assert A.resolve_formats(cuda, "auto", "fp8") == ("int8", "fp8")  # an explicit format is kept
    monkeypatch.setattr(A, "gluon_loop_usable", lambda device: False)
    assert A.resolve_formats(cuda) == ("int8", A.DEFAULT_PV_FORMAT)


def test_too_old_triton_keeps_the_triton_loop_with_one_log_line(monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(A, "_gluon_module", lambda: None)
    monkeypatch.setattr(A, "_interpreting", lambda: False)
    A._log_once.cache_clear()
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        assert not A.gluon_loop_usable(torch.device("cuda", 0))
        assert not A.gluon_loop_usable(torch.device("cuda", 0))
        assert A.resolve_formats(torch.device("cuda", 0)) == ("int8", A.DEFAULT_PV_FORMAT)
    lines = [r.getMessage() for r in caplog.records if "warp-specialized" in r.getMessage()]
    assert len(lines) == 1 and "Triton >= 3.6" in lines[0]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert not A.gluon_loop_usable(torch.device("cuda", 0))  # not Hopper: no loop, nothing more said
    A._log_once.cache_clear()


def test_auto_times_the_fp16_pv_kernel_only_where_the_gluon_loop_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from comfyui_lowvram_dit.kernels import attention_backends as AB

    assert "int8_pv16" in AB.AUTO_QUANTIZED and "int8_pv16" in AB.auto_quantized()  # no library to install
    assert "int8_pv16" not in AB.AUTO_CANDIDATES  # never among the exact ones
    cuda = torch.device("cuda", 0)
    assert AB.unavailable_reason("int8_pv16", torch.device("cpu"), torch.bfloat16, 128)
    monkeypatch.setattr(A, "is_supported", lambda device, dtype, head_dim: True)
    monkeypatch.setattr(A, "gluon_loop_usable", lambda device: True)
    monkeypatch.setattr(A, "_gluon_module", lambda: types.SimpleNamespace(HEAD_DIMS=(128, )))  # a Triton 3.5 host
    assert AB.unavailable_reason("int8_pv16", cuda, torch.bfloat16, 128) is None
    assert "head size 128" in AB.unavailable_reason("int8_pv16", cuda, torch.bfloat16, 64)
    assert AB.unavailable_reason("int8_pv16", cuda, torch.bfloat16, 128, has_mask=True) == \
        "does not take an attention mask"
    monkeypatch.setattr(A, "gluon_loop_usable", lambda device: False)  # sm89, sm120, an old Triton, a failed launch
    assert "sm90" in AB.unavailable_reason("int8_pv16", cuda, torch.bfloat16, 128)
    calls: list = []
    monkeypatch.setattr(A, "attention_int8", lambda q, k, v, **kw: calls.append(kw) or q)
    q = torch.zeros(1, 2, 4, 128)
    AB.BACKENDS["int8_pv16"].call(q, q, q, None)
    assert calls == [{"layout": "BHLD", "pv_format": "fp16"}]
    backend = AB.BACKENDS["int8_pv16"]
    assert backend.trades_accuracy and backend.tolerance == AB.QUANTIZED_TOLERANCE


class _Launch:
    """Stands for a Triton kernel: kernel[grid](*args, **kwargs) records the call."""

    def __init__(self) -> None:
        self.calls = 0

    def __getitem__(self, grid: object):  # noqa: ANN204
        def launch(*args: object, **kwargs: object) -> None:
            self.calls += 1
        return launch


def _planted_qq(n: int = 256, d: int = 128) -> types.SimpleNamespace:
    """The QuantizedQKV fields attention_from_quantized reads, for the fp16 P·V scheme."""
    f32 = torch.zeros(1, n)
    return types.SimpleNamespace(
        q8=torch.zeros(1, n, d, dtype=torch.int8), q_scale=f32, k8=torch.zeros(1, n, d, dtype=torch.int8),
        k_scale=f32, vt=torch.zeros(1, d, n, dtype=torch.float16), v_scale=torch.ones(1, d), v_mean=torch.zeros(1, d),
        q16=torch.zeros(1, 1, n, d, dtype=torch.bfloat16), k_hi=torch.zeros(1, 128, d, dtype=torch.bfloat16),
        k_mean=torch.zeros(1, d), n_hi=128, sm_scale=d ** -0.5, qk_format="int8", pv_format="fp16", v_sum=None,
        v_hi=None, v_hi_scale=None)


def test_a_failing_gluon_loop_falls_back_to_triton_once_and_for_good(monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    tried = []

    def broken(*args: object) -> None:
        tried.append(args)
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(A, "_GLUON_FAILED", [])
    monkeypatch.setattr(A, "_interpreting", lambda: False)
    monkeypatch.setattr(A, "gluon_loop_usable", lambda device: not A._GLUON_FAILED)
    monkeypatch.setattr(A, "_gluon_module", lambda: types.SimpleNamespace(HEAD_DIMS=(128, ),
                                                                          attention_from_quantized=broken))
    triton_loop = _Launch()
    monkeypatch.setattr(A, "_autotuned_kernel", lambda: triton_loop)
    monkeypatch.setattr(A, "_triton_module", lambda: types.SimpleNamespace())
    qq, out = _planted_qq(), torch.zeros(1, 1, 256, 128, dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="comfyui_lowvram_dit"):
        A.attention_from_quantized(qq, out, 256, 256)
        A.attention_from_quantized(qq, out, 256, 256)
    assert len(tried) == 1 and triton_loop.calls == 2
    assert A.gluon_loop_failure() == "RuntimeError: PassManager::run failed"
    assert [r.getMessage() for r in caplog.records if "Gluon" in r.getMessage()] == [
        "lowvram_dit 8-bit attention: the Gluon (sm90) loop failed (RuntimeError: PassManager::run failed); "
        "using the Triton loop"]


def test_the_gluon_loop_takes_only_what_it_was_built_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(A, "gluon_loop_usable", lambda device: True)
    monkeypatch.setattr(A, "_gluon_module", lambda: types.SimpleNamespace(HEAD_DIMS=(128, )))
    qq, out = _planted_qq(), torch.zeros(1, 1, 256, 128, dtype=torch.bfloat16)
    assert A._gluon_loop_fits(qq, out)
    for field, value in (("pv_format", "fp8"), ("pv_format", "int8"), ("qk_format", "fp8")):
        assert not A._gluon_loop_fits(types.SimpleNamespace(**{**vars(qq), field: value}), out)
    assert not A._gluon_loop_fits(qq, torch.zeros(1, 1, 256, 64, dtype=torch.bfloat16))  # head dim 64
    assert not A._gluon_loop_fits(qq, torch.zeros(1, 1, 128, 256, dtype=torch.bfloat16).transpose(2, 3))
    strided_q = types.SimpleNamespace(**{**vars(qq), "q16": torch.zeros(1, 1, 128, 256).transpose(2, 3)})
    assert not A._gluon_loop_fits(strided_q, out)


# ------------------------------------------------------------------------------------------------------------
# GPU: the Gluon loop against Triton's loop on the same prologue output

GPU_CASES = [  # (Lq, Lk, layout): ragged tails, Lk inside the first 16-bit block, cross-attention, [B, L, H, D] memory
    (300, 333, "BHLD"), (77, 100, "BHLD"), (1000, 512, "BLHD"), (4097, 4097, "BLHD"), (129, 20000, "BHLD")]
GPU_FAMILIES = ("gauss", "k_token_outliers", "token_outliers", "attention_sinks", "qk_mean_offsets")


def _sm90_with_gluon() -> bool:
    return torch.cuda.is_available() and A.gluon_loop_usable(torch.device("cuda"))


@pytest.mark.cuda
@pytest.mark.parametrize("lq,lk,layout", GPU_CASES)
@pytest.mark.parametrize("family", GPU_FAMILIES)
def test_cuda_gluon_loop_matches_the_triton_loop(lq: int, lk: int, layout: str, family: str) -> None:
    """Measured on an H200 (Triton 3.6): 0.01-0.08 % apart, the same error vs fp32 to 4 digits."""
    if not _sm90_with_gluon():
        pytest.skip("needs an sm90 GPU and a Triton with Gluon >= 3.6")
    q, k, v = make_family(family, 1, 4, lq, lk, 128, device="cuda")
    if layout == "BLHD":  # [B, H, L, D] views of [B, L, H, D] memory, as models call it
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    qq = A.quantize_qkv(q, k, v, qk_format="int8", pv_format="fp16")
    gluon, triton_loop = torch.empty_like(q), torch.empty_like(q)
    A.attention_from_quantized(qq, gluon, lq, lk)
    A.attention_from_quantized(qq, triton_loop, lq, lk, {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4,
                                                         "num_stages": 2})
    assert A.gluon_loop_failure() is None
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert A.relative_error(gluon, triton_loop.float()) < 3e-3
    assert A.relative_error(gluon, ref) <= A.relative_error(triton_loop, ref) + 1e-3


@pytest.mark.cuda
def test_cuda_auto_times_the_fp16_pv_kernel_and_runs_the_faster() -> None:
    """Auto on sm90 at Wan's 480p self-attention shape (fewer heads): the 8-bit candidate passes its first-use check
    and is timed beside the exact backends; whichever of it and the fastest exact one timed faster runs the shape
    (which one wins is the benchmarks' business, not this test's)."""
    if not _sm90_with_gluon():
        pytest.skip("needs an sm90 GPU and a Triton with Gluon >= 3.6")
    from comfyui_lowvram_dit.kernels import attention as attn
    from comfyui_lowvram_dit.kernels import attention_backends as AB

    q, k, v = make_family("gauss", 1, 8, 32760, 32760, 128, device="cuda")
    sel = attn.AttentionSelector()
    out = sel.run(q, k, v, None, "auto")
    (detail,) = sel.details.values()
    ms = detail.timings_ms
    assert "int8_pv16" in ms and "int8_pv16" not in detail.rejected, detail.describe()
    assert detail.errors["int8_pv16"] <= AB.QUANTIZED_TOLERANCE
    exact = min((n for n in ms if not AB.BACKENDS[n].trades_accuracy), key=ms.get)
    assert detail.backend == ("int8_pv16" if ms["int8_pv16"] < ms[exact] else exact), detail.describe()
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert A.relative_error(out, ref) <= (0.02 if detail.backend == "int8_pv16" else 0.005)
