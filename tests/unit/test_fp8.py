"""CPU tests of kernels/fp8.py: exact quantization round trips, path selection, the fp8 linear vs its fp32
emulation, scaled_mm layouts checked against torch's own meta checks, and one Wan block's accuracy."""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from comfyui_lowvram_dit.kernels import fp8
from triton_interpreter import interpreter_env, interpreter_problem

U8 = torch.uint8


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(U8)


def _weight(n: int, k: int, outlier_cols: tuple[int, ...] = (), mult: float = 20.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5
    for c in outlier_cols:
        w[:, c] *= mult
    return w


# ---- quantize / dequantize -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_per_tensor_round_trip_is_exact(dtype):
    w = _weight(96, 80, (3, 41)).to(dtype)
    q, s = fp8.quantize_per_tensor(w)
    assert q.dtype == fp8.FP8_DTYPE and s.dtype == torch.float32 and s.dim() == 0
    assert s.item() == pytest.approx(w.float().abs().max().item() / 448.0, rel=1e-7)  # correctly rounded
    d = fp8.dequantize_per_tensor(q, s, torch.float32)
    assert torch.equal(d, q.float() * s)
    q2, s2 = fp8.quantize_per_tensor(d)
    assert torch.equal(_bits(q2), _bits(q)) and torch.equal(s2, s)
    # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4 for normal numbers
    normal = (w.float().abs() / s) >= 2**-6
    assert ((d - w.float()).abs() <= w.float().abs() * 2**-4 + 1e-12)[normal].all()


@pytest.mark.parametrize("shape", [(256, 256), (300, 200), (130, 70), (1, 129), (384, 5)])
@pytest.mark.parametrize("block_size", [128, 64])
def test_blockwise_round_trip_is_exact(shape, block_size):
    n, k = shape
    w = _weight(n, k, tuple(c for c in (2, 67) if c < k), mult=30.0).to(torch.bfloat16)
    q, s = fp8.quantize_blockwise(w, block_size)
    assert q.shape == w.shape and q.is_contiguous()
    assert tuple(s.shape) == (-(-n // block_size), -(-k // block_size)) and s.dtype == torch.float32
    # independent per-tile check: each tile's scale is its own amax / 448 (fp32, correctly rounded), and
    # dequant = q * that scale
    expect = torch.empty(n, k)
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            rs, cs = slice(bi * block_size, (bi + 1) * block_size), slice(bj * block_size, (bj + 1) * block_size)
            tile = w[rs, cs].float()
            amax = tile.abs().max().item()  # exact in fp64, so fp64 / 448 rounded to fp32 is the IEEE fp32 quotient
            assert s[bi, bj].item() == max(torch.tensor(amax / 448.0, dtype=torch.float32).item(), fp8.SCALE_MIN)
            expect[rs, cs] = q[rs, cs].float() * s[bi, bj]
    d = fp8.dequantize_blockwise(q, s, block_size, torch.float32)
    assert torch.equal(d, expect)
    q2, s2 = fp8.quantize_blockwise(d, block_size)
    assert torch.equal(_bits(q2), _bits(q)) and torch.equal(s2, s)
    assert torch.equal(fp8.dequantize(q, s, block_size, torch.bfloat16), expect.to(torch.bfloat16))


def test_zeros_and_zero_blocks_are_safe():
    z = torch.zeros(64, 200)
    q, s = fp8.quantize_per_tensor(z)
    assert s.item() == fp8.SCALE_MIN and not _bits(q).any()
    assert torch.equal(fp8.dequantize_per_tensor(q, s, torch.float32), z)
    w = _weight(256, 256)
    w[:128, 128:] = 0  # one all-zero 128x128 block
    q, s = fp8.quantize_blockwise(w)
    assert s[0, 1].item() == fp8.SCALE_MIN
    d = fp8.dequantize_blockwise(q, s, 128, torch.float32)
    assert torch.isfinite(d).all() and not d[:128, 128:].any()
    xq, xs = fp8.quantize_rowwise_torch(torch.zeros(3, 64, dtype=torch.bfloat16))
    assert torch.isfinite(xs).all() and not _bits(xq).any()
    assert fp8.quantize_per_tensor(torch.zeros(0, 16))[0].shape == (0, 16)


def test_blockwise_rejects_bad_input():
    with pytest.raises(ValueError, match="2-D"):
        fp8.quantize_blockwise(torch.randn(4, 4, 4))
    q, s = fp8.quantize_blockwise(torch.randn(256, 256))
    with pytest.raises(ValueError, match="block scale shape"):
        fp8.dequantize_blockwise(q, s, 64)


def test_blockwise_beats_per_tensor_when_per_tensor_underflows():
    """Why block scales exist: outlier channels 2^15x push the other weights into e4m3 subnormals per tensor."""
    w = _weight(256, 512, (5, 9), mult=32768.0)
    rest = torch.ones(512, dtype=torch.bool)
    rest[[5, 9]] = False
    err = {}
    for name, (q, s, bs) in {"tensor": (*fp8.quantize_per_tensor(w), None),
                             "block": (*fp8.quantize_blockwise(w), 128)}.items():
        d = fp8.dequantize(q, s, bs, torch.float32)
        err[name] = ((d - w)[:, rest].norm() / w[:, rest].norm()).item()
    assert err["block"] <= 0.7 * err["tensor"], err


# ---- activation quantizers -------------------------------------------------------------------------------------


def _lora_requant_errors(ratio: float) -> dict[str, float]:
    """Relative L2 error against W + delta (W: tiny synthetic Wan block weights with outlier channels, delta: a
    rank-16 LoRA delta with ||delta|| = ratio * ||W||) of fp8 W + delta re-quantized into W's existing scale
    (what a merged LoRA gets) or into a scale recomputed from the merged weight, per tensor and per 128-block."""
    from comfyui_lowvram_dit.checkpoints import wan as wan_checkpoint
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    sd = synth.synthetic_state_dict("wan22_t2v_14B", size="tiny", fmt="bf16", seed=11)
    g = torch.Generator().manual_seed(0)
    err = dict.fromkeys(("existing", "recomputed", "existing_bw", "recomputed_bw", "ref"), 0.0)
    for k, v in sd.items():
        if not wan_checkpoint.is_fp8_target(k, tuple(v.shape)):
            continue
        w = v.float()
        d = torch.randn(w.shape[0], 16, generator=g) @ torch.randn(16, w.shape[1], generator=g)
        d = d * ratio * w.norm() / d.norm()
        ref = w + d
        q, s = fp8.quantize_per_tensor(w)
        merged = q.float() * s + d
        existing = (merged / s).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8_DTYPE).float() * s
        recomputed = fp8.dequantize(*fp8.quantize_per_tensor(merged), None, torch.float32)
        qb, sb = fp8.quantize_blockwise(w, 128)
        sbe = fp8.expand_block_scale(sb, tuple(w.shape), 128)
        merged_bw = qb.float() * sbe + d
        existing_bw = (merged_bw / sbe).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8_DTYPE).float() * sbe
        recomputed_bw = fp8.dequantize(*fp8.quantize_blockwise(merged_bw, 128), 128, torch.float32)
        for name, t in (("existing", existing), ("recomputed", recomputed), ("existing_bw", existing_bw),
                        ("recomputed_bw", recomputed_bw)):
            err[name] += (t - ref).pow(2).sum().item()
        err["ref"] += ref.pow(2).sum().item()
    return {n: (e / err["ref"]) ** 0.5 for n, e in err.items() if n != "ref"}


@pytest.mark.parametrize("ratio", [0.02, 0.1, 0.3])
def test_lora_merge_into_the_existing_scale_is_no_worse_than_a_new_scale(ratio: float) -> None:
    """Why merged LoRAs keep the layer's scale (which ComfyUI's unpatch restores with the weight): for deltas up to
    30 % of the weight the error is the same within 0.1 % (measured 0.0296/0.0336/0.0347 per tensor)."""
    e = _lora_requant_errors(ratio)
    assert e["existing"] <= e["recomputed"] * 1.001, e
    assert e["existing_bw"] <= e["recomputed_bw"] * 1.001, e


def test_lora_as_large_as_the_weight_clips_in_the_existing_block_scale() -> None:
    """Where keeping the scale stops holding: a delta as large as the weight overflows small blocks' scales."""
    e = _lora_requant_errors(1.0)
    assert e["existing_bw"] > 1.3 * e["recomputed_bw"], e


def test_groupwise_activation_layout_and_padding():
    x = torch.randn(6, 384, dtype=torch.bfloat16)
    x[2] = 0
    q, s = fp8.quantize_groupwise_torch(x, 128, pad_rows_to=4)
    assert q.shape == (8, 384) and s.shape == (8, 3) and s.stride() == (1, 8)  # column-major, rows padded to 8
    assert not _bits(q[6:]).any()
    d = q[:6].float() * s[:6].repeat_interleave(128, 1)
    for g in range(3):
        cols = slice(128 * g, 128 * (g + 1))
        row_amax = x[:, cols].float().abs().amax(1)
        assert torch.equal(s[:6, g], (row_amax / 448).clamp_min(fp8.SCALE_MIN))  # CPU: a true division
    assert ((d - x.float()).abs() <= x.float().abs() * 2**-4 + s[:6].max() * 2**-9).all()
    qr, sr = fp8.quantize_rowwise_torch(x)
    assert sr.shape == (6, 1) and torch.equal(sr[:, 0], (x.float().abs().amax(1) / 448).clamp_min(fp8.SCALE_MIN))


def test_scale_is_the_ieee_quotient():
    """Scales are the correctly rounded fp32 amax / 448 (checked against fp64), not amax * fp32(1/448), which is
    what torch's CUDA kernel computes for `t / 448.0` and differs by 1 ulp for some amax (the cases exist: the
    H200 run of tests/unit/test_fp8_cuda.py failed on them). The GPU side is tested there."""
    amax = torch.linspace(1e-3, 1e3, 4099)
    ieee = (amax.double() / 448.0).float()  # fp32 / 448 is exact in fp64, so this is the correctly rounded quotient
    assert not torch.equal(amax * torch.tensor(1 / 448.0), ieee)  # the 1-ulp cases exist
    assert torch.equal(fp8._scale_from_amax(amax), ieee)
    assert torch.equal(fp8._scale_from_amax(torch.zeros(3)), torch.full((3,), fp8.SCALE_MIN))
    assert fp8.SCALE_MIN == torch.finfo(torch.float32).tiny


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed in this venv")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: tests/unit/test_fp8_cuda.py runs the real kernels "
                    "(and Triton 3.6's interpreter breaks on numpy 2.5 there)")
