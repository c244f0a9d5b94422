"""Tiny synthetic GGUF files (ComfyUI-GGUF's format) and the vendored ComfyUI-GGUF that reads them, for tests.

A file holds the pack's synthetic state dict (synthetic/: real key names and shapes, random weights) the way
ComfyUI-GGUF's converter stores a diffusion model: ``general.architecture`` names the model, 2-D Linear weights are
quantized (``Q8_0``: ``gguf``'s own quantizer; ``Q4_K``: the ``gguf`` package cannot quantize K-quants, so their
144-byte super-blocks are written from random bytes with small finite scales, which is a valid Q4_K tensor of random
weights), everything else stays F32. Needs the ``gguf`` package (in the ``[test]`` extra); tests skip without it.

``tests/vendor/ComfyUI-GGUF`` is ComfyUI-GGUF's loader, ops, dequant and nodes, verbatim (its README says from
which commit): the test server loads it as a custom node and in-process tests import it as a package.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

VENDORED_GGUF = Path(__file__).resolve().parent / "vendor" / "ComfyUI-GGUF"
GGUF_NODES_FOLDER = "ComfyUI-GGUF"  # its folder name under custom_nodes, as users clone it
ARCH = {"wan": "wan", "qwen": "qwen_image"}  # general.architecture ComfyUI-GGUF expects per model family


def gguf_or_skip() -> ModuleType:
    """The ``gguf`` package, or skip the test saying how to get it."""
    import pytest

    return pytest.importorskip("gguf", reason="the gguf package is missing: pip install -e '.[test]' adds it")


def q4_k_blocks(rows: int, cols: int, gen: np.random.Generator) -> np.ndarray:
    """Random Q4_K super-blocks (256 weights in 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales, 128 of
    nibbles) with d and dmin small enough for a random Linear of width ``cols``."""
    blocks = gen.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    scale = np.float16(0.6 / (63 * 15 * np.sqrt(cols)))
    blocks[..., 0:2] = np.frombuffer(scale.tobytes(), dtype=np.uint8)
    blocks[..., 2:4] = np.frombuffer(np.float16(scale * 4).tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, cols // 256 * 144)


def quantized_bytes(gguf: ModuleType, w: torch.Tensor, qtype: str, gen: np.random.Generator) -> tuple[np.ndarray, object]:
    """(bytes, GGML type) of a 2-D weight in ``qtype``, or in Q8_0 where its width does not fit ``qtype``'s blocks."""
    Q = gguf.GGMLQuantizationType
    rows, cols = w.shape
    if qtype == "Q4_K" and cols % 256 == 0:
        return q4_k_blocks(rows, cols, gen), Q.Q4_K
    return gguf.quants.quantize(w.float().numpy(), Q.Q8_0), Q.Q8_0


def write_gguf(path: Path, state_dict: dict[str, torch.Tensor], arch: str, qtype: str = "Q8_0",
               seed: int = 0) -> dict[str, str]:
    """Write ``state_dict`` as a GGUF diffusion model (``qtype``: "Q8_0" or "Q4_K"); returns key -> GGML type name."""
    gguf = gguf_or_skip()
    gen = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch=arch)
    types = {}
    for key, t in state_dict.items():
        if t.ndim == 2 and t.numel() >= 1024 and t.shape[1] % 32 == 0:
            data, raw = quantized_bytes(gguf, t, qtype, gen)
            writer.add_tensor(key, data, raw_dtype=raw)
            types[key] = raw.name
        else:
            writer.add_tensor(key, t.float().numpy())
            types[key] = "F32"
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def write_tiny_gguf(path: Path, model: str = "wan22_t2v_14B", qtype: str = "Q8_0", seed: int = 0,
                    num_layers: int = 6) -> dict[str, str]:
    """A tiny synthetic ``model`` (synthetic/specs.py) as a GGUF file at ``path``; returns key -> GGML type name."""
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    sd = synth.synthetic_state_dict(model, size="tiny", fmt="bf16", seed=seed, num_layers=num_layers)
    return write_gguf(path, sd, ARCH["qwen" if model.startswith("qwen") else "wan"], qtype, seed)


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
