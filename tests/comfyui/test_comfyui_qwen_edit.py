"""Qwen-Image-Edit staged loader: the streamed encoder (vision tower included) against ComfyUI's own
CLIPLoader + TextEncodeQwenImageEditPlus, on the CPU and (``-m cuda``, run alone) on the GPU, the cache keyed by
prompt + image content + encoder + device type, ``text_encoder_device`` reaching the encoder, and a real server.

Files: a small Qwen2.5-VL encoder (``EDIT_TE``: ComfyUI's widths, the full 32-block vision tower ComfyUI always builds,
2 language layers; written by tests/unit/test_staged.py's writer), the tiny Wan 2.1 VAE and, for the server, the tiny Qwen-Image transformer.
The vision tower and a 1024x1024 VAE encode run on the CPU here: each encode takes about a minute.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from comfy_server import (
    ComfyServer, check_device_choices, check_gpu_refused_on_a_cpu_server, check_stage_1_devices,
    comfyui_in_process_or_skip, stock_conditioning,
)
from comfyui_lowvram_dit.synthetic import checkpoints as synth
from comfyui_lowvram_dit.synthetic.specs import Qwen25VLConfig, model_config
from test_staged import WITH_VISION, write_small_text_encoder

pytestmark = pytest.mark.comfyui
NODE = "Qwen-Image-Edit Staged Loader (LowVRAM)"
# Written here, not shared with the text-only tests: Edit needs the full vision tower (32 blocks, width 1280, fixed in
# ComfyUI) and the language model at ComfyUI's widths (3584 = the transformer's joint_attention_dim), 2 layers deep.
EDIT_TE = Qwen25VLConfig(num_layers=2, hidden=3584, intermediate=256, num_heads=28, num_kv_heads=4, head_dim=128,
                         vocab_size=152064, vision_layers=32, vision_hidden=1280, vision_intermediate=3420)
# The tiny transformer, narrow as the runner's, with a joint dim equal to the encoder's hidden size (the vision
# tower's merger, which ComfyUI builds at fixed sizes, projects to 3584).
EDIT_DIT = replace(model_config("qwen_image", "tiny"), joint_dim=EDIT_TE.hidden)
GIB = float(1 << 30)
STAGE1_RE = re.compile(r"Qwen-Image stage 1 \(text \+ vision encoder, ([^)]*)\): [\d.]+ s, RSS ([\d.]+) -> "
                       r"([\d.]+) GiB \(peak ([\d.]+) GiB\)(?:, VRAM [^;]*)?; (.*)")


def _image(seed: int, h: int = 40, w: int = 56):  # noqa: ANN202 - IMAGE tensor [1, H, W, 3]
    import torch

    return torch.rand(1, h, w, 3, generator=torch.Generator().manual_seed(seed))


def _same(a: list, b: list) -> None:
    """Two CONDITIONING lists hold equal tensors (reference latents included) and the same extras."""
    import torch

    assert len(a) == len(b)
    for (ta, ea), (tb, eb) in zip(a, b):
        assert torch.equal(ta.cpu(), tb.cpu())
        assert sorted(ea) == sorted(eb)
        for k in ea:
            va, vb = ea[k], eb[k]
            if isinstance(va, list):
                assert len(va) == len(vb) and all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(va, vb)), k
            elif isinstance(va, torch.Tensor):
                assert torch.equal(va.cpu(), vb.cpu()), k
            else:
                assert va == vb, k


def _stock_edit(te: Path, device, prompts: list[str], vae, image) -> list[list]:  # noqa: ANN001
    """CLIPLoader (load_clip, QWEN_IMAGE, loaded on ``device``) + TextEncodeQwenImageEditPlus(prompt, vae, image)."""
    import torch
    from comfy_extras.nodes_qwen import TextEncodeQwenImageEditPlus
    from comfyui_lowvram_dit.checkpoints import safetensors_io as checkpoint_io, text_encoders

    cfg = text_encoders.qwen25_vl_config_from_header(checkpoint_io.read_header(te))
    return stock_conditioning(te, "QWEN_IMAGE", {"load_device": device, "offload_device": torch.device("cpu"),
                                                 "qwen25_7b_model_config": cfg}, prompts,
                              lambda clip, p: TextEncodeQwenImageEditPlus.execute(clip, p, vae, image, None,
                                                                                  None).args[0])


def test_edit_encode_equals_stock_and_caches_by_image(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In process: streamed encode == CLIPLoader (load_clip, QWEN_IMAGE, CPU) + TextEncodeQwenImageEditPlus, tensor
    for tensor; the same prompt + image is then served from the cache (encoder not loaded), a changed pixel misses;
    RSS holds one copy of the encoder and falls back after it is freed."""
    comfyui_in_process_or_skip()
    import folder_paths
    import torch
    from comfyui_lowvram_dit.host import qwen_edit, qwen_stages

    monkeypatch.setattr(folder_paths, "get_user_directory", lambda: str(tmp_path / "user"))
    te = write_small_text_encoder(tmp_path / "te.safetensors", "bf16", seed=2, cfg=EDIT_TE)
    vae = qwen_stages.load_vae(synth.write_synthetic("wan21_vae", tmp_path / "vae.safetensors", "tiny", "bf16",
                                                     seed=3))
    img = _image(0)
    prompt = "Replace the cat with a dalmatian"
    cpu = torch.device("cpu")
    with torch.inference_mode():
        ours, rep = qwen_edit.encode_edit_prompts(te, [prompt], [img], vae, target_device=cpu)
        assert "0 of 1 prompts from the embedding cache" in rep.notes[0] and "encoder freed" in rep.notes[0], rep
        (stock,) = _stock_edit(te, cpu, [prompt], vae, img)
        _same(ours[0], stock)
        assert ours[0][0][0].shape[-1] == 3584 and len(ours[0][0][1]["reference_latents"]) == 1
        # Same prompt and image: from the cache, the encoder never built; reference latents made again by the VAE.
        hit, rep = qwen_edit.encode_edit_prompts(te, [prompt], [img], vae, target_device=cpu)
        assert "1 of 1 prompts from the embedding cache" in rep.notes[0] and "encoder not loaded" in rep.notes[0]
        _same(hit[0], stock)
        # One pixel changed: a miss with other embeddings (no VAE here: RSS then shows the encoder alone).
        changed = img.clone()
        changed[0, 0, 0, 0] = 1.0 - changed[0, 0, 0, 0]
        miss, rep = qwen_edit.encode_edit_prompts(te, [prompt], [changed], None, target_device=cpu)
    assert "0 of 1 prompts from the embedding cache" in rep.notes[0], rep
    assert miss[0][0][0].shape == ours[0][0][0].shape and not torch.equal(miss[0][0][0], ours[0][0][0])
    size = te.stat().st_size
    assert rep.rss_peak - rep.rss_start < 1.5 * size, rep.format()  # one copy of the encoder (+ activations)
    assert rep.rss_peak - rep.rss_start > 0.8 * size, rep.format()  # ...and it was resident
    assert rep.rss_end - rep.rss_start < 0.35 * GIB, rep.format()  # freed afterwards


