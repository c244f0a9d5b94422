"""Block Swap's once-per-load verdict (offload/verdict.py) checked against independent timings on a GPU.

Run on the GPU box from the repo root (about 2 minutes on an H100, ~16 GB of GPU memory, ~30 GB of RAM):
    python -m comfyui_lowvram_dit.benchmarks.check_swap_verdict --out-dir $OUT
    python -m comfyui_lowvram_dit.benchmarks.check_swap_verdict --smoke --out-dir DIR   # CPU, tiny: plumbing only
No ComfyUI: 20 Wan-14B-sized blocks (d 5120, FFN 13824, 40 heads, 512 context tokens; fp8 weights cast to bf16 per
call, or bf16 weights), streamed by offload/engine.py's BlockStreamer through its StreamHook as the Block Swap
node does (the first forward untimed, the next two timed with CUDA events, handed over once). Per regime (tokens,
source dtype, streamed blocks, prefetch) it prints the verdict line the node would log and checks it against:
- the same blocks all resident (median forward) and the streamed run's untimed forwards after the timed ones: the
  verdict's stall per call must explain streamed - resident (within max(2 ms, 5 % of resident, 25 % of the stall,
  two copies));
- one block's bytes copied alone from pinned RAM: the verdict's copy per block within 0.7-1.5x of it;
- resident forward / blocks: the verdict's compute per streamed block within 0.8-1.25x of it;
- torch.cuda.set_sync_debug_mode("error") around the timed forwards and the hand-over: no CPU sync.
Writes check_swap_verdict.json and .md to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from comfyui_lowvram_dit.benchmarks import harness
from comfyui_lowvram_dit.offload import engine as offload
from comfyui_lowvram_dit.offload.engine import BlockStreamer, StreamHook
from comfyui_lowvram_dit.offload.plan import SwapConfig, plan_swap
from comfyui_lowvram_dit.offload.verdict import StreamStats, SwapSetup, SwapVerdict, swap_verdict
from comfyui_lowvram_dit.checkpoints.safe_write import write_report

FULL = {"d": 5120, "ffn": 13824, "heads": 40, "ctx": 512, "blocks": 20}
SMOKE = {"d": 64, "ffn": 128, "heads": 2, "ctx": 8, "blocks": 6}
# (name, source dtype, tokens, streamed blocks, prefetch); 32760 tokens = Wan 14B at 832x480x81
REGIMES = [
    ("fp8, 32760 tokens (480p/81), 18 of 20 streamed", "fp8", 32760, 18, 1),
    ("fp8, 4096 tokens, 18 of 20 streamed", "fp8", 4096, 18, 1),
    ("fp8, 4096 tokens, 6 of 20 streamed, prefetch 2", "fp8", 4096, 6, 2),
    ("bf16, 8192 tokens, 18 of 20 streamed", "bf16", 8192, 18, 1),
]
SMOKE_REGIMES = [("fp8 smoke", "fp8", 16, 3, 1), ("bf16 smoke", "bf16", 16, 3, 2)]


class Block(torch.nn.Module):
    """A Wan-like block: self-attention, cross-attention and GELU FFN; weights cast to bf16 per call."""

    def __init__(self, d: int, ffn: int, heads: int, dtype: torch.dtype, device: torch.device,
                 gen: torch.Generator) -> None:
        super().__init__()
        self.heads = heads

        def weight(n_out: int, n_in: int) -> torch.nn.Parameter:
            w = torch.randn(n_out, n_in, device=device, generator=gen, dtype=torch.bfloat16) * n_in**-0.5
            return torch.nn.Parameter(w.to(dtype), requires_grad=False)

        self.q, self.k, self.v, self.o = (weight(d, d) for _ in range(4))
        self.cq, self.ck, self.cv, self.co = (weight(d, d) for _ in range(4))
        self.up, self.down = weight(ffn, d), weight(d, ffn)

    def _attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        def split(t: torch.Tensor) -> torch.Tensor:
            return t.unflatten(-1, (self.heads, -1)).transpose(1, 2)

        return F.scaled_dot_product_attention(split(q), split(k), split(v)).transpose(1, 2).flatten(2)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        def lin(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return t @ w.to(t.dtype).t()

        x = x + lin(self._attn(lin(x, self.q), lin(x, self.k), lin(x, self.v)), self.o)
        x = x + lin(self._attn(lin(x, self.cq), lin(ctx, self.ck), lin(ctx, self.cv)), self.co)
        return x + lin(F.gelu(lin(x, self.up), approximate="tanh"), self.down)


class Owner:
    """What the Block Swap node is to the StreamHook: the streamer, and a sink for the timed forwards."""

    debug = False

    def __init__(self, st: BlockStreamer) -> None:
        self.st = st
        self.forwards = 0
        self.handed: list[list[StreamStats]] = []
        self.handed_at: list[int] = []  # the forward whose end handed them over

    def block_streamer(self) -> BlockStreamer:
        return self.st

    def forward_streamer(self) -> BlockStreamer:
        self.forwards += 1  # asked once at the start of every forward
        return self.st

    def oom_advice(self, message: str) -> str:
        return message

    def swap_measured(self, calls: list[StreamStats]) -> None:
        self.handed.append(calls)
        self.handed_at.append(self.forwards)


def forward(blocks: list[Block], x: torch.Tensor, ctx: torch.Tensor, hook: StreamHook | None = None) -> torch.Tensor:
    """One model forward; with ``hook``, through the StreamHook as host/hooks.py installs it."""
    def body() -> torch.Tensor:
        h = x
        for i, b in enumerate(blocks):
            h = hook.wrap_block(i, h, lambda a, b=b: b(a, ctx)) if hook is not None else b(h, ctx)
        return h

    with torch.no_grad():
        return hook.wrap_forward(None, body, None) if hook is not None else body()


def median_ms(fn: Any, device: torch.device, repeats: int, warmup: int) -> float:
    return statistics.median(harness.time_fn(fn, device, repeats=repeats, warmup=warmup))


def isolated_copy_ms(nbytes: int, device: torch.device) -> float | None:
    """One block's bytes copied alone from pinned RAM to the GPU (median of 5), or None on CPU."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return median_ms(lambda: dst.copy_(src, non_blocking=True), device, repeats=5, warmup=2)


