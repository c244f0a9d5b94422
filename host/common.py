"""Names shared by every node: one category tree and one display-name style."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CATEGORY = "lowvram_dit"
CATEGORY_LOADERS = f"{CATEGORY}/loaders"
CATEGORY_PATCHES = f"{CATEGORY}/model_patches"
CATEGORY_UTILS = f"{CATEGORY}/utils"


def node_id(name: str) -> str:
    """The pack's node id for ``name`` (prefixed so it never collides with a core id)."""
    return f"LowVRAM_{name}"


def display_name(name: str) -> str:
    """The display name for ``name`` in the pack's one style: ``<name> (LowVRAM)``."""
    return f"{name} (LowVRAM)"


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
    """Map checkpoint files (weights cost page cache, not RAM) unless ComfyUI runs with ``--disable-mmap``."""
    try:
        import comfy.utils

        return not bool(getattr(comfy.utils, "DISABLE_MMAP", False))
    except Exception:  # noqa: BLE001 - outside ComfyUI (tests, scripts): mapping is the default
        return True


def embedding_cache() -> Any:  # kernels.embedding_cache.EmbeddingCache
    """The pack's embedding cache under ComfyUI's user directory (kept across restarts, unlike temp)."""
    import folder_paths

    from ..checkpoints.embedding_cache import EmbeddingCache

    return EmbeddingCache(Path(folder_paths.get_user_directory()).joinpath(*EMBEDDING_CACHE_FOLDER))


_DETECTION_LOCK = threading.Lock()


@contextmanager
def detected_config_defaults(values: dict[str, Any]) -> Iterator[None]:
    """While active, ComfyUI's model detection (``comfy.model_detection.detect_unet_config``) adds ``values`` to
    the config it detects, for keys it did not set itself; the model is then built with them.

    ComfyUI's loaders take no model config, and its detection reads some architectures' sizes from the weights
    but builds others (Qwen-Image's width, heads, joint dimension) at fixed defaults. What it detects itself always
    wins. The module attribute is swapped only for the call (one loader at a time) and restored after.
    """
    if not values:
        yield
        return
    import comfy.model_detection as md

    with _DETECTION_LOCK:
        original = md.detect_unet_config

        def detect(*args: Any, **kwargs: Any) -> Any:
            config = original(*args, **kwargs)
            if isinstance(config, dict):
                for key, value in values.items():
                    config.setdefault(key, value)
            return config

        md.detect_unet_config = detect
        try:
            yield
        finally:
            md.detect_unet_config = original


_MIXED: dict[tuple[type, type], type] = {}


def mixed_class(mixin: type, base: type, prefix: str) -> type:
    """``base`` (a ModelPatcher class) with ``mixin`` in front, named ``<prefix><base>``; cached and idempotent,
    so patchers re-mixed on every node run keep one class (and ``clone()``, which uses ``__class__``, keeps it)."""
    if issubclass(base, mixin):
        return base
    key = (mixin, base)
    if key not in _MIXED:
        _MIXED[key] = type(f"{prefix}{base.__name__}", (mixin, base), {})
    return _MIXED[key]


def dynamic_vram_manages(patcher: Any) -> bool:
    """Whether ComfyUI's DynamicVRAM (``ModelPatcherDynamic``, on by default on NVIDIA since 0.16) owns this
    patcher's VRAM; False on hosts without it and under ``--disable-dynamic-vram``."""
    is_dynamic = getattr(patcher, "is_dynamic", None)
    return bool(is_dynamic()) if callable(is_dynamic) else False


_SAID_ONCE: set[str] = set()


def say_once(logger: Any, message: str) -> None:
    """Log ``message`` as a warning the first time this process says it."""
    if message not in _SAID_ONCE:
        _SAID_ONCE.add(message)
        logger.warning(message)


def load_diffusion_model(state_dict: dict, model_options: dict, reload: tuple[Callable, tuple],
                         disable_dynamic: bool = False, unet_config: dict[str, Any] | None = None) -> Any:
    """``comfy.sd.load_diffusion_model_state_dict``, with the pack's rule for ComfyUI's DynamicVRAM.

    The pack's fp8 layers (``model_options["custom_operations"]``) keep their weights themselves and do not
    implement DynamicVRAM's on-demand weight streaming, so on hosts with DynamicVRAM such a model gets the legacy
    patcher (ComfyUI's own torch.compile node does the same), and Block Swap and the file-backed offload manage
    it; a model built with ComfyUI's own layers stays as UNETLoader builds it. ``reload`` = (loader, args) is
    registered as ``cached_patcher_init``, which ComfyUI calls with ``disable_dynamic=True`` for a fresh copy.
    ``unet_config``: model-config values read from the file that ComfyUI's detection leaves at its defaults
    (see ``detected_config_defaults``)."""
    import inspect

    import comfy.sd

    kwargs = {}
    if "disable_dynamic" in inspect.signature(comfy.sd.load_diffusion_model_state_dict).parameters:
        kwargs["disable_dynamic"] = disable_dynamic or "custom_operations" in model_options
    with detected_config_defaults(unet_config or {}):
        model = comfy.sd.load_diffusion_model_state_dict(state_dict, model_options=model_options, **kwargs)
    if model is not None and hasattr(model, "cached_patcher_init"):
        model.cached_patcher_init = reload
    return model
