"""LoRA patches merged once into the host copies of streamed blocks (Block Swap), instead of on every call.

ComfyUI merges a patch into a weight it loads (``ModelPatcher.patch_weight_to_device``) and applies it per call
(``LowVramPatch`` in ``weight_function``) to a weight it streams. Block Swap streams whole blocks from a private host
arena (offload/engine.py), so it can do what ComfyUI does for loaded weights, once per load: each patched tensor
of a streamed block is computed with ComfyUI's own pieces (the op's ``convert_*`` to real values, then
``comfy.lora.calculate_weight``, then the op's ``set_*``: the pack's fp8 layers re-quantize with the layer's own
per-tensor or per-block scale; layers without one round stochastically, as ComfyUI does) and written into the arena
in place. Every later step streams the merged bytes: no per-step LoRA cost.

Each merged tensor goes back from the GPU straight into the pinned arena with an asynchronous copy (no pageable
staging copy, no wait per tensor; one wait at the end), so a load pays about one host round trip of the merged bytes.
Where the arena is being filled into memory that is already pinned (an expert switch re-using the memory the idle
expert left), ``BlockMerge`` merges each block in a worker thread while the next one is copied, so that round trip
and the CPU's copy overlap; at an expert switch that runs beside the model's first step (offload/arena_fill.py), and a
block whose merge finds no GPU memory there is finished on the model's thread once the GPU has run what was queued.

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
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
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
def merged_weight(patcher: Any, key: str, device: torch.device, source: torch.Tensor | None = None) -> torch.Tensor:
    """``key``'s stored tensor with its patches applied, computed on ``device``, in the stored dtype/layout.

    The same steps as ComfyUI's ``patch_weight_to_device``, without replacing the parameter or backing it up.
    ``source``: the bytes to read instead of the bound tensor (the same values: its copy in the host arena)."""
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
    out = comfy.lora.calculate_weight(patcher.patches[key], temp, key)
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
        # the merge under way (begin -> merge_keys -> finish): its start, tensors and bytes merged, whether it ran
        # beside the arena copy
        self._started: float | None = None
        self._done, self._nbytes, self._overlapped = 0, 0, False

    @property
    def merged(self) -> bool:
        """True while the arena holds merged weights."""
        return self.uuid is not None

    @property
    def overlapped(self) -> bool:
        """True when the last merge ran block by block beside the arena copy."""
        return self._overlapped

    def is_current(self, patcher: Any) -> bool:
        """True when the arena already holds exactly ``patcher``'s patches."""
        return self.uuid is not None and self.uuid == patcher.patches_uuid

    def ran_beside_copy(self) -> None:
        """Mark the merge under way as run block by block beside the arena copy (for its log line)."""
        self._overlapped = True

    def begin(self) -> None:
        """Start a merge: the arena gets its original bytes back first."""
        self.restore()
        # timed from its first merged tensor (the arena copy before it is not the merge's)
        self._started, self._done, self._nbytes, self._overlapped = None, 0, 0, False

    @torch.no_grad()
    def merge_keys(self, patcher: Any, keys: list[str], originals: dict[str, torch.Tensor], device: torch.device,
                   attach: AttachPatches | None = None, targets: dict[str, torch.Tensor] | None = None) -> None:
        """Merge (or attach) ``keys`` of a merge begun with ``begin`` in place; its GPU copies may still be under way.

        ``keys``: parameters in the host arena. ``originals``: key -> file-backed tensor holding the same bytes as
        the arena (restored from; never written). ``attach``: sets a quantized GGML weight's patches on every view
        the streamer binds (GGUF models). ``targets``: key -> the arena view written (default: the tensor the model
        has bound, which is the arena view unless the arena is being filled beside the forward)."""
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
            # read from the arena (pinned, just copied), not from a file mapping the forward's thread still binds:
            # the file's pages would come back into RSS and be read at pageable speed
            new = merged_weight(patcher, key, device, source=target)
            stored, original = ggml.stored(target), originals.get(key)
            file_backed = original is not None and ggml.stored(original).shape == stored.shape \
                and original.dtype == stored.dtype
            if not file_backed:
                original = stored.clone()  # not file-backed: the original bytes need their own copy
            self._backups[key] = (target, original, file_backed)
            patcher.backup[key] = _Backup(original, True)  # copied in place into the arena by any clone's unpatch
            self._shared = patcher.backup
            # GPU -> arena without staging: asynchronous into pinned memory (the caching allocator hands ``new``'s
            # block only to later work on this stream, which runs after the copy), synchronous into pageable memory
            stored.copy_(new, non_blocking=True)
            self._done += 1
            self._nbytes += stored.numel() * stored.element_size()

    def finish(self, patcher: Any, device: torch.device, sync: bool = True) -> int:
        """End a merge begun with ``begin``: wait for its copies (``sync=False``: a ``BlockMerge`` waited for all of
        them), log it; returns the count of merged tensors."""
        if device.type == "cuda" and self._done and sync:
            torch.cuda.current_stream(device).synchronize()  # the arena is read on the CPU and by the copy stream
        # nothing to merge: nothing to keep track of
        self.uuid = patcher.patches_uuid if self._backups or self._attached else None
        self.merges += self._done
        if self._done:
            self.last_seconds = time.perf_counter() - self._started
            log.info("lowvram_dit Block Swap: LoRA merged into %d streamed weights (%.2f GB) in %.1f s%s, once for "
                     "this load (no per-step patching)", self._done, self._nbytes / 1e9, self.last_seconds,
                     ", each block while the next was copied into the arena" if self._overlapped else "")
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


