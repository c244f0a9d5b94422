"""Qwen-Image staged loader inside a real ComfyUI v0.8.0: tiny synthetic Qwen-Image end to end.

Files: the tiny Qwen-Image transformer (tools.synth: 1 block, 2 heads, joint dim 128; the loader reads the widths
from the file), the tiny Qwen2.5-VL text encoder of `run --synthetic tiny` (2 layers, hidden 128, no vision tower;
tests/unit/test_staged.py) and the tiny Wan 2.1 VAE.
Graph: LowVRAM_QwenImageStagedLoader -> KSampler -> LowVRAM_QwenImageDecode. A second test proves in process that
the streamed encoder gives exactly ComfyUI's own embeddings (load_clip + encode), bf16 and fp8_scaled, on the CPU and
(``-m cuda``, run alone) on the GPU; others that ``text_encoder_device`` reaches the encoder and keys the cache.
Runs in order (one server per session): cold run (cache miss, RSS falls back), cache hit (encoder not loaded),
encoder file replaced under the same name (cache miss, different embeddings).
"""

from __future__ import annotations

import itertools
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from comfy_server import (
    ComfyServer, check_device_choices, check_gpu_refused_on_a_cpu_server, check_stage_1_devices,
    comfyui_in_process_or_skip, stock_conditioning,
)
from comfyui_lowvram_dit.synthetic import checkpoints as synth
from test_staged import SMALL_TE, WITH_VISION, write_small_text_encoder

pytestmark = pytest.mark.comfyui
PROMPTS = ["a red cat on a blue chair, photo", " "]
NODE = "Qwen-Image Staged Loader (LowVRAM)"
_seed = itertools.count(7000)
STAGE_RE = re.compile(r"Qwen-Image (stage \d) \(([^)]*)\): ([\d.]+) s, RSS ([\d.]+) -> ([\d.]+) GiB \(peak ([\d.]+) GiB\)"
                      r"(?:, VRAM [^;]*)?(?:; (.*))?")


@pytest.fixture(scope="module")
def files(comfy_server: ComfyServer) -> Iterator[dict[str, str]]:
    """Unique file names (the server is shared by the session) for transformer, encoder and VAE; deleted after
    the module (the server outlives it)."""
    tag = uuid.uuid4().hex[:8]
    models = comfy_server.base_dir / "models"
    names = {"unet": f"staged_qwen_{tag}.safetensors", "te": f"staged_te_{tag}.safetensors",
             "vae": f"staged_vae_{tag}.safetensors"}
    synth.write_synthetic("qwen_image", models / "diffusion_models" / names["unet"], "tiny", "bf16", seed=3)
    write_small_text_encoder(models / "text_encoders" / names["te"], "bf16", seed=0)
    synth.write_synthetic("wan21_vae", models / "vae" / names["vae"], "tiny", "bf16", seed=3)
    yield names
    for folder, key in (("diffusion_models", "unet"), ("text_encoders", "te"), ("vae", "vae")):
        (models / folder / names[key]).unlink(missing_ok=True)


