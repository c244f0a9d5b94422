"""When the pack's fp8 layers compute in int8 (by GPU), and which int8 GEMM runs each shape (timed once).

Compute modes (``Compute``): "auto" picks by CUDA compute capability: 7.5 up to (not including) 8.9, the GPUs with
int8 but no fp8 tensor cores (RTX 20xx/30xx, A-series), run int8 W8A8 (kernels/int8.py); 8.9 and newer keep fp8
matmul; anything else (CPU, older or non-NVIDIA GPUs) is left to kernels/fp8.py's choice (dequantize). "int8"
asks for int8 everywhere it can run (an error on a GPU older than 7.5; the CPU runs ``torch._int_mm``). "fp8"
and "dequantize" are kernels/fp8.py's. Which mode a device got, and why, is logged once per device.

GEMMs: where both ``torch._int_mm`` (cuBLASLt, epilogue in torch) and the fused Triton GEMM run, the first call of
each shape times both on its real input and keeps the faster, keyed by the kind of GPU and the rows per batch
sample, as kernels/fp8_choice.py does (integer sums are exact, so the choice changes speed only). Where
comfy-kitchen (>= 0.2.40, kernels/int8_comfy_kitchen.py) is installed, its ``int8_linear`` on the same weight is a
third candidate, admitted only when its error on the real input (vs a float64 product) is at most the pack's: it
quantizes the activation itself, so the rounding is its own.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Literal, get_args

import torch

from . import fp8, int8, int8_comfy_kitchen, int8_triton
from .fp8_choice import row_bucket
from .decisions import FastestPerKey, describe_kind, device_kind, samples_of

log = logging.getLogger("comfyui_lowvram_dit")

Compute = Literal["auto", "fp8", "int8", "dequantize"]
COMPUTE: tuple[str, ...] = get_args(Compute)
INT8_MIN_CAPABILITY = (7, 5)  # int8 tensor cores (Turing)
FP8_MIN_CAPABILITY = (8, 9)  # fp8 tensor cores (Ada)
ROTATE = True  # Hadamard-rotate activations and weights before int8 (needs K % 128 == 0); see kernels/int8.py

_SAID: set[tuple[str, str]] = set()  # (device, compute) already logged
KITCHEN = "comfy_kitchen"  # the GEMM name of comfy-kitchen's int8_linear
# comfy-kitchen's error may exceed the pack's by this share and still count as equal: two quantizers of one scheme
# round a few ties differently
KITCHEN_ERROR_SLACK = 0.02
KITCHEN_CHECK_ROWS = 256  # rows of the real input the error comparison runs on


def device_capability(device: torch.device | str) -> tuple[int, int] | None:
    """(major, minor) of an NVIDIA GPU, None elsewhere (the lookup tests replace to plan other GPUs)."""
    return fp8.device_capability(device)


# int comparisons in code torch.compile traces (see fp8.capability_code)
INT8_MIN_CODE, FP8_MIN_CODE = fp8.capability_code(INT8_MIN_CAPABILITY), fp8.capability_code(FP8_MIN_CAPABILITY)


def _mode(code: int, compute: str) -> str:
    """"int8", or the compute kernels/fp8.py's ``select_path`` takes, for a GPU of capability ``code``; plain int
    comparisons (traced by torch.compile when a compiled model's first call decides it)."""
    if compute != "auto":
        return compute
    return "int8" if INT8_MIN_CODE <= code < FP8_MIN_CODE else "auto"


def _named(cap: tuple[int, int] | None) -> str:
    return f"compute capability {cap[0]}.{cap[1]}" if cap else "no NVIDIA GPU"


def _why(cap: tuple[int, int] | None, compute: str, mode: str) -> str:
    """The reason ``_mode`` gave ``mode``, for the log line."""
    named = _named(cap)
    if compute != "auto":
        return "asked for"
    if mode == "int8":
        return f"{named}: int8 tensor cores but no fp8 matmul (needs 8.9)"
    if fp8.capability_code(cap) >= FP8_MIN_CODE:
        return f"{named}: fp8 tensor cores"
    return f"{named}: neither fp8 nor int8 tensor cores the pack uses"


def _check(device: torch.device, cap: tuple[int, int] | None, compute: str) -> None:
    """ValueError / RuntimeError for a ``compute`` this device cannot run."""
    if compute not in COMPUTE:
        raise ValueError(f"compute must be one of {COMPUTE}, got {compute!r}")
    if compute == "int8" and device.type == "cuda" and fp8.capability_code(cap) < INT8_MIN_CODE:
        raise RuntimeError(f"compute 'int8 matmul' needs an NVIDIA GPU with compute capability >= 7.5 (RTX 20xx "
                           f"or newer); {device} has {_named(cap)}. Set compute to 'auto' or 'dequantize'.")


def compute_mode(device: torch.device | str, compute: str = "auto") -> str:
    """"int8" where the fp8 layers on ``device`` compute in int8, else the fp8 compute to hand to
    ``fp8.select_path``; logs the choice and its reason once per device (never while torch.compile traces)."""
    dev = torch.device(device)
    cap = device_capability(dev)
    _check(dev, cap, compute)
    mode = _mode(fp8.capability_code(cap), compute)
    key = (str(dev), compute)
    if key not in _SAID and not torch.compiler.is_compiling():
        _SAID.add(key)
        why = _why(cap, compute, mode)
        what = {"int8": int8.describe(), "fp8": "fp8 matmul", "dequantize": fp8.describe_path("dequantize"),
                "auto": "fp8 matmul" if why.endswith("fp8 tensor cores") else fp8.describe_path("dequantize")}[mode]
        log.info("lowvram_dit: fp8 layers on %s (compute '%s'): %s - %s", dev, compute, what, why)
    return mode


def rotate_for(in_features: int) -> bool:
    """Whether a layer of ``in_features`` inputs is rotated (ROTATE on and K a multiple of the rotation block)."""
    return ROTATE and in_features % int8.ROTATION_BLOCK == 0


class GemmChooser:
    """Per-shape choices between ``torch._int_mm`` and the Triton GEMM, made once by timing both."""

    def __init__(self) -> None:
        # a GEMM that fails is left out; with neither timed, torch._int_mm (the first) is kept
        self._fastest = FastestPerKey(self._decided, self._failed, kept_as="int8 gemm",
                                      describe_kept=self._kept)
        self.decisions: dict[tuple, str] = self._fastest.decisions  # the helper's own dicts, read directly
        self.timings: dict[tuple, dict[str, float]] = self._fastest.timings

    def choose(self, x2: torch.Tensor, samples: int, n: int,
               weight: tuple[torch.Tensor, torch.Tensor, bool] | None = None) -> str:
        """The GEMM for ``x2`` [M, K] against an [N, K] weight; ``weight`` (int8 codes, scales, rotate) lets
        comfy-kitchen's int8_linear compete (its error is checked on it)."""
        if x2.device.type != "cuda" or not int8_triton.gemm_available(x2.device):
            return "int_mm"
        m, k = x2.shape
        if not int8.int_mm_ok(m, n, k):
            return "triton"
        key = (device_kind(x2.device), row_bucket(m // max(samples, 1)), n, k)
        found = self.decisions.get(key)
        return found if found is not None else self._decide(key, x2, n, weight)

    @torch.compiler.disable
    def _decide(self, key: tuple, x2: torch.Tensor, n: int,
                weight: tuple[torch.Tensor, torch.Tensor, bool] | None = None) -> str:
        def candidates() -> dict[str, Callable[[], torch.Tensor]]:
            xq, xs = int8.quantize_activation(x2)
            wq = torch.ones((n, x2.shape[1]), dtype=torch.int8, device=x2.device)  # the speed is the same
            ws = torch.ones(n, dtype=torch.float32, device=x2.device)
            found: dict[str, Callable[[], torch.Tensor]] = {
                g: functools.partial(int8._run_gemm, g, xq, xs, wq, ws, None, x2.dtype) for g in ("int_mm", "triton")}
            if weight is not None and self._kitchen_admitted(key, x2, weight):
                found[KITCHEN] = functools.partial(int8_comfy_kitchen.int8_linear, x2, wq, ws, None, x2.dtype,
                                                   weight[2])
            return found

        return self._fastest.decide(key, candidates, x2.device)

    def _kitchen_admitted(self, key: tuple, x2: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor, bool]) -> bool:
        """Whether comfy-kitchen's int8_linear may compete for ``key``: installed, and its error on the first
        KITCHEN_CHECK_ROWS rows of the real input at most the pack's (within KITCHEN_ERROR_SLACK); logs why not."""
        if int8_comfy_kitchen.module() is None:
            return False
        try:
            ours, theirs = kitchen_errors(x2[:KITCHEN_CHECK_ROWS], *weight)
        except (RuntimeError, ValueError, TypeError) as exc:  # an input comfy-kitchen refuses: no candidate
            log.info("lowvram_dit int8: comfy-kitchen's int8_linear failed for %s (%s)", self.describe(key), exc)
            return False
        if theirs <= ours * (1 + KITCHEN_ERROR_SLACK):
            return True
        log.info("lowvram_dit int8 %s: comfy-kitchen's int8_linear is not timed, its error %.2f %% is above the "
                 "pack's %.2f %%", self.describe(key), 100 * theirs, 100 * ours)
        return False

    def _decided(self, key: tuple, best: str, times: dict[str, float]) -> str:
        timed = ", ".join(f"{g} {t:.2f} ms" for g, t in times.items())
        return f"lowvram_dit int8 {self.describe(key)}: {timed} -> {best}"

    def _kept(self, key: tuple, best: str) -> str:
        return f"lowvram_dit int8 {self.describe(key)}: {best} (kept from an earlier run)"

    def _failed(self, key: tuple, name: str, exc: Exception) -> str:
        return f"lowvram_dit int8: {name} failed for {self.describe(key)} ({exc})"

    @staticmethod
    def describe(key: tuple) -> str:
        """A decision key as a log phrase."""
        kind, rows, n, k = key
        return f"linear {k}->{n} at <= {rows} rows per sample ({describe_kind(kind)})"

    def clear(self) -> None:
        """Forget every choice."""
        self._fastest.clear()


def kitchen_errors(x2: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor,
                   rotate: bool) -> tuple[float, float]:
    """(the pack's, comfy-kitchen's) relative error of one int8 linear on ``x2`` vs the float64 product with the
    dequantized weight: only the activation quantization differs between the two."""
    x64 = int8.rotate_blocks(x2).double() if rotate else x2.double()
    ref = x64 @ (weight_q.double() * weight_scale.double().reshape(-1, 1)).t()

    def error(out: torch.Tensor) -> float:
        return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))

    ours = int8.int8_linear(x2, weight_q, weight_scale, None, out_dtype=torch.float32, rotate=rotate)
    theirs = int8_comfy_kitchen.int8_linear(x2, weight_q, weight_scale, None, torch.float32, rotate)
    return error(ours), error(theirs)


GEMMS = GemmChooser()


def linear(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
           rotate: bool) -> torch.Tensor:
    """``int8.int8_linear`` on the GEMM this shape was timed to run fastest with (output in x's dtype)."""
    gemm = GEMMS.choose(x.reshape(-1, x.shape[-1]), samples_of(x), weight_q.shape[0], (weight_q, weight_scale, rotate))
    if gemm == KITCHEN:
        out_dtype = x.dtype if x.dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.bfloat16
        b = bias.to(out_dtype) if bias is not None else None
        return int8_comfy_kitchen.int8_linear(x, weight_q, weight_scale, b, out_dtype, rotate)
    return int8.int8_linear(x, weight_q, weight_scale, bias, gemm=gemm, rotate=rotate)
