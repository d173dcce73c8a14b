"""SQLAlchemy 2.x models of the registry.

Tables:
- ``fingerprints``: one row per environment (``Fingerprint`` fields), unique
  by ``digest``. ``measurement`` (from ``0010_measurement_fingerprints``) is
  the FlashInfer v2 measurement policy the environment's entries were tuned
  under (canonical JSON of its ``measure_*`` manifest fields; NULL: the
  default policy, and every row written before it): two rows may hold the
  same other fields under two policies, each with its own digest.
- ``entries``: the current tactic of one FlashInfer ``file_key`` under one
  fingerprint and one rank scope. ``key`` is FlashInfer's string, verbatim;
  ``op`` and ``runner`` are read from it for queries (its shapes and extras
  are read from it when shown: ``flashinfer_format.parse_key``). ``tactic``
  is canonical JSON text; ``policy_id`` names the entry's measurement policy
  in ``policies`` (NULL: none). ``selection`` is how
  FlashInfer (0.7.4+) chose the winner (a cache value's fourth element, a
  JSON object such as ``{"time_ms", "runner_up_ms", "margin",
  "candidates"}``) as canonical JSON text, NULL when the value had none.
- ``policies``: every measurement policy (a cache value's third element) an
  entry or a change holds, once: canonical JSON text, unique by its SHA-256
  ``digest`` (a hash, not the text, is indexed: PostgreSQL's b-tree refuses
  long keys). A registry holds a handful of policies and tens of thousands
  of entries, so each row stores a small id instead of the text
  (``ficache.policies``). Rows are only ever added: a policy row is never
  changed or deleted, so any id a change row keeps stays valid.
- ``commits``: one row per write, with its provenance and counts.
- ``entry_changes``: what each commit did to each entry (added, replaced,
  removed) with the value it replaced and the value it wrote (their
  policies by id, as ``entries`` holds them), so every
  commit can be shown and reverted and nothing stored is lost silently.
- ``records``: FlashInfer's namespaced records (a cache file's ``_records``:
  ``{namespace: {record key: JSON value}}``), one row per (fingerprint,
  scope, namespace, record key); ``value`` is canonical JSON text
  (``flashinfer_format.record_value_json``). ``record_changes`` is their
  change log, as ``entry_changes`` is the entries' (``ficache.records``).
- ``protocol_records`` (from ``0009_protocol_records``): FlashInfer 0.7.4's
  protocol records (``publish_protocol_record(namespace, key, value)``,
  persisted by FlashInfer only in a v2 store, as entries keyed
  ``('__protocol__', namespace, key)``), one row per (fingerprint, scope,
  namespace, key): ``value`` canonical JSON text, ``policy_id`` the entry
  file's measurement policy (NULL: none, what FlashInfer writes today).
  A table of their own: they never share a row, a namespace or a change log
  with ``records`` (FlashInfer's v1 ``_records``). ``protocol_record_changes``
  is their change log; ``commits.protocol_added``/``protocol_replaced``/
  ``protocol_removed`` count them.
- ``schema_compat`` (from ``0007_compat``): one row naming the registry's
  revision and the oldest ficache schema heads that can still read it
  (``readable_from``) and write it (``writable_from``), so code older than
  the schema can tell whether it may serve and commit (``ficache.schema``).

Invariants:
- ``(fingerprint_id, scope, namespace, key)`` is unique in ``records``.
- A commit's ``added``/``replaced``/``removed`` count its entry changes,
  ``records_added``/``records_replaced``/``records_removed`` its record
  changes; every commit has at least one change of either kind.
- Every ``entries`` (``records``) row names the commit that wrote its
  current value, and that commit has an ``entry_changes``
  (``record_changes``) row for it.
- ``scope`` is ``"shared"`` (valid on every rank) or ``"<layout>/rank<N>"``.
- ``(fingerprint_id, scope, key)`` is unique in ``entries``, ``digest`` in
  ``policies``; every policy id an entry or a change holds names a
  ``policies`` row (foreign keys), so one policy text has exactly one id
  and two values have the same policy exactly when their ids are equal.
- Times are UNIX seconds (UTC) as floats: cheap to write in bulk, simple to
  compare for pruning by age. ``entries.updated_at`` is when this registry
  last wrote the row; ``entries.tuned_at`` is when the value was tuned, and
  travels with it through merges and bundles (the ``newest`` merge policy
  compares it). ``fingerprints.last_served_at`` is when a warm start last
  served the fingerprint (``prune --unused-for``); NULL means never.
  ``served_starts``, ``replay_starts`` and ``replay_misses`` (from
  ``0008_start_counts``) count the starts that served it, those in replay
  mode, and the keys those replay starts missed (``ficache.usage``).
- ``selection`` is not part of an entry's value: two values are the same
  when their (runner, tactic, policy) are, whatever their selections. It
  travels with the value as ``tuned_at`` does: written when the value is
  written, kept when an equal value arrives, replaced with the value, kept
  as ``old_selection`` / ``new_selection`` in ``entry_changes``.
- The schema is owned by Alembic (``migrations/``); a test checks these
  models and the migrations do not drift.
"""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import (
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Table,
    Text,
    UniqueConstraint,
    func,
    select,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from ficache.scopes import SHARED_SCOPE as SHARED_SCOPE  # re-exported


class Base(DeclarativeBase):
    pass


class FingerprintRow(Base):
    __tablename__ = "fingerprints"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    digest: Mapped[str] = mapped_column(String(64), unique=True, nullable=False)
    flashinfer_version: Mapped[str] = mapped_column(Text, nullable=False)
    cuda_version: Mapped[str] = mapped_column(Text, nullable=False)
    cublas_version: Mapped[str] = mapped_column(Text, nullable=False)
    cudnn_version: Mapped[str] = mapped_column(Text, nullable=False)
    cudnn_frontend_version: Mapped[str] = mapped_column(Text, nullable=False)
    cutlass_dsl_version: Mapped[str] = mapped_column(Text, nullable=False)
    gpu: Mapped[str] = mapped_column(Text, nullable=False)
    compute_capability: Mapped[str] = mapped_column(Text, nullable=False)
    torch_version: Mapped[str] = mapped_column(Text, nullable=False)
    created_at: Mapped[float] = mapped_column(Float, nullable=False)
    last_served_at: Mapped[float | None] = mapped_column(Float)
    # From 0008_start_counts: incremented by the served mark (``ficache.usage``).
    served_starts: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    replay_starts: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    replay_misses: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    # From 0010_measurement_fingerprints: ``Fingerprint.measurement``, NULL for the default.
    measurement: Mapped[str | None] = mapped_column(Text)


class PolicyRow(Base):
    __tablename__ = "policies"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    digest: Mapped[str] = mapped_column(String(64), unique=True, nullable=False)  # sha256 hex
    policy: Mapped[str] = mapped_column(Text, nullable=False)  # canonical JSON list


class SchemaCompatRow(Base):
    __tablename__ = "schema_compat"

    revision: Mapped[str] = mapped_column(String(64), primary_key=True)
    readable_from: Mapped[str] = mapped_column(String(64), nullable=False)
    writable_from: Mapped[str] = mapped_column(String(64), nullable=False)


class CommitRow(Base):
    __tablename__ = "commits"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    created_at: Mapped[float] = mapped_column(Float, nullable=False)
    kind: Mapped[str] = mapped_column(String(16), nullable=False)
    host: Mapped[str] = mapped_column(Text, nullable=False)
    user: Mapped[str | None] = mapped_column(Text)
    message: Mapped[str | None] = mapped_column(Text)
    world_size: Mapped[int | None] = mapped_column(Integer)
    layout: Mapped[str | None] = mapped_column(Text)
    added: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    replaced: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    removed: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    provenance: Mapped[str | None] = mapped_column(Text)  # JSON object
    reverts_commit_id: Mapped[int | None] = mapped_column(ForeignKey("commits.id"))
    records_added: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    records_replaced: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    records_removed: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    # From 0009_protocol_records: the commit's protocol record changes per action.
    protocol_added: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    protocol_replaced: Mapped[int] = mapped_column(
        Integer, nullable=False, server_default=text("0")
    )
    protocol_removed: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))

    __table_args__ = (Index("ix_commits_created_at", "created_at"),)


