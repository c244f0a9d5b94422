"""Wan 2.2 T2V-A14B through a real ComfyUI server: seconds per sampler step, peak VRAM and peak RSS per variant.

Each variant is one API graph run in a fresh ComfyUI server started as users start it (``main.py``; DynamicVRAM
on unless the variant turns it off; ``--front-end-root`` on an empty folder, since only the API is used). Native
graphs: UNETLoader (a weight_dtype) x2, CLIPLoader + CLIPTextEncode, KSamplerAdvanced x2. Pack graphs: the
shipped workflow's nodes (Wan Loader, Attention, optional Block Swap / Torch Compile, Wan Text Encode). An
"8 GB card" is ComfyUI's own ``--reserve-vram`` set to the card's total minus 8 GiB; nothing stops the process
from taking more, so the measured GPU peak says whether it would fit.

Step time: the server sends a websocket ``progress`` message after every sampler step (value 1..n per
KSamplerAdvanced node); the interval between consecutive messages of one node is one step. A node's first step
also holds the model load (DynamicVRAM loads weights inside it), Torch Compile's compile and the attention
timing, so it is reported apart and the headline is the median of the later steps of both experts. ComfyUI's
tqdm lines in the server log give an independent check (their average includes the first step).
Memory: ``tools.memwatch`` samples the server process from outside every 0.5 s: VmHWM (kernel peak RSS),
RssAnon/RssFile, and the process's GPU memory from nvidia-smi (CUDA context and allocator cache included).

4-step LoRA rows (``--variants lora``): the lightx2v 4-step LoRAs (stock LoraLoaderModelOnly after each loader), cfg 1,
shift 5 as workflows/wan22_t2v_a14b_4step.json, 8 GB cap, each next to the same graph without the LoRAs: native
fp8_e4m3fn_fast, the pack with Block Swap (merged once per load) and under ComfyUI's partial loading (per-call LoRA).
The LoRA files must be in ``--models``/loras (``--write-models`` writes them where the runner can).

Run (the ComfyUI Python, with the pack importable as ``comfyui_lowvram_dit``)::

    python -m comfyui_lowvram_dit.benchmarks.bench_server --comfyui PATH --models DIR \\
        --variants native_default,pack --out benchmarks/results/server_0.33
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any, Self

from ..tools import runner
from ..tools.memwatch import MemoryWatch
from . import harness, server_probe
from .bench_server_env import gpu_facts, merged_rows, software_facts, write_models

PACK_ROOT = Path(__file__).resolve().parents[1]
RESULTS = PACK_ROOT / "benchmarks" / "results" / "server_0.33"
BENCH = "server_t2v_a14b"
GIB = float(1 << 30)
CARD_GIB = 8.0

HIGH = "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors"
LOW = "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors"
TEXT_ENCODER = "umt5_xxl_fp8_e4m3fn_scaled.safetensors"
VAE = "wan_2.1_vae.safetensors"
MODEL_FILES = (HIGH, LOW, TEXT_ENCODER, VAE)
# The lightx2v 4-step LoRAs of workflows/wan22_t2v_a14b_4step.json (official template names, models/loras).
HIGH_LORA = "wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors"
LOW_LORA = "wan2.2_t2v_lightx2v_4steps_lora_v1.1_low_noise.safetensors"
LORA_FILES = (HIGH_LORA, LOW_LORA)
LORA_SHIFT, LORA_CFG = 5.0, 1.0  # the 4-step workflow's ModelSamplingSD3 shift and cfg

# The shipped workflow's settings (workflows/wan22_t2v_a14b.json; a unit test keeps them equal).
POSITIVE = ("A red fox trots through fresh snow in a birch forest at golden hour, its breath visible in the cold "
            "air; the camera tracks it at eye level, shallow depth of field, cinematic.")
NEGATIVE = ("blurry, low quality, jpeg artifacts, static, still image, overexposed, subtitles, watermark, deformed, "
            "extra limbs, worst quality")
SHIFT, CFG, SEED, SAMPLER, SCHEDULER = 8.0, 3.5, 42, "euler", "simple"
WIDTH, HEIGHT, FRAMES = 832, 480, 81


@dataclass(frozen=True)
class ServerVariant:
    """One measured configuration: which graph, which server flags, which card size."""

    name: str
    graph: str  # "native" or "pack"
    weight_dtype: str = "default"  # native UNETLoader
    attention: str = "auto"  # pack Attention backend
    compile: bool = False  # pack Torch Compile after Attention
    block_swap_gb: float | None = None  # pack Block Swap vram_budget_gb (None: no Block Swap node)
    ck_attention: bool = False  # server flag --use-ck-attention
    dynamic_vram: bool = True  # False: --disable-dynamic-vram (legacy partial loading)
    card_gib: float | None = None  # None: the whole GPU; else --reserve-vram = total - card_gib
    baseline: bool = False  # a native row other rows are compared against
    lora: bool = False  # the 4-step LoRAs after each expert's loader (LoraLoaderModelOnly)
    four_step: bool = False  # the 4-step workflow's sampling (cfg 1, shift 5), with or without the LoRAs
    fp8_path: str = "default"  # pack per-tensor fp8 GEMM path, set by the Kernel Profile node (needs --kernel-profile)

    @property
    def cfg(self) -> float:
        """The sampler's cfg: 1 for 4-step rows (one forward per step), the shipped workflow's otherwise."""
        return LORA_CFG if self.four_step else CFG

    @property
    def shift(self) -> float:
        """ModelSamplingSD3 shift of this row."""
        return LORA_SHIFT if self.four_step else SHIFT

    def server_args(self, total_vram_gib: float) -> list[str]:
        """ComfyUI command-line flags for this variant on a GPU of ``total_vram_gib``."""
        args = ["--use-ck-attention"] if self.ck_attention else []
        if not self.dynamic_vram:
            args.append("--disable-dynamic-vram")
        if self.card_gib is not None:
            reserve = total_vram_gib - self.card_gib
            if reserve <= 0:
                raise ValueError(f"variant {self.name}: the GPU has {total_vram_gib:.2f} GiB, not more than the "
                                 f"{self.card_gib} GiB card to emulate; drop the capped variants")
            args.append(f"--reserve-vram={reserve:.2f}")
        return args

    def describe(self) -> str:
        """One line saying what the variant runs."""
        if self.graph == "native":
            parts = [f"UNETLoader {self.weight_dtype}", "ck attention" if self.ck_attention else "default attention"]
        else:
            parts = ["Wan Loader fp8 per-tensor", f"Attention {self.attention}"]
            if self.block_swap_gb is not None:
                parts.append(f"Block Swap {self.block_swap_gb:g} GB")
            if self.compile:
                parts.append("Torch Compile")
            parts += [f"fp8 path {self.fp8_path}"] if self.fp8_path != "default" else []
        if self.four_step:
            parts.append("4-step LoRAs" if self.lora else "4-step sampling without the LoRAs")
        parts.append("DynamicVRAM" if self.dynamic_vram else "legacy loading (--disable-dynamic-vram)")
        parts.append("whole GPU" if self.card_gib is None else f"{self.card_gib:g} GB card")
        return ", ".join(parts)


_8 = CARD_GIB
VARIANTS: dict[str, ServerVariant] = {v.name: v for v in (
    ServerVariant("native_default", "native", baseline=True),
    ServerVariant("native_fp8fast", "native", weight_dtype="fp8_e4m3fn_fast", baseline=True),
    ServerVariant("native_fp8fast_ck", "native", weight_dtype="fp8_e4m3fn_fast", ck_attention=True, baseline=True),
    ServerVariant("pack", "pack"),
    ServerVariant("pack_int8", "pack", attention="lowvram 8-bit"),
    ServerVariant("pack_int8_compile", "pack", attention="lowvram 8-bit", compile=True),
    ServerVariant("pack_tensorwise", "pack", fp8_path="scaled_mm_tensorwise"),
    ServerVariant("pack_int8_compile_tensorwise", "pack", attention="lowvram 8-bit", compile=True,
                  fp8_path="scaled_mm_tensorwise"),
    ServerVariant("native_default_8gb", "native", card_gib=_8, baseline=True),
    ServerVariant("native_fp8fast_8gb", "native", weight_dtype="fp8_e4m3fn_fast", card_gib=_8, baseline=True),
    ServerVariant("native_fp8fast_ck_8gb", "native", weight_dtype="fp8_e4m3fn_fast", ck_attention=True, card_gib=_8,
                  baseline=True),
    ServerVariant("native_fp8fast_legacy_8gb", "native", weight_dtype="fp8_e4m3fn_fast", dynamic_vram=False,
                  card_gib=_8, baseline=True),
    ServerVariant("pack_8gb", "pack", card_gib=_8),
    ServerVariant("pack_blockswap_8gb", "pack", block_swap_gb=_8, card_gib=_8),
    ServerVariant("pack_blockswap_int8_8gb", "pack", attention="lowvram 8-bit", block_swap_gb=_8, card_gib=_8),
    ServerVariant("pack_int8_compile_8gb", "pack", attention="lowvram 8-bit", compile=True, card_gib=_8),
    # 4-step LoRA rows (cfg 1, shift 5) at the 8 GB cap: each LoRA row next to the same graph without the LoRAs
    ServerVariant("native_fp8fast_8gb_4step", "native", weight_dtype="fp8_e4m3fn_fast", card_gib=_8, four_step=True,
                  baseline=True),
    ServerVariant("native_fp8fast_8gb_lora4", "native", weight_dtype="fp8_e4m3fn_fast", card_gib=_8, four_step=True,
                  lora=True, baseline=True),
    ServerVariant("pack_blockswap_8gb_4step", "pack", block_swap_gb=_8, card_gib=_8, four_step=True),
    ServerVariant("pack_blockswap_8gb_lora4", "pack", block_swap_gb=_8, card_gib=_8, four_step=True, lora=True),
    ServerVariant("pack_8gb_lora4", "pack", card_gib=_8, four_step=True, lora=True),
)}
LORA_ROWS = [n for n, v in VARIANTS.items() if v.four_step]
UNCAPPED = [n for n, v in VARIANTS.items() if v.card_gib is None]
CAPPED = [n for n, v in VARIANTS.items() if v.card_gib is not None]


# ----------------------------------------------------------------------------------------------------------
# graphs


def _node(class_type: str, title: str, **inputs: Any) -> dict:
    return {"class_type": class_type, "inputs": inputs, "_meta": {"title": title}}


def _samplers(high_model: list, low_model: list, pos: list, neg: list, steps_per_expert: int,
              cfg: float = CFG) -> dict:
    """The two KSamplerAdvanced nodes of the workflow: high-noise expert first, low-noise expert after."""
    steps = 2 * steps_per_expert
    common = {"steps": steps, "cfg": cfg, "sampler_name": SAMPLER, "scheduler": SCHEDULER,
              "positive": pos, "negative": neg}
    return {
        "15": _node("KSamplerAdvanced", "Sampler (high noise)", add_noise="enable", noise_seed=SEED,
                    start_at_step=0, end_at_step=steps_per_expert, return_with_leftover_noise="enable",
                    model=high_model, latent_image=["13", 0], **common),
        "16": _node("KSamplerAdvanced", "Sampler (low noise)", add_noise="disable", noise_seed=0,
                    start_at_step=steps_per_expert, end_at_step=10000, return_with_leftover_noise="disable",
                    model=low_model, latent_image=["15", 0], **common),
    }


def _pack_model_chain(graph: dict, first_id: int, unet: str, variant: ServerVariant, label: str) -> list:
    """Wan Loader -> [Block Swap] -> Attention -> [Torch Compile] -> ModelSamplingSD3; returns the output link."""
    nid = first_id
    graph[str(nid)] = _node("LowVRAM_WanLoader", f"Wan Loader ({label})", unet_name=unet,
                            quantization="fp8 per-tensor", block_size="128", compute="auto", save_quantized=False)
    link = [str(nid), 0]
    if variant.lora:
        nid += 1
        graph[str(nid)] = _lora(link, unet, label)
        link = [str(nid), 0]
    if variant.block_swap_gb is not None:
        nid += 1
        graph[str(nid)] = _node("LowVRAM_BlockSwap", f"Block Swap ({label})", model=link,
                                vram_budget_gb=variant.block_swap_gb, blocks_to_swap=-1, prefetch=1, pinned=True,
                                offload_embeddings=False, debug=False)
        link = [str(nid), 0]
    nid += 1
    graph[str(nid)] = _node("LowVRAM_Attention", f"Attention ({label})", model=link, backend=variant.attention)
    link = [str(nid), 0]
    if variant.compile:
        nid += 1
        graph[str(nid)] = _node("LowVRAM_TorchCompile", f"Torch Compile ({label})", model=link, mode="default",
                                backend="inductor", dynamic="auto", fullgraph=False, cache_size_limit=64,
                                fallback=True, scope="blocks")
        link = [str(nid), 0]
    nid += 1
    graph[str(nid)] = _node("ModelSamplingSD3", f"ModelSamplingSD3 ({label})", model=link, shift=variant.shift)
    return [str(nid), 0]


def _lora(model: list, unet: str, label: str) -> dict:
    """The stock LoraLoaderModelOnly with the expert's 4-step LoRA at the official template's strength 1."""
    return _node("LoraLoaderModelOnly", f"LoRA 4-step ({label})", model=model,
                 lora_name=HIGH_LORA if unet == HIGH else LOW_LORA, strength_model=1.0)


def build_graph(variant: ServerVariant, steps_per_expert: int = 3, width: int = WIDTH, height: int = HEIGHT,
                frames: int = FRAMES, decode: bool = False, probe: bool = False) -> dict:
    """The API graph of ``variant``: two experts, ``steps_per_expert`` steps each; decode+WEBP or SaveLatent.

    ``probe``: each expert's model goes through the benchmark's Kernel Profile node (benchmarks/server_probe),
    which times every model call and profiles the second (PROBE_CALL).
    """
    if steps_per_expert < 2:
        raise ValueError("steps_per_expert must be >= 2: the first step of each expert holds loading, so at least "
                         "one later step is needed for a per-step time")
    graph: dict[str, dict] = {"13": _node("EmptyHunyuanLatentVideo", "Video size", width=width, height=height,
                                          length=frames, batch_size=1)}
    if variant.graph == "native":
        graph["3"] = _node("UNETLoader", "Load Diffusion Model (high noise)", unet_name=HIGH,
                           weight_dtype=variant.weight_dtype)
        graph["7"] = _node("UNETLoader", "Load Diffusion Model (low noise)", unet_name=LOW,
                           weight_dtype=variant.weight_dtype)
        high_src, low_src = ["3", 0], ["7", 0]
        if variant.lora:
            graph["4"], graph["8"] = _lora(high_src, HIGH, "high noise"), _lora(low_src, LOW, "low noise")
            high_src, low_src = ["4", 0], ["8", 0]
        graph["6"] = _node("ModelSamplingSD3", "ModelSamplingSD3 (high noise)", model=high_src, shift=variant.shift)
        graph["10"] = _node("ModelSamplingSD3", "ModelSamplingSD3 (low noise)", model=low_src, shift=variant.shift)
        graph["11"] = _node("CLIPLoader", "Load CLIP", clip_name=TEXT_ENCODER, type="wan", device="default")
        graph["20"] = _node("CLIPTextEncode", "Positive", text=POSITIVE, clip=["11", 0])
        graph["21"] = _node("CLIPTextEncode", "Negative", text=NEGATIVE, clip=["11", 0])
        high, low, pos, neg = ["6", 0], ["10", 0], ["20", 0], ["21", 0]
    elif variant.graph == "pack":
        high = _pack_model_chain(graph, 30, HIGH, variant, "high noise")
        low = _pack_model_chain(graph, 40, LOW, variant, "low noise")
        graph["11"] = _node("LowVRAM_WanTextEncode", "Wan Text Encode (LowVRAM)", clip_name=TEXT_ENCODER,
                            positive=POSITIVE, negative=NEGATIVE, cache_embeddings=True)
        pos, neg = ["11", 0], ["11", 1]
    else:
        raise ValueError(f"variant {variant.name}: graph must be 'native' or 'pack', not {variant.graph!r}")
    if variant.fp8_path != "default" and not probe:
        raise ValueError(f"variant {variant.name}: an fp8 path is set by the Kernel Profile node; add --kernel-profile")
    if probe:
        for nid, label in (("50", "high"), ("51", "low")):
            src = high if label == "high" else low
            graph[nid] = _node(PROBE_NODE, f"Kernel Profile ({label} noise)", model=src, label=label,
                               profile_call=PROBE_CALL, fp8_path=variant.fp8_path)
        high, low = ["50", 0], ["51", 0]
    graph.update(_samplers(high, low, pos, neg, steps_per_expert, variant.cfg))
    if decode:
        graph["12"] = _node("VAELoader", "Load VAE", vae_name=VAE)
        graph["18"] = _node("VAEDecode", "VAE Decode", samples=["16", 0], vae=["12", 0])
        graph["19"] = _node("SaveAnimatedWEBP", "Save", images=["18", 0], filename_prefix=f"bench/{variant.name}",
                            fps=16.0, lossless=False, quality=85, method="default")
    else:
        graph["19"] = _node("SaveLatent", "Save latent", samples=["16", 0], filename_prefix=f"bench/{variant.name}")
    return graph


SAMPLER_NODES = ("15", "16")
PROBE_NODE = "LowVRAMBench_KernelProfile"
PROBE_CALL = 1  # the second model call of each expert = its second step (cfg batched: one call per step)
PROBE_DIR = "lowvram_bench_probe"  # its folder name in the server's custom_nodes


# ----------------------------------------------------------------------------------------------------------
# timing from websocket events and the server log


def step_times(events: list[tuple[float, dict]], node: str) -> dict:
    """Per-step times of one sampler node from ``(arrival time, message)`` pairs of the server's websocket.

    ``first_s``: node start ('executing') to its first 'progress' (load + first step); ``steps_s``: intervals
    between consecutive progress values (each later step). Repeated values (re-sent progress) count once.
    """
    start = next((t for t, m in events if m.get("type") == "executing" and m["data"].get("node") == node), None)
    seen: dict[int, float] = {}
    for t, m in events:
        if m.get("type") == "progress" and str(m["data"].get("node")) == node:
            seen.setdefault(int(m["data"]["value"]), t)
    values = sorted(seen)
    stamps = [seen[v] for v in values]
    return {"node": node, "progress_values": values,
            "first_s": round(stamps[0] - start, 3) if stamps and start is not None else None,
            "steps_s": [round(b - a, 3) for a, b in pairwise(stamps)]}


def node_times(events: list[tuple[float, dict]]) -> dict[str, float]:
    """Seconds each executed node took: from its 'executing' message to the next node's (or the end)."""
    marks = [(t, m["data"].get("node")) for t, m in events if m.get("type") == "executing"]
    out: dict[str, float] = {}
    for (t, node), (t_next, _) in pairwise(marks):
        if node is not None:
            out[str(node)] = round(out.get(str(node), 0.0) + t_next - t, 3)
    return out


