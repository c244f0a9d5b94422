"""Benchmark only: a ComfyUI server that ``server_render --ram-gib`` starts imports this first (its folder leads the
server's PYTHONPATH). psutil then reports the emulated machine's RAM as the total, and what is available never above
it, so ComfyUI's pinned-memory budget and the pack's RAM rules see the machine a user has; the memory itself is
limited by the balloon of benchmarks/ram_limit.py. Without LOWVRAM_BENCH_RAM_TOTAL it changes nothing."""

import os


def _emulate() -> None:
    total = int(os.environ.get("LOWVRAM_BENCH_RAM_TOTAL") or 0)
    if total <= 0:
        return
    import psutil

    real = psutil.virtual_memory

    def virtual_memory():  # noqa: ANN202 - psutil's own named tuple
        vm = real()
        available = min(vm.available, total)
        return vm._replace(total=total, available=available, free=min(vm.free, available), used=total - available,
                           percent=round(100.0 * (total - available) / total, 1))

    psutil.virtual_memory = virtual_memory


_emulate()
