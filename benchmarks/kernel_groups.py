"""Kernel time of a torch.profiler run, grouped by kind (attention, matmul, quantize/cast, norm/elementwise).

Torch-free, so the server probe (benchmarks/server_probe) and the in-process profile share one grouping.
"""

from __future__ import annotations

import re
from typing import Any

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
