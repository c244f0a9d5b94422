"""The fixture nodes (ids ``LowVRAMTest_*``); imported only inside a running ComfyUI.

Statistics nodes are output nodes that return their numbers as UI output, so a test reads them
from ``ComfyServer.run(api)["outputs"][node_id]`` without saving files.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from comfy_api.latest import ComfyExtension, io

CATEGORY = "lowvram_dit_tests"


def _tensor_stats(t: torch.Tensor) -> dict[str, Any]:
    """Shape, dtype, device and float64 moments of ``t`` (JSON-ready)."""
    f = t.detach().to(device="cpu", dtype=torch.float64)
    finite = bool(torch.isfinite(f).all())
    return {
        "shape": list(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
        "device": str(t.device),
        "finite": finite,
        "mean": float(f.mean()) if f.numel() else 0.0,
        "std": float(f.std()) if f.numel() > 1 else 0.0,
        "min": float(f.min()) if f.numel() else 0.0,
        "max": float(f.max()) if f.numel() else 0.0,
    }


class RandomConditioning(io.ComfyNode):
    """A CONDITIONING of Gaussian noise, so samplers run without a text encoder."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowVRAMTest_RandomConditioning",
            display_name="Random Conditioning (test)",
            category=CATEGORY,
            inputs=[
                io.Int.Input("seed", default=0, min=0, max=2**31 - 1, tooltip="Seed of the CPU generator."),
                io.Int.Input("length", default=16, min=1, max=4096, tooltip="Number of text tokens."),
                # 4096 = umt5-xxl width that Wan's text_embedding expects; Qwen-Image takes 3584.
                io.Int.Input("dim", default=4096, min=1, max=16384, tooltip="Embedding width."),
                io.Float.Input("std", default=1.0, min=0.0, max=100.0, tooltip="Standard deviation."),
            ],
            outputs=[io.Conditioning.Output()],
        )

    @classmethod
    def execute(cls, seed: int, length: int, dim: int, std: float) -> io.NodeOutput:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        cond = torch.randn((1, length, dim), generator=gen, dtype=torch.float32) * std
        return io.NodeOutput([[cond, {}]])


class ConditioningStats(io.ComfyNode):
    """Reports each conditioning entry's tensor statistics and extra keys as UI output."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowVRAMTest_ConditioningStats",
            display_name="Conditioning Stats (test)",
            category=CATEGORY,
            inputs=[io.Conditioning.Input("conditioning", tooltip="Conditioning to describe.")],
            outputs=[],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, conditioning: list) -> io.NodeOutput:
        stats = [{**_tensor_stats(c[0]), "keys": sorted(c[1].keys())} for c in conditioning]
        return io.NodeOutput(ui={"conditioning_stats": stats})


class LatentStats(io.ComfyNode):
    """Reports the LATENT's ``samples`` statistics as UI output."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowVRAMTest_LatentStats",
            display_name="Latent Stats (test)",
            category=CATEGORY,
            inputs=[io.Latent.Input("latent", tooltip="Latent to describe.")],
            outputs=[],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, latent: dict) -> io.NodeOutput:
        stats = {**_tensor_stats(latent["samples"]), "keys": sorted(latent.keys())}
        return io.NodeOutput(ui={"latent_stats": [stats]})


def _model_info(patcher: Any) -> dict[str, Any]:
    """What a MODEL is made of and patched with: classes, dtypes, layer classes, wrappers, patches."""
    model = patcher.model
    diffusion_model = getattr(model, "diffusion_model", None)
    modules = diffusion_model.modules() if diffusion_model is not None else model.modules()
    layer_classes = Counter(f"{type(m).__module__}.{type(m).__qualname__}" for m in modules)
    dtypes = Counter(str(p.dtype).removeprefix("torch.") for p in model.parameters())
    devices = Counter(str(p.device) for p in model.parameters())
    opts = patcher.model_options
    t_opts = opts.get("transformer_options", {})
    return {
        "patcher_class": f"{type(patcher).__module__}.{type(patcher).__qualname__}",
        "model_class": type(model).__name__,
        "diffusion_model_class": type(diffusion_model).__name__ if diffusion_model is not None else None,
        "parameter_dtypes": dict(dtypes),
        "parameter_devices": dict(devices),
        "layer_classes": dict(layer_classes),
        "model_options_keys": sorted(opts.keys()),
        "transformer_options_keys": sorted(t_opts.keys()),
        # {wrapper type: {key: count}}, as comfy.patcher_extension stores them
        "wrappers": {w: {k: len(v) for k, v in d.items()} for w, d in getattr(patcher, "wrappers", {}).items()},
        "callbacks": {c: {k: len(v) for k, v in d.items()} for c, d in getattr(patcher, "callbacks", {}).items()},
        "patches_replace": {k: sorted(map(str, v.keys())) for k, v in t_opts.get("patches_replace", {}).items()},
        "object_patches": sorted(getattr(patcher, "object_patches", {}).keys()),
        "weight_patches": len(getattr(patcher, "patches", {})),
        "load_device": str(patcher.load_device),
        "offload_device": str(patcher.offload_device),
        "model_size_bytes": int(patcher.model_size()),
    }


