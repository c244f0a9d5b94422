"""The model files of a render run: synthetic ones (GGUF too) written when a row first needs them, in a child process
(the runner never holds a CUDA context, which would shrink an emulated card), freed for later rows (``--free-disk``:
only files this pack wrote), and the Wan Loader's saved fp8 copies."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from comfyui_lowvram_dit.benchmarks import report
from comfyui_lowvram_dit.benchmarks import server_render_graphs as rg
from comfyui_lowvram_dit.cli import server as cli_server
from comfyui_lowvram_dit.cli import workflow_models

if TYPE_CHECKING:
    from comfyui_lowvram_dit.benchmarks.server_render import RenderRow

WRITE_GB_PER_S = 0.8  # --write-models: synthetic files generated on the GPU and written


def _synthetic(path: Path) -> bool:
    """Whether ``path`` is a file this pack wrote: a synthetic model / LoRA / GGUF model, or a quantized copy."""
    if path.suffix == ".gguf":
        from comfyui_lowvram_dit.synthetic.gguf_checkpoints import is_synthetic  # imports torch: only here

        return is_synthetic(path)
    meta = workflow_models._header(path).get("__metadata__", {})
    return meta.get("synthetic") == workflow_models.SYNTHETIC_MARK or "lowvram-fp8" in path.name


def gguf_files() -> dict[str, tuple[str, str]]:
    """Each GGUF file a row may load -> (its synthetic model, the GGML type of its Linear weights)."""
    return {rg.gguf_name(name, fmt): (model, qtype) for name, (folder, model, _) in
            workflow_models.KNOWN_MODEL_FILES.items() if folder == "diffusion_models"
            for fmt, qtype in rg.GGUF_TYPES.items()}


def write_gguf_models(models: Path, names: set[str], size: str, device: str) -> None:
    """The synthetic GGUF files ``names`` (of gguf_files) in ``models``/diffusion_models, missing ones only."""
    from comfyui_lowvram_dit.synthetic.gguf_checkpoints import write_synthetic_gguf

    for name in sorted(names):
        path, (model, qtype) = models / "diffusion_models" / name, gguf_files()[name]
        if not path.is_file():
            print(f"model {name}: writing a synthetic {size} {qtype} GGUF file", flush=True)
            path.parent.mkdir(parents=True, exist_ok=True)
            write_synthetic_gguf(model, path, qtype, size, device=device)


@dataclass
class ModelFiles:
    """A run's model folder: synthetic files written when first needed; ``free_disk``: ones no later row needs gone."""

    models: Path
    write: bool = False
    free_disk: bool = False
    took: dict[str, float] = field(default_factory=dict)
    freed: list[str] = field(default_factory=list)

    def missing(self, names: Sequence[str]) -> list[str]:
        """The names of ``names`` not in any model folder yet."""
        return [n for n in names if not any(self.models.glob(f"*/{n}"))]

    def prepare(self, row: RenderRow, later: Sequence[RenderRow]) -> None:
        """Make the files of ``row`` present (``later``: the rows after it, whose files are kept)."""
        if not (missing := self.missing(rg.model_files(row.spec, row.file_format))):
            return
        if not self.write:
            raise cli_server.RunError(f"model files missing under --models: {', '.join(missing)}; put them there or "
                                      "pass --write-models (full-size synthetic files)")
        if self.free_disk:
            keep = {n for r in (row, *later) for n in rg.model_files(r.spec, r.file_format)}
            for path in sorted(p for p in self.models.glob("*/*") if p.suffix in (".safetensors", ".gguf")
                               and p.name not in keep):
                if _synthetic(path):
                    path.unlink()
                    self.freed.append(path.name)
                    print(f"model {path.name}: deleted (--free-disk; no later row loads it)", flush=True)
        result = self.models / ".write_models.json"
        run_child(WRITE_CHILD, str(self.models), str(result), *missing)
        self.took.update(json.loads(result.read_text(encoding="utf-8")))
        result.unlink()


def quantized_copies(models: Path, row: RenderRow) -> list[tuple[Path, Path]]:
    """(16-bit source, the Wan Loader's saved fp8 copy of it) for every Wan Loader file of ``row``'s graph."""
    from comfyui_lowvram_dit.checkpoints import wan as wc

    sources = [n for n in rg.model_files(row.spec, "bf16") if "_14B_" in n or "_5B_" in n]
    found = [p for n in sources for p in models.glob(f"diffusion_models/{n}")]
    return [(p, wc.quantized_path_for(p, "per_tensor", 128)) for p in found]


# Children that touch the GPU, so this process never holds a CUDA context (an emulated card is total - reserve of
# what is free: memory held here would shrink it).
WRITE_CHILD = ("import json, sys; from pathlib import Path; from comfyui_lowvram_dit.benchmarks import "
               "server_render_models as m; from comfyui_lowvram_dit.checkpoints.safe_write import write_report; "
               "write_report(sys.argv[2], json.dumps(m.write_models(Path(sys.argv[1]), sys.argv[3:])))")
