"""The render scenario's report: rows in the results index's common format, each compared with native's best of its
workflow and card (``against``, ``ratio`` = its warm render seconds / this row's) and on its final latents
(``||a - b|| / ||b||``), and a markdown table per workflow and card; written by ``report.write``."""

from __future__ import annotations

import json
from pathlib import Path

from comfyui_lowvram_dit.benchmarks import report
from comfyui_lowvram_dit.benchmarks.results_index import ROW_FIELDS
from comfyui_lowvram_dit.benchmarks.server import compare_latents
from comfyui_lowvram_dit.benchmarks.server_render_split import PARTS

KIND_LABEL = {"first_ever": "first-ever", "cold": "cold", "warm": "warm", "warm_new_prompt": "warm, new prompt"}
NATIVE = "native_best"
CACHED_NATIVE = {"EasyCache": "native_best_easycache"}  # step cache -> native's best with it (setup ids)
REFERENCE = ("native_default", "bf16")  # the 16-bit reference: setup and file format
COLUMNS = ("setup", "row", *(f"{label} s" for label in KIND_LABEL.values()), (  # a workflow and card's table
    "split of the warm render: load / text / sampling / decode / save / other s (each sampler's node total: its first "
    "+ n x median step; GiB it read from the disk)"), "s/step", "peak VRAM GiB", "peak RSS GiB",
    "output error vs native (; vs bf16)", "against", "status")
ROW_KEYS = (*ROW_FIELDS, "renders", "side", "how", "cfg", "lora", "status")  # every row's (None: not measured)


def finished_rows(path: Path) -> list[dict]:
    """The finished rows of an earlier report (``--resume``) with their server logs and the file they came from."""
    if not path.is_file():
        return []
    doc = json.loads(path.read_text(encoding="utf-8"))
    rows = [{**r, "source": r.get("source") or path.name} for r in doc.get("rows", []) if r.get("status") == "ok"]
    for r in rows:
        for life, log in zip(r.get("lives") or [], (doc.get("logs") or {}).get(r["name"], []), strict=False):
            life["log"] = log
    return rows


def native_row(row: dict, rows: list[dict]) -> dict | None:
    """The finished native's-best row of ``row``'s workflow, card and step cache (for a native row: none), if any."""
    if row.get("setup_id") == NATIVE:
        return None
    cached = row.get("step_cache") and row.get("side") != "native"
    want = CACHED_NATIVE[row["step_cache"].split(" (")[0]] if cached else NATIVE  # the cache, its threshold aside
    same = [r for r in rows if r.get("setup_id") == want and r.get("workflow") == row.get("workflow")
            and r.get("step_cache") == (row["step_cache"] if cached else None)
            and r.get("card_gib") == row.get("card_gib") and r is not row and r.get("status") == "ok"]
    mine = (row.get("dynamic_vram"), row.get("format"))  # the same memory manager and file format where one ran
    return min(same, key=lambda r: (r.get("dynamic_vram") != mine[0], r.get("format") != mine[1]), default=None)


