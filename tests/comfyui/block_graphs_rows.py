"""The measurement of test_block_graphs_cuda.py, in a fresh process: the pack's Qwen-Image transformer (full width, a
few blocks, two of them streamed by Block Swap) sampled with its blocks replayed from CUDA graphs and again eagerly
(ComfyUI's ``--disable-cuda-graphs``, which the graphs obey), before and after a LoRA is merged into its weights, and
once more after the graphs gave their memory back.

Run as ``python block_graphs_rows.py --model FILE``; prints ``RESULT <json>``. Also a probe of the host's share of a
step: the step times of both ways are in the record.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from multigpu_rows import _import_comfy, sample_timed


def _sample(model: Any, size: tuple[int, int], steps: int) -> tuple[torch.Tensor, list[float]]:
    """``steps`` euler steps at cfg 1 on a Qwen-Image latent of ``size`` (width, height): the latent, each step's seconds."""
    return sample_timed(model, 1, size[1], size[0], steps, 1.0, latent=torch.zeros(1, 16, size[1] // 8, size[0] // 8))


def _both_ways(model: Any, size: tuple[int, int], steps: int) -> tuple[dict, torch.Tensor]:
    """Sample eagerly (twice: the first loads and decides), then with graphs (twice: the first captures); latents
    compared, steps timed, the GPU memory the graphs took (free device memory before and after them)."""
    from comfy.cli_args import args

    from comfyui_lowvram_dit.host.block_graphs import block_graphs_of

    graphs = block_graphs_of(model)
    args.disable_cuda_graphs = True
    try:
        _sample(model, size, steps)
        off, t_off = _sample(model, size, steps)
    finally:
        args.disable_cuda_graphs = False
    torch.cuda.synchronize()
    free_eager = torch.cuda.mem_get_info()[0]
    _sample(model, size, steps)
    on, t_on = _sample(model, size, steps)
    torch.cuda.synchronize()
    stats = graphs.for_model(model.model).stats() if graphs is not None else {}
    return {"stats": stats, "steps_graphs": t_on, "steps_eager": t_off,
            "graphs_vs_eager_rel": float((on - off).norm() / off.norm()), "identical": bool(torch.equal(on, off)),
            "graph_memory_gib": (free_eager - torch.cuda.mem_get_info()[0]) / 2**30,
            "allocator": torch.cuda.get_allocator_backend()}, off


def _given_back(model: Any, size: tuple[int, int], steps: int, eager: torch.Tensor) -> dict:
    """The graphs' memory given back while the weights stay (what a decode beside the model asks): what ComfyUI's
    free-memory reading gained, and a sampling after it, eager, against the eager latent."""
    from comfyui_lowvram_dit.host.block_graphs import block_graphs_of, release_block_graphs

    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    given = release_block_graphs(torch.device("cuda", torch.cuda.current_device()), [model])
    free_after = torch.cuda.mem_get_info()[0]
    after, t_after = _sample(model, size, steps)
    return {"comfyui_free_gain_gib": given / 2**30, "device_free_gain_gib": (free_after - free_before) / 2**30,
            "steps_eager_after": t_after,
            "stats_after": block_graphs_of(model).for_model(model.model).stats(),
            "vs_eager_rel": float((after - eager).norm() / eager.norm())}


class _Kept(logging.Handler):
    """The pack's log lines of the run, for the record (a failed capture's warning names its error)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "block graphs" in record.getMessage():
            self.lines.append(record.getMessage())


def child(args: argparse.Namespace) -> dict:
    kept = _Kept()
    pack_log = logging.getLogger("comfyui_lowvram_dit")
    pack_log.addHandler(kept)
    pack_log.setLevel(logging.INFO)
    _import_comfy(False)
    import comfy.sd
    import comfy.model_management as mm

    from comfyui_lowvram_dit.host.attention import apply_attention
    from comfyui_lowvram_dit.host.block_graphs import block_graphs_of
    from comfyui_lowvram_dit.host.qwen_stages import load_staged_model
    from comfyui_lowvram_dit.synthetic.lora import synthetic_lora

    size = (args.width, args.height)
    model = apply_attention(load_staged_model(args.model, "per_tensor", blocks_to_swap=args.swap)[0], "auto")
    record: dict = {}
    record["plain"], plain = _both_ways(model, size, args.steps)
    lora = synthetic_lora("Qwen-Image-Lightning-4steps-V1.0.safetensors", "full", 16)
    with_lora = comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0.0)[0]
    record["lora"], merged = _both_ways(with_lora, size, args.steps)
    record["lora_vs_plain_rel"] = float((merged - plain).norm() / plain.norm())
    record["given_back"] = _given_back(with_lora, size, args.steps, merged)
    record["log"] = kept.lines
    print("RESULT " + json.dumps(record), flush=True)
    mm.unload_all_models()  # the model leaves the GPU: its graphs are dropped (ON_DETACH)
    gc.collect()
    torch.cuda.synchronize()
    record["after_unload"] = block_graphs_of(model).for_model(model.model).stats()
    return record


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--width", type=int, default=1328)
    p.add_argument("--height", type=int, default=1328)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--swap", type=int, default=2, help="Block Swap blocks_to_swap")
    args = p.parse_args(argv)
    print("FINAL " + json.dumps(child(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main(sys.argv[1:]))
