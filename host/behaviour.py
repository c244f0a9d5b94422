"""Behaviour checks for the ComfyUI seams that are protocols rather than names.

Each check receives the ComfyUI object its probe resolved (a class or function), exercises the protocol the pack
relies on with a tiny CPU model or call, and returns True when ComfyUI behaved as the pack expects. They run once
per process (host/seams.py caches the result), in well under a second, and never touch a GPU.

The tiny models' attention goes through ``transformer_options["optimized_attention_override"]`` to plain torch
(``_cpu_attention``): ComfyUI's global backend is whatever its launch flags chose (``--use-ck-attention``,
``--use-sage-attention``, ``--use-flash-attention``), whose kernels need CUDA tensors and would fail a CPU probe,
disabling the pack's nodes on a ComfyUI that has every seam.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

# Tiny widths that ComfyUI's own detection accepts (Wan reads heads as dim // 128, text and time widths are fixed).
_WAN_TINY = dict(model_type="t2v", patch_size=(1, 2, 2), text_len=4, in_dim=4, dim=128, ffn_dim=32, freq_dim=256,
                 text_dim=4096, out_dim=4, num_heads=1, num_layers=1)
_QWEN_TINY = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16,
                  num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(4, 6, 6))


def _eager_ops() -> type:
    """ComfyUI's ``disable_weight_init`` layers with real weight tensors from the start: under DynamicVRAM
    (comfy-aimdo) its Linear leaves ``weight`` None until a state dict is loaded, which a probe never does."""
    import comfy.ops
    import torch

    layers = {name: type(name, (cls,), {"_load_from_state_dict": torch.nn.Module._load_from_state_dict})
              for name, cls in vars(comfy.ops.disable_weight_init).items()
              if isinstance(cls, type) and issubclass(cls, torch.nn.Module)}
    return type("EagerOps", (comfy.ops.disable_weight_init,), layers)


def _zeroed(module: Any) -> Any:
    """``module`` with every parameter set to zero (ComfyUI's disable_weight_init leaves them uninitialised)."""
    import torch

    with torch.no_grad():
        for p in module.parameters():
            p.zero_()
    return module


def _cpu_attention(func: Callable, q: Any, k: Any, v: Any, heads: int, mask: Any = None, **kwargs: Any) -> Any:
    """An ``optimized_attention_override`` that ignores ComfyUI's backend ``func`` and attends in plain torch (the
    layouts of ComfyUI's attention functions: ``b s (h d)``, or ``b h s d`` with ``skip_reshape``)."""
    import torch

    if not kwargs.get("skip_reshape", False):
        b, _, inner = q.shape
        q, k, v = (t.reshape(b, -1, heads, inner // heads).transpose(1, 2) for t in (q, k, v))
    if mask is not None:
        mask = mask.unsqueeze(1) if mask.ndim == 3 else mask  # b s s -> b 1 s s, as ComfyUI's attention does
        mask = mask if mask.dtype == torch.bool else mask.to(q.dtype)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if kwargs.get("skip_output_reshape", False):
        return out
    return out.transpose(1, 2).reshape(out.shape[0], -1, out.shape[1] * out.shape[-1])


def _first_block_replaced(model: Any, call: Callable[[Any, dict], Any]) -> bool:
    """Whether ``call(model, transformer_options)`` runs a ``patches_replace["dit"][("double_block", 0)]`` patch
    that hands the block to ComfyUI's ``original_block``."""
    import torch

    seen: list[bool] = []

    def replace(args: dict, extra: dict) -> Any:
        seen.append(True)
        return extra["original_block"](args)

    options = {"patches_replace": {"dit": {("double_block", 0): replace}},
               "optimized_attention_override": _cpu_attention}
    with torch.no_grad():
        call(model, options)
    return bool(seen)


def wan_block_replace(wan_model_class: type) -> bool:
    """Wan's forward runs per-block replace patches (Block Swap, NaN Guard)."""
    import torch

    model = _zeroed(wan_model_class(**_WAN_TINY, operations=_eager_ops(), dtype=torch.float32))
    x, t, context = torch.zeros(1, 4, 1, 4, 4), torch.zeros(1), torch.zeros(1, 4, 4096)
    return _first_block_replaced(model, lambda m, o: m(x, t, context, transformer_options=o))


def qwen_image_block_replace(qwen_model_class: type) -> bool:
    """Qwen-Image's forward runs per-block replace patches (Block Swap, NaN Guard)."""
    import torch

    model = _zeroed(qwen_model_class(**_QWEN_TINY, operations=_eager_ops(), dtype=torch.float32))
    x, t, context = torch.zeros(1, 4, 1, 4, 4), torch.zeros(1), torch.zeros(1, 4, 16)
    return _first_block_replaced(model, lambda m, o: m(x, t, context, transformer_options=o))


def attention_override(optimized_attention: Callable) -> bool:
    """ComfyUI's attention entry point hands the call to ``transformer_options["optimized_attention_override"]``."""
    import torch

    called: list[bool] = []

    def override(func: Callable, *args: Any, **kwargs: Any) -> Any:
        called.append(True)
        return _cpu_attention(func, *args, **kwargs)

    q = torch.zeros(1, 4, 32)
    optimized_attention(q, q, q, 2, transformer_options={"optimized_attention_override": override})
    return bool(called)


def custom_operations(load_diffusion_model_state_dict: Callable) -> bool:
    """``model_options["custom_operations"]`` builds a diffusion model's layers (the fp8 loaders' ops class)."""
    import comfy.ldm.wan.model
    import comfy.ops
    import torch

    made: list[bool] = []

    class CountingOps(comfy.ops.manual_cast):
        class Linear(comfy.ops.manual_cast.Linear):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                made.append(True)

    tiny = _zeroed(comfy.ldm.wan.model.WanModel(**_WAN_TINY, operations=_eager_ops(), dtype=torch.float32))
    state_dict = {k: v.clone() for k, v in tiny.state_dict().items()}
    kwargs = {"disable_dynamic": True} if "disable_dynamic" in inspect.signature(
        load_diffusion_model_state_dict).parameters else {}  # build no DynamicVRAM patcher state for a probe
    load_diffusion_model_state_dict(state_dict, model_options={"custom_operations": CountingOps}, **kwargs)
    return bool(made)


def qwen_image_text_mask(qwen_model_class: type) -> bool:
    """Qwen-Image's forward gives zero-padded text masked by ``attention_mask`` the output of the unpadded text."""
    import torch

    model = qwen_model_class(**_QWEN_TINY, operations=_eager_ops(), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        x, context = torch.randn(1, 4, 1, 4, 4, generator=g), torch.randn(1, 3, 16, generator=g)
        padded = torch.cat([context, torch.zeros(1, 2, 16)], dim=1)
        mask = torch.tensor([[1, 1, 1, 0, 0]])
        opts, t = {"optimized_attention_override": _cpu_attention}, torch.full((1,), 0.5)
        alone = model(x, t, context, transformer_options=opts)
        masked = model(x, t, padded, attention_mask=mask, transformer_options=opts)
        unmasked = model(x, t, padded, transformer_options=opts)
    # the padding unmasked must change the output, or the check would prove nothing
    return torch.allclose(alone, masked, atol=1e-5) and not torch.allclose(alone, unmasked, atol=1e-5)


def qwen_image_mask_cond(qwen_base_model_class: type) -> bool:
    """Qwen-Image's ``extra_conds`` hands a conditioning's ``attention_mask`` to the model."""
    import torch

    model = object.__new__(qwen_base_model_class)  # extra_conds reads no weights: an instance without __init__
    for name in ("concat_cond", "encode_adm"):  # BaseModel.extra_conds' own inputs, none here
        object.__setattr__(model, name, lambda **kwargs: None)
    out = qwen_base_model_class.extra_conds(model, cross_attn=torch.zeros(1, 2, 16),
                                            attention_mask=torch.ones(1, 2, dtype=torch.long))
    return "attention_mask" in out
