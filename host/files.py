"""Model files as ComfyUI knows them: paths' fingerprints, mmap setting, the embedding cache and the kept kernel
decisions under ComfyUI's user directory, input-named errors."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .log import say_once

log = logging.getLogger("comfyui_lowvram_dit")


@contextmanager
def checked_input(node: str, option: str) -> Iterator[None]:
    """Re-raise a CheckpointError (a file refused) as one that starts with the node and the input it came from."""
    from ..checkpoints.safetensors_io import CheckpointError

    try:
        yield
    except CheckpointError as exc:
        raise CheckpointError(f"{node}, {option}: {exc}") from None


# The staged text nodes (Wan Text Encode, Qwen-Image Staged Loader) share one embedding cache and one key recipe.
EMBEDDING_CACHE_FOLDER = ("comfyui-lowvram-dit", "embeddings")


# Timed kernel choices kept across restarts (kernels/decision_store.py), beside the embedding cache.
DECISIONS_FILE = ("comfyui-lowvram-dit", "decisions.json")
KEEP_DECISIONS = True  # False: every process times its choices afresh (tests that plant timings set it)


def file_fingerprint(folder: str, name: str) -> str:
    """``name:size:mtime_ns`` of a model file in a ComfyUI folder (``name:missing`` when absent): a node's
    ``fingerprint_inputs`` so it re-runs when the file changes on disk under the same name."""
    import folder_paths

    path = folder_paths.get_full_path(folder, name)
    try:
        st = Path(path).stat() if path else None
    except OSError:
        st = None
    return f"{name}:{st.st_size}:{st.st_mtime_ns}" if st else f"{name}:missing"


def use_mmap() -> bool:
    """Map checkpoint files (weights cost page cache, not RAM) unless ComfyUI runs with ``--disable-mmap``, or
    with ``--novram`` / ``--lowvram``: there the weights stay in host memory and every step reads them, and a step
    that reads a mapping whose file was cut short meanwhile (overwritten in place by a download) kills the whole
    server with SIGBUS, which no code can catch. Reading into private memory costs RAM instead of page cache."""
    try:
        import comfy.model_management as mm
        import comfy.utils
    except Exception:  # noqa: BLE001 - outside ComfyUI (tests, scripts): mapping is the default
        return True
    if bool(getattr(comfy.utils, "DISABLE_MMAP", False)):
        return False
    state = getattr(mm, "vram_state", None)
    if state is not None and getattr(state, "name", "") in ("NO_VRAM", "LOW_VRAM"):
        say_once(log, f"lowvram_dit: ComfyUI keeps weights in host memory ({state.name}); model files are read "
                 "into memory instead of mapped, so a file changed on disk cannot take the server down")
        return False
    return True


def embedding_cache() -> Any:  # checkpoints.embedding_cache.EmbeddingCache
    """The pack's embedding cache under ComfyUI's user directory (kept across restarts, unlike temp)."""
    import folder_paths

    from ..checkpoints.embedding_cache import EmbeddingCache

    return EmbeddingCache(Path(folder_paths.get_user_directory()).joinpath(*EMBEDDING_CACHE_FOLDER))


def keep_decisions() -> None:
    """Keep the kernels' timed choices (fp8 activation scales, int8 GEMM, attention auto) in ComfyUI's user
    directory, so a restarted server runs what this machine timed before instead of timing a near tie anew. Called
    once when ComfyUI loads the pack's nodes, never at import; without a user directory the choices stay in memory
    (said once)."""
    if not KEEP_DECISIONS:
        return
    from ..kernels.decision_store import keep_in
    from .version import pack_version

    try:
        import folder_paths

        path = Path(folder_paths.get_user_directory()).joinpath(*DECISIONS_FILE)
    except Exception as exc:  # noqa: BLE001 - a missing seam must not fail a model load
        say_once(log, f"lowvram_dit: no ComfyUI user directory ({type(exc).__name__}: {exc}); kernel choices are "
                 "timed again after every restart")
        return
    keep_in(path, pack_version())
