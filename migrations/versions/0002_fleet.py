"""ficache 0.2: tuned times, last served times, new values in the change log.

Adds ``entries.tuned_at`` (backfilled from ``updated_at``),
``fingerprints.last_served_at`` (NULL: never served), and to
``entry_changes`` the value each change wrote (``new_runner``,
``new_tactic``, ``new_policy``) and the tuned time of the value it replaced
(``old_tuned_at``). The new values of changes recorded before this revision
are recovered from history: the old value of the next change to the same
entry, else the entry as it stands when the change is its current one.

Revision ID: 0002_fleet
Revises: 0001_registry
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002_fleet"
down_revision: str | Sequence[str] | None = "0001_registry"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
# Rolling upgrades (ficache.schema): the oldest schema heads whose code reads and writes this
# revision; adds nullable columns only: 0.1 reads it; its writes would leave the new change-log
# values empty.
readable_from: str = "0001_registry"
writable_from: str = "0002_fleet"


def lost_on_downgrade(conn: sa.Connection) -> list[str]:
    """What downgrading to 0001 loses (upgrading again recovers the change rows' new values)."""
    served = conn.execute(
        sa.text("SELECT count(*) FROM fingerprints WHERE last_served_at IS NOT NULL")
    ).scalar_one()
    tuned = conn.execute(
        sa.text(
            "SELECT count(*) FROM entries WHERE tuned_at IS NOT NULL AND tuned_at <> updated_at"
        )
    ).scalar_one()
    lost = []
    if tuned:
        lost.append(f"when {tuned} entries were tuned (upgrading again takes their last write)")
    if served:
        lost.append(f"when {served} fingerprints were last served")
    return lost


def upgrade() -> None:
    # Plain ALTER TABLE ADD/DROP COLUMN (SQLite 3.35+), not batch mode: a batch
    # recreates each table, and dropping a table that others reference fails
    # their foreign keys (which ficache keeps on).
    op.add_column("fingerprints", sa.Column("last_served_at", sa.Float(), nullable=True))
    op.add_column("entries", sa.Column("tuned_at", sa.Float(), nullable=True))
    op.add_column("entry_changes", sa.Column("old_tuned_at", sa.Float(), nullable=True))
    op.add_column("entry_changes", sa.Column("new_runner", sa.Text(), nullable=True))
    op.add_column("entry_changes", sa.Column("new_tactic", sa.Text(), nullable=True))
    op.add_column("entry_changes", sa.Column("new_policy", sa.Text(), nullable=True))
    op.execute("UPDATE entries SET tuned_at = updated_at WHERE tuned_at IS NULL")
    _backfill_new_values()


def _backfill_new_values() -> None:
    """Fill ``new_*`` of every added or replaced change from later history."""
    conn = op.get_bind()
    changes = sa.table(
        "entry_changes",
        sa.column("id", sa.Integer),
        sa.column("commit_id", sa.Integer),
        sa.column("fingerprint_id", sa.Integer),
        sa.column("scope", sa.String),
        sa.column("key", sa.Text),
        sa.column("action", sa.String),
        sa.column("old_runner", sa.Text),
        sa.column("old_tactic", sa.Text),
        sa.column("old_policy", sa.Text),
        sa.column("new_runner", sa.Text),
        sa.column("new_tactic", sa.Text),
        sa.column("new_policy", sa.Text),
    )
    entries = sa.table(
        "entries",
        sa.column("fingerprint_id", sa.Integer),
        sa.column("scope", sa.String),
        sa.column("key", sa.Text),
        sa.column("runner", sa.Text),
        sa.column("tactic", sa.Text),
        sa.column("policy", sa.Text),
        sa.column("commit_id", sa.Integer),
    )
    current = {
        (r.fingerprint_id, r.scope, r.key): r
        for r in conn.execute(
            sa.select(
                entries.c.fingerprint_id,
                entries.c.scope,
                entries.c.key,
                entries.c.runner,
                entries.c.tactic,
                entries.c.policy,
                entries.c.commit_id,
            )
        )
    }
    rows = conn.execute(
        sa.select(
            changes.c.id,
            changes.c.commit_id,
            changes.c.fingerprint_id,
            changes.c.scope,
            changes.c.key,
            changes.c.action,
            changes.c.old_runner,
            changes.c.old_tactic,
            changes.c.old_policy,
        ).order_by(changes.c.id.desc())
    ).all()
    following: dict[tuple[int, str, str], object] = {}  # the next change of each entry
    updates = []
    for row in rows:  # newest first
        ident = (row.fingerprint_id, row.scope, row.key)
        if row.action in ("added", "replaced"):
            later = following.get(ident)
            value = None
            if later is not None:
                value = (later.old_runner, later.old_tactic, later.old_policy)
            else:
                entry = current.get(ident)
                if entry is not None and entry.commit_id == row.commit_id:
                    value = (entry.runner, entry.tactic, entry.policy)
            if value is not None and value[0] is not None:
                updates.append(
                    {
                        "b_id": row.id,
                        "b_runner": value[0],
                        "b_tactic": value[1],
                        "b_policy": value[2],
                    }
                )
        following[ident] = row
    if updates:
        conn.execute(
            changes.update()
            .where(changes.c.id == sa.bindparam("b_id"))
            .values(
                new_runner=sa.bindparam("b_runner"),
                new_tactic=sa.bindparam("b_tactic"),
                new_policy=sa.bindparam("b_policy"),
            ),
            updates,
        )


def downgrade() -> None:
    for column in ("new_policy", "new_tactic", "new_runner", "old_tuned_at"):
        op.drop_column("entry_changes", column)
    op.drop_column("entries", "tuned_at")
    op.drop_column("fingerprints", "last_served_at")
