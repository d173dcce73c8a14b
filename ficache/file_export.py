"""FlashInfer cache files from the registry: one stored fingerprint's (``Registry.export_text``)
and the one an environment should load (``Registry.export_for``).

This module owns choosing what such a file holds: the stored fingerprints,
the scopes layered (shared, plus one rank's scope when asked) and the
``_metadata`` it names. It does not own rendering the file
(``ficache.flashinfer_format.render_file``: save_configs' own layout and
``_generation``), per-rank slices of a warm start
and their cache (``ficache.slices``), bundles or v2 stores
(``ficache.exporting``), connections or error translation: every function
takes an open ``Connection`` from ``Registry``.

Invariants:
- Read-only: an export never writes to the registry.
- A stored key is exported verbatim; records go out as ``_records``.
- The file is what FlashInfer's ``save_configs`` writes for that content, byte
  for byte, ``_generation`` included (``render_file``).
- ``export_for``'s ``_metadata`` is the environment's own, so FlashInfer
  accepts the file; no stored fingerprint serving it is ``NotFoundError``.
"""

from __future__ import annotations

from sqlalchemy import Connection

from ficache import kind_read, stored_entries, stored_fingerprints
from ficache.errors import NotFoundError
from ficache.fingerprint import Fingerprint
from ficache.flashinfer_format import render_file
from ficache.kinds import RECORD_KIND
from ficache.models import SHARED_SCOPE


def _scopes(scope: str) -> list[str]:
    return [SHARED_SCOPE] if scope == SHARED_SCOPE else [SHARED_SCOPE, scope]


def _render(conn: Connection, current: Fingerprint, ids: list[int], scope: str) -> tuple[str, int]:
    rows = stored_entries.slice_rows(conn, ids, _scopes(scope))
    records = kind_read.slice_values(conn, RECORD_KIND, ids, _scopes(scope))
    return render_file(current.flashinfer_metadata(), rows.values(), records), len(rows)


def export_text(conn: Connection, fingerprint_id: int, scope: str) -> tuple[str, int]:
    """The FlashInfer cache file of one stored fingerprint's entries, and its size."""
    info = stored_fingerprints.fingerprint(conn, fingerprint_id)
    return _render(conn, info.fingerprint, [info.id], scope)


def export_for(conn: Connection, current: Fingerprint, scope: str) -> tuple[str, int]:
    """The cache file the environment ``current`` should load, from every stored fingerprint
    that serves it, and its size."""
    infos = stored_fingerprints.serving(conn, current)
    if not infos:
        raise NotFoundError(
            "no stored fingerprint serves the current environment; "
            "see `ficache fingerprints` and `ficache fingerprint`"
        )
    return _render(conn, current, [i.id for i in infos], scope)
