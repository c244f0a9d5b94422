"""Feature detection of the ComfyUI seams the pack builds on, and what a node does when one is missing.

Every ComfyUI name a node relies on is listed once in ``SEAMS``. A node class declares the seams it needs and
what to do without them:

    COMFY_SEAMS = ("wrappers.apply_model", "model_patcher.wrappers")
    IF_SEAMS_MISSING = "pass_through"   # or "disable"

At registration ``guard_nodes`` (called by nodes/__init__.py) keeps a node whose seams are all present,
leaves out a "disable" node with one warning, and replaces a "pass_through" node (MODEL in, MODEL out) by a
subclass whose execute returns the input model unchanged (one warning at startup, one at the first run).
Every message names the node, the missing ComfyUI name and the running ComfyUI version.

A probe is an import plus ``getattr``; seams that are protocols rather than names (per-block replace patches,
the attention override, custom operations) also run a behaviour check from host/behaviour.py on a tiny CPU
model. Probes import ComfyUI only when called, never raise, and each result is computed once per process.
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import behaviour
from .log import say_once
from .version import comfyui_version

log = logging.getLogger("comfyui_lowvram_dit")

MIN_COMFYUI = "0.8.0"  # pyproject.toml [tool.comfy] requires-comfyui
TESTED_COMFYUI = ("0.8.0", "0.33.0")  # the oldest and newest ComfyUI every seam below was checked on
PASS_THROUGH, DISABLE = "pass_through", "disable"
_RESULTS: dict["Probe", bool] = {}  # a probe's outcome cannot change while ComfyUI runs


@dataclass(frozen=True)
class Probe:
    """``module:attr.path`` must resolve; with ``check``, calling it on that object must return True."""

    target: str
    check: Callable[[Any], bool] | None = None

    def describe(self) -> str:
        """The dotted name a user can search for (and the behaviour it must show, for behaviour probes)."""
        name = self.target.replace(":", ".")
        if self.check is None:
            return name
        return f"{name} (behaviour: {(self.check.__doc__ or self.check.__name__).strip().rstrip('.')})"

    def ok(self) -> bool:
        """True when the target exists (and passes its behaviour check); never raises."""
        if self not in _RESULTS:
            _RESULTS[self] = self._run()
        return _RESULTS[self]

    def _run(self) -> bool:
        try:
            module_name, _, path = self.target.partition(":")
            obj: Any = importlib.import_module(module_name)
            for part in filter(None, path.split(".")):
                obj = getattr(obj, part)
            return True if self.check is None else bool(self.check(obj))
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - ImportError, AttributeError, a changed protocol
            log.debug("lowvram_dit: seam probe %s failed: %s: %s", self.target, type(exc).__name__, exc)
            return False


def forget_probe_results() -> None:
    """Drop cached probe outcomes (for tests that swap the ComfyUI under the pack)."""
    _RESULTS.clear()


def _p(*targets: str) -> tuple[Probe, ...]:
    return tuple(Probe(t) for t in targets)


# Seam name -> probes (all must pass). Where each is used is in the comment.
SEAMS: dict[str, tuple[Probe, ...]] = {
    # Every node module (imported at module top; one that fails to import disables the module in nodes/__init__.py).
    "v3_node_api": _p("comfy_api.latest:ComfyExtension", "comfy_api.latest:io.ComfyNode",
                      "comfy_api.latest:io.Schema", "comfy_api.latest:io.NodeOutput",
                      "comfy_api.latest:io.Model.Input", "comfy_api.latest:ui.PreviewText"),
    # Loaders: model lists and paths; embedding cache under the user directory (host/common.py).
    "folder_paths": _p("folder_paths:get_filename_list", "folder_paths:get_full_path",
                       "folder_paths:get_full_path_or_raise", "folder_paths:get_folder_paths",
                       "folder_paths:get_user_directory"),
    # Block Swap, NaN Guard, Torch Compile: the hook chain around apply_model (host/hooks.py).
    "wrappers.apply_model": _p("comfy.patcher_extension:WrappersMP.APPLY_MODEL"),
    # Block Swap: activation estimate before the model loads.
    "wrappers.prepare_sampling": _p("comfy.patcher_extension:WrappersMP.PREPARE_SAMPLING",
                                    "comfy.sampler_helpers:estimate_memory"),
    # Every MODEL-patching node: clone + keyed wrappers + attachments.
    "model_patcher.wrappers": _p("comfy.model_patcher:ModelPatcher.clone",
                                 "comfy.model_patcher:ModelPatcher.add_wrapper_with_key",
                                 "comfy.model_patcher:ModelPatcher.remove_wrappers_with_key",
                                 "comfy.model_patcher:ModelPatcher.get_wrappers",
                                 "comfy.model_patcher:ModelPatcher.set_attachments",
                                 "comfy.model_patcher:ModelPatcher.get_model_object"),
    # Block Swap: its ModelPatcher subclass overrides these and builds LowVramPatch for LoRA on streamed layers.
    "model_patcher.loading": _p("comfy.model_patcher:ModelPatcher.load", "comfy.model_patcher:ModelPatcher._load_list",
                                "comfy.model_patcher:ModelPatcher.partially_load",
                                "comfy.model_patcher:ModelPatcher.unpatch_model",
                                "comfy.model_patcher:ModelPatcher.detach",
                                "comfy.model_patcher:ModelPatcher.model_size",
                                "comfy.model_patcher:LowVramPatch",
                                "comfy.model_patcher:get_key_weight"),
    # Block Swap, NaN Guard: per-block replace patches (the hooks' block chain), read by the Wan and Qwen-Image
    # forwards.
    "dit.block_replace": (Probe("comfy.ldm.wan.model:WanModel", behaviour.wan_block_replace),
                          Probe("comfy.ldm.qwen_image.model:QwenImageTransformer2DModel",
                                behaviour.qwen_image_block_replace)),
    # Attention: per-model override called by wrap_attn (comfy/ldm/modules/attention.py).
    "attention.override": (Probe("comfy.ldm.modules.attention:optimized_attention", behaviour.attention_override),),
    # Loaders: the fp8 Linear (host/fp8_ops.py) passed as model_options["custom_operations"].
    "ops.custom_operations": (Probe("comfy.sd:load_diffusion_model_state_dict", behaviour.custom_operations),),
    "ops.manual_cast": _p("comfy.ops:manual_cast.Linear.forward_comfy_cast_weights", "comfy.ops:run_every_op",
                          "comfy.ops:uncast_bias_weight", "comfy.float:stochastic_rounding",
                          "comfy.model_management:get_offload_stream", "comfy.model_management:cast_to",
                          "comfy.model_management:sync_stream", "comfy.model_management:device_supports_non_blocking"),
    # Loaders and staged nodes: devices, freeing, sizes, progress bars.
    "model_management": _p("comfy.model_management:get_torch_device", "comfy.model_management:cleanup_models_gc",
                           "comfy.model_management:free_memory", "comfy.model_management:soft_empty_cache",
                           "comfy.model_management:module_size", "comfy.model_management:get_free_memory",
                           "comfy.model_management:sage_attention_enabled", "comfy.utils:ProgressBar"),
    "diffusion_model_loading": _p("comfy.sd:load_diffusion_model_state_dict"),
    # Qwen-Image Staged Loader: the widths read from the file join the config ComfyUI detects
    # (host/model_loading.py detected_config_defaults).
    "model_detection": _p("comfy.model_detection:detect_unet_config"),
    # Wan Text Encode: umT5 built with ComfyUI's own classes, weights streamed in.
    "text_encoder.umt5": _p("comfy.text_encoders.wan:te", "comfy.text_encoders.wan:WanT5Tokenizer",
                            "comfy.text_encoders.sd3_clip:t5_xxl_detect", "comfy.utils:convert_old_quants",
                            "comfy.sd:CLIP.tokenize", "comfy.sd:CLIP.encode_from_tokens_scheduled"),
    # Qwen-Image Staged Loader: Qwen2.5-VL built the way load_text_encoder_state_dicts(QWEN_IMAGE) does.
    "text_encoder.qwen25_vl": _p("comfy.text_encoders.qwen_image:te",
                                 "comfy.text_encoders.qwen_image:QwenImageTokenizer",
                                 "comfy.sd:detect_te_model", "comfy.sd:TEModel.QWEN25_7B", "comfy.sd:llama_detect",
                                 "comfy.utils:convert_old_quants", "comfy.sd:CLIP.tokenize",
                                 "comfy.sd:CLIP.encode_from_tokens_scheduled"),
    # Qwen-Image-Edit Staged Loader: ComfyUI's own edit encode node, called with a served clip and the VAE.
    "text_encoder.qwen_image_edit": _p("comfy_extras.nodes_qwen:TextEncodeQwenImageEditPlus.execute",
                                       "node_helpers:conditioning_set_values", "comfy.sd:VAE.encode"),
    # Qwen-Image Staged Loader / Decode: VAE as VAELoader builds it, tiled decode (memory_used_decode is set per
    # instance in VAE.__init__, so it cannot be probed on the class).
    "vae": _p("comfy.sd:VAE.decode", "comfy.sd:VAE.decode_tiled",
              "comfy.sd:VAE.spacial_compression_decode", "comfy.sd:VAE.temporal_compression_decode",
              "comfy.sd:VAE.throw_exception_if_invalid", "comfy.utils:load_torch_file"),
}

# Seams of host/block_swap.py's apply_block_swap (also needed by the Qwen-Image Staged Loader, which calls it).
BLOCK_SWAP_SEAMS = ("wrappers.apply_model", "wrappers.prepare_sampling", "model_patcher.wrappers",
                    "model_patcher.loading", "dit.block_replace")


def missing_probes(name: str) -> list[str]:
    """The ComfyUI names of seam ``name`` that this ComfyUI lacks (an unknown seam name is reported as missing)."""
    probes = SEAMS.get(name)
    if probes is None:
        return [f"(unknown seam {name!r} in host/seams.py)"]
    return [p.describe() for p in probes if not p.ok()]


def missing_seams(names: tuple[str, ...] | list[str]) -> list[str]:
    """The seams among ``names`` that this ComfyUI lacks."""
    return [n for n in names if missing_probes(n)]


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])


def seam_problem(node_name: str, names: tuple[str, ...] | list[str], action: str = "is disabled") -> str | None:
    """None when every seam in ``names`` is present, else the message naming the node, the gap and the version."""
    gaps = [g for n in names for g in missing_probes(n)]
    if not gaps:
        return None
    version = (comfyui_version() or "unknown")
    what = ", ".join(gaps[:3]) + (f" (and {len(gaps) - 3} more)" if len(gaps) > 3 else "")
    message = f"{node_name} {action}: this ComfyUI ({version}) lacks {what}; "
    v = _version_tuple(version)
    if v and v < _version_tuple(MIN_COMFYUI):
        return message + f"the pack needs ComfyUI >= {MIN_COMFYUI}. Update ComfyUI."
    checked = " to ".join(TESTED_COMFYUI)
    return message + (f"the pack needs ComfyUI >= {MIN_COMFYUI} and was checked on {checked}; a newer ComfyUI may "
                      "have moved it: update comfyui-lowvram-dit (or report it with this message).")


def seam_status() -> dict[str, str]:
    """Every seam -> "ok" or "missing: <names>" (for the Doctor node)."""
    out = {}
    for name in SEAMS:
        gaps = missing_probes(name)
        out[name] = "ok" if not gaps else "missing: " + ", ".join(gaps)
    return out


def _label(cls: type) -> str:
    """The node's display name (its class name if the schema cannot be built)."""
    try:
        return str(cls.define_schema().display_name or cls.__name__)
    except Exception:  # noqa: BLE001 - a schema that needs a missing seam (folder_paths) must not stop the check
        return cls.__name__


