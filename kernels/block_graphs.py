"""CUDA graphs of transformer blocks: a block is captured once per input layout and replayed after that.

Where the host issues a block's launches one by one slower than the GPU runs them (Qwen-Image at 1328x1328; the
numbers are in docs/benchmarks.md), a replay issues the whole block at once and the step runs at the GPU's pace. ``BlockGraphs`` is a ``ModelHook`` inside every other per-block hook (Block Swap's
waits stay outside it):

- the first call of a block with a given input layout runs eagerly; it makes every decision its kernels need (the
  attention backend, fp8 activation scales, autotuned tiles). A later call of that layout is captured once no
  decision was made during the eager call before it (``decisions.made()``), and replayed from then on;
- a replay copies the call's tensors into the layout's static inputs and returns the static outputs. Both are shared
  by every block of the model (the blocks run one after another on one stream), so graphs cost two activations per
  layout, plus the scratch of their capture, in one pool shared by all of them;
- a graph is replayed only while every tensor of its block is where it was at capture (``data_ptr``; a weight changed
  in place is read at its new value, a weight moved or re-bound is captured again) and no layer of the block has
  per-call weight functions (lowvram LoRA patches) or a DynamicVRAM slot;
- a capture that fails (a host sync inside the block, an op CUDA cannot capture) leaves that block eager for that
  layout, with one log line;
- memory the host takes back while the weights stay (``give_back``: a decode that fits beside the model only
  without the graphs) leaves the model eager until its weights leave: captured again, the graphs would be given back
  again after every render.

What may stand a whole model call aside (a mask, a ControlNet, another node's patches, Torch Compile) is the host's
to say: ``standing_aside`` returns the reason, or None. A block's outputs are the static buffers, valid until the next
replay of a block of the same layout: the model's own block loop consumes each one before the next block runs.

Plain torch, no ComfyUI import.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_map_only

from . import decisions, triton_launch
from .hooks import HookRegistry, ModelHook, PerModel, find_blocks

log = logging.getLogger("comfyui_lowvram_dit")

StandAside = Callable[[Any, HookRegistry, tuple], "str | None"]  # (model, registry, (args, kwargs)) -> reason

_FAILED = "failed"  # a layout whose capture failed: that block stays eager for it


def _meta(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.dtype, t.device, t.stride())


def layout(inputs: Any) -> tuple | None:
    """What a capture depends on in a block's inputs: each tensor's shape, dtype, device and strides, and each plain
    value, by name. None when an input is of a kind a graph cannot take (a list, a nested dict beside the
    ``transformer_options`` the block reads through Python)."""
    if not isinstance(inputs, dict):
        return None
    out = []
    for name, value in inputs.items():
        if name == "transformer_options":
            continue
        if isinstance(value, torch.Tensor):
            out.append((name, _meta(value)))
        elif isinstance(value, tuple) and all(isinstance(v, torch.Tensor) for v in value):
            out.append((name, tuple(_meta(v) for v in value)))
        elif value is None or isinstance(value, (bool, int, float, str)):
            out.append((name, value))
        else:
            return None
    return tuple(out)


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    tensors: list[tuple[torch.nn.Module, str, bool]]  # (owner, name, is a parameter) of every block tensor
    pointers: tuple[int, ...]  # their data_ptr at capture
    layers: list[torch.nn.Module]  # modules that may carry per-call weight functions or a DynamicVRAM slot
    outputs: Any  # the static outputs the replay writes


@dataclass
class _Layout:
    """Static buffers shared by every block's graph of one input layout."""

    inputs: dict[str, Any]  # name -> static tensor (or tuple of them); plain values as given
    outputs: Any = None  # the static outputs, allocated at the first capture from the eager call's outputs


@dataclass
class _ModelGraphs:
    """The graphs of one model on one device."""

    device: torch.device
    stream: Any  # torch.cuda.Stream
    pool: Any  # one capture pool for every graph of the model
    graphs: dict[tuple, _Graph | str] = field(default_factory=dict)  # (block, layout) -> graph or _FAILED
    layouts: dict[tuple, _Layout] = field(default_factory=dict)
    clean: dict[tuple, bool] = field(default_factory=dict)  # (block, layout): the last eager call decided nothing
    out_meta: dict[tuple, Any] = field(default_factory=dict)  # layout -> the eager call's output structure
    layers: dict[int, list[torch.nn.Module]] = field(default_factory=dict)  # block -> layers with weight functions
    warmed: bool = False  # the capture stream has run a block eagerly (its cuBLAS / cuDNN workspaces exist)
    replays: int = 0
    captured: int = 0


