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


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


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
    x = _act(m, k, dtype)
    q, s = fp8_triton.quantize_rowwise(x)
    qr, sr = fp8.quantize_rowwise_torch(x)
    assert torch.equal(s, sr) and _bits_equal(q, qr)
    for g in (128, 64):
        q, s = fp8_triton.quantize_groupwise(x, g, 4)
        qr, sr = fp8.quantize_groupwise_torch(x, g, 4)
        assert s.stride() == sr.stride() and torch.equal(s, sr) and _bits_equal(q, qr)
    q, s = fp8_triton.quantize_tensorwise(x)
    qr, sr = fp8.quantize_tensorwise_torch(x)
    assert torch.equal(s, sr) and _bits_equal(q, qr)


def test_weight_quantization_on_gpu_matches_cpu():
    w = torch.randn(640, 384) * 0.02
    w[:, 5] *= 20
    for quant in (fp8.quantize_per_tensor, fp8.quantize_blockwise):
        qc, sc = quant(w)
        qg, sg = quant(w.cuda())
        assert torch.equal(sg.cpu(), sc) and _bits_equal(qg.cpu(), qc)


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
    """What engineer E relies on: a compiled block containing fp8 linears has no graph break (inductor)."""
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