class EntryRow(Base):
    __tablename__ = "entries"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    fingerprint_id: Mapped[int] = mapped_column(ForeignKey("fingerprints.id"), nullable=False)
    scope: Mapped[str] = mapped_column(String(64), nullable=False)
    key: Mapped[str] = mapped_column(Text, nullable=False)
    op: Mapped[str] = mapped_column(Text, nullable=False)
    runner: Mapped[str] = mapped_column(Text, nullable=False)
    tactic: Mapped[str] = mapped_column(Text, nullable=False)  # canonical JSON
    policy_id: Mapped[int | None] = mapped_column(ForeignKey("policies.id"))
    commit_id: Mapped[int] = mapped_column(ForeignKey("commits.id"), nullable=False)
    updated_at: Mapped[float] = mapped_column(Float, nullable=False)
    tuned_at: Mapped[float | None] = mapped_column(Float)  # NULL only before 0002's backfill
    selection: Mapped[str | None] = mapped_column(Text)  # canonical JSON object, or NULL

    __table_args__ = (
        UniqueConstraint("fingerprint_id", "scope", "key", name="uq_entries_fingerprint_scope_key"),
    )


class EntryChangeRow(Base):
    __tablename__ = "entry_changes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    commit_id: Mapped[int] = mapped_column(ForeignKey("commits.id"), nullable=False)
    fingerprint_id: Mapped[int] = mapped_column(ForeignKey("fingerprints.id"), nullable=False)
    scope: Mapped[str] = mapped_column(String(64), nullable=False)
    key: Mapped[str] = mapped_column(Text, nullable=False)
    action: Mapped[str] = mapped_column(String(8), nullable=False)  # added/replaced/removed
    old_runner: Mapped[str | None] = mapped_column(Text)
    old_tactic: Mapped[str | None] = mapped_column(Text)
    old_policy_id: Mapped[int | None] = mapped_column(ForeignKey("policies.id"))
    old_commit_id: Mapped[int | None] = mapped_column(Integer)
    old_tuned_at: Mapped[float | None] = mapped_column(Float)
    # The value the commit wrote (added, replaced); NULL for removed.
    new_runner: Mapped[str | None] = mapped_column(Text)
    new_tactic: Mapped[str | None] = mapped_column(Text)
    new_policy_id: Mapped[int | None] = mapped_column(ForeignKey("policies.id"))
    # How FlashInfer chose the old and the new value (canonical JSON object; NULL: none).
    old_selection: Mapped[str | None] = mapped_column(Text)
    new_selection: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (Index("ix_entry_changes_commit_id", "commit_id"),)


