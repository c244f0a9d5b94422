"""comfyui-lowvram-dit: Wan 2.2 and Qwen-Image on small GPUs, as native ComfyUI nodes.

ComfyUI imports this file from ``custom_nodes/<folder>`` (any folder name); ``pip install -e .``
exposes the same files as ``comfyui_lowvram_dit``. Nothing here imports ComfyUI or does work at
import time: the node classes are built when ComfyUI asks for them through ``comfy_entrypoint``.
"""

from __future__ import annotations

__version__ = "0.1.0"
PACK_ID = "comfyui-lowvram-dit"


async def comfy_entrypoint():  # noqa: ANN201 - returns comfy_api.latest.ComfyExtension
    """ComfyUI V3 entry point: returns the pack's extension (imports ComfyUI only now)."""
    from .nodes import make_extension

    return make_extension()
