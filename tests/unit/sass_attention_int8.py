"""Static profile of the 8-bit attention kernel: compile it for a GPU target without a GPU, count its SASS.

A helper of tests/unit/test_attention_int8.py (the shipped tile must not spill), and the tool behind
benchmarks/results/attention_int8_profile.md (was benchmarks/sass_attention_int8.py until 3c8e1e2).

    python tests/unit/sass_attention_int8.py [--arch 90] [--config BLOCK_M BLOCK_N WARPS STAGES] ...

Needs only Triton (its bundled ptxas / nvdisasm / cuobjdump); the kernel file is loaded by path, so no torch and
no GPU. The launch is specialised the way Triton's JIT specialises the real call (16-byte aligned pointers,
16-divisible pads and strides, the output's unit stride a constant). For each config it prints the registers
per thread, shared memory, how many CTAs fit on one SM, and the instruction mix of the main loop (one 128-key
tile per iteration for each warp): MUFU (exp2), F2FP (conversions), the wgmma ops, barriers, and local-memory
traffic (spills). See benchmarks/results/attention_int8_profile.md for what it says about the H200 numbers.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

KERNEL_FILE = Path(__file__).resolve().parents[2] / "kernels" / "attention_int8_triton.py"
GLUON_FILE = KERNEL_FILE.with_name("attention_int8_gluon.py")
SAFE_WRITE_FILE = KERNEL_FILE.parents[1] / "checkpoints" / "safe_write.py"
SM_REGS, SM_SMEM, SM_WARPS = 65536, 227 * 1024, 64  # sm80/sm89/sm90 per-SM limits (sm90/sm80 smem; sm89 has 99 KB)
POINTERS = ("Q8", "QScale", "K8", "KScale", "VT", "VScale", "VMean", "Out", "Q16", "KHi", "KMean", "VSum", "VHi",
            "VHiScale")
DIV16_INTS = ("stride_ob", "stride_oh", "stride_om", "stride_qb", "stride_qh", "stride_qm", "Lq_pad", "Lk_pad")
WATCH = ("MUFU", "F2FP", "I2F", "IGMMA", "QGMMA", "HGMMA", "LDGSTS", "UTMALDG", "LDG", "LDS", "LDSM", "STS", "LDL",
         "STL", "BAR", "SYNCS", "SHFL")
GLUON_WATCH = (*WATCH, "WARPGROUP", "FFMA", "FADD", "FMUL", "FMNMX", "IADD3", "VIADD", "IMAD", "MOV")
KERNEL_WATCH = ("LDL", "STL", "USETMAXREG", "UTMALDG", "IGMMA", "HGMMA", "QGMMA", "WARPGROUP")


def _load_kernel_module(name: str = "attention_int8_triton_aot", path: Path = KERNEL_FILE):  # noqa: ANN202
    """A kernels/ file loaded by path (no torch, no package import)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_kernel(arch: int, block_m: int, block_n: int, warps: int, stages: int, qk: str = "int8",
                   pv: str = "fp16", pv_acc: int = 1, exp_emu: int = 0):  # noqa: ANN201 - triton CompiledKernel
    """Compile attn_fwd_kernel for ``sm{arch}`` with the JIT's specialisation of a real launch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _load_kernel_module().attn_fwd_kernel
    qty = "i8" if qk == "int8" else "fp8e4nv"
    sig = {"Q8": f"*{qty}", "QScale": "*fp32", "K8": f"*{qty}", "KScale": "*fp32",
           "VT": {"fp8": "*fp8e4nv", "int8": "*i8"}.get(pv, "*fp16"), "VScale": "*fp32", "VMean": "*fp32",
           "Out": "*bf16", "Q16": "*bf16", "KHi": "*bf16", "KMean": "*fp32", "VSum": "*i32", "VHi": "*fp16",
           "VHiScale": "*fp32",
           "stride_ob": "i64", "stride_oh": "i64", "stride_om": "i64", "stride_od": "constexpr",
           "stride_qb": "i64", "stride_qh": "i64", "stride_qm": "i64", "stride_qd": "constexpr",
           **{n: "i32" for n in ("H", "Lq", "Lk", "Lq_pad", "Lk_pad", "LQ_BUCKET", "LK_BUCKET", "N_HI_BLK")},
           "hi_scale": "fp32",
           **{n: "constexpr" for n in ("HEAD_DIM", "BLOCK_M", "BLOCK_N", "KBLK_", "QK_FP8", "PV_FP8", "PV_ACC",
                                        "EXP_EMU", "F32_DOT", "PV_INT8")}}
    const = {"stride_od": 1, "stride_qd": 1, "HEAD_DIM": 128, "BLOCK_M": block_m, "BLOCK_N": block_n, "KBLK_": 128,
             "QK_FP8": qk == "fp8", "PV_FP8": pv == "fp8", "PV_ACC": pv_acc, "EXP_EMU": exp_emu, "F32_DOT": False,
             "PV_INT8": pv == "int8"}
    names = fn.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in (*POINTERS, *DIV16_INTS)}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": warps, "num_stages": stages})


def compile_prologue_kernel(arch: int, name: str, block: int, tiles: int, warps: int,  # noqa: ANN201
                            dtype: str = "bf16"):
    """The prologue's ``quantize_q_kernel`` or ``quantize_k_kernel`` (int8, keys gathered) built for ``sm{arch}``
    with ``block`` tokens per tile and ``tiles`` tiles per program, for [B, L, H, D] input of ``dtype``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(_load_kernel_module(), name)
    k = name == "quantize_k_kernel"
    sig = {"X": f"*{dtype}", "Rot": f"*{dtype}", **({"MeanRot": "*fp32", "Order": "*i32"} if k else {}),
           "Out": "*i8", "Scale": "*fp32", **{n: "i32" for n in ("stride_b", "stride_h", "stride_l")},
           "stride_d": "constexpr", **{n: "i32" for n in ("H", "L", "L_pad")},
           **({} if k else {"scale_mult": "fp32"}), "eps": "fp32",
           **{n: "constexpr" for n in ("HEAD_DIM", "BLOCK", "TO_FP8", *(("GATHER",) if k else ()), "TILES")}}
    const = {"stride_d": 1, "HEAD_DIM": 128, "BLOCK": block, "TO_FP8": False, **({"GATHER": True} if k else {}),
             "TILES": tiles}
    return triton.compile(ASTSource(fn, sig, const, {}), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": warps})


def compile_gluon_kernel(arch: int = 90):  # noqa: ANN201 - triton CompiledKernel
    """attention_int8_gluon.attn_fwd_kernel built for ``sm{arch}`` as a Wan 480p call specialises it (its shipped
    block shapes, [B, L, H, D] memory); needs torch and a Triton whose Gluon has that file's API (3.6 on)."""
    import torch
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    g, d = _load_kernel_module("attention_int8_gluon_aot", GLUON_FILE), 128

    def desc(shape: tuple[int, int], dtype: torch.dtype, block: list[int]):  # noqa: ANN202
        return g._descriptor(torch.zeros(*shape, dtype=dtype), block, g._GL_DTYPES[dtype])

    ptr, out = torch.zeros(16), torch.zeros(16, dtype=torch.bfloat16)
    values = dict(q_desc=desc((512, d), torch.int8, [g.BLOCK_M // 2, d]),
                  k_desc=desc((512, d), torch.int8, [g.BLOCK_N, d]),
                  vt_desc=desc((2 * d, 256), torch.float16, [d, g.BLOCK_N]),
                  khi_desc=desc((256, d), torch.bfloat16, [g.BLOCK_N, d]),
                  QScale=ptr, KScale=ptr, VScale=ptr, VMean=ptr, KMean=ptr, Out=out, Q16=out,
                  stride_ob=40 * 32760 * d, stride_oh=d, stride_om=40 * d, stride_qb=40 * 32760 * d, stride_qh=d,
                  stride_qm=40 * d, Lq_pad=32768, Lk_pad=32768, N_HI=384,
                  **{name: 32760 for name in g.attn_fwd_kernel.do_not_specialize}, hi_scale=0.1)
    fn = g.attn_fwd_kernel
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name not in values:
            sig[name] = "constexpr"
            continue
        spec = native_specialize_impl(BaseBackend, values[name], False, True, True)[0]
        sig[name] = "i32" if name in fn.do_not_specialize else spec
        if spec.startswith("*"):
            attrs[(i, )] = [["tt.divisibility", 16]]
    const = dict(BLOCK_M=g.BLOCK_M, BLOCK_N=g.BLOCK_N, STAGES=g.STAGES)
    return triton.compile(GluonASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": 4, "maxnreg": 168})


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def main_loop_mix(sass: str, innermost: bool = False) -> tuple[int, collections.Counter]:
    """Instruction count and opcode mix of the K/V tile loop: of the backward-branch bodies, the one with the
    most 8-bit wgmmas (IGMMA / QGMMA; the 16-bit-key loop has fewer), then the longest; with ``innermost`` (the
    Gluon kernel, whose partitions sit in outer loops) the shortest body holding an 8-bit wgmma."""
    instrs: list[str] = []
    labels: dict[str, int] = {}
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?);", line)
        if m:
            instrs.append(re.sub(r"^@!?U?P\w+\s+", "", m.group(1)))
        label = re.match(r"\.(L_x_\d+):", line.strip())
        if label:
            labels[label.group(1)] = len(instrs)
    best: tuple = (0, 0, 0, -1)
    for i, ins in enumerate(instrs):
        m = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", ins)
        if m and m.group(1) in labels and labels[m.group(1)] <= i:
            lo = labels[m.group(1)]
            wgmma8 = sum(op.startswith(("IGMMA", "QGMMA")) for op in instrs[lo:i + 1])
            key = (wgmma8 > 0, lo - i) if innermost else (wgmma8, i - lo + 1)  # innermost: the shortest such body
            best = max(best, (*key, lo, i))
    lo, hi = best[2], best[3]
    return hi - lo + 1, collections.Counter(ins.split()[0].split(".")[0] for ins in instrs[lo:hi + 1])


def profile(kernel, warps: int, gluon: bool = False) -> dict:  # noqa: ANN001
    """Registers, shared memory, CTAs per SM, stack bytes (spills), the main loop's instruction mix and, over the
    whole kernel, the count of each opcode in KERNEL_WATCH of a compiled kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        _load_kernel_module("lowvram_safe_write", SAFE_WRITE_FILE).write_atomic(cubin, kernel.asm["cubin"])
        sass = subprocess.run([_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True,
                             check=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    smem = int(kernel.metadata.shared)
    ctas = min(SM_REGS // (regs * 32 * warps), SM_SMEM // max(smem, 1), SM_WARPS // warps)
    n, mix = main_loop_mix(sass, innermost=gluon)
    ops = collections.Counter(re.findall(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)", sass, re.M))
    return {"regs": regs, "shared_bytes": smem, "ctas_per_sm": ctas, "loop_instructions": n,
            "stack_bytes": int(re.search(r"STACK:(\d+)", res).group(1)),
            "loop_mix": {k: mix[k] for k in (GLUON_WATCH if gluon else WATCH) if mix[k]},
            "kernel_ops": {k: ops[k] for k in KERNEL_WATCH}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--config", type=int, nargs=4, action="append", metavar=("BM", "BN", "WARPS", "STAGES"),
                        help="tile config (repeatable); default: the autotune set")
    parser.add_argument("--qk", choices=("int8", "fp8"), default="int8")
    parser.add_argument("--pv", choices=("int8", "fp8", "fp16"), default="fp16")
    parser.add_argument("--gluon", action="store_true", help="the warp-specialized sm90 loop (attention_int8_gluon)")
    args = parser.parse_args(argv)
    import triton

    if args.gluon:  # 12 warps: the loader's warpgroup and two consumer warpgroups
        p = profile(compile_gluon_kernel(args.arch), 12, gluon=True)
        print(f"triton {triton.__version__}, sm{args.arch}, Gluon loop (int8 Q·Kᵀ, fp16 P·V): {p['regs']} registers "
              f"per thread at entry, {p['shared_bytes'] / 1024:.0f} KB shared, {p['loop_instructions']} loop "
              f"instructions per warp and tile: " + " ".join(f"{k}={v}" for k, v in p["loop_mix"].items()))
        return 0

    configs = args.config or [list(c[:4]) for c in _load_kernel_module().ATTN_CONFIGS if c[4] == 0]
    print(f"triton {triton.__version__}, sm{args.arch}, Q·Kᵀ {args.qk}, P·V {args.pv}, head dim 128")
    print("| BLOCK_M | BLOCK_N | warps | stages | regs/thread | shared KB | CTAs/SM | loop instrs/warp | loop mix |")
    print("|---|---|---|---|---|---|---|---|---|")
    for bm, bn, warps, stages in configs:
        p = profile(compile_kernel(args.arch, bm, bn, warps, stages, args.qk, args.pv), warps)
        mix = " ".join(f"{k}={v}" for k, v in p["loop_mix"].items())
        print(f"| {bm} | {bn} | {warps} | {stages} | {p['regs']} | {p['shared_bytes'] / 1024:.0f} | "
              f"{p['ctas_per_sm']} | {p['loop_instructions']} | {mix} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