def test_triton_quantizers_match_torch_in_interpreter():
    """Runs the Triton kernels with TRITON_INTERPRET=1 (a subprocess: the flag is read when kernels are defined).
    For machines without a GPU only.

    The interpreter's own fp32->fp8 cast is wrong (it rounds 127.1 to 64), so the kernels write fp32 here and the
    cast is done by torch; the GPU cast is covered by tests/unit/test_fp8_cuda.py.
    """
    if (problem := interpreter_problem()) is not None:
        pytest.skip(problem)
    script = textwrap.dedent("""
        import torch
        from comfyui_lowvram_dit.kernels import fp8, fp8_triton as ft
        torch.manual_seed(0)
        x = torch.randn(37, 300, dtype=torch.bfloat16); x[3] = 0; x[:, 7] *= 40
        e4 = torch.float8_e4m3fn
        same = lambda qf, qr: torch.equal(qf.to(e4).view(torch.uint8), qr.view(torch.uint8))
        qf, s = ft._launch_rows(x, None, torch.float32, ft._direct); qr, sr = fp8.quantize_rowwise_torch(x)
        assert torch.equal(s, sr) and same(qf, qr), "rows"
        w = torch.tensor(0.37)  # a per-tensor weight scale folded into the row scales: same codes, scales times w
        qf, s = ft._launch_rows(x, w, torch.float32, ft._direct)
        assert torch.equal(s, sr * w) and same(qf, qr), "rows, folded"
        for g in (128, 64):
            qf, s = ft._launch_groups(x, g, 4, torch.float32, ft._direct)
            qr, sr = fp8.quantize_groupwise_torch(x, g, 4)
            assert s.stride() == sr.stride() == (1, 40) and torch.equal(s, sr) and same(qf, qr), g
        qf, s = ft._launch_scalar(x, torch.float32, ft._direct); qr, sr = fp8.quantize_tensorwise_torch(x)
        assert torch.equal(s, sr) and same(qf, qr), "tensor"
        q, s = ft.quantize_groupwise(x, 128, 4)  # through the registered triton_op
        assert q.dtype == e4 and q.shape == (40, 300) and s.stride() == (1, 40)
        print("OK")
    """)
    env = interpreter_env()
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


