"""Scenario ``server_render``: whole renders, Queue to output file, through fresh ComfyUI servers (see the README)."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from comfyui_lowvram_dit.benchmarks import page_cache, ram_limit
from comfyui_lowvram_dit.benchmarks import report as reports
from comfyui_lowvram_dit.benchmarks import server
from comfyui_lowvram_dit.benchmarks import server_render_graphs as rg
from comfyui_lowvram_dit.benchmarks import server_render_models as models
from comfyui_lowvram_dit.benchmarks import server_render_report as report
from comfyui_lowvram_dit.benchmarks import step_sync
from comfyui_lowvram_dit.benchmarks.server_render_split import node_memory, split
from comfyui_lowvram_dit.checkpoints.safe_write import write_report
from comfyui_lowvram_dit.cli import server as cli_server
from comfyui_lowvram_dit.cli import workflow as cli_workflow
from comfyui_lowvram_dit.cli import workflow_models

RENDERS = ("first_ever", "warm", "warm_new_prompt", "cold")
SEED_OFFSET = {"first_ever": 0, "warm": 1, "warm_new_prompt": 2, "cold": 0}
REPEAT_SEED_STEP = 100  # each further warm render (--warm-repeats) adds this to the seed: never another kind's seed
CARDS = (8.0, 12.0, 16.0, 24.0, None)
FIXTURE_NODES = reports.PACK_ROOT / "tests" / "fixture_nodes"  # smoke only: the stand-in CLIPLoader
FIXTURE_FOLDER = "zz_lowvram_dit_test_nodes"
STEP_SYNC_NODES = reports.PACK_ROOT / "benchmarks" / "step_sync"  # every server: progress after a device sync
STEP_SYNC_FOLDER = "zz_lowvram_dit_bench_step_sync"
STAND_IN_CLIP = "LowVRAMTest_StreamedCLIPLoader"
CACHE_ENV = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor", "CUDA_CACHE_PATH": "cuda"}
# Rough seconds of one render on one H100/H200 (page cache warm) for --deadline, from the server scenarios' step
# times and walls at the workflows' steps and sizes: (first-ever or cold, warm: the models already loaded).
ESTIMATE_S = {"wan_t2v_4step": (40, 25), "wan_t2v": (220, 150), "wan_i2v": (220, 150), "wan_i2v_4step": (45, 28),
              "wan_ti2v_5b": (65, 60), "qwen_t2i_4step": (25, 5), "qwen_t2i": (70, 20), "qwen_edit": (90, 40)}
SMALL_CARD_FACTOR = 1.3  # 12 GB and less: weights streamed every step
SERVER_START_S = 20.0
OOM = re.compile(r"out of memory|OutOfMemory|OOM", re.IGNORECASE)
EASYCACHE_SKIPS = re.compile(r"EasyCache - skipped (\d+)/(\d+) steps")  # logged after each sampler, verbose or not
SMOKE_OUT = Path(tempfile.gettempdir()) / "server_render_smoke"
SMOKE_NATIVE = ("stock UNETLoader and CLIPLoader build Qwen-Image and Qwen2.5-VL at their full widths, which the tiny "
                "smoke files do not fill; the native rows need the full-size files")
EDIT_IMAGE = (1024, 1024)  # the Edit reference image: FluxKontextImageScale keeps 1024x1024 (1 MP)


@dataclass(frozen=True)
class RenderRow:
    """One measured configuration: workflow, setup, card, memory manager and file format."""

    name: str
    workflow: str  # a key of server_render_graphs.WORKFLOWS
    setup: str  # a key of server_render_graphs.SETUPS
    card_gib: float | None = None  # None: the whole GPU
    dynamic_vram: bool = True  # False: --disable-dynamic-vram
    file_format: str = "fp8_scaled"
    easycache_threshold: float | None = None  # EasyCache's reuse_threshold (None: its node's default)
    ram_gib: float | None = None  # the machine's RAM emulated (benchmarks/ram_limit.py); None: this machine's own

    @property
    def spec(self) -> rg.RenderWorkflow:
        """The row's workflow."""
        return rg.WORKFLOWS[self.workflow]

    def server_args(self, total_vram_gib: float) -> list[str]:
        """ComfyUI flags of this row on a GPU of ``total_vram_gib``."""
        setup = rg.SETUPS[self.setup]
        return server.server_flags(self.name, total_vram_gib, self.card_gib, setup.ck_attention, self.dynamic_vram,
                                   setup.cuda_graphs)


def make_row(workflow: str, setup: str, card: float | None, dynamic_vram: bool = True,
             file_format: str | None = None) -> RenderRow:
    """The row named ``<workflow>_<setup>_<card>[_legacy][_<format>]`` (default format and DynamicVRAM unnamed)."""
    wf = rg.WORKFLOWS[workflow]
    fmt = file_format or wf.default_format
    name = "_".join([workflow, setup, "whole" if card is None else f"{card:g}gb", *([] if dynamic_vram else ["legacy"]),
                     *([] if fmt == wf.default_format else [fmt])])
    return RenderRow(name, workflow, setup, card, dynamic_vram, fmt)


