"""Packaging: requirements, `comfy node validate`, imports without ComfyUI.

CPU only, no ComfyUI needed: runs in CI (.ci/run). The Registry's fields one by one: tests/unit/test_registry_metadata.py.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
COMFY_MODULES = ("comfy", "comfy_api", "comfy_extras", "comfy_execution", "comfy_config", "folder_paths")
# Installed by ComfyUI itself; a pack that lists them makes Manager/pip fight over the user's CUDA build.
HOST_OWNED = ("torch", "torchvision", "torchaudio", "torchsde")
# GPU-only libraries a `*_triton.py` kernel module may import at top: absent on the CPU CI machine.
OPTIONAL_GPU_LIBS = ("triton",)


def _requirement_names(path: Path) -> list[str]:
    names = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            assert not line.startswith("-"), f"{path.name}: pip options ({line!r}) break ComfyUI-Manager's per-line install"
            names.append(re.split(r"[\s<>=!~;\[@]", line, maxsplit=1)[0].lower())
    return names


def test_requirements_never_install_torch() -> None:
    """requirements.txt (what Manager / Registry installs run) and [project].dependencies leave torch alone."""
    for names, where in ((_requirement_names(REPO_ROOT / "requirements.txt"), "requirements.txt"),
                         ([re.split(r"[\s<>=!~;\[@]", d, maxsplit=1)[0].lower()
                           for d in PYPROJECT["project"].get("dependencies", [])], "[project].dependencies")):
        assert not set(names) & set(HOST_OWNED), f"{where} lists {set(names) & set(HOST_OWNED)}"


def test_comfy_node_validate_passes_without_warnings(tmp_path: Path) -> None:
    """`comfy node validate` (what `comfy node publish` runs first) passes with no warning at all."""
    if importlib.util.find_spec("comfy_cli") is None:
        pytest.skip("comfy-cli is not installed (pip install -e '.[test]')")
    env = {**os.environ, "HOME": str(tmp_path), "DO_NOT_TRACK": "1", "COMFY_NO_TELEMETRY": "1", "NO_COLOR": "1"}
    proc = subprocess.run([sys.executable, "-m", "comfy_cli", "--skip-prompt", "--no-json", "node", "validate"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "warning" not in out.lower(), out
    assert "All validation checks passed" in out, out


_IMPORT_PROBE = """
import importlib, importlib.util, json, pkgutil, sys, inspect
import comfyui_lowvram_dit as pack
names = []
for package in ("kernels", "offload", "checkpoints"):  # compute and files: never ComfyUI
    sub = importlib.import_module(f"comfyui_lowvram_dit.{package}")
    names += sorted(f"{package}.{m.name}" for m in pkgutil.iter_modules(sub.__path__))
failed, skipped = {}, {}
for name in names:
    try:
        importlib.import_module(f"comfyui_lowvram_dit.{name}")
    except ModuleNotFoundError as exc:
        root = (exc.name or "").split(".")[0]
        if root in OPTIONAL_GPU_LIBS and importlib.util.find_spec(root) is None:
            skipped[name] = f"needs {root}, not installed here"
        else:
            failed[name] = f"{type(exc).__name__}: {exc}"
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps({
    "kernels": names, "failed": failed, "skipped": skipped,
    "comfy_loaded": sorted(m for m in sys.modules if m.split(".")[0] in COMFY_MODULES),
    "entrypoint_is_coroutine": inspect.iscoroutinefunction(getattr(pack, "comfy_entrypoint", None)),
    "version": getattr(pack, "__version__", None),
}))
"""


def test_pack_and_kernels_import_without_comfyui(tmp_path: Path) -> None:
    """The package and every kernels module import with ComfyUI absent and never import ComfyUI.

    A module may fail only for a missing GPU-only library (triton) that is really not installed.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COMFYUI_PATH")}
    code = f"COMFY_MODULES = {COMFY_MODULES!r}\nOPTIONAL_GPU_LIBS = {OPTIONAL_GPU_LIBS!r}\n" + _IMPORT_PROBE
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["kernels"], "no kernels modules found: is the pack installed (pip install -e .)?"
    assert not report["failed"], f"kernels modules that fail to import without ComfyUI: {report['failed']}"
    assert not report["comfy_loaded"], f"kernels must never import ComfyUI, but loaded {report['comfy_loaded']}"
    assert report["entrypoint_is_coroutine"], "__init__.comfy_entrypoint must be an async function"
    assert report["version"] == PYPROJECT["project"]["version"]


def test_pack_code_uses_relative_self_imports() -> None:
    """Inside ComfyUI the pack lives in custom_nodes/<any folder>: `import comfyui_lowvram_dit` would fail there."""
    offenders = []
    packages = sorted(p.parent for p in REPO_ROOT.glob("*/__init__.py") if p.parent.name != "benchmarks")
    for path in [REPO_ROOT / "__init__.py", *(f for package in packages for f in sorted(package.rglob("*.py")))]:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            if any(m.split(".")[0] == "comfyui_lowvram_dit" for m in mods):
                offenders.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
    assert not offenders, f"absolute self-imports (use `from .x import y`): {offenders}"


def test_workflows_are_json() -> None:
    """Shipped workflows parse (a broken file only shows up as a missing template in the UI)."""
    for folder in ("workflows", "example_workflows"):
        for path in sorted((REPO_ROOT / folder).glob("*.json")):
            json.loads(path.read_text())
