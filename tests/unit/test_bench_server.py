"""The server scenarios on CPU, without ComfyUI (benchmarks/server.py, server_report.py, server_wan.py): graphs,
server flags, step timing from websocket events and the log, ratios against named native rows, goals, reports."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from comfyui_lowvram_dit.benchmarks import server as run
from comfyui_lowvram_dit.benchmarks import server_report as rep
from comfyui_lowvram_dit.benchmarks import server_wan as bs

TESTS = Path(__file__).resolve().parents[1]
OBJECT_INFO = {**json.loads((TESTS / "object_info-0.8.0.schema.json").read_text()),
               **json.loads((TESTS / "pack_object_info.json").read_text())}
FILE_INPUTS = {"unet_name", "clip_name", "vae_name", "lora_name"}
# core's MultiGPU CFG Split as ComfyUI 0.33.0 lists it (0.8.0 has no such node; tests/comfyui checks a live server)
SPLIT_INFO = {run.SPLIT_NODE: {"input": {"required": {"model": ["MODEL", {}],
                                                     "max_gpus": ["INT", {"default": 2, "min": 1, "step": 1}]}},
                               "output": ["MODEL"]}}


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
        req, opt = info["input"].get("required", {}), info["input"].get("optional", {})
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


@pytest.mark.parametrize("name", list(bs.VARIANTS))
@pytest.mark.parametrize("decode", [False, True])
def test_every_variant_graph_validates(name: str, decode: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    variant = bs.VARIANTS[name]
    probe = variant.fp8_path != "default"  # the fp8 path is set by the Kernel Profile node
    if variant.gpus > 1:
        monkeypatch.setitem(OBJECT_INFO, run.SPLIT_NODE, SPLIT_INFO[run.SPLIT_NODE])
    if probe:
        monkeypatch.setitem(OBJECT_INFO, run.PROBE_NODE, PROBE_INFO[run.PROBE_NODE])
        with pytest.raises(ValueError, match="--kernel-profile"):
            bs.build_graph(variant, 2, decode=decode)
    graph = bs.build_graph(variant, 2, decode=decode, probe=probe)
    assert _problems(graph) == []
    assert {bs.HIGH, bs.LOW} <= {n["inputs"].get("unet_name") for n in graph.values()}


def test_schema_check_catches_a_broken_graph() -> None:
    graph = bs.build_graph(bs.VARIANTS["pack_blockswap_8gb"], 2)
    graph["31"]["inputs"]["prefetch_blocks"] = 1
    graph["32"]["inputs"]["backend"] = "fastest"
    graph["15"]["inputs"]["model"] = ["99", 0]
    assert len(_problems(graph)) == 3


def test_variant_graphs_hold_the_nodes_they_name() -> None:
    kinds = {n: {node["class_type"] for node in bs.build_graph(v, 2, probe=v.fp8_path != "default").values()}
             for n, v in bs.VARIANTS.items()}
    assert "UNETLoader" in kinds["native_default"] and "LowVRAM_WanLoader" not in kinds["native_default"]
    assert {"LowVRAM_WanLoader", "LowVRAM_Attention", "LowVRAM_WanTextEncode"} <= kinds["pack"]
    assert "LowVRAM_BlockSwap" not in kinds["pack_8gb"] and "LowVRAM_BlockSwap" in kinds["pack_blockswap_8gb"]
    assert "LowVRAM_TorchCompile" in kinds["pack_int8_compile"]
    g = bs.build_graph(bs.VARIANTS["pack_blockswap_8gb"], 2)
    assert {n["inputs"]["vram_budget_gb"] for n in g.values() if n["class_type"] == "LowVRAM_BlockSwap"} == {8.0}
    g = bs.build_graph(bs.VARIANTS["native_fp8fast"], 2)
    assert {n["inputs"]["weight_dtype"] for n in g.values() if n["class_type"] == "UNETLoader"} == {"fp8_e4m3fn_fast"}


def test_lora_rows_pair_with_the_same_graph_without_the_loras() -> None:
    """The 4-step rows: LoraLoaderModelOnly right after each expert's loader (before Block Swap), cfg 1, shift 5;
    each LoRA row has a row of the same graph without it at the same cap."""
    for name in bs.LORA_ROWS:
        v = bs.VARIANTS[name]
        g = bs.build_graph(v, 2)
        loras = {n["inputs"]["lora_name"]: n["inputs"]["model"] for n in g.values()
                 if n["class_type"] == "LoraLoaderModelOnly"}
        assert set(loras) == (set(bs.LORA_FILES) if v.lora else set()), name
        loaders = {"UNETLoader", "LowVRAM_WanLoader"}
        assert all(g[src[0]]["class_type"] in loaders for src in loras.values()), name
        assert {g[s]["inputs"]["cfg"] for s in bs.SAMPLER_NODES} == {1.0} and v.card_gib == run.CARD_GIB
        assert {n["inputs"]["shift"] for n in g.values() if n["class_type"] == "ModelSamplingSD3"} == {5.0}
        if v.lora:
            twin = [w for w in bs.LORA_ROWS if bs.VARIANTS[w] == replace(v, name=w, lora=False)]
            assert twin or name == "pack_8gb_lora4", name
    assert bs.cfg_of(bs.VARIANTS["pack"]) == bs.CFG and [v.name for v in bs.pick_variants("lora")] == bs.LORA_ROWS
    wf = json.loads((TESTS.parent / "workflows" / "wan22_t2v_a14b_4step.json").read_text())
    assert {n["widgets_values"][0] for n in wf["nodes"] if n["type"] == "LoraLoaderModelOnly"} == set(bs.LORA_FILES)
    assert {n["widgets_values"][4] for n in wf["nodes"] if n["type"] == "KSamplerAdvanced"} == {bs.LORA_CFG}
    assert {n["widgets_values"][0] for n in wf["nodes"] if n["type"] == "ModelSamplingSD3"} == {bs.LORA_SHIFT}


def test_steps_split_between_experts() -> None:
    g = bs.build_graph(bs.VARIANTS["pack"], 3)
    hi, lo = g["15"]["inputs"], g["16"]["inputs"]
    assert hi["steps"] == lo["steps"] == 6
    assert (hi["start_at_step"], hi["end_at_step"], lo["start_at_step"]) == (0, 3, 3)
    assert g["16"]["inputs"]["latent_image"] == ["15", 0]
    with pytest.raises(ValueError, match="steps_per_expert"):
        bs.build_graph(bs.VARIANTS["pack"], 1)


def test_easycache_rows_put_the_cache_last_before_each_sampler_next_to_their_twins() -> None:
    for group in ("easycache", "easycache_4step"):
        rows = bs.pick_variants(group)
        cached = [v for v in rows if v.step_cache is not None]
        assert len(cached) == 2 and all(replace(v, name=w.name, step_cache=None) == w
                                        for v, w in zip(cached, [r for r in rows if r.step_cache is None])), group
        for v in cached:
            for probe in (False, True):
                g = bs.build_graph(v, 2, probe=probe and v.graph == "pack")
                caches = {nid: n for nid, n in g.items() if n["class_type"] == "EasyCache"}
                assert len(caches) == 2 and all(n["inputs"] | {"model": None} == {"model": None,
                                                                                  **bs.STEP_CACHE_DEFAULTS}
                                                for n in caches.values()), v.name
                assert {tuple(g[s]["inputs"]["model"]) for s in bs.SAMPLER_NODES} == {(nid, 0) for nid in caches}
    assert "EasyCache" in bs.describe(bs.VARIANTS["pack_int8_compile_easycache"])


def test_settings_match_the_shipped_workflow() -> None:
    wf = json.loads((TESTS.parent / "workflows" / "wan22_t2v_a14b.json").read_text())
    by_type: dict[str, list] = {}
    for node in wf["nodes"]:
        by_type.setdefault(node["type"], []).append(node.get("widgets_values"))
    assert by_type["LowVRAM_WanTextEncode"][0] == [bs.TEXT_ENCODER, bs.POSITIVE, bs.NEGATIVE, True, "auto"]
    assert by_type["EmptyHunyuanLatentVideo"][0] == [bs.WIDTH, bs.HEIGHT, bs.FRAMES, 1]
    assert {tuple(w) for w in by_type["ModelSamplingSD3"]} == {(bs.SHIFT,)}
    assert {w[0] for w in by_type["LowVRAM_WanLoader"]} == {bs.HIGH, bs.LOW}
    assert {tuple(w[1:]) for w in by_type["LowVRAM_WanLoader"]} == {("fp8 per-tensor", "128", "auto", False)}
    assert {w[0] for w in by_type["LowVRAM_Attention"]} == {"auto"}
    first = by_type["KSamplerAdvanced"][0]
    assert (first[1], first[4], first[5], first[6]) == (bs.SEED, bs.CFG, bs.SAMPLER, bs.SCHEDULER)
    assert by_type["VAELoader"][0] == [bs.VAE]


def test_server_args() -> None:
    v = bs.VARIANTS
    assert v["native_default"].server_args(79.65) == []
    assert v["native_fp8fast_ck"].server_args(79.65) == ["--use-ck-attention"]
    assert v["native_fp8fast_8gb"].server_args(79.65) == ["--reserve-vram=71.65"]
    assert v["native_fp8fast_legacy_8gb"].server_args(79.65) == ["--disable-dynamic-vram", "--reserve-vram=71.65"]
    with pytest.raises(ValueError, match="drop the capped variants"):
        v["pack_8gb"].server_args(8.0)


def test_pick_variants() -> None:
    assert [v.name for v in bs.pick_variants("uncapped")] == bs.UNCAPPED
    assert bs.pick_variants("pack,uncapped")[0].name == "pack"
    assert [v.name for v in bs.pick_variants("all")] == [n for n, v in bs.VARIANTS.items() if v.gpus == 1]
    assert [v.name for v in bs.pick_variants("multigpu")] == [
        "native_fp8fast_ck", "native_fp8fast_ck_2gpu", "native_fp8fast", "native_fp8fast_2gpu", "pack", "pack_2gpu",
        "pack_int8_compile", "pack_int8_compile_2gpu"]
    assert not {n for n in bs.UNCAPPED + bs.CAPPED if bs.VARIANTS[n].gpus > 1}
    with pytest.raises(SystemExit, match="unknown"):
        bs.pick_variants("pack,nope")


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
    hi, lo = run.step_times(EVENTS, "15"), run.step_times(EVENTS, "16")
    assert hi == {"node": "15", "progress_values": [1, 2], "first_s": 4.0, "steps_s": [2.5]}
    assert lo["first_s"] == 8.0 and lo["steps_s"] == [2.0]
    s = run.summarize_steps([hi, lo])
    assert s["s_per_step"] == 2.25 and s["steps_timed"] == 2 and s["first_step_s"] == [4.0, 8.0]
    assert run.step_times(EVENTS, "99") == {"node": "99", "progress_values": [], "first_s": None, "steps_s": []}
    assert run.summarize_steps([run.step_times(EVENTS, "99")])["s_per_step"] is None


def test_node_times() -> None:
    assert run.node_times(EVENTS) == {"11": 4.9, "15": 7.0, "16": 10.5}


LOG_033 = ("got prompt\n  0%|          | 0/2 [00:00<?, ?it/s]\r 50%|█████     | 1/2 [00:06<00:06,  6.47s/it]\r"
           "100%|██████████| 2/2 [00:04<00:00,  2.34s/it]\r100%|██████████| 2/2 [00:04<00:00,  2.34s/it]\n"
           "100%|██████████| 2/2 [00:16<00:00,  7.47s/it]\r100%|██████████| 2/2 [00:16<00:00,  8.01s/it]\n"
           "\x1b[32m[INFO]\x1b[0m lowvram_dit attention auto -> SDPA cuDNN\nPrompt executed in 45.20 seconds\n")


def test_tqdm_closing_lines() -> None:
    assert run.tqdm_summaries(LOG_033) == [{"steps": 2, "elapsed_s": 4, "s_per_step": 2.34},
                                          {"steps": 2, "elapsed_s": 16, "s_per_step": 8.01}]
    assert run.tqdm_summaries("100%|█| 3/3 [01:02<00:00,  4.00it/s]") == [
        {"steps": 3, "elapsed_s": 62, "s_per_step": 0.25}]


def test_log_digest_drops_colours_and_bars() -> None:
    assert run.log_digest(LOG_033) == ["[INFO] lowvram_dit attention auto -> SDPA cuDNN", "Prompt executed in 45.20 seconds"]


def _row(name: str, sps: float | None, rss: float = 10.0, status: str = "ok") -> dict:
    v = bs.VARIANTS[name]
    return {"name": name, "what": bs.describe(v), "variant": asdict(v), "status": status, "s_per_step": sps,
            "peak_rss_hwm_gib": rss, "peak_gpu_gib": 7.5, "first_step_s": [9.0, 8.0], "tqdm": []}


RESULTS = [_row("native_default", 4.0), _row("native_fp8fast_ck", 3.0), _row("pack", 2.4),
           _row("native_fp8fast_8gb", 5.0, rss=30.0), _row("pack_8gb", 5.5, rss=20.0),
           _row("pack_blockswap_8gb", 4.5, rss=31.0), _row("native_fp8fast", None, status="error")]


def test_ratios_name_the_native_row_and_stay_within_a_card_size() -> None:
    r = rep.ratios(RESULTS)
    assert r["pack"] == {"native_default": 1.667, "native_fp8fast_ck": 1.25}
    assert r["pack_8gb"] == {"native_fp8fast_8gb": 0.909}
    assert r["native_default"] == {"native_fp8fast_ck": 0.75}
    assert "native_fp8fast" not in r
    assert rep.best_native(RESULTS, None)["name"] == "native_fp8fast_ck"


def test_goals() -> None:
    got = {(c["row"], c["against"], c["metric"]): c["met"] for c in rep.goals(RESULTS)}
    assert got == {("pack", "native_default", "s/step"): True, ("pack", "native_fp8fast_ck", "s/step"): False,
                   ("pack_8gb", "native_fp8fast_8gb", "s/step"): False,
                   ("pack_8gb", "native_fp8fast_8gb", "peak RSS (VmHWM)"): True,
                   ("pack_blockswap_8gb", "native_fp8fast_8gb", "s/step"): True,
                   ("pack_blockswap_8gb", "native_fp8fast_8gb", "peak RSS (VmHWM)"): False}


def test_report_files(tmp_path: Path) -> None:
    env = {"device_name": "GPU", "torch": "2.x", "comfyui_version": "0.33.0", "command": "python bench"}
    settings = {"steps_per_expert": 2, "width": 832, "height": 480, "frames": 81, "cfg": 3.5, "decode": False,
                "model_files_gb": {bs.HIGH: 14.29}}
    paths = rep.write(tmp_path, "t", RESULTS, env, settings)
    md = (tmp_path / "t.md").read_text()
    assert "1.67x vs native_default" in md and "## 8 GB card" in md and "| NO |" in md
    assert json.loads((tmp_path / "t.json").read_text())["ratios"]["pack"]["native_default"] == 1.667
    assert {p.name for p in paths} <= {"t.json", "t.md", "t.png"} and len(paths) >= 2


def test_merged_rows(tmp_path: Path) -> None:
    rows = [_row("native_default", 4.0), _row("native_fp8fast", 5.0), {**_row("native_default_8gb", None),
                                                                        "status": "skipped"}]
    path = tmp_path / "natives.json"
    path.write_text(json.dumps({"variants": rows}))
    got = run.merged_rows([path], {"native_fp8fast"})
    assert [(r["name"], r["source"]) for r in got] == [("native_default", "natives.json")]
    md = rep.markdown(got, {}, {"steps_per_expert": 2, "width": 1, "height": 1, "frames": 1, "cfg": 1, "decode": False})
    assert "(from natives.json)" in md


def test_profile_groups_kernels_by_name_and_sums_them() -> None:
    from types import SimpleNamespace

    from comfyui_lowvram_dit.benchmarks import server_probe as kg

    assert kg.group_of("sm90_xmma_gemm_e4m3bf16_e4m3f32") == "matmul"
    assert kg.group_of("flash_fwd_kernel<Flash_fwd_kernel_traits>") == "attention"
    assert kg.group_of("attn_fwd_kernel") == "attention"
    assert kg.group_of("_quant_rows_kernel") == "quantize/cast"
    assert kg.group_of("some_unknown_thing") == "other"
    assert kg.group_of("elementwise_kernel<gpu_kernel_impl_nocast<addcmul_cuda_kernel>>") == "norm/elementwise"
    events = [SimpleNamespace(key="sm90_xmma_gemm_x", self_device_time_total=3000.0, count=4),
              SimpleNamespace(key="flash_fwd_kernel", self_device_time_total=5000.0, count=2),
              SimpleNamespace(key="aten::mm", self_device_time_total=3000.0, count=4),  # an op row, not a kernel
              SimpleNamespace(key="Command Buffer Full", self_device_time_total=7000.0, count=9)]  # a profiler marker
    table = kg.kernel_table(SimpleNamespace(key_averages=lambda: events), top=5)
    assert table["groups_ms"] == {"matmul": 3.0, "attention": 5.0} and table["total_ms"] == 8.0
    assert [k["kernel"] for k in table["top"]] == ["flash_fwd_kernel", "sm90_xmma_gemm_x"]


PROBE_INFO = {run.PROBE_NODE: {"input": {"required": {"model": ["MODEL"], "label": ["STRING", {}],
                                                     "profile_call": ["INT", {}]},
                                        "optional": {"fp8_path": [["default", "scaled_mm_rowwise",
                                                                   "scaled_mm_tensorwise"]]}},
                               "output": ["MODEL"]}}


def test_probe_sets_the_fp8_path_of_the_loaded_pack(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from comfyui_lowvram_dit.benchmarks import server_probe
    from comfyui_lowvram_dit.kernels import fp8

    assert server_probe.KernelProfile.INPUT_TYPES()["optional"]["fp8_path"][0] == list(server_probe.FP8_PATHS)
    from comfyui_lowvram_dit.kernels import fp8_choice

    twin = types.SimpleNamespace(PER_TENSOR_DEFAULT_PATH="scaled_mm_rowwise")  # the pack loaded by ComfyUI
    monkeypatch.setitem(sys.modules, "custom_nodes.comfyui-lowvram-dit.kernels.fp8", twin)
    monkeypatch.setattr(fp8, "PER_TENSOR_DEFAULT_PATH", fp8.PER_TENSOR_DEFAULT_PATH)
    monkeypatch.setattr(fp8_choice, "TIME_PER_SHAPE", True)
    assert server_probe.set_fp8_path("default") == []
    changed = server_probe.set_fp8_path("scaled_mm_tensorwise")
    assert "custom_nodes.comfyui-lowvram-dit.kernels.fp8" in changed
    assert twin.PER_TENSOR_DEFAULT_PATH == fp8.PER_TENSOR_DEFAULT_PATH == "scaled_mm_tensorwise"
    assert fp8_choice.TIME_PER_SHAPE is False  # a forced path is not timed away
    with pytest.raises(ValueError, match="fp8_path"):
        server_probe.set_fp8_path("fast")


@pytest.mark.parametrize("name", ["native_default", "pack_int8_compile"])
def test_probe_sits_between_each_expert_and_its_sampler(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from comfyui_lowvram_dit.benchmarks import server_probe

    monkeypatch.setitem(OBJECT_INFO, run.PROBE_NODE, PROBE_INFO[run.PROBE_NODE])
    required = server_probe.KernelProfile.INPUT_TYPES()["required"]
    assert set(required) == set(PROBE_INFO[run.PROBE_NODE]["input"]["required"])
    assert server_probe.NODE_CLASS_MAPPINGS[run.PROBE_NODE] is server_probe.KernelProfile
    graph = bs.build_graph(bs.VARIANTS[name], 3, probe=True)
    assert _problems(graph) == []
    probes = {nid: n for nid, n in graph.items() if n["class_type"] == run.PROBE_NODE}
    assert {n["inputs"]["label"] for n in probes.values()} == {"high", "low"}
    assert {graph[s]["inputs"]["model"][0] for s in bs.SAMPLER_NODES} == set(probes)
    assert run.PROBE_NODE not in {n["class_type"] for n in bs.build_graph(bs.VARIANTS[name], 3).values()}


def test_probe_wrapper_times_every_call_and_profiles_one(tmp_path: Path) -> None:
    import torch
    from comfyui_lowvram_dit.benchmarks import server_probe

    out = tmp_path / "probe" / "high.json"
    wrapper = server_probe.make_wrapper("high", 1, out)
    x = torch.randn(64, 64)
    results = [wrapper(lambda a, scale=1.0: torch.mm(a, a) * scale, x, scale=2.0) for _ in range(3)]
    assert all(torch.equal(r, torch.mm(x, x) * 2.0) for r in results)
    got = json.loads(out.read_text())
    assert got["label"] == "high" and len(got["call_s"]) == 3 and got["profiled_call"] == 1
    assert got["profile"]["call"] == 1 and got["profile"]["total_ms"] > 0
    assert any("mm" in k["kernel"] for k in got["profile"]["top"])
    none = server_probe.make_wrapper("low", -1, tmp_path / "low.json")
    none(lambda: x)
    assert json.loads((tmp_path / "low.json").read_text())["profile"] is None


def test_probe_results_leave_the_profiled_step_out_and_reach_the_report(tmp_path: Path) -> None:
    folder = tmp_path / "bench_probe"
    folder.mkdir()
    prof = {"call": 1, "total_ms": 4000.0, "groups_ms": {"attention": 3000.0, "matmul": 1000.0},
            "top": [{"kernel": "cudnn_sdpa_fprop", "ms": 3000.0, "calls": 80, "group": "attention"}]}
    (folder / "high.json").write_text(json.dumps({"label": "high", "call_s": [9.0, 5.5, 4.0, 4.2],
                                                  "profiled_call": 1, "profile": prof}))
    (folder / "low.json").write_text("{broken")
    from comfyui_lowvram_dit.benchmarks import server_probe

    probe = server_probe.read_probe(folder)
    assert probe["high"]["call_s"] == [9.0, 5.5, 4.0, 4.2] and "error" in probe["low"]
    md = "\n".join(rep.probe_lines([{"name": "pack", "probe": probe}]))
    assert "| pack | high | 4.100 | 4 | 5.500 | 4000.0 | 3000.0 | 1000.0 |" in md and "`cudnn_sdpa_fprop`" in md
    assert rep.probe_lines([{"name": "pack"}]) == []
    per_node = [{"first_s": 9.0, "steps_s": [5.5, 4.0, 4.2]}, {"first_s": 3.0, "steps_s": [6.0, 4.4, 4.6]}]
    server_probe.drop_profiled_steps(per_node, run.PROBE_CALL)
    assert [d["steps_s"] for d in per_node] == [[4.0, 4.2], [4.4, 4.6]]
    assert [d["profiled_step_s"] for d in per_node] == [[5.5], [6.0]]
    assert run.summarize_steps(per_node)["s_per_step"] == 4.3


def test_native_ck_rows_with_the_4step_loras() -> None:
    """native_fp8fast_ck_8gb_4step / _lora4: the graphs of the default-attention 4-step rows on a server with
    --use-ck-attention at the 8 GB cap, baselines in the 'lora' group, each ratio naming them."""
    v = bs.VARIANTS
    for name, twin in (("native_fp8fast_ck_8gb_4step", "native_fp8fast_8gb_4step"),
                       ("native_fp8fast_ck_8gb_lora4", "native_fp8fast_8gb_lora4")):
        row = v[name]
        assert name in bs.LORA_ROWS and row.baseline and row.four_step and row.card_gib == run.CARD_GIB
        assert row == replace(v[twin], name=name, ck_attention=True)
        same, other = bs.build_graph(row, 3), bs.build_graph(v[twin], 3)
        assert {k: n for k, n in same.items() if k != "19"} == {k: n for k, n in other.items() if k != "19"}
        assert row.server_args(79.65) == ["--use-ck-attention", "--reserve-vram=71.65"]
    assert v["native_fp8fast_ck_8gb_lora4"].lora and not v["native_fp8fast_ck_8gb_4step"].lora
    rows = [_row("native_fp8fast_ck_8gb_4step", 2.4), _row("native_fp8fast_ck_8gb_lora4", 3.0),
            _row("pack_blockswap_8gb_lora4", 2.0)]
    assert rep.ratios(rows)["pack_blockswap_8gb_lora4"] == {"native_fp8fast_ck_8gb_4step": 1.2,
                                                            "native_fp8fast_ck_8gb_lora4": 1.5}
    assert "1.50x vs native_fp8fast_ck_8gb_lora4" in rep.markdown(rows, {}, {
        "steps_per_expert": 3, "width": 1, "height": 1, "frames": 1, "cfg": 1.0, "decode": False})


def test_cli_keeps_its_flags() -> None:
    opts = run.parser(bs.SCENARIO).parse_args(["--comfyui", "c", "--models", "m", "--variants", "lora", "--keep-logs",
                                    "--list-nodes", "--deadline", "500", "--merge", "a.json", "--write-models"])
    assert (opts.keep_logs, opts.list_nodes, opts.deadline, opts.merge, opts.write_models) == (
        True, True, 500.0, [Path("a.json")], True)
    assert {"native_fp8fast_ck_8gb_4step", "native_fp8fast_ck_8gb_lora4"} <= {v.name for v in bs.pick_variants("lora")}


# ----------------------------------------------------------------------------------------------------------
# the shared row runner (server.run_row) with a stand-in for ComfyUI


class FakeServer:
    """What run_row reads of a started server: its log, /object_info, the URL and the process id."""

    def __init__(self, log: str) -> None:
        self.log, self.url, self.pid = log, "http://127.0.0.1:1", 1

    def log_text(self) -> str:
        return self.log

    def get(self, route: str, timeout: float = 30.0) -> dict:
        return {"LowVRAM_WanLoader": {}, "LowVRAM_BlockSwap": {}, "KSampler": {}}


def fake_start(monkeypatch: pytest.MonkeyPatch, log: Callable[[Path], str]) -> list[dict]:
    """Replace ComfyServer.start: each start records its base folder and flags, writes ``log(base)`` as the
    server log; returns the list of starts."""
    starts: list[dict] = []

    @contextlib.contextmanager
    def start(comfyui: Path, base: Path, *, cpu: bool = False, extra_args: list[str] | None = None,
              timeout: float = 300.0) -> Iterator[FakeServer]:
        pack = base / "custom_nodes" / "comfyui-lowvram-dit"
        starts.append({"base": base, "args": list(extra_args or []), "cpu": cpu, "pack": pack.resolve(),
                       "inputs": sorted(p.name for p in (base / "input").iterdir())})
        (base / "comfyui.log").write_text(log(base))
        yield FakeServer(log(base))

    monkeypatch.setattr(run.cli_server.ComfyServer, "start", start)
    return starts


def _measured(server: object, graph: dict, timeout: float, sampler_nodes: tuple, probe_dir: object = None) -> dict:
    return {"status": "ok", "s_per_step": 1.5, "first_step_s": [9.0], "timeline": [[0.0, 1.0, 1.0, 2.0]],
            "sampler_nodes": list(sampler_nodes)}


def test_run_row_records_flags_without_machine_paths_and_keeps_the_log(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    starts = fake_start(monkeypatch, lambda base: LOG_033)
    monkeypatch.setattr(run, "measure", _measured)
    setup = run.ServerSetup(tmp_path / "comfy", tmp_path / "models", tmp_path / "work", keep_logs=True,
                            list_nodes=True)
    setup.work.mkdir()
    row = bs.VARIANTS["native_fp8fast_ck_8gb_lora4"]
    rec = run.run_row(setup, row, {}, 79.65, {"name": row.name}, sampler_nodes=bs.SAMPLER_NODES,
                      prepare_input=lambda folder: (folder / "ref.png").write_bytes(b"x"))
    assert rec["status"] == "ok" and rec["sampler_nodes"] == ["15", "16"] and rec["s_per_step"] == 1.5
    assert starts[0]["pack"] == run.PACK_ROOT and starts[0]["inputs"] == ["ref.png"]
    assert not any(str(tmp_path) in f for f in rec["server_args"]), rec["server_args"]
    flags = rec["server_args"]
    assert flags[flags.index("--user-directory") + 1] == "$WORK/user"
    assert flags[flags.index("--front-end-root") + 1] == "$WORK/frontend"
    assert flags[-2:] == ["--use-ck-attention", "--reserve-vram=71.65"]
    assert rec["tqdm"] == run.tqdm_summaries(LOG_033) and rec["log"] == run.log_digest(LOG_033)
    assert rec["lora_keys_not_loaded"] == 0
    assert rec["pack_nodes"] == ["LowVRAM_BlockSwap", "LowVRAM_WanLoader"] and rec["object_info_nodes"] == 3
    assert (setup.work / f"{row.name}.log").read_bytes().decode() == LOG_033
    assert not starts[0]["base"].exists()  # the row's base folder is removed
    rec = run.run_row(setup, row, {}, 79.65, {"name": row.name}, sampler_nodes=("3",), own_user_dir=True)
    base = str(starts[1]["base"]).replace(str(setup.work), "$WORK")
    assert rec["server_args"][rec["server_args"].index("--user-directory") + 1] == f"{base}/user"


def test_run_row_records_a_pack_that_failed_to_import_and_a_gpu_too_small(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    starts = fake_start(monkeypatch, lambda base: (f"Traceback ...\nImportError: boom\n   0.1 seconds (IMPORT FAILED): "
                                                   f"{base / 'custom_nodes' / 'comfyui-lowvram-dit'}\n"))
    monkeypatch.setattr(run, "measure", lambda *a, **k: pytest.fail("a graph was queued on a server without the pack"))
    setup = run.ServerSetup(tmp_path, tmp_path, tmp_path)
    rec = run.run_row(setup, bs.VARIANTS["pack"], {}, 79.65, {"name": "pack"}, sampler_nodes=bs.SAMPLER_NODES)
    assert rec["status"] == "error" and "the pack failed to import" in rec["error"], rec
    assert "ImportError: boom" in rec["log"] and rec["lora_keys_not_loaded"] == 0
    rec = run.run_row(setup, bs.VARIANTS["pack_8gb"], {}, 6.0, {"name": "pack_8gb"}, sampler_nodes=bs.SAMPLER_NODES)
    assert rec["status"] == "error" and "drop the capped variants" in rec["error"] and len(starts) == 1


def test_run_rows_skips_what_the_deadline_leaves_no_time_for(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [bs.VARIANTS["native_fp8fast_ck_8gb_4step"], bs.VARIANTS["pack_blockswap_8gb_4step"]]
    written: list[int] = []
    done = run.run_rows(rows, lambda v: {"name": v.name, "status": "ok"}, lambda row: run.head(bs.SCENARIO, row),
                        lambda res: written.append(len(res)), [], time.monotonic())
    assert [r["status"] for r in done] == ["ok", "ok"] and written == [1, 2]
    done = run.run_rows(rows, lambda v: pytest.fail("started past the deadline"), lambda row: run.head(bs.SCENARIO, row), written.append,
                        [{"name": "merged"}], time.monotonic() - 100, deadline=150, reserve_estimate=60)
    assert [(r["name"], r["status"]) for r in done[1:]] == [(v.name, "skipped") for v in rows]
    assert done[1]["variant"]["ck_attention"] is True and done[1]["what"] == bs.describe(rows[0])


def test_run_row_keeps_no_machine_path_in_the_log_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setup = run.ServerSetup(tmp_path / "comfy", tmp_path / "models", tmp_path / "work")
    setup.work.mkdir()
    header = (f"# comfyui_lowvram_dit: ComfyUI log: {sys.executable} {setup.comfyui}/main.py --base-directory "
              f"{setup.work}/bench_row_x1 --user-directory {setup.work}/user\n")
    fake_start(monkeypatch, lambda base: header + LOG_033)
    monkeypatch.setattr(run, "measure", _measured)
    row = bs.VARIANTS["native_fp8fast_ck_8gb_lora4"]
    rec = run.run_row(setup, row, {}, 79.65, {"name": row.name}, sampler_nodes=bs.SAMPLER_NODES)
    assert rec["log"][0] == ("# comfyui_lowvram_dit: ComfyUI log: python3 <ComfyUI>/main.py --base-directory "
                             "$WORK/bench_row_x1 --user-directory $WORK/user"), rec["log"][0]
    assert not any(str(tmp_path) in line for line in rec["log"])
