"""Checks a loader can make on the queued graph before loading anything: does the VAE that will decode this
model's latents fit it?

ComfyUI widens an empty latent to whatever the model wants, so a Wan 2.2 TI2V-5B file (48 latent channels) wired
into a graph with the Wan 2.1 VAE (16 channels), or a 14B expert with the Wan 2.2 VAE, samples the whole run and
fails only in VAE Decode. The loader sees the whole prompt (ComfyUI's hidden ``PROMPT`` input, the API graph:
node id -> {"class_type", "inputs"}, a link is ``[source id, output index]``), finds the decoders whose latent
descends from it and reads the header of each decoder's VAE file (a stock VAE Loader's), no tensor data.

Nothing here may stop a valid workflow: any graph shape it does not understand (custom decoders, a VAE from
another node, odd prompt content) is skipped, and only a Wan VAE whose channels are known and differ is reported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoints.safetensors_io import CheckpointError, read_header

DECODERS = ("VAEDecode", "VAEDecodeTiled")
VAE_LOADERS = ("VAELoader",)
WAN_VAE_KEY = "decoder.middle.0.residual.0.gamma"  # what ComfyUI's VAE detection looks for (Wan 2.1 and 2.2)
TAEHV_KEY = "decoder.22.bias"  # ComfyUI's key for a tiny video autoencoder (TAEHV, lighttaew2_1 / lighttaew2_2)
_MAX_NODES = 100_000  # a prompt larger than this is not walked (the check is skipped, never slow)


@dataclass(frozen=True)
class VaeMismatch:
    """A decoder of this model's latents whose VAE gives ``vae_channels`` latent channels."""

    decoder_id: str
    decoder_type: str
    vae_loader_id: str
    vae_name: str
    vae_channels: int


def wan_vae_latent_channels(path: str | Path) -> int | None:
    """Latent channels of a Wan VAE file from its header (16: Wan 2.1, 48: Wan 2.2), or of a tiny video
    autoencoder (TAEHV: the input channels of its first decoder conv, as ComfyUI reads them); None for anything
    else."""
    try:
        tensors = read_header(path).tensors
    except (CheckpointError, OSError, ValueError):
        return None  # unreadable here: VAELoader reports it with its own message
    first = tensors.get("decoder.1.weight")
    if TAEHV_KEY in tensors and WAN_VAE_KEY not in tensors:
        return int(first.shape[1]) if first is not None and len(first.shape) == 4 else None
    conv2 = tensors.get("conv2.weight")
    if WAN_VAE_KEY not in tensors or conv2 is None or not conv2.shape:
        return None
    return int(conv2.shape[0])


def _link_source(value: Any) -> str | None:
    """The source node id of an input value when it is a link ``[id, index]``."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[1], int) \
            and isinstance(value[0], (str, int)) and not isinstance(value[0], bool):
        return str(value[0])
    return None


def _nodes(prompt: Any) -> dict[str, dict]:
    """The prompt's well-formed nodes by id (a dict with a string class_type and a dict of inputs)."""
    if not isinstance(prompt, dict) or len(prompt) > _MAX_NODES:
        return {}
    return {str(k): n for k, n in prompt.items()
            if isinstance(n, dict) and isinstance(n.get("class_type"), str) and isinstance(n.get("inputs"), dict)}


def downstream(nodes: dict[str, dict], start: str) -> set[str]:
    """Ids of every node that takes (directly or through others) an output of ``start``."""
    consumers: dict[str, list[str]] = {}
    for nid, node in nodes.items():
        for value in node["inputs"].values():
            src = _link_source(value)
            if src is not None:
                consumers.setdefault(src, []).append(nid)
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nid in consumers.get(todo.pop(), []):
            if nid not in seen:
                seen.add(nid)
                todo.append(nid)
    return seen


def mismatched_vaes(prompt: Any, loader_id: Any, latent_channels: int,
                    vae_path: Callable[[str], str | Path | None]) -> list[VaeMismatch]:
    """Decoders of ``loader_id``'s latents whose (stock-loaded) Wan VAE has other than ``latent_channels``."""
    nodes = _nodes(prompt)
    if loader_id is None or str(loader_id) not in nodes:
        return []
    below = downstream(nodes, str(loader_id))
    found = []
    for nid in sorted(below):
        node = nodes[nid]
        if node["class_type"] not in DECODERS or _link_source(node["inputs"].get("samples")) not in below:
            continue
        src = _link_source(node["inputs"].get("vae"))
        loader = nodes.get(src or "")
        name = loader["inputs"].get("vae_name") if loader and loader["class_type"] in VAE_LOADERS else None
        if not isinstance(name, str):
            continue
        try:
            path = vae_path(name)
        except Exception:  # noqa: BLE001 - a name the folder lookup refuses is VAELoader's to report
            continue
        channels = wan_vae_latent_channels(path) if path else None
        if channels is not None and channels != latent_channels:
            found.append(VaeMismatch(nid, node["class_type"], str(src), name, channels))
    return found


def vae_mismatch_message(model_file: str, loader_id: Any, latent_channels: int,
                         mismatches: list[VaeMismatch]) -> str:
    """One error for the user: which file makes which latents, which VAE cannot decode them, what to load."""
    want = ("the Wan 2.2 VAE (wan2.2_vae.safetensors; Wan22ImageToVideoLatent for the empty latent)"
            if latent_channels == 48 else "the Wan 2.1 VAE (wan_2.1_vae.safetensors)")
    parts = [f"{m.decoder_type} (node {m.decoder_id}) would decode them with {m.vae_name} (VAE Loader, node "
             f"{m.vae_loader_id}), a {m.vae_channels}-channel VAE" for m in mismatches]
    return (f"{model_file} (Wan Loader, node {loader_id}) makes {latent_channels}-channel latents, but "
            + "; ".join(parts) + f". Load {want} in that VAE Loader; the run was stopped before sampling.")
