"""The maps a newcomer reads cannot go stale: the README's layout block and docs/layout.md are
what ``make maps`` renders from the docstrings, and the architecture's code map names every
package."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import maps

ARCH = maps.ROOT / "docs" / "architecture.md"


def test_docs_layout_is_what_the_docstrings_say() -> None:
    assert maps.LAYOUT_MD.read_text() == maps.render_layout(), "docs/layout.md is stale: make maps"


def test_readme_layout_block_is_what_the_docstrings_say() -> None:
    text = maps.README.read_text()
    assert maps.readme_with_packages(text) == text, "README.md's Layout block is stale: make maps"


def test_a_module_without_a_docstring_is_named(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""A package. More."""\n')
    (pkg / "bare.py").write_text("x = 1\n")
    with pytest.raises(maps.MissingDocstring, match=r"bare\.py has no module docstring"):
        maps.summary_of_tree(pkg)


def test_a_summary_is_the_first_sentence_not_a_dot_inside_code() -> None:
    assert maps.first_sentence("Erasure round (``peers.mode: erasure``). More.") == (
        "Erasure round (``peers.mode: erasure``)"
    )
    assert maps.first_sentence("Restore: which step. Second.") == "Restore: which step"


def _code_map_blocks() -> str:
    text = ARCH.read_text()
    section = text[text.index("## Code map") :]
    section = section[: section.index("\n## ", 4)]
    return "\n".join(re.findall(r"```\n(.*?)```", section, flags=re.S))


@pytest.mark.parametrize("rel_root", [r for r, _ in maps.PACKAGES])
def test_the_code_map_names_every_top_level_package(rel_root: str) -> None:
    block = _code_map_blocks()
    root = maps.ROOT / rel_root
    packages = sorted(p.name for p in root.iterdir() if (p / "__init__.py").exists())
    missing = [p for p in packages if not re.search(rf"^{re.escape(p)}/", block, flags=re.M)]
    assert not missing, f"docs/architecture.md's code map does not name {missing}"


_OUTSIDE = re.compile(r"\b[Ii]ssues? \d+|DESIGN\.md|\.\./shared/")


@pytest.mark.parametrize("rel_root", [r for r, _ in maps.PACKAGES])
def test_runtime_code_cites_nothing_outside_the_repository(rel_root: str) -> None:
    """No "issue N" (the tracker is not in the repository), no file beside it."""
    hits = [
        f"{path.relative_to(maps.ROOT)}:{i}: {line.strip()}"
        for path in sorted((maps.ROOT / rel_root).rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if _OUTSIDE.search(line)
    ]
    assert not hits, "references outside the repository:\n" + "\n".join(hits)