# ---- path selection ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cap,block,dims,expect", [
    ((9, 0), None, (5120, 5120), fp8.PER_TENSOR_DEFAULT_PATH),
    ((9, 0), 128, (13824, 5120), "scaled_mm_blockwise" if fp8.has_blockwise_scaled_mm() else "dequantize"),
    ((9, 0), 64, (5120, 5120), "dequantize"),
    ((9, 0), 128, (5120, 5184), "dequantize"),  # K not a multiple of 128: no cuBLASLt block path
    ((8, 9), None, (3072, 3072), "scaled_mm_rowwise" if fp8.PER_TENSOR_DEFAULT_PATH == "scaled_mm_rowwise"
     else "scaled_mm_tensorwise"),
    ((8, 9), 128, (3072, 3072), "dequantize"),
    ((12, 0), None, (3072, 3072), "scaled_mm_tensorwise"),
    ((12, 0), 128, (3072, 3072), "dequantize"),
    ((8, 6), None, (3072, 3072), "dequantize"),
    ((9, 0), None, (5120, 36), "dequantize"),  # in_features not a multiple of 16
    ((9, 0), None, (100, 5120), "dequantize"),
])
def test_select_path_per_architecture(cap, block, dims, expect):
    assert fp8.select_path("cuda", block, *dims, capability=cap) == expect