def compare(rows: list[dict], latents: Path) -> list[dict]:
    """Each finished row gets ``against``, ``ratio`` and ``outputs_compared``: ``||a - b|| / ||b||`` of its kept
    latents and the other row's first-ever one (the earlier result when a file is gone); returns ``rows``."""
    for row in rows:
        row.update({key: row.get(key) for key in ROW_KEYS})  # every key, appended as None where it is missing
        if row.get("status") != "ok":
            continue
        native = native_row(row, rows)
        ref = min((r for r in rows if (r.get("setup_id"), r.get("format"), r.get("status")) == (*REFERENCE, "ok")
                   and r.get("workflow") == row.get("workflow") and r is not row),
                  key=lambda r: r.get("card_gib") != row.get("card_gib"), default=None)  # the same card first
        row["against"] = native["name"] if native else None
        warm = native.get("render_s") if native else None
        row["ratio"] = round(warm / row["render_s"], 3) if warm and row.get("render_s") else None
        old, checks = row.get("outputs_compared") or {}, {}
        pairs = {"vs_native": ("first_ever", native), "vs_bf16": ("first_ever", ref),  # (this row's render, against)
                 "cold_vs_first_ever": ("cold", row if "cold" in (row.get("renders") or {}) else None)}
        for key, (kind, other) in ((k, v) for k, v in pairs.items() if v[1]):
            a, b = latents / f"{row['name']}.{kind}.latent", latents / f"{other['name']}.first_ever.latent"
            against = f"{other['name']} (first_ever)"
            checks[key] = ({"against": against, **compare_latents(a, b)} if a.is_file() and b.is_file() else
                           old.get(key) or {"against": against, "error": "latent not kept in this run"})
        row["outputs_compared"] = checks
        row["error_vs_native"] = (checks.get("vs_native") or {}).get("rel_diff")
        row["error_vs_bf16"] = (checks.get("vs_bf16") or {}).get("rel_diff")
    return rows


def _seconds(row: dict, kind: str, native: dict | None) -> str:
    """One render's seconds, with native's seconds / these in brackets."""
    if not (r := (row.get("renders") or {}).get(kind)) or r.get("status") != "ok":
        return r.get("status", "?") if r else "—"
    n = ((native or {}).get("renders") or {}).get(kind) or {}
    ratio = f" ({n['total_s'] / r['total_s']:.2f}x)" if n.get("status") == "ok" and r.get("total_s") else ""
    spread = r.get("repeats_s") or []
    spread = f" [{min(spread):.1f}-{max(spread):.1f}, {len(spread)} renders]" if len(spread) > 1 else ""
    return f"{r['total_s']:.1f}{ratio}{spread}"


def _warm_split(row: dict) -> str:
    """The warm render's parts, each sampler's total (the firm part: the GPU runs behind the progress messages) with
    its first and median steps, and the steps EasyCache skipped."""
    w = (row.get("renders") or {}).get("warm") or (row.get("renders") or {}).get("first_ever") or {}
    if "total_s" not in w:
        return "—"
    parts = " / ".join(report.cell(w.get(k), "{:.1f}") for k in PARTS)
    steps = ", ".join((f"{s['node_s']:.1f}: " if s.get("node_s") else "") + report.cell(s["first_step_s"], "{:.1f}")
                      + (f" + {s['steps'] - 1} x {s['median_step_s']:.2f}"
                         if s["steps"] > 1 and s.get("median_step_s") else "")
                      + (f"; {s['disk_read_gib']:.1f} GiB read" if s.get("disk_read_gib") is not None else "")
                      for s in w.get("samplers", []) if s.get("steps"))
    read = f"; {w['disk_read_gib']:.1f} GiB read from the disk" if w.get("disk_read_gib") is not None else ""
    skipped = ", ".join(f"{k}/{n}" for k, n in w.get("easycache_skipped") or [])
    return ((f"{parts} ({steps})" if steps else parts) + read
            + (f"; EasyCache skipped {skipped} steps" if skipped else ""))


def step_clock(rows: list[dict]) -> str:
    """What the step times of these rows measure: device time where every server life synced the GPU before each
    progress message (benchmarks/step_sync), else the host's clock."""
    lives = [life for r in rows for life in r.get("lives", [])]
    if lives and all(life.get("step_sync") for life in lives):
        return " (each progress message after a GPU sync, so steps are device times)"
    return " (progress messages unsynced: a step's time is the host's, up to about a step off where nothing syncs)"


def _ram_text(rows: list[dict]) -> str:
    """How the machine's RAM was emulated for these rows (server_render --ram-gib), else nothing."""
    facts = next((r["ram_emulation"] for r in rows if r.get("ram_emulation")), None)
    if not facts:
        return ""
    return (f", a machine of {facts['ram_gib']:g} GiB RAM (emulated: {facts['locked_gib']} of this machine's "
            f"{facts['machine_gib']} GiB locked by a balloon process, the servers' psutil reporting "
            f"{facts['ram_gib']:g} GiB)")


