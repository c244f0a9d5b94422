"""ComfyUI's step caches (EasyCache, LazyCache: comfy_extras/nodes_easycache.py, in 0.8.0 and 0.33.0) before and
after each pack node, through a real server, on tiny synthetic models.

Each graph runs the same cache on the native model (UNETLoader) and with a pack node before or after it, and
compares: the sampled latent (exactly where the pack node changes no numerics, within the tolerance the node's own
equality tests use where it does), and the cache's own count of skipped steps ("<cache> - skipped K/N steps"),
which must be the same and above zero. What a skipped step could leave stale is checked on the way: Block Swap's
ring (debug lines: every model call, skipped or not, loads nothing on demand; a plain run after the cached one
is still exact), compiled regions (no recompile warning, no fallback), the attention choice (one per shape).

Thresholds: EasyCache skips a step while its accumulated estimate of the output change stays under
``reuse_threshold``, LazyCache likewise one level up (the whole noise prediction). At 8 steps with these
thresholds both skip several steps on this model, and the native run checks that no estimate comes within 10 % of
the threshold, so a pack node's rounding cannot flip a decision. CI runs half of the cache x pack node x order
combinations (each pack node with each cache once), the slow tier the rest. Needs COMFYUI_PATH.
"""

from __future__ import annotations

import itertools
import re
import uuid
from typing import Any

import pytest
import torch
from comfy_server import chain_nodes, sample_nodes
from safetensors.torch import load_file
from test_comfyui_qwen_staged import files  # noqa: F401 - the tiny Qwen-Image files (a module fixture)

pytestmark = pytest.mark.comfyui
STEPS = 8
CACHES = {"EasyCache": 0.6, "LazyCache": 0.55}  # reuse_threshold per cache on the tiny Wan (module docstring)
QWEN_CACHES = {"EasyCache": 0.6, "LazyCache": 0.8}  # the same on the tiny Qwen-Image
MARGIN = 0.1
TOL = {"rtol": 1e-4, "atol": 1e-4}  # Attention / Torch Compile equality tolerance (test_comfyui_attention_compile)
FP8_REL_L2 = 0.05  # the Wan Loader's fp8 modes against bf16 (test_comfyui_wan_loader.py)
_prefix = itertools.count()

ATTENTION = ("LowVRAM_Attention", {"backend": "auto"})
NAN_GUARD = ("LowVRAM_NanGuard", {"action": "warn"})
BLOCK_SWAP = ("LowVRAM_BlockSwap", {"vram_budget_gb": 0.0, "blocks_to_swap": 3, "prefetch": 1, "pinned": True,
                                    "offload_embeddings": False, "debug": True})


def _compile(scope: str) -> tuple[str, dict]:
    # backend cudagraphs on CPU tensors runs the traced graph without recording (inductor would take minutes here)
    return "LowVRAM_TorchCompile", {"mode": "default", "backend": "cudagraphs", "dynamic": "auto", "fullgraph": False,
                                    "cache_size_limit": 16, "fallback": True, "scope": scope}


PACK_NODES: dict[str, tuple[tuple[str, dict], str]] = {  # name -> (node, how its output must compare)
    "attention": (ATTENTION, "close"),
    "nan_guard": (NAN_GUARD, "exact"),
    "compile_blocks": (_compile("blocks"), "close"),
    "compile_whole_model": (_compile("whole model"), "close"),
    "block_swap": (BLOCK_SWAP, "exact"),
}


def _cache(name: str, thresholds: dict[str, float] = CACHES) -> tuple[str, dict]:
    return name, {"reuse_threshold": thresholds[name], "start_percent": 0.15, "end_percent": 0.95, "verbose": True}


@pytest.fixture(scope="module")
def wan_file(comfy_server: Any) -> str:
    """A 6-block bf16 Wan 2.1 file (Block Swap streams 3 of them) under a unique name."""
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    name = f"cache_wan_{uuid.uuid4().hex[:8]}.safetensors"
    synth.write_synthetic("wan21_t2v_1_3B", comfy_server.base_dir / "models" / "diffusion_models" / name,
                          size="tiny", fmt="bf16", seed=0, num_layers=6)
    return name


def _graph(loader: dict, chain: list[tuple[str, dict]], seed: int = 5) -> dict:
    """loader -> ``chain`` (class, inputs) in order -> KSampler (8 euler steps, cfg 3, 64x64x5) -> SaveLatent."""
    return {**chain_nodes(loader, chain), **sample_nodes(seed, steps=STEPS, size=64, cond_length=12),
            "save": {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0],
                                                            "filename_prefix": f"caches/run{next(_prefix)}"}}}


def _unet(name: str) -> dict:
    return {"class_type": "UNETLoader", "inputs": {"unet_name": name, "weight_dtype": "default"}}


