"""Merge machinery written once for every kind of stored result: policies, plans, reconciling.

A kind (entries, namespaced records, and the kinds to come) is described
once, by ``ficache.kinds.Kind`` (tables, identity and value columns, change
rows); a ``MergeKind`` adds what merging needs besides: the type of a
writer's item (read through the description's item fields: ``split`` gives
fingerprint, scope and key, ``value`` the value compared), the group a plan
counts an identity in, and the conflict object its plans report. Everything a merge or an import
decides is decided here, the same way for every kind:

- ``resolve``: the winner of one conflict under a policy (``ficache.merge``'s
  module docstring says what each policy does);
- ``plan_kind``: a merge plan of one kind against a registry: candidates per
  identity in source order, the registry's current values and (for ``drop``)
  its tombstones, then one decision per identity;
- ``reconcile``: an import's own inputs reconciled under a policy, with no
  target (``ficache.importing``).

It owns the decisions and the reads they need, never a write: plans are
executed by ``ficache.merge`` and ``ficache.importing`` through
``Registry.write``. It knows no kind by name: ``ficache.merge`` describes the
entries and the records.

Invariants:
- A key held by one source (or several, with one value) that the registry
  does not hold is added; one the registry holds with that value is
  identical; anything else is a conflict, resolved by ``resolve`` and
  reported with its resolution. Within one source a later duplicate wins.
- Tombstones are read for the candidates only: an absent identity whose
  latest change is a merge's removal, with the value it removed (so
  ``drop`` stays idempotent). Identities no source holds are never kept.
- Every written or removed identity is paired in ``expected`` with the
  commit that holds it when planned (None: absent), which the write checks
  under its lock.
- Candidate collection is the bulk hot path (one lookup per candidate): it
  reads candidates through ``split``, which for entries is a C-level
  ``itemgetter`` over the named tuple.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from sqlalchemy import Connection, Table, select
from sqlalchemy.sql.elements import ColumnElement

from ficache.fingerprint import Fingerprint
from ficache.kind_store import present
from ficache.kinds import Kind
from ficache.models import COMMITS as C
from ficache.models import FINGERPRINTS as F
from ficache.models import policy_text

#: Resolutions that are not a source: the registry's value stays; the identity is removed.
TARGET = "target"
DROP = "dropped"
UNRESOLVED = "unresolved"

#: Positions of a group's counts: added, replaced, removed, identical, conflicting.
ADDED, REPLACED, REMOVED, IDENTICAL, CONFLICTING = range(5)

#: ``(source number from 1, candidate)``.
Candidate = tuple[int, Any]


def _getter(item_type: type, names: Sequence[str]) -> Callable[[Any], Any]:
    """A C-level getter of ``names`` of an item: by position on a named tuple
    (``NewEntry``), by attribute otherwise (``NewRecord``)."""
    fields = getattr(item_type, "_fields", None)
    if fields is not None:
        return operator.itemgetter(*(fields.index(name) for name in names))
    return operator.attrgetter(*names)


@dataclass(frozen=True)
class MergeKind:
    """What merging and reconciling need to know of one kind of stored result:
    its description (``kinds.Kind``), the type of a writer's item, and two
    things a merge plan reports by kind.

    - ``op(key, item)``: the group a plan counts an identity in ("" for one group).
    - ``conflict(digest, fingerprint id, scope, key, baseline, candidates,
      resolution)``: the kind's conflict object.

    The rest is read off the description: a candidate's ``key`` is its
    identity after fingerprint and scope (one column: that column's value;
    several: their tuple), its ``value`` the value columns' (one column: its
    value; several: their tuple; policies as text, as writers hand them over).
    """

    kind: Kind
    item_type: type
    op: Callable[[Any, Any], str]
    conflict: Callable[..., Any]

    @functools.cached_property
    def split(self) -> Callable[[Any], tuple[Fingerprint, str, Any]]:
        """``item -> (fingerprint, scope, key)``."""
        identity = self.kind.item_identity
        if len(identity) == 1:
            return _getter(self.item_type, ("fingerprint", "scope", *identity))
        head, key = (
            _getter(self.item_type, ("fingerprint", "scope")),
            _getter(self.item_type, identity),
        )
        return lambda item: (*head(item), key(item))

    @functools.cached_property
    def value(self) -> Callable[[Any], Hashable]:
        """``item -> value``, as ``value_columns`` read it."""
        return _getter(self.item_type, self.kind.item_values)

    @property
    def key_columns(self) -> tuple[str, ...]:
        return self.kind.identity

    @functools.cached_property
    def value_columns(self) -> tuple[ColumnElement[Any], ...]:
        """The value in ``kind.rows``, policies as their text."""
        return self._text(self.kind.rows, self.kind.values)

    @functools.cached_property
    def old_value_columns(self) -> tuple[ColumnElement[Any], ...]:
        """The value a change replaced or removed, in ``kind.changes``, policies as text."""
        old = [self.kind.old_column(name) for name in self.kind.values]
        return self._text(self.kind.changes, old, self.kind.values)

    def _text(
        self, table: Table, columns: Sequence[str], names: Sequence[str] | None = None
    ) -> tuple[ColumnElement[Any], ...]:
        policies = self.kind.policy_columns
        return tuple(
            policy_text(table.c[column]).label(column) if name in policies else table.c[column]
            for column, name in zip(columns, names or columns, strict=True)
        )

    def identity(self, fp: Fingerprint, scope: str, key: Any) -> tuple[Any, ...]:
        """The identity a write names: ``(fingerprint, scope, *key columns)``."""
        return (fp, scope, key) if len(self.key_columns) == 1 else (fp, scope, *key)


def _tuned(t: float | None) -> float:
    return t if t is not None else -math.inf


def resolve(
    policy: str,
    target: tuple[Any, float | None] | None,
    candidates: Sequence[Candidate],
    kind: MergeKind,
) -> str | Candidate:
    """The winner of a conflict: ``TARGET``, ``DROP``, ``UNRESOLVED`` or a candidate.

    ``target`` is the registry's ``(value, tuned_at)`` (None: it holds none);
    candidates carry a ``tuned_at`` and ``kind.value`` gives their value.
    """
    if policy == "keep":
        return TARGET if target is not None else candidates[0]
    if policy == "theirs":
        return candidates[-1]
    if policy == "newest":
        best: str | Candidate
        if target is not None:
            _value, target_at = target
            best, best_at = TARGET, _tuned(target_at)
        else:
            _source, first = best = candidates[0]
            best_at = _tuned(first.tuned_at)
        for cand in candidates:
            _source, item = cand
            at = _tuned(item.tuned_at)
            if at > best_at:
                best, best_at = cand, at
        return best
    if policy == "vote":
        votes: dict[Any, int] = {}
        for _n, item in candidates:
            v = kind.value(item)
            votes[v] = votes.get(v, 0) + 1
        top = max(votes.values())
        tied = {v for v, n in votes.items() if n == top}
        if len(tied) > 1 and target is not None:
            return TARGET
        return next((n, item) for n, item in candidates if kind.value(item) in tied)
    if policy == "drop":
        return DROP
    return UNRESOLVED


# --------------------------------------------------------------------------
# Merge plans.

#: ``(fingerprint index, scope) -> {key: [candidate, ...]}``, in source order.
Groups = dict[tuple[int, str], dict[Any, list[Candidate]]]
#: ``(fingerprint index, scope, key)``: an identity as a plan indexes it.
Indexed = tuple[int, str, Any]


@dataclass
class KindPlan:
    """One kind's part of a merge plan, before its caller shapes it."""

    fingerprints: list[Fingerprint]  # by index, in order of first appearance
    target_ids: list[int | None]  # each one's id in the registry (None: new there)
    counts: dict[tuple[int, str, str], list[int]] = field(default_factory=dict)
    conflicts: dict[Indexed, Any] = field(default_factory=dict)  # identity -> conflict
    writes: list[Any] = field(default_factory=list)
    removals: list[tuple[Any, ...]] = field(default_factory=list)
    expected: list[tuple[tuple[Any, ...], int | None]] = field(default_factory=list)

    def order(self, index: int) -> tuple[bool, int, str]:
        """Fingerprints the registry holds first, by id, then new ones by digest."""
        fid = self.target_ids[index]
        return (fid is None, fid or 0, self.fingerprints[index].digest)


