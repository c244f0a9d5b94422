"""Whether Block Swap streams a model that ComfyUI's DynamicVRAM (comfy-aimdo) already manages, or steps aside.

DynamicVRAM alone renders the Wan 2.2 14B experts faster than Block Swap does where the machine's page cache holds
the model files (Block Swap must rebuild the model for ComfyUI's legacy loading, and reloads the expert it switches
to), and it fits its pinned memory to the machine's RAM, reading the rest from the page cache. On a machine of 32 GB
it rendered the two-expert workflow faster than Block Swap streaming, which read the other expert's streamed blocks
from the disk at every switch (docs/benchmarks.md, "On a machine with 32 GB of RAM?"). So ``auto`` lets DynamicVRAM
manage the model where RAM holds one model of its size and 16 GiB besides (text encoder, VAE, the system), and
streams on smaller machines, where nothing was measured and streaming keeps less in RAM. Inside a container the RAM is
its memory limit where that is smaller (``machine_ram``).
"""

from __future__ import annotations

from .machine_ram import Ram

CHOICES = ("auto", "step aside", "stream")
GIB = 1 << 30
RAM_BESIDES = 16 * GIB  # text encoder, VAE, ComfyUI and the system, beside the diffusion model's weights


def steps_aside(choice: str, ram: Ram, model_bytes: int) -> tuple[bool, str]:
    """(step aside?, why, for the log line) for a model of ``model_bytes`` that DynamicVRAM manages, with ``ram`` as
    this process can use it (a container's limit where smaller than the machine); ``choice`` is the node's option."""
    if choice not in CHOICES:
        raise ValueError(f"Block Swap, dynamic_vram: {choice!r} is not one of {list(CHOICES)}")
    if choice == "step aside":
        return True, "dynamic_vram = step aside"
    if choice == "stream":
        return False, "dynamic_vram = stream"
    need = model_bytes + RAM_BESIDES
    want = f"{need / GIB:.0f} GiB (this model + 16)"
    if ram.total >= need:
        return True, f"auto: {ram.label()} holds {want}, and DynamicVRAM renders faster"
    return False, f"auto: {ram.label()} is less than {want}; streaming keeps less of it"
