"""Per-tensor fp8 linears: per-token or per-call activation scales, chosen per GEMM shape by timing both once.

On GPUs with both `torch._scaled_mm` variants (SM89/SM90) neither is faster everywhere: which cuBLASLt kernel a
shape gets decides it, and that changes with the row count and the GPU. So the first call of each shape, bucketed
by its rows per batch sample (next power of two), runs both paths on its real input, keeps the faster one and says
so once in the log; later calls of that shape look the choice up. Per-token scales are a little more accurate on
outlier tokens, per-call scales (one per batch sample, see kernels/fp8.py) cost one extra amax pass but run the
plain per-tensor GEMM. The two round differently, so the choice is keyed by the kind of GPU and the per-sample
shape and made once (kernels/decisions.py): every GPU of one kind, and a batch of one or of two, get the same.

Under torch.compile the lookup is a dict read (dynamo guards on it); a miss leaves the graph for the timing
(``torch.compiler.disable``), as the attention selector does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from . import fp8
from .decisions import FastestPerKey, describe_kind, device_kind, samples_of

CANDIDATES: tuple[str, str] = ("scaled_mm_rowwise", "scaled_mm_tensorwise")
TIME_PER_SHAPE = True  # False: keep the path select_path gave (fp8.PER_TENSOR_DEFAULT_PATH)


def row_bucket(rows: int) -> int:
    """The power of two at or above ``rows``: shapes within a factor of two share one choice."""
    return 1 << max(rows - 1, 0).bit_length()


class ScaleChooser:
    """Cached per-shape choices between per-token and per-call activation scales for per-tensor fp8 weights."""

    def __init__(self) -> None:
        # a path that raises is not chosen (cuBLASLt lacks row-wise, fast-accumulating kernels with a bias epilogue
        # for some shapes); timed choices go to the decisions file
        self._fastest = FastestPerKey(self._decided, self._failed, kept_as="fp8 scales",
                                      describe_kept=self._kept)
        # the helper's own dicts, read directly: plain str values, so dynamo guards on a hit
        self.decisions: dict[tuple, str] = self._fastest.decisions
        self.timings: dict[tuple, dict[str, float]] = self._fastest.timings

    def choose(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, path: str) -> str:
        """The path for this call: ``path`` unless it is per-token scaling and timing both says otherwise."""
        if path != CANDIDATES[0] or not TIME_PER_SHAPE or x.device.type != "cuda":
            return path
        # int(): a compiled graph specializes on it
        rows = int(x.numel() // (x.shape[-1] * samples_of(x))) if x.shape[-1] else 0
        key = (device_kind(x.device), row_bucket(rows), *weight.shape, x.dtype)
        found = self.decisions.get(key)
        return found if found is not None else self._decide(key, x, weight, weight_scale, bias)

    @torch.compiler.disable
    def _decide(self, key: tuple, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None) -> str:
        def candidates() -> dict[str, Callable[[], torch.Tensor]]:
            # time_call warms up once first: cuBLASLt picks its kernel on the first call of a shape
            return {p: functools.partial(fp8.fp8_linear, x, weight, weight_scale, bias, path=p, out_dtype=x.dtype)
                    for p in CANDIDATES}

        with torch.no_grad():  # the timed runs build no autograd graph
            return self._fastest.decide(key, candidates, x.device)

    def _decided(self, key: tuple, best: str, times: dict[str, float]) -> str:
        token, call = (f"{times[p]:.2f} ms" if p in times else "cannot run" for p in CANDIDATES)
        return (f"lowvram_dit fp8 {self.describe(key)}: per-token scales {token}, per-call scale {call} -> "
                f"{fp8.describe_path(best)}")

    def _kept(self, key: tuple, best: str) -> str:
        return f"lowvram_dit fp8 {self.describe(key)}: {fp8.describe_path(best)} (kept from an earlier run)"

    def _failed(self, key: tuple, name: str, exc: Exception) -> str:
        scales = "per-token scales" if name == CANDIDATES[0] else "the per-call scale"
        return f"lowvram_dit fp8: {scales} cannot run {self.describe(key)} ({exc}); not chosen"

    @staticmethod
    def describe(key: tuple) -> str:
        """A decision key as a log phrase: rows bucket and the weight's shape."""
        kind, rows, n, k, dtype = key
        return (f"linear {k}->{n} at <= {rows} rows per sample ({str(dtype).removeprefix('torch.')}, "
                f"{describe_kind(kind)})")

    def report(self) -> list[str]:
        """Every choice with its timings, for the Doctor and benchmarks."""
        return [f"{self.describe(k)}: {fp8.describe_path(v)} "
                + ", ".join(f"{n} {t:.2f} ms" for n, t in self.timings.get(k, {}).items())
                for k, v in self.decisions.items()]

    def clear(self) -> None:
        """Forget every choice (the next call of each shape times again)."""
        self._fastest.clear()


CHOOSER = ScaleChooser()
