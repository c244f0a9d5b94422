"""The server scenarios' runner: one API graph per row, each row in a fresh ComfyUI server, one report per run.

A scenario (``ServerScenario``, data in server_wan / server_qwen) names its rows, the graph each row runs, the model
files, the sampler nodes to time and its CLI defaults; README.md says how rows are started, timed and recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import Any, Self, TypeVar

from comfyui_lowvram_dit.benchmarks import harness, server_probe
from comfyui_lowvram_dit.benchmarks.server_report import write
from comfyui_lowvram_dit.checkpoints.safe_write import write_report
from comfyui_lowvram_dit.cli import server as cli_server
from comfyui_lowvram_dit.cli import workflow_models
from comfyui_lowvram_dit.cli.memwatch import MemoryWatch

PACK_ROOT, RESULTS, GIB = harness.PACK_ROOT, harness.RESULTS, harness.GIB
CARD_GIB = 8.0
PROBE_NODE = "LowVRAMBench_KernelProfile"
PROBE_CALL = 1  # the second model call of each expert = its second step (cfg batched: one call per step)
PROBE_DIR = "lowvram_bench_probe"  # its folder name in the server's custom_nodes
SPLIT_NODE = "MultiGPU_WorkUnits"  # core's "MultiGPU CFG Split" (ComfyUI 0.33 and later)
LATENTS = "latents"  # the run's work subfolder where each row's saved latent is kept as <row>.latent
WORK_MARK = "$WORK"  # stands for the scratch folder in recorded server flags (no machine paths in results)
R = TypeVar("R")


@dataclass(frozen=True)
class Row:
    """One measured configuration of a server scenario: which graph, which nodes, which server flags and card."""

    name: str
    graph: str  # "native" or "pack"
    weight_dtype: str = "default"  # native UNETLoader
    attention: str | None = None  # pack Attention node backend (None: no Attention node)
    compile: bool = False  # pack Torch Compile after Attention
    block_swap_gb: float | None = None  # pack Block Swap vram_budget_gb (None: no Block Swap node)
    ck_attention: bool = False  # server flag --use-ck-attention
    dynamic_vram: bool = True  # False: --disable-dynamic-vram (legacy partial loading)
    card_gib: float | None = None  # None: the whole GPU; else --reserve-vram = total - card_gib
    baseline: bool = False  # a native row other rows are compared against
    lora: bool = False  # the 4-step LoRA(s) after the loader(s) (LoraLoaderModelOnly)
    four_step: bool = False  # the 4-step workflow's sampling, with or without the LoRAs
    fp8_path: str = "default"  # pack per-tensor fp8 GEMM path, set by the Kernel Profile node (needs --kernel-profile)
    gpus: int = 1  # > 1: core's MultiGPU CFG Split (MultiGPU_WorkUnits, max_gpus=gpus) on each sampled model
    same_as: str | None = None  # the one-GPU row whose final latent this row must equal (a split row's twin)
    step_cache: str | None = None  # core's EasyCache / LazyCache (its defaults) on each sampled model, last before it

    def server_args(self, total_vram_gib: float) -> list[str]:
        """ComfyUI command-line flags for this row on a GPU of ``total_vram_gib``."""
        return server_flags(self.name, total_vram_gib, self.card_gib, self.ck_attention, self.dynamic_vram)


@dataclass(frozen=True)
class ServerScenario:
    """A server benchmark as data: rows, groups, the graph of a row under the CLI options, files, defaults."""

    name: str  # the suite's scenario name and the default result stem
    title: str  # report and plot heading
    rows: dict[str, Row]
    groups: dict[str, list[str]]
    graph: Callable[[Row, argparse.Namespace], dict]  # the API graph of a row
    describe: Callable[[Row], str]  # one line saying what a row runs
    files: Callable[[Sequence[Row], argparse.Namespace], tuple[str, ...]]  # the model files the rows load
    sampler_nodes: tuple[str, ...]
    out: Path
    defaults: dict = field(default_factory=dict)  # CLI defaults: variants, steps, width, height, frames, unet, ...
    smoke: Callable[[argparse.Namespace, tuple[str, ...]], None] | None = None  # tiny files + small sizes (CPU)
    smoke_native: str = ""  # why the native rows are skipped in a smoke run
    own_user_dir: bool = False  # True: each row starts with an empty embedding cache
    keep_timeline: bool = True  # keep the memory timeline in the rows
    prepare_input: Callable[[Path, argparse.Namespace], object] | None = None  # files the graph loads from input/
    summary: Callable[[list[dict]], dict] | None = None  # scenario-specific goal numbers


def server_flags(name: str, total_vram_gib: float, card_gib: float | None, ck_attention: bool = False,
                 dynamic_vram: bool = True) -> list[str]:
    """``--use-ck-attention``, ``--disable-dynamic-vram`` and the card cap ``--reserve-vram`` = total - card."""
    args = ["--use-ck-attention"] if ck_attention else []
    if not dynamic_vram:
        args.append("--disable-dynamic-vram")
    if card_gib is not None:
        reserve = total_vram_gib - card_gib
        if reserve <= 0:
            raise ValueError(f"variant {name}: the GPU has {total_vram_gib:.2f} GiB, not more than the "
                             f"{card_gib} GiB card to emulate; drop the capped variants")
        args.append(f"--reserve-vram={reserve:.2f}")
    return args


def node(class_type: str, title: str, **inputs: Any) -> dict:
    """One API-graph node."""
    return {"class_type": class_type, "inputs": inputs, "_meta": {"title": title}}


# ----------------------------------------------------------------------------------------------------------
# timing from websocket events and the server log


def step_times(events: list[tuple[float, dict]], node_id: str) -> dict:
    """Per-step times of one sampler node from ``(arrival time, message)`` pairs of the server's websocket:
    ``first_s`` from its 'executing' to its first 'progress', ``steps_s`` between later progress values."""
    start = next((t for t, m in events if m.get("type") == "executing" and m["data"].get("node") == node_id), None)
    seen: dict[int, float] = {}
    for t, m in events:
        if m.get("type") == "progress" and str(m["data"].get("node")) == node_id:
            seen.setdefault(int(m["data"]["value"]), t)  # a re-sent value counts once
    values = sorted(seen)
    stamps = [seen[v] for v in values]
    return {"node": node_id, "progress_values": values,
            "first_s": round(stamps[0] - start, 3) if stamps and start is not None else None,
            "steps_s": [round(b - a, 3) for a, b in pairwise(stamps)]}


def node_times(events: list[tuple[float, dict]]) -> dict[str, float]:
    """Seconds each executed node took: from its 'executing' message to the next node's (or the end)."""
    marks = [(t, m["data"].get("node")) for t, m in events if m.get("type") == "executing"]
    out: dict[str, float] = {}
    for (t, nid), (t_next, _) in pairwise(marks):
        if nid is not None:
            out[str(nid)] = round(out.get(str(nid), 0.0) + t_next - t, 3)
    return out


