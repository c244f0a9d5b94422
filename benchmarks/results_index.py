"""The index of current results: benchmarks/results/INDEX.md, index.json and docs/by-card.md, from every result JSON
under benchmarks/results/ in the common format of benchmarks/README.md. Plain JSON: no ComfyUI, no torch."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

from comfyui_lowvram_dit.benchmarks.__main__ import SCENARIOS
from comfyui_lowvram_dit.benchmarks.report import RESULTS, cell, table
from comfyui_lowvram_dit.checkpoints.safe_write import write_report

BY_CARD = RESULTS.parents[1] / "docs" / "by-card.md"
SKIPPED_DIRS = ("investigations",)
COMMAND = "python -m comfyui_lowvram_dit.benchmarks.results_index"
MODELS = ("Wan 2.2 T2V-A14B", "Wan 2.2 TI2V-5B", "Qwen-Image", "Qwen-Image-Edit")
# Fields of a common-format row (benchmarks/README.md); `side`, `how`, `cfg`, `gpus`, `lora`, `status` are optional.
ROW_FIELDS = ("name", "model", "resolution", "frames", "steps", "card_gib", "file_format", "setup", "memory_manager",
              "s_per_step", "render_s", "peak_vram_gib", "peak_rss_gib", "against", "ratio")
ENV_FIELDS = ("device", "gpu", "torch", "comfyui", "comfy_kitchen", "commit", "date", "started", "command")
OPTIONAL = {"side": "pack", "how": "server", "cfg": None, "gpus": 1, "lora": None, "step_cache": None, "status": "ok",
            "dynamic_vram": None, "ram_gib": None}
FORMATS = ("fp8_scaled", "fp8_e4m3fn", "bf16")
CARDS = (8.0, 12.0, 16.0, 24.0)
# The run keys of a row: rows of one run that share these are one workload, compared with each other.
WORKLOAD = ("model", "resolution", "frames", "steps", "cfg", "card_gib", "gpus", "lora", "step_cache", "how",
            "dynamic_vram", "ram_gib")


def read(data: object, source: str) -> tuple[dict, list[dict]]:
    """(environment, setup rows) of one result file; no rows for a component (kernel) result. The environment: the
    index's fields of its ``env`` (older results' key names too), the commit short with ``-dirty`` kept."""
    env = data.get("env") or data.get("environment") if isinstance(data, dict) else None
    if not isinstance(env, dict):
        raise ValueError(f"{source}: not a result in the common format of benchmarks/README.md (top-level keys "
                         f"{sorted(data) if isinstance(data, dict) else type(data).__name__}); write it so, or move a "
                         "superseded file out of benchmarks/results/")
    rows = data.get("rows") if isinstance(data.get("rows"), list) else []
    setups = [{**{k: None for k in ROW_FIELDS}, **OPTIONAL, **r} for r in rows if isinstance(r, dict) and "setup" in r]
    gpu = env.get("gpu") or env.get("device_name") or (env.get("gpus") or [None])[0]
    commit = env.get("commit") or env.get("git_sha")
    return {"device": env.get("device") or ("cuda" if gpu else None), "gpu": gpu and gpu.removeprefix("NVIDIA "),
            "torch": env.get("torch"), "comfyui": env.get("comfyui") or env.get("comfyui_version"),
            "comfy_kitchen": env.get("comfy_kitchen"),
            "commit": commit and commit[:7] + ("-dirty" if commit.endswith("-dirty") else ""),
            "date": (env.get("date") or env.get("timestamp") or "")[:10] or None, "command": env.get("command"),
            "started": env.get("date") or env.get("timestamp")}, setups  # started: runs of one day in order


def _link_against(rows: list[dict]) -> None:
    """Give every row without one the fastest native row of its run and workload as ``against``, and the ratio."""
    key = lambda r: (r["run"], *(r[k] for k in WORKLOAD))  # rows of one run and workload: a group
    for group in ([r for r in rows if key(r) == k] for k in dict.fromkeys(map(key, rows))):
        timed = [r for r in group if r["status"] == "ok" and r["s_per_step"]]
        for row in timed:
            natives = [r for r in timed if r["side"] == "native" and r is not row]
            same_file = [r for r in natives if r["file_format"] == row["file_format"]]
            best = min(same_file or natives, key=lambda r: r["s_per_step"], default=None)
            if row["against"] is None and best is not None and (row["side"] == "pack" or
                                                                  best["s_per_step"] < row["s_per_step"]):
                row["against"] = best["name"]
            if row["against"] and row["ratio"] is None:
                base = next((r for r in group if r["name"] == row["against"] and r["s_per_step"]), None)
                row["ratio"] = round(base["s_per_step"] / row["s_per_step"], 3) if base else None


def collect(root: Path = RESULTS) -> tuple[list[dict], list[dict]]:
    """(setup rows, component entries) of every current result file under ``root``."""
    rows, components = [], []  # every result JSON: not investigations/, not the index, not workflow inputs
    for path in sorted(p for p in root.rglob("*.json") if p.name != "index.json" and not p.name.endswith(".api.json")
                       and not set(p.relative_to(root).parts[:-1]) & set(SKIPPED_DIRS)):
        rel = path.relative_to(root).as_posix()
        env, found = read(json.loads(path.read_text(encoding="utf-8")), rel)
        # the report: <stem>.md, else the README of the run's folder (a run reported by hand), else the JSON itself
        md = path.with_suffix(".md")
        reports = (md, *([path.parent / "README.md"] if path.parent != root else []))
        link = next((p for p in reports if p.is_file()), path).relative_to(root).as_posix()
        if not found:  # a component: what it measures is its report's title, else its scenario's description
            title = md.read_text(encoding="utf-8").splitlines()[0].lstrip("# ").strip() if md.is_file() else ""
            match = re.search(r"benchmarks(?: |\.|/)(\w+)", env.get("command") or "")
            name = match.group(1) if match else path.stem
            scenario = next((s for key, s in SCENARIOS.items() if name in (key, s.module)), None)
            what = title if " " in title else scenario.what if scenario else f"`{name}`"  # a title: a sentence
            components.append({"source": rel, "link": link, "what": what, **env})
            continue
        run = rel.removesuffix(".json")
        for row in found:
            rows.append({**row, **{k: row.get(k) or env.get(k) for k in ENV_FIELDS}, "source": rel, "link": link,
                         "run": run})
    _link_against(rows)
    order = {m: i for i, m in enumerate(MODELS)}
    rows.sort(key=lambda r: (order.get(r["model"], len(order)), r["model"], _neg_date(r), r["run"]))
    return rows, components


def _neg_date(row: dict) -> str:
    """A sort key that puts newer runs first (ISO times, YYYY-MM-DD... where a result gives only its day)."""
    return "".join(chr(0x7F - ord(c)) for c in row.get("started") or row.get("date") or "0")


def _fmt(value: object, digits: int = 3) -> str:
    """A cell (``report.cell``) with a float's trailing zeros cut."""
    return f"{value:.{digits}f}".rstrip("0").rstrip(".") if isinstance(value, float) else cell(value)


