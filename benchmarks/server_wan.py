"""Scenarios ``server_wan14b`` and ``server_wan14b_4step``: Wan 2.2 T2V-A14B through a real server, as data.

Native rows: UNETLoader (a weight_dtype) x2, CLIPLoader + CLIPTextEncode, KSamplerAdvanced x2 (the official
template). Pack rows: the shipped workflow's nodes (Wan Loader, [LoRA], [Block Swap], Attention, [Torch Compile],
Wan Text Encode). 4-step rows: the lightx2v 4-step LoRAs (stock LoraLoaderModelOnly after each loader), cfg 1,
shift 5 as workflows/wan22_t2v_a14b_4step.json, 8 GB card, each next to the same graph without the LoRAs.
Split rows (group 'multigpu'): core's MultiGPU CFG Split on each expert's model right before its sampler, each
next to its one-GPU twin, whose final latent it must equal.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace

from comfyui_lowvram_dit.benchmarks.server import (
    CARD_GIB, PROBE_CALL, PROBE_NODE, RESULTS, SPLIT_NODE, Row, ServerScenario, node, pick_rows)

HIGH = "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors"
LOW = "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors"
TEXT_ENCODER = "umt5_xxl_fp8_e4m3fn_scaled.safetensors"
VAE = "wan_2.1_vae.safetensors"
MODEL_FILES = (HIGH, LOW, TEXT_ENCODER, VAE)
HIGH_LORA = "wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors"  # official template names, models/loras
LOW_LORA = "wan2.2_t2v_lightx2v_4steps_lora_v1.1_low_noise.safetensors"
LORA_FILES = (HIGH_LORA, LOW_LORA)
LORA_SHIFT, LORA_CFG = 5.0, 1.0  # the 4-step workflow's ModelSamplingSD3 shift and cfg
# The shipped workflow's settings (workflows/wan22_t2v_a14b.json; a unit test keeps them equal).
POSITIVE = ("A red fox trots through fresh snow in a birch forest at golden hour, its breath visible in the cold "
            "air; the camera tracks it at eye level, shallow depth of field, cinematic.")
NEGATIVE = ("blurry, low quality, jpeg artifacts, static, still image, overexposed, subtitles, watermark, deformed, "
            "extra limbs, worst quality")
SHIFT, CFG, SEED, SAMPLER, SCHEDULER = 8.0, 3.5, 42, "euler", "simple"
WIDTH, HEIGHT, FRAMES = 832, 480, 81
SAMPLER_NODES = ("15", "16")
SPLIT_GPUS = 2  # the split rows' max_gpus
_8 = CARD_GIB


def _r(name: str, graph: str, **kw: object) -> Row:
    """A row of this scenario: native rows are baselines, pack rows run Attention auto unless told otherwise."""
    kw.setdefault("baseline", graph == "native")
    if graph == "pack":
        kw.setdefault("attention", "auto")
    return Row(name, graph, **kw)


FAST, CK = {"weight_dtype": "fp8_e4m3fn_fast"}, {"weight_dtype": "fp8_e4m3fn_fast", "ck_attention": True}
INT8 = {"attention": "lowvram 8-bit"}
FOUR = {"card_gib": _8, "four_step": True}
VARIANTS: dict[str, Row] = {r.name: r for r in (
    _r("native_default", "native"), _r("native_fp8fast", "native", **FAST), _r("native_fp8fast_ck", "native", **CK),
    _r("pack", "pack"), _r("pack_int8", "pack", **INT8), _r("pack_int8_compile", "pack", **INT8, compile=True),
    _r("pack_tensorwise", "pack", fp8_path="scaled_mm_tensorwise"),
    _r("pack_int8_compile_tensorwise", "pack", **INT8, compile=True, fp8_path="scaled_mm_tensorwise"),
    _r("native_default_8gb", "native", card_gib=_8), _r("native_fp8fast_8gb", "native", **FAST, card_gib=_8),
    _r("native_fp8fast_ck_8gb", "native", **CK, card_gib=_8),
    _r("native_fp8fast_legacy_8gb", "native", **FAST, dynamic_vram=False, card_gib=_8),
    _r("pack_8gb", "pack", card_gib=_8), _r("pack_blockswap_8gb", "pack", block_swap_gb=_8, card_gib=_8),
    _r("pack_blockswap_int8_8gb", "pack", **INT8, block_swap_gb=_8, card_gib=_8),
    _r("pack_int8_compile_8gb", "pack", **INT8, compile=True, card_gib=_8),
    # 4-step LoRA rows (cfg 1, shift 5) at the 8 GB card: each LoRA row next to the same graph without the LoRAs
    _r("native_fp8fast_8gb_4step", "native", **FAST, **FOUR), _r("native_fp8fast_8gb_lora4", "native", **FAST, **FOUR, lora=True),
    _r("native_fp8fast_ck_8gb_4step", "native", **CK, **FOUR),
    _r("native_fp8fast_ck_8gb_lora4", "native", **CK, **FOUR, lora=True),
    _r("pack_blockswap_8gb_4step", "pack", block_swap_gb=_8, **FOUR),
    _r("pack_blockswap_8gb_lora4", "pack", block_swap_gb=_8, **FOUR, lora=True),
    _r("pack_8gb_lora4", "pack", **FOUR, lora=True),
    # core's EasyCache on each expert, next to the same rows without it (group easycache / easycache_4step)
    _r("native_fp8fast_ck_easycache", "native", **CK, step_cache="EasyCache"),
    _r("pack_int8_compile_easycache", "pack", **INT8, compile=True, step_cache="EasyCache"),
    _r("native_fp8fast_ck_8gb_lora4_easycache", "native", **CK, **FOUR, lora=True, step_cache="EasyCache"),
    _r("pack_blockswap_8gb_lora4_easycache", "pack", block_swap_gb=_8, **FOUR, lora=True, step_cache="EasyCache"),
)}
STEP_CACHE_DEFAULTS = {"reuse_threshold": 0.2, "start_percent": 0.15, "end_percent": 0.95, "verbose": False}


def split_row(twin: Row, gpus: int = SPLIT_GPUS) -> Row:
    """``twin``'s graph with core's MultiGPU CFG Split over ``gpus`` GPUs: named ``<twin>_<gpus>gpu``, not a
    baseline (ratios and goals stay one-GPU numbers), its final latent checked against ``twin``'s."""
    return replace(twin, name=f"{twin.name}_{gpus}gpu", gpus=gpus, same_as=twin.name, baseline=False)


