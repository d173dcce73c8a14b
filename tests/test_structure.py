"""The package's structure, read from its source with ``ast`` (nothing is imported but
by the one check that says so).

Every import counts, wherever it is written: at the top of a module, inside a
function (a lazy import) or under ``if TYPE_CHECKING:``. The rules:
- no import cycle among ficache's modules;
- format modules (``flashinfer_format``, ``bundle``, ``v2_store``) translate
  between files and data: they import no registry, schema, engine, store
  machinery or raw SQLite code, directly or through the modules they import
  (``ficache.exporting`` reads the registry for them); imported in a fresh
  interpreter, they load no SQLAlchemy (the one check here that imports);
- raw ``sqlite3`` only in ``ficache.schema`` (connection setup) and
  ``ficache.sqlite_fast`` (the fast paths);
- offline operations (merge, verify, adoption, import, export, revert) import
  nothing from the startup protocol (``ficache.sync``), directly or through
  the modules they import.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ficache"

FORMAT_MODULES = ("ficache.flashinfer_format", "ficache.bundle", "ficache.v2_store")
#: What a format module may not import: the registry, its schema, models and engine,
#: the store machinery and the kinds' modules over it (they hold SQL), the export side,
#: raw SQLite.
FORMAT_FORBIDDEN = (
    "ficache.registry",
    "ficache.schema",
    "ficache.models",
    "ficache.sqlite_fast",
    "ficache.exporting",
    "ficache.slices",
    "ficache.kinds",
    "ficache.kind_store",
    "ficache.kind_read",
    "ficache.records",
    "ficache.protocol_records",
    "sqlalchemy",
    "sqlite3",
)
RAW_SQLITE_ALLOWED = ("ficache.schema", "ficache.sqlite_fast")
OFFLINE_MODULES = (
    "ficache.merge",
    "ficache.verify",
    "ficache.adopt",
    "ficache.importing",
    "ficache.exporting",
    "ficache.revert",
)
PROTOCOL = "ficache.sync"


def _modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts).removesuffix(".__init__")
        found[name] = ast.parse(path.read_text(), filename=str(path))
    return found


def _imports(name: str, tree: ast.Module) -> Iterator[tuple[str, int]]:
    """``(imported module or module.name, line)`` of every import in ``tree``."""
    package = name.split(".") if name == "ficache" else name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + [node.module or ""])
            else:
                base = node.module or ""
            base = base.rstrip(".")
            yield base, node.lineno
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno


def _graph(modules: dict[str, ast.Module]) -> dict[str, dict[str, int]]:
    """``module -> {ficache module it imports: first line}``, the package itself left out."""
    graph: dict[str, dict[str, int]] = {}
    for name, tree in modules.items():
        edges: dict[str, int] = {}
        for target, line in _imports(name, tree):
            if target in modules and target not in (name, "ficache"):
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path(graph: dict[str, dict[str, int]], start: str, goal: str) -> list[str] | None:
    """One chain of imports from ``start`` to ``goal`` (breadth first), or None."""
    came_from: dict[str, str | None] = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        if v == goal:
            chain = [v]
            while (prev := came_from[chain[-1]]) is not None:
                chain.append(prev)
            return chain[::-1]
        for w in graph.get(v, {}):
            if w not in came_from:
                came_from[w] = v
                queue.append(w)
    return None


def test_the_package_is_found() -> None:
    modules = _modules()
    assert {"ficache.registry", *FORMAT_MODULES, *OFFLINE_MODULES, PROTOCOL} <= set(modules)


def test_no_import_cycles_lazy_imports_included() -> None:
    graph = _graph(_modules())
    cycles = _cycles(graph)
    shown = [
        " <-> ".join(c)
        + ": "
        + ", ".join(f"{a}:{graph[a][b]} imports {b}" for a in c for b in c if b in graph[a])
        for c in cycles
    ]
    assert not cycles, "import cycles:\n" + "\n".join(shown)


def _reached(graph: dict[str, dict[str, int]], start: str) -> set[str]:
    """``start`` and every ficache module it imports, directly or not."""
    seen = {start}
    queue = [start]
    while queue:
        for w in graph.get(queue.pop(), {}):
            if w not in seen:
                seen.add(w)
                queue.append(w)
    return seen


def test_format_modules_import_no_registry_schema_or_engine_code() -> None:
    """Nor through a ficache module they import (lazy imports included)."""
    modules = _modules()
    graph = _graph(modules)
    bad = [
        f"{name}: {reached}:{line} imports {target}"
        for name in FORMAT_MODULES
        for reached in sorted(_reached(graph, name))
        for target, line in _imports(reached, modules[reached])
        if any(target == f or target.startswith(f + ".") for f in FORMAT_FORBIDDEN)
    ]
    assert not bad, "format modules must only translate:\n" + "\n".join(bad)


def test_format_modules_load_no_sqlalchemy_in_a_fresh_interpreter() -> None:
    """What importing them really loads (``sys.modules``), not only what the source says."""
    heavy = ("sqlalchemy", "sqlite3", "ficache.models", "ficache.schema", "ficache.registry")
    code = (
        "import sys\n"
        f"import {', '.join(FORMAT_MODULES)}\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))\n"
    )
    path = os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"importing the format modules loads {done.stdout}"


def test_raw_sqlite3_only_in_schema_and_the_fast_path_module() -> None:
    modules = _modules()
    bad = [
        f"{name}:{line} imports {target}"
        for name, tree in modules.items()
        if name not in RAW_SQLITE_ALLOWED
        for target, line in _imports(name, tree)
        if target == "sqlite3" or target.startswith("sqlite3.")
    ]
    assert not bad, "raw sqlite3 outside ficache.schema and ficache.sqlite_fast:\n" + "\n".join(bad)


def test_offline_operations_import_nothing_from_the_protocol() -> None:
    graph = _graph(_modules())
    chains = [
        " -> ".join(chain)
        for name in OFFLINE_MODULES
        if (chain := _path(graph, name, PROTOCOL)) is not None
    ]
    assert not chains, "offline modules reach ficache.sync:\n" + "\n".join(chains)


def test_the_checks_see_lazy_and_type_checking_imports() -> None:
    """The reader itself: an import inside a function or under TYPE_CHECKING is an edge."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ficache.registry import Registry\n"
        "def f():\n    from . import sync\n    import sqlite3\n"
    )
    found = {target for target, _line in _imports("ficache.merge", ast.parse(source))}
    assert {"ficache.registry.Registry", "ficache.sync", "sqlite3"} <= found
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _path(graph, "d", "c") == ["d", "a", "b", "c"]