_TQDM_DONE = re.compile(r"100%\|[^|]*\|\s*(\d+)/(\1)\s*\[(\d+):(\d+)<[^,\]]*,\s*([\d.]+)(s/it|it/s)\]")


def tqdm_summaries(log: str) -> list[dict]:
    """ComfyUI's closing tqdm line of each sampler run in ``log``: steps, elapsed (whole s) and average s/step.

    tqdm prints the 100% line twice per run (last update, then close with the run's average): every second one
    is kept when they pair up.
    """
    out = []
    for segment in log.replace("\r", "\n").split("\n"):
        m = _TQDM_DONE.search(segment)
        if m:
            rate = float(m.group(5))
            out.append({"steps": int(m.group(1)), "elapsed_s": int(m.group(3)) * 60 + int(m.group(4)),
                        "s_per_step": rate if m.group(6) == "s/it" else round(1.0 / rate, 4)})
    return out[1::2] if len(out) % 2 == 0 else out


def summarize_steps(per_node: list[dict]) -> dict:
    """Headline numbers: median/mean of the later steps of every sampler node, and the first steps."""
    later = [s for d in per_node for s in d["steps_s"]]
    return {"s_per_step": round(statistics.median(later), 3) if later else None,
            "s_per_step_mean": round(statistics.fmean(later), 3) if later else None,
            "steps_timed": len(later),
            "first_step_s": [d["first_s"] for d in per_node]}


