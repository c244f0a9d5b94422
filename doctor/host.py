"""The running ComfyUI's engine settings that change what the pack's nodes meet, as Doctor report lines.

The Comfy Compiler (allocation-graph recording; the pack's block chain and attention step outside it), CUDA
graphs, the ``--fast`` options (``fp16_accumulation`` routes Wan's FFN around a layer's forward; the pack's fp8
layers opt out) and the pinned-memory account (Block Swap's arena is counted in it). Read from objects the caller
passes (``comfy.cli_args.args``, ``comfy.model_management`` ...), so older ComfyUIs and tests work alike: a setting
this ComfyUI does not have reads "not in this ComfyUI". Plain Python, no ComfyUI import.
"""

from __future__ import annotations

from typing import Any

MISSING = "not in this ComfyUI"
GIB = float(1 << 30)


def compiler_setting(args: Any, prefetch: Any, device: Any) -> str:
    """Whether the Comfy Compiler records allocation graphs here, and what decides it."""
    if not hasattr(args, "disable_comfy_compiler"):
        return MISSING
    if args.disable_comfy_compiler:
        return "off (--disable-comfy-compiler)"
    enabled = getattr(prefetch, "malloc_graph_enabled", None)
    if not callable(enabled):
        return "on unless DynamicVRAM is off or the device is not CUDA"
    try:
        on = bool(enabled(device))
    except Exception as exc:  # noqa: BLE001 - a report line, never an error
        return f"unknown ({type(exc).__name__}: {exc})"
    return ("on (models that opt in record their allocations; the pack's block chain and attention pause it)"
            if on else "off (needs DynamicVRAM on a CUDA device)")


def cuda_graphs_setting(args: Any) -> str:
    """ComfyUI's own CUDA graphs (``--disable-cuda-graphs``; the compiler's switch turns them off too)."""
    if not hasattr(args, "disable_cuda_graphs"):
        return MISSING
    if getattr(args, "disable_comfy_compiler", False):
        return "off (--disable-comfy-compiler)"
    if args.disable_cuda_graphs:
        return "off (--disable-cuda-graphs)"
    return "allowed (models that opt in, DynamicVRAM patchers only)"


def fast_setting(args: Any, fp16_accumulation_now: bool | None = None) -> str:
    """The ``--fast`` options that are on (plain ``--fast`` turns on every one)."""
    if not hasattr(args, "fast"):
        return MISSING
    names = sorted(str(getattr(f, "value", f)) for f in (args.fast or ()))
    text = ", ".join(names) if names else "none"
    if "fp16_accumulation" in names or fp16_accumulation_now:
        text += "; fp16 accumulation on (the pack's fp8 layers opt out of ComfyUI's fp16 GEMM)"
    return text


def pinned_setting(args: Any, mm: Any, pack_bytes: int = 0) -> str:
    """ComfyUI's pinned-memory cap, what is pinned now, and how much of it is Block Swap's arenas."""
    cap, total = getattr(mm, "MAX_PINNED_MEMORY", None), getattr(mm, "TOTAL_PINNED_MEMORY", None)
    if not isinstance(cap, (int, float)) or not isinstance(total, (int, float)):
        return MISSING
    if getattr(args, "disable_pinned_memory", False):
        return "off (--disable-pinned-memory; Block Swap's arena stays pageable)"
    if cap <= 0:
        return "off (no CUDA / ROCm device)"
    return (f"cap {cap / GIB:.1f} GiB, {total / GIB:.2f} GiB pinned now "
            f"({pack_bytes / GIB:.2f} GiB of it Block Swap arenas)")


def engine_settings(args: Any, mm: Any, prefetch: Any = None, device: Any = None,
                    pack_pinned_bytes: int = 0, fp16_accumulation_now: bool | None = None) -> dict[str, str]:
    """Doctor ``host`` lines for the compiler, CUDA graphs, ``--fast`` and pinned memory."""
    graph_breaks = "on" if getattr(args, "assert_graph_breaks", False) else "off"
    return {
        "comfy_compiler": compiler_setting(args, prefetch, device),
        "cuda_graphs": cuda_graphs_setting(args),
        "assert_graph_breaks": graph_breaks if hasattr(args, "assert_graph_breaks") else MISSING,
        "fast": fast_setting(args, fp16_accumulation_now),
        "pinned_memory": pinned_setting(args, mm, pack_pinned_bytes),
        "fast_disk": ("on" if args.fast_disk else "off") if hasattr(args, "fast_disk") else MISSING,
    }
