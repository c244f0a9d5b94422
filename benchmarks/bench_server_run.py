"""One benchmark row through a fresh ComfyUI server, shared by bench_server (Wan 2.2) and the Qwen-Image benches.

``run_row`` starts ComfyUI as users start it (``main.py``, a hermetic base directory with this pack in
custom_nodes, ``--front-end-root`` on an empty folder), checks that the pack imported, queues one API graph and
measures it; a failure is recorded in the row with its reason and the server log, never raised.

Step time: the server sends a websocket ``progress`` message after every sampler step (value 1..n per sampler
node); the interval between consecutive messages of one node is one step. A node's first step also holds the
model load (DynamicVRAM loads weights inside it), compiles and attention timing, so it is reported apart and the
headline is the median of the later steps of every sampler node. ComfyUI's tqdm lines in the server log give an
independent check (their average includes the first step).
Memory: ``tools.memwatch`` samples the server process from outside every 0.5 s: VmHWM (kernel peak RSS),
RssAnon/RssFile, and the process's GPU memory from nvidia-smi (CUDA context and allocator cache included).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any, Protocol, Self, TypeVar

from ..cli import runner
from ..cli.memwatch import MemoryWatch
from . import server_probe
from ..checkpoints.safe_write import write_report

PACK_ROOT = Path(__file__).resolve().parents[1]
GIB = float(1 << 30)
PROBE_NODE = "LowVRAMBench_KernelProfile"
PROBE_CALL = 1  # the second model call of each expert = its second step (cfg batched: one call per step)
PROBE_DIR = "lowvram_bench_probe"  # its folder name in the server's custom_nodes
WORK_MARK = "$WORK"  # stands for the scratch folder in recorded server flags (no machine paths in results)
Row = TypeVar("Row")


class ServerRow(Protocol):
    """What ``run_row`` needs of a variant row: its name and its server flags on a GPU of some size."""

    name: str

    def server_args(self, total_vram_gib: float) -> list[str]: ...


@dataclass(frozen=True)
class ServerSetup:
    """Where and how the servers of one benchmark run start."""

    comfyui: Path  # ComfyUI checkout (main.py there)
    models: Path  # folder with diffusion_models/ text_encoders/ vae/ loras/
    work: Path  # scratch folder: one base directory per row, the shared front-end root and user directory
    timeout: float = 420.0  # seconds one graph may take
    cpu: bool = False  # ComfyUI on the CPU (tests of the benches only)
    keep_logs: bool = False  # keep each server log as <work>/<row>.log
    list_nodes: bool = False  # record the pack's nodes from /object_info


def server_flags(name: str, total_vram_gib: float, card_gib: float | None, ck_attention: bool = False,
                 dynamic_vram: bool = True) -> list[str]:
    """ComfyUI flags of a row: ``--use-ck-attention``, ``--disable-dynamic-vram`` and the card cap
    ``--reserve-vram`` = the GPU's total minus ``card_gib`` (None: the whole GPU)."""
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


# ----------------------------------------------------------------------------------------------------------
# timing from websocket events and the server log


def step_times(events: list[tuple[float, dict]], node: str) -> dict:
    """Per-step times of one sampler node from ``(arrival time, message)`` pairs of the server's websocket.

    ``first_s``: node start ('executing') to its first 'progress' (load + first step); ``steps_s``: intervals
    between consecutive progress values (each later step). Repeated values (re-sent progress) count once.
    """
    start = next((t for t, m in events if m.get("type") == "executing" and m["data"].get("node") == node), None)
    seen: dict[int, float] = {}
    for t, m in events:
        if m.get("type") == "progress" and str(m["data"].get("node")) == node:
            seen.setdefault(int(m["data"]["value"]), t)
    values = sorted(seen)
    stamps = [seen[v] for v in values]
    return {"node": node, "progress_values": values,
            "first_s": round(stamps[0] - start, 3) if stamps and start is not None else None,
            "steps_s": [round(b - a, 3) for a, b in pairwise(stamps)]}


def node_times(events: list[tuple[float, dict]]) -> dict[str, float]:
    """Seconds each executed node took: from its 'executing' message to the next node's (or the end)."""
    marks = [(t, m["data"].get("node")) for t, m in events if m.get("type") == "executing"]
    out: dict[str, float] = {}
    for (t, node), (t_next, _) in pairwise(marks):
        if node is not None:
            out[str(node)] = round(out.get(str(node), 0.0) + t_next - t, 3)
    return out


