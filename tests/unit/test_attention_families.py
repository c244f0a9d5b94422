"""The 8-bit attention's 2 % error budget on every outlier-heavy input family (tests/unit/attention_families.py).

CPU: attention_int8_reference, the fp32 emulation of the kernel's exact scheme (rotation, per-token / per-block
scales, K and V mean smoothing, sorted keys with the farthest from the mean in 16 bits, tile-wise fp8 or fp16 P),
on each family and combination at small L; the interpreter test runs the Triton kernels themselves on three families. GPU (`cuda`): the kernels on the same inputs at L=4096. The Wan shapes
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
from triton_interpreter import interpreter_env, interpreter_problem

BUDGET = 0.02
DEFAULT_FORMATS = (A.DEFAULT_QK_FORMAT, A.DEFAULT_PV_FORMAT)  # what "auto" runs on sm89+ (sm80/86: fp16 P·V)


def family_shape(name: str) -> tuple[int, int, int, int, int]:
    """(B, H, Lq, Lk, D) of the CPU tests: Wan's 40 heads for wan_like, 2 heads otherwise."""
    return (1, 40 if name == "wan_like" else 2, 1024, 1024, 128)


def family_error(name: str, qk: str = "int8", pv: str = "fp16", seed: int = 0, hi_keys: int | None = None) -> float:
    """Relative error of the emulated kernel vs fp32 attention on one family at the test shape."""
    q, k, v = AF.make_family(name, *family_shape(name), seed=seed)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    return A.relative_error(A.attention_int8_reference(q, k, v, qk_format=qk, pv_format=pv, hi_keys=hi_keys), ref)


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


# Families where fp8 P·V (int8 Q·Kᵀ, fp8 P·V, 16-bit keys: the default; int8 P·V holds 2 % on all) is over
# the 2 % budget at the test shape, with the bound it is held to and why. fp8 P·V rounds P and V to 3 mantissa bits;
# that noise averages out over the keys a query attends to, so it is largest where attention is spread over zero-mean
# noise (gauss, heavy_tailed_v) or near one-hot (the k_token_outliers families: one key carries the output and its P
# and V rounding with it). Each bound sits just above its error here (CPU emulation, 1024 keys, in the comment).
FP8_PV_BOUNDS: dict[str, float] = {
    "gauss": 0.04,  # 3.76 %: zero-mean V noise, fp8 P·V's worst case
    "heavy_tailed_v": 0.04,  # 3.66 %
    "wan_like": 0.025,  # 2.12 %: 1024 keys are few for fp8 P; the Wan shapes are far under 2 %
    "token_outliers": 0.0215,  # 2.06 %: 10-100x V tokens times fp8 P's rounding
    "k_token_outliers": 0.03,  # 2.44 %: near one-hot attention, fp8 P·V of the one key
    "qk_channel_outliers+k_token_outliers": 0.03,  # 2.36 %
    "head_scales+k_token_outliers": 0.03,  # 2.59 %
    "k_channel_outliers+k_mean_offsets+head_scales+k_token_outliers": 0.03,  # 2.27 %
    "qk_channel_outliers+qk_mean_offsets+head_scales+token_outliers+k_token_outliers": 0.0245,  # 2.37 %
}
# fp8 P·V without the 16-bit keys (the scheme before them): far over the bounds above on these (its errors at the
# test shape are 2.3-17 %)
OLD_SCHEME_BREAKS = ("token_outliers", "k_token_outliers", "head_scales+k_token_outliers",
                     "qk_mean_offsets+k_token_outliers",
                     "k_channel_outliers+k_mean_offsets+head_scales+k_token_outliers",
                     "qk_channel_outliers+qk_mean_offsets+head_scales+token_outliers+k_token_outliers")


def fp8_bound(name: str) -> float:
    """The error bound of fp8 P·V on one family at the test shape."""
    return FP8_PV_BOUNDS.get(name, BUDGET)