def test_select_path_overrides_and_errors():
    assert fp8.select_path("cpu", None, 256, 256) == "dequantize"
    assert fp8.select_path("cuda", None, 256, 256, "dequantize", capability=(9, 0)) == "dequantize"
    assert fp8.select_path("cuda", None, 256, 256, "fp8", capability=(9, 0)) != "dequantize"
    with pytest.raises(RuntimeError, match="compute capability"):
        fp8.select_path("cpu", None, 256, 256, "fp8")
    with pytest.raises(ValueError, match="compute"):
        fp8.select_path("cpu", None, 256, 256, "fast")


def _fallback_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "comfyui_lowvram_dit" and "fp8:" in r.getMessage()]


def test_auto_on_a_gpu_without_fp8_matmul_falls_back_and_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(fp8, "device_capability", lambda device: (8, 6))  # an RTX 3090, seen from a CPU box
    monkeypatch.setattr(fp8, "_gpu_name", lambda device: "NVIDIA GeForce RTX 3090")
    monkeypatch.setattr(fp8, "_FALLBACKS_SAID", set())
    caplog.set_level("WARNING", logger="comfyui_lowvram_dit")
    for _ in range(3):  # every Linear of a model asks: one message per device and reason
        assert fp8.select_path("cuda:0", None, 5120, 5120, "auto") == "dequantize"
    (msg,) = _fallback_messages(caplog)
    assert "compute 'auto'" in msg and "NVIDIA GeForce RTX 3090" in msg and "compute capability 8.6" in msg
    assert "falling back to 'dequantize'" in msg and "compute to 'dequantize'" in msg
    with pytest.raises(RuntimeError, match="compute capability"):  # explicit fp8 still refuses
        fp8.select_path("cuda:0", None, 5120, 5120, "fp8")
    # Explicit capability (planning, the doctor's what-if) and CPU runs never log.
    assert fp8.select_path("cuda:0", None, 5120, 5120, capability=(7, 5)) == "dequantize"
    assert fp8.select_path("cpu", None, 5120, 5120) == "dequantize"
    assert fp8.select_path("cuda:0", None, 256, 256, "dequantize") == "dequantize"
    assert len(_fallback_messages(caplog)) == 1


