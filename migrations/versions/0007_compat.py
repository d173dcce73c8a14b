"""ficache 0.7: the registry says which older ficache may still read and write it.

Adds ``schema_compat``: one row naming the registry's revision and the
oldest schema heads whose code can read it (``readable_from``) and write it
(``writable_from``), taken from the revision module's constants of the same
names. ``ficache.schema`` rewrites the row after every upgrade and downgrade,
so it always describes the revision ``alembic_version`` holds. Code that
meets a revision it does not know reads this row to decide whether it may
serve and commit (rolling upgrades); code before this revision cannot, and
refuses any newer schema. Downgrading drops the table and keeps every value.

Revision ID: 0007_compat
Revises: 0006_policies
Create Date: 2026-12-08
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_compat"
down_revision: str | Sequence[str] | None = "0006_policies"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
# Rolling upgrades (ficache.schema): adds a table only, which 0.6 never reads or writes: 0.6's
# code could read and write it, though, predating this table, it refuses any newer revision.
readable_from: str = "0006_policies"
writable_from: str = "0006_policies"


def lost_on_downgrade(conn: sa.Connection) -> list[str]:
    """Downgrading keeps every stored value (the compatibility row describes the schema only)."""
    return []


def upgrade() -> None:
    table = op.create_table(
        "schema_compat",
        sa.Column("revision", sa.String(64), primary_key=True),
        sa.Column("readable_from", sa.String(64), nullable=False),
        sa.Column("writable_from", sa.String(64), nullable=False),
    )
    op.bulk_insert(
        table,
        [{"revision": revision, "readable_from": readable_from, "writable_from": writable_from}],
    )


def downgrade() -> None:
    op.drop_table("schema_compat")
