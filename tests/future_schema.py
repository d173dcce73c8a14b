"""A synthetic future schema revision, for the rolling-upgrade tests.

The previous release of ficache, relative to a future one, is this code: a
future additive revision ``0098_future`` (a new table ``future_notes`` with
one row, and a nullable column ``entries.future_note``) on top of this
checkout's head declares, as every revision does, the oldest schema heads
that read and write it: both that head. ``write_future_migrations`` copies this checkout's
migrations and adds that revision; ``upgrade_to_future`` runs the future
code's upgrade (this ``ficache.schema`` pointed at those migrations for the
duration of the call) on a registry; ``future_state`` reads back what the
future schema owns, to show that this code left it as it was.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, inspect, text
from sqlalchemy.pool import NullPool

from ficache import schema

REVISION = "0098_future"

_MIGRATION = '''"""A future ficache (tests only): a table and a nullable column, nothing else.

Revision ID: 0098_future
Revises: HEAD_REVISION
"""

import sqlalchemy as sa
from alembic import op

revision = "0098_future"
down_revision = "HEAD_REVISION"
branch_labels = None
depends_on = None
readable_from: str = "HEAD_REVISION"
writable_from: str = "HEAD_REVISION"


def lost_on_downgrade(conn):
    return []


def upgrade() -> None:
    op.create_table(
        "future_notes",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("note", sa.Text(), nullable=False),
    )
    op.execute("INSERT INTO future_notes (note) VALUES ('kept by older ficache')")
    op.add_column("entries", sa.Column("future_note", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("entries", "future_note")
    op.drop_table("future_notes")
'''


def write_future_migrations(dest: Path) -> Path:
    """This checkout's migrations plus ``0098_future``, under ``dest``; returns the directory."""
    target = dest / "migrations"
    shutil.copytree(schema.migrations_dir(), target, ignore=shutil.ignore_patterns("__pycache__"))
    head = schema.head_revision()  # this checkout's head, before the future one is added
    (target / "versions" / f"{REVISION}.py").write_text(_MIGRATION.replace("HEAD_REVISION", head))
    return target


def upgrade_to_future(db: str | Path, migrations: Path) -> None:
    """Upgrade the registry ``db`` to ``0098_future`` as the future ficache would."""
    saved = schema.migrations_dir
    schema.migrations_dir = lambda: migrations  # type: ignore[assignment]
    schema.script_directory.cache_clear()
    try:
        location = schema.resolve(str(db))
        engine, _readonly = schema.make_engine(location)
        try:
            schema.upgrade(engine, location, "head")
        finally:
            engine.dispose()
    finally:
        schema.migrations_dir = saved  # type: ignore[assignment]
        schema.script_directory.cache_clear()


def future_state(db: str | Path) -> dict[str, Any]:
    """The revision, the compatibility row and what ``0098_future`` added, as stored."""
    location = schema.resolve(str(db))
    engine = create_engine(location.url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            columns = {c["name"] for c in inspect(conn).get_columns("entries")}
            return {
                "revision": conn.execute(text("SELECT version_num FROM alembic_version")).all(),
                "compat": conn.execute(text("SELECT * FROM schema_compat")).all(),
                "notes": conn.execute(text("SELECT id, note FROM future_notes")).all(),
                "future_note": "future_note" in columns,
                "noted": conn.execute(
                    text("SELECT count(*) FROM entries WHERE future_note IS NOT NULL")
                ).scalar_one(),
            }
    finally:
        engine.dispose()
