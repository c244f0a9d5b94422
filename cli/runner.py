"""Run a workflow headless: ``python -m comfyui_lowvram_dit run WORKFLOW [options]``.

Starts ComfyUI from a checkout (or uses one already running), converts the UI-format workflow to API format with
comfy-cli against the server's own ``/object_info``, queues it, shows progress and prints where the outputs went.
``--synthetic tiny`` writes tiny random-weight models under the file names the workflow expects, so the whole path
runs on a fresh machine without downloads.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..checkpoints import safe_write
from ..doctor.checkout import POINT_AT, checkout_problem
from .inputs import check_number
from .memwatch import MemoryWatch
from .server import (
    MODEL_FOLDERS, ComfyServer, RunError, RunInputError, execution_error, pack_import_problems, prepare_base_dir,
)
from .workflow import (
    apply_overrides, ensure_input_images, is_api_workflow, missing_node_types, output_files, read_workflow,
    resolve_workflow, to_api, tiny_overrides,
)
from .workflow_models import (
    extra_model_paths_yaml, referenced_model_files, staged_text_encoder_files, stock_loaded_qwen_image_files,
    swap_tiny_vaes, vision_text_encoder_files, write_synthetic_models,
)

TIMEOUT_MAX_S = 1e9  # about 30 years: any finite wait the user means
SYNTHETIC_NOTE = ("note: the models were synthetic (random weights), so the output is noise from random weights, "
                  "not a picture; pass --models DIR with the real files for real output")


def check_node_types(server: ComfyServer, workflow: dict, object_info: dict) -> None:
    """RunError naming every node type the workflow uses that the server lacks, and the server's version."""
    missing = missing_node_types(workflow, object_info)
    if missing:
        version = server.get("/system_stats").get("system", {}).get("comfyui_version", "unknown version")
        raise RunError(f"this ComfyUI ({version}) has no node {', '.join(missing)}: the workflow needs a newer "
                       "ComfyUI or the custom nodes that provide it")


def run_workflow(server: ComfyServer, workflow: dict, overrides: list[str], output_dir: Path, timeout: float,
                 tiny: bool = False, object_info: dict | None = None) -> list[Path]:
    """Convert, queue and wait for one workflow (``tiny``: apply tiny_overrides first); returns the output files.

    ``object_info``: the server's /object_info when the caller already read it (a large reply)."""
    object_info = object_info if object_info is not None else server.object_info()
    check_node_types(server, workflow, object_info)
    api = workflow if is_api_workflow(workflow) else to_api(workflow, object_info)
    if tiny:
        auto = tiny_overrides(api)
        print(f"--synthetic tiny: {' '.join(auto) or 'no size/step overrides'}", flush=True)
        overrides = [*auto, *overrides]
    api = apply_overrides(api, overrides)
    prompt_id = server.queue(api)
    print(f"queued prompt {prompt_id}", flush=True)
    start = time.monotonic()
    last = [0.0]

    def tick() -> None:
        if time.monotonic() - last[0] > 10:
            last[0] = time.monotonic()
            print(f"  ... running ({time.monotonic() - start:.0f} s)", flush=True)

    entry = server.wait(prompt_id, timeout, tick)
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
        raise RunInputError("no ComfyUI: pass --comfyui PATH or set COMFYUI_PATH=/path/to/ComfyUI "
                            "(or --url for a running one)")
    if problem := checkout_problem(args.comfyui):
        raise RunInputError(f"--comfyui {args.comfyui}: {problem}; {POINT_AT}")
    if args.python and not shutil.which(args.python):
        raise RunInputError(f"--python {args.python}: no such program; give the Python that runs ComfyUI")
    base = Path(tempfile.mkdtemp(prefix="lowvram_dit_run_"))
    try:
        pack_dir = prepare_base_dir(base)
        cache_root = Path(os.environ.get("LOWVRAM_DIT_CACHE", Path.home() / ".cache" / "comfyui_lowvram_dit"))
        user_dir = (cache_root / "user").resolve()  # persistent, so the embedding cache survives runs
        user_dir.mkdir(parents=True, exist_ok=True)
        extra = ["--output-directory", str(output_dir), "--user-directory", str(user_dir)]
        models_dir = args.models
        if not args.models and not args.synthetic:  # (--synthetic full may name the folder with --models)
            _say("no --models given: using tiny synthetic models (--synthetic tiny)")
            args.synthetic = "tiny"
        if args.synthetic == "tiny" and (stock := stock_loaded_qwen_image_files(workflow)):
            raise RunInputError(f"--synthetic tiny cannot serve {', '.join(sorted(stock))} to a stock loader: "
                                "ComfyUI builds Qwen-Image at its full width, the tiny file is narrow (only the pack's "
                                "Qwen-Image loaders read widths from the file). Convert the workflow first (python -m "
                                "comfyui_lowvram_dit convert WORKFLOW.json) or give real files with --models")
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
        with ComfyServer.start(Path(args.comfyui), base, python=python, cpu=cpu, extra_args=extra, progress=_say,
                               pack_dir=pack_dir) as server:
            problems = pack_import_problems(server.log_text(), pack_dir)
            if problems:
                raise RunError(f"the pack failed to import in ComfyUI: {problems[0].strip()}")
            object_info = server.object_info()
            check_node_types(server, workflow, object_info)
            if args.synthetic:
                write_synthetic_models(referenced_model_files(workflow), models_dir, args.synthetic,
                                       staged_text_encoder_files(workflow), vision_text_encoder_files(workflow))
            with MemoryWatch(server.pid) as watch:
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
    """Entry point of ``python -m comfyui_lowvram_dit run`` (a failure raises RunError: cli/main.py prints it)."""
    args = _parser().parse_args(argv)
    check_number(args.timeout, "--timeout", 0.0, TIMEOUT_MAX_S, "the seconds to wait for the workflow")
    wf_path = resolve_workflow(args.workflow)
    workflow = read_workflow(wf_path)
    output_dir = args.output.resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    if args.url:
        server = ComfyServer(args.url)  # an http(s) URL or a RunInputError naming it
        if args.synthetic or args.models:
            raise RunInputError("--synthetic and --models need a ComfyUI started by the runner; drop --url")
        try:
            server.get("/system_stats", timeout=30)
        except RunError as exc:  # nothing listening, or not a ComfyUI: the URL given is wrong
            raise RunInputError(f"--url {args.url}: {exc}") from None
        files = run_workflow(server, workflow, args.overrides, output_dir, args.timeout)
    else:
        files = _run_started(args, workflow, wf_path, output_dir)
    for f in files:
        print(f"output: {f}")
    if not files:
        print("the workflow finished but wrote no output files")
    if args.synthetic:
        print(SYNTHETIC_NOTE)
    return 0
