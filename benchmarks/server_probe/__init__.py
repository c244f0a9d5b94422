"""A benchmark-only ComfyUI node: times every model call of a sampler and profiles one with torch.profiler.

Kernel time is grouped by kind (attention, matmul, quantize/cast, norm/elementwise) by kernel name. No torch at
import: ComfyUI imports this folder as a top-level package (so it loads pack files by path).

``--kernel-profile`` of the server scenarios (benchmarks/server.py) links this folder into the server's
custom_nodes and puts the node after each expert's ModelSamplingSD3, so native and pack graphs are measured by the
same code inside the server they run in. Each call's time is taken between two CUDA synchronisations; the profiled call is slower by the profiler's
overhead and is reported apart. Results: ``<output dir>/bench_probe/<label>.json``, rewritten after every call.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

WRAPPER_KEY = "lowvram_bench_probe"
FP8_PATHS = ("default", "scaled_mm_rowwise", "scaled_mm_tensorwise")


def set_fp8_path(path: str) -> list[str]:
    """Make ``path`` the per-tensor fp8 GEMM path of every loaded copy of the pack's kernels (no per-shape timing).

    A benchmark knob (the pack has no user option for it): layers pick their path at their first forward, so this
    must run before sampling. Returns the module names it changed; "default" changes nothing.
    """
    if path == "default":
        return []
    if path not in FP8_PATHS:
        raise ValueError(f"fp8_path {path!r}: expected one of {FP8_PATHS}")
    changed = []
    for name, module in list(sys.modules.items()):
        if name.endswith("kernels.fp8") and hasattr(module, "PER_TENSOR_DEFAULT_PATH"):
            module.PER_TENSOR_DEFAULT_PATH = path
            changed.append(name)
        elif name.endswith("kernels.fp8_choice") and hasattr(module, "TIME_PER_SHAPE"):
            module.TIME_PER_SHAPE = False
            changed.append(name)
    if not changed:
        raise RuntimeError("fp8_path: the pack's kernels/fp8.py is not loaded in this server")
    return changed


def _pack_file(name: str, rel: str) -> ModuleType:
    """A plain-Python file of the pack (``rel`` from its root), loaded by path under ``name``."""
    path = Path(__file__).resolve().parents[2] / rel
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GROUPS = (  # first match wins; kernel names of cuBLAS/CUTLASS/flash/cuDNN/Triton/inductor
    ("attention", re.compile(r"flash|fmha|attn|attention|sdpa|cudnn.*(mha|sdp)", re.IGNORECASE)),
    ("matmul", re.compile(r"gemm|matmul|sm90_|sm80_|cutlass|scaled_mm|cublas|nvjet|xmma", re.IGNORECASE)),
    ("quantize/cast", re.compile(r"quant|fp8|amax|e4m3|float8|copy_|to_copy|_to_|(?<!no)cast", re.IGNORECASE)),
    ("norm/elementwise", re.compile(r"norm|elementwise|vectorized|reduce|rope|mul|add|silu|gelu|triton_", re.IGNORECASE)),
)
# Profiler rows that are not kernels: ATen ops, CUDA runtime calls, copies, and the profiler's own
# "Command Buffer Full" marker (time the host waited for room in the launch queue, not GPU work).
NOT_KERNELS = ("aten::", "cuda", "Memcpy", "Memset", "Command Buffer Full")


def group_of(kernel: str) -> str:
    """The group a kernel name falls in (see GROUPS), 'other' when none matches."""
    return next((name for name, rx in GROUPS if rx.search(kernel)), "other")


def _self_us(event: Any, device: bool) -> float:
    """Self device (or, with ``device=False``, CPU) time of a profiler row in microseconds."""
    attrs = ("self_device_time_total", "self_cuda_time_total") if device else ("self_cpu_time_total",)
    for attr in attrs:  # the device attribute was renamed in torch 2.4
        if hasattr(event, attr):
            return float(getattr(event, attr))
    return 0.0


def kernel_table(prof: Any, top: int, device: bool = True) -> dict:
    """Per-group and top-kernel milliseconds of one profiled call (GPU kernels; CPU ops with ``device=False``)."""
    rows = [(e.key, _self_us(e, device) / 1e3, e.count) for e in prof.key_averages() if _self_us(e, device) > 0]
    rows = [r for r in rows if not r[0].startswith(NOT_KERNELS)] or rows
    groups: dict[str, float] = {}
    for name, ms, _ in rows:
        groups[group_of(name)] = groups.get(group_of(name), 0.0) + ms
    rows.sort(key=lambda r: -r[1])
    return {"total_ms": round(sum(groups.values()), 1), "groups_ms": {k: round(v, 1) for k, v in groups.items()},
            "top": [{"kernel": n[:140], "ms": round(ms, 2), "calls": c, "group": group_of(n)}
                    for n, ms, c in rows[:top]]}


def make_wrapper(label: str, profile_call: int, out_path: Path, top: int = 25) -> Callable[..., Any]:
    """An APPLY_MODEL wrapper: times each call, profiles call number ``profile_call`` (0-based; -1: none)."""
    import torch

    safe_write = _pack_file("lowvram_safe_write", "checkpoints/safe_write.py")
    calls: list[float] = []
    state: dict[str, Any] = {"label": label, "call_s": calls, "profiled_call": profile_call, "profile": None}
    cuda = torch.cuda.is_available()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def wrapper(executor: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        sync()
        t0 = time.perf_counter()
        if len(calls) == profile_call:
            activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
            with torch.profiler.profile(activities=[activity]) as prof:
                out = executor(*args, **kwargs)
                sync()
            state["profile"] = {"call": profile_call, **kernel_table(prof, top, device=cuda)}
        else:
            out = executor(*args, **kwargs)
            sync()
        calls.append(round(time.perf_counter() - t0, 4))
        out_path.parent.mkdir(parents=True, exist_ok=True)
        safe_write.write_report(out_path, json.dumps(state))
        return out

    return wrapper


def drop_profiled_steps(per_node: list[dict], profiled_call: int) -> None:
    """Move each sampler's profiled step (it carries the profiler's overhead) from ``steps_s`` to ``profiled_step_s``.

    ``steps_s[i]`` is the step after progress i + 1, i.e. model call i + 1, so call ``profiled_call`` is index ``profiled_call - 1``.
    """
    for d in per_node:
        i = profiled_call - 1
        d["profiled_step_s"] = d["steps_s"][i:i + 1]
        d["steps_s"] = d["steps_s"][:i] + d["steps_s"][i + 1:]


def read_probe(folder: Path) -> dict:
    """The Kernel Profile node's files: {label: {call_s, profiled_call, profile}}; {} when it wrote none."""
    out = {}
    for path in sorted(folder.glob("*.json")):
        try:
            out[path.stem] = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            out[path.stem] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


class KernelProfile:
    """Benchmark probe: the model unchanged, with its calls timed and one of them profiled."""

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {"required": {
            "model": ("MODEL",),
            "label": ("STRING", {"default": "model"}),
            "profile_call": ("INT", {"default": 1, "min": -1, "max": 100000}),
        }, "optional": {"fp8_path": (list(FP8_PATHS), {"default": "default"})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "lowvram_dit/benchmark"

    def patch(self, model: Any, label: str, profile_call: int, fp8_path: str = "default") -> tuple[Any]:
        import comfy.patcher_extension
        import folder_paths

        set_fp8_path(fp8_path)

        out = Path(folder_paths.get_output_directory()) / "bench_probe" / f"{label}.json"
        patched = model.clone()
        patched.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, WRAPPER_KEY,
                                     make_wrapper(label, profile_call, out))
        return (patched,)


NODE_CLASS_MAPPINGS = {"LowVRAMBench_KernelProfile": KernelProfile}
NODE_DISPLAY_NAME_MAPPINGS = {"LowVRAMBench_KernelProfile": "Kernel Profile (benchmark)"}