# The single families in CI, their combinations in the slow tier (about 5 s each on CI's CPUs)
@pytest.mark.parametrize("name", [*AF.FAMILIES, *(pytest.param(c, marks=pytest.mark.slow) for c in AF.COMBINATIONS)])
def test_formats_within_their_bounds(name: str) -> None:
    """On every family and combination: int8 P·V within 2 % (and below fp8's error wherever that is over it); fp8
    P·V (what 'auto' picks on sm89+) within FP8_PV_BOUNDS; fp16 P·V (sm80/86) within 2 %."""
    assert DEFAULT_FORMATS == ("int8", "fp8")
    err = family_error(name, "int8", "int8")
    assert err <= BUDGET, f"{name}: int8/int8 error {err:.4f} > {BUDGET}"
    err8 = family_error(name, "int8", "fp8")
    assert err8 <= fp8_bound(name), f"{name}: int8/fp8 error {err8:.4f} > {fp8_bound(name)}"
    assert name not in FP8_PV_BOUNDS or err < err8
    err16 = family_error(name, "int8", "fp16")
    assert err16 <= BUDGET, f"{name}: int8/fp16 error {err16:.4f} > {BUDGET}"


def test_fp8_bounds_are_ones_the_old_scheme_breaks() -> None:
    """The fp8 bounds are not loose: without the 16-bit keys (the scheme before them) fp8 P·V exceeds them."""
    for name in OLD_SCHEME_BREAKS:
        err = family_error(name, "int8", "fp8", hi_keys=0)
        assert err > fp8_bound(name), f"{name}: the old scheme's error {err:.4f} is within the bound"


@pytest.mark.parametrize("name,pv,hi_keys,above", [
    # keys 10-100x larger: 7 bits of their logits decide which key wins; without the 16-bit keys no P·V helps
    ("k_token_outliers", "fp16", 0, 0.05),
    ("qk_mean_offsets+k_token_outliers", "fp16", 0, 0.2),
    # fp8 P·V: e4m3 rounds P and V to 3 bits, which averaged zero-mean V noise does not average out
    ("gauss", "fp8", None, 0.03),
    ("heavy_tailed_v", "fp8", None, 0.03),
    # int8 P·V without the 16-bit keys: V tokens 10-100x coarsen their blocks' int8 V scales
    ("token_outliers", "int8", 0, 0.025),
])
def test_what_each_part_of_the_scheme_is_for(name: str, pv: str, hi_keys: int | None, above: float) -> None:
    """Without the part, the family is far over budget: the 16-bit keys (with int8 P·V they also take the values
    10-100x the rest), int8 (or fp16) P·V for zero-mean noise."""
    assert family_error(name, pv=pv, hi_keys=hi_keys) > above


def test_k_token_outliers_attention_is_near_one_hot() -> None:
    """Why k_token_outliers needs the 16-bit keys: most queries put over half their weight on a single key."""
    q, k, _ = AF.make_family("k_token_outliers", 1, 2, 1024, 1024, 128)
    p = torch.softmax(q.float() @ k.float().transpose(-1, -2) / 128 ** 0.5, dim=-1)
    assert (p.amax(dim=-1) > 0.5).float().mean() > 0.3


# ------------------------------------------------------------------------------------------------------------
# The Triton kernels on outlier families under TRITON_INTERPRET=1, in a subprocess (see test_attention_int8.py)

_INTERPRETER_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    import torch.nn.functional as F
    sys.path.insert(0, sys.argv[2])
    import attention_families as AF
    from comfyui_lowvram_dit.kernels import attention_int8 as A
    rows = []
    for name in json.loads(sys.argv[1]):
        q, k, v = AF.make_family(name, 1, 2, 200, 300, 128, seed=5)  # 300 keys: 16-bit keys, int8 keys, a tail
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        for pv in ("int8", "fp16"):
            out = A.attention_int8(q, k, v, pv_format=pv, config={"BLOCK_M": 64, "BLOCK_N": 64}, hi_keys=128)
            emu = A.attention_int8_reference(q, k, v, pv_format=pv, block_n=64, hi_keys=128)
            rows.append({"family": name, "pv": pv, "err_vs_emulation": A.relative_error(out, emu),
                         "err_vs_fp32": A.relative_error(out, ref)})
    print("RESULT" + json.dumps(rows))
