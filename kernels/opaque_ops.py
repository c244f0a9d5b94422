"""Attention and per-tensor fp8 linears as opaque torch ops while torch.compile traces a model.

Both decide per shape at run time: the attention selector checks and times backends (the 8-bit kernel also
autotunes), the fp8 scale chooser times per-token against per-call activation scales. Traced by Dynamo, a
decision not made yet is a graph break (it runs behind ``torch.compiler.disable``), and a decision made while the
graph runs changes the dicts Dynamo guards on, so the next block compiles again; backends Dynamo cannot trace
(the 8-bit kernel, flash-attn 3, SageAttention) break the graph on every call. As ``torch.library.custom_op``s
with a fake implementation, Dynamo and Inductor see one node whose output shape is known, and the selector or
chooser runs inside the op when the compiled graph runs, exactly as it does eagerly.

Only traced calls take the ops (``torch.compiler.is_compiling()``); eager calls go straight to the selector and
``fp8_linear``. ``OPAQUE_UNDER_COMPILE = False`` restores the traced paths (benchmarks compare the two). Each copy
of this module registers its own op names (the pack can be imported under two names, as a ComfyUI custom node and
as an installed package), so an op always runs its own copy's selector and chooser.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Optional

import torch

from . import attention, fp8
from .fp8_choice import CHOOSER

Tensor = torch.Tensor

OPAQUE_UNDER_COMPILE = True  # False: Dynamo traces into the selector and the fp8 linear (the older path)
NAMESPACE = "lowvram_dit"
_SUFFIX = hashlib.sha1(__name__.encode(), usedforsecurity=False).hexdigest()[:10]
_HOSTS: dict[str, attention.HostAttention] = {}  # the names the attention op knows host backends by


def register_host(host: Optional[attention.HostAttention]) -> str:
    """The name the attention op knows ``host`` by ('' for None); hosts with the same backends share a name."""
    if host is None:
        return ""
    name = f"{host.tag}|{host.default}"
    _HOSTS[name] = host
    return name


def _attention_impl(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], backend: str, host: str) -> Tensor:
    out = attention.SELECTOR.run(q, k, v, mask, backend, _HOSTS[host] if host else None)
    # One layout whatever the backend returns, so the fake's strides are the real ones: [B, Lq, H, D], the
    # layout callers reshape to [B, Lq, H*D] (a no-op copy for backends that write it already).
    return out.to(q.dtype).transpose(1, 2).contiguous()


def _attention_fake(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], backend: str, host: str) -> Tensor:
    b, h, lq, _ = q.shape
    return q.new_empty((b, lq, h, v.shape[-1]))


def _fp8_linear_impl(x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Optional[Tensor], path: str) -> Tensor:
    chosen = CHOOSER.choose(x, weight, weight_scale, bias, path)
    return fp8.fp8_linear(x, weight, weight_scale, bias, path=chosen, out_dtype=x.dtype).contiguous()


def _fp8_linear_fake(x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Optional[Tensor], path: str) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def op_name(name: str) -> str:
    """The qualified name of this copy's op ``name`` ('lowvram_dit::attention_<suffix>')."""
    return f"{NAMESPACE}::{name}_{_SUFFIX}"


def _register(name: str, impl: Callable[..., Tensor], fake: Callable[..., Tensor]) -> Any:
    """A custom op with a fake, or None where torch has no ``torch.library.custom_op`` (then nothing is opaque)."""
    if not hasattr(torch.library, "custom_op"):
        return None
    try:
        op = torch.library.custom_op(op_name(name), mutates_args=())(impl)
        op.register_fake(fake)
        return op
    except RuntimeError:  # this copy was imported before under the same name (a reload): reuse its op
        return getattr(getattr(torch.ops, NAMESPACE), f"{name}_{_SUFFIX}").default


ATTENTION_OP = _register("attention", _attention_impl, _attention_fake)
FP8_LINEAR_OP = _register("fp8_linear", _fp8_linear_impl, _fp8_linear_fake)


def selected_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None, backend: str = "auto",
                       host: Optional[attention.HostAttention] = None, host_name: str = "") -> Tensor:
    """``attention.SELECTOR.run`` on [B, H, L, D] views; while torch.compile traces, one opaque op.

    ``host_name`` is ``register_host(host)``, done once by the caller so that tracing reads a plain string."""
    if ATTENTION_OP is None or not OPAQUE_UNDER_COMPILE or not torch.compiler.is_compiling():
        return attention.SELECTOR.run(q, k, v, mask, backend, host)
    if host is not None and not host_name:
        host_name = register_host(host)
    return ATTENTION_OP(q, k, v, mask, backend, host_name).transpose(1, 2)


def fp8_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Optional[Tensor], block_size: Optional[int],
               path: str) -> Tensor:
    """The pack's fp8 Linear: ``fp8.fp8_linear`` on the path the scale chooser picks for this shape; a per-tensor
    fp8 matmul is one opaque op while torch.compile traces (dequantize and block-wise paths stay traceable)."""
    if (block_size is None and path != "dequantize" and FP8_LINEAR_OP is not None and OPAQUE_UNDER_COMPILE
            and torch.compiler.is_compiling()):
        return FP8_LINEAR_OP(x, weight, weight_scale, bias, path)
    path = CHOOSER.choose(x, weight, weight_scale, bias, path)
    return fp8.fp8_linear(x, weight, weight_scale, bias, block_size=block_size, path=path, out_dtype=x.dtype)
