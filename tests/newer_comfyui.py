"""Behaviours of ComfyUI releases after 0.33 that cannot run here, re-created on the ComfyUI under test.

Each helper reproduces one behaviour read from the newer source (written here from its description, not copied),
so a test can show what the pack does when it meets it. Import inside a test, after ComfyUI is imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

_EAGER_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
}


def fp16_accumulation_linear_input_act(linear: Any, x: torch.Tensor, input_act: str, *args: Any,
                                       **kwargs: Any) -> torch.Tensor:
    """``comfy.ops.linear_input_act`` as newer ComfyUI runs it with ``--fast fp16_accumulation`` and fp16
    activations (the condition is taken as met, so it runs on the CPU in any dtype).

    A layer whose weight is not a ``QuantizedTensor`` and that does not set ``_full_precision_mm`` is not called:
    its weight comes from ``comfy.ops.cast_bias_weight`` (cast to the activation dtype) and goes into a plain
    GEMM. Every other layer is called as ``linear(act(x))``.
    """
    import comfy.model_management as mm
    import comfy.ops

    act = _EAGER_ACTS[input_act]
    quantized = type(linear.weight).__name__ == "QuantizedTensor"
    if getattr(mm, "in_training", False) or quantized or getattr(linear, "_full_precision_mm", False):
        return linear(act(x))
    weight, bias, stream = comfy.ops.cast_bias_weight(linear, x, offloadable=True)
    try:
        return torch.nn.functional.linear(act(x), weight, bias)
    finally:
        comfy.ops.uncast_bias_weight(linear, weight, bias, stream)


class FakeMallocGraph:
    """Newer ComfyUI's allocation-graph recorder (``comfy.model_prefetch``) as far as custom code sees it:
    ``pause_malloc_graph(sync)`` returns a context inside which allocations are not recorded. ``paused`` counts
    the pauses open now, so a probe can tell where an allocation would have gone."""

    def __init__(self) -> None:
        self.paused = 0

    @contextlib.contextmanager
    def pause(self, sync: bool = False) -> Iterator[None]:
        """What ``comfy.model_prefetch.pause_malloc_graph(sync)`` returns."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


def budgeted_pin_memory(tensor: torch.Tensor, evict_active: bool = True) -> bool:
    """``comfy.model_management.pin_memory`` as newer ComfyUI runs it: False, pinning nothing, when its
    pinned-memory account has no room for the tensor even after evicting what it may evict."""
    import comfy.model_management as mm

    if mm.MAX_PINNED_MEMORY <= 0 or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return False
    size = tensor.nbytes
    ensure = getattr(mm, "ensure_pin_registerable", None)
    room = ensure(size, evict_active=evict_active) if callable(ensure) else \
        mm.TOTAL_PINNED_MEMORY + size <= mm.MAX_PINNED_MEMORY
    if not room or torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), size, 1) != 0:
        return False
    mm.PINNED_MEMORY[tensor.data_ptr()] = size
    mm.TOTAL_PINNED_MEMORY += size
    return True


@contextlib.contextmanager
def cpu_patching_partial_unload(shape_changing: set[str]) -> Iterator[list[str]]:
    """``ModelPatcher.partially_unload`` as newer ComfyUI (about 0.38) runs it for a weight whose patches change its
    shape (``comfy.lora.calculate_shape`` differs from the weight's; here: the keys in ``shape_changing``, whatever
    their patches): as its module leaves the GPU, the weight is patched on the CPU (``patch_weight_to_device(key)``,
    ComfyUI's backup of the original made there) instead of getting a LowVramPatch that patches it at each cast.
    Written over ComfyUI's own partially_unload: for the modules that call moved, each such key's LowVramPatch is
    taken back and the weight patched. Yields the keys patched so, in order."""
    import comfy.model_patcher as mp

    real, done = mp.ModelPatcher.partially_unload, []

    def partially_unload(self: Any, device_to: Any, memory_to_free: int = 0, force_patch_weights: bool = False) -> int:
        loaded = [(n, m) for n, m in self.model.named_modules() if getattr(m, "comfy_patched_weights", False)]
        freed = real(self, device_to, memory_to_free, force_patch_weights)
        for name, m in loaded:
            for attr in ("weight", "bias") if m.comfy_patched_weights is False else ():
                key, funcs = f"{name}.{attr}", getattr(m, f"{attr}_function", [])
                if key not in shape_changing or key not in self.patches:
                    continue
                kept = [f for f in funcs if getattr(f, "key", None) != key]
                self.model.lowvram_patch_counter -= len(funcs) - len(kept)
                setattr(m, f"{attr}_function", kept)
                self.patch_weight_to_device(key)
                done.append(key)
        return freed

    mp.ModelPatcher.partially_unload = partially_unload
    try:
        yield done
    finally:
        mp.ModelPatcher.partially_unload = real


SPARSE_OVERRIDE_KEY = "optimized_attention_override"
SPARSE_CALLBACK_KEY = "block_sparse_attention"


def block_sparse_standin(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int) -> torch.Tensor:
    """Stand-in for the sparse kernel (a CUDA-only comfy_kitchen kernel) on [B, H, L, D]: each query block of
    ``block`` rows attends only to its own key block and to the first one (the sink), so the output differs from
    dense attention in a way a test can recompute."""
    rows = torch.arange(q.shape[-2], device=q.device) // block
    cols = torch.arange(k.shape[-2], device=q.device) // block
    keep = (rows[:, None] == cols[None, :]) | (cols[None, :] == 0)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)


