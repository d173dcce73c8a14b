"""ficache 0.4: how FlashInfer chose each value (a cache value's fourth element).

FlashInfer 0.7.4 saves a value as ``[runner, tactic, policy, selection]``
when real tuning chose it; ``selection`` is a JSON object (``time_ms``,
``runner_up_ms``, ``margin``, ``candidates``). Adds ``entries.selection``
and, to ``entry_changes``, ``old_selection`` and ``new_selection`` (canonical
JSON text; NULL for every value stored before this revision, which had
none). Downgrading drops them: values keep their runner, tactic and policy,
which is all FlashInfer 0.7.2 reads.

Revision ID: 0004_selection
Revises: 0003_records
Create Date: 2026-12-04
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_selection"
down_revision: str | Sequence[str] | None = "0003_records"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
# Rolling upgrades (ficache.schema): the oldest schema heads whose code reads and writes this
# revision; adds nullable columns only: 0.3 reads it; its writes would keep a replaced value's
# selection.
readable_from: str = "0003_records"
writable_from: str = "0004_selection"


def lost_on_downgrade(conn: sa.Connection) -> list[str]:
    """What downgrading to 0003 loses: every selection (values keep runner, tactic, policy)."""
    entries = conn.execute(
        sa.text("SELECT count(*) FROM entries WHERE selection IS NOT NULL")
    ).scalar_one()
    changes = conn.execute(
        sa.text(
            "SELECT count(*) FROM entry_changes "
            "WHERE old_selection IS NOT NULL OR new_selection IS NOT NULL"
        )
    ).scalar_one()
    if not (entries or changes):
        return []
    return [f"the selections of {entries} entries and {changes} change rows"]


def upgrade() -> None:
    # Plain ADD/DROP COLUMN (SQLite 3.35+), not batch mode: see 0002.
    op.add_column("entries", sa.Column("selection", sa.Text(), nullable=True))
    op.add_column("entry_changes", sa.Column("old_selection", sa.Text(), nullable=True))
    op.add_column("entry_changes", sa.Column("new_selection", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("entry_changes", "new_selection")
    op.drop_column("entry_changes", "old_selection")
    op.drop_column("entries", "selection")