class ModelInfo(io.ComfyNode):
    """Reports what a MODEL is made of and patched with, so tests can check a pack node's effect."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowVRAMTest_ModelInfo",
            display_name="Model Info (test)",
            category=CATEGORY,
            inputs=[io.Model.Input("model", tooltip="Model to describe.")],
            outputs=[],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, model: Any) -> io.NodeOutput:
        return io.NodeOutput(ui={"model_info": [_model_info(model)]})


class Raise(io.ComfyNode):
    """Raises ``RuntimeError(message)``: checks that failures reach the test with their message."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowVRAMTest_Raise",
            display_name="Raise (test)",
            category=CATEGORY,
            inputs=[io.String.Input("message", default="boom", tooltip="Exception message.")],
            outputs=[],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, message: str) -> io.NodeOutput:
        raise RuntimeError(message)


def _pack_submodule(name: str) -> Any:
    """A module of the pack as ComfyUI loaded it (ComfyUI names a custom-node package after its path)."""
    import importlib
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    for mod_name, mod in list(sys.modules.items()):
        file = getattr(mod, "__file__", None)
        if file and "." not in mod_name.replace("_x_", "") and Path(file).resolve() == repo / "__init__.py":
            return importlib.import_module(f"{mod_name}.{name}")
    raise RuntimeError(f"the pack at {repo} is not loaded in this ComfyUI")


class StreamedCLIPLoader(io.ComfyNode):
    """TEST STAND-IN for ComfyUI's CLIPLoader (types wan and qwen_image), same inputs and CLIP output.

    Stock CLIPLoader builds umT5-XXL / Qwen2.5-VL-7B from ComfyUI's fixed full-size configs, so it cannot load
    the 2-layer synthetic encoders the tests write (the full-size files are 6.7 / 8.3 GB). This node builds the
    same ComfyUI classes (``comfy.sd.CLIP`` with ComfyUI's own tokenizer and encoder) with the sizes read from the
    file, through the pack's streaming builders, so the rest of an official template (CLIPTextEncode,
    TextEncodeQwenImageEditPlus, samplers, LoRAs, VAE) runs as shipped. Used only by
    tests/comfyui/test_comfyui_templates.py on templates that use the stock text encoder.
    """

    @classmethod
    def define_schema(cls) -> io.Schema:
        import folder_paths

        return io.Schema(
            node_id="LowVRAMTest_StreamedCLIPLoader",
            display_name="Streamed CLIP Loader (test stand-in for CLIPLoader)",
            category=CATEGORY,
            inputs=[io.Combo.Input("clip_name", options=folder_paths.get_filename_list("text_encoders")),
                    io.Combo.Input("type", options=["wan", "qwen_image"]),
                    io.Combo.Input("device", options=["default", "cpu"], optional=True)],
            outputs=[io.Clip.Output()],
        )

    @classmethod
    def execute(cls, clip_name: str, type: str, device: str = "default") -> io.NodeOutput:  # noqa: A002
        import folder_paths

        path = folder_paths.get_full_path_or_raise("text_encoders", clip_name)
        if type == "wan":
            return io.NodeOutput(_pack_submodule("host.wan_text").build_umt5_streaming(path))
        return io.NodeOutput(_pack_submodule("host.qwen_stages").build_text_encoder_streaming(path))


