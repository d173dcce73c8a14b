"""The registry library: commits, history, revert, prune plans, exports.

Every test that uses the ``reg`` fixture runs on SQLite and on PostgreSQL
(``backend``; the PostgreSQL cases run in ``tox -e postgres``)."""

from __future__ import annotations

import json
import pickle
import re
import sqlite3
import time
from typing import Any

import pytest
from sqlalchemy import event, text
from sqlalchemy.exc import OperationalError

from ficache import schema
from ficache.errors import (
    ConflictError,
    FicacheError,
    FingerprintError,
    MergeConflictError,
    NotFoundError,
    RegistryBusyError,
)
from ficache.fingerprint import Fingerprint
from ficache.flashinfer_format import parse_cache_bytes, parse_key
from ficache.kinds import ENTRY_KIND
from ficache.records import NewRecord, RecordWrite
from ficache.registry import (
    NewEntry,
    PruneGroup,
    Registry,
    bulk_new_entry,
    rank_scope,
    validate_scope,
)
from ficache.revert import RevertCounts, plan_revert

FIELDS = {
    "flashinfer_version": "0.7.2.post1",
    "cuda_version": "12.9",
    "cublas_version": "12.9.1",
    "cudnn_version": "91002",
    "cudnn_frontend_version": "1.32.0",
    "cutlass_dsl_version": "nvidia-cutlass-dsl==4.8.1",
}
H200 = Fingerprint(**FIELDS, gpu="NVIDIA H200", compute_capability="9.0", torch_version="2.13.0")
B200 = Fingerprint(**FIELDS, gpu="NVIDIA B200", compute_capability="10.0", torch_version="2.13.0")
H200_OLD = Fingerprint(**{**FIELDS, "flashinfer_version": "0.6.0"}, gpu="NVIDIA H200")


def key(m: int, op: str = "flashinfer::mm_fp4", runner: str = "CutlassRunner") -> str:
    return str((op, runner, ((m, 4096), (4096, 2048)), ("torch.bfloat16",)))


def entry(
    fp: Fingerprint, m: int, tactic: object, scope: str = "shared", policy: list | None = None
) -> NewEntry:
    return NewEntry(
        fp,
        key(m),
        "CutlassRunner",
        json.dumps(tactic, separators=(",", ":")),
        json.dumps(policy, separators=(",", ":")) if policy is not None else None,
        scope,
    )


def current(reg: Registry) -> dict[tuple[int, str, str], str]:
    return {(e.fingerprint_id, e.scope, e.key): e.tactic_json for e in reg.entries()}


def fid(reg: Registry, fp: Fingerprint) -> int:
    [found] = [i.id for i in reg.fingerprints() if i.fingerprint == fp]
    return found


def count(reg: Registry, table: str) -> int:
    with reg.engine.connect() as conn:
        return conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()


@pytest.fixture
def reg(backend: str, registry_db: str):
    with Registry.open(registry_db) as registry:
        yield registry


def test_a_write_is_one_commit_with_provenance(reg: Registry) -> None:
    result = reg.write(
        [entry(H200, 16, 1), entry(H200, 32, [2, [3, 4]])],
        kind="startup",
        message="warm",
        world_size=2,
        layout="tp2",
        provenance={"vllm": "0.33.0"},
    )

    assert (result.commit_id, result.added, result.replaced, result.unchanged) == (1, 2, 0, 0)
    [commit] = reg.log()
    assert (commit.id, commit.kind, commit.message, commit.world_size, commit.layout) == (
        1,
        "startup",
        "warm",
        2,
        "tp2",
    )
    assert (commit.added, commit.replaced, commit.removed) == (1 + 1, 0, 0)
    assert commit.provenance == {"vllm": "0.33.0"}
    assert commit.host and commit.created_at > 0
    entries = list(reg.entries())
    assert [(e.key, e.op, e.runner, e.tactic_json, e.commit_id) for e in entries] == [
        (key(16), "flashinfer::mm_fp4", "CutlassRunner", "1", 1),
        (key(32), "flashinfer::mm_fp4", "CutlassRunner", "[2,[3,4]]", 1),
    ]
    assert json.loads(entries[0].shapes) == [[16, 4096], [4096, 2048]]
    assert entries[0].extras == "('torch.bfloat16',)"
    assert count(reg, "entry_changes") == 2


def test_writing_nothing_new_creates_no_commit(reg: Registry, registry_db: str, dump_db) -> None:
    reg.write([entry(H200, 16, 1)], kind="import")
    before = dump_db(registry_db)

    assert reg.write([entry(H200, 16, 1)], kind="import").commit_id is None
    assert reg.write([entry(H200, 16, 1)], kind="import").unchanged == 1
    assert reg.write([], kind="import").commit_id is None

    assert dump_db(registry_db) == before
    assert len(reg.log()) == 1


