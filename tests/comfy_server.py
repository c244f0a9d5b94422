"""A real ComfyUI server for integration tests: started headless on CPU, driven over HTTP.

How to run the integration tests (``comfyui`` marker)::

    pip install -e .                  # once, in the Python that runs pytest: the tests import the pack's nodes too
    COMFYUI_PATH=/path/to/ComfyUI python -m pytest tests -m comfyui

Anywhere else: ``COMFYUI_PATH`` = a ComfyUI >= 0.8.0 checkout (``git clone
https://github.com/comfyanonymous/ComfyUI``, its ``requirements.txt`` installed into the Python
that runs pytest, plus ``pip install -e .`` of this repo). ``COMFYUI_PYTHON`` picks another Python
for the server (default: the one running pytest). ``COMFYUI_GPU=1`` drops ``--cpu``;
``COMFYUI_EXTRA_ARGS`` is appended to the server's command line (shell syntax);
``COMFYUI_START_TIMEOUT`` (seconds, default 180) bounds the start.

Hermetic: ``--base-directory`` puts custom_nodes, models, input, output, temp and user in a temp
dir (the checkout stays untouched and no other installed pack loads: beside the pack, only the test nodes and,
where the server's Python has ``gguf``, the vendored ComfyUI-GGUF in tests/vendor), the database is in memory,
API nodes are off. Not covered by any flag: ComfyUI always reads ``<COMFYUI_PATH>/extra_model_paths.yaml``
if that file exists (a warning says so). The pack is linked as ``custom_nodes/comfyui-lowvram-dit``
(the Registry folder name) and, in a second import-only start (``--quick-test-for-ci``), under a
git/zip-style name with dots and capitals, because users get either. Running two copies in one
server would register every node id twice (the later silently wins), so that proves nothing.
A ``comfyui_lowvram_dit`` that raises ImportError shadows the editable install inside the server,
so an absolute self-import in the pack (which works only where the pack is pip-installed) fails
here as it would for users.

Identical prompts are served from ComfyUI's cache: vary an input (or a file name) per test.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from comfyui_lowvram_dit.benchmarks.server import gguf_custom_nodes
from comfyui_lowvram_dit.cli.server import (
    ComfyServer, comfyui_command, launch, pack_import_problems, prepare_base_dir, stop_process,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURE_NODES = Path(__file__).resolve().parent / "fixture_nodes"
PACK_FOLDER = "comfyui-lowvram-dit"  # [project].name: where Registry / Manager installs put the pack
# git clone / release-archive style (capitals, dots: ComfyUI maps "." to "_x_" in module names);
# only a name, it need not track the version.
ALT_PACK_FOLDER = "ComfyUI-LowVRAM-DiT-0.1.0"
FIXTURE_FOLDER = "zz_lowvram_dit_test_nodes"

SETUP_HINT = (
    "point COMFYUI_PATH at a ComfyUI >= 0.8.0 checkout whose requirements are installed in this Python, "
    "e.g. COMFYUI_PATH=/path/to/ComfyUI python -m pytest tests -m comfyui "
    "(elsewhere: git clone https://github.com/comfyanonymous/ComfyUI; pip install -r ComfyUI/requirements.txt; "
    "pip install -e <this repo>)"
)

_SHADOW_INIT = (
    "raise ImportError('the pack imported itself as comfyui_lowvram_dit; inside ComfyUI it lives in "
    "custom_nodes/<any folder>, so use relative imports (from .kernels import ...)')\n"
)


def comfyui_path_or_reason() -> tuple[Path | None, str]:
    """The ComfyUI checkout from ``COMFYUI_PATH``, or None and why integration tests must skip."""
    raw = os.environ.get("COMFYUI_PATH", "").strip()
    if not raw:
        return None, f"COMFYUI_PATH not set: {SETUP_HINT}"
    path = Path(raw).expanduser().resolve()
    if not (path / "main.py").is_file():
        return None, f"COMFYUI_PATH={raw} has no main.py: {SETUP_HINT}"
    return path, ""


def import_comfyui_in_process(comfy: Path) -> None:
    """Make ``comfy``/``comfy_api`` importable in this (test) process, on CPU, as in ComfyUI's own unit tests."""
    if str(comfy) not in sys.path:
        sys.path.append(str(comfy))  # appended: ComfyUI's top-level names (utils, app) must not shadow others
    from comfy.cli_args import args

    args.cpu = True  # before comfy.model_management is imported, else CUDA-less machines crash


