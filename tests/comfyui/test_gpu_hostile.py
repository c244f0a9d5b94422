"""Hostile inputs on the GPU paths a CPU run cannot reach.

Every case must end in a clear error or a correct result; the process (or server) must survive, and nothing may stay
allocated or pinned. Each case records the memory it found before and after (torch allocated / reserved, the bytes
Block Swap's arenas hold in ComfyUI's pinned-memory account, the RSS), what happened and the messages it saw, in
``RECORD``; the report is rewritten after every case to ``$GPU_HOSTILE_REPORT.json`` / ``.md`` (kernels.safe_write;
nothing is written when the variable is unset), so a run cut short still leaves what it measured.

In this process (ComfyUI imported from ``COMFYUI_PATH`` on the GPU, ``comfy.sample`` as KSampler calls it):
1. Block Swap with hostile settings: a budget far below one block, more blocks_to_swap than blocks, prefetch larger
   than the ring -> the same output as unswapped; ring freed and arena unpinned after the unload.
2. fp8 GEMMs with inf/NaN activations (every fp8 path, and a latent holding NaN/inf under NaN Guard) and with weight
   files holding NaN/inf (bf16 weights quantized at load, and a pre-quantized file with a NaN scale) -> non-finite
   output that NaN Guard names, or a clear error naming the file; the next normal run in the process still works.
3. LoRA merged into Block Swap's arena: a LoRA of another model size, one holding NaN, one with alpha 1e30 ->
   ComfyUI's warning/skip, NaN Guard naming the block or a clear error; afterwards the plain model's output is
   bit-identical to its output before any LoRA (arena restored exactly).
4. "lowvram 8-bit" attention with NaN/inf in q or k (the kernel directly, and inside a model under NaN Guard) ->
   non-finite output where exact attention has it (never silently finite) or a clear error; the next call is correct.
In ComfyUI servers of their own (tests/comfy_server.py, on the GPU):
5. A mapped, pre-quantized fp8 file truncated in place while the server samples -> a clear error naming the file and
   a server that still answers; once with the model resident in VRAM (default flags) and once with ``--novram``
   (weights kept in host memory and read on every call: the pack reads the file into memory there instead of
   mapping it). A dead server (SIGBUS) fails the case and the report says so.
6. /interrupt in the middle of a Block Swap sampling run -> the server survives, the next prompt succeeds, and after
   /free nothing of the model stays allocated or pinned.
7. 20 prompts switching between two models (as tests/test_gpu_leak.py) -> no growth of VRAM, pinned memory or RSS.

The server cases need ComfyUI's server dependencies (aiohttp, SQLAlchemy, alembic, pydantic) in the Python that runs
pytest; without them the server does not start and those cases error at setup.

Wan 2.2 14B blocks at full width (351 M params each: a leaked block or ring is hundreds of MB), 2-3 blocks per file.
About 6-8 minutes on one H100 / H200:

    GPU_HOSTILE_REPORT=/tmp/gpu_hostile COMFYUI_PATH=<ComfyUI> python -m pytest tests/test_gpu_hostile.py -q -s
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import re
import shutil
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from comfy_server import ComfyServer, comfy_server_session, comfyui_path_or_reason, loader_swap_nodes, sample_nodes

from comfyui_lowvram_dit.cli.memwatch import proc_status
from comfyui_lowvram_dit.cli.server import execution_error

pytestmark = [pytest.mark.cuda, pytest.mark.comfyui]

MODEL = "wan22_t2v_14B"
LAYERS = 3  # in-process model and the server's switch models
POISON_LAYERS = 2  # files with NaN / inf weights
MiB = 2**20
GiB = 2**30
# After a case, with every model unloaded: what may remain beyond the "before" measurement (cuBLAS workspaces,
# Triton autotune buffers, the 8-bit attention's cached rotations; one 14B block in fp8 is 351 MB).
TOL_ALLOCATED = 128 * MiB
TOL_PINNED = 16 * MiB  # Block Swap arenas are counted exactly; the Doctor prints GiB with 2 decimals
TOL_RSS_SERVER = 1 * GiB  # glibc arenas keep freed memory (tests/test_gpu_leak.py)
FP8_REL = 0.02  # relative difference accepted as "the same output" where a requantization may round
INT8_REL = 0.08  # kernels/attention.py QUANTIZED_TOLERANCE

RECORD: list[dict[str, Any]] = []
_ENV: dict[str, Any] = {}


# ----------------------------------------------------------------------------------------------------------
# the report


def _fmt_bytes(v: Any) -> str:
    return "-" if not isinstance(v, (int, float)) else f"{v / MiB:.0f}"


MEM_KEYS = ("torch_allocated", "torch_reserved", "pinned_pack", "pinned_comfy", "rss", "rss_anon")


def _markdown() -> str:
    lines = ["# GPU hostile inputs", "",
             f"{_ENV.get('gpu', '?')}; torch {_ENV.get('torch', '?')}; ComfyUI {_ENV.get('comfyui', '?')}; "
             f"`tests/test_gpu_hostile.py`; synthetic {MODEL} at full width, {LAYERS} blocks "
             f"({POISON_LAYERS} in the poisoned files).", "",
             "Memory in MiB, before -> after the case (after = models unloaded). In-process cases: torch allocated / "
             "reserved of the test process, `pinned_pack` = Block Swap arenas counted in ComfyUI's pinned account, "
             "`pinned_comfy` = that whole account, RSS of the test process. Server cases: the server's torch "
             "active / reserved (/system_stats), the Doctor node's pinned lines, the server's RSS (/proc).", "",
             "| case | what | run | result | " + " | ".join(MEM_KEYS) + " |",
             "|---|---|---|---|" + "---|" * len(MEM_KEYS)]
    for e in RECORD:
        before, after = e.get("before") or {}, e.get("after") or {}
        mem = " | ".join(f"{_fmt_bytes(before.get(k))} -> {_fmt_bytes(after.get(k))}" for k in MEM_KEYS)
        verdict = "PASS" if e.get("passed") else ("FAIL" if e.get("passed") is False else "incomplete")
        lines.append(f"| {e['case']} | {e['what']} | {e.get('run') or '-'} | {verdict} | {mem} |")
    lines += ["", "## What happened", ""]
    for e in RECORD:
        verdict = "PASS" if e.get("passed") else "FAIL"
        lines.append(f"### {e['case']}: {e['what']} ({verdict})")
        lines.append("")
        for ev in e.get("events", []):
            lines.append(f"- {ev}")
        for p in e.get("problems", []):
            lines.append(f"- **problem:** {p}")
        if e.get("series"):
            keys = ("torch_allocated", "torch_reserved", "rss_anon", "pinned_comfy", "pinned_pack")
            lines += ["", "| run | s | " + " | ".join(keys) + " (MiB) |", "|---|---|" + "---|" * len(keys)]
            for i, m in enumerate(e["series"], 1):
                lines.append(f"| {i} | {m.get('secs')} | " + " | ".join(_fmt_bytes(m.get(k)) for k in keys) + " |")
            lines.append("")
        if e.get("messages"):
            lines.append("- messages seen:")
            for m in e["messages"][:12]:
                lines.append(f"  - `{m[:400]}`")
        lines.append("")
    return "\n".join(lines) + "\n"


def _write_report() -> None:
    dest = os.environ.get("GPU_HOSTILE_REPORT", "").strip()
    if not dest:
        return
    from comfyui_lowvram_dit.benchmarks.report import public_text
    from comfyui_lowvram_dit.checkpoints.safe_write import write_report

    base = Path(dest)
    base.parent.mkdir(parents=True, exist_ok=True)
    payload = {"report": "gpu_hostile", "environment": _ENV, "cases": RECORD}
    # no path of the machine that ran it (ComfyUI's folder, pytest's temporary folders, home)
    write_report(base.with_name(base.name + ".json"), public_text(json.dumps(payload, indent=1, default=str)))
    write_report(base.with_name(base.name + ".md"), public_text(_markdown()))


class _Messages(logging.Handler):
    """Warnings of any logger and the pack's info lines, while a case runs."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING or record.name.startswith("comfyui_lowvram_dit"):
            self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}"[:2000])