SPLIT_TWINS = ("native_fp8fast_ck", "native_fp8fast", "pack", "pack_int8_compile")
VARIANTS.update({r.name: r for r in (split_row(VARIANTS[t]) for t in SPLIT_TWINS)})
ONE_GPU = [n for n, v in VARIANTS.items() if v.gpus == 1]
LORA_ROWS = [n for n, v in VARIANTS.items() if v.four_step and v.step_cache is None]
EASYCACHE = ["native_fp8fast_ck", "native_fp8fast_ck_easycache", "pack_int8_compile", "pack_int8_compile_easycache"]
EASYCACHE_4STEP = ["native_fp8fast_ck_8gb_lora4", "native_fp8fast_ck_8gb_lora4_easycache", "pack_blockswap_8gb_lora4",
                   "pack_blockswap_8gb_lora4_easycache"]
UNCAPPED = [n for n in ONE_GPU if VARIANTS[n].card_gib is None]
CAPPED = [n for n in ONE_GPU if VARIANTS[n].card_gib is not None]
MULTIGPU = [n for t in SPLIT_TWINS for n in (t, split_row(VARIANTS[t]).name)]  # each twin, then its split row
# 'all': every one-GPU row; the split rows run only when asked for ('multigpu' or by name)
GROUPS = {"uncapped": UNCAPPED, "capped": CAPPED, "lora": LORA_ROWS, "multigpu": MULTIGPU, "easycache": EASYCACHE,
          "easycache_4step": EASYCACHE_4STEP, "all": ONE_GPU}


def cfg_of(row: Row) -> float:
    """The sampler's cfg: 1 for 4-step rows (one forward per step), the shipped workflow's otherwise."""
    return LORA_CFG if row.four_step else CFG


def shift_of(row: Row) -> float:
    """ModelSamplingSD3 shift of a row."""
    return LORA_SHIFT if row.four_step else SHIFT


def describe(row: Row) -> str:
    """One line saying what a row runs."""
    if row.graph == "native":
        parts = [f"UNETLoader {row.weight_dtype}", "ck attention" if row.ck_attention else "default attention"]
    else:
        parts = ["Wan Loader fp8 per-tensor", f"Attention {row.attention}"]
        parts += [f"Block Swap {row.block_swap_gb:g} GB"] if row.block_swap_gb is not None else []
        parts += ["Torch Compile"] if row.compile else []
        parts += [f"fp8 path {row.fp8_path}"] if row.fp8_path != "default" else []
    if row.four_step:
        parts.append("4-step LoRAs" if row.lora else "4-step sampling without the LoRAs")
    parts.append("DynamicVRAM" if row.dynamic_vram else "legacy loading (--disable-dynamic-vram)")
    parts.append("whole GPU" if row.card_gib is None else f"{row.card_gib:g} GB card")
    if row.gpus > 1:
        parts.append(f"MultiGPU CFG Split over {row.gpus} GPUs")
    if row.step_cache is not None:
        parts.append(f"{row.step_cache} (its defaults) on each expert")
    return ", ".join(parts)


