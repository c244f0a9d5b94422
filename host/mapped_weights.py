"""Weights served from a checkpoint's file mapping stay file-backed through ComfyUI's load / offload / unload.

Our loaders map pre-quantized files (``checkpoints/safetensors_io.py map_tensors``): a mapped weight costs page cache, not
anonymous RAM, which is what keeps two Wan 2.2 experts (or Qwen-Image's 20 GB) inside 32 GB of RAM. Two stock
ModelPatcher steps would turn them into anonymous copies:

- Pinning an offloaded weight (``pin_weight_to_device`` -> ``cudaHostRegister``, writable) makes the kernel
  copy every page of a private file mapping (copy-on-write): RAM grows by the pinned size. Mapped weights are
  left unpinned (their H2D copies are pageable; ComfyUI's ``--disable-pinned-memory`` behaves the same).
- Unloading (``unpatch_model`` / ``partially_unload``: ``module.to(offload_device)``) copies each GPU weight into
  fresh CPU memory. An unpatched weight is identical to its file view, so it is pointed back at the view
  instead: the copy is never made (full unload) or freed at once (partial unload, at the pin step).
- Loading (``module.to(device)``) reads each weight's file pages for the copy, and they would stay in RSS beside the
  GPU copy (peak RSS = the loaded size again). They are dropped as each module moves, and as each LoRA-patched
  weight is merged onto the device; the page cache keeps them.

A mapped file that is truncated or rewritten in place while the model lives would crash the process (SIGBUS) or
mix old and new weights the next time its pages are read. Each file's size, mtime and inode are recorded with the
views, and every sampling run checks them first (an OUTER_SAMPLE wrapper) and fails with a message naming the file.
A file deleted or replaced by a new one (rename) is harmless: the mapping keeps the old inode's data. What remains
unavoidable: a file truncated during a sampling run, after the check (the kernel delivers SIGBUS on the next read).

Weights with patches (LoRA, hooks) or backups are left to ComfyUI, and so is a module an object patch replaced;
a patcher that patches in place (``weight_inplace_update``) turns this off for the model. Views are recorded right
after the model is built, on the model itself, so clones share them.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..checkpoints.safetensors_io import CheckpointError
from ..offload.host_memory import file_backed_ranges, is_file_backed, page_out
from .log import say_once
from .patchers import dynamic_vram_manages, mixed_class

log = logging.getLogger("comfyui_lowvram_dit")

VIEWS_ATTR = "lowvram_dit_file_views"
STAMPS_ATTR = "lowvram_dit_file_stamps"
CHECK_KEY = "lowvram_dit_mapped_files"
MOVING_ATTR = "_lowvram_dit_moving"  # on a patcher while its load runs: that load's PageOutAsMoved


@dataclass(frozen=True)
class FileStamp:
    """A mapped file as it was when the model was built: what must not change while its pages are in use."""

    path: str
    ino: int
    size: int
    mtime_ns: int


def mapped_file_stamps(tensors: list[torch.Tensor]) -> list[FileStamp]:
    """Stamps of the files (Linux /proc/self/maps) whose mappings hold ``tensors``; empty elsewhere."""
    ptrs = sorted(t.data_ptr() for t in tensors)
    found: dict[str, int] = {}
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) < 6 or not parts[5].startswith("/") or parts[5].rstrip().endswith("(deleted)"):
                    continue
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if any(lo <= p < hi for p in ptrs):
                    found[parts[5].rstrip("\n")] = int(parts[4])
    except OSError:
        return []
    stamps = []
    for path, ino in found.items():
        try:
            st = os.stat(path)
        except OSError:
            continue
        if st.st_ino == ino:  # else already replaced: the mapping reads the old, intact inode
            stamps.append(FileStamp(path, ino, st.st_size, st.st_mtime_ns))
    return stamps


def check_mapped_files(model: torch.nn.Module) -> None:
    """CheckpointError naming the file if a file ``model``'s weights are mapped from changed in place since."""
    for stamp in getattr(model, STAMPS_ATTR, ()):
        try:
            st = os.stat(stamp.path)
        except OSError:
            continue  # deleted: the mapping keeps the data alive
        if st.st_ino != stamp.ino:
            continue  # replaced by a new file: the mapping still reads the old one; the loader re-runs next prompt
        if (st.st_size, st.st_mtime_ns) != (stamp.size, stamp.mtime_ns):
            name = os.path.basename(stamp.path)
            raise CheckpointError(
                f"{name} changed on disk while this model was loaded from it (size {stamp.size} -> {st.st_size} "
                "bytes, or rewritten in place); reading its weights again could crash ComfyUI (SIGBUS) or mix old "
                "and new weights, so this run stops here. Replace model files only while ComfyUI does not use them "
                "(copy to a new name, then rename); queue the prompt again and the loader reads the file anew")


