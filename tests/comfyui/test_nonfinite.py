"""Non-finite values are never erased (benchmarks/results/gpu_hostile.md, findings 1-4).

Rule: NaN in -> NaN out; +inf / -inf in -> a non-finite output. The torch quantizers (CPU fallback and reference)
follow it through amax and clamp; the Triton quantizers of fp8 linears and of the 8-bit attention follow it since
they count NaNs (cuda tests below: the Triton interpreter cannot show the bug, its numpy max propagates NaN).
A bf16 file whose weight quantizes to a non-finite scale is refused by name, and a LoRA that is clipped to the
fp8 range says so.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from comfyui_lowvram_dit.kernels import fp8
from comfyui_lowvram_dit.checkpoints import wan as wc
from comfyui_lowvram_dit.checkpoints.safetensors_io import CheckpointError
from comfyui_lowvram_dit.synthetic import checkpoints as synth

BAD = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
WEIGHT = "blocks.0.ffn.0.weight"  # a quantized block Linear of the tiny Wan file


def _poisoned_rows(k: int = 256, m: int = 8) -> tuple[torch.Tensor, dict[str, int]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    rows = {"nan": 1, "inf": 3, "-inf": 6}
    for label, r in rows.items():
        x[r, 17] = BAD[label]
    return x, rows


# ---- torch quantizers (CPU): the rule the Triton kernels must follow ----------------------------------------


def test_torch_activation_quantizers_keep_nan_and_inf_non_finite() -> None:
    x, rows = _poisoned_rows()
    q, s = fp8.quantize_rowwise_torch(x)
    for label, r in rows.items():
        assert not torch.isfinite(s[r]).all() or not torch.isfinite(q[r].float()).all(), label
        assert not torch.isfinite(q[r].float() * s[r]).all(), label  # what the GEMM sees
    assert torch.isnan(s[rows["nan"]]).all() and torch.isnan(q[rows["nan"]].float()).all()
    clean = [r for r in range(x.shape[0]) if r not in rows.values()]
    assert torch.isfinite(q.float()[clean]).all() and torch.isfinite(s[clean]).all()
    q, s = fp8.quantize_groupwise_torch(x, 128, 4)
    a = q.float()[: x.shape[0]] * s[: x.shape[0]].repeat_interleave(128, 1)
    for label, r in rows.items():
        assert not torch.isfinite(a[r]).all(), label
    for label, r in rows.items():
        q, s = fp8.quantize_tensorwise_torch(x[r:r + 1])
        assert not torch.isfinite(q.float() * s).all(), label


@pytest.mark.parametrize("path", ["dequantize"])
def test_fp8_linear_on_cpu_keeps_bad_rows_non_finite(path: str) -> None:
    x, rows = _poisoned_rows()
    w, ws = fp8.quantize_per_tensor(torch.randn(64, 256))
    out = fp8.fp8_linear(x, w, ws, path=path)
    bad = ~torch.isfinite(out).all(dim=-1)
    assert sorted(torch.nonzero(bad).flatten().tolist()) == sorted(rows.values())


# ---- finding 3: a bf16 file quantized at load -------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("nonfinite")
    return synth.write_synthetic("wan21_t2v_1_3B", root / "wan_bf16.safetensors", size="tiny", fmt="bf16", seed=1)


@pytest.mark.parametrize("mode", ["per_tensor", "blockwise"])
@pytest.mark.parametrize("label", list(BAD))
def test_a_bf16_file_with_non_finite_weights_is_refused_by_name(bf16_file: Path, tmp_path: Path, mode: str,
                                                                label: str) -> None:
    sd = load_file(str(bf16_file))
    key = next(k for k in sd if k.endswith(WEIGHT))
    w = sd[key].clone()
    w.view(-1)[[3, 70, 500]] = BAD[label]
    path = tmp_path / f"poisoned_{label}.safetensors"
    save_file({**sd, key: w}, str(path))
    with pytest.raises(CheckpointError) as err:
        wc.load_wan_state_dict(path, mode, 64)
    msg = str(err.value)
    assert msg.startswith(f"{path.name}: ") and repr(key) in msg, msg
    assert "NaN or infinite" in msg and "download it again" in msg and "converted wrongly" in msg, msg


def test_the_clean_bf16_file_still_loads(bf16_file: Path) -> None:
    loaded = wc.load_wan_state_dict(bf16_file, "per_tensor")
    assert loaded.fp8_layers > 0


# ---- finding 4: a LoRA clipped to the fp8 range warns -----------------------------------------------------


@pytest.mark.comfyui
def test_a_lora_past_the_fp8_range_warns_once_per_merge(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    from comfy_server import comfyui_in_process_or_skip

    comfyui_in_process_or_skip()
    from comfyui_lowvram_dit.host import fp8_ops as fp8_layers
    from comfyui_lowvram_dit.host.fp8_ops import Fp8OpsConfig, make_fp8_ops

    monkeypatch.setattr(fp8_layers, "_clip_warned_at", [-math.inf])
    clock = [1000.0]
    monkeypatch.setattr(fp8_layers.time, "monotonic", lambda: clock[0])
    ops = make_fp8_ops(Fp8OpsConfig())
    g = torch.Generator().manual_seed(0)
    q, s = fp8.quantize_per_tensor(torch.randn(32, 64, generator=g))
    layer = ops.Linear(64, 32, bias=False, device="meta")
    layer.load_state_dict({"weight": q, "weight_scale": s}, assign=True)
    caplog.set_level(logging.WARNING, logger="comfyui_lowvram_dit")

    def clip_lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "clipped" in r.getMessage()]

    real = layer.convert_weight(q.float())
    same = layer.set_weight(real + 0.01 * torch.randn(32, 64, generator=g), return_weight=True)  # in range
    assert same.dtype == q.dtype and not clip_lines()
    edge = real.clone()
    edge[0, 0] = s * 449  # a normal LoRA's sliver past the largest weight: clipped silently, as always
    assert layer.set_weight(edge, return_weight=True).float()[0, 0] == 448 and not clip_lines()
    big = real.clone()
    big[0, :5] = s * 448 * 1e6  # 5 values a million times past the range
    new = layer.set_weight(big, return_weight=True)
    assert new.float()[0, :5].eq(448).all()  # still clipped, as before
    (line,) = clip_lines()
    assert "5 values" in line and "[32, 64]" in line and "1e+06 times" in line and "alpha/strength" in line, line
    layer.set_weight(big, return_weight=True)  # the next layer of the same merge: not listed again
    assert len(clip_lines()) == 1
    clock[0] += fp8_layers.CLIP_WARNING_QUIET_S + 1  # a later merge (another load) warns again
    layer.set_weight(big, return_weight=True)
    assert len(clip_lines()) == 2
    nan = real.clone()
    nan[1, 1] = math.nan
    clock[0] += fp8_layers.CLIP_WARNING_QUIET_S + 1
    assert layer.set_weight(nan, return_weight=True).float()[1, 1].isnan()  # NaN stays NaN, not a clip
    assert len(clip_lines()) == 2


@pytest.mark.comfyui
def test_clip_checks_deferred_warn_once_for_the_worst_layer(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """Within ``clip_checks_deferred`` (Block Swap's merge inside a forward) no layer's check is read where it runs;
    ``warn_if_clipped_any`` reads them once and warns for the worst layer, with the same words; a merge whose layers
    stay in range warns nothing."""
    from comfy_server import comfyui_in_process_or_skip

    comfyui_in_process_or_skip()
    from comfyui_lowvram_dit.host import fp8_ops as fp8_layers
    from comfyui_lowvram_dit.host.fp8_ops import Fp8OpsConfig, make_fp8_ops

    monkeypatch.setattr(fp8_layers, "_clip_warned_at", [-math.inf])
    ops = make_fp8_ops(Fp8OpsConfig())
    g = torch.Generator().manual_seed(1)
    layers = []
    for shape in ((32, 64), (48, 64)):
        q, s = fp8.quantize_per_tensor(torch.randn(*shape, generator=g))
        layer = ops.Linear(shape[1], shape[0], bias=False, device="meta")
        layer.load_state_dict({"weight": q, "weight_scale": s}, assign=True)
        layers.append((layer, layer.convert_weight(q.float()), s))
    caplog.set_level(logging.WARNING, logger="comfyui_lowvram_dit")
    peaks: list = []
    with fp8_layers.clip_checks_deferred(peaks):
        for (layer, real, s), factor in zip(layers, (1e3, 1e6)):
            big = real.clone()
            big[0, :3] = s * 448 * factor
            assert layer.set_weight(big, return_weight=True).float()[0, :3].eq(448).all()
    assert len(peaks) == 2 and all(isinstance(p, torch.Tensor) for p, _ in peaks)
    assert not [r for r in caplog.records if "clipped" in r.getMessage()]  # nothing read inside
    fp8_layers.warn_if_clipped_any(peaks)
    (line,) = [r.getMessage() for r in caplog.records if "clipped" in r.getMessage()]
    assert "[48, 64]" in line and "1e+06 times" in line and "alpha/strength" in line and peaks == [], line
    monkeypatch.setattr(fp8_layers, "_clip_warned_at", [-math.inf])  # past the quiet time: a clip would warn
    with fp8_layers.clip_checks_deferred(peaks):
        layer, real, _ = layers[0]
        layer.set_weight(real, return_weight=True)
    fp8_layers.warn_if_clipped_any(peaks)
    assert len([r for r in caplog.records if "clipped" in r.getMessage()]) == 1


# ---- findings 1 and 2 on the GPU: the Triton quantizers ---------------------------------------------------

cuda = pytest.mark.cuda


def _bad_rows_of(out: torch.Tensor) -> list[int]:
    return torch.nonzero(~torch.isfinite(out.float()).all(dim=-1)).flatten().tolist()


@cuda
def test_triton_fp8_quantizers_give_nan_scales_and_codes() -> None:
    from comfyui_lowvram_dit.kernels import fp8_triton as ft

    if not ft.TRITON_AVAILABLE:
        pytest.skip("no Triton")
    x, rows = _poisoned_rows(k=3000, m=37)  # K past one row-kernel chunk (1024)
    x = x.cuda()
    q, s = ft.quantize_rowwise(x)
    qr, sr = fp8.quantize_rowwise_torch(x)
    assert torch.equal(s.isnan(), sr.isnan()) and torch.equal(s.isinf(), sr.isinf())
    assert torch.equal(q.float().isnan(), qr.float().isnan())  # the same NaN codes as torch
    assert torch.isnan(s[rows["nan"]]).all() and torch.isnan(q[rows["nan"]].float()).all()
    for g in (128, 64):
        q, s = ft.quantize_groupwise(x, g, 4)
        qr, sr = fp8.quantize_groupwise_torch(x, g, 4)
        assert torch.equal(s.isnan(), sr.isnan()) and torch.equal(s.isinf(), sr.isinf()), g
        assert torch.equal(q.float().isnan(), qr.float().isnan()), g
    for label, r in rows.items():
        q, s = ft.quantize_tensorwise(x[r:r + 1].contiguous())
        qr, sr = fp8.quantize_tensorwise_torch(x[r:r + 1])
        assert torch.equal(s.isnan(), sr.isnan()) and torch.equal(q.float().isnan(), qr.float().isnan()), label
    clean = torch.randn(64, 3000, device="cuda").to(torch.bfloat16)  # clean input: unchanged bits
    for (qa, sa), (qb, sb) in ((ft.quantize_rowwise(clean), fp8.quantize_rowwise_torch(clean)),
                               (ft.quantize_groupwise(clean, 128, 4), fp8.quantize_groupwise_torch(clean, 128, 4))):
        assert torch.equal(sa, sb) and torch.equal(qa.view(torch.uint8), qb.view(torch.uint8))


@cuda
@pytest.mark.parametrize("path,block", [("scaled_mm_rowwise", None), ("scaled_mm_tensorwise", None),
                                        ("scaled_mm_blockwise", 128), ("dequantize", None)])
def test_fp8_linear_on_the_gpu_keeps_bad_rows_non_finite(path: str, block: int | None) -> None:
    if fp8.device_capability("cuda") is None or fp8.device_capability("cuda") < (8, 9):
        pytest.skip("no fp8 matmul on this GPU")
    if path == "scaled_mm_blockwise" and not fp8.has_blockwise_scaled_mm():
        pytest.skip("no block-wise scaled_mm in this torch")
    x, rows = _poisoned_rows(k=256, m=64)
    w32 = torch.randn(128, 256)
    w, ws = fp8.quantize_blockwise(w32, 128) if block else fp8.quantize_per_tensor(w32)
    out = fp8.fp8_linear(x.cuda(), w.cuda(), ws.cuda(), block_size=block, path=path)
    if path == "scaled_mm_tensorwise":  # one scale for the call: every row may go non-finite, but these must
        assert set(rows.values()) <= set(_bad_rows_of(out))
    else:
        assert _bad_rows_of(out) == sorted(rows.values())


@cuda
@pytest.mark.parametrize("which,value", [("q", math.nan), ("q", math.inf), ("k", math.nan), ("k", -math.inf)])
def test_int8_attention_keeps_nan_and_inf_of_q_and_k(which: str, value: float) -> None:
    import torch.nn.functional as F

    from comfyui_lowvram_dit.kernels import attention_int8

    if not attention_int8.is_supported("cuda", torch.bfloat16, 128):
        pytest.skip("8-bit attention not supported on this GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 4, 300, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    (q if which == "q" else k)[0, 2, 17, 5] = value
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    out = attention_int8.attention_int8(q, k, v)
    exact_bad = ~torch.isfinite(exact).all(dim=-1)
    out_bad = ~torch.isfinite(out).all(dim=-1)
    assert exact_bad.any()
    assert not (exact_bad & ~out_bad).any(), f"{int((exact_bad & ~out_bad).sum())} rows silently finite"
    assert not out_bad[:, [0, 1, 3]].any()  # other heads untouched