@contextlib.contextmanager
def recorded(case: str, what: str, measure: Callable[[], dict], settle: Callable[[], None]) -> Iterator[dict]:
    """One RECORD entry: memory before, events / problems the body adds, memory after ``settle()``."""
    entry: dict[str, Any] = {"case": case, "what": what, "events": [], "problems": [], "messages": [],
                             "passed": None, "run": os.environ.get("GPU_HOSTILE_RUN", "")}
    handler = _Messages()
    pack_log = logging.getLogger("comfyui_lowvram_dit")
    old_level = pack_log.level
    pack_log.setLevel(logging.INFO)
    logging.getLogger().addHandler(handler)
    t0 = time.monotonic()
    try:
        entry["before"] = measure()
    except Exception as exc:  # noqa: BLE001 - a measurement must not hide the case
        entry["before"] = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        yield entry
    except BaseException as exc:
        entry["problems"].append(f"the test raised {type(exc).__name__}: {str(exc)[:1500]}")
        raise
    finally:
        logging.getLogger().removeHandler(handler)
        pack_log.setLevel(old_level)
        entry["messages"] += handler.lines[-40:]
        try:
            settle()
            entry["after"] = measure()
        except Exception as exc:  # noqa: BLE001
            entry["after"] = {"error": f"{type(exc).__name__}: {exc}"}
            entry["problems"].append(f"measuring after the case failed: {type(exc).__name__}: {exc}")
        entry["seconds"] = round(time.monotonic() - t0, 1)
        entry["passed"] = not entry["problems"]
        RECORD.append(entry)
        _write_report()


def _leaks(entry: dict, keys_tol: dict[str, int]) -> None:
    """Add a problem for every measurement that grew more than its tolerance from before to after."""
    before, after = entry.get("before") or {}, entry.get("after") or {}
    for key, tol in keys_tol.items():
        b, a = before.get(key), after.get(key)
        if isinstance(b, (int, float)) and isinstance(a, (int, float)) and a - b > tol:
            entry["problems"].append(f"{key} grew {(a - b) / MiB:+.0f} MiB over the case (tolerance "
                                     f"{tol / MiB:.0f} MiB)")
    entry["passed"] = not entry["problems"]


def _verdict(entry: dict) -> None:
    """Fail the test with the entry's problems (the entry is already in RECORD and the report)."""
    _write_report()
    assert not entry["problems"], f"{entry['case']}: " + "; ".join(entry["problems"])


@pytest.fixture(scope="module", autouse=True)
def _final_report() -> Iterator[None]:
    yield
    _write_report()


# ----------------------------------------------------------------------------------------------------------
# in-process ComfyUI on the GPU


@pytest.fixture(scope="module")
def comfy_gpu() -> Iterator[Any]:
    """``comfy.model_management`` of ComfyUI imported here, on the GPU."""
    comfy, reason = comfyui_path_or_reason()
    if comfy is None:
        pytest.skip(reason)
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import comfy_native

    comfy_native.import_comfy(cpu=False)
    import comfy.model_management as mm

    if mm.get_torch_device().type != "cuda":
        pytest.skip(f"ComfyUI picked {mm.get_torch_device()}, not a CUDA device")
    version = (comfy / "comfyui_version.py").read_text().split('"')[1] \
        if (comfy / "comfyui_version.py").exists() else "?"
    _ENV.update(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, comfyui=version,
                cuda=torch.version.cuda)
    yield mm
    mm.unload_all_models()
    mm.soft_empty_cache(True)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("gpu_hostile")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def base_file(comfy_gpu: Any, work: Path) -> Path:
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    return synth.write_synthetic(MODEL, work / "hostile_base.safetensors", size="full", fmt="bf16", seed=0,
                                 device="cuda", num_layers=LAYERS)


def _here() -> dict[str, Any]:
    """This process: torch allocator, the pack's pinned arenas, ComfyUI's pinned account, RSS."""
    import comfy.model_management as mm
    import torch

    from comfyui_lowvram_dit.offload import host_memory
    from comfyui_lowvram_dit.host.pin_budget import pinned_by_pack

    st = proc_status(os.getpid())
    return {"torch_allocated": torch.cuda.memory_allocated(), "torch_reserved": torch.cuda.memory_reserved(),
            "pinned_pack": pinned_by_pack(), "pinned_comfy": int(getattr(mm, "TOTAL_PINNED_MEMORY", 0) or 0),
            "unfreed_arenas": len(host_memory._UNFREED), "rss": st.get("VmRSS"), "rss_anon": st.get("RssAnon")}


def _settle_here() -> None:
    import comfy.model_management as mm
    import torch

    mm.unload_all_models()
    gc.collect()
    torch.cuda.synchronize()
    mm.soft_empty_cache(True)


@contextlib.contextmanager
def case_here(case: str, what: str) -> Iterator[dict]:
    with recorded(case, what, _here, _settle_here) as entry:
        yield entry
    _leaks(entry, {"torch_allocated": TOL_ALLOCATED, "pinned_pack": 0, "pinned_comfy": TOL_PINNED,
                   "unfreed_arenas": 0})


def _fp8(path: Path) -> Any:
    from comfyui_lowvram_dit.host.wan_loader import load_wan_model

    return load_wan_model(path, "per_tensor", 128, "auto")


def _sample(model: Any, seed: int = 0, steps: int = 2, frames: int = 3, latent_value: float | None = None) -> Any:
    """KSampler's path (comfy.sample.sample, euler, cfg 3) on a [1, 16, frames, 8, 8] Wan latent; the result on the
    CPU in fp32. ``latent_value`` is written into one latent element (NaN / inf)."""
    import comfy.sample
    import torch

    g = torch.Generator().manual_seed(seed)
    latent = torch.zeros(1, 16, frames, 8, 8)
    noise = torch.randn(latent.shape, generator=g)
    pos = [[torch.randn(1, 12, 4096, generator=g) * 0.2, {}]]
    neg = [[torch.randn(1, 12, 4096, generator=g) * 0.2, {}]]
    if latent_value is not None:
        latent[0, 3, 1, 4, 4] = latent_value
    out = comfy.sample.sample(model, noise, steps, 3.0, "euler", "simple", pos, neg, latent, seed=seed,
                              disable_pbar=True)
    return out.float().cpu()