def _window_peak(samples: list[dict], t0: float, t1: float, key: str) -> float | None:
    vals = [s[key] for s in samples if t0 <= s["t"] <= t1 and s.get(key) is not None]
    return round(max(vals) / GIB, 3) if vals else None


LOG_KEEP = re.compile(r"lowvram_dit|DynamicVRAM|loaded (completely|partially)|Requested to load|model weight dtype|"
                      r"Prompt executed|ComfyUI version|comfy-(kitchen|aimdo) version|Total VRAM|pytorch version|"
                      r"attention|Error|error|Traceback|out of memory|OutOfMemory", re.IGNORECASE)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def log_digest(log: str, limit: int = 200) -> list[str]:
    """The server log lines that explain a run (loading, attention, memory, errors); colours and tqdm bars dropped."""
    lines = [_ANSI.sub("", ln).strip() for ln in log.replace("\r", "\n").split("\n")]
    return [ln for ln in lines if LOG_KEEP.search(ln) and "it/s]" not in ln and "s/it]" not in ln][-limit:]


# ----------------------------------------------------------------------------------------------------------
# running one variant


class EventRecorder:
    """Every JSON message of the server's websocket for ``client_id``, stamped with ``time.monotonic()`` on arrival."""

    def __init__(self, url: str, client_id: str) -> None:
        self.ws_url = url.replace("http://", "ws://", 1) + f"/ws?clientId={client_id}"
        self.events: list[tuple[float, dict]] = []
        self.error: str | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._listen()), name="bench-ws", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        if not self._ready.wait(30) or self.error:
            raise runner.RunError(f"websocket {self.ws_url} did not open: {self.error or 'timeout'}")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    async def _listen(self) -> None:
        import aiohttp  # ComfyUI's own dependency: present wherever its server runs

        try:
            async with aiohttp.ClientSession() as session, session.ws_connect(self.ws_url, max_msg_size=0) as ws:
                self._ready.set()
                while not self._stop.is_set():
                    try:
                        msg = await ws.receive(timeout=0.5)
                    except asyncio.TimeoutError:
                        continue
                    if msg.type == aiohttp.WSMsgType.TEXT:
                        self.events.append((time.monotonic(), json.loads(msg.data)))
                    elif msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                        break
        except Exception as exc:  # noqa: BLE001 - reported by __enter__ or in the variant's record
            self.error = f"{type(exc).__name__}: {exc}"
            self._ready.set()


