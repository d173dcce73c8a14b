"""Registries frozen at past schema revisions, on SQLite and on PostgreSQL, for upgrade tests.

The SQLite files are ``tests/data/registry-<revision>.db``, each made by the
ficache release that added the revision (``tests/data/make_frozen_registry.py``,
through that release's own migrations and public API, with real data).

A frozen PostgreSQL state is built from the same file: the database is
migrated to the file's revision with this repository's Alembic revisions
(``ficache db upgrade REVISION``), then every table's rows are copied from
the file in foreign-key order (``alembic_version`` and ``schema_compat`` are
the migrations' own), and each id sequence is moved past the copied ids.
"""

from __future__ import annotations

import shutil
import sqlite3
from contextlib import closing
from pathlib import Path

from sqlalchemy import MetaData, create_engine, text
from sqlalchemy.pool import NullPool

from ficache.registry_schema import RegistrySchema

DATA = Path(__file__).parent / "data"
#: Tables the migrations fill themselves.
_SCHEMA_TABLES = ("alembic_version", "schema_compat")


def frozen_file(revision: str) -> Path:
    return DATA / f"registry-{revision}.db"


def frozen_registry(revision: str, db: str) -> None:
    """Make ``db`` (a SQLite path, or an empty PostgreSQL database's URL) the frozen
    registry of ``revision``."""
    if db.startswith("postgresql"):
        frozen_postgres(revision, db)
    else:
        shutil.copyfile(frozen_file(revision), db)


def frozen_postgres(revision: str, url: str) -> None:
    """Migrate the empty database ``url`` to ``revision``, then load the frozen file's rows."""
    with RegistrySchema.open(url, create=True) as target:
        target.upgrade(revision)
    engine = create_engine(url, poolclass=NullPool)
    try:
        metadata = MetaData()
        metadata.reflect(engine)
        with (
            closing(sqlite3.connect(f"{frozen_file(revision).as_uri()}?mode=ro", uri=True)) as src,
            engine.begin() as conn,
        ):
            for table in metadata.sorted_tables:
                if table.name in _SCHEMA_TABLES:
                    continue
                names = [column.name for column in table.columns]
                quoted = ", ".join(f'"{name}"' for name in names)
                rows = src.execute(f"SELECT {quoted} FROM {table.name} ORDER BY 1").fetchall()
                if rows:
                    conn.execute(
                        table.insert(), [dict(zip(names, row, strict=True)) for row in rows]
                    )
                if "id" in table.c:
                    conn.execute(
                        text(
                            f"SELECT setval(pg_get_serial_sequence('{table.name}', 'id'), "
                            f"(SELECT coalesce(max(id), 0) + 1 FROM {table.name}), false)"
                        )
                    )
    finally:
        engine.dispose()