def _pass_through_class(cls: type, message: str) -> type | None:
    """A subclass of ``cls`` whose execute returns its MODEL input unchanged; None if ``cls`` is not MODEL -> MODEL."""
    from comfy_api.latest import io

    schema = cls.define_schema()
    model_inputs = [i.id for i in schema.inputs or [] if getattr(i, "io_type", None) == "MODEL"]
    outputs = [getattr(o, "io_type", None) for o in schema.outputs or []]
    if len(model_inputs) != 1 or outputs != ["MODEL"]:
        return None
    model_arg = model_inputs[0]
    define_schema = cls.define_schema  # bound to the original class

    def _define_schema(c: type) -> Any:
        s = define_schema()
        s.description = f"{message}\n\n{s.description or ''}".strip()
        return s

    def _execute(c: type, **kwargs: Any) -> Any:
        say_once(log, f"lowvram_dit: {message}")
        return io.NodeOutput(kwargs[model_arg])

    return type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                       "__doc__": cls.__doc__, "define_schema": classmethod(_define_schema),
                                       "execute": classmethod(_execute), "SEAM_PROBLEM": message})


def guard_node(cls: type) -> type | None:
    """``cls`` itself, its pass-through twin, or None (left out), per its ``COMFY_SEAMS`` / ``IF_SEAMS_MISSING``."""
    names = tuple(getattr(cls, "COMFY_SEAMS", ()) or ())
    if not names or not missing_seams(names):
        return cls
    policy = getattr(cls, "IF_SEAMS_MISSING", DISABLE)
    label = _label(cls)
    if policy == PASS_THROUGH:
        message = seam_problem(label, names, "passes the model through unchanged")
        try:
            twin = _pass_through_class(cls, message)
        except Exception as exc:  # noqa: BLE001 - the schema itself needs something missing: disable instead
            log.debug("lowvram_dit: no pass-through for %s (%s)", cls.__name__, exc)
            twin = None
        if twin is not None:
            log.warning("lowvram_dit: %s", message)
            return twin
    log.warning("lowvram_dit: %s", seam_problem(label, names))
    return None


def guard_nodes(classes: list[type]) -> list[type]:
    """Apply ``guard_node`` to every class; a failure inside the check keeps the node (logged) rather than crash."""
    out = []
    for cls in classes:
        try:
            guarded = guard_node(cls)
        except Exception as exc:  # noqa: BLE001 - the check must never break ComfyUI's startup
            log.warning("lowvram_dit: could not check the ComfyUI seams of %s (%s: %s); keeping it",
                        getattr(cls, "__name__", cls), type(exc).__name__, exc)
            guarded = cls
        if guarded is not None:
            out.append(guarded)
    return out