_TQDM_DONE = re.compile(r"100%\|[^|]*\|\s*(\d+)/(\1)\s*\[(\d+):(\d+)<[^,\]]*,\s*([\d.]+)(s/it|it/s)\]")


def tqdm_summaries(log: str) -> list[dict]:
    """ComfyUI's closing tqdm line of each sampler run in ``log``: steps, elapsed (whole s) and average s/step.

    tqdm prints the 100% line twice per run (last update, then close with the run's average): every second one
    is kept when they pair up.
    """
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
            "steps_timed": len(later),
            "first_step_s": [d["first_s"] for d in per_node]}


def _window_peak(samples: list[dict], t0: float, t1: float, key: str) -> float | None:
    vals = [s[key] for s in samples if t0 <= s["t"] <= t1 and s.get(key) is not None]
    return round(max(vals) / GIB, 3) if vals else None


LOG_KEEP = re.compile(r"lowvram_dit|DynamicVRAM|loaded (completely|partially)|Requested to load|model weight dtype|"
                      r"Prompt executed|ComfyUI version|comfy-(kitchen|aimdo) version|Total VRAM|pytorch version|"
                      r"attention|Error|error|Traceback|out of memory|OutOfMemory", re.IGNORECASE)
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
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._listen()), name="bench-ws", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        if not self._ready.wait(30) or self.error:
            raise runner.RunError(f"websocket {self.ws_url} did not open: {self.error or 'timeout'}")
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
        except Exception as exc:  # noqa: BLE001 - reported by __enter__ or in the variant's record
            self.error = f"{type(exc).__name__}: {exc}"
            self._ready.set()