def _workload(row: dict) -> str:
    """Resolution x frames, steps and cfg as one cell."""
    size = row["resolution"] + (f"x{row['frames']}" if row["frames"] else "") if row["resolution"] else "—"
    steps = f"{row['steps']} steps" if row["steps"] else "one forward"
    extras = "".join(f", {row[k]}" for k in ("lora", "step_cache") if row[k])
    return f"{size}, {steps}, cfg {_fmt(row['cfg'])}{extras}"


def index_markdown(rows: list[dict], components: list[dict]) -> str:
    """INDEX.md: a section per model, a table per run (the heading is the run's anchor), then the components."""
    runs = {run: [r for r in rows if r["run"] == run] for run in dict.fromkeys(r["run"] for r in rows)}  # in order
    out = [
        "# Benchmark results: every current setup", "",
        f"Generated by `{COMMAND}` from every result file under `benchmarks/results/` (dated evidence of an "
        "investigation lives in `investigations/` and is not indexed); do not edit by hand. "
        f"{len(rows)} setups from {len(runs)} runs; each run's GPU, versions, date and commit are on the line under "
        "its heading (`index.json` carries them on every row). The fastest setup per card: "
        "[docs/by-card.md](../../docs/by-card.md); how they were measured: "
        "[docs/benchmarks.md](../../docs/benchmarks.md).",
        "",
        "- **s/step**: seconds per sampler step. *server*: through a real ComfyUI server, the median step after each "
        "sampler's first (websocket progress); *in process*: one forward through `apply_model` (cfg 1) in a fresh "
        "process; *workflow*: a shipped workflow end to end. **render s**: a whole render, where measured.",
        "- **card**: the GPU memory ComfyUI was given (`--reserve-vram` through a server, a hard cap in process). "
        "**VRAM**: server: the process's GPU memory (nvidia-smi, CUDA context included); in process: torch's "
        "reserved peak. **RAM**: peak RSS (VmHWM).",
        "- **ratio**: the `against` row's s/step over this row's (above 1: this row is faster); rows are only "
        "compared within one run (same GPU, same machine start). Without a given baseline, `against` is native's "
        "fastest row of the same workload and card in the run.", "",
    ]
    model = None
    for run, group in runs.items():
        if group[0]["model"] != model:
            model = group[0]["model"]
            out += [f"## {model}", ""]
        cells = [[r["name"] + ("" if r["status"] == "ok" else f" ({r['status']})"), r["side"], _fmt(r["setup"]),
                  _workload(r), ("whole GPU" if r["card_gib"] is None else f"{r['card_gib']:g} GB")
                  + (f" x{r['gpus']} GPUs" if r["gpus"] > 1 else ""),
                  r["file_format"], _fmt(r["memory_manager"]), _fmt(r["s_per_step"]), _fmt(r["render_s"], 1),
                  _fmt(r["peak_vram_gib"], 2), _fmt(r["peak_rss_gib"], 2), _fmt(r["against"]),
                  _fmt(r["ratio"], 2) + "x" if r["ratio"] else "—"] for r in group]
        r, gpus = group[0], max(x["gpus"] for x in group)  # under the heading: file, how, GPU, versions, date, commit
        versions = ", ".join(f"{name} {r[key]}" for name, key in (("ComfyUI", "comfyui"), ("torch", "torch"),
                                                                  ("comfy-kitchen", "comfy_kitchen")) if r[key])
        gpu = f"{gpus}x {r['gpu']}" if gpus > 1 and r["gpu"] else r["gpu"] or "GPU not recorded"
        line = (f"[{r['link']}]({r['link']}) · {r['how']} · {gpu} · {versions or 'versions not recorded'} · "
                f"{r['date'] or 'date not recorded'} · commit {r['commit'] or 'not recorded'}")
        out += [f"### {Path(run).name}", "", line, "", *table(
            ["row", "side", "setup", "workload", "card", "file", "memory", "s/step", "render s", "VRAM GiB", "RAM GiB",
             "against", "ratio"], cells), ""]
    out += ["## Kernels and correctness", "", "Results that measure a kernel or a property, not a setup.", "", *table(
        ["result", "what", "GPU", "ComfyUI", "torch", "date", "commit"],
        [[f"[{c['source'].removesuffix('.json')}]({c['link']})", c["what"], *(_fmt(c[k]) for k in (
            "gpu", "comfyui", "torch", "date", "commit"))] for c in components])]
    return "\n".join(out) + "\n"