def _owned_tensors(block: torch.nn.Module) -> list[tuple[torch.nn.Module, str, bool]]:
    found = []
    for mod in block.modules():
        found += [(mod, n, True) for n, p in mod._parameters.items() if p is not None]
        found += [(mod, n, False) for n, b in mod._buffers.items() if b is not None]
    return found


def _pointers(tensors: Sequence[tuple[torch.nn.Module, str, bool]]) -> tuple[int, ...] | None:
    out = []
    for mod, name, is_param in tensors:
        t = (mod._parameters if is_param else mod._buffers).get(name)
        if t is None:
            return None
        out.append(t.data_ptr())
    return tuple(out)


def _per_call_weights(layers: Sequence[torch.nn.Module]) -> bool:
    """Whether a layer computes its weight per call (LoRA weight functions, a DynamicVRAM slot)."""
    return any(getattr(m, "weight_function", None) or getattr(m, "bias_function", None)
               or getattr(m, "_v", None) is not None for m in layers)


def _empty_like(value: Any, device: torch.device | str | None = None) -> Any:
    """``value``'s structure with every tensor replaced by an empty one of its shape, strides and dtype, on ``device``
    (None: each tensor's own; "meta": a record of the structure that holds no memory)."""
    return tree_map_only(torch.Tensor, lambda t: torch.empty_strided(
        t.shape, t.stride(), dtype=t.dtype, device=t.device if device is None else device), value)


def _copy_into(static: Any, value: Any) -> None:
    """Copy ``value``'s tensors into ``static``'s, of the same structure (one already in place is not copied)."""
    for s, v in zip(tree_leaves(static), tree_leaves(value)):
        if isinstance(s, torch.Tensor) and s.data_ptr() != v.data_ptr():
            s.copy_(v)


def _same_structure(static: Any, value: Any) -> bool:
    """Same containers and keys, tensors of the same shape, dtype, device and strides, and equal plain values."""
    leaves, spec = tree_flatten(static)
    other, other_spec = tree_flatten(value)
    return spec == other_spec and all(_same_leaf(s, v) for s, v in zip(leaves, other))


def _same_leaf(static: Any, value: Any) -> bool:
    if isinstance(static, torch.Tensor):
        return isinstance(value, torch.Tensor) and _meta(static) == _meta(value)
    return not isinstance(value, torch.Tensor) and static == value


def _tensors_of(inputs: dict) -> dict:
    return {k: v for k, v in inputs.items() if k != "transformer_options"}


def _end_capture_quietly(graph: Any) -> None:
    try:
        graph.capture_end()
    except RuntimeError:  # the capture was invalidated by the error being raised; that error is the one to report
        pass


def _trim_graph_memory(index: int) -> None:
    """``cuDeviceGraphMemTrim`` on device ``index``, through the CUDA driver torch has loaded (nothing without one)."""
    try:
        driver = ctypes.CDLL("nvcuda.dll" if os.name == "nt" else "libcuda.so.1")
    except OSError:
        return
    handle = ctypes.c_int()
    if driver.cuDeviceGet(ctypes.byref(handle), index) == 0:
        driver.cuDeviceGraphMemTrim(handle)


class CudaApi:
    """The CUDA calls ``BlockGraphs`` makes, in one place (the CPU tests give it a stand-in that re-runs the body)."""

    def usable(self, x: torch.Tensor) -> bool:
        """Whether a call whose first input is ``x`` may capture or replay."""
        return x.device.type == "cuda" and not torch.cuda.is_current_stream_capturing()

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def on_stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def new_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def free_graph_memory(self, device: torch.device) -> None:
        """Hand the memory of destroyed graphs back to ``device``. torch's native allocator releases their pool at
        ``empty_cache`` (the host's to call); under cudaMallocAsync (ComfyUI's default) a capture's allocations are
        graph memory nodes, whose physical memory CUDA keeps for graphs, outside the allocator's statistics, until
        ``cuDeviceGraphMemTrim`` (CUDA programming guide, graph memory nodes)."""
        if device.type == "cuda" and torch.cuda.is_initialized():
            torch.cuda.synchronize(device)
            _trim_graph_memory(torch.cuda.current_device() if device.index is None else device.index)

    def record(self, graph: Any, pool: Any, body: Callable[[], None]) -> None:
        """Capture ``body()`` (on the current stream, which the caller set) into ``graph``, in ``pool``; an error
        raised inside ends the capture and propagates."""
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            body()
        except BaseException:
            _end_capture_quietly(graph)
            raise
        graph.capture_end()