def test_edit_encoder_requires_the_vision_tower(tmp_path: Path) -> None:
    """A text-only Qwen2.5-VL file is refused by name for Edit (the text-only loader accepts it with a warning)."""
    comfyui_in_process_or_skip()
    from comfyui_lowvram_dit.checkpoints.safetensors_io import CheckpointError
    from comfyui_lowvram_dit.host import qwen_edit
    from comfyui_lowvram_dit.host import text_encoders
    from comfyui_lowvram_dit.synthetic.specs import Qwen25VLConfig

    te = write_small_text_encoder(tmp_path / "te_text_only.safetensors", "bf16",
                                  cfg=Qwen25VLConfig(num_layers=1, intermediate=128, vision_layers=0))
    with pytest.raises(CheckpointError, match="te_text_only.safetensors: the file lacks .* Qwen2.5-VL weights"):
        text_encoders.build_streaming(qwen_edit.QWEN25_VL_EDIT, te)


def test_the_node_hands_the_chosen_device_to_stage_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """text_encoder_device reaches the text + vision stage resolved (left out = auto = where ComfyUI runs text
    encoders); a choice that is not an option, or gpu on a CPU-only ComfyUI, is an error naming the node and the
    option, raised before any file is read. The stages are planted: what is checked is what the node hands them."""
    comfyui_in_process_or_skip()
    from comfyui_lowvram_dit.nodes import qwen_edit

    calls: list = []
    monkeypatch.setattr(qwen_edit, "prepare_files", lambda *a: calls.append("files") or ("u", "t", "v"))
    monkeypatch.setattr(qwen_edit, "load_vae", lambda path: "vae")
    monkeypatch.setattr(qwen_edit, "encode_edit_prompts", lambda te, prompts, images, vae, use_cache, device:
                        calls.append(device) or (([], []), None))
    monkeypatch.setattr(qwen_edit, "load_staged_model", lambda *a: ("model", None))
    args = {"unet_name": "u", "clip_name": "t", "vae_name": "v", "positive": "p", "negative": " ",
            "quantization": "fp8 per-tensor", "vram_budget_gb": 0.0, "blocks_to_swap": -1, "cache_embeddings": True,
            "compute": "auto", "image1": None}
    check_device_choices(monkeypatch, lambda **choice: qwen_edit.QwenImageEditStagedLoader.execute(**args, **choice),
                         calls, f"{NODE}, text_encoder_device")


