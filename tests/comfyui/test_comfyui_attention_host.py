"""Attention auto against ComfyUI's own attention functions, in-process on CPU (0.8.0 and newer hosts):
the layout adapter, discovery through the public registry, fake registered backends that are faster, slower,
quantized or broken, and a host without the registry."""

from __future__ import annotations

import functools
import logging
import sys
import time
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from comfy_server import comfyui_in_process_or_skip, sample_wan

pytestmark = pytest.mark.comfyui
_sample = functools.partial(sample_wan, frames=1)


@pytest.fixture(scope="module")
def core() -> Any:
    """ComfyUI's attention module, imported in this process on CPU."""
    comfyui_in_process_or_skip()
    import comfy.model_management  # noqa: F401 - after args.cpu
    from comfy.ldm.modules import attention

    return attention


@pytest.fixture(scope="module")
def tiny_wan(core: Any) -> Any:
    """A 2-block Wan 2.2 14B-layout model from the synthetic checkpoint, as UNETLoader builds it."""
    synth = pytest.importorskip("comfyui_lowvram_dit.synthetic.checkpoints")
    import comfy.sd

    return comfy.sd.load_diffusion_model_state_dict(synth.synthetic_state_dict("wan22_t2v_14B", size="tiny"))


@pytest.fixture
def fake_core(core: Any, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201 - registers fake core functions
    """Register fake functions in ComfyUI's registry (and optionally make one the default); undone afterwards."""
    monkeypatch.setattr(core, "REGISTERED_ATTENTION_FUNCTIONS", dict(core.REGISTERED_ATTENTION_FUNCTIONS))

    def register(name: str, delay: float = 0.0, broken: str = "", noise: float = 0.0, default: bool = False) -> list:
        calls: list = []

        @core.wrap_attn
        def fake(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                 **kwargs):
            calls.append(q.shape)
            time.sleep(delay)
            if broken == "raises":
                raise RuntimeError(f"{name} kernel failed")
            out = core.attention_pytorch(q, k, v, heads, mask, skip_reshape=skip_reshape,
                                         skip_output_reshape=skip_output_reshape)
            if broken == "nan":
                return out * float("nan")
            return out + noise * out.std() * torch.randn_like(out) if noise else out

        core.REGISTERED_ATTENTION_FUNCTIONS[name] = fake
        if default:
            monkeypatch.setattr(core, "optimized_attention", fake)
        return calls

    return register


@pytest.fixture
def slow_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make auto's own candidates one exact fake of 50 ms, so a fake core function can beat it on CPU."""
    from comfyui_lowvram_dit.kernels import attention as ak
    from comfyui_lowvram_dit.kernels import attention_backends

    def slow(q, k, v, mask):
        time.sleep(0.05)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    registry = dict(ak.BACKENDS)  # one copy for the registry module and the selector that reads it
    monkeypatch.setattr(attention_backends, "BACKENDS", registry)
    monkeypatch.setattr(ak, "BACKENDS", registry)
    attention_backends.register_backend(ak.AttentionBackend("slow_sdpa", "slow SDPA", slow, lambda *a: None))
    monkeypatch.setattr(ak, "AUTO_CANDIDATES", ("slow_sdpa",))


def _run_auto(model: Any, seed: int = 0) -> tuple[Any, Any]:
    from comfyui_lowvram_dit.kernels import attention as ak
    from comfyui_lowvram_dit.host.attention import apply_attention

    with ak.isolated_selector() as sel:
        out = _sample(apply_attention(model, "auto"), seed=seed)
    return out, sel


# ------------------------------------------------------------------------------------------------ adapter


@pytest.mark.parametrize("name", ["pytorch", "sub_quad", "split"])
@pytest.mark.parametrize("masked", [False, True])
def test_core_adapter_matches_sdpa(core: Any, name: str, masked: bool) -> None:
    """Core's functions through the adapter on [B, H, L, D] views equal SDPA (layouts and heads right)."""
    from comfyui_lowvram_dit.host.attention import core_adapter

    g = torch.Generator().manual_seed(2)
    b, h, lq, lk, d = 2, 3, 40, 24, 32
    # Wan-style [B, L, H*D] projections viewed as [B, H, L, D]: non-contiguous, as the override passes them
    q, k, v = (torch.randn(b, n, h * d, generator=g).view(b, n, h, d).transpose(1, 2) for n in (lq, lk, lk))
    mask = None
    if masked:
        mask = torch.zeros(b, 1, lq, lk)
        mask[..., -5:] = float("-inf")
    out = core_adapter(core.get_attention_function(name))(q, k, v, mask)
    assert out.shape == (b, h, lq, d)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------- discovery


def test_discovery_names_core_default_and_its_candidates(core: Any) -> None:
    from comfyui_lowvram_dit.host.attention import core_attention

    host = core_attention()
    names = [b.name for b in host.backends]
    default = next(n for n, fn in core.REGISTERED_ATTENTION_FUNCTIONS.items() if fn is core.optimized_attention)
    assert host.default == f"comfy:{default}" and host.default in names
    assert "comfy:pytorch" in names and "comfy:split" not in names  # a slow fallback, not core's choice here
    assert host.default_label.startswith(core.optimized_attention.__name__)
    assert not any(b.trades_accuracy for b in host.backends)


def test_quantized_core_functions_join_only_when_core_uses_one(core: Any, fake_core) -> None:
    from comfyui_lowvram_dit.host.attention import core_attention

    fake_core("comfy_kitchen_int8")
    fake_core("flash")
    assert [b.name for b in core_attention().backends if b.trades_accuracy] == []
    assert "comfy:flash" in [b.name for b in core_attention().backends]
    fake_core("sage", default=True)  # as --use-sage-attention would
    host = core_attention()
    assert host.default == "comfy:sage" and host.default_label == "fake"
    assert {b.name for b in host.backends if b.trades_accuracy} == {"comfy:sage", "comfy:comfy_kitchen_int8"}


def test_default_label_names_sdpa_priority(core: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import comfy.ops
    from torch.nn.attention import SDPBackend

    from comfyui_lowvram_dit.host.attention import core_default_label

    monkeypatch.delattr(comfy.ops, "SDPA_BACKEND_PRIORITY", raising=False)  # 0.8.0 off Windows, CPU hosts
    assert core_default_label(core.attention_pytorch) == "attention_pytorch (SDPA, torch picks)"
    monkeypatch.setattr(comfy.ops, "SDPA_BACKEND_PRIORITY", [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                                                             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
                        raising=False)  # what 0.33 sets on CUDA
    assert core_default_label(core.attention_pytorch) == \
        "attention_pytorch (SDPA with FLASH>CUDNN>EFFICIENT>MATH priority)"
    assert core_default_label(core.attention_sub_quad) == "attention_sub_quad"


# ------------------------------------------------------------------------------------------------ sampling


def test_core_backend_faster_than_ours_is_chosen(core: Any, tiny_wan: Any, fake_core, slow_ours,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    base = _sample(tiny_wan, seed=4)
    core.REGISTERED_ATTENTION_FUNCTIONS.clear()  # only the fake (core's real SDPA would win on CPU as well)
    calls = fake_core("flash", delay=0.0, default=True)
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        out, sel = _run_auto(tiny_wan, seed=4)
    torch.testing.assert_close(out, base, rtol=1e-4, atol=1e-4)
    assert sorted(sel.decisions.values()) == ["comfy:flash", "comfy:flash"], sel.report()  # self and cross
    assert len(calls) > 2 * 5  # checked and timed per shape, then every call of the sampler
    lines = [r.getMessage() for r in caplog.records if "core would use" in r.getMessage()]
    assert len(lines) == 2, lines  # one line per shape
    assert all("core would use fake; chose ComfyUI flash (" in line and " ms vs " in line for line in lines), lines


def test_ours_faster_than_core_default(core: Any, tiny_wan: Any, fake_core,
                                       caplog: pytest.LogCaptureFixture) -> None:
    base = _sample(tiny_wan, seed=5)
    core.REGISTERED_ATTENTION_FUNCTIONS.clear()  # only the slow fake stands for core
    fake_core("slow_default", delay=0.1, default=True)
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        out, sel = _run_auto(tiny_wan, seed=5)
    torch.testing.assert_close(out, base, rtol=1e-4, atol=1e-4)
    assert all(not name.startswith("comfy:") for name in sel.decisions.values()), sel.report()
    assert all("comfy:slow_default" in d.timings_ms for d in sel.details.values())
    lines = [r.getMessage() for r in caplog.records if "core would use fake;" in r.getMessage()]
    assert len(lines) == 2 and all(" ms vs " in line for line in lines), lines


@pytest.mark.parametrize("broken", ["raises", "nan"])
def test_broken_core_backend_never_chosen(tiny_wan: Any, fake_core, slow_ours, broken: str,
                                          caplog: pytest.LogCaptureFixture) -> None:
    base = _sample(tiny_wan, seed=6)
    fake_core("flash", broken=broken, default=True)
    fake_core("sage", broken=broken)  # registered, not a candidate: core's default is exact
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        out, sel = _run_auto(tiny_wan, seed=6)
    torch.testing.assert_close(out, base, rtol=1e-4, atol=1e-4)
    assert set(sel.decisions.values()) <= {"slow_sdpa", "comfy:pytorch"}, sel.report()
    assert all("comfy:flash" in d.rejected and "comfy:sage" not in d.errors for d in sel.details.values())
    assert any("core would use fake (" in r.getMessage() for r in caplog.records)


def test_broken_quantized_core_default_never_chosen(tiny_wan: Any, fake_core, slow_ours) -> None:
    base = _sample(tiny_wan, seed=7)
    fake_core("comfy_kitchen_int8", noise=0.5, default=True)  # finite but far outside the 8-bit tolerance
    out, sel = _run_auto(tiny_wan, seed=7)
    torch.testing.assert_close(out, base, rtol=1e-4, atol=1e-4)
    assert all("relative error" in d.rejected["comfy:comfy_kitchen_int8"] for d in sel.details.values())


def test_host_without_registry(core: Any, tiny_wan: Any, monkeypatch: pytest.MonkeyPatch,
                               caplog: pytest.LogCaptureFixture) -> None:
    """Older hosts have no REGISTERED_ATTENTION_FUNCTIONS: core's default is still measured; without an
    importable attention module the node still runs ours."""
    from comfyui_lowvram_dit.host.attention import core_attention

    base = _sample(tiny_wan, seed=8)
    monkeypatch.delattr(core, "REGISTERED_ATTENTION_FUNCTIONS")
    monkeypatch.delattr(core, "get_attention_function")
    host = core_attention()
    assert [b.name for b in host.backends] == ["comfy:optimized"] and host.default == "comfy:optimized"
    with caplog.at_level(logging.INFO, logger="comfyui_lowvram_dit"):
        out, sel = _run_auto(tiny_wan, seed=8)
    torch.testing.assert_close(out, base, rtol=1e-4, atol=1e-4)
    assert all("comfy:optimized" in d.timings_ms for d in sel.details.values())
    assert any(f"core would use {core.optimized_attention.__name__}" in r.getMessage() for r in caplog.records)
    import comfy.ldm.modules

    monkeypatch.delattr(comfy.ldm.modules, "attention")
    monkeypatch.setitem(sys.modules, "comfy.ldm.modules.attention", None)  # the import now fails
    assert core_attention() is None
    out, sel = _run_auto(tiny_wan, seed=8)
    torch.testing.assert_close(out, base, rtol=1e-4, atol=1e-4)
    assert len(sel.decisions) == 2


# ------------------------------------------------------------------------------------------------ 8-bit warm-up


@pytest.fixture
def warmups(monkeypatch: pytest.MonkeyPatch) -> list:
    """Record kernels.attention_int8.start_warmup calls instead of starting threads."""
    from comfyui_lowvram_dit.kernels import attention_int8

    calls: list = []
    monkeypatch.setattr(attention_int8, "start_warmup", lambda *args: calls.append(args))
    return calls


def test_8bit_backend_warms_its_kernels_for_the_models_geometry(tiny_wan: Any, warmups: list) -> None:
    from comfyui_lowvram_dit.host.attention import apply_attention

    dm = tiny_wan.model.diffusion_model
    apply_attention(tiny_wan, "auto")
    assert warmups == []  # auto's 8-bit candidate runs only in the sm90 Gluon loop (not here)
    apply_attention(tiny_wan, "lowvram 8-bit")
    (device, dtype, heads, head_dim, pv_format), = warmups
    assert device == torch.device(tiny_wan.load_device) and pv_format == "auto"
    assert (heads, head_dim) == (dm.num_heads, dm.dim // dm.num_heads)
    model_dtype = getattr(tiny_wan.model, "manual_cast_dtype", None) or tiny_wan.model.get_dtype()
    assert dtype == (model_dtype if model_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16)
    apply_attention(tiny_wan, "lowvram 8-bit, int8 P·V")  # another kernel: its own warm-up
    assert warmups[1] == (device, dtype, heads, head_dim, "int8")


def test_8bit_warmup_reads_qwen_image_heads(core: Any, warmups: list, tmp_path: Any) -> None:
    synth = pytest.importorskip("comfyui_lowvram_dit.synthetic.checkpoints")
    from comfyui_lowvram_dit.host.attention import apply_attention
    from comfyui_lowvram_dit.host.qwen_stages import load_transformer

    path = tmp_path / "qwen_bf16.safetensors"
    synth.write_synthetic("qwen_image", path, "tiny", "bf16", seed=3)
    qwen = load_transformer(path, "per_tensor", 128, "auto")
    attn = next(m for m in qwen.model.diffusion_model.modules() if isinstance(getattr(m, "heads", None), int))
    apply_attention(qwen, "lowvram 8-bit")
    assert warmups[0][2:4] == (attn.heads, attn.inner_dim // attn.heads)


def test_auto_warms_its_8bit_candidate_only_where_the_gluon_loop_runs(tiny_wan: Any, warmups: list,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import comfy.model_management

    from comfyui_lowvram_dit.host import attention as host_attention
    from comfyui_lowvram_dit.kernels import attention_int8

    monkeypatch.setattr(attention_int8, "gluon_loop_usable", lambda device: True)
    monkeypatch.setattr(attention_int8, "_gluon_module", lambda: types.SimpleNamespace(HEAD_DIMS=(128, )))
    monkeypatch.setattr(host_attention, "_attention_geometry", lambda dm: (40, 64))
    host_attention.apply_attention(tiny_wan, "auto")
    assert warmups == []  # head size 64: the loop does not take it
    monkeypatch.setattr(host_attention, "_attention_geometry", lambda dm: (40, 128))
    host_attention.apply_attention(tiny_wan, "auto")
    (device, _, heads, head_dim, pv_format), = warmups
    assert device == torch.device(tiny_wan.load_device) and (heads, head_dim, pv_format) == (40, 128, "fp16")
    warmups.clear()
    host_attention.warm_int8_for_prompt(_prompt("auto"))  # a queued auto prompt starts it too
    assert warmups == [(comfy.model_management.get_torch_device(), torch.bfloat16, 24, 128, "fp16")]
    monkeypatch.setattr(attention_int8, "gluon_loop_usable", lambda device: False)
    host_attention.warm_int8_for_prompt(_prompt("auto"))
    host_attention.apply_attention(tiny_wan, "auto")
    assert len(warmups) == 1


def test_8bit_warmup_skips_models_it_cannot_read(warmups: list) -> None:
    from comfyui_lowvram_dit.host.attention import warm_int8_kernels

    class Bare:
        load_device = "cpu"

    warm_int8_kernels(Bare())  # no .model: nothing to warm, nothing raised
    assert warmups == []


def _prompt(backend: str) -> dict:
    return {"prompt": {"3": {"class_type": "KSampler", "inputs": {"seed": 1}},
                       "7": {"class_type": "LowVRAM_Attention", "inputs": {"model": ["5", 0], "backend": backend}}},
            "client_id": "x"}


def test_queued_8bit_prompt_starts_the_warmup_at_once(core: Any, warmups: list) -> None:
    import comfy.model_management

    from comfyui_lowvram_dit.host.attention import warm_int8_for_prompt

    data = _prompt("lowvram 8-bit")
    assert warm_int8_for_prompt(data) is data  # the prompt passes through untouched
    gpu = comfy.model_management.get_torch_device()
    assert warmups == [(gpu, torch.bfloat16, 24, 128, "auto")]
    for other in (_prompt("auto"), {"prompt": "not a graph"}, None, {"prompt": {"1": None}}):
        assert warm_int8_for_prompt(other) is other
    assert len(warmups) == 1
    warm_int8_for_prompt(_prompt("lowvram 8-bit, int8 P·V"))
    assert warmups[1:] == [(gpu, torch.bfloat16, 24, 128, "int8")]


def test_prompt_warmup_registers_once(core: Any) -> None:
    from comfyui_lowvram_dit.host.attention import register_prompt_warmup, warm_int8_for_prompt

    class Server:
        def __init__(self) -> None:
            self.on_prompt_handlers: list = []

        def add_on_prompt_handler(self, handler: Any) -> None:
            self.on_prompt_handlers.append(handler)

    server = Server()
    assert register_prompt_warmup(server) and register_prompt_warmup(server)
    assert server.on_prompt_handlers == [warm_int8_for_prompt]
    assert not register_prompt_warmup(object())  # no handler list: nothing to hook
