"""Per-model attention backend through ComfyUI's ``optimized_attention_override``.

ComfyUI's ``wrap_attn`` (comfy/ldm/modules/attention.py) calls ``override(func, *args, **kwargs)`` for every
attention call of a model whose ``transformer_options`` hold an override. ``func`` is ComfyUI's global
choice; ``kwargs`` already carries ``_inside_attn_wrapper=True``, which must stay there when ``func`` is
called or the wrapper recurses. Call shapes we serve: Wan ``optimized_attention(q, k, v, heads=H)`` with
[B, L, H*D]; Qwen-Image ``optimized_attention_masked(q, k, v, H, mask, skip_reshape=True)`` with [B, H, L, D].
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Optional

import torch

from ..kernels import attention_backends as attention_kernels
from ..kernels import opaque_ops
from ..kernels.int8_comfy_kitchen import SOL_ATTN_LABEL
from .compiler import outside_allocation_graph
from .names import node_id

log = logging.getLogger("comfyui_lowvram_dit")

OVERRIDE_KEY = "optimized_attention_override"
COMFY_DEFAULT = "ComfyUI default"
# UI label -> kernels/attention_backends.py registry name (None: call ComfyUI's own choice).
BACKEND_CHOICES: dict[str, Optional[str]] = {
    "auto": "auto",
    "SDPA cuDNN": "sdpa_cudnn",
    "SDPA flash": "sdpa_flash",
    "SDPA memory-efficient": "sdpa_efficient",
    "SDPA math": "sdpa_math",
    "flash-attn 2": "flash_attn2",
    "flash-attn 3": "flash_attn3",
    "SageAttention": "sage",
    "xformers": "xformers",
    "lowvram 8-bit": "int8",
    "lowvram 8-bit, int8 P·V": "int8_pv8",
    "lowvram 8-bit, fp8 P·V": "int8_pvfp8",
    "comfy-kitchen int8": "ck_int8",
    SOL_ATTN_LABEL: "ck_sol",  # an approximation, and its label says so
    COMFY_DEFAULT: None,
}
# The pack's 8-bit backends and the P·V format each one's kernel is compiled for (its background warm-up)
INT8_PV_FORMATS = {"int8": "auto", "int8_pv8": "int8", "int8_pvfp8": "fp8"}
AUTO_PV_FORMAT = "fp16"  # auto's own 8-bit candidate (int8_pv16), warmed only where its Gluon loop runs
PROMPT_WARMUP_HEAD_DIM = 128  # a queued prompt's warm-up, before any model is read: Wan's and Qwen-Image's
_ARG_NAMES = ("q", "k", "v", "heads", "mask", "attn_precision", "skip_reshape", "skip_output_reshape")
CORE_PREFIX = "comfy:"
# ComfyUI's registered functions whose numerics are known. Exact ones join auto; quantized ones join only when
# ComfyUI's launch flags already chose one (the user accepted quantized attention), as our 8-bit kernel is opt-in.
CORE_EXACT = ("pytorch", "flash", "xformers")
CORE_QUANTIZED = ("comfy_kitchen_int8", "sage", "sage3")
CORE_COMPILE_SAFE = ("pytorch",)  # plain SDPA (under sdpa_kernel priority on newer hosts): dynamo traces it


def core_adapter(fn: Any) -> attention_kernels.AttentionFn:
    """ComfyUI's ``fn(q, k, v, heads, mask, skip_reshape=, skip_output_reshape=)`` as the pack's
    ``(q, k, v, mask)`` on [B, H, L, D]; no transformer_options, so ComfyUI's wrapper does not re-enter us."""

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        return fn(q, k, v, q.shape[1], mask, skip_reshape=True, skip_output_reshape=True)

    return call


def _core_registry(core: Any) -> dict[str, Any]:
    """name -> function from ComfyUI's public attention registry; {} on hosts without one."""
    registered = getattr(core, "REGISTERED_ATTENTION_FUNCTIONS", None)
    if not isinstance(registered, dict):
        return {}
    get = getattr(core, "get_attention_function", None)
    found = {}
    for name in list(registered):
        fn = get(name, None) if callable(get) else registered[name]
        if callable(fn):
            found[str(name)] = fn
    return found


def core_default_label(default: Any) -> str:
    """What ComfyUI itself runs: its ``optimized_attention`` and, for SDPA, the kernel priority it sets."""
    name = getattr(default, "__name__", repr(default))
    if name != "attention_pytorch":
        return name
    import comfy.ops

    priority = getattr(comfy.ops, "SDPA_BACKEND_PRIORITY", None)
    if not priority:
        return f"{name} (SDPA, torch picks)"
    order = ">".join(getattr(b, "name", str(b)).replace("_ATTENTION", "") for b in priority)
    return f"{name} (SDPA with {order} priority)"