_TQDM_DONE = re.compile(r"100%\|[^|]*\|\s*(\d+)/(\1)\s*\[(\d+):(\d+)<[^,\]]*,\s*([\d.]+)(s/it|it/s)\]")


def tqdm_summaries(log: str) -> list[dict]:
    """ComfyUI's closing tqdm line of each sampler run: steps, elapsed (whole s) and average s/step. tqdm prints
    the 100% line twice per run (last update, then close with the run's average): every second one is kept."""
    out = []
    for segment in log.replace("\r", "\n").split("\n"):
        m = _TQDM_DONE.search(segment)
        if m:
            rate = float(m.group(5))
            out.append({"steps": int(m.group(1)), "elapsed_s": int(m.group(3)) * 60 + int(m.group(4)),
                        "s_per_step": rate if m.group(6) == "s/it" else round(1.0 / rate, 4)})
    return out[1::2] if len(out) % 2 == 0 else out


def summarize_steps(per_node: list[dict]) -> dict:
    """Headline numbers: median/mean of the later steps of every sampler node, and the first steps."""
    later = [s for d in per_node for s in d["steps_s"]]
    return {"s_per_step": round(statistics.median(later), 3) if later else None,
            "s_per_step_mean": round(statistics.fmean(later), 3) if later else None,
            "steps_timed": len(later), "first_step_s": [d["first_s"] for d in per_node]}


LOG_KEEP = re.compile(r"lowvram_dit|DynamicVRAM|loaded (completely|partially)|Requested to load|model weight dtype|"
                      r"Prompt executed|ComfyUI version|comfy-(kitchen|aimdo) version|Total VRAM|pytorch version|"
                      r"attention|multigpu|Error|error|Traceback|out of memory|OutOfMemory", re.IGNORECASE)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