""")


@pytest.mark.skipif(A._triton_module() is None, reason="triton is not installed in this environment")
def test_triton_kernels_on_outlier_families_under_interpreter() -> None:
    """The kernels (key sort, 16-bit keys, int8 keys, int8 and fp16 P·V) do what the reference does, on the families
    each part is for."""
    if (problem := interpreter_problem()) is not None:
        pytest.skip(problem)
    families = ["k_channel_outliers", "k_token_outliers", "qk_mean_offsets+k_token_outliers", "token_outliers"]
    env = interpreter_env()
    proc = subprocess.run([sys.executable, "-c", _INTERPRETER_SCRIPT, json.dumps(families), os.path.dirname(__file__)],
                          check=False, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for row in json.loads(proc.stdout.split("RESULT", 1)[1]):
        assert row["err_vs_emulation"] <= 0.01, row  # the emulation is the kernel's scheme
        assert row["err_vs_fp32"] <= BUDGET, row


# ------------------------------------------------------------------------------------------------------------
# GPU: the kernels on the CPU-generated families (same values as above) at a longer sequence


@pytest.mark.cuda
@pytest.mark.parametrize("name", AF.ALL_FAMILIES)
def test_cuda_families_match_emulation_and_budget(name: str) -> None:
    qk, pv = A.resolve_formats(torch.device("cuda"))
    q, k, v = (t.cuda() for t in AF.make_family(name, 1, 2, 4096, 4096, 128, seed=0))
    out = A.attention_int8(q, k, v, qk_format=qk, pv_format=pv)
    emu = A.attention_int8_reference(q, k, v, qk_format=qk, pv_format=pv, block_n=128)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert A.relative_error(out, emu) <= 0.015, name
    # The kernel is its scheme: it adds at most half a point of error to the emulation's. The scheme's own bounds
    # are the CPU tests' at 1024 keys; at 4096 some token-outlier families sit up to a point above them.
    err = A.relative_error(out, ref)
    assert err <= A.relative_error(emu, ref) + 0.005, name
    # fp16 P·V ("auto" on sm80/86, and on sm90 in the Gluon loop) holds 2 % wherever its scheme does: on every family
    # but outlier queries stacked with mean offsets and head scales (the emulation's own 2.6 % at 4,096 keys)
    assert pv == "fp8" or err <= BUDGET or A.relative_error(emu, ref) > BUDGET, name
    out8 = A.attention_int8(q, k, v, qk_format="int8", pv_format="int8")
    emu8 = A.attention_int8_reference(q, k, v, qk_format="int8", pv_format="int8", block_n=128)
    assert A.relative_error(out8, emu8) <= 0.015, name
    assert A.relative_error(out8, ref) <= BUDGET, name  # int8 P·V holds 2 % on every family


# ------------------------------------------------------------------------------------------------------------
# Against comfy-kitchen's INT8 attention (ComfyUI's own 8-bit kernel): never less accurate, at Wan's key counts

# comfy-kitchen int8_attention's error vs fp32 per family at Wan 14B 480p (B1 H40 Lq 32,760; benchmarks/results/
# bench_attention_int8_families.md, H100, comfy-kitchen 0.2.31; 0.2.40 measured 1.67 % on gauss there as well)
KITCHEN_MEASURED: dict[int, dict[str, float]] = {
    32760: {"gauss": 0.0167, "rmsnorm_outliers": 0.0049, "q_channel_outliers": 0.0099, "k_channel_outliers": 0.0083,
            "qk_channel_outliers": 0.0055, "k_mean_offsets": 0.0031, "qk_mean_offsets": 0.0028, "head_scales": 0.0028,
            "token_outliers": 0.0776, "k_token_outliers": 0.0923, "v_outliers": 0.0028, "wan_like": 0.0066},
    512: {"gauss": 0.0146, "rmsnorm_outliers": 0.0067, "q_channel_outliers": 0.0139, "k_channel_outliers": 0.0105,
          "qk_channel_outliers": 0.0062, "k_mean_offsets": 0.0105, "qk_mean_offsets": 0.0111, "head_scales": 0.0091,
          "token_outliers": 0.0417, "k_token_outliers": 0.0270, "v_outliers": 0.0094, "wan_like": 0.0070},
}
# At 32,760 keys (5-25 s each on CI's CPUs) CI checks the families nearest comfy-kitchen's error and Wan's own; the
# rest at that length are the slow tier; every family at 512 keys.
KITCHEN_CI_LONG = ("gauss", "wan_like", "token_outliers", "k_token_outliers")
KITCHEN_CASES = [(name, lk) if lk != 32760 or name in KITCHEN_CI_LONG
                 else pytest.param(name, lk, marks=pytest.mark.slow)
                 for lk, table in KITCHEN_MEASURED.items() for name in table]


@pytest.mark.parametrize("name,lk", KITCHEN_CASES)
def test_emulation_not_above_kitchen_at_wan_key_counts(name: str, lk: int) -> None:
    """The int8 P·V scheme's emulation at Wan's key counts (self 32,760, cross 512; 32 queries: the error is a
    per-query statistic) is at most comfy-kitchen's measured error on the same family."""
    q, k, v = AF.make_family(name, 1, 40 if name == "wan_like" else 2, 32, lk, 128, seed=0)
    if name == "wan_like":  # Wan's 40 heads differ in sharpness; four of them keep the test short
        q, k, v = (t[:, ::10] for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    err = A.relative_error(A.attention_int8_reference(q, k, v, qk_format="int8", pv_format="int8"), ref)
    assert err <= KITCHEN_MEASURED[lk][name], f"{name} Lk={lk}: {err:.4f} > comfy-kitchen {KITCHEN_MEASURED[lk][name]}"


def _kitchen_attention():  # noqa: ANN202 - comfy_kitchen.int8_attention or None
    from comfyui_lowvram_dit.kernels import int8_comfy_kitchen

    ck = int8_comfy_kitchen.module()
    return None if ck is None or not ck.int8_attention_is_available(torch.device("cuda")) else ck.int8_attention


# int8 P·V misses comfy-kitchen's measured error on one case (H200, Triton 3.6: 1.02 % against 0.99 %); strict, so
# the mark fails once the kernel meets it
INT8_PV_MISSES = {("q_channel_outliers", 32760)}
CUDA_CASES = [pytest.param(name, lk, pv, marks=pytest.mark.xfail(strict=True, reason="int8 P·V above comfy-kitchen"))
              if pv == "int8" and (name, lk) in INT8_PV_MISSES else (name, lk, pv)
              for name in AF.FAMILIES for lk in (32760, 512) for pv in ("int8", "fp16")]


@pytest.mark.cuda
@pytest.mark.parametrize("name,lk,pv", CUDA_CASES)
def test_cuda_error_not_above_kitchen(name: str, lk: int, pv: str) -> None:
    """The kernel with int8 or fp16 P·V (the latter in the Gluon loop on sm90, where "auto" picks it) at Wan 480p key
    counts (2 heads, 2048 queries) against comfy-kitchen >= 0.2.40 on the same inputs where it runs here, else
    against its measured error (KITCHEN_MEASURED); 2 % on gauss."""
    q, k, v = AF.make_family(name, 1, 2, 2048, lk, 128, seed=0, device="cuda")
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    err = A.relative_error(A.attention_int8(q, k, v, pv_format=pv), ref)
    kitchen = _kitchen_attention()
    bound = A.relative_error(kitchen(q, k, v), ref) + 5e-4 if kitchen is not None \
        else KITCHEN_MEASURED[lk].get(name)
    if bound is None:
        pytest.skip(f"comfy-kitchen >= 0.2.40 does not run here and {name} has no measured comfy-kitchen error")
    assert err <= bound, f"{name} Lk={lk}: {err:.4f} > comfy-kitchen {bound:.4f}"
    assert name != "gauss" or err <= BUDGET