def comfyui_in_process_or_skip() -> Path:
    """Skip the calling test (with the reason) without a usable ``COMFYUI_PATH``; else import ComfyUI here, on CPU."""
    import pytest

    comfy, reason = comfyui_path_or_reason()
    if comfy is None:
        pytest.skip(reason)
    import_comfyui_in_process(comfy)
    return comfy


def sample_wan(patcher: Any, seed: int = 0, steps: int = 2, cfg: float = 3.0, frames: int = 3) -> Any:
    """In-process KSampler path (``comfy.sample.sample``: wrappers, transformer_options, cond + uncond batched in
    one forward) on a tiny Wan latent [1, 16, frames, 8, 8] with random 12-token conditioning; returns the latent."""
    import comfy.sample
    import torch

    g = torch.Generator().manual_seed(seed)
    latent = torch.zeros(1, 16, frames, 8, 8)
    noise = torch.randn(latent.shape, generator=g)
    pos = [[torch.randn(1, 12, 4096, generator=g), {}]]
    neg = [[torch.randn(1, 12, 4096, generator=g), {}]]
    return comfy.sample.sample(patcher, noise, steps, cfg, "euler", "simple", pos, neg, latent, seed=seed,
                               disable_pbar=True)


def stock_conditioning(te: Path, clip_type: str, model_options: dict, prompts: list[str],
                       encode: Callable[[Any, str], list] | None = None) -> list[list]:
    """What CLIPLoader + CLIPTextEncode give for each prompt: ``comfy.sd.load_clip`` of ``te`` (``clip_type``: a
    ``comfy.sd.CLIPType`` name) with ``model_options``; ``encode(clip, prompt)`` stands in for another encode node
    (e.g. TextEncodeQwenImageEditPlus); the encoder is freed afterwards."""
    import comfy.model_management as mm
    import comfy.sd
    import torch

    with torch.inference_mode():
        clip = comfy.sd.load_clip([str(te)], clip_type=getattr(comfy.sd.CLIPType, clip_type),
                                  model_options=model_options)
        out = [clip.encode_from_tokens_scheduled(clip.tokenize(p)) if encode is None else encode(clip, p)
               for p in prompts]
    del clip
    mm.cleanup_models_gc()
    return out


def check_device_choices(monkeypatch: Any, execute: Callable[..., Any], calls: list, option: str) -> None:
    """A staged node's text encoder device choice, its stages planted (``execute(**{name: choice})`` records
    ``["files", device]`` in ``calls``): left out or auto = where ComfyUI runs text encoders, on a ComfyUI on a GPU
    and on one on the CPU only; cpu; gpu. An unknown choice, or gpu on a CPU-only ComfyUI, is a ValueError naming
    ``option`` ("<node>, <name>") raised before any file is read."""
    import comfy.model_management as mm
    import pytest
    import torch

    name = option.rsplit(", ", 1)[-1]
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    for where in (gpu, cpu):  # a ComfyUI on a GPU, then one on the CPU only
        monkeypatch.setattr(mm, "text_encoder_device", lambda where=where: where)
        monkeypatch.setattr(mm, "get_torch_device", lambda where=where: where)
        for choice, want in ((None, where), ("auto", where), ("cpu", cpu)) + ((("gpu", gpu),) if where == gpu else ()):
            calls.clear()
            execute(**({} if choice is None else {name: choice}))
            assert calls == ["files", want], (where, choice, calls)
    calls.clear()
    with pytest.raises(ValueError, match=re.escape(f"{option} = gpu, but ComfyUI runs on the CPU")):
        execute(**{name: "gpu"})
    with pytest.raises(ValueError, match=re.escape(f"{option}: 'tpu' is not one of ['auto', ")):
        execute(**{name: "tpu"})
    assert calls == []


