"""The server scenarios' API graphs against a real ComfyUI's /object_info (the unit tests check them against the
0.8.0 schema snapshot): every node, input, option and link type the running version would validate."""

from __future__ import annotations

import pytest
from comfy_server import ComfyServer
from comfyui_lowvram_dit.benchmarks import server_qwen as bq
from comfyui_lowvram_dit.benchmarks import server_wan as bs
from test_bench_server import _problems

pytestmark = pytest.mark.comfyui


@pytest.fixture(scope="module")
def object_info(comfy_server: ComfyServer) -> dict:
    return comfy_server.object_info()


@pytest.mark.parametrize("decode", [False, True])
def test_qwen_t2i_rows_validate(object_info: dict, decode: bool) -> None:
    for name, row in bq.ROWS.items():
        assert _problems(bq.build_graph(row, decode=decode), object_info) == [], name
    bad = bq.build_graph(bq.ROWS["native_fp8fast_ck_8gb_lora4"], decode=decode)
    bad["37"]["inputs"]["weight_dtype"], bad["38"]["inputs"]["type"] = "fp8_fastest", "qwen"
    bad["66"]["inputs"]["model"] = ["6", 0]  # a CONDITIONING where a MODEL goes
    assert len(_problems(bad, object_info)) == 3


@pytest.mark.parametrize("decode", [False, True])
def test_wan_4step_rows_validate(object_info: dict, decode: bool) -> None:
    for name in bs.LORA_ROWS:
        assert _problems(bs.build_graph(bs.VARIANTS[name], 3, decode=decode), object_info) == [], name


@pytest.mark.parametrize("edit", ["2509", "2511"])
def test_qwen_edit_rows_validate(object_info: dict, edit: str) -> None:
    for kind in ("native", "pack"):
        graph = bq.build_edit_graph(kind, bq.EDIT_UNET, bq.EDIT_TEXT_ENCODER, bq.VAE, 4, edit, 8.0,
                                    empty_image=(1024, 1024))
        assert _problems(graph, object_info) == [], kind


def test_wan_split_rows_validate_where_core_has_the_split_node(object_info: dict) -> None:
    """The MultiGPU CFG Split rows: valid on a ComfyUI with core's split node (0.33), an unknown node before it
    (0.8.0: the runner skips them there, see server.split_skip_reason)."""
    from comfyui_lowvram_dit.benchmarks import server as run

    for name in (n for n, v in bs.VARIANTS.items() if v.gpus > 1):
        problems = _problems(bs.build_graph(bs.VARIANTS[name], 3), object_info)
        if run.SPLIT_NODE in object_info:
            assert problems == [], name
        else:
            assert problems == [f"52: unknown node {run.SPLIT_NODE}", f"53: unknown node {run.SPLIT_NODE}"], name
