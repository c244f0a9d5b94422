"""Size limits of the pack's Python: no file over 600 lines, no function or method over 80 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", "node_modules", "build", "dist"}


def python_files(root: Path) -> list[Path]:
    """Every tracked-looking ``*.py`` under ``root`` (virtual environments, caches and hidden folders left out)."""
    return sorted(p for p in root.rglob("*.py") if not SKIP_DIRS.intersection(p.relative_to(root).parts)
                  and not any(part.startswith(".") for part in p.relative_to(root).parts[:-1]))


def oversized(root: Path) -> list[str]:
    """One line per file over MAX_FILE_LINES and per function over MAX_FUNCTION_LINES, naming where it is."""
    problems = []
    for path in python_files(root):
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(root).as_posix()
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            problems.append(f"{rel}: {lines} lines (limit {MAX_FILE_LINES}): split it by job")
        for node in ast.walk(ast.parse(text, filename=rel)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                length = node.end_lineno - start + 1
                if length > MAX_FUNCTION_LINES:
                    problems.append(f"{rel}:{node.lineno} {node.name}(): {length} lines (limit {MAX_FUNCTION_LINES})")
    return problems


def test_no_file_or_function_over_the_limits() -> None:
    problems = oversized(ROOT)
    assert not problems, "code over the size limits:\n" + "\n".join(problems)


def test_the_check_names_an_oversized_file_and_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "big.py").write_text("def long_one():\n" + body + "\n" + "\n" * MAX_FILE_LINES, encoding="utf-8")
    (tmp_path / "small.py").write_text("def short():\n    return 1\n", encoding="utf-8")
    problems = oversized(tmp_path)
    assert len(problems) == 2
    assert problems[0].startswith("big.py: ") and "split it by job" in problems[0]
    assert problems[1].startswith("big.py:1 long_one(): 81 lines")