def _any_input(device: torch.device, dtype: torch.dtype, head_dim: int, has_mask: bool) -> Optional[str]:
    return None  # ComfyUI's functions fall back internally; the first-use check decides


def core_attention() -> Optional[attention_kernels.HostAttention]:
    """ComfyUI's own attention functions as auto candidates and the one it runs by default (None without it)."""
    try:
        from comfy.ldm.modules import attention as core
    except Exception as exc:  # a host that cannot import its attention module still runs ours
        log.info("lowvram_dit attention: ComfyUI's attention functions are not importable (%s)", exc)
        return None
    default = getattr(core, "optimized_attention", None)
    registry = _core_registry(core)
    default_name = next((n for n, fn in registry.items() if fn is default), None)
    if default_name is None and callable(default):  # hosts without the registry, or an unregistered default
        default_name, registry = "optimized", {**registry, "optimized": default}
    quantized_ok = default_name in CORE_QUANTIZED
    backends = []
    for name, fn in registry.items():
        quantized = name in CORE_QUANTIZED
        if name != default_name and not (name in CORE_EXACT or (quantized and quantized_ok)):
            continue  # unknown numerics (another pack's function) or slow fallbacks: not a candidate
        backends.append(attention_kernels.AttentionBackend(
            CORE_PREFIX + name, f"ComfyUI {name}", core_adapter(fn), _any_input,
            tolerance=attention_kernels.QUANTIZED_TOLERANCE if quantized else attention_kernels.EXACT_TOLERANCE,
            compile_safe=name in CORE_COMPILE_SAFE, trades_accuracy=quantized))
    if default_name is None:
        return attention_kernels.HostAttention(tuple(backends))
    return attention_kernels.HostAttention(tuple(backends), CORE_PREFIX + default_name, core_default_label(default))


def _bind(args: tuple, kwargs: dict) -> dict[str, Any]:
    """Name ComfyUI's attention arguments whether they came positionally (Qwen) or by keyword (Wan)."""
    bound = dict(zip(_ARG_NAMES, args))
    for name in _ARG_NAMES:
        if name in kwargs:
            bound[name] = kwargs[name]
    bound.setdefault("mask", None)
    return bound