def prepare_base(base: Path, models: Path, probe: bool = False) -> list[str]:
    """A hermetic ComfyUI base dir with this pack (and the probe node) in custom_nodes; returns its path flags."""
    for sub in ("custom_nodes", "input", "output", "temp"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    (base / "custom_nodes" / runner.REGISTRY_FOLDER_NAME).symlink_to(PACK_ROOT, target_is_directory=True)
    if probe:
        (base / "custom_nodes" / PROBE_DIR).symlink_to(Path(__file__).resolve().parent / "server_probe",
                                                       target_is_directory=True)
    yaml = runner.extra_model_paths_yaml(models.resolve(), base / "extra_model_paths.yaml")
    return ["--extra-model-paths-config", str(yaml), "--output-directory", str(base / "output")]


def measure(variant: ServerVariant, server: runner.ComfyServer, graph: dict, timeout: float,
            probe_dir: Path | None = None) -> dict:
    """Queue ``graph`` on ``server`` and measure it: step times, node times, memory peaks (and probe results)."""
    cid = uuid.uuid4().hex
    with EventRecorder(server.url, cid) as rec:
        t_watch = time.monotonic()
        with MemoryWatch(server.process.pid) as watch:
            t0 = time.monotonic()
            status, body = server.post_prompt(graph, client_id=cid)
            if status != 200:
                raise runner.RunError(f"ComfyUI rejected the graph ({status}): "
                                      f"{json.dumps(body.get('node_errors') or body)[:2000]}")
            entry = server.wait_for_history(body["prompt_id"], timeout)
            wall = time.monotonic() - t0
        time.sleep(0.3)  # the last websocket messages
    events = rec.events
    per_node = [step_times(events, n) for n in SAMPLER_NODES]
    probe = server_probe.read_probe(probe_dir) if probe_dir is not None else None
    if probe:
        server_probe.drop_profiled_steps(per_node, PROBE_CALL)
    out: dict[str, Any] = {"wall_s": round(wall, 2), **summarize_steps(per_node), "samplers": per_node,
                           "node_s": node_times(events), **watch.summary()}
    if probe is not None:
        out["probe"] = probe
    starts = [t for t, m in events if m.get("type") == "executing" and m["data"].get("node") == SAMPLER_NODES[0]]
    if starts:
        rel = starts[0] - t_watch
        out["peak_gpu_sampling_gib"] = _window_peak(watch.samples, rel, rel + 1e9, "gpu")
    out["timeline"] = [[s["t"], round(s["rss"] / GIB, 3), round(s["anon"] / GIB, 3),
                        None if s["gpu"] is None else round(s["gpu"] / GIB, 3)] for s in watch.samples]
    if entry["status"]["status_str"] != "success":
        out["status"], out["error"] = "error", runner.execution_error(entry) or str(entry["status"])
    else:
        out["status"] = "ok"
    return out


def run_variant(variant: ServerVariant, opts: argparse.Namespace, total_vram_gib: float) -> dict:
    """One fresh server, one graph; a failure is recorded with its reason and the log, never raised."""
    base = Path(tempfile.mkdtemp(prefix=f"bench_{variant.name}_", dir=opts.work))
    record: dict[str, Any] = {"name": variant.name, "what": variant.describe(), "variant": asdict(variant),
                              "status": "error"}
    graph = build_graph(variant, opts.steps_per_expert, opts.width, opts.height, opts.frames, decode=opts.decode,
                        probe=opts.kernel_profile)
    log = ""
    try:
        flags = [*prepare_base(base, opts.models, probe=opts.kernel_profile), "--front-end-root", str(opts.work / "frontend"),
                 "--user-directory", str(opts.work / "user"), *variant.server_args(total_vram_gib)]
        record["server_args"] = [f.replace(str(opts.work), "$WORK") for f in flags]  # no machine paths in results
        t0 = time.monotonic()
        with runner.start_comfyui(opts.comfyui, base, cpu=opts.cpu, extra_args=flags, startup_timeout=240) as server:
            record["startup_s"] = round(time.monotonic() - t0, 1)
            problems = runner.pack_import_problems(server.log_text(), base / "custom_nodes" /
                                                   runner.REGISTRY_FOLDER_NAME)
            if problems:
                raise runner.RunError(f"the pack failed to import: {problems[0].strip()}")
            if opts.list_nodes:
                info = server.get("/object_info", timeout=180)
                record["pack_nodes"] = sorted(k for k in info if k.startswith("LowVRAM_"))
                record["object_info_nodes"] = len(info)
            try:
                probe_dir = base / "output" / "bench_probe" if opts.kernel_profile else None
                record.update(measure(variant, server, graph, opts.timeout, probe_dir))
            finally:
                log = server.log_text()
    except Exception as exc:  # noqa: BLE001 - one variant's failure must not stop the others
        record["error"] = f"{type(exc).__name__}: {exc}"[:4000]
        if not log and (base / "comfyui.log").exists():
            log = (base / "comfyui.log").read_text(errors="replace")
    record["tqdm"] = tqdm_summaries(log)
    record["log"] = log_digest(log)
    if opts.keep_logs:
        (opts.work / f"{variant.name}.log").write_text(log, errors="replace")
    shutil.rmtree(base, ignore_errors=True)
    return record


# ----------------------------------------------------------------------------------------------------------
# environment, synthetic files, main


def pick_variants(spec: str) -> list[ServerVariant]:
    """Variants from a comma list of names or the groups 'uncapped', 'capped', 'lora' (4-step rows), 'all'."""
    names: list[str] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        group = {"uncapped": UNCAPPED, "capped": CAPPED, "lora": LORA_ROWS, "all": list(VARIANTS)}.get(item)
        if group is None and item not in VARIANTS:
            raise SystemExit(f"--variants: unknown {item!r}; known: uncapped, capped, lora, all, "
                             f"{', '.join(VARIANTS)}")
        names += group or [item]
    return [VARIANTS[n] for n in dict.fromkeys(names)]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--comfyui", type=Path, required=True, help="ComfyUI checkout (main.py there)")
    p.add_argument("--models", type=Path, required=True, help="folder with diffusion_models/ text_encoders/ vae/")
    p.add_argument("--write-models", action="store_true", help="write missing full-size synthetic files first")
    p.add_argument("--variants", default="all", help="comma list of names or uncapped, capped, lora, all")
    p.add_argument("--steps-per-expert", type=int, default=3)
    p.add_argument("--width", type=int, default=WIDTH)
    p.add_argument("--height", type=int, default=HEIGHT)
    p.add_argument("--frames", type=int, default=FRAMES)
    p.add_argument("--cpu", action="store_true", help="run ComfyUI on the CPU (tests of this script only)")
    p.add_argument("--decode", action="store_true", help="VAE decode + SaveAnimatedWEBP instead of SaveLatent")
    p.add_argument("--out", type=Path, default=RESULTS, help="where the json/md/png go")
    p.add_argument("--stem", default=BENCH, help="result file name stem")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds one graph may take")
    p.add_argument("--deadline", type=float, default=0.0,
                   help="seconds from start after which no new variant starts (0: none)")
    p.add_argument("--reserve-estimate", type=float, default=90.0,
                   help="seconds a variant is assumed to take when checking --deadline")
    p.add_argument("--git-sha", default=None, help="pack commit to record (default: git rev-parse here)")
    p.add_argument("--git-status", default=None, help="`git status --short` of the pack checkout to record")
    p.add_argument("--keep-logs", action="store_true", help="keep each server log in the work folder")
    p.add_argument("--list-nodes", action="store_true", help="record the pack's nodes from /object_info")
    p.add_argument("--kernel-profile", action="store_true",
                   help="time every model call inside the server and profile each expert's second step "
                        "(benchmarks/server_probe); that step is left out of s/step")
    p.add_argument("--merge", type=Path, action="append", default=[], metavar="JSON",
                   help="rows of an earlier run of this script to report with (a row run now replaces its name)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the chosen variants one fresh server each and write the reports after every variant."""
    from . import bench_server_report as report

    opts = _parser().parse_args(argv)
    started = time.monotonic()
    opts.work = (opts.work or Path(tempfile.mkdtemp(prefix="bench_server_"))).resolve()
    (opts.work / "frontend").mkdir(parents=True, exist_ok=True)
    (opts.work / "user").mkdir(parents=True, exist_ok=True)
    variants = pick_variants(opts.variants)
    if not opts.kernel_profile and (need := [v.name for v in variants if v.fp8_path != "default"]):
        raise SystemExit(f"--variants {','.join(need)}: the Kernel Profile node sets their fp8 path; add --kernel-profile")
    env = {**harness.parent_environment(), **gpu_facts(), **software_facts(),
           "comfyui_version": harness.comfyui_version(opts.comfyui)}
    env["git_sha"] = opts.git_sha or env.get("git_sha")
    env["git_status"] = opts.git_status
    settings = {"steps_per_expert": opts.steps_per_expert, "width": opts.width, "height": opts.height, "frames": opts.frames,
                "kernel_profile": opts.kernel_profile,
                "cfg": CFG, "cfg_4step": LORA_CFG, "shift_4step": LORA_SHIFT, "decode": opts.decode,
                "variants": [v.name for v in variants]}
    if opts.write_models:
        settings["model_write_s"] = write_models(opts.models, lora=any(v.lora for v in variants))
    settings["model_files_gb"] = {n: round(p.stat().st_size / 1e9, 2) for n in MODEL_FILES
                                  for p in opts.models.glob(f"*/{n}")}
    total = env.get("vram_total_gib") or 0.0
    results = merged_rows(opts.merge, {v.name for v in variants})
    for variant in variants:
        elapsed = time.monotonic() - started
        if opts.deadline and elapsed + opts.reserve_estimate > opts.deadline:
            print(f"skip {variant.name}: {elapsed:.0f} s used of the {opts.deadline:.0f} s deadline", flush=True)
            results.append({"name": variant.name, "what": variant.describe(), "variant": asdict(variant),
                            "status": "skipped", "error": "not started: time budget"})
            continue
        print(f"== {variant.name}: {variant.describe()}", flush=True)
        rec = run_variant(variant, opts, total)
        results.append(rec)
        print(f"   {rec['status']} s/step={rec.get('s_per_step')} first={rec.get('first_step_s')} "
              f"wall={rec.get('wall_s')} gpu={rec.get('peak_gpu_gib')} rss={rec.get('peak_rss_hwm_gib')} "
              f"{rec.get('error', '')[:300]}", flush=True)
        report.write(opts.out, opts.stem, results, env, settings)
    paths = report.write(opts.out, opts.stem, results, env, settings)
    print(report.markdown(results, env, settings))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if any(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
