"""The 8-bit attention's 2 % error budget on every outlier-heavy input family (tests/unit/attention_families.py).

CPU: attention_int8_reference, the fp32 emulation of the kernel's exact scheme (rotation, per-token / per-block
scales, K and V mean smoothing, tile-wise fp8 P), on each family at small L; the interpreter test runs the Triton
kernels themselves on two families. GPU (`cuda`): the kernels on the same inputs at L=4096. The Wan shapes
(L = 32,760 and 75,600) are measured by benchmarks/bench_attention_int8.py --families.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import attention_families as AF  # tests/unit/attention_families.py
from comfyui_lowvram_dit.kernels import attention_int8 as A
from triton_interpreter import interpreter_problem

BUDGET = 0.02
# Families a P·V format keeps above 2 % (int8 Q·Kᵀ), with why and the bound that still guards them against
# regressions (measured at the test shapes, fp8 / fp16 P·V: gauss 3.8 / 1.1 %, token_outliers 2.3 / 1.3 %,
# wan_like 2.1 / 0.4 %, k_token_outliers 6.6 / 6.1 %; the GPU test's L=4096: 4.0, 2.3, 2.5, 7.5 % with fp8).
# - gauss, token_outliers, wan_like (fp8): the output is averaged zero-mean V noise (Gaussian V, or V channels
#   whose spread is 2-20x) or dominated by a few huge V tokens, so e4m3's 3-bit rounding of P and V does not
#   average out. wan_like moves with the seed and L (1.5-2.6 % over the ones tried), the others do not.
# - k_token_outliers: keys 10-100x larger make attention near one-hot on them; int8 carries 7 bits of each
#   logit, whose absolute error then grows with the logit. No 8-bit Q·Kᵀ scheme stays within 2 % there.
OVER_BUDGET: dict[str, dict[str, float]] = {
    "fp8": {"gauss": 0.05, "token_outliers": 0.03, "wan_like": 0.03, "k_token_outliers": 0.1},
    "fp16": {"k_token_outliers": 0.1},
}
DEFAULT_FORMATS = (A.DEFAULT_QK_FORMAT, A.DEFAULT_PV_FORMAT)  # what "auto" runs on sm89+


def family_shape(name: str) -> tuple[int, int, int, int, int]:
    """(B, H, Lq, Lk, D) of the CPU tests: Wan's 40 heads for wan_like, 2 heads otherwise."""
    return (1, 40 if name == "wan_like" else 2, 1024, 1024, 128)


def family_error(name: str, qk: str = "int8", pv: str = "fp8", seed: int = 0) -> float:
    """Relative error of the emulated kernel vs fp32 attention on one family at the test shape."""
    q, k, v = AF.make_family(name, *family_shape(name), seed=seed)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    return A.relative_error(A.attention_int8_reference(q, k, v, qk_format=qk, pv_format=pv), ref)


def _expected_over(name: str, pv: str) -> list:
    """pytest.param for one family: strict xfail where OVER_BUDGET says 2 % is out of reach with this P·V."""
    if name in OVER_BUDGET[pv]:
        return pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=f"above 2 % with {pv} P·V: see "
                                                                               "OVER_BUDGET"))
    return pytest.param(name)


def test_families_shapes_determinism_and_bad_names() -> None:
    for name in AF.FAMILIES:
        q, k, v = AF.make_family(name, 1, 4, 40, 300, 64, seed=3)
        assert q.shape == (1, 4, 40, 64) and k.shape == v.shape == (1, 4, 300, 64), name
        assert q.dtype == k.dtype == v.dtype == torch.bfloat16
        assert all(torch.isfinite(t.float()).all() for t in (q, k, v)), name
        again = AF.make_family(name, 1, 4, 40, 300, 64, seed=3)
        assert all(torch.equal(a, b) for a, b in zip((q, k, v), again)), name
        other = AF.make_family(name, 1, 4, 40, 300, 64, seed=4)
        assert not torch.equal(q, other[0]), name
    with pytest.raises(ValueError, match="unknown family 'nope'"):
        AF.make_family("nope", 1, 1, 8, 8, 64)


def test_temperature_normalisation_and_structure() -> None:
    """The normalised families have logit std TEMPERATURE; each structure is really there."""
    for name in ("q_channel_outliers", "k_channel_outliers", "qk_mean_offsets", "head_scales", "v_outliers"):
        q, k, _ = AF.make_family(name, 1, 4, 256, 256, 128, seed=1)
        assert torch.allclose(AF.logit_std(q, k), torch.full((1, 4), AF.TEMPERATURE), rtol=0.02), name
    q, k, v = AF.make_family("k_channel_outliers", 1, 1, 256, 256, 128)
    ch_rms = k.float().pow(2).mean(dim=(0, 1, 2)).sqrt()
    assert ch_rms.max() / ch_rms.median() > 50  # a 100x channel
    _, k, _ = AF.make_family("k_mean_offsets", 1, 1, 256, 256, 128)
    assert k.float().mean(dim=2).abs().mean() > 5 * k.float().std(dim=2).mean()  # offsets dwarf the spread
    _, _, v = AF.make_family("head_scales", 1, 4, 64, 64, 128)
    head_rms = v.float().pow(2).mean(dim=(0, 2, 3)).sqrt()
    assert head_rms[0] / head_rms[1] > 50  # 10x and 0.1x heads
    q, _, v = AF.make_family("token_outliers", 1, 1, 1024, 1024, 128)
    for t in (q, v):
        tok_rms = t.float().pow(2).mean(dim=-1).sqrt()[0, 0]
        assert tok_rms.max() / tok_rms.median() > 50  # a 100x token
    q, k, _ = AF.make_family("wan_like", 1, 40, 256, 256, 128)
    assert AF.logit_std(q, k).max() / AF.logit_std(q, k).min() > 2  # heads differ in sharpness, as in Wan


