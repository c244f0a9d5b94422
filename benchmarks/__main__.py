"""The benchmark suite's one entry point: ``python -m comfyui_lowvram_dit.benchmarks SCENARIO [--out DIR] [options]``.

``--list`` prints the scenarios; options after the name win over the scenario's own."""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

PKG = "comfyui_lowvram_dit.benchmarks"


@dataclass(frozen=True)
class Scenario:
    """What a scenario measures, the module whose ``main(argv)`` runs it, and the arguments it starts with."""
    what: str
    module: str
    args: tuple[str, ...] = ()


SCENARIOS: dict[str, Scenario] = {
    # kernels (no ComfyUI unless said)
    "attention_int8": Scenario("the 8-bit attention kernel vs cuDNN and comfy-kitchen: time, TFLOP/s, error per "
                               "input family, kernel vs emulation (--families)", "bench_attention_int8"),
    "attention_kitchen": Scenario("the 8-bit attention (fp8 and int8 P·V) vs cuDNN and comfy-kitchen versions (each "
                                  "in its own process, --wheels DIR): error per input family, time at Wan 480p/720p "
                                  "self and cross", "bench_attention_int8", ("--kitchen",)),
    "fp8_gemm": Scenario("fp8 GEMMs of one Wan 14B block: native fp8_e4m3fn_fast vs bf16 and the pack's paths, per "
                         "activation family: time, error (--dry on the CPU)", "bench_gemm", ("fp8_gemm",)),
    "int8_gemm": Scenario("int8 W8A8 GEMMs (GPUs without fp8 matmul) at Wan 14B / Qwen-Image shapes vs bf16, native "
                          "fp8 and ours fp8: time, TFLOP/s, error, one Wan block's error (--quick, --tiny on the CPU)",
                          "bench_gemm", ("int8_gemm",)),
    # through a real ComfyUI server, one fresh server per row
    "server_render": Scenario("whole renders, Queue to output file, first-ever / warm / cold, through fresh servers: "
                              "each shipped workflow vs its native equivalent per card, split by stage",
                              "server_render"),
}


def main(argv: list[str] | None = None) -> int:
    """Run the scenario named first in ``argv`` with the rest of ``argv``; ``--list`` lists them."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("--list", "-l", "--help", "-h"):
        width = max(map(len, SCENARIOS))  # one line per scenario: what it measures, module and starting arguments
        print(__doc__.strip().splitlines()[0], "", *(f"{name:<{width}}  {s.what} [{' '.join((s.module, *s.args))}]"
                                                      for name, s in SCENARIOS.items()), sep="\n")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SCENARIOS:
        print(f"unknown scenario {name!r}; --list shows them", file=sys.stderr)
        return 2
    scenario = SCENARIOS[name]
    return importlib.import_module(f"{PKG}.{scenario.module}").main([*scenario.args, *rest])


if __name__ == "__main__":
    sys.argv[:1] = ["-m", PKG]  # results record the command as it was typed: python3 -m PKG SCENARIO ...
    sys.exit(main(sys.argv[2:]))
