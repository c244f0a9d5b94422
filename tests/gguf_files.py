"""Tiny synthetic GGUF files (ComfyUI-GGUF's format) and the vendored ComfyUI-GGUF that reads them, for tests.

A file holds the pack's synthetic model (synthetic/: real key names and shapes, random weights) as
synthetic/gguf_checkpoints.py writes it (Q8_0 or Q4_K Linear weights, the rest F32), tiny here and full-size in the
render benchmark. Needs the ``gguf`` package (in the ``[test]`` extra); tests skip without it.

``tests/vendor/ComfyUI-GGUF`` is ComfyUI-GGUF's loader, ops, dequant and nodes, verbatim (its README says from
which commit): the test server loads it as a custom node and in-process tests import it as a package.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

from comfyui_lowvram_dit.benchmarks.server import VENDORED_GGUF
from comfyui_lowvram_dit.synthetic.gguf_checkpoints import write_synthetic_gguf


def gguf_or_skip() -> ModuleType:
    """The ``gguf`` package, or skip the test saying how to get it."""
    import pytest

    return pytest.importorskip("gguf", reason="the gguf package is missing: pip install -e '.[test]' adds it")


def write_tiny_gguf(path: Path, model: str = "wan22_t2v_14B", qtype: str = "Q8_0", seed: int = 0,
                    num_layers: int = 6) -> dict[str, str]:
    """A tiny synthetic ``model`` (synthetic/specs.py) as a GGUF file at ``path``; returns key -> GGML type name."""
    gguf_or_skip()
    return write_synthetic_gguf(model, path, qtype, "tiny", seed, num_layers=num_layers)


def import_vendored_gguf() -> ModuleType:
    """The vendored ComfyUI-GGUF package with its ``nodes``, ``ops``, ``loader`` and ``dequant`` modules imported
    (in this process, once).

    Needs ComfyUI imported in process and ``gguf``. Its package ``__init__`` is not run (it registers nodes), and
    its ``import nodes`` (ComfyUI's node module, read only by its CLIP loaders' inputs) gets an empty stand-in
    while it imports: here the pack's own ``nodes/`` would answer that name."""
    gguf_or_skip()
    name = "comfyui_gguf_vendored"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, VENDORED_GGUF / "__init__.py",
                                                      submodule_search_locations=[str(VENDORED_GGUF)])
        sys.modules[name] = importlib.util.module_from_spec(spec)
        stand_in = "nodes" not in sys.modules
        if stand_in:
            sys.modules["nodes"] = ModuleType("nodes")
        try:
            importlib.import_module(f"{name}.nodes")
        finally:
            if stand_in:
                del sys.modules["nodes"]
    return sys.modules[name]


def load_gguf_in_process(path: Path, widths: dict | None = None):  # noqa: ANN201 - ModelPatcher
    """What ``UnetLoaderGGUF`` returns for ``path`` (its loader, ops and patcher), built in this process;
    ``widths``: model-config values ComfyUI's detection leaves at their defaults (a tiny Qwen-Image's)."""
    import comfy.sd

    from comfyui_lowvram_dit.host.model_loading import detected_config_defaults

    vendored = import_vendored_gguf()
    sd = vendored.loader.gguf_sd_loader(str(path))
    with detected_config_defaults(widths or {}):
        model = comfy.sd.load_diffusion_model_state_dict(sd, model_options={"custom_operations": vendored.ops.GGMLOps()})
    return vendored.nodes.GGUFModelPatcher.clone(model)


def tiny_lora(model: str = "wan22_t2v_14B", num_layers: int = 6, seed: int = 0, rank: int = 4) -> dict:
    """A LoRA for the tiny ``model`` in ComfyUI's key format: every Linear in its blocks (``lora_down``/``lora_up``),
    and a bias difference (``diff_b``) on each block's first Linear, so F32 tensors get patches too."""
    from comfyui_lowvram_dit.synthetic.specs import model_spec

    gen = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    firsts: set[str] = set()
    for name, shape, _ in model_spec(model, "tiny", num_layers=num_layers):
        block = name.split(".")[1] if name.startswith(("blocks.", "transformer_blocks.")) else None
        if block is None or not name.endswith(".weight") or len(shape) != 2:
            continue
        key = "diffusion_model." + name[: -len(".weight")]
        sd[f"{key}.lora_down.weight"] = torch.randn(rank, shape[1], generator=gen) * 0.05
        sd[f"{key}.lora_up.weight"] = torch.randn(shape[0], rank, generator=gen) * 0.05
        sd[f"{key}.alpha"] = torch.tensor(float(rank))
        if block not in firsts:
            firsts.add(block)
            sd[f"{key}.diff_b"] = torch.randn(shape[0], generator=gen) * 0.05
    return sd
