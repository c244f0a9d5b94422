"""One hook abstraction for behaviour attached around a DiT's forward and around each of its transformer blocks.

A ``ModelHook`` is a small object with explicit ``pre_forward`` / ``post_forward`` and ``pre_block`` /
``post_block`` methods (or ``wrap_forward`` / ``wrap_block`` when it needs try/finally or a retry). A
``HookRegistry`` holds the hooks of one model by name, runs them as one chain ordered by ``ORDER`` (smaller runs
outside larger), and registering and removing are symmetric, so a model can be restored. Block Swap, NaN Guard
and Torch Compile are hooks; host/hooks.py installs a registry into a ComfyUI MODEL.

Plain torch, no ComfyUI import.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch

# The repeated transformer block list of the DiTs the pack serves: Wan (``blocks``), Qwen-Image
# (``transformer_blocks``).
BLOCK_LISTS: tuple[str, ...] = ("blocks", "transformer_blocks")


def find_blocks(diffusion_model: torch.nn.Module, who: str) -> tuple[str, torch.nn.ModuleList]:
    """The transformer block list of a Wan or Qwen-Image diffusion model; ValueError naming ``who`` otherwise."""
    for name in BLOCK_LISTS:
        blocks = getattr(diffusion_model, name, None)
        if isinstance(blocks, torch.nn.ModuleList) and len(blocks) > 0:
            return name, blocks
    raise ValueError(f"{who}: {type(diffusion_model).__name__} has no `blocks`/`transformer_blocks` list; "
                     "it supports Wan 2.1/2.2 and Qwen-Image models (connect one of those)")


class ModelHook:
    """Behaviour around a model's forward and each of its blocks; every default passes the call through."""

    ORDER: ClassVar[int] = 50  # position in the chain: a smaller ORDER runs outside a larger one
    PER_BLOCK: ClassVar[bool] = False  # True when the block methods do something (the installer skips them else)
    MOVES_WEIGHTS: ClassVar[bool] = False  # True when weights change address between calls (no CUDA graphs)
    PER_SAMPLE: ClassVar[bool] = False  # True when every model call must run one sample at a time (the installer
    # splits a batch of B into B calls): results then do not depend on how samples were batched

    def pre_forward(self, module: Any) -> None:
        """Before the model's forward runs."""

    def post_forward(self, module: Any, output: Any) -> Any:
        """After the forward returned; returns the (possibly replaced) output."""
        return output

    def wrap_forward(self, module: Any, call: Callable[[], Any], registry: HookRegistry) -> Any:
        """Run ``call()`` (the rest of the chain and the forward); ``registry`` tells what else is attached."""
        self.pre_forward(module)
        return self.post_forward(module, call())

    def pre_block(self, index: int, inputs: Any) -> None:
        """Before block ``index`` runs on ``inputs``."""

    def post_block(self, index: int, outputs: Any) -> Any:
        """After block ``index`` returned; returns the (possibly replaced) outputs."""
        return outputs

    def wrap_block(self, index: int, inputs: Any, call: Callable[[Any], Any]) -> Any:
        """Run ``call(inputs)`` (the rest of the chain and the block)."""
        self.pre_block(index, inputs)
        return self.post_block(index, call(inputs))

    def for_model(self, module: Any) -> ModelHook:
        """The hook that serves ``module``'s forward: this one, unless the hook keeps state per model."""
        return self

    def __deepcopy__(self, memo: dict) -> ModelHook:
        return self  # hosts deep-copy model options on clone: every clone keeps sharing the hook's state


