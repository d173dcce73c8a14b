"""A registry's schema as ``ficache db`` manages it: its revision read, upgraded, downgraded.

This module owns the engine of a schema command: ``RegistrySchema.open``
makes it from ``--db`` (creating a new SQLite file only with ``create``),
each operation runs on it, and ``close`` disposes it. It does not own the
migrations, revision checks and downgrade plans themselves
(``ficache.schema``: ``upgrade``, ``check_revision``, ``plan_downgrade``), the
registry's entries (``ficache.registry``), or printing (the CLI).

Invariants:
- One engine per opened schema, disposed by ``close`` (``RegistrySchema`` is a
  context manager), also when an operation raises.
- Opening never checks or changes the schema: unlike ``Registry.open``, it
  opens a registry of any revision, so that ``db`` can report and move it.
- Reading the revision never changes anything, and a revision newer than this
  ficache is reported (``RevisionState.newer``), not refused; a database error while reading
  it is one line (``schema.translate_operational_error``).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine
from sqlalchemy.exc import DatabaseError

from ficache import schema
from ficache.errors import SchemaTooNewError
from ficache.location import Location


@dataclass(frozen=True)
class RevisionState:
    """A registry's schema revision (None: no schema yet) and this ficache's head."""

    revision: str | None
    head: str
    #: The revision is one this ficache does not know: a newer ficache made it.
    newer: bool = False

    @property
    def state(self) -> str:
        """``up to date``, ``empty`` (no schema), ``needs upgrade`` or ``newer than this
        ficache ...`` (what to do: upgrade ficache)."""
        if self.newer:
            return "newer than this ficache; upgrade ficache (pip install -U ficache)"
        if self.revision == self.head:
            return "up to date"
        return "empty" if self.revision is None else "needs upgrade"


class RegistrySchema:
    """One registry's schema, opened for ``ficache db``. Use ``RegistrySchema.open``."""

    def __init__(self, location: Location, engine: Engine, *, created: bool) -> None:
        self.location = location
        self.engine = engine
        #: True when ``open`` created this registry's SQLite file (``schema.is_new_sqlite_file``).
        self.created = created

    @classmethod
    def open(cls, db: str | None, *, create: bool) -> RegistrySchema:
        """The schema of the registry at ``db`` (``schema.resolve``); ``create``: a missing
        SQLite file is created (empty: ``upgrade`` gives it its schema)."""
        location = schema.resolve(db)
        new = create and schema.is_new_sqlite_file(location)
        engine, _readonly = schema.make_engine(location, create=create)
        return cls(location, engine, created=new)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> RegistrySchema:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def revision(self) -> RevisionState:
        """The registry's revision (``schema.check_revision``; one this ficache
        does not know is ``newer``) and the head; a database error is one line."""
        try:
            with self.engine.connect() as conn:
                try:
                    revision = schema.check_revision(conn, self.location)
                except SchemaTooNewError:  # reported, never refused: reading it writes nothing
                    return RevisionState(
                        schema.current_revision(conn), schema.head_revision(), newer=True
                    )
        except DatabaseError as exc:  # a server that cannot be reached, say
            raise schema.translate_operational_error(exc, self.location) from None
        return RevisionState(revision, schema.head_revision())

    def upgrade(self, revision: str = "head") -> str | None:
        """Upgrade (or create) the schema to ``revision`` (``schema.upgrade``); the
        revision it is at then."""
        schema.upgrade(self.engine, self.location, revision)
        with self.engine.connect() as conn:
            return schema.current_revision(conn)

    def plan_upgrade(self, revision: str = "head") -> schema.UpgradePlan:
        """The revisions up to ``revision`` and the releases they stop (``schema.plan_upgrade``)."""
        return schema.plan_upgrade(self.engine, self.location, revision)

    def upgrade_planned(self, plan: schema.UpgradePlan) -> None:
        """Apply ``plan``, only while the registry is still at the revision it was made at."""
        plan.execute(self.engine)

    def upgrade_sql(self, plan: schema.UpgradePlan) -> str:
        """The SQL ``plan`` runs, for this registry's database (``schema.upgrade_sql``)."""
        return schema.upgrade_sql(plan, self.engine.dialect.name)

    def plan_downgrade(self, revision: str) -> schema.DowngradePlan:
        """The steps down to ``revision`` (or ``base``), counted (``schema.plan_downgrade``)."""
        return schema.plan_downgrade(self.engine, self.location, revision)

    def downgrade(self, plan: schema.DowngradePlan) -> None:
        """Apply ``plan``, only while the registry is still at the revision it was made at."""
        plan.execute(self.engine)


__all__ = ["RegistrySchema", "RevisionState"]