def _how(row: dict) -> str:
    """How a row was measured, with the memory manager where ComfyUI's default was off and the RAM where emulated."""
    off = ", DynamicVRAM off" if row["dynamic_vram"] is False else ""
    ram = f", {_fmt(float(row['ram_gib']))} GiB RAM (emulated)" if row["ram_gib"] else ""
    return f"{row['how']}{off}{ram}"


def _by_card_rows(model: str, fmt: str, rows: list[dict]) -> list[list[str]]:
    """A cell's rows: per workload, the pack's fastest vs native's best in the newest run with both (else newest)."""
    runs: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        runs[(r["how"], r["resolution"], r["frames"], r["cfg"], r["lora"], r["step_cache"], r["dynamic_vram"] is False,
              r["ram_gib"] or 0)][r["run"]].append(r)
    metric = lambda r: r["render_s"] or r["s_per_step"]  # a row's rank: the render time users wait for, else s/step
    best = lambda g, side: min((r for r in g if r["side"] == side and r["status"] == "ok" and metric(r)), key=metric,
                               default=None)  # the fastest timed row of a side in a run

    def shown(row: dict | None) -> str:
        if row is None:
            return "—"
        if not row["render_s"]:
            return f"{_fmt(row['s_per_step'])} s/step"
        renders = row.get("renders") if row["step_cache"] else None  # its warm render's skips, else the first's
        render = isinstance(renders, dict) and (renders.get("warm") or next(iter(renders.values()), None))
        skipped = (render.get("easycache_skipped") if isinstance(render, dict) else None) or []
        skips = f", {row['step_cache']} skipped {sum(k for k, _ in skipped)}/{sum(n for _, n in skipped)} steps"
        step = f" ({_fmt(row['s_per_step'])} s/step{skips if skipped else ''})" if row["s_per_step"] else ""
        return f"{_fmt(row['render_s'], 1)} s render{step}"

    lines = []
    for key in sorted(runs, key=lambda k: tuple(str(x) for x in k)):
        newest = sorted(runs[key].values(), key=lambda g: _neg_date(g[0]))
        both = [g for g in newest if best(g, "pack") and best(g, "native")]
        pack, native = (best((both or newest)[0], side) for side in ("pack", "native"))
        if r := pack or native:
            where = f"{_how(r)}, {r['gpu'] or '—'}, ComfyUI {r['comfyui'] or '—'}, {r['date'] or '—'}"
            ratio = f"**{metric(native) / metric(pack):.2f}x**" if pack and native else "—"
            ram = f"{_fmt(pack and pack['peak_rss_gib'], 1)} / {_fmt(native and native['peak_rss_gib'], 1)}"
            anchor = Path(r["run"]).name  # GitHub's anchor of its heading in INDEX.md
            slug = re.sub(r"[^\w\- ]", "", anchor.strip().lower()).replace(" ", "-")
            lines.append([model, fmt, _workload(r), where, _fmt(pack and pack["setup"]), shown(pack),
                          _fmt(native and native["setup"]), shown(native), ratio, ram,
                          f"[{anchor}](../benchmarks/results/INDEX.md#{slug})"])
    return lines