def candidates_of(
    kind: MergeKind, sources: Sequence[Iterable[Any]]
) -> tuple[list[Fingerprint], Groups]:
    """Every source's candidates grouped by (fingerprint index, scope), then key.

    The hot path: candidates come in runs of one fingerprint object and one
    scope, so a fingerprint is hashed once per run and a candidate costs one
    lookup by its key.
    """
    split = kind.split
    fp_index: dict[Fingerprint, int] = {}
    by_group: Groups = {}
    for number, items in enumerate(sources, start=1):
        last_fp: Fingerprint | None = None
        last_scope: str | None = None
        candidates: dict[Any, list[Candidate]] = {}
        for item in items:
            fp, scope, key = split(item)
            if fp is not last_fp or scope != last_scope:
                if fp is not last_fp:
                    last_fp = fp
                    index = fp_index.setdefault(fp, len(fp_index))
                last_scope = scope
                candidates = by_group.setdefault((index, scope), {})
            found = candidates.get(key)
            if found is None:
                candidates[key] = [(number, item)]
            elif found[-1][0] == number:  # a duplicate within one source: the later wins
                found[-1] = (number, item)
            else:
                found.append((number, item))
    return list(fp_index), by_group


def _one(columns: Sequence[Any]) -> Any:
    """One column's value, or the tuple of several (a key, a value)."""
    return columns[0] if len(columns) == 1 else tuple(columns)


