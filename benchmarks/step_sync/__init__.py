"""Benchmark-only ComfyUI node pack, linked into every server of the render scenario (benchmarks/server_render.py),
native rows and pack rows alike: it waits for the GPUs before each progress message (a sampler sends one per step;
tiled VAE decoding one per tile, where the sync costs both sides the same).

A sampler queues a step's kernels and returns; its progress message leaves while the GPU may still run that step,
so step times taken between messages are host times (up to about a step off on a whole GPU, where weights stay
resident and nothing else syncs). With a device sync first, each message marks the end of the step's GPU work: the
split's per-step and first-step (load) seconds become device times. The cost is one sync per step.

Nothing is imported until ComfyUI calls ``comfy_entrypoint``; the patch goes in then, once per process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

LOG_LINE = "lowvram_dit benchmark: sampler progress waits for the GPU"


def synced(update: Callable[..., Any], sync: Callable[[], None]) -> Callable[..., Any]:
    """``update`` (ProgressBar.update_absolute) calling ``sync`` first; marked so that a second wrap is skipped."""
    if getattr(update, "_lowvram_synced", False):
        return update

    def update_absolute(self, *args: Any, **kwargs: Any) -> Any:
        sync()
        return update(self, *args, **kwargs)

    update_absolute._lowvram_synced = True  # type: ignore[attr-defined]
    return update_absolute


def sync_all_cuda() -> None:
    """Wait for every CUDA device this process has used (MultiGPU rows run on several); nothing without CUDA."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


async def comfy_entrypoint():  # noqa: ANN201 - returns comfy_api.latest.ComfyExtension
    """ComfyUI V3 entry point: patches ProgressBar.update_absolute, lists no nodes."""
    import comfy.utils
    from comfy_api.latest import ComfyExtension

    comfy.utils.ProgressBar.update_absolute = synced(comfy.utils.ProgressBar.update_absolute, sync_all_cuda)
    logging.info(LOG_LINE)

    class StepSyncExtension(ComfyExtension):
        async def get_node_list(self) -> list:
            return []

    return StepSyncExtension()
