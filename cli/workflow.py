"""Run a workflow headless: ``python -m comfyui_lowvram_dit run WORKFLOW [options]``.

Starts ComfyUI from a checkout (or uses one already running), converts the UI-format workflow to
API format with comfy-cli against the server's own ``/object_info``, queues it, shows progress and
prints where the outputs went. ``--synthetic tiny`` writes tiny random-weight models under the file
names the workflow expects, so the whole path runs on a fresh machine without downloads.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .memwatch import MemoryWatch
from ..synthetic.run_models import (
    KNOWN_MODEL_FILES, MODEL_FOLDERS, STAGED_TEXT_NODES, TINY_TE_LAYERS, TINY_VAE_SWAPS, RunError, _layer_count,
    extra_model_paths_yaml, referenced_model_files, staged_text_encoder_files, stock_loaded_qwen_image_files,
    swap_tiny_vaes, tiny_text_encoder_config, vision_text_encoder_files, write_synthetic_models,
)
from .ui_graph import BYPASSED_MODES, FRONTEND_ONLY, all_nodes
from ..checkpoints import safe_write
from ..checkpoints.safe_write import commit, starts_with, temp_beside, write_atomic

PACK_DIR = Path(__file__).resolve().parent.parent  # the repository root is the pack
WORKFLOWS_DIR = PACK_DIR / "workflows"
REGISTRY_FOLDER_NAME = "comfyui-lowvram-dit"

# --synthetic tiny: sizes and steps every sampler/latent node gets unless --set says otherwise.
TINY_OVERRIDES: dict[str, dict[str, int]] = {
    "EmptyHunyuanLatentVideo": {"width": 64, "height": 64, "length": 5},
    "WanImageToVideo": {"width": 64, "height": 64, "length": 5},
    "Wan22ImageToVideoLatent": {"width": 64, "height": 64, "length": 5},
    "EmptySD3LatentImage": {"width": 64, "height": 64},
    "EmptyLatentImage": {"width": 64, "height": 64},
}
TINY_STEPS = 2
STARTUP_NOTE_S = 3.0  # seconds between progress lines while ComfyUI starts


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(url: str, payload: dict | None = None, timeout: float = 30.0) -> tuple[int, dict]:
    """GET (or POST ``payload`` as JSON) and return ``(status, parsed JSON)``; HTTP errors are returned, not raised."""
    data = None if payload is None else json.dumps(payload).encode("utf-8")
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
            return resp.status, (json.loads(body) if body else {})
    except urllib.error.HTTPError as err:
        body = err.read()
        try:
            return err.code, json.loads(body)
        except json.JSONDecodeError:
            return err.code, {"error": body.decode("utf-8", "replace")}


@dataclass
class ComfyServer:
    """A ComfyUI server reachable at ``url``; ``process`` is set when this module started it."""

    url: str
    process: subprocess.Popen | None = None
    log_path: Path | None = None

    def log_text(self) -> str:
        """The server log so far ("" for a server this module did not start)."""
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def get(self, route: str, timeout: float = 30.0) -> dict:
        """GET a JSON route; raises RunError on a non-200 answer."""
        status, body = http_json(self.url + route, timeout=timeout)
        if status != 200:
            raise RunError(f"GET {route} answered {status}: {body}")
        return body

    def post_prompt(self, api: dict, client_id: str | None = None) -> tuple[int, dict]:
        """POST an API-format graph to /prompt; returns (status, JSON)."""
        return http_json(self.url + "/prompt", {"prompt": api, "client_id": client_id or uuid.uuid4().hex})

    def wait_for_history(self, prompt_id: str, timeout: float, on_tick=None) -> dict:  # noqa: ANN001
        """Poll /history until the prompt finished; returns its history entry."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            entry = self.get(f"/history/{prompt_id}").get(prompt_id)
            if entry and entry.get("status", {}).get("status_str") in {"success", "error"}:
                return entry
            if self.process is not None and self.process.poll() is not None:
                raise RunError(f"ComfyUI exited (rc={self.process.returncode}) while running; log:\n{self.log_text()[-4000:]}")
            if on_tick:
                on_tick()
            time.sleep(0.25)
        raise RunError(f"prompt {prompt_id} did not finish within {timeout:.0f} s")

    def stop(self) -> None:
        """Stop the server if this module started it."""
        if self.process is not None:
            stop_process(self.process)