def test_blockwise_weights_without_a_blockwise_gemm_fall_back_and_say_so(monkeypatch, caplog):
    monkeypatch.setattr(fp8, "device_capability", lambda device: (8, 9))  # Ada: per-tensor fp8 GEMM only
    monkeypatch.setattr(fp8, "_gpu_name", lambda device: "NVIDIA GeForce RTX 4090")
    monkeypatch.setattr(fp8, "_FALLBACKS_SAID", set())
    caplog.set_level("WARNING", logger="comfyui_lowvram_dit")
    assert fp8.select_path("cuda:0", 128, 5120, 5120, "auto") == "dequantize"
    assert fp8.select_path("cuda:0", 128, 5120, 13824, "auto") == "dequantize"
    assert fp8.select_path("cuda:0", 128, 5120, 5184, "auto") == "dequantize"  # odd shape: silent
    assert fp8.select_path("cuda:0", None, 5120, 5120, "auto") != "dequantize"  # per-tensor: fp8 matmul, silent
    (msg,) = _fallback_messages(caplog)
    assert "RTX 4090" in msg and "8.9" in msg and "Hopper" in msg and "'fp8 per-tensor'" in msg
    monkeypatch.setattr(fp8, "device_capability", lambda device: (9, 0))
    assert fp8.select_path("cuda:0", 64, 5120, 5120, "auto") == "dequantize"
    assert "block_size 64" in _fallback_messages(caplog)[-1]


# ---- fp8_linear vs its emulation -----------------------------------------------------------------------------


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@functools.lru_cache(maxsize=None)
def _cpu_rowwise_scaled_mm_error() -> str | None:
    """None when this torch's CPU torch._scaled_mm takes row-wise scales, else its error (probed once, 16x16).

    torch 2.13 CPU does; torch 2.11's CPU (mkldnn) kernel asserts "Now _scaled_mm only supports per-tensor scaling
    for CPU backend"."""
    a = torch.ones(16, 16).to(fp8.FP8_DTYPE)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError as e:
        return str(e).splitlines()[0][-160:]
    return None


def _skip_unless_cpu_supports(path: str) -> None:
    if path == "scaled_mm_rowwise" and (err := _cpu_rowwise_scaled_mm_error()):
        pytest.skip(f"this torch's CPU _scaled_mm has no row-wise scaling: {err}")