def check_stage_1_devices(monkeypatch: Any, encode: Callable[[Any, Any], tuple[list, Any]], stage: str,
                          width: int) -> None:
    """``encode(device, target_device)`` (two prompts, the embedding cache on in a temp user directory) hands
    ``device`` to the streamed encoder (a spy records it and builds on this CPU), names it in the stage label
    ``stage 1 (<stage>, <device>)``, keys the embedding cache by its type (a GPU's kernels round differently from the
    CPU's) and returns the embeddings on the target; ``None``: the default, the compute device, which ``encode``
    points at the meta device."""
    import torch
    from comfyui_lowvram_dit.host import text_encoders

    real, seen = text_encoders.build_streaming, []

    def spy(enc, te_path, progress=None, device=text_encoders.CPU):  # noqa: ANN001, ANN202
        seen.append(device)
        return real(enc, te_path, progress)

    monkeypatch.setattr(text_encoders, "build_streaming", spy)
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    first, r1 = encode(gpu, cpu)
    assert seen == [gpu] and r1.name == f"stage 1 ({stage}, cuda:0)", (seen, r1.name)
    assert re.search(r"\b0 of 2 prompts from the embedding cache.*, encoder freed", "; ".join(r1.notes)), r1.notes
    _, r2 = encode(cpu, cpu)
    assert seen == [gpu, cpu] and r2.name == f"stage 1 ({stage}, cpu)", (seen, r2.name)
    assert re.search(r"\b0 of 2 prompts from the embedding cache", "; ".join(r2.notes)), r2.notes  # the CPU's own
    again, r3 = encode(gpu, None)
    assert seen == [gpu, cpu], seen
    assert re.search(r"\b2 of 2 prompts from the embedding cache.*, encoder not loaded", "; ".join(r3.notes)), r3.notes
    for (a, _), (b, extra) in ((x[0], y[0]) for x, y in zip(first, again, strict=True)):
        assert b.device.type == "meta" and b.shape == a.shape and a.shape[-1] == width
        assert all(v.device.type == "meta" for v in extra.values() if isinstance(v, torch.Tensor))


def check_gpu_refused_on_a_cpu_server(server: ComfyServer, graph: dict, node: str, option: str) -> None:
    """``graph`` with node ``node``'s text encoder device (``option``: "<display name>, <input>") set to gpu, run
    where ComfyUI runs on the CPU: an error naming the node, the option and the fix, before stage 1 runs."""
    import pytest

    if os.environ.get("COMFYUI_GPU") == "1":
        pytest.skip("the test server runs on the GPU here (COMFYUI_GPU=1): gpu is a valid choice")
    graph[node]["inputs"][option.rsplit(", ", 1)[-1]] = "gpu"
    before = len(server.log_text())
    with pytest.raises(AssertionError) as err:
        server.run(graph, timeout=300)
    assert f"{option} = gpu, but ComfyUI runs on the CPU here" in str(err.value), str(err.value)
    assert "pick auto or cpu" in str(err.value)
    assert "stage 1" not in server.log_text()[before:]


def loader_swap_nodes(unet: str, blocks_to_swap: int) -> dict:
    """API nodes "1" (Wan Loader, fp8 per-tensor) and "2" (Block Swap streaming ``blocks_to_swap`` blocks)."""
    return {
        "1": {"class_type": "LowVRAM_WanLoader", "inputs": {
            "unet_name": unet, "quantization": "fp8 per-tensor", "block_size": "128", "compute": "auto",
            "save_quantized": False}},
        "2": {"class_type": "LowVRAM_BlockSwap", "inputs": {
            "model": ["1", 0], "vram_budget_gb": 0.0, "blocks_to_swap": blocks_to_swap, "prefetch": 1,
            "pinned": True, "offload_embeddings": False, "debug": False, "dynamic_vram": "stream"}},
    }


def chain_nodes(loader: dict, chain: list[tuple[str, dict]]) -> dict:
    """API nodes: ``loader``, then each (class, inputs) of ``chain`` on the MODEL before it; the last MODEL is node
    "3", the one ``sample_nodes`` samples."""
    nodes = [loader] + [{"class_type": cls, "inputs": dict(inputs)} for cls, inputs in chain]
    ids = [f"m{i}" for i in range(len(nodes) - 1)] + ["3"]
    for i in range(1, len(nodes)):
        nodes[i]["inputs"]["model"] = [ids[i - 1], 0]
    return dict(zip(ids, nodes))


def sample_nodes(seed: int, steps: int, size: int, cond_length: int) -> dict:
    """API nodes "4"-"8": random cond/uncond (``cond_length`` tokens), a ``size``² x 5-frame Wan latent, KSampler
    (euler, cfg 3) on the MODEL of node "3", and the latent's stats (``LowVRAMTest_LatentStats``)."""
    def cond(seed: int) -> dict:
        return {"class_type": "LowVRAMTest_RandomConditioning",
                "inputs": {"seed": seed, "length": cond_length, "dim": 4096, "std": 1.0}}

    return {
        "4": cond(1),
        "5": cond(2),
        "6": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": size, "height": size, "length": 5,
                                                                   "batch_size": 1}},
        "7": {"class_type": "KSampler", "inputs": {
            "model": ["3", 0], "seed": seed, "steps": steps, "cfg": 3.0, "sampler_name": "euler",
            "scheduler": "simple", "positive": ["4", 0], "negative": ["5", 0], "latent_image": ["6", 0],
            "denoise": 1.0}},
        "8": {"class_type": "LowVRAMTest_LatentStats", "inputs": {"latent": ["7", 0]}},
    }