def by_card_markdown(rows: list[dict]) -> str:
    """docs/by-card.md: per card size, model and file format, the fastest pack setup against native's best."""
    one_gpu = [r for r in rows if r["gpus"] == 1]
    cards = sorted({r["card_gib"] for r in one_gpu if r["card_gib"] is not None} | set(CARDS)) + [None]
    models = list(MODELS) + sorted({r["model"] for r in one_gpu} - set(MODELS))
    # beyond the three every model ships in, a format is listed for the models some row measured in it (a GGUF
    # file, Wan's fp16 files), not for every model
    extra = {m: sorted({r["file_format"] for r in one_gpu if r["model"] == m} - set(FORMATS)) for m in models}
    out = ["# The fastest setup for your card", "",
           f"Generated by `{COMMAND}` from [the results index](../benchmarks/results/INDEX.md); do not edit by hand. "
           "For each card size, model and model file format: the pack's fastest setup in the newest run that "
           "measured it, against native's best **in the same run** (same GPU, same machine start), per kind of "
           "measurement and workload. A synthetic file of that format was measured (random weights, real shapes). "
           "How: [benchmarks.md](benchmarks.md). One GPU only; two GPUs: "
           "[benchmarks.md](benchmarks.md#do-two-gpus-help).", ""]
    for card in cards:
        cells = []
        for model in models:
            for fmt in [*FORMATS, *extra[model]]:
                cell = [r for r in one_gpu if (r["card_gib"], r["model"], r["file_format"]) == (card, model, fmt)]
                cells += _by_card_rows(model, fmt, cell) or [[model, fmt, "not measured" + " |" * 8]]  # 8 empty cells
        out += [f"## {'Whole GPU' if card is None else f'{card:g} GB card'}", "", *table(
            ["model", "file", "workload", "how, GPU, ComfyUI, date", "fastest pack setup", "time", "native's best",
             "time", "pack vs native", "peak RAM GiB pack / native", "run"], cells), ""]
    return "\n".join(out).rstrip() + "\n"


def outputs(root: Path = RESULTS, by_card: Path = BY_CARD) -> dict[Path, str]:
    """Each generated file and the text it should hold."""
    rows, components = collect(root)
    data = {"generated_by": COMMAND, "rows": rows, "components": components}  # index.json
    return {root / "INDEX.md": index_markdown(rows, components),
            root / "index.json": json.dumps(data, indent=1, ensure_ascii=False) + "\n", by_card: by_card_markdown(rows)}


def main(argv: list[str] | None = None) -> int:
    """Write INDEX.md, index.json and docs/by-card.md; with --check, exit 1 (naming them) if any is stale."""
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.strip().splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated file is stale")
    args = parser.parse_args(argv)
    files = outputs()
    stale = [path for path, text in files.items() if not path.is_file() or path.read_text(encoding="utf-8") != text]
    if args.check:
        for path in stale:
            print(f"{path.name} is stale: run {COMMAND}", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        write_report(path, files[path])
    print(f"wrote {', '.join(p.name for p in stale)}" if stale else "already current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