class Held(NamedTuple):
    """What the registry holds for one candidate identity."""

    value: Any
    tuned_at: float | None
    commit_id: int


def _current(
    conn: Connection, kind: MergeKind, index_of_id: dict[int, int], by_group: Groups
) -> dict[Indexed, Held]:
    """What the registry holds for every candidate identity it holds."""
    table, nk = kind.kind.rows, len(kind.key_columns)
    rows = conn.execute(
        select(
            table.c.fingerprint_id,
            table.c.scope,
            table.c.tuned_at,
            table.c.commit_id,
            *(table.c[name] for name in kind.key_columns),
            *kind.value_columns,
        ).where(table.c.fingerprint_id.in_(sorted(index_of_id)))
    )
    current: dict[Indexed, Held] = {}
    one_key, one_value = nk == 1, len(kind.value_columns) == 1
    make = tuple.__new__  # Held(...) by position, as a C call: one per row held
    for row in rows:  # (fingerprint id, scope, tuned_at, commit, *key, *value)
        index, scope = index_of_id[row[0]], row[1]
        key = row[4] if one_key else tuple(row[4 : 4 + nk])
        if key in by_group.get((index, scope), ()):
            value = row[4 + nk] if one_value else tuple(row[4 + nk :])
            current[(index, scope, key)] = make(Held, (value, row[2], row[3]))
    return current


