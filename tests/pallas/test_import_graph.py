"""Imports flow one way: `kvjax.ops` may import `kvjax.pallas` (dispatch), `kvjax.pallas` never imports
`kvjax.ops`, and no kvjax module imports one that imports it back, at any distance.

The graph is read from the source with `ast`, function-level (lazy) imports included, so a cycle that only
closes at call time is caught too. The implicit import of a parent package's `__init__` is not an edge.
"""

from __future__ import annotations

import ast
import pathlib

import kvjax

PACKAGE = pathlib.Path(kvjax.__file__).parent


def _module_files() -> dict[str, pathlib.Path]:
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def _imports(name: str, path: pathlib.Path, modules: set[str]) -> set[str]:
    """The kvjax modules `name` imports anywhere in its source (`from pkg import sub` names `pkg.sub`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    files = _module_files()
    return {name: _imports(name, path, set(files)) for name, path in files.items()}


def _reachable(graph: dict[str, set[str]], start: str) -> dict[str, str | None]:
    """Every module `start` reaches, mapped to the module it was reached from (a path back to `start`)."""
    seen: dict[str, str | None] = {start: None}
    todo = [start]
    while todo:
        here = todo.pop()
        for there in graph[here]:
            if there not in seen:
                seen[there] = here
                todo.append(there)
    return seen


def _path(seen: dict[str, str | None], end: str) -> list[str]:
    chain = [end]
    while seen[chain[-1]] is not None:
        chain.append(seen[chain[-1]])
    return chain[::-1]


def test_the_graph_is_read():
    """The walk sees the edges it must: the lazy dispatch of ops into pallas, and the shared helpers."""
    graph = _graph()
    assert "kvjax.pallas.scoring" in graph["kvjax.ops.scoring"]  # a function-level import
    assert "kvjax._kernel_common" in graph["kvjax.pallas.scoring"]
    assert "kvjax._kernel_common" in graph["kvjax.ops.scoring"]
    assert "kvjax.tuning" in graph["kvjax.ops._impl"]


def test_pallas_never_imports_ops():
    graph = _graph()
    for name in (m for m in graph if m == "kvjax.pallas" or m.startswith("kvjax.pallas.")):
        seen = _reachable(graph, name)
        bad = sorted(m for m in seen if m == "kvjax.ops" or m.startswith("kvjax.ops."))
        assert not bad, f"{name} imports kvjax.ops: {' -> '.join(_path(seen, bad[0]))}"


def test_no_module_imports_one_that_imports_it_back():
    graph = _graph()
    for name in sorted(graph):
        for dep in sorted(graph[name]):
            seen = _reachable(graph, dep)
            assert name not in seen, f"import cycle: {name} -> {' -> '.join(_path(seen, name))}"


def _under(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_tasks_sit_below_eval_train_and_calibrate():
    """The long-context tasks (`kvjax.tasks`) import no layer above them, and training and calibration build their
    prompts from them without reaching up into the eval (issue 59); `kvjax.eval.tasks` is an alias of them."""
    graph = _graph()
    for name in (m for m in graph if _under(m, "kvjax.tasks")):
        seen = _reachable(graph, name)
        bad = sorted(m for m in seen if m != name and not _under(m, "kvjax.tasks", "kvjax.errors"))
        assert not bad, f"{name} imports {' -> '.join(_path(seen, bad[0]))}"
    for name in (m for m in graph if _under(m, "kvjax.train", "kvjax.calibrate")):
        seen = _reachable(graph, name)
        bad = sorted(m for m in seen if _under(m, "kvjax.eval"))
        assert not bad, f"{name} reaches into the eval: {' -> '.join(_path(seen, bad[0]))}"
    assert "kvjax.tasks" in graph["kvjax.train.loop"] and "kvjax.tasks" in graph["kvjax.eval.tasks"]


def test_the_shared_cli_flags_stand_below_the_eval():
    """`kvjax.cli` (the flags and parsers another entry point reuses) imports nothing of `kvjax.eval`."""
    graph = _graph()
    for name in (m for m in graph if _under(m, "kvjax.cli")):
        seen = _reachable(graph, name)
        bad = sorted(m for m in seen if _under(m, "kvjax.eval"))
        assert not bad, f"{name} imports {' -> '.join(_path(seen, bad[0]))}"


def test_the_refusal_line_imports_nothing_of_kvjax():
    """`kvjax.cli.refuse` (every command's one-line error) stands below every layer, so an entry point at any layer
    (`kvjax.models.gguf_assemble`, `kvjax.train`) uses it without an import reaching up."""
    assert _graph()["kvjax.cli.refuse"] == set()