def stop_process(proc: subprocess.Popen) -> None:
    """Terminate a child process, killing it if it does not exit within 30 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


LOG_MARKER = b"# comfyui_lowvram_dit: ComfyUI log: "


def prepare_base_dir(base: Path, extra_custom_nodes: dict[str, Path] | None = None) -> None:
    """Make a hermetic ComfyUI base directory with this pack linked into ``custom_nodes``."""
    for sub in ("custom_nodes", "input", "output", "user", "temp", *(f"models/{f}" for f in MODEL_FOLDERS)):
        (base / sub).mkdir(parents=True, exist_ok=True)
    links = {REGISTRY_FOLDER_NAME: PACK_DIR, **(extra_custom_nodes or {})}
    for name, target in links.items():
        link = base / "custom_nodes" / name
        if not link.exists():
            link.symlink_to(target, target_is_directory=True)


def open_log(log_path: Path, cmd: list[str]) -> BinaryIO:
    """ComfyUI's log file, new and open for writing; it starts with a marker line, the proof that lets a later run
    replace it (kernels.safe_write: a link or a file of the user's at that name is refused)."""
    tmp, logf = temp_beside(log_path)
    try:
        logf.write(LOG_MARKER + shlex.join(cmd).encode("utf-8", "replace") + b"\n")
        logf.flush()
        commit(tmp, log_path, starts_with(LOG_MARKER, len(LOG_MARKER)))
    except BaseException:
        logf.close()
        raise
    return logf


@contextmanager
def start_comfyui(
    comfyui_path: Path,
    base_dir: Path,
    *,
    python: str | None = None,
    cpu: bool = False,
    extra_args: list[str] | None = None,
    startup_timeout: float = 300.0,
    progress: Callable[[str], None] | None = None,
) -> Iterator[ComfyServer]:
    """Start ComfyUI headless on a free loopback port; stop it on exit. Fails fast if it dies.

    ``progress`` gets a line every few seconds while ComfyUI starts (elapsed time and its last log line).
    """
    main_py = comfyui_path / "main.py"
    if not main_py.is_file():
        raise RunError(f"{comfyui_path}: no main.py here; point --comfyui (or COMFYUI_PATH) at a ComfyUI checkout")
    port = free_port()
    # Headless: an empty web root, so ComfyUI neither needs nor version-checks its front-end package; no
    # paid-API nodes (a second to import, and a headless run has no account to call them with).
    web_root = base_dir / "web"
    web_root.mkdir(exist_ok=True)
    front = [] if any(a.startswith("--front-end-root") for a in extra_args or []) else [
        "--front-end-root", str(web_root)]
    cmd = [
        python or sys.executable, str(main_py), "--listen", "127.0.0.1", "--port", str(port),
        "--base-directory", str(base_dir), "--disable-auto-launch", "--database-url", "sqlite:///:memory:",
        "--disable-api-nodes", *front, *(["--cpu"] if cpu else []), *(extra_args or []),
    ]  # fmt: skip
    log_path = base_dir / "comfyui.log"
    logf = open_log(log_path, cmd)
    proc = subprocess.Popen(
        cmd, cwd=comfyui_path, stdout=logf, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    server = ComfyServer(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        t0 = time.monotonic()
        deadline = t0 + startup_timeout
        next_note = t0 + STARTUP_NOTE_S
        while True:
            if proc.poll() is not None:
                raise RunError(f"ComfyUI exited at startup (rc={proc.returncode}); log:\n{server.log_text()[-4000:]}")
            try:
                if http_json(server.url + "/system_stats", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            now = time.monotonic()
            if now > deadline:
                raise RunError(f"ComfyUI did not answer within {startup_timeout:.0f} s; log:\n{server.log_text()[-4000:]}")
            if progress is not None and now >= next_note:
                next_note = now + STARTUP_NOTE_S
                last = next((ln for ln in reversed(server.log_text().splitlines()) if ln.strip()), "")
                progress(f"  ComfyUI starting ({now - t0:.0f} s){': ' + last.strip()[:100] if last else ''}")
            time.sleep(0.25)
        if progress is not None:
            progress(f"ComfyUI ready in {time.monotonic() - t0:.1f} s")
        yield server
    finally:
        server.stop()
        logf.close()


def pack_import_problems(log: str, pack_dir: Path) -> list[str]:
    """Log lines saying ComfyUI failed to import or register the pack at ``pack_dir``."""
    path = re.escape(str(pack_dir))
    patterns = [
        rf"\(IMPORT FAILED\): {path}\s*$",
        rf"Cannot import {path} module",
        rf"Error while calling comfy_entrypoint in {path}\b",
        rf"comfy_entrypoint in {path} (is not callable|did not return)",
        rf"Skip {path} module",
    ]
    rx = re.compile("|".join(patterns))
    return [line for line in log.splitlines() if rx.search(line)]


def resolve_workflow(name_or_path: str) -> Path:
    """A workflow path, or the name of a shipped workflow (with or without ``.json``)."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    shipped = WORKFLOWS_DIR / (name_or_path if name_or_path.endswith(".json") else name_or_path + ".json")
    if shipped.is_file():
        return shipped
    names = sorted(f.stem for f in WORKFLOWS_DIR.glob("*.json"))
    raise RunError(f"workflow {name_or_path!r} not found; shipped workflows: {', '.join(names) or '(none)'}")


def is_api_workflow(workflow: dict) -> bool:
    """True for an API-format workflow: ``{node_id: {"class_type": ..., "inputs": {...}}}``."""
    return bool(workflow) and "nodes" not in workflow and all(
        isinstance(n, dict) and "class_type" in n for n in workflow.values())


def to_api(workflow: dict, object_info: dict) -> dict:
    """Convert a UI-format workflow to API format with comfy-cli (API format passes through)."""
    if is_api_workflow(workflow):  # no comfy-cli needed (e.g. a GPU box with only ComfyUI's requirements)
        return workflow
    try:
        from comfy_cli.workflow_to_api import convert_ui_to_api, is_api_format
    except ImportError:
        raise RunError("converting UI workflows needs comfy-cli: pip install comfy-cli") from None
    return workflow if is_api_format(workflow) else convert_ui_to_api(workflow, object_info)


def missing_node_types(workflow: dict, object_info: dict) -> list[str]:
    """Node types a UI or API workflow needs that this ComfyUI lacks (bypassed, muted, front-end-only nodes and
    subgraph instances left out), sorted."""
    if is_api_workflow(workflow):
        return sorted({n["class_type"] for n in workflow.values()} - object_info.keys())
    subgraphs = {str(sg.get("id")) for sg in (workflow.get("definitions") or {}).get("subgraphs") or []}
    used = {str(n.get("type")) for n in all_nodes(workflow) if n.get("mode", 0) not in BYPASSED_MODES}
    return sorted(used - FRONTEND_ONLY - subgraphs - object_info.keys())


def check_node_types(server: ComfyServer, workflow: dict, object_info: dict) -> None:
    """RunError naming every node type the workflow uses that the server lacks, and the server's version."""
    missing = missing_node_types(workflow, object_info)
    if missing:
        version = server.get("/system_stats").get("system", {}).get("comfyui_version", "unknown version")
        raise RunError(f"this ComfyUI ({version}) has no node {', '.join(missing)}: the workflow needs a newer "
                       "ComfyUI or the custom nodes that provide it")


def apply_overrides(api: dict, overrides: list[str]) -> dict:
    """Apply ``NODE.INPUT=VALUE`` overrides; NODE is a node id, a title or a class_type (must be unique)."""
    for item in overrides:
        target, sep, raw = item.partition("=")
        node_key, dot, input_name = target.rpartition(".")
        if not sep or not dot or not node_key or not input_name:
            raise RunError(f"--set {item!r}: expected NODE.INPUT=VALUE")
        matches = [
            nid for nid, n in api.items()
            if node_key in (nid, n.get("class_type"), n.get("_meta", {}).get("title"))
        ]  # fmt: skip
        if len(matches) != 1:
            raise RunError(f"--set {item!r}: {len(matches)} nodes match {node_key!r}; use the node id")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        api[matches[0]].setdefault("inputs", {})[input_name] = value
    return api


def tiny_overrides(api: dict) -> list[str]:
    """``--set`` items that shrink a workflow for --synthetic tiny: latent sizes and 2 sampler steps.

    KSamplerAdvanced start/end steps are scaled with the step count, so a two-expert split (0->10, 10->end of
    20) stays a split (0->1, 1->end of 2).
    """
    items: list[str] = []
    for nid, node in api.items():
        ct, inp = node.get("class_type"), node.get("inputs", {})
        for key, value in TINY_OVERRIDES.get(ct, {}).items():
            if key in inp:
                items.append(f"{nid}.{key}={value}")
        if ct in ("KSampler", "KSamplerAdvanced") and isinstance(inp.get("steps"), int) and inp["steps"] > TINY_STEPS:
            old = inp["steps"]
            items.append(f"{nid}.steps={TINY_STEPS}")
            for key in ("start_at_step", "end_at_step"):
                v = inp.get(key)
                if isinstance(v, int) and v < old:
                    items.append(f"{nid}.{key}={round(v * TINY_STEPS / old)}")
    return items


def ensure_input_images(workflow: dict, input_dir: Path, synthetic: bool, search: list[Path]) -> list[Path]:
    """Put every image a LoadImage node names into ComfyUI's input folder.

    The file is copied from ``search`` (the workflow's folder, the current directory); for --synthetic runs a
    missing one is drawn (a 256x256 gradient PNG), otherwise its absence is an error naming the fix.
    """
    nodes = list(all_nodes(workflow))  # subgraphs too
    names = [n["widgets_values"][0] for n in nodes if n.get("type") == "LoadImage" and n.get("widgets_values")]
    if "nodes" not in workflow:
        names = [n["inputs"]["image"] for n in workflow.values() if n.get("class_type") == "LoadImage"]
    placed = []
    for name in names:
        dst = input_dir / name
        if dst.exists():  # a file of the user's (or a link to one) is used as it is
            continue
        src = next((d / name for d in search if (d / name).is_file()), None)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src is not None:
            write_atomic(dst, src.read_bytes())  # a link or folder at dst is refused, never written through
        elif synthetic:
            write_atomic(dst, gradient_png())
        else:
            raise RunError(f"LoadImage wants {name!r}: put it in the current directory (or next to the workflow), "
                           "or use --set NODE.image=FILE with a file that is there")
        placed.append(dst)
    return placed


def gradient_png() -> bytes:
    """The 256x256 gradient PNG a --synthetic run draws for a missing LoadImage file."""
    import io

    from PIL import Image

    img = Image.new("RGB", (256, 256))
    img.putdata([(x, y, (x + y) // 2) for y in range(256) for x in range(256)])
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def output_files(entry: dict, output_dir: Path) -> list[Path]:
    """Paths of the files a finished prompt wrote (images, videos, latents...)."""
    found = []
    for node_out in entry.get("outputs", {}).values():
        for items in node_out.values():
            for item in items if isinstance(items, list) else []:
                if isinstance(item, dict) and "filename" in item and item.get("type", "output") == "output":
                    found.append(output_dir / item.get("subfolder", "") / item["filename"])
    return found


def execution_error(entry: dict) -> str:
    """ComfyUI's execution error message from a history entry ("" when none)."""
    for kind, data in entry.get("status", {}).get("messages", []):
        if kind == "execution_error":
            return f"{data.get('node_type')} (node {data.get('node_id')}): {data.get('exception_message', '').strip()}"
    return ""


def run_workflow(server: ComfyServer, workflow: dict, overrides: list[str], output_dir: Path, timeout: float,
                 tiny: bool = False, object_info: dict | None = None) -> list[Path]:
    """Convert, queue and wait for one workflow (``tiny``: apply tiny_overrides first); returns the output files.

    ``object_info``: the server's /object_info when the caller already read it (a large reply)."""
    object_info = object_info if object_info is not None else server.get("/object_info", timeout=120)
    check_node_types(server, workflow, object_info)
    api = workflow if is_api_workflow(workflow) else to_api(workflow, object_info)
    if tiny:
        auto = tiny_overrides(api)
        print(f"--synthetic tiny: {' '.join(auto) or 'no size/step overrides'}", flush=True)
        overrides = [*auto, *overrides]
    api = apply_overrides(api, overrides)
    status, body = server.post_prompt(api)
    if status != 200:
        raise RunError(f"ComfyUI rejected the workflow ({status}): {json.dumps(body.get('node_errors') or body)[:2000]}")
    prompt_id = body["prompt_id"]
    print(f"queued prompt {prompt_id}", flush=True)
    start = time.monotonic()
    last = [0.0]

    def tick() -> None:
        if time.monotonic() - last[0] > 10:
            last[0] = time.monotonic()
            print(f"  ... running ({time.monotonic() - start:.0f} s)", flush=True)

    entry = server.wait_for_history(prompt_id, timeout, tick)
    if entry["status"]["status_str"] != "success":
        raise RunError(f"the workflow failed: {execution_error(entry) or entry['status']}")
    print(f"finished in {time.monotonic() - start:.1f} s", flush=True)
    return output_files(entry, output_dir)


def write_report(path: Path, args: argparse.Namespace, wall_s: float, summary: dict, watch: MemoryWatch,
                 log: str, files: list[Path]) -> None:
    """The ``--report`` JSON: what ran, how long, peak memory, the sampled timeline and ComfyUI's log tail."""
    report = {"workflow": args.workflow, "overrides": args.overrides, "synthetic": args.synthetic,
              "comfyui_args": args.comfyui_args, "wall_s": round(wall_s, 2), **summary,
              "marks": watch.marks, "timeline": watch.samples, "outputs": [str(f) for f in files],
              "comfyui_log_tail": log[-20000:]}
    path.parent.mkdir(parents=True, exist_ok=True)
    safe_write.write_report(path, json.dumps(report, indent=1))
    print(f"report: {path}", flush=True)


SYNTHETIC_NOTE = ("note: the models were synthetic (random weights), so the output is noise from random weights, "
                  "not a picture; pass --models DIR with the real files for real output")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m comfyui_lowvram_dit run", description=__doc__.splitlines()[0])
    p.add_argument("workflow", help="a workflow file, or the name of a shipped workflow (see workflows/)")
    p.add_argument("--comfyui", type=Path, default=os.environ.get("COMFYUI_PATH"),
                   help="ComfyUI checkout to start (default: $COMFYUI_PATH)")
    p.add_argument("--python", default=None, help="Python that runs ComfyUI (default: this one)")
    p.add_argument("--url", default=None,
                   help="use a running ComfyUI (e.g. http://127.0.0.1:8188) instead of starting one")
    p.add_argument("--models", type=Path, default=None, help="folder with diffusion_models/ text_encoders/ vae/ loras/")
    p.add_argument("--synthetic", choices=["tiny", "full"], default=None,
                   help="tiny: write tiny random-weight models and shrink the workflow (64 px, 5 frames, 2 steps), "
                        "the default when --models is not given; full: full-size random-weight files with real "
                        "shapes (tens of GB, written under --models or the cache; the workflow keeps its sizes)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="NODE.INPUT=VALUE",
                   help="change one input of the workflow before it is queued; NODE is a node id, title or class "
                        "name that matches one node, VALUE is JSON or else a string, e.g. --set KSampler.steps=4 "
                        "(repeatable; applied after --synthetic tiny's own size/step changes)")
    p.add_argument("--output", type=Path, default=Path("lowvram_dit_output"),
                   help="folder for the outputs (default: ./lowvram_dit_output, ignored by the pack's .gitignore)")
    p.add_argument("--cpu", action="store_true", help="run ComfyUI on the CPU (default when no CUDA GPU is found)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the workflow to finish")
    p.add_argument("--keep", action="store_true", help="keep the temporary ComfyUI base directory (for debugging)")
    p.add_argument("--report", type=Path, default=None,
                   help="write a JSON report: wall time, peak RSS (anonymous/file-backed) and GPU memory of ComfyUI")
    p.add_argument("--comfyui-arg", dest="comfyui_args", action="append", default=[], metavar="ARG",
                   help="extra ComfyUI command-line argument, e.g. --comfyui-arg=--reserve-vram=2 (repeatable)")
    p.epilog = ("Models: --models DIR, else tiny synthetic ones cached under $LOWVRAM_DIT_CACHE "
                "(default ~/.cache/comfyui_lowvram_dit).")
    return p


def _cuda_available(python: str) -> bool:
    """Whether ``python``'s torch sees a GPU; on Linux without an NVIDIA/AMD driver, no (skips a torch import)."""
    if sys.platform.startswith("linux") and not any(os.path.exists(p) for p in ("/proc/driver/nvidia", "/dev/kfd")):
        return False
    code = "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([python, "-c", code], capture_output=True).returncode == 0


def _say(line: str) -> None:
    print(line, flush=True)


def _run_started(args: argparse.Namespace, workflow: dict, wf_path: Path, output_dir: Path) -> list[Path]:
    """Start ComfyUI in a temporary base directory (models: --models or synthetic), run the workflow, stop it."""
    if not args.comfyui:
        raise RunError("no ComfyUI: pass --comfyui PATH or set COMFYUI_PATH=/path/to/ComfyUI "
                       "(or --url for a running one)")
    base = Path(tempfile.mkdtemp(prefix="lowvram_dit_run_"))
    try:
        prepare_base_dir(base)
        cache_root = Path(os.environ.get("LOWVRAM_DIT_CACHE", Path.home() / ".cache" / "comfyui_lowvram_dit"))
        user_dir = (cache_root / "user").resolve()  # persistent, so the embedding cache survives runs
        user_dir.mkdir(parents=True, exist_ok=True)
        extra = ["--output-directory", str(output_dir), "--user-directory", str(user_dir)]
        models_dir = args.models
        if not args.models and not args.synthetic:  # (--synthetic full may name the folder with --models)
            _say("no --models given: using tiny synthetic models (--synthetic tiny)")
            args.synthetic = "tiny"
        if args.synthetic == "tiny" and (stock := stock_loaded_qwen_image_files(workflow)):
            raise RunError(f"--synthetic tiny cannot serve {', '.join(sorted(stock))} to a stock loader: ComfyUI builds "
                           "Qwen-Image at its full width, the tiny file is narrow (only the pack's Qwen-Image loaders "
                           "read widths from the file). Convert the workflow first (python -m comfyui_lowvram_dit "
                           "convert WORKFLOW.json) or give real files with --models")
        if args.synthetic == "tiny":
            for old, new in swap_tiny_vaes(workflow):
                _say(f"--synthetic tiny: VAE Loader {old} -> {new}, a tiny decoder of the same latents (ComfyUI "
                     "builds that VAE at full size, 1.4 GB even with random weights)")
        if args.synthetic:  # the files are written once ComfyUI is up and has every node the workflow needs
            models_dir = args.models or cache_root / "synthetic" / args.synthetic
            for folder in MODEL_FOLDERS:  # present at startup, so ComfyUI's file lists see files added later
                (models_dir / folder).mkdir(parents=True, exist_ok=True)
        ensure_input_images(workflow, base / "input", bool(args.synthetic), [wf_path.parent, Path.cwd()])
        if models_dir:
            yaml = extra_model_paths_yaml(models_dir.resolve(), base / "extra_model_paths.yaml")
            extra += ["--extra-model-paths-config", str(yaml)]
        python = args.python or sys.executable
        cpu = args.cpu or not _cuda_available(python)
        _say(f"starting ComfyUI from {args.comfyui}{' on the CPU' if cpu else ''} ...")
        extra += args.comfyui_args
        with start_comfyui(Path(args.comfyui), base, python=python, cpu=cpu, extra_args=extra,
                           progress=_say) as server:
            problems = pack_import_problems(server.log_text(), base / "custom_nodes" / REGISTRY_FOLDER_NAME)
            if problems:
                raise RunError(f"the pack failed to import in ComfyUI: {problems[0].strip()}")
            object_info = server.get("/object_info", timeout=120)
            check_node_types(server, workflow, object_info)
            if args.synthetic:
                write_synthetic_models(referenced_model_files(workflow), models_dir, args.synthetic,
                                       staged_text_encoder_files(workflow), vision_text_encoder_files(workflow))
            with MemoryWatch(server.process.pid) as watch:
                start = time.monotonic()
                files = run_workflow(server, workflow, args.overrides, output_dir, args.timeout,
                                     tiny=args.synthetic == "tiny", object_info=object_info)
                wall = time.monotonic() - start
            summary = watch.summary()
            _say("memory: " + ", ".join(f"{k}={v}" for k, v in summary.items() if k.startswith("peak")))
            if args.report:
                write_report(args.report, args, wall, summary, watch, server.log_text(), files)
        return files
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


def cli(argv: list[str]) -> int:
    """Entry point of ``python -m comfyui_lowvram_dit run``."""
    args = _parser().parse_args(argv)
    try:
        wf_path = resolve_workflow(args.workflow)
        workflow = json.loads(wf_path.read_text())
        output_dir = args.output.resolve()
        output_dir.mkdir(parents=True, exist_ok=True)
        if args.url:
            if args.synthetic or args.models:
                raise RunError("--synthetic and --models need a ComfyUI started by the runner; drop --url")
            files = run_workflow(ComfyServer(args.url.rstrip("/")), workflow, args.overrides, output_dir,
                                 args.timeout)
        else:
            files = _run_started(args, workflow, wf_path, output_dir)
    except RunError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for f in files:
        print(f"output: {f}")
    if not files:
        print("the workflow finished but wrote no output files")
    if args.synthetic:
        print(SYNTHETIC_NOTE)
    return 0
