"""Streaming a safetensors file into an existing module, one owning module at a time.

Plain torch, no ComfyUI. Small tensors (scales, norms, biases, markers) are read up front by one rule that both
the text encoders and the diffusion-model loaders use; every other tensor is read once, in file order, and
handed over as soon as its module is complete, so the RAM overhead is about one module's weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from .safetensors_io import (
    MADV_DONTNEED, CheckpointError, MapHook, SafetensorsHeader, advise_mapped, read_tensors,
)

ProgressFn = Callable[[int, int], None]

SMALL_TENSOR_BYTES = 1 << 16  # scales, norms, biases: read up front (they are ~0.1 % of a text encoder)
SCALE_SUFFIXES = (".scale_weight", ".weight_scale", ".scale_input", ".input_scale", ".comfy_quant",
                   ".scale_weight_tensor")


def owner_of(key: str) -> str:
    """The module path that owns parameter/buffer ``key`` ("model.layers.3.mlp.up_proj.weight" -> "...up_proj")."""
    return key.rpartition(".")[0]


def small_tensor_names(header: SafetensorsHeader) -> list[str]:
    """Names read before streaming: tensors <= 64 KiB, every scale/marker, in file order."""
    return [n for n, i in header.tensors.items() if i.nbytes <= SMALL_TENSOR_BYTES or n.endswith(SCALE_SUFFIXES)]


@dataclass
class StreamStats:
    """What a streaming load read: bytes, tensors, and the most bytes it held at once (the RAM overhead)."""

    bytes_read: int = 0
    tensors: int = 0
    groups: int = 0
    max_held_bytes: int = 0


def iter_owner_groups(
    header: SafetensorsHeader,
    small: dict[str, torch.Tensor],
    *,
    skip: Callable[[str], bool] | None = None,
    progress: ProgressFn | None = None,
    stats: StreamStats | None = None,
    prefetch: bool = True,
    already_read: Iterable[str] = (),
    mmap: bool = False,
    on_map: MapHook | None = None,
) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """Yield ``(owner, {param_name: tensor})`` for every owning module, as soon as all its tensors are read.

    ``small`` holds the already-read (and possibly renamed, e.g. by ComfyUI's ``convert_old_quants``) small
    tensors, keyed by full name; every other tensor in the file is read once, in file order, and released
    when its group is yielded, so the RAM overhead is about one module's weights (the largest is the
    embedding table). ``already_read`` names file tensors that ``small`` holds under other names (renamed
    scales); they are not read again. Keys for which ``skip`` is true are neither read nor yielded.

    ``mmap``: the streamed tensors are views of a file mapping instead of copies read into RAM (one memory
    pass less: the consumer copies straight out of the page cache). Once the consumer asks for the next group,
    the previous group's pages are dropped from this process (MADV_DONTNEED; the page cache stays warm), so
    they never add up in RSS. A consumer may keep the views only if it never writes into them (their pages are
    read from the file again when touched). ``on_map`` sees each mapped view (safetensors_io.map_tensors).
    """
    stats = stats if stats is not None else StreamStats()
    keep = (lambda n: not skip(n)) if skip is not None else (lambda n: True)
    done = set(already_read)
    big = [n for n in header.tensors if n not in small and n not in done and keep(n)]
    expected: dict[str, set[str]] = {}
    for n in [*small, *big]:
        if keep(n):
            expected.setdefault(owner_of(n), set()).add(n)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    held = 0
    total = sum(header.tensors[n].nbytes for n in big)

    held_by: dict[str, int] = {}  # bytes of streamed (not small) tensors waiting in each pending group

    def add(name: str, t: torch.Tensor, streamed: bool) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        nonlocal held
        owner = owner_of(name)
        group = pending.setdefault(owner, {})
        group[name] = t
        if streamed:
            n = t.numel() * t.element_size()
            held += n
            held_by[owner] = held_by.get(owner, 0) + n
            stats.max_held_bytes = max(stats.max_held_bytes, held)
        if len(group) == len(expected[owner]):
            del pending[owner]
            held -= held_by.pop(owner, 0)
            stats.groups += 1
            prefix = len(owner) + 1 if owner else 0
            yield owner, {k[prefix:]: v for k, v in group.items()}
            if mmap:  # consumed: its mapped pages leave RSS (small tensors are private copies, never mapped)
                advise_mapped([v for k, v in group.items() if k not in small], MADV_DONTNEED)

    # Groups made only of small tensors (norms, biases of skipped weights...) go first.
    big_owners = {owner_of(n) for n in big}
    for name, t in small.items():
        if keep(name) and owner_of(name) not in big_owners:
            yield from add(name, t, streamed=False)
    for name, t in small.items():
        if keep(name) and owner_of(name) in big_owners:
            pending.setdefault(owner_of(name), {})[name] = t
    for name, t in read_tensors(header, big, mmap=mmap, prefetch=prefetch, on_map=on_map):
        stats.bytes_read += t.numel() * t.element_size()
        stats.tensors += 1
        yield from add(name, t, streamed=True)
        if progress:
            progress(stats.bytes_read, total)
    if pending:
        raise CheckpointError(f"{header.path.name}: incomplete module(s) {sorted(pending)[:4]} after reading the file")


def load_streaming(
    root: torch.nn.Module,
    groups: Iterable[tuple[str, dict[str, torch.Tensor]]],
    assign: bool = False,
) -> list[str]:
    """Load each ``(owner, tensors)`` group into ``root.get_submodule(owner)``; returns the full keys loaded.

    Each call goes through the module's own ``load_state_dict`` (so custom ops, e.g. ComfyUI's mixed-precision
    Linear, see exactly the keys they would in a full load); ``assign`` as in ``load_state_dict`` (the module
    takes the given tensors instead of copying them, as ComfyUI's loaders do for a DynamicVRAM model). Unknown owners
    or unexpected keys raise.
    """
    loaded: list[str] = []
    for owner, tensors in groups:
        try:
            module = root.get_submodule(owner) if owner else root
        except AttributeError:
            raise CheckpointError(f"the file has tensors for {owner!r}, which this model does not have "
                                  f"({sorted(tensors)[:3]}); it is not the model the loader expects") from None
        result = module.load_state_dict(tensors, strict=False, assign=assign)
        if result.unexpected_keys:
            raise CheckpointError(f"{owner}: unexpected tensors {result.unexpected_keys} for "
                                  f"{type(module).__name__}; the file does not match the model")
        loaded += [f"{owner}.{k}" if owner else k for k in tensors]
    return loaded
