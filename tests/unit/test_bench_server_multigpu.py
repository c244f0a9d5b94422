"""The MultiGPU CFG Split rows of server_wan14b on CPU, without ComfyUI: their graphs (core's split node right
before each sampler), the skip on a ComfyUI or machine that cannot split, the final latent kept per row and compared
with the one-GPU twin's, and the report's split table."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from comfyui_lowvram_dit.benchmarks import server as run
from comfyui_lowvram_dit.benchmarks import server_report as rep
from comfyui_lowvram_dit.benchmarks import server_wan as bs
from safetensors.torch import save_file
from test_bench_server import OBJECT_INFO, PROBE_INFO, SPLIT_INFO, _measured, _problems, fake_start

SPLIT_ROWS = [n for n, v in bs.VARIANTS.items() if v.gpus > 1]


def test_split_rows_pair_with_their_one_gpu_twin() -> None:
    assert SPLIT_ROWS == [f"{t}_2gpu" for t in bs.SPLIT_TWINS]
    for name in SPLIT_ROWS:
        row = bs.VARIANTS[name]
        twin = bs.VARIANTS[row.same_as]
        assert row == replace(twin, name=name, gpus=2, same_as=twin.name, baseline=False)
        assert twin.gpus == 1 and twin.same_as is None
        assert bs.describe(row) == bs.describe(twin) + ", MultiGPU CFG Split over 2 GPUs"
        assert row.server_args(79.65) == twin.server_args(79.65)


@pytest.mark.parametrize("name", SPLIT_ROWS)
@pytest.mark.parametrize("probe", [False, True])
def test_split_node_sits_right_before_each_sampler(name: str, probe: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """MultiGPU_WorkUnits (max_gpus = the row's GPUs) on each expert's model after ModelSamplingSD3 (and after the
    Kernel Profile node when there is one); otherwise the twin's graph."""
    monkeypatch.setitem(OBJECT_INFO, run.SPLIT_NODE, SPLIT_INFO[run.SPLIT_NODE])
    monkeypatch.setitem(OBJECT_INFO, run.PROBE_NODE, PROBE_INFO[run.PROBE_NODE])
    row = bs.VARIANTS[name]
    graph, twin = bs.build_graph(row, 3, probe=probe), bs.build_graph(bs.VARIANTS[row.same_as], 3, probe=probe)
    assert _problems(graph) == []
    splits = {nid: n for nid, n in graph.items() if n["class_type"] == run.SPLIT_NODE}
    assert [graph[s]["inputs"]["model"][0] for s in bs.SAMPLER_NODES] == list(splits) == ["52", "53"]
    assert {n["inputs"]["max_gpus"] for n in splits.values()} == {2}
    before = {twin[s]["inputs"]["model"][0] for s in bs.SAMPLER_NODES}  # what the twin's samplers take
    assert {n["inputs"]["model"][0] for n in splits.values()} == before
    want = {run.PROBE_NODE} if probe else {"ModelSamplingSD3"}
    assert {graph[n["inputs"]["model"][0]]["class_type"] for n in splits.values()} == want
    for g in (graph, twin):
        for s in bs.SAMPLER_NODES:
            g[s]["inputs"].pop("model")
        g["19"]["inputs"].pop("filename_prefix")
    assert {k: n for k, n in graph.items() if k not in splits} == twin
    assert run.SPLIT_NODE not in {n["class_type"] for n in bs.build_graph(bs.VARIANTS["pack"], 3).values()}


def _comfyui(tmp_path: Path, with_split: bool) -> Path:
    """A stand-in ComfyUI checkout whose comfy_extras has (or lacks) core's split node."""
    folder = tmp_path / ("comfy_split" if with_split else "comfy_old")
    (folder / "comfy_extras").mkdir(parents=True, exist_ok=True)
    if with_split:
        (folder / "comfy_extras" / "nodes_multigpu.py").write_text('node_id="MultiGPU_WorkUnits",\n')
    return folder


def test_split_rows_are_skipped_where_they_cannot_split(tmp_path: Path) -> None:
    new, old = _comfyui(tmp_path, True), _comfyui(tmp_path, False)
    split, one = bs.VARIANTS["pack_2gpu"], bs.VARIANTS["pack"]
    assert run.has_split_node(new) and not run.has_split_node(old)
    assert run.split_skip_reason(split, new, "0.33.0", 2, on_cpu=False) is None
    assert run.split_skip_reason(one, old, "0.8.0", 0, on_cpu=True) is None
    assert "ComfyUI 0.8.0 has no MultiGPU_WorkUnits node" in run.split_skip_reason(split, old, "0.8.0", 2, False)
    assert "this machine has 1 (nvidia-smi)" in run.split_skip_reason(split, new, "0.33.0", 1, False)
    assert "runs on the CPU" in run.split_skip_reason(split, new, "0.33.0", 2, True)


def _latent(path: Path, tensor: torch.Tensor) -> Path:
    """A file as SaveLatent writes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"latent_tensor": tensor.contiguous(), "latent_format_version_0": torch.tensor([])}, str(path))
    return path


def test_compare_latents(tmp_path: Path) -> None:
    a = torch.randn(1, 16, 3, 6, 8, generator=torch.Generator().manual_seed(0))
    ref = _latent(tmp_path / "a.latent", a)
    same = run.compare_latents(_latent(tmp_path / "same.latent", a.clone()), ref)
    assert same["identical"] is True and same["rel_diff"] == 0.0 and same["max_abs"] == 0.0
    b = a.clone()
    b[0, 1, 2, 3, 4] += 0.5
    got = run.compare_latents(_latent(tmp_path / "b.latent", b), ref)
    want = float(torch.linalg.vector_norm((b - a).double()) / torch.linalg.vector_norm(a.double()))
    assert got["identical"] is False and got["rel_diff"] == pytest.approx(want) and got["max_abs"] == pytest.approx(0.5)
    assert got["shape"] == [1, 16, 3, 6, 8]
    assert run.compare_latents(_latent(tmp_path / "bf16.latent", a.bfloat16()), ref)["identical"] is False
    assert "shapes differ" in run.compare_latents(_latent(tmp_path / "c.latent", a[:, :8]), ref)["error"]


def _rec(name: str, status: str = "ok", **kw: object) -> dict:
    v = bs.VARIANTS[name]
    return {"name": name, "what": bs.describe(v), "variant": asdict(v), "status": status, "s_per_step": 1.0, **kw}


def test_twin_checks_say_why_a_pair_was_not_compared(tmp_path: Path) -> None:
    t = torch.ones(1, 16, 2, 2, 2)
    for name in ("pack", "pack_2gpu", "native_fp8fast_2gpu", "pack_int8_compile_2gpu"):
        _latent(tmp_path / f"{name}.latent", t)
    results = [_rec("pack"), _rec("pack_2gpu"), _rec("native_fp8fast_2gpu"), _rec("native_fp8fast_ck_2gpu", "skipped"),
               _rec("pack_int8_compile", source="old.json"), _rec("pack_int8_compile_2gpu"),
               _rec("native_fp8fast", "error")]
    checks = {r["name"]: r.get("vs_one_gpu") for r in run.twin_checks(results, tmp_path)}
    assert checks["pack"] is None and checks["pack_2gpu"]["identical"] is True
    assert checks["pack_2gpu"]["row"] == "pack" and checks["pack_2gpu"]["rel_diff"] == 0.0
    assert checks["native_fp8fast_2gpu"]["error"] == "native_fp8fast did not finish (error)"
    assert checks["native_fp8fast_ck_2gpu"]["error"] == "this row did not finish (skipped)"
    assert checks["pack_int8_compile_2gpu"]["error"] == "pack_int8_compile comes from old.json, not from this run"
    (tmp_path / "pack.latent").unlink()
    got = run.twin_checks([_rec("pack"), _rec("pack_2gpu")], tmp_path)[1]["vs_one_gpu"]
    assert got["error"] == "no saved latent of pack (--decode saves frames)"
    assert run.twin_checks([_rec("pack_2gpu")], tmp_path)[0]["vs_one_gpu"]["error"] == "pack did not run in this run"


def _saves_latent(base: Path) -> str:
    """The stand-in server's log; on the way it writes the row's SaveLatent file (the split rows' latent equals
    their twin's, except native_fp8fast_2gpu's)."""
    row = max((n for n in bs.VARIANTS if base.name.startswith(f"bench_{n}_")), key=len)  # mkdtemp's prefix
    t = torch.arange(2 * 16 * 3, dtype=torch.float32).reshape(1, 16, 3, 2, 1)
    if row == "native_fp8fast_2gpu":
        t = t + 0.25
    _latent(base / "output" / "bench" / f"{row}_00001_.latent", t)
    return "Prompt executed in 3.00 s\n"


def _main(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpus: int, comfyui: Path, variants: str,
          *extra: str) -> tuple[dict, str, list]:
    starts = fake_start(monkeypatch, _saves_latent)
    monkeypatch.setattr(run, "gpu_facts", lambda: {"device_name": "GPU", "vram_total_gib": 79.65, "gpu_count": gpus})
    times = {"pack": 2.0, "pack_2gpu": 1.0, "native_fp8fast": 3.0, "native_fp8fast_2gpu": 1.6}

    def measured(server: object, graph: dict, timeout: float, sampler_nodes: tuple, probe_dir: object = None) -> dict:
        name = graph["19"]["inputs"]["filename_prefix"].split("/")[1]
        return {**_measured(server, graph, timeout, sampler_nodes), "s_per_step": times.get(name, 1.5)}

    monkeypatch.setattr(run, "measure", measured)
    out = tmp_path / "out"
    run.main(bs.SCENARIO, ["--comfyui", str(comfyui), "--models", str(tmp_path), "--out", str(out), "--stem", "mg",
                           "--variants", variants, "--work", str(tmp_path / "w"), *extra])
    return json.loads((out / "mg.json").read_text()), (out / "mg.md").read_text(), starts


def test_main_compares_each_split_row_with_its_twin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc, md, starts = _main(tmp_path, monkeypatch, 2, _comfyui(tmp_path, True),
                            "pack,pack_2gpu,native_fp8fast,native_fp8fast_2gpu,native_fp8fast_ck_2gpu")
    got = {r["name"]: r for r in doc["variants"]}
    assert [r["status"] for r in doc["variants"]] == ["ok"] * 5 and len(starts) == 5
    assert got["pack_2gpu"]["vs_one_gpu"] == {"row": "pack", "identical": True, "rel_diff": 0.0, "max_abs": 0.0,
                                              "shape": [1, 16, 3, 2, 1]}
    off = got["native_fp8fast_2gpu"]["vs_one_gpu"]
    assert off["identical"] is False and off["max_abs"] == 0.25 and off["rel_diff"] > 0
    assert got["native_fp8fast_ck_2gpu"]["vs_one_gpu"]["error"] == "native_fp8fast_ck did not run in this run"
    assert "vs_one_gpu" not in got["pack"]
    assert sorted(p.name for p in (tmp_path / "w" / run.LATENTS).iterdir()) == sorted(f"{n}.latent" for n in got)
    assert doc["ratios"]["pack_2gpu"] == {"native_fp8fast": 3.0, "pack": 2.0, "native_fp8fast_2gpu": 1.6,
                                          "native_fp8fast_ck_2gpu": 1.5}
    assert "## MultiGPU CFG Split vs one GPU" in md and "2.00x vs pack" in md and "GPU (79.65 GiB) x2, driver" in md
    assert "| pack_2gpu | 2 | 1.000 | pack | 2.000 | 2.00x | identical | ok |" in md
    assert f"| native_fp8fast_2gpu | 2 | 1.600 | native_fp8fast | 3.000 | 1.88x | rel diff {off['rel_diff']:.3g}" in md
    assert ("| native_fp8fast_ck_2gpu | 2 | 1.500 | native_fp8fast_ck | — (native_fp8fast_ck did not run) | — |"
            in md)


@pytest.mark.parametrize("gpus, with_node, extra, why", [
    (1, True, (), "this machine has 1 (nvidia-smi)"), (2, False, (), "has no MultiGPU_WorkUnits node"),
    (2, True, ("--cpu",), "the server runs on the CPU")])
def test_main_skips_split_rows_that_cannot_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpus: int,
                                                 with_node: bool, extra: tuple, why: str) -> None:
    doc, md, starts = _main(tmp_path, monkeypatch, gpus, _comfyui(tmp_path, with_node), "multigpu", *extra)
    got = {r["name"]: r for r in doc["variants"]}
    assert len(starts) == 4 and {got[n]["status"] for n in bs.SPLIT_TWINS} == {"ok"}
    for name in SPLIT_ROWS:
        assert got[name]["status"] == "skipped" and why in got[name]["error"], got[name]
        assert got[name]["vs_one_gpu"]["error"] == "this row did not finish (skipped)"
        assert got[name]["what"].endswith("MultiGPU CFG Split over 2 GPUs")
    assert "## MultiGPU CFG Split vs one GPU" in md and why in md


def test_report_of_split_rows() -> None:
    """Split rows stay out of the goals and the baselines; an older record without ``gpus`` reads as one GPU."""
    old = _rec("native_fp8fast_ck")
    del old["variant"]["gpus"], old["variant"]["same_as"]
    results = [old, _rec("native_default", s_per_step=4.0), _rec("pack", s_per_step=2.0),
               _rec("pack_2gpu", s_per_step=0.5, vs_one_gpu={"row": "pack", "identical": False, "rel_diff": 1.25e-3,
                                                              "max_abs": 0.0625}),
               _rec("native_fp8fast_ck_2gpu", s_per_step=0.8)]
    r = rep.ratios(results)
    assert r["pack_2gpu"] == {"native_fp8fast_ck": 2.0, "native_default": 8.0, "pack": 4.0,
                              "native_fp8fast_ck_2gpu": 1.6}
    assert r["pack"] == {"native_fp8fast_ck": 0.5, "native_default": 2.0}
    assert r["native_fp8fast_ck_2gpu"] == {"native_fp8fast_ck": 1.25, "native_default": 5.0}
    assert {c["row"] for c in rep.goals(results)} == {"pack"}
    assert rep.best_native(results, None)["name"] == "native_fp8fast_ck"
    lines = rep.split_lines(results)
    assert "| pack_2gpu | 2 | 0.500 | pack | 2.000 | 4.00x | rel diff 0.00125, max abs 0.0625 | ok |" in lines
    assert "| native_fp8fast_ck_2gpu | 2 | 0.800 | native_fp8fast_ck | 1.000 | 1.25x | — | ok |" in lines
    assert rep.split_lines(results[:3]) == []
    assert "4.00x vs pack" in rep.markdown(results, {}, {"steps": 3})