def _rel(a: Any, b: Any) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _finite(t: Any) -> bool:
    import torch

    return bool(torch.isfinite(t).all())


def _cuda_still_works() -> str | None:
    """None when a small kernel and a sync still work in this process, else the error (a poisoned context)."""
    import torch

    try:
        x = torch.arange(1024, device="cuda", dtype=torch.float32)
        ok = float((x * 2).sum().item()) == 1024 * 1023
        torch.cuda.synchronize()
        return None if ok else "a small kernel gave a wrong sum"
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"


# ----------------------------------------------------------------------------------------------------------
# 1. Block Swap with hostile settings


SWAP_SETTINGS = {
    "budget far below one block (vram_budget_gb=0.05)": dict(vram_budget_gb=0.05),
    "more blocks_to_swap than blocks (50 of 3)": dict(blocks_to_swap=50),
    "prefetch larger than the ring (prefetch 3, 1 block streamed)": dict(blocks_to_swap=1, prefetch=3),
    "budget 0.05 GB with prefetch 3, unpinned": dict(vram_budget_gb=0.05, prefetch=3, pinned=False),
}


@pytest.fixture(scope="module")
def unswapped_ref(comfy_gpu: Any, base_file: Path) -> Any:
    model = _fp8(base_file)
    ref = _sample(model, seed=11)
    comfy_gpu.unload_all_models()
    del model
    gc.collect()
    return ref


@pytest.mark.parametrize("label", list(SWAP_SETTINGS))
def test_1_block_swap_hostile_settings(comfy_gpu: Any, base_file: Path, unswapped_ref: Any, label: str) -> None:
    from comfyui_lowvram_dit.offload.plan import SwapConfig
    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY, apply_block_swap

    with case_here("1 Block Swap", label) as entry:
        try:
            config = SwapConfig(**SWAP_SETTINGS[label])
        except ValueError as exc:
            entry["events"].append(f"refused by SwapConfig: {exc}")
            config = None
        if config is not None:
            swapped = apply_block_swap(_fp8(base_file), config)
            ctl = swapped.attachments[SWAP_KEY]
            try:
                out = _sample(swapped, seed=11)
            except Exception as exc:  # noqa: BLE001 - a clear error is an accepted outcome; its text is recorded
                entry["events"].append(f"sampling raised {type(exc).__name__}: {exc}")
                if "Block Swap" not in str(exc) and "blocks_to_swap" not in str(exc):
                    entry["problems"].append("the error does not name Block Swap or its setting")
            else:
                plan, st = ctl.plan, ctl.streamer
                entry["events"].append(
                    f"plan: {len(plan.streamed)} of {plan.num_blocks} blocks streamed {list(plan.streamed)}, ring "
                    f"{plan.ring} x {plan.slot_bytes / MiB:.0f} MiB; arena pinned: "
                    f"{st is not None and st.arena is not None and st.arena.pinned}; on-demand loads "
                    f"{st.stats.on_demand if st is not None else '-'}")
                if SWAP_SETTINGS[label].get("vram_budget_gb") and len(plan.streamed) < plan.num_blocks:
                    entry["events"].append("(the budget fits some blocks here: not the hostile case this GPU "
                                           "run is meant to be)")
                same = bool(out.equal(unswapped_ref))
                rel = _rel(out, unswapped_ref)
                entry["events"].append(f"output vs unswapped: {'bit-identical' if same else f'rel diff {rel:.2e}'}")
                if not _finite(out) or rel > FP8_REL:
                    entry["problems"].append(f"output differs from unswapped (rel {rel:.3e}, finite {_finite(out)})")
            entry["during"] = during = _here()
            entry["events"].append(f"while loaded: torch allocated {during['torch_allocated'] / MiB:.0f} MiB, Block Swap "
                                   f"arena pinned {during['pinned_pack'] / MiB:.0f} MiB")
            comfy_gpu.unload_all_models()
            if ctl.active:
                entry["problems"].append("the ring is still active after unload_all_models")
            if ctl.streamer is not None and ctl.streamer.arena is not None and ctl.streamer.arena.pinned:
                entry["problems"].append("the arena is still pinned after unload_all_models")
            del swapped, ctl
    _verdict(entry)


# ----------------------------------------------------------------------------------------------------------
# 2. fp8 GEMMs with non-finite activations and weights