def _run(server: Any, api: dict) -> tuple[torch.Tensor, str]:
    """The saved latent and the server log the run wrote."""
    mark = len(server.log_text())
    entry = server.run(api, timeout=600)
    (saved,) = entry["outputs"]["save"]["latents"]
    latent = load_file(str(server.base_dir / "output" / saved["subfolder"] / saved["filename"]))["latent_tensor"]
    return latent, server.log_text()[mark:]


def _skipped(log: str, cache: str) -> int:
    """Steps the cache skipped in this run, from its own summary line (exactly one per run)."""
    found = re.findall(rf"{cache} - skipped (\d+)/(\d+) steps", log)
    assert len(found) == 1, f"expected one '{cache} - skipped' line, got {found}"
    skipped, total = map(int, found[0])
    assert total == STEPS
    return skipped


def _reference_skips(log: str, cache: str, thresholds: dict[str, float] = CACHES) -> int:
    """Steps the cache skipped on the reference run: some, and every estimate clear of the threshold."""
    rates = [float(r) for r in re.findall(rf"{cache} \[verbose\] - (?:NOT )?skipping step; "
                                          r"cumulative_change_rate: ([\d.e+-]+)", log)]
    threshold = thresholds[cache]
    assert rates and all(abs(r - threshold) > MARGIN * threshold for r in rates), (cache, rates)
    skipped = _skipped(log, cache)
    assert skipped > 0, f"{cache} skipped nothing: the test would prove nothing"
    return skipped


@pytest.fixture(scope="module")
def native(comfy_server: Any, wan_file: str) -> dict[str, tuple[torch.Tensor, int]]:
    """Each cache on the native model: (latent, skipped steps)."""
    out = {}
    for cache in CACHES:
        latent, log = _run(comfy_server, _graph(_unet(wan_file), [_cache(cache)]))
        out[cache] = (latent, _reference_skips(log, cache))
    return out


def _compare(latent: torch.Tensor, ref: torch.Tensor, how: str) -> None:
    if how == "exact":
        assert torch.equal(latent, ref), (latent - ref).abs().max()
    elif how == "close":
        torch.testing.assert_close(latent, ref, **TOL)
    else:
        rel = ((latent.float() - ref.float()).norm() / ref.float().norm()).item()
        assert rel < FP8_REL_L2, rel


def _state_checks(name: str, cache: str, log: str, skipped: int) -> None:
    """What a skipped step must not leave stale, read from the run's log."""
    if name == "block_swap":  # one debug line per model call: LazyCache skips the call, EasyCache only the blocks
        lines = re.findall(r"block swap: (\d+) loads \((\d+) on demand\)", log)
        calls = STEPS if cache == "EasyCache" else STEPS - skipped
        assert len(lines) == calls and all(on_demand == "0" for _, on_demand in lines), lines
    if name.startswith("compile"):  # no fallback; a recompile only where the cache's own code is compiled too
        assert "retrying this step with" not in log and "something in the inputs" not in log, log[-3000:]
        recompiles = re.findall(r"new graph\(s\) compiled on call \d+; (.*)", log)
        if name == "compile_blocks" or cache == "LazyCache":  # its wrapper sits outside apply_model
            assert not recompiles, recompiles
        assert all("diffusion-model wrappers (easycache)" in line for line in recompiles), recompiles
    if name == "attention":
        decided = re.findall(r"lowvram_dit attention auto for (\S+ \S+ \S+)", log)
        assert len(decided) == len(set(decided)), decided  # one timed choice per shape, kept across skipped steps


def _combinations() -> list[Any]:
    """Every (cache, pack node, order); CI runs half of them, each pack node with each cache once, in alternating
    orders (so each cache also meets each order); the other half is the slow tier."""
    out = []
    for i, name in enumerate(PACK_NODES):
        for j, cache in enumerate(CACHES):
            for k, order in enumerate(("pack_then_cache", "cache_then_pack")):
                marks = () if (i + j + k) % 2 == 0 else (pytest.mark.slow,)
                out.append(pytest.param(cache, name, order, marks=marks, id=f"{cache}-{name}-{order}"))
    return out


@pytest.mark.parametrize("cache, name, order", _combinations())
def test_pack_node_before_and_after_a_step_cache(comfy_server: Any, wan_file: str, native: dict, cache: str,
                                                 name: str, order: str) -> None:
    node, how = PACK_NODES[name]
    chain = [node, _cache(cache)] if order == "pack_then_cache" else [_cache(cache), node]
    latent, log = _run(comfy_server, _graph(_unet(wan_file), chain))
    ref, ref_skipped = native[cache]
    skipped = _skipped(log, cache)
    assert skipped == ref_skipped, (skipped, ref_skipped)
    _compare(latent, ref, how)
    _state_checks(name, cache, log, skipped)
    if name == "block_swap":  # the ring after a cached run: a plain run through the same Block Swap is exact
        plain, _ = _run(comfy_server, _graph(_unet(wan_file), [node]))
        plain_ref, _ = _run(comfy_server, _graph(_unet(wan_file), []))
        assert torch.equal(plain, plain_ref)


