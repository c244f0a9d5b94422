"""Every relative link in the repository's Markdown resolves: the file exists and a `#anchor` names a heading there.

Result files move (superseded runs leave the tree, git keeps them); this keeps README, docs/ and the result reports
pointing at files that are still here.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".git", ".venv", "venv", "node_modules", "__pycache__", ".pytest_cache"}
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")


def markdown_files(root: Path) -> list[Path]:
    """Every Markdown file under ``root`` outside virtual environments, caches and hidden folders."""
    return sorted(p for p in root.rglob("*.md") if not SKIP_DIRS.intersection(p.relative_to(root).parts)
                  and not any(part.startswith(".") for part in p.relative_to(root).parts[:-1]))


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where brackets are not links."""
    return re.sub(r"`[^`\n]*`", "", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))


@cache
def anchors(path: Path) -> frozenset[str]:
    """GitHub's anchors of a Markdown file's headings (duplicates get -1, -2, ...) and its explicit ids."""
    seen: dict[str, int] = {}
    found = set(re.findall(r'<a (?:id|name)="([^"]+)"', path.read_text(encoding="utf-8")))
    for line in _prose(path.read_text(encoding="utf-8")).splitlines():
        if match := re.match(r"#{1,6}\s+(.+?)\s*#*$", line):
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return frozenset(found)


def broken_links(root: Path) -> list[str]:
    """One line per relative link under ``root`` whose file or heading is missing."""
    problems = []
    for path in markdown_files(root):
        for target in LINK.findall(_prose(path.read_text(encoding="utf-8"))):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(root)}: ({target})"
            if not dest.exists():
                problems.append(f"{where} no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where} no heading #{anchor} in {dest.relative_to(root)}")
    return problems


def test_every_relative_link_resolves() -> None:
    problems = broken_links(REPO_ROOT)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_check_names_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n\n## Do two GPUs help?\n", encoding="utf-8")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md#do-two-gpus-help) [gone](docs/b.md) [bad](docs/a.md#nope) [web](https://x.org/y) "
        "`[code](not/a/link.md)`\n```\n[fenced](nor/this.md)\n```\n", encoding="utf-8")
    assert broken_links(tmp_path) == ["README.md: (docs/b.md) no such file",
                                      "README.md: (docs/a.md#nope) no heading #nope in docs/a.md"]