def streamed_run(blocks: list[Block], x: torch.Tensor, ctx: torch.Tensor, streamed: int, prefetch: int,
                 device: torch.device, repeats: int) -> dict:
    """Stream ``streamed`` blocks: the verdict from the hook's hand-over, then the untimed median forward."""
    sizes = [offload.block_nbytes(b) for b in blocks]
    plan = plan_swap(sizes, SwapConfig(blocks_to_swap=streamed, prefetch=prefetch))
    for i, b in enumerate(blocks):
        b.to(device if i not in plan.streamed else "cpu")
    st = BlockStreamer(blocks, plan, device, pinned=device.type == "cuda")
    st.activate()
    owner = Owner(st)
    hook = StreamHook(owner)
    forward(blocks, x, ctx, hook)  # the untimed first forward of the load
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):  # two timed forwards and one more; each end queries the events (never waits)
            forward(blocks, x, ctx, hook)
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
    swapped = median_ms(lambda: forward(blocks, x, ctx, hook), device, repeats=repeats, warmup=1)
    if not owner.handed:  # never passed by the GPU during the forwards: what the node's unload does
        calls = st.take_measurement(wait=True)
        if calls:
            owner.swap_measured(calls)
    setup = SwapSetup(model="Wan14B-sized test blocks", num_blocks=len(blocks), streamed=len(plan.streamed),
                      prefetch=prefetch, pinned=st.arena is not None and st.arena.pinned,
                      block_bytes=st.streamed_bytes // max(len(plan.streamed), 1), ring_bytes=plan.ring_bytes,
                      resident_bytes=sum(s for i, s in enumerate(sizes) if i not in plan.streamed),
                      source_itemsize=st.weight_itemsize(), blocks_to_swap=streamed, pinned_option=True)
    verdict = swap_verdict(owner.handed[0] if owner.handed else [], setup)
    st.deactivate()
    for b in blocks:
        b.to("cpu")
    return {"verdict": verdict, "handovers": len(owner.handed), "handed_over_after_forward": owner.handed_at,
            "swapped_ms": swapped, "block_bytes": setup.block_bytes}