def _graph(files: dict[str, str], prompt: str, *, quantization: str = "fp8 block-wise", blocks_to_swap: int = -1,
           vram_budget_gb: float = 0.0) -> dict:
    seed = next(_seed)
    g = {
        "1": {"class_type": "LowVRAM_QwenImageStagedLoader", "inputs": {
            "unet_name": files["unet"], "clip_name": files["te"], "vae_name": files["vae"], "positive": prompt,
            "negative": " ", "quantization": quantization, "vram_budget_gb": vram_budget_gb,
            "blocks_to_swap": blocks_to_swap, "cache_embeddings": True, "compute": "auto"}},
        "2": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "3": {"class_type": "KSampler", "inputs": {
            "model": ["1", 0], "positive": ["1", 1], "negative": ["1", 2], "latent_image": ["2", 0], "seed": seed,
            "steps": 2, "cfg": 2.5, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        "4": {"class_type": "LowVRAM_QwenImageDecode", "inputs": {
            "samples": ["3", 0], "vae": ["1", 3], "vram_budget_gb": 0.0, "tile_size": 512, "overlap": 64,
            "allow_cpu": False}},
        "5": {"class_type": "LowVRAMTest_LatentStats", "inputs": {"latent": ["3", 0]}},
        "6": {"class_type": "LowVRAMTest_ConditioningStats", "inputs": {"conditioning": ["1", 1]}},
        "7": {"class_type": "LowVRAMTest_ModelInfo", "inputs": {"model": ["1", 0]}},
        "8": {"class_type": "PreviewImage", "inputs": {"images": ["4", 0]}},
    }
    return g


def _stages(log: str) -> dict[str, dict]:
    out = {}
    for m in STAGE_RE.finditer(log):
        out[m.group(1)] = {"what": m.group(2), "seconds": float(m.group(3)), "rss_start": float(m.group(4)),
                           "rss_end": float(m.group(5)), "rss_peak": float(m.group(6)), "notes": m.group(7) or ""}
    return out


def _ui(entry: dict, node: str, key: str) -> dict:
    return entry["outputs"][node][key][0]


def test_schema_lists_files_and_options(comfy_server: ComfyServer, files: dict[str, str]) -> None:
    info = comfy_server.object_info("LowVRAM_QwenImageStagedLoader")
    req = info["input"]["required"]
    assert files["te"] in req["clip_name"][1]["options"] and files["unet"] in req["unet_name"][1]["options"]
    assert info["output"] == ["MODEL", "CONDITIONING", "CONDITIONING", "VAE"]
    assert "LowVRAM_QwenImageDecode" in comfy_server.object_info()
    # last and optional: a workflow saved before it keeps its widget order, and an API prompt without it runs (auto)
    order = info["input_order"]
    assert order["required"][-1] == "compute" and order["optional"] == ["text_encoder_device", "batch_cfg"], order
    kind, spec = info["input"]["optional"]["text_encoder_device"]
    assert kind == "COMBO" and spec["options"] == ["auto", "cpu", "gpu"] and spec["default"] == "auto", spec
    kind, spec = info["input"]["optional"]["batch_cfg"]
    assert kind == "BOOLEAN" and spec["default"] is True, spec


def test_end_to_end_cache_miss_hit_and_encoder_change(comfy_server: ComfyServer, files: dict[str, str]) -> None:
    prompt = f"a red cat on a blue chair {uuid.uuid4().hex[:6]}"
    # 1) cold: stage 1 encodes (cache miss) and frees the encoder (equality with ComfyUI's own encode: below).
    before = len(comfy_server.log_text())
    entry = comfy_server.run(_graph(files, prompt), timeout=900)
    log = comfy_server.log_text()[before:]
    ours = _ui(entry, "6", "conditioning_stats")
    assert ours["shape"][-1] == SMALL_TE.hidden and ours["finite"] and ours["device"] == "cpu", ours
    assert _ui(entry, "5", "latent_stats")["finite"]
    model = _ui(entry, "7", "model_info")
    assert model["model_class"] == "QwenImage" and any("LowVramFp8Ops" in c for c in model["layer_classes"]), model
    assert entry["outputs"]["8"]["images"], entry["outputs"]["8"]
    stages = _stages(log)
    assert {"stage 1", "stage 2", "stage 3"} <= set(stages), log[-4000:]
    s1 = stages["stage 1"]
    assert "0 of 2 prompts from the embedding cache" in s1["notes"] and "encoder freed" in s1["notes"], s1
    assert s1["what"] == "text encoder, cpu", s1  # text_encoder_device left out = auto: the CPU under --cpu
    te_gib = (comfy_server.base_dir / "models" / "text_encoders" / files["te"]).stat().st_size / 2**30
    assert s1["rss_peak"] - s1["rss_start"] > 0.5 * te_gib, s1  # the encoder was resident...
    assert s1["rss_end"] - s1["rss_start"] < 0.35, s1  # ...and RSS fell back after it was freed
    assert "streamed to the CPU" in log and "full decode" in stages["stage 3"]["notes"], log[-3000:]

    # 2) same prompt, transformer re-loaded (other quantization): text stage served from the cache.
    before = len(comfy_server.log_text())
    entry2 = comfy_server.run(_graph(files, prompt, quantization="fp8 per-tensor", blocks_to_swap=1,
                                     vram_budget_gb=4.0), timeout=900)
    log2 = comfy_server.log_text()[before:]
    s1 = _stages(log2)["stage 1"]
    assert "2 of 2 prompts from the embedding cache, encoder not loaded" in s1["notes"], s1
    assert "streamed to the CPU" not in log2
    assert _ui(entry2, "6", "conditioning_stats") == ours
    assert "Block Swap" in log2 and _ui(entry2, "5", "latent_stats")["finite"], log2[-3000:]

    # 3) encoder replaced under the same name (here: by its fp8_scaled version): cache miss, new embeddings.
    te_path = comfy_server.base_dir / "models" / "text_encoders" / files["te"]
    write_small_text_encoder(Path(te_path), "fp8_scaled", seed=1)
    before = len(comfy_server.log_text())
    entry3 = comfy_server.run(_graph(files, prompt, quantization="fp8 per-tensor", blocks_to_swap=1,
                                     vram_budget_gb=4.0), timeout=900)
    log3 = comfy_server.log_text()[before:]
    s1 = _stages(log3)["stage 1"]
    assert "0 of 2 prompts from the embedding cache" in s1["notes"] and "format fp8_scaled" in log3, s1
    new = _ui(entry3, "6", "conditioning_stats")
    assert new["finite"] and new["mean"] != ours["mean"] and new["std"] != ours["std"], (new, ours)


@pytest.mark.parametrize(("fmt", "vision"), [("bf16", False), ("fp8_scaled", True)])
def test_streamed_encoder_equals_comfyui_load_clip(tmp_path: Path, fmt: str, vision: bool) -> None:
    """In process: our streamed CPU encoder == comfy.sd.load_clip(QWEN_IMAGE, cpu) + encode, bit for bit; for a
    file without a vision tower (left out by the streamed loader) and one with ComfyUI's full vision tower.

    (Stock CLIPLoader cannot load the 2-layer test encoder: load_clip gets the same config override here. Stock
    cannot size an fp8_scaled file without its vision tower at all: its fp8 Linears never get a weight.)"""
    comfyui_in_process_or_skip()
    import comfy.sd
    import torch
    from comfyui_lowvram_dit.checkpoints import safetensors_io as checkpoint_io, text_encoders
    from comfyui_lowvram_dit.host import qwen_stages

    te_cfg = WITH_VISION if vision else SMALL_TE
    te = write_small_text_encoder(tmp_path / f"te_{fmt}.safetensors", fmt, seed=2, cfg=te_cfg)
    prompt = PROMPTS[0]
    with torch.inference_mode():
        ours_clip = qwen_stages.build_text_encoder_streaming(te)
        ours = ours_clip.encode_from_tokens_scheduled(ours_clip.tokenize(prompt))
        del ours_clip
        cpu = torch.device("cpu")
        cfg = text_encoders.qwen25_vl_config_from_header(checkpoint_io.read_header(te))
        stock_clip = comfy.sd.load_clip([str(te)], clip_type=comfy.sd.CLIPType.QWEN_IMAGE, model_options={
            "load_device": cpu, "offload_device": cpu, "qwen25_7b_model_config": cfg})
        stock = stock_clip.encode_from_tokens_scheduled(stock_clip.tokenize(prompt))
    te.unlink()  # 0.7 GB with the vision tower
    assert torch.equal(ours[0][0], stock[0][0]) and ours[0][0].shape[-1] == te_cfg.hidden
    assert sorted(ours[0][1]) == sorted(stock[0][1])


def test_transformer_widths_come_from_the_file(tmp_path: Path) -> None:
    """In process: the tiny Qwen-Image (2 heads, joint dim 128) is built at its own widths, which ComfyUI's detection
    alone would build at 24 heads / 3584; the detection function is ComfyUI's own again afterwards."""
    comfyui_in_process_or_skip()
    import comfy.model_detection as md
    from comfyui_lowvram_dit.host import qwen_stages

    original = md.detect_unet_config
    path = synth.write_synthetic("qwen_image", tmp_path / "q.safetensors", "tiny", "fp8")
    patcher = qwen_stages.load_transformer(path, "per_tensor")
    dm = patcher.model.diffusion_model
    assert dm.inner_dim == 256 and dm.txt_in.in_features == SMALL_TE.hidden and len(dm.transformer_blocks) == 1
    assert patcher.model.model_config.unet_config["num_attention_heads"] == 2
    assert md.detect_unet_config is original


def test_a_gpu_text_encoder_on_a_cpu_server_is_refused_by_name(comfy_server: ComfyServer,
                                                               files: dict[str, str]) -> None:
    """text_encoder_device = gpu where ComfyUI runs on the CPU: an error naming the node, the option and the fix,
    before the text stage runs."""
    check_gpu_refused_on_a_cpu_server(comfy_server, _graph(files, f"a boat {uuid.uuid4().hex[:6]}"), "1",
                                      f"{NODE}, text_encoder_device")


def test_the_node_hands_the_chosen_device_to_stage_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """text_encoder_device reaches stage 1 resolved (left out = auto = where ComfyUI runs text encoders); a choice
    that is not an option, or gpu on a CPU-only ComfyUI, is an error naming the node and the option, raised before
    any file is read. The stages are planted: what is checked is what the node hands them."""
    comfyui_in_process_or_skip()
    from comfyui_lowvram_dit.nodes import qwen_staged

    calls: list = []
    monkeypatch.setattr(qwen_staged, "prepare_files", lambda *a: calls.append("files") or ("u", "t", "v"))
    monkeypatch.setattr(qwen_staged, "encode_prompts",
                        lambda te, prompts, use_cache, device: calls.append(device) or (([], []), None))
    monkeypatch.setattr(qwen_staged, "load_staged_model", lambda *a: ("model", None))
    monkeypatch.setattr(qwen_staged, "load_vae", lambda path: "vae")
    args = {"unet_name": "u", "clip_name": "t", "vae_name": "v", "positive": "p", "negative": " ",
            "quantization": "fp8 per-tensor", "vram_budget_gb": 0.0, "blocks_to_swap": -1, "cache_embeddings": True,
            "compute": "auto"}
    check_device_choices(monkeypatch, lambda **choice: qwen_staged.QwenImageStagedLoader.execute(**args, **choice),
                         calls, f"{NODE}, text_encoder_device")


def test_stage_1_encodes_on_its_device_and_keeps_devices_apart_in_the_cache(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """encode_prompts hands its device to the streamed encoder (a spy records it and builds on this CPU), names it in
    the stage label, keys the embedding cache by its type (a GPU's kernels round differently from the CPU's) and
    still returns the embeddings on the compute device."""
    comfyui_in_process_or_skip()
    import folder_paths
    import torch
    from comfyui_lowvram_dit.host import qwen_stages

    monkeypatch.setattr(folder_paths, "get_user_directory", lambda: str(tmp_path / "user"))
    monkeypatch.setattr(qwen_stages, "_compute_device", lambda: torch.device("meta"))  # stands in for the GPU
    te = write_small_text_encoder(tmp_path / "te.safetensors", "bf16", seed=4)
    check_stage_1_devices(monkeypatch, lambda device, target: qwen_stages.encode_prompts(
        te, PROMPTS, target_device=target, device=device), "text encoder", SMALL_TE.hidden)


@pytest.mark.cuda
@pytest.mark.parametrize(("fmt", "vision"), [("bf16", False), ("fp8_scaled", True)])
def test_on_the_gpu_equals_stock_load_clip_on_the_gpu(comfy_on_gpu: None, tmp_path: Path, fmt: str,
                                                      vision: bool) -> None:
    """text_encoder_device = gpu: ComfyUI's model management loads the streamed encoder onto the GPU to encode, as
    it loads CLIPLoader's: the same CONDITIONING as stock load_clip(QWEN_IMAGE) + CLIPTextEncode on that GPU, bit
    for bit, and it ends on the compute device."""
    import comfy.model_management as mm
    import torch
    from comfyui_lowvram_dit.checkpoints import safetensors_io as checkpoint_io, text_encoders
    from comfyui_lowvram_dit.host import qwen_stages, text_encoders as host_te

    te = write_small_text_encoder(tmp_path / f"te_{fmt}.safetensors", fmt, seed=2,
                                  cfg=WITH_VISION if vision else SMALL_TE)
    gpu = host_te.resolve_device("gpu", f"{NODE}, text_encoder_device")
    ours, report = qwen_stages.encode_prompts(te, PROMPTS, use_cache=False, device=gpu)
    assert "cuda" in report.name, report.name
    cfg = text_encoders.qwen25_vl_config_from_header(checkpoint_io.read_header(te))
    stock = stock_conditioning(te, "QWEN_IMAGE", {"load_device": gpu, "offload_device": torch.device("cpu"),
                                                  "qwen25_7b_model_config": cfg}, PROMPTS)
    for a, b in zip(ours, stock, strict=True):
        assert len(a) == len(b) == 1 and sorted(a[0][1]) == sorted(b[0][1])
        assert a[0][0].device == mm.get_torch_device() and a[0][0].dtype == b[0][0].dtype
        assert torch.equal(a[0][0].cpu(), b[0][0].cpu()) and bool(a[0][0].abs().sum() > 0)


def _check_batched_sampling(tmp_path: Path, pos: list, neg: list, latent_hw: int = 8) -> None:
    """Sampled through a tiny Qwen-Image: the padded prompt pair reaches the model as one batch of 2 (one call per
    step instead of two) with the latent of the unbatched pair within bf16 rounding; without the mask, not."""
    import comfy.sample
    import torch
    from comfyui_lowvram_dit.host import qwen_cfg_batch, qwen_stages

    unet = tmp_path / "qwen.safetensors"
    synth.write_synthetic("qwen_image", unet, "tiny", "bf16", seed=3)
    model = qwen_stages.load_transformer(unet, "none").clone()
    batches: list[int] = []

    def counting(apply_model, args: dict):  # noqa: ANN001, ANN202 - ComfyUI's model_function_wrapper protocol
        batches.append(int(args["input"].shape[0]))
        return apply_model(args["input"], args["timestep"], **args["c"])

    model.set_model_unet_function_wrapper(counting)
    latent = torch.zeros(1, 16, 1, latent_hw, latent_hw)  # a Qwen-Image latent: Wan VAE channels, frames, h, w

    def sample(positive: list, negative: list) -> tuple[torch.Tensor, list[int]]:
        batches.clear()
        noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(1))
        out = comfy.sample.sample(model, noise, 2, 2.5, "euler", "simple", positive, negative, latent, seed=1)
        return out.float(), list(batches)

    def err(a: torch.Tensor) -> float:
        return ((a - plain).norm() / plain.norm()).item()

    plain, plain_calls = sample(pos, neg)
    p, n = qwen_cfg_batch.batched_conditioning(pos, neg)
    batched, batched_calls = sample(p, n)
    assert plain_calls == [1, 1, 1, 1] and batched_calls == [2, 2]
    assert err(batched) < 1e-5, err(batched)  # measured 1.8e-7
    unmasked = [[[e, {k: v for k, v in x.items() if k != "attention_mask"}] for e, x in c] for c in (p, n)]
    assert err(sample(*unmasked)[0]) > 1e-3  # the padding alone would change the picture: the mask is what keeps it


def test_batch_cfg_samples_both_prompts_as_one_batch_with_the_same_latent(tmp_path: Path) -> None:
    """In process: the Staged Loader's prompts, padded by batch_cfg, sample as one batch with the same latent; on a
    ComfyUI without Qwen-Image's text mask the conditioning is left as it is."""
    comfyui_in_process_or_skip()
    import torch
    from comfyui_lowvram_dit.host import qwen_cfg_batch, qwen_stages

    te = write_small_text_encoder(tmp_path / "te.safetensors", "bf16", seed=0)
    (pos, neg), _ = qwen_stages.encode_prompts(te, PROMPTS, use_cache=False, target_device=torch.device("cpu"))
    if not all(p.ok() for p in qwen_cfg_batch.TEXT_MASK):  # 0.8.0: its Qwen-Image has no text mask
        assert qwen_cfg_batch.batched_conditioning(pos, neg) == (pos, neg)
        return
    _check_batched_sampling(tmp_path, pos, neg)


def test_batch_cfg_with_reference_latents_as_the_edit_loader_gives(tmp_path: Path) -> None:
    """In process: Edit conditioning (both prompts with the same reference latents, which join the image tokens the
    text mask is laid beside) also samples as one batch with the same latent."""
    comfyui_in_process_or_skip()
    import torch
    from comfyui_lowvram_dit.host import qwen_cfg_batch
    from comfyui_lowvram_dit.synthetic.specs import model_config

    if not all(p.ok() for p in qwen_cfg_batch.TEXT_MASK):
        pytest.skip("this ComfyUI's Qwen-Image has no text mask: batch_cfg stays off")
    gen = torch.Generator().manual_seed(5)
    ref = torch.randn(1, 16, 1, 6, 6, generator=gen)  # another size than the latent, as a reference image may be
    pos, neg = ([[torch.randn(1, n, model_config("qwen_image", "tiny").joint_dim, generator=gen),
                  {"reference_latents": [ref], "reference_latents_method": "index"}]] for n in (9, 4))
    _check_batched_sampling(tmp_path, pos, neg)


def test_cfg_1_samples_an_unpadded_prompt_without_its_mask(tmp_path: Path) -> None:
    """batch_cfg masks both prompts; at cfg 1 ComfyUI samples the positive alone. Where the positive lost no token
    (the longer prompt) its call runs unmasked, with the latent of the never-padded prompt; a padded positive keeps
    its mask, and at cfg > 1 the batched pair keeps both."""
    comfyui_in_process_or_skip()
    import comfy.sample
    import torch
    from comfyui_lowvram_dit.host import qwen_cfg_batch, qwen_stages
    from comfyui_lowvram_dit.synthetic.specs import model_config

    if not all(p.ok() for p in qwen_cfg_batch.TEXT_MASK):
        pytest.skip("this ComfyUI's Qwen-Image has no text mask: batch_cfg stays off")
    unet = tmp_path / "qwen.safetensors"
    synth.write_synthetic("qwen_image", unet, "tiny", "bf16", seed=3)
    model = qwen_stages.load_transformer(unet, "none").clone()
    masked: list[bool] = []

    def recording(apply_model, args: dict):  # noqa: ANN001, ANN202 - ComfyUI's model_function_wrapper protocol
        masked.append("attention_mask" in args["c"])
        return apply_model(args["input"], args["timestep"], **args["c"])

    model.set_model_unet_function_wrapper(recording)
    latent = torch.zeros(1, 16, 1, 8, 8)
    gen = torch.Generator().manual_seed(5)
    width = model_config("qwen_image", "tiny").joint_dim
    long, short = ([[torch.randn(1, n, width, generator=gen), {}]] for n in (9, 4))

    def sample(positive: list, negative: list, cfg: float) -> tuple[torch.Tensor, list[bool]]:
        masked.clear()
        noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(1))
        out = comfy.sample.sample(model, noise, 2, cfg, "euler", "simple", positive, negative, latent, seed=1)
        return out.float(), list(masked)

    p, n = qwen_cfg_batch.batched_conditioning(long, short)
    plain, seen = sample(long, short, 1.0)
    assert seen == [False, False]
    out, seen = sample(p, n, 1.0)
    assert seen == [False, False] and torch.equal(out, plain)
    assert sample(p, n, 2.5)[1] == [True, True]  # one batch of two: the padded negative needs its mask
    p, n = qwen_cfg_batch.batched_conditioning(short, long)
    plain = sample(short, long, 1.0)[0]
    out, seen = sample(p, n, 1.0)
    assert seen == [True, True] and ((out - plain).norm() / plain.norm()).item() < 1e-5
    for mask, nothing in ((torch.ones(1, 3, dtype=torch.long), True), (torch.tensor([[1, 1, 0]]), False),
                          (torch.zeros(1, 3), True), (torch.tensor([[0.0, -1e4, 0.0]]), False)):
        assert qwen_cfg_batch.masks_nothing(mask) is nothing


def _split_graph(files: dict[str, str], prompt: str, seed: int) -> dict:
    """The staged graph with Qwen-Image Loader + Qwen-Image Text Encode in place of the Staged Loader (the shipped
    workflows' pair)."""
    g = _graph(files, prompt)
    staged = g.pop("1")["inputs"]
    g["1"] = {"class_type": "LowVRAM_QwenImageLoader", "inputs": {
        k: staged[k] for k in ("unet_name", "vae_name", "quantization", "vram_budget_gb", "blocks_to_swap", "compute")}}
    g["9"] = {"class_type": "LowVRAM_QwenImageTextEncode", "inputs": {
        k: staged[k] for k in ("clip_name", "positive", "negative", "cache_embeddings")}}
    g["3"]["inputs"].update(positive=["9", 0], negative=["9", 1], seed=seed)
    g["4"]["inputs"]["vae"] = ["1", 1]
    g["6"]["inputs"]["conditioning"] = ["9", 0]
    return g


def test_split_nodes_equal_the_staged_loader_and_a_new_prompt_keeps_the_transformer(
        comfy_server: ComfyServer, files: dict[str, str]) -> None:
    """Qwen-Image Loader + Qwen-Image Text Encode give the Staged Loader's picture; a second prompt re-runs only the
    text node (the transformer is built once), as CLIPTextEncode does beside UNETLoader."""
    tag = uuid.uuid4().hex[:6]
    staged = _graph(files, f"a lighthouse at dusk {tag}")
    staged["3"]["inputs"]["seed"] = 4242
    ref = _ui(comfy_server.run(staged, timeout=900), "5", "latent_stats")
    built = "lowvram_dit Qwen-Image transformer " + files["unet"]
    before = len(comfy_server.log_text())
    first = comfy_server.run(_split_graph(files, f"a lighthouse at dusk {tag}", 4242), timeout=900)
    log = comfy_server.log_text()[before:]
    assert _ui(first, "5", "latent_stats") == ref
    assert log.count(built) == 1 and "2 of 2 prompts from the embedding cache" in _stages(log)["stage 1"]["notes"]
    before = len(comfy_server.log_text())
    second = comfy_server.run(_split_graph(files, f"a harbour at dawn {tag}", 4242), timeout=900)
    log2 = comfy_server.log_text()[before:]
    assert built not in log2 and "stage 2" not in _stages(log2), log2[-3000:]
    assert "1 of 2 prompts from the embedding cache" in _stages(log2)["stage 1"]["notes"], log2[-3000:]
    assert _ui(second, "5", "latent_stats") != ref and _ui(second, "5", "latent_stats")["finite"]
