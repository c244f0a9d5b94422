"""What the Doctor node adds to doctor/report.py inside ComfyUI: the running server's settings and measurements."""

from __future__ import annotations

import sys

from ..host.version import comfyui_version
from . import host as doctor_host


def comfyui_host_info() -> tuple[str | None, dict]:
    """ComfyUI's version and the settings of the running server that the report should show."""
    version = comfyui_version()
    host: dict = {}
    try:
        import comfy.model_management as mm
        from comfy.cli_args import args

        host["vram_state"] = getattr(mm.vram_state, "name", str(mm.vram_state))
        host["reserved_vram_gib"] = round(mm.extra_reserved_memory() / 2**30, 2)
        host["attention_flags"] = [f for f in ("use_sage_attention", "use_flash_attention", "use_pytorch_cross_attention",
                                               "use_split_cross_attention", "disable_xformers") if getattr(args, f, False)]
        host["disable_pinned_memory"] = bool(getattr(args, "disable_pinned_memory", False))
    except Exception as exc:  # the report must still come out if a ComfyUI internal moved
        host["error"] = f"{type(exc).__name__}: {exc}"
    host.update(comfyui_engine_settings())
    return version, host


def comfyui_engine_settings() -> dict[str, str]:
    """The running ComfyUI's compiler, CUDA-graph, ``--fast`` and pinned-memory settings (doctor/host.py)."""
    try:
        import comfy.model_management as mm
        import torch
        from comfy.cli_args import args

        from ..host.pin_budget import pinned_by_pack

        accumulate = getattr(torch.backends.cuda.matmul, "allow_fp16_accumulation", None)
        return doctor_host.engine_settings(args, mm, sys.modules.get("comfy.model_prefetch"), mm.get_torch_device(),
                                           pinned_by_pack(), accumulate)
    except Exception as exc:  # noqa: BLE001 - one missing line, never a missing report
        return {"engine_settings_error": f"{type(exc).__name__}: {exc}"}


def block_swap_verdicts() -> list[str] | None:
    """The Block Swap node's measured verdicts in this server (None when its module did not load here)."""
    # read, never imported here: a Block Swap module that failed to load must not take the Doctor with it
    block_swap = sys.modules.get(f"{__package__.rpartition('.')[0]}.host.block_swap")
    return None if block_swap is None else block_swap.measured_verdicts()


def selftest_report() -> str:
    """The selftest's verdict lines, run in this server on its device (doctor/selftest.py)."""
    from . import selftest  # imported on use only: the checks import the node modules themselves

    lines = ["Self-test (each node vs its stock ComfyUI equivalent, tiny synthetic models)"]
    verdicts = selftest.run_selftest(emit=lines.append)
    return "\n".join(lines + [selftest.summary(verdicts)])
