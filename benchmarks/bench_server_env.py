"""The server benches' surroundings: the GPU and software facts they record, the synthetic model files they write,
and earlier result rows bench_server merges with."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

from ..cli import runner


def gpu_facts() -> dict:
    """GPU name, total memory and driver from nvidia-smi (no CUDA context in this process); {} without it."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return {}
    res = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30, check=False)
    first = res.stdout.strip().splitlines()[0] if res.returncode == 0 and res.stdout.strip() else ""
    fields = [f.strip() for f in first.split(",")]
    if len(fields) != 3:
        return {}
    return {"device_name": fields[0], "vram_total_gib": round(int(fields[1]) / 1024, 2), "driver": fields[2]}


def software_facts() -> dict:
    """Versions of torch, Triton, comfy-kitchen and comfy-aimdo in this Python (read without importing them)."""
    from importlib import metadata

    out = {}
    for dist in ("torch", "triton", "comfy-kitchen", "comfy-aimdo"):
        try:
            out[dist.replace("-", "_")] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist.replace("-", "_")] = None
    return out


def write_models(models: Path, names: Iterable[str]) -> dict[str, float]:
    """Write the full-size synthetic files ``names`` (missing ones only); seconds per file (about 0 for one already there).

    A name the runner has no synthetic writer for is reported and left out: its real file must be in ``models``."""
    from ..synthetic.lora import KNOWN_LORA_FILES

    took = {}
    for name in names:
        if name not in runner.KNOWN_MODEL_FILES and name not in KNOWN_LORA_FILES:
            print(f"model {name}: no synthetic writer for it; put the real file under {models}", flush=True)
            continue
        t0 = time.monotonic()
        runner.write_synthetic_models({name}, models, "full")
        took[name] = round(time.monotonic() - t0, 1)
        print(f"model {name}: {took[name]} s", flush=True)
    return took


def model_file_sizes(models: Path, names: Iterable[str]) -> dict[str, float]:
    """GB of each file of ``names`` found in a folder of ``models``."""
    return {n: round(p.stat().st_size / 1e9, 2) for n in names for p in models.glob(f"*/{n}")}


def merged_rows(paths: list[Path], replaced: set[str]) -> list[dict]:
    """Finished rows of earlier result files, each marked with the file it came from; names in ``replaced`` left out."""
    rows = []
    for path in paths:
        for row in json.loads(path.read_text(encoding="utf-8"))["variants"]:
            if row.get("status") != "skipped" and row["name"] not in replaced:
                rows.append({**row, "source": row.get("source") or path.name})
    return rows
