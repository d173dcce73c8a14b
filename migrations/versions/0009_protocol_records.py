"""ficache 0.9: FlashInfer 0.7.4's protocol records, a kind of stored result of their own.

Adds ``protocol_records`` (one row per fingerprint, scope, namespace and key:
the value as canonical JSON and the measurement policy its v2 entry file
carried, by ``policies`` id) and ``protocol_record_changes`` (what each
commit did to each of them), and to ``commits`` the counts of their changes
(``protocol_added``, ``protocol_replaced``, ``protocol_removed``; 0 for every
earlier commit). Tables apart from ``records``: a protocol record and a v1
``_records`` record never share a row, even under one namespace and key.
Downgrading drops the protocol records, their history and the commits that
changed nothing else.

Revision ID: 0009_protocol_records
Revises: 0008_start_counts
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009_protocol_records"
down_revision: str | Sequence[str] | None = "0008_start_counts"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
# Rolling upgrades (ficache.schema): adds tables and defaulted columns only: 0.8 reads it;
# its prune and revert would ignore protocol records, so it does not write it.
readable_from: str = "0008_start_counts"
writable_from: str = "0009_protocol_records"

_COUNTS = ("protocol_added", "protocol_replaced", "protocol_removed")
# Expand, then contract (ficache.schema.features_of): what this revision adds, in words and by
# name. Later code reads a registry without it (no protocol records, counts 0) and commits to
# it what it can hold, skipping protocol records with a warning.
adds: str = "protocol records"
adds_tables: tuple[str, ...] = ("protocol_records", "protocol_record_changes")
adds_columns: dict[str, tuple[str, ...]] = {"commits": _COUNTS}
#: A commit that changed no entry and no record (only protocol records, or nothing).
_ONLY_PROTOCOL = (
    "added = 0 AND replaced = 0 AND removed = 0 "
    "AND records_added = 0 AND records_replaced = 0 AND records_removed = 0 "
    "AND id NOT IN (SELECT commit_id FROM entries) "
    "AND id NOT IN (SELECT commit_id FROM entry_changes) "
    "AND id NOT IN (SELECT commit_id FROM records) "
    "AND id NOT IN (SELECT commit_id FROM record_changes)"
)


def lost_on_downgrade(conn: sa.Connection) -> list[str]:
    """What downgrading to 0008 loses: the protocol records, their history, their commits."""
    rows = conn.execute(sa.text("SELECT count(*) FROM protocol_records")).scalar_one()
    changes = conn.execute(sa.text("SELECT count(*) FROM protocol_record_changes")).scalar_one()
    if not (rows or changes):
        return []
    commits = conn.execute(
        sa.text(f"SELECT count(*) FROM commits WHERE {_ONLY_PROTOCOL}")
    ).scalar_one()
    return [
        f"{rows} protocol records, {changes} protocol record change rows and {commits} commits "
        "that changed only protocol records"
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
        "protocol_records",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("fingerprint_id", sa.Integer(), sa.ForeignKey("fingerprints.id"), nullable=False),
        sa.Column("scope", sa.String(64), nullable=False),
        sa.Column("namespace", sa.Text(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.Column("policy_id", sa.Integer(), sa.ForeignKey("policies.id"), nullable=True),
        sa.Column("commit_id", sa.Integer(), sa.ForeignKey("commits.id"), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("tuned_at", sa.Float(), nullable=False),
        sa.UniqueConstraint(
            "fingerprint_id",
            "scope",
            "namespace",
            "key",
            name="uq_protocol_records_fingerprint_scope_namespace_key",
        ),
    )
    op.create_index("ix_protocol_records_commit_id", "protocol_records", ["commit_id"])
    op.create_table(
        "protocol_record_changes",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("commit_id", sa.Integer(), sa.ForeignKey("commits.id"), nullable=False),
        sa.Column("fingerprint_id", sa.Integer(), sa.ForeignKey("fingerprints.id"), nullable=False),
        sa.Column("scope", sa.String(64), nullable=False),
        sa.Column("namespace", sa.Text(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("action", sa.String(8), nullable=False),
        sa.Column("old_value", sa.Text(), nullable=True),
        sa.Column("old_policy_id", sa.Integer(), sa.ForeignKey("policies.id"), nullable=True),
        sa.Column("old_commit_id", sa.Integer(), nullable=True),
        sa.Column("old_tuned_at", sa.Float(), nullable=True),
        sa.Column("new_value", sa.Text(), nullable=True),
        sa.Column("new_policy_id", sa.Integer(), sa.ForeignKey("policies.id"), nullable=True),
    )
    op.create_index(
        "ix_protocol_record_changes_commit_id", "protocol_record_changes", ["commit_id"]
    )


def downgrade() -> None:
    # The commits that changed only protocol records go with them. Their ids are read
    # first (the tables naming them are dropped before them), and deleted newest first:
    # a revert (always newer) of one of them changed only protocol records too.
    conn = op.get_bind()
    doomed = [
        int(row[0])
        for row in conn.execute(
            sa.text(
                f"SELECT id FROM commits WHERE {_ONLY_PROTOCOL} "
                "AND id IN (SELECT commit_id FROM protocol_record_changes) ORDER BY id DESC"
            )
        )
    ]
    op.drop_index("ix_protocol_record_changes_commit_id", table_name="protocol_record_changes")
    op.drop_table("protocol_record_changes")
    op.drop_index("ix_protocol_records_commit_id", table_name="protocol_records")
    op.drop_table("protocol_records")
    for commit_id in doomed:
        conn.execute(sa.text("DELETE FROM commits WHERE id = :id"), {"id": commit_id})
    for column in reversed(_COUNTS):
        op.drop_column("commits", column)
