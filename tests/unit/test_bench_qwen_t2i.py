"""The Qwen-Image 4-step server benchmark on CPU, without ComfyUI: every row's graph validates against the schemas
and holds what it compares (native: the official template's loaders with native's best settings; pack: the shipped
4-step workflow's graph), the settings equal the shipped workflow's, the files are ones --write-models can write,
the CLI and the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from comfyui_lowvram_dit.benchmarks import server as run
from comfyui_lowvram_dit.benchmarks import server_qwen as bq
from comfyui_lowvram_dit.cli import workflow_models as run_models
from comfyui_lowvram_dit.synthetic import lora as synth_lora
from template_files import graphs, load_template
from test_bench_server import _measured, _problems, fake_start

WORKFLOWS = Path(__file__).resolve().parents[2] / "workflows"


def _types(graph: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for node in graph.values():
        out.setdefault(node["class_type"], []).append(node["inputs"])
    return out


@pytest.mark.parametrize("name", list(bq.ROWS))
@pytest.mark.parametrize("decode", [False, True])
def test_every_row_graph_validates(name: str, decode: bool) -> None:
    graph = bq.build_graph(bq.ROWS[name], decode=decode)
    assert _problems(graph) == []
    assert graph[bq.SAMPLER]["class_type"] == "KSampler"
    assert {"SaveImage" if decode else "SaveLatent"} <= set(_types(graph))


def test_native_rows_are_the_template_with_natives_best_settings() -> None:
    for name in ("native_fp8fast_ck_8gb_4step", "native_fp8fast_ck_8gb_lora4"):
        row = bq.ROWS[name]
        t = _types(bq.build_graph(row))
        assert row.baseline and row.ck_attention and row.card_gib == 8.0
        assert row.server_args(79.65) == ["--use-ck-attention", "--reserve-vram=71.65"]
        assert t["UNETLoader"] == [{"unet_name": bq.UNET, "weight_dtype": "fp8_e4m3fn_fast"}]
        assert t["CLIPLoader"] == [{"clip_name": bq.TEXT_ENCODER, "type": "qwen_image", "device": "default"}]
        assert sorted(n["text"] for n in t["CLIPTextEncode"]) == sorted([bq.POSITIVE, bq.NEGATIVE])
        assert "LowVRAM_QwenImageStagedLoader" not in t and "LowVRAM_Attention" not in t
        assert ("LoraLoaderModelOnly" in t) == row.lora


def test_pack_rows_are_the_shipped_4step_workflow() -> None:
    for name in ("pack_staged_8gb_4step", "pack_staged_8gb_lora4", "pack_staged_attn_8gb_lora4"):
        row = bq.ROWS[name]
        g = bq.build_graph(row)
        t = _types(g)
        assert not row.baseline and row.server_args(79.65) == ["--reserve-vram=71.65"]
        loader = t["LowVRAM_QwenImageStagedLoader"][0]
        assert (loader["unet_name"], loader["clip_name"], loader["vae_name"]) == (bq.UNET, bq.TEXT_ENCODER, bq.VAE)
        assert loader["vram_budget_gb"] == 8.0 and loader["blocks_to_swap"] == -1
        assert not {"UNETLoader", "CLIPLoader", "CLIPTextEncode"} & set(t)
        assert g[bq.SAMPLER]["inputs"]["positive"] == ["2", 1] and g[bq.SAMPLER]["inputs"]["negative"] == ["2", 2]
        assert ("LowVRAM_Attention" in t) == (row.attention is not None)
    # the LoRA sits right after the loader, the Attention node (when there) after the LoRA, as in server_wan
    g = bq.build_graph(bq.ROWS["pack_staged_attn_8gb_lora4"])
    assert g["73"]["inputs"]["model"] == ["2", 0] and g["74"]["inputs"]["model"] == ["73", 0]
    assert g["66"]["inputs"]["model"] == ["74", 0] and g[bq.SAMPLER]["inputs"]["model"] == ["66", 0]
    assert bq.DEFAULT_ROWS == ["native_fp8fast_ck_8gb_4step", "native_fp8fast_ck_8gb_lora4",
                               "pack_staged_8gb_4step", "pack_staged_8gb_lora4"]


def test_each_lora_row_pairs_with_the_same_graph_without_it() -> None:
    for name, row in bq.ROWS.items():
        g = bq.build_graph(row)
        loras = [n["inputs"] for n in g.values() if n["class_type"] == "LoraLoaderModelOnly"]
        assert loras == ([{"model": ["37", 0] if row.graph == "native" else ["2", 0], "lora_name": bq.LORA,
                           "strength_model": 1.0}] if row.lora else []), name
        s = g[bq.SAMPLER]["inputs"]
        assert (s["steps"], s["cfg"], s["sampler_name"], s["scheduler"]) == (4, 1.0, "euler", "simple"), name
        assert _types(g)["EmptySD3LatentImage"] == [{"width": 1328, "height": 1328, "batch_size": 1}]
        assert _types(g)["ModelSamplingAuraFlow"][0]["shift"] == 3.1
    twins = {(r.graph, r.attention) for r in bq.ROWS.values() if not r.lora}
    assert {(r.graph, r.attention) for r in bq.ROWS.values() if r.lora} - twins == {("pack", "auto")}
    with pytest.raises(ValueError, match="steps"):
        bq.build_graph(bq.ROWS["pack_staged_8gb_4step"], steps=1)
    with pytest.raises(ValueError, match="graph must be"):
        bq.build_graph(bq.QwenRow("x", "other"))


def test_settings_match_the_shipped_4step_workflow() -> None:
    wf = json.loads((WORKFLOWS / "qwen_image_t2i_4step.json").read_text())
    by_type = {n["type"]: n["widgets_values"] for n in wf["nodes"]}
    assert by_type["LowVRAM_QwenImageStagedLoader"][:5] == [bq.UNET, bq.TEXT_ENCODER, bq.VAE, bq.POSITIVE,
                                                            bq.NEGATIVE]
    assert by_type["LoraLoaderModelOnly"] == [bq.LORA, 1.0]
    assert by_type["ModelSamplingAuraFlow"] == [bq.SHIFT] and by_type["EmptySD3LatentImage"] == [bq.SIZE, bq.SIZE, 1]
    seed, _, steps, cfg, sampler, scheduler, denoise = by_type["KSampler"]
    assert (seed, steps, cfg, sampler, scheduler, denoise) == (bq.SEED, bq.STEPS, bq.CFG, "euler", "simple", 1.0)


def test_native_loaders_match_the_official_template() -> None:
    """image_qwen_image.json (comfyui-workflow-templates-json): which files, which CLIP loader type and device."""
    nodes = [n for _, g in graphs(load_template("image_qwen_image")) for n in g["nodes"]]
    widgets = {n["type"]: n.get("widgets_values") for n in nodes}
    assert widgets["UNETLoader"][0] == bq.UNET and widgets["VAELoader"] == [bq.VAE]
    assert widgets["CLIPLoader"] == [bq.TEXT_ENCODER, "qwen_image", "default"]
    assert abs(widgets["ModelSamplingAuraFlow"][0] - bq.SHIFT) < 1e-6
    assert widgets["EmptySD3LatentImage"][:2] == [bq.SIZE, bq.SIZE]
    assert widgets["KSampler"][3:6] == [1, "euler", "simple"]  # cfg 1 with its Lightning LoRA
    assert any(n["type"] == "LoraLoaderModelOnly" for n in nodes)


def test_write_models_knows_every_file_the_rows_load() -> None:
    rows = [bq.ROWS[n] for n in bq.DEFAULT_ROWS]
    assert bq.model_files(rows) == (bq.UNET, bq.TEXT_ENCODER, bq.VAE, bq.LORA)
    assert bq.model_files([bq.ROWS["pack_staged_8gb_4step"]]) == (bq.UNET, bq.TEXT_ENCODER, bq.VAE)
    known = run_models.KNOWN_MODEL_FILES
    assert known[bq.UNET] == ("diffusion_models", "qwen_image", "fp8")  # the template's plain fp8 file
    assert known[bq.TEXT_ENCODER] == ("text_encoders", "qwen25_vl_7b", "fp8_scaled")
    assert known[bq.VAE][0] == "vae"
    assert synth_lora.KNOWN_LORA_FILES[bq.LORA][0] == "qwen_image"


def test_cli(tmp_path: Path) -> None:
    opts = run.parser(bq.SCENARIO).parse_args(["--comfyui", "c", "--models", "m"])
    assert (opts.variants, opts.steps, opts.width, opts.height, opts.out) == ("default", 4, 1328, 1328, bq.SCENARIO.out)
    assert [r.name for r in run.pick_rows("default", bq.ROWS, bq.GROUPS)] == bq.DEFAULT_ROWS
    assert [r.name for r in run.pick_rows("pack,native_fp8fast_ck_8gb_4step", bq.ROWS, bq.GROUPS)] == [
        "pack_staged_8gb_4step", "pack_staged_8gb_lora4", "pack_staged_attn_8gb_lora4", "native_fp8fast_ck_8gb_4step"]
    with pytest.raises(SystemExit, match="unknown 'nope'"):
        run.pick_rows("nope", bq.ROWS, bq.GROUPS)
    with pytest.raises(SystemExit, match="pick one"):
        run.main(bq.SCENARIO, ["--comfyui", str(tmp_path), "--models", str(tmp_path), "--smoke", "--write-models"])


def test_main_writes_the_report_with_ratios_naming_the_native_rows(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows go through the shared runner (a stand-in for ComfyUI here); the report names the native rows."""
    times = {"native_fp8fast_ck_8gb_4step": 1.2, "native_fp8fast_ck_8gb_lora4": 1.8, "pack_staged_8gb_4step": 1.0,
             "pack_staged_8gb_lora4": 1.0}
    starts = fake_start(monkeypatch, lambda base: ("lora key not loaded: transformer_blocks.0.attn.to_q\n" * 2
                                                   if "lora4" in base.name else "") + "Prompt executed in 3.00 s\n")
    monkeypatch.setattr(run, "gpu_facts", lambda: {"device_name": "GPU", "vram_total_gib": 79.65})
    names: list[str] = []

    def measured(server: object, graph: dict, timeout: float, sampler_nodes: tuple, probe_dir: object = None) -> dict:
        names.append(graph["60"]["inputs"]["filename_prefix"].split("/")[1])
        return {**_measured(server, graph, timeout, sampler_nodes), "s_per_step": times[names[-1]]}

    monkeypatch.setattr(run, "measure", measured)
    out = tmp_path / "out"
    assert run.main(bq.SCENARIO, ["--comfyui", str(tmp_path), "--models", str(tmp_path), "--out", str(out), "--stem", "q",
                    "--work", str(tmp_path / "w")]) == 0
    assert names == bq.DEFAULT_ROWS and len(starts) == 4
    assert all(s["args"][-1] == "--reserve-vram=71.65" for s in starts)
    doc = json.loads((out / "q.json").read_text())
    assert doc["ratios"]["pack_staged_8gb_lora4"] == {"native_fp8fast_ck_8gb_4step": 1.2,
                                                      "native_fp8fast_ck_8gb_lora4": 1.8}
    assert [r["name"] for r in doc["variants"]] == bq.DEFAULT_ROWS and "timeline" not in doc["variants"][0]
    assert [r["lora_keys_not_loaded"] for r in doc["variants"]] == [0, 2, 0, 2]
    md = (out / "q.md").read_text()
    assert "## 8 GB card" in md and "1.80x vs native_fp8fast_ck_8gb_lora4" in md and "first step s" in md