LORA_KEY_MISSED = "lora key not loaded"  # ComfyUI's warning for each LoRA key that matches no model weight


def log_digest(log: str, limit: int = 200) -> list[str]:
    """The server log lines that explain a run (loading, attention, memory, errors); colours and tqdm bars dropped."""
    lines = [_ANSI.sub("", ln).strip() for ln in log.replace("\r", "\n").split("\n")]
    return [ln for ln in lines if LOG_KEEP.search(ln) and "it/s]" not in ln and "s/it]" not in ln][-limit:]


# ----------------------------------------------------------------------------------------------------------
# running one row


class EventRecorder:
    """Every JSON message of the server's websocket for ``client_id``, stamped with ``time.monotonic()`` on arrival."""

    def __init__(self, url: str, client_id: str) -> None:
        self.ws_url = url.replace("http://", "ws://", 1) + f"/ws?clientId={client_id}"
        self.events: list[tuple[float, dict]] = []
        self.error: str | None = None
        self._ready, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._listen()), name="bench-ws", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        if not self._ready.wait(30) or self.error:
            raise cli_server.RunError(f"websocket {self.ws_url} did not open: {self.error or 'timeout'}")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    async def _listen(self) -> None:
        import aiohttp  # ComfyUI's own dependency: present wherever its server runs

        try:
            async with aiohttp.ClientSession() as session, session.ws_connect(self.ws_url, max_msg_size=0) as ws:
                self._ready.set()
                while not self._stop.is_set():
                    try:
                        msg = await ws.receive(timeout=0.5)
                    except asyncio.TimeoutError:
                        continue
                    if msg.type == aiohttp.WSMsgType.TEXT:
                        self.events.append((time.monotonic(), json.loads(msg.data)))
                    elif msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                        break
        except Exception as exc:  # noqa: BLE001 - reported by __enter__ or in the row's record
            self.error = f"{type(exc).__name__}: {exc}"
            self._ready.set()


