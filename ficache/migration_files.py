"""The installed migration files, read without Alembic: where they are and which head they declare.

Alembic owns the schema (``ficache.schema`` runs it); this module only finds
its environment (``migrations_dir``: in an installed wheel, else a checkout)
and reads each revision file's ``revision`` / ``down_revision`` strings with
``ast`` (``declared_head``), so that a warm start can tell whether a SQLite
file is at this code's head without importing Alembic or SQLAlchemy.

Invariants:
- Nothing here executes a migration file or imports Alembic or SQLAlchemy.
- ``declared_head`` answers None on any doubt (a branch, a merge, a value
  that is not a plain string, an unreadable file); callers then ask Alembic
  (``schema.head_revision``). A test checks that both name the same head.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

from ficache.errors import SchemaError


def migrations_dir() -> Path:
    """The Alembic environment, from an installed wheel or a checkout."""
    spec = importlib.util.find_spec("ficache.migrations")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            if (Path(location) / "env.py").exists():
                return Path(location)
    checkout = Path(__file__).resolve().parent.parent / "migrations"
    if (checkout / "env.py").exists():
        return checkout
    raise SchemaError("ficache's migrations are missing from this installation; reinstall ficache")


@functools.lru_cache(maxsize=1)
def declared_head() -> str | None:
    """The head revision the installed migration files declare, read without Alembic.

    Each file's module-level ``revision`` and ``down_revision`` strings, read
    with ``ast``; the head is the one revision no other names as its parent.
    None on any doubt (a merge or branch, a value that is not a plain
    string, an unreadable file): callers then ask ``head_revision``. The warm
    start's fast path uses it to trust a SQLite file's revision without
    loading Alembic; a test checks it names Alembic's head.
    """
    import ast

    parents: dict[str, str | None] = {}
    try:
        for path in sorted((migrations_dir() / "versions").glob("*.py")):
            found: dict[str, Any] = {}
            for node in ast.parse(path.read_text(encoding="utf-8")).body:
                if isinstance(node, ast.AnnAssign | ast.Assign) and node.value is not None:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for target in targets:
                        if isinstance(target, ast.Name) and target.id in (
                            "revision",
                            "down_revision",
                        ):
                            found[target.id] = ast.literal_eval(node.value)
            if "revision" not in found:
                continue
            revision, parent = found["revision"], found.get("down_revision")
            if not isinstance(revision, str) or not (parent is None or isinstance(parent, str)):
                return None
            parents[revision] = parent
    except (OSError, SyntaxError, ValueError, SchemaError):
        return None
    heads = set(parents) - set(parents.values())
    return heads.pop() if len(heads) == 1 else None