def pack_import_line_seen(log: str, pack_dir: Path) -> bool:
    """Whether ComfyUI's "Import times for custom nodes" list names ``pack_dir`` (it tried to load it)."""
    # 0.8 logs the bare line; newer ComfyUI prefixes a (coloured) level name.
    rx = re.compile(rf"(^|\s)[\d.]+ seconds( \(IMPORT FAILED\))?: {re.escape(str(pack_dir))}\s*$", re.M)
    return rx.search(log) is not None


def _prepare_base(base: Path, pack_folder: str, fixtures: dict[str, Path]) -> Path:
    """The base directory with the pack (and ``fixtures``: other custom node folders) linked and the self-import
    shadow; returns the pack link."""
    link = prepare_base_dir(base, pack_folder, fixtures)
    (base / "models" / "checkpoints").mkdir(exist_ok=True)
    shadow = base / "pythonpath_shadow" / "comfyui_lowvram_dit"
    shadow.mkdir(parents=True, exist_ok=True)
    (shadow / "__init__.py").write_text(_SHADOW_INIT)
    return link


def _server_env(base: Path) -> dict[str, str]:
    env = dict(os.environ)
    shadow = str(base / "pythonpath_shadow")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (shadow, env.get("PYTHONPATH", "")) if p)
    env.update(DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def _check_alt_folder(proc: Any, log_path: Path, pack_dir: Path, timeout: float) -> None:
    """Wait for the ``--quick-test-for-ci`` start and assert it imported the pack under the alt name."""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"--quick-test-for-ci start did not exit in {timeout:.0f} s") from None
    log = log_path.read_text(errors="replace")
    problems = pack_import_problems(log, pack_dir)
    if rc != 0 or problems or not pack_import_line_seen(log, pack_dir):
        raise AssertionError(f"the pack does not import from custom_nodes/{pack_dir.name} (rc={rc}): "
                             f"{problems or 'no import line for it'}\nlog tail:\n{log[-6000:]}")


@contextlib.contextmanager
def comfy_server_session(comfy: Path, base: Path, python: str | None = None,
                         gpu: bool | None = None) -> Iterator[ComfyServer]:
    """Start ComfyUI with the pack + fixture nodes (+ ComfyUI-GGUF) under ``base`` (and the alt-name import check).

    ``gpu``: True runs it on the GPU (no ``--cpu``), False on the CPU, None (default) as ``COMFYUI_GPU`` says."""
    python = python or os.environ.get("COMFYUI_PYTHON") or sys.executable
    timeout = float(os.environ.get("COMFYUI_START_TIMEOUT", "180"))
    cpu = not (os.environ.get("COMFYUI_GPU", "") in ("1", "true") if gpu is None else gpu)
    extra = shlex.split(os.environ.get("COMFYUI_EXTRA_ARGS", ""))
    if (comfy / "extra_model_paths.yaml").is_file():
        import warnings

        warnings.warn(f"{comfy / 'extra_model_paths.yaml'} adds model paths to the test server", stacklevel=2)
    pack_dir = _prepare_base(base / "main", PACK_FOLDER, {FIXTURE_FOLDER: FIXTURE_NODES, **gguf_custom_nodes(python)})
    alt_dir = _prepare_base(base / "alt", ALT_PACK_FOLDER, {})
    # Both starts run at once: the import check costs no extra wall time on 2+ cores.
    alt_log = base / "alt" / "comfyui.log"
    alt_proc = launch(comfyui_command(comfy, base / "alt", python, cpu, [*extra, "--quick-test-for-ci"]), comfy,
                      alt_log, _server_env(base / "alt"))
    try:
        with ComfyServer.start(comfy, base / "main", python=python, cpu=cpu, extra_args=extra, timeout=timeout,
                               env=_server_env(base / "main"), pack_dir=pack_dir, error=AssertionError) as server:
            problems = pack_import_problems(server.log_text(), pack_dir)
            if problems or not pack_import_line_seen(server.log_text(), pack_dir):
                raise AssertionError(f"ComfyUI did not import the pack from {pack_dir}: "
                                     f"{problems or 'no import line for it'}\nlog tail:\n{server.log_tail()}")
            _check_alt_folder(alt_proc, alt_log, alt_dir, timeout)
            yield server
    finally:
        stop_process(alt_proc)