class _CheckMappedFiles:
    """OUTER_SAMPLE wrapper: check the mapped files before sampling touches their pages."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = weakref.ref(model)

    def __deepcopy__(self, memo: dict) -> _CheckMappedFiles:
        return self  # clones share the model and its stamps

    def __call__(self, executor, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN204
        model = self.model()
        if model is not None:
            check_mapped_files(model)
        return executor(*args, **kwargs)


@dataclass(frozen=True)
class FileView:
    """A parameter's file-mapped tensor and the module that held it when the model was built."""

    tensor: torch.Tensor
    owner: weakref.ref  # an object patch may put another module at the same path: never rebind into that one


def file_views(model: torch.nn.Module) -> dict[str, FileView]:
    """The recorded ``key -> FileView`` map of ``model`` (a ComfyUI BaseModel); empty if none."""
    return getattr(model, VIEWS_ATTR, None) or {}


class MappedWeightsMixin:
    """ModelPatcher behaviour for models whose weights are views of a file mapping (see the module docstring)."""

    def _is_its_view(self, key: str, weight: torch.Tensor | None) -> bool:
        fv = file_views(self.model).get(key)
        return fv is not None and weight is not None and weight.device.type == "cpu" \
            and weight.data_ptr() == fv.tensor.data_ptr()

    def _file_view(self, key: str, weight: torch.Tensor | None) -> torch.Tensor | None:
        """The view ``key`` may be pointed back at, or None where that would not give the same weight."""
        import comfy.utils

        fv = file_views(self.model).get(key)
        if fv is None or weight is None or key in self.patches or key in self.backup or key in self.hook_backup:
            return None
        owner_path = key.rpartition(".")[0]
        owner = comfy.utils.get_attr(self.model, owner_path) if owner_path else self.model
        if owner is not fv.owner():
            return None  # an object patch replaced the module
        if weight.shape != fv.tensor.shape or weight.dtype != fv.tensor.dtype:
            return None  # replaced by something else (a merge, a requantization): not ours to restore
        return fv.tensor

    def load(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        if self.weight_inplace_update and file_views(self.model):
            # in-place patches write into the mapping, so its pages may no longer hold the file's weights
            file_views(self.model).clear()
            log.info("lowvram_dit: weight_inplace_update patcher: weights are no longer pointed back at the file")
        views = [(fv.owner(), key.rpartition(".")[2], fv.tensor) for key, fv in file_views(self.model).items()]
        with PageOutAsMoved(views) as moved:
            self.__dict__[MOVING_ATTR] = moved
            try:
                out = super().load(*args, **kwargs)  # type: ignore[misc]
            finally:
                self.__dict__.pop(MOVING_ATTR, None)
        if moved.bytes:
            log.info("lowvram_dit: %.2f GB of file pages under weights now on the GPU left this process's RSS as they "
                     "were copied (the page cache keeps them for the next load)", moved.bytes / 1e9)
        return out

    def patch_weight_to_device(self, key: str, device_to: Any = None, *args: Any, **kwargs: Any) -> Any:
        # ComfyUI's load puts every patched (LoRA) weight on the device first and moves the modules afterwards: the
        # merge read the weight's file pages, and waiting for the module's move would hold all of them at once.
        out = super().patch_weight_to_device(key, device_to, *args, **kwargs)  # type: ignore[misc]
        moved = self.__dict__.get(MOVING_ATTR)
        fv = file_views(self.model).get(key)
        if moved is not None and fv is not None and not kwargs.get("return_weight"):
            import comfy.model_patcher as mp

            if not self._is_its_view(key, mp.get_key_weight(self.model, key)[0]):  # the merged copy replaced it
                moved.drop([fv.tensor])
        return out

    def pin_weight_to_device(self, key: str) -> None:
        import comfy.model_patcher as mp
        import comfy.utils

        weight, _, _ = mp.get_key_weight(self.model, key)
        if self._is_its_view(key, weight):
            return  # pinning a private file mapping would copy it into anonymous RAM
        view = self._file_view(key, weight)
        if view is not None and weight.device.type == "cpu":
            self.unpin_weight(key)  # never free memory that is still registered with CUDA
            comfy.utils.set_attr_param(self.model, key, view)  # just offloaded: back to the file, copy freed
            return
        super().pin_weight_to_device(key)  # type: ignore[misc]

    def unpatch_model(self, device_to=None, unpatch_weights=True):  # noqa: ANN001, ANN201
        if unpatch_weights and device_to is not None and torch.device(device_to).type == "cpu":
            self.rebind_to_file(lambda w: w.device.type != "cpu")
        return super().unpatch_model(device_to, unpatch_weights)  # type: ignore[misc]

    def rebind_to_file(self, which: Any = None) -> int:
        """Point every unpatched weight (``which(weight)`` true, default all) back at its file view; returns bytes."""
        import comfy.model_patcher as mp
        import comfy.utils

        done = 0
        for key in file_views(self.model):
            weight, _, _ = mp.get_key_weight(self.model, key)
            view = self._file_view(key, weight)
            if view is None or weight.data_ptr() == view.data_ptr() or (which is not None and not which(weight)):
                continue
            self.unpin_weight(key)
            comfy.utils.set_attr_param(self.model, key, view)
            done += view.numel() * view.element_size()
        return done


class PageOutAsMoved:
    """While ComfyUI loads a model, drop each file view's pages from this process's RSS as soon as its module has moved
    the weight off the CPU (``module.to(device)`` runs the module's ``_apply``; a LoRA-merged weight was already put
    on the device by ``patch_weight_to_device``). The copy read those pages; until the weight comes back to the CPU
    (pointed at its view again) nothing reads them, so keeping them would only raise peak RSS by the loaded size.
    Per module, not after the load, so that the peak stays low too; per weight for the patched weights, which
    ComfyUI's load merges and puts on the device before it moves any module (the patcher's
    ``patch_weight_to_device`` calls ``drop``). ``offload.host_memory.page_out`` says why
    MADV_DONTNEED (the page cache stays warm). The wrappers are instance attributes of this model's modules, removed
    on exit. ``views``: (module, parameter name, the plain CPU tensor over its file pages); a None module is skipped.
    """

    def __init__(self, views: Iterable[tuple[torch.nn.Module | None, str, torch.Tensor]]) -> None:
        self.bytes = 0
        self._ranges: list[tuple[int, int]] | None = None  # the process's file mappings, read at the first page-out
        self._dropped: set[int] = set()
        self._owners: dict[int, tuple[torch.nn.Module, list[tuple[str, torch.Tensor]]]] = {}
        for owner, attr, tensor in views:
            if owner is not None:
                self._owners.setdefault(id(owner), (owner, []))[1].append((attr, tensor))

    def __enter__(self) -> PageOutAsMoved:
        for key, (module, views) in list(self._owners.items()):
            if "_apply" in module.__dict__:  # someone else's instance override: leave that module alone
                del self._owners[key]
                continue
            module.__dict__["_apply"] = functools.partial(self._apply_then_page_out, module, module._apply, views)
        return self

    def __exit__(self, *exc: object) -> None:
        for module, _ in self._owners.values():
            module.__dict__.pop("_apply", None)

    def _apply_then_page_out(self, module: torch.nn.Module, apply: Any, views: list[tuple[str, torch.Tensor]],
                             fn: Any, *args: Any, **kwargs: Any) -> torch.nn.Module:
        out = apply(fn, *args, **kwargs)
        gone = []
        for attr, view in views:
            now = module._parameters.get(attr)
            if now is not None and now.device.type != "cpu":
                gone.append(view)
        self.drop(gone)
        return out

    def drop(self, views: list[torch.Tensor]) -> None:
        """Page out ``views`` whose weights no longer read them (each once per load)."""
        views = [v for v in views if v.data_ptr() not in self._dropped]
        if not views:
            return
        if self._ranges is None:
            self._ranges = file_backed_ranges()
        self._dropped.update(v.data_ptr() for v in views)
        self.bytes += page_out(views, self._ranges)


def keep_file_backed(patcher):  # noqa: ANN001, ANN201 - ModelPatcher in, the same object out
    """Record ``patcher``'s file-mapped weights and give it MappedWeightsMixin; a no-op when none are mapped."""
    if dynamic_vram_manages(patcher):
        say_once(log, "lowvram_dit: ComfyUI's DynamicVRAM manages the mapped fp8 weights (its own pinning and "
                      "disk-backed offload); the pack's file-backed offload steps aside")
        return patcher
    ranges = file_backed_ranges()
    views = {}
    for owner_name, module in patcher.model.named_modules():
        for attr, p in module.named_parameters(recurse=False):
            # ComfyUI's quantized layouts (QuantizedTensor) keep their own storage: ComfyUI moves them as it would
            if type(p.data) is torch.Tensor and is_file_backed(p, ranges):
                key = f"{owner_name}.{attr}" if owner_name else attr
                views[key] = FileView(p.data, weakref.ref(module))
    if not views:
        return patcher
    setattr(patcher.model, VIEWS_ATTR, views)
    setattr(patcher.model, STAMPS_ATTR, mapped_file_stamps([v.tensor for v in views.values()]))
    import comfy.patcher_extension as pe

    patcher.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, CHECK_KEY, _CheckMappedFiles(patcher.model))
    patcher.__class__ = mixed_class(MappedWeightsMixin, type(patcher), "Mapped")
    log.debug("lowvram_dit: %d weights (%.2f GB) stay file-backed", len(views),
              sum(v.tensor.numel() * v.tensor.element_size() for v in views.values()) / 1e9)
    return patcher
