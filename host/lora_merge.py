"""LoRA patches merged once into the host copies of streamed blocks (Block Swap), instead of on every call.

ComfyUI merges a patch into a weight it loads (``ModelPatcher.patch_weight_to_device``) and applies it per call
(``LowVramPatch`` in ``weight_function``) to a weight it streams. Block Swap streams whole blocks from a private host
arena (offload/engine.py), so it can do what ComfyUI does for loaded weights, once per load: each patched tensor
of a streamed block is computed with ComfyUI's own pieces (the op's ``convert_*`` to real values, then
``comfy.lora.calculate_weight``, then the op's ``set_*``: the pack's fp8 layers re-quantize with the layer's own
per-tensor or per-block scale; layers without one round stochastically, as ComfyUI does) and written into the arena
in place. Every later step streams the merged bytes: no per-step LoRA cost.

For a forward (every load but a read of the weights) the merge runs in the ring: the first forward after a load
merges each streamed block's patched weights in the GPU ring slot the block was just copied into, on the forward's
own stream right before the block runs (``RingMerge``, the engine's ``RingFill``), and the engine copies the merged
bytes back into the pinned arena behind it. So the merge costs its GPU math and one copy back per weight, inside
the forward, instead of a round trip per weight beside it with its kernels queued behind the forward's (an expert
switch's first step waited up to a second for that). A weight whose merge finds no GPU memory beside the forward's
activations is merged on the CPU from the slot's bytes, with a warning. A load that reads the weights
(``force_patch_weights``) merges into the arena before it returns.

Restoring is exact, and any clone can do it: each merged weight's original is also entered in the patcher's
``backup`` (ComfyUI shares one backup dict among a model's clones, in place), so when another clone of the same
weights loads with other patches (ComfyUI detaches ours without unpatching and unpatches from the shared backup), the
arena gets its original bytes back before that clone reads it. The original bytes come back from the file-backed
tensor the arena was copied from (the checkpoint's mapping, which is never written) or, for weights that were not
file-backed, from a copy taken before the merge. When the arena is about to be dropped and its parameters rebound to
those file-backed tensors (an idle expert going back to the file), only the private copies are restored: reading the
file back into an arena that is freed next would cost the whole file in time and page cache for nothing. A merge is
keyed by the patcher's ``patches_uuid`` (ComfyUI gives every clone with new patches or a new strength a new one), so
a re-load of the same patcher merges nothing, and other patches restore first.

GGUF models (ComfyUI-GGUF): a quantized GGML weight is never merged (re-quantizing would change it); its patches are
attached to the streamed tensor as ComfyUI-GGUF's ``GGUFModelPatcher.patch_weight_to_device`` attaches them
(``[(patches, key)]`` in its ``patches`` attribute), so its layer applies them on dequantization, exactly as without
Block Swap. Its F32/F16 tensors (biases, norms) are merged like plain ones, in float32 as that patcher merges them.
"""

from __future__ import annotations

import collections
import copy
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..offload import ggml_tensors as ggml

log = logging.getLogger("comfyui_lowvram_dit")
_Backup = collections.namedtuple("Dimension", ["weight", "inplace_update"])  # a ModelPatcher.backup entry
AttachPatches = Callable[[str, list], None]  # (key, [(patches, key)] or []) -> set on the streamed GGML tensor


def _seed(key: str) -> int:
    """ComfyUI's per-key stochastic-rounding seed (``string_to_seed`` moved from model_patcher to utils)."""
    import comfy.utils

    fn = getattr(comfy.utils, "string_to_seed", None)
    if fn is None:
        import comfy.model_patcher

        fn = comfy.model_patcher.string_to_seed
    return fn(key)