class RecordRow(Base):
    __tablename__ = "records"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    fingerprint_id: Mapped[int] = mapped_column(ForeignKey("fingerprints.id"), nullable=False)
    scope: Mapped[str] = mapped_column(String(64), nullable=False)
    namespace: Mapped[str] = mapped_column(Text, nullable=False)
    key: Mapped[str] = mapped_column(Text, nullable=False)
    value: Mapped[str] = mapped_column(Text, nullable=False)  # canonical JSON
    commit_id: Mapped[int] = mapped_column(ForeignKey("commits.id"), nullable=False)
    updated_at: Mapped[float] = mapped_column(Float, nullable=False)
    tuned_at: Mapped[float] = mapped_column(Float, nullable=False)

    __table_args__ = (
        UniqueConstraint(
            "fingerprint_id",
            "scope",
            "namespace",
            "key",
            name="uq_records_fingerprint_scope_namespace_key",
        ),
        Index("ix_records_commit_id", "commit_id"),
    )


class RecordChangeRow(Base):
    __tablename__ = "record_changes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    commit_id: Mapped[int] = mapped_column(ForeignKey("commits.id"), nullable=False)
    fingerprint_id: Mapped[int] = mapped_column(ForeignKey("fingerprints.id"), nullable=False)
    scope: Mapped[str] = mapped_column(String(64), nullable=False)
    namespace: Mapped[str] = mapped_column(Text, nullable=False)
    key: Mapped[str] = mapped_column(Text, nullable=False)
    action: Mapped[str] = mapped_column(String(8), nullable=False)  # added/replaced/removed
    old_value: Mapped[str | None] = mapped_column(Text)
    old_commit_id: Mapped[int | None] = mapped_column(Integer)
    old_tuned_at: Mapped[float | None] = mapped_column(Float)
    new_value: Mapped[str | None] = mapped_column(Text)  # NULL for removed

    __table_args__ = (Index("ix_record_changes_commit_id", "commit_id"),)