@pytest.mark.parametrize("name", [_expected_over(n, "fp16") for n in AF.FAMILIES])
def test_qk_scheme_within_budget(name: str) -> None:
    """int8 Q·Kᵀ with fp16 P·V (P·V then adds ~0.1 %): the error left is the Q·Kᵀ scheme's own.
    Without the rotation, q_channel_outliers measured 3.0 %, k_channel_outliers 5.9 % and wan_like 1.7 % here."""
    err = family_error(name, pv="fp16")
    assert err <= BUDGET, f"{name}: int8 Q·Kᵀ error {err:.4f} > {BUDGET}"


@pytest.mark.parametrize("name", [_expected_over(n, DEFAULT_FORMATS[1]) for n in AF.FAMILIES])
def test_default_formats_within_budget(name: str) -> None:
    """The formats 'auto' picks on sm89+ (int8 Q·Kᵀ, fp8 P·V). Without the rotation, q_channel_outliers
    measured 3.3 % and k_channel_outliers 6.1 % here."""
    err = family_error(name, *DEFAULT_FORMATS)
    assert err <= BUDGET, f"{name}: {'/'.join(DEFAULT_FORMATS)} error {err:.4f} > {BUDGET}"


@pytest.mark.parametrize("pv,name", [(pv, n) for pv, table in OVER_BUDGET.items() for n in sorted(table)])
def test_families_over_budget_stay_at_their_measured_error(pv: str, name: str) -> None:
    assert family_error(name, pv=pv) <= OVER_BUDGET[pv][name]


def test_k_token_outliers_attention_is_near_one_hot() -> None:
    """Why k_token_outliers is out of reach: most queries put over half their weight on a single key."""
    q, k, _ = AF.make_family("k_token_outliers", 1, 2, 1024, 1024, 128)
    p = torch.softmax(q.float() @ k.float().transpose(-1, -2) / 128 ** 0.5, dim=-1)
    assert (p.amax(dim=-1) > 0.5).float().mean() > 0.3


# ------------------------------------------------------------------------------------------------------------
# The Triton kernels on two families under TRITON_INTERPRET=1, in a subprocess (see test_attention_int8.py)

_INTERPRETER_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    import torch.nn.functional as F
    sys.path.insert(0, sys.argv[2])
    import attention_families as AF
    from comfyui_lowvram_dit.kernels import attention_int8 as A
    rows = []
    for name in json.loads(sys.argv[1]):
        q, k, v = AF.make_family(name, 1, 2, 256, 256, 128, seed=5)
        out = A.attention_int8(q, k, v, pv_format="fp16", config={"BLOCK_M": 64, "BLOCK_N": 64})
        emu = A.attention_int8_reference(q, k, v, pv_format="fp16", block_n=64)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        rows.append({"family": name, "err_vs_emulation": A.relative_error(out, emu),
                     "err_vs_fp32": A.relative_error(out, ref)})
    print("RESULT" + json.dumps(rows))
""")


@pytest.mark.skipif(A._triton_module() is None, reason="triton is not installed in this environment")
def test_triton_kernels_on_outlier_channel_families_under_interpreter() -> None:
    if (problem := interpreter_problem()) is not None:
        pytest.skip(problem)
    families = ["k_channel_outliers", "wan_like"]
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _INTERPRETER_SCRIPT, json.dumps(families), os.path.dirname(__file__)],
                          check=False, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for row in json.loads(proc.stdout.split("RESULT", 1)[1]):
        assert row["err_vs_emulation"] <= 0.01, row  # the emulation is the kernel's scheme
        assert row["err_vs_fp32"] <= BUDGET, row


# ------------------------------------------------------------------------------------------------------------
# GPU: the kernels on the CPU-generated families (same values as above) at a longer sequence


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(AF.FAMILIES))
def test_cuda_families_match_emulation_and_budget(name: str) -> None:
    qk, pv = A.resolve_formats(torch.device("cuda"))
    q, k, v = (t.cuda() for t in AF.make_family(name, 1, 2, 4096, 4096, 128, seed=0))
    out = A.attention_int8(q, k, v, qk_format=qk, pv_format=pv)
    emu = A.attention_int8_reference(q, k, v, qk_format=qk, pv_format=pv, block_n=128)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert A.relative_error(out, emu) <= 0.015, name
    bound = OVER_BUDGET[pv].get(name, BUDGET)
    assert A.relative_error(out, ref) <= bound, name