def _tombstones(
    conn: Connection,
    kind: MergeKind,
    index_of_id: dict[int, int],
    by_group: Groups,
    current: dict[Indexed, Held],
) -> dict[Indexed, Any]:
    """Absent candidate identities whose latest change is a merge's removal, with the
    value it removed."""
    changes, nk = kind.kind.changes, len(kind.key_columns)
    rows = conn.execute(
        select(
            changes.c.fingerprint_id,
            changes.c.scope,
            changes.c.action,
            C.c.kind,
            *(changes.c[name] for name in kind.key_columns),
            *kind.old_value_columns,
        )
        .join(C, C.c.id == changes.c.commit_id)
        .where(changes.c.fingerprint_id.in_(sorted(index_of_id)))
        .order_by(changes.c.id)
    )
    latest: dict[Indexed, tuple[str, str, Any, bool]] = {}
    one_key = nk == 1
    for fid, scope, action, commit_kind, *rest in rows:
        index, key = index_of_id[fid], rest[0] if one_key else tuple(rest[:nk])
        ident = (index, scope, key)
        if key in by_group.get((index, scope), ()) and ident not in current:
            old = rest[nk:]
            latest[ident] = (action, commit_kind, _one(old), old[0] is not None)
    return {
        ident: value
        for ident, (action, commit_kind, value, held) in latest.items()
        if action == "removed" and commit_kind == "merge" and held
    }


def plan_kind(
    conn: Connection, kind: MergeKind, sources: Sequence[Iterable[Any]], policy: str
) -> KindPlan:
    """Plan merging ``sources`` (each an iterable of the kind's candidates, in order)
    into the registry read by ``conn``, under ``policy``.

    Longer than the guide because it is one decision per identity, inline:
    the loop runs once per candidate identity of the largest merges, and the
    common case (sources agree with the registry) is plain comparisons.
    """
    fps, by_group = candidates_of(kind, sources)
    stored = dict(conn.execute(select(F.c.digest, F.c.id)).all())
    plan = KindPlan(fps, [stored.get(fp.digest) for fp in fps])
    index_of_id = {fid: i for i, fid in enumerate(plan.target_ids) if fid is not None}
    current: dict[Indexed, Held] = {}
    tombstones: dict[Indexed, Any] = {}
    if index_of_id and present(conn, kind.kind):  # an older schema may lack the kind: none held
        current = _current(conn, kind, index_of_id, by_group)
        if policy == "drop":
            tombstones = _tombstones(conn, kind, index_of_id, by_group, current)
    value_of, identity = kind.value, kind.identity
    flat = len(kind.key_columns) == 1  # the identity is (fingerprint, scope, key)
    writes, removals, expected = plan.writes, plan.removals, plan.expected
    ops: dict[Any, str] = {}
    # In (fingerprint, scope, key) order, so a large commit inserts in the order of
    # the registry's unique index (shuffled: 25% slower at 300k). Sorting each
    # group's keys gives that order at a third of the cost of sorting identities.
    for index, scope in sorted(by_group):
        candidates = by_group[(index, scope)]
        counts_of_op: dict[str, list[int]] = {}
        fp = fps[index]
        for key in sorted(candidates):
            cands = candidates[key]
            _source, first = cands[0]
            op = ops.get(key)
            if op is None:
                op = ops[key] = kind.op(key, first)
            group = counts_of_op.get(op)
            if group is None:
                group = counts_of_op[op] = plan.counts.setdefault((index, scope, op), [0] * 5)
            now = current.get((index, scope, key)) if current else None
            if now is not None:
                baseline = now.value
            else:
                baseline = tombstones.get((index, scope, key)) if tombstones else None
            agree = True
            if len(cands) > 1 or baseline is not None:  # else one source, nothing to compare
                value = value_of(first)
                if baseline is not None and baseline != value:
                    agree = False
                elif len(cands) > 1:
                    for _n, item in cands:
                        if value_of(item) != value:
                            agree = False
                            break
            if agree:
                if now is None:
                    writes.append(first)
                    expected.append(((fp, scope, key) if flat else identity(fp, scope, key), None))
                    group[ADDED] += 1
                else:
                    group[IDENTICAL] += 1
                continue
            group[CONFLICTING] += 1
            target = (now.value, now.tuned_at) if now is not None else None
            winner = resolve(policy, target, cands, kind)
            if isinstance(winner, str):
                resolution = winner
                if winner == DROP and now is not None:
                    removals.append(identity(fp, scope, key))
                    expected.append((removals[-1], now.commit_id))
                    group[REMOVED] += 1
            else:
                source, chosen = winner
                resolution = f"source {source}"
                if now is None:
                    writes.append(chosen)
                    expected.append((identity(fp, scope, key), None))
                    group[ADDED] += 1
                elif value_of(chosen) != now.value:
                    writes.append(chosen)
                    expected.append((identity(fp, scope, key), now.commit_id))
                    group[REPLACED] += 1
                else:
                    resolution = TARGET
            plan.conflicts[(index, scope, key)] = kind.conflict(
                fp.digest, plan.target_ids[index], scope, key, baseline, cands, resolution
            )
    return plan


