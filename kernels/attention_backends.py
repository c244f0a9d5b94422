"""Attention backends: the registry of kernels behind one call signature and what each can run.

Every backend takes ``q, k, v`` as ``[B, H, L, D]`` views (any strides) plus an optional additive or boolean
mask broadcastable to ``[B, H, Lq, Lk]`` and returns ``[B, H, Lq, D]``. Optional libraries (flash-attn 2/3,
SageAttention, xformers, comfy-kitchen, our 8-bit kernel) are imported on first use; a missing one is "not
available".
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
AttentionFn = Callable[[Tensor, Tensor, Tensor, Optional[Tensor]], Tensor]

# Relative Frobenius error vs the fp32 reference that still counts as correct. bf16 kernels land near 0.4 %,
# SageAttention 1 near 1.4 %; 3 % / 8 % leave headroom without passing garbage.
EXACT_TOLERANCE = 0.03
QUANTIZED_TOLERANCE = 0.08
# Sparse approximations (comfy-kitchen's Sol-Attn) are asked for by name, knowing they approximate; past this the
# output is no longer attention and the first-use check falls back.
APPROXIMATE_TOLERANCE = 0.15


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


def _int8_with(pv_format: str) -> AttentionFn:
    """The pack's 8-bit kernel with P·V in ``pv_format`` ("auto": the format resolve_formats picks for the GPU)."""
    def call(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
        from . import attention_int8  # optional (needs Triton)

        return attention_int8.attention_int8(q, k, v, layout="BHLD", pv_format=pv_format)

    return call


def _int8_fp8_pv_reason(device: torch.device, dtype: torch.dtype, head_dim: int, has_mask: bool) -> Optional[str]:
    reason = _int8_reason(device, dtype, head_dim, has_mask)
    if reason is None and torch.cuda.get_device_capability(device) < (8, 9):
        return "fp8 P·V needs fp8 tensor cores (sm89+: RTX 40xx, H100 and newer)"
    return reason


def _int8_gluon_reason(device: torch.device, dtype: torch.dtype, head_dim: int, has_mask: bool) -> Optional[str]:
    """The fp16 P·V scheme as auto's candidate: only where its loop runs warp-specialized, one compile and no
    autotuning in a render's first step (Triton's loop autotunes there)."""
    reason = _int8_reason(device, dtype, head_dim, has_mask)
    if reason is not None:
        return reason
    if not _optional_module(f"{__package__}.attention_int8").gluon_loop_runs(device, head_dim):
        return "runs only in the warp-specialized loop: sm90 (H100 / H200), Triton >= 3.6, head size 128"
    return None


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


def _kitchen_reason(sparse: bool) -> Callable[[torch.device, torch.dtype, int, bool], Optional[str]]:
    def reason(device: torch.device, dtype: torch.dtype, head_dim: int, has_mask: bool) -> Optional[str]:
        from . import int8_comfy_kitchen

        if has_mask and sparse:
            return "does not take an attention mask"
        try:
            return int8_comfy_kitchen.attention_reason(device, dtype, head_dim, sparse)
        except Exception as exc:  # its capability probe must not take the sampler down
            return f"comfy-kitchen's availability check failed: {exc}"

    return reason


def _kitchen_int8(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
    from . import int8_comfy_kitchen

    return int8_comfy_kitchen.int8_attention(q, k, v, mask)


def _kitchen_sol(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
    from . import int8_comfy_kitchen

    return int8_comfy_kitchen.sol_attn(q, k, v, mask)


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
    register_backend(AttentionBackend("int8", "lowvram 8-bit", _int8_with("auto"), _int8_reason,
                                      tolerance=QUANTIZED_TOLERANCE, trades_accuracy=True))
    # the same kernel with int8 P·V: more exact than fp8 P·V, more instructions per tile (docs/nodes.md)
    register_backend(AttentionBackend("int8_pv8", "lowvram 8-bit, int8 P·V", _int8_with("int8"), _int8_reason,
                                      tolerance=QUANTIZED_TOLERANCE, trades_accuracy=True))
    # fp8 P·V wherever fp8 runs: what "lowvram 8-bit" runs on sm89+ GPUs but sm90 with Gluon, kept as a choice there
    # (faster than the fp16 P·V loop and less exact: docs/benchmarks.md)
    register_backend(AttentionBackend("int8_pvfp8", "lowvram 8-bit, fp8 P·V", _int8_with("fp8"), _int8_fp8_pv_reason,
                                      tolerance=QUANTIZED_TOLERANCE, trades_accuracy=True))
    # fp16 P·V, auto's own 8-bit candidate where its Gluon loop runs: at most comfy-kitchen int8's error on every test
    # family, and faster than cuDNN on long self-attention there (docs/benchmarks.md)
    register_backend(AttentionBackend("int8_pv16", "lowvram 8-bit, fp16 P·V", _int8_with("fp16"), _int8_gluon_reason,
                                      tolerance=QUANTIZED_TOLERANCE, trades_accuracy=True))
    from .int8_comfy_kitchen import SOL_ATTN_LABEL  # a constant; comfy-kitchen itself is imported on first use

    register_backend(AttentionBackend("ck_int8", "comfy-kitchen int8", _kitchen_int8, _kitchen_reason(False),
                                      tolerance=QUANTIZED_TOLERANCE, trades_accuracy=True))
    register_backend(AttentionBackend("ck_sol", SOL_ATTN_LABEL, _kitchen_sol, _kitchen_reason(True),
                                      tolerance=APPROXIMATE_TOLERANCE, trades_accuracy=True))


_register_builtin()

# Fallback order when the requested backend cannot run: usually fastest kinds first, the always-working SDPA
# dispatch last. `auto` measures instead of trusting this order.
FALLBACK_ORDER: tuple[str, ...] = (
    "sdpa_cudnn", "flash_attn3", "flash_attn2", "sdpa_flash", "sage", "xformers", "sdpa_efficient", "sdpa",
    "sdpa_math",
)
# Exact candidates `auto` times (quantized ones: AUTO_QUANTIZED below), math is only a reference.
AUTO_CANDIDATES: tuple[str, ...] = (
    "sdpa_cudnn", "flash_attn3", "flash_attn2", "sdpa_flash", "xformers", "sdpa_efficient", "sdpa",
)
# Quantized candidates `auto` also times, each kept only where faster than the fastest exact one: comfy-kitchen's
# INT8 attention, the 8-bit kernel ComfyUI itself ships (where it is installed, MIN_VERSION or newer), and the pack's
# 8-bit kernel with fp16 P·V where its warp-specialized loop runs (at most comfy-kitchen's error: the same bar).
AUTO_QUANTIZED: tuple[str, ...] = ("ck_int8", "int8_pv16")


def auto_quantized() -> list[str]:
    """The AUTO_QUANTIZED backends whose library is installed (a missing one is no candidate, said once)."""
    from . import int8_comfy_kitchen

    return [name for name in AUTO_QUANTIZED if not name.startswith("ck_") or int8_comfy_kitchen.module() is not None]


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
