"""The RAM the pack plans by inside ComfyUI: the same numbers ComfyUI plans by where it reads a container's limit.

ComfyUI after 0.33 reads the cgroup memory limit itself (``comfy.system_memory``: ``virtual_memory_total``,
``virtual_memory_available``, ``cgroup_memory_limit``), so there the pack takes its numbers and both plan by one
figure; on older ComfyUI the pack reads the limit itself (``offload.machine_ram``), and ComfyUI still reads the
machine's RAM.
"""

from __future__ import annotations

from ..offload import machine_ram
from ..offload.machine_ram import Ram


def comfyui_reads_the_limit() -> bool:
    """Whether this ComfyUI caps its own RAM figures at a container's memory limit."""
    try:
        import comfy.system_memory as sm
    except ImportError:
        return False
    return all(callable(getattr(sm, f, None)) for f in ("virtual_memory_total", "virtual_memory_available"))


def usable_ram() -> Ram:
    """This process's RAM: ComfyUI's cgroup-aware figures where it has them, else psutil capped by the pack."""
    if not comfyui_reads_the_limit():
        return machine_ram.usable_ram()
    import comfy.system_memory as sm
    import psutil

    total, available = int(sm.virtual_memory_total()), int(sm.virtual_memory_available())
    machine = int(psutil.virtual_memory().total)
    return Ram(total, available, total < machine, max(machine, total))
