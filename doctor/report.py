"""The Doctor: what this machine has, which fast paths really work here, and what to use.

One report: versions, the GPU, system and pinnable RAM, which fp8 matmul paths run AND match their fp32 emulation
on a tiny GEMM, which attention backends import AND match an fp32 reference on a tiny call, known-bad version
combinations and a recommendation (doctor/advice.py). Every probe is guarded: without a GPU (or with a broken
library) the report says what was skipped or failed, and ``collect`` never raises.

Plain torch; never imports ComfyUI (its version is read from ``comfyui_version.py`` or passed in by the node).
``cli(argv)`` backs ``python -m comfyui_lowvram_dit doctor [--json]``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

from ..host.version import comfyui_version as read_comfyui_version
from ..host.version import pack_version
from .advice import _os_kind, format_report, known_issues, recommend
from .checkout import POINT_AT, checkout_problem, package_problem

GIB = float(1 << 30)
# fp8 paths are compared with kernels.fp8's exact emulation of the same quantization, so only output rounding
# (bf16: 2^-8) remains.
FP8_TOLERANCE = 0.02
PIN_TEST_MIB = 256  # bounded pinned-allocation + H2D copy test: milliseconds of PCIe time
# ComfyUI's MAX_PINNED_MEMORY: 95 % of RAM on Linux, 45 % on Windows (comfy/model_management.py).
COMFY_PIN_FRACTION = {"linux": 0.95, "windows": 0.45}


def _guard(fn: Callable[[], Any], default: Any = None) -> tuple[Any, str | None]:
    """Run a probe; return (value, None) or (default, "ExcType: message").

    Anything short of KeyboardInterrupt is a finding: an optional library whose import calls ``sys.exit()`` (a
    SystemExit) is reported as broken and the report goes on.
    """
    try:
        return fn(), None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - a probe's failure is a finding, never a crash
        return default, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


# Versions


def dist_version(*names: str) -> str | None:
    """Installed version of the first distribution found among ``names`` (metadata only, no import)."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except Exception:  # not installed, or a broken dist-info: the report goes on
            continue
    return None


COMFYUI_HINT = ("ComfyUI not found: run the Doctor from ComfyUI/custom_nodes/<this pack>, set "
                "COMFYUI_PATH=/path/to/ComfyUI or pass --comfyui-path /path/to/ComfyUI")


def _is_comfyui(path: Path) -> bool:
    return (path / "main.py").is_file() and (path / "comfy").is_dir()


def _given_comfyui(explicit: str | os.PathLike | None) -> tuple[Path, str] | None:
    """The ComfyUI the user named (--comfyui-path, else $COMFYUI_PATH) and how, None when none was named."""
    for given, how in ((explicit, "--comfyui-path"), (os.environ.get("COMFYUI_PATH"), "COMFYUI_PATH")):
        if given:
            return Path(given).expanduser(), how
    return None


def find_comfyui(explicit: str | os.PathLike | None = None, cwd: Path | None = None) -> tuple[Path | None, str]:
    """(ComfyUI checkout, how it was found): --comfyui-path, $COMFYUI_PATH, or custom_nodes/<pack> above us.

    The pack's own folder is checked unresolved too, so a symlinked custom_nodes entry still counts.
    """
    if (given := _given_comfyui(explicit)) is not None:
        return given
    pack = Path(__file__).parent.parent
    starts = [Path(os.path.abspath(cwd or Path.cwd())), Path(os.path.abspath(pack)), pack.resolve()]
    for start in starts:
        for d in (start, *start.parents):
            if _is_comfyui(d):
                return d, f"found above {start}"
            if d.name == "custom_nodes" and _is_comfyui(d.parent):
                return d.parent, f"found above {start}"
    return None, COMFYUI_HINT


def import_error(module: str) -> str | None:
    """None when ``module`` imports, else why not (an installed but broken Triton is as good as none)."""
    _, err = _guard(lambda: importlib.import_module(module))
    return err


