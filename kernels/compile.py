"""Regional torch.compile with an OOM-safe fallback chain, usable around any call that runs a model.

Regional: every repeated transformer block is wrapped in its own ``torch.compile`` object. Dynamo inlines
nn.Modules and treats parameters as graph inputs (always on since torch 2.6), so the first block is traced
once and the other blocks reuse that graph; weights that block swap streams into new buffers do not
recompile either, because guards check dtype/device/shape, not addresses. Offload and prefetch code runs
between block calls, outside the compiled region.

Compiled modules are swapped into the model only for the duration of ``CompiledRegions.run`` and always
restored in ``finally``: the model is never left half-patched and ``state_dict()`` never shows ``_orig_mod.``.

OOM-safe: a compile failure or out-of-memory during compile or the first compiled run frees what the attempt
held and retries the same call one step down the chain (e.g. reduce-overhead -> default -> eager); the mode in
use is logged. CUDA graphs (reduce-overhead, max-autotune, the cudagraphs backend) need fixed weight
addresses, so they are swapped for their no-cudagraphs twin when weights stream. Under CUDA graphs every block
call is its own torch.compile invocation, which cudagraph trees treat as a new step: the previous block's
outputs (this block's input) would be overwritten by the next replay, so block outputs are cloned outside the
compiled region (one copy of the hidden states per block).

Where compiling pays is timed per model and input shapes on the GPU (kernels/compile_pays.py, ``pays``): a model
whose compiled call is not faster runs eager. ``CompileHook`` attaches the regions to a model through
kernels/hooks.py. Never imports ComfyUI.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, TypeVar

import torch
from torch.utils._pytree import tree_map_only

from .compile_gate import GATE, input_signature
from .compile_pays import COMPILED, EAGER, CallTimer, CompilePays, call_device
from .decisions import device_kind
from .hooks import BLOCK_LISTS, HookRegistry, ModelHook

log = logging.getLogger("comfyui_lowvram_dit")

T = TypeVar("T")

MODES: tuple[str, ...] = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_BACKENDS: tuple[str, ...] = ("inductor", "cudagraphs")


@dataclass(frozen=True)
class CompileConfig:
    """What to compile and how; built by the node, consumed by ``CompiledRegions``."""

    mode: str = "default"
    backend: str = "inductor"
    dynamic: Optional[bool] = None  # None = auto: static first, dynamic after a shape change
    fullgraph: bool = False
    cache_size_limit: int = 64  # dynamo's default 8 is too few for cond/uncond x resolutions x 2 experts
    fallback: bool = True
    # Inductor picks its reduction configs without timing them on the GPU: timed choices differ between GPUs and
    # runs, so a model copy on a second GPU (MultiGPU CFG split) would round differently from the first.
    deterministic: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"CompileConfig.mode '{self.mode}' is not one of {MODES}")
        if self.backend not in COMPILE_BACKENDS:
            raise ValueError(f"CompileConfig.backend '{self.backend}' is not one of {COMPILE_BACKENDS}")
        if self.cache_size_limit < 1:
            raise ValueError("CompileConfig.cache_size_limit must be >= 1")

    @property
    def uses_cuda_graphs(self) -> bool:
        """True when this config records CUDA graphs (needs static weight addresses)."""
        return self.backend == "cudagraphs" or self.mode in ("reduce-overhead", "max-autotune")

    def describe(self) -> str:
        """Short form for logs: 'inductor/max-autotune-no-cudagraphs'."""
        return self.backend if self.backend == "cudagraphs" else f"{self.backend}/{self.mode}"


def without_cuda_graphs(config: CompileConfig) -> CompileConfig:
    """The closest config that records no CUDA graphs (what works while weights stream)."""
    if config.backend == "cudagraphs":
        return dataclasses.replace(config, backend="inductor", mode="default")
    twin = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}
    return dataclasses.replace(config, mode=twin.get(config.mode, config.mode))


def fallback_chain(config: CompileConfig) -> list[Optional[CompileConfig]]:
    """Configs to try in order, ending in None (eager): cheaper and less memory-hungry at each step."""
    chain: list[Optional[CompileConfig]] = [config]
    if config.fallback:
        step = config
        while True:
            if step.uses_cuda_graphs:
                step = without_cuda_graphs(step)
            elif step.mode == "max-autotune-no-cudagraphs":
                step = dataclasses.replace(step, mode="default")
            else:
                break
            chain.append(step)
        chain.append(None)
    return chain


def compile_kwargs(config: CompileConfig, guard_filter_fn: Optional[Callable] = None) -> dict[str, Any]:
    """Keyword arguments for ``torch.compile``.

    torch refuses ``mode`` together with ``options``; a guard filter needs ``options``, so the mode is spelled
    out as the inductor options it stands for (``torch._inductor.list_mode_options``).
    """
    kwargs: dict[str, Any] = {"backend": config.backend, "fullgraph": config.fullgraph, "dynamic": config.dynamic}
    if config.backend != "inductor":
        if guard_filter_fn is not None:
            kwargs["options"] = {"guard_filter_fn": guard_filter_fn}
        return kwargs
    deterministic = inductor_deterministic(config)
    if guard_filter_fn is None and not deterministic:
        kwargs["mode"] = config.mode
        return kwargs
    import torch._inductor

    options = dict(torch._inductor.list_mode_options(config.mode))
    if guard_filter_fn is not None:
        options["guard_filter_fn"] = guard_filter_fn
    if deterministic:
        options["deterministic"] = True
    kwargs["options"] = options
    return kwargs


def inductor_deterministic(config: CompileConfig) -> bool:
    """Whether to compile in Inductor's deterministic mode: asked for, known to this torch (2.10+), and not a
    max-autotune mode (whose point is timing kernels on the GPU)."""
    if not config.deterministic or config.backend != "inductor" or config.mode.startswith("max-autotune"):
        return False
    try:
        import torch._inductor.config as inductor_config
    except ImportError:
        return False
    return hasattr(inductor_config, "deterministic")


def transformer_options_guard_filter(guard_entries: list[Any]) -> list[bool]:
    """Dynamo guard filter: drop guards on ``transformer_options`` (block_index, sigmas, patches change per block
    and per step and would recompile every block), but keep those on the attention override so models with
    different attention settings never share a graph. ComfyUI's own node drops all of them
    (comfy_extras/nodes_torch_compile.py, skip_torch_compile_dict)."""
    return [("transformer_options" not in e.name) or ("optimized_attention_override" in e.name)
            for e in guard_entries]


# ------------------------------------------------------------------------------------ failure classification


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    stack: list[Optional[BaseException]] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack += [getattr(e, "inner_exception", None), e.__cause__, e.__context__]


def is_oom(exc: BaseException) -> bool:
    """True for out-of-memory anywhere in the exception chain (dynamo wraps backend errors)."""
    for e in _chain(exc):
        if isinstance(e, torch.OutOfMemoryError):
            return True
        if isinstance(e, RuntimeError) and "out of memory" in str(e).lower():
            return True  # Triton / cuBLAS workspace failures surface as plain RuntimeError
    return False


# cudagraph trees raise plain RuntimeErrors; these phrases mark the CUDA-graph runtime, not the model.
_CUDA_GRAPH_ERRORS: tuple[str, ...] = ("cudagraph", "cuda graph", "stream capture", "stream is capturing")


def is_compile_failure(exc: BaseException) -> bool:
    """True when the compiler (dynamo, AOT, inductor, Triton) or its CUDA-graph runtime failed, not the model."""
    for e in _chain(exc):
        module = type(e).__module__ or ""
        if module.startswith(("torch._dynamo", "torch._inductor", "torch._functorch", "triton")):
            return True
        if isinstance(e, RuntimeError) and any(p in str(e).lower() for p in _CUDA_GRAPH_ERRORS):
            return True
    return False


def describe_failure(exc: BaseException) -> str:
    """'out of memory: OutOfMemoryError: CUDA out of memory...' using the innermost cause dynamo wrapped."""
    causes = list(_chain(exc))
    inner = next((e for e in causes if isinstance(e, torch.OutOfMemoryError)), None)
    inner = inner or getattr(exc, "inner_exception", None) or exc.__cause__ or exc
    text = str(inner).strip().splitlines()[0][:300] if str(inner).strip() else ""
    where = raised_at(inner)
    return (f"{'out of memory' if is_oom(exc) else 'compiler error'}: {type(inner).__name__}: {text}"
            + (f" (raised at {where})" if where else ""))


def raised_at(exc: BaseException) -> str:
    """Where ``exc`` was raised, as 'torch/_dynamo/x.py:123 in fn': the frame a bug report needs, with the path
    from the package folder on (no folder of this machine)."""
    tb = exc.__traceback__
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    parts = code.co_filename.replace("\\", "/").split("/")
    anchor = max((i for i, p in enumerate(parts) if p in ("site-packages", "dist-packages")), default=len(parts) - 3)
    return f"{'/'.join(parts[anchor + 1:]) or parts[-1]}:{tb.tb_lineno} in {code.co_name}"


class GraphOutputsCloned(torch.nn.Module):
    """Runs a compiled block and clones its tensor outputs, so a later CUDA-graph replay cannot overwrite them.

    The compiled module is held outside ``_modules``: the wrapper adds no parameters and no state_dict keys. Other
    attributes read through to it, as a swapped-in whole model must still answer ``dtype`` and the like."""

    def __init__(self, compiled: Any) -> None:
        super().__init__()
        self.__dict__["compiled"] = compiled

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["compiled"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return tree_map_only(torch.Tensor, torch.Tensor.clone, self.compiled(*args, **kwargs))


def contiguous_hidden_states(module: Any, args: tuple) -> Optional[tuple]:
    """Forward pre-hook of a compiled block: its first argument (the hidden states) made contiguous.

    Dynamo guards on strides. Block 0 gets the patch embedding's transposed view, every later block the previous
    block's contiguous output, so without the copy block 0 compiles a graph of its own: a second full compile in
    the first step. One copy of the hidden states per step."""
    if args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
        return (args[0].contiguous(), *args[1:])
    return None


# ---------------------------------------------------------------------------------------------- regions


def find_block_lists(root: torch.nn.Module, prefix: str = "") -> list[str]:
    """Dotted paths of every block of the repeated-block lists under ``root`` (e.g. 'blocks.0' ... 'blocks.39')."""
    paths: list[str] = []
    for name, module in root.named_modules(prefix=prefix.rstrip(".")):
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.ModuleList) and leaf in BLOCK_LISTS and len(module) > 0:
            paths += [f"{name}.{i}" for i in range(len(module))]
    return paths


def get_submodule(root: torch.nn.Module, path: str) -> torch.nn.Module:
    """``root.a.b.0`` for path 'a.b.0'."""
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def set_submodule(root: torch.nn.Module, path: str, module: torch.nn.Module) -> None:
    """Replace the submodule at ``path`` (ModuleList items included)."""
    parent_path, _, leaf = path.rpartition(".")
    parent = get_submodule(root, parent_path) if parent_path else root
    setattr(parent, leaf, module)


class _RecompileLimit:
    """Dynamo's recompile limit raised while any compiled call runs, restored when the last one ends.

    The limit is process-wide and ComfyUI's MultiGPU split runs one compiled model per GPU in threads at once: a
    plain ``dcfg.patch`` per call would let the first call to finish restore the default under the other, whose
    next recompile could then give up and run eagerly (other rounding)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.saved: dict[str, int] = {}
        self.limit = 0

    @contextlib.contextmanager
    def scope(self, limit: int) -> Iterator[None]:
        """Raise the limit to at least ``limit`` for the duration of one call."""
        import torch._dynamo.config as dcfg

        name = "recompile_limit" if hasattr(dcfg, "recompile_limit") else "cache_size_limit"
        acc = "accumulated_recompile_limit" if hasattr(dcfg, "accumulated_recompile_limit") else \
            "accumulated_cache_size_limit"
        with self.lock:
            if self.users == 0:
                self.saved = {n: getattr(dcfg, n) for n in (name, acc) if hasattr(dcfg, n)}
                self.limit = 0
            self.users += 1
            self.limit = max(self.limit, limit)
            setattr(dcfg, name, self.limit)
            if acc in self.saved:
                setattr(dcfg, acc, max(self.saved[acc], self.limit * 8))
        try:
            yield
        finally:
            with self.lock:
                self.users -= 1
                if self.users == 0:
                    for n, value in self.saved.items():
                        setattr(dcfg, n, value)