def _poison_file(path: Path, tensor_suffix: str, value: float) -> str:
    """Write ``value`` into the first (up to 8) elements of the tensor named ``*tensor_suffix`` of a safetensors
    file, in place; returns the tensor's full name."""
    with open(path, "r+b") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(hlen))
        name = next(k for k in header if k != "__metadata__" and k.endswith(tensor_suffix))
        info = header[name]
        if info["dtype"] == "BF16":
            one = struct.pack("<f", value)[2:]  # bf16 = the high half of the fp32 bits
        elif info["dtype"] == "F32":
            one = struct.pack("<f", value)
        else:
            raise ValueError(f"{name}: dtype {info['dtype']} not handled")
        lo, hi = info["data_offsets"]
        count = min(8, (hi - lo) // len(one))
        f.seek(8 + hlen + lo)
        f.write(one * count)
    return name


FP8_ROWS = {"nan": (0, 3), "inf": (0, 10), "-inf": (1, 5)}  # (sample, token) of each poisoned activation


def _fp8_paths(entry: dict) -> None:
    import torch

    from comfyui_lowvram_dit.kernels import fp8

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(5120, 5120, device="cuda", generator=g, dtype=torch.float32) * 0.02
    bias = torch.randn(5120, device="cuda", generator=g) * 0.01
    x = torch.randn(2, 64, 5120, device="cuda", generator=g).to(torch.bfloat16)
    bad = x.clone()
    for key, (s, tok) in FP8_ROWS.items():
        bad[s, tok, 7] = float(key)
    paths = [("scaled_mm_rowwise", None), ("scaled_mm_tensorwise", None), ("dequantize", None),
             ("scaled_mm_blockwise", 128), ("dequantize", 128)]
    for path, bs in paths:
        label = f"{path}{'' if bs is None else f' (block-wise {bs})'}"
        q, scale = fp8.quantize_per_tensor(w) if bs is None else fp8.quantize_blockwise(w, bs)
        try:
            clean = fp8.fp8_linear(x, q, scale, bias, block_size=bs, path=path)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a path this GPU lacks
            entry["events"].append(f"{label}: not available here ({type(exc).__name__}: {str(exc)[:200]})")
            continue
        try:
            out = fp8.fp8_linear(bad, q, scale, bias, block_size=bs, path=path)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001
            entry["events"].append(f"{label}: raised {type(exc).__name__}: {str(exc)[:300]}")
            out = None
        if out is not None:
            finite_rows = torch.isfinite(out).all(dim=-1).cpu()
            silent = [k for k, (s, tok) in FP8_ROWS.items() if bool(finite_rows[s, tok])]
            clean_rows = torch.ones(2, 64, dtype=torch.bool)
            for s, tok in FP8_ROWS.values():
                clean_rows[s, tok] = False
            other = out[clean_rows.cuda()]
            same_other = bool(torch.equal(other, clean[clean_rows.cuda()]))
            n_bad = int((~torch.isfinite(out).all(dim=-1)).sum())
            entry["events"].append(f"{label}: {n_bad} of 128 token rows non-finite; rows with a non-finite "
                                   f"input that came out finite: {silent or 'none'}; clean rows "
                                   f"{'identical to the clean call' if same_other else 'changed'}")
            if silent:
                entry["problems"].append(f"{label}: a {'/'.join(silent)} activation gave a finite output row "
                                         "(the bad value vanished silently)")
            if path in ("scaled_mm_rowwise", "scaled_mm_blockwise") and not same_other:
                entry["problems"].append(f"{label}: per-token path, yet rows without a bad value changed")
        err = _cuda_still_works()
        again = fp8.fp8_linear(x, q, scale, bias, block_size=bs, path=path)
        torch.cuda.synchronize()
        if err or not torch.equal(again, clean):
            entry["problems"].append(f"{label}: after the bad call the process is not healthy ({err}) or a clean "
                                     "call changed")


def test_2a_fp8_linear_with_non_finite_activations(comfy_gpu: Any) -> None:
    """Every fp8 GEMM path with one NaN, one inf and one -inf token: those tokens' outputs must be non-finite (never
    silently finite), the others as in a clean call on per-token paths; then a clean call must still work."""
    with case_here("2 fp8 GEMMs", "fp8_linear, every path, NaN/inf activations") as entry:
        _fp8_paths(entry)  # its tensors are freed before the "after" measurement
    _verdict(entry)


def _check_normal_run(entry: dict, model: Callable[[], Any], unswapped_ref: Any, what: str) -> None:
    """After a hostile case: CUDA still works, then ``model()`` samples bit-identically to the reference."""
    err = _cuda_still_works()
    out = _sample(model(), seed=11)
    if err or not out.equal(unswapped_ref):
        entry["problems"].append(f"{what} is not correct (CUDA: {err}, rel {_rel(out, unswapped_ref):.2e})")
    else:
        entry["events"].append(f"{what} in this process: bit-identical to the reference")


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_2b_non_finite_latent_through_fp8_model_under_nan_guard(comfy_gpu: Any, base_file: Path, unswapped_ref: Any,
                                                                value: str) -> None:
    from comfyui_lowvram_dit.kernels.nan_guard import NonFiniteError
    from comfyui_lowvram_dit.host.nan_guard import apply_nan_guard

    with case_here("2 fp8 GEMMs", f"latent holding {value}, fp8 model + NaN Guard (raise)") as entry:
        model = _fp8(base_file)
        guarded = apply_nan_guard(model, "raise")
        try:
            out = _sample(guarded, seed=11, latent_value=float(value))
            entry["events"].append(f"sampling finished; output finite: {_finite(out)}")
            entry["problems"].append("NaN Guard (raise) did not stop a run whose latent held " + value)
        except NonFiniteError as exc:
            entry["events"].append(f"NaN Guard: {exc}")
            if "blocks.0" not in str(exc) and "input" not in str(exc):
                entry["problems"].append("the guard's message does not name the input / block")
        except Exception as exc:  # noqa: BLE001
            entry["problems"].append(f"not NaN Guard's error but {type(exc).__name__}: {str(exc)[:500]}")
        _check_normal_run(entry, lambda m=model: m, unswapped_ref, "the next normal run")
        del model, guarded
    _verdict(entry)


POISONED_WEIGHTS = {
    "bf16 file, NaN in blocks.1.ffn.0.weight (quantized at load)": ("bf16", "blocks.1.ffn.0.weight", math.nan),
    "bf16 file, inf in blocks.0.self_attn.q.weight (quantized at load)": ("bf16", "blocks.0.self_attn.q.weight",
                                                                          math.inf),
    "fp8_scaled file, NaN scale_weight of blocks.1.ffn.2 (mapped)": ("fp8_scaled", "blocks.1.ffn.2.scale_weight",
                                                                    math.nan),
}


@pytest.mark.parametrize("label", list(POISONED_WEIGHTS))
def test_2c_weight_file_with_non_finite_values(comfy_gpu: Any, base_file: Path, unswapped_ref: Any, work: Path,
                                               label: str) -> None:
    from comfyui_lowvram_dit.kernels.nan_guard import NonFiniteError
    from comfyui_lowvram_dit.host.nan_guard import apply_nan_guard
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    fmt, suffix, value = POISONED_WEIGHTS[label]
    with case_here("2 fp8 GEMMs", label) as entry:
        path = synth.write_synthetic(MODEL, work / f"poison_{uuid.uuid4().hex[:6]}.safetensors", size="full",
                                     fmt=fmt, seed=3, device="cuda", num_layers=POISON_LAYERS)
        name = _poison_file(path, suffix, value)
        block = re.search(r"blocks\.(\d+)\.", name).group(1)
        entry["events"].append(f"{path.name}: 8 values of {name} set to {value}")
        try:
            model = _fp8(path)
        except Exception as exc:  # noqa: BLE001 - a clear error at load is an accepted outcome
            entry["events"].append(f"Wan Loader raised {type(exc).__name__}: {exc}")
            if path.name not in str(exc):
                entry["problems"].append("the loader's error does not name the file")
            if name not in str(exc):
                entry["problems"].append(f"the loader's error does not name {name}")
            model = None
        if model is not None:
            layer = model.model.diffusion_model.get_submodule(name[:-len(".weight")])
            codes, scale = layer.weight.float(), getattr(layer, "weight_scale", None)
            entry["events"].append(f"after load: {name} is {layer.weight.dtype}, {int((~codes.isfinite()).sum())} "
                                   f"non-finite codes, |code| max {float(codes.nan_to_num(0).abs().amax()):.4g}, "
                                   f"weight_scale {None if scale is None else scale.flatten()[:1].tolist()}")
            del codes
            try:
                out = _sample(apply_nan_guard(model, "raise"), seed=5)
                entry["events"].append(f"loaded and sampled; output finite: {_finite(out)}")
                entry["problems"].append("neither the loader nor NaN Guard (raise) stopped a model with "
                                         f"{value} weights")
            except NonFiniteError as exc:
                entry["events"].append(f"loaded; NaN Guard: {exc}")
                if f"blocks.{block}" not in str(exc):
                    entry["problems"].append(f"the guard does not name blocks.{block}, whose weight is {value}")
            except Exception as exc:  # noqa: BLE001
                entry["problems"].append(f"sampling raised {type(exc).__name__}: {str(exc)[:500]}")
            del model
        comfy_gpu.unload_all_models()
        _check_normal_run(entry, lambda: _fp8(base_file), unswapped_ref, "a normal run afterwards")
        path.unlink(missing_ok=True)
    _verdict(entry)


# ----------------------------------------------------------------------------------------------------------
# 3. LoRA merged into Block Swap's arena


def _lora(kind: str, streamed: list[int]) -> tuple[dict, str]:
    """A rank-4 LoRA on every Linear of the model's blocks (or, "wrong shapes", of a Wan 2.1 1.3B of the same
    depth: same key names, other widths) and the block it poisons (the last streamed one)."""
    import torch

    from comfyui_lowvram_dit.synthetic.specs import model_spec
    from comfyui_lowvram_dit.synthetic.lora import LORA_ALPHA

    rank = 4
    size_model = "wan21_t2v_1_3B" if kind == "wrong shapes" else MODEL
    g = torch.Generator().manual_seed(7)
    sd: dict[str, Any] = {}
    for name, shape, _ in model_spec(size_model, "full", LAYERS):
        if not (name.startswith("blocks.") and name.endswith(".weight") and len(shape) == 2):
            continue
        key = f"diffusion_model.{name[:-len('.weight')]}"
        sd[f"{key}.lora_down.weight"] = torch.randn(rank, int(shape[1]), generator=g) * 0.01
        sd[f"{key}.lora_up.weight"] = torch.randn(int(shape[0]), rank, generator=g) * 0.01
        sd[f"{key}.alpha"] = torch.tensor(LORA_ALPHA)
    target = streamed[-1]
    poisoned = f"diffusion_model.blocks.{target}.ffn.0"
    if kind == "NaN":
        sd[f"{poisoned}.lora_up.weight"][0, 0] = math.nan
    elif kind == "alpha 1e30":
        sd[f"{poisoned}.alpha"] = torch.tensor(1e30)
    return sd, f"blocks.{target}"


@pytest.mark.parametrize("kind", ["wrong shapes", "NaN", "alpha 1e30"])
def test_3_lora_merged_into_the_arena(comfy_gpu: Any, base_file: Path, kind: str) -> None:
    import comfy.sd

    from comfyui_lowvram_dit.kernels.nan_guard import NonFiniteError
    from comfyui_lowvram_dit.offload.plan import SwapConfig, streamed_block_indices
    from comfyui_lowvram_dit.host.block_swap import SWAP_KEY, apply_block_swap
    from comfyui_lowvram_dit.host.nan_guard import apply_nan_guard

    with case_here("3 LoRA into the arena", f"LoRA with {kind}, Block Swap 2 of {LAYERS} blocks") as entry:
        swapped = apply_block_swap(_fp8(base_file), SwapConfig(blocks_to_swap=2, prefetch=1))
        ctl = swapped.attachments[SWAP_KEY]
        ref = _sample(swapped, seed=21)
        streamed = streamed_block_indices(LAYERS, 2)
        lora, where = _lora(kind, streamed)
        patched = comfy.sd.load_lora_for_models(swapped, None, lora, 1.0, 0.0)[0]
        entry["events"].append(f"{len(patched.patches)} weight patches added by ComfyUI's LoRA loader; streamed "
                               f"blocks {streamed}; poisoned {where}")
        merges = ctl.lora.merges
        try:
            out = _sample(apply_nan_guard(patched, "raise"), seed=21)
            import comfy.utils

            merged = comfy.utils.get_attr(patched.model, f"diffusion_model.{where}.ffn.0.weight")
            entry["events"].append(f"the merged {where}.ffn.0.weight ({merged.device}, {merged.dtype}): "
                                   f"{int((~merged.float().isfinite()).sum())} non-finite codes, |code| max "
                                   f"{float(merged.float().nan_to_num(0).abs().amax()):.4g}")
            rel = _rel(out, ref)
            entry["events"].append(f"sampled with the LoRA: output finite {_finite(out)}, rel diff to no LoRA "
                                   f"{rel:.3e}; {ctl.lora.merges - merges} weights merged into the arena")
            warned = [m for m in entry_messages(entry) if m.split(" ", 1)[0] in ("WARNING", "ERROR", "CRITICAL")
                      and ("lora" in m.lower() or "shape" in m.lower())]
            if kind == "wrong shapes":
                if not warned:
                    entry["problems"].append("a LoRA of another model size was applied without a warning")
                if rel > FP8_REL:
                    entry["problems"].append(f"skipped patches changed the output by {rel:.3e}")
            elif kind == "alpha 1e30" and any("clipped" in m and "alpha/strength" in m for m in warned):
                entry["events"].append("warned: " + next(m for m in warned if "clipped" in m)[:400])
            else:
                entry["problems"].append(f"a LoRA with {kind} sampled to a {'finite' if _finite(out) else 'non-finite'}"
                                         " result with neither an error, a clipping warning nor NaN Guard naming the "
                                         "block")
        except NonFiniteError as exc:
            entry["events"].append(f"NaN Guard: {exc}")
            if kind != "wrong shapes" and where not in str(exc):
                entry["problems"].append(f"NaN Guard does not name {where}, the block the LoRA poisons")
            if kind == "wrong shapes":
                entry["problems"].append("a LoRA of another size made the output non-finite")
        except Exception as exc:  # noqa: BLE001 - a clear error is accepted; recorded for the report
            entry["events"].append(f"sampling raised {type(exc).__name__}: {str(exc)[:600]}")
        after = _sample(swapped, seed=21)
        if after.equal(ref):
            entry["events"].append("the plain model afterwards: bit-identical to before the LoRA (arena restored)")
        else:
            entry["problems"].append(f"the plain model afterwards differs from before the LoRA (rel "
                                     f"{_rel(after, ref):.3e}): the arena or a resident weight was not restored")
        if ctl.lora.merged:
            entry["problems"].append("the arena still holds merged weights after the plain model ran")
        entry["during"] = during = _here()
        entry["events"].append(f"while loaded: torch allocated {during['torch_allocated'] / MiB:.0f} MiB, Block Swap "
                               f"arena pinned {during['pinned_pack'] / MiB:.0f} MiB")
        comfy_gpu.unload_all_models()
        del swapped, patched, ctl
    _verdict(entry)


def entry_messages(entry: dict) -> list[str]:
    """Log lines seen so far in the running case (the handler of ``recorded`` is the last one on the root)."""
    for h in reversed(logging.getLogger().handlers):
        if isinstance(h, _Messages):
            return list(h.lines)
    return list(entry.get("messages", []))


# ----------------------------------------------------------------------------------------------------------
# 4. 8-bit attention with non-finite q / k


ATTN_POISON = {"q NaN": ("q", math.nan), "q inf": ("q", math.inf), "k NaN": ("k", math.nan),
               "k -inf": ("k", -math.inf)}


def _int8_poisoned(entry: dict) -> None:
    import torch
    import torch.nn.functional as F

    from comfyui_lowvram_dit.kernels import attention_int8

    if not attention_int8.is_supported("cuda", torch.bfloat16, 128):
        entry["problems"].append("attention_int8 is not supported on this GPU (nothing tested)")
    else:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, 8, 300, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
        exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float()).to(torch.bfloat16)
        clean = attention_int8.attention_int8(q, k, v)
        entry["events"].append(f"clean call: rel error vs exact {_rel(clean, exact):.3e}")
        for label, (which, value) in ATTN_POISON.items():
            qq, kk = q.clone(), k.clone()
            (qq if which == "q" else kk)[0, 2, 17, 5] = value
            ref = F.scaled_dot_product_attention(qq.float(), kk.float(), v.float())
            try:
                out = attention_int8.attention_int8(qq, kk, v)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001
                entry["events"].append(f"{label}: raised {type(exc).__name__}: {str(exc)[:300]}")
                out = None
            if out is not None:
                ref_bad = ~torch.isfinite(ref).all(dim=-1)
                out_bad = ~torch.isfinite(out).all(dim=-1)
                silent = int((ref_bad & ~out_bad).sum())
                entry["events"].append(f"{label}: exact attention has {int(ref_bad.sum())} non-finite rows, the "
                                       f"8-bit kernel {int(out_bad.sum())}; rows silently finite: {silent}")
                if silent:
                    entry["problems"].append(f"{label}: {silent} output rows are finite where exact attention is "
                                             "not (the bad value vanished silently)")
            err = _cuda_still_works()
            again = attention_int8.attention_int8(q, k, v)
            torch.cuda.synchronize()
            rel = _rel(again, exact)
            if err or rel > INT8_REL:
                entry["problems"].append(f"{label}: the next normal call is wrong (CUDA: {err}, rel {rel:.3e})")
            elif not torch.equal(again, clean):
                entry["events"].append(f"{label}: next normal call correct (rel {rel:.3e}) but not bit-identical "
                                       "to the first clean call")
        entry["events"].append("after every poisoned call the next normal call was checked against exact "
                               f"attention (tolerance {INT8_REL})")