def collect_versions(comfyui_version: str | None, comfyui_path: str | None) -> dict:
    """Python, platform, torch/CUDA/cuDNN and the libraries the pack can use."""
    import torch

    cudnn, _ = _guard(lambda: torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
    return {
        "pack": pack_version(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_hip": getattr(torch.version, "hip", None),
        "cudnn": cudnn,
        "numpy": dist_version("numpy"),
        "safetensors": dist_version("safetensors"),
        "triton": dist_version("triton", "triton-windows", "pytorch-triton"),
        "triton_import_error": import_error("triton"),
        "comfyui": comfyui_version or (read_comfyui_version(comfyui_path) if comfyui_path else None),
        "comfyui_path": str(comfyui_path) if comfyui_path else None,
        "comfy_kitchen": dist_version("comfy-kitchen", "comfy_kitchen"),
        "flash_attn": dist_version("flash-attn", "flash_attn"),
        "sageattention": dist_version("sageattention"),
        "xformers": dist_version("xformers"),
    }


# GPU and memory


def collect_gpu() -> dict:
    """CUDA device facts, or ``{"available": False, "reason": ...}``."""
    import torch

    if not torch.cuda.is_available():
        return {"available": False, "reason": "torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})"}
    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    free, total = torch.cuda.mem_get_info(dev)
    arch_list, _ = _guard(torch.cuda.get_arch_list, [])
    return {
        "available": True,
        "index": dev,
        "count": torch.cuda.device_count(),
        "name": props.name,
        "capability": [props.major, props.minor],
        "sm_count": props.multi_processor_count,
        "vram_total_gib": round(total / GIB, 2),
        "vram_free_gib": round(free / GIB, 2),
        "arch_list": arch_list,
    }


def _ram() -> tuple[int | None, int | None, int | None]:
    """Total and available RAM for this process (a smaller container limit caps both), and the machine's total where
    a container limit is smaller and this ComfyUI (if any) still plans by the machine's RAM (else None)."""
    try:
        from ..host.system_ram import comfyui_reads_the_limit, usable_ram

        ram = usable_ram()
        hidden = ram.container_limit and not comfyui_reads_the_limit()
        return ram.total, ram.available, ram.machine_total if hidden else None
    except ImportError:  # psutil missing
        pass
    try:
        from ..offload.machine_ram import meminfo_bytes

        return meminfo_bytes("MemTotal"), meminfo_bytes("MemAvailable"), None
    except (OSError, RuntimeError, ValueError):  # not Linux, or a /proc/meminfo without those lines
        return None, None, None


def collect_memory(gpu: dict, pin_test: bool = True) -> dict:
    """System RAM, the pinnable budget ComfyUI would use, and a bounded pinned-copy test on the GPU."""
    import torch

    total, available, machine = _ram()
    kind = _os_kind()
    out: dict = {"ram_total_gib": round(total / GIB, 2) if total else None,
                 "ram_available_gib": round(available / GIB, 2) if available else None,
                 "ram_machine_gib": round(machine / GIB, 2) if machine else None}  # set: ComfyUI reads the machine's
    fraction = COMFY_PIN_FRACTION.get(kind, 0.95)
    if total:
        out["comfyui_pin_cap_gib"] = round((machine or total) * fraction / GIB, 2)  # ComfyUI reads the machine's
        out["comfyui_pin_cap_rule"] = f"{fraction:.0%} of RAM ({kind}, ComfyUI v0.8.0 MAX_PINNED_MEMORY)"
    try:
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        out["memlock_limit"] = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / GIB:.2f} GiB"
    except (ImportError, AttributeError, OSError):
        out["memlock_limit"] = None
    if not gpu.get("available"):
        out["pin_test"] = {"status": "skip", "detail": "no CUDA GPU"}
    elif not pin_test:
        out["pin_test"] = {"status": "skip", "detail": "disabled"}
    elif available is not None and available < 4 * PIN_TEST_MIB * (1 << 20):
        out["pin_test"] = {"status": "skip", "detail": f"only {available / GIB:.2f} GiB RAM available"}
    else:
        def pin_and_copy() -> dict:
            n = PIN_TEST_MIB << 20
            t0 = time.perf_counter()
            host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            pin_s = time.perf_counter() - t0
            dev = torch.empty(n, dtype=torch.uint8, device="cuda")
            dev.copy_(host, non_blocking=True)  # warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dev.copy_(host, non_blocking=True)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
            del host, dev
            return {"status": "ok", "pinned_mib": PIN_TEST_MIB, "pin_alloc_ms": round(pin_s * 1e3, 1),
                    "h2d_pinned_gbps": round(n / (ms * 1e-3) / 1e9, 1)}

        result, err = _guard(pin_and_copy)
        out["pin_test"] = result if err is None else {"status": "fail", "detail": err}
    return out


# fp8


def _rel_err(got: Any, ref: Any) -> float:
    got, ref = got.float(), ref.float()
    if not bool(got.isfinite().all()):
        return float("inf")
    return float((got - ref).norm() / ref.norm().clamp_min(1e-12))


def _checked(kind: str, name: str, measure: Callable[[], float], tol: float, **extra: Any) -> dict:
    """Run one numerics probe (``measure`` returns its relative error): {kind: name, status ok|fail, rel_err,
    detail, **extra}."""
    err, exc = _guard(measure)
    if exc is not None:
        return {kind: name, **extra, "status": "fail", "detail": exc}
    ok = err <= tol
    return {kind: name, **extra, "status": "ok" if ok else "fail", "rel_err": err,
            "detail": "" if ok else f"relative error {err:.3g} > {tol:g}"}


FP8_LABELS = {"scaled_mm_rowwise": "per-tensor weight, row-wise act. (torch._scaled_mm)",
              "scaled_mm_tensorwise": "per-tensor (torch._scaled_mm)",
              "scaled_mm_blockwise": "block-wise 128 (F.scaled_mm)", "dequantize": "dequantize + bf16 matmul"}


def _probe_fp8_with_pack(device: Any) -> list[dict]:
    """Each kernels.fp8 path on a tiny GEMM vs its own fp32 emulation (fp8_linear_reference)."""
    import torch

    from ..kernels import fp8

    torch.manual_seed(0)
    x = torch.randn(64, 256, device=device, dtype=torch.bfloat16)
    w = torch.randn(256, 256, device=device, dtype=torch.float32) * 0.02
    probes = []
    for path in fp8.FP8_PATHS:
        block = 128 if path == "scaled_mm_blockwise" else None
        label = FP8_LABELS.get(path, path)
        if device.type != "cuda" and path != "dequantize":
            probes.append({"path": path, "label": label, "status": "skip", "detail": "no CUDA GPU"})
            continue

        def run(path: str = path, block: int | None = block) -> float:
            q, s = fp8.quantize_per_tensor(w) if block is None else fp8.quantize_blockwise(w, block)
            got = fp8.fp8_linear(x, q, s, block_size=block, path=path, out_dtype=torch.bfloat16)
            ref = fp8.fp8_linear_reference(x, q, s, block_size=block, path=path, out_dtype=torch.bfloat16)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return _rel_err(got, ref)

        probes.append(_checked("path", path, run, FP8_TOLERANCE, label=label))
    return probes


def _probe_fp8_direct(device: Any) -> list[dict]:
    """Without kernels.fp8: try torch's scaled matmuls directly on a tiny GEMM vs an fp32 reference."""
    import torch
    import torch.nn.functional as F

    fp8_dtype = getattr(torch, "float8_e4m3fn", None)
    if fp8_dtype is None:
        return [{"path": "dequantize", "status": "fail", "detail": f"torch {torch.__version__} has no float8_e4m3fn"}]
    torch.manual_seed(0)
    m, n, k = 64, 256, 256
    a = (torch.randn(m, k, device=device) * 8).to(fp8_dtype)
    b = (torch.randn(n, k, device=device) * 8).to(fp8_dtype)
    ref = (a.float() @ b.float().t())
    probes = [{"path": "dequantize", "status": "ok", "detail": "float8_e4m3fn storage + cast"}]
    one = torch.ones((), device=device)
    calls: dict[str, Callable[[], Any]] = {
        "scaled_mm_tensorwise": lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
        "scaled_mm_rowwise": lambda: torch._scaled_mm(a, b.t(), scale_a=torch.ones(m, 1, device=device),
                                                      scale_b=torch.ones(1, n, device=device),
                                                      out_dtype=torch.bfloat16),
    }
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        # Activation scale (M, K/128) column-major; weight scale (N/128, K/128) passed transposed.
        sa = torch.ones(k // 128, m, device=device).t()
        sb = torch.ones(n // 128, k // 128, device=device).t()
        calls["scaled_mm_blockwise"] = lambda: F.scaled_mm(a, b.t(), sa, F.ScalingType.BlockWise1x128, sb,
                                                           F.ScalingType.BlockWise128x128,
                                                           output_dtype=torch.bfloat16)
    else:
        probes.append({"path": "scaled_mm_blockwise", "status": "skip",
                       "detail": f"torch {torch.__version__} has no F.scaled_mm (torch >= 2.10)"})
    for path, call in calls.items():
        if device.type != "cuda":
            probes.append({"path": path, "status": "skip", "detail": "no CUDA GPU"})
            continue
        probes.append(_checked("path", path, lambda call=call: _rel_err(call(), ref), FP8_TOLERANCE))
    return probes


def collect_fp8(device: Any) -> dict:
    """Which fp8 paths work here, and which path the pack's fp8 layer would pick."""
    fp8_mod, import_err = _guard(lambda: importlib.import_module("..kernels.fp8", __package__))
    if fp8_mod is not None:
        probes, err = _guard(lambda: _probe_fp8_with_pack(device), [])
        source = "kernels.fp8"
    else:
        probes, err = _guard(lambda: _probe_fp8_direct(device), [])
        source = f"torch (kernels.fp8 not importable: {import_err})"
    out: dict = {"source": source, "probes": probes}
    if err:
        out["error"] = err
    if fp8_mod is not None:
        # The path our loader picks for 128-block and per-tensor weights at a Wan 14B q/k/v shape.
        blockwise, e1 = _guard(lambda: fp8_mod.select_path(device, 128, 5120, 5120))
        per_tensor, e2 = _guard(lambda: fp8_mod.select_path(device, None, 5120, 5120))
        out["selected"] = {"blockwise_128": blockwise or e1, "per_tensor": per_tensor or e2}
    return out


# Attention


def _probe_attention_with_pack(device: Any, dtype: Any) -> list[dict]:
    """Every backend in kernels.attention's registry: static capability check, then a tiny checked call."""
    import torch

    from ..kernels import attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 256, 128, device=device, dtype=dtype) for _ in range(3))
    probes = []
    for name, backend in attention.BACKENDS.items():
        reason, exc = _guard(lambda name=name: attention.unavailable_reason(name, device, dtype, 128))
        if exc or reason:
            probes.append({"backend": name, "label": backend.label, "status": "skip", "detail": exc or reason})
            continue

        def run(backend: Any = backend) -> tuple[bool, float, str]:
            out = backend.call(q, k, v, None)
            return attention.check_output(q, k, v, None, out)

        res, exc = _guard(run)
        if exc:
            probes.append({"backend": name, "label": backend.label, "status": "fail", "detail": exc})
            continue
        finite, err, note = res
        ok = finite and err <= backend.tolerance
        probes.append({"backend": name, "label": backend.label, "status": "ok" if ok else "fail", "rel_err": err,
                       "detail": note or ("" if ok else f"relative error {err:.3g} > {backend.tolerance:g}")})
    return probes


def collect_attention(device: Any) -> dict:
    """Which attention backends import and pass a tiny numerics check on ``device`` (bf16, head_dim 128)."""
    import torch

    from ..kernels import attention

    probes, err = _guard(lambda: _probe_attention_with_pack(device, torch.bfloat16), [])
    out = {"source": "kernels.attention", "device": str(device), "probes": probes,
           "preference": list(attention.FALLBACK_ORDER)}
    if err:
        out["error"] = err
    return out


# Report


def _section(report: dict, key: str, fn: Callable[[], dict], default: dict, error_key: str = "error") -> None:
    """``report[key] = fn()``; a failure leaves ``default`` with the error under ``error_key``."""
    report[key], err = _guard(fn, default)
    if err:
        report[key][error_key] = err


def collect(comfyui_version: str | None = None, comfyui_path: str | os.PathLike | None = None,
            gpu_probes: bool = True, host: dict | None = None, seams: dict[str, str] | None = None,
            progress: Callable[[str], None] | None = None, swap_measured: list[str] | None = None) -> dict:
    """The whole report as a dict. Never raises: a failing section records its error.

    ``progress`` gets a line before each probe section (the CLI prints them to stderr).

    ``seams`` (seam -> "ok" / "missing: ...") comes from host/seams.py when the Doctor node runs inside ComfyUI;
    ``swap_measured`` (Block Swap's verdict lines of this server, nodes/block_swap.py) too.
    """
    say = progress or (lambda _line: None)
    report: dict = {"generated": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "skipped": []}
    if not comfyui_version:
        found, how = find_comfyui(comfyui_path)
        comfyui_path = found
        report["comfyui_found"] = how
        if found is not None:
            say("Doctor: reading the ComfyUI checkout ...")
            problem, _ = _guard(lambda: checkout_problem(found) or package_problem(found), "it cannot be read")
            if problem:
                report["comfyui_problem"] = f"{found}: {problem}"
    if host:
        report["host"] = host
    if seams:
        report["seams"] = dict(seams)
    if swap_measured is not None:
        report["block_swap_measured"] = list(swap_measured)
    say("Doctor: reading versions ...")
    _section(report, "versions", lambda: collect_versions(comfyui_version, comfyui_path), {})
    if comfyui_path is not None and not report["versions"].get("comfyui") and "comfyui_problem" not in report:
        report["comfyui_problem"] = (f"{comfyui_path}: its version cannot be read (no comfyui_version.py with a "
                                     "__version__ there); update or reinstall that ComfyUI")
    say("Doctor: looking for a GPU ...")
    _section(report, "gpu", collect_gpu, {"available": False}, "reason")
    if not report["gpu"].get("available"):
        report["skipped"].append(f"GPU probes: {report['gpu'].get('reason', 'no CUDA GPU')}")
    _section(report, "memory", lambda: collect_memory(report["gpu"], pin_test=gpu_probes), {})
    import torch

    on_gpu = bool(report["gpu"].get("available")) and gpu_probes
    device = torch.device("cuda", report["gpu"].get("index", 0)) if on_gpu else torch.device("cpu")
    if report["gpu"].get("available") and not gpu_probes:
        report["skipped"].append("GPU fp8/attention/pinned-memory probes: disabled (--no-gpu-probes)")
    say(f"Doctor: probing fp8 matmul paths on {device} ...")
    _section(report, "fp8", lambda: collect_fp8(device), {"probes": []})
    say(f"Doctor: probing attention backends on {device} ...")
    _section(report, "attention", lambda: collect_attention(device), {"probes": []})
    for section in ("fp8", "attention"):
        for p in report[section].get("probes", []):
            if p.get("status") == "skip":
                report["skipped"].append(f"{section} {p.get('path') or p.get('backend')}: {p.get('detail')}")
    report["known_issues"], err = _guard(lambda: known_issues(report), [])
    if err:
        report["known_issues"] = [{"id": "doctor_error", "severity": "info", "message": err, "source": "doctor"}]
    report["recommendation"], err = _guard(lambda: recommend(report), {})
    if err:
        report["recommendation"] = {"error": err}
    return report



def _json_safe(value: Any) -> Any:
    """Non-finite floats become strings so ``--json`` output is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def to_json(report: dict) -> str:
    """The report as strict JSON."""
    return json.dumps(_json_safe(report), indent=1, default=str, allow_nan=False)


def cli(argv: list[str]) -> int:
    """``python -m comfyui_lowvram_dit doctor [--json] [--comfyui-path P] [--no-gpu-probes]``: exit 0, or 1 when the
    ComfyUI found is broken; a named path that is no ComfyUI raises InputError (cli/main.py prints it)."""
    from ..cli.errors import InputError

    parser = argparse.ArgumentParser(prog="python -m comfyui_lowvram_dit doctor",
                                     description="Report versions, GPU, working fp8/attention paths and a "
                                                 "recommendation for this machine.")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--comfyui-path", default=None, help="ComfyUI checkout to read the version from "
                        "(default: $COMFYUI_PATH, else the ComfyUI whose custom_nodes holds the pack or the "
                        "current folder)")
    parser.add_argument("--no-gpu-probes", action="store_true", help="skip the tiny GPU matmul/attention/pin tests")
    args = parser.parse_args(argv)
    given = _given_comfyui(args.comfyui_path)
    if given is not None and (problem := checkout_problem(given[0])):
        raise InputError(f"{given[1]} {given[0]}: {problem}; {POINT_AT}, or leave it out to report without one")
    report = collect(comfyui_path=args.comfyui_path, gpu_probes=not args.no_gpu_probes,
                     progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(to_json(report) if args.json else format_report(report), end="\n" if args.json else "")
    if report.get("comfyui_problem"):
        print(f"doctor: the ComfyUI checkout is broken: {report['comfyui_problem']}", file=sys.stderr)
        return 1
    return 0
