"""One warm start on a real gloo rank, reporting which heavy modules the rank imported.

Run through ``ficache._ranks.run_ranks`` (fresh, spawned processes). The module
itself imports nothing of ficache at the top, so what the rank holds in
``sys.modules`` afterwards is what the start and the stand-in tuning loop brought.
"""

from __future__ import annotations

import sys
from typing import Any

#: Modules a start should not need on a rank that does not read the registry.
HEAVY = ("sqlalchemy", "alembic", "ficache.registry", "ficache.schema", "ficache.models")


def start_and_list_modules(rank: int, world: int, db: str) -> dict[str, Any]:
    """A warm start around the stand-in loop; its report and the heavy modules now loaded."""
    from ficache.standin import standin_tune
    from ficache.sync import warm_start

    with warm_start(None, db=db, timeout=60.0) as ws:
        standin_tune()
    return {
        "report": ws.report.as_json(),
        "heavy": [name for name in HEAVY if name in sys.modules],
    }
