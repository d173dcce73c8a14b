"""ficache 0.1: fingerprints, entries, commits and the entry change log.

Revision ID: 0001_registry
Revises:
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001_registry"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
# Rolling upgrades (ficache.schema): the oldest schema heads whose code reads and writes this
# revision; the first schema.
readable_from: str = "0001_registry"
writable_from: str = "0001_registry"


def lost_on_downgrade(conn: sa.Connection) -> list[str]:
    """What downgrading below this revision (to base) loses: everything stored."""
    count = {t: conn.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar_one() for t in _TABLES}
    return [
        f"{count['entries']} entries, {count['fingerprints']} fingerprints, "
        f"{count['commits']} commits and {count['entry_changes']} change rows"
    ]


_TABLES = ("entries", "fingerprints", "commits", "entry_changes")


def upgrade() -> None:
    op.create_table(
        "fingerprints",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("flashinfer_version", sa.Text(), nullable=False),
        sa.Column("cuda_version", sa.Text(), nullable=False),
        sa.Column("cublas_version", sa.Text(), nullable=False),
        sa.Column("cudnn_version", sa.Text(), nullable=False),
        sa.Column("cudnn_frontend_version", sa.Text(), nullable=False),
        sa.Column("cutlass_dsl_version", sa.Text(), nullable=False),
        sa.Column("gpu", sa.Text(), nullable=False),
        sa.Column("compute_capability", sa.Text(), nullable=False),
        sa.Column("torch_version", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.UniqueConstraint("digest"),
    )
    op.create_table(
        "commits",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("host", sa.Text(), nullable=False),
        sa.Column("user", sa.Text(), nullable=True),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("world_size", sa.Integer(), nullable=True),
        sa.Column("layout", sa.Text(), nullable=True),
        sa.Column("added", sa.Integer(), nullable=False),
        sa.Column("replaced", sa.Integer(), nullable=False),
        sa.Column("removed", sa.Integer(), nullable=False),
        sa.Column("provenance", sa.Text(), nullable=True),
        sa.Column("reverts_commit_id", sa.Integer(), sa.ForeignKey("commits.id"), nullable=True),
    )
    op.create_index("ix_commits_created_at", "commits", ["created_at"])
    op.create_table(
        "entries",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("fingerprint_id", sa.Integer(), sa.ForeignKey("fingerprints.id"), nullable=False),
        sa.Column("scope", sa.String(64), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("op", sa.Text(), nullable=False),
        sa.Column("runner", sa.Text(), nullable=False),
        sa.Column("shapes", sa.Text(), nullable=False),
        sa.Column("extras", sa.Text(), nullable=False),
        sa.Column("tactic", sa.Text(), nullable=False),
        sa.Column("policy", sa.Text(), nullable=True),
        sa.Column("commit_id", sa.Integer(), sa.ForeignKey("commits.id"), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.UniqueConstraint(
            "fingerprint_id", "scope", "key", name="uq_entries_fingerprint_scope_key"
        ),
    )
    op.create_index("ix_entries_op", "entries", ["op"])
    op.create_index("ix_entries_commit_id", "entries", ["commit_id"])
    op.create_table(
        "entry_changes",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("commit_id", sa.Integer(), sa.ForeignKey("commits.id"), nullable=False),
        sa.Column("fingerprint_id", sa.Integer(), sa.ForeignKey("fingerprints.id"), nullable=False),
        sa.Column("scope", sa.String(64), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("action", sa.String(8), nullable=False),
        sa.Column("old_runner", sa.Text(), nullable=True),
        sa.Column("old_tactic", sa.Text(), nullable=True),
        sa.Column("old_policy", sa.Text(), nullable=True),
        sa.Column("old_commit_id", sa.Integer(), nullable=True),
    )
    op.create_index("ix_entry_changes_commit_id", "entry_changes", ["commit_id"])


def downgrade() -> None:
    op.drop_index("ix_entry_changes_commit_id", table_name="entry_changes")
    op.drop_table("entry_changes")
    op.drop_index("ix_entries_commit_id", table_name="entries")
    op.drop_index("ix_entries_op", table_name="entries")
    op.drop_table("entries")
    op.drop_index("ix_commits_created_at", table_name="commits")
    op.drop_table("commits")
    op.drop_table("fingerprints")
