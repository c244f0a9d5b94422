"""The pack's node menu: one category tree, node ids and one display-name style."""

from __future__ import annotations

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