class SparsePatch:
    """The newer node's per-model state: its options, the overrides it installed, and counters for tests
    (``taken``: calls its kernel ran; ``declined``: calls it passed on, counted at every layer that saw them;
    ``installs``: overrides put on top, at patch time and by the per-step re-assertion)."""

    def __init__(self, sigma_start: float, sigma_end: float, min_tokens: int, block: int) -> None:
        self.sigma_start, self.sigma_end, self.min_tokens, self.block = sigma_start, sigma_end, min_tokens, block
        self.installed: list[Any] = []
        self.taken = self.declined = self.installs = self.cleanups = 0

    def dense_reason(self, q: torch.Tensor, k: torch.Tensor, mask: Any, tokens: int, options: dict) -> str | None:
        """Why the call stays dense: a mask, cross-attention, too few tokens, or a sigma outside the window."""
        if mask is not None:
            return "mask"
        if q.shape != k.shape:
            return "cross-attention"
        if tokens < self.min_tokens:
            return "min_tokens"
        sigmas = options.get("sigmas")
        if sigmas is not None and not self.sigma_end <= float(sigmas.flatten()[0]) <= self.sigma_start:
            return "sigma window"
        return None


def make_sparse_override(patch: SparsePatch, previous: Any) -> Callable[..., torch.Tensor]:
    """The newer node's attention override: a call it declines runs ``previous`` (the override that was on top
    when this one was installed) with ComfyUI's ``func``, or ``func`` itself when there was none."""

    def override(func: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, mask: Any = None,
                 attn_precision: Any = None, skip_reshape: bool = False, skip_output_reshape: bool = False,
                 **kwargs: Any) -> torch.Tensor:
        tokens = q.shape[2] if skip_reshape else q.shape[1]
        if patch.dense_reason(q, k, mask, tokens, kwargs.get("transformer_options") or {}) is not None:
            patch.declined += 1
            kw = dict(mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                      skip_output_reshape=skip_output_reshape, **kwargs)
            return func(q, k, v, heads, **kw) if previous is None else previous(func, q, k, v, heads, **kw)
        patch.taken += 1
        b = q.shape[0]
        if skip_reshape:
            qh, kh, vh = q, k, v
        else:
            qh, kh, vh = (t.view(b, -1, heads, t.shape[-1] // heads).transpose(1, 2) for t in (q, k, v))
        out = block_sparse_standin(qh, kh, vh, patch.block)
        return out if skip_output_reshape else out.transpose(1, 2).reshape(b, -1, out.shape[1] * out.shape[-1])

    return override


def install_sparse_override(patch: SparsePatch, transformer_options: dict) -> None:
    """Put the patch's override on top of whatever override is there, unless one of its own already is."""
    current = transformer_options.get(SPARSE_OVERRIDE_KEY)
    if any(current is mine for mine in patch.installed):
        return
    override = make_sparse_override(patch, current)
    patch.installed.append(override)
    patch.installs += 1
    transformer_options[SPARSE_OVERRIDE_KEY] = override


def sparse_reasserts_each_step() -> bool:
    """Whether this ComfyUI hands ON_PREPARE_STATE callbacks the sampling model_options (newer than 0.8.0),
    which the newer node's per-step re-assertion needs."""
    import inspect

    import comfy.model_patcher

    return "model_options" in inspect.signature(comfy.model_patcher.ModelPatcher.prepare_state).parameters


def apply_block_sparse_attention(model: Any, start_percent: float = 0.0, end_percent: float = 1.0,
                                 min_tokens: int = 0, block: int = 8) -> tuple[Any, SparsePatch]:
    """ComfyUI's "Model Sparse Attention" node (comfy_extras/nodes_sparse_attention.py, about 0.36 and newer) as
    other attention overrides meet it.

    A clone whose override sits on top of the override already there and passes the calls it declines to it
    (masked, cross-attention, under ``min_tokens``, or a sigma outside the start/end window); and, on hosts whose
    ``prepare_state`` passes the sampling model_options, an ON_PREPARE_STATE callback that re-installs it on top
    every step (wrapping whatever a node applied later put there) and an ON_CLEANUP one that ends the run.
    Returns the clone and its counters."""
    import comfy.patcher_extension as pe

    sampling = model.get_model_object("model_sampling")
    patch = SparsePatch(float(sampling.percent_to_sigma(start_percent)), float(sampling.percent_to_sigma(end_percent)),
                        min_tokens, block)
    m = model.clone()
    install_sparse_override(patch, m.model_options.setdefault("transformer_options", {}))
    if sparse_reasserts_each_step():
        m.add_callback_with_key(pe.CallbacksMP.ON_PREPARE_STATE, SPARSE_CALLBACK_KEY,
                                lambda patcher, timestep, model_options: install_sparse_override(
                                    patch, model_options["transformer_options"]))
    m.add_callback_with_key(pe.CallbacksMP.ON_CLEANUP, SPARSE_CALLBACK_KEY,
                            lambda patcher: setattr(patch, "cleanups", patch.cleanups + 1))
    return m, patch


@contextlib.contextmanager
def cgroup_aware_system_memory(total: int, available: int, limit: int | None) -> Iterator[Any]:
    """``comfy.system_memory`` as ComfyUI after 0.33 has it: RAM total and available already capped at the
    container's cgroup limit (``limit``: None where none applies), and that limit; installed for the ``with`` body."""
    import sys
    import types

    import comfy
    import pytest

    module = types.ModuleType("comfy.system_memory")
    module.virtual_memory_total = lambda: total  # type: ignore[attr-defined]
    module.virtual_memory_available = lambda: available  # type: ignore[attr-defined]
    module.cgroup_memory_limit = lambda: limit  # type: ignore[attr-defined]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "comfy.system_memory", module)
        mp.setattr(comfy, "system_memory", module, raising=False)
        yield module
