"""Checkpoint I/O: validated safetensors headers, tensor-at-a-time reads and streaming writes.

Plain torch + safetensors; no ComfyUI. Every error names the file and what was expected, so a node
can show it to the user as is.
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import os
import queue
import struct
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import safe_write

# safetensors dtype strings <-> torch dtypes (the subset diffusion checkpoints use).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
if hasattr(torch, "float8_e8m0fnu"):  # mxfp8 block scales (ComfyUI's mxfp8 layout); torch >= 2.7
    SAFETENSORS_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu
TORCH_TO_SAFETENSORS: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_DTYPES.items()}

_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit
_MAX_DIMS, _MAX_DIM = 16, 1 << 40  # diffusion checkpoints use <= 5 dimensions; larger ones come from damage
_ALIGN = 8
# Called with each tensor map_tensors serves as a view of the file, its byte offset in the file and its size: how a
# host's memory manager learns it can read the weight from the file itself (host/file_slices.py).
MapHook = Callable[[torch.Tensor, int, int], None]


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; the message names the file and the fix."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in a safetensors header."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated safetensors header: tensors by name, the ``__metadata__`` dict, the data offset."""

    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_offset: int
    file_size: int


def written_with(key: str, value: str | None = None) -> safe_write.Owned:
    """Proof that a safetensors file is the pack's (for StreamingSafetensorsWriter's ``owned``): its header
    metadata holds ``key`` (equal to ``value`` when given); a file that is not safetensors proves nothing."""

    def owned(path: Path) -> bool:
        try:
            meta = read_header(path).metadata
        except CheckpointError:
            return False
        return key in meta and (value is None or meta[key] == value)

    return owned


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Read and validate a safetensors header without touching tensor data.

    Raises CheckpointError for a missing file, a pickle checkpoint, a corrupt header, an unknown
    dtype, a shape that does not match its byte range, or a truncated file.
    """
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"{p}: file not found")
    suffix = p.suffix.lower()
    if suffix in {".ckpt", ".pt", ".pth", ".bin", ".pkl"}:
        raise CheckpointError(
            f"{p.name}: pickle checkpoints ({suffix}) can run code when loaded and are not read by this pack; "
            "convert it to .safetensors"
        )
    size = p.stat().st_size
    if size < 8:
        raise CheckpointError(f"{p.name}: {size} bytes is too small to be a safetensors file (truncated?)")
    with p.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        _check_header_start(p, header_len, size)
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:  # RecursionError: deep nesting
        # the exception's text quotes bytes of the file (UnicodeDecodeError): only its kind is named
        raise CheckpointError(f"{p.name}: corrupt safetensors header ({type(exc).__name__}); the file is damaged "
                              "or not a safetensors file") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{p.name}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{p.name}: corrupt safetensors header (__metadata__ is not an object)")
    data_offset = 8 + header_len
    data_size = size - data_offset
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        try:
            dtype_s, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            shape_t = tuple(int(s) for s in shape)
            begin, end = int(begin), int(end)
        except (TypeError, KeyError, ValueError, OverflowError):  # OverflowError: Infinity / 1e400 in the JSON
            raise CheckpointError(f"{p.name}: corrupt safetensors header entry for tensor {name!r}") from None
        dtype = SAFETENSORS_DTYPES.get(dtype_s) if isinstance(dtype_s, str) else None
        if dtype is None:
            raise CheckpointError(f"{p.name}: tensor {name!r} has unsupported dtype {dtype_s!r}")
        if any(s < 0 for s in shape_t) or begin < 0 or end < begin:
            raise CheckpointError(f"{p.name}: corrupt safetensors header entry for tensor {name!r}")
        if len(shape_t) > _MAX_DIMS or any(s > _MAX_DIM for s in shape_t):
            raise CheckpointError(f"{p.name}: tensor {name!r} declares the impossible shape {list(shape_t)[:8]} "
                                  f"({len(shape_t)} dimensions); the header is corrupt, download the file again")
        expected = math.prod(shape_t) * dtype.itemsize
        if end - begin != expected:
            raise CheckpointError(
                f"{p.name}: tensor {name!r} declares shape {list(shape_t)} {dtype_s} ({expected} bytes) "
                f"but spans {end - begin} bytes; the header is corrupt"
            )
        if end > data_size:
            raise CheckpointError(
                f"{p.name}: truncated file: tensor {name!r} ends at byte {data_offset + end} "
                f"but the file has {size} bytes; download it again"
            )
        tensors[name] = TensorInfo(name, dtype, shape_t, data_offset + begin, data_offset + end)
    _check_no_overlap(p, tensors)
    return SafetensorsHeader(p, tensors, {str(k): str(v) for k, v in metadata.items()}, data_offset, size)


def _check_header_start(p: Path, header_len: int, size: int) -> None:
    """CheckpointError unless the first 8 bytes are a plausible safetensors header length for this file.

    The declared length is never put in the message: for a file of another kind it is that file's first bytes.
    """
    if header_len <= 0 or header_len > _MAX_HEADER_BYTES:
        raise CheckpointError(f"{p.name}: not a safetensors file (corrupt safetensors header: its first bytes are not "
                              "a header length); pick the model's .safetensors file, or download it again")
    if 8 + header_len > size:
        raise CheckpointError(f"{p.name}: truncated safetensors file (its header runs past the end of the file's "
                              f"{size} bytes); download it again")


def _check_no_overlap(p: Path, tensors: dict[str, TensorInfo]) -> None:
    """The format forbids two tensors sharing bytes; a header that does so is crafted or corrupt."""
    spans = sorted((i.begin, i.end, i.name) for i in tensors.values() if i.end > i.begin)
    for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:]):
        if begin_b < end_a:
            raise CheckpointError(f"{p.name}: tensors {a!r} and {b!r} overlap in the file (data_offsets); the "
                                  "header is corrupt, download the file again")


WEIGHT_SCALE_SUFFIXES = (".scale_weight", ".weight_scale", ".scale_weight_tensor")
_MAX_QUANT_JSON = 1 << 16  # bytes of one layer's ComfyUI quantization config; real ones are ~50


def check_weight_scales(header: SafetensorsHeader, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """CheckpointError naming the file and tensor unless every weight scale among ``tensors`` is a finite,
    positive float: a NaN, infinite, zero or negative scale loads silently and spoils every image later."""
    for name, t in tensors:
        if not name.endswith(WEIGHT_SCALE_SUFFIXES):
            continue
        if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise CheckpointError(f"{header.path.name}: weight scale {name!r} is {t.dtype}, expected a float32/"
                                  "bf16/fp16 scale; the file is damaged, download it again")
        v = t.float()
        if v.numel() and not bool((torch.isfinite(v) & (v > 0)).all()):
            raise CheckpointError(f"{header.path.name}: weight scale {name!r} holds NaN, infinite, zero or negative "
                                  "values; the file is damaged (download it again) or was quantized wrongly")


def _quant_json(header: SafetensorsHeader, raw: str | bytes, where: str) -> Any:
    """``raw`` parsed as JSON; CheckpointError naming the file and ``where`` for bad bytes, syntax or nesting."""
    try:
        return json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{header.path.name}: {where} is not valid UTF-8 JSON ({type(exc).__name__}); the "
                              "file is damaged, download it again") from None


def quant_layer_configs(header: SafetensorsHeader) -> dict[str, dict[str, Any]]:
    """ComfyUI's per-layer quantization configs (``_quantization_metadata`` and ``<layer>.comfy_quant`` tensors),
    keyed by full layer name, each checked to be an object with a string ``format``; CheckpointError naming the
    file, the tensor and the fix otherwise (never an AttributeError, RecursionError or UnicodeDecodeError)."""
    def conf_of(value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict) or not isinstance(value.get("format", ""), str):
            raise CheckpointError(f"{header.path.name}: {where} is not a quantization config (a JSON object with a "
                                  "string 'format'); the file is damaged, download it again")
        return value

    layers: dict[str, dict[str, Any]] = {}
    raw = header.metadata.get("_quantization_metadata")
    if raw is not None:
        meta = _quant_json(header, raw, "metadata _quantization_metadata")
        if not isinstance(meta, dict) or not isinstance(meta.get("layers"), dict):
            raise CheckpointError(f"{header.path.name}: metadata _quantization_metadata has no 'layers' object; "
                                  "the file is damaged, download it again")
        for name, conf in meta["layers"].items():
            layers[name] = conf_of(conf, f"_quantization_metadata layer {name!r}")
    names = [n for n in header.tensors if n.endswith(".comfy_quant")]
    for name in names:
        info = header.tensors[name]
        if info.dtype not in (torch.uint8, torch.int8) or len(info.shape) != 1 or info.nbytes > _MAX_QUANT_JSON:
            raise CheckpointError(f"{header.path.name}: tensor {name!r} ({info.dtype}, {list(info.shape)}) is not a "
                                  "quantization config (1-D uint8 JSON); the file is damaged, download it again")
    for name, t in iter_tensors(header, names):
        conf = _quant_json(header, bytes(t.view(torch.uint8).tolist()), f"tensor {name!r}")
        layers[name[: -len(".comfy_quant")]] = conf_of(conf, f"tensor {name!r}")
    return layers


def check_quantization(header: SafetensorsHeader) -> dict[str, dict[str, Any]]:
    """Validate a file's quantization data before any weight is read: ``quant_layer_configs`` plus
    ``check_weight_scales`` over its scale tensors (read here; loaders with per-layer scalars use this)."""
    layers = quant_layer_configs(header)
    # fp8 / e8m0 block scales of ComfyUI's other layouts (mxfp8, nvfp4, ...) are ComfyUI's to check
    other = {layer for layer, conf in layers.items() if conf.get("format") not in ("float8_e4m3fn", "float8_e5m2")}
    names = [n for n in header.tensors if n.endswith(WEIGHT_SCALE_SUFFIXES) and n.rpartition(".")[0] not in other]
    check_weight_scales(header, iter_tensors(header, names))
    return layers


def check_ranks(header: SafetensorsHeader, ranks: dict[str, int], what: str) -> None:
    """CheckpointError naming the file unless each (present) tensor in ``ranks`` has that many dimensions.

    Readers call this before sizing a model from ``shape[i]``, so a damaged header gives this message, not an
    IndexError (found by tests/unit/test_reliability.py).
    """
    for key, rank in ranks.items():
        info = header.tensors.get(key)
        if info is not None and (len(info.shape) != rank or 0 in info.shape):
            raise CheckpointError(
                f"{header.path.name}: tensor {key!r} has shape {list(info.shape)}, expected a non-empty {rank}-D "
                f"tensor; the file is damaged or not a {what}"
            )


def iter_tensors(
    header: SafetensorsHeader, names: list[str] | None = None, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` one at a time (file order), each read fresh so RSS stays ~one tensor."""
    order = sorted((header.tensors[n] for n in (names if names is not None else header.tensors)), key=lambda t: t.begin)
    with header.path.open("rb") as f:
        for info in order:
            f.seek(info.begin)
            # Read into torch-allocated (64-byte aligned) memory: the tensor behaves like any other CPU tensor.
            t = torch.empty(info.nbytes, dtype=torch.uint8)
            got = f.readinto(memoryview(t.numpy())) if info.nbytes else 0
            if got != info.nbytes:
                raise CheckpointError(f"{header.path.name}: truncated file while reading tensor {info.name!r}")
            t = t.view(info.dtype).reshape(info.shape)
            yield info.name, (t.to(device) if torch.device(device).type != "cpu" else t)


