"""ficache 0.5: entries lose their index on op, which cost every write and served no read.

Every import, merge and startup commit inserted each entry into
``ix_entries_op`` too: one more b-tree insert per entry, 6% of the pages a
10k-entry import writes and 5-10% of its time (``benchmarks/import_speed.py``,
measured side by side with and without it). Nothing needs it: a
registry holds a handful of ops, so the index could not narrow a lookup by
op much, and the reads that name an op (``ficache list --op``, ``stats``)
also read the entries of one fingerprint or all of them. Downgrading
creates it again.

Revision ID: 0005_drop_op_index
Revises: 0004_selection
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_drop_op_index"
down_revision: str | Sequence[str] | None = "0004_selection"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
# Rolling upgrades (ficache.schema): the oldest schema heads whose code reads and writes this
# revision; drops an index no query needs: 0.4 reads and writes it.
readable_from: str = "0004_selection"
writable_from: str = "0004_selection"


def lost_on_downgrade(conn: sa.Connection) -> list[str]:
    """Downgrading keeps every stored value."""
    return []


def upgrade() -> None:
    op.drop_index("ix_entries_op", table_name="entries")


def downgrade() -> None:
    op.create_index("ix_entries_op", "entries", ["op"])
