"""The Comfy Registry's fields in pyproject.toml, the icon they point at and the workflow that publishes them.

What the Registry reads is in its specification (docs.comfy.org/registry/specifications); `comfy node validate`
(tests/comfyui/test_packaging.py) checks only part of it, so each field is checked here.
"""

from __future__ import annotations

import ast
import re
import struct
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PROJECT, COMFY = PYPROJECT["project"], PYPROJECT["tool"]["comfy"]
REPOSITORY = PROJECT.get("urls", {}).get("Repository", "")
ICON_MAX = (800, 400)  # the Registry's largest icon, width x height


def _ci_hosts() -> list[str]:
    """The ComfyUI versions CI runs, oldest first, from .ci/run's default HOSTS."""
    match = re.search(r"HOSTS=\(\$\{CI_COMFYUI_HOSTS:-([\d. ]+)\}\)", (REPO_ROOT / ".ci/run").read_text())
    assert match, ".ci/run no longer sets HOSTS=(${CI_COMFYUI_HOSTS:-...}): update this test"
    return sorted(match.group(1).split(), key=lambda v: tuple(map(int, v.split("."))))


def _pack_version() -> str:
    """``__version__`` from the pack's ``__init__.py``, read without importing it."""
    for node in ast.parse((REPO_ROOT / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("__init__.py has no __version__ = '...' assignment")


def test_node_id_and_version() -> None:
    """The node id follows the Registry's rules (and is immutable once published); the version is X.Y.Z."""
    name = PROJECT["name"]
    assert name == "comfyui-lowvram-dit"
    assert len(name) < 100 and re.fullmatch(r"[A-Za-z][A-Za-z0-9._-]*", name) and not re.search(r"[._-]{2}", name)
    assert re.fullmatch(r"\d+\.\d+\.\d+", PROJECT["version"]), PROJECT["version"]
    assert PROJECT["version"] == _pack_version(), "bump [project].version and __init__.__version__ together"
    assert PROJECT.get("description", "").strip()
    assert (REPO_ROOT / PROJECT["license"]["file"]).is_file()
    assert PROJECT["requires-python"].startswith(">=3.")


def test_urls_point_at_one_github_repository() -> None:
    """Repository, Documentation and Bug Tracker are the same public GitHub repository."""
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", REPOSITORY), REPOSITORY
    urls = PROJECT["urls"]
    assert urls["Documentation"].startswith(REPOSITORY + "/")
    assert urls["Bug Tracker"] == REPOSITORY + "/issues"


def test_publisher_and_display_name() -> None:
    """PublisherId is a Registry publisher id (lowercase, digits, hyphens); DisplayName is set."""
    assert re.fullmatch(r"[a-z0-9][a-z0-9-]*", COMFY["PublisherId"]), COMFY["PublisherId"]
    assert COMFY["DisplayName"].strip()


def test_requires_comfyui_is_what_ci_runs() -> None:
    """requires-comfyui starts at the oldest host CI runs; the description names the newest one tested."""
    hosts = _ci_hosts()
    assert COMFY["requires-comfyui"] == f">={hosts[0]}"
    assert f"{hosts[0]} to {hosts[-1]}" in PROJECT["description"], "say the tested hosts where the Registry shows it"
    assert f"ComfyUI {hosts[0]} to {hosts[-1]}" in (REPO_ROOT / "README.md").read_text(encoding="utf-8")


def _image_size(path: Path) -> tuple[int, int]:
    """Width and height of an SVG (its width/height attributes) or a PNG (its IHDR chunk)."""
    if path.suffix == ".svg":
        root = ET.parse(path).getroot()
        assert root.tag.endswith("svg"), f"{path.name} is not an SVG"
        return int(float(root.attrib["width"])), int(float(root.attrib["height"]))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_icon_is_a_raw_url_of_a_file_in_this_repository() -> None:
    """Icon is the raw.githubusercontent URL of an SVG or PNG committed here, no larger than the Registry allows."""
    owner_repo = REPOSITORY.removeprefix("https://github.com/")
    match = re.fullmatch(rf"https://raw\.githubusercontent\.com/{re.escape(owner_repo)}/main/(.+)", COMFY["Icon"])
    assert match, f"Icon {COMFY['Icon']!r} is not a raw URL of {REPOSITORY} on main"
    icon = REPO_ROOT / match.group(1)
    assert icon.is_file() and icon.suffix in (".svg", ".png"), f"{match.group(1)} is not an SVG/PNG in the repository"
    width, height = _image_size(icon)
    assert 0 < width <= ICON_MAX[0] and 0 < height <= ICON_MAX[1], (width, height)


def test_publish_workflow_runs_the_registry_action_on_version_bumps() -> None:
    """.github/workflows/publish.yml: pushes to main that change pyproject.toml publish through the Registry action."""
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with comfy-cli (pip install -e '.[test]')")
    workflow = yaml.safe_load((REPO_ROOT / ".github/workflows/publish.yml").read_text(encoding="utf-8"))
    trigger = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` key as True
    assert trigger["push"] == {"branches": ["main"], "paths": ["pyproject.toml"]}
    steps = [step for job in workflow["jobs"].values() for step in job["steps"]]
    publish = [s for s in steps if str(s.get("uses", "")).startswith("Comfy-Org/publish-node-action@")]
    assert len(publish) == 1, "one Comfy-Org/publish-node-action step"
    assert publish[0]["with"]["personal_access_token"] == "${{ secrets.REGISTRY_ACCESS_TOKEN }}"
    bump = [s for s in steps if s.get("id") == "version"]
    assert bump and "HEAD^:pyproject.toml" in bump[0]["run"], "the publish step is gated on a version change"
    assert publish[0]["if"] == "steps.version.outputs.publish == 'true'"
