"""selftest checks of the nodes that load or patch a Wan model, each against the stock path it stands in for.

Wan Loader vs UNETLoader, Attention vs ComfyUI's own attention, Block Swap / NaN Guard / Torch Compile vs the
same model without them, and stock LoraLoaderModelOnly on the pack's fp8 model vs on UNETLoader's model. The
model is the tiny Wan 2.2 T2V of synthetic/checkpoints.py (2 blocks of width 256, heads of 128, real key names).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..kernels import attention as attention_kernels
from ..kernels.attention_backends import EXACT_TOLERANCE, QUANTIZED_TOLERANCE
from .report import FP8_TOLERANCE
from .selftest_env import FAIL, SKIP, SEED, Check, SelfTestEnv, Verdict, comfy_nodes, compare, relative_difference

WAN_FILE = "lowvram_selftest_wan22_t2v_tiny_bf16.safetensors"
LORA_FILE = "lowvram_selftest_wan22_lora.safetensors"
LORA_SOURCE = "wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors"  # synthetic/lora.py's layout for it
# The synthetic LoRA is scaled up until it moves the tiny model's prediction well past the fp8 tolerance: a merge
# lost on the fp8 layers then fails the check instead of hiding inside the quantization error. Not further: deltas
# several times the weights outgrow the block-wise scales the merge re-quantizes into.
LORA_GAIN = 60.0
FP8_MODES = ("fp8 per-tensor", "fp8 block-wise")
BLOCK_SIZE = 128  # the Wan Loader's default block_size
STOCK = "UNETLoader (weight_dtype default) on the same file"
FP32 = "UNETLoader's model in fp32"


def _write_wan(path: Path) -> None:
    from ..synthetic.checkpoints import write_synthetic

    write_synthetic("wan22_t2v_14B", path, "tiny", "bf16", seed=SEED)


def _wan_file(env: SelfTestEnv) -> str:
    return env.file("diffusion_models", WAN_FILE, _write_wan)


def stock_wan(env: SelfTestEnv) -> Any:
    """ComfyUI's UNETLoader on the tiny Wan file, default weight dtype."""
    return comfy_nodes().UNETLoader().load_unet(_wan_file(env), "default")[0]


def pack_wan(env: SelfTestEnv, quantization: str) -> Any:
    """The pack's Wan Loader node on the same file."""
    from ..nodes.wan_loader import WanLoader

    return WanLoader.execute(unet_name=_wan_file(env), quantization=quantization, block_size=str(BLOCK_SIZE),
                             compute="auto", save_quantized=False).args[0]


def stock_output(env: SelfTestEnv) -> torch.Tensor:
    """One sampler step of UNETLoader's model (computed once per run)."""
    return env.memo("wan stock", lambda: env.sample(stock_wan(env)))


def fp32_output(env: SelfTestEnv) -> torch.Tensor:
    """One sampler step of the same file built in fp32 by ComfyUI (the accuracy reference for fp8)."""
    def make() -> torch.Tensor:
        import comfy.sd
        import folder_paths

        path = folder_paths.get_full_path_or_raise("diffusion_models", _wan_file(env))
        return env.sample(comfy.sd.load_diffusion_model(path, model_options={"dtype": torch.float32}))

    return env.memo("wan fp32", make)


def fp8_tolerance(env: SelfTestEnv, model: Any, mode: str) -> tuple[float, str]:
    """(tolerance, fp8 path) of a pack fp8 model on this device: FP8_TOLERANCE where its layers dequantize (only the
    weights are quantized), the quantized-kernel tolerance where they run fp8 matmuls (activations are 8-bit too)."""
    from ..kernels.fp8 import select_path

    layer = next(m for m in model.model.diffusion_model.modules() if getattr(m, "weight_scale", None) is not None)
    path = select_path(env.device, None if mode == "fp8 per-tensor" else BLOCK_SIZE, *layer.weight.shape)
    return (FP8_TOLERANCE if path == "dequantize" else QUANTIZED_TOLERANCE), path


def check_wan_loader(env: SelfTestEnv) -> Iterator[Verdict]:
    """none: identical to UNETLoader; fp8 modes: within the fp8 tolerance of the fp32 model."""
    yield compare("Wan Loader [none]", env.sample(pack_wan(env, "none")), stock_output(env), 0.0, STOCK)
    for mode in FP8_MODES:
        model = pack_wan(env, mode)
        tolerance, path = fp8_tolerance(env, model, mode)
        yield compare(f"Wan Loader [{mode}, {path}]", env.sample(model), fp32_output(env), tolerance, FP32)


def _compute_dtype(model: Any) -> torch.dtype:
    return model.model.manual_cast_dtype or model.model.get_dtype()


def _ran(selector: Any, requested: str) -> str:
    """What the node's attention actually ran, when it is not what was asked for (a checked fallback, or an exact
    kernel that was faster than the 8-bit one asked for)."""
    other = {d.label(d.backend): "; ".join(d.rejected.values()) for d in selector.details.values()
             if requested != "auto" and d.backend != requested}
    return "".join(f"; the node ran {label} instead ({why or 'see the log'})" for label, why in other.items())


