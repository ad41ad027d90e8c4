"""Every relative link of the front page and the docs resolves: the file exists, and an anchor names a heading.

The long README sections moved under docs/ (issue 45); their links were rewritten for their new place.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: pathlib.Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    heads = re.findall(r"^#{1,6} (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in _LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def _table_names(page: pathlib.Path) -> set[str]:
    """The back-quoted names in the first cell of every table row of `page`."""
    names: set[str] = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([a-z0-9_]+)`", line.split("|")[1]))
    return names


def test_every_method_has_a_row_in_the_method_tables():
    """A new method is listed where users look for it: docs/library.md's table and docs/methods.md's."""
    from kvjax import methods

    for page in (ROOT / "docs" / "library.md", ROOT / "docs" / "methods.md"):
        missing = sorted(set(methods.available()) - _table_names(page))
        assert not missing, f"{page.name} has no table row for {missing}"
