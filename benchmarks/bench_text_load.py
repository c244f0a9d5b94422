"""Qwen-Image text encoder on the CPU: our streamed load (mapped or copying reader) vs ComfyUI's own load_clip.

    COMFYUI_PATH=/path/to/ComfyUI python -m comfyui_lowvram_dit.benchmarks.bench_text_load [--layers 6] [--repeats 2]

Writes a synthetic Qwen2.5-VL encoder (full width, ``--layers`` of the 28 language layers, 2 vision layers, bf16)
once, then loads it in a fresh process per run: ``ours`` (nodes.qwen_staged.build_text_encoder_streaming, file
mapping), ``ours_copying`` (the same with ComfyUI's ``--disable-mmap`` behaviour: tensors read into RAM) and
``native`` (comfy.sd.load_clip, what CLIPLoader(type=qwen_image, device=cpu) runs), then encodes two prompts.
Per run: load seconds, encode seconds, peak RSS (ru_maxrss). Results: ``results/text_encoder_load_cpu.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from comfyui_lowvram_dit.checkpoints.safe_write import write_report

RESULTS = Path(__file__).resolve().parent / "results"
PROMPTS = ["a red fox running through fresh snow at golden hour, cinematic lighting", ""]
KINDS = ("ours", "ours_copying", "native")


def child(kind: str, te: str) -> dict:
    """One load + encode in this (fresh) process."""
    from .comfy_native import import_comfy

    import_comfy(cpu=True)
    import comfy.sd
    import torch

    from ..checkpoints import safetensors_io as checkpoint_io, text_encoders
    from ..nodes import qwen_staged

    if kind == "ours_copying":
        import comfy.utils

        comfy.utils.DISABLE_MMAP = True  # what ComfyUI's --disable-mmap sets: our readers copy into RAM
    t0 = time.perf_counter()
    with torch.inference_mode():
        if kind == "native":
            cpu = torch.device("cpu")
            cfg = text_encoders.qwen25_vl_config_from_header(checkpoint_io.read_header(te))
            clip = comfy.sd.load_clip([te], clip_type=comfy.sd.CLIPType.QWEN_IMAGE, model_options={
                "load_device": cpu, "offload_device": cpu, "qwen25_7b_model_config": cfg})
        else:
            clip = qwen_staged.build_text_encoder_streaming(te)
        t1 = time.perf_counter()
        out = [clip.encode_from_tokens_scheduled(clip.tokenize(p)) for p in PROMPTS]
    t2 = time.perf_counter()
    return {"kind": kind, "load_s": round(t1 - t0, 3), "encode_s": round(t2 - t1, 3),
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
            "embedding": list(out[0][0][0].shape)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2, help="fresh-process runs per kind (interleaved)")
    parser.add_argument("--files", type=Path, default=Path("/tmp/lowvram_dit_bench_text"))
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--child", nargs=2, metavar=("KIND", "FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    from ..synthetic import checkpoints as synth
    from ..synthetic.specs import Qwen25VLConfig

    te = args.files / f"qwen25_vl_{args.layers}l_bf16.safetensors"
    if not te.is_file():
        args.files.mkdir(parents=True, exist_ok=True)
        synth.write_synthetic("qwen25_vl_7b", te, size="full", fmt="bf16", seed=0,
                              config=Qwen25VLConfig(num_layers=args.layers, vision_layers=2))
    runs = []
    for r in range(args.repeats):
        for kind in KINDS:
            proc = subprocess.run([sys.executable, "-m", "comfyui_lowvram_dit.benchmarks.bench_text_load",
                                   "--child", kind, str(te)], capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                runs.append({"kind": kind, "error": proc.stderr.strip().splitlines()[-1:]})
                continue
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            row["repeat"] = r
            runs.append(row)
            print(row, file=sys.stderr)
    env = {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine(),
           "file_gb": round(te.stat().st_size / 1e9, 3), "layers": args.layers,
           "command": " ".join([Path(sys.executable).name, "-m", "comfyui_lowvram_dit.benchmarks.bench_text_load",
                                *(argv if argv is not None else sys.argv[1:])]),
           "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        import torch

        env["torch"] = torch.__version__
    except ImportError:
        pass
    best = {k: min((r for r in runs if r["kind"] == k and "load_s" in r), key=lambda r: r["load_s"], default=None)
            for k in KINDS}
    lines = ["# Qwen-Image text encoder load on the CPU: ours vs ComfyUI load_clip", "",
             *[f"- {k}: `{v}`" for k, v in env.items()], "",
             "| kind | best load s | vs native | encode s (2 prompts) | peak RSS GiB |", "|---|---|---|---|---|"]
    for k in KINDS:
        b = best[k]
        if b is None:
            lines.append(f"| {k} | failed | | | |")
            continue
        ratio = best["native"]["load_s"] / b["load_s"] if best["native"] else float("nan")
        lines.append(f"| {k} | {b['load_s']:.2f} | {ratio:.2f}x | {b['encode_s']:.2f} | {b['peak_rss_gib']:.2f} |")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_report((args.out_dir / "text_encoder_load_cpu.json"), json.dumps({"env": env, "runs": runs}, indent=1))
    write_report((args.out_dir / "text_encoder_load_cpu.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