def test_a_write_with_a_token_lands_once_and_a_retry_reports_that_commit(
    reg: Registry, registry_db: str, dump_db
) -> None:
    first = reg.write(
        [entry(H200, 16, 1), entry(H200, 32, 2, scope="tp2/rank1")],
        kind="startup",
        provenance={"framework": "vllm"},
        once_token="a1b2c3",
    )
    before = dump_db(registry_db)

    # A retry of the same write (its first answer lost): the commit that landed, nothing more.
    again = reg.write([entry(H200, 16, 9)], kind="startup", once_token="a1b2c3")
    assert (again.commit_id, again.added, again.shared_written) == (first.commit_id, 2, 1)
    assert dump_db(registry_db) == before
    assert reg.commit_with_token("a1b2c3") == again
    assert reg.log()[0].provenance == {"framework": "vllm", "start_token": "a1b2c3"}
    # Another token, or a token only contained in another, is another write.
    assert reg.commit_with_token("a1b2c") is None
    assert reg.write([entry(H200, 16, 9)], kind="startup", once_token="a1b2c").replaced == 1


class AnotherWriter:
    """Another writer holding the registry's write lock (plain driver SQL) until ``release``:
    SQLite's ``BEGIN IMMEDIATE``, or on PostgreSQL the advisory lock writers queue on."""

    def __init__(self, db: str) -> None:
        location = schema.resolve(db)
        self.conn: Any
        if location.path is not None:
            self.conn = sqlite3.connect(location.path, isolation_level=None)
            self.conn.execute("BEGIN IMMEDIATE")
            self.release_sql = "ROLLBACK"
        else:
            import psycopg

            self.conn = psycopg.connect(
                db.replace("postgresql+psycopg://", "postgresql://"), autocommit=True
            )
            self.conn.execute(f"SELECT pg_advisory_lock({schema.PG_MIGRATION_LOCK_ID})")
            self.release_sql = f"SELECT pg_advisory_unlock({schema.PG_MIGRATION_LOCK_ID})"
        self.held = True

    def release(self) -> None:
        if self.held:
            self.conn.execute(self.release_sql)
            self.held = False

    def close(self) -> None:
        self.release()
        self.conn.close()


