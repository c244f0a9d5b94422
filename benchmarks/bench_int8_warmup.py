"""The 8-bit attention's first calls with and without its kernels compiled ahead (the first compiled step).

    python -m comfyui_lowvram_dit.benchmarks.bench_int8_warmup [--out-dir DIR]

Each mode runs in a fresh interpreter with empty Triton and Inductor caches (a user's first run on a machine):
- ``cold``: a torch.compile'd stand-in block (Inductor compiles it, as the first compiled sampler step does), then
  the first 8-bit attention calls at Wan 14B 832x480x81, cfg batch 2: self-attention (32,760 tokens) and
  cross-attention (512 text tokens), which compile the quantizers and autotune the main loop;
- ``ahead``: the same, but ``start_warmup`` (what the Attention node does when it selects the 8-bit kernel) starts
  first, so its compiles run in a thread while Inductor compiles the block;
- ``ahead_idle``: the warm-up alone, joined, then the calls (how long the warm-up itself takes).
Reported: wall seconds of the compile, of waiting for the warm-up, of the first attention calls, the total, and
Triton compiles during the first calls.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from comfyui_lowvram_dit.benchmarks import harness
from comfyui_lowvram_dit.checkpoints.safe_write import write_report

MODES = ("cold", "ahead", "ahead_idle")
B, H, D, L_SELF, L_TEXT = 2, 40, 128, 32_760, 512


def _block():  # noqa: ANN202 - a torch.nn.Module built after torch is imported in the child
    import torch

    class Block(torch.nn.Module):
        """A stand-in DiT block (norm, modulation, MLP, residual) for Inductor to compile."""

        def __init__(self, width: int = 5120) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(width, elementwise_affine=False)
            self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)
            self.mod = torch.nn.Parameter(torch.randn(2, width) * 0.02)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.norm(x) * (1 + self.mod[0]) + self.mod[1]
            return x + self.down(torch.nn.functional.gelu(self.up(y), approximate="tanh"))

    return Block().cuda().bfloat16()


def child(mode: str) -> dict:
    """One mode in this (fresh) process; returns its timings."""
    import torch
    import triton

    from comfyui_lowvram_dit.kernels import attention_int8 as ai

    compiled: list[str] = []
    triton.knobs.compilation.listener = (
        lambda *, src, metadata, metadata_group, times, cache_hit: compiled.append(getattr(src, "name", "?")))
    torch.cuda.init()
    t0 = time.perf_counter()
    thread = ai.start_warmup("cuda", torch.bfloat16, H, D) if mode != "cold" else None
    if mode == "ahead_idle":
        thread.join()
    t_compile = time.perf_counter()
    if mode != "ahead_idle":
        block = torch.compile(_block())
        with torch.no_grad():
            block(torch.randn(1, 4096, 5120, device="cuda", dtype=torch.bfloat16))
        torch.cuda.synchronize()
    t_wait = time.perf_counter()
    ai.wait_for_warmup()
    before, t_calls = len(compiled), time.perf_counter()
    x = torch.randn(B, L_SELF, H, D, device="cuda", dtype=torch.bfloat16)
    ctx = torch.randn(B, L_TEXT, H, D, device="cuda", dtype=torch.bfloat16)
    for k in (x, ctx):
        ai.attention_int8(x, k, k, layout="BLHD")
    torch.cuda.synchronize()
    t_end = time.perf_counter()
    return {"mode": mode, "warmup_alone_s": round(t_compile - t0, 2) if mode == "ahead_idle" else None,
            "inductor_compile_s": round(t_wait - t_compile, 2), "wait_for_warmup_s": round(t_calls - t_wait, 2),
            "first_attention_calls_s": round(t_end - t_calls, 2), "total_s": round(t_end - t0, 2),
            "triton_compiles_in_calls": len(compiled) - before, "triton_compiles_total": len(compiled),
            "configs": ai.chosen_configs()}


def run_mode(mode: str) -> dict:
    """``child(mode)`` in a fresh interpreter with empty Triton / Inductor caches."""
    with tempfile.TemporaryDirectory(prefix="int8_warmup_") as tmp:
        env = {**os.environ, "TRITON_CACHE_DIR": f"{tmp}/triton", "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor"}
        code = ("import json, sys; from comfyui_lowvram_dit.benchmarks import bench_int8_warmup as b; "
                "print('RESULT ' + json.dumps(b.child(sys.argv[1])))")
        out = subprocess.run([sys.executable, "-c", code, mode], env=env, capture_output=True, text=True,
                             timeout=600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        return {"mode": mode, "status": "error", "error": out.stderr[-2000:]}
    return {"status": "ok", **json.loads(lines[-1][len("RESULT "):])}


def markdown(rows: list[dict], env: dict) -> str:
    lines = ["# bench_int8_warmup: the 8-bit attention's kernels compiled ahead", ""]
    lines += [f"- {k}: {env.get(k)}" for k in ("device_name", "torch", "triton", "git_sha", "timestamp")]
    lines += [f"- command: `{env.get('command')}`",
              f"- first calls: self-attention B{B} H{H} L{L_SELF} D{D} and cross-attention to {L_TEXT} text tokens, "
              "bf16; fresh process and empty Triton / Inductor caches per row; the compiled block is a stand-in "
              "(LayerNorm, modulation, 5120 -> 20480 -> 5120 MLP at 4,096 tokens)", "",
              "| mode | warm-up alone s | Inductor compile s | waiting for warm-up s | first attention calls s | "
              "total s | Triton compiles in the calls |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['mode']} | error: {r.get('error', '')[-200:]!r} | | | | | |")
            continue
        lines.append(f"| {r['mode']} | {r['warmup_alone_s'] if r['warmup_alone_s'] is not None else '—'} | "
                     f"{r['inductor_compile_s']} | {r['wait_for_warmup_s']} | {r['first_attention_calls_s']} | "
                     f"{r['total_s']} | {r['triton_compiles_in_calls']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--out-dir", type=Path, default=harness.RESULTS)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_int8_warmup needs a CUDA GPU")
        return 2
    env = harness.gpu_script_environment("bench_int8_warmup", argv, torch.device("cuda"))
    rows = []
    for mode in args.modes:
        rows.append(run_mode(mode))
        print(json.dumps(rows[-1])[:600], flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / "bench_int8_warmup"
    write_report(stem.with_suffix(".json"), json.dumps({"env": env, "rows": rows}, indent=1, default=str))
    write_report(stem.with_suffix(".md"), markdown(rows, env))
    plot = harness.write_plot(stem.with_suffix(".png"), "bench_int8_warmup",
                              [{"name": r["mode"], "status": r.get("status"), "total_s": r.get("total_s")}
                               for r in rows], "total_s", env)
    print(plot or f"wrote {stem}.json, .md and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
