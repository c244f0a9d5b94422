"""The Doctor's advice and text: known-bad combinations (public sources only), the recommendation, the report.

Pure functions of the report dict that doctor/report.py collects; plain Python, no torch import.
"""

from __future__ import annotations

import math
import re
import sys
from typing import Any

GIB = float(1 << 30)
# Weight bytes per model (GB = 1e9) and the B=1 activation working set at the named size (FFN phase), for the
# starting-point swap recommendation.
SWAP_MODELS: dict[str, dict[str, Any]] = {
    "wan22_14B (one expert), 832x480x81": {"blocks": 40, "block_gb": {"bf16": 0.703, "fp8": 0.352},
                                            "nonblock_gb": 0.465, "activations_gib": 2.6},
    "wan22_ti2v_5B, 1280x704x121": {"blocks": 30, "block_gb": {"bf16": 0.327, "fp8": 0.164},
                                     "nonblock_gb": 0.180, "activations_gib": 1.9},
    "qwen_image, 1328x1328": {"blocks": 60, "block_gb": {"bf16": 0.680, "fp8": 0.340},
                              "nonblock_gb": 0.081, "activations_gib": 0.44},
}
# ComfyUI's model_management: EXTRA_RESERVED_VRAM 400 MB (600 MB Windows) + minimum_inference_memory 0.8 GiB.
COMFY_RESERVED_GIB = {"linux": 0.4 * 1e9 / GIB, "windows": 0.6 * 1e9 / GIB}
COMFY_MIN_INFERENCE_GIB = 0.8

COMFYUI_REPO = "comfyanonymous/ComfyUI"
WRAPPER_REPO = "kijai/ComfyUI-WanVideoWrapper"
SUPPORTED_COMFYUI = ((0, 8, 0), (0, 33, 0))  # oldest and newest ComfyUI the pack is tested on


def _gh(repo: str, *numbers: int) -> str:
    """Public GitHub links to issues/PRs (GitHub redirects an issue link to the PR of the same number)."""
    return " ".join(f"https://github.com/{repo}/issues/{n}" for n in numbers)


def _os_kind() -> str:
    return "windows" if sys.platform.startswith("win") else "linux" if sys.platform.startswith("linux") else sys.platform


def _version_tuple(version: str | None) -> tuple[int, ...]:
    """'2.11.0+cu130' -> (2, 11, 0); None or unparsable -> ()."""
    if not version:
        return ()
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])


# Known-bad combinations (sourced only) and the recommendation