def all_rows() -> dict[str, RenderRow]:
    """Every valid row by name."""
    rows = [make_row(w, s, c, d, f) for w, wf in rg.WORKFLOWS.items() for s in rg.SETUPS for c in CARDS
            for d in (True, False) for f in wf.formats]
    return {r.name: r for r in rows if rg.setup_applies(r.spec, r.setup, r.file_format) is None}


# What most users run: Wan 2.2 T2V-A14B 4-step at 12 GB, 24 GB and the whole GPU, Qwen-Image 4-step at 12 and 24 GB.
DEFAULT_SETUPS = ("native_best", "pack", "pack_stream")
CORE = [make_row("wan_t2v_4step", s, c) for c in (12.0, 24.0, None) for s in DEFAULT_SETUPS]
CORE += [make_row("qwen_t2i_4step", s, c) for c in (12.0, 24.0) for s in ("native_best", "pack")]
CORE_RENDERS = ("first_ever", "cold", "warm")
GROUPS = {"core": [r.name for r in CORE]}


def parse_cards(spec: str | None) -> list[float | None] | None:
    """``12,24,whole`` -> [12.0, 24.0, None]; None when not given."""
    items = [s.strip().lower() for s in (spec or "").split(",") if s.strip()]
    return [None if i in ("whole", "none", "all") else float(i.removesuffix("gb")) for i in items] if spec else None


def pick_rows(opts: argparse.Namespace) -> list[RenderRow]:
    """The rows of ``--rows`` (a workflow or ``all`` expands over setups x cards x memory x formats), each once."""
    table, cards = all_rows(), parse_cards(opts.cards)
    setups = [s.strip() for s in opts.setups.split(",") if s.strip()]
    memory = [m.strip() == "on" for m in opts.memory.split(",") if m.strip()]
    formats = [f.strip() for f in opts.formats.split(",") if f.strip()] if opts.formats else [None]
    picked: list[RenderRow] = []
    for item in (s.strip() for s in opts.rows.split(",") if s.strip()):
        if item in GROUPS:
            picked += [table[n] for n in GROUPS[item] if cards is None or table[n].card_gib in cards]
        elif item in rg.WORKFLOWS or item == "all":
            keys = list(rg.WORKFLOWS) if item == "all" else [item]
            candidates = [make_row(w, s, c, d, f or rg.WORKFLOWS[w].default_format) for w in keys for c in
                          (cards or [12.0, 24.0, None]) for f in formats for d in memory for s in setups]
            picked += [r for r in candidates if r.name in table]
        elif item in table:
            picked.append(table[item])
        else:
            raise SystemExit(f"--rows: unknown {item!r}: a row name, a group ({', '.join(GROUPS)}), a workflow "
                             f"({', '.join(rg.WORKFLOWS)}) or all")
    threshold, ram = getattr(opts, "easycache_threshold", None), getattr(opts, "ram_gib", None)
    picked = [replace(r, name=f"{r.name}_ram{ram:g}gb", ram_gib=ram) if ram else r for r in picked]
    return [replace(r, easycache_threshold=threshold) if rg.SETUPS[r.setup].easycache else r
            for r in {r.name: r for r in picked}.values()]


def setup_text(row: RenderRow) -> str:
    """The row's nodes and options as a user would wire them."""
    wf, setup, what = row.spec, rg.SETUPS[row.setup], rg.SETUPS[row.setup].what
    source = f"workflows/{wf.shipped}.json" if wf.shipped else "the Qwen-Image-Edit 2509 graph"
    if row.file_format in rg.GGUF_TYPES:
        gguf = f"UnetLoaderGGUF (ComfyUI-GGUF) {rg.GGUF_TYPES[row.file_format]}"
        loader = "the Wan Loader" if wf.key.startswith("wan") else "the Qwen-Image Loader (+ Block Swap, Load VAE)"
        what = re.sub(r"UNETLoader [^,]+", gguf, what) if setup.native else f"{gguf} in place of {loader}, {what}"
    if row.easycache_threshold is not None:
        what = what.replace("EasyCache (its defaults)", step_cache(row))
    if setup.native:
        return f"native equivalent of {source}: {what}"
    if setup.drop_block_swap:
        return f"{source}, {what}"
    budget = wf.budgets[row.card_gib]
    return f"{source}, {what}, Block Swap budget {budget:g} GB" + ("" if budget else " (all free VRAM)")


def describe(row: RenderRow) -> str:
    """One line saying what a row runs."""
    where = "whole GPU" if row.card_gib is None else f"{row.card_gib:g} GB card"
    memory = "DynamicVRAM" if row.dynamic_vram else "legacy loading (--disable-dynamic-vram)"
    ram = f", a machine of {row.ram_gib:g} GiB RAM (emulated)" if row.ram_gib else ""
    return f"{row.spec.title}: {setup_text(row)}, {row.file_format} files, {memory}, {where}{ram}"


