"""What every selftest check shares: the temporary model folders, the tiny files, one sampler step, the comparison.

The folders are added to ComfyUI's model paths for the run only, so pack and stock nodes find the same files by
name, as they would in a workflow; they are removed again afterwards (the Doctor node runs this in a live server).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass(frozen=True)
class Verdict:
    """The outcome of one comparison: PASS / FAIL / SKIP, and what was measured or why it did not run."""

    node: str
    status: str
    detail: str
    seconds: float = 0.0

    def line(self) -> str:
        """``PASS  Wan Loader [none]: identical to UNETLoader (0.4 s)``."""
        took = f" ({self.seconds:.1f} s)" if self.seconds else ""
        return f"{self.status}  {self.node}: {self.detail}{took}"


@dataclass(frozen=True)
class Check:
    """One node's comparisons: ``run(env)`` yields a Verdict per variant (backend, quantization, ...)."""

    key: str  # what ``--only`` selects
    node: str  # the node's display name, used when the check cannot start
    node_class: tuple[str, str]  # (module under nodes/, class): its COMFY_SEAMS must exist on this ComfyUI
    run: Callable[..., Iterable[Verdict]]


MODEL_FOLDERS = ("diffusion_models", "text_encoders", "vae", "loras")
SEED = 1234
WAN_LATENT = (1, 16, 2, 8, 8)  # 2 latent frames of 8x8: both rotary axes and a temporal step, 32 tokens
QWEN_LATENT = (1, 16, 8, 8)  # what EmptySD3LatentImage gives for 64x64
WAN_CONTEXT = (1, 12, 4096)  # 12 tokens at Wan's fixed text width
CFG = 3.0  # > 1: cond and uncond both run, batched, as in a real KSampler


def comfy_nodes() -> ModuleType:
    """ComfyUI's own ``nodes`` module (UNETLoader, LoraLoaderModelOnly, VAELoader), also when another top-level
    ``nodes`` comes first on ``sys.path`` (this pack's folder is the working directory, as in its test runs)."""
    import folder_paths

    try:
        import nodes
    except ImportError:
        nodes = None
    if nodes is not None and hasattr(nodes, "UNETLoader"):
        return nodes
    name = "_comfyui_nodes_for_selftest"
    if name not in sys.modules:
        path = Path(folder_paths.__file__).with_name("nodes.py")
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"selftest: cannot load ComfyUI's {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def relative_difference(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in fp32."""
    got, ref = got.detach().float().cpu(), ref.detach().float().cpu()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-12))


def compare(node: str, got: torch.Tensor, ref: torch.Tensor, tolerance: float, versus: str) -> Verdict:
    """PASS when ``got`` is within ``tolerance`` (relative L2; 0 means bit-identical) of ``ref``, else FAIL."""
    got, ref = got.detach().cpu(), ref.detach().cpu()
    if got.shape != ref.shape:
        return Verdict(node, FAIL, f"output shape {tuple(got.shape)}, {versus} gives {tuple(ref.shape)}")
    if not bool(torch.isfinite(got).all()):
        return Verdict(node, FAIL, f"output holds NaN/inf ({versus} does not)" if bool(torch.isfinite(ref).all())
                       else f"output and {versus} both hold NaN/inf")
    diff = relative_difference(got, ref)
    if tolerance == 0:
        same = got.dtype == ref.dtype and torch.equal(got, ref)
        text = f"identical to {versus}" if same else \
            f"differs from {versus}: relative difference {diff:.3g}, {got.dtype} vs {ref.dtype} (must be identical)"
        return Verdict(node, PASS if same else FAIL, text)
    ok = diff <= tolerance
    return Verdict(node, PASS if ok else FAIL,
                   f"relative difference {diff:.3g} {'<=' if ok else '>'} tolerance {tolerance:g} vs {versus}")