def test_stage_1_encodes_on_its_device_and_keeps_devices_apart_in_the_cache(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """encode_edit_prompts hands its device to the streamed encoder (a spy records it and builds on this CPU), names
    it in the stage label, keys the embedding cache by its type (a GPU's kernels round differently from the CPU's) and
    still returns the embeddings on the compute device. Text-only prompts: the vision tower is built, not run."""
    comfyui_in_process_or_skip()
    import comfy.model_management as mm
    import folder_paths
    import torch
    from comfyui_lowvram_dit.host import qwen_edit

    monkeypatch.setattr(folder_paths, "get_user_directory", lambda: str(tmp_path / "user"))
    te = write_small_text_encoder(tmp_path / "te.safetensors", "fp8_scaled", seed=4, cfg=WITH_VISION)

    def encode(device: torch.device, target: torch.device | None) -> tuple[list, object]:
        if target is None:  # the default, the compute device: meta stands in for the GPU (no encoder is built now)
            monkeypatch.setattr(mm, "get_torch_device", lambda: torch.device("meta"))
        with torch.inference_mode():
            return qwen_edit.encode_edit_prompts(te, ["make the sky green", " "], [], None, target_device=target,
                                                 device=device)

    check_stage_1_devices(monkeypatch, encode, "text + vision encoder", WITH_VISION.hidden)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["bf16", "fp8_scaled"])
def test_on_the_gpu_equals_stock_load_clip_on_the_gpu(comfy_on_gpu: None, tmp_path: Path, fmt: str) -> None:
    """text_encoder_device = gpu: ComfyUI's model management loads the streamed encoder onto the GPU to encode (the
    encoder moves the CPU reference image there itself), as it loads CLIPLoader's: the same CONDITIONING as stock
    load_clip(QWEN_IMAGE) on that GPU + TextEncodeQwenImageEditPlus, reference latents included, bit for bit; it
    ends on the compute device."""
    import comfy.model_management as mm
    import torch
    from comfyui_lowvram_dit.host import qwen_edit, qwen_stages, text_encoders

    te = write_small_text_encoder(tmp_path / f"te_{fmt}.safetensors", fmt, seed=2, cfg=WITH_VISION)
    vae = qwen_stages.load_vae(synth.write_synthetic("wan21_vae", tmp_path / "vae.safetensors", "tiny", "bf16",
                                                     seed=3))
    gpu = text_encoders.resolve_device("gpu", f"{NODE}, text_encoder_device")
    img, prompts = _image(0), ["Replace the cat with a dalmatian", " "]
    with torch.inference_mode():
        ours, report = qwen_edit.encode_edit_prompts(te, prompts, [img], vae, use_cache=False, device=gpu)
    assert "cuda" in report.name and "encoder freed" in report.notes[0], (report.name, report.notes)
    stock = _stock_edit(te, gpu, prompts, vae, img)
    for a, b in zip(ours, stock, strict=True):
        (emb, extra), = a
        assert emb.device == mm.get_torch_device() and bool(emb.abs().sum() > 0)
        assert [r.device for r in extra["reference_latents"]] == [mm.get_torch_device()]
        _same(a, b)