def memory_manager(row: RenderRow) -> str:
    """Who keeps the diffusion model's weights, as the results index names it (Block Swap always streams GGUF)."""
    setup = rg.SETUPS[row.setup]
    dynamic = row.dynamic_vram and row.file_format not in rg.GGUF_TYPES
    if setup.native or setup.drop_block_swap:
        return "DynamicVRAM" if dynamic else "ComfyUI legacy loading"
    if dynamic and row.spec.swaps_blocks and not setup.block_swap_mode:
        return "Block Swap auto"
    return "Block Swap"


def step_cache(row: RenderRow) -> str | None:
    """The row's step cache, its own workload (it changes the output); a threshold set apart from the default."""
    if not rg.SETUPS[row.setup].easycache:
        return None
    return "EasyCache" + (f" (reuse_threshold {row.easycache_threshold:g})" if row.easycache_threshold is not None
                          else "")


def head(row: RenderRow) -> dict:
    """The keys every record of ``row`` starts with (the results index's common row fields among them)."""
    wf, setup = row.spec, rg.SETUPS[row.setup]
    return {"name": row.name, "what": describe(row), "variant": asdict(row), "workflow": row.workflow,
            "title": wf.title, "model": wf.model, "shipped": f"workflows/{wf.shipped}.json" if wf.shipped else None,
            "setup": setup_text(row), "setup_id": row.setup, "side": "native" if setup.native else "pack",
            "how": "server", "card_gib": row.card_gib, "format": row.file_format,
            "file_format": wf.layout(row.file_format), "memory_manager": memory_manager(row),
            "dynamic_vram": row.dynamic_vram, "lora": "4-step LoRA" if "4step" in row.workflow else None,
            "step_cache": step_cache(row), "ram_gib": row.ram_gib, "files": rg.model_files(wf, row.file_format)}


@dataclass
class RunContext:
    """What every row of a run shares."""

    opts: argparse.Namespace
    models: models.ModelFiles
    total_vram_gib: float
    host_flags: str  # ComfyUI's comfy/cli_args.py source: which flags this host knows
    comfyui_version: str
    renders: tuple[str, ...]
    rows: list[RenderRow] = field(default_factory=list)
    disk_read_gbs: float | None = None  # --drop-page-cache: the disk's cold read speed, timed once models exist


def smoke_graph(graph: dict, native: bool) -> dict:
    """A graph shrunk for tiny models on the CPU (tiny VAE; native: the stand-in CLIPLoader for 2-layer encoders)."""
    graph = cli_workflow.apply_overrides(graph, cli_workflow.tiny_overrides(graph))
    workflow_models.swap_tiny_vaes(graph)
    for nid in rg.of_type(graph, "CLIPLoader") if native else ():
        graph[nid]["class_type"] = STAND_IN_CLIP
    return graph


def empty_images(graph: dict) -> dict:
    """Each LoadImage as a one-colour EmptyImage of the rendered size (hosts without PyAV); the same compute."""
    size = (graph_facts(graph)["resolution"] or "{}x{}".format(*EDIT_IMAGE)).split("x")
    for nid in rg.of_type(graph, "LoadImage"):
        graph[nid]["class_type"] = "EmptyImage"
        graph[nid]["inputs"] = {"width": int(size[0]), "height": int(size[1]), "batch_size": 1, "color": 0x5A7D9A}
    return graph


def build_graph(row: RenderRow, srv: cli_server.ComfyServer, opts: argparse.Namespace) -> dict:
    """The row's graph against the running server's node schemas (shrunk for --smoke, --empty-image applied)."""
    info = {t: i for t in rg.node_types_needed(row.spec) if (i := srv.object_info(t))}
    graph = rg.render_graph(row.spec, row.setup, row.card_gib, row.file_format, info, row.name)
    for n in rg.of_type(graph, "EasyCache") if row.easycache_threshold is not None else ():
        graph[n]["inputs"]["reuse_threshold"] = row.easycache_threshold
    graph = empty_images(graph) if opts.empty_image else graph
    return smoke_graph(graph, rg.SETUPS[row.setup].native) if opts.smoke else graph


def graph_facts(graph: dict) -> dict:
    """Resolution, frames and total steps the graph renders."""
    out: dict[str, Any] = {"resolution": None, "frames": None, "steps": None, "cfg": None}
    for n in graph.values():
        i = n["inputs"]
        if isinstance(i.get("width"), int) and isinstance(i.get("height"), int):
            out["resolution"] = f"{i['width']}x{i['height']}"
            out["frames"] = i.get("length") if isinstance(i.get("length"), int) else None
        if n["class_type"] in rg.SAMPLERS and isinstance(i.get("steps"), int):
            out["steps"], out["cfg"] = i["steps"], i.get("cfg")
    if out["resolution"] is None and rg.of_type(graph, "LoadImage"):
        out["resolution"] = "{}x{}".format(*EDIT_IMAGE)
    return out


