"""A workflow on its way to ComfyUI's ``/prompt``: found by name, converted to API format, its inputs overridden and
its input images placed; and the files it wrote.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from ..checkpoints.safe_write import write_atomic
from .errors import InputError, one_line
from .inputs import NotJSONError, loads, read_json_file
from .server import PACK_DIR, RunError, RunInputError
from .ui_graph import BYPASSED_MODES, FRONTEND_ONLY, all_nodes
from .workflow_shape import check_api_workflow, check_ui_workflow

WORKFLOWS_DIR = PACK_DIR / "workflows"
# --synthetic tiny: sizes and steps every sampler/latent node gets unless --set says otherwise.
TINY_OVERRIDES: dict[str, dict[str, int]] = {
    "EmptyHunyuanLatentVideo": {"width": 64, "height": 64, "length": 5},
    "WanImageToVideo": {"width": 64, "height": 64, "length": 5},
    "Wan22ImageToVideoLatent": {"width": 64, "height": 64, "length": 5},
    "EmptySD3LatentImage": {"width": 64, "height": 64},
    "EmptyLatentImage": {"width": 64, "height": 64},
}
TINY_STEPS = 2


def resolve_workflow(name_or_path: str) -> Path:
    """A workflow path (anything at that path: reading it says what is wrong with it), or the name of a shipped
    workflow (with or without ``.json``)."""
    if "\x00" in name_or_path:
        raise RunInputError(f"workflow {name_or_path[:200]!r}: a path cannot hold a NUL character")
    p = Path(name_or_path)
    if p.exists() or p.is_symlink():
        return p
    plain = name_or_path and "/" not in name_or_path and "\\" not in name_or_path and name_or_path not in (".", "..")
    shipped = WORKFLOWS_DIR / (name_or_path if name_or_path.endswith(".json") else name_or_path + ".json")
    if plain and shipped.is_file():
        return shipped
    names = sorted(f.stem for f in WORKFLOWS_DIR.glob("*.json"))
    raise RunInputError(f"workflow {name_or_path!r} not found: no such file, and no shipped workflow of that name; "
                        f"shipped workflows: {', '.join(names) or '(none)'}")


def read_workflow(path: Path) -> dict:
    """The workflow in the file at ``path``, UI or API format, checked field by field (cli/workflow_shape.py);
    InputError naming the file otherwise."""
    workflow = read_json_file(path)
    if not isinstance(workflow, dict) or not workflow:
        raise RunInputError(f"{path}: not a ComfyUI workflow (expected a JSON object: the UI format Workflow > Save "
                            "writes, or the API format Export (API) writes)")
    if "nodes" in workflow:
        check_ui_workflow(workflow, str(path))
    else:
        check_api_workflow(workflow, str(path))
    return workflow


def is_api_workflow(workflow: dict) -> bool:
    """True for an API-format workflow: ``{node_id: {"class_type": ..., "inputs": {...}}}``."""
    return bool(workflow) and "nodes" not in workflow and all(
        isinstance(n, dict) and "class_type" in n for n in workflow.values())


def to_api(workflow: dict, object_info: dict) -> dict:
    """Convert a UI-format workflow to API format with comfy-cli (API format passes through)."""
    if is_api_workflow(workflow):  # no comfy-cli needed (e.g. a GPU box with only ComfyUI's requirements)
        return workflow
    try:
        from comfy_cli.workflow_to_api import convert_ui_to_api, is_api_format
    except ImportError:
        raise RunError("converting UI workflows needs comfy-cli: pip install comfy-cli") from None
    if is_api_format(workflow):
        return workflow
    try:
        return convert_ui_to_api(workflow, object_info)
    except Exception as exc:  # noqa: BLE001 - comfy-cli on a workflow it cannot read: name it, never a traceback
        raise RunInputError(f"comfy-cli could not convert this UI workflow to API format ({one_line(exc)}); open it in "
                            "ComfyUI and save it again, or give its API format (Workflow > Export (API))") from None


def missing_node_types(workflow: dict, object_info: dict) -> list[str]:
    """Node types a UI or API workflow needs that this ComfyUI lacks (bypassed, muted, front-end-only nodes and
    subgraph instances left out), sorted."""
    if is_api_workflow(workflow):
        return sorted({n["class_type"] for n in workflow.values()} - object_info.keys())
    subgraphs = {str(sg.get("id")) for sg in (workflow.get("definitions") or {}).get("subgraphs") or []}
    used = {str(n.get("type")) for n in all_nodes(workflow) if n.get("mode", 0) not in BYPASSED_MODES}
    return sorted(used - FRONTEND_ONLY - subgraphs - object_info.keys())


def apply_overrides(api: dict, overrides: list[str]) -> dict:
    """Apply ``NODE.INPUT=VALUE`` overrides; NODE is a node id, a title or a class_type (must be unique)."""
    for item in overrides:
        target, sep, raw = item.partition("=")
        node_key, dot, input_name = target.rpartition(".")
        if not sep or not dot or not node_key or not input_name:
            raise RunInputError(f"--set {item!r}: expected NODE.INPUT=VALUE")
        matches = [
            nid for nid, n in api.items()
            if node_key in (nid, n.get("class_type"), n.get("_meta", {}).get("title"))
        ]  # fmt: skip
        if len(matches) != 1:
            raise RunInputError(f"--set {item!r}: {len(matches)} nodes match {node_key!r}; use the node id")
        try:
            value: Any = loads(raw, f"--set {item!r}")
        except NotJSONError:  # not JSON: the value is the text itself
            value = raw
        api[matches[0]].setdefault("inputs", {})[input_name] = value
    return api


def tiny_overrides(api: dict) -> list[str]:
    """``--set`` items that shrink a workflow for --synthetic tiny: latent sizes and 2 sampler steps.

    KSamplerAdvanced start/end steps are scaled with the step count, so a two-expert split (0->10, 10->end of
    20) stays a split (0->1, 1->end of 2).
    """
    items: list[str] = []
    for nid, node in api.items():
        ct, inp = node.get("class_type"), node.get("inputs", {})
        for key, value in TINY_OVERRIDES.get(ct, {}).items():
            if key in inp:
                items.append(f"{nid}.{key}={value}")
        if ct in ("KSampler", "KSamplerAdvanced") and isinstance(inp.get("steps"), int) and inp["steps"] > TINY_STEPS:
            old = inp["steps"]
            items.append(f"{nid}.steps={TINY_STEPS}")
            for key in ("start_at_step", "end_at_step"):
                v = inp.get(key)
                if isinstance(v, int) and v < old:
                    items.append(f"{nid}.{key}={round(v * TINY_STEPS / old)}")
    return items


def ensure_input_images(workflow: dict, input_dir: Path, synthetic: bool, search: list[Path]) -> list[Path]:
    """Put every image a LoadImage node names into ComfyUI's input folder.

    The file is copied from ``search`` (the workflow's folder, the current directory); for --synthetic runs a
    missing one is drawn (a 256x256 gradient PNG), otherwise its absence is an error naming the fix.
    """
    if "nodes" in workflow:  # UI format, subgraphs too
        names = [_first_widget(n) for n in all_nodes(workflow) if n.get("type") == "LoadImage"]
    else:
        names = [n.get("inputs", {}).get("image") for n in workflow.values() if n.get("class_type") == "LoadImage"]
    placed = []
    for name in names:
        if name is None or isinstance(name, list):  # no value (ComfyUI says so), or a link to another node
            continue
        dst = input_dir / _image_name(name)
        if dst.exists():  # a file of the user's (or a link to one) is used as it is
            continue
        src = next((d / name for d in search if (d / name).is_file()), None)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src is not None:
            write_atomic(dst, src.read_bytes())  # a link or folder at dst is refused, never written through
        elif synthetic:
            write_atomic(dst, gradient_png())
        else:
            raise RunInputError(f"LoadImage wants {name!r}: put it in the current directory (or next to the "
                                "workflow), or use --set NODE.image=FILE with a file that is there")
        placed.append(dst)
    return placed


def _first_widget(node: dict) -> Any:
    """A UI node's first widget value (its ``image`` when the values are an object); None when it has none."""
    values = node.get("widgets_values")
    if isinstance(values, dict):
        return values.get("image")
    return values[0] if isinstance(values, list) and values else None


def _image_name(name: Any) -> str:
    """A LoadImage file name as a path inside ComfyUI's input folder; InputError for one that leaves it."""
    parts = PurePosixPath(name).parts if isinstance(name, str) else ()
    if not isinstance(name, str) or not name or PurePosixPath(name).is_absolute() \
            or PureWindowsPath(name).is_absolute() or PureWindowsPath(name).drive or ".." in parts or "\x00" in name:
        raise InputError(f"LoadImage image {str(name)[:200]!r}: not a file name inside ComfyUI's input folder; give "
                         "a name such as photo.png (or sub/photo.png) of a file in the current directory")
    return name


def gradient_png() -> bytes:
    """The 256x256 gradient PNG a --synthetic run draws for a missing LoadImage file."""
    import io

    from PIL import Image

    img = Image.new("RGB", (256, 256))
    img.putdata([(x, y, (x + y) // 2) for y in range(256) for x in range(256)])
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def output_files(entry: dict, output_dir: Path) -> list[Path]:
    """Paths of the files a finished prompt wrote (images, videos, latents...)."""
    found = []
    for node_out in entry.get("outputs", {}).values():
        for items in node_out.values():
            for item in items if isinstance(items, list) else []:
                if isinstance(item, dict) and "filename" in item and item.get("type", "output") == "output":
                    found.append(output_dir / item.get("subfolder", "") / item["filename"])
    return found
