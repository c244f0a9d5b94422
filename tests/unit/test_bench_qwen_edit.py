"""The Qwen-Image-Edit server benchmark on CPU, without ComfyUI: both graphs validate against the schemas, hold the
template's nodes (native) or the pack's staged Edit loader (pack), and the goal numbers come from the rows."""

from __future__ import annotations

from pathlib import Path

import pytest
from comfyui_lowvram_dit.benchmarks import server as run
from comfyui_lowvram_dit.benchmarks import server_qwen as be
from test_bench_server import _measured, _problems, fake_start


@pytest.mark.parametrize("kind", ["native", "pack"])
@pytest.mark.parametrize("edit", ["2509", "2511"])
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("scale", [True, False])
def test_graphs_validate(kind: str, edit: str, decode: bool, scale: bool) -> None:
    graph = be.build_edit_graph(kind, be.EDIT_UNET, be.EDIT_TEXT_ENCODER, be.VAE, 4, edit, 8.0, decode, scale)
    # LoadImage lists the server's input folder: the benchmark writes its image there before queueing
    assert [p for p in _problems(graph) if not p.startswith(f"1.image: {be.IMAGE!r} not in")] == []
    assert graph["1"]["inputs"]["image"] == be.IMAGE
    assert graph[be.EDIT_SAMPLER]["class_type"] == "KSampler" and graph[be.EDIT_SAMPLER]["inputs"]["steps"] == 4


def test_graphs_hold_what_they_compare() -> None:
    native = be.build_edit_graph("native", be.EDIT_UNET, be.EDIT_TEXT_ENCODER, be.VAE, 4, "2511", 8.0)
    pack = be.build_edit_graph("pack", be.EDIT_UNET, be.EDIT_TEXT_ENCODER, be.VAE, 4, "2511", 8.0)
    kinds = {k: {n["class_type"] for n in g.values()} for k, g in (("native", native), ("pack", pack))}
    assert {"UNETLoader", "CLIPLoader", "TextEncodeQwenImageEditPlus"} <= kinds["native"]
    assert "LowVRAM_QwenImageEditStagedLoader" not in kinds["native"]
    assert not {"UNETLoader", "CLIPLoader", "TextEncodeQwenImageEditPlus"} & kinds["pack"]
    shared = {"FluxKontextImageScale", "FluxKontextMultiReferenceLatentMethod", "ModelSamplingAuraFlow", "CFGNorm",
              "VAEEncode", "KSampler"}
    assert shared <= kinds["native"] and shared <= kinds["pack"]
    assert {n["inputs"]["device"] for n in native.values() if n["class_type"] == "CLIPLoader"} == {"cpu"}
    loader = next(n for n in pack.values() if n["class_type"] == "LowVRAM_QwenImageEditStagedLoader")
    assert loader["inputs"]["vram_budget_gb"] == 8.0 and loader["inputs"]["image1"] == ["2", 0]
    encodes = [n for n in native.values() if n["class_type"] == "TextEncodeQwenImageEditPlus"]
    assert sorted(n["inputs"]["prompt"] for n in encodes) == ["", be.PROMPT]
    assert all(n["inputs"]["image1"] == ["2", 0] for n in encodes)
    with pytest.raises(ValueError, match="native"):
        be.build_edit_graph("other", be.EDIT_UNET, be.EDIT_TEXT_ENCODER, be.VAE, 4, "2509", 8.0)


def test_goal_numbers_from_rows() -> None:
    rows = [{"variant": {"graph": "native"}, "status": "ok", "s_per_step": 6.0, "peak_rss_hwm_gib": 30.0},
            {"variant": {"graph": "pack"}, "status": "ok", "s_per_step": 4.0, "peak_rss_hwm_gib": 20.5}]
    assert be.summary(rows) == {"pack_peak_rss_gib": 20.5, "speedup_per_step": 1.5}
    assert be.summary([rows[0], {**rows[1], "status": "error"}]) == {}


def test_input_image_is_written(tmp_path: Path) -> None:
    Image = pytest.importorskip("PIL.Image")
    path = be.write_input_image(tmp_path, 24, 16)
    with Image.open(path) as im:
        assert im.size == (24, 16) and im.mode == "RGB" and im.getpixel((23, 15))[:2] == (255, 255)


def test_empty_image_replaces_the_loaded_one_with_the_same_size() -> None:
    graph = be.build_edit_graph("pack", be.EDIT_UNET, be.EDIT_TEXT_ENCODER, be.VAE, 4, "2509", 8.0, empty_image=(1024, 768))
    assert graph["1"]["class_type"] == "EmptyImage"
    assert (graph["1"]["inputs"]["width"], graph["1"]["inputs"]["height"]) == (1024, 768)
    assert _problems(graph) == []  # EmptyImage is in the schema snapshot, LoadImage is gone


def test_rows_run_through_the_shared_runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each row: a server of its own with its own user directory (cold embedding cache), the reference image in the
    input folder before the start, the pack-import check, flags recorded with $WORK, the log kept on --keep-logs."""
    pytest.importorskip("PIL.Image")
    starts = fake_start(monkeypatch, lambda base: "got prompt\nPrompt executed in 3.00 seconds\n")
    monkeypatch.setattr(run, "measure", _measured)
    opts = run.parser(be.EDIT_SCENARIO).parse_args(["--comfyui", str(tmp_path), "--models", str(tmp_path), "--keep-logs",
                                    "--variants", "pack_edit_blockswap_8gb", "--steps", "4"])
    opts.work = tmp_path / "work"
    opts.work.mkdir()
    rec = run.run_one(be.EDIT_SCENARIO, be.EDIT_ROWS["pack_edit_blockswap_8gb"], opts, 79.65)
    assert rec["status"] == "ok" and rec["variant"]["graph"] == "pack" and rec["variant"]["card_gib"] == 8.0
    assert "timeline" not in rec
    assert rec["sampler_nodes"] == [be.EDIT_SAMPLER] and starts[0]["inputs"] == [be.IMAGE]
    flags = rec["server_args"]
    assert flags[flags.index("--user-directory") + 1].endswith("/user") and flags[-1] == "--reserve-vram=71.65"
    assert all(str(tmp_path) not in f for f in flags) and flags[flags.index("--user-directory") + 1] != "$WORK/user"
    assert (opts.work / "pack_edit_blockswap_8gb.log").is_file()
