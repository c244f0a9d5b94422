"""Block Swap: stream whole transformer blocks through a GPU ring, inside ComfyUI's memory manager.

How it cooperates with ComfyUI (v0.8.0, comfy/model_patcher.py + comfy/model_management.py):
- The node returns a clone of the MODEL whose class is the input's ModelPatcher class plus ``BlockSwapMixin``
  (``clone()`` keeps it, so ModelSampling*/LoRA nodes after this one keep the behaviour).
- ``_load_list`` leaves the streamed blocks (and, if asked, the embeddings/head) out, so the stock ``load`` never
  moves them; ``model_size`` reports resident weights + ring, so ``load_models_gpu``/``free_memory`` budget what
  really goes to the GPU; after the stock load the ring bytes are added to ``model_loaded_weight_memory``.
- ``unpatch_model``/``detach`` (unload, model switch, another clone taking over) free the ring and put every
  streamed block back on its CPU master. The clone gets its own ``patches_uuid``, so a plain clone of the same
  weights reloads cleanly after us.
- Prefetch/wait logic is a offload/engine.py ``StreamHook`` installed by host/hooks.py (per-block replace
  patches and the forward chain), outside the block forward: a compiled block stays compiled; swapped weights
  keep shape/dtype/device.
- The pinned host arena is counted in ComfyUI's pinned-memory account while it is registered, and stays pageable
  when that account has no room (host/pin_budget.py), so ComfyUI's own pins never push past its cap.
- LoRA on streamed blocks is merged once per load into their host arena (host/lora_merge.py: ComfyUI's own
  convert / calculate_weight / set steps, so fp8 layers re-quantize with their own scales), each block while the
  next is copied into the arena, and restored exactly on unload; every step streams the merged bytes. Offloaded
  embeddings keep ComfyUI's ``LowVramPatch`` (per call).
- Once per load, after its first model calls, one log line says whether compute hid the copies or by how much
  they stalled it and what would help (offload/verdict.py, from the engine's CUDA-event timings); the Doctor
  node shows the latest line of each model. A CPU run times nothing and says nothing.

Two-expert Wan 2.2 A14B (RAM): only the loaded expert's streamed blocks sit in the pinned host arena. When an
expert's weights came from a file mapping (a loader that maps the safetensors file instead of copying) and it is
unloaded, its blocks point at the file again and the arena's memory, still pinned, is offered to the next arena of
its size (the other expert's), so the idle expert costs page cache, not RSS, and a switch neither allocates nor pins.
Otherwise the arena is unpinned and stays the blocks' CPU copy: with ComfyUI's stock loader (anonymous copies) it
replaces the original tensors, so RAM never holds two copies of a streamed block.

On a CPU-only ComfyUI there is no VRAM to save: with ``blocks_to_swap`` or ``vram_budget_gb`` set the node runs
the same code path with a CPU "ring" (synchronous copies; used by the integration tests), otherwise it passes the
model through with a log line.
"""

from __future__ import annotations

import enum
import logging
import time
import uuid
import weakref

import torch

from ..kernels.hooks import find_blocks
from ..offload import dynamic_vram_policy
from ..offload import engine as offload
from ..offload import ggml_tensors as ggml
from ..offload import plan as swap_plan
from ..offload.engine import BlockStreamer, StreamHook
from ..offload.host_memory import file_backed_ranges, is_file_backed, release_spares
from ..offload.plan import SwapConfig, SwapPlan
from ..offload.verdict import StreamStats, SwapSetup, swap_verdict
from . import system_ram
from .block_graphs import release_block_graphs
from .core_quant import model_layouts
from .dynamic_vram import legacy_clone
from .hooks import register_hook
from .log import say_once
from .lora_merge import RingMerge, StreamedMerge
from .mapped_weights import PageOutAsMoved
from .parked_weights import ParkedWeights, regular_weights
from .patchers import dynamic_vram_manages, mixed_class
from .pin_budget import ComfyPinBudget

log = logging.getLogger("comfyui_lowvram_dit")

SWAP_KEY = "lowvram_dit_block_swap"
MEASURED_KEEP = 8
_measured: dict[int, str] = {}  # id(SwapController) -> its latest verdict line, oldest first (for the Doctor node)


def measured_verdicts() -> list[str]:
    """The latest measured verdict of each recent Block Swap model in this process, oldest first."""
    return list(_measured.values())


# A full unload parks the resident part only where it is at most this share of the model: on a small card, where
# most blocks stream, it is what each Wan 2.2 expert switch would otherwise read from its file and merge with the
# LoRA again (docs/benchmarks.md, the streaming rows). A larger resident part would hold that much more RAM pinned
# per idle model, on machines that stream because RAM is short.
PARK_SHARE = 0.25


class SwapState(enum.Enum):
    """Where one Block Swap model is in ComfyUI's load cycle (``SwapController.state``)."""

    UNLOADED = "unloaded"  # no plan: the next load plans afresh (resolution or free VRAM may have changed)
    PLANNED = "planned"  # planned for the load under way; nothing of ours on the GPU yet
    ACTIVE = "active"  # ring on the GPU, streamed blocks bound to the host arena, ring counted in ComfyUI's account
    DETACHED = "detached"  # the weights went to a clone for a re-load: ring freed, plan, arena and LoRA merge kept