def known_issues(report: dict) -> list[dict]:
    """Sourced version/hardware combinations that are known to break or degrade, that apply here."""
    v, gpu = report["versions"], report["gpu"]
    cap = tuple(gpu.get("capability") or ())
    torch_v, cuda_v = _version_tuple(v.get("torch")), _version_tuple(v.get("torch_cuda"))
    issues: list[dict] = []

    def add(issue_id: str, severity: str, message: str, source: str = "") -> None:
        issues.append({"id": issue_id, "severity": severity, "message": message, "source": source})

    missing = {name: s for name, s in (report.get("seams") or {}).items() if s != "ok"}
    if missing:
        add("comfyui_seams_missing", "error", f"This ComfyUI ({v.get('comfyui') or 'unknown version'}) lacks "
            f"{len(missing)} seam(s) the pack uses ({', '.join(missing)}): the nodes that need them are left out or "
            "pass the model through (see 'ComfyUI seams' and the startup log).")
    comfy_v = _version_tuple(v.get("comfyui"))
    if comfy_v and comfy_v < SUPPORTED_COMFYUI[0]:
        add("comfyui_too_old", "error", f"ComfyUI {v['comfyui']} is older than 0.8.0, which this pack requires "
            "(V3 node API, mixed-precision fp8 ops). Update ComfyUI.")
    elif comfy_v and comfy_v > SUPPORTED_COMFYUI[1]:
        add("comfyui_newer_than_tested", "info", f"ComfyUI {v['comfyui']} is newer than 0.33.0, the newest the "
            "pack was tested on; the seam check above says whether everything it uses is still there.")
    if cap and gpu.get("arch_list"):
        arch = f"sm_{cap[0]}{cap[1]}"
        ptx_ok = any(a.startswith("compute_") and _version_tuple(a[8:]) and int(a[8:]) <= cap[0] * 10 + cap[1]
                     for a in gpu["arch_list"])
        if arch not in gpu["arch_list"] and not ptx_ok:
            add("gpu_arch_not_in_torch_build", "error",
                f"This torch build has kernels for {', '.join(gpu['arch_list'])} but not {arch} ({gpu.get('name')}): "
                "GPU kernels fail with 'no kernel image is available'. Install a torch build for this GPU "
                "(RTX 50xx / sm_120 needs a CUDA >= 12.8 build).")
    if cap and cap[0] == 9 and torch_v >= (2, 10) and cuda_v and cuda_v < (12, 9):
        add("blockwise_fp8_needs_cuda_12_9", "warn",
            f"torch {v['torch']} is built with CUDA {v['torch_cuda']}: block-wise fp8 F.scaled_mm needs cuBLASLt "
            ">= 12.9 on SM90 (cu128 wheels raise). Block-wise fp8 falls back to Triton or dequantize; a cu129+/cu130 "
            "torch build restores it.", _gh("pytorch/pytorch", 158037, 166639))
    if cap and cap[0] >= 10:
        add("no_rowwise_scaled_mm", "info", f"SM{cap[0]}{cap[1]}: cuBLAS row-wise fp8 scaled_mm is unsupported, so "
            "per-tensor fp8 weights use one activation scale per call (tensor-wise).",
            _gh("pytorch/pytorch", 160693, 161236))
    if v.get("sageattention"):
        add("sage_fp8_black_output", "warn",
            "SageAttention with fp8 Wan weights has produced black frames (RTX 5090/Windows, and native Wan with "
            "--use-sage-attention + fp8). If outputs turn black, switch attention to SDPA.",
            _gh("kijai/ComfyUI-KJNodes", 352) + " " + _gh("thu-ml/SageAttention", 221) + " " + _gh(COMFYUI_REPO, 7020))
    if cap and cap >= (8, 9):
        add("fp8_e4m3fn_fast_quality", "info",
            "ComfyUI's 'fp8_e4m3fn_fast' multiplies with unit scales and clamps activations to ±448; on the Wan "
            "720p I2V fp8 model it gave blocky output. Prefer scaled fp8 (per-tensor or block-wise) weights.",
            _gh(WRAPPER_REPO, 283))
    if torch_v and torch_v < (2, 7):
        add("no_fp16_accumulation", "info", f"torch {v['torch']} < 2.7 has no "
            "torch.backends.cuda.matmul.allow_fp16_accumulation ('fp16_fast' options in other packs fail).",
            _gh(COMFYUI_REPO, 11621) + " " + _gh(WRAPPER_REPO, 108, 233, 446))
    if v.get("triton") and v.get("triton_import_error"):
        add("triton_broken", "warn", f"Triton {v['triton']} is installed but does not import "
            f"({v['triton_import_error']}): torch.compile, the fused fp8 activation quantization and the 8-bit "
            "attention kernel are unavailable (the pack falls back to eager/dequantize/SDPA). Reinstall a triton "
            "matching this torch.")
    if not v.get("triton"):
        if _os_kind() == "windows":
            add("triton_missing_windows", "warn", "Triton is not installed: torch.compile, SageAttention and the "
                "pack's Triton kernels are unavailable. On Windows install 'triton-windows'.",
                _gh(COMFYUI_REPO, 9826, 7484) + " " + _gh(WRAPPER_REPO, 1400))
        elif gpu.get("available"):
            add("triton_missing", "info", "Triton is not installed: torch.compile, the fused fp8 activation "
                "quantization and Triton block-wise fp8 / 8-bit attention kernels are unavailable.")
    if _os_kind() == "windows" and "dev" in (v.get("torch") or "") and torch_v[:2] == (2, 10):
        add("sage_build_torch_2_10_dev_windows", "info", "Building SageAttention from source failed on Windows "
            "with a PyTorch 2.10 nightly (compiled_autograd.h); use a release torch or a prebuilt wheel.")
    return issues


def _passing(probes: list[dict], key: str) -> list[str]:
    return [p[key] for p in probes if p.get("status") == "ok"]


