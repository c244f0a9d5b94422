"""Doctor node: the tools.doctor report inside ComfyUI, shown on the node and returned as a STRING."""

from __future__ import annotations

import sys

from comfy_api.latest import io, ui

from ..doctor import report as doctor, host as doctor_host
from ..host.common import CATEGORY_UTILS, display_name, node_id
from ..host.seams import seam_status
from ..host.version import comfyui_version


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
    block_swap = sys.modules.get(f"{__package__}.block_swap")
    return None if block_swap is None else block_swap.measured_verdicts()


class Doctor(io.ComfyNode):
    """Checks versions, GPU, working fp8/attention paths and recommends settings for this machine.

    Declares no seams: it must stay available on any ComfyUI to report which seams are missing.
    """

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=node_id("Doctor"),
            display_name=display_name("Doctor"),
            category=CATEGORY_UTILS,
            description="Report versions, GPU, which fp8 matmul and attention paths really work here, known-bad "
                        "version combinations, and recommended fp8 / attention / block-swap settings.",
            inputs=[
                io.Boolean.Input("gpu_probes", default=True,
                                 tooltip="Run tiny fp8 matmul, attention and pinned-copy tests on the GPU "
                                         "(well under a second). Off: report versions and hardware only."),
                io.Boolean.Input("run_selftest", default=False, optional=True,
                                 tooltip="Also run every pack node next to its stock ComfyUI equivalent on tiny "
                                         "synthetic models in this server (about a minute; more on a CPU) and "
                                         "list PASS / FAIL / SKIP per node (python -m comfyui_lowvram_dit "
                                         "selftest does the same from a shell)."),
            ],
            outputs=[io.String.Output(display_name="report", tooltip="The report as text.")],
            is_output_node=True,
        )

    @classmethod
    def fingerprint_inputs(cls, gpu_probes: bool = True, run_selftest: bool = False) -> float:
        return float("nan")  # NaN never equals itself: re-run every time (free VRAM, loaded libraries change)

    @classmethod
    def execute(cls, gpu_probes: bool = True, run_selftest: bool = False) -> io.NodeOutput:
        version, host = comfyui_host_info()
        report = doctor.collect(comfyui_version=version, gpu_probes=gpu_probes, host=host, seams=seam_status(),
                                swap_measured=block_swap_verdicts())
        text = doctor.format_report(report)
        if run_selftest:
            text += "\n\n" + selftest_report()
        return io.NodeOutput(text, ui=ui.PreviewText(text))


def selftest_report() -> str:
    """The selftest's verdict lines, run in this server on its device (doctor/selftest.py)."""
    from ..doctor import selftest  # imported on use only: the checks import the node modules themselves

    lines = ["Self-test (each node vs its stock ComfyUI equivalent, tiny synthetic models)"]
    verdicts = selftest.run_selftest(emit=lines.append)
    return "\n".join(lines + [selftest.summary(verdicts)])


NODES = [Doctor]
