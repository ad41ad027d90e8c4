"""Every relative link of the front page and the docs resolves: the file exists, and an anchor names a heading.

The long README sections moved under docs/ (issue 45); their links were rewritten for their new place.
"""

from __future__ import annotations

import pathlib
import re

import pytest

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


def test_methods_that_refuse_budget_or_ratio_are_the_documented_ones():
    """docs/library.md's lists of the methods that take only one of `budget` / `compression_ratio`, or neither:
    each refuses the one it does not take (a ConfigError from the method itself) and builds with the one it does."""
    import learned_files

    from kvjax import methods
    from kvjax.errors import ConfigError

    text = (ROOT / "docs" / "library.md").read_text(encoding="utf-8")
    para = " ".join(text[text.index("## Methods"):].split("\n\n")[1].split())
    found = [re.search(r"`compression_ratio` only: (.*?); `budget` only", para),
             re.search(r"`budget` only \([^)]*\): (.*?)\. Some", para),
             re.search(r"Some take neither, and say how much to keep otherwise: (.*?); `duo_attention` takes no "
                       r"`budget`", para)]
    assert all(found), f"the paragraph no longer reads as this test expects: {para}"
    ratio_only, budget_only, neither = (re.findall(r"`([a-z_]+)`(?: \(|,| and|$)", m.group(1)) for m in found)
    assert (len(ratio_only), len(budget_only), len(neither)) == (2, 3, 3), (ratio_only, budget_only, neither)
    needs = {"lukv": {"curve": learned_files.lukv_curve()}, "duo_attention": {"patterns": learned_files.duo_pattern()}}
    budget, ratio = {"budget": 8192}, {"compression_ratio": 0.5}
    cases = [(name, budget, ratio) for name in ratio_only] + [(name, ratio, budget) for name in budget_only]
    cases += [(name, refused, None) for name in neither for refused in (budget, ratio)]
    for name, refused, taken in cases + [("duo_attention", budget, ratio)]:
        with pytest.raises(ConfigError, match=f"^{name}: "):
            methods.get(name, **needs.get(name, {}), **refused)
        if taken is not None:
            methods.get(name, **needs.get(name, {}), **taken)