def recommend(report: dict) -> dict:
    """fp8 path, attention backend and blocks to swap per model for this machine (a starting point)."""
    gpu, fp8, attn = report["gpu"], report["fp8"], report["attention"]
    rec: dict = {}
    fp8_ok = _passing(fp8.get("probes", []), "path")
    selected = (fp8.get("selected") or {}).get("per_tensor")  # the loader's default mode
    matmul_paths = ["scaled_mm_rowwise", "scaled_mm_tensorwise", "scaled_mm_blockwise"]
    for path in ([selected] if selected in matmul_paths else []) + matmul_paths:
        if path in fp8_ok:
            block = path == "scaled_mm_blockwise"
            rec["fp8"] = {"path": path, "weights": "fp8 block-wise 128" if block else "fp8 per-tensor scaled",
                          "why": "fp8 matmul passed its numerics check here (faster than bf16 per GEMM: "
                                 "docs/benchmarks.md)"}
            break
    else:
        rec["fp8"] = {"path": "dequantize", "weights": "fp8 storage only" if gpu.get("available") else "bf16",
                      "why": "no fp8 matmul path works here: fp8 weights halve memory and transfers, compute "
                             "stays bf16/fp16" if gpu.get("available") else "no CUDA GPU"}
    attn_ok = _passing(attn.get("probes", []), "backend")
    order = attn.get("preference") or ["sdpa_cudnn", "flash_attn3", "flash_attn2", "flash_attn", "sdpa_flash",
                                       "sageattention", "sage", "xformers", "sdpa_efficient", "sdpa", "sdpa_math"]
    best = next((b for b in order if b in attn_ok), None)
    rec["attention"] = {"backend": best, "device": attn.get("device"), "passing": attn_ok,
                        "why": "first passing backend in speed order (docs/benchmarks.md)"}
    if "sage" in attn_ok or "sageattention" in attn_ok:
        rec["attention"]["note"] = "SageAttention passes but changes numerics (8-bit); see known issues with fp8."
    if not gpu.get("available"):
        rec["swap"] = {"skipped": "no CUDA GPU"}
        return rec
    kind = _os_kind()
    budget = (gpu["vram_total_gib"] - COMFY_RESERVED_GIB.get(kind, 0.4) - COMFY_MIN_INFERENCE_GIB)
    pin_cap = report["memory"].get("comfyui_pin_cap_gib")
    storage = "fp8" if gpu.get("capability", [0])[0] >= 8 else "bf16"
    models = {}
    for model, m in SWAP_MODELS.items():
        weights_budget = budget - m["activations_gib"] - m["nonblock_gb"] * 1e9 / GIB
        block_gib = m["block_gb"][storage] * 1e9 / GIB
        resident = max(0, min(m["blocks"], math.floor(weights_budget / block_gib))) if weights_budget > 0 else 0
        swapped = m["blocks"] - resident
        entry = {"blocks": m["blocks"], "blocks_to_swap": swapped, "storage": storage,
                 "vram_budget_gib": round(max(weights_budget, 0.0), 2), "pinned_needed_gib": round(swapped * block_gib, 2)}
        if pin_cap is not None and swapped * block_gib > pin_cap:
            entry["warning"] = "swapped blocks exceed the pinnable RAM: expect pageable (slow) copies or RAM pressure"
        models[model] = entry
    rec["swap"] = {"vram_total_gib": gpu["vram_total_gib"], "models": models,
                   "why": "VRAM minus ComfyUI's reserve and 0.8 GiB inference minimum, minus the B=1 activation "
                          "working set at the named size; a starting point, not a measurement"}
    return rec


# Report text


def _probe_line(p: dict, key: str) -> str:
    mark = {"ok": "OK  ", "fail": "FAIL", "skip": "skip"}.get(p.get("status"), "?   ")
    err = f" (rel err {p['rel_err']:.2%})" if isinstance(p.get("rel_err"), float) and math.isfinite(p["rel_err"]) else ""
    label = f" - {p['label']}" if p.get("label") else ""
    detail = f": {p['detail']}" if p.get("detail") else ""
    return f"  [{mark}] {p.get(key)}{label}{err}{detail}"


def no_gpu_detail(probe: dict) -> bool:
    """True for a probe skipped only because there is no CUDA GPU."""
    return probe.get("status") == "skip" and "CUDA" in str(probe.get("detail"))


def _probe_lines(probes: list[dict], key: str, no_gpu: bool) -> list[str]:
    """One line per probe; without a GPU the GPU-only ones share one line (the GPU section says why)."""
    gpu_only = [p for p in probes if no_gpu and no_gpu_detail(p)]
    lines = [_probe_line(p, key) for p in probes if p not in gpu_only]
    if gpu_only:
        lines.append(f"  [skip] GPU only: {', '.join(str(p.get(key)) for p in gpu_only)}")
    return lines


def _ram_line(mem: dict) -> str:
    """The report's RAM line: a container's limit where it is below the machine's RAM, said as such."""
    limit = (f" (this container's memory limit; the machine has {mem['ram_machine_gib']} GiB, which ComfyUI's "
             "pinned-memory cap below is taken from)") if mem.get("ram_machine_gib") else ""
    return f"  RAM {mem.get('ram_total_gib', '-')} GiB total{limit}, {mem.get('ram_available_gib', '-')} GiB available"