class PerModel:
    """Which instance of a hook serves which model, for hooks whose state belongs to one model.

    ComfyUI's MultiGPU split deep-clones a model per extra GPU and runs every copy through the wrappers of the
    first, in one thread per GPU: a hook with per-model or per-forward state (a GPU ring, a NaN record) must not
    serve two models. The first model served keeps the original instance; another gets the one bound to it
    (``bind``) or, failing that, a new one from ``make``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._first: weakref.ref | None = None
        self._others: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def bind(self, module: Any, hook: ModelHook) -> None:
        """Serve ``module`` with ``hook`` from now on."""
        with self._lock:
            self._others[module] = hook

    def others(self) -> list[ModelHook]:
        """The instances serving models other than the first."""
        with self._lock:
            return list(self._others.values())

    def get(self, module: Any, original: ModelHook, make: Callable[[], ModelHook] | None = None) -> ModelHook:
        """The instance for ``module``: bound, else ``original`` for the first model, else ``make()`` (or
        ``original`` without ``make``)."""
        try:
            weakref.ref(module)
        except TypeError:  # not a model object (a bare call in a test or a script): nothing to keep apart
            return original
        with self._lock:
            found = self._others.get(module)
            if found is not None:
                return found
            first = self._first() if self._first is not None else None
            if first is None:
                self._first, first = weakref.ref(module), module
            if first is module or make is None:
                return original
            self._others[module] = made = make()
            return made


class HookRegistry:
    """The named hooks of one model, run as one chain (ORDER, then registration order)."""

    def __init__(self, hooks: dict[str, ModelHook] | None = None) -> None:
        self._hooks: dict[str, ModelHook] = dict(hooks or {})
        self._chain: list[ModelHook] = []
        self._block_chain: list[ModelHook] = []
        self._local = threading.local()  # the chain serving the forward that runs in this thread
        self._sort()

    def _sort(self) -> None:
        self._chain = sorted(self._hooks.values(), key=lambda h: h.ORDER)  # stable: ties keep registration order
        self._block_chain = [h for h in self._chain if h.PER_BLOCK]

    def register(self, name: str, hook: ModelHook) -> None:
        """Attach ``hook`` under ``name``; a hook already there under that name is replaced (the last one wins)."""
        if not isinstance(hook, ModelHook):
            raise TypeError(f"HookRegistry.register({name!r}): {type(hook).__name__} is not a ModelHook")
        self._hooks.pop(name, None)
        self._hooks[name] = hook
        self._sort()

    def remove(self, name: str) -> ModelHook | None:
        """Detach the hook under ``name`` and return it (None when there was none)."""
        hook = self._hooks.pop(name, None)
        self._sort()
        return hook

    def get(self, name: str) -> ModelHook | None:
        """The hook under ``name``, or None."""
        return self._hooks.get(name)

    def copy(self) -> HookRegistry:
        """A registry with the same hooks (shared objects): change the copy, the original stays as it was."""
        return HookRegistry(self._hooks)

    def names(self) -> list[str]:
        """Hook names in chain order (outermost first)."""
        by_id = {id(h): n for n, h in self._hooks.items()}
        return [by_id[id(h)] for h in self._chain]

    def __contains__(self, name: object) -> bool:
        return name in self._hooks

    def __len__(self) -> int:
        return len(self._hooks)

    @property
    def per_block(self) -> bool:
        """True when any hook acts around blocks (the installer then wraps every block)."""
        return bool(self._block_chain)

    @property
    def per_sample(self) -> bool:
        """True when any hook needs every model call to run one sample at a time (``ModelHook.PER_SAMPLE``)."""
        return any(h.PER_SAMPLE for h in self._chain)

    def moves_weights(self) -> bool:
        """True when a hook streams weights between calls (compiled CUDA graphs would replay stale addresses)."""
        return any(h.MOVES_WEIGHTS for h in self._chain)

    def run_forward(self, module: Any, call: Callable[[], Any], inputs: tuple = ((), {})) -> Any:
        """Run ``call()`` (the model's forward) inside every hook's ``wrap_forward``, outermost first; the blocks
        it runs in this thread go through the same model's hooks (``ModelHook.for_model``). ``inputs``: the
        call's (args, kwargs), which hooks read with ``call_inputs``."""
        chain = [h.for_model(module) for h in self._chain]
        outer = getattr(self._local, "block_chain", None), getattr(self._local, "inputs", ((), {}))
        self._local.block_chain, self._local.inputs = [h for h in chain if h.PER_BLOCK], inputs
        try:
            return self._forward(chain, 0, module, call)
        finally:
            self._local.block_chain, self._local.inputs = outer

    def call_inputs(self) -> tuple:
        """(args, kwargs) of the forward running in this thread (empty outside one)."""
        return getattr(self._local, "inputs", ((), {}))

    def _forward(self, chain: list[ModelHook], k: int, module: Any, call: Callable[[], Any]) -> Any:
        if k == len(chain):
            return call()
        return chain[k].wrap_forward(module, lambda: self._forward(chain, k + 1, module, call), self)

    def run_block(self, index: int, inputs: Any, call: Callable[[Any], Any]) -> Any:
        """Run ``call(inputs)`` (block ``index``) inside every per-block hook's ``wrap_block``, outermost first."""
        chain = getattr(self._local, "block_chain", None)
        return self._block(self._block_chain if chain is None else chain, 0, index, inputs, call)

    def _block(self, chain: list[ModelHook], k: int, index: int, inputs: Any, call: Callable[[Any], Any]) -> Any:
        if k == len(chain):
            return call(inputs)
        return chain[k].wrap_block(index, inputs, lambda a: self._block(chain, k + 1, index, a, call))

    def __deepcopy__(self, memo: dict) -> HookRegistry:
        return self  # never changed after installation (changes go to a copy): clones may share it
