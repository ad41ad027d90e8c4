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


def test_every_method_has_one_row_in_the_sliding_window_table():
    """docs/models.md says what each method does on a model with sliding-window layers: every registered method in
    exactly one row (it listed about 20 of 51 before)."""
    from kvjax import methods

    text = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    lines = text[text.index("### Compression on models with sliding-window layers"):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| method |"))
    listed: list[str] = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        listed += [name.strip() for name in line.split("|")[1].split(",")]
    assert sorted(listed) == sorted(set(listed)), "a method in two rows"
    assert set(listed) == set(methods.available()), sorted(set(methods.available()) ^ set(listed))


def _rows(page: str, section: str | None = None) -> list[tuple[list[str], str]]:
    """`(method names, hyperparameter cell)` of every row of `page`'s method table (the first table after the
    heading `section`, or the page's table whose header starts with `| name |`)."""
    text = (ROOT / page).read_text(encoding="utf-8")
    lines = text[text.index(section):].splitlines() if section else text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| name |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        rows.append((re.findall(r"`([a-z0-9_]+)`", cells[0]), cells[2]))
    return rows


def _literal(value: str):
    """A documented value as Python reads it (a mapping as the sorted pairs a frozen method stores), or `None`
    where the docs give a description, not a value (`[...]`, `N`)."""
    import ast

    if "..." in value:
        return None
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return None
    return tuple(sorted(parsed.items())) if isinstance(parsed, dict) else parsed


@pytest.mark.parametrize("page,section", [("docs/library.md", None), ("docs/methods.md", "## Table")])
def test_documented_defaults_are_the_code_defaults(page, section):
    """Each `name=value` of a method table's hyperparameter column names a field of the method, and where the
    field has a default, the value is that default (a field defaulting to None resolves it when built: the docs
    give the value it resolves to; `tests/methods/test_<name>.py` checks that). A back-quoted bare name is a field,
    `budget` / `compression_ratio`, or another method (whose hyperparameters the row refers to)."""
    import dataclasses

    from kvjax import methods

    wrong, checked = [], 0
    for names, cell in _rows(page, section):
        for name in names:
            fields = {f.name: f for f in dataclasses.fields(methods.method_class(name))}
            for key, value in re.findall(r"`([a-z0-9_]+)=([^`]*)`", cell):
                if key not in fields:
                    wrong.append(f"{name}: no hyperparameter {key!r}")
                    continue
                field, documented = fields[key], _literal(value)
                if field.default_factory is not dataclasses.MISSING:
                    default = field.default_factory()
                else:
                    default = field.default
                if default is dataclasses.MISSING or documented is None or (default is None and value):
                    continue
                checked += 1
                if documented != default:
                    wrong.append(f"{name}: the docs give {key}={value}, the code {key}={default!r}")
            for bare in re.findall(r"`([a-z0-9_]+)`", cell):
                if bare not in fields and bare not in ("budget", "compression_ratio") and \
                        bare not in methods.available():
                    wrong.append(f"{name}: {bare!r} is no hyperparameter")
    assert checked > 60, f"only {checked} documented defaults found in {page}: has the table changed shape?"
    assert not wrong, f"{page}:\n" + "\n".join(wrong)


def test_retrieval_defaults_table_is_the_code():
    """docs/retrieval.md's table of the retrieval methods' defaults: each cell the method's field default."""
    import dataclasses

    from kvjax import methods

    text = (ROOT / "docs" / "retrieval.md").read_text(encoding="utf-8").splitlines()
    start = text.index("| name | `infllm` | `qllm` | `actqkv` | meaning |")
    wrong, checked = [], 0
    for line in text[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.split("|")[1:-1]]
        keys = re.findall(r"`([a-z0-9_]+)`", cells[0])
        for method, cell in zip(("infllm", "qllm", "actqkv"), cells[1:4], strict=True):
            fields = {f.name: f.default for f in dataclasses.fields(methods.method_class(method))}
            if cell == "–":
                wrong += [f"{method}: {key} is documented as absent" for key in keys if key in fields]
                continue
            values = [v.strip().strip("`") for v in re.split(r" / |, ", cell)]
            for key, value in zip(keys, values, strict=True):
                if key not in fields:
                    wrong.append(f"{method}: no hyperparameter {key!r}")
                elif fields[key] is None:  # resolved when built (`global_position`: `n_local - 1`)
                    continue
                else:
                    checked += 1
                    documented = _literal(value)
                    if (value if documented is None else documented) != fields[key]:
                        wrong.append(f"{method}: the docs give {key}={value}, the code {fields[key]!r}")
    assert checked > 30 and not wrong, "\n".join(wrong)


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
