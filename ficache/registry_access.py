"""The part of a registry that the offline machinery uses, as a type.

``RegistryAccess`` is a ``typing.Protocol`` that ``ficache.registry.Registry``
satisfies: its location and engine, its commit log, the check that a plan is
applied to the registry it was made on, and its one ``write``. ``merge``,
``importing``, ``revert`` and ``history`` (and the import helpers of the format
modules) take a registry typed as this, so they never import
``ficache.registry``: the registry's facade methods (``Registry.import_cache``,
``Registry.revert``) call into them without an import cycle.

Invariants:
- It owns no behaviour and holds no state: a registry passed as
  ``RegistryAccess`` is the ``Registry`` itself, never a wrapper.
- Its signatures are ``Registry``'s own: mypy checks every place a
  ``Registry`` is passed as one, so the two cannot drift apart silently.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy import Engine

from ficache.fingerprint import Fingerprint
from ficache.protocol_records import NewProtocolRecord, ProtocolWrite
from ficache.records import NewRecord, RecordWrite
from ficache.schema import Location, SchemaFeatures
from ficache.values import CommitInfo, Expected, NewEntry, WriteResult

if TYPE_CHECKING:
    from ficache.commit_log import LogFilter


class RegistryAccess(Protocol):
    """What ``merge``, ``importing``, ``revert`` and ``history`` need of a ``Registry``."""

    location: Location
    engine: Engine
    #: What the registry's schema revision lacks of this code's head (``Registry.features``).
    features: SchemaFeatures

    def log(
        self,
        limit: int | None = 20,
        *,
        commit_id: int | None = None,
        where: LogFilter | None = None,
    ) -> list[CommitInfo]:
        """The newest commits first, those ``where`` lets through (``Registry.log``)."""
        ...

    def require_planned_on(self, target: str) -> None:
        """Raise ``ValueError`` unless ``target`` names this registry (``Registry.require_planned_on``)."""
        ...

    def write(
        self,
        entries: Iterable[NewEntry],
        *,
        kind: str,
        message: str | None = None,
        world_size: int | None = None,
        layout: str | None = None,
        provenance: dict[str, Any] | None = None,
        removals: Iterable[tuple[Fingerprint, str, str]] = (),
        expected: Expected | None = None,
        keep_existing: bool = False,
        records: RecordWrite | Iterable[NewRecord] = (),
        protocol_records: ProtocolWrite | Iterable[NewProtocolRecord] = (),
        reverts_commit_id: int | None = None,
        once_token: str | None = None,
        token_is_new: bool = False,
    ) -> WriteResult:
        """One commit (``Registry.write``)."""
        ...


__all__ = ["RegistryAccess"]