def prepare_base(base: Path, models: Path, probe: bool = False) -> list[str]:
    """A hermetic ComfyUI base dir with this pack (and the probe node) in custom_nodes; returns its path flags."""
    for sub in ("custom_nodes", "input", "output", "temp"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    (base / "custom_nodes" / cli_server.REGISTRY_FOLDER_NAME).symlink_to(PACK_ROOT, target_is_directory=True)
    if probe:
        (base / "custom_nodes" / PROBE_DIR).symlink_to(Path(server_probe.__file__).resolve().parent,
                                                       target_is_directory=True)
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
    watch_started: float  # time.monotonic() when the memory samples' clock started


def run_prompt(server: cli_server.ComfyServer, graph: dict, timeout: float) -> PromptRun:
    """Queue ``graph`` with the websocket and the memory watch on, and wait until it finished (or failed); a graph
    the server refuses raises RunError naming the node errors."""
    cid = uuid.uuid4().hex
    with EventRecorder(server.url, cid) as rec:
        t_watch = time.monotonic()
        with MemoryWatch(server.pid) as watch:
            t0 = time.monotonic()
            status, body = server.post_prompt(graph, client_id=cid)
            if status != 200:
                raise cli_server.RunError(f"ComfyUI rejected the graph ({status}): "
                                      f"{json.dumps(body.get('node_errors') or body)[:2000]}")
            entry = server.wait(body["prompt_id"], timeout)
            wall = time.monotonic() - t0
        time.sleep(0.3)  # the last websocket messages
    return PromptRun(rec.events, entry, t0, wall, watch, t_watch)


def measure(server: cli_server.ComfyServer, graph: dict, timeout: float, sampler_nodes: tuple[str, ...],
            probe_dir: Path | None = None) -> dict:
    """Queue ``graph`` and measure it: step times of ``sampler_nodes`` (in the order they run), node times, memory
    peaks (and the Kernel Profile node's results from ``probe_dir``)."""
    run = run_prompt(server, graph, timeout)
    events, entry, wall, watch, t_watch = run.events, run.entry, run.wall_s, run.watch, run.watch_started
    per_node = [step_times(events, n) for n in sampler_nodes]
    probe = server_probe.read_probe(probe_dir) if probe_dir is not None else None
    if probe:
        server_probe.drop_profiled_steps(per_node, PROBE_CALL)
    out: dict[str, Any] = {"wall_s": round(wall, 2), **summarize_steps(per_node), "samplers": per_node,
                           "node_s": node_times(events), **watch.summary()}
    if probe is not None:
        out["probe"] = probe
    starts = [t for t, m in events if m.get("type") == "executing" and m["data"].get("node") == sampler_nodes[0]]
    if starts:  # the GPU peak from the first sampler on
        gpu = [s["gpu"] for s in watch.samples if s["t"] >= starts[0] - t_watch and s.get("gpu") is not None]
        out["peak_gpu_sampling_gib"] = round(max(gpu) / GIB, 3) if gpu else None
    out["timeline"] = [[s["t"], round(s["rss"] / GIB, 3), round(s["anon"] / GIB, 3),
                        None if s["gpu"] is None else round(s["gpu"] / GIB, 3)] for s in watch.samples]
    ok = entry["status"]["status_str"] == "success"
    out["status"] = "ok" if ok else "error"
    if not ok:
        out["error"] = cli_server.execution_error(entry) or str(entry["status"])
    return out


@dataclass(frozen=True)
class ServerSetup:
    """Where and how the servers of one run start."""

    comfyui: Path  # ComfyUI checkout (main.py there)
    models: Path  # folder with diffusion_models/ text_encoders/ vae/ loras/
    work: Path  # scratch folder: one base directory per row, the shared front-end root and user directory
    timeout: float = 420.0  # seconds one graph may take
    cpu: bool = False  # ComfyUI on the CPU (smoke runs and tests)
    keep_logs: bool = False  # keep each server log as <work>/<row>.log
    list_nodes: bool = False  # record the pack's nodes from /object_info


def scrub_work(flags: list[str], work: Path) -> list[str]:
    """``flags`` with the scratch folder written as $WORK (the recorded flags name no machine path)."""
    return [f.replace(str(work), WORK_MARK) for f in flags]


def public_log(lines: list[str], setup: ServerSetup) -> list[str]:
    """Server log lines as results may show them: the scratch folder as $WORK, ComfyUI's folder as <ComfyUI>, the
    interpreter as python3, other machine paths through ``harness.public_text`` (a log's first line names all
    three)."""
    swaps = ((str(setup.comfyui), "<ComfyUI>"), (sys.executable, "python3"))
    shown = []
    for line in scrub_work(lines, setup.work):
        for path, mark in swaps:
            line = line.replace(path, mark)
        shown.append(harness.public_text(line))
    return shown


def _serve(setup: ServerSetup, base: Path, flags: list[str], record: dict, graph: dict,
           sampler_nodes: tuple[str, ...], probe: bool) -> None:
    """Start the server, check the pack imported, measure ``graph`` into ``record``."""
    t0 = time.monotonic()
    with cli_server.ComfyServer.start(setup.comfyui, base, cpu=setup.cpu, extra_args=flags, timeout=240) as server:
        record["startup_s"] = round(time.monotonic() - t0, 1)
        problems = cli_server.pack_import_problems(server.log_text(), base / "custom_nodes" / cli_server.REGISTRY_FOLDER_NAME)
        if problems:
            raise cli_server.RunError(f"the pack failed to import: {problems[0].strip()}")
        if setup.list_nodes:
            info = server.get("/object_info", timeout=180)
            record["pack_nodes"] = sorted(k for k in info if k.startswith("LowVRAM_"))
            record["object_info_nodes"] = len(info)
        probe_dir = base / "output" / "bench_probe" if probe else None
        record.update(measure(server, graph, setup.timeout, sampler_nodes, probe_dir))


def run_row(setup: ServerSetup, row: Row, graph: dict, total_vram_gib: float, record: dict, *,
            sampler_nodes: tuple[str, ...], probe: bool = False, own_user_dir: bool = False,
            prepare_input: Callable[[Path], object] | None = None) -> dict:
    """One fresh server with ``row``'s flags, one graph; the measurements are added to ``record`` and returned.

    ``own_user_dir``: a user directory of this row only, else the run's shared one. ``prepare_input(input_dir)``
    writes what the graph loads before the start. A failure sets ``status`` "error" with its reason; the row still
    gets the log digest (and the whole log under ``keep_logs``). The latent the graph saved is kept as
    ``<work>/latents/<row>.latent`` (``keep_latent``) before the row's base folder is removed."""
    setup.work.mkdir(parents=True, exist_ok=True)
    (setup.work / LATENTS / f"{row.name}.latent").unlink(missing_ok=True)  # none left from an earlier run
    base = Path(tempfile.mkdtemp(prefix=f"bench_{row.name}_", dir=setup.work))
    record.update(status="error")
    log = ""
    try:
        user = base / "user" if own_user_dir else setup.work / "user"
        for folder in (setup.work / "frontend", user):
            folder.mkdir(parents=True, exist_ok=True)
        flags = [*prepare_base(base, setup.models, probe=probe), "--front-end-root", str(setup.work / "frontend"),
                 "--user-directory", str(user), *row.server_args(total_vram_gib)]
        record["server_args"] = scrub_work(flags, setup.work)
        if prepare_input is not None:
            prepare_input(base / "input")
        _serve(setup, base, flags, record, graph, sampler_nodes, probe)
    except Exception as exc:  # noqa: BLE001 - one row's failure must not stop the others
        record["error"] = f"{type(exc).__name__}: {exc}"[:4000]
    if (base / "comfyui.log").exists():  # the server's log (cli.server writes it there)
        log = (base / "comfyui.log").read_bytes().decode("utf-8", "replace")
    record["tqdm"] = tqdm_summaries(log)
    record["log"] = public_log(log_digest(log), setup)
    record["lora_keys_not_loaded"] = log.count(LORA_KEY_MISSED)  # > 0: a LoRA row ran partly without its LoRA
    if setup.keep_logs:
        write_report((setup.work / f"{row.name}.log"), log)
    keep_latent(base / "output", setup.work / LATENTS, row.name)
    shutil.rmtree(base, ignore_errors=True)
    return record


def keep_latent(output: Path, folder: Path, name: str) -> Path | None:
    """Move the newest ``*.latent`` under a row's ``output`` (SaveLatent's file) to ``folder/<name>.latent``;
    None when the row saved none (an error, or decoded frames)."""
    saved = sorted(output.rglob("*.latent"), key=lambda p: p.stat().st_mtime) if output.is_dir() else []
    if not saved:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    return Path(shutil.move(saved[-1], folder / f"{name}.latent"))


def compare_latents(path: Path, reference: Path) -> dict:
    """How far the latent in ``path`` is from the one in ``reference`` (SaveLatent files, key ``latent_tensor``):
    ``rel_diff`` = ||a - b|| / ||b|| and ``max_abs`` = max |a - b| in float64 on the CPU; ``identical`` when the
    tensors are bit-equal (same dtype, shape and values)."""
    import torch  # the runner itself never starts CUDA: the tensors stay on the CPU
    from safetensors.torch import load_file

    a, b = load_file(str(path))["latent_tensor"], load_file(str(reference))["latent_tensor"]
    if a.shape != b.shape:
        return {"identical": False, "error": f"shapes differ: {list(a.shape)} vs {list(b.shape)}"}
    diff = a.double() - b.double()
    ref = float(torch.linalg.vector_norm(b.double()))
    err = float(torch.linalg.vector_norm(diff))
    return {"identical": a.dtype == b.dtype and torch.equal(a, b),
            "rel_diff": err / ref if ref else (0.0 if err == 0 else float("inf")),
            "max_abs": float(diff.abs().max()) if diff.numel() else 0.0, "shape": list(a.shape)}


def twin_checks(results: list[dict], folder: Path) -> list[dict]:
    """Each record of a row with ``same_as`` gets ``vs_one_gpu``: its final latent against its twin's (both kept
    in ``folder`` by this run), or why they could not be compared. Returns ``results``."""
    by_name = {r["name"]: r for r in results}
    for rec in results:
        twin = (rec.get("variant") or {}).get("same_as")
        if not twin:
            continue
        check: dict[str, Any] = {"row": twin}
        other = by_name.get(twin)
        mine, theirs = folder / f"{rec['name']}.latent", folder / f"{twin}.latent"
        if rec.get("status") != "ok":
            check["error"] = f"this row did not finish ({rec.get('status')})"
        elif other is None:
            check["error"] = f"{twin} did not run in this run"
        elif other.get("source"):
            check["error"] = f"{twin} comes from {other['source']}, not from this run"
        elif other.get("status") != "ok":
            check["error"] = f"{twin} did not finish ({other.get('status')})"
        elif not (mine.is_file() and theirs.is_file()):
            check["error"] = "no saved latent of " + " or ".join(
                n for n, p in ((rec["name"], mine), (twin, theirs)) if not p.is_file()) + " (--decode saves frames)"
        else:
            check.update(compare_latents(mine, theirs))
        rec["vs_one_gpu"] = check
    return results


def pick_rows(spec: str, table: dict[str, R], groups: dict[str, list[str]]) -> list[R]:
    """Rows of ``table`` from a comma list of row names and group names, in order, each once."""
    names: list[str] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        group = groups.get(item)
        if group is None and item not in table:
            raise SystemExit(f"--variants: unknown {item!r}; known: {', '.join(groups)}, {', '.join(table)}")
        names += group or [item]
    return [table[n] for n in dict.fromkeys(names)]


def run_rows(rows: Sequence[R], run_one: Callable[[R], dict], head: Callable[[R], dict],
             written: Callable[[list[dict]], object], results: list[dict], started: float, deadline: float = 0.0,
             reserve_estimate: float | Callable[[R], float] = 90.0) -> list[dict]:
    """``run_one`` each row, appending to ``results`` and calling ``written(results)`` after each. A row that would
    start later than ``deadline`` s after ``started`` minus ``reserve_estimate`` (seconds, or a function of the row;
    0: no deadline) is recorded as skipped; ``head(row)`` gives the name/what/variant keys."""
    for row in rows:
        what = head(row)
        elapsed = time.monotonic() - started
        needs = reserve_estimate(row) if callable(reserve_estimate) else reserve_estimate
        if deadline and elapsed + needs > deadline:
            print(f"skip {what['name']}: {elapsed:.0f} s used of the {deadline:.0f} s deadline", flush=True)
            results.append({**what, "status": "skipped", "error": "not started: time budget"})
            continue
        print(f"== {what['name']}: {what['what']}", flush=True)
        rec = run_one(row)
        results.append(rec)
        print(f"   {rec['status']} s/step={rec.get('s_per_step')} first={rec.get('first_step_s')} "
              f"wall={rec.get('wall_s')} gpu={rec.get('peak_gpu_gib')} rss={rec.get('peak_rss_hwm_gib')} "
              f"{rec.get('error', '')[:300]}", flush=True)
        written(results)
    return results


# ----------------------------------------------------------------------------------------------------------
# environment and model files


def gpu_facts() -> dict:
    """GPU name, total memory and driver of the first GPU, and the number of GPUs, from nvidia-smi (no CUDA context
    in this process); {} without it."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return {}
    res = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30, check=False)
    lines = res.stdout.strip().splitlines() if res.returncode == 0 else []
    fields = [f.strip() for f in (lines[0] if lines else "").split(",")]
    if len(fields) != 3:
        return {}
    return {"device_name": fields[0], "vram_total_gib": round(int(fields[1]) / 1024, 2), "driver": fields[2],
            "gpu_count": len(lines)}


def has_split_node(comfyui: Path) -> bool:
    """Whether the ComfyUI checkout defines core's MultiGPU CFG Split node (read from its source, not imported)."""
    source = comfyui / "comfy_extras" / "nodes_multigpu.py"
    return source.is_file() and f'"{SPLIT_NODE}"' in source.read_text(encoding="utf-8", errors="replace")


def split_skip_reason(row: Row, comfyui: Path, version: str, gpus: int, on_cpu: bool) -> str | None:
    """Why a MultiGPU CFG Split row (``gpus`` > 1) cannot run here, or None: the ComfyUI version lacks the node,
    the server runs on the CPU, or the machine has fewer GPUs than the row splits over."""
    if row.gpus <= 1:
        return None
    if not has_split_node(comfyui):
        return f"ComfyUI {version} has no {SPLIT_NODE} node (core's MultiGPU CFG Split, ComfyUI 0.33 and later)"
    if on_cpu:
        return f"MultiGPU CFG Split over {row.gpus} GPUs: the server runs on the CPU (--cpu/--smoke)"
    if gpus < row.gpus:
        return f"MultiGPU CFG Split over {row.gpus} GPUs: this machine has {gpus} (nvidia-smi)"
    return None


def write_models(models: Path, names: Iterable[str]) -> dict[str, float]:
    """Write the full-size synthetic files ``names`` (missing ones only); seconds per file. A name the runner has no
    synthetic writer for is reported and left out: its real file must be in ``models``."""
    from comfyui_lowvram_dit.synthetic.lora import KNOWN_LORA_FILES

    took = {}
    for name in names:
        if name not in workflow_models.KNOWN_MODEL_FILES and name not in KNOWN_LORA_FILES:
            print(f"model {name}: no synthetic writer for it; put the real file under {models}", flush=True)
            continue
        t0 = time.monotonic()
        workflow_models.write_synthetic_models({name}, models, "full")
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


# ----------------------------------------------------------------------------------------------------------
# the CLI of every server scenario


def parser(scenario: ServerScenario) -> argparse.ArgumentParser:
    """The options of a server scenario (its own defaults: rows, steps, sizes, files)."""
    d = scenario.defaults
    p = argparse.ArgumentParser(prog=f"python -m comfyui_lowvram_dit.benchmarks {scenario.name}",
                                description=scenario.title + " through fresh ComfyUI servers")
    p.add_argument("--comfyui", type=Path, required=True, help="ComfyUI checkout (main.py there)")
    p.add_argument("--models", type=Path, required=True, help="folder with diffusion_models/ text_encoders/ vae/ loras/")
    p.add_argument("--write-models", action="store_true", help="write missing full-size synthetic files first")
    p.add_argument("--variants", default=d.get("variants", "all"), help=f"comma list of names or {', '.join(scenario.groups)}")
    p.add_argument("--steps", "--steps-per-expert", dest="steps", type=int, default=d.get("steps", 3),
                   help="sampler steps (per expert for Wan)")
    for name in ("width", "height", "frames"):
        p.add_argument(f"--{name}", type=int, default=d.get(name))
    for name in ("unet", "te", "vae"):
        p.add_argument(f"--{name}", default=d.get(name), help="model file name (default: the template's)")
    p.add_argument("--edit", choices=["2509", "2511"], default="2509", help="Edit only: 2511 adds the reference method")
    p.add_argument("--image-size", type=int, nargs=2, default=[1024, 1024], metavar=("W", "H"), help="Edit only")
    p.add_argument("--empty-image", action="store_true", help="Edit only: a one-colour EmptyImage, not LoadImage")
    p.add_argument("--card-gib", type=float, default=None, help="the card size of the capped rows (default 8)")
    p.add_argument("--decode", action="store_true", help="VAE decode + save instead of SaveLatent")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny files written into --models, small, 2 steps, no cap")
    p.add_argument("--cpu", action="store_true", help="run ComfyUI on the CPU (tests)")
    p.add_argument("--kernel-profile", action="store_true", help="time every model call inside the server and "
                   "profile each expert's second step (benchmarks/server_probe); that step is left out of s/step")
    p.add_argument("--out", type=Path, default=scenario.out, help="where the json/md/png go")
    p.add_argument("--stem", default=scenario.name, help="result file name stem")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=d.get("timeout", 420.0), help="seconds one graph may take")
    p.add_argument("--deadline", type=float, default=0.0, help="seconds from start after which no new row starts")
    p.add_argument("--reserve-estimate", type=float, default=90.0, help="seconds a row is assumed to take")
    p.add_argument("--git-sha", default=None, help="pack commit to record (default: git rev-parse here)")
    p.add_argument("--git-status", default=None, help="`git status --short` of the pack checkout to record")
    p.add_argument("--keep-logs", action="store_true", help="keep each server log in the work folder")
    p.add_argument("--list-nodes", action="store_true", help="record the pack's nodes from /object_info")
    p.add_argument("--merge", type=Path, action="append", default=[], metavar="JSON",
                   help="rows of an earlier run to report with (a row run now replaces its name)")
    return p


