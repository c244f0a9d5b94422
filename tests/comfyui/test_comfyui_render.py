"""The render scenario through real ComfyUI servers (benchmarks/server_render.py): every row graph against the running
version's /object_info, and the core group's Wan 2.2 T2V-A14B 4-step rows (native's best and the pack's shipped
workflow) end to end with ``--smoke``: tiny models on the CPU, every render kind (first-ever, warm, warm with a new
prompt, cold in a second server) producing its output file and its split; and the GGUF rows (ComfyUI-GGUF linked in,
tiny GGUF files written) and the EasyCache rows (skipped steps per sampler and render, from the server log)."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
from comfy_server import ComfyServer
from comfyui_lowvram_dit.benchmarks import server_render as sr
from comfyui_lowvram_dit.benchmarks import server_render_graphs as rg
from comfyui_lowvram_dit.benchmarks.server_render_split import PARTS
from test_bench_server import _problems

pytestmark = pytest.mark.comfyui
NATIVE, PACK = "wan_t2v_4step_native_best_whole", "wan_t2v_4step_pack_whole"


def test_every_render_graph_validates_against_the_running_comfyui(comfy_server: ComfyServer) -> None:
    info = comfy_server.object_info()
    gguf = "UnetLoaderGGUF" in info  # the test server links ComfyUI-GGUF where its Python has gguf
    for key, wf in rg.WORKFLOWS.items():
        for setup in rg.SETUPS:
            for fmt in [wf.default_format, *(f for f in rg.GGUF_TYPES if gguf and f in wf.formats)]:
                if rg.setup_applies(wf, setup, fmt) is None:
                    graph = rg.render_graph(wf, setup, 12.0, fmt, info, "row")
                    problems = [p for p in _problems(graph, info) if not re.match(r"\d+\.image: ", p)]
                    assert problems == [], (key, setup, fmt, problems)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One ``--smoke`` run of the two rows with every render kind (two warm renders); its JSON report."""
    out = tmp_path_factory.mktemp("render_out")
    rc = sr.main(["--smoke", "--comfyui", os.environ["COMFYUI_PATH"], "--rows", f"{NATIVE},{PACK}",
                  "--renders", ",".join(sr.RENDERS), "--out", str(out), "--stem", "smoke", "--warm-repeats", "2",
                  "--work", str(tmp_path_factory.mktemp("render_work"))])
    doc = json.loads((out / "smoke.json").read_text())
    assert rc == 0, json.dumps(doc["rows"], indent=1)[-4000:]
    assert (out / "smoke.md").is_file()
    return doc


@pytest.mark.parametrize("name", [NATIVE, PACK])
def test_smoke_renders_every_kind_with_its_output_and_split(smoke_run: dict, name: str) -> None:
    row = next(r for r in smoke_run["rows"] if r["name"] == name)
    assert row["status"] == "ok", row.get("error")
    assert set(row["renders"]) == set(sr.RENDERS) and len(row["lives"]) == 2
    assert all(life["step_sync"] for life in row["lives"])  # benchmarks/step_sync loaded in every server
    assert (row["resolution"], row["frames"], row["steps"]) == ("64x64", 5, 2)
    for kind, r in row["renders"].items():
        assert r["status"] == "ok", (kind, r.get("error"))
        assert any(o.endswith(".mp4") for o in r["outputs"]) and any(o.endswith(".latent") for o in r["outputs"])
        assert math.isclose(sum(r[p] for p in PARTS), r["total_s"], abs_tol=0.1), kind
        assert [s["steps"] for s in r["samplers"]] == [1, 1], kind  # one step per expert after --smoke
        assert r["peak_rss_gib"] and r["peak_rss_gib"] > 0.3
    fresh, warm, new = row["renders"]["first_ever"], row["renders"]["warm"], row["renders"]["warm_new_prompt"]
    for r in (fresh, row["renders"]["cold"]):
        assert r["load_s"] > 0 and r["text_encode_s"] > 0 and not r["cached_nodes"]
    assert warm["load_s"] == 0 and warm["text_encode_s"] == 0 and warm["cached_nodes"]  # only the seed changed
    assert len(warm["repeats_s"]) == 2 and warm["total_s"] == min(warm["repeats_s"])  # two warm renders, lower median
    assert new["text_encode_s"] > 0 and new["load_s"] == 0
    assert row["outputs_compared"]["cold_vs_first_ever"]["identical"]  # a fresh server renders the same latent
    assert row["render_s"] == warm["total_s"]


