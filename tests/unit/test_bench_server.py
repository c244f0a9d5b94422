"""The render scenario's server side on the CPU, without ComfyUI (benchmarks/server.py): a row's flags, step and
node times from websocket events (server_render_split.py), the log digest, paths kept out of the record; and the
schema check (``_problems``) the render graphs are validated with here and against a live server."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from comfyui_lowvram_dit.benchmarks import server as run
from comfyui_lowvram_dit.benchmarks import server_render_graphs as rg
from comfyui_lowvram_dit.benchmarks.server_render_split import node_memory, node_times, sampler_steps

TESTS = Path(__file__).resolve().parents[1]
# + ComfyUI-GGUF's loader as /object_info lists it (tests/vendor/ComfyUI-GGUF/nodes.py: a combo of the .gguf files)
OBJECT_INFO = {**json.loads((TESTS / "object_info-0.8.0.schema.json").read_text()),
               **json.loads((TESTS / "pack_object_info.json").read_text()),
               "UnetLoaderGGUF": {"input": {"required": {"unet_name": [[]]}}, "input_order": {"required": ["unet_name"]},
                                  "output": ["MODEL"], "output_name": ["MODEL"], "display_name": "Unet Loader (GGUF)"}}
FILE_INPUTS = {"unet_name", "clip_name", "vae_name", "lora_name"}


def _input_spec(schema_inputs: dict, key: str, values: dict) -> list | None:
    """The spec of input ``key``; a dotted key (``format.codec``: a widget of a dynamic combo's chosen option, as
    0.33.0's Save Video has) is looked up in the option its combo chose in ``values``."""
    specs = {**schema_inputs.get("required", {}), **schema_inputs.get("optional", {})}
    head, dot, rest = key.partition(".")
    if not dot or key in specs:
        return specs.get(key)
    spec = specs.get(head) or []
    options = spec[1].get("options") or [] if len(spec) > 1 and spec[0] == "COMFY_DYNAMICCOMBO_V3" else []
    chosen = next((o for o in options if o.get("key") == values.get(head)), None)
    sub_values = {k[len(head) + 1:]: v for k, v in values.items() if k.startswith(f"{head}.")}
    return None if chosen is None else _input_spec(chosen.get("inputs") or {}, rest, sub_values)


def _problems(graph: dict, object_info: dict | None = None) -> list[str]:
    """Every way ``graph`` would fail ComfyUI's prompt validation that the schemas (``object_info``: a server's
    /object_info; default the 0.8.0 snapshot + the pack's nodes) can tell."""
    schemas = OBJECT_INFO if object_info is None else object_info
    out = []
    for nid, node in graph.items():
        info = schemas.get(node["class_type"])
        if info is None:
            out.append(f"{nid}: unknown node {node['class_type']}")
            continue
        req = info["input"].get("required", {})
        out += [f"{nid}: missing {k}" for k in req if k not in node["inputs"]]
        for key, value in node["inputs"].items():
            spec = _input_spec(info["input"], key, node["inputs"])
            if spec is None:
                out.append(f"{nid}: unknown input {key}")
            elif isinstance(value, list):
                src = graph.get(value[0])
                if src is None:
                    out.append(f"{nid}.{key}: link to missing node {value[0]}")
                elif src["class_type"] in schemas and schemas[src["class_type"]]["output"][value[1]] != spec[0]:
                    out.append(f"{nid}.{key}: {src['class_type']} output {value[1]} is not {spec[0]}")
            elif key not in FILE_INPUTS:
                options = spec[0] if isinstance(spec[0], list) else (spec[1].get("options") if spec[0] == "COMBO"
                                                                      else None)
                if options is not None and value not in options:
                    out.append(f"{nid}.{key}: {value!r} not in {options}")
    return out


def test_server_flags() -> None:
    assert run.server_flags("a", 79.65, None) == []
    assert run.server_flags("a", 79.65, None, ck_attention=True) == ["--use-ck-attention"]
    assert run.server_flags("a", 79.65, 8.0) == ["--reserve-vram=71.65"]
    assert run.server_flags("a", 79.65, 8.0, dynamic_vram=False) == ["--disable-dynamic-vram", "--reserve-vram=71.65"]
    with pytest.raises(ValueError, match="drop the capped variants"):
        run.server_flags("a", 8.0, 8.0)


def test_schema_check_catches_a_broken_graph() -> None:
    graph = {"1": rg.node("UNETLoader", "u", unet_name="x.safetensors", weight_dtype="fp9"),
             "2": rg.node("KSampler", "k", model=["1", 0], positive=["9", 0], bogus=1)}
    found = _problems(graph)
    assert any(p.startswith("1.weight_dtype: 'fp9' not in") for p in found), found
    assert "2.positive: link to missing node 9" in found and "2: unknown input bogus" in found
    assert "2: missing seed" in found and _problems({"1": rg.node("NoSuchNode", "n")}) == ["1: unknown node NoSuchNode"]


def _ev(t: float, kind: str, **data: object) -> tuple[float, dict]:
    return (t, {"type": kind, "data": data})


EVENTS = [
    _ev(0.0, "execution_start"), _ev(0.1, "executing", node="11"), _ev(5.0, "executing", node="15"),
    _ev(9.0, "progress", node="15", value=1, max=4), _ev(9.0, "progress", node="11", value=1, max=1),
    _ev(11.5, "progress", node="15", value=2, max=4), _ev(11.6, "progress", node="15", value=2, max=4),
    _ev(12.0, "executing", node="16"), _ev(20.0, "progress", node="16", value=3, max=4),
    _ev(22.0, "progress", node="16", value=4, max=4), _ev(22.5, "executing", node=None),
]


def test_step_times_from_progress_events() -> None:
    hi, lo = sampler_steps(EVENTS, "15"), sampler_steps(EVENTS, "16")
    assert {k: hi[k] for k in ("steps", "first_step_s", "later_steps_s", "load_part_s")} == {
        "steps": 2, "first_step_s": 4.0, "later_steps_s": [2.5], "load_part_s": 1.5}
    assert lo["first_step_s"] == 8.0 and lo["later_steps_s"] == [2.0]
    none = sampler_steps(EVENTS, "99")
    assert (none["steps"], none["first_step_s"], none["later_steps_s"], none["median_step_s"]) == (0, None, [], None)


def test_node_times() -> None:
    assert node_times(EVENTS) == {"11": 4.9, "15": 7.0, "16": 10.5}


def test_node_memory_takes_the_samples_inside_each_node() -> None:
    gib = 1 << 30
    t0 = 100.0  # the watch's clock starts earlier than the events' (monotonic seconds 100 + t)
    events = [(t0 + t, m) for t, m in EVENTS]
    samples = [{"t": t, "anon": a * gib, "file": 2 * gib} for t, a in
               ((0.05, 30), (3.0, 36), (4.95, 35), (6.0, 37), (11.0, 36.5), (15.0, 38), (22.0, 37.5), (23.0, 99))]
    mem = node_memory(events, samples, t0)
    assert mem == {"11": {"anon_peak_gib": 36.0, "file_peak_gib": 2.0, "anon_end_gib": 35.0},
                   "15": {"anon_peak_gib": 37.0, "file_peak_gib": 2.0, "anon_end_gib": 36.5},
                   "16": {"anon_peak_gib": 38.0, "file_peak_gib": 2.0, "anon_end_gib": 37.5}}
    assert node_memory(events, samples[:1], t0) == {}  # no sample inside any node


def test_node_memory_counts_each_nodes_disk_reads_from_the_samples_around_it() -> None:
    """A node's reads run from the last sample before it to the first after it; a node that ran twice sums them."""
    gib = 1 << 30
    t0 = 100.0
    events = [(t0 + t, m) for t, m in EVENTS]  # nodes 11: 0.1-5.0, 15: 5.0-12.0, 16: 12.0-22.5 s
    reads = ((0.05, 0.0), (3.0, 1.0), (4.95, 1.5), (6.0, 4.0), (11.0, 4.0), (15.0, 4.25), (22.0, 4.25), (23.0, 6.0))
    samples = [{"t": t, "anon": gib, "file": gib, "disk": int(r * gib)} for t, r in reads]
    mem = node_memory(events, samples, t0)
    assert {n: m["disk_read_gib"] for n, m in mem.items()} == {"11": 4.0, "15": 2.75, "16": 2.0}
    twice = events + [(t0 + 22.6, {"type": "executing", "data": {"node": "11"}}),
                      (t0 + 22.9, {"type": "executing", "data": {"node": None}})]
    samples.append({"t": 22.7, "anon": gib, "file": gib, "disk": int(5 * gib)})
    samples.sort(key=lambda s: s["t"])
    assert node_memory(twice, samples, t0)["11"]["disk_read_gib"] == 4.0 + 1.75  # 4.25 -> 6.0 the second time
    unread = [{k: v for k, v in s.items() if k != "disk"} for s in samples]  # /proc/<pid>/io unreadable
    assert all("disk_read_gib" not in m for m in node_memory(events, unread, t0).values())


LOG_033 = ("got prompt\n  0%|          | 0/2 [00:00<?, ?it/s]\r 50%|█████     | 1/2 [00:06<00:06,  6.47s/it]\r"
           "\x1b[32m[INFO]\x1b[0m lowvram_dit attention auto -> SDPA cuDNN\nPrompt executed in 45.20 seconds\n")


def test_log_digest_drops_colours_and_bars() -> None:
    assert run.log_digest(LOG_033) == ["[INFO] lowvram_dit attention auto -> SDPA cuDNN", "Prompt executed in 45.20 seconds"]


def test_log_lines_and_flags_name_no_machine_path(tmp_path: Path) -> None:
    comfyui, work = tmp_path / "comfy", tmp_path / "work"
    header = (f"# comfyui_lowvram_dit: ComfyUI log: {sys.executable} {comfyui}/main.py --base-directory "
              f"{work}/bench_row_x1 --user-directory {work}/user")
    assert run.public(header, comfyui, work) == (
        "# comfyui_lowvram_dit: ComfyUI log: python3 <ComfyUI>/main.py --base-directory $WORK/bench_row_x1 "
        "--user-directory $WORK/user")
    assert run.public(f"{work}/user", comfyui, work) == "$WORK/user"


def test_base_folder_links_this_pack(tmp_path: Path) -> None:
    flags = run.prepare_base(tmp_path / "base", tmp_path / "models")
    assert (tmp_path / "base" / "custom_nodes" / "comfyui-lowvram-dit").resolve() == run.report.PACK_ROOT
    assert flags[0] == "--extra-model-paths-config" and Path(flags[1]).is_file()
    assert flags[2:] == ["--output-directory", str(tmp_path / "base" / "output")]


def test_a_reused_base_folder_links_this_checkout(tmp_path: Path) -> None:
    """--resume reuses a row's base folder: a link left there to another checkout (or a deleted one, where ComfyUI
    fails with an unbound local) is replaced, so the server loads the pack being measured; a real folder stays."""
    from comfyui_lowvram_dit.cli import server as cli_server

    nodes = tmp_path / "base" / "custom_nodes"
    nodes.mkdir(parents=True)
    old = tmp_path / "old_checkout"
    old.mkdir()
    (nodes / cli_server.REGISTRY_FOLDER_NAME).symlink_to(old, target_is_directory=True)
    (nodes / "other").symlink_to(tmp_path / "deleted", target_is_directory=True)
    link = cli_server.prepare_base_dir(tmp_path / "base", extra_custom_nodes={"other": old})
    assert link.resolve() == cli_server.PACK_DIR.resolve()
    assert (nodes / "other").resolve() == old.resolve()
    real = tmp_path / "real" / "custom_nodes" / cli_server.REGISTRY_FOLDER_NAME
    real.mkdir(parents=True)
    (real / "keep.txt").write_text("x")
    assert cli_server.prepare_base_dir(tmp_path / "real") == real and (real / "keep.txt").exists()