@torch.no_grad()
def merged_weight(patcher: Any, key: str, device: torch.device, source: torch.Tensor | None = None,
                  patches: list | None = None) -> torch.Tensor:
    """``key``'s stored tensor with its patches applied, computed on ``device``, in the stored dtype/layout.

    The same steps as ComfyUI's ``patch_weight_to_device``, without replacing the parameter or backing it up.
    ``source``: the bytes to read instead of the bound tensor (the same values: its copy in the host arena).
    ``patches``: ``patcher.patches[key]`` with its tensors already on ``device``."""
    import comfy.float
    import comfy.lora
    import comfy.model_management as mm
    import comfy.model_patcher as mp

    weight, set_func, convert_func = mp.get_key_weight(patcher.model, key)
    weight = weight if source is None else source
    # ComfyUI-GGUF merges into its unquantized GGML tensors in float32, ComfyUI in its LoRA compute dtype
    compute = torch.float32 if ggml.is_ggml(weight) else mm.lora_compute_dtype(device)
    # as patch_weight_to_device: a non-blocking copy converts on the GPU (a blocking one converts on the CPU)
    temp = mm.cast_to_device(ggml.stored(weight), device, compute, copy=True)
    if convert_func is not None:
        temp = convert_func(temp, inplace=True)
    out = comfy.lora.calculate_weight(patches if patches is not None else patcher.patches[key], temp, key)
    if set_func is not None:
        new = set_func(out, inplace_update=False, seed=_seed(key), return_weight=True)
    else:
        new = comfy.float.stochastic_rounding(out, weight.dtype, seed=_seed(key))
    if not isinstance(new, torch.Tensor) or type(new) is not torch.Tensor or new.shape != ggml.stored(weight).shape \
            or new.dtype != weight.dtype:
        raise TypeError(f"{key}: merging its LoRA gave a {type(new).__name__} {getattr(new, 'dtype', '')} "
                        f"{tuple(getattr(new, 'shape', ()))}, not a plain {weight.dtype} {tuple(weight.shape)} tensor; "
                        "Block Swap can only merge into plain weights")
    return new


class StreamedMerge:
    """The LoRA state of one Block Swap model's host arena: which patches are merged and how to undo them."""

    def __init__(self) -> None:
        self.uuid: Any = None  # patches_uuid of the merged patches (None: the arena holds the original bytes)
        # key -> (arena tensor, original bytes, whether the original is the file-backed tensor)
        self._backups: dict[str, tuple[torch.Tensor, torch.Tensor, bool]] = {}
        self._attached: list[str] = []  # quantized GGML weights whose patches apply on dequantization
        self._attach: AttachPatches | None = None
        self._shared: dict = {}  # the patcher's backup dict (shared by its clones) holding our entries
        self.merges = 0  # tensors merged so far (a counter for logs and tests)
        self.last_seconds = 0.0  # wall time of the last merge that merged anything
        # the merge under way (begin -> merge_keys -> finish): its start, tensors and bytes merged, whether it ran in
        # the ring slots during the first forward, the host time spent merging there
        self._started: float | None = None
        self._done, self._nbytes, self._in_ring, self._ring_s = 0, 0, False, 0.0

    @property
    def merged(self) -> bool:
        """True while the arena holds merged weights."""
        return self.uuid is not None

    @property
    def in_ring(self) -> bool:
        """True when the last merge ran in the ring slots as the first forward reached each block."""
        return self._in_ring

    def is_current(self, patcher: Any) -> bool:
        """True when the arena already holds exactly ``patcher``'s patches."""
        return self.uuid is not None and self.uuid == patcher.patches_uuid

    def ran_in_ring(self, host_seconds: float) -> None:
        """Mark the merge under way as run in the ring slots; ``host_seconds`` of the forward's thread went into it."""
        self._in_ring = True
        self._ring_s += host_seconds

    def begin(self) -> None:
        """Start a merge: the arena gets its original bytes back first."""
        self.restore()
        # timed from its first merged tensor (the arena copy before it is not the merge's)
        self._started, self._done, self._nbytes, self._in_ring, self._ring_s = None, 0, 0, False, 0.0

    @torch.no_grad()
    def merge_keys(self, patcher: Any, keys: list[str], originals: dict[str, torch.Tensor], device: torch.device,
                   attach: AttachPatches | None = None, targets: dict[str, torch.Tensor] | None = None,
                   staging: dict[str, torch.Tensor] | None = None, patches: dict[str, list] | None = None) -> None:
        """Merge (or attach) ``keys`` of a merge begun with ``begin`` in place; its GPU copies may still be under way.

        ``keys``: parameters in the host arena. ``originals``: key -> file-backed tensor holding the same bytes as
        the arena (restored from; never written). ``attach``: sets a quantized GGML weight's patches on every view
        the streamer binds (GGUF models). ``targets``: key -> the arena view (default: the tensor the model has
        bound). ``staging``: key -> a copy of the arena's bytes (the ring slot) to read and write instead of the
        arena view; the caller copies it back into the arena. ``patches``: key -> its patches on ``device``."""
        import comfy.utils

        if self._started is None:
            self._started = time.perf_counter()
        for key in keys:
            target = targets[key] if targets is not None else comfy.utils.get_attr(patcher.model, key)
            if ggml.is_quantized(target) and attach is not None:
                attach(key, [(_on_device(patcher.patches[key], _patch_device(patcher)), key)])
                self._attached.append(key)
                self._attach = attach
                continue
            # read from the arena (pinned) or its copy in the ring, never from a file mapping: the file's pages would
            # come back into RSS and be read at pageable speed
            work = staging[key] if staging is not None else target
            new = merged_weight(patcher, key, device, source=work,
                                patches=patches.get(key) if patches is not None else None)
            stored, original = ggml.stored(target), originals.get(key)
            file_backed = original is not None and ggml.stored(original).shape == stored.shape \
                and original.dtype == stored.dtype
            if not file_backed:
                original = stored.clone()  # not file-backed: the original bytes need their own copy
            self._backups[key] = (target, original, file_backed)
            patcher.backup[key] = _Backup(original, True)  # copied in place into the arena by any clone's unpatch
            self._shared = patcher.backup
            # asynchronous into pinned or GPU memory (the caching allocator hands ``new``'s block only to later work
            # on this stream, which runs after the copy), synchronous into pageable memory
            ggml.stored(work).copy_(new, non_blocking=True)
            self._done += 1
            self._nbytes += stored.numel() * stored.element_size()

    def finish(self, patcher: Any, device: torch.device, sync: bool = True) -> int:
        """End a merge begun with ``begin``: wait for its copies (``sync=False``: a ``RingMerge``, whose copies into
        the arena the engine waits for after that forward), log it; returns the count of merged tensors."""
        if device.type == "cuda" and self._done and sync:
            torch.cuda.current_stream(device).synchronize()  # the arena is read on the CPU and by the copy stream
        # nothing to merge: nothing to keep track of
        self.uuid = patcher.patches_uuid if self._backups or self._attached else None
        self.merges += self._done
        if self._done:
            self.last_seconds = self._ring_s if self._in_ring else time.perf_counter() - self._started
            where = " on the GPU in the ring slots as the first forward reached each block (its thread's time)" \
                if self._in_ring else ""
            log.info("lowvram_dit Block Swap: LoRA merged into %d streamed weights (%.2f GB) in %.2f s%s, once for "
                     "this load (no per-step patching)", self._done, self._nbytes / 1e9, self.last_seconds, where)
        if self._attached:
            log.info("lowvram_dit Block Swap: LoRA on %d streamed GGUF-quantized weights applies when they are "
                     "dequantized, as ComfyUI-GGUF applies it", len(self._attached))
        return self._done

    @torch.no_grad()
    def restore(self, arena_dropped: bool = False) -> None:
        """Put the original bytes back into the arena (bit-exact); a no-op when nothing is merged.

        ``arena_dropped``: the arena is freed next and its parameters rebound to their file-backed originals, so
        only the weights without one (kept as private copies) are copied back."""
        for key, (target, original, file_backed) in self._backups.items():
            if not (arena_dropped and file_backed):
                ggml.stored(target).copy_(ggml.stored(original))
            if getattr(self._shared.get(key), "weight", None) is original:
                del self._shared[key]
        self._backups.clear()
        for key in self._attached:
            self._attach(key, [])
        self._attached.clear()
        self.uuid = None


