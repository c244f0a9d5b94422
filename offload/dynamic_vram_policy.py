"""Whether Block Swap streams a model that ComfyUI's DynamicVRAM (comfy-aimdo) already manages, or steps aside.

DynamicVRAM alone renders the Wan 2.2 14B experts faster than Block Swap does (Block Swap must rebuild the model for
ComfyUI's legacy loading), but holds every loaded model's weights in RAM, where Block Swap keeps only what it streams
(docs/benchmarks.md, "How long does a whole render take?"). So ``auto`` lets DynamicVRAM manage the model where RAM
holds two models of its size (Wan 2.2's other expert) and 16 GiB besides (text encoder, VAE, the system), and
streams otherwise.
"""

from __future__ import annotations

CHOICES = ("auto", "step aside", "stream")
GIB = 1 << 30
RAM_BESIDES = 16 * GIB  # text encoder, VAE, ComfyUI and the system, beside the diffusion models' weights


def steps_aside(choice: str, ram_total: int, model_bytes: int) -> tuple[bool, str]:
    """(step aside?, why, for the log line) for a model of ``model_bytes`` on a machine of ``ram_total`` RAM bytes
    whose DynamicVRAM manages it; ``choice`` is the node's option."""
    if choice not in CHOICES:
        raise ValueError(f"Block Swap, dynamic_vram: {choice!r} is not one of {list(CHOICES)}")
    if choice == "step aside":
        return True, "dynamic_vram = step aside"
    if choice == "stream":
        return False, "dynamic_vram = stream"
    need = 2 * model_bytes + RAM_BESIDES
    ram, want = f"{ram_total / GIB:.0f} GiB", f"{need / GIB:.0f} GiB (twice this model + 16)"
    if ram_total >= need:
        return True, f"auto: this machine's {ram} of RAM holds what DynamicVRAM keeps, {want}, and it renders faster"
    return False, f"auto: this machine's {ram} of RAM is less than DynamicVRAM would keep, {want}"