def _lora(model: list, unet: str, label: str) -> dict:
    """The stock LoraLoaderModelOnly with the expert's 4-step LoRA at the official template's strength 1."""
    return node("LoraLoaderModelOnly", f"LoRA 4-step ({label})", model=model,
                lora_name=HIGH_LORA if unet == HIGH else LOW_LORA, strength_model=1.0)


def _pack_chain(graph: dict, first_id: int, unet: str, row: Row, label: str) -> list:
    """Wan Loader -> [LoRA] -> [Block Swap] -> Attention -> [Torch Compile] -> ModelSamplingSD3; the output link."""
    chain = [node("LowVRAM_WanLoader", f"Wan Loader ({label})", unet_name=unet, quantization="fp8 per-tensor",
                  block_size="128", compute="auto", save_quantized=False)]
    if row.lora:
        chain.append(_lora(None, unet, label))
    if row.block_swap_gb is not None:
        chain.append(node("LowVRAM_BlockSwap", f"Block Swap ({label})", model=None, vram_budget_gb=row.block_swap_gb,
                          blocks_to_swap=-1, prefetch=1, pinned=True, offload_embeddings=False, debug=False,
                          dynamic_vram="stream"))  # these rows measure streaming
    chain.append(node("LowVRAM_Attention", f"Attention ({label})", model=None, backend=row.attention))
    if row.compile:
        chain.append(node("LowVRAM_TorchCompile", f"Torch Compile ({label})", model=None, mode="default",
                          backend="inductor", dynamic="auto", fullgraph=False, cache_size_limit=64, fallback=True,
                          scope="blocks"))
    chain.append(node("ModelSamplingSD3", f"ModelSamplingSD3 ({label})", model=None, shift=shift_of(row)))
    for i, n in enumerate(chain):
        if i:
            n["inputs"]["model"] = [str(first_id + i - 1), 0]
        graph[str(first_id + i)] = n
    return [str(first_id + len(chain) - 1), 0]


def _native(graph: dict, row: Row) -> tuple[list, list, list, list]:
    """The template's loaders and text encoding; the high/low model and positive/negative links."""
    graph["3"] = node("UNETLoader", "Load Diffusion Model (high noise)", unet_name=HIGH, weight_dtype=row.weight_dtype)
    graph["7"] = node("UNETLoader", "Load Diffusion Model (low noise)", unet_name=LOW, weight_dtype=row.weight_dtype)
    high_src, low_src = ["3", 0], ["7", 0]
    if row.lora:
        graph["4"], graph["8"] = _lora(high_src, HIGH, "high noise"), _lora(low_src, LOW, "low noise")
        high_src, low_src = ["4", 0], ["8", 0]
    graph["6"] = node("ModelSamplingSD3", "ModelSamplingSD3 (high noise)", model=high_src, shift=shift_of(row))
    graph["10"] = node("ModelSamplingSD3", "ModelSamplingSD3 (low noise)", model=low_src, shift=shift_of(row))
    graph["11"] = node("CLIPLoader", "Load CLIP", clip_name=TEXT_ENCODER, type="wan", device="default")
    graph["20"] = node("CLIPTextEncode", "Positive", text=POSITIVE, clip=["11", 0])
    graph["21"] = node("CLIPTextEncode", "Negative", text=NEGATIVE, clip=["11", 0])
    return ["6", 0], ["10", 0], ["20", 0], ["21", 0]


