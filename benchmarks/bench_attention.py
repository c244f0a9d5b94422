"""Scenario ``attention``: every backend of kernels/attention.py at Wan 2.2 and Qwen-Image shapes (README)."""

from __future__ import annotations

import argparse
from pathlib import Path
from comfyui_lowvram_dit.checkpoints.safe_write import write_report

from comfyui_lowvram_dit.benchmarks import harness

MODULE = "comfyui_lowvram_dit.benchmarks.bench_attention"
# (B, H, Lq, Lk, D): the token counts of Wan 2.2 and Qwen-Image at these resolutions.
SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "wan14b_480p_self": (1, 40, 32760, 32760, 128),  # 832x480x81 -> 21x30x52
    "wan14b_480p_cross": (1, 40, 32760, 512, 128),  # umT5 context, 512 tokens
    "wan14b_720p_self": (1, 40, 75600, 75600, 128),  # 1280x720x81 -> 21x45x80
    "wan5b_L8190": (1, 24, 8190, 8190, 128),  # dim 3072 / 128; 5B smaller video
    "wan5b_L27280": (1, 24, 27280, 27280, 128),  # 5B 1280x704x121
    "qwen_image_1328": (1, 24, 6889 + 128, 6889 + 128, 128),  # 83x83 image patches + 128 text tokens, joint
}
SMOKE_SHAPES: dict[str, tuple[int, int, int, int, int]] = {"smoke_self": (1, 2, 256, 256, 64),
                                                           "smoke_cross": (1, 2, 256, 32, 64)}
BACKENDS = ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math", "sdpa", "flash_attn2", "flash_attn3",
            "sage", "xformers", "int8", "auto")
MATH_MAX_SCORES = 2 * 40 * 32760 * 32760  # SDPA math materialises the scores: skip it above Wan 480p size


def attention_case(ctx: harness.BenchContext, shape: list[int], backend: str, dtype: str = "bfloat16") -> dict:
    """Harness target: inputs on the device, one backend checked against fp32, then timed by the harness."""
    import torch

    from ..kernels import attention as A
    from ..kernels.attention_check import reference_attention

    b, h, lq, lk, d = shape
    dt = getattr(torch, dtype)
    if backend != "auto":
        reason = A.unavailable_reason(backend, ctx.device, dt, d)
        if reason is not None:
            return {"skipped": reason}
        if backend == "sdpa_math" and b * h * lq * lk > MATH_MAX_SCORES:
            return {"skipped": "scores matrix too large for SDPA math"}
    g = torch.Generator(device=ctx.device).manual_seed(0)
    # [B, L, H*D] projections viewed as [B, H, L, D], exactly what the Attention node hands the kernels (Wan).
    q, k, v = (torch.randn(b, n, h * d, device=ctx.device, generator=g, dtype=dt).view(b, n, h, d).transpose(1, 2)
               for n in (lq, lk, lk))
    with A.isolated_selector() as sel:
        out = sel.run(q, k, v, None, backend)
        (decision,) = sel.details.values()
    ok, rel, note = A.check_output(q, k, v, None, out)
    heads = sorted({0, h - 1})
    rows = torch.linspace(0, lq - 1, min(lq, 256), device=ctx.device).long().unique()
    ref = reference_attention(q[:1, heads][:, :, rows], k[:1, heads], v[:1, heads])
    max_abs = float((out[:1, heads][:, :, rows].float() - ref).abs().max())
    chosen = decision.backend
    metrics = {"shape": f"B{b} H{h} L{lq}/{lk} D{d}", "backend_used": A.BACKENDS[chosen].label,
               "rel_err": rel, "max_abs_err": max_abs, "finite": ok, "flop": 4.0 * b * h * lq * lk * d}
    if backend == "auto":
        metrics["auto_timings_ms"] = {A.BACKENDS[n].label: round(t, 3) for n, t in decision.timings_ms.items()}
    elif chosen != backend:
        metrics["fallback_reason"] = decision.rejected.get(backend) or decision.note or note
    call = A.BACKENDS[chosen].call
    del out
    return {"fn": lambda: call(q, k, v, None), **metrics}


def variants(shapes: dict[str, tuple[int, ...]], backends: tuple[str, ...]) -> list[harness.Variant]:
    """One variant per (shape, backend)."""
    return [harness.Variant(f"{s}/{bk}", f"{MODULE}:attention_case", {"shape": list(shape), "backend": bk})
            for s, shape in shapes.items() for bk in backends]


def summary(results: list[dict]) -> str:
    """Markdown: per shape, backends sorted by time, with TFLOP/s and error."""
    lines = ["| shape | backend | ms | TFLOP/s | rel err | max abs err | note |", "|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["name"].split("/")[0], r.get("time_ms") or 1e18)):
        m = r.get("metrics", {})
        shape, backend = r["name"].split("/")
        if r.get("status") != "ok" or "skipped" in m:
            lines.append(f"| {shape} | {backend} | - | - | - | - | {m.get('skipped') or r.get('error', '')[:120]} |")
            continue
        t = r.get("time_ms")
        tflops = m["flop"] / (t * 1e-3) / 1e12 if t else float("nan")
        note = m.get("fallback_reason", "")
        if backend == "auto":
            note = f"picked {m['backend_used']} from {m.get('auto_timings_ms')}"
        lines.append(f"| {shape} | {backend} | {t:.2f} | {tflops:.0f} | {m['rel_err']:.2e} | {m['max_abs_err']:.2e} "
                     f"| {note} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the per-shape summary."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--backends", nargs="+", choices=list(BACKENDS), default=list(BACKENDS))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--in-process", action="store_true", help="all variants in this process (faster)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--out-dir", "--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    shapes = SMOKE_SHAPES if args.smoke else {s: SHAPES[s] for s in args.shapes}
    bench = "bench_attention_smoke" if args.smoke else "bench_attention"
    if not args.smoke and (args.shapes != list(SHAPES) or args.backends != list(BACKENDS)):
        bench += "_partial"
    results = harness.run_benchmark(bench, variants(shapes, tuple(args.backends)), repeats=args.repeats,
                                    warmup=args.warmup, out_dir=args.out_dir, fresh_process=not args.in_process,
                                    force_cpu=args.smoke, argv=harness.command_argv(MODULE, argv))
    text = summary(results)
    write_report((Path(args.out_dir) / f"{bench}_summary.md"), text + "\n")
    print(text)
    return 0 if any(r.get("status") == "ok" for r in results) else 1

