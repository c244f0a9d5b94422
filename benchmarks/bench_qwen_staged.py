"""Scenario ``qwen_image``: the Qwen-Image staged pipeline vs native, per stage (README)."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from comfyui_lowvram_dit.benchmarks import harness

if TYPE_CHECKING:
    import torch

MODULE = "comfyui_lowvram_dit.benchmarks.bench_qwen_staged"
PROMPT = ("A coffee shop entrance features a chalkboard sign reading \"Qwen Coffee 2 dollars\", with a neon light "
          "beside it displaying a glowing logo; a poster of a beautiful woman hangs next to it")
NEGATIVE = " "
TEXT_TOKENS = 120  # a typical prompt's length through the Qwen-Image template


def _stage(report) -> dict:  # noqa: ANN001 - kernels.stage_meter.StageReport
    d = report.as_dict()
    name = d.pop("stage").split(" ")[1]
    return {f"s{name}_{k}": v for k, v in d.items() if k != "notes"} | {f"s{name}_notes": "; ".join(d["notes"])}


def _setup(ctx: harness.BenchContext, user_dir: str):  # noqa: ANN202
    from . import comfy_native

    comfy = comfy_native.import_comfy(cpu=ctx.device.type == "cpu")
    import folder_paths
    Path(user_dir).mkdir(parents=True, exist_ok=True)
    folder_paths.set_user_directory(user_dir)  # embedding cache lives here, not in the ComfyUI checkout
    return comfy


def _step_inputs(patcher: Any, latent: tuple[int, ...], context: torch.Tensor | None,
                 edit: bool) -> tuple[dict, dict]:
    """A seeded random latent of shape ``latent``, the timestep, ``context`` (None: random text embeddings of the
    model's width) and, for ``edit``, a reference latent; on the patcher's device, in the dtype ``_apply_model``
    casts inputs to."""
    import torch

    dev = patcher.load_device
    dtype = patcher.model.manual_cast_dtype or patcher.model.get_dtype()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(latent, generator=g).to(dev, dtype)
    if context is None:
        context = torch.randn((1, TEXT_TOKENS, patcher.model.diffusion_model.txt_in.in_features), generator=g)
    extra = {"ref_latents": [torch.randn(latent, generator=g).to(dev, dtype)]} if edit else {}
    return {"x": x, "timestep": torch.full((1,), 0.5, device=dev), "context": context.to(dev, dtype)}, extra


def _placed_forward(patcher: Any, width: int, height: int, vram_cap_gb: float | None, *,
                    context: torch.Tensor | None = None,
                    edit: bool = False) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
    """Load ``patcher`` as KSampler would under the cap (memory estimate at this size, cond + uncond) and return one
    sampler step at cfg 1 (one forward through ``apply_model``) with its latent. ``context`` is the encoded prompt
    (None: random embeddings); ``edit`` adds a Qwen-Image-Edit reference latent."""
    import torch

    import comfy.sampler_helpers as sampler_helpers

    from . import comfy_native

    if vram_cap_gb:
        comfy_native.apply_vram_cap(vram_cap_gb)
    latent = (1, 16, 1, height // 8, width // 8)
    inputs, extra = _step_inputs(patcher, latent, context, edit)
    # KSampler's placement: ComfyUI's estimate counts the Edit reference latent (its conds' shapes) and runs the
    # PREPARE_SAMPLING wrappers (Block Swap records that estimate to plan around the activations)
    cond = {"reference_latents": extra["ref_latents"]} if edit else {}
    sampler_helpers.prepare_sampling(patcher, latent, {"positive": [cond], "negative": [cond]},
                                     model_options=patcher.model_options)
    options = comfy_native.transformer_options(patcher)  # merged once, as a sampling run does

    def step() -> torch.Tensor:
        with torch.inference_mode():  # sigma = t / 1000: ModelSamplingDiscreteFlow's multiplier
            return patcher.model.apply_model(inputs["x"], inputs["timestep"] / 1000.0,
                                             c_crossattn=inputs["context"], transformer_options=options, **extra)

    if not torch.isfinite(step()).all():
        raise RuntimeError("the forward produced non-finite values")
    return step, inputs["x"]


def ours(ctx: harness.BenchContext, files: str, te: str, user_dir: str, width: int, height: int,
         vram_cap_gb: float | None, quantization: str = "fp8 per-tensor", clear_cache: bool = False) -> dict:
    """Harness target: the staged pipeline, stage by stage; returns the transformer forward as ``fn``."""
    import torch

    _setup(ctx, user_dir)
    import comfy.model_management as mm
    from ..host import qwen_stages as qwen_staged
    from ..host.files import EMBEDDING_CACHE_FOLDER

    f = Path(files)
    if clear_cache:
        shutil.rmtree(Path(user_dir) / EMBEDDING_CACHE_FOLDER[0], ignore_errors=True)
    reset = ctx.device.type == "cuda"
    (pos, _neg), r1 = qwen_staged.encode_prompts(str(f / te), [PROMPT, NEGATIVE], reset_cuda_peak=reset)
    model, r2 = qwen_staged.load_staged_model(str(f / "qwen_image.safetensors"), quantization,
                                              vram_budget_gb=vram_cap_gb or 0.0, reset_cuda_peak=reset)
    vae = qwen_staged.load_vae(str(f / "vae.safetensors"))
    if reset:
        torch.cuda.reset_peak_memory_stats()
    fn, x = _placed_forward(model, width, height, vram_cap_gb, context=pos[0][0])
    ctx.sync()
    load_peak = torch.cuda.max_memory_allocated() if reset else None
    fn()  # one more forward so the stage-3 decode sees a model that has really run
    _images, r3 = qwen_staged.decode_staged(x.float(), vae, vram_budget_gb=vram_cap_gb or 0.0, reset_cuda_peak=reset)
    mm.load_models_gpu([model])  # back on the GPU for the timed forwards (decode unloaded it)
    out = {"fn": fn, "resolution": f"{width}x{height}", "te": te, "quantization": quantization,
           "load_and_first_forward_vram_gib": None if load_peak is None else round(load_peak / 2**30, 3)}
    for r in (r1, r2, r3):
        out.update(_stage(r))
    return out


def native(ctx: harness.BenchContext, files: str, te: str, user_dir: str, width: int, height: int,
           vram_cap_gb: float | None) -> dict:
    """Harness target: CLIPLoader(cpu) + encode, UNETLoader(default), VAEDecode, as stock v0.8.0 does them."""
    import torch

    comfy = _setup(ctx, user_dir)
    import comfy.model_management as mm
    import comfy.utils

    from ..offload import stage_meter

    f = Path(files)
    cpu = torch.device("cpu")
    reset = ctx.device.type == "cuda"
    with stage_meter.StageMeter("stage 1 (native CLIPLoader cpu)", reset_cuda_peak=reset) as m1:
        options = {"load_device": cpu, "offload_device": cpu}
        clip = comfy.sd.load_clip([str(f / te)], clip_type=comfy.sd.CLIPType.QWEN_IMAGE, model_options=options)
        with torch.inference_mode():
            pos = clip.encode_from_tokens_scheduled(clip.tokenize(PROMPT))
            clip.encode_from_tokens_scheduled(clip.tokenize(NEGATIVE))
        del clip
        mm.cleanup_models_gc()
    with stage_meter.StageMeter("stage 2 (native UNETLoader)", reset_cuda_peak=reset) as m2:
        model = comfy.sd.load_diffusion_model(str(f / "qwen_image.safetensors"))
        vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(f / "vae.safetensors")))
    fn, x = _placed_forward(model, width, height, vram_cap_gb, context=pos[0][0])
    fn()
    with stage_meter.StageMeter("stage 3 (native VAEDecode)", device=torch.device(vae.device), reset_cuda_peak=reset) as m3:
        vae.decode(x.float())
    mm.load_models_gpu([model])
    out = {"fn": fn, "resolution": f"{width}x{height}", "te": te}
    for r in (m1.report, m2.report, m3.report):
        out.update(_stage(r))
    return out


NATIVE_ROWS = {"native fp8_e4m3fn_fast": False, "native fp8_e4m3fn_fast + ck attention": True}


def native_step(ctx: harness.BenchContext, file: str, width: int, height: int, vram_cap_gb: float | None,
                ck_attention: bool = False, edit: bool = False) -> dict:
    """Harness target: UNETLoader(fp8_e4m3fn_fast) [+ --use-ck-attention], one step per call."""
    from . import comfy_native

    sys.path.insert(0, str(comfy_native.comfyui_path()))
    from comfy.cli_args import args

    args.use_ck_attention = ck_attention  # read when comfy.ldm.modules.attention is imported (next line)
    comfy = comfy_native.import_comfy()
    patcher = comfy.sd.load_diffusion_model(file, model_options=comfy_native.unet_model_options("fp8_e4m3fn_fast"))
    fn, _x = _placed_forward(patcher, width, height, vram_cap_gb, edit=edit)
    return {"fn": fn, "cap_gb": vram_cap_gb or "none"}


def ours_step(ctx: harness.BenchContext, file: str, width: int, height: int, vram_cap_gb: float | None,
              edit: bool = False) -> dict:
    """Harness target: the Staged Loader's transformer (fp8 per-tensor, Block Swap at the cap, 0 = uncapped)
    + Attention auto, one step per call."""
    from . import comfy_native

    comfy_native.import_comfy(cpu=ctx.device.type == "cpu")
    from ..host import qwen_stages
    from ..host.attention import apply_attention

    model, _report = qwen_stages.load_staged_model(file, "fp8 per-tensor", vram_budget_gb=vram_cap_gb or 0.0)
    model = apply_attention(model, "auto")
    fn, _x = _placed_forward(model, width, height, vram_cap_gb, edit=edit)
    return {"fn": fn, "cap_gb": vram_cap_gb or "none"}


def main_caps(args: argparse.Namespace, argv: list[str] | None) -> int:
    """Per-step rows at each cap: native's two best options and the staged transformer + Attention auto."""
    f = args.files / "qwen_image_bf16.safetensors"
    if not f.is_file():
        from ..synthetic import checkpoints as synth
        import torch

        args.files.mkdir(parents=True, exist_ok=True)
        synth.write_synthetic("qwen_image", f, "full", "bf16", seed=0,
                              device="cuda" if torch.cuda.is_available() else "cpu")
    width, height = args.size
    variants = []
    for cap in args.caps:
        common = {"file": str(f), "width": width, "height": height, "vram_cap_gb": cap, "edit": args.edit}
        label = f"cap {cap:g} GB" if cap else "uncapped"
        variants += [harness.Variant(f"{name} {label}", f"{MODULE}:native_step", {**common, "ck_attention": ck})
                     for name, ck in NATIVE_ROWS.items()]
        variants.append(harness.Variant(f"ours staged + Attention auto {label}", f"{MODULE}:ours_step", common))
    caps = "_".join(f"{c:g}" if c else "none" for c in args.caps)
    bench = f"qwen_{'edit' if args.edit else 'image'}_caps_{width}x{height}_{caps}"
    results = harness.run_benchmark(bench, variants, repeats=args.repeats, warmup=args.warmup,
                                    out_dir=args.out_dir, argv=harness.command_argv(MODULE, argv))
    print((Path(args.out_dir) / f"{bench}.md").read_text(encoding="utf-8"))
    return 0 if all(r.get("status") == "ok" for r in results) else 1


def write_files(files: Path, te_formats: list[str], smoke: bool) -> None:
    """Write the synthetic files once (skipped when present); full size on the GPU when there is one. Smoke files
    are the runner's tiny ones: a narrow transformer and a 2-layer encoder of its width (the pack's loaders read
    both widths from the files)."""
    import torch

    from ..synthetic import checkpoints as synth
    from ..cli.workflow_models import TINY_LAYOUT
    from ..synthetic.tiny import tiny_text_encoder_config

    files.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    size = "tiny" if smoke else "full"
    jobs = [("qwen_image", "qwen_image.safetensors", "fp8"), ("wan21_vae", "vae.safetensors", "bf16")]
    jobs += [("qwen25_vl_7b", f"te_{fmt}.safetensors", fmt) for fmt in te_formats]
    for model, name, fmt in jobs:
        path = files / name
        if path.is_file():
            continue
        print(f"writing {path} ({model}, {size}, {fmt})", file=sys.stderr)
        synth.write_synthetic(model, path, size, fmt, seed=0, device=dev, progress=True,
                              config=tiny_text_encoder_config(model) if smoke else None,
                              metadata={"tiny_layout": TINY_LAYOUT} if smoke else None)


def _cap(text: str) -> float | None:
    return None if text == "none" else float(text)


def main(argv: list[str] | None = None) -> int:
    """Write files if needed, run the variants, print the markdown table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=Path, required=True, help="folder for the synthetic model files")
    parser.add_argument("--te", nargs="+", choices=["bf16", "fp8_scaled"], default=["bf16"])
    parser.add_argument("--vram-gb", type=float, default=8.0, help="simulated card size for native and ours")
    parser.add_argument("--size", type=int, nargs=2, default=[1328, 1328], metavar=("W", "H"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--skip-native", action="store_true")
    parser.add_argument("--out-dir", "--out", type=Path, default=harness.RESULTS)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny files, 64x64, CPU, no cap, no native rows (stock loaders cannot read tiny widths)")
    parser.add_argument("--caps", nargs="+", type=_cap, default=None, metavar="GB|none",
                        help="per-step rows at these VRAM caps instead of the per-stage pipeline")
    parser.add_argument("--edit", action="store_true", help="with --caps: Qwen-Image-Edit (a reference latent)")
    args = parser.parse_args(argv)
    if args.caps:
        return main_caps(args, argv)
    write_files(args.files, args.te, args.smoke)
    width, height = (64, 64) if args.smoke else tuple(args.size)
    cap = None if args.smoke else args.vram_gb
    user_dir = str(args.files / "comfy_user")
    common = {"files": str(args.files), "user_dir": user_dir, "width": width, "height": height}
    variants, natives = [], []
    for te in args.te:
        te_file = f"te_{te}.safetensors"
        if not (args.skip_native or args.smoke):  # last: stock CLIPLoader on the CPU is the slow part of the bench
            natives.append(harness.Variant(f"native te={te} cap={cap}", f"{MODULE}:native",
                                           {**common, "te": te_file, "vram_cap_gb": cap}))
        variants += [
            harness.Variant(f"ours cold te={te} cap={cap}", f"{MODULE}:ours",
                            {**common, "te": te_file, "vram_cap_gb": cap, "clear_cache": True}),
            harness.Variant(f"ours cached te={te} cap={cap}", f"{MODULE}:ours",
                            {**common, "te": te_file, "vram_cap_gb": cap}),
        ]
    variants.append(harness.Variant("ours resident (no cap, no swap)", f"{MODULE}:ours",
                                    {**common, "te": f"te_{args.te[0]}.safetensors", "vram_cap_gb": None}))
    variants += natives
    bench = "qwen_staged_smoke" if args.smoke else f"qwen_staged_{width}x{height}_cap{args.vram_gb:g}gb"
    argv_used = harness.command_argv(MODULE, argv)
    results = harness.run_benchmark(bench, variants, repeats=min(args.repeats, 2) if args.smoke else args.repeats,
                                    warmup=args.warmup, out_dir=args.out_dir, force_cpu=args.smoke, argv=argv_used)
    print((Path(args.out_dir) / f"{bench}.md").read_text(encoding="utf-8"))
    return 0 if all(r.get("status") == "ok" for r in results) else 1

