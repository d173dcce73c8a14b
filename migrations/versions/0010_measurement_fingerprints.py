"""ficache 0.10: one environment under several FlashInfer measurement policies.

Adds ``fingerprints.measurement`` (nullable text): the measurement policy a
v2 store environment's entries were tuned under, the canonical JSON of its
``measure_*`` manifest fields (``Fingerprint.measurement``); NULL is the
default policy, and every row stored before this revision holds NULL, so
every digest, entry, record and commit stays as it was. FlashInfer keeps
runs under two policies apart (two ``env_hash`` directories); ficache now
keeps them apart as two fingerprints, so they never conflict and never
replace each other.

Downgrading: 0009 cannot tell a fingerprint's policy, so a fingerprint
under a non-default policy would read as its default sibling's environment
and serve its policy's tactics to every start. Downgrading therefore
removes those fingerprints with their entries, records, protocol records
and change rows, the commits that then hold no change, and recounts the
commits that keep some; ``lost_on_downgrade`` counts them first (export them
with ``ficache export --v2-store`` to keep them). Default-policy data is
kept.

Revision ID: 0010_measurement_fingerprints
Revises: 0009_protocol_records
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_measurement_fingerprints"
down_revision: str | Sequence[str] | None = "0009_protocol_records"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
# Rolling upgrades (ficache.schema): adds one nullable column, so 0.9 and 0.8 read every table
# as before and never see it: they serve, list and export. readable_from is 0.8, not 0.9: 0.8
# already reads 0009 (0009's readable_from) and only this column separates the two, so an
# upgrade from 0009 keeps the 0.8 servers of a rollout serving, as the 0009 upgrade did; naming
# 0009 here would make 0.8 refuse the registry (it does not know that revision) and tune
# uncached. Neither can tell a policy apart: a fingerprint under another policy reads, to them,
# as a second row of the same fields, so their warm starts are served both rows' entries (the
# newer row first; tactics valid on that hardware, measured under either policy, as they mixed
# policies themselves; checked with 0.8's code on the 0010 frozen registry), and 0.9's `verify`
# reports that row's digest (0.8's refuses every newer revision). They do not write it: their
# import and merge would put another policy's entries under the default fingerprint, the
# replacement this revision ends.
readable_from: str = "0008_start_counts"
writable_from: str = "0010_measurement_fingerprints"
# Expand, then contract (ficache.schema.features_of): what this revision adds, in words and by
# name; a ficache at this head reads and writes an 0009 registry without it (every fingerprint
# the default policy's; entries under another policy are refused there, never mixed in).
adds: str = "measurement policies of fingerprints"
adds_tables: tuple[str, ...] = ()
adds_columns: dict[str, tuple[str, ...]] = {"fingerprints": ("measurement",)}

_UNDER_POLICY = "SELECT id FROM fingerprints WHERE measurement IS NOT NULL"
#: Tables whose rows belong to a fingerprint: rows and change rows of every kind.
_OWNED = (
    "entry_changes",
    "record_changes",
    "protocol_record_changes",
    "entries",
    "records",
    "protocol_records",
)
_CHANGES = ("entry_changes", "record_changes", "protocol_record_changes")
#: (commit count column, change table, action) recounted for the commits that keep changes.
_COUNTS = (
    ("added", "entry_changes", "added"),
    ("replaced", "entry_changes", "replaced"),
    ("removed", "entry_changes", "removed"),
    ("records_added", "record_changes", "added"),
    ("records_replaced", "record_changes", "replaced"),
    ("records_removed", "record_changes", "removed"),
    ("protocol_added", "protocol_record_changes", "added"),
    ("protocol_replaced", "protocol_record_changes", "replaced"),
    ("protocol_removed", "protocol_record_changes", "removed"),
)


def _count(conn: sa.Connection, sql: str) -> int:
    return int(conn.execute(sa.text(sql)).scalar_one())


def _touched_commits(conn: sa.Connection) -> list[int]:
    """Commits holding a change row of a fingerprint under a non-default policy."""
    ids: set[int] = set()
    for table in _CHANGES:
        ids.update(
            int(row[0])
            for row in conn.execute(
                sa.text(
                    f"SELECT DISTINCT commit_id FROM {table} "
                    f"WHERE fingerprint_id IN ({_UNDER_POLICY})"
                )
            )
        )
    return sorted(ids)


def _holds_change(conn: sa.Connection, commit_id: int) -> bool:
    return any(
        conn.execute(
            sa.text(f"SELECT 1 FROM {table} WHERE commit_id = :id LIMIT 1"), {"id": commit_id}
        ).first()
        is not None
        for table in (*_CHANGES, "entries", "records", "protocol_records")
    )


def lost_on_downgrade(conn: sa.Connection) -> list[str]:
    """What downgrading to 0009 loses: everything stored under a non-default policy."""
    fingerprints = _count(conn, "SELECT count(*) FROM fingerprints WHERE measurement IS NOT NULL")
    if not fingerprints:
        return []
    held = [
        _count(conn, f"SELECT count(*) FROM {table} WHERE fingerprint_id IN ({_UNDER_POLICY})")
        for table in ("entries", "records", "protocol_records")
    ]
    changes = sum(
        _count(conn, f"SELECT count(*) FROM {table} WHERE fingerprint_id IN ({_UNDER_POLICY})")
        for table in _CHANGES
    )
    return [
        f"{fingerprints} fingerprints under a non-default measurement policy, with their "
        f"{held[0]} entries, {held[1]} records, {held[2]} protocol records and {changes} "
        f"change rows (commits touching them: {len(_touched_commits(conn))}, removed where "
        "nothing else remains)"
    ]


def upgrade() -> None:
    # Plain ADD COLUMN (see 0002): nullable, so every existing row is the default policy.
    op.add_column("fingerprints", sa.Column("measurement", sa.Text(), nullable=True))


def downgrade() -> None:
    conn = op.get_bind()
    touched = _touched_commits(conn)
    for table in _OWNED:
        conn.execute(sa.text(f"DELETE FROM {table} WHERE fingerprint_id IN ({_UNDER_POLICY})"))
    conn.execute(sa.text("DELETE FROM fingerprints WHERE measurement IS NOT NULL"))
    # Newest first: a revert (always newer) of a removed commit is removed before it.
    for commit_id in reversed(touched):
        if not _holds_change(conn, commit_id):
            conn.execute(sa.text("DELETE FROM commits WHERE id = :id"), {"id": commit_id})
            continue
        for column, table, action in _COUNTS:
            conn.execute(
                sa.text(
                    f"UPDATE commits SET {column} = (SELECT count(*) FROM {table} "
                    "WHERE commit_id = :id AND action = :action) WHERE id = :id"
                ),
                {"id": commit_id, "action": action},
            )
    # Dropping a plain column needs no table copy on SQLite 3.35+ (see 0008).
    op.drop_column("fingerprints", "measurement")