def test_2511_marker_reaches_comfyui_detection(tmp_path: Path) -> None:
    """A 2511 file's ``__index_timestep_zero__`` survives the fp8 streaming read: ComfyUI then sets the reference
    method as it does for UNETLoader; a 2509-style file without it keeps the default."""
    comfyui_in_process_or_skip()
    import torch
    from comfyui_lowvram_dit.checkpoints.safetensors_io import iter_tensors, read_header
    from comfyui_lowvram_dit.host import qwen_stages
    from safetensors.torch import save_file

    plain = synth.write_synthetic("qwen_image", tmp_path / "edit_2509.safetensors", "tiny", "bf16", seed=3)
    header = read_header(plain)
    sd = dict(iter_tensors(header, list(header.tensors)))
    save_file({**sd, "__index_timestep_zero__": torch.tensor([])}, str(tmp_path / "edit_2511.safetensors"))
    del sd
    methods = {}
    for name in ("edit_2509", "edit_2511"):
        patcher = qwen_stages.load_transformer(tmp_path / f"{name}.safetensors", "per_tensor")
        methods[name] = patcher.model.diffusion_model.default_ref_method
        del patcher
    assert methods == {"edit_2509": "index", "edit_2511": "index_timestep_zero"}, methods


# ---------------------------------------------------------------------------------------------------------
# Through a real server


@pytest.fixture(scope="module")
def files(comfy_server: ComfyServer) -> Iterator[dict[str, str]]:
    """Unique file names (the server is shared by the session); deleted after the module."""
    tag = uuid.uuid4().hex[:8]
    models = comfy_server.base_dir / "models"
    names = {"unet": f"edit_qwen_{tag}.safetensors", "te": f"edit_te_{tag}.safetensors",
             "vae": f"edit_vae_{tag}.safetensors"}
    synth.write_synthetic("qwen_image", models / "diffusion_models" / names["unet"], "tiny", "bf16", seed=3,
                          config=EDIT_DIT)
    write_small_text_encoder(models / "text_encoders" / names["te"], "bf16", seed=0, cfg=EDIT_TE)
    synth.write_synthetic("wan21_vae", models / "vae" / names["vae"], "tiny", "bf16", seed=3)
    yield names
    for folder, key in (("diffusion_models", "unet"), ("text_encoders", "te"), ("vae", "vae")):
        (models / folder / names[key]).unlink(missing_ok=True)