def compare_conditioning(node: str, got: list, ref: list, versus: str) -> Verdict:
    """CONDITIONING lists: every tensor (embeddings, reference latents) bit-identical and the same extras."""
    if len(got) != len(ref):
        return Verdict(node, FAIL, f"{len(got)} conditioning entries, {versus} gives {len(ref)}")
    for (t_got, x_got), (t_ref, x_ref) in zip(got, ref):
        if sorted(x_got) != sorted(x_ref):
            return Verdict(node, FAIL, f"conditioning extras {sorted(x_got)}, {versus} gives {sorted(x_ref)}")
        pairs = [(t_got, t_ref, "embeddings")]
        for key in x_got:
            a, b = x_got[key], x_ref[key]
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
                pairs.append((a, b, key))
            elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
                pairs += [(x, y, key) for x, y in zip(a, b) if isinstance(x, torch.Tensor)]
            elif a != b:
                return Verdict(node, FAIL, f"conditioning '{key}' {a!r}, {versus} gives {b!r}")
        for a, b, what in pairs:
            verdict = compare(node, a, b, 0.0, versus)
            if verdict.status != PASS:
                return Verdict(node, FAIL, f"{what}: {verdict.detail}")
    return Verdict(node, PASS, f"identical to {versus} ({len(got)} entr{'y' if len(got) == 1 else 'ies'})")


class SelfTestEnv:
    """Model folders under ``root`` registered with ComfyUI while the context is open, and shared results."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._added: list[tuple[str, str]] = []
        self._memo: dict[str, Any] = {}

    def __enter__(self) -> "SelfTestEnv":
        import folder_paths

        for folder in MODEL_FOLDERS:
            path = self.root / "models" / folder
            path.mkdir(parents=True, exist_ok=True)
            folder_paths.add_model_folder_path(folder, str(path))
            self._added.append((folder, str(path)))
        return self

    def __exit__(self, *exc: object) -> None:
        import comfy.model_management as mm
        import folder_paths

        for folder, path in self._added:
            paths = folder_paths.folder_names_and_paths.get(folder, ([],))[0]
            if path in paths:
                paths.remove(path)
            getattr(folder_paths, "filename_list_cache", {}).pop(folder, None)
        self._memo.clear()
        mm.cleanup_models_gc()

    @property
    def device(self) -> torch.device:
        """Where ComfyUI runs models (its GPU, or the CPU under ``--cpu`` / without one)."""
        import comfy.model_management as mm

        return torch.device(mm.get_torch_device())

    def describe(self) -> str:
        """``ComfyUI 0.33.0, torch 2.9.1, cpu``."""
        from ..host.version import comfyui_version

        dev = self.device
        name = f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""
        return f"ComfyUI {comfyui_version() or 'unknown'}, torch {torch.__version__}, {dev}{name}"

    def file(self, folder: str, name: str, write: Callable[[Path], object]) -> str:
        """The name of a file in model folder ``folder``, written by ``write(path)`` the first time it is asked."""
        path = self.root / "models" / folder / name
        if not path.exists():
            write(path)
        return name

    def memo(self, key: str, make: Callable[[], Any]) -> Any:
        """``make()`` once per run (a reference output several checks compare with)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def sample(self, model: Any, positive: list | None = None, negative: list | None = None,
               latent: tuple[int, ...] = WAN_LATENT) -> torch.Tensor:
        """The model's prediction in one euler step of KSampler's path (``comfy.sample.sample``, cfg 3) from seeded
        noise; Wan's random 12-token conditioning unless given.

        Wan and Qwen-Image are flow models: the first step starts from sigma_max * noise and returns the denoised
        latent x - sigma * v, so v = (sigma * noise - denoised) / sigma. Compared as v, a difference in the model
        is not diluted by the noise that the denoised latent mostly consists of at the first step."""
        import comfy.sample

        empty = comfy.sample.fix_empty_latent_channels(model, torch.zeros(latent))  # as KSampler does (4-D -> 5-D)
        g = torch.Generator().manual_seed(SEED)
        noise = torch.randn(empty.shape, generator=g)
        if positive is None or negative is None:
            positive = [[torch.randn(WAN_CONTEXT, generator=g), {}]]
            negative = [[torch.randn(WAN_CONTEXT, generator=g), {}]]
        out = comfy.sample.sample(model, noise, 1, CFG, "euler", "simple", positive, negative, empty, seed=SEED,
                                  disable_pbar=True)
        sigma = float(model.get_model_object("model_sampling").sigma_max)
        return (sigma * noise - out.float().cpu()) / sigma