def prepare_base(base: Path, models: Path, probe: bool = False) -> list[str]:
    """A hermetic ComfyUI base dir with this pack (and the probe node) in custom_nodes; returns its path flags."""
    for sub in ("custom_nodes", "input", "output", "temp"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    (base / "custom_nodes" / runner.REGISTRY_FOLDER_NAME).symlink_to(PACK_ROOT, target_is_directory=True)
    if probe:
        (base / "custom_nodes" / PROBE_DIR).symlink_to(Path(__file__).resolve().parent / "server_probe",
                                                       target_is_directory=True)
    yaml = runner.extra_model_paths_yaml(models.resolve(), base / "extra_model_paths.yaml")
    return ["--extra-model-paths-config", str(yaml), "--output-directory", str(base / "output")]


def measure(server: runner.ComfyServer, graph: dict, timeout: float, sampler_nodes: tuple[str, ...],
            probe_dir: Path | None = None) -> dict:
    """Queue ``graph`` on ``server`` and measure it: step times of ``sampler_nodes`` (in the order they run), node
    times, memory peaks (and the Kernel Profile node's results from ``probe_dir``)."""
    cid = uuid.uuid4().hex
    with EventRecorder(server.url, cid) as rec:
        t_watch = time.monotonic()
        with MemoryWatch(server.process.pid) as watch:
            t0 = time.monotonic()
            status, body = server.post_prompt(graph, client_id=cid)
            if status != 200:
                raise runner.RunError(f"ComfyUI rejected the graph ({status}): "
                                      f"{json.dumps(body.get('node_errors') or body)[:2000]}")
            entry = server.wait_for_history(body["prompt_id"], timeout)
            wall = time.monotonic() - t0
        time.sleep(0.3)  # the last websocket messages
    events = rec.events
    per_node = [step_times(events, n) for n in sampler_nodes]
    probe = server_probe.read_probe(probe_dir) if probe_dir is not None else None
    if probe:
        server_probe.drop_profiled_steps(per_node, PROBE_CALL)
    out: dict[str, Any] = {"wall_s": round(wall, 2), **summarize_steps(per_node), "samplers": per_node,
                           "node_s": node_times(events), **watch.summary()}
    if probe is not None:
        out["probe"] = probe
    starts = [t for t, m in events if m.get("type") == "executing" and m["data"].get("node") == sampler_nodes[0]]
    if starts:
        rel = starts[0] - t_watch
        out["peak_gpu_sampling_gib"] = _window_peak(watch.samples, rel, rel + 1e9, "gpu")
    out["timeline"] = [[s["t"], round(s["rss"] / GIB, 3), round(s["anon"] / GIB, 3),
                        None if s["gpu"] is None else round(s["gpu"] / GIB, 3)] for s in watch.samples]
    if entry["status"]["status_str"] != "success":
        out["status"], out["error"] = "error", runner.execution_error(entry) or str(entry["status"])
    else:
        out["status"] = "ok"
    return out


def scrub_work(flags: list[str], work: Path) -> list[str]:
    """``flags`` with the scratch folder written as $WORK (the recorded flags name no machine path)."""
    return [f.replace(str(work), WORK_MARK) for f in flags]


def run_row(setup: ServerSetup, row: ServerRow, graph: dict, total_vram_gib: float, record: dict, *,
            sampler_nodes: tuple[str, ...], probe: bool = False, own_user_dir: bool = False,
            prepare_input: Callable[[Path], object] | None = None) -> dict:
    """One fresh server with ``row``'s flags, one graph; the measurements are added to ``record`` and returned.

    ``own_user_dir``: a user directory of this row only (the pack's embedding caches start empty), else the run's
    shared one. ``prepare_input(input_dir)`` writes what the graph loads from the input folder before the start.
    A failure sets ``status`` "error" with its reason; the row still gets the log digest (and the whole log under
    ``--keep-logs``).
    """
    setup.work.mkdir(parents=True, exist_ok=True)
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
        t0 = time.monotonic()
        with runner.start_comfyui(setup.comfyui, base, cpu=setup.cpu, extra_args=flags,
                                  startup_timeout=240) as server:
            record["startup_s"] = round(time.monotonic() - t0, 1)
            problems = runner.pack_import_problems(server.log_text(), base / "custom_nodes" /
                                                   runner.REGISTRY_FOLDER_NAME)
            if problems:
                raise runner.RunError(f"the pack failed to import: {problems[0].strip()}")
            if setup.list_nodes:
                info = server.get("/object_info", timeout=180)
                record["pack_nodes"] = sorted(k for k in info if k.startswith("LowVRAM_"))
                record["object_info_nodes"] = len(info)
            try:
                probe_dir = base / "output" / "bench_probe" if probe else None
                record.update(measure(server, graph, setup.timeout, sampler_nodes, probe_dir))
            finally:
                log = server.log_text()
    except Exception as exc:  # noqa: BLE001 - one row's failure must not stop the others
        record["error"] = f"{type(exc).__name__}: {exc}"[:4000]
        if not log and (base / "comfyui.log").exists():
            log = (base / "comfyui.log").read_text(errors="replace")
    record["tqdm"] = tqdm_summaries(log)
    record["log"] = log_digest(log)
    record["lora_keys_not_loaded"] = log.count(LORA_KEY_MISSED)  # > 0: a LoRA row ran partly without its LoRA
    if setup.keep_logs:
        write_report((setup.work / f"{row.name}.log"), log)
    shutil.rmtree(base, ignore_errors=True)
    return record


def pick_rows(spec: str, table: dict[str, Row], groups: dict[str, list[str]]) -> list[Row]:
    """Rows of ``table`` from a comma list of row names and group names (``groups``), in order, each once."""
    names: list[str] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        group = groups.get(item)
        if group is None and item not in table:
            raise SystemExit(f"--variants: unknown {item!r}; known: {', '.join(groups)}, {', '.join(table)}")
        names += group or [item]
    return [table[n] for n in dict.fromkeys(names)]


def run_rows(rows: Sequence[Row], run_one: Callable[[Row], dict], head: Callable[[Row], dict],
             written: Callable[[list[dict]], object], results: list[dict], started: float, deadline: float = 0.0,
             reserve_estimate: float = 90.0) -> list[dict]:
    """``run_one`` each row and append its record to ``results``, calling ``written(results)`` after each (a run
    cut short keeps its numbers). A row that would start later than ``deadline`` s after ``started`` minus
    ``reserve_estimate`` (0: no deadline) is recorded as skipped; ``head(row)`` gives the name/what/variant keys."""
    for row in rows:
        what = head(row)
        elapsed = time.monotonic() - started
        if deadline and elapsed + reserve_estimate > deadline:
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