def check_attention(env: SelfTestEnv) -> Iterator[Verdict]:
    """Every backend this device can run vs ComfyUI's default attention, within that backend's tolerance."""
    from ..host.attention import BACKEND_CHOICES
    from ..nodes.attention import AttentionSelect

    model = stock_wan(env)
    dm = model.model.diffusion_model
    dtype, head_dim = _compute_dtype(model), dm.dim // dm.num_heads
    for label, name in BACKEND_CHOICES.items():
        node = f"Attention [{label}]"
        reason = None if name in (None, "auto") else \
            attention_kernels.unavailable_reason(name, env.device, dtype, head_dim)
        if reason is not None:
            yield Verdict(node, SKIP, reason)
            continue
        tolerance = 0.0 if name is None else EXACT_TOLERANCE if name == "auto" else \
            attention_kernels.BACKENDS[name].tolerance
        with attention_kernels.isolated_selector() as selector:
            out = env.sample(AttentionSelect.execute(model, label).args[0])
        verdict = compare(node, out, stock_output(env), tolerance, "ComfyUI's default attention")
        yield Verdict(node, verdict.status, verdict.detail + _ran(selector, name or ""))


def check_block_swap(env: SelfTestEnv) -> Iterator[Verdict]:
    """One of the two blocks streamed: identical to the same fp8 model without Block Swap."""
    from ..host.block_swap import SWAP_KEY
    from ..nodes.block_swap import BlockSwap

    model = pack_wan(env, "fp8 per-tensor")
    ref = env.sample(model)
    swapped = BlockSwap.execute(model, vram_budget_gb=0.0, blocks_to_swap=1, prefetch=1, pinned=True,
                                offload_embeddings=False, debug=False).args[0]
    node = "Block Swap [1 of 2 blocks streamed]"
    if swapped is model or SWAP_KEY not in swapped.attachments:
        yield Verdict(node, SKIP, "the node passed the model through here (see the log: e.g. ComfyUI's DynamicVRAM "
                                  "manages this model)")
        return
    yield compare(node, env.sample(swapped), ref, 0.0, "the same Wan Loader fp8 model without Block Swap")


def check_nan_guard(env: SelfTestEnv) -> Iterator[Verdict]:
    """A checked model computes exactly what the unchecked one does."""
    from ..nodes.nan_guard import NanGuard

    out = env.sample(NanGuard.execute(stock_wan(env), "warn").args[0])
    yield compare("NaN Guard", out, stock_output(env), 0.0, "the same model without NaN Guard")


def _write_lora(path: Path) -> None:
    from safetensors.torch import save

    from ..checkpoints.safe_write import write_atomic
    from ..synthetic.lora import synthetic_lora

    sd = synthetic_lora(LORA_SOURCE, "tiny", seed=SEED)
    sd = {k: v * LORA_GAIN if k.endswith("lora_up.weight") else v for k, v in sd.items()}
    write_atomic(path, save(sd, metadata={"synthetic": "comfyui_lowvram_dit"}))


def check_lora(env: SelfTestEnv) -> Iterator[Verdict]:
    """Stock LoraLoaderModelOnly on the pack's fp8 models vs on UNETLoader's model, within the fp8 tolerance; and
    the LoRA must move the pack's output at least half as far as it moves the stock one (it reached the fp8 layers:
    where fp8 matmuls run, the tolerance alone would let a lost merge pass)."""
    lora = env.file("loras", LORA_FILE, _write_lora)
    loader = comfy_nodes().LoraLoaderModelOnly()
    stock = env.sample(loader.load_lora_model_only(stock_wan(env), lora, 1.0)[0])
    effect = relative_difference(stock, stock_output(env))
    for mode in FP8_MODES:
        model = pack_wan(env, mode)
        tolerance, path = fp8_tolerance(env, model, mode)
        out = env.sample(loader.load_lora_model_only(model, lora, 1.0)[0])
        moved = relative_difference(out, env.sample(model))
        verdict = compare(f"LoRA merge [LoraLoaderModelOnly on Wan Loader {mode}, {path}]", out, stock, tolerance,
                          "LoraLoaderModelOnly on UNETLoader's model")
        status = verdict.status if moved >= effect / 2 else FAIL
        yield Verdict(verdict.node, status, f"{verdict.detail}; the LoRA moves the output by {moved:.3g} "
                                            f"(on UNETLoader's model: {effect:.3g})")


def check_compile(env: SelfTestEnv) -> Iterator[Verdict]:
    """Compiled blocks (inductor, no fallback) vs eager; SKIP where torch.compile itself does not work here."""
    from ..kernels.compile import describe_failure, is_compile_failure
    from ..host.torch_compile import COMPILE_KEY
    from ..nodes.compile import TorchCompile

    compiled = TorchCompile.execute(stock_wan(env), mode="default", backend="inductor", dynamic="auto",
                                    fullgraph=False, cache_size_limit=64, fallback=False, scope="blocks").args[0]
    node = "Torch Compile [inductor, blocks]"
    try:
        out = env.sample(compiled)
    except Exception as exc:  # noqa: BLE001 - sorted below: the compiler's own failure or the node's
        if not is_compile_failure(exc):
            raise
        yield Verdict(node, SKIP, f"torch.compile does not work on {env.device} here ({describe_failure(exc)}); "
                                  "the node then runs eager")
        return
    verdict = compare(node, out, stock_output(env), EXACT_TOLERANCE, "the same model eager")
    yield Verdict(node, verdict.status, f"{verdict.detail}; {compiled.attachments[COMPILE_KEY].status()}")


CHECKS = [
    Check("wan_loader", "Wan Loader", ("wan_loader", "WanLoader"), check_wan_loader),
    Check("attention", "Attention", ("attention", "AttentionSelect"), check_attention),
    Check("block_swap", "Block Swap", ("block_swap", "BlockSwap"), check_block_swap),
    Check("nan_guard", "NaN Guard", ("nan_guard", "NanGuard"), check_nan_guard),
    Check("lora", "LoRA merge", ("wan_loader", "WanLoader"), check_lora),
]
SLOW_CHECKS = [Check("compile", "Torch Compile", ("compile", "TorchCompile"), check_compile)]