QUANTIZE_CHILD = ("import sys; from comfyui_lowvram_dit.checkpoints import wan as wc; src = sys.argv[1]; "
                  "loaded = wc.load_wan_state_dict(src, 'per_tensor', 128, device=sys.argv[2]); "
                  "wc.save_quantized(loaded, wc.quantized_path_for(src, 'per_tensor', 128), src)")


def write_models(models: Path, names: Sequence[str]) -> dict[str, float]:
    """Write the missing full-size synthetic files ``names`` (a name without a writer is reported); seconds each."""
    from comfyui_lowvram_dit.synthetic.lora import KNOWN_LORA_FILES

    took = {}
    for name in names:
        if name not in {**workflow_models.KNOWN_MODEL_FILES, **KNOWN_LORA_FILES, **gguf_files()}:
            print(f"model {name}: no synthetic writer for it; put the real file under {models}", flush=True)
            continue
        t0 = time.monotonic()
        if name.endswith(".gguf"):
            import torch  # in the writer child only (WRITE_CHILD)

            write_gguf_models(models, {name}, "full", "cuda" if torch.cuda.is_available() else "cpu")
        else:
            workflow_models.write_synthetic_models({name}, models, "full")
        took[name] = round(time.monotonic() - t0, 1)
        print(f"model {name}: {took[name]} s", flush=True)
    return took


def run_child(code: str, *args: str) -> None:
    """Python ``code`` with ``args`` in a child process that imports this checkout; CalledProcessError if it fails."""
    shim = Path(tempfile.mkdtemp(prefix="lowvram_dit_shim_"))  # comfyui_lowvram_dit -> this checkout
    (shim / report.PACKAGE).symlink_to(report.PACK_ROOT, target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")]))}
    try:
        subprocess.run([sys.executable, "-c", code, *args], env=env, check=True, timeout=3600)
    finally:
        shutil.rmtree(shim, ignore_errors=True)


@contextmanager
def pack_copies_for(row: RenderRow, models: Path, device: str, record: dict) -> Iterator[None]:
    """The saved fp8 copies the Wan Loader picks up: written for a ``pack_fp8`` row, moved aside for a 16-bit one."""
    copies = quantized_copies(models, row) if row.workflow.startswith("wan") else []
    hidden: list[tuple[Path, Path]] = []
    t0 = time.monotonic()
    if row.file_format == "pack_fp8":
        for src, copy in copies:
            if not copy.is_file():
                print(f"model {copy.name}: writing the pack's saved fp8 copy", flush=True)
                run_child(QUANTIZE_CHILD, str(src), device)
        record["pack_copy_write_s"] = round(time.monotonic() - t0, 1)
    elif row.file_format == "bf16" and not rg.SETUPS[row.setup].native:
        for _, copy in copies:
            if copy.is_file():
                hidden.append((copy, copy.with_name(copy.name + ".aside")))
                copy.rename(hidden[-1][1])
    try:
        yield
    finally:
        for copy, aside in hidden:
            aside.rename(copy)


def file_gb(name: str) -> float:
    """A full-size model file's size in GB, roughly, from its name (a LoRA's when no other key matches)."""
    for key, gb in (("wan2.2_vae", 1.4), ("vae", 0.3), ("14B_fp16", 28.6), ("14B_fp8", 14.3), ("14B_Q8_0", 15.2),
                    ("14B_Q4_K", 8.1), ("5B_Q8_0", 5.4), ("5B_Q4_K", 2.9), ("5B", 10.0), ("qwen_image_bf16", 40.9),
                    ("qwen_image_Q8_0", 21.7), ("qwen_image_Q4_K", 11.6), ("qwen_image", 20.4), ("umt5", 6.7),
                    ("qwen_2.5_vl_7b_fp8", 8.3), ("qwen_2.5_vl", 16.6)):
        if key in name:
            return gb
    return 1.3


def write_smoke_models(rows: Sequence[RenderRow], models: Path) -> None:
    """The tiny synthetic files every row loads (text encoders 2 layers deep, their sizes read from the file)."""
    names = {n for r in rows for n in rg.model_files(r.spec, r.file_format)}
    names |= {workflow_models.TINY_VAE_SWAPS.get(n, n) for n in names}
    encoders = {n for n in names if workflow_models.KNOWN_MODEL_FILES.get(n, ("",))[0] == "text_encoders"}
    gguf = {n for n in names if n.endswith(".gguf")}
    workflow_models.write_synthetic_models(names - gguf, models, "tiny", reduced_text_encoders=encoders)
    write_gguf_models(models, gguf, "tiny", "cpu")