def format_report(report: dict) -> str:
    """The human-readable text report."""
    v, gpu, mem = report.get("versions", {}), report.get("gpu", {}), report.get("memory", {})
    lines = [f"LowVRAM DiT Doctor — {report.get('generated', '')}", "", "Versions"]
    for key in ("pack", "python", "platform", "torch", "torch_cuda", "cudnn", "numpy", "safetensors", "triton",
                "comfyui", "comfy_kitchen", "flash_attn", "sageattention", "xformers"):
        lines.append(f"  {key:<14} {v.get(key) if v.get(key) is not None else '-'}")
    if v.get("error"):
        lines.append(f"  error: {v['error']}")
    if report.get("comfyui_found"):
        where = v.get("comfyui_path")
        lines.append(f"  comfyui path   {where} ({report['comfyui_found']})" if where else
                     f"  {report['comfyui_found']}")
    if report.get("comfyui_problem"):
        lines.append(f"  comfyui BROKEN {report['comfyui_problem']}")
    if report.get("host"):
        lines += ["", "ComfyUI (running)"] + [f"  {k:<14} {val}" for k, val in report["host"].items()]
    if report.get("seams"):
        lines += ["", "ComfyUI seams (host/seams.py)"] + [f"  {k:<25} {val}" for k, val in report["seams"].items()]
    lines += ["", "GPU"]
    if gpu.get("available"):
        cap = ".".join(map(str, gpu.get("capability", [])))
        lines += [f"  {gpu['name']} (compute capability {cap}, {gpu.get('sm_count')} SMs), "
                  f"{gpu['vram_total_gib']} GiB VRAM, {gpu['vram_free_gib']} GiB free",
                  f"  torch arch list: {' '.join(gpu.get('arch_list') or []) or '-'}"]
    else:
        lines.append(f"  none: {gpu.get('reason', 'no CUDA GPU')}")
    lines += ["", "Memory",
              _ram_line(mem),
              f"  pinnable (ComfyUI cap): {mem.get('comfyui_pin_cap_gib', '-')} GiB "
              f"({mem.get('comfyui_pin_cap_rule', '-')}); RLIMIT_MEMLOCK {mem.get('memlock_limit', '-')}"]
    pin = mem.get("pin_test") or {}
    if pin.get("status") == "ok":
        lines.append(f"  pinned test: {pin['pinned_mib']} MiB pinned in {pin['pin_alloc_ms']} ms, "
                     f"host->device {pin['h2d_pinned_gbps']} GB/s")
    elif not (no_gpu_detail(pin) and not gpu.get("available")):
        lines.append(f"  pinned test: {pin.get('status', '-')}: {pin.get('detail', '')}")
    fp8 = report.get("fp8", {})
    no_gpu = not gpu.get("available")
    lines += ["", f"fp8 matmul paths ({fp8.get('source', '-')})"]
    lines += _probe_lines(fp8.get("probes", []), "path", no_gpu)
    if fp8.get("selected"):
        lines.append(f"  pack selects: block-wise 128 -> {fp8['selected'].get('blockwise_128')}, "
                     f"per-tensor -> {fp8['selected'].get('per_tensor')}")
    attn = report.get("attention", {})
    lines += ["", f"Attention backends on {attn.get('device', '-')} ({attn.get('source', '-')})"]
    lines += _probe_lines(attn.get("probes", []), "backend", no_gpu)
    lines += ["", "Known issues"]
    issues = report.get("known_issues", [])
    lines += [f"  [{i['severity']}] {i['message']}" + (f"\n      source: {i['source']}" if i.get("source") else "")
              for i in issues] or ["  none known"]
    rec = report.get("recommendation", {})
    lines += ["", "Recommendation"]
    if rec.get("fp8"):
        lines.append(f"  fp8: {rec['fp8']['weights']} via {rec['fp8']['path']} — {rec['fp8']['why']}")
    if rec.get("attention"):
        lines.append(f"  attention ({rec['attention'].get('device')}): {rec['attention']['backend'] or '-'} — "
                     f"{rec['attention']['why']}")
        if rec["attention"].get("note"):
            lines.append(f"    {rec['attention']['note']}")
    swap = rec.get("swap", {})
    if swap.get("models"):
        lines.append(f"  block swap ({swap['vram_total_gib']} GiB VRAM; {swap['why']}):")
        for model, e in swap["models"].items():
            warn = f" — {e['warning']}" if e.get("warning") else ""
            lines.append(f"    {model}: swap {e['blocks_to_swap']}/{e['blocks']} {e['storage']} blocks "
                         f"(weights budget {e['vram_budget_gib']} GiB, pinned RAM {e['pinned_needed_gib']} GiB){warn}")
    elif swap.get("skipped"):
        lines.append(f"  block swap: skipped ({swap['skipped']})")
    if rec.get("error"):
        lines.append(f"  error: {rec['error']}")
    if "block_swap_measured" in report:
        lines += ["", "Block Swap in this server (measured after each load's first model calls)"]
        lines += [f"  {v}" for v in report["block_swap_measured"]] or [
            "  nothing measured yet: a Block Swap load on a CUDA GPU reports here after its first model calls"]
    # Probe skips are already on their probe's line and "no GPU" in the GPU section: list only the rest.
    rest = [s for s in report.get("skipped", []) if not s.startswith(("GPU probes:", "fp8 ", "attention "))]
    if rest:
        lines += ["", "Skipped"] + [f"  {s}" for s in rest]
    return "\n".join(lines) + "\n"