def head(scenario: ServerScenario, row: Row) -> dict:
    """The keys every record of ``row`` starts with."""
    return {"name": row.name, "what": scenario.describe(row), "variant": asdict(row)}


def run_one(scenario: ServerScenario, row: Row, opts: argparse.Namespace, total_vram_gib: float) -> dict:
    """One fresh server, one graph; failures are recorded, not raised."""
    if opts.smoke:
        row = replace(row, card_gib=None)
    elif opts.card_gib is not None and row.card_gib is not None:
        row = replace(row, card_gib=opts.card_gib)
    graph = scenario.graph(row, opts)
    setup = ServerSetup(opts.comfyui, opts.models, opts.work, timeout=opts.timeout, cpu=opts.cpu or opts.smoke,
                        keep_logs=opts.keep_logs, list_nodes=opts.list_nodes)
    prepare = scenario.prepare_input
    record = run_row(setup, row, graph, total_vram_gib, head(scenario, row), sampler_nodes=scenario.sampler_nodes,
                     probe=opts.kernel_profile, own_user_dir=scenario.own_user_dir,
                     prepare_input=None if prepare is None else lambda folder: prepare(folder, opts))
    if not scenario.keep_timeline:
        record.pop("timeline", None)
    return record


def skip_rows(scenario: ServerScenario, rows: Sequence[Row], opts: argparse.Namespace, env: dict,
              results: list[dict]) -> list[Row]:
    """Record the rows that cannot run here as skipped, with the reason (the native rows of a smoke run, split rows
    without core's split node or enough GPUs); returns the others."""
    kept = []
    for row in rows:
        if opts.smoke and row.graph == "native":
            reason: str | None = scenario.smoke_native
        else:
            reason = split_skip_reason(row, opts.comfyui, env.get("comfyui_version") or "?",
                                       env.get("gpu_count") or 0, opts.cpu or opts.smoke)
        if reason is None:
            kept.append(row)
            continue
        results.append({**head(scenario, row), "status": "skipped", "error": reason})
        print(f"skip {row.name}: {reason}", flush=True)
    return kept


