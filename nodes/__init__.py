"""The ComfyUI nodes: one module per capability, each exporting ``NODES`` (V3 ``io.ComfyNode`` classes): schemas
and ``execute`` only; what a node does lives in host/.

Imported only by ``comfy_entrypoint`` inside a running ComfyUI. A listed module that does not exist is an
ImportError; one that exists but fails to import (a ComfyUI seam that moved, a missing optional library)
disables its own nodes and logs why, so the rest of the pack and ComfyUI's startup keep working. Each node
class declares the ComfyUI seams it uses (``COMFY_SEAMS``); host/seams.py leaves out, or turns into a
pass-through, a node whose seams this ComfyUI lacks, with one warning naming the node, the seam and the version.
"""

from __future__ import annotations

import importlib
import logging

log = logging.getLogger("comfyui_lowvram_dit")

# Order is the order in the node menu.
NODE_MODULES: tuple[str, ...] = (
    "wan_loader",
    "block_swap",
    "attention",
    "compile",
    "qwen_image",
    "qwen_staged",
    "qwen_edit",
    "wan_text",
    "nan_guard",
    "doctor",
)


def load_node_classes() -> list[type]:
    """Import every node module and collect its ``NODES``.

    A module listed in NODE_MODULES that does not exist is a bug of the pack: ImportError. A module that exists
    but cannot import (a ComfyUI seam that moved, a broken optional library) loses its nodes with a warning, so
    ComfyUI's startup survives it.
    """
    classes: list[type] = []
    for name in NODE_MODULES:
        try:
            module = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name == f"{__name__}.{name}":
                raise ImportError(f"nodes/__init__.py lists node module {name!r}, which does not exist") from exc
            log.warning("lowvram_dit: nodes in %s disabled: %s", name, exc)
            continue
        except Exception as exc:  # a changed ComfyUI seam must not break ComfyUI's startup
            log.warning("lowvram_dit: nodes in %s disabled: %s: %s", name, type(exc).__name__, exc)
            continue
        classes.extend(getattr(module, "NODES", ()))
    try:
        from ..host.seams import guard_nodes
    except Exception as exc:  # the seam check itself must not cost the user every node
        log.warning("lowvram_dit: ComfyUI seam check unavailable (%s: %s); nodes registered unchecked",
                    type(exc).__name__, exc)
        return classes
    return guard_nodes(classes)


def make_extension():  # noqa: ANN201 - comfy_api.latest.ComfyExtension
    """Build the ``ComfyExtension`` that lists the pack's nodes."""
    from comfy_api.latest import ComfyExtension

    class LowVramDitExtension(ComfyExtension):
        async def get_node_list(self) -> list[type]:
            # Called once when ComfyUI loads the pack (0.8.0 has no on_load): the 8-bit attention warm-up hooks
            # into queued prompts and the decisions file is set here, never at import.
            try:
                from ..host.attention import register_prompt_warmup

                register_prompt_warmup()
            except Exception as exc:  # noqa: BLE001 - the nodes load without it (load_node_classes says why)
                logging.getLogger("comfyui_lowvram_dit").debug("lowvram_dit: no prompt warm-up hook (%s)", exc)
            try:  # the kernels' timed choices are kept per machine from here on (one place, set once)
                from ..host.files import keep_decisions

                keep_decisions()
            except Exception as exc:  # noqa: BLE001 - the choices then stay in memory
                logging.getLogger("comfyui_lowvram_dit").warning("lowvram_dit: kernel choices are not kept across "
                                                                 "restarts (%s)", exc)
            try:  # options that write files take only real booleans (host/prompt_inputs.py says why)
                from ..host.prompt_inputs import add_prompt_handler, check_strict_booleans

                add_prompt_handler(check_strict_booleans)
            except Exception as exc:  # noqa: BLE001 - the nodes load without it
                logging.getLogger("comfyui_lowvram_dit").warning("lowvram_dit: no check of file-writing options in "
                                                                 "queued prompts (%s)", exc)
            return load_node_classes()

    return LowVramDitExtension()
