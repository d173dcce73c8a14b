"""A real SQLite registry damaged as a bad disk or a bad copy leaves it (tests only).

``damage_history(path)`` fills the registry with entries of a fingerprint no
test serves (so its change log spans many pages), then overwrites the cell
pointers of two leaf pages in the middle of ``entry_changes``: SQLite's
``PRAGMA quick_check`` reports the file malformed, while reading entries and
appending a commit touch none of those pages, so a write would go through
unless it asks first.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

from ficache.fingerprint import Fingerprint
from ficache.registry import Registry
from ficache.values import NewEntry

#: A fingerprint no environment has (its entries only fill pages).
FILLER = Fingerprint("0.0.0", "0", "0", "0", "0", "0", "filler GPU")


def damage_history(path: Path, *, filler: int = 400) -> None:
    """Damage the registry file at ``path`` (a SQLite registry; see the module docstring)."""
    with Registry.open(str(path)) as reg:
        reg.write(
            [
                NewEntry(FILLER, f"('mm', 'Runner', (({m}, 64),), (torch.bfloat16,))", "R", str(m))
                for m in range(filler)
            ],
            kind="import",
            message="filler",
        )
    with closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        leaves = [
            page
            for (page,) in conn.execute(
                "SELECT pageno FROM dbstat WHERE name = 'entry_changes' AND pagetype = 'leaf' "
                "ORDER BY pageno"
            )
        ]
    assert len(leaves) >= 4, f"entry_changes spans {len(leaves)} leaf pages; add filler"
    with path.open("r+b") as handle:
        for page in leaves[1:3]:
            handle.seek((page - 1) * page_size + 8)  # past the leaf page's header
            handle.write(b"\xff" * 64)  # its first cell pointers, now out of range
    with closing(sqlite3.connect(path)) as conn:
        [(check,)] = conn.execute("PRAGMA quick_check(1)").fetchall()
    assert check != "ok", "the damage went unseen"
