"""Eager calls launch the quantizers' Triton kernels directly; only traced calls take the registered ops, and the
check between the two must itself be traceable by Dynamo (a bool() of a dict broke fullgraph compiles)."""

from __future__ import annotations

import torch

from comfyui_lowvram_dit.kernels import fp8_triton, int8_triton


def test_eager_calls_do_not_take_the_registered_ops() -> None:
    assert fp8_triton._traced() is False


def test_the_check_traces_in_a_fullgraph_compile() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        fp8 = fp8_triton._traced()
        int8 = torch.compiler.is_compiling() and "int8_quant_rows" in int8_triton._OPS
        return x + (1 if fp8 else 0) + (2 if int8 else 0)

    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True, backend="eager")(torch.zeros(2))
    registered = fp8_triton._REGISTERED[0]
    assert torch.equal(out, torch.full((2,), (1.0 if registered else 0.0) + (2.0 if "int8_quant_rows" in
                                                                            int8_triton._OPS else 0.0)))
