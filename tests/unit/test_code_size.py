"""Size limit of the pack's Python: no function or method over 80 lines.

Files have no line limit: "one job per file" (docs/development.md) is the rule for them.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FUNCTION_LINES = 80
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", "node_modules", "build", "dist", "vendor"}  # vendor: third-party test fixtures, kept verbatim


def python_files(root: Path) -> list[Path]:
    """Every tracked-looking ``*.py`` under ``root`` (virtual environments, caches and hidden folders left out)."""
    return sorted(p for p in root.rglob("*.py") if not SKIP_DIRS.intersection(p.relative_to(root).parts)
                  and not any(part.startswith(".") for part in p.relative_to(root).parts[:-1]))


def oversized(root: Path) -> list[str]:
    """One line per function or method over MAX_FUNCTION_LINES (decorators included), naming where it is."""
    problems = []
    for path in python_files(root):
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(text, filename=rel)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                length = node.end_lineno - start + 1
                if length > MAX_FUNCTION_LINES:
                    problems.append(f"{rel}:{node.lineno} {node.name}(): {length} lines (limit {MAX_FUNCTION_LINES})")
    return problems


def test_no_function_over_the_limit() -> None:
    problems = oversized(ROOT)
    assert not problems, "functions over the size limit:\n" + "\n".join(problems)


def test_the_check_names_an_oversized_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "big.py").write_text("def long_one():\n" + body + "\n", encoding="utf-8")
    (tmp_path / "small.py").write_text("def short():\n    return 1\n", encoding="utf-8")
    # a long file of short functions is fine: files are held to "one job per file", not to a length
    (tmp_path / "long_file.py").write_text("".join(f"def f{i}():\n    return {i}\n\n\n" for i in range(300)),
                                           encoding="utf-8")
    problems = oversized(tmp_path)
    assert len(problems) == 1
    assert problems[0].startswith("big.py:1 long_one(): 81 lines")
