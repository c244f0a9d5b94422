"""One ComfyUI server as the render scenario drives it: flags, base folder, a queued graph's events and memory, the log
digest, latent comparison (the events' times: server_render_split). The runner itself never starts CUDA."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from comfyui_lowvram_dit.benchmarks import report
from comfyui_lowvram_dit.cli import server as cli_server
from comfyui_lowvram_dit.cli import workflow_models
from comfyui_lowvram_dit.cli.memwatch import MemoryWatch

VENDORED_GGUF = report.PACK_ROOT / "tests" / "vendor" / "ComfyUI-GGUF"  # verbatim (its README: which commit)
WORK_MARK = "$WORK"  # stands for the scratch folder in recorded server flags (no machine paths in results)


def server_flags(name: str, total_vram_gib: float, card_gib: float | None, ck_attention: bool = False,
                 dynamic_vram: bool = True, cuda_graphs: bool = True) -> list[str]:
    """``--use-ck-attention``, ``--disable-dynamic-vram``, ``--disable-cuda-graphs`` and the card cap
    ``--reserve-vram`` = total - card."""
    args = ["--use-ck-attention"] if ck_attention else []
    if not cuda_graphs:
        args.append("--disable-cuda-graphs")
    if not dynamic_vram:
        args.append("--disable-dynamic-vram")
    if card_gib is not None:
        if (reserve := total_vram_gib - card_gib) <= 0:
            raise ValueError(f"variant {name}: the GPU has {total_vram_gib:.2f} GiB, not more than the "
                             f"{card_gib} GiB card to emulate; drop the capped variants")
        args.append(f"--reserve-vram={reserve:.2f}")
    return args


LOG_KEEP = re.compile(r"lowvram_dit|DynamicVRAM|loaded (completely|partially)|Requested to load|model weight dtype|"
                      r"Prompt executed|ComfyUI version|comfy-(kitchen|aimdo) version|Total VRAM|pytorch version|"
                      r"attention|multigpu|EasyCache|gguf|Error|Traceback|out of memory|OutOfMemory", re.IGNORECASE)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def log_digest(log: str, limit: int = 200) -> list[str]:
    """The server log lines that explain a run (loading, attention, memory, errors); colours and tqdm bars dropped."""
    lines = [_ANSI.sub("", ln).strip() for ln in log.replace("\r", "\n").split("\n")]
    return [ln for ln in lines if LOG_KEEP.search(ln) and "it/s]" not in ln and "s/it]" not in ln][-limit:]


def gguf_custom_nodes(python: str) -> dict[str, Path]:
    """The vendored ComfyUI-GGUF as ``{folder: path}`` when ``python`` has the ``gguf`` package; else empty."""
    has_gguf = subprocess.run([python, "-c", "import gguf"], capture_output=True, check=False).returncode == 0
    return {"ComfyUI-GGUF": VENDORED_GGUF} if has_gguf else {}  # the folder name users clone it as


def prepare_base(base: Path, models: Path, custom_nodes: dict[str, Path] | None = None) -> list[str]:
    """A hermetic ComfyUI base dir with this pack (and ``custom_nodes``) linked in; its path flags."""
    cli_server.prepare_base_dir(base, cli_server.REGISTRY_FOLDER_NAME, custom_nodes)
    yaml = workflow_models.extra_model_paths_yaml(models.resolve(), base / "extra_model_paths.yaml")
    return ["--extra-model-paths-config", str(yaml), "--output-directory", str(base / "output")]


@dataclass
class PromptRun:
    """One queued graph as the runner saw it: websocket events, history entry, wall time, memory samples."""

    events: list[tuple[float, dict]]  # (time.monotonic() on arrival, message)
    entry: dict  # the prompt's /history entry
    posted_at: float  # time.monotonic() right before the POST
    wall_s: float  # from the POST until /history showed the prompt finished
    watch: MemoryWatch  # the server process's memory, sampled from before the POST


def run_prompt(server: cli_server.ComfyServer, graph: dict, timeout: float) -> PromptRun:
    """Queue ``graph`` with websocket and memory watch on and wait for it; RunError naming a refused graph's errors."""
    import aiohttp  # ComfyUI's own dependency: present wherever its server runs

    cid = uuid.uuid4().hex
    url, events, error = server.url.replace("http://", "ws://", 1) + f"/ws?clientId={cid}", [], []
    ready, stop = threading.Event(), threading.Event()

    async def listen() -> None:  # every JSON message for this client, stamped with time.monotonic() on arrival
        try:
            async with aiohttp.ClientSession() as session, session.ws_connect(url, max_msg_size=0) as ws:
                ready.set()
                while not stop.is_set():
                    try:
                        msg = await ws.receive(timeout=0.5)
                    except asyncio.TimeoutError:
                        continue
                    if msg.type == aiohttp.WSMsgType.TEXT:
                        events.append((time.monotonic(), json.loads(msg.data)))
                    elif msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                        break
        except Exception as exc:  # noqa: BLE001 - before the socket opened: raised below
            error.append(f"{type(exc).__name__}: {exc}")
            ready.set()

    thread = threading.Thread(target=lambda: asyncio.run(listen()), name="bench-ws", daemon=True)
    thread.start()
    if not ready.wait(30) or error:
        raise cli_server.RunError(f"websocket {url} did not open: {error[0] if error else 'timeout'}")
    try:
        with MemoryWatch(server.pid) as watch:
            t0 = time.monotonic()
            entry = server.wait(server.queue(graph, client_id=cid), timeout)  # a refused graph: RunError
            wall = time.monotonic() - t0
        time.sleep(0.3)  # the last websocket messages
    finally:
        stop.set()
        thread.join(timeout=10)
    return PromptRun(events, entry, t0, wall, watch)


def public(text: str, comfyui: Path, work: Path) -> str:
    """A flag or log line with $WORK, <ComfyUI>, python3 for their paths, other machine paths by ``public_text``."""
    for path, mark in ((str(work), WORK_MARK), (str(comfyui), "<ComfyUI>"), (sys.executable, "python3")):
        text = text.replace(path, mark)
    return report.public_text(text)


def compare_latents(path: Path, reference: Path) -> dict:
    """``rel_diff`` ||a - b|| / ||b||, ``max_abs`` and bit-``identical`` of two SaveLatent files (float64, CPU)."""
    import torch  # the runner itself never starts CUDA: the tensors stay on the CPU
    from safetensors.torch import load_file

    a, b = load_file(str(path))["latent_tensor"], load_file(str(reference))["latent_tensor"]
    if a.shape != b.shape:
        return {"identical": False, "error": f"shapes differ: {list(a.shape)} vs {list(b.shape)}"}
    diff = a.double() - b.double()
    ref, err = (float(torch.linalg.vector_norm(t)) for t in (b.double(), diff))
    return {"identical": a.dtype == b.dtype and torch.equal(a, b),
            "rel_diff": err / ref if ref else (0.0 if err == 0 else float("inf")),
            "max_abs": float(diff.abs().max()) if diff.numel() else 0.0, "shape": list(a.shape)}


def gpu_facts() -> dict:
    """The first GPU's name, total memory and driver per nvidia-smi (no CUDA context here); {} without it."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return {}
    res = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30, check=False)
    fields = [f.strip() for f in res.stdout.strip().split("\n")[0].split(",")] if res.returncode == 0 else []
    return ({"device_name": fields[0], "vram_total_gib": round(int(fields[1]) / 1024, 2), "driver": fields[2]}
            if len(fields) == 3 else {})