def checks(v: SwapVerdict, resident_ms: float, swapped_ms: float, copy_alone: float | None, n: int) -> dict:
    """Each check's result (None where it cannot apply, e.g. no timings on CPU)."""
    out: dict[str, bool | None] = {"stall_explains_slowdown": None, "copy_matches_isolated": None,
                                   "compute_matches_resident": None, "hidden_means_resident_speed": None}
    if v.stall_ms is None:
        return out
    slowdown = swapped_ms - resident_ms
    # the untimed forwards are timed one by one (a sync after each): the first copies of a forward then finish
    # in the gap between forwards, which back-to-back timed forwards do not have
    slack = max(2.0, 0.05 * resident_ms, 0.25 * v.stall_ms, 2 * v.copy_ms)
    out["stall_explains_slowdown"] = abs(slowdown - v.stall_ms) <= slack
    if copy_alone:
        out["copy_matches_isolated"] = 0.7 <= v.copy_ms / copy_alone <= 1.5
    out["compute_matches_resident"] = 0.8 <= v.compute_ms / (resident_ms / n) <= 1.25
    if v.kind == "hidden":
        out["hidden_means_resident_speed"] = swapped_ms <= 1.03 * resident_ms + 1.0
    return out


def run_dtype(dtype_name: str, regimes: list[tuple], dims: dict, device: torch.device, repeats: int) -> list[dict]:
    """All regimes of one source dtype on one set of blocks (built once on the GPU)."""
    dtype = torch.float8_e4m3fn if dtype_name == "fp8" else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    blocks = [Block(dims["d"], dims["ffn"], dims["heads"], dtype, device, gen) for _ in range(dims["blocks"])]
    act = torch.bfloat16
    ctx = torch.randn(1, dims["ctx"], dims["d"], device=device, generator=gen).to(act)
    rows = []
    for name, _, tokens, streamed, prefetch in regimes:
        x = torch.randn(1, tokens, dims["d"], device=device, generator=gen).to(act)
        for b in blocks:
            b.to(device)
        resident = median_ms(lambda x=x: forward(blocks, x, ctx), device, repeats=repeats, warmup=2)
        run = streamed_run(blocks, x, ctx, streamed, prefetch, device, repeats)
        alone = isolated_copy_ms(run["block_bytes"], device)
        v: SwapVerdict = run.pop("verdict")
        rows.append({"regime": name, "tokens": tokens, "streamed": streamed, "prefetch": prefetch,
                     "resident_ms": resident, "isolated_copy_ms": alone, **run, "verdict": asdict(v),
                     "checks": checks(v, resident, run["swapped_ms"], alone, len(blocks))})
        print(f"\n[{name}] resident {resident:.1f} ms, streamed {run['swapped_ms']:.1f} ms, copy alone "
              f"{alone if alone is None else round(alone, 2)} ms\n  {v.text}\n  checks: {rows[-1]['checks']}",
              flush=True)
    return rows


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def write(out_dir: Path, env: dict, rows: list[dict]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_report((out_dir / "check_swap_verdict.json"), json.dumps({"env": env, "regimes": rows}, indent=1))
    md = ["# check_swap_verdict", ""] + [f"- {k}: {v}" for k, v in env.items()] + [
        "", "| regime | resident ms | streamed ms | verdict | copy ms / alone | compute ms/block | stall ms | checks |",
        "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        v, c = r["verdict"], r["checks"]
        bad = [k for k, ok in c.items() if ok is False]
        md.append(f"| {r['regime']} | {r['resident_ms']:.1f} | {r['swapped_ms']:.1f} | {v['kind']} | "
                  f"{_fmt(v['copy_ms'])} / {_fmt(r['isolated_copy_ms'])} | {_fmt(v['compute_ms'])} | "
                  f"{_fmt(v['stall_ms'])} | {'FAIL: ' + ', '.join(bad) if bad else 'pass'} |")
    md += ["", "Verdict lines:", ""] + [f"- {r['regime']}: {r['verdict']['text']}" for r in rows]
    write_report((out_dir / "check_swap_verdict.md"), "\n".join(md) + "\n")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=harness.RESULTS)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny blocks: the code path only (no timings)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dims, regimes = (SMOKE, SMOKE_REGIMES) if device.type == "cpu" else (FULL, REGIMES)
    env = {**harness.parent_environment(), **harness.child_environment(device)}
    rows = []
    for dtype_name in ("fp8", "bf16"):
        rows += run_dtype(dtype_name, [r for r in regimes if r[1] == dtype_name], dims, device, args.repeats)
        write(args.out_dir, env, rows)  # rewritten after each dtype: a run cut short keeps its numbers
    failed = [r["regime"] for r in rows if any(ok is False for ok in r["checks"].values())
              or r["handovers"] > 1]
    timed = any(r["verdict"]["stall_ms"] is not None for r in rows)
    print("\nFAILED: " + "; ".join(failed) if failed else
          "\nall checks passed" if timed else "\nno timings on this device (CPU): the code path ran, nothing to check",
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
