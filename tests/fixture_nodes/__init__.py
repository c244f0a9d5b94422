"""Test-only ComfyUI node pack, linked next to the real pack by ``tests/comfy_server.py``.

It gives integration tests inputs without model files (random CONDITIONING) and outputs they can
assert on through ``/history`` (tensor statistics, what a MODEL was patched with, a node that
raises). Never shipped: ``.comfyignore`` drops ``tests/``. Nothing is imported until ComfyUI
calls ``comfy_entrypoint``, so pytest can walk this folder without ComfyUI on ``sys.path``.
"""

from __future__ import annotations


async def comfy_entrypoint():  # noqa: ANN201 - returns comfy_api.latest.ComfyExtension
    """ComfyUI V3 entry point: the extension listing the fixture nodes."""
    from .fixture_nodes import make_extension

    return make_extension()