def test_4a_int8_attention_kernel_with_non_finite_q_k(comfy_gpu: Any) -> None:
    with case_here("4 8-bit attention", "kernel: NaN/inf in q or k") as entry:
        _int8_poisoned(entry)  # its tensors are freed before the "after" measurement
    _verdict(entry)


class _PoisonAttention:
    """An ``optimized_attention_override`` that writes a NaN into q of the ``at``-th attention call of each forward
    (Wan: call 2 = block 1's self-attention), then calls the real override."""

    def __init__(self, inner: Any, value: float, which: str, at: int = 2) -> None:
        self.inner, self.value, self.which, self.at = inner, value, which, at
        self.calls = 0
        self.fired = 0

    def __deepcopy__(self, memo: dict) -> "_PoisonAttention":
        return self

    def __call__(self, func: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        per_forward = 2 * LAYERS  # self + cross attention per block
        if (self.calls - 1) % per_forward == self.at:
            args = list(args)
            i = 0 if self.which == "q" else 1
            t = args[i].clone()
            t.view(-1)[5] = self.value
            args[i] = t
            self.fired += 1
        return self.inner(func, *args, **kwargs)


@pytest.mark.parametrize("label", ["q NaN", "k inf"])
def test_4b_int8_attention_in_a_model_under_nan_guard(comfy_gpu: Any, base_file: Path, label: str) -> None:
    from comfyui_lowvram_dit.kernels.nan_guard import NonFiniteError
    from comfyui_lowvram_dit.host.attention import OVERRIDE_KEY, apply_attention
    from comfyui_lowvram_dit.host.nan_guard import apply_nan_guard

    which, value = label.split()
    with case_here("4 8-bit attention", f"model with lowvram 8-bit, {label} in block 1's self-attention, "
                                        "NaN Guard (raise)") as entry:
        base = _fp8(base_file)
        int8 = apply_attention(base, "lowvram 8-bit")
        exact = _sample(apply_attention(base, "SDPA math"), seed=31)
        clean = _sample(int8, seed=31)
        for backend, model in (("SDPA math (control)", apply_attention(base, "SDPA math")), ("lowvram 8-bit", int8)):
            poisoned = model.clone()
            opts = poisoned.model_options["transformer_options"]
            poison = _PoisonAttention(opts[OVERRIDE_KEY], float(value), which)
            opts[OVERRIDE_KEY] = poison
            try:
                out = _sample(apply_nan_guard(poisoned, "raise"), seed=31)
                rel = _rel(out, exact if backend.startswith("SDPA") else clean)
                entry["events"].append(f"{backend}: {label} injected {poison.fired} times; no error, output finite "
                                       f"{_finite(out)}, rel diff to the same backend unpoisoned {rel:.3e}")
                # both: the fp8 GEMMs after attention must carry the NaN on to NaN Guard (finding 1, fixed)
                entry["problems"].append(f"{backend}: no error and a finite output although {label} was injected "
                                         f"{poison.fired} times (the bad value vanished silently)")
            except NonFiniteError as exc:
                entry["events"].append(f"{backend}: {label} injected {poison.fired} times; NaN Guard: {exc}")
                if "blocks.1" not in str(exc):
                    entry["problems"].append(f"{backend}: NaN Guard does not name blocks.1, where it was injected")
            except Exception as exc:  # noqa: BLE001
                entry["events"].append(f"{backend}: raised {type(exc).__name__}: {str(exc)[:500]}")
        err = _cuda_still_works()
        out = _sample(int8, seed=31)
        rel = _rel(out, exact)
        if not out.equal(clean):
            entry["events"].append(f"next normal 8-bit run differs from the first one (rel {_rel(out, clean):.3e})")
        entry["events"].append(f"next normal 8-bit run: finite {_finite(out)}, rel diff to SDPA math {rel:.3e}")
        if err or not _finite(out) or rel > INT8_REL:
            entry["problems"].append(f"the next normal call is not correct (CUDA: {err}, rel {rel:.3e})")
        del base, int8, poisoned, model
    _verdict(entry)


# ----------------------------------------------------------------------------------------------------------
# servers


def _doctor_pinned(server: ComfyServer) -> tuple[int | None, int | None]:
    """(ComfyUI's pinned account, Block Swap arenas in it) in bytes, from the Doctor node's report."""
    try:
        entry = server.run({"1": {"class_type": "LowVRAM_Doctor", "inputs": {"gpu_probes": False}}}, timeout=120)
    except AssertionError:
        return None, None
    m = re.search(r"([\d.]+) GiB pinned now \(([\d.]+) GiB of it Block Swap arenas\)", json.dumps(entry["outputs"]))
    if not m:
        return None, None
    return int(float(m.group(1)) * GiB), int(float(m.group(2)) * GiB)


def _server_mem(server: ComfyServer, pinned: bool = True) -> dict[str, Any]:
    dev = server.get("/system_stats")["devices"][0]
    st = proc_status(server.pid)
    out: dict[str, Any] = {
        "torch_allocated": dev["torch_vram_total"] - dev["torch_vram_free"],  # active bytes (ComfyUI's arithmetic)
        "torch_reserved": dev["torch_vram_total"], "rss": st.get("VmRSS"), "rss_anon": st.get("RssAnon"),
        "vm_pin": st.get("VmPin"), "vm_lck": st.get("VmLck"), "device": dev["type"]}
    if pinned:
        out["pinned_comfy"], out["pinned_pack"] = _doctor_pinned(server)
    return out


def _alive(server: ComfyServer) -> str | None:
    """None when the server process runs and answers /system_stats, else why not."""
    if server.proc.poll() is not None:
        rc = server.proc.returncode
        sig = f" (signal {-rc}{', SIGBUS' if rc == -7 else ''})" if rc < 0 else ""
        return f"the server exited rc={rc}{sig}"
    try:
        server.get("/system_stats")
        return None
    except Exception as exc:  # noqa: BLE001
        return f"/system_stats failed: {type(exc).__name__}: {exc}"


def _free_and_wait(server: ComfyServer, seconds: float = 3.0) -> None:
    server.free()
    time.sleep(seconds)


@contextlib.contextmanager
def case_server(server: ComfyServer, case: str, what: str) -> Iterator[dict]:
    def settle() -> None:
        if server.proc.poll() is None:
            _free_and_wait(server)

    def measure() -> dict:
        if server.proc.poll() is not None:
            return {"error": "server not running"}
        return _server_mem(server)

    with recorded(case, what, measure, settle) as entry:
        yield entry
    _leaks(entry, {"torch_allocated": 256 * MiB, "pinned_pack": TOL_PINNED, "pinned_comfy": TOL_PINNED,
                   "rss_anon": TOL_RSS_SERVER})


def _start_server(tmp_path_factory: pytest.TempPathFactory, tag: str, extra: str = "") -> Iterator[ComfyServer]:
    comfy, reason = comfyui_path_or_reason()
    if comfy is None:
        pytest.skip(reason)
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    base = tmp_path_factory.mktemp(f"comfyui_hostile_{tag}")
    old = os.environ.get("COMFYUI_EXTRA_ARGS")
    os.environ["COMFYUI_EXTRA_ARGS"] = extra
    try:
        with comfy_server_session(comfy, base, gpu=True) as server:
            if old is None:
                os.environ.pop("COMFYUI_EXTRA_ARGS", None)
            else:
                os.environ["COMFYUI_EXTRA_ARGS"] = old
            yield server
    finally:
        if old is None:
            os.environ.pop("COMFYUI_EXTRA_ARGS", None)
        else:
            os.environ["COMFYUI_EXTRA_ARGS"] = old
        shutil.rmtree(base / "main" / "models", ignore_errors=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComfyServer]:
    yield from _start_server(tmp_path_factory, "default")


def _write_server_model(server: ComfyServer, prefix: str, fmt: str, seed: int) -> str:
    from comfyui_lowvram_dit.synthetic import checkpoints as synth

    name = f"{prefix}_{uuid.uuid4().hex[:6]}.safetensors"
    synth.write_synthetic(MODEL, server.base_dir / "models" / "diffusion_models" / name, size="full", fmt=fmt,
                          seed=seed, device="cuda", num_layers=LAYERS)
    return name


@pytest.fixture(scope="module")
def switch_models(server: ComfyServer) -> tuple[str, str]:
    """Two bf16 files (quantized at every load); one warm-up prompt each, so the server's first-use growth (CUDA
    libraries, kernels, allocator pools) lands before any case's "before" measurement."""
    import torch

    names = (_write_server_model(server, "switch_a", "bf16", 0), _write_server_model(server, "switch_b", "bf16", 1))
    torch.cuda.empty_cache()
    for i, name in enumerate(names):
        server.run(_swap_graph(name, seed=90 + i), timeout=300)
    return names


def _swap_graph(unet: str, seed: int, steps: int = 2, size: int = 256, swap: int = 2) -> dict:
    return {**loader_swap_nodes(unet, swap),
            "3": {"class_type": "LowVRAM_Attention", "inputs": {"model": ["2", 0], "backend": "auto"}},
            **sample_nodes(seed, steps=steps, size=size, cond_length=24)}


def _plain_graph(unet: str, seed: int, steps: int, size: int) -> dict:
    graph = _swap_graph(unet, seed, steps, size)
    del graph["2"]
    graph["3"]["inputs"]["model"] = ["1", 0]
    return graph


def _wait_entry(server: ComfyServer, prompt_id: str, timeout: float) -> dict | None:
    """The finished /history entry, or None when the server died or time ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            return None
        try:
            entry = server.get(f"/history/{prompt_id}").get(prompt_id)
        except Exception:  # noqa: BLE001 - a server dying under the request
            return None
        if entry is not None and entry.get("status", {}).get("status_str") in ("success", "error"):
            return entry
        time.sleep(0.1)
    return None


def _wait_log(server: ComfyServer, start: int, pattern: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if re.search(pattern, server.log_text()[start:]):
            return True
        if server.proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def _log_tail(server: ComfyServer, start: int, n: int = 2500) -> str:
    """The server's log since ``start`` without colour codes and progress bars; from a fatal error on, if any."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", server.log_text()[start:]).replace("\r", "\n")
    fatal = text.find("Fatal Python error")
    if fatal >= 0:
        return text[fatal:fatal + n]
    text = "\n".join(line for line in text.splitlines() if line.strip() and not re.search(r"\d+/\d+ \[", line))
    return text[-n:]


def _status_text(entry: dict) -> str:
    if entry["status"]["status_str"] == "success":
        return "success"
    return execution_error(entry)


# ----------------------------------------------------------------------------------------------------------
# 6. /interrupt mid-step with Block Swap (before 5: the truncation cases may take the server down)


def test_6_interrupt_mid_step_with_block_swap(server: ComfyServer, switch_models: tuple[str, str]) -> None:
    a, _ = switch_models
    _free_and_wait(server)
    with case_server(server, "6 /interrupt", "interrupt a Block Swap run mid-step, then a normal prompt") as entry:
        start = len(server.log_text())
        status, reply = server.post_prompt(_swap_graph(a, seed=600, steps=300, size=512))
        assert status == 200, reply
        streamed = _wait_log(server, start, r"Block Swap: \d+ of \d+ blocks streamed", 120)
        stepping = _wait_log(server, start, r"\|\s*[1-9]\d*/300 \[", 30)  # tqdm: at least one step done
        time.sleep(0.3)
        mid = _server_mem(server, pinned=False)
        server.interrupt()
        t0 = time.monotonic()
        done = _wait_entry(server, reply["prompt_id"], 120)
        entry["events"].append(f"ring active before the interrupt: {streamed}; sampler stepping: {stepping}; "
                               f"server torch active while sampling {mid['torch_allocated'] / MiB:.0f} MiB")
        if done is None:
            entry["problems"].append(f"no result after /interrupt: {_alive(server)}")
        else:
            entry["events"].append(f"interrupted run ended in {time.monotonic() - t0:.1f} s: "
                                   f"{_status_text(done)[:300]}")
            if done["status"]["status_str"] == "success":
                entry["problems"].append("the run finished instead of being interrupted (too fast to hit mid-step)")
        alive = _alive(server)
        if alive:
            entry["problems"].append(alive)
        else:
            after_int = _server_mem(server)
            entry["events"].append(f"right after the interrupt (model still loaded): torch active "
                                   f"{after_int['torch_allocated'] / MiB:.0f} MiB, pinned arenas "
                                   f"{_fmt_bytes(after_int.get('pinned_pack'))} MiB")
            nxt = server.run(_swap_graph(a, seed=601), timeout=180)
            stats = nxt["outputs"]["8"]["latent_stats"][0]
            entry["events"].append(f"next prompt: success, latent finite {stats['finite']}")
            if not stats["finite"]:
                entry["problems"].append("the next prompt's latent is not finite")
        log = server.log_text()[start:]
        if "Traceback" in log and "InterruptProcessingException" not in log[log.index("Traceback"):][:4000]:
            entry["messages"].append(log[log.index("Traceback"):][:1500])
    _verdict(entry)


# ----------------------------------------------------------------------------------------------------------
# 7. 20 model switches: VRAM, pinned and RSS growth


RUNS, WARMUP = 20, 4


def _trend(values: list[float]) -> float:
    n = len(values)
    xm, ym = (n - 1) / 2, sum(values) / n
    slope = sum((i - xm) * (v - ym) for i, v in enumerate(values)) / sum((i - xm) ** 2 for i in range(n))
    return slope * (n - 1)


def test_7_twenty_model_switches_vram_pinned_rss(server: ComfyServer, switch_models: tuple[str, str]) -> None:
    a, b = switch_models
    _free_and_wait(server)
    with case_server(server, "7 20 switches", f"{RUNS} prompts alternating two models, Block Swap 2 of "
                                              f"{LAYERS}") as entry:
        start = len(server.log_text())
        series = []
        for i in range(RUNS):
            t0 = time.monotonic()
            res = server.run(_swap_graph(a if i % 2 == 0 else b, seed=700 + i), timeout=180)
            secs = time.monotonic() - t0
            m = _server_mem(server, pinned=(i % 5 == 4 or i == 0))
            m["secs"] = round(secs, 1)
            m["finite"] = res["outputs"]["8"]["latent_stats"][0]["finite"]
            series.append(m)
        entry["series"] = series
        log = server.log_text()[start:]
        reads = log.count("lowvram_dit: read switch_")
        entry["events"].append(f"{RUNS} runs in {sum(m['secs'] for m in series):.0f} s; Wan Loader read a file in "
                               f"{reads} runs (each run a switch)")
        if reads < RUNS:
            entry["problems"].append(f"only {reads} of {RUNS} runs re-read a model: not every run switched")
        if not all(m["finite"] for m in series):
            entry["problems"].append("a run gave a non-finite latent")
        measured = series[WARMUP:]
        for key, tol in (("torch_allocated", 256 * MiB), ("torch_reserved", 1 * GiB), ("rss_anon", TOL_RSS_SERVER),
                         ("pinned_comfy", TOL_PINNED), ("pinned_pack", TOL_PINNED)):
            values = [m[key] for m in measured if isinstance(m.get(key), (int, float))]
            if len(values) < 2:
                entry["events"].append(f"{key}: not measured")
                continue
            diff, trend = values[-1] - values[0], _trend(values)
            entry["events"].append(f"{key}: run {WARMUP + 1} -> {RUNS}: {diff / MiB:+.0f} MiB (trend "
                                   f"{trend / MiB:+.0f} MiB; values {[round(v / MiB) for v in values]} MiB)")
            if diff > tol or trend > tol:
                entry["problems"].append(f"{key} grew {diff / MiB:+.0f} MiB (trend {trend / MiB:+.0f}) over runs "
                                         f"{WARMUP + 1}-{RUNS}; tolerance {tol / MiB:.0f} MiB")
        if "Potential memory leak" in log:
            entry["problems"].append("ComfyUI reported a potential memory leak (a model alive after its patcher)")
    _verdict(entry)


# ----------------------------------------------------------------------------------------------------------
# 5. a mapped fp8 file truncated in place while the server samples


def _truncation_case(server: ComfyServer, switch: str | None, flags: str) -> None:
    name = _write_server_model(server, "trunc", "fp8_scaled", 5)
    path = server.base_dir / "models" / "diffusion_models" / name
    _free_and_wait(server, 1.0)
    with case_server(server, "5 truncated mapped file", f"{flags}: fp8_scaled file (mapped) truncated to half "
                                                        "while sampling") as entry:
        start = len(server.log_text())
        status, reply = server.post_prompt(_plain_graph(name, seed=500, steps=200, size=512))
        assert status == 200, reply
        read = _wait_log(server, start, rf"lowvram_dit: read {re.escape(name)}", 120)
        stepping = _wait_log(server, start, r"\|\s*[1-9]\d*/200 \[", 45)
        size = path.stat().st_size
        os.truncate(path, size // 2)
        entry["events"].append(f"loader read the file: {read}; sampler stepping: {stepping}; truncated {name} "
                               f"from {size / MiB:.0f} MiB to {size // 2 / MiB:.0f} MiB in place")
        done = _wait_entry(server, reply["prompt_id"], 240)
        if done is None:
            why = _alive(server) or "no result in 240 s"
            entry["problems"].append(f"the sampling run did not end with a result: {why}")
            entry["log_tail"] = _log_tail(server, start)
            entry["events"].append("server log from the failure on: " + entry["log_tail"][:1200].replace("\n", " / "))
        else:
            entry["events"].append(f"the run during the truncation: {_status_text(done)[:600]}")
            if done["status"]["status_str"] == "error" and name not in _status_text(done):
                entry["problems"].append("the run failed with an error that does not name the file")
        alive = _alive(server)
        if alive:
            entry["problems"].append(f"server did not survive: {alive}")
        else:
            entry["events"].append("server answers /system_stats after the truncation")
            try:
                again = server.run(_plain_graph(name, seed=501, steps=2, size=256), timeout=180)
                entry["events"].append(f"the same graph again: {_status_text(again)}")
                entry["problems"].append("a truncated file loaded and sampled without an error")
            except AssertionError as exc:
                text = str(exc)
                entry["events"].append(f"the same graph again: {text[:600]}")
                if name not in text:
                    entry["problems"].append("the error for the truncated file does not name it")
                if "exited" in text:
                    entry["problems"].append("the server died on the truncated file")
            if switch is not None and not _alive(server):
                nxt = server.run(_swap_graph(switch, seed=502), timeout=180)
                entry["events"].append(f"a prompt with a good model afterwards: success, latent finite "
                                       f"{nxt['outputs']['8']['latent_stats'][0]['finite']}")
    _verdict(entry)


def test_5a_truncated_mapped_file_model_resident_in_vram(server: ComfyServer, switch_models: tuple[str, str]) -> None:
    _truncation_case(server, switch_models[0], "default flags (model resident in VRAM)")


@pytest.fixture(scope="module")
def novram_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComfyServer]:
    yield from _start_server(tmp_path_factory, "novram", "--novram")


def test_5b_truncated_mapped_file_weights_cast_from_the_mapping(novram_server: ComfyServer) -> None:
    _truncation_case(novram_server, None, "--novram (weights in host memory, read every call)")
