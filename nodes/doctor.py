"""Doctor node: the doctor/report.py report inside ComfyUI, shown on the node and returned as a STRING."""

from __future__ import annotations

from comfy_api.latest import io, ui

from ..doctor import report as doctor
from ..doctor.comfyui_info import block_swap_verdicts, comfyui_host_info, selftest_report
from ..host.names import CATEGORY_UTILS, display_name, node_id
from ..host.seams import seam_status


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


NODES = [Doctor]