def to_device_or_cpu(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` for on-load quantization; if the copy fails, ``t`` stays on the CPU (said once).

    Quantizing on the GPU is ~10x faster, but a failed copy must not fail the load: the CPU path computes the
    same values, only slower. (A copy fails with "invalid argument" when the source lies in memory that was
    cudaHostRegister'ed and freed without being unregistered, e.g. by another node pack.)
    """
    if device.type == "cpu" or t.device == device:
        return t
    try:
        return t.to(device, non_blocking=False)
    except RuntimeError as exc:  # torch.AcceleratorError is a RuntimeError
        if not _FALLBACK_SAID:
            _FALLBACK_SAID.append(str(device))
            logging.getLogger("comfyui_lowvram_dit").warning(
                "lowvram_dit: copying a weight to %s for quantization failed (%s); quantizing on the CPU instead "
                "(slower, same result)", device, str(exc).splitlines()[0])
        return t


_FALLBACK_SAID: list[str] = []


MADV_DONTNEED = 4  # drop these pages from this process (a private file mapping re-reads them from the file)
MADV_PAGEOUT = 21  # Linux >= 5.4: reclaim these pages now (clean file pages are dropped, never lost)


def advise_mapped(tensors: Iterable[torch.Tensor], advice: int) -> int:
    """``madvise(advice)`` over the pages under CPU tensors (Linux; elsewhere a no-op); returns bytes advised.

    Only for views of a file mapping that were never written (map_tensors): both advices keep the data valid,
    a later access re-faults it from the file. MADV_DONTNEED leaves the page cache warm, MADV_PAGEOUT evicts.
    """
    if not sys.platform.startswith("linux"):
        return 0
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        page = os.sysconf("SC_PAGE_SIZE")
    except (OSError, AttributeError, ValueError):
        return 0
    done = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if t.device.type != "cpu" or n < page:
            continue
        start = t.data_ptr() // page * page
        length = -(-(t.data_ptr() + n - start) // page) * page
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice) == 0:
            done += n
    return done


def map_tensors(
    header: SafetensorsHeader, names: list[str] | None = None, on_map: MapHook | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` as zero-copy views of a private (copy-on-write) mapping of the file.

    The tensors cost page cache, not anonymous RAM: the kernel can drop their pages and re-read them from the
    file, which is what lets an idle model (e.g. the other Wan 2.2 expert) sit at ~0 RSS. Nothing is read
    until a tensor is touched. Callers must not write into them (a write would make that page anonymous).
    Empty files and zero-size tensors are served as fresh empty tensors. ``on_map(tensor, offset, size)`` is
    called for each view of the file (each has a storage of its own, starting at that offset).
    """
    order = sorted((header.tensors[n] for n in (names if names is not None else header.tensors)), key=lambda t: t.begin)
    size = header.path.stat().st_size
    if any(info.begin + info.nbytes > size for info in order):
        raise CheckpointError(f"{header.path.name}: truncated file (a tensor ends past the file's {size} bytes)")
    mapped = None
    if any(info.nbytes for info in order):
        with header.path.open("rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # the mapping outlives the descriptor
    for info in order:
        if not info.nbytes:
            yield info.name, torch.empty(0, dtype=torch.uint8).view(info.dtype).reshape(info.shape)
            continue
        t = torch.frombuffer(mapped, dtype=torch.uint8, count=info.nbytes, offset=info.begin)
        t = t.view(info.dtype).reshape(info.shape)
        if on_map is not None:
            on_map(t, info.begin, info.nbytes)
        yield info.name, t


def prefetched(it: Iterator[tuple[str, torch.Tensor]], depth: int = 2) -> Iterator[tuple[str, torch.Tensor]]:
    """Run a tensor reader ``depth`` items ahead in a thread, so disk reads overlap the consumer's work."""
    q: queue.Queue[object] = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def worker() -> None:
        try:
            for item in it:
                if stop.is_set():
                    return
                q.put(item)
        except BaseException as exc:  # re-raised in the consumer
            q.put(exc)
            return
        q.put(done)

    th = threading.Thread(target=worker, daemon=True, name="lowvram-dit-reader")
    th.start()
    try:
        while True:
            item = q.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item  # type: ignore[misc]
    finally:
        stop.set()
        while th.is_alive():  # unblock a worker stuck on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                th.join(0.05)


def read_tensors(
    header: SafetensorsHeader, names: list[str] | None = None, *, mmap: bool = False, prefetch: bool = False,
    on_map: MapHook | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The loaders' one tensor reader: zero-copy views of the file (``mmap``, see map_tensors; ``on_map`` sees
    each) or fresh copies (iter_tensors), read ahead in a thread when ``prefetch`` (mapped views need none)."""
    if mmap:
        return map_tensors(header, names, on_map)
    return prefetched(iter_tensors(header, names)) if prefetch else iter_tensors(header, names)


class StreamingSafetensorsWriter:
    """Write a safetensors file tensor by tensor when every name, shape and dtype is known up front.

    The header is written first; ``write(name, tensor)`` must then be called in the declared order.
    The file is written to a new hidden temp file beside ``path`` and renamed on ``close()`` (checkpoints/safe_write.py),
    so a crash never leaves a file that looks complete and no write follows a link. An existing ``path`` is
    replaced only when ``owned(path)`` proves the pack wrote it (see written_with); otherwise the constructor
    raises safe_write.UnsafeTargetError before anything is written.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        layout: list[tuple[str, tuple[int, ...], torch.dtype]],
        metadata: dict[str, str] | None = None,
        owned: safe_write.Owned | None = None,
    ) -> None:
        self.path = Path(path)
        self._owned = owned
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        self._order: list[tuple[str, tuple[int, ...], torch.dtype, int]] = []
        for name, shape, dtype in layout:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {
                "dtype": TORCH_TO_SAFETENSORS[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._order.append((name, tuple(shape), dtype, nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-(len(raw)) % _ALIGN)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        safe_write.refuse_unowned(self.path, owned)
        self._next = 0
        self._tmp, self._f = safe_write.temp_beside(self.path)
        try:
            self._f.write(struct.pack("<Q", len(raw)))
            self._f.write(raw)
        except BaseException:  # e.g. a disk that fills while the header is written: no .partial survives
            self.abort()
            raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor; it must match the declared name, shape and dtype."""
        if self._next >= len(self._order):
            raise ValueError(f"{self.path.name}: more tensors written than declared (got {name!r})")
        exp_name, shape, dtype, nbytes = self._order[self._next]
        if name != exp_name or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(
                f"{self.path.name}: expected {exp_name!r} {list(shape)} {dtype}, "
                f"got {name!r} {list(tensor.shape)} {tensor.dtype}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        try:
            self._f.write(memoryview(data.numpy()))
        except BaseException:  # a failed write leaves nothing behind, whatever the caller does next
            self.abort()
            raise
        self._next += 1

    def write_zeros(self, name: str) -> None:
        """Declare the next tensor all zeros without writing it: the file position skips over its bytes, so on
        file systems with sparse files (Linux, macOS) it takes no disk space; reads return zeros."""
        if self._next >= len(self._order) or self._order[self._next][0] != name:
            expected = self._order[self._next][0] if self._next < len(self._order) else "no more tensors"
            raise ValueError(f"{self.path.name}: expected {expected!r}, got zeros for {name!r}")
        self._f.seek(self._order[self._next][3], os.SEEK_CUR)
        self._next += 1

    def close(self) -> Path:
        """Finish the file (all declared tensors must have been written) and move it into place."""
        try:
            self._f.truncate()  # sets the size when the last tensors were skipped zeros (a no-op otherwise)
            self._f.flush()  # a full disk can fail here
            os.fsync(self._f.fileno())
            self._f.close()
            if self._next != len(self._order):
                raise ValueError(f"{self.path.name}: {len(self._order) - self._next} declared tensors were not written")
            safe_write.commit(self._tmp, self.path, self._owned)
        except BaseException:
            self.abort()
            raise
        return self.path

    def abort(self) -> None:
        """Close the handle and drop the partial file; never raises (it runs while another error propagates)."""
        try:
            self._f.close()
        except OSError:  # the failed flush of a full disk: CPython closes the descriptor anyway
            pass
        safe_write.discard(self._tmp)

    def __enter__(self) -> StreamingSafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:  # noqa: ANN001
        if exc_type is None:
            self.close()
        else:
            self.abort()