class BlockGraphs(ModelHook):
    """Per block: replay the block's CUDA graph for this input layout, capturing it when the layout is settled."""

    ORDER = 45  # inside Block Swap's waits (40): a streamed block's weights are in place before the replay
    PER_BLOCK = True

    def __init__(self, standing_aside: StandAside | None = None, cuda: CudaApi | None = None) -> None:
        self.standing_aside = standing_aside
        self.cuda = cuda or CudaApi()
        self.models = PerModel()
        self._devices: dict[torch.device, _ModelGraphs] = {}
        self._local = threading.local()  # (graphs, blocks) of the forward running in this thread, or None
        self._said: set[str] = set()
        self.given_back = False  # the host took the graphs' memory back while the weights stayed: run eagerly

    def for_model(self, module: Any) -> BlockGraphs:
        """The instance holding ``module``'s graphs (a MultiGPU copy gets its own)."""
        return self.models.get(module, self, lambda: BlockGraphs(self.standing_aside, self.cuda))

    def drop(self) -> None:
        """Forget every graph and static buffer of this model (its weights left the GPU); a later load captures
        again."""
        self._release(list(self._devices))
        self.given_back = False

    def give_back(self, device: torch.device) -> bool:
        """Forget this model's graphs and static buffers on ``device`` (no index: any of its type) because the host
        needs their memory while the weights stay, and run eagerly from now until ``drop``: graphs captured again
        would be given back again, each time for a capture's cost. Whether any were held."""
        held = self._release([d for d in self._devices if d.type == device.type and device.index in (None, d.index)])
        self.given_back = self.given_back or held
        return held

    def _release(self, devices: list[torch.device]) -> bool:
        """Drop the graphs and static buffers held on ``devices`` and hand their memory back; whether any were."""
        for device in devices:
            del self._devices[device]
            self.cuda.free_graph_memory(device)
        return bool(devices)

    def stats(self) -> dict[str, int]:
        """Graphs captured and replays run since the last ``drop``, over every device of this model."""
        return {"captured": sum(s.captured for s in self._devices.values()),
                "replays": sum(s.replays for s in self._devices.values()),
                "failed": sum(g == _FAILED for s in self._devices.values() for g in s.graphs.values())}

    def _say(self, message: str, level: int = logging.INFO) -> None:
        if message not in self._said:
            self._said.add(message)
            log.log(level, message)

    def wrap_forward(self, module: Any, call: Callable[[], Any], registry: HookRegistry) -> Any:
        ctx = self._context(module, registry)
        outer = getattr(self._local, "ctx", None)
        self._local.ctx = ctx
        try:
            return call()
        finally:
            self._local.ctx = outer

    def _context(self, module: Any, registry: HookRegistry) -> tuple[_ModelGraphs, Sequence[torch.nn.Module]] | None:
        """This forward's graphs and blocks, or None when it runs eagerly (one log line per reason)."""
        args, kwargs = registry.call_inputs()
        x = args[0] if args else kwargs.get("x")
        if not isinstance(x, torch.Tensor) or torch.compiler.is_compiling() or not self.cuda.usable(x):
            return None
        reason = self.standing_aside(module, registry, (args, kwargs)) if self.standing_aside else None
        if reason is None and self.given_back:
            reason = "the memory its graphs held was needed beside it; they come back when it is loaded again"
        if reason:
            self._say(f"lowvram_dit block graphs: this model's calls run eagerly ({reason})")
            return None
        _, blocks = find_blocks(getattr(module, "diffusion_model", module), "Block graphs")
        graphs = self._devices.get(x.device)
        if graphs is None:
            graphs = self._devices[x.device] = _ModelGraphs(x.device, self.cuda.new_stream(x.device),
                                                            self.cuda.new_pool())
        return graphs, blocks

    def wrap_block(self, index: int, inputs: Any, call: Callable[[Any], Any]) -> Any:
        ctx = getattr(self._local, "ctx", None)
        lay = layout(inputs) if ctx is not None else None
        if lay is None:
            return call(inputs)
        graphs, blocks = ctx
        key = (index, lay)
        found = graphs.graphs.get(key)
        if found == _FAILED:
            return call(inputs)
        if found is not None:
            if _pointers(found.tensors) == found.pointers and not _per_call_weights(found.layers):
                return self._replay(graphs, lay, found, inputs)
            self._forget(graphs, key)  # its weights moved: eager once more, then captured again
        if graphs.clean.get(key) and lay in graphs.out_meta:
            layers = graphs.layers.get(index)
            if layers is None:
                layers = graphs.layers[index] = [m for m in blocks[index].modules()
                                                 if hasattr(m, "weight_function") or hasattr(m, "_v")]
            if not _per_call_weights(layers):
                return self._capture(graphs, key, blocks[index], layers, inputs, call)
            self._say("lowvram_dit block graphs: blocks whose weights are cast per call (DynamicVRAM, or LoRA "
                      "patches applied per call) run eagerly")
        before = decisions.made()
        out = call(inputs)
        graphs.clean[key] = decisions.made() == before
        graphs.out_meta.setdefault(lay, _empty_like(out, "meta"))
        return out

    def _forget(self, graphs: _ModelGraphs, key: tuple) -> None:
        """Drop one graph. With the last one goes the capture pool: torch's native allocator releases a pool no graph
        uses, and a capture into a released pool's id fails (an internal assert), so later captures get a new one."""
        del graphs.graphs[key]
        graphs.clean.pop(key, None)
        if not any(isinstance(g, _Graph) for g in graphs.graphs.values()):
            graphs.pool = self.cuda.new_pool()

    def _replay(self, graphs: _ModelGraphs, lay: tuple, found: _Graph, inputs: dict) -> Any:
        _copy_into(graphs.layouts[lay].inputs, _tensors_of(inputs))
        found.graph.replay()
        graphs.replays += 1
        return tree_map(lambda x: x, found.outputs)  # new containers: the caller may replace entries

    def _capture(self, graphs: _ModelGraphs, key: tuple, block: torch.nn.Module, layers: list[torch.nn.Module],
                 inputs: dict, call: Callable[[Any], Any]) -> Any:
        """Capture block ``key[0]`` for layout ``key[1]`` on the model's capture stream and replay it for this call;
        the stream's first use runs the block there eagerly instead (libraries allocate their per-stream workspaces
        on first use, which must not happen inside a capture), and the next call captures."""
        current = self.cuda.current_stream(graphs.device)
        graphs.stream.wait_stream(current)
        if not graphs.warmed:
            with self.cuda.on_stream(graphs.stream):
                out = call(inputs)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.is_cuda:  # made on the capture stream, used on the caller's
                    t.record_stream(current)
            current.wait_stream(graphs.stream)
            graphs.warmed = True
            return out
        shared = graphs.layouts.get(key[1])
        if shared is None:
            shared = graphs.layouts[key[1]] = _Layout(_empty_like(_tensors_of(inputs)))
        if shared.outputs is None:
            shared.outputs = _empty_like(graphs.out_meta[key[1]], graphs.device)
        tensors = _owned_tensors(block)
        graph = self.cuda.new_graph()
        try:
            self._record(graph, graphs, shared, inputs, call)
        except (RuntimeError, ValueError) as exc:  # CUDA's capture errors, Triton's launcher; an interrupt propagates
            current.wait_stream(graphs.stream)
            graphs.graphs[key] = _FAILED
            self._say(f"lowvram_dit block graphs: block {key[0]} runs eagerly for this input layout: its capture "
                      f"failed ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})", logging.WARNING)
            return call(inputs)
        current.wait_stream(graphs.stream)
        graphs.graphs[key] = _Graph(graph, tensors, _pointers(tensors) or (), layers, shared.outputs)
        graphs.captured += 1
        return self._replay(graphs, key[1], graphs.graphs[key], inputs)

    def _record(self, graph: Any, graphs: _ModelGraphs, shared: _Layout, inputs: dict,
                call: Callable[[Any], Any]) -> None:
        """Record the block, run on the static inputs and writing into the static outputs, into ``graph``: every
        allocation made inside is freed inside, so the graph keeps only scratch memory in the model's pool."""
        static_call = dict(shared.inputs)
        if "transformer_options" in inputs:
            static_call["transformer_options"] = inputs["transformer_options"]

        def body() -> None:
            out = call(static_call)
            if not _same_structure(shared.outputs, out):
                raise RuntimeError("the block's outputs differ from its eager call's in this layout")
            _copy_into(shared.outputs, out)

        with self.cuda.on_stream(graphs.stream), triton_launch.capturing():
            self.cuda.record(graph, graphs.pool, body)