@pytest.mark.parametrize("path", ["scaled_mm_rowwise", "scaled_mm_tensorwise", "dequantize"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_linear_matches_reference_on_cpu(path, dtype):
    """torch._scaled_mm has a CPU kernel, so the row/tensor-wise paths run here for real (3-D input, bias)."""
    _skip_unless_cpu_supports(path)
    w = _weight(192, 256, (7,))
    q, s = fp8.quantize_per_tensor(w)
    x = torch.randn(2, 9, 256).to(dtype)
    bias = (torch.randn(192) * 0.1).to(dtype)
    y = fp8.fp8_linear(x, q, s, bias, path=path)
    ref = fp8.fp8_linear_reference(x, q, s, bias, path=path)
    assert y.shape == (2, 9, 192) and y.dtype == dtype
    assert _rel(y, ref) < 2e-3
    exact = F.linear(x.float(), w, bias.float())
    assert _rel(y, exact) < 0.06  # fp8 W8A8 error on Gaussian data is ~3-4% (research notes)


@pytest.mark.parametrize("path", ["scaled_mm_rowwise", "scaled_mm_tensorwise", "dequantize"])
def test_a_sample_computes_the_same_in_any_batch(path):
    """cond and uncond batched on one GPU, or one each on two GPUs (ComfyUI's MultiGPU split): a sample's output
    must not depend on what it is batched with. A per-call activation scale over the whole batch would."""
    _skip_unless_cpu_supports(path)
    w = _weight(192, 256, (7,))
    q, s = fp8.quantize_per_tensor(w)
    x = torch.randn(2, 9, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    x[1] *= 40  # the other sample's activations are much larger: a shared scale would coarsen sample 0
    both = fp8.fp8_linear(x, q, s, None, path=path)
    for i in range(2):
        alone = fp8.fp8_linear(x[i:i + 1], q, s, None, path=path)
        assert torch.equal(both[i:i + 1], alone)
        ref_both = fp8.fp8_linear_reference(x, q, s, None, path=path)[i:i + 1]
        # the fp32 emulation's GEMM blocks differently per batch size; its bf16 output then rounds by an ulp
        assert _rel(ref_both, fp8.fp8_linear_reference(x[i:i + 1], q, s, None, path=path)) < 2e-3


def test_fp8_linear_auto_on_cpu_dequantizes_any_dtype():
    w = _weight(100, 36)  # odd shape
    for bs, (q, s) in ((None, fp8.quantize_per_tensor(w)), (64, fp8.quantize_blockwise(w, 64))):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(5, 36, dtype=dtype)
            y = fp8.fp8_linear(x, q, s, block_size=bs)
            assert y.dtype == dtype
            expect = F.linear(x, fp8.dequantize(q, s, bs, dtype))
            assert torch.equal(y, expect)
            assert _rel(y, fp8.fp8_linear_reference(x, q, s, block_size=bs)) < 1e-2


def test_fp8_linear_rejects_mismatches():
    q, s = fp8.quantize_per_tensor(torch.randn(64, 64))
    qb, sb = fp8.quantize_blockwise(torch.randn(256, 256))
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="per-tensor weights"):
        fp8.fp8_linear(torch.randn(3, 256, dtype=torch.bfloat16), qb, sb, block_size=128, path="scaled_mm_rowwise")
    with pytest.raises(ValueError, match="block-wise"):
        fp8.fp8_linear(x, q, s, path="scaled_mm_blockwise")
    with pytest.raises(ValueError, match="bf16/fp16"):
        fp8.fp8_linear(x.float(), q, s, path="scaled_mm_rowwise")
    with pytest.raises(ValueError, match="block-wise scale shape"):
        fp8.fp8_linear(torch.randn(3, 256), qb, sb, block_size=64)
    with pytest.raises(ValueError, match="features"):
        fp8.fp8_linear(torch.randn(3, 65), q, s)


def test_fast_accum_runs_where_torch_takes_it():
    qw, sw = fp8.quantize_per_tensor(torch.randn(64, 128))
    x = torch.randn(4, 128).bfloat16()
    try:
        y = fp8.fp8_linear(x, qw, sw, path="scaled_mm_tensorwise", act=fp8.ActQuant(fast_accum=True))
    except (RuntimeError, TypeError) as exc:  # a CPU kernel without the argument
        pytest.skip(f"this torch's CPU _scaled_mm rejects use_fast_accum: {exc}")
    assert _rel(y, fp8.fp8_linear(x, qw, sw, path="scaled_mm_tensorwise")) < 1e-2


@pytest.mark.parametrize("m,k,n", [(6, 384, 256), (32, 5120 // 10, 128)])
def test_blockwise_scaled_mm_layouts_pass_torch_meta_checks(m, k, n):
    """F.scaled_mm's meta kernel enforces cuBLASLt's layouts: 1x128 scales column-major with stride M, the
    128x128 weight scale transposed and padded to a multiple of 4 K-blocks. Check ours on meta tensors."""
    if not fp8.has_blockwise_scaled_mm():
        pytest.skip("torch has no F.scaled_mm (needs torch >= 2.10)")
    x = torch.empty(m, k, dtype=torch.bfloat16, device="meta")
    w = torch.empty(n, k, dtype=fp8.FP8_DTYPE, device="meta")
    s = torch.empty(n // 128, k // 128, device="meta")
    bias = torch.empty(n, dtype=torch.bfloat16, device="meta")
    out = fp8._linear_scaled_mm(x, w, s, bias, "scaled_mm_blockwise", torch.bfloat16)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("path", ["scaled_mm_rowwise", "scaled_mm_tensorwise", None])
def test_fp8_linear_compiles_without_graph_breaks(path):
    _skip_unless_cpu_supports(path)
    w = _weight(128, 128)
    q, s = fp8.quantize_per_tensor(w)
    x = torch.randn(2, 5, 128, dtype=torch.bfloat16)
    torch._dynamo.reset()
    f = torch.compile(lambda x: fp8.fp8_linear(x, q, s, path=path), fullgraph=True, backend="eager")  # None = auto
    assert torch.equal(f(x), fp8.fp8_linear(x, q, s, path=path))


def test_blockwise_path_compiles_fullgraph_on_meta():
    """Dynamo cannot trace torch._scaled_mm_v2 (what F.scaled_mm calls; torch 2.11), so the block-wise GEMM is a
    custom op under compile. Traced here on meta tensors (no CPU kernel exists); the op's fake implementation runs
    torch's meta checks, so a bad scale layout still fails."""
    if not fp8.has_blockwise_scaled_mm():
        pytest.skip("torch has no F.scaled_mm (needs torch >= 2.10)")
    w = torch.empty(256, 384, dtype=fp8.FP8_DTYPE, device="meta")
    s = torch.empty(2, 3, device="meta")
    bias = torch.empty(256, dtype=torch.bfloat16, device="meta")
    torch._dynamo.reset()
    f = torch.compile(lambda x: fp8.fp8_linear(x, w, s, bias, block_size=128, path="scaled_mm_blockwise"),
                      fullgraph=True, backend="eager")
    y = f(torch.empty(2, 7, 384, dtype=torch.bfloat16, device="meta"))  # M = 14: rows padded to 16 and sliced back
    assert y.shape == (2, 7, 256) and y.dtype == torch.bfloat16


# ---- accuracy of one Wan block --------------------------------------------------------------------------------

WAN_LINEARS = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.k",
               "cross_attn.v", "cross_attn.o", "ffn.0", "ffn.2")


def _wan_block_state_dict(dim: int, ffn: int, outlier_mult: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights of one Wan 2.x WanAttentionBlock (key names as in the checkpoints), with outlier input channels."""
    g = torch.Generator().manual_seed(seed)
    sd = {"modulation": torch.randn(1, 6, dim, generator=g) / dim**0.5}
    for name in WAN_LINEARS:
        n, k = {"ffn.0": (ffn, dim), "ffn.2": (dim, ffn)}.get(name, (dim, dim))
        w = torch.randn(n, k, generator=g) / k**0.5
        w[:, torch.randperm(k, generator=g)[: max(1, k // 128)]] *= outlier_mult
        sd[f"{name}.weight"], sd[f"{name}.bias"] = w, torch.randn(n, generator=g) * 0.02
    for name in ("self_attn.norm_q", "self_attn.norm_k", "cross_attn.norm_q", "cross_attn.norm_k", "norm3"):
        sd[f"{name}.weight"] = 1 + 0.1 * torch.randn(dim, generator=g)
    sd["norm3.bias"] = 0.02 * torch.randn(dim, generator=g)
    return sd


def _wan_block(sd, x, e, context, heads, linear):
    """WanAttentionBlock.forward (comfy/ldm/wan/model.py) without RoPE, which has no weights."""
    dim = x.shape[-1]
    mod = (sd["modulation"] + e).chunk(6, dim=1)

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def attn(p, xq, xkv):
        q = rms(linear(f"{p}.q", xq), sd[f"{p}.norm_q.weight"])
        k = rms(linear(f"{p}.k", xkv), sd[f"{p}.norm_k.weight"])
        v = linear(f"{p}.v", xkv)
        heads_of = lambda t: t.view(t.shape[0], t.shape[1], heads, -1).transpose(1, 2)  # noqa: E731
        o = F.scaled_dot_product_attention(heads_of(q), heads_of(k), heads_of(v))
        return linear(f"{p}.o", o.transpose(1, 2).reshape(x.shape[0], -1, dim))

    h = F.layer_norm(x, (dim,)) * (1 + mod[1]) + mod[0]
    x = x + attn("self_attn", h, h) * mod[2]
    x = x + attn("cross_attn", F.layer_norm(x, (dim,), sd["norm3.weight"], sd["norm3.bias"]), context)
    h = F.layer_norm(x, (dim,)) * (1 + mod[4]) + mod[3]
    return x + linear("ffn.2", F.gelu(linear("ffn.0", h), approximate="tanh")) * mod[5]


def _wan_block_errors(outlier_mult: float) -> dict[str, float]:
    dim, ffn, heads = 256, 768, 2
    sd = _wan_block_state_dict(dim, ffn, outlier_mult)
    g = torch.Generator().manual_seed(1)
    x, e, ctx = (torch.randn(1, 96, dim, generator=g), 0.1 * torch.randn(1, 6, dim, generator=g),
                 torch.randn(1, 24, dim, generator=g))
    ref = _wan_block(sd, x, e, ctx, heads, lambda n, h: F.linear(h, sd[f"{n}.weight"], sd[f"{n}.bias"]))

    def fp8_linear_fn(block_size, path):
        quant = fp8.quantize_per_tensor if block_size is None else fp8.quantize_blockwise
        qs = {n: quant(sd[f"{n}.weight"]) for n in WAN_LINEARS}
        return lambda n, h: fp8.fp8_linear_reference(h.bfloat16(), *qs[n], sd[f"{n}.bias"].bfloat16(),
                                                     block_size=block_size, path=path).float()

    variants = {
        "bf16": lambda n, h: F.linear(h.bfloat16(), sd[f"{n}.weight"].bfloat16(),
                                      sd[f"{n}.bias"].bfloat16()).float(),
        "per_tensor": fp8_linear_fn(None, fp8.PER_TENSOR_DEFAULT_PATH),
        "blockwise": fp8_linear_fn(128, "scaled_mm_blockwise"),
    }
    return {name: _rel(_wan_block(sd, x, e, ctx, heads, lin), ref) for name, lin in variants.items()}


@pytest.mark.parametrize("outlier_mult", [1.0, 20.0])
def test_wan_block_fp8_accuracy(outlier_mult, capsys):
    """Relative error of one Wan block (dim 256) vs fp32 with fp8 weights: per-tensor (row-wise activations) vs
    block-wise (128x128 weights, 1x128 activations). Measured here over seeds 0-2: no outliers: per-tensor
    2.18-2.25%, block-wise 2.13-2.20%; 20x outlier input channels: per-tensor 5.4-6.1%, block-wise 5.0-6.1%
    (bf16: 0.2-0.5%). The 0.7x goal is NOT reached: e4m3 rounding is relative (3 mantissa bits) whatever the scale,
    so block scales only win where a per-tensor scale pushes weights into subnormals (the 2^15 test above)."""
    err = _wan_block_errors(outlier_mult)
    with capsys.disabled():
        print(f"\nWan block rel. error vs fp32 (outliers {outlier_mult}x): "
              + ", ".join(f"{k} {v:.4%}" for k, v in err.items()))
    assert err["bf16"] < 0.01
    assert err["per_tensor"] < 0.08 and err["blockwise"] < 0.08
    assert err["blockwise"] <= 1.15 * err["per_tensor"]  # never materially worse
