"""Rank scopes: the names that say which ranks an entry or record is valid on.

A leaf module (no SQLAlchemy, no ficache import) so that the startup
protocol can name scopes on every rank without importing the registry;
``ficache.models`` and ``ficache.values`` re-export these names.

Invariants:
- A scope is ``SHARED_SCOPE`` (``"shared"``) or ``"<layout>/rank<N>"``.
- ``rank_scope`` and ``validate_scope`` raise ``ValueError`` for anything else.
"""

from __future__ import annotations

SHARED_SCOPE = "shared"


def rank_scope(layout: str, rank: int) -> str:
    """The scope of entries valid only on ``rank`` of ``layout`` (``tp4/rank1``)."""
    if not layout or "/" in layout or len(layout) > 40:
        raise ValueError(f"layout must be a short name without '/', got {layout!r}")
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    return f"{layout}/rank{rank}"


def validate_scope(scope: str) -> str:
    """``scope`` itself when it is ``shared`` or ``<layout>/rank<N>``; else ``ValueError``."""
    if scope == SHARED_SCOPE:
        return scope
    layout, sep, rank = scope.partition("/rank")
    if sep and rank.isdigit() and layout:
        return rank_scope(layout, int(rank))
    raise ValueError(f"scope must be 'shared' or '<layout>/rank<N>', got {scope!r}")
