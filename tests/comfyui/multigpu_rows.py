"""The rows of test_multigpu_cuda.py: each pack node (and native) samples on one GPU, then under ComfyUI's MultiGPU CFG
split over two, and the final latents are compared.

Each row runs in a fresh process (this file with ``--child``), so ComfyUI's launch flags and loaded models never leak
between rows; a 1-step run before each makes the first-call choices, so the compared runs are warm.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch


ROWS: dict[str, str] = {
    "native_best": "UNETLoader fp8_e4m3fn_fast + --use-ck-attention",
    "native_default": "UNETLoader default",
    "pack_fp8": "Wan Loader fp8 per-tensor",
    "pack_fp8_blockwise": "Wan Loader fp8 block-wise",
    "pack_attn_auto": "Wan Loader fp8 per-tensor + Attention auto",
    "pack_attn_cudnn": "Wan Loader fp8 per-tensor + Attention SDPA cuDNN",
    "pack_int8": "Wan Loader fp8 per-tensor + Attention lowvram 8-bit",
    "pack_nan_guard": "Wan Loader fp8 per-tensor + NaN Guard",
    "pack_block_swap": "Wan Loader fp8 per-tensor + Block Swap (4 blocks)",
    "pack_stack": "Wan Loader fp8 per-tensor + Attention lowvram 8-bit + Torch Compile",
    "pack_stack_dynamic": "Wan Loader fp8 per-tensor + Attention lowvram 8-bit + Torch Compile dynamic=true",
    "pack_lora": "Wan Loader fp8 per-tensor + stock LoraLoaderModelOnly (rank 64, every block Linear)",
    "qwen_native": "Qwen-Image UNETLoader default",
    "qwen_staged": "Qwen-Image Staged transformer (fp8, Block Swap budget 0) + Attention auto",
}
QWEN_SIZE = (1024, 1024)  # Qwen-Image rows sample one 1024x1024 image (4-D latent, as EmptySD3LatentImage gives)
CK_ROWS = ("native_best",)


def _import_comfy(ck: bool) -> None:
    root = os.environ["COMFYUI_PATH"]
    if root not in sys.path:
        sys.path.insert(0, root)
    from comfy.cli_args import args

    args.use_ck_attention = ck  # read when comfy.ldm.modules.attention is imported


def _with_lora(model: Any) -> Any:
    """The stock LoRA loader (``comfy.sd.load_lora_for_models``) with a full-rank synthetic lightx2v LoRA."""
    import comfy.sd

    from comfyui_lowvram_dit.synthetic.lora import FULL_RANK, synthetic_lora

    lora = synthetic_lora("wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors", "full", FULL_RANK)
    return comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0.0)[0]


def _loaders(path: str, qwen_path: str) -> dict[str, Callable[[], Any]]:
    import comfy.sd

    from comfyui_lowvram_dit.kernels.compile import CompileConfig
    from comfyui_lowvram_dit.offload.plan import SwapConfig
    from comfyui_lowvram_dit.host.attention import apply_attention
    from comfyui_lowvram_dit.host.block_swap import apply_block_swap
    from comfyui_lowvram_dit.host.torch_compile import apply_compile
    from comfyui_lowvram_dit.host.nan_guard import apply_nan_guard
    from comfyui_lowvram_dit.host.qwen_stages import load_staged_model
    from comfyui_lowvram_dit.host.wan_loader import load_wan_model

    def fp8() -> Any:
        return load_wan_model(path, "per_tensor", 128, "auto")

    return {
        "native_best": lambda: comfy.sd.load_diffusion_model(
            path, model_options={"dtype": torch.float8_e4m3fn, "fp8_optimizations": True}),
        "native_default": lambda: comfy.sd.load_diffusion_model(path),
        "pack_fp8": fp8,
        "pack_fp8_blockwise": lambda: load_wan_model(path, "blockwise", 128, "auto"),
        "pack_attn_auto": lambda: apply_attention(fp8(), "auto"),
        "pack_attn_cudnn": lambda: apply_attention(fp8(), "SDPA cuDNN"),
        "pack_int8": lambda: apply_attention(fp8(), "lowvram 8-bit"),
        "pack_nan_guard": lambda: apply_nan_guard(fp8(), "warn"),
        "pack_block_swap": lambda: apply_block_swap(fp8(), SwapConfig(blocks_to_swap=4)),
        "pack_stack": lambda: apply_compile(apply_attention(fp8(), "lowvram 8-bit"), CompileConfig()),
        "pack_stack_dynamic": lambda: apply_compile(apply_attention(fp8(), "lowvram 8-bit"),
                                                    CompileConfig(dynamic=True)),
        "pack_lora": lambda: _with_lora(fp8()),
        "qwen_native": lambda: comfy.sd.load_diffusion_model(qwen_path),
        "qwen_staged": lambda: apply_attention(load_staged_model(qwen_path, "per_tensor")[0], "auto"),
    }


def _conds(seed: int = 1, tokens: int = 512, width: int = 4096) -> tuple[list, list]:
    g = torch.Generator().manual_seed(seed)
    return ([[torch.randn(1, tokens, width, generator=g) * 0.2, {}]],
            [[torch.randn(1, tokens, width, generator=g) * 0.2, {}]])


def sample_timed(model: Any, frames: int, height: int, width: int, steps: int, cfg: float,
                 start: int | None = None, last: int | None = None, latent: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, list[float]]:
    """``comfy.sample.sample`` (euler, simple) on a Wan 2.2 14B latent; returns it and each step's seconds."""
    import comfy.sample

    if latent is None:
        latent = torch.zeros(1, 16, (frames - 1) // 4 + 1, height // 8, width // 8)
    pos, neg = _conds() if latent.ndim == 5 else _conds(tokens=128, width=3584)  # Wan's umT5 / Qwen2.5-VL
    if latent.ndim == 4:  # as KSampler's fix_empty_latent_channels: Qwen-Image's latent format has t = 1
        latent = latent.unsqueeze(2)
    noise = comfy.sample.prepare_noise(latent, 0)
    marks: list[float] = []

    def tick(*_: Any) -> None:
        torch.cuda.synchronize()
        marks.append(time.perf_counter())

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = comfy.sample.sample(model, noise, steps, cfg, "euler", "simple", pos, neg, latent, seed=0,
                              callback=tick, disable_pbar=True, start_step=start, last_step=last,
                              disable_noise=start not in (None, 0), force_full_denoise=last is None)
    stamps = [t0, *marks]
    return out.float().cpu(), [b - a for a, b in zip(stamps, stamps[1:])]


def _median_after_first(times: list[float]) -> float | None:
    rest = sorted(times[1:])
    return rest[len(rest) // 2] if rest else None


def child(row: str, args: argparse.Namespace) -> dict:
    """One row in this process: one GPU, then the split; latents compared, steps timed."""
    _import_comfy(row in CK_ROWS)
    import comfy.model_management as mm
    import comfy.multigpu

    shape = (args.frames, args.height, args.width, args.steps, args.cfg)
    warm = (args.frames, args.height, args.width, 1, args.cfg)  # first calls: kernel choices, compiles, autotune
    latent = None
    if row.startswith("qwen_"):
        latent = torch.zeros(1, 16, QWEN_SIZE[1] // 8, QWEN_SIZE[0] // 8)
    model = _loaders(args.model, args.model_qwen)[row]()
    sample_timed(model, *warm, latent=latent)
    alone, t_alone = sample_timed(model, *shape, latent=latent)
    split = comfy.multigpu.create_multigpu_deepclones(model, 2, reuse_loaded=True)
    sample_timed(split, *warm, latent=latent)
    together, t_split = sample_timed(split, *shape, latent=latent)
    again = sample_timed(split, *shape, latent=latent)[0] if args.repeat else together
    mm.unload_all_models()
    one, two = _median_after_first(t_alone), _median_after_first(t_split)
    return {"row": row, "graph": ROWS[row], "s_per_step_1gpu": one, "s_per_step_split": two,
            "speedup": one / two if one and two else None, "steps_1gpu": t_alone, "steps_split": t_split,
            "split_vs_1gpu_rel": float((together - alone).norm() / alone.norm()),
            "split_repeat_rel": float((again - together).norm() / together.norm()) if args.repeat else None,
            "identical": bool(torch.equal(together, alone))}


def _ensure_model(path: Path, layers: int, seed: int, model: str = "wan22_t2v_14B") -> None:
    from comfyui_lowvram_dit.synthetic.checkpoints import write_synthetic

    if not path.exists():
        write_synthetic(model, path, size="full", fmt="bf16", device="cuda", num_layers=layers, seed=seed)


def _run_child(row: str, argv: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", row, *argv], capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"row": row, "error": f"rc {proc.returncode}", "stderr_tail": proc.stderr[-3000:]}


def run(rows: list[str], work: Path, layers: int, steps: int, repeat: bool) -> dict[str, dict]:
    """Each row in its own process on a ``layers``-block Wan 2.2 14B (and Qwen-Image) written into ``work``,
    832x480x81 at cfg 3.5; row name -> its record (``error`` when the child failed)."""
    model, qwen = work / f"wan22_14b_high_{layers}l.safetensors", work / f"qwen_image_{layers}l.safetensors"
    _ensure_model(model, layers, 0)
    if any(row.startswith("qwen_") for row in rows):
        _ensure_model(qwen, layers, 2, "qwen_image")
    shared = ["--layers", str(layers), "--steps", str(steps), "--model", str(model), "--model-qwen", str(qwen),
              *(["--repeat"] if repeat else [])]
    return {row: _run_child(row, shared) for row in rows}


def main(argv: list[str]) -> int:
    """``--child ROW ...``: one row in this process, its record printed as ``RESULT <json>``."""
    p = argparse.ArgumentParser()
    p.add_argument("--child", required=True)
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--cfg", type=float, default=3.5)
    p.add_argument("--repeat", action="store_true", help="sample the split twice and compare the two")
    p.add_argument("--model", required=True)
    p.add_argument("--model-qwen", required=True)
    args = p.parse_args(argv)
    print("RESULT " + json.dumps(child(args.child, args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