class BlockMerge:
    """A merge begun with ``StreamedMerge.begin``, done block by block while the streamer fills the arena (the
    engine's ``BlockFill``): a block's weights are merged in one worker thread as soon as the block is copied, so the
    CPU's copy of the next block and the GPU round trip of this block's weights run at the same time instead of one
    after the other. The worker computes in the loading thread's inference / grad mode (torch keeps them per thread),
    so what it makes is what the loading thread would have made. Its GPU work runs on a stream of its own, ordered
    after what the loading thread had queued when it was made: when the arena fills beside the first forward, the
    merge's kernels and copies do not queue behind the forward's, nor the forward behind them."""

    def __init__(self, merge: StreamedMerge, patcher: Any, keys: dict[int, list[str]],
                 originals: Callable[[int], dict[str, torch.Tensor]], device: torch.device,
                 attach: AttachPatches | None = None,
                 targets: Callable[[int], dict[str, torch.Tensor]] | None = None) -> None:
        self._merge, self.patcher, self.keys, self._originals = merge, patcher, keys, originals
        self.device, self._attach, self._targets = device, attach, targets
        self._inference = torch.is_inference_mode_enabled()
        self._pool: ThreadPoolExecutor | None = None
        self._stream: torch.cuda.Stream | None = None
        if device.type == "cuda":
            # high priority: its kernels start as SMs free up, not behind the forward's queued kernels
            self._stream = torch.cuda.Stream(device, priority=-1)
            self._stream.wait_stream(torch.cuda.current_stream(device))  # the patches' uploads come first
        self._jobs: list[Future] = []
        self._settled: set[int] = set()  # ids of the jobs whose leftover work ran
        self.blocks: set[int] = set()  # the blocks handed over so far

    def block(self, b: int) -> Future | None:
        """Block ``b`` is in the arena: merge its keys in the worker; the merge's future (None: nothing to merge)."""
        self.blocks.add(b)
        keys = self.keys.get(b)
        if not keys:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="lowvram_dit_lora_merge")
            self._merge.ran_beside_copy()
        targets = self._targets(b) if self._targets is not None else None
        job = self._pool.submit(self._run, keys, self._originals(b), targets)
        self._jobs.append(job)
        return job

    def _run(self, keys: list[str], originals: dict[str, torch.Tensor],
             targets: dict[str, torch.Tensor] | None) -> Callable[[], None] | None:
        """Merge ``keys`` in the worker; what a lack of GPU memory left over (beside a forward's activations), as the
        work for ``settle`` to run on the waiting thread, or None."""
        stream = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        left: list[str] = []
        with torch.inference_mode(self._inference), torch.no_grad(), stream:
            for i, key in enumerate(keys):
                try:
                    self._merge.merge_keys(self.patcher, [key], originals, self.device, self._attach, targets)
                except torch.OutOfMemoryError:
                    left = keys[i:]
                    break
        if self._stream is not None:
            self._stream.synchronize()  # this block's copies into the arena are done
        if not left:
            return None
        log.warning("lowvram_dit Block Swap: the LoRA merge ran out of GPU memory in its worker at %s (beside the "
                    "model's first step, or the arena copy); the model's thread merges the rest of that block once "
                    "the GPU has run what was queued", left[0])
        return lambda: self._merge_here(left, originals, targets)

    @torch.no_grad()
    def _merge_here(self, keys: list[str], originals: dict[str, torch.Tensor],
                    targets: dict[str, torch.Tensor] | None) -> None:
        """Merge ``keys`` on this thread once the GPU has run what was queued (between two blocks of a forward the
        memory a block's activations took is free again)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        with torch.inference_mode(self._inference):
            self._merge.merge_keys(self.patcher, keys, originals, self.device, self._attach, targets)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def settle(self, job: Future) -> None:
        """Wait for a block's merge; run what it left (``_run``) on this thread, once; raise what it raised."""
        left = job.result()
        if left is not None and id(job) not in self._settled:
            self._settled.add(id(job))
            left()

    def wait(self) -> None:
        """Return once every handed-over block is merged (what a worker left, merged on this thread); raises the first
        error a block's merge raised."""
        if self._pool is None:
            return
        try:
            for job in self._jobs:
                self.settle(job)
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool, self._jobs = None, []


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