# What each ComfyUI event does to a Block Swap model (BlockSwapMixin carries it out):
#   load(), not ACTIVE ............................ plan_load(), then activate() when a block streams
#   partially_load() after the stock early return . activate() (the stock path skipped load())
#   detach(unpatch_all=False) ..................... detach(): ring freed, arena kept for the re-load
#   detach(unpatch_all=True), unpatch_model() ..... unload(): LoRA restored, ring and arena freed, plan dropped;
#                                                   a model that streams parks its resident part (parked_weights)
#   a forward while not ACTIVE .................... ensure_active(): activate() with the kept plan and device


class SwapController:
    """State shared by every clone of one Block Swap MODEL: the plan, the streamer, what was moved and why."""

    def __init__(self, config: SwapConfig, base_model: torch.nn.Module) -> None:
        self.config = config
        dm = base_model.diffusion_model
        self.model_name = type(dm).__name__
        self.list_name, self.blocks = find_blocks(dm, "Block Swap")
        self.prefix = f"diffusion_model.{self.list_name}."
        self.block_bytes = [offload.block_nbytes(b) for b in self.blocks]
        self.block_state_bytes = [offload.module_bytes(b) for b in self.blocks]
        self.embed_names = tuple(f"diffusion_model.{n}" for n, m in dm.named_children()
                                 if n != self.list_name and any(True for _ in m.parameters()))
        self.embed_bytes = sum(offload.module_bytes(getattr(dm, n.split(".", 1)[1])) for n in self.embed_names)
        self.full_bytes = offload.module_bytes(base_model)
        self.model_ref = weakref.ref(base_model)
        self.activation_bytes = 0  # ComfyUI's own estimate at the current resolution (PREPARE_SAMPLING wrapper)
        self.plan: SwapPlan | None = None
        self.streamer: BlockStreamer | None = None
        self.state = SwapState.UNLOADED
        self.device: torch.device | None = None
        self._moved: dict[str, torch.Tensor] = {}  # non-leaf params moved to the GPU -> their CPU originals
        self._flagged: list[torch.nn.Module] = []  # modules whose comfy_cast_weights we set
        self._pinned_keys: list[str] = []
        self._extra_loaded = 0
        self._patcher: weakref.ref | None = None
        self.lora = StreamedMerge()  # LoRA patches merged into the streamed blocks' host arena
        self.parked = ParkedWeights(ComfyPinBudget())  # resident weights ComfyUI unloaded partially, for the reload

    def __deepcopy__(self, memo: dict) -> "SwapController":
        return self  # model_options are deep-copied on clone: the controller (GPU ring) must be shared

    @property
    def active(self) -> bool:
        """True while the ring is on the GPU and the streamed blocks are served from the arena."""
        return self.state is SwapState.ACTIVE

    @staticmethod
    def _account(patcher, delta: int) -> None:  # noqa: ANN001 - ModelPatcher
        """Add ``delta`` bytes (ring + moved params) to what ComfyUI counts as loaded for ``patcher``'s model."""
        patcher.model.model_loaded_weight_memory = max(0, patcher.model.model_loaded_weight_memory + delta)

    # -- planning ------------------------------------------------------------------------------------------

    def fixed_bytes(self) -> int:
        """Weights that stay on the GPU besides blocks (embeddings/head unless offloaded)."""
        nonblock = self.full_bytes - sum(self.block_state_bytes)
        return nonblock - (self.embed_bytes if self.config.offload_embeddings else 0)

    def plan_load(self, weight_budget: float | None) -> None:
        """UNLOADED / PLANNED / DETACHED -> PLANNED: the plan for the load under way (an equal plan keeps the arena)."""
        self.plan = self.make_plan(weight_budget)
        self.state = SwapState.PLANNED

    def make_plan(self, weight_budget: float | None) -> SwapPlan:
        """Plan for a load: ``weight_budget`` is what ComfyUI offers for weights (None = unlimited)."""
        budget, why = weight_budget, f"the {(weight_budget or 0) / 1e9:.1f} GB ComfyUI offers for weights"
        if self.config.vram_budget_gb > 0:
            user = swap_plan.budget_bytes_from_gb(self.config.vram_budget_gb) - self.activation_bytes
            if budget is None or user <= budget:
                budget, why = user, (f"vram_budget_gb {self.config.vram_budget_gb:g} less ComfyUI's activation "
                                     f"estimate ({self.activation_bytes / 1e9:.1f} GB)")
        plan = swap_plan.plan_swap(self.block_bytes, self.config, budget_bytes=None if budget is None else int(budget),
                                   fixed_bytes=self.fixed_bytes())
        need = swap_plan.minimum_bytes(self.block_bytes, self.config, self.fixed_bytes())
        if budget is not None and need > budget and self.config.blocks_to_swap < 0:
            # once per distinct shortfall (0.1 GB steps): ComfyUI asks a model's size several times per load
            say_once(log, f"lowvram_dit Block Swap: {why} leaves {budget / 1e9:.1f} GB for weights, below the "
                          f"{need / 1e9:.1f} GB of a ring with every block streamed; streaming every block anyway "
                          "(its 'Block Swap measured' line says whether that costs speed). Raise vram_budget_gb or "
                          "lower prefetch if it runs out of memory.")
        return plan

    def gpu_bytes(self, plan: SwapPlan) -> int:
        """What a load with ``plan`` puts on the GPU: fixed + resident blocks + ring."""
        streamed = sum(self.block_state_bytes[i] for i in plan.streamed)
        return self.fixed_bytes() + sum(self.block_state_bytes) - streamed + plan.ring_bytes

    def streams_from_file(self) -> bool:
        """True when the first streamed block's largest weight lies in a file mapping (Linux tells; elsewhere False)."""
        maps = file_backed_ranges()
        largest = max(self.blocks[self.plan.streamed[0]].parameters(), key=lambda p: ggml.stored(p).nbytes)
        return bool(maps) and is_file_backed(ggml.stored(largest), maps)

    def is_swapped_module(self, name: str) -> bool:
        """True for modules ComfyUI must not load: streamed blocks' modules and offloaded embeddings."""
        plan = self.plan
        if plan is not None and plan.streamed and name.startswith(self.prefix):
            idx = name[len(self.prefix):].split(".", 1)[0]
            if idx.isdigit() and int(idx) in set(plan.streamed):
                return True
        if self.config.offload_embeddings:
            return any(name == e or name.startswith(e + ".") for e in self.embed_names)
        return False

    # -- load / unload ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def activate(self, patcher, device: torch.device, weights_read: bool = False,  # noqa: ANN001
                 resident_s: float | None = None) -> None:
        """After ComfyUI loaded the resident part: build the ring, flag streamed/offloaded layers, account memory.

        ``weights_read``: the load is for reading the weights (ComfyUI's ``force_patch_weights``, a checkpoint save),
        not for a forward: the arena is filled and the LoRA merged into it before this returns, not by the first
        forward.
        ``resident_s``: how long ComfyUI's load of the resident part took (for the log line)."""
        import comfy.model_patcher as mp

        if self.active:
            return
        plan = self.plan
        self.device = device
        self._patcher = weakref.ref(patcher)
        took = {"start": time.perf_counter()}
        if plan.streamed:
            self._activate_streamer(patcher, device, weights_read)
            took["arena"] = time.perf_counter()
        model = patcher.model
        swapped = [(n, m) for n, m in model.named_modules() if self.is_swapped_module(n)]
        for n, m in swapped:  # LoRA on offloaded embeddings: ComfyUI's LowVramPatch, computed on the GPU per call
            embed = self.config.offload_embeddings and not n.startswith(self.prefix)
            if not hasattr(m, "comfy_cast_weights") or not embed:
                continue
            for kind in ("weight", "bias"):
                key = f"{n}.{kind}"
                if key in patcher.patches and ggml.is_ggml(getattr(m, kind)):
                    # ComfyUI-GGUF's layers read no weight_function: the tensor carries its patches, as its patcher
                    # attaches them to weights it leaves on the CPU
                    getattr(m, kind).patches = [(patcher.patches[key], key)]
                elif key in patcher.patches:
                    _, set_func, convert_func = mp.get_key_weight(model, key)
                    # a new list: the op class's default list is shared by every layer of that class
                    setattr(m, f"{kind}_function", [*getattr(m, f"{kind}_function"),
                                                    mp.LowVramPatch(key, patcher.patches, convert_func, set_func)])
            m.prev_comfy_cast_weights = m.comfy_cast_weights
            m.comfy_cast_weights = True  # cast per call (embeddings stay on the CPU, pinned by ComfyUI)
            self._flagged.append(m)
            for p, _ in m.named_parameters(recurse=False):
                key = f"{n}.{p}"
                patcher.pin_weight_to_device(key)
                self._pinned_keys.append(key)
        # Params owned by non-leaf modules (Wan `blocks.N.modulation`, `head.modulation`) are skipped by
        # ModelPatcher._load_list and would be copied synchronously every call: move the resident ones once.
        moved = 0
        for n, m in model.named_modules():
            if self.is_swapped_module(n) or not any(True for _ in m.children()):
                continue
            for p, t in list(m.named_parameters(recurse=False)):
                if t.device != device:
                    key = f"{n}.{p}" if n else p
                    self._moved[key] = t
                    offload.set_param(model, key, t.to(device))
                    moved += t.numel() * t.element_size()
        self._extra_loaded = plan.ring_bytes + moved
        self._account(patcher, self._extra_loaded)
        self.state = SwapState.ACTIVE
        where = "GPU" if device.type == "cuda" else f"{device.type} (no VRAM to save: test path)"
        log.info("lowvram_dit Block Swap: %d of %d blocks streamed %s, ring %d x %.0f MB, prefetch %d, pinned %s, "
                 "resident %.2f GB + ring %.2f GB on %s; %s", len(plan.streamed), plan.num_blocks, list(plan.streamed),
                 plan.ring, plan.slot_bytes / 2**20, self.config.prefetch, self.config.pinned,
                 (self.gpu_bytes(plan) - plan.ring_bytes) / 1e9, plan.ring_bytes / 1e9, where,
                 _took(took, self.streamer.took if plan.streamed and self.streamer else None, resident_s))

    def _activate_streamer(self, patcher, device: torch.device, weights_read: bool) -> None:  # noqa: ANN001
        """The streamer for this plan and device (made anew for another), activated with this load's LoRA merge: by
        the first forward in the ring slots, or into the arena now for a weights read."""
        plan = self.plan
        if self.streamer is None or self.streamer.plan != plan or self.streamer.device != device:
            if self.streamer is not None:
                # a new plan: the old arena goes first, and file-backed weights go back to the file, so the new
                # arena is copied from the file (its masters stay file-backed) and RAM does not double
                self._release_arena()
            spare = self.streamer.spare if self.streamer is not None else None
            self.streamer = BlockStreamer(self.blocks, plan, device, pinned=self.config.pinned,
                                          debug=self.config.debug, pin_budget=ComfyPinBudget())
            self.streamer.spare = spare  # the old arena's memory: taken, or freed before a new one is allocated
        keys = self._lora_keys(patcher)
        fill = None if keys is None or weights_read else RingMerge(
            self.lora, patcher, keys, self._block_originals, self._block_views, self.prefix, device,
            attach=self._attach_patches)
        self.streamer.activate(fill, background=fills_beside_forward(device) and not weights_read)
        if keys is not None and weights_read:
            self._merge_into_arena(patcher, keys, device)

    def _lora_keys(self, patcher) -> dict[int, list[str]] | None:  # noqa: ANN001 - ModelPatcher
        """``patcher``'s patched keys per streamed block for a merge begun now, or None when the arena holds them
        already. The arena gets its original bytes back first."""
        if self.lora.is_current(patcher):
            return None
        keys: dict[int, list[str]] = {}
        streamed = set(self.plan.streamed)
        for key in patcher.patches:
            idx, _, _ = key[len(self.prefix):].partition(".") if key.startswith(self.prefix) else ("", "", "")
            if idx.isdigit() and int(idx) in streamed:
                keys.setdefault(int(idx), []).append(key)
        self.lora.begin()
        return keys

    def _block_originals(self, b: int) -> dict[str, torch.Tensor]:
        """Block ``b``'s file-backed tensors (what its arena bytes were copied from), by the patcher's key."""
        return {f"{self.prefix}{b}.{name}": t for name, t in self.streamer.originals.get(b, {}).items()}

    def _block_views(self, b: int) -> dict[str, torch.Tensor]:
        """Block ``b``'s arena views (what the merge writes), by the patcher's key."""
        return {f"{self.prefix}{b}.{name}": t for name, t in self.streamer.cpu_views(b).items()}

    def _merge_into_arena(self, patcher, keys: dict[int, list[str]], device: torch.device) -> None:  # noqa: ANN001
        """Merge every streamed block's patches into the arena now (the weights are read, not run): one weight at a
        time goes to ``device`` and back; then wait for the copies and log it."""
        for b, block_keys in keys.items():
            self.lora.merge_keys(patcher, block_keys, self._block_originals(b), device, self._attach_patches,
                                 self._block_views(b))
        self.lora.finish(patcher, device)

    def _attach_patches(self, key: str, patches: list) -> None:
        """Give the streamed GGML weight ``key`` these LoRA patches, applied by its layer on dequantization."""
        idx, _, name = key[len(self.prefix):].partition(".")
        self.streamer.set_tensor_attr(int(idx), name, "patches", patches)

    @torch.no_grad()
    def detach(self, patcher) -> None:  # noqa: ANN001 - ModelPatcher
        """ACTIVE -> DETACHED (ComfyUI detaches the model before every re-load): the ring is freed; the plan, the
        pinned arena and its merged LoRA stay, so the next load re-activates at the cost of a cached allocation."""
        if not self.active:
            return
        self._hand_over_timings()
        self.streamer.detach()
        self._release_gpu(patcher)
        self.state = SwapState.DETACHED

    def weights_to_park(self, patcher) -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:  # noqa: ANN001
        """Before a full unload: the resident weights to keep in pinned memory for the next load (LoRA merged), for
        a model that streams most of its blocks with pinning on (a Wan 2.2 expert on a small card, unloaded at every
        switch); else none."""
        if not (self.active and self.plan.streamed and self.config.pinned and torch.cuda.is_available()):
            return {}
        weights = {} if patcher.weight_inplace_update else regular_weights(patcher)
        kept = sum(t.numel() * t.element_size() for _, t in weights.values())
        return weights if kept <= PARK_SHARE * self.full_bytes else {}

    @torch.no_grad()
    def unload(self, patcher, keep_parked: bool = False) -> None:  # noqa: ANN001 - ModelPatcher
        """Any state -> UNLOADED: the arena gets its original bytes back (or, when it is dropped for the file
        mapping, only its private copies), the ring and the arena are freed and the plan is dropped. The parked
        weights go too unless ``keep_parked`` (the unload parks the resident part there next)."""
        was_active = self.active
        self._hand_over_timings()
        t0 = time.perf_counter()
        restore_s = self._release_arena() if self.streamer is not None else 0.0
        if not keep_parked:
            self.parked.drop()
        if was_active:
            self._release_gpu(patcher)
        self.plan, self.state = None, SwapState.UNLOADED
        if was_active:
            log.info("lowvram_dit Block Swap: unloaded in %.2f s (LoRA restore %.2f s)", time.perf_counter() - t0,
                     restore_s)

    def _release_arena(self) -> float:
        """The streamer lets go of its arena (and ring), after the merged LoRA is undone as far as the arena needs
        it: all of it when the arena stays, only the private copies when it is dropped for the file mapping.
        Returns the seconds the restore took."""
        self.streamer.detach()  # a fill beside the forward and the ring's write-backs into the arena complete first
        t0 = time.perf_counter()
        self.lora.restore(arena_dropped=self.streamer.drops_arena_on_release())
        restored = time.perf_counter() - t0
        self.streamer.release()
        return restored

    def _hand_over_timings(self) -> None:
        """A load too short for the hook to hand its timings over: take them now."""
        if self.active and self.streamer is not None:
            calls = self.streamer.take_measurement(wait=True)
            if calls:
                self.swap_measured(calls)

    def _release_gpu(self, patcher) -> None:  # noqa: ANN001 - ModelPatcher
        """Undo what ``activate`` did besides the streamer: layer flags, pins, moved params, the accounting."""
        for m in self._flagged:
            if hasattr(m, "prev_comfy_cast_weights"):
                m.comfy_cast_weights = m.prev_comfy_cast_weights
                del m.prev_comfy_cast_weights
            m.weight_function = []
            m.bias_function = []
            for kind in ("weight", "bias"):
                if ggml.is_ggml(getattr(m, kind, None)):
                    getattr(m, kind).patches = []
        self._flagged.clear()
        for key in self._pinned_keys:
            patcher.unpin_weight(key)
        self._pinned_keys.clear()
        for key, cpu in self._moved.items():
            offload.set_param(patcher.model, key, cpu)
        self._moved.clear()
        self._account(patcher, -self._extra_loaded)
        self._extra_loaded = 0

    def ensure_active(self) -> bool:
        """Safety net for a forward that finds the ring inactive (ComfyUI skipped ``load``): activate lazily."""
        if self.active:
            return bool(self.plan and self.plan.streamed)
        patcher = self._patcher() if self._patcher is not None else None
        if patcher is None or self.plan is None or self.device is None:
            return False
        log.warning("lowvram_dit Block Swap: model ran without a load; activating the ring now")
        self.activate(patcher, self.device)
        return bool(self.plan.streamed)

    # -- what the StreamHook asks (offload/engine.py StreamOwner) -----------------------------------------

    @property
    def debug(self) -> bool:
        """Log per-forward transfer statistics."""
        return self.config.debug

    def block_streamer(self) -> BlockStreamer | None:
        """The streamer while the ring is active."""
        return self.streamer if self.active else None

    def forward_streamer(self) -> BlockStreamer | None:
        """The streamer at the start of a forward (activated now if ComfyUI skipped the load), or None."""
        return self.streamer if self.ensure_active() else None

    def oom_advice(self, message: str) -> str:
        """The out-of-memory message naming what was on the GPU and the setting that would fit."""
        return swap_plan.oom_advice(self.plan, self.block_bytes, self.config, message, self.fixed_bytes(),
                                    self.embed_bytes)

    def swap_setup(self) -> SwapSetup:
        """The shape of the active load, for offload/verdict.py."""
        plan, st = self.plan, self.streamer
        streamed = len(plan.streamed)
        return SwapSetup(model=self.model_name, num_blocks=plan.num_blocks, streamed=streamed,
                         prefetch=self.config.prefetch, pinned=st.arena is not None and st.arena.pinned,
                         block_bytes=st.streamed_bytes // max(streamed, 1), ring_bytes=plan.ring_bytes,
                         resident_bytes=self.gpu_bytes(plan) - plan.ring_bytes, source_itemsize=st.weight_itemsize(),
                         vram_budget_gb=self.config.vram_budget_gb, blocks_to_swap=self.config.blocks_to_swap,
                         pinned_option=self.config.pinned)

    def swap_measured(self, calls: list[StreamStats]) -> None:
        """Log this load's verdict once (the engine hands its timed calls over once per load) and keep it."""
        verdict = swap_verdict(calls, self.swap_setup())
        if verdict.kind == "unmeasured":
            log.debug("lowvram_dit %s", verdict.text)
            return
        log.log(logging.INFO if verdict.kind == "hidden" else logging.WARNING, "lowvram_dit %s", verdict.text)
        _measured.pop(id(self), None)
        _measured[id(self)] = f"[{time.strftime('%H:%M:%S')}] {verdict.text}"
        while len(_measured) > MEASURED_KEEP:
            del _measured[next(iter(_measured))]


