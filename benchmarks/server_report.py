"""Reports of the server scenarios: ratios against named native rows, the goals, markdown tables and a plot.

Every ratio is native s/step / row s/step (above 1: the row is faster), names the native row it is against, and is
taken only within one card size (whole GPU, or the 8 GB card). A MultiGPU CFG Split row is also compared with its
one-GPU twin (speed-up, and whether its final latent is the same) and with the native split rows of its GPU count.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from comfyui_lowvram_dit.checkpoints.safe_write import write_report

if TYPE_CHECKING:
    from comfyui_lowvram_dit.benchmarks.server import ServerScenario

# Goals (Wan rows): whole GPU, pack vs native default and native's best; 8 GB card, pack vs native DynamicVRAM.
GOAL_VS_DEFAULT, GOAL_VS_BEST, GOAL_CAPPED = 1.6, 1.3, 1.0
NATIVE_DEFAULT = {None: "native_default", 8.0: "native_default_8gb"}
NATIVE_DYNAMIC_8GB = ("native_fp8fast_8gb", "native_default_8gb")




def _ok(r: dict) -> bool:
    return r.get("status") == "ok" and r.get("s_per_step") is not None


def _card(r: dict) -> float | None:
    return r["variant"]["card_gib"]


def _gpus(r: dict) -> int:
    return r["variant"].get("gpus", 1)  # rows recorded before split rows existed ran on one GPU


def _against(r: dict, other: dict) -> bool:
    """Whether ``r``'s ratios name ``other``: a native baseline, ``r``'s one-GPU twin, or for a split row a native
    split row over as many GPUs; always of the same card size."""
    if other["name"] == r["name"] or _card(other) != _card(r):
        return False
    split_native = _gpus(r) > 1 and _gpus(other) == _gpus(r) and other["variant"]["graph"] == "native"
    return other["variant"]["baseline"] or split_native or other["name"] == r["variant"].get("same_as")


def ratios(results: list[dict]) -> dict[str, dict[str, float]]:
    """``{row: {other row: other s/step / row s/step}}`` against native rows of the same card size (and for a split
    row its twin and the native split rows, see ``_against``)."""
    done = [r for r in results if _ok(r)]
    return {r["name"]: {n["name"]: round(n["s_per_step"] / r["s_per_step"], 3) for n in done if _against(r, n)}
            for r in done}


def best_native(results: list[dict], card: float | None) -> dict | None:
    """The fastest successful native row of one card size."""
    rows = [r for r in results if _ok(r) and r["variant"]["baseline"] and _card(r) == card]
    return min(rows, key=lambda r: r["s_per_step"]) if rows else None


def goals(results: list[dict]) -> list[dict]:
    """Each goal checked for every pack row it applies to: ratio, target, pass/fail, and the rows compared."""
    by_name = {r["name"]: r for r in results if _ok(r)}
    checks: list[dict] = []
    for r in (r for r in results if _ok(r) and r["variant"]["graph"] == "pack" and _gpus(r) == 1):
        card = _card(r)
        if card is None:
            pairs = [(by_name.get(NATIVE_DEFAULT[None]), GOAL_VS_DEFAULT, "native default"),
                     (best_native(results, None), GOAL_VS_BEST, "native's best")]
        else:
            pairs = [(by_name.get(n), GOAL_CAPPED, "native DynamicVRAM") for n in NATIVE_DYNAMIC_8GB]
        for native, target, label in [p for p in pairs if p[0] is not None]:
            ratio = round(native["s_per_step"] / r["s_per_step"], 3)
            checks.append({"row": r["name"], "against": native["name"], "label": label, "metric": "s/step",
                           "ratio": ratio, "target": target, "met": ratio >= target})
            if card is not None and r.get("peak_rss_hwm_gib") and native.get("peak_rss_hwm_gib"):
                checks.append({"row": r["name"], "against": native["name"], "label": label,
                               "metric": "peak RSS (VmHWM)", "ratio": round(r["peak_rss_hwm_gib"], 2),
                               "target": round(native["peak_rss_hwm_gib"], 2),
                               "met": r["peak_rss_hwm_gib"] <= native["peak_rss_hwm_gib"]})
    return checks


def _f(v: Any, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def probe_lines(results: list[dict]) -> list[str]:
    """Markdown of the in-server probe: model-call time per expert and where the profiled call's GPU time went."""
    rows = [(r["name"], label, p) for r in results for label, p in (r.get("probe") or {}).items() if "call_s" in p]
    if not rows:
        return []
    out = ["## Inside the server (Kernel Profile node)", "",
           "Model call = one sampler step's forward (cond + uncond batched), between two CUDA synchronisations; "
           "median of the calls after the first, the profiled call left out. GPU ms of the profiled call by kernel "
           "group; the attention kernel is the top kernel of that group.", "",
           "| variant | expert | call s (median) | calls | profiled call s | kernels ms | attention ms | matmul ms "
           "| quantize/cast ms | norm/elementwise ms | attention kernel |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, label, p in rows:
        calls = p["call_s"]
        timed = [t for i, t in enumerate(calls) if i and i != p.get("profiled_call")]
        prof = p.get("profile") or {}
        g = prof.get("groups_ms", {})
        attn = next((k["kernel"] for k in prof.get("top", []) if k["group"] == "attention"), "—")
        profiled = calls[p["profiled_call"]] if 0 <= p.get("profiled_call", -1) < len(calls) else None
        out.append(f"| {name} | {label} | {_f(statistics.median(timed), 3) if timed else '—'} | {len(calls)} | "
                   f"{_f(profiled, 3)} | {_f(prof.get('total_ms'), 1)} | {_f(g.get('attention'), 1)} | "
                   f"{_f(g.get('matmul'), 1)} | {_f(g.get('quantize/cast'), 1)} | {_f(g.get('norm/elementwise'), 1)} "
                   f"| `{attn[:90]}` |")
    return out + [""]


def _latent_check(check: dict | None) -> str:
    """One cell: whether a split row's final latent equals its twin's."""
    if not check:
        return "—"
    if check.get("error"):
        return check["error"]
    if check["identical"]:
        return "identical"
    return f"rel diff {check['rel_diff']:.3g}, max abs {check['max_abs']:.3g}"


def split_lines(results: list[dict]) -> list[str]:
    """Markdown of the MultiGPU CFG Split rows: s/step next to the one-GPU twin's of the same run, the speed-up, and
    the final latent against the twin's (bit-identical, or ||a-b||/||b|| and max |a-b|)."""
    rows = [r for r in results if r.get("variant") and r["variant"].get("same_as")]
    if not rows:
        return []
    by_name = {r["name"]: r for r in results}
    out = ["## MultiGPU CFG Split vs one GPU", "",
           "Each split row next to the same graph on one GPU (its twin); speed-up = twin s/step / split s/step; "
           "final latent: the split row's saved latent against the twin's.", "",
           ("| split row | GPUs | s/step | one-GPU row | its s/step | speed-up | split vs 1 GPU (final latent) "
            "| status |"),
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        twin = r["variant"]["same_as"]
        t = by_name.get(twin)
        speed = f"{t['s_per_step'] / r['s_per_step']:.2f}x" if t and _ok(t) and _ok(r) else "—"
        twin_sps = _f(t.get("s_per_step"), 3) if t else f"— ({twin} did not run)"
        out.append(f"| {r['name']} | {_gpus(r)} | {_f(r.get('s_per_step'), 3)} | {twin} | {twin_sps} | {speed} | "
                   f"{_latent_check(r.get('vs_one_gpu'))} | {r.get('status')}"
                   f"{': ' + r['error'][:160] if r.get('error') else ''} |")
    return out + [""]


def table_lines(rows: list[dict], rat: dict[str, dict[str, float]], first: str = "first step high/low s") -> list[str]:
    """The markdown table of ``rows``: s/step, ratios naming the native rows, first steps (column ``first``), tqdm
    average, wall, GPU and RSS peaks, status."""
    lines = [(f"| variant | what | s/step | speed-up vs native rows | {first} | tqdm avg s/step | wall s "
              "| GPU peak GiB (run / sampling) | RSS HWM GiB | anon GiB | status |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rs = ", ".join(f"{v:.2f}x vs {k}" for k, v in rat.get(r["name"], {}).items()) or "—"
        tq = [t["s_per_step"] * t["steps"] for t in r.get("tqdm", [])]
        steps = sum(t["steps"] for t in r.get("tqdm", []))
        first_s = "/".join(_f(x, 1) for x in r.get("first_step_s", [])) or "—"
        lines.append(f"| {r['name']} | {r.get('what', '')} | {_f(r.get('s_per_step'), 3)} | {rs} | {first_s} | "
                     f"{_f(sum(tq) / steps, 3) if steps else '—'} | {_f(r.get('wall_s'), 1)} | "
                     f"{_f(r.get('peak_gpu_gib'))} / {_f(r.get('peak_gpu_sampling_gib'))} | "
                     f"{_f(r.get('peak_rss_hwm_gib'))} | {_f(r.get('peak_rss_anon_gib'))} | "
                     f"{r.get('status')}{': ' + r['error'][:160] if r.get('error') else ''}"
                     f"{' (from ' + r['source'] + ')' if r.get('source') else ''} |")
    return lines


def markdown(results: list[dict], env: dict, settings: dict, title: str = "Wan 2.2 T2V-A14B",
             first: str = "first step high/low s") -> str:
    """The results as markdown: environment, settings, one table per card size, the probe, the goals."""
    rat = ratios(results)
    shown = {k: v for k, v in settings.items() if k not in ("model_files_gb", "variants", "model_write_s")}
    lines = [f"# {title} through a ComfyUI {env.get('comfyui_version', '?')} server", "",
             (f"- device: {env.get('device_name', '?')} ({env.get('vram_total_gib', '?')} GiB)"
              f"{' x' + str(env['gpu_count']) if (env.get('gpu_count') or 1) > 1 else ''}, driver "
              f"{env.get('driver', '?')}; torch {env.get('torch', '?')}, comfy-kitchen {env.get('comfy_kitchen', '?')}, "
              f"comfy-aimdo {env.get('comfy_aimdo', '?')}, Python {env.get('python', '?')}"),
             f"- pack: git {env.get('git_sha', '?')}; status: {env.get('git_status') or 'clean'}",
             "- settings: " + ", ".join(f"{k} {v}" for k, v in shown.items()),
             "- files (synthetic: random weights, real names; GB): " + ", ".join(
                 f"{k} {v}" for k, v in settings.get("model_files_gb", {}).items()),
             f"- command: `{env.get('command', '?')}`",
             ("- s/step: median of each sampler's steps after its first (websocket progress messages); first steps "
              "(model load, LoRA merge, compile, attention timing inside) apart; tqdm avg: ComfyUI's own average over "
              "all steps; GPU: the server process per nvidia-smi (context + cache), whole run / from the first sampler "
              "on; RSS: VmHWM and peak anonymous RSS of the server process"), ""]
    for card in dict.fromkeys(_card(r) for r in results if r.get("variant")):
        rows = [r for r in results if r.get("variant") and _card(r) == card]
        heading = "whole GPU" if card is None else f"{card:g} GB card (--reserve-vram = total - {card:g} GiB)"
        lines += [f"## {heading}", "", *table_lines(rows, rat, first), ""]
    lines += split_lines(results)
    lines += probe_lines(results)
    checks = goals(results)
    if checks:
        lines += ["## Goals", "", "| row | against | metric | value | target | met |", "|---|---|---|---|---|---|"]
        for c in checks:
            value = f"{c['ratio']:.2f}x" if c["metric"] == "s/step" else f"{c['ratio']:.2f} GiB"
            target = f">= {c['target']:.1f}x" if c["metric"] == "s/step" else f"<= {c['target']:.2f} GiB"
            lines.append(f"| {c['row']} | {c['against']} ({c['label']}) | {c['metric']} | {value} | {target} | "
                         f"{'yes' if c['met'] else 'NO'} |")
        lines.append("")
    return "\n".join(lines)


def plot(path: Path, results: list[dict], env: dict, title: str = "Wan 2.2 T2V-A14B 832x480x81") -> str | None:
    """Bars: s/step per row (left), peak GPU and peak RSS (right); returns a note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed"
    rows = [r for r in results if r.get("variant")]
    names = [r["name"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 2), sharey=True)
    colors = ["tab:purple" if _gpus(r) > 1 else "tab:gray" if r["variant"]["graph"] == "native" else "tab:blue"
              for r in rows]  # split rows apart
    sps = [r.get("s_per_step") or 0.0 for r in rows]
    for bar, r, v in zip(ax1.barh(names, sps, color=colors), rows, sps):
        ax1.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                 f" {v:.2f}" if _ok(r) else f" {r.get('status')}", va="center", fontsize=8)
    ax1.invert_yaxis()
    ax1.set_xlabel("seconds per sampler step (lower is better)")
    y = range(len(rows))
    ax2.barh([i - 0.2 for i in y], [r.get("peak_gpu_gib") or 0.0 for r in rows], height=0.4, color="tab:green",
             label="GPU peak (nvidia-smi)")
    ax2.barh([i + 0.2 for i in y], [r.get("peak_rss_hwm_gib") or 0.0 for r in rows], height=0.4, color="tab:orange",
             label="peak RSS (VmHWM)")
    ax2.set_xlabel("GiB")
    ax2.legend(fontsize=8)
    fig.suptitle(f"{title} via ComfyUI {env.get('comfyui_version', '?')} server — "
                 f"{env.get('device_name', '?')}, torch {env.get('torch', '?')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write(out_dir: Path, stem: str, results: list[dict], env: dict, settings: dict,
          scenario: ServerScenario | None = None) -> list[Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and ``<stem>.png`` into ``out_dir``; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    title = scenario.title if scenario else "Wan 2.2 T2V-A14B"
    first = "first step s" if scenario and len(scenario.sampler_nodes) == 1 else "first step high/low s"
    note = plot(out_dir / f"{stem}.png", results, env, title=title) if results else "no results"
    if note is None:
        paths.append(out_dir / f"{stem}.png")
    doc = {"bench": stem, "env": env, "settings": settings, "ratios": ratios(results), "goals": goals(results),
           "notes": [note] if note else [], "variants": results}
    if scenario is not None and scenario.summary is not None:
        doc["summary"] = scenario.summary(results)
    write_report(paths[0], json.dumps(doc, indent=1, default=str))
    write_report(paths[1], markdown(results, env, settings, title, first))
    return paths
