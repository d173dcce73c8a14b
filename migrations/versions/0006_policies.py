"""ficache 0.6: measurement policies stored once; entries lose the columns their key holds.

A 10k-entry import wrote the same policy text 20,000 times (each entry and
its change row) and each key's shapes and extras a second time beside the
key: a third of the bytes every import, merge and startup commit writes
(``benchmarks/import_speed.py``). This revision:

- adds ``policies`` (id, the SHA-256 ``digest`` of the text, unique, and the
  canonical JSON text) holding every policy an entry or a change held;
- replaces ``entries.policy`` with ``policy_id`` and ``entry_changes``'
  ``old_policy``/``new_policy`` with ``old_policy_id``/``new_policy_id``,
  each naming its policy's row (NULL where the text was NULL);
- drops ``entries.shapes`` and ``entries.extras``: readers parse them from
  the key (``flashinfer_format.parse_key``), which every writer checked;
- drops ``ix_entries_commit_id``: the one query that used it (the change
  rows of a commit's added entries) now reads the range of new row ids.

Downgrading puts the texts back, fills shapes and extras from the keys and
recreates the index; every value is kept both ways.

Revision ID: 0006_policies
Revises: 0005_drop_op_index
Create Date: 2026-12-06
"""

import hashlib
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_policies"
down_revision: str | Sequence[str] | None = "0005_drop_op_index"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
# Rolling upgrades (ficache.schema): the oldest schema heads whose code reads and writes this
# revision; replaces and drops columns: code before it can neither read nor write it.
readable_from: str = "0006_policies"
writable_from: str = "0006_policies"

#: (table, text column, id column) of every stored policy.
_POLICY_COLUMNS = (
    ("entries", "policy", "policy_id"),
    ("entry_changes", "old_policy", "old_policy_id"),
    ("entry_changes", "new_policy", "new_policy_id"),
)


def lost_on_downgrade(conn: sa.Connection) -> list[str]:
    """Downgrading keeps every stored value."""
    return []


def upgrade() -> None:
    op.create_table(
        "policies",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("policy", sa.Text(), nullable=False),
        sa.UniqueConstraint("digest"),
    )
    conn = op.get_bind()
    for table, _text_column, id_column in _POLICY_COLUMNS:
        if conn.dialect.name == "sqlite":
            # SQLite adds a nullable column with a REFERENCES clause in place;
            # Alembic would only do it by copying the table (batch mode).
            op.execute(
                f"ALTER TABLE {table} ADD COLUMN {id_column} INTEGER REFERENCES policies (id)"
            )
        else:
            op.add_column(
                table,
                sa.Column(id_column, sa.Integer(), sa.ForeignKey("policies.id"), nullable=True),
            )
    texts: set[str] = set()
    for table, text_column, _id_column in _POLICY_COLUMNS:
        texts.update(
            row[0]
            for row in conn.execute(
                sa.text(
                    f"SELECT DISTINCT {text_column} FROM {table} WHERE {text_column} IS NOT NULL"
                )
            )
        )
    policies = sa.table(
        "policies",
        sa.column("id", sa.Integer),
        sa.column("digest", sa.String),
        sa.column("policy", sa.Text),
    )
    for text in sorted(texts):
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        conn.execute(policies.insert().values(digest=digest, policy=text))
    for table, text_column, id_column in _POLICY_COLUMNS:
        # The policy table is small (a handful of rows): one lookup per row.
        conn.execute(
            sa.text(
                f"UPDATE {table} SET {id_column} = "
                f"(SELECT p.id FROM policies p WHERE p.policy = {table}.{text_column}) "
                f"WHERE {text_column} IS NOT NULL"
            )
        )
    for table, text_column, _id_column in _POLICY_COLUMNS:
        op.drop_column(table, text_column)
    op.drop_column("entries", "shapes")
    op.drop_column("entries", "extras")
    op.drop_index("ix_entries_commit_id", table_name="entries")


def downgrade() -> None:
    from ficache.flashinfer_format import parse_key

    op.create_index("ix_entries_commit_id", "entries", ["commit_id"])
    for table, text_column, _id_column in _POLICY_COLUMNS:
        op.add_column(table, sa.Column(text_column, sa.Text(), nullable=True))
    # NOT NULL as 0001 made them; SQLite adds a NOT NULL column only with a default.
    op.add_column("entries", sa.Column("shapes", sa.Text(), nullable=False, server_default=""))
    op.add_column("entries", sa.Column("extras", sa.Text(), nullable=False, server_default=""))
    conn = op.get_bind()
    for table, text_column, id_column in _POLICY_COLUMNS:
        conn.execute(
            sa.text(
                f"UPDATE {table} SET {text_column} = "
                f"(SELECT p.policy FROM policies p WHERE p.id = {table}.{id_column}) "
                f"WHERE {id_column} IS NOT NULL"
            )
        )
    columns = []
    for entry_id, key in conn.execute(sa.text("SELECT id, key FROM entries")):
        fields = parse_key(key)
        columns.append({"b_id": entry_id, "shapes": fields.shapes_json, "extras": fields.extras})
    if columns:
        conn.execute(
            sa.text("UPDATE entries SET shapes = :shapes, extras = :extras WHERE id = :b_id"),
            columns,
        )
    # A column holding a foreign key: SQLite drops it only by recreating the
    # table (nothing references entries or entry_changes, so that is safe).
    with op.batch_alter_table("entries") as batch:
        batch.drop_column("policy_id")
    with op.batch_alter_table("entry_changes") as batch:
        batch.drop_column("old_policy_id")
        batch.drop_column("new_policy_id")
    op.drop_table("policies")
