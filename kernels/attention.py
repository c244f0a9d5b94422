"""Attention backends behind one call, with capability checks, a first-use accuracy check and auto-selection.

Every backend takes ``q, k, v`` as ``[B, H, L, D]`` views (any strides) plus an optional additive or boolean
mask broadcastable to ``[B, H, Lq, Lk]`` and returns ``[B, H, Lq, D]``. Optional libraries (flash-attn 2/3,
SageAttention, xformers, our 8-bit kernel) are imported on first use; a missing one is "not available".

``AttentionSelector.run`` is what model code calls. The first time a backend meets a shape it runs once for
real, and its output is compared with an fp32 reference on a slice of query rows (attention rows are
independent, so the slice needs the full K/V but only a few queries). NaN/Inf or a large error means fall
back to the next backend and say so once. ``auto`` times every candidate that passes on the real inputs,
once per (per-sample shape, dtype, kind of GPU), and caches the fastest: the ranking differs by GPU and torch version
(benchmarks/results/bench_attention_partial.md). ``HostAttention`` adds the host's own backends to it.

Never imports ComfyUI; the ComfyUI call contract (layouts, heads, ``_inside_attn_wrapper``) lives in
``nodes/attention.py``.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .decisions import DECIDING, describe_kind, device_kind, time_call

log = logging.getLogger("comfyui_lowvram_dit")

Tensor = torch.Tensor
AttentionFn = Callable[[Tensor, Tensor, Tensor, Optional[Tensor]], Tensor]

# Relative Frobenius error vs the fp32 reference that still counts as correct. bf16 kernels land near 0.4 %,
# SageAttention 1 at 1.4 % (measured-h200-2026-11-21.md); 3 % / 8 % leave headroom without passing garbage.
EXACT_TOLERANCE = 0.03
QUANTIZED_TOLERANCE = 0.08
_CHECK_QUERY_ROWS = 256  # query rows compared per head: enough to catch a broken kernel, cheap at L=75600
_CHECK_HEADS = 2


class BackendUnavailable(RuntimeError):
    """The backend cannot run this call (library missing, GPU, dtype, head size or mask unsupported)."""


@dataclass(frozen=True)
class AttentionBackend:
    """One attention implementation and what it can run."""

    name: str
    label: str
    call: AttentionFn
    # reason(device, dtype, head_dim, has_mask) -> None when supported, else a short human reason.
    reason: Callable[[torch.device, torch.dtype, int, bool], Optional[str]]
    tolerance: float = EXACT_TOLERANCE
    # Traceable by dynamo (SDPA, custom ops). Others run behind torch.compiler.disable: a graph break, not a crash.
    compile_safe: bool = False
    # Quantized (8-bit) kernels give up accuracy for speed: where they are not faster, an exact kernel is used.
    trades_accuracy: bool = False


@dataclass(frozen=True)
class HostAttention:
    """The host application's attention: extra ``auto`` candidates (exact ones timed with ours, quantized ones
    winning a shape only where faster than the best exact one) and the one the host would run itself."""

    backends: tuple[AttentionBackend, ...] = ()
    default: Optional[str] = None  # the name in ``backends`` of what the host runs without us, if known
    default_label: str = ""  # how the log names the host's own choice
    tag: str = field(init=False, default="")  # part of the cache key: a plain str, so dynamo guards on it

    def __post_init__(self) -> None:
        clash = [b.name for b in self.backends if b.name in BACKENDS]
        if clash:
            raise ValueError(f"kernels/attention.py: host backend names {clash} clash with the pack's own; "
                             "give host backends a prefix")
        object.__setattr__(self, "tag", ",".join(b.name for b in self.backends))


# --------------------------------------------------------------------------------------------- capability


def _sm(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)


def _optional_module(name: str):  # noqa: ANN202 - a module or None
    try:
        return importlib.import_module(name)
    except (Exception, SystemExit):  # a broken install (ABI mismatch, a sys.exit on import) is as good as missing
        return None


def _needs_half(dtype: torch.dtype) -> Optional[str]:
    return None if dtype in (torch.float16, torch.bfloat16) else f"needs fp16/bf16, got {dtype}"


def _cuda_half(min_sm: tuple[int, int], max_head: int, mask_ok: bool, lib: Optional[str] = None):
    """Reason function for a CUDA fp16/bf16 kernel with a minimum SM and head size."""

    def reason(device: torch.device, dtype: torch.dtype, head_dim: int, has_mask: bool) -> Optional[str]:
        if lib is not None and _optional_module(lib) is None:
            return f"python package '{lib}' is not installed"
        if device.type != "cuda":
            return "needs a CUDA GPU"
        if _sm(device) < min_sm:
            return f"needs SM {min_sm[0]}.{min_sm[1]}+, this GPU is SM {_sm(device)[0]}.{_sm(device)[1]}"
        if (msg := _needs_half(dtype)) is not None:
            return msg
        if head_dim > max_head or head_dim % 8:
            return f"head size {head_dim} unsupported (multiple of 8, <= {max_head})"
        if has_mask and not mask_ok:
            return "does not take an attention mask"
        return None

    return reason


# ----------------------------------------------------------------------------------------------- backends


def _sdpa_with(kernel: Optional["torch.nn.attention.SDPBackend"]) -> AttentionFn:
    def call(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
        if kernel is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel([kernel]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return call


def _sdpa_backend(name: str):  # noqa: ANN202 - SDPBackend or None
    from torch.nn.attention import SDPBackend

    return getattr(SDPBackend, name, None)


def _flash_attn2(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
    from flash_attn import flash_attn_func  # flash-attn >= 2.7 registers torch custom ops: compile-safe

    return flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def _flash_attn3(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
    from flash_attn_interface import flash_attn_func  # FA3 (hopper/ build of flash-attention)

    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    out = out[0] if isinstance(out, tuple) else out  # FA3 betas returned (out, lse)
    return out.transpose(1, 2)


def _sage(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
    from sageattention import sageattn

    return sageattn(q, k, v, tensor_layout="HND", is_causal=False)


def _xformers(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
    import xformers.ops

    out = xformers.ops.memory_efficient_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def _int8(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
    from . import attention_int8  # optional (needs Triton)

    return attention_int8.attention_int8(q, k, v, layout="BHLD")


def _int8_reason(device: torch.device, dtype: torch.dtype, head_dim: int, has_mask: bool) -> Optional[str]:
    mod = _optional_module(f"{__package__}.attention_int8")
    if mod is None:
        return "kernels/attention_int8.py is not available"
    if has_mask:
        return "does not take an attention mask"
    try:
        if mod.is_supported(device, dtype, head_dim):
            return None
        if device.type == "cuda" and mod._triton_module() is None:
            return "needs Triton, which does not import here (pip install triton; triton-windows on Windows)"
        return "unsupported on this GPU/dtype/head size (CUDA sm80+, bf16/fp16, head dim 64 or 128)"
    except Exception as exc:  # its capability probe must not take the sampler down
        return f"is_supported() failed: {exc}"


def _sdpa_reason(kind: str) -> Callable[[torch.device, torch.dtype, int, bool], Optional[str]]:
    def reason(device: torch.device, dtype: torch.dtype, head_dim: int, has_mask: bool) -> Optional[str]:
        if _sdpa_backend(kind) is None:
            return f"torch {torch.__version__} has no SDPBackend.{kind}"
        if kind == "MATH":
            return None
        if kind == "FLASH_ATTENTION":
            if device.type == "cpu":
                return None  # torch ships a CPU flash kernel (fp32/bf16/fp16)
            return _cuda_half((8, 0), 256, True)(device, dtype, head_dim, has_mask)
        if device.type != "cuda":
            return "needs a CUDA GPU"
        if kind == "CUDNN_ATTENTION":
            return _cuda_half((8, 0), 256, True)(device, dtype, head_dim, has_mask)
        return None  # EFFICIENT_ATTENTION: fp32/fp16/bf16, masks, SM 5.0+

    return reason


def _always(device: torch.device, dtype: torch.dtype, head_dim: int, has_mask: bool) -> Optional[str]:
    return None


BACKENDS: dict[str, AttentionBackend] = {}


def register_backend(backend: AttentionBackend) -> None:
    """Add or replace a backend in the registry (tests register failing ones)."""
    BACKENDS[backend.name] = backend


def _register_builtin() -> None:
    for name, label, kind in (
        ("sdpa_cudnn", "SDPA cuDNN", "CUDNN_ATTENTION"),
        ("sdpa_flash", "SDPA flash", "FLASH_ATTENTION"),
        ("sdpa_efficient", "SDPA memory-efficient", "EFFICIENT_ATTENTION"),
        ("sdpa_math", "SDPA math", "MATH"),
    ):
        register_backend(AttentionBackend(name, label, _sdpa_with(_sdpa_backend(kind)), _sdpa_reason(kind),
                                          compile_safe=True))
    register_backend(AttentionBackend("sdpa", "SDPA (torch picks)", _sdpa_with(None), _always, compile_safe=True))
    register_backend(AttentionBackend("flash_attn2", "flash-attn 2", _flash_attn2,
                                      _cuda_half((8, 0), 256, False, "flash_attn"), compile_safe=True))
    register_backend(AttentionBackend("flash_attn3", "flash-attn 3", _flash_attn3,
                                      _cuda_half((9, 0), 256, False, "flash_attn_interface")))
    register_backend(AttentionBackend("sage", "SageAttention", _sage, _cuda_half((8, 0), 128, False, "sageattention"),
                                      tolerance=QUANTIZED_TOLERANCE, trades_accuracy=True))
    register_backend(AttentionBackend("xformers", "xformers", _xformers,
                                      _cuda_half((7, 5), 256, False, "xformers.ops")))
    register_backend(AttentionBackend("int8", "lowvram 8-bit", _int8, _int8_reason, tolerance=QUANTIZED_TOLERANCE,
                                      trades_accuracy=True))


_register_builtin()

# Fallback order when the requested backend cannot run: fastest kinds first (H200 table in the module doc),
# the always-working SDPA dispatch last. `auto` measures instead of trusting this order.
FALLBACK_ORDER: tuple[str, ...] = (
    "sdpa_cudnn", "flash_attn3", "flash_attn2", "sdpa_flash", "sage", "xformers", "sdpa_efficient", "sdpa",
    "sdpa_math",
)
# Candidates `auto` times. 8-bit kernels are opt-in (they change numerics), math is only a reference.
AUTO_CANDIDATES: tuple[str, ...] = (
    "sdpa_cudnn", "flash_attn3", "flash_attn2", "sdpa_flash", "xformers", "sdpa_efficient", "sdpa",
)


def unavailable_reason(name: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                       has_mask: bool = False) -> Optional[str]:
    """Why backend ``name`` cannot run here, or None when it can (static check; the first run confirms)."""
    backend = BACKENDS.get(name)
    if backend is None:
        return f"unknown attention backend '{name}' (known: {', '.join(BACKENDS)})"
    return backend.reason(torch.device(device), dtype, head_dim, has_mask)


def available_backends(device: torch.device, dtype: torch.dtype, head_dim: int, has_mask: bool = False) -> list[str]:
    """Names of the registered backends that pass the static capability check."""
    return [n for n in BACKENDS if unavailable_reason(n, device, dtype, head_dim, has_mask) is None]


# ---------------------------------------------------------------------------------------------- checking


def reference_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None) -> Tensor:
    """fp32 softmax(q k^T / sqrt(D)) v on [B, H, L, D] inputs: the accuracy reference."""
    q, k, v = q.float(), k.float(), v.float()
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    return torch.softmax(scores, dim=-1) @ v


def _slice_mask(mask: Optional[Tensor], heads: list[int], rows: Tensor) -> Optional[Tensor]:
    if mask is None:
        return None
    m = mask[:1]
    m = m[:, heads] if m.shape[1] > 1 else m
    return m[:, :, rows] if m.shape[2] > 1 else m


def check_output(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], out: Tensor) -> tuple[bool, float, str]:
    """Compare ``out`` with the fp32 reference on a slice: (finite, relative error, note)."""
    if not bool(torch.isfinite(out).all()):
        return False, float("inf"), "output has NaN/Inf"
    lq = q.shape[2]
    heads = sorted({0, q.shape[1] - 1})[:_CHECK_HEADS]
    rows = torch.linspace(0, lq - 1, min(lq, _CHECK_QUERY_ROWS), device=q.device).long().unique()
    ref = reference_attention(q[:1, heads][:, :, rows], k[:1, heads], v[:1, heads], _slice_mask(mask, heads, rows))
    if not bool(torch.isfinite(ref).all()):
        return True, 0.0, "reference not finite (inputs carry NaN/Inf); check skipped"
    got = out[:1, heads][:, :, rows].float()
    err = float((got - ref).norm() / ref.norm().clamp_min(1e-12))
    return True, err, ""


# ------------------------------------------------------------------------------------------------ timing


def attention_tflops(b: int, h: int, lq: int, lk: int, d: int, ms: float) -> float:
    """TFLOP/s of non-causal attention (4·B·H·Lq·Lk·D flops: two matmuls)."""
    return 4.0 * b * h * lq * lk * d / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------------------------------------- selector


@dataclass
class Decision:
    """What the selector settled on for one (request, shape, dtype, device)."""

    backend: str
    requested: str
    timings_ms: dict[str, float] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    note: str = ""
    labels: dict[str, str] = field(default_factory=dict)  # labels of host backends, which are not in BACKENDS

    def label(self, name: str) -> str:
        """The human name of backend ``name`` (ours or the host's)."""
        if name in self.labels:
            return self.labels[name]
        return BACKENDS[name].label if name in BACKENDS else name

    def describe(self) -> str:
        """One log line: the choice, the timings behind it and what was rejected and why."""
        times = ", ".join(f"{self.label(n)} {t:.2f} ms" for n, t in sorted(self.timings_ms.items(),
                                                                           key=lambda kv: kv[1]))
        rej = "; ".join(f"{self.label(n)}: {r}" for n, r in self.rejected.items())
        text = self.label(self.backend)
        if times:
            text += f" [{times}]"
        if rej:
            text += f" (rejected: {rej})"
        if self.note:
            text += f"; {self.note}"
        return text

    def versus_host(self, host: HostAttention) -> str:
        """'core would use X; chose Y (ms vs ms)': the choice against what the host runs without us."""
        core, chosen, ms = host.default_label or str(host.default), self.label(self.backend), self.timings_ms
        if self.backend in ms and host.default in ms:
            return f"core would use {core}; chose {chosen} ({ms[self.backend]:.2f} ms vs {ms[host.default]:.2f} ms)"
        return f"core would use {core} ({self.rejected.get(host.default or '', 'not measured')}); chose {chosen}"


def _key(requested: str, q: Tensor, k: Tensor, mask: Optional[Tensor], host: Optional[HostAttention] = None) -> tuple:
    """Per-sample shape and device kind, never the batch size or the GPU's index (kernels/decisions.py)."""
    _, h, lq, d = q.shape
    mask_kind = "none" if mask is None else ("bool" if mask.dtype == torch.bool else "float")
    return (requested, h, lq, k.shape[2], d, q.dtype, device_kind(q.device), mask_kind,
            "" if host is None else host.tag)


def describe_key(key: tuple) -> str:
    """Human form of a cache key: 'H40 L32760/32760 D128 bfloat16 cuda NVIDIA H100 (SM 9.0)'."""
    _, h, lq, lk, d, dtype, kind, mask_kind = key[:8]
    masked = "" if mask_kind == "none" else f" {mask_kind}-mask"
    return f"H{h} L{lq}/{lk} D{d} {str(dtype).replace('torch.', '')} {describe_kind(kind)}{masked}"


class AttentionSelector:
    """Runs attention through a requested backend with fallback, first-use checks and cached auto choices."""

    def __init__(self) -> None:
        # key -> backend name. Plain str values so dynamo can guard on a hit and trace straight into the kernel.
        self.decisions: dict[tuple, str] = {}
        self.details: dict[tuple, Decision] = {}
        self.host_backends: dict[str, AttentionBackend] = {}
        self._said: set[str] = set()

    def run(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None, backend: str = "auto",
            host: Optional[HostAttention] = None) -> Tensor:
        """Attention on [B, H, L, D] views with ``backend`` ("auto" or a registry name); never silently wrong.

        ``host`` adds the host application's backends to ``auto``'s candidates and names its own choice."""
        name = self.decisions.get(_key(backend, q, k, mask, host))
        if name is not None:
            return _call(self.backend(name), q, k, v, mask)
        return self._decide_and_run(q, k, v, mask, backend, host)

    def backend(self, name: str) -> AttentionBackend:
        """The pack's backend ``name``, else a host backend this selector has been given."""
        found = BACKENDS.get(name)
        return found if found is not None else self.host_backends[name]

    def say_once(self, message: str, level: int = logging.WARNING) -> None:
        """Log ``message`` the first time it is seen by this selector."""
        if message not in self._said:
            self._said.add(message)
            log.log(level, message)

    def report(self) -> list[str]:
        """Every cached decision as a log-ready line (for the doctor node and benchmarks)."""
        return [f"{describe_key(k)}: {d.describe()}" for k, d in self.details.items()]

    def clear(self) -> None:
        """Forget every cached choice (next call measures and checks again)."""
        self.decisions.clear()
        self.details.clear()
        self.host_backends.clear()

    @torch.compiler.disable
    def _decide_and_run(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], backend: str,
                        host: Optional[HostAttention]) -> Tensor:
        key = _key(backend, q, k, mask, host)
        with DECIDING:  # another GPU deciding the same key: wait, then use its choice
            if (known := self.decisions.get(key)) is not None:  # also a graph traced before the decision landed
                return self.backend(known).call(q, k, v, mask)
            return self._decide(key, q, k, v, mask, backend, host)

    def _decide(self, key: tuple, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], backend: str,
                host: Optional[HostAttention]) -> Tensor:
        decision = Decision(backend="sdpa_math", requested=backend)
        exact, quantized = self._candidates(backend, host, decision)
        result = self._first_or_fastest(exact, q, k, v, mask, decision, key)
        if result is None:  # every candidate failed: the math kernel runs everything torch runs
            decision.backend, result = "sdpa_math", BACKENDS["sdpa_math"].call(q, k, v, mask)
        elif backend == "auto":
            result = self._quantized_where_faster(quantized, q, k, v, mask, decision, result)
        elif decision.backend == backend and BACKENDS[backend].trades_accuracy:
            result = self._prefer_faster_exact(q, k, v, mask, decision, result)
        self.decisions[key], self.details[key] = decision.backend, decision
        if backend == "auto" and host is not None and host.default is not None:
            self.say_once(f"lowvram_dit attention auto for {describe_key(key)}: {decision.versus_host(host)}; "
                          f"measured: {decision.describe()}", logging.INFO)
        else:
            level = logging.INFO if decision.backend == backend or backend == "auto" or decision.note \
                else logging.WARNING
            self.say_once(f"lowvram_dit attention {backend} {describe_key(key)} -> {decision.describe()}", level)
        return result

    def _candidates(self, backend: str, host: Optional[HostAttention],
                    decision: Decision) -> tuple[list[str], list[str]]:
        """(exact candidates in order, quantized host candidates) for this request."""
        if backend != "auto":
            return [backend] + [n for n in FALLBACK_ORDER if n != backend], []
        exact, quantized = list(AUTO_CANDIDATES), []
        for extra in host.backends if host is not None else ():
            self.host_backends[extra.name] = extra
            decision.labels[extra.name] = extra.label
            (quantized if extra.trades_accuracy else exact).append(extra.name)
        return exact, quantized

    def _unavailable(self, name: str, q: Tensor, mask: Optional[Tensor]) -> Optional[str]:
        if name in BACKENDS or name not in self.host_backends:
            return unavailable_reason(name, q.device, q.dtype, q.shape[-1], mask is not None)
        return self.host_backends[name].reason(q.device, q.dtype, q.shape[-1], mask is not None)

    def _first_or_fastest(self, order: list[str], q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                          decision: Decision, key: tuple) -> Optional[Tensor]:
        """A request: the first of ``order`` that passes. Auto: the fastest that passes. None if none does."""
        auto, result = decision.requested == "auto", None
        for name in order:
            reason = self._unavailable(name, q, mask)
            if reason is None:
                out, reason = self._try(name, q, k, v, mask, decision)
                if out is not None and not auto:
                    decision.backend = name
                    return out
                if out is not None:
                    self._time(decision, name, q, k, v, mask)
                    if result is None or decision.timings_ms[name] < decision.timings_ms[decision.backend]:
                        decision.backend, result = name, out
                    continue
            decision.rejected[name] = reason
            if not auto and name == decision.requested:
                self.say_once(f"lowvram_dit attention: {decision.label(name)} cannot run {describe_key(key)}: "
                              f"{reason}; falling back")
        return result

    def _quantized_where_faster(self, names: list[str], q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                                decision: Decision, result: Tensor) -> Tensor:
        """Auto's quantized host candidates: each that passes the check wins only where faster than the
        current choice (the fastest exact one), the rule an 8-bit request follows."""
        for name in names:
            reason = self._unavailable(name, q, mask)
            out = None
            if reason is None:
                out, reason = self._try(name, q, k, v, mask, decision)
            if out is None:
                decision.rejected[name] = reason
            elif self._keeps_quantized(decision, name, decision.backend, q, k, v, mask):
                decision.note = f"{decision.label(name)} is faster than {decision.label(decision.backend)} here"
                decision.backend, result = name, out
        return result

    def _keeps_quantized(self, decision: Decision, quantized: str, exact: str, q: Tensor, k: Tensor, v: Tensor,
                         mask: Optional[Tensor]) -> bool:
        """True where ``quantized`` is faster than ``exact`` on these inputs; else the note says why not."""
        if self._time(decision, quantized, q, k, v, mask) < self._time(decision, exact, q, k, v, mask):
            return True
        decision.note = (f"{decision.label(quantized)} is slower than {decision.label(exact)} at this shape, "
                         f"so {decision.label(exact)} runs it")
        return False

    def _prefer_faster_exact(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], decision: Decision,
                             result: Tensor) -> Tensor:
        """An 8-bit kernel only pays on long sequences (H100: 1.21x cuDNN at Wan 480p self-attention, 0.62x on
        its 512-key cross-attention, 0.86x on Qwen-Image 1328² joint attention). Time it once against the first
        exact backend that passes and keep the faster: slower and less accurate is never the right trade."""
        quantized = decision.backend
        for name in FALLBACK_ORDER:
            if name == quantized or BACKENDS[name].trades_accuracy or name == "sdpa_math":
                continue
            if unavailable_reason(name, q.device, q.dtype, q.shape[-1], mask is not None) is not None:
                continue
            out, reason = self._try(name, q, k, v, mask, decision)
            if out is None:
                decision.rejected[name] = reason
                continue
            if self._keeps_quantized(decision, quantized, name, q, k, v, mask):
                return result
            decision.backend = name
            return out
        return result

    def _try(self, name: str, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
             decision: Decision) -> tuple[Optional[Tensor], str]:
        backend = self.backend(name)
        try:
            out = backend.call(q, k, v, mask)
        except Exception as exc:  # "cannot run" is learnt here as often as from the static check
            return None, f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if not isinstance(out, Tensor) or tuple(out.shape) != (*q.shape[:3], v.shape[-1]):
            return None, f"returned shape {tuple(getattr(out, 'shape', ()))}"
        finite, err, note = check_output(q, k, v, mask, out)
        decision.errors[name] = err
        if not finite:
            return None, note
        if err > backend.tolerance:
            return None, f"relative error {err:.3g} > {backend.tolerance:g} vs fp32 reference"
        return out, ""

    def _time(self, decision: Decision, name: str, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> float:
        """Milliseconds of backend ``name`` on these inputs, measured once per decision (``timings_ms``)."""
        if name not in decision.timings_ms:
            fn = self.backend(name).call
            decision.timings_ms[name] = time_call(lambda: fn(q, k, v, mask), q.device)
        return decision.timings_ms[name]


def _call(backend: AttentionBackend, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
    if backend.compile_safe:
        return backend.call(q, k, v, mask)
    return _eager_call(backend.call, q, k, v, mask)


@torch.compiler.disable
def _eager_call(fn: AttentionFn, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
    return fn(q, k, v, mask)


SELECTOR = AttentionSelector()  # process-wide: "once per (shape, dtype, GPU)" means once per process


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None, backend: str = "auto") -> Tensor:
    """Attention on [B, H, L, D] through the process-wide selector."""
    return SELECTOR.run(q, k, v, mask, backend)


@contextlib.contextmanager
def isolated_selector():  # noqa: ANN201 - yields AttentionSelector
    """Swap in a fresh process-wide selector (tests, benchmarks); restores the old one on exit."""
    global SELECTOR
    old, SELECTOR = SELECTOR, AttentionSelector()
    try:
        yield SELECTOR
    finally:
        SELECTOR = old