def _graph(files: dict[str, str], prompt: str, quantization: str, seed: int) -> dict:
    """The 2511 template's shape: reference image -> loader -> FluxKontextMultiReferenceLatentMethod -> KSampler on
    the VAE-encoded image; one step at cfg 1 (the tiny transformer still sees the reference tokens)."""
    return {
        "1": {"class_type": "EmptyImage", "inputs": {"width": 56, "height": 40, "batch_size": 1, "color": 0x3366CC}},
        "2": {"class_type": "LowVRAM_QwenImageEditStagedLoader", "inputs": {
            "unet_name": files["unet"], "clip_name": files["te"], "vae_name": files["vae"], "positive": prompt,
            "negative": "", "quantization": quantization, "vram_budget_gb": 0.0, "blocks_to_swap": -1,
            "cache_embeddings": True, "compute": "auto", "image1": ["1", 0]}},
        "3": {"class_type": "FluxKontextMultiReferenceLatentMethod", "inputs": {
            "conditioning": ["2", 1], "reference_latents_method": "index_timestep_zero"}},
        "4": {"class_type": "VAEEncode", "inputs": {"pixels": ["1", 0], "vae": ["2", 3]}},
        "5": {"class_type": "KSampler", "inputs": {
            "model": ["2", 0], "positive": ["3", 0], "negative": ["2", 2], "latent_image": ["4", 0], "seed": seed,
            "steps": 1, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        "6": {"class_type": "LowVRAMTest_LatentStats", "inputs": {"latent": ["5", 0]}},
        "7": {"class_type": "LowVRAMTest_ConditioningStats", "inputs": {"conditioning": ["3", 0]}},
    }


def _stage1(log: str) -> tuple[float, float, float, str]:
    """Stage 1's RSS at start, end and peak, and its notes; the device it names is the server's."""
    m = STAGE1_RE.search(log)
    assert m, log[-4000:]
    want = "cpu" if os.environ.get("COMFYUI_GPU") != "1" else "cuda"  # text_encoder_device left out = auto
    assert m.group(1).startswith(want), m.group(0)
    return float(m.group(2)), float(m.group(3)), float(m.group(4)), m.group(5)


def test_edit_loader_through_the_server(comfy_server: ComfyServer, files: dict[str, str]) -> None:
    """Cold run (both prompts encoded with the image, encoder freed, reference latents in the CONDITIONING), then the
    same prompt and image with the transformer re-loaded: stage 1 from the cache, identical conditioning."""
    info = comfy_server.object_info("LowVRAM_QwenImageEditStagedLoader")
    # last and optional: a workflow saved before it keeps its widget order, and an API prompt without it runs (auto)
    order = info["input_order"]
    assert order["required"][-1] == "compute", order
    assert order["optional"] == ["image1", "image2", "image3", "text_encoder_device", "batch_cfg"], order
    kind, spec = info["input"]["optional"]["text_encoder_device"]
    assert kind == "COMBO" and spec["options"] == ["auto", "cpu", "gpu"] and spec["default"] == "auto", spec
    assert info["output"] == ["MODEL", "CONDITIONING", "CONDITIONING", "VAE"]
    prompt = f"make the sky green {uuid.uuid4().hex[:6]}"
    before = len(comfy_server.log_text())
    entry = comfy_server.run(_graph(files, prompt, "fp8 block-wise", 1), timeout=1500)
    start, end, peak, notes = _stage1(comfy_server.log_text()[before:])
    assert "0 of 2 prompts from the embedding cache, 1 reference image(s), encoder freed" in notes, notes
    assert end - start < 0.5, (start, end, peak)
    cond = entry["outputs"]["7"]["conditioning_stats"][0]
    assert cond["shape"][-1] == 3584 and cond["finite"], cond
    assert {"reference_latents", "reference_latents_method"} <= set(cond["keys"]), cond
    assert entry["outputs"]["6"]["latent_stats"][0]["finite"]

    before = len(comfy_server.log_text())
    entry2 = comfy_server.run(_graph(files, prompt, "fp8 per-tensor", 2), timeout=1500)
    log2 = comfy_server.log_text()[before:]
    assert "2 of 2 prompts from the embedding cache, 1 reference image(s), encoder not loaded" in _stage1(log2)[3]
    assert "streamed to the CPU" not in log2
    assert entry2["outputs"]["7"]["conditioning_stats"] == entry["outputs"]["7"]["conditioning_stats"]


def test_a_gpu_text_encoder_on_a_cpu_server_is_refused_by_name(comfy_server: ComfyServer,
                                                               files: dict[str, str]) -> None:
    """text_encoder_device = gpu where ComfyUI runs on the CPU: an error naming the node, the option and the fix,
    before the text stage runs."""
    graph = _graph(files, f"make the boat red {uuid.uuid4().hex[:6]}", "fp8 per-tensor", 3)
    check_gpu_refused_on_a_cpu_server(comfy_server, graph, "2", f"{NODE}, text_encoder_device")


def test_shared_images_run_the_vision_tower_and_the_vae_once() -> None:
    """Both prompts carry the same images: the vision tower and the VAE encode run once per distinct input, and each
    caller gets its own copy of the same values; another input runs again."""
    comfyui_in_process_or_skip()
    import torch
    from comfyui_lowvram_dit.host import qwen_edit

    calls: list[str] = []

    class Tower(torch.nn.Module):
        def forward(self, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
            calls.append("tower")
            return pixels.sum(-1, keepdim=True) * grid.sum()

    class Vae:
        downscale_ratio = 8

        def encode(self, pixels: torch.Tensor) -> torch.Tensor:
            calls.append("vae")
            return pixels.mean(-1)

    tower, pixels, grid = Tower(), torch.rand(4, 6), torch.tensor([[1, 2, 2]])
    qwen_edit.reuse_vision_features(tower)
    first, again = tower(pixels, grid), tower(pixels.clone(), grid)
    assert torch.equal(first, again) and first.data_ptr() != again.data_ptr()
    assert not torch.equal(tower(pixels + 1, grid), first) and not torch.equal(tower(pixels, grid * 2), first)
    assert calls == ["tower"] * 3
    vae = qwen_edit.ReusedVAEEncodes(Vae())
    image = torch.rand(1, 8, 8, 3)
    latents = [vae.encode(image), vae.encode(image.clone()), vae.encode(image * 0.5)]
    assert calls.count("vae") == 2 and torch.equal(latents[0], latents[1]) and not torch.equal(latents[0], latents[2])
    assert vae.downscale_ratio == 8  # everything else is the VAE's own


def _split_graph(files: dict[str, str], prompt: str, seed: int) -> dict:
    """The same edit with Qwen-Image Loader + Qwen-Image-Edit Text Encode in place of the Edit Staged Loader."""
    g = _graph(files, prompt, "fp8 per-tensor", seed)
    staged = g.pop("2")["inputs"]
    g["2"] = {"class_type": "LowVRAM_QwenImageLoader", "inputs": {
        k: staged[k] for k in ("unet_name", "vae_name", "quantization", "vram_budget_gb", "blocks_to_swap", "compute")}}
    g["8"] = {"class_type": "LowVRAM_QwenImageEditTextEncode", "inputs": {
        "clip_name": staged["clip_name"], "vae": ["2", 1], "positive": staged["positive"],
        "negative": staged["negative"], "cache_embeddings": True, "image1": ["1", 0]}}
    g["3"]["inputs"]["conditioning"] = ["8", 0]
    g["4"]["inputs"]["vae"] = ["2", 1]
    g["5"]["inputs"]["negative"] = ["8", 1]
    return g


def test_edit_split_nodes_equal_the_staged_loader_and_keep_the_transformer(comfy_server: ComfyServer,
                                                                          files: dict[str, str]) -> None:
    """Qwen-Image Loader + Qwen-Image-Edit Text Encode give the Edit Staged Loader's picture; a new instruction
    re-runs only the text node (the transformer is built once)."""
    tag = uuid.uuid4().hex[:6]
    ref = comfy_server.run(_graph(files, f"make the roof red {tag}", "fp8 per-tensor", 77), timeout=1500)
    built = "lowvram_dit Qwen-Image transformer " + files["unet"]
    before = len(comfy_server.log_text())
    first = comfy_server.run(_split_graph(files, f"make the roof red {tag}", 77), timeout=1500)
    log = comfy_server.log_text()[before:]
    assert first["outputs"]["6"] == ref["outputs"]["6"] and first["outputs"]["7"] == ref["outputs"]["7"]
    assert log.count(built) == 1, log[-3000:]
    before = len(comfy_server.log_text())
    second = comfy_server.run(_split_graph(files, f"make the door blue {tag}", 77), timeout=1500)
    log2 = comfy_server.log_text()[before:]
    assert built not in log2, log2[-3000:]
    assert "1 of 2 prompts from the embedding cache, 1 reference image(s)" in _stage1(log2)[3]
    assert second["outputs"]["7"] != ref["outputs"]["7"] and second["outputs"]["6"]["latent_stats"][0]["finite"]
