"""The pack's layout rules, read statically (ast) from every module: no import circle, and each layer imports only
the layers below it (kernels < checkpoints < offload < host < the rest; kernels / checkpoints / offload are plain
torch; nodes never import the CLI).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACK_ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {"tests", "benchmarks", "workflows", "docs", ".ci", ".git", "__pycache__"}
PLAIN_TORCH = ("kernels", "offload", "checkpoints")
# The layers in the order docs/development.md gives: each imports only those before it; nodes, doctor, cli,
# synthetic and the root build on all of them (nodes never on cli).
ORDER = ("kernels", "checkpoints", "offload", "host")
TOP = ("nodes", "doctor", "cli", "synthetic")
FORBIDDEN = {**{pkg: ORDER[i + 1:] + TOP for i, pkg in enumerate(ORDER)}, "nodes": ("cli",)}
# The one crossing the order allows: checkpoints' two file helpers (no pack imports of their own) keep the
# decisions file of kernels/ as safe as every other file the pack writes.
ALLOWED = {"kernels.decision_store": {"checkpoints.safe_read", "checkpoints.safe_write"}}
# ComfyUI's top-level modules, which plain-torch packages never import
COMFYUI = ("comfy*", "folder_paths", "server", "nodes", "node_helpers", "latent_preview", "execution")


def pack_modules(root: Path, skip: set[str] = SKIP_DIRS) -> dict[str, Path]:
    """Dotted module name (relative to the package, '' for the root __init__) -> file, for every .py of the pack."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in skip for part in rel.parts[:-1]):
            continue
        if not all((root.joinpath(*rel.parts[:i]) / "__init__.py").is_file() for i in range(1, len(rel.parts))):
            continue  # not inside the package (a virtual environment or a local folder beside the code)
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The package-relative dotted target of a relative ``from`` import inside ``module``."""
    parts = module.split(".") if module else []
    base = parts if is_package else parts[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_of(module: str, path: Path, known: dict[str, Path], pkg_name: str) -> tuple[set[str], set[str]]:
    """(pack modules ``module`` imports, outside top-level names it imports), wherever in the file the import is."""
    is_package = path.name == "__init__.py"
    inside, outside = set(), set()

    def add_inside(target: str, names: list[str]) -> None:
        for name in names:  # ``from . import x`` names a module; ``from .m import f`` names the module m
            full = f"{target}.{name}" if target else name
            if full in known:
                inside.add(full)
                continue
            if target in known:
                inside.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            add_inside(_resolve(module, is_package, node), [a.name for a in node.names])
        elif isinstance(node, ast.ImportFrom) and node.module:
            top, _, rest = node.module.partition(".")
            if top == pkg_name:
                add_inside(rest, [a.name for a in node.names])
            else:
                outside.add(top)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                top, _, rest = alias.name.partition(".")
                if top == pkg_name:
                    add_inside(rest.rpartition(".")[0], [rest.rpartition(".")[2]]) if rest else None
                else:
                    outside.add(top)
    inside.discard(module)
    return inside, outside


def import_graph(root: Path, pkg_name: str = "comfyui_lowvram_dit") -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> pack modules it imports, module -> outside top-level names it imports) for the package at root."""
    known = pack_modules(root)
    graph, outside = {}, {}
    for module, path in known.items():
        graph[module], outside[module] = imports_of(module, path, known, pkg_name)
    return graph, outside


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each sorted; [] when the graph has none."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _matches(name: str, pattern: str) -> bool:
    return name.startswith(pattern[:-1]) if pattern.endswith("*") else name == pattern


def layer_violations(graph: dict[str, set[str]], outside: dict[str, set[str]]) -> list[str]:
    """'a imports b' for every import of a higher layer of the pack, or of ComfyUI from plain-torch code."""
    found = []
    for module in sorted(graph):
        package = module.split(".")[0]
        inside = {t.split(".")[0] for t in graph[module] - ALLOWED.get(module, set())
                  if t.split(".")[0] in FORBIDDEN.get(package, ())}
        comfy = {t for t in outside[module] if package in PLAIN_TORCH and any(_matches(t, p) for p in COMFYUI)}
        found += [f"{module} imports {t}" for t in sorted(inside | comfy)]
    return found