def markdown(rows: list[dict], env: dict, settings: dict) -> list[str]:
    """The report as markdown: environment, what was timed, one table per workflow and card."""
    lines = report.header("Renders through a ComfyUI server: Queue to output file", env, [
        (f"renders: {', '.join(settings.get('renders', []))}; smoke: {settings.get('smoke')}; page cache: "
         f"{settings.get('page_cache')}"),
        ("first-ever: a fresh server with empty Triton / TorchInductor / CUDA caches and user folder; warm: the same "
        "graph, new seed (with --warm-repeats: the median render, their range in square brackets); warm, new "
        "prompt: new seed and prompt; cold: a fresh server keeping the first one's caches and user folder. Seconds "
        "from Queue (POST /prompt) until the output file is written; in brackets native's best seconds / these (the "
        "row in 'against'). Split from the websocket events" + step_clock(rows) + ": load = loader nodes + each "
        "sampler's first step above its median step; peak RSS: the server process's VmHWM (first render of a "
        "server) or sampled RSS; VRAM: the process per nvidia-smi. Output vs native: ||a - b|| / ||b|| of the final "
        "latents of the first-ever renders (same seed).")])
    group = lambda r: (r.get("title") or r.get("model") or "?", r.get("card_gib"))  # a table per workflow and card
    for title, card in dict.fromkeys(map(group, rows)):
        members = [r for r in rows if group(r) == (title, card)]
        members.sort(key=lambda r: (r.get("setup_id") != NATIVE, r.get("name")))
        first, cells = members[0], []
        facts = ", ".join(str(x) for x in (first.get("resolution"), first.get("frames") and f"{first['frames']} "
                                           "frames", first.get("steps") and f"{first['steps']} steps") if x)
        where = "whole GPU" if card is None else f"{card:g} GB card (--reserve-vram = total - {card:g} GiB)"
        for r in members:
            native = next((n for n in rows if n["name"] == r.get("against")), None)
            status = r.get("status", "?") + (f": {report.cell(r['error'])[:160]}" if r.get("error") else "")
            status += f" (from {r['source']})" if r.get("source") else ""
            checks = [(label, (r.get("outputs_compared") or {}).get(key) or {})  # vs native, vs the 16-bit reference
                      for key, label in (("vs_native", ""), ("vs_bf16", "bf16: "))]
            error = "; ".join(label + (report.cell(c["error"]) if c.get("error") else f"{c['rel_diff']:.3g}")
                              for label, c in checks if c.get("error") or c.get("rel_diff") is not None) or "—"
            cells.append([r.get("setup_id"), r["name"], *(_seconds(r, k, native) for k in KIND_LABEL), _warm_split(r),
                          *(report.cell(r.get(k), f) for k, f in (("s_per_step", "{:.3f}"), ("peak_vram_gib", "{:.2f}"),
                                                                  ("peak_rss_gib", "{:.2f}"))),
                          error, (native or {}).get("name", "—"), status])
        lines += [f"## {title}, {where}{_ram_text(members)}", "",
                  f"{facts}; in brackets: the 'against' row's seconds / the row's",
                  "", *report.table(COLUMNS, cells), ""]
    return lines


def write(out_dir: Path, stem: str, rows: list[dict], env: dict, settings: dict, latents: Path) -> list[Path]:
    """``<stem>.json`` (``env``, ``settings``, ``rows``, their server log digests as ``logs``) and ``<stem>.md``."""
    compare(rows, latents)
    logs = {r["name"]: [life.get("log", []) for life in r["lives"]] for r in rows if r.get("lives")}
    shown = [{**r, "lives": [{k: v for k, v in life.items() if k != "log"} for life in r["lives"]]}
             if r.get("lives") else r for r in rows]
    doc = {"scenario": "server_render", "env": env, "settings": settings, "rows": shown, "logs": logs}
    return report.write(out_dir, stem, doc, markdown(rows, env, settings))
