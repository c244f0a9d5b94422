"""The model files a workflow names, for ``run``: which official files they are, and their synthetic stand-ins.

``write_synthetic_models`` writes a tiny (or full-size) random-weight file under each official name a workflow
uses, cached between runs; the cache is checked by reading headers as JSON, so a cached run never imports torch.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator
from pathlib import Path

from ..checkpoints.safe_write import write_report
from ..synthetic.lora import KNOWN_LORA_FILES, write_synthetic_loras
from ..synthetic.tiny import TINY_TE_LAYERS, TINY_ZERO_PREFIXES, tiny_text_encoder_config
from .server import MODEL_FOLDERS, RunError
from .ui_graph import all_nodes

# Official ComfyUI repackaged file names -> (model folder, synthetic model, synthetic format).
KNOWN_MODEL_FILES: dict[str, tuple[str, str, str]] = {
    "wan2.2_t2v_high_noise_14B_fp16.safetensors": ("diffusion_models", "wan22_t2v_14B", "fp16"),
    "wan2.2_t2v_low_noise_14B_fp16.safetensors": ("diffusion_models", "wan22_t2v_14B", "fp16"),
    "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors": ("diffusion_models", "wan22_t2v_14B", "fp8_scaled"),
    "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors": ("diffusion_models", "wan22_t2v_14B", "fp8_scaled"),
    "wan2.2_i2v_high_noise_14B_fp16.safetensors": ("diffusion_models", "wan22_i2v_14B", "fp16"),
    "wan2.2_i2v_low_noise_14B_fp16.safetensors": ("diffusion_models", "wan22_i2v_14B", "fp16"),
    "wan2.2_i2v_high_noise_14B_fp8_scaled.safetensors": ("diffusion_models", "wan22_i2v_14B", "fp8_scaled"),
    "wan2.2_i2v_low_noise_14B_fp8_scaled.safetensors": ("diffusion_models", "wan22_i2v_14B", "fp8_scaled"),
    "wan2.2_ti2v_5B_fp16.safetensors": ("diffusion_models", "wan22_ti2v_5B", "fp16"),
    "qwen_image_bf16.safetensors": ("diffusion_models", "qwen_image", "bf16"),
    "qwen_image_fp8_e4m3fn.safetensors": ("diffusion_models", "qwen_image", "fp8"),
    "qwen_image_edit_2509_fp8_e4m3fn.safetensors": ("diffusion_models", "qwen_image", "fp8"),
    "qwen_image_edit_2511_fp8mixed.safetensors": ("diffusion_models", "qwen_image", "fp8"),
    "umt5_xxl_fp16.safetensors": ("text_encoders", "umt5_xxl_enc", "fp16"),
    "umt5_xxl_fp8_e4m3fn_scaled.safetensors": ("text_encoders", "umt5_xxl_enc", "fp8_scaled"),
    "qwen_2.5_vl_7b.safetensors": ("text_encoders", "qwen25_vl_7b", "bf16"),
    "qwen_2.5_vl_7b_fp8_scaled.safetensors": ("text_encoders", "qwen25_vl_7b", "fp8_scaled"),
    "wan_2.1_vae.safetensors": ("vae", "wan21_vae", "fp16"),
    "wan2.2_vae.safetensors": ("vae", "wan22_vae", "fp16"),
    "qwen_image_vae.safetensors": ("vae", "wan21_vae", "fp16"),
    "lighttaew2_2.safetensors": ("vae_approx", "wan22_tae", "fp16"),  # VAELoader reads lighttae* from vae_approx
}

# Nodes that stream their text encoder and read its sizes from the file: --synthetic tiny writes them a
# TINY_TE_LAYERS-layer encoder; stock CLIPLoader needs ComfyUI's fixed full-size one (6.7 GB umT5 / 8.3 GB Qwen2.5-VL
# fp8).
STAGED_TEXT_NODES = ("LowVRAM_WanTextEncode", "LowVRAM_QwenImageTextEncode", "LowVRAM_QwenImageEditTextEncode",
                     "LowVRAM_QwenImageStagedLoader", "LowVRAM_QwenImageEditStagedLoader")
QWEN_IMAGE_NODES = ("LowVRAM_QwenImageLoader", "LowVRAM_QwenImageStagedLoader", "LowVRAM_QwenImageEditStagedLoader")
# Staged nodes that also run the Qwen2.5-VL vision tower (image prompts): their tiny encoder carries it.
VISION_TEXT_NODES = ("LowVRAM_QwenImageEditStagedLoader", "LowVRAM_QwenImageEditTextEncode")
VISION_KEY = "visual.merger.mlp.2.weight"  # present in a text encoder file with the vision tower

# VAEs that ComfyUI builds at full size whatever the file holds (the Wan 2.2 VAE's widths are fixed in comfy/sd.py:
# 1.4 GB even for random weights): --synthetic tiny loads the tiny autoencoder of the same latent space instead,
# which stock VAELoader recognises by its keys (comfy/taesd/taehv.py). Decoding only: ComfyUI 0.8.0's TAEHV for
# 48 channels cannot encode, so a workflow that encodes an image with it fails there.
TINY_VAE_SWAPS = {"wan2.2_vae.safetensors": "lighttaew2_2.safetensors"}

# Stamped into the metadata of the files --synthetic tiny writes; a cached tiny file with another value has another
# layout and is written again.
TINY_LAYOUT = "2"
SYNTHETIC_MARK = "comfyui_lowvram_dit"  # the "synthetic" metadata value of synthetic/checkpoints.py's files


def _nodes(workflow: dict, instances: bool = True) -> Iterator[tuple[str | None, list]]:
    """(node type, widget values / inputs) of every node of a UI (subgraphs too) or API workflow; ``instances=False``
    leaves out the nodes that stand for a subgraph."""
    if "nodes" in workflow:
        for node in all_nodes(workflow, instances):
            wv = node.get("widgets_values")
            yield node.get("type"), list(wv.values()) if isinstance(wv, dict) else list(wv or [])
    else:
        for node in workflow.values():
            yield node.get("class_type"), list(node.get("inputs", {}).values())


def referenced_model_files(workflow: dict) -> set[str]:
    """Every ``*.safetensors`` name in a UI or API workflow's widget values / inputs."""
    return {v for _, values in _nodes(workflow) for v in values if isinstance(v, str) and v.endswith(".safetensors")}


