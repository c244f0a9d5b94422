"""A Triton kernel around the int8 P·V kernel's P coding (_p_int8), for the interpreter test in test_attention_int8.py:
the log2-domain offsets x in, P and its int8 codes out."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from comfyui_lowvram_dit.kernels import attention_int8_triton as tk


@triton.jit
def _p_int8_probe(X, P, Codes, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EXP_EMU: tl.constexpr):
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    p, codes = tk._p_int8(tl.load(X + offs), BLOCK_M, BLOCK_N, EXP_EMU)
    tl.store(P + offs, p)
    tl.store(Codes + offs, codes)


def p_and_codes(x: torch.Tensor, exp_emu: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, int8 codes) of a [BLOCK_M, BLOCK_N] fp32 tile of offsets x, as _pv_int8 computes them."""
    p, codes = torch.empty_like(x), torch.empty(x.shape, dtype=torch.int8, device=x.device)
    _p_int8_probe[(1,)](x.contiguous(), p, codes, x.shape[0], x.shape[1], exp_emu)
    return p, codes
