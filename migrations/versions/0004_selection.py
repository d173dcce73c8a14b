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


def upgrade() -> None:
    # Plain ADD/DROP COLUMN (SQLite 3.35+), not batch mode: see 0002.
    op.add_column("entries", sa.Column("selection", sa.Text(), nullable=True))
    op.add_column("entry_changes", sa.Column("old_selection", sa.Text(), nullable=True))
    op.add_column("entry_changes", sa.Column("new_selection", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("entry_changes", "new_selection")
    op.drop_column("entry_changes", "old_selection")
    op.drop_column("entries", "selection")