_RECOMPILE_LIMIT = _RecompileLimit()


def _recompile_limit(limit: int) -> contextlib.AbstractContextManager[None]:
    """Scope dynamo's recompile limit to the calls that run compiled: never a permanent global flip."""
    return _RECOMPILE_LIMIT.scope(limit)


def free_compiler_memory(used_cuda_graphs: bool) -> None:
    """Release what a failed attempt held: graphs' pools (global dynamo reset, only then), caches, garbage."""
    if used_cuda_graphs:
        # cudagraph trees keep private memory pools that only a dynamo reset frees; it also drops other
        # models' compiled code (they recompile on next use), acceptable after an OOM.
        torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def unique_graphs() -> int:
    """Graphs dynamo compiled in this process so far (every recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompiledRegions:
    """Compiles the named submodules of a root module lazily and runs calls through them with fallback."""

    def __init__(self, config: CompileConfig, paths: list[str], *,
                 guard_filter_fn: Optional[Callable] = None,
                 compile_fn: Callable[..., Any] = torch.compile,
                 pays: Optional[CompilePays] = None) -> None:
        if not paths:
            raise ValueError("CompiledRegions needs at least one submodule path to compile")
        self.requested = config
        self.paths = list(paths)
        self.guard_filter_fn = guard_filter_fn
        self.compile_fn = compile_fn  # injectable: tests force failures at compile or first run
        self.pays = pays  # None: always compiled; else compiled only where a timed call says it pays (GPU only)
        self.eager_because = ""  # why the last call ran eager although a compile config is in use
        self.chain = fallback_chain(config)
        self.level = 0
        self.streaming_adjusted = False
        self._compiled: dict[tuple[int, str], Any] = {}  # (id(root), path) -> compiled module
        self._verified: set[int] = set()  # roots whose first compiled run at the current level succeeded
        self._seen: set[tuple] = set()  # (id(root), input signature, level) that ran compiled already
        self._ran_eager: set[tuple] = set()  # (id(root), input signature) that ran eager already
        self.calls = 0
        self._graphs_after_warmup: Optional[int] = None
        self._recompile_warned = False
        self.recompile_cause: Optional[str] = None  # set by the caller when it knows why graphs change per step

    @property
    def current(self) -> Optional[CompileConfig]:
        """The config in use now; None means eager."""
        return self.chain[self.level]

    def status(self) -> str:
        """Human summary: requested config, config in use, why it differs."""
        now = "eager (not compiled)" if self.current is None else self.current.describe()
        if self.current is not None and self.eager_because:
            now = f"eager ({self.eager_because})"
        text = f"torch.compile {self.requested.describe()}: running {now} over {len(self.paths)} region(s)"
        if self.streaming_adjusted:
            text += "; CUDA graphs disabled because weights stream"
        return text

    def adapt_to_streaming(self) -> None:
        """Weights move between calls (Block Swap streams blocks): drop CUDA-graph configs, say so once."""
        if self.streaming_adjusted or self.current is None or not self.current.uses_cuda_graphs:
            return
        fixed = without_cuda_graphs(self.current)
        self.chain = [fixed] + [c for c in fallback_chain(fixed)[1:]]
        self.level = 0
        self.streaming_adjusted = True
        self._drop_compiled()
        log.warning("lowvram_dit compile: %s records CUDA graphs, which need fixed weight addresses; weights "
                    "stream (Block Swap), so using %s instead", self.requested.describe(),
                    fixed.describe())

    def run(self, root: torch.nn.Module, call: Callable[[], T], *, streaming: bool = False,
            signature: tuple = (), device: Optional[torch.device] = None) -> T:
        """Run ``call()`` with the regions of ``root`` compiled; on compile failure or OOM step down and retry.

        ``signature`` (``compile_gate.input_signature`` of the model call): a call of one not seen yet for this
        root may compile, so it runs alone (``compile_gate.GATE``); others run beside other threads' calls. With
        ``pays`` a call on a GPU (``device``, ``compile_pays.call_device``) may run eager instead: while it is
        timed, or where compiling did not pay."""
        if streaming:
            self.adapt_to_streaming()
        how, timer = self._plan(root, signature, device)
        if timer is not None:
            timer.start()
        try:
            if how == EAGER:
                result = call()
                self._ran_eager.add((id(root), signature))
            else:
                seen = (id(root), signature, self.level)
                with GATE.call(may_compile=seen not in self._seen or id(root) not in self._verified):
                    result = self._run(root, call)
                self._seen.add((id(root), signature, self.level))
        except BaseException:
            if timer is not None:
                timer.failed = True
            raise
        if timer is not None:
            timer.stop()
        return result

    def _plan(self, root: torch.nn.Module, signature: tuple,
              device: Optional[torch.device]) -> tuple[str, Optional[CallTimer]]:
        """How this call runs: compiled (with no ``pays``, off the GPU, or once eager is the chain's end) or as
        ``pays`` says for this model, input shapes, device kind and config (eager while it measures)."""
        self.eager_because = ""
        if self.pays is None or self.current is None or device is None or device.type != "cuda":
            return COMPILED, None
        key = (type(root).__name__, signature, device_kind(device), self.current.describe())
        how, timer = self.pays.plan(key, device, warm=self._warm_ways(root, signature))
        if how == EAGER:
            self.eager_because = "compiling did not pay" if self.pays.winners.get(key) == EAGER else \
                "timing whether compiling pays"
        return how, timer

    def _warm_ways(self, root: torch.nn.Module, signature: tuple) -> frozenset[str]:
        """How ``root`` has already run with inputs of ``signature``: EAGER, COMPILED (at the current level)."""
        ways = {EAGER} if (id(root), signature) in self._ran_eager else set()
        if (id(root), signature, self.level) in self._seen:
            ways.add(COMPILED)
        return frozenset(ways)

    def _run(self, root: torch.nn.Module, call: Callable[[], T]) -> T:
        while True:
            config = self.current
            if config is None:
                return call()
            first = id(root) not in self._verified
            before = unique_graphs()
            failure: Optional[str] = None
            try:
                with self._swapped_in(root, config), _recompile_limit(config.cache_size_limit):
                    result = call()
            except Exception as exc:
                if not (is_oom(exc) or is_compile_failure(exc)) or not config.fallback:
                    raise
                failure = describe_failure(exc)
                del exc  # drop the traceback's frames (and the activations they hold) before retrying
            if failure is None:
                self._verified.add(id(root))
                self._watch_recompiles(before, first)
                return result
            self._step_down(config, failure)

    def _step_down(self, failed: CompileConfig, failure: str) -> None:
        self._drop_compiled()
        free_compiler_memory(failed.uses_cuda_graphs)
        self.level += 1
        self._verified.clear()
        now = "eager (no compile)" if self.current is None else self.current.describe()
        log.warning("lowvram_dit compile: %s failed (%s); freed its memory, retrying this step with %s",
                    failed.describe(), failure, now)

    def _drop_compiled(self) -> None:
        self._compiled.clear()

    def _compiled_for(self, root: torch.nn.Module, path: str, config: CompileConfig) -> Any:
        key = (id(root), path)
        if key not in self._compiled:
            module = get_submodule(root, path)
            compiled = self.compile_fn(module, **compile_kwargs(config, self.guard_filter_fn))
            if isinstance(compiled, torch.nn.Module):  # runs eagerly, before Dynamo's frame
                compiled.register_forward_pre_hook(contiguous_hidden_states)
            self._compiled[key] = GraphOutputsCloned(compiled) if config.uses_cuda_graphs else compiled
        return self._compiled[key]

    @contextlib.contextmanager
    def _swapped_in(self, root: torch.nn.Module, config: CompileConfig) -> Iterator[None]:
        originals: dict[str, torch.nn.Module] = {}
        try:
            for path in self.paths:
                original = get_submodule(root, path)
                compiled = self._compiled_for(root, path, config)
                originals[path] = original
                set_submodule(root, path, compiled)
            yield
        finally:
            for path, original in originals.items():
                set_submodule(root, path, original)

    def _watch_recompiles(self, before: int, first: bool) -> None:
        """Warn once when graphs keep appearing after warm-up: a recompile every step costs more than it saves."""
        self.calls += 1
        new = unique_graphs() - before
        if first or self.calls <= 3 or new <= 0:
            return
        if not self._recompile_warned:
            self._recompile_warned = True
            cause = self.recompile_cause or ("something in the inputs changes every step (shape, dtype, or a "
                                             "streamed weight's device). Set dynamic=true, or compile once per "
                                             "resolution")
            log.warning("lowvram_dit compile: %d new graph(s) compiled on call %d; %s", new, self.calls, cause)


class CompileHook(ModelHook):
    """Runs every model call through ``CompiledRegions``; CUDA-graph modes give way while weights stream."""

    ORDER = 0  # outermost: a retry after a failed compile re-runs every other hook's forward
    # Inductor's kernels for a batch of 1 and of 2 round differently, and ComfyUI's MultiGPU split runs cond and
    # uncond one sample per GPU where one GPU runs them as a batch of 2: every sample goes through the batch-1
    # graph instead, so a compiled model gives the same result split or not.
    PER_SAMPLE = True

    def __init__(self, regions: CompiledRegions,
                 partial_load: Callable[[Any], bool] = lambda module: False,
                 recompile_cause: Callable[[tuple], Optional[str]] = lambda inputs: None) -> None:
        self.regions = regions
        self.partial_load = partial_load  # the host's own partial (low-VRAM) loading: runs eager
        self.recompile_cause = recompile_cause  # the host's reading of a call's inputs: what recompiles per step
        self._last_status = ""

    def wrap_forward(self, module: Any, call: Callable[[], T], registry: HookRegistry) -> T:
        """Run ``call`` with ``module``'s regions compiled; log the mode in use whenever it changes."""
        inputs = registry.call_inputs()
        if self.partial_load(module):  # every offloaded layer copies its weight per call: a graph break each
            self.regions.eager_because = "the host loaded this model partially; its layers copy weights per call"
            out = call()
        else:
            self.regions.recompile_cause = self.recompile_cause(inputs)
            out = self.regions.run(module, call, streaming=registry.moves_weights(),
                                   signature=input_signature(*inputs), device=call_device(*inputs))
        status = self.regions.status()
        if status != self._last_status:
            self._last_status = status
            log.info("lowvram_dit %s", status)
        return out