class ProtocolRecordRow(Base):
    """One FlashInfer 0.7.4 protocol record (``ficache.protocol_records``)."""

    __tablename__ = "protocol_records"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    fingerprint_id: Mapped[int] = mapped_column(ForeignKey("fingerprints.id"), nullable=False)
    scope: Mapped[str] = mapped_column(String(64), nullable=False)
    namespace: Mapped[str] = mapped_column(Text, nullable=False)
    key: Mapped[str] = mapped_column(Text, nullable=False)
    value: Mapped[str] = mapped_column(Text, nullable=False)  # canonical JSON
    policy_id: Mapped[int | None] = mapped_column(ForeignKey("policies.id"))
    commit_id: Mapped[int] = mapped_column(ForeignKey("commits.id"), nullable=False)
    updated_at: Mapped[float] = mapped_column(Float, nullable=False)
    tuned_at: Mapped[float] = mapped_column(Float, nullable=False)

    __table_args__ = (
        UniqueConstraint(
            "fingerprint_id",
            "scope",
            "namespace",
            "key",
            name="uq_protocol_records_fingerprint_scope_namespace_key",
        ),
        Index("ix_protocol_records_commit_id", "commit_id"),
    )


class ProtocolRecordChangeRow(Base):
    __tablename__ = "protocol_record_changes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    commit_id: Mapped[int] = mapped_column(ForeignKey("commits.id"), nullable=False)
    fingerprint_id: Mapped[int] = mapped_column(ForeignKey("fingerprints.id"), nullable=False)
    scope: Mapped[str] = mapped_column(String(64), nullable=False)
    namespace: Mapped[str] = mapped_column(Text, nullable=False)
    key: Mapped[str] = mapped_column(Text, nullable=False)
    action: Mapped[str] = mapped_column(String(8), nullable=False)  # added/replaced/removed
    old_value: Mapped[str | None] = mapped_column(Text)
    old_policy_id: Mapped[int | None] = mapped_column(ForeignKey("policies.id"))
    old_commit_id: Mapped[int | None] = mapped_column(Integer)
    old_tuned_at: Mapped[float | None] = mapped_column(Float)
    new_value: Mapped[str | None] = mapped_column(Text)  # NULL for removed
    new_policy_id: Mapped[int | None] = mapped_column(ForeignKey("policies.id"))

    __table_args__ = (Index("ix_protocol_record_changes_commit_id", "commit_id"),)


# The tables as SQLAlchemy Core objects, for the bulk queries of the modules
# that read and write many rows at once (registry, merge, history, verify, records).
FINGERPRINTS = cast(Table, FingerprintRow.__table__)
POLICIES = cast(Table, PolicyRow.__table__)
ENTRIES = cast(Table, EntryRow.__table__)
COMMITS = cast(Table, CommitRow.__table__)
ENTRY_CHANGES = cast(Table, EntryChangeRow.__table__)
RECORDS = cast(Table, RecordRow.__table__)
RECORD_CHANGES = cast(Table, RecordChangeRow.__table__)
PROTOCOL_RECORDS = cast(Table, ProtocolRecordRow.__table__)
PROTOCOL_RECORD_CHANGES = cast(Table, ProtocolRecordChangeRow.__table__)


def policy_text(policy_id: Any) -> Any:
    """The canonical JSON of the policy ``policy_id`` names (a column of the
    enclosing query), as a correlated scalar subquery: NULL for NULL.

    Readers select it where they used to select a policy column, so rows
    keep their shape: ``policy_text(ENTRIES.c.policy_id).label("policy")``.
    """
    return select(POLICIES.c.policy).where(POLICIES.c.id == policy_id).scalar_subquery()


#: An entry's policy, and a change's old and new policies, as canonical JSON text.
ENTRY_POLICY = policy_text(ENTRIES.c.policy_id).label("policy")
OLD_POLICY = policy_text(ENTRY_CHANGES.c.old_policy_id).label("old_policy")
NEW_POLICY = policy_text(ENTRY_CHANGES.c.new_policy_id).label("new_policy")

#: An entry's identity and value with when it was tuned and how it was chosen,
#: as bundles and merges copy it: ``(fingerprint_id, scope, key, runner,
#: tactic, policy, tuned_at, selection)`` (``tuned_at`` falls back to
#: ``updated_at`` for rows from before 0002; ``selection`` may be NULL).
ENTRY_VALUE_COLUMNS = (
    ENTRIES.c.fingerprint_id,
    ENTRIES.c.scope,
    ENTRIES.c.key,
    ENTRIES.c.runner,
    ENTRIES.c.tactic,
    ENTRY_POLICY,
    func.coalesce(ENTRIES.c.tuned_at, ENTRIES.c.updated_at),
    ENTRIES.c.selection,
)