def build_graph(row: Row, steps_per_expert: int = 3, width: int = WIDTH, height: int = HEIGHT, frames: int = FRAMES,
                decode: bool = False, probe: bool = False) -> dict:
    """The API graph of ``row``: two experts, ``steps_per_expert`` steps each; decode + mp4 (SaveVideo) or SaveLatent.
    ``probe``: each expert's model goes through the Kernel Profile node (benchmarks/server_probe)."""
    if steps_per_expert < 2:
        raise ValueError("steps_per_expert must be >= 2: the first step of each expert holds loading, so at least "
                         "one later step is needed for a per-step time")
    graph: dict[str, dict] = {"13": node("EmptyHunyuanLatentVideo", "Video size", width=width, height=height,
                                         length=frames, batch_size=1)}
    if row.graph == "native":
        high, low, pos, neg = _native(graph, row)
    elif row.graph == "pack":
        high, low = _pack_chain(graph, 30, HIGH, row, "high noise"), _pack_chain(graph, 40, LOW, row, "low noise")
        graph["11"] = node("LowVRAM_WanTextEncode", "Wan Text Encode (LowVRAM)", clip_name=TEXT_ENCODER,
                           positive=POSITIVE, negative=NEGATIVE, cache_embeddings=True, device="auto")
        pos, neg = ["11", 0], ["11", 1]
    else:
        raise ValueError(f"variant {row.name}: graph must be 'native' or 'pack', not {row.graph!r}")
    if row.fp8_path != "default" and not probe:
        raise ValueError(f"variant {row.name}: an fp8 path is set by the Kernel Profile node; add --kernel-profile")
    if probe:
        for nid, label, src in (("50", "high", high), ("51", "low", low)):
            graph[nid] = node(PROBE_NODE, f"Kernel Profile ({label} noise)", model=src, label=label,
                              profile_call=PROBE_CALL, fp8_path=row.fp8_path)
        high, low = ["50", 0], ["51", 0]
    if row.step_cache is not None:  # a step cache decides per sampler run: on each expert's model, before sampling
        for nid, label, src in (("54", "high", high), ("55", "low", low)):
            graph[nid] = node(row.step_cache, f"{row.step_cache} ({label} noise)", model=src, **STEP_CACHE_DEFAULTS)
        high, low = ["54", 0], ["55", 0]
    if row.gpus > 1:  # core's split goes last on the model (after the nodes that change it), right before sampling
        for nid, label, src in (("52", "high", high), ("53", "low", low)):
            graph[nid] = node(SPLIT_NODE, f"MultiGPU CFG Split ({label} noise)", model=src, max_gpus=row.gpus)
        high, low = ["52", 0], ["53", 0]
    common = {"steps": 2 * steps_per_expert, "cfg": cfg_of(row), "sampler_name": SAMPLER, "scheduler": SCHEDULER,
              "positive": pos, "negative": neg}
    graph["15"] = node("KSamplerAdvanced", "Sampler (high noise)", add_noise="enable", noise_seed=SEED,
                       start_at_step=0, end_at_step=steps_per_expert, return_with_leftover_noise="enable",
                       model=high, latent_image=["13", 0], **common)
    graph["16"] = node("KSamplerAdvanced", "Sampler (low noise)", add_noise="disable", noise_seed=0,
                       start_at_step=steps_per_expert, end_at_step=10000, return_with_leftover_noise="disable",
                       model=low, latent_image=["15", 0], **common)
    if decode:
        graph["12"] = node("VAELoader", "Load VAE", vae_name=VAE)
        graph["18"] = node("VAEDecode", "VAE Decode", samples=["16", 0], vae=["12", 0])
        graph["19"] = node("CreateVideo", "Create Video", images=["18", 0], fps=16.0)
        graph["22"] = node("SaveVideo", "Save", video=["19", 0], filename_prefix=f"bench/{row.name}", format="auto",
                           codec="auto")  # codec: 0.8.0's combo, a hidden input 0.33.0 still reads
    else:
        graph["19"] = node("SaveLatent", "Save latent", samples=["16", 0], filename_prefix=f"bench/{row.name}")
    return graph


def pick_variants(spec: str) -> list[Row]:
    """Rows from a comma list of names or the groups 'uncapped', 'capped', 'lora' (4-step rows), 'multigpu' (split
    rows and their twins), 'all' (every one-GPU row)."""
    return pick_rows(spec, VARIANTS, GROUPS)


def _graph(row: Row, opts: argparse.Namespace) -> dict:
    return build_graph(row, opts.steps, opts.width, opts.height, opts.frames, opts.decode, opts.kernel_profile)


def _files(rows: Sequence[Row], opts: argparse.Namespace) -> tuple[str, ...]:
    return MODEL_FILES + (LORA_FILES if any(r.lora for r in rows) else ())


_DEFAULTS = {"steps": 3, "width": WIDTH, "height": HEIGHT, "frames": FRAMES, "cfg": CFG, "cfg_4step": LORA_CFG,
             "shift_4step": LORA_SHIFT}
SCENARIO = ServerScenario(
    "server_wan14b", "Wan 2.2 T2V-A14B", VARIANTS, GROUPS, _graph, describe, _files, SAMPLER_NODES,
    RESULTS / "server_0.33", defaults={**_DEFAULTS, "variants": "all"})
SCENARIO_4STEP = replace(SCENARIO, name="server_wan14b_4step", title="Wan 2.2 T2V-A14B, 4 steps with the LoRAs",
                         defaults={**_DEFAULTS, "variants": "lora"})