class RingMerge:
    """A merge begun with ``StreamedMerge.begin``, done by the engine's first forward (its ``RingFill``): each streamed
    block's patched weights are merged in the GPU ring slot the block was just copied into, on the forward's stream
    right before the block runs; the engine copies the merged weights back into the arena behind it, so later loads
    bring merged bytes. The merge ends (``StreamedMerge.finish``) with the last block; a forward stopped before it
    leaves the rest to the next one. It computes in the loading thread's inference / grad mode, as a merge at load
    would. It holds the patcher weakly: the streamer keeps it for the load, and the patcher keeps the streamer, so a
    strong reference would keep a patcher ComfyUI let go of alive until the garbage collector runs."""

    def __init__(self, merge: StreamedMerge, patcher: Any, keys: dict[int, list[str]],
                 originals: Callable[[int], dict[str, torch.Tensor]], targets: Callable[[int], dict[str, torch.Tensor]],
                 prefix: str, device: torch.device, attach: AttachPatches | None = None) -> None:
        self._merge, self._patcher, self._originals, self._targets = merge, weakref.ref(patcher), originals, targets
        self._prefix, self.device, self._attach = prefix, device, attach
        self._pending = {b: k for b, k in keys.items() if k}
        self._inference = torch.is_inference_mode_enabled()
        self._short_of_memory = False
        self._clips: list = []  # fp8 clip checks kept on the GPU, read after the last block
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # the patches' uploads
        if not self._pending:
            merge.finish(patcher, device, sync=False)

    def wants(self, b: int) -> bool:
        """True while block ``b``'s weights are not merged yet."""
        return b in self._pending

    def fill(self, b: int, views: dict[str, torch.Tensor]) -> list[str]:
        """Merge block ``b``'s patched weights into ``views`` (its ring slot, by name inside the block, bound to the
        block); the names written, for the engine to copy back into the arena. Nothing here waits for the GPU: the
        patches go up on a stream of their own, and fp8 clip checks are read once, after the last block."""
        from . import fp8_ops

        t0 = time.perf_counter()
        patcher, keys = self._live_patcher(), self._pending[b]
        cut = len(f"{self._prefix}{b}.")
        staging = {key: views[key[cut:]] for key in keys}
        originals, targets = self._originals(b), self._targets(b)
        with torch.inference_mode(self._inference), torch.no_grad(), fp8_ops.clip_checks_deferred(self._clips):
            patches = self._upload(patcher, keys)
            for key in keys:
                self._merge_one(patcher, key, originals, targets, staging, patches)
        del self._pending[b]
        self._merge.ran_in_ring(time.perf_counter() - t0)
        if not self._pending:
            fp8_ops.warn_if_clipped_any(self._clips)
            self._merge.finish(patcher, self.device, sync=False)
        return [key[cut:] for key in keys if not ggml.is_quantized(staging[key])]

    def _upload(self, patcher: Any, keys: list[str]) -> dict[str, list] | None:
        """``keys``' patches on the GPU, copied on the upload stream (a copy from pageable memory on the forward's
        stream would wait for the forward); the forward's stream waits for them. None on the CPU."""
        if self._stream is None:
            return None
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            out = {key: _uploaded(patcher.patches[key], self.device, compute) for key in keys}
        compute.wait_stream(self._stream)
        return out

    def _live_patcher(self) -> Any:
        patcher = self._patcher()
        if patcher is None:
            raise RuntimeError("block swap: the model whose LoRA was being merged is gone")
        return patcher

    def _merge_one(self, patcher: Any, key: str, originals: dict[str, torch.Tensor], targets: dict[str, torch.Tensor],
                   staging: dict[str, torch.Tensor], patches: dict[str, list] | None) -> None:
        """Merge ``key`` on the ring's device; short of memory there, on the CPU from the slot's bytes."""
        try:
            self._merge.merge_keys(patcher, [key], originals, self.device, self._attach, targets, staging, patches)
        except torch.OutOfMemoryError:
            if not self._short_of_memory:
                self._short_of_memory = True
                log.warning("lowvram_dit Block Swap: no GPU memory for the LoRA merge beside the forward at %s; "
                            "weights that do not fit are merged on the CPU (slower, same patches)", key)
            self._merge.merge_keys(patcher, [key], originals, torch.device("cpu"), self._attach, targets, staging)


