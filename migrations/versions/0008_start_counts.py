"""ficache 0.8: how many starts each fingerprint served, and what replay starts missed.

Adds three counters to ``fingerprints`` (integers, 0 for every row stored
before this revision): ``served_starts`` (warm starts that loaded the
fingerprint's entries), ``replay_starts`` (those of them in replay mode) and
``replay_misses`` (the keys those replay starts looked up and did not find,
summed). The served mark (``ficache.usage.mark_served``) increments them in its
one UPDATE. Downgrading drops them: the counts are lost, every entry, record
and commit is kept.

Revision ID: 0008_start_counts
Revises: 0007_compat
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008_start_counts"
down_revision: str | Sequence[str] | None = "0007_compat"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
# Rolling upgrades (ficache.schema): adds columns with defaults only: 0.7 reads them never and
# writes fingerprints without them (the defaults fill them); its marks do not count starts.
readable_from: str = "0007_compat"
writable_from: str = "0007_compat"

COUNTERS = ("served_starts", "replay_starts", "replay_misses")
# Expand, then contract (ficache.schema.features_of): what this revision adds, in words and by
# name. Later code reads a registry without it (the counters as 0) and writes it without them.
adds: str = "start counts"
adds_tables: tuple[str, ...] = ()
adds_columns: dict[str, tuple[str, ...]] = {"fingerprints": COUNTERS}


def lost_on_downgrade(conn: sa.Connection) -> list[str]:
    """What downgrading to 0007 loses: the start counts (entries and records are kept)."""
    counted = conn.execute(
        sa.text("SELECT count(*) FROM fingerprints WHERE served_starts > 0 OR replay_misses > 0")
    ).scalar_one()
    return [f"the start counts of {counted} fingerprints"] if counted else []


def upgrade() -> None:
    # Plain ADD/DROP COLUMN (SQLite 3.35+), not batch mode: see 0002.
    for name in COUNTERS:
        op.add_column(
            "fingerprints",
            sa.Column(name, sa.Integer(), nullable=False, server_default=sa.text("0")),
        )


def downgrade() -> None:
    for name in reversed(COUNTERS):
        op.drop_column("fingerprints", name)