def _node_strings(workflow: dict) -> Iterator[tuple[str | None, set[str]]]:
    for node_type, values in _nodes(workflow, instances=False):
        yield node_type, {v for v in values if isinstance(v, str)}


def staged_text_encoder_files(workflow: dict) -> set[str]:
    """Model names used by the pack's streaming text-encoder nodes only (never also by another node)."""
    staged: set[str] = set()
    other: set[str] = set()
    for node_type, names in _node_strings(workflow):
        (staged if node_type in STAGED_TEXT_NODES else other).update(names)
    return staged - other


def vision_text_encoder_files(workflow: dict) -> set[str]:
    """Known text encoder file names a node that runs the vision tower (VISION_TEXT_NODES) uses."""
    return {n for node_type, names in _node_strings(workflow) if node_type in VISION_TEXT_NODES for n in names
            if KNOWN_MODEL_FILES.get(n, ("",))[0] == "text_encoders"}


def stock_loaded_qwen_image_files(workflow: dict) -> set[str]:
    """Qwen-Image transformer files a node other than the pack's Qwen-Image loaders loads (e.g. stock UNETLoader).

    The tiny synthetic Qwen-Image is narrow: only the pack's loaders read its widths from the file, while ComfyUI
    builds Qwen-Image at its fixed full width, so such a workflow cannot run on tiny files."""
    return {n for node_type, names in _node_strings(workflow) if node_type not in QWEN_IMAGE_NODES
            for n in names if KNOWN_MODEL_FILES.get(n, ("", ""))[1] == "qwen_image"}


def swap_tiny_vaes(workflow: dict) -> list[tuple[str, str]]:
    """Point every VAE Loader of a UI or API workflow that names a TINY_VAE_SWAPS file at its tiny stand-in, in
    place; returns the (official, stand-in) names it changed."""
    done = []
    if "nodes" in workflow:
        for node in all_nodes(workflow):  # subgraphs too, as referenced_model_files reads them
            wv = node.get("widgets_values")
            if node.get("type") == "VAELoader" and isinstance(wv, list) and wv and wv[0] in TINY_VAE_SWAPS:
                done.append((wv[0], TINY_VAE_SWAPS[wv[0]]))
                wv[0] = TINY_VAE_SWAPS[wv[0]]
    else:
        for node in workflow.values():
            inputs = node.get("inputs", {}) if isinstance(node, dict) else {}
            name = inputs.get("vae_name")
            if node.get("class_type") == "VAELoader" and isinstance(name, str) and name in TINY_VAE_SWAPS:
                done.append((name, TINY_VAE_SWAPS[name]))
                inputs["vae_name"] = TINY_VAE_SWAPS[name]
    return done


def _header(path: Path) -> dict:
    """The safetensors header (8-byte length + JSON) of a file, {} when unreadable."""
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            return json.loads(f.read(size)) if size < (100 << 20) else {}
    except (OSError, struct.error, ValueError):
        return {}