# tag -> counters of the attention overrides below, read back by AttentionCounts after the sampler ran.
ATTENTION_COUNTS: dict[str, Any] = {}


def _newer_comfyui() -> Any:
    """tests/newer_comfyui.py (behaviours of newer ComfyUI re-created for tests), imported from its file."""
    import sys
    from pathlib import Path

    tests = str(Path(__file__).resolve().parents[1])
    if tests not in sys.path:
        sys.path.append(tests)
    import newer_comfyui

    return newer_comfyui


class CountingOverride:
    """Another pack's attention override as the house rule wants one: it counts each call and passes it to the
    override that was on the model before it (or to ComfyUI's function when there was none)."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous
        self.calls = 0
        self.fallbacks: Counter = Counter()  # name of the ``func`` each call came with

    def __deepcopy__(self, memo: dict) -> CountingOverride:
        return self  # 0.8.0 deep-copies model options on clone: every clone keeps counting here

    def __call__(self, func: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        self.fallbacks[getattr(func, "__name__", type(func).__name__)] += 1
        if self.previous is not None:
            return self.previous(func, *args, **kwargs)
        return func(*args, **kwargs)

    def counts(self) -> dict[str, Any]:
        """JSON-ready counters."""
        return {"calls": self.calls, "fallbacks": dict(self.fallbacks),
                "previous": type(self.previous).__name__ if self.previous is not None else None}


class CountingAttention(io.ComfyNode):
    """Puts a CountingOverride on top of the model's attention override (chaining the one already there)."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowVRAMTest_CountingAttention",
            display_name="Counting Attention Override (test)",
            category=CATEGORY,
            inputs=[io.Model.Input("model", tooltip="Model to patch."),
                    io.String.Input("tag", default="count", tooltip="Name the counters are read back under.")],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model: Any, tag: str) -> io.NodeOutput:
        m = model.clone()
        opts = m.model_options.setdefault("transformer_options", {})
        ATTENTION_COUNTS[tag] = override = CountingOverride(opts.get("optimized_attention_override"))
        opts["optimized_attention_override"] = override
        return io.NodeOutput(m)


class BlockSparseAttention(io.ComfyNode):
    """ComfyUI's newer "Model Sparse Attention" node as re-created in tests/newer_comfyui.py (CPU stand-in kernel,
    the same chaining and per-step re-assertion)."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowVRAMTest_BlockSparseAttention",
            display_name="Model Sparse Attention (test re-creation)",
            category=CATEGORY,
            inputs=[io.Model.Input("model", tooltip="Model to patch."),
                    io.Float.Input("start_percent", default=0.2, min=0.0, max=1.0, tooltip="Sparse from here."),
                    io.String.Input("tag", default="sparse", tooltip="Name the counters are read back under.")],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model: Any, start_percent: float, tag: str) -> io.NodeOutput:
        m, patch = _newer_comfyui().apply_block_sparse_attention(model, start_percent=start_percent)
        ATTENTION_COUNTS[tag] = patch
        return io.NodeOutput(m)


class AttentionCounts(io.ComfyNode):
    """Reports the counters of a CountingAttention / BlockSparseAttention node after the sampler ran."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowVRAMTest_AttentionCounts",
            display_name="Attention Counts (test)",
            category=CATEGORY,
            inputs=[io.Latent.Input("latent", tooltip="The sampler's output (so this runs after it)."),
                    io.String.Input("tag", default="count", tooltip="The counters' name.")],
            outputs=[],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, latent: dict, tag: str) -> io.NodeOutput:
        found = ATTENTION_COUNTS[tag]
        counts = found.counts() if isinstance(found, CountingOverride) else {
            k: getattr(found, k) for k in ("taken", "declined", "installs", "cleanups")}
        return io.NodeOutput(ui={"attention_counts": [counts]})


NODES = [RandomConditioning, ConditioningStats, LatentStats, ModelInfo, Raise, StreamedCLIPLoader, CountingAttention,
         BlockSparseAttention, AttentionCounts]


def make_extension() -> ComfyExtension:
    """The ``ComfyExtension`` listing :data:`NODES`."""

    class FixtureExtension(ComfyExtension):
        async def get_node_list(self) -> list[type[io.ComfyNode]]:
            return list(NODES)

    return FixtureExtension()