class AttentionOverride:
    """The per-model ``optimized_attention_override``: routes each call to ``kernels.attention``."""

    def __init__(self, backend: str, host: Optional[attention_kernels.HostAttention] = None) -> None:
        self.backend = backend
        self.host = host  # ComfyUI's own backends: auto measures them with ours
        self.host_name = opaque_ops.register_host(host)  # how the compiled graph's attention op names it

    def __repr__(self) -> str:
        return f"AttentionOverride({self.backend!r})"

    def __call__(self, func: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the compiled region's own memory plan; no host calls traced
            return self._attend(func, args, kwargs)
        with outside_allocation_graph():  # cached rotations and fused kernels outlive ComfyUI's recorded step
            return self._attend(func, args, kwargs)

    def _attend(self, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        a = _bind(args, kwargs)
        q, k, v, heads = a["q"], a["k"], a["v"], a["heads"]
        if a.get("skip_reshape", False):
            b, _, _, d = q.shape
            if q.shape[1] != heads or k.shape[1] != heads:
                return func(*args, **kwargs)  # grouped K/V or odd layout: leave it to ComfyUI
            qh, kh, vh = q, k, v
        else:
            b, _, inner = q.shape
            d = inner // heads
            if k.shape[-1] != inner or v.shape[-1] != inner:
                return func(*args, **kwargs)
            qh, kh, vh = (t.view(b, -1, heads, d).transpose(1, 2) for t in (q, k, v))
        mask = a["mask"]
        if mask is not None:  # ComfyUI's normalisation: [Lq, Lk] / [B, Lq, Lk] -> [B, H, Lq, Lk]
            if mask.ndim == 2:
                mask = mask.unsqueeze(0)
            if mask.ndim == 3:
                mask = mask.unsqueeze(1)
        out = opaque_ops.selected_attention(qh, kh, vh, mask, self.backend, self.host, self.host_name)
        if a.get("skip_output_reshape", False):
            return out
        return out.transpose(1, 2).reshape(b, -1, heads * out.shape[-1])


class ChainedOverride:
    """Another node's override composed with the pack's: ``outer`` runs first, and the function it is given to
    fall back to (ComfyUI's ``func`` argument) is the pack's attention, which itself falls back to ComfyUI's."""

    def __init__(self, outer: Any, inner: AttentionOverride) -> None:
        self.outer, self.inner = outer, inner

    def __repr__(self) -> str:
        return f"ChainedOverride({describe_override(self.outer)} -> {self.inner!r})"

    def __call__(self, func: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        inner = self.inner

        def pack_attention(*a: Any, **kw: Any) -> torch.Tensor:
            return inner(func, *a, **kw)

        pack_attention.__name__ = f"lowvram_dit {inner.backend}"  # what the outer override logs as its fallback
        return self.outer(pack_attention, *args, **kwargs)


def describe_override(override: Any) -> str:
    """Where another node's attention override comes from: its module and function (or class) name."""
    target = override.func if isinstance(override, functools.partial) else override
    if not (inspect.isfunction(target) or inspect.ismethod(target) or inspect.isbuiltin(target)):
        target = type(target)  # a callable object: its class
    qualname = getattr(target, "__qualname__", repr(target)).split(".<locals>")[0]
    return f"{getattr(target, '__module__', None) or '?'}.{qualname}"


def foreign_part(override: Any) -> Any:
    """The part of a model's attention override that another node installed (None when it is all the pack's)."""
    if override is None or isinstance(override, AttentionOverride):
        return None
    return override.outer if isinstance(override, ChainedOverride) else override


def pack_owned(override: Any) -> bool:
    """Whether the pack's Attention node installed this override (alone or composed under another one)."""
    return isinstance(override, (AttentionOverride, ChainedOverride))


class ReportLaterOverride:
    """``ON_PRE_RUN`` callback: names, once, an override another node applied after the Attention node (it then
    runs first, and the pack's attention runs the calls it passes on to the override it wrapped)."""

    def __init__(self, backend_label: str) -> None:
        self.backend_label = backend_label
        self.said: Any = None

    def __deepcopy__(self, memo: dict) -> ReportLaterOverride:
        return self

    def __call__(self, patcher: Any) -> None:
        opts = getattr(patcher, "model_options", {}).get("transformer_options", {})
        top = opts.get(OVERRIDE_KEY)
        if top is None or pack_owned(top) or top is self.said:
            return  # nothing added after the node, or a later Attention node said what it did
        self.said = top
        log.info("lowvram_dit attention: another attention override (%s), applied after the Attention node, runs "
                 "first on this model; the calls it passes on to the override it wrapped run %s",
                 describe_override(top), self.backend_label)


def _composition_line(backend_label: str, outer: Any) -> str:
    """The node's one log line: which override runs where."""
    if outer is None:
        return f"lowvram_dit attention: model uses {backend_label}"
    if BACKEND_CHOICES[backend_label] is None:
        return (f"lowvram_dit attention: model uses {backend_label}; another attention override "
                f"({describe_override(outer)}) stays on it and runs first")
    return (f"lowvram_dit attention: model uses {backend_label} inside another attention override "
            f"({describe_override(outer)}): that override runs first and the calls it does not take run "
            f"{backend_label}")


def apply_attention(model: Any, backend_label: str) -> Any:
    """A clone of ``model`` (ModelPatcher) whose attention runs through ``backend_label``. An override another
    node put there stays and runs first, with the pack's attention as the function it falls back to."""
    if backend_label not in BACKEND_CHOICES:
        raise ValueError(f"Attention: backend '{backend_label}' is not one of {list(BACKEND_CHOICES)}")
    m = model.clone()
    opts = m.model_options.setdefault("transformer_options", {})
    outer = foreign_part(opts.get(OVERRIDE_KEY))
    name = BACKEND_CHOICES[backend_label]
    if name is None:
        opts.pop(OVERRIDE_KEY, None)
        if outer is not None:
            opts[OVERRIDE_KEY] = outer
    else:
        ours = AttentionOverride(name, core_attention() if name == "auto" else None)
        opts[OVERRIDE_KEY] = ours if outer is None else ChainedOverride(outer, ours)
    if name in INT8_PV_FORMATS:
        warm_int8_kernels(m, INT8_PV_FORMATS[name])
    elif name == "auto":  # its 8-bit candidate (kernels.attention_backends.AUTO_QUANTIZED), where it can run
        warm_int8_kernels(m, AUTO_PV_FORMAT, only_warp_specialized=True)
    _watch_later_overrides(m, backend_label)
    log.info("%s", _composition_line(backend_label, outer))
    return m


def _watch_later_overrides(m: Any, backend_label: str) -> None:
    """Replace an earlier Attention node's watcher by this node's (best effort: hosts without callbacks skip)."""
    try:
        import comfy.patcher_extension as pe

        m.remove_callbacks_with_key(pe.CallbacksMP.ON_PRE_RUN, OVERRIDE_KEY)
        m.add_callback_with_key(pe.CallbacksMP.ON_PRE_RUN, OVERRIDE_KEY, ReportLaterOverride(backend_label))
    except (ImportError, AttributeError) as exc:  # a host without patcher callbacks: the node line still says it
        log.debug("lowvram_dit attention: no watch for later attention overrides (%s)", exc)


def _attention_geometry(diffusion_model: Any) -> tuple[Optional[int], Optional[int]]:
    """(heads, head dim) of a diffusion model: Wan keeps ``num_heads`` and ``dim`` on the model, Qwen-Image
    ``heads`` and ``inner_dim`` on each attention module; (None, None) when neither is found."""
    heads, width = getattr(diffusion_model, "num_heads", None), getattr(diffusion_model, "dim", None)
    if not isinstance(heads, int):
        module = next((mod for mod in diffusion_model.modules() if isinstance(getattr(mod, "heads", None), int)),
                      None)
        heads, width = (module.heads, getattr(module, "inner_dim", None)) if module is not None else (None, None)
    if not isinstance(heads, int) or heads <= 0:
        return None, None
    return heads, width // heads if isinstance(width, int) and width % heads == 0 else None


def warm_int8_kernels(model: Any, pv_format: str = "auto", only_warp_specialized: bool = False) -> None:
    """Start compiling the 8-bit attention kernels for this model's GPU, dtype and head size (and the backend's P·V
    format) in the background (kernels.attention_int8.start_warmup), so the first sampler step does not compile
    them; best effort. ``only_warp_specialized``: only where the Gluon loop runs (auto's 8-bit candidate)."""
    from ..kernels import attention_int8

    try:
        device = torch.device(model.load_device)
        base = model.model
        dtype = getattr(base, "manual_cast_dtype", None) or base.get_dtype()
        heads, head_dim = _attention_geometry(base.diffusion_model)
    except (AttributeError, TypeError, RuntimeError) as exc:  # not a ComfyUI model we know: the first call compiles
        log.debug("lowvram_dit attention: no 8-bit warm-up for this model (%s)", exc)
        return
    if dtype not in attention_int8.SUPPORTED_DTYPES:
        dtype = torch.bfloat16
    head_dim = head_dim or 128
    if only_warp_specialized and not attention_int8.gluon_loop_runs(device, head_dim):
        return
    attention_int8.start_warmup(device, dtype, heads or 24, head_dim, pv_format)


def warm_int8_for_prompt(json_data: Any) -> Any:
    """ComfyUI on-prompt handler: a queued prompt that sets an Attention node to one of the pack's 8-bit backends
    (or to auto, where auto's 8-bit candidate can run) starts that backend's warm-up at once (bf16, head dim 128: Wan
    and Qwen-Image), so text encoding and model loading hide it; the node's own warm-up for the loaded model then
    finds it running or done. Returns the prompt unchanged."""
    try:
        prompt = json_data.get("prompt") if isinstance(json_data, dict) else None
        wanted = node_id("Attention")
        backends = {n["inputs"].get("backend") for n in (prompt.values() if isinstance(prompt, dict) else ())
                    if isinstance(n, dict) and n.get("class_type") == wanted and isinstance(n.get("inputs"), dict)}
        formats = {INT8_PV_FORMATS[name] for label, name in BACKEND_CHOICES.items()
                   if name in INT8_PV_FORMATS and label in backends}
        if formats or "auto" in backends:
            import comfy.model_management

            from ..kernels import attention_int8

            device, head_dim = comfy.model_management.get_torch_device(), PROMPT_WARMUP_HEAD_DIM
            if "auto" in backends and attention_int8.gluon_loop_runs(device, head_dim):
                formats.add(AUTO_PV_FORMAT)
            for pv_format in sorted(formats):
                attention_int8.start_warmup(device, torch.bfloat16, 24, head_dim, pv_format)
    except Exception as exc:  # noqa: BLE001 - a prompt must never fail because of a warm-up
        log.debug("lowvram_dit attention: no warm-up for this prompt (%s)", exc)
    return json_data


def register_prompt_warmup(prompt_server: Any = None) -> bool:
    """Add ``warm_int8_for_prompt`` to the server's on-prompt handlers once; False without a running server."""
    from .prompt_inputs import add_prompt_handler

    return add_prompt_handler(warm_int8_for_prompt, prompt_server)