# --------------------------------------------------------------------------
# Reconciling an import's own inputs.


@dataclass
class Reconciled:
    """What an import writes of one kind, and what its inputs disagreed on."""

    writes: list[Any]
    duplicates: int = 0
    conflicts: int = 0
    conflicting: list[Any] = field(default_factory=list)


def reconcile(kind: MergeKind, inputs: Sequence[Sequence[Any]], policy: str) -> Reconciled:
    """The candidate to write per identity of ``inputs`` (in order) under ``policy``,
    with the duplicates and conflicts among them (``ficache.importing``'s counts).

    The hot path is one dict lookup per candidate: each (fingerprint, scope)
    group maps a key to the first candidate holding it, and only keys held
    again get a candidate list. Candidates come in runs of one fingerprint
    object and scope, so a fingerprint is hashed once per run.
    """
    split = kind.split
    by_group: dict[tuple[Fingerprint, str], dict[Any, Candidate]] = {}
    again: dict[tuple[Fingerprint, str, Any], list[Candidate]] = {}
    for number, items in enumerate(inputs, start=1):
        last_fp: Fingerprint | None = None
        last_scope: str | None = None
        group: dict[Any, Candidate] = {}
        for item in items:
            fp, scope, key = split(item)
            if fp is not last_fp or scope != last_scope:
                last_fp, last_scope = fp, scope
                group = by_group.setdefault((fp, scope), {})
            cand = (number, item)
            first = group.setdefault(key, cand)
            if first is not cand:
                ident = (fp, scope, key)
                if ident not in again:
                    again[ident] = [first]
                again[ident].append(cand)
    if not again:  # the common case: every identity once, in input order
        return Reconciled([item for items in inputs for item in items])
    done = Reconciled([])
    for (fp, scope), group in by_group.items():
        for key, (_number, only) in group.items():
            cands = again.get((fp, scope, key))
            if cands is None:
                done.writes.append(only)
            else:
                _settle(kind, policy, fp, scope, key, cands, done)
    return done


def _settle(
    kind: MergeKind,
    policy: str,
    fp: Fingerprint,
    scope: str,
    key: Any,
    cands: list[Candidate],
    done: Reconciled,
) -> None:
    """One identity that several inputs hold: its write, duplicates and conflicts."""
    values = list(dict.fromkeys(kind.value(item) for _n, item in cands))
    done.duplicates += len(cands) - len(values)
    if len(values) == 1:
        _source, only = cands[0]
        done.writes.append(only)
        return
    winner = resolve(policy, None, cands, kind)
    if isinstance(winner, str):  # dropped, or unresolved (``fail``)
        done.conflicts += len(values)
        resolution = winner
    else:
        done.conflicts += len(values) - 1
        source, chosen = winner
        done.writes.append(chosen)
        resolution = f"source {source}"
    done.conflicting.append(kind.conflict(fp.digest, None, scope, key, None, cands, resolution))


__all__ = [
    "DROP",
    "TARGET",
    "UNRESOLVED",
    "KindPlan",
    "MergeKind",
    "Reconciled",
    "candidates_of",
    "plan_kind",
    "reconcile",
    "resolve",
]