def public(text: str, opts: argparse.Namespace) -> str:
    """Text as results may show it: the scratch folder as $WORK, ComfyUI's as <ComfyUI>, no other machine path."""
    return server.public(text, opts.comfyui, opts.work)


def render(srv: cli_server.ComfyServer, graph: dict, kind: str, timeout: float, output: Path, latents: Path,
           row: str, first_of_life: bool) -> dict:
    """One render: queued, waited for, split, its memory peaks and output files; failures recorded."""
    rec: dict[str, Any] = {"kind": kind, "status": "error", "seed_offset": SEED_OFFSET[kind]}
    try:
        run = server.run_prompt(srv, graph, timeout)
    except Exception as exc:  # noqa: BLE001 - a refused graph or a dead server is this render's result
        rec["error"] = reports.error_text(exc, 4000)
        return rec
    rec.update(split(run.events, graph, run.posted_at, run.wall_s))
    for nid, peaks in node_memory(run.events, run.watch.samples, run.watch.t0).items():
        rec["nodes"].get(nid, {}).update(peaks)  # which node raised the server's RSS, which one read the disk
    for sampler in rec["samplers"]:
        sampler["disk_read_gib"] = rec["nodes"].get(sampler["node"], {}).get("disk_read_gib")
    mem = run.watch.summary()
    rss = mem["peak_rss_hwm_gib"] if first_of_life else mem["peak_rss_sampled_gib"]  # VmHWM spans the life
    rec.update(peak_vram_gib=mem["peak_gpu_gib"], peak_rss_gib=rss, peak_rss_anon_gib=mem["peak_rss_anon_gib"],
               peak_rss_file_gib=mem["peak_rss_file_gib"], rss_hwm_gib=mem["peak_rss_hwm_gib"],
               disk_read_gib=mem["disk_read_gib"])
    if run.entry["status"]["status_str"] != "success":
        rec["error"] = cli_server.execution_error(run.entry) or str(run.entry["status"])
        return rec
    files = cli_workflow.output_files(run.entry, output)
    rec["outputs"] = [f.relative_to(output).as_posix() for f in files if f.is_file()]
    latent = next((f for f in files if f.suffix == ".latent" and f.is_file()), None)
    if latent is not None:
        latents.mkdir(parents=True, exist_ok=True)
        shutil.move(latent, latents / f"{row}.{kind}.latent")
    if not any(not f.endswith(".latent") for f in rec["outputs"]):
        rec["error"] = "the render finished but its output file is not there"
        return rec
    rec["status"] = "ok"
    return rec