def test_smoke_skips_the_native_rows_and_runs_the_pack_uncapped(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    written: list[tuple] = []
    monkeypatch.setattr(bq, "write_smoke_models", lambda models, names, te: written.append((names, te)))
    starts = fake_start(monkeypatch, lambda base: "")
    monkeypatch.setattr(run, "measure", _measured)
    out = tmp_path / "out"
    assert run.main(bq.SCENARIO, ["--comfyui", str(tmp_path), "--models", str(tmp_path), "--smoke", "--out", str(out),
                    "--variants", "native_fp8fast_ck_8gb_lora4,pack_staged_8gb_lora4"]) == 0
    assert written == [((bq.UNET, bq.TEXT_ENCODER, bq.VAE, bq.LORA), bq.TEXT_ENCODER)]
    doc = json.loads((out / f"{bq.SCENARIO.name}.json").read_text())
    assert [(r["name"], r["status"]) for r in doc["variants"]] == [("native_fp8fast_ck_8gb_lora4", "skipped"),
                                                                   ("pack_staged_8gb_lora4", "ok")]
    assert starts[0]["cpu"] and not any(a.startswith("--reserve-vram") for a in starts[0]["args"])
    assert doc["variants"][1]["variant"]["card_gib"] is None and doc["settings"]["width"] == 64