def _stale_tiny_file(path: Path) -> bool:
    """A tiny file this runner wrote with another layout (TINY_LAYOUT); files it did not write are never stale."""
    meta = _header(path).get("__metadata__", {})
    return meta.get("synthetic") == SYNTHETIC_MARK and meta.get("size") == "tiny" \
        and meta.get("tiny_layout") != TINY_LAYOUT


def _has_vision_tower(path: Path) -> bool:
    return VISION_KEY in _header(path)


def _layer_count(path: Path) -> int | None:
    """Blocks/layers of an existing text encoder file (None when unreadable)."""
    keys = _header(path)
    if not keys:
        return None
    pat = re.compile(r"(?:encoder\.block|model\.layers)\.(\d+)\.")
    return len({m.group(1) for k in keys if (m := pat.match(k))})


def _cached(path: Path, folder: str, size: str, reduced: bool, vision: bool) -> bool:
    """Whether ``path`` holds the file wanted; one of the other kind (e.g. cached for a stock loader when a staged
    node wants it, or with another tiny layout) is deleted."""
    if not path.exists():
        return False
    if (folder == "text_encoders" and (_layer_count(path) == TINY_TE_LAYERS) != reduced) \
            or (reduced and _has_vision_tower(path) != vision) or (size == "tiny" and _stale_tiny_file(path)):
        path.unlink()
        return False
    return True


def write_synthetic_models(names: set[str], models_dir: Path, size: str = "tiny",
                           reduced_text_encoders: set[str] = frozenset(),
                           vision_text_encoders: set[str] = frozenset()) -> list[Path]:
    """Write a synthetic model under each known file name (cached: an existing file of the right kind is kept).

    Names in ``reduced_text_encoders`` get a 2-layer encoder (synthetic/tiny.py), with the vision tower when they
    are also in ``vision_text_encoders``; other text encoders keep ComfyUI's full config (stock loaders cannot read
    anything else). ``size="full"`` writes the real sizes (a 14B fp8 expert is ~14 GB), generated on the GPU when
    there is one. Prints one line per file it writes and nothing when every file is cached.
    """
    loras = {n for n in names if n in KNOWN_LORA_FILES}
    names = {n for n in names if n not in loras}
    unknown = sorted(n for n in names if n not in KNOWN_MODEL_FILES)
    if unknown:
        raise RunError(
            f"--synthetic cannot make {', '.join(unknown)}: not an official file name this runner knows "
            f"({', '.join(sorted({*KNOWN_MODEL_FILES, *KNOWN_LORA_FILES}))}); give real files with --models instead"
        )
    todo: list[tuple[Path, str, str, bool, bool]] = []
    paths = []
    for name in sorted(names):
        folder, model, fmt = KNOWN_MODEL_FILES[name]
        path = models_dir / folder / name
        reduced = size == "tiny" and name in reduced_text_encoders and folder == "text_encoders"
        vision = reduced and name in vision_text_encoders
        if not _cached(path, folder, size, reduced, vision):
            todo.append((path, model, fmt, reduced, vision))
        paths.append(path)
    if todo:
        _write_models(todo, models_dir, size)
    return paths + write_synthetic_loras(loras, models_dir, size)


def _write_models(todo: list[tuple[Path, str, str, bool, bool]], models_dir: Path, size: str) -> None:
    from ..synthetic.checkpoints import write_synthetic  # imports torch: only when a file is missing

    device = "cpu"
    if size == "full":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"writing {len(todo)} synthetic {size} model file(s) (random weights) to {models_dir}", flush=True)
    for path, model, fmt, reduced, vision in todo:
        config = tiny_text_encoder_config(model, vision) if reduced else None
        what = f"{TINY_TE_LAYERS}-layer " if config is not None else ""
        what += "(vision tower blocks zero, sparse) " if vision else ""
        print(f"  {what}{model} ({fmt}) -> {path.relative_to(models_dir)}", flush=True)
        write_synthetic(model, path, size=size, fmt=fmt, config=config, device=device,
                        metadata={"tiny_layout": TINY_LAYOUT} if size == "tiny" else None,
                        zeros=TINY_ZERO_PREFIXES if vision else ())


def extra_model_paths_yaml(models_dir: Path, path: Path) -> Path:
    """An extra_model_paths.yaml that adds ``models_dir/<folder>`` for every model folder."""
    lines = ["lowvram_dit_models:", f"    base_path: {json.dumps(str(models_dir))}"]
    lines += [f"    {folder}: {folder}/" for folder in MODEL_FOLDERS]
    write_report(path, "\n".join(lines) + "\n")
    return path