def render_kind(srv: cli_server.ComfyServer, graph: dict, kind: str, opts: argparse.Namespace, base: Path, row: str,
                first_of_life: bool) -> dict:
    """One render, or for ``warm`` and ``warm_new_prompt`` the median of ``--warm-repeats`` (new seeds, and each new
    prompt another one; totals in run order in ``repeats_s``); stops at a failed render."""
    records: list[dict] = []
    for i in range(max(opts.warm_repeats, 1) if kind in ("warm", "warm_new_prompt") else 1):
        seen = len(srv.log_text())
        g = rg.with_new_prompt(graph, rg.NEW_PROMPT + f" ({i + 1})" * (i > 0)) if kind == "warm_new_prompt" else graph
        if opts.drop_page_cache:
            page_cache.evict(opts.models)
        r = render(srv, rg.with_seed(g, SEED_OFFSET[kind] + REPEAT_SEED_STEP * i), kind, opts.timeout,
                   base / "output", opts.work / "latents", row, first_of_life and i == 0)
        if skips := EASYCACHE_SKIPS.findall(srv.log_text()[seen:]):  # one line per sampler, in run order
            r["easycache_skipped"] = [[int(k), int(n)] for k, n in skips]
        records.append(r)
        if r["status"] != "ok":
            return r
    if len(records) == 1:
        return records[0]
    median = sorted(records, key=lambda r: r["total_s"])[(len(records) - 1) // 2]  # the lower one of an even count
    return {**median, "repeats_s": [r["total_s"] for r in records]}


def _life(ctx: RunContext, row: RenderRow, kinds: list[str], folder: Path, env: dict, flags: list[str],
          rec: dict, graph: dict | None) -> dict | None:
    """One server life: start, build the graph (first life), render ``kinds`` in order until one fails."""
    opts, base = ctx.opts, folder / "base"
    life: dict[str, Any] = {"renders": kinds}
    rec["lives"].append(life)
    t0 = time.monotonic()
    try:
        with cli_server.ComfyServer.start(opts.comfyui, base, cpu=opts.smoke, extra_args=flags, env=env,
                                          timeout=300) as srv:
            life["startup_s"] = round(time.monotonic() - t0, 1)
            if problems := cli_server.pack_import_problems(srv.log_text(),
                                                           base / "custom_nodes" / cli_server.REGISTRY_FOLDER_NAME):
                raise cli_server.RunError(f"the pack failed to import: {problems[0].strip()}")
            if graph is None:
                graph = build_graph(row, srv, opts)
                rec.update(graph_facts(graph))  # synthetic: Edit's reference image drawn (scaled to 1 MP anyway)
                cli_workflow.ensure_input_images(graph, base / "input", True, [cli_workflow.WORKFLOWS_DIR])
            for i, kind in enumerate(kinds):
                r = render_kind(srv, graph, kind, opts, base, row.name, i == 0)
                if r.get("error"):
                    r["error"] = public(r["error"], opts)
                rec["renders"][kind] = r
                print(f"   {kind}: {r['status']} {r.get('total_s')} s {r.get('error', '')[:200]}", flush=True)
                if r["status"] != "ok":
                    break
    except Exception as exc:  # noqa: BLE001 - a server that does not start is this row's result
        life["error"] = public(reports.error_text(exc, 4000), opts)
    log_path = base / "comfyui.log"
    if log_path.exists():
        text = log_path.read_text(errors="replace")
        life["step_sync"] = step_sync.LOG_LINE in text  # False: step times are host times (benchmarks/step_sync)
        life["log"] = [public(line, opts) for line in server.log_digest(text, 80)]
        if opts.keep_logs:
            write_report(opts.work / f"{row.name}.life{len(rec['lives'])}.log", text)
        log_path.unlink()
    return graph


def run_row(ctx: RunContext, row: RenderRow) -> dict:
    """Every render of one row, first-ever and warm ones in one server life, cold in the next."""
    opts, rec = ctx.opts, {**head(row), "status": "error", "renders": {}, "lives": []}
    later = ctx.rows[ctx.rows.index(row) + 1:] if row in ctx.rows else []
    folder = None
    try:
        ctx.models.prepare(row, later)
        if (opts.drop_page_cache or row.ram_gib) and ctx.disk_read_gbs is None:
            ctx.disk_read_gbs = page_cache.cold_read_gbs(opts.models)
        flags, rec["flags_left_out"] = row_flags(ctx, row)
        folder = opts.work / "rows" / row.name  # fresh: its own kernel caches, user folder and ComfyUI base dir
        shutil.rmtree(folder, ignore_errors=True)
        env = dict(os.environ)
        for var, sub in CACHE_ENV.items():
            (folder / "cache" / sub).mkdir(parents=True, exist_ok=True)
            env[var] = str(folder / "cache" / sub)
        (folder / "user").mkdir(parents=True)
        (opts.work / "frontend").mkdir(parents=True, exist_ok=True)
        nodes = {STEP_SYNC_FOLDER: STEP_SYNC_NODES, **({FIXTURE_FOLDER: FIXTURE_NODES} if opts.smoke else {})}
        if row.file_format in rg.GGUF_TYPES:
            if not (gguf := server.gguf_custom_nodes(sys.executable)):
                raise cli_server.RunError("ComfyUI-GGUF needs the gguf package in this Python: pip install gguf (on "
                                          "the GPU machine benchmarks/gpu_kit.sh puts it in .whl/)")
            nodes.update(gguf)
        base_flags = [*server.prepare_base(folder / "base", opts.models, nodes), "--user-directory",
                      str(folder / "user"), "--front-end-root", str(opts.work / "frontend")]
        rec["server_flags"] = [public(f, opts) for f in flags]
        lives = [[k for k in ("first_ever", "warm", "warm_new_prompt") if k == "first_ever" or k in ctx.renders],
                 [k for k in ("cold",) if k in ctx.renders]]
        with models.pack_copies_for(row, opts.models, "cpu" if opts.smoke else "cuda", rec), \
                _machine_ram(row, rec):
            env = ram_limit.server_env(env, row.ram_gib) if row.ram_gib else env
            rec["page_cache_evicted_gib"] = evict_at_row_start(opts, row)
            graph = None
            for kinds in filter(None, lives):
                if rec["lives"] and any(r["status"] != "ok" for r in rec["renders"].values()):
                    break  # the first life failed: a cold start of the same row would fail the same way
                graph = _life(ctx, row, kinds, folder, env, [*base_flags, *flags], rec, graph)
    except Exception as exc:  # noqa: BLE001 - one row's failure must not stop the others
        rec["error"] = public(reports.error_text(exc, 4000), opts)
    finally:
        if folder is not None and not opts.keep_logs:
            shutil.rmtree(folder, ignore_errors=True)
    return finish(rec, ctx.renders)


def evict_at_row_start(opts: argparse.Namespace, row: RenderRow) -> float | None:
    """On an emulated machine (--ram-gib) each row starts with its model files out of the page cache, so no row's
    first render finds what writing the models or the row before left there; GiB advised (None: not evicted)."""
    if not row.ram_gib or opts.drop_page_cache:  # --drop-page-cache evicts before every render anyway
        return None
    return round(page_cache.evict(opts.models) / (1 << 30), 1)


@contextmanager
def _machine_ram(row: RenderRow, rec: dict) -> Iterator[None]:
    """The row's servers on a machine of its --ram-gib (a balloon locks the rest; its facts go into ``rec``)."""
    if not row.ram_gib:
        yield
        return
    with ram_limit.emulated(row.ram_gib) as facts:
        rec["ram_emulation"] = facts
        print(f"   RAM: {facts['locked_gib']} GiB of {facts['machine_gib']} locked in {facts['lock_s']} s, "
              f"{row.ram_gib:g} GiB left to the servers", flush=True)
        yield


def row_flags(ctx: RunContext, row: RenderRow) -> tuple[list[str], list[str]]:
    """The row's ComfyUI flags this host knows (by their names in its cli_args.py), and the ones left out and why."""
    left = []
    if ctx.opts.smoke:  # no card, and ComfyUI exits at --use-ck-attention without a kitchen backend
        flags = server.server_flags(row.name, 0.0, None, False, row.dynamic_vram)
        if rg.SETUPS[row.setup].ck_attention:
            left.append("--use-ck-attention (no comfy-kitchen attention on the CPU)")
    else:
        flags = row.server_args(ctx.total_vram_gib)
    known = [f for f in flags if f.split("=")[0] in ctx.host_flags]
    return known, left + [f"{f} (not a flag of ComfyUI {ctx.comfyui_version})" for f in flags if f not in known]


def finish(rec: dict, renders: Sequence[str]) -> dict:
    """The row's status (ok when every asked render is), first error, headline numbers and peaks."""
    done = rec["renders"]
    asked = ["first_ever", *[k for k in renders if k != "first_ever"]]
    failed = [k for k in asked if done.get(k, {}).get("status") != "ok"]
    errors = [f"{k}: {done[k].get('error')}" for k in asked if k in done and done[k].get("error")]
    errors += [f"server: {life['error']}" for life in rec["lives"] if life.get("error")]
    if not failed:
        rec["status"] = "ok"
    elif not rec.get("error"):
        rec["error"] = "; ".join(errors) or f"not run: {', '.join(failed)}"
    if rec["status"] != "ok" and OOM.search(rec["error"]):
        rec["status"] = "oom"
    warm = done.get("warm", {})
    rec["render_s"] = warm.get("total_s") if warm.get("status") == "ok" else None
    rec["s_per_step"] = warm.get("s_per_step")
    ok = [r for r in done.values() if r.get("status") == "ok"]
    for key in ("peak_vram_gib", "peak_rss_gib"):
        rec[key] = max((r[key] for r in ok if r.get(key) is not None), default=None)
    return rec


def estimate_s(ctx: RunContext, row: RenderRow) -> float:
    """Seconds the row should take (--deadline): renders, server starts, writing its missing model files."""
    if ctx.opts.reserve_estimate:
        return ctx.opts.reserve_estimate
    factor = SMALL_CARD_FACTOR if row.card_gib is not None and row.card_gib <= 12 else 1.0
    lives = 1 + ("cold" in ctx.renders)  # first-ever always runs
    warm = (("warm" in ctx.renders) + ("warm_new_prompt" in ctx.renders)) * ctx.opts.warm_repeats
    first_s, warm_s = ESTIMATE_S[row.workflow]
    seconds = (first_s * lives + warm_s * warm) * factor + SERVER_START_S * lives
    if ctx.models.write:
        missing = ctx.models.missing(rg.model_files(row.spec, row.file_format))
        seconds += sum(models.file_gb(n) for n in missing) / models.WRITE_GB_PER_S
    return seconds


def run_all(ctx: RunContext, written: Callable[[list[dict]], object], results: list[dict], started: float) -> None:
    """Each row into ``results``, ``written`` after each; from the first that --deadline leaves no time for, it and
    every later row are skipped (so --resume goes on in order, and no later row replaces a skipped row's files)."""
    stopped = False
    for row in ctx.rows:
        elapsed, deadline = time.monotonic() - started, ctx.opts.deadline
        stopped = stopped or bool(deadline and elapsed + estimate_s(ctx, row) > deadline)
        if stopped:
            print(f"skip {row.name}: {elapsed:.0f} s used of the {deadline:.0f} s deadline", flush=True)
            results.append({**head(row), "status": "skipped", "error": "not started: time budget"})
            continue
        print(f"== {row.name}: {describe(row)}", flush=True)
        results.append(rec := run_row(ctx, row))
        print(f"   {rec['status']} render_s={rec.get('render_s')} {rec.get('error', '')[:300]}", flush=True)
        written(results)


def parser() -> argparse.ArgumentParser:
    """The scenario's options."""
    p = argparse.ArgumentParser(prog="python -m comfyui_lowvram_dit.benchmarks server_render",
                                description=__doc__.strip().splitlines()[0])
    p.add_argument("--comfyui", type=Path, default=os.getenv("COMFYUI_PATH"), help="ComfyUI checkout ($COMFYUI_PATH)")
    p.add_argument("--models", type=Path, help="folder of diffusion_models/ text_encoders/ vae/ loras/ (default "
                   "with --smoke: <work>/models)")
    p.add_argument("--rows", default="core", help=f"comma list of row names, groups (core), workflows "
                   f"({', '.join(rg.WORKFLOWS)}) or all")
    p.add_argument("--cards", help="cards in GiB or 'whole', e.g. 12,24,whole (a workflow's default); filters groups")
    p.add_argument("--setups", default=",".join(DEFAULT_SETUPS), help=f"for workflows: {', '.join(rg.SETUPS)}")
    p.add_argument("--formats", help="for workflows: fp8_scaled, bf16 (the 16-bit files), pack_fp8 (the Wan Loader's "
                   "saved fp8 copy); default each workflow's own")
    p.add_argument("--memory", default="on", help="for workflows: DynamicVRAM on, off (--disable-dynamic-vram), on,off")
    p.add_argument("--renders", help=f"among {', '.join(RENDERS)} (first_ever always runs); default "
                   f"{','.join(CORE_RENDERS)} for core, all four otherwise")
    p.add_argument("--write-models", action="store_true", help="write missing full-size synthetic files as needed")
    p.add_argument("--free-disk", action="store_true", help="with --write-models: first delete synthetic files no "
                   "later row loads (Wan's before Qwen-Image's)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny synthetic files, 64 px, 5 frames, 2 steps, no card")
    p.add_argument("--empty-image", action="store_true", help="image inputs as a one-colour EmptyImage, not LoadImage "
                   "(a ComfyUI without PyAV, which decodes loaded images)")
    p.add_argument("--deadline", type=float, default=0.0, help="seconds from start; no row starts that would not end "
                   "in time (skipped rows are recorded)")
    p.add_argument("--reserve-estimate", type=float, default=0.0, help="seconds a row is assumed to take (default: "
                   "by workflow, card and renders)")
    p.add_argument("--warm-repeats", type=int, default=1, help="warm renders (and new prompts) per row, new seeds; "
                   "reported as median and range (one render of a few seconds is noisy)")
    p.add_argument("--easycache-threshold", type=float, help="EasyCache rows: its reuse_threshold (default: the "
                   "node's, which skips no step of random synthetic weights)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one render may take")
    p.add_argument("--out", type=Path, help="for json/md (default benchmarks/results/render; with --smoke "
                   f"{SMOKE_OUT}, never the results the index reads)")
    p.add_argument("--stem", help="result file name stem (default: the --rows text)")
    p.add_argument("--work", type=Path, help="scratch folder (default: a temp dir, removed after)")
    p.add_argument("--resume", action="store_true", help="keep the finished rows of <out>/<stem>.json, run the rest")
    p.add_argument("--keep-logs", action="store_true", help="keep each server log and row folder in the work folder")
    p.add_argument("--drop-page-cache", action="store_true", help="before every render, drop the model files from "
                   "the page cache (no root needed): they are read from the disk, as on a machine whose RAM cannot "
                   "cache them (RAM size itself is not emulated); the disk's read speed goes into the report")
    p.add_argument("--ram-gib", type=float, help="emulate a machine of this much RAM (Linux, root or CAP_IPC_LOCK): "
                   "a balloon process locks the rest while each row's servers run, and their psutil reports this "
                   "total (benchmarks/ram_limit.py); rows are named <row>_ram<N>gb")
    p.add_argument("--git-sha", help="pack commit to record (default: git rev-parse here)")
    return p


def video_problem(rows: list[RenderRow]) -> str | None:
    """Why rows that save video would fail at their last node here (PyAV is the GPU kit's stub), else None."""
    try:
        import av
    except ImportError:
        return None
    shipped = {r.workflow: r.spec.shipped for r in rows if r.spec.shipped}  # each workflow file read once
    video = sorted(w for w, name in shipped.items() if "SaveVideo" in rg.ui_node_types(rg.shipped_workflow(name)))
    if not video or not str(getattr(av, "__version__", "")).endswith("+stub"):
        return None
    return (f"--rows: {', '.join(video)} save video (SaveVideo), and PyAV here is the stub of benchmarks/gpu_kit.sh: "
            "every render would fail at its last node. Fill the kit with `bash benchmarks/gpu_kit.sh --av`")


def _prepare(opts: argparse.Namespace) -> tuple[list[RenderRow], tuple[str, ...], bool]:
    """Checked options: the rows, the render kinds and whether the work folder is this run's own."""
    if opts.comfyui is None or not (Path(opts.comfyui) / "main.py").is_file():
        raise SystemExit("--comfyui: no ComfyUI checkout given (or COMFYUI_PATH); point it at the folder with main.py")
    if opts.smoke and opts.write_models:
        raise SystemExit("--smoke writes tiny files and --write-models full-size ones: pick one")
    rows = pick_rows(opts)
    if problem := video_problem(rows):
        raise SystemExit(problem)
    if opts.drop_page_cache and not page_cache.supported():
        raise SystemExit("--drop-page-cache: this system has no posix_fadvise (Linux only)")
    kinds = tuple(k.strip() for k in (opts.renders or (",".join(CORE_RENDERS) if opts.rows == "core" else
                                                        ",".join(RENDERS))).split(",") if k.strip())
    if unknown := [k for k in kinds if k not in RENDERS]:
        raise SystemExit(f"--renders: unknown {', '.join(unknown)}; known: {', '.join(RENDERS)}")
    own_work = opts.work is None
    opts.work = (opts.work or Path(tempfile.mkdtemp(prefix="bench_render_"))).resolve()
    if opts.models is None:
        if not opts.smoke:
            raise SystemExit("--models: the folder with diffusion_models/ text_encoders/ vae/ loras/ is needed")
        opts.models = opts.work / "models"
    for folder in cli_server.MODEL_FOLDERS:
        (opts.models / folder).mkdir(parents=True, exist_ok=True)
    opts.out = opts.out or (SMOKE_OUT if opts.smoke else reports.RESULTS / "render")
    opts.stem = opts.stem or (opts.rows if opts.rows.replace("_", "").isalnum() else "server_render")
    return rows, kinds, own_work


def page_cache_note(drop: bool, disk_read_gbs: float | None, ram_gib: float | None = None) -> str:
    """What the report says of the page cache (with --drop-page-cache or --ram-gib: the disk's measured speed)."""
    speed = "not measured (no row ran)" if disk_read_gbs is None else f"{disk_read_gbs:.2f} GB/s"
    if ram_gib and not drop:
        return (f"bounded by the emulated {ram_gib:g} GiB and emptied of the model files at each row's start: each "
                "row's first render reads them from the disk, later ones find what fitted beside the servers, the "
                f"rest read again from the disk, which read one file at {speed} (1 GiB, cold)")
    if not drop:
        return "not dropped: files written or read earlier in the run come from RAM"
    return ("dropped before every render (posix_fadvise DONTNEED on every file under the models folder; pages a "
            f"server has mapped stay): model files come from the disk, which read one at {speed} (1 GiB, cold)")


def main(argv: list[str] | None = None) -> int:
    """Run the chosen rows; the reports are rewritten after every row."""
    opts = parser().parse_args(argv)
    started = time.monotonic()
    rows, kinds, own_work = _prepare(opts)
    env = reports.environment("comfyui_lowvram_dit.benchmarks.server_render", argv, comfyui=opts.comfyui)
    gpu = server.gpu_facts()  # as nvidia-smi names it: this process never starts CUDA
    env.update(device="cpu" if opts.smoke or not gpu else "cuda", gpu=gpu.get("device_name"),
               vram_total_gib=gpu.get("vram_total_gib"), driver=gpu.get("driver"), commit=opts.git_sha or env["commit"])
    host = (Path(opts.comfyui) / "comfy" / "cli_args.py").read_text(encoding="utf-8", errors="replace")
    ctx = RunContext(opts, models.ModelFiles(opts.models, opts.write_models, opts.free_disk),
                     env.get("vram_total_gib") or 0.0, host, env.get("comfyui") or "?", kinds)
    settings = {"renders": list(kinds), "smoke": opts.smoke, "empty_image": opts.empty_image,
                "rows": [r.name for r in rows]}
    results = report.finished_rows(opts.out / f"{opts.stem}.json") if opts.resume else []
    done = {r["name"] for r in results}
    for row in [r for r in rows if r.name not in done]:  # a smoke run skips what the tiny files cannot run
        reason = None
        if opts.smoke and row.workflow == "qwen_edit":
            reason = "the Edit graphs need the full-size vision tower; the smoke covers Wan and Qwen-Image t2i"
        elif opts.smoke and row.workflow.startswith("qwen") and rg.SETUPS[row.setup].native:
            reason = SMOKE_NATIVE
        if reason:
            results.append({**head(row), "status": "skipped", "error": reason})
        else:
            ctx.rows.append(row)
    if opts.smoke:
        models.write_smoke_models(ctx.rows, opts.models)

    def written(records: list[dict]) -> list[Path]:
        settings["model_write_s"], settings["model_files_deleted"] = ctx.models.took, ctx.models.freed
        settings["page_cache"] = page_cache_note(opts.drop_page_cache, ctx.disk_read_gbs, opts.ram_gib)
        return report.write(opts.out, opts.stem, records, env, settings, opts.work / "latents")

    run_all(ctx, written, results, started)
    paths = written(results)
    if own_work and not opts.keep_logs:
        shutil.rmtree(opts.work, ignore_errors=True)
    print(paths[1].read_text(encoding="utf-8"))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if any(r.get("status") == "ok" for r in results) else 1