def _uploaded(item: Any, device: torch.device, user: torch.cuda.Stream) -> Any:
    """``item`` (ComfyUI's nested patch tuples and lists, weight adapters) with every tensor of more than one value on
    ``device``, each marked as used by ``user`` (so the allocator keeps it until that stream has run); 0-d tensors (a
    LoRA's alpha) stay where they are, read as numbers."""
    if isinstance(item, torch.Tensor):
        if item.ndim == 0 or item.device == device:
            return item
        moved = item.to(device, non_blocking=True)
        moved.record_stream(user)
        return moved
    if isinstance(item, (tuple, list)):
        return type(item)(_uploaded(x, device, user) for x in item)
    if isinstance(getattr(item, "weights", None), (tuple, list)):  # a weight adapter (LoRA, LoHa, ...) object
        moved = copy.copy(item)
        moved.weights = _uploaded(item.weights, device, user)
        return moved
    return item


def _patch_device(patcher: Any) -> torch.device:
    """Where ComfyUI-GGUF keeps a weight's patches: the load device with its ``patch_on_device`` option, else the
    offload device (moved to the weight's device on each use)."""
    return patcher.load_device if getattr(patcher, "patch_on_device", False) else patcher.offload_device


def _on_device(item: Any, device: torch.device) -> Any:
    """``item`` (ComfyUI's nested patch tuples and lists) with every tensor in it on ``device``."""
    if isinstance(item, torch.Tensor):
        return item.to(device, non_blocking=True)
    if isinstance(item, (tuple, list)):
        return type(item)(_on_device(x, device) for x in item)
    return item