def test_pack_has_no_import_circle() -> None:
    graph, _ = import_graph(PACK_ROOT)
    assert len(graph) > 50 and graph["nodes.block_swap"], "the scan found too little to mean anything"
    assert find_cycles(graph) == []


def test_layers_import_only_downwards() -> None:
    graph, outside = import_graph(PACK_ROOT)
    assert layer_violations(graph, outside) == []


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_a_planted_circle_is_found(tmp_path: Path) -> None:
    """The scan is not vacuous: a two-module circle through relative imports (one inside a function) is reported."""
    pkg = _write(tmp_path / "pkg", {
        "__init__.py": "",
        "host/__init__.py": "",
        "host/a.py": "from .b import f\n",
        "host/b.py": "def f():\n    from ..host import a\n",
        "kernels/__init__.py": "",
        "kernels/c.py": "from ..host.a import f\nimport comfy.ops\n",
        "nodes/__init__.py": "",
        "nodes/n.py": "from pkg.cli import main\n",
        "cli/__init__.py": "",
        "cli/main.py": "",
    })
    graph, outside = import_graph(pkg, pkg_name="pkg")
    assert find_cycles(graph) == [["host.a", "host.b"]]
    assert layer_violations(graph, outside) == ["kernels.c imports comfy", "kernels.c imports host",
                                                 "nodes.n imports cli"]


def test_the_layer_order_is_checked_between_lower_layers(tmp_path: Path) -> None:
    """Each of kernels < checkpoints < offload < host imports only those before it; the allowed crossing is
    exactly kernels.decision_store -> checkpoints' file helpers."""
    pkg = _write(tmp_path / "pkg", {
        "__init__.py": "",
        **{f"{p}/__init__.py": "" for p in (*ORDER, "doctor")},
        "checkpoints/safe_read.py": "", "checkpoints/safe_write.py": "", "checkpoints/load.py": "",
        "kernels/decision_store.py": "from ..checkpoints.safe_read import f\nfrom ..checkpoints import safe_write\n",
        "kernels/other.py": "from ..checkpoints.safe_read import f\n",
        "checkpoints/c.py": "from ..kernels import other\nfrom ..offload import o\n",
        "offload/o.py": "from ..checkpoints import load\nfrom ..host import h\n",
        "host/h.py": "from ..offload import o\nfrom ..doctor import d\n",
        "doctor/d.py": "from ..host import h\n",
    })
    graph, outside = import_graph(pkg, pkg_name="pkg")
    assert layer_violations(graph, outside) == ["checkpoints.c imports offload", "host.h imports doctor",
                                                 "kernels.other imports checkpoints", "offload.o imports host"]


@pytest.mark.parametrize("text, expect", [
    ("from . import b\n", {"pkg.b"}),
    ("from .b import x\n", {"pkg.b"}),
    ("from .. import c\n", {"c"}),
    ("def f():\n    from ..c import x\n", {"c"}),
    ("import p.c\n", {"c"}),
    ("from p.pkg import b\n", {"pkg.b"}),
])
def test_imports_resolve(tmp_path: Path, text: str, expect: set[str]) -> None:
    root = _write(tmp_path / "p", {"__init__.py": "", "c.py": "", "pkg/__init__.py": "", "pkg/a.py": text,
                                   "pkg/b.py": ""})
    graph, _ = import_graph(root, pkg_name="p")
    assert graph["pkg.a"] == expect


def test_node_modules_hold_schemas_only() -> None:
    """Each nodes/<module>.py defines only node classes (schema + execute) and ``NODES``; logic lives in host/."""
    found = []
    for path in sorted((PACK_ROOT / "nodes").glob("*.py")):
        if path.name == "__init__.py":
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)) or (isinstance(node, ast.Expr)
                                                                 and isinstance(node.value, ast.Constant)):
                continue
            if isinstance(node, ast.ClassDef) and any("ComfyNode" in ast.unparse(b) for b in node.bases):
                continue
            if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["NODES"]:
                continue
            found.append(f"nodes/{path.name}:{node.lineno} {type(node).__name__}")
    assert found == []