def test_a_write_that_finds_the_lock_busy_retries_and_commits_once(
    reg: Registry, registry_db: str
) -> None:
    """The write's first attempt waits out a short lock timeout while another writer holds
    the lock, and fails busy. The other writer lets go exactly then, from SQLAlchemy's
    ``handle_error`` event on that failure (no sleeps, no timing): the retry takes the
    lock and the write commits, once."""
    reg.write([entry(H200, 16, 1)], kind="import")
    if reg.engine.dialect.name == "sqlite":

        @event.listens_for(reg.engine, "connect")  # after ficache's own: this one wins
        def short_busy_timeout(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.execute("PRAGMA busy_timeout = 20")

    else:
        reg.engine.update_execution_options(ficache_lock_timeout_ms=20)
    lock_attempts: list[str] = []
    failures: list[str] = []

    @event.listens_for(reg.engine, "before_cursor_execute")
    def count_lock_attempts(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement == "BEGIN IMMEDIATE" or "pg_advisory_xact_lock" in statement:
            lock_attempts.append(statement)

    other = AnotherWriter(registry_db)

    @event.listens_for(reg.engine, "handle_error")
    def other_writer_lets_go(context: Any) -> None:
        failures.append(str(context.original_exception).splitlines()[0])
        other.release()

    try:
        result = reg.write([entry(H200, 32, 2)], kind="import", message="after a busy wait")
    finally:
        other.close()

    # One busy failure (the first attempt), then a second attempt that committed.
    assert failures in (["database is locked"], ["canceling statement due to lock timeout"])
    assert len(lock_attempts) == 2 and lock_attempts[0] == lock_attempts[1]
    assert (result.commit_id, result.added) == (2, 1)
    assert [(c.id, c.message) for c in reg.log()] == [(2, "after a busy wait"), (1, None)]
    assert count(reg, "commits") == 2 and count(reg, "entry_changes") == 2
    assert current(reg) == {(1, "shared", key(16)): "1", (1, "shared", key(32)): "2"}


def test_a_write_that_breaks_a_constraint_fails_at_once_without_retrying(
    reg: Registry, registry_db: str, dump_db
) -> None:
    """A constraint the write breaks (here a unique index on commit messages, added for the
    test) breaks again on every attempt: the write takes the lock once, then one line."""
    reg.write([entry(H200, 16, 1)], kind="import", message="same")
    with reg.engine.begin() as conn:
        conn.execute(text("CREATE UNIQUE INDEX one_message ON commits (message)"))
    before = dump_db(registry_db)
    lock_attempts: list[str] = []

    @event.listens_for(reg.engine, "before_cursor_execute")
    def count_lock_attempts(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement == "BEGIN IMMEDIATE" or "pg_advisory_xact_lock" in statement:
            lock_attempts.append(statement)

    with pytest.raises(FicacheError) as raised:
        reg.write([entry(H200, 32, 2)], kind="import", message="same")

    assert len(lock_attempts) == 1
    message = str(raised.value)
    assert "\n" not in message and not isinstance(raised.value, RegistryBusyError)
    assert message.startswith(f"registry {reg.location.display} refused the write (")
    assert message.endswith("nothing was written; check it with `ficache verify`")
    assert "unique" in message.lower()
    assert dump_db(registry_db) == before


def test_a_write_looks_up_the_fingerprint_of_its_records_once_not_once_per_record(
    reg: Registry,
) -> None:
    """40 records of a fingerprint no entry of the write names, then 40 removals of it:
    its row is looked up once per write (while the write lock is held), not per record."""
    reg.write([entry(H200, 16, 1)], kind="import")
    lookups: list[str] = []

    @event.listens_for(reg.engine, "before_cursor_execute")
    def count_fingerprint_lookups(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "FROM fingerprints" in statement:
            lookups.append(statement)

    records = [NewRecord(B200, "trtllm_moe_da", f"k{n}", str(n)) for n in range(40)]
    written = reg.write([entry(H200, 32, 2)], kind="import", records=records)
    assert (written.added, written.records_added) == (1, 40)
    assert len(lookups) == 2  # H200 for the entries, B200 for the records
    lookups.clear()
    removals = tuple((B200, "shared", "trtllm_moe_da", f"k{n}") for n in range(40))
    removed = reg.write([], kind="import", records=RecordWrite(removals=removals))
    assert removed.records_removed == 40
    assert len(lookups) == 1


def test_a_lock_held_past_the_bound_is_one_line_saying_the_wait(
    reg: Registry, registry_db: str, dump_db
) -> None:
    """Another writer holds the write lock throughout; the registry's bound is 0.2 s.
    The error states that bound and the time the write waited, over every attempt."""
    reg.write([entry(H200, 16, 1)], kind="import")
    before = dump_db(registry_db)
    schema.bound_busy_timeout(reg.engine, 0.2)
    assert schema.busy_timeout_ms(reg.engine) == 200
    other = AnotherWriter(registry_db)
    started = time.monotonic()
    try:
        with pytest.raises(RegistryBusyError) as raised:
            reg.write([entry(H200, 32, 2)], kind="import")
        elapsed = time.monotonic() - started
    finally:
        other.close()

    message = str(raised.value)
    found = re.fullmatch(
        rf"registry {re.escape(reg.location.display)} stayed locked by another writer for "
        r"(\d+\.\d) s \(4 attempts, each waiting up to 0\.2 s for the lock\); "
        r"retry when it finishes",
        message,
    )
    assert found is not None, message
    # It waited out the bound on each attempt, and says no more than it waited.
    assert 4 * 0.2 <= float(found.group(1)) <= elapsed + 0.05
    assert dump_db(registry_db) == before


def test_a_busy_error_without_a_measured_wait_states_the_bound(reg: Registry) -> None:
    """A read that found the lock busy did not time its wait: the bound alone."""
    locked = OperationalError("SELECT 1", {}, sqlite3.OperationalError("database is locked"))
    schema.bound_busy_timeout(reg.engine, 5)
    error = schema.translate_operational_error(locked, reg.location, engine=reg.engine)
    default = schema.translate_operational_error(locked, reg.location)

    assert isinstance(error, RegistryBusyError) and isinstance(default, RegistryBusyError)
    assert str(error) == (
        f"registry {reg.location.display} stayed locked by another writer longer than the "
        "5 s a write waits for the lock; retry when it finishes"
    )
    assert str(default) == (
        f"registry {reg.location.display} stayed locked by another writer longer than the "
        "30 s a write waits for the lock; retry when it finishes"
    )


def test_replacing_keeps_the_old_value_in_history(reg: Registry) -> None:
    reg.write([entry(H200, 16, 1), entry(H200, 32, 2)], kind="import")

    result = reg.write([entry(H200, 16, 9), entry(H200, 32, 2), entry(H200, 64, 3)], kind="import")

    assert (result.commit_id, result.added, result.replaced, result.unchanged) == (2, 1, 1, 1)
    with reg.engine.connect() as conn:
        rows = [
            tuple(row)
            for row in conn.execute(
                text(
                    "SELECT action, key, old_tactic, old_commit_id FROM entry_changes "
                    "WHERE commit_id = 2 ORDER BY id"
                )
            )
        ]
    assert sorted(rows) == sorted([("added", key(64), None, None), ("replaced", key(16), "1", 1)])
    assert reg.log()[0].replaced == 1


def test_the_same_key_under_different_fingerprints_and_scopes_is_separate(reg: Registry) -> None:
    reg.write(
        [entry(H200, 16, 1), entry(B200, 16, 2), entry(H200, 16, 3, scope="tp2/rank1")],
        kind="import",
    )

    assert sorted(current(reg).values()) == ["1", "2", "3"]
    assert sorted((i.fingerprint.gpu, i.entries) for i in reg.fingerprints()) == [
        ("NVIDIA B200", 1),
        ("NVIDIA H200", 2),
    ]


def test_a_bad_key_or_scope_writes_nothing(reg: Registry, registry_db: str, dump_db) -> None:
    reg.write([entry(H200, 16, 1)], kind="import")
    before = dump_db(registry_db)

    with pytest.raises(FicacheError, match="not a FlashInfer key"):
        reg.write([entry(H200, 32, 1), NewEntry(H200, "__import__('os')", "R", "1")], kind="import")
    with pytest.raises(ValueError, match="scope must be"):
        reg.write([entry(H200, 32, 1, scope="rank1")], kind="import")

    assert dump_db(registry_db) == before


def test_revert_restores_replaced_and_removes_added(reg: Registry) -> None:
    reg.write([entry(H200, 16, 1), entry(H200, 32, 2)], kind="import")
    before = current(reg)
    reg.write([entry(H200, 16, 9), entry(H200, 64, 3)], kind="import")

    result = reg.revert(2)

    assert (result.commit_id, result.added, result.replaced, result.removed) == (3, 0, 1, 1)
    assert current(reg) == before
    newest = reg.log()[0]
    assert (newest.kind, newest.reverts_commit_id, newest.message) == (
        "revert",
        2,
        "revert commit 2",
    )
    # a revert is a commit too, so it can be reverted
    reg.revert(3)
    assert current(reg)[(1, "shared", key(16))] == "9"
    assert (1, "shared", key(64)) in current(reg)


def test_revert_refuses_when_later_commits_changed_its_entries(
    reg: Registry, registry_db: str, dump_db
) -> None:
    reg.write([entry(H200, 16, 1)], kind="import")
    reg.write([entry(H200, 16, 2)], kind="import")
    before = dump_db(registry_db)

    with pytest.raises(ConflictError, match="1 of 1 entries of commit 1 changed in later commits"):
        reg.revert(1)
    with pytest.raises(NotFoundError, match="no commit 99"):
        reg.revert(99)

    assert dump_db(registry_db) == before


def test_a_revert_plan_is_what_the_revert_does(reg: Registry, registry_db: str, dump_db) -> None:
    reg.write([entry(H200, 16, 1), entry(H200, 32, 2)], kind="import")
    reg.write(
        [entry(H200, 16, 9), entry(H200, 64, 3)],
        kind="import",
        removals=[(H200, "shared", key(32))],
    )

    plan = plan_revert(reg, 2)

    assert plan == plan_revert(reg, 2)
    assert plan != plan_revert(reg, 1)
    assert (plan.target, plan.commit.id, plan.entries, plan.records) == (
        reg.location.display,
        2,
        RevertCounts(remove=1, restore=1, re_add=1),
        RevertCounts(),
    )
    assert (plan.conflicts, plan.refusal, plan.reverted_by) == ((), None, None)
    refused = plan_revert(reg, 1)
    assert [(c.key, c.action, c.changed_by) for c in refused.conflicts] == [
        (key(16), "added", 2),
        (key(32), "added", 2),
    ]
    before = dump_db(registry_db)
    with pytest.raises(ConflictError, match="^2 of 2 entries of commit 1 changed in later"):
        refused.execute(reg)
    assert dump_db(registry_db) == before

    result = plan.execute(reg)

    assert (result.commit_id, result.added, result.replaced, result.removed) == (3, 1, 1, 1)
    assert current(reg) == {(1, "shared", key(16)): "1", (1, "shared", key(32)): "2"}
    assert plan_revert(reg, 2).reverted_by == 3
    assert plan_revert(reg, 2).refusal == (
        "commit 2 is already reverted by commit 3; nothing to revert (revert commit 3 to "
        "bring it back)"
    )


def test_a_revert_plan_refuses_a_registry_that_moved(
    reg: Registry, registry_db: str, dump_db
) -> None:
    reg.write([entry(H200, 16, 1), entry(H200, 32, 2)], kind="import")
    reg.write([entry(H200, 16, 9)], kind="import")
    plan = plan_revert(reg, 2)
    reg.write([entry(H200, 16, 7)], kind="import")  # commit 3 changes what the plan restores
    before = dump_db(registry_db)

    with pytest.raises(ConflictError) as caught:
        plan.execute(reg)

    assert str(caught.value) == (
        f"registry {reg.location.display} changed since the revert of commit 2 was planned; "
        "nothing changed, plan it again (ficache revert 2)"
    )
    assert dump_db(registry_db) == before
    assert plan_revert(reg, 2).refusal == (
        "1 of 1 entries of commit 2 changed in later commits; revert those first (ficache log)"
    )


def test_plans_refuse_a_registry_they_were_not_made_on(reg: Registry, tmp_path, dump_db) -> None:
    """Two registries with the same history: a plan of one names rows of the other."""
    other_db = str(tmp_path / "other.db")
    with Registry.open(other_db) as other:
        for registry in (reg, other):
            registry.write([entry(H200, 16, 1), entry(H200, 32, 2)], kind="import")
            registry.write([entry(H200, 16, 9)], kind="import")
        prune = reg.plan_prune(fingerprint_ids=[fid(reg, H200)])
        revert = plan_revert(reg, 2)
        before = dump_db(other_db)

        for plan in (prune, revert):
            with pytest.raises(ValueError) as caught:
                plan.execute(other)
            assert str(caught.value) == (
                f"this plan was made for {reg.location.display}, not {other.location.display}"
            )

        assert dump_db(other_db) == before
        assert len(current(other)) == 2


def test_prune_plans_compare_with_eq_and_execute_as_one_commit(reg: Registry) -> None:
    reg.write(
        [
            entry(H200, 16, 1),
            entry(H200, 32, 2),
            entry(H200, 16, 5, scope="tp2/rank0"),
            entry(B200, 16, 3),
            entry(H200_OLD, 16, 4),
        ],
        kind="import",
    )

    h200, b200, old = fid(reg, H200), fid(reg, B200), fid(reg, H200_OLD)

    plan = reg.plan_prune(fingerprint_ids=[h200])

    assert plan == reg.plan_prune(fingerprint_ids=[h200])
    assert plan != reg.plan_prune(fingerprint_ids=[b200])
    assert plan.criteria == (("fingerprint", str(h200)),)
    assert plan.groups == (
        PruneGroup(h200, "NVIDIA H200", "0.7.2.post1", "shared", 2),
        PruneGroup(h200, "NVIDIA H200", "0.7.2.post1", "tp2/rank0", 1),
    )
    assert (plan.total, plan.is_empty) == (3, False)
    assert reg.plan_prune(flashinfer_versions=["0.6.0"]).groups == (
        PruneGroup(old, "NVIDIA H200", "0.6.0", "shared", 1),
    )
    assert reg.plan_prune(scope="tp2/rank0").total == 1
    assert reg.plan_prune(fingerprint_ids=[h200], scope="shared").total == 2

    result = plan.execute(reg)

    assert (result.commit_id, result.removed) == (2, 3)
    assert sorted(f for f, _s, _k in current(reg)) == sorted([b200, old])
    newest = reg.log()[0]
    assert (newest.kind, newest.removed, newest.message) == ("prune", 3, f"fingerprint={h200}")
    # and a prune is revertible
    reg.revert(2)
    assert len(current(reg)) == 5


def test_prune_by_age(reg: Registry) -> None:
    reg.write([entry(H200, 16, 1)], kind="import")
    written = next(iter(reg.entries())).updated_at

    assert reg.plan_prune(older_than_seconds=60, now=written + 30).is_empty
    assert reg.plan_prune(older_than_seconds=60, now=written + 90).total == 1
    assert reg.plan_prune(older_than_seconds=60, now=written + 90).criteria == (
        ("older_than_seconds", "60"),
    )


def test_an_empty_plan_writes_nothing(reg: Registry) -> None:
    reg.write([entry(H200, 16, 1)], kind="import")

    plan = reg.plan_prune(flashinfer_versions=["0.1"])

    assert plan.is_empty
    assert plan.execute(reg).commit_id is None
    assert len(reg.log()) == 1


def test_a_stale_plan_is_refused_and_removes_nothing(
    reg: Registry, registry_db: str, dump_db
) -> None:
    reg.write([entry(H200, 16, 1), entry(H200, 32, 2)], kind="import")
    plan = reg.plan_prune(fingerprint_ids=[1])
    reg.write([entry(H200, 16, 7)], kind="import")
    before = dump_db(registry_db)

    with pytest.raises(ConflictError, match="1 of 2 planned entries changed since the plan"):
        plan.execute(reg)

    assert dump_db(registry_db) == before


def test_prune_needs_a_criterion_and_a_known_fingerprint(reg: Registry) -> None:
    with pytest.raises(FicacheError, match="prune needs a criterion"):
        reg.plan_prune()
    with pytest.raises(NotFoundError, match="no fingerprint '7'"):
        reg.plan_prune(fingerprint_ids=[7])


def content(exported: str) -> dict[str, Any]:
    """An exported file's content but its ``_generation`` (derived from that content)."""
    data = json.loads(exported)
    assert data.pop("_generation")
    return data


def test_export_slices_shared_and_rank_scoped_entries(reg: Registry) -> None:
    reg.write(
        [
            entry(H200, 16, 1),
            entry(H200, 32, 2),
            entry(H200, 16, 10, scope="tp2/rank0"),
            entry(H200, 16, 11, scope="tp2/rank1"),
            entry(H200, 64, 12, scope="tp2/rank1"),
            entry(B200, 16, 3),
        ],
        kind="import",
    )

    h200 = fid(reg, H200)
    shared, n_shared = reg.export_text(h200)
    rank1, n_rank1 = reg.export_text(h200, scope="tp2/rank1")

    assert n_shared == 2 and n_rank1 == 3
    assert content(shared) == {
        "_metadata": H200.flashinfer_metadata(),
        key(16): ["CutlassRunner", 1],
        key(32): ["CutlassRunner", 2],
    }
    assert content(rank1) == {
        "_metadata": H200.flashinfer_metadata(),
        key(16): ["CutlassRunner", 11],
        key(32): ["CutlassRunner", 2],
        key(64): ["CutlassRunner", 12],
    }
    assert reg.slice_rows([h200], ["shared", "tp2/rank0"])[key(16)] == (
        key(16),
        "CutlassRunner",
        "10",
        None,
        None,  # no selection
    )


def test_export_for_an_environment_takes_every_serving_fingerprint(reg: Registry) -> None:
    wildcard_gpu = Fingerprint(**FIELDS, gpu="*")
    reg.write(
        [
            entry(H200, 16, 1),
            entry(wildcard_gpu, 16, 2),
            entry(wildcard_gpu, 32, 3),
            entry(B200, 64, 4),
        ],
        kind="import",
    )

    text, n = reg.export_for(H200)

    assert n == 2
    # the exact fingerprint wins over the wildcard one; B200's entries are not served
    assert content(text) == {
        "_metadata": H200.flashinfer_metadata(),
        key(16): ["CutlassRunner", 1],
        key(32): ["CutlassRunner", 3],
    }
    assert [i.fingerprint for i in reg.serving(H200)] == [H200, wildcard_gpu]
    with pytest.raises(NotFoundError, match="no stored fingerprint serves"):
        reg.export_for(H200_OLD)


def test_export_is_exactly_what_was_imported(reg: Registry) -> None:
    policy = ["cuda_graph_profile_replays", None, "l2_cache_policy", "hot"]
    text = json.dumps(
        {
            "_metadata": H200.flashinfer_metadata(),
            key(16): ["CutlassRunner", [1, [2, 3]], policy],
            str(("op", "Runner", ((1,),), ("it's", 1e-05, float("-inf"), None))): ["Runner", -1],
        }
    )
    cache = parse_cache_bytes(text.encode())
    reg.import_cache([("a.json", cache)])

    exported, _n = reg.export_text(1)

    assert content(exported) == json.loads(text)


def test_driver_placeholders_in_keys_are_data(reg: Registry) -> None:
    """The bulk insert hands rows to the driver as parameters: a key holding
    ``%s``, ``%(x)s``, ``?`` or ``:name`` is stored and exported verbatim."""
    odd = str(("op", "Runner", ((1,),), ("100%s", "%(key)s", "?", ":name", "%%", "'; --")))
    reg.write([NewEntry(H200, odd, "Runner", "[1]"), entry(H200, 16, 2)], kind="import")
    reg.write([NewEntry(H200, odd, "Runner", "[3]")], kind="import")  # the replace path

    assert {e.key: e.tactic_json for e in reg.entries()} == {odd: "[3]", key(16): "2"}
    assert json.loads(reg.export_text(1)[0])[odd] == ["Runner", [3]]


def test_import_without_metadata_needs_a_fingerprint(reg: Registry) -> None:
    cache = parse_cache_bytes(json.dumps({key(16): ["CutlassRunner", 1]}).encode())

    with pytest.raises(FingerprintError, match="a.json has no _metadata"):
        reg.import_cache([("a.json", cache)])
    assert reg.log() == []

    result = reg.import_cache([("a.json", cache)], fingerprint=B200, scope="tp4/rank3")

    assert result.added == 1
    [stored] = reg.entries()
    assert (reg.fingerprint(stored.fingerprint_id).fingerprint, stored.scope) == (B200, "tp4/rank3")


def _cache(entries: dict[str, Any], records: dict[str, Any] | None = None) -> Any:
    data: dict[str, Any] = {"_metadata": H200.flashinfer_metadata(), **entries}
    if records is not None:
        data["_records"] = records
    return parse_cache_bytes(json.dumps(data).encode())


def test_import_cache_takes_a_key_two_files_hold_from_the_first_as_merge_keeps(
    reg: Registry,
) -> None:
    a = _cache({key(1): ["CutlassRunner", 1], key(2): ["CutlassRunner", 2]}, {"ns": {"r": 1}})
    b = _cache({key(1): ["CutlassRunner", 10], key(2): ["CutlassRunner", 2]}, {"ns": {"r": 9}})

    with pytest.raises(MergeConflictError, match=r"^a\.json and b\.json hold different values"):
        reg.import_cache([("a.json", a), ("b.json", b)], on_conflict="fail")
    assert reg.log() == []

    result = reg.import_cache([("a.json", a), ("b.json", b)])

    assert (result.added, result.replaced, result.unchanged, result.records_added) == (2, 0, 0, 1)
    assert {k: t for (_f, _s, k), t in current(reg).items()} == {key(1): "1", key(2): "2"}
    assert reg.slice_records([1], ["shared"]) == {"ns": {"r": "1"}}
    [commit] = reg.log()
    assert {k: commit.provenance[k] for k in ("on_conflict", "duplicates", "conflicts")} == {
        "on_conflict": "keep",
        "duplicates": 1,
        "conflicts": 1,
    }


def test_an_import_plan_counts_every_input_entry_once_and_previews_without_writing(
    reg: Registry, registry_db: str, dump_db
) -> None:
    from ficache.importing import file_inputs, plan_import

    reg.import_cache([("old.json", _cache({key(1): ["CutlassRunner", 0]}))])
    before = dump_db(registry_db)
    inputs = file_inputs(
        [
            ("a.json", _cache({key(1): ["CutlassRunner", 1], key(2): ["CutlassRunner", 2]})),
            ("b.json", _cache({key(1): ["CutlassRunner", 1], key(3): ["CutlassRunner", 3]})),
            ("c.json", _cache({key(1): ["CutlassRunner", 5], key(3): ["CutlassRunner", 3]})),
        ]
    )

    plan = plan_import(inputs, "vote")
    preview = plan.preview(reg)

    assert dump_db(registry_db) == before
    assert (plan.entries, plan.duplicates, plan.conflicts) == (6, 2, 1)
    assert (preview.added, preview.replaced, preview.unchanged) == (2, 1, 0)
    assert preview.added + preview.replaced + preview.unchanged + 2 + 1 == plan.entries
    [conflict] = plan.conflicting
    assert (conflict.key, conflict.resolution) == (key(1), "source 1")
    result = plan.execute(reg, message="a, b, c")
    assert (result.added, result.replaced, result.unchanged) == (2, 1, 0)
    assert {k: t for (_f, _s, k), t in current(reg).items()} == {
        key(1): "1",
        key(2): "2",
        key(3): "3",
    }


def test_fingerprint_lookup_by_id_and_digest_prefix(reg: Registry) -> None:
    reg.write([entry(H200, 16, 1), entry(B200, 16, 1)], kind="import")

    assert reg.fingerprint(fid(reg, B200)).fingerprint == B200
    assert reg.fingerprint(str(fid(reg, B200))).fingerprint == B200
    assert reg.fingerprint(B200.digest[:8]).fingerprint == B200
    assert reg.fingerprint(B200.digest.upper()).fingerprint == B200
    with pytest.raises(NotFoundError):
        reg.fingerprint(3)
    with pytest.raises(NotFoundError):
        reg.fingerprint("abc")


def test_stats(reg: Registry) -> None:
    reg.write(
        [
            entry(H200, 16, 1),
            entry(H200, 32, 1, scope="tp2/rank1"),
            NewEntry(H200, key(16, op="flashinfer::other"), "CutlassRunner", "1"),
        ],
        kind="import",
    )

    stats = reg.stats()

    assert (
        stats.fingerprints,
        stats.entries,
        stats.shared_entries,
        stats.scoped_entries,
        stats.commits,
    ) == (1, 3, 2, 1, 1)
    assert stats.ops == (("flashinfer::mm_fp4", 2), ("flashinfer::other", 1))
    assert stats.revision == schema.head_revision()
    assert stats.size_bytes and stats.size_bytes > 0


def test_scopes() -> None:
    assert rank_scope("tp4", 3) == "tp4/rank3"
    assert validate_scope("shared") == "shared"
    assert validate_scope("tp4/rank3") == "tp4/rank3"
    for bad in ["", "rank1", "tp4/rank", "tp4/rankx", "/rank1", "a/b/rank1"]:
        with pytest.raises(ValueError):
            validate_scope(bad)


def test_bulk_new_entry_builds_the_same_entry_as_the_constructor() -> None:
    values = (
        H200,
        key(16),
        "CutlassRunner",
        "[1]",
        "[2]",
        "tp2/rank1",
        parse_key(key(16)),
        12.5,
        '{"candidates":2}',
    )

    fast = bulk_new_entry(*values)

    assert fast == NewEntry(*values)
    assert type(fast) is NewEntry
    names = (
        "fingerprint",
        "key",
        "runner",
        "tactic_json",
        "policy_json",
        "scope",
        "fields",
        "tuned_at",
        "selection_json",
    )
    assert tuple(getattr(fast, name) for name in names) == values
    assert NewEntry(**dict(zip(names, values, strict=True))) == fast
    assert pickle.loads(pickle.dumps(fast)) == fast
    assert type(pickle.loads(pickle.dumps(fast))) is NewEntry
    assert "runner='CutlassRunner'" in repr(fast)
    with pytest.raises(AttributeError):
        fast.key = "other"  # type: ignore[misc]


def test_an_import_request_decides_its_import_refusals_and_prepared_commit(
    reg: Registry, registry_db: str, dump_db, tmp_path
) -> None:
    from ficache import ingest
    from ficache.import_request import (
        ADOPTION,
        ImportRequest,
        ImportUsageError,
        read_file_import,
    )

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path, tactic in ((a, 1), (b, 2)):
        data = {"_metadata": H200.flashinfer_metadata(), key(1): ["CutlassRunner", tactic]}
        path.write_text(json.dumps(data))
    with pytest.raises(ImportUsageError, match="not both"):
        ImportRequest(from_vllm="", from_sglang="").kind()
    with pytest.raises(ImportUsageError, match="takes no FILES"):
        ImportRequest(files=(a,), from_vllm="").kind()
    with pytest.raises(ImportUsageError, match="^--on-conflict goes with FILES"):
        ImportRequest(from_sglang="", policy="vote").kind()
    with pytest.raises(ImportUsageError, match="--layout goes with") as raised:
        ImportRequest(files=(a,), layout="tp2-pp1-dp1-ep1").kind()
    assert raised.value.param_hint is None
    with pytest.raises(ImportUsageError, match="separate commands"):
        ImportRequest(files=(a, tmp_path)).kind()
    assert ImportRequest(from_vllm=str(tmp_path)).kind() == ADOPTION
    assert ImportRequest(files=(a, b)).kind() == ingest.FLASHINFER
    with pytest.raises(ImportUsageError, match="every file given has one"):
        read_file_import(ImportRequest(files=(a, b), fingerprint_ref="1"))

    read = read_file_import(ImportRequest(files=(a, b), policy="theirs"))
    prepared = read.early_plan()
    assert prepared is not None and read.note is None
    assert prepared.message == f"{a}, {b}"
    before = dump_db(registry_db)
    preview = prepared.preview(reg)
    assert dump_db(registry_db) == before
    assert (prepared.plan.entries, prepared.plan.conflicts, preview.added) == (2, 1, 1)
    result = prepared.execute(reg)
    assert (result.added, result.replaced, result.unchanged) == (1, 0, 0)
    assert {k: t for (_f, _s, k), t in current(reg).items()} == {key(1): "2"}
    assert reg.log()[0].message == f"{a}, {b}"
    failing = read_file_import(ImportRequest(files=(a, b), policy="fail"))
    with pytest.raises(MergeConflictError):
        failing.early_plan()


def test_prune_plans_and_executes_through_its_own_module(reg: Registry, tmp_path) -> None:
    from ficache import prune

    reg.write(
        [entry(H200, 16, 1), entry(H200, 16, 2, scope="tp2/rank0"), entry(B200, 16, 3)],
        kind="import",
    )
    h200 = fid(reg, H200)

    plan = prune.plan_prune(reg, fingerprint_ids=[h200], scope="tp2/rank0")

    assert plan == reg.plan_prune(fingerprint_ids=[h200], scope="tp2/rank0")
    assert isinstance(plan, prune.PrunePlan)
    assert plan.groups == (prune.PruneGroup(h200, "NVIDIA H200", "0.7.2.post1", "tp2/rank0", 1),)
    assert plan.versions(ENTRY_KIND) == plan.entry_versions and plan.total == 1
    with (
        Registry.open(str(tmp_path / "other.db")) as other,
        pytest.raises(ValueError, match="this plan was made for"),
    ):
        plan.execute(other)
    result = plan.execute(reg)
    assert (result.removed, reg.log()[0].kind) == (1, "prune")
    assert len(current(reg)) == 2


def test_prune_conditions_show_every_criterion() -> None:
    from ficache.prune import prune_conditions

    conditions, criteria = prune_conditions([3, 1], ["0.7.2", "0.6"], 90.0, "shared", 86400.0, 1e9)

    assert len(conditions) == 5
    assert criteria == [
        ("fingerprint", "1,3"),
        ("flashinfer_version", "0.6,0.7.2"),
        ("older_than_seconds", "90"),
        ("scope", "shared"),
        ("unused_for_seconds", "86400"),
    ]
    assert prune_conditions([], [], None, None, 1.5, 0.0)[1] == [("unused_for_seconds", "1.5")]


def test_export_file_of_a_stored_fingerprint_and_of_current(reg: Registry, monkeypatch) -> None:
    import ficache.fingerprint
    from ficache.exporting import export_file, source_fingerprint_ids

    reg.write(
        [entry(H200, 16, 1), entry(H200, 32, 2, scope="tp2/rank0"), entry(B200, 16, 3)],
        kind="import",
    )
    h200 = fid(reg, H200)

    stored = export_file(reg, h200, scope="tp2/rank0")

    assert (stored.text, stored.entries) == reg.export_text(h200, scope="tp2/rank0")
    assert stored.fingerprint_ids == (h200,) and stored.entries == 2
    assert source_fingerprint_ids(reg, h200) == [h200]
    monkeypatch.setattr(ficache.fingerprint, "collect", lambda: H200)
    now = export_file(reg, "current")
    assert (now.text, now.entries) == reg.export_for(H200)
    assert now.fingerprint_ids == tuple(i.id for i in reg.serving(H200))
    assert source_fingerprint_ids(reg, "current") == list(now.fingerprint_ids)
    monkeypatch.setattr(ficache.fingerprint, "collect", lambda: H200_OLD)
    with pytest.raises(NotFoundError, match="no stored fingerprint serves"):
        export_file(reg, "current")
