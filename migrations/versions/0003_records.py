"""ficache 0.3: FlashInfer's namespaced records and their change log.

Adds ``records`` (one row per fingerprint, scope, namespace and record key,
the value as canonical JSON) and ``record_changes`` (what each commit did to
each record), and to ``commits`` the counts of record changes
(``records_added``, ``records_replaced``, ``records_removed``; 0 for every
earlier commit). Downgrading drops the records and their history.

Revision ID: 0003_records
Revises: 0002_fleet
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_records"
down_revision: str | Sequence[str] | None = "0002_fleet"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
# Rolling upgrades (ficache.schema): the oldest schema heads whose code reads and writes this
# revision; adds tables and defaulted columns only: 0.2 reads it; its prune and revert would
# ignore records.
readable_from: str = "0002_fleet"
writable_from: str = "0003_records"

_COUNTS = ("records_added", "records_replaced", "records_removed")


def lost_on_downgrade(conn: sa.Connection) -> list[str]:
    """What downgrading to 0002 loses: the records, their history, records-only commits."""
    records = conn.execute(sa.text("SELECT count(*) FROM records")).scalar_one()
    changes = conn.execute(sa.text("SELECT count(*) FROM record_changes")).scalar_one()
    commits = conn.execute(
        sa.text(
            "SELECT count(*) FROM commits WHERE added = 0 AND replaced = 0 AND removed = 0 "
            "AND id NOT IN (SELECT commit_id FROM entries) "
            "AND id NOT IN (SELECT commit_id FROM entry_changes)"
        )
    ).scalar_one()
    if not (records or changes or commits):
        return []
    return [
        f"{records} records, {changes} record change rows and {commits} commits "
        "that changed only records"
    ]


def upgrade() -> None:
    # Plain ADD COLUMN (see 0002): a batch would recreate ``commits``, which
    # other tables reference.
    for column in _COUNTS:
        op.add_column(
            "commits",
            sa.Column(column, sa.Integer(), nullable=False, server_default=sa.text("0")),
        )
    op.create_table(
        "records",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("fingerprint_id", sa.Integer(), sa.ForeignKey("fingerprints.id"), nullable=False),
        sa.Column("scope", sa.String(64), nullable=False),
        sa.Column("namespace", sa.Text(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.Column("commit_id", sa.Integer(), sa.ForeignKey("commits.id"), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("tuned_at", sa.Float(), nullable=False),
        sa.UniqueConstraint(
            "fingerprint_id",
            "scope",
            "namespace",
            "key",
            name="uq_records_fingerprint_scope_namespace_key",
        ),
    )
    op.create_index("ix_records_commit_id", "records", ["commit_id"])
    op.create_table(
        "record_changes",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("commit_id", sa.Integer(), sa.ForeignKey("commits.id"), nullable=False),
        sa.Column("fingerprint_id", sa.Integer(), sa.ForeignKey("fingerprints.id"), nullable=False),
        sa.Column("scope", sa.String(64), nullable=False),
        sa.Column("namespace", sa.Text(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("action", sa.String(8), nullable=False),
        sa.Column("old_value", sa.Text(), nullable=True),
        sa.Column("old_commit_id", sa.Integer(), nullable=True),
        sa.Column("old_tuned_at", sa.Float(), nullable=True),
        sa.Column("new_value", sa.Text(), nullable=True),
    )
    op.create_index("ix_record_changes_commit_id", "record_changes", ["commit_id"])


def downgrade() -> None:
    op.drop_index("ix_record_changes_commit_id", table_name="record_changes")
    op.drop_table("record_changes")
    op.drop_index("ix_records_commit_id", table_name="records")
    op.drop_table("records")
    # A commit that changed only records has no entry changes left: drop it,
    # and first what refers to it (a revert of it, which changed only records too).
    op.execute(
        "DELETE FROM commits WHERE added = 0 AND replaced = 0 AND removed = 0 "
        "AND id NOT IN (SELECT commit_id FROM entries) "
        "AND id NOT IN (SELECT commit_id FROM entry_changes) "
        "AND reverts_commit_id IS NOT NULL"
    )
    op.execute(
        "DELETE FROM commits WHERE added = 0 AND replaced = 0 AND removed = 0 "
        "AND id NOT IN (SELECT commit_id FROM entries) "
        "AND id NOT IN (SELECT commit_id FROM entry_changes) "
        "AND id NOT IN (SELECT reverts_commit_id FROM commits WHERE reverts_commit_id IS NOT NULL)"
    )
    for column in reversed(_COUNTS):
        op.drop_column("commits", column)