@pytest.mark.parametrize("quantization", ["none", "fp8 per-tensor"])
@pytest.mark.parametrize("cache", list(CACHES))
def test_wan_loader_then_a_step_cache(comfy_server: Any, wan_file: str, native: dict, cache: str,
                                      quantization: str) -> None:
    loader = {"class_type": "LowVRAM_WanLoader", "inputs": {
        "unet_name": wan_file, "quantization": quantization, "block_size": "128", "compute": "auto",
        "save_quantized": False}}
    latent, log = _run(comfy_server, _graph(loader, [_cache(cache)]))
    ref, ref_skipped = native[cache]
    assert _skipped(log, cache) == ref_skipped
    _compare(latent, ref, "exact" if quantization == "none" else "fp8")


# ------------------------------------------------------------------------------------------------ Qwen-Image


def _qwen_graph(files: dict[str, str], cache: str, quantization: str, blocks_to_swap: int) -> dict:
    """Qwen-Image Staged Loader -> the cache -> KSampler (8 steps) -> SaveLatent."""
    return {
        "1": {"class_type": "LowVRAM_QwenImageStagedLoader", "inputs": {
            "unet_name": files["unet"], "clip_name": files["te"], "vae_name": files["vae"], "positive": "a cat",
            "negative": " ", "quantization": quantization, "vram_budget_gb": 0.0, "blocks_to_swap": blocks_to_swap,
            "cache_embeddings": True, "compute": "auto"}},
        "2": {"class_type": cache, "inputs": {"model": ["1", 0], **_cache(cache, QWEN_CACHES)[1]}},
        "lat": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "ks": {"class_type": "KSampler", "inputs": {
            "model": ["2", 0], "positive": ["1", 1], "negative": ["1", 2], "latent_image": ["lat", 0], "seed": 3,
            "steps": STEPS, "cfg": 2.5, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        "save": {"class_type": "SaveLatent", "inputs": {"samples": ["ks", 0],
                                                        "filename_prefix": f"caches/qwen{next(_prefix)}"}},
    }


@pytest.mark.parametrize("cache", list(CACHES))
def test_qwen_image_staged_loader_then_a_step_cache(comfy_server: Any, files: dict, cache: str) -> None:
    """The staged loader as stored and unstreamed is the native model; streaming its one block and fp8 keep the
    cache's decisions."""
    ref, log = _run(comfy_server, _qwen_graph(files, cache, "none", 0))
    ref_skipped = _reference_skips(log, cache, QWEN_CACHES)
    streamed, log = _run(comfy_server, _qwen_graph(files, cache, "none", 1))
    assert _skipped(log, cache) == ref_skipped and "Block Swap: 1 of 1 blocks streamed" in log
    _compare(streamed, ref, "exact")
    fp8, log = _run(comfy_server, _qwen_graph(files, cache, "fp8 per-tensor", 1))
    assert _skipped(log, cache) == ref_skipped
    _compare(fp8, ref, "fp8")


# ------------------------------------------------------------------------------------------------ in process


@pytest.mark.slow  # CI: the whole-model compile combinations above check the same log lines where they occur
def test_whole_model_compile_names_the_step_cache_as_the_reason_for_new_graphs(
        caplog: pytest.LogCaptureFixture) -> None:
    """Whole-model scope traces EasyCache's wrapper: when it starts skipping, a graph is added; the warning says
    that, not "your inputs change", and the output and skipped steps stay the cache's own."""
    from comfy_server import comfyui_in_process_or_skip, sample_wan

    comfyui_in_process_or_skip()
    import logging

    import comfy.sd
    from comfy_extras.nodes_easycache import EasyCacheNode
    from test_comfyui_attention_compile import _CountingCompiler

    from comfyui_lowvram_dit.host.torch_compile import apply_compile
    from comfyui_lowvram_dit.kernels.compile import CompileConfig
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    sd = synth.synthetic_state_dict("wan21_t2v_1_3B", size="tiny", fmt="bf16", seed=0, num_layers=6)
    plain = comfy.sd.load_diffusion_model_state_dict(sd, {"dtype": torch.bfloat16})

    def cached(model: Any) -> Any:
        return EasyCacheNode.execute(model, CACHES["EasyCache"], 0.15, 0.95, False).result[0]

    def run(model: Any) -> tuple[torch.Tensor, str]:
        caplog.clear()
        with caplog.at_level(logging.INFO):
            out = sample_wan(model, seed=1, steps=STEPS, frames=5)
        return out, caplog.text

    ref, log = run(cached(plain))
    torch._dynamo.reset()
    out, compiled_log = run(cached(apply_compile(plain, CompileConfig(), "whole model", compile_fn=_CountingCompiler())))
    torch.testing.assert_close(out, ref, **TOL)
    assert _skipped(compiled_log, "EasyCache") == _skipped(log, "EasyCache") > 0
    lines = [r.getMessage() for r in caplog.records if "new graph(s) compiled" in r.getMessage()]
    assert len(lines) == 1 and "diffusion-model wrappers (easycache)" in lines[0], lines
