"""GPU test of kernels/fp8_requantize.py: the Triton kernel's codes and clip peak equal the torch reference's bit for
bit (the LoRA merge of a resident weight and of a streamed one must give the same bytes). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from comfyui_lowvram_dit.kernels import fp8, fp8_requantize as rq

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)
if not rq.TRITON_AVAILABLE or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("the kernel needs Triton and fp8 conversions (compute capability >= 8.9)", allow_module_level=True)

E4 = torch.float8_e4m3fn


def _hostile(shape: tuple[int, int], dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Gaussian values plus every e4m3 rounding midpoint, subnormal codes, values past 448, NaN and inf (in codes)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    w = torch.randn(shape, generator=g, device="cuda") * (100 * scale)
    codes = torch.arange(256, dtype=torch.uint8, device="cuda").view(E4).float()
    codes = codes[torch.isfinite(codes)].sort().values
    mids = (codes[1:] + codes[:-1]) / 2  # ties: round half to even
    special = torch.cat([codes, mids, mids.nextafter(torch.tensor(float("inf"), device="cuda")),
                         torch.tensor([449.0, -1000.0, 2**-10, -(2**-9) * 1.5, float("nan"), float("inf")],
                                      device="cuda")])
    flat = w.view(-1)
    flat[: special.numel()] = special * scale
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,block", [((5120, 5120), None), ((13824, 5120), None), ((1000, 4100), None),
                                         ((1000, 4100), 128), ((5120, 13824), 128)])
def test_the_kernel_equals_the_torch_reference(dtype, shape, block):
    scale_value = 0.01
    w = _hostile(shape, dtype, scale_value)
    if block is None:
        scale = torch.tensor(scale_value, device="cuda")
    else:
        scale = fp8.quantize_blockwise(w.float().nan_to_num(0, 0, 0), block)[1].cuda()
    q, peak = rq.requantize(w, scale, block, E4)
    qr, pr = rq.requantize_torch(w, scale, block, E4)
    bad = (q.view(torch.uint8) != qr.view(torch.uint8)) & ~(torch.isnan(q.float()) & torch.isnan(qr.float()))
    assert not bad.any(), f"{int(bad.sum())} codes differ, first at {bad.nonzero()[0].tolist()}"
    assert torch.equal(peak, pr), (peak.item(), pr.item())
    if block is None:
        assert peak.item() > 1  # the hostile values go past 448 codes


def test_the_kernel_runs_without_waiting_for_the_gpu():
    w = _hostile((5120, 5120), torch.float16, 0.01)
    scale = torch.tensor(0.01, device="cuda")
    rq.requantize(w, scale, None, E4)  # compiled outside sync debug mode
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rq.requantize(w, scale, None, E4)
    finally:
        torch.cuda.set_sync_debug_mode("default")