def test_smoke_compares_the_pack_with_native(smoke_run: dict) -> None:
    rows = {r["name"]: r for r in smoke_run["rows"]}
    native, pack = rows[NATIVE], rows[PACK]
    assert pack["against"] == NATIVE and pack["ratio"] == pytest.approx(native["render_s"] / pack["render_s"], 0.01)
    assert 0 < pack["error_vs_native"] < math.inf  # fp8 per-tensor vs fp8_e4m3fn_fast: close, not equal
    assert native["flags_left_out"] == ["--use-ck-attention (no comfy-kitchen attention on the CPU)"]
    command = smoke_run["env"]["command"]
    assert smoke_run["env"]["device"] == "cpu" and str(Path.home()) not in command and "/tmp/" not in command
    logs = [line for lives in smoke_run["logs"].values() for life in lives for line in life]
    assert len(smoke_run["logs"][PACK]) == 2 and any("lowvram_dit" in line for line in logs)
    assert not any(str(Path.home()) in line or "/tmp/" in line for line in logs)  # $WORK, <ComfyUI>, python3


GGUF_ROWS = ("wan_t2v_4step_native_best_whole_gguf_q8_0", "wan_t2v_4step_pack_whole_gguf_q4_k",
             "wan_ti2v_5b_pack_whole_gguf_q8_0")
EASYCACHE_ROWS = ("wan_t2v_pack_easycache_whole",)  # native's EasyCache graph: validated above, same node placing


def test_smoke_gguf_and_easycache_rows(tmp_path: Path) -> None:
    """GGUF rows: ComfyUI-GGUF loads the tiny GGUF files the runner wrote (native alone, the pack's graph with Block
    Swap); EasyCache rows: each render records the steps skipped per sampler (the smoke's one step each: none)."""
    pytest.importorskip("gguf", reason="the gguf package is missing: pip install -e '.[test]' adds it")
    rc = sr.main(["--smoke", "--comfyui", os.environ["COMFYUI_PATH"], "--rows", ",".join(GGUF_ROWS + EASYCACHE_ROWS),
                  "--renders", "first_ever", "--out", str(tmp_path / "out"), "--stem", "smoke",
                  "--work", str(tmp_path / "work")])
    doc = json.loads((tmp_path / "out" / "smoke.json").read_text())
    rows = {r["name"]: r for r in doc["rows"]}
    assert rc == 0 and all(r["status"] == "ok" for r in rows.values()), json.dumps(doc["rows"], indent=1)[-4000:]
    for name, qtype in zip(GGUF_ROWS, ("Q8_0", "Q4_K", "Q8_0"), strict=True):
        log = [line for life in doc["logs"][name] for line in life]
        assert rows[name]["file_format"] == f"gguf_{qtype.lower()}"
        assert any(re.search(rf"gguf qtypes: F32 \(\d+\), {qtype} \(\d+\)", line) for line in log), log
    assert rows[GGUF_ROWS[1]]["against"] == GGUF_ROWS[0]
    for name in EASYCACHE_ROWS:
        assert [r["easycache_skipped"] for r in rows[name]["renders"].values()] == [[[0, 1], [0, 1]]]
    assert "easycache_skipped" not in rows[GGUF_ROWS[0]]["renders"]["first_ever"]
