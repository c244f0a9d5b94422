"""GPU tests of kernels/fp8.py: the real fast paths (Triton quantizers, torch._scaled_mm, F.scaled_mm) against the
fp32 emulation `fp8_linear_reference`, and under torch.compile(fullgraph=True). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from comfyui_lowvram_dit.kernels import fp8, fp8_triton

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)

CAP = torch.cuda.get_device_capability()
FP8_GPU = CAP >= (8, 9)
needs_triton = pytest.mark.skipif(not fp8_triton.TRITON_AVAILABLE, reason="triton is not installed")
needs_fp8 = pytest.mark.skipif(not FP8_GPU, reason=f"fp8 matmul needs compute capability >= 8.9, have {CAP}")


def _assert_same_quant(q, s, qr, sr, what: str) -> None:
    """Bit-exact scales, then bit-exact codes, with a message saying which differs and by how much."""
    assert s.shape == sr.shape and s.stride() == sr.stride(), (what, s.shape, s.stride(), sr.shape, sr.stride())
    bad = (s.view(torch.int32) != sr.view(torch.int32)).nonzero()
    assert bad.numel() == 0, (f"{what}: {bad.shape[0]} scales differ, max |ulp diff| "
                              f"{(s.view(torch.int32).long() - sr.view(torch.int32).long()).abs().max().item()}, "
                              f"first at {bad[0].tolist()}: {s[tuple(bad[0])].item()!r} vs {sr[tuple(bad[0])].item()!r}")
    nq = (q.view(torch.uint8) != qr.view(torch.uint8)).sum().item()
    assert nq == 0, f"{what}: scales equal but {nq} fp8 codes differ"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _act(m: int, k: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g)
    x[:, 3] *= 40  # an outlier channel
    x[1] = 0  # an all-zero token
    return x.to(dtype)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,k", [(257, 384), (64, 5120), (3, 13824)])
def test_triton_quantizers_are_bit_exact(dtype, m, k):
    """Triton (div_rn) vs the torch versions on the GPU (tensor / tensor divisions, IEEE on CUDA) and on the CPU.

    Exact is achievable because both sides do the same IEEE operations: amax (exact in any order), amax / 448,
    x / scale, clamp, round-to-nearest-even cast. The first H200 run failed here because torch computed
    `amax / 448.0` (a Python-scalar divisor) as amax * fp32(1/448), 1 ulp off for some rows; kernels/fp8.py now
    divides by a device tensor."""
    x = _act(m, k, dtype)
    xc = x.cpu()
    for what, triton_fn, torch_fn in (
            ("row", fp8_triton.quantize_rowwise, fp8.quantize_rowwise_torch),
            ("group128", lambda t: fp8_triton.quantize_groupwise(t, 128, 4),
             lambda t: fp8.quantize_groupwise_torch(t, 128, 4)),
            ("group64", lambda t: fp8_triton.quantize_groupwise(t, 64, 4),
             lambda t: fp8.quantize_groupwise_torch(t, 64, 4)),
            ("tensor", fp8_triton.quantize_tensorwise, fp8.quantize_tensorwise_torch)):
        q, s = triton_fn(x)
        qr, sr = torch_fn(x)
        _assert_same_quant(q, s, qr, sr, f"{what}: triton vs torch on cuda")
        qc, sc = torch_fn(xc)
        _assert_same_quant(q.cpu(), s.cpu(), qc, sc, f"{what}: triton vs torch on cpu")
    w = torch.tensor(0.0123, device=x.device)  # a per-tensor weight scale folded into the row scales
    q, s = fp8.quantize_activation(x, "row", fold=w)
    qr, sr = fp8.quantize_activation(xc, "row", fold=w.cpu())
    _assert_same_quant(q.cpu(), s.cpu(), qr, sr, "row, folded: triton vs torch on cpu")


def test_weight_quantization_on_gpu_matches_cpu():
    """Checkpoints quantized on the GPU and on the CPU are bit-identical (same IEEE divisions on both)."""
    w = torch.randn(640, 384) * 0.02
    w[:, 5] *= 20
    w[:128, 128:256] = 0  # an all-zero block: SCALE_MIN on both
    for quant in (fp8.quantize_per_tensor, fp8.quantize_blockwise):
        qc, sc = quant(w)
        qg, sg = quant(w.cuda())
        _assert_same_quant(qg.cpu(), sg.cpu(), qc, sc, quant.__name__)
    # many scales, so a 1-ulp disagreement between the devices cannot hide
    for quant in (fp8.quantize_rowwise_torch, lambda t: fp8.quantize_groupwise_torch(t, 128, 4)):
        x = _act(1024, 1024, torch.float32)
        qg, sg = quant(x)
        qc, sc = quant(x.cpu())
        _assert_same_quant(qg.cpu(), sg.cpu(), qc, sc, "activation quantizer, torch cuda vs cpu")


def _paths_for_cap() -> list[tuple[str, int | None]]:
    paths: list[tuple[str, int | None]] = [("dequantize", None), ("dequantize", 128)]
    if FP8_GPU:
        paths.append(("scaled_mm_tensorwise", None))
        if CAP in ((8, 9), (9, 0)):
            paths.append(("scaled_mm_rowwise", None))
        if CAP[0] == 9 and fp8.has_blockwise_scaled_mm():
            paths.append(("scaled_mm_blockwise", 128))
    return paths


@pytest.mark.parametrize("path,block_size", _paths_for_cap())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k,n", [(257, 384, 256), (1024, 5120, 1280)])  # M % 4 != 0, K/128 = 3 (padded to 4)
def test_fast_paths_match_reference(path, block_size, dtype, m, k, n):
    w = torch.randn(n, k, device="cuda") / k**0.5
    w[:, 7] *= 20
    q, s = fp8.quantize_per_tensor(w) if block_size is None else fp8.quantize_blockwise(w, block_size)
    x = _act(m, k, dtype).view(1, m, k)
    bias = (0.1 * torch.randn(n, device="cuda")).to(dtype)
    y = fp8.fp8_linear(x, q, s, bias, block_size=block_size, path=path)
    ref = fp8.fp8_linear_reference(x, q, s, bias, block_size=block_size, path=path)
    assert y.shape == (1, m, n) and y.dtype == dtype
    assert _rel(y, ref) < 5e-3, path  # same quantization; only accumulation order and output rounding differ
    assert _rel(y, F.linear(x.float(), w, bias.float())) < 0.08


@needs_fp8
def test_auto_path_is_the_expected_one_and_correct():
    w = torch.randn(512, 512, device="cuda") * 0.03
    for block_size, (q, s) in ((None, fp8.quantize_per_tensor(w)), (128, fp8.quantize_blockwise(w))):
        path = fp8.select_path("cuda", block_size, 512, 512)
        assert path != "dequantize" or (block_size == 128 and CAP[0] != 9)
        x = _act(100, 512)
        y = fp8.fp8_linear(x, q, s, block_size=block_size)
        assert _rel(y, fp8.fp8_linear_reference(x, q, s, block_size=block_size, path=path)) < 5e-3


@pytest.mark.parametrize("path,block_size", _paths_for_cap())
def test_fast_paths_compile_fullgraph(path, block_size):
    """What Torch Compile relies on: a compiled block containing fp8 linears has no graph break (inductor)."""
    w = torch.randn(384, 512, device="cuda") * 0.03
    q, s = fp8.quantize_per_tensor(w) if block_size is None else fp8.quantize_blockwise(w, block_size)
    bias = torch.randn(384, device="cuda", dtype=torch.bfloat16)

    def block(x):
        h = F.layer_norm(x, (512,))
        return x[..., :384] + fp8.fp8_linear(h, q, s, bias, block_size=block_size, path=path)

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    x = _act(300, 512).view(2, 150, 512)
    assert _rel(compiled(x), block(x)) < 1e-2