def resident_file_views(patcher) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:  # noqa: ANN001
    """The GGML weights of the modules ComfyUI loads that still lie in their file's mapping (Block Swap kept
    ComfyUI-GGUF from copying them out of it, see ``load``), for PageOutAsMoved; empty once they were moved."""
    ctl = patcher.attachments.get(SWAP_KEY)
    if ctl is None or getattr(patcher, "mmap_released", None) is not True:
        return []
    on_cpu = []
    for name, module in patcher.model.named_modules():
        if not ctl.is_swapped_module(name):
            on_cpu += [(module, attr, ggml.stored(p)) for attr, p in module.named_parameters(recurse=False)
                       if ggml.is_ggml(p) and p.device.type == "cpu"]
    maps = file_backed_ranges() if on_cpu else []  # the process's mappings, read only when a weight may lie in one
    return [view for view in on_cpu if is_file_backed(view[2], maps)]


class BlockSwapMixin:
    """ModelPatcher behaviour for block swap; mixed in front of the MODEL's own patcher class.

    ``apply_block_swap`` sets this class only once the controller is attached; a patcher whose attachment is gone
    anyway (removed by another node) behaves as its base class, so teardown (``__del__``) never raises."""

    @property
    def _swap(self) -> SwapController | None:
        return self.attachments.get(SWAP_KEY)

    def clone(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        n = super().clone(*args, **kwargs)
        # a base class whose clone resets ``__class__`` (ComfyUI-GGUF's patcher) would drop Block Swap downstream
        if SWAP_KEY in n.attachments and not isinstance(n, BlockSwapMixin):
            n.__class__ = _swap_class(type(n))
        return n

    def model_size(self) -> int:
        ctl = self._swap
        if ctl is None:
            return super().model_size()
        if ctl.active or ctl.plan is not None:
            return ctl.gpu_bytes(ctl.plan)
        if ctl.config.blocks_to_swap >= 0 or ctl.config.vram_budget_gb > 0:
            return ctl.gpu_bytes(ctl.make_plan(None))
        return ctl.full_bytes  # auto: ask for everything, stream what ComfyUI cannot give

    def get_ram_usage(self) -> int:
        return self._swap.full_bytes if self._swap is not None else super().get_ram_usage()

    def _load_list(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - whatever the host's _load_list takes
        ctl = self._swap
        # entries end with (name, module, params); the sort keys in front of them differ between load modes
        return [x for x in super()._load_list(*args, **kwargs) if ctl is None or not ctl.is_swapped_module(x[-3])]

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):  # noqa: ANN001
        # options go on by keyword: ComfyUI-GGUF's load(*args, force_patch_weights=..., **kwargs) sets its own
        ctl = self._swap
        if device_to is None or ctl is None:
            return super().load(device_to, lowvram_model_memory, force_patch_weights=force_patch_weights,
                                full_load=full_load)
        if not ctl.active:
            offered = None if (full_load or lowvram_model_memory <= 0 or lowvram_model_memory >= 1e30) \
                else lowvram_model_memory
            ctl.plan_load(offered)
            if ctl.plan.streamed and getattr(self, "mmap_released", None) is False and ctl.streams_from_file():
                # ComfyUI-GGUF's first load copies every weight it leaves on the CPU to the GPU and back to detach
                # it from the file mapping: the streamed blocks would reach the arena from anonymous copies, so an
                # idle expert's arena could never be dropped for its file pages. They are copied into the arena
                # straight from the file instead (where this platform says what is mapped: Linux); the resident
                # modules go to the GPU either way.
                self.mmap_released = True
        if not ctl.plan.streamed and not ctl.config.offload_embeddings:
            release_spares(torch.device(device_to))  # nothing streams: no arena to take one
            if not ctl.active:
                log.info("lowvram_dit Block Swap: everything fits (%s); nothing to stream",
                         "no budget set on a CPU device" if torch.device(device_to).type == "cpu" else "budget")
            out = super().load(device_to, lowvram_model_memory, force_patch_weights=force_patch_weights,
                                full_load=full_load)
            ctl.parked.say_restored()
            return out
        # The stock loader handles every resident module (LoRA baking, pinning, partial loading if VRAM is short),
        # but must never `model.to(device)` (full_load) since that would move the streamed blocks too. When the plan
        # fits what ComfyUI offered it gets no budget to split: its per-module offload reserve (larger for patched
        # weights) would otherwise leave some resident layers on the CPU, cast and LoRA-patched on every call.
        fits = full_load or lowvram_model_memory <= 0 or ctl.gpu_bytes(ctl.plan) <= lowvram_model_memory
        weights = 1e32 if fits else lowvram_model_memory - ctl.plan.ring_bytes
        if ctl.active:  # a re-load while active: the stock load recounts what it loads, ours is added back after
            ctl._account(self, -ctl._extra_loaded)
        started = time.perf_counter()
        with PageOutAsMoved(resident_file_views(self)) as moved:
            super().load(device_to, lowvram_model_memory=max(weights, 0.1), force_patch_weights=force_patch_weights,
                         full_load=False)
        resident_s = time.perf_counter() - started
        if moved.bytes:
            log.info("lowvram_dit Block Swap: %.2f GB of file pages under the GGUF weights now on the GPU left this "
                     "process's RSS as they were copied (the page cache keeps them)", moved.bytes / 1e9)
        ctl.parked.say_restored()
        if ctl.active:
            ctl._account(self, ctl._extra_loaded)
        else:
            ctl.activate(self, torch.device(device_to), weights_read=force_patch_weights, resident_s=resident_s)

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):  # noqa: ANN001
        out = super().partially_load(device_to, extra_memory, force_patch_weights=force_patch_weights)
        ctl = self._swap
        if ctl is not None and not ctl.active and ctl.plan is not None and ctl.plan.streamed:
            # the stock early return skipped load()
            ctl.activate(self, torch.device(device_to), weights_read=force_patch_weights)
        return out

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):  # noqa: ANN001
        # The block graphs' memory goes first (the model then runs eagerly, with every weight still in place). The
        # weights ComfyUI moves off the GPU here are kept, as they were there, for the next load to copy back
        # (host/parked_weights.py); force_patch_weights and in-place patching leave patched values on the CPU.
        given = release_block_graphs(torch.device(self.load_device), [self]) if memory_to_free > 0 else 0
        if given >= memory_to_free > 0:
            return given
        memory_to_free -= given
        ctl = self._swap
        if ctl is None or force_patch_weights or self.weight_inplace_update:
            return given + super().partially_unload(device_to, memory_to_free, force_patch_weights=force_patch_weights)
        before = regular_weights(self)
        freed = given + super().partially_unload(device_to, memory_to_free, force_patch_weights=force_patch_weights)
        try:
            ctl.parked.park(self, before)
        except (RuntimeError, MemoryError) as exc:  # parking only saves time: never fail ComfyUI's unload for it
            log.warning("lowvram_dit Block Swap: could not keep the unloaded weights in pinned memory (%s); the next "
                        "load reads them from their files", exc)
            ctl.parked.drop()
        return freed

    def patch_weight_to_device(self, key, device_to=None, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
        ctl = self._swap
        if (ctl is not None and ctl.parked.slots and device_to is not None and not args and not kwargs
                and not self.weight_inplace_update and ctl.parked.restore(self, key, device_to)):
            return None
        return super().patch_weight_to_device(key, device_to, *args, **kwargs)

    def unpatch_model(self, device_to=None, unpatch_weights=True):  # noqa: ANN001
        ctl = self._swap
        if not unpatch_weights or ctl is None:
            return super().unpatch_model(device_to=device_to, unpatch_weights=unpatch_weights)
        # A model that streams blocks is unloaded at every Wan 2.2 expert switch: its resident part, LoRA merged,
        # goes to pinned memory for the next load (host/parked_weights.py) instead of back to its file only
        before = ctl.weights_to_park(self)
        ctl.unload(self, keep_parked=bool(before))
        out = super().unpatch_model(device_to=device_to, unpatch_weights=unpatch_weights)
        if before:
            try:
                ctl.parked.park(self, before, whole=True)
            except (RuntimeError, MemoryError) as exc:  # parking only saves time: never fail ComfyUI's unload for it
                log.warning("lowvram_dit Block Swap: could not keep the unloaded weights in pinned memory (%s); the "
                            "next load reads them from their files", exc)
                ctl.parked.drop()
        return out

    def detach(self, unpatch_all=True):  # noqa: ANN001
        # unpatch_all=False: ComfyUI hands the weights to a clone (often this very patcher, re-loaded for the next
        # sampler run): free the ring now, keep the plan and the pinned arena for partially_load to re-activate.
        # unpatch_all: the stock detach unloads through unpatch_model (above); a base class whose detach does not
        # is unloaded after it.
        ctl = self._swap
        if ctl is not None and not unpatch_all:
            ctl.detach(self)
        out = super().detach(unpatch_all)
        if ctl is not None and unpatch_all and ctl.state is not SwapState.UNLOADED:
            ctl.unload(self)
        return out


def fills_beside_forward(device: torch.device) -> bool:
    """Whether an arena whose memory is final (an expert switch into the memory the idle expert left) is filled
    beside the first forward (offload/arena_fill.py): on a GPU, where that forward runs while the CPU copies. On the
    CPU test path the load fills it, so the model's weights are the arena's right after the load."""
    return device.type == "cuda"


def _took(marks: dict[str, float], streamer_took: dict[str, float] | None = None,
          resident_s: float | None = None) -> str:
    """``activated in 2.10 s (host arena 1.50 s (copy 1.0 s, pin 0.5 s)), after ComfyUI loaded the resident part in
    0.80 s`` from perf_counter marks taken in order and the stock load's time, where known."""
    now = time.perf_counter()
    parts = []
    if "arena" in marks:
        split = ""
        if streamer_took and streamer_took.get("background"):
            split = " (the copy runs beside the first forward, into the memory of a dropped arena)" \
                if streamer_took.get("reused") else " (the copy runs beside the first forward)"
        elif streamer_took:
            reused = ", into the memory of a dropped arena" if streamer_took.get("reused") else ""
            split = f" (copy {streamer_took['copy']:.2f} s, pin {streamer_took['pin']:.2f} s{reused})"
        parts.append(f"host arena {marks['arena'] - marks['start']:.2f} s{split}")
    resident = f", after ComfyUI loaded the resident part in {resident_s:.2f} s" if resident_s is not None else ""
    return f"activated in {now - marks['start']:.2f} s" + (f" ({', '.join(parts)})" if parts else "") + resident


def _swap_class(base: type) -> type:
    return mixed_class(BlockSwapMixin, base, "BlockSwap")


class _SwapPrepare:
    """PREPARE_SAMPLING wrapper: record ComfyUI's activation estimate at this resolution before the load.

    The estimate is the one ComfyUI sizes its own partial load by: one model call's batch (``estimate_memory``'s
    second value). Its first value, for a cond+uncond batch, is about twice that, and ComfyUI batches the two only
    when they fit in what is free; reserving it would stream blocks that stock loading keeps on the GPU."""

    def __init__(self, ctl: SwapController, hook: StreamHook | None = None) -> None:
        self.ctl, self.hook = ctl, hook

    def __deepcopy__(self, memo: dict) -> "_SwapPrepare":
        return self

    def __call__(self, executor, model, noise_shape, conds, *args, **kwargs):  # noqa: ANN001, ANN204
        import comfy.sampler_helpers

        try:
            estimate = int(comfy.sampler_helpers.estimate_memory(model, noise_shape, conds)[1])
            self.ctl.activation_bytes = estimate
            for other in self.hook.models.others() if self.hook is not None else ():  # MultiGPU copies
                other.owner.activation_bytes = estimate
        except Exception as exc:  # an estimate must never break sampling
            log.debug("lowvram_dit Block Swap: no activation estimate (%s)", exc)
        out = executor(model, noise_shape, conds, *args, **kwargs)
        # the models are loaded: an arena's memory dropped in this load and not taken by it is not waited for
        release_spares(torch.device(model.load_device))
        return out


# ComfyUI's MultiGPU split (0.23+) calls these on every model copy it makes for another GPU.
MULTIGPU_CALLBACKS = ("ON_DEEPCLONE_MULTIGPU", "ON_MATCH_MULTIGPU_CLONES")


class _SwapPerDevice:
    """MultiGPU clone callback: a copy of the model on another GPU streams its own blocks through its own ring.

    The copy's patcher shares the first model's attachments and forward wrappers; its controller (plan, ring,
    arena) is rebuilt for its own model, and the shared stream hook hands that model's forwards to it."""

    def __init__(self, hook: StreamHook) -> None:
        self.hook = hook  # its owner is the first model's controller

    def __deepcopy__(self, memo: dict) -> "_SwapPerDevice":
        return self

    def __call__(self, parent, clone) -> None:  # noqa: ANN001 - ModelPatcher, ModelPatcher
        first = self.hook.owner
        if clone.model is first.model_ref():
            return
        own = self.hook.for_model(clone.model)
        ctl = own.owner if own is not self.hook else SwapController(first.config, clone.model)
        ctl.activation_bytes = first.activation_bytes
        clone.set_attachments(SWAP_KEY, ctl)
        self.hook.serve(clone.model, ctl)
        log.info("lowvram_dit Block Swap: the model copy for %s streams its own blocks", clone.load_device)


def _controller_or_reason(model, config: SwapConfig) -> tuple[SwapController | None, str]:  # noqa: ANN001
    """The controller that streams ``model``'s blocks, or None and why Block Swap cannot (one log line's worth)."""
    layouts = model_layouts(model)
    if layouts:
        return None, (f"its layers are ComfyUI's quantized layouts ({', '.join(layouts)}), which Block Swap cannot "
                      "stream (it streams plain tensors and GGUF files' GGML tensors); ComfyUI's own partial loading "
                      "offloads it")
    try:
        return SwapController(config, model.model), ""
    except TypeError as exc:  # a tensor kind the engine cannot stream: offload/engine.py block_tensors names it
        return None, f"{exc}; ComfyUI's own partial loading offloads it"


def _replace_previous(m) -> None:  # noqa: ANN001 - ModelPatcher
    """Take a Block Swap applied upstream off the clone ``m`` (its PREPARE_SAMPLING wrapper and MultiGPU callbacks;
    the hook and the attachment are replaced under the same key): the last Block Swap wins wholly."""
    import comfy.patcher_extension as pe

    m.remove_wrappers_with_key(pe.WrappersMP.PREPARE_SAMPLING, SWAP_KEY)
    for kind in MULTIGPU_CALLBACKS:
        if hasattr(pe.CallbacksMP, kind):
            m.remove_callbacks_with_key(getattr(pe.CallbacksMP, kind), SWAP_KEY)


def _legacy_or_reason(model, config: SwapConfig):  # noqa: ANN001, ANN202 - ModelPatcher in, ModelPatcher or str out
    """For a model DynamicVRAM manages: its legacy clone to stream, or why Block Swap leaves it to DynamicVRAM."""
    aside, why = dynamic_vram_policy.steps_aside(config.dynamic_vram, system_ram.usable_ram(), model.model_size())
    if aside:
        return why
    say_once(log, f"lowvram_dit Block Swap streams this model ({why})")
    if model_layouts(model):
        return "ComfyUI's own quantized layers, which Block Swap cannot rebuild"
    return legacy_clone(model, "Block Swap") or "its loader cannot rebuild it for ComfyUI's legacy loading"


def apply_block_swap(model, config: SwapConfig):  # noqa: ANN001, ANN201 - ModelPatcher in and out
    """Return a clone of ``model`` that streams blocks per ``config`` (the node's whole job), or ``model`` itself
    with one log line saying why it passes through."""
    import comfy.patcher_extension as pe

    source = model  # what passes through when Block Swap cannot stream
    if dynamic_vram_manages(model):
        legacy = _legacy_or_reason(model, config)
        if isinstance(legacy, str):
            say_once(log, f"lowvram_dit Block Swap steps aside ({legacy}): ComfyUI's DynamicVRAM streams this "
                          "model's weights to the GPU on demand, and two managers of one model's VRAM would fight. "
                          "Block Swap streams it with dynamic_vram = stream (a model it can rebuild) or with "
                          "ComfyUI started with --disable-dynamic-vram.")
            return model
        model = legacy
    if model.load_device.type == "cpu" and config.blocks_to_swap < 0 and config.vram_budget_gb <= 0:
        log.info("lowvram_dit Block Swap: load device is the CPU and no budget/blocks are set: nothing to swap to, "
                 "the model passes through unchanged")
        return source
    ctl, reason = _controller_or_reason(model, config)  # before the clone: a refusal leaves nothing half-built
    if ctl is None:
        log.warning("lowvram_dit Block Swap passes this model through unchanged: %s", reason)
        return source
    hook = StreamHook(ctl)
    m = model.clone()
    _replace_previous(m)
    m.patches_uuid = uuid.uuid4()  # a plain clone of the same weights must reload after us, and vice versa
    m.set_attachments(SWAP_KEY, ctl)
    register_hook(m, SWAP_KEY, hook)
    m.add_wrapper_with_key(pe.WrappersMP.PREPARE_SAMPLING, SWAP_KEY, _SwapPrepare(ctl, hook))
    for kind in MULTIGPU_CALLBACKS:
        if hasattr(pe.CallbacksMP, kind):
            m.add_callback_with_key(getattr(pe.CallbacksMP, kind), SWAP_KEY, _SwapPerDevice(hook))
    m.__class__ = _swap_class(type(m))  # last: a patcher of this class always has its controller attached
    return m