def main(scenario: ServerScenario, argv: list[str] | None = None) -> int:
    """Run the chosen rows one fresh server each; the reports are rewritten after every row."""
    opts = parser(scenario).parse_args(argv)
    started = time.monotonic()
    rows = pick_rows(opts.variants, scenario.rows, scenario.groups)
    if opts.smoke and opts.write_models:
        raise SystemExit("--smoke writes tiny files and --write-models full-size ones into --models: pick one")
    if opts.smoke and scenario.smoke is None:
        raise SystemExit(f"{scenario.name} has no smoke mode")
    if not opts.kernel_profile and (need := [r.name for r in rows if r.fp8_path != "default"]):
        raise SystemExit(f"--variants {','.join(need)}: the Kernel Profile node sets their fp8 path; add --kernel-profile")
    own_work = opts.work is None  # a temp folder of this run: removed at the end unless --keep-logs
    opts.work = (opts.work or Path(tempfile.mkdtemp(prefix=f"bench_{scenario.name}_"))).resolve()
    env = {**harness.parent_environment(), **gpu_facts(), **harness.software_facts(),
           "comfyui_version": harness.comfyui_version(opts.comfyui)}
    env["git_sha"] = opts.git_sha or env.get("git_sha")
    env["git_status"] = opts.git_status
    files = scenario.files(rows, opts)
    if opts.smoke:
        scenario.smoke(opts, files)
    keys = ("steps", "width", "height", "frames", "decode", "smoke", "kernel_profile",
            *(("edit", "image_size", "empty_image") if scenario.prepare_input else ()))
    settings = {k: v for k, v in vars(opts).items() if k in keys and v is not None}
    settings.update({k: v for k, v in scenario.defaults.items() if k in ("cfg", "shift", "cfg_4step", "shift_4step")})
    settings["variants"] = [r.name for r in rows]
    if opts.write_models:
        settings["model_write_s"] = write_models(opts.models, files)
    settings["model_files_gb"] = model_file_sizes(opts.models, files)
    results = merged_rows(opts.merge, {r.name for r in rows})
    rows = skip_rows(scenario, rows, opts, env, results)
    total = env.get("vram_total_gib") or 0.0
    latents = opts.work / LATENTS

    def written(done: list[dict]) -> list[Path]:
        return write(opts.out, opts.stem, twin_checks(done, latents), env, settings, scenario)

    run_rows(rows, lambda r: run_one(scenario, r, opts, total), lambda r: head(scenario, r), written, results,
             started, opts.deadline, opts.reserve_estimate)
    paths = written(results)
    if own_work and not opts.keep_logs:
        shutil.rmtree(opts.work, ignore_errors=True)
    print(paths[1].read_text(encoding="utf-8"))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if any(r["status"] == "ok" for r in results) else 1
