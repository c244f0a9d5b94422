"""A stand-in for ``torch.cuda.cudart()`` that keeps the host-registration table the CUDA driver keeps.

cudaHostRegister'ed memory that is freed without cudaHostUnregister stays registered in the driver; a later
allocation at the same address then fails its host-to-device copy with "CUDA error: invalid argument" (ComfyUI
issues #10862/#11152). The driver's bookkeeping is by page, so overlapping registrations fail the way the real
one does (cudaErrorHostMemoryAlreadyRegistered). Tests install it, run a lifecycle on the CPU and check that
every registration was undone: a leftover entry is memory that would be freed while still registered.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

PAGE = 4096
ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
NOT_REGISTERED = 713  # cudaErrorHostMemoryNotRegistered


@dataclass
class FakeCudart:
    registered: dict[int, int] = field(default_factory=dict)  # ptr -> size, as registered
    calls: list[tuple[str, int, int]] = field(default_factory=list)  # (call, ptr, size or flags)

    def _pages(self, ptr: int, size: int) -> range:
        return range(ptr // PAGE, (ptr + max(size, 1) - 1) // PAGE + 1)

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.calls.append(("register", ptr, size))
        mine = set(self._pages(ptr, size))
        if any(mine.intersection(self._pages(p, s)) for p, s in self.registered.items()):
            return ALREADY_REGISTERED
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr, 0))
        if self.registered.pop(ptr, None) is None:
            return NOT_REGISTERED
        return 0

    def overlaps(self, lo: int, hi: int) -> bool:
        """True if any registered range touches [lo, hi)."""
        return any(p < hi and lo < p + s for p, s in self.registered.items())

    @classmethod
    def install(cls, monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
        """Route ``torch.cuda.cudart()`` here and make ``torch.cuda.is_available()`` true for the test."""
        import torch

        fake = cls()
        monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        return fake


def install_comfy_pinning(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    """ComfyUI (importable in this process, on the CPU) with its pinned-memory account on: pin_memory/unpin_memory
    and every other cudaHostRegister call register into a fake table, as they do on a GPU."""
    import comfy.model_management as mm
    import comfy.sd  # noqa: F401 - imported before is_available() turns true: its import asks the (absent) GPU

    cudart = FakeCudart.install(monkeypatch)
    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", 1 << 40)
    monkeypatch.setattr(mm, "discard_cuda_async_error", lambda: None)
    monkeypatch.setattr(mm, "PINNED_MEMORY", {})
    monkeypatch.setattr(mm, "TOTAL_PINNED_MEMORY", 0)
    return cudart
