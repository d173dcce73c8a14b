"""``ficache verify``: a healthy registry is clean, and each kind of damage made
behind ficache's back with plain SQL is found, read-only.

Every problem kind verify reports is the expected finding of a damage case on
each backend (``test_every_kind_is_found_by_a_damage_case_on_each_backend``):
``DAMAGE`` and ``RECORD_DAMAGE`` run on both, ``DAMAGE_ON_ONE_BACKEND`` on the
one that can hold it, and ``OTHER_DAMAGE_CASES`` names the tests that damage
files and indexes. A duplicate entry is refused by the unique constraint on both
backends; it is found once the constraint is gone. On PostgreSQL a B-tree leaf
page of the registry is damaged on disk and ``amcheck`` finds it.

Tests marked ``@both_backends`` run on SQLite and on PostgreSQL (the PostgreSQL
cases in ``tox -e postgres``); those marked ``postgres`` only there; the others
are about SQLite files."""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import struct
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pg_server
import pytest
import reliability_log
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError
from sqlalchemy.pool import NullPool

from ficache import schema
from ficache.errors import RegistryDamagedError
from ficache.fingerprint import Fingerprint
from ficache.merge import open_source, plan_merge
from ficache.protocol_records import NewProtocolRecord
from ficache.records import NewRecord
from ficache.registry import NewEntry, Registry
from ficache.verify import KINDS, Checked, Problem, VerifyReport, verify

HEAD = schema.head_revision()
DATA = Path(__file__).resolve().parent / "data"
FIELDS = {
    "flashinfer_version": "0.7.2.post1",
    "cuda_version": "12.9",
    "cublas_version": "12.9.1",
    "cudnn_version": "91002",
    "cudnn_frontend_version": "1.32.0",
    "cutlass_dsl_version": "nvidia-cutlass-dsl==4.8.1",
}
H200 = Fingerprint(**FIELDS, gpu="NVIDIA H200")
B200 = Fingerprint(**FIELDS, gpu="NVIDIA B200")
POLICY = '["cuda_graph_profile_replays",null,"l2_cache_policy","hot"]'
AMCHECK_NOTE = (
    "PostgreSQL: the amcheck extension is not installed, so index structure was not checked "
    "(CREATE EXTENSION amcheck enables it)"
)

#: Runs a test on SQLite and on PostgreSQL: ``registry_db`` and ``cli`` follow ``backend``.
both_backends = pytest.mark.usefixtures("backend")


def key(m: int) -> str:
    return str(
        ("flashinfer::mm_fp4", "CutlassRunner", ((m, 4096), (4096, 2048)), ("torch.bfloat16",))
    )


def new(
    fp: Fingerprint, m: int, tactic: str, scope: str = "shared", policy: str | None = None
) -> NewEntry:
    return NewEntry(fp, key(m), "CutlassRunner", tactic, policy, scope)


def build(db: str) -> None:
    """Six commits through the registry's three write paths (``write``, prune,
    revert) under every commit kind.

    Ids (the same on both backends): fingerprints H200 1, B200 2. Entries
    1 H200 m16, 2 m32, 3 m64 (removed by commit 3, re-added by commit 5 as
    ``READDED``, an id the backends could give differently), 4 H200 m16
    tp2/rank1, 5 and 6 B200 (pruned by commit 4), 7 H200 m128, 8 H200 m256
    tp2/rank0 (removed by commit 5). Policy 1 is m64's.
    Commits: 1 import (6 added, changes 1-6), 2 merge (changes 7 added m128,
    8 replaced m32), 3 startup (9 added m256 tp2/rank0, 10 removed m64),
    4 prune of B200 (11, 12), 5 revert of 3 (13 removed m256, 14 added m64),
    6 import (15 replaced m16).
    """
    with Registry.open(db) as reg:
        reg.write(
            [
                new(H200, 16, "[1,[2,3]]"),
                new(H200, 32, "4"),
                new(H200, 64, "5", policy=POLICY),
                new(H200, 16, "6", scope="tp2/rank1"),
                new(B200, 16, "7"),
                new(B200, 32, "8"),
            ],
            kind="import",
            message="h200.json, b200.json",
        )
        reg.write([new(H200, 128, "9"), new(H200, 32, "10")], kind="merge")
        startup = reg.write(
            [new(H200, 256, "11", scope="tp2/rank0")],
            kind="startup",
            removals=[(H200, "shared", key(64))],
            world_size=2,
            layout="tp2",
            provenance={"protocol": "ficache.warm_start"},
        )
        assert startup.commit_id == 3
        assert reg.plan_prune(fingerprint_ids=[2]).execute(reg).commit_id == 4
        assert reg.revert(3).commit_id == 5
        assert reg.write([new(H200, 16, "[12]")], kind="import").commit_id == 6


#: The id of the m64 entry commit 5 re-added: SQLite gives the largest rowid
#: plus one, PostgreSQL the sequence's next value. They agree (9) because the
#: revert's write inserts m64 before it removes entry 8 (m256).
READDED = {"sqlite": 9, "postgres": 9}


def display(db: str) -> str:
    return db if not db.startswith("postgresql") else make_url(db).render_as_string()


def behind_the_back(db: str, *statements: str) -> None:
    """Run SQL on the registry as a shell or a restore tool would, foreign keys off."""
    if db.startswith("postgresql"):
        engine = create_engine(db, poolclass=NullPool)
        try:
            with engine.begin() as conn:
                conn.exec_driver_sql("SET LOCAL session_replication_role = replica")
                for statement in statements:
                    conn.exec_driver_sql(statement)
        finally:
            engine.dispose()
        return
    conn = sqlite3.connect(db)  # foreign keys are off unless a connection turns them on
    try:
        with conn:
            for statement in statements:
                conn.execute(statement)
    finally:
        conn.close()


def files_of(path: Path) -> tuple[bytes, bytes]:
    """The registry file's bytes and its WAL's (none: empty). A read-only WAL reader may
    create an empty ``-wal`` and the ``-shm`` (shared memory, not data); nothing else."""
    wal = Path(f"{path}-wal")
    return path.read_bytes(), wal.read_bytes() if wal.exists() else b""


def short(text: str) -> str:
    """How a report quotes a long key: its first 80 characters."""
    return repr(text[:80] + "...")


# -- healthy registries ---------------------------------------------------------------


@both_backends
def test_a_healthy_registry_is_clean(cli, registry_db: str, backend: str, dump_db) -> None:
    build(registry_db)
    before = dump_db(registry_db)

    result = cli("verify")

    dialect = "sqlite" if backend == "sqlite" else "postgresql"
    notes = f"note: {AMCHECK_NOTE}\n" if backend == "postgres" else ""
    assert (result.exit_code, result.stderr) == (0, "")
    assert result.stdout == (
        f"registry {display(registry_db)} ({dialect}, schema {HEAD}), checked read-only\n"
        "checked 2 fingerprints, 5 entries, 6 commits, 15 changes\n"
        f"{notes}"
        "ok: no problems\n"
    )
    assert dump_db(registry_db) == before


@both_backends
def test_the_library_report(registry_db: str, backend: str) -> None:
    build(registry_db)

    report = verify(registry_db)

    assert report == VerifyReport(
        display(registry_db),
        "sqlite" if backend == "sqlite" else "postgresql",
        HEAD,
        HEAD,
        Checked(fingerprints=2, entries=5, commits=6, changes=15, policies=1),
        (),
        (AMCHECK_NOTE,) if backend == "postgres" else (),
    )
    assert report.ok
    assert report.counts == ()


@both_backends
def test_real_imports_merges_prunes_and_reverts_stay_clean(
    cli, cache_file, registry_db: str
) -> None:
    meta = {**FIELDS, "gpu": "NVIDIA H200"}
    first = cache_file(
        "a.json",
        {key(16): ["CutlassRunner", [1, 2]], key(32): ["CutlassRunner", 3, [1, None]]},
        metadata=meta,
    )
    second = cache_file(
        "b.json", {key(16): ["CutlassRunner", [9, 9]], key(64): ["CutlassRunner", 5]}, metadata=meta
    )
    assert cli("import", first).exit_code == 0
    with Registry.open(registry_db) as reg:
        merged = plan_merge(reg, [open_source(second)], "theirs").execute(reg)
        assert (merged.added, merged.replaced) == (1, 1)
        assert plan_merge(reg, [open_source(second)], "theirs").execute(reg).commit_id is None
    assert cli("revert", "2", "--yes").exit_code == 0
    assert cli("prune", "--scope", "shared", "--yes").exit_code == 0
    assert cli("revert", "4", "--yes").exit_code == 0

    result = cli("verify", "--format", "json")

    assert (result.exit_code, result.stderr) == (0, "")
    data = json.loads(result.stdout)
    assert (data["ok"], data["checked"], data["problems"]) == (
        True,
        {
            "fingerprints": 1,
            "entries": 2,
            "commits": 5,
            "changes": 10,
            "records": 0,
            "record_changes": 0,
            "policies": 1,
        },
        [],
    )


@pytest.mark.parametrize("frozen", sorted(DATA.glob("registry-*.db")), ids=lambda p: p.stem)
def test_every_frozen_registry_upgraded_to_head_is_clean(frozen: Path, tmp_path: Path) -> None:
    path = tmp_path / frozen.name
    shutil.copyfile(frozen, path)
    Registry.open(str(path)).close()  # upgrades it, recovering history (0002's backfill)

    report = verify(str(path))

    # Registries made at 0003_records and later hold two records, each added once; from
    # 0009_protocol_records on, a fifth commit adds two protocol records.
    # From 0010_measurement_fingerprints on, a sixth adds the H200 under cold_l2: one
    # fingerprint, one entry and one protocol record more.
    records = 2 if frozen.stem >= "registry-0003" else 0
    measured = frozen.stem >= "registry-0010"
    protocol = (2 if frozen.stem >= "registry-0009" else 0) + measured
    assert (report.problems, report.checked) == (
        (),
        Checked(
            fingerprints=2 + measured,
            entries=4 + measured,
            commits=4 + (protocol > 0) + measured,
            changes=7 + measured,
            records=records,
            record_changes=records,
            policies=1,
            protocol_records=protocol,
            protocol_changes=protocol,
        ),
    )


def test_an_older_registry_is_reported_not_upgraded(cli, tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    shutil.copyfile(DATA / "registry-0001_registry.db", path)
    before = files_of(path)

    result = cli("verify", db=path)

    assert (result.exit_code, result.stderr) == (1, "")
    assert result.stdout == (
        f"registry {path} (sqlite, schema 0001_registry), checked read-only\n"
        "note: data checks skipped: they need the schema at head\n"
        "1 problem:\n"
        "schema_revision: 1\n"
        f"  schema is at 0001_registry, head is {HEAD}; upgrade it (ficache db upgrade)\n"
    )
    assert files_of(path) == before


WRITER_UNTIL_STOPPED = """
import sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from ficache.registry import Registry
from test_verify import new, H200
stop = Path({stop!r})
with Registry.open({db!r}) as reg:
    deadline = time.monotonic() + 120
    i = 0
    while not stop.exists() and time.monotonic() < deadline:
        i += 1
        reg.write([new(H200, m, str(i)) for m in range(1, 40)], kind="import")
        if i % 3 == 0:
            reg.revert(reg.plan_prune(scope="shared").execute(reg).commit_id)
        Path({started!r}).touch()
"""


def commits(report: VerifyReport) -> int:
    return report.checked.commits if report.checked is not None else 0


@both_backends
def test_verify_is_clean_while_a_writer_commits(
    registry_db: str, backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    build(registry_db)
    started, stop = tmp_path / "started", tmp_path / "stop"
    script = WRITER_UNTIL_STOPPED.format(
        tests=str(Path(__file__).resolve().parent),
        db=registry_db,
        started=str(started),
        stop=str(stop),
    )
    writer = subprocess.Popen([sys.executable, "-c", script])
    try:
        while not started.exists():  # the writer is importing; wait for its first commit
            assert writer.poll() is None, "the writer died before its first commit"
            time.sleep(0.05)
        reports = [verify(registry_db)]
        while commits(reports[-1]) < commits(reports[0]) + 10 and len(reports) < 500:
            reports.append(verify(registry_db))  # each while the writer commits
    finally:
        stop.touch()
        try:
            assert writer.wait(timeout=150) == 0
        finally:
            writer.kill()

    assert [r.problems for r in reports] == [()] * len(reports)
    first, last = commits(reports[0]), commits(reports[-1])
    assert first > 6 and last >= first + 10  # the writer committed before and while they ran
    assert verify(registry_db).ok
    reliability_log.record(
        item="2. verify",
        test=request.node.nodeid,
        backend=backend,
        applied=f"{len(reports)} verifies while a writer made {last - first} commits",
        outcome=f"{len(reports)}/{len(reports)} clean (one snapshot each)",
        ok=True,
        figures={"verifies": len(reports), "commits_meanwhile": last - first},
    )


# -- damage ----------------------------------------------------------------------------

#: A policy as no writer stores it (not canonical JSON), with its SHA-256 (so only its text is off).
OTHER_POLICY = '[ "hot" ]'
OTHER_DIGEST = hashlib.sha256(OTHER_POLICY.encode()).hexdigest()
CANON_DIGEST = hashlib.sha256(b"[1]").hexdigest()

#: ``(statements, {kind: count}, the first problem's message)``, made on ``build``'s registry.
DAMAGE = {
    "unparsable key": (
        [
            "UPDATE entries SET key = 'mm(16)' WHERE id = 7",
            "UPDATE entry_changes SET key = 'mm(16)' WHERE id = 7",
        ],
        {"bad_key": 2},
        "change 7: key 'mm(16)' does not parse: trailing text after the key tuple at offset 2",
    ),
    "key columns": (
        ["UPDATE entries SET op = 'other' WHERE id = 2"],
        {"key_columns": 1},
        f"entry 2: op differs from its key {short(key(32))}",
    ),
    "missing policy": (
        ["DELETE FROM policies"],
        {"orphan_entry": 1, "orphan_change": 3},
        "entry {readded}: policy 1 is missing",
    ),
    "policy digest": (
        ["UPDATE policies SET digest = 'abc'"],
        {"policy_digest": 1},
        "policy 1: digest 'abc' is not the SHA-256 of its text",
    ),
    "policy not canonical": (
        [f"UPDATE policies SET policy = '{OTHER_POLICY}', digest = '{OTHER_DIGEST}'"],
        {"bad_json": 1},
        f"policy 1: {OTHER_POLICY!r} is not canonical JSON",
    ),
    "entry names another policy": (
        [
            f"INSERT INTO policies (id, digest, policy) VALUES (2, '{CANON_DIGEST}', '[1]')",
            "UPDATE entries SET policy_id = 2 WHERE policy_id = 1",
        ],
        {"entry_value": 1},
        "entry {readded}: value differs from the one commit 5 wrote",
    ),
    "missing commit": (
        ["DELETE FROM commits WHERE id = 6"],
        {"orphan_entry": 1, "orphan_change": 1},
        "entry 1: commit 6 is missing",
    ),
    "entry names another commit": (
        ["UPDATE entries SET commit_id = 1 WHERE id = 2"],
        {"entry_unlogged": 1},
        "entry 2 names commit 1, its last change is in commit 2",
    ),
    "count mismatch": (
        ["UPDATE commits SET added = 5, removed = 1 WHERE id = 1"],
        {"commit_counts": 1},
        "commit 1 has 6 added (the commit says 5), 0 removed (the commit says 1)",
    ),
    "value differs from the log": (
        ["UPDATE entries SET tactic = '99' WHERE id = 7"],
        {"entry_value": 1},
        "entry 7: value differs from the one commit 2 wrote",
    ),
    "lost entry": (
        ["DELETE FROM entries WHERE id = 4"],
        {"entry_lost": 1},
        "commit 1 wrote an entry that is missing (fingerprint 1, scope tp2/rank1, "
        f"key {short(key(16))})",
    ),
    "digest mismatch": (
        ["UPDATE fingerprints SET gpu = 'NVIDIA H100' WHERE id = 1"],
        {"fingerprint_digest": 1},
        f"fingerprint 1: digest {H200.digest[:12]} is not its fields' "
        f"{Fingerprint(**FIELDS, gpu='NVIDIA H100').digest[:12]}",
    ),
    "orphan change rows": (  # B200's entries were pruned; its row deleted by hand
        ["DELETE FROM fingerprints WHERE id = 2"],
        {"orphan_change": 4},
        "change 5: fingerprint 2 is missing",
    ),
    "unknown scope": (
        [
            "UPDATE entries SET scope = 'tp2/rank01' WHERE id = 4",
            "UPDATE entry_changes SET scope = 'tp2/rank01' WHERE id = 4",
        ],
        {"bad_scope": 2},
        "change 4: scope 'tp2/rank01' is invalid",
    ),
    "tactic not canonical": (
        [
            "UPDATE entries SET tactic = '[12, 1]' WHERE id = 1",
            "UPDATE entry_changes SET new_tactic = '[12, 1]' WHERE id = 15",
        ],
        {"bad_json": 2},
        "change 15: new tactic '[12, 1]' is not canonical JSON",
    ),
    "commit with no changes": (
        [
            "INSERT INTO commits (id, created_at, kind, host, added, replaced, removed) "
            "VALUES (7, 0, 'import', 'h', 0, 0, 0)"
        ],
        {"empty_commit": 1},
        "commit 7 has no changes",
    ),
    "unknown commit kind": (
        ["UPDATE commits SET kind = 'magic' WHERE id = 2"],
        {"bad_commit": 1},
        "commit 2: unknown kind 'magic'",
    ),
    "revert of another commit": (
        ["UPDATE commits SET reverts_commit_id = 2 WHERE id = 5"],
        {"revert_mismatch": 1},
        "commit 5 reverts commit 2, but 4 of its entries do not undo it",
    ),
    "old value contradicts the log": (
        ["UPDATE entry_changes SET old_tactic = '3' WHERE id = 15"],
        {"log_inconsistent": 1},
        "change 15 (commit 6): old value is not the one commit 1 wrote",
    ),
    "change deleted": (
        ["DELETE FROM entry_changes WHERE id = 8", "UPDATE commits SET replaced = 0 WHERE id = 2"],
        {"entry_unlogged": 1},
        "entry 2 names commit 2, its last change is in commit 1",
    ),
    "change moved to an earlier commit": (
        ["UPDATE entry_changes SET commit_id = 1 WHERE id = 15"],
        {"log_inconsistent": 1, "commit_counts": 2, "entry_unlogged": 1},
        "change 15 of commit 1 follows changes of commit 5",
    ),
    "extra index": (
        ["CREATE INDEX ix_entries_scope ON entries (scope)"],
        {"schema_drift": 1},
        "unexpected index entries.ix_entries_scope",
    ),
    "unknown change action": (  # change 7 added m128 in commit 2: the log no longer holds it
        ["UPDATE entry_changes SET action = 'moved' WHERE id = 7"],
        {"bad_change": 1, "commit_counts": 1, "entry_unlogged": 1},
        "change 7: unknown action 'moved'",
    ),
    "two changes to one entry in a commit": (  # commit 6 replaces m16 twice, counted
        [
            "INSERT INTO entry_changes (commit_id, fingerprint_id, scope, key, action, "
            "old_runner, old_tactic, old_commit_id, new_runner, new_tactic) "
            "SELECT commit_id, fingerprint_id, scope, key, action, new_runner, new_tactic, "
            "commit_id, new_runner, new_tactic FROM entry_changes WHERE id = 15",
            "UPDATE commits SET replaced = 2 WHERE id = 6",
        ],
        {"bad_change": 1},
        "change 16: a second change to its entry in commit 6",
    ),
    "added change with an old value": (
        ["UPDATE entry_changes SET old_runner = 'CutlassRunner', old_tactic = '1' WHERE id = 7"],
        {"bad_change": 1},
        "change 7: an added entry with an old value",
    ),
    "replaced change without its old value": (  # and so unlike the value commit 1 wrote
        ["UPDATE entry_changes SET old_runner = NULL, old_tactic = NULL WHERE id = 15"],
        {"bad_change": 1, "log_inconsistent": 1},
        "change 15: a replaced entry without its old value",
    ),
    "removed change with a new value": (  # change 10 removed m64 in commit 3
        ["UPDATE entry_changes SET new_runner = 'CutlassRunner', new_tactic = '5' WHERE id = 10"],
        {"bad_change": 1},
        "change 10: a removed entry with a new value",
    ),
    "selection not canonical": (
        ["UPDATE entries SET selection = '{ }' WHERE id = 7"],
        {"bad_selection": 1},
        "entry 7: selection '{ }' is not canonical JSON",
    ),
}


@both_backends
@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_damage_is_found_read_only(
    cli, registry_db: str, backend: str, dump_db, damage: str, request: pytest.FixtureRequest
) -> None:
    build(registry_db)
    found_read_only(cli, registry_db, backend, dump_db, damage, *DAMAGE[damage], request)


#: Damage one backend can hold: ``{name: (backend, statements, {kind: count}, first message)}``.
DAMAGE_ON_ONE_BACKEND = {
    # All of the registry's foreign keys are the orphan checks'; one a hand-added column
    # declares is reported as a foreign key violation (and the column as drift). On
    # PostgreSQL the same column is drift only: verify does not read PostgreSQL's keys
    # row by row, it checks that PostgreSQL enforces them (below).
    "foreign key of an added column": (
        "sqlite",
        [
            "ALTER TABLE commits ADD COLUMN fingerprint_id INTEGER REFERENCES fingerprints (id)",
            "UPDATE commits SET fingerprint_id = 99 WHERE id = 1",
        ],
        {"foreign_key": 1, "schema_drift": 2},  # the column, and its foreign key
        "commits row 1 refers to a missing fingerprints row",
    ),
    "foreign key not validated": (
        "postgres",
        [
            "UPDATE pg_constraint SET convalidated = false "
            "WHERE conrelid = 'entries'::regclass AND conname = 'entries_commit_id_fkey'"
        ],
        {"foreign_key": 1},
        "constraint entries_commit_id_fkey of entries is not validated",
    ),
    "index marked invalid": (
        "postgres",
        [
            "UPDATE pg_index SET indisvalid = false "
            "WHERE indexrelid = 'ix_entry_changes_commit_id'::regclass"
        ],
        {"integrity": 1},
        "index ix_entry_changes_commit_id of entry_changes is invalid; REINDEX it",
    ),
}


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(name, id=name, marks=[pytest.mark.postgres] if on == "postgres" else [])
        for name, (on, *_case) in DAMAGE_ON_ONE_BACKEND.items()
    ],
)
def test_damage_one_backend_can_hold_is_found_read_only(
    cli, registry_path: Path, dump_db, damage: str, request: pytest.FixtureRequest
) -> None:
    backend, *case = DAMAGE_ON_ONE_BACKEND[damage]
    db = (
        str(request.getfixturevalue("postgres_url"))
        if backend == "postgres"
        else str(registry_path)
    )
    build(db)
    found_read_only(cli, db, backend, dump_db, damage, *case, request)


def found_read_only(
    cli,
    registry_db: str,
    backend: str,
    dump_db,
    damage: str,
    statements: list[str],
    counts: dict[str, int],
    first: str,
    request: pytest.FixtureRequest,
) -> None:
    """Apply ``statements`` behind the registry's back; verify finds exactly ``counts``,
    ``first`` first, in the library and the CLI (exit 1), and changes nothing."""
    behind_the_back(registry_db, *statements)
    before = dump_db(registry_db)
    first = first.replace("{readded}", str(READDED[backend]))

    report = verify(registry_db)
    result = cli("verify", db=registry_db)

    assert dict(report.counts) == counts
    assert report.problems[0].message == first
    assert all(p.kind in KINDS for p in report.problems)
    assert (result.exit_code, result.stderr) == (1, "")
    lines = result.stdout.splitlines()
    found = len(report.problems)
    header = 1 + (report.checked is not None) + len(report.notes)  # registry, checked, notes
    assert lines[header] == f"{found} problem{'s' if found > 1 else ''}:"
    assert f"  {first}" in lines
    assert dump_db(registry_db) == before
    reliability_log.record(
        item="2. verify",
        test=request.node.nodeid,
        backend=backend,
        applied=f"{damage}, by plain SQL: {'; '.join(statements)}",
        outcome=(
            f"found: {', '.join(f'{k} {n}' for k, n in sorted(counts.items()))}; exit 1; "
            "registry unchanged"
        ),
        ok=True,
        figures={"problems": found},
    )


@both_backends
def test_an_older_revision_is_reported_and_skips_the_data_checks(
    cli, registry_db: str, dump_db
) -> None:
    build(registry_db)
    behind_the_back(registry_db, "UPDATE alembic_version SET version_num = '0001_registry'")
    before = dump_db(registry_db)

    report = verify(registry_db)
    result = cli("verify")

    assert (report.counts, report.checked) == ((("schema_revision", 1),), None)
    assert report.problems[0].message == (
        f"schema is at 0001_registry, head is {HEAD}; upgrade it (ficache db upgrade)"
    )
    assert (result.exit_code, result.stderr) == (1, "")
    assert "schema_revision: 1" in result.stdout.splitlines()
    assert dump_db(registry_db) == before


def build_records(db: str) -> None:
    """``build``'s registry, then commit 7: two records of H200 (1 ``ns/a``, 2 ``ns/b``),
    and commit 8: record 1 replaced (record changes 1, 2 added; 3 replaced)."""
    build(db)
    with Registry.open(db) as reg:
        reg.write(
            [],
            kind="import",
            records=[NewRecord(H200, "ns", "a", "1"), NewRecord(H200, "ns", "b", '{"x":2}')],
        )
        reg.write([], kind="import", records=[NewRecord(H200, "ns", "a", "3")])


#: Damage to the records tables: ``(statements, {kind: count}, the first problem's message)``.
RECORD_DAMAGE = {
    "record of a missing fingerprint": (
        ["UPDATE records SET fingerprint_id = 7 WHERE id = 2"],
        {"orphan_record": 1, "record_unlogged": 2},
        "record 2: fingerprint 7 is missing",
    ),
    "record value not canonical": (
        ["UPDATE records SET value = '{\"x\": 2}' WHERE id = 2"],
        {"bad_record": 1, "record_unlogged": 1},
        "record 2: record value '{\"x\": 2}' is not canonical JSON",
    ),
    "record counts": (
        ["UPDATE commits SET records_replaced = 0 WHERE id = 8"],
        {"record_counts": 1},
        "commit 8 has record changes: 1 replaced (the commit says 0)",
    ),
    "record value differs from the log": (
        ["UPDATE records SET value = '4' WHERE id = 1"],
        {"record_unlogged": 1},
        "record 1 is not what commit 8 wrote",
    ),
}


@both_backends
@pytest.mark.parametrize("damage", RECORD_DAMAGE, ids=list(RECORD_DAMAGE))
def test_damage_to_records_is_found_read_only(
    cli, registry_db: str, backend: str, dump_db, damage: str, request: pytest.FixtureRequest
) -> None:
    build_records(registry_db)
    assert verify(registry_db).ok
    found_read_only(cli, registry_db, backend, dump_db, damage, *RECORD_DAMAGE[damage], request)


#: Damage to a record revert (``build_records`` and commit 9, the revert of commit 8: record
#: change 4 replaces record 1's 3 by 1 again): ``(statements, {kind: count}, first message)``.
RECORD_REVERT_DAMAGE = {
    "record revert writes back another value": (
        [
            "UPDATE record_changes SET new_value = '4' WHERE id = 4",
            "UPDATE records SET value = '4' WHERE id = 1",
        ],
        {"record_revert_mismatch": 1},
        "commit 9 reverts commit 8, but 1 of its records do not undo it",
    ),
    "record revert of another commit": (  # commit 7 added records 1 and 2; 9 replaced 1
        ["UPDATE commits SET reverts_commit_id = 7 WHERE id = 9"],
        {"record_revert_mismatch": 1},
        "commit 9 reverts commit 7, but 2 of its records do not undo it",
    ),
}


@both_backends
@pytest.mark.parametrize("damage", RECORD_REVERT_DAMAGE, ids=list(RECORD_REVERT_DAMAGE))
def test_a_record_revert_that_does_not_invert_its_target_is_found(
    cli, registry_db: str, backend: str, dump_db, damage: str, request: pytest.FixtureRequest
) -> None:
    """As for entries: a revert's record changes are the inverse of its target's."""
    build_records(registry_db)
    with Registry.open(registry_db) as reg:
        assert reg.revert(8).records_replaced == 1
    assert verify(registry_db).ok
    statements, counts, first = RECORD_REVERT_DAMAGE[damage]
    found_read_only(cli, registry_db, backend, dump_db, damage, statements, counts, first, request)


def build_protocol(db: str) -> None:
    """``build``'s registry, then commit 7: two protocol records of H200 (``moe/a`` 1 with
    ``POLICY``, ``moe/b`` {"x":2}), and commit 8: protocol record 1 replaced by 3
    (protocol record changes 1, 2 added; 3 replaced)."""
    build(db)
    with Registry.open(db) as reg:
        reg.write(
            [],
            kind="import",
            protocol_records=[
                NewProtocolRecord(H200, "moe", "a", "1", POLICY),
                NewProtocolRecord(H200, "moe", "b", '{"x":2}'),
            ],
        )
        reg.write(
            [], kind="import", protocol_records=[NewProtocolRecord(H200, "moe", "a", "3", POLICY)]
        )


#: Damage to the protocol records' tables: ``(statements, {kind: count}, first message)``.
PROTOCOL_DAMAGE = {
    "protocol record of a missing fingerprint": (
        ["UPDATE protocol_records SET fingerprint_id = 7 WHERE id = 2"],
        {"orphan_protocol": 1, "protocol_unlogged": 2},
        "protocol record 2: fingerprint 7 is missing",
    ),
    "protocol record value not canonical": (
        ["UPDATE protocol_records SET value = '{\"x\": 2}' WHERE id = 2"],
        {"bad_protocol": 1, "protocol_unlogged": 1},
        "protocol record 2: value '{\"x\": 2}' is not canonical JSON",
    ),
    "protocol record counts": (
        ["UPDATE commits SET protocol_replaced = 0 WHERE id = 8"],
        {"protocol_counts": 1},
        "commit 8 has protocol record changes: 1 replaced (the commit says 0)",
    ),
    "protocol record value differs from the log": (
        ["UPDATE protocol_records SET value = '4' WHERE id = 1"],
        {"protocol_unlogged": 1},
        "protocol record 1 is not what commit 8 wrote",
    ),
    "protocol record policy differs from the log": (
        ["UPDATE protocol_records SET policy_id = NULL WHERE id = 1"],
        {"protocol_unlogged": 1},
        "protocol record 1 is not what commit 8 wrote",
    ),
}


@both_backends
@pytest.mark.parametrize("damage", PROTOCOL_DAMAGE, ids=list(PROTOCOL_DAMAGE))
def test_damage_to_protocol_records_is_found_read_only(
    cli, registry_db: str, backend: str, dump_db, damage: str, request: pytest.FixtureRequest
) -> None:
    """A good registry with protocol records is clean; each tampered row is found."""
    build_protocol(registry_db)
    report = verify(registry_db)
    assert (report.problems, report.checked.protocol_records, report.checked.protocol_changes) == (
        (),
        2,
        3,
    )
    found_read_only(cli, registry_db, backend, dump_db, damage, *PROTOCOL_DAMAGE[damage], request)


#: Damage to a protocol record revert (``build_protocol`` and commit 9, the revert of commit 8).
PROTOCOL_REVERT_DAMAGE = {
    "protocol revert writes back another value": (
        [
            "UPDATE protocol_record_changes SET new_value = '4' WHERE id = 4",
            "UPDATE protocol_records SET value = '4' WHERE id = 1",
        ],
        {"protocol_revert_mismatch": 1},
        "commit 9 reverts commit 8, but 1 of its protocol records do not undo it",
    ),
}


@both_backends
@pytest.mark.parametrize("damage", PROTOCOL_REVERT_DAMAGE, ids=list(PROTOCOL_REVERT_DAMAGE))
def test_a_protocol_revert_that_does_not_invert_its_target_is_found(
    cli, registry_db: str, backend: str, dump_db, damage: str, request: pytest.FixtureRequest
) -> None:
    build_protocol(registry_db)
    with Registry.open(registry_db) as reg:
        assert reg.revert(8).protocol_replaced == 1
    assert verify(registry_db).ok
    statements, counts, first = PROTOCOL_REVERT_DAMAGE[damage]
    found_read_only(cli, registry_db, backend, dump_db, damage, statements, counts, first, request)


#: A second entry with entry 7's identity (H200, shared, m128), as a restore tool might insert it.
DUPLICATE_ENTRY = (
    "INSERT INTO entries (fingerprint_id, scope, key, op, runner, tactic, policy_id, commit_id, "
    "updated_at, tuned_at) SELECT fingerprint_id, scope, key, op, runner, tactic, policy_id, "
    "commit_id, updated_at, tuned_at FROM entries WHERE id = 7"
)


def without_the_unique_constraint(db: str) -> list[str]:
    """Statements that drop entries' unique constraint: PostgreSQL drops it; SQLite cannot
    drop a table's constraint, so the table is rebuilt without it (as a hand-made copy would)."""
    if db.startswith("postgresql"):
        return ["ALTER TABLE entries DROP CONSTRAINT uq_entries_fingerprint_scope_key"]
    with closing(sqlite3.connect(db)) as conn:
        [create] = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'entries'").fetchone()
    unique = (
        ' \n\tCONSTRAINT uq_entries_fingerprint_scope_key UNIQUE (fingerprint_id, scope, "key"),'
    )
    assert unique in create
    return [
        create.replace(unique, "").replace("CREATE TABLE entries", "CREATE TABLE entries_copy"),
        "INSERT INTO entries_copy SELECT * FROM entries",
        "DROP TABLE entries",
        "ALTER TABLE entries_copy RENAME TO entries",
    ]


@both_backends
def test_a_duplicate_entry_is_refused_and_found_once_the_constraint_is_gone(
    cli, registry_db: str, dump_db
) -> None:
    build(registry_db)
    before = dump_db(registry_db)
    # The unique constraint makes a duplicate impossible while it stands: the database refuses it.
    with pytest.raises((sqlite3.IntegrityError, IntegrityError), match="(?i)unique"):
        behind_the_back(registry_db, DUPLICATE_ENTRY)
    assert dump_db(registry_db) == before
    assert verify(registry_db).ok

    behind_the_back(registry_db, *without_the_unique_constraint(registry_db), DUPLICATE_ENTRY)
    report = verify(registry_db)
    result = cli("verify")

    assert dict(report.counts) == {"schema_drift": 1, "duplicate_entry": 1}
    [drift] = report.examples("schema_drift", 1)
    assert "uq_entries_fingerprint_scope_key" in drift.message
    [duplicate] = report.examples("duplicate_entry", 1)
    assert duplicate.row_id not in (None, 7)
    assert duplicate.message == (
        f"entry {duplicate.row_id} repeats entry 7 (fingerprint 1, scope shared, "
        f"key {short(key(128))})"
    )
    assert (result.exit_code, result.stderr) == (1, "")
    assert "duplicate_entry: 1" in result.stdout.splitlines()


@both_backends
def test_the_text_report_shows_each_kind_with_a_count_and_examples(
    cli, registry_db: str, backend: str
) -> None:
    build(registry_db)
    behind_the_back(
        registry_db,
        "UPDATE commits SET added = added + 1",
        "UPDATE fingerprints SET gpu = 'NVIDIA H100' WHERE id = 1",
    )

    result = cli("verify")

    notes = f"note: {AMCHECK_NOTE}\n" if backend == "postgres" else ""
    dialect = "sqlite" if backend == "sqlite" else "postgresql"
    h100 = Fingerprint(**FIELDS, gpu="NVIDIA H100").digest[:12]
    assert (result.exit_code, result.stderr) == (1, "")
    assert result.stdout == (
        f"registry {display(registry_db)} ({dialect}, schema {HEAD}), checked read-only\n"
        "checked 2 fingerprints, 5 entries, 6 commits, 15 changes\n"
        f"{notes}"
        "7 problems:\n"
        "fingerprint_digest: 1\n"
        f"  fingerprint 1: digest {H200.digest[:12]} is not its fields' {h100}\n"
        "commit_counts: 6\n"
        "  commit 1 has 6 added (the commit says 7)\n"
        "  commit 2 has 1 added (the commit says 2)\n"
        "  commit 3 has 1 added (the commit says 2)\n"
        "  ... and 3 more\n"
    )


@both_backends
def test_the_json_report(cli, registry_db: str, backend: str) -> None:
    build(registry_db)
    behind_the_back(registry_db, "UPDATE entries SET tactic = '99' WHERE id = 7")

    result = cli("verify", "--format", "json")

    assert (result.exit_code, result.stderr) == (1, "")
    assert json.loads(result.stdout) == {
        "registry": display(registry_db),
        "backend": "sqlite" if backend == "sqlite" else "postgresql",
        "read_only": True,
        "revision": HEAD,
        "head": HEAD,
        "ok": False,
        "checked": {
            "fingerprints": 2,
            "entries": 5,
            "commits": 6,
            "changes": 15,
            "records": 0,
            "record_changes": 0,
            "policies": 1,
        },
        "counts": {"entry_value": 1},
        "problems": [
            {
                "kind": "entry_value",
                "table": "entries",
                "id": 7,
                "message": "entry 7: value differs from the one commit 2 wrote",
            }
        ],
        "notes": [AMCHECK_NOTE] if backend == "postgres" else [],
    }
    assert Problem("entry_value", "m", "entries", 7).as_json() == {
        "kind": "entry_value",
        "table": "entries",
        "id": 7,
        "message": "m",
    }


# -- SQLite files ----------------------------------------------------------------------


def test_a_damaged_index_page_fails_integrity_check(cli, registry_path: Path) -> None:
    build(str(registry_path))
    assert not Path(f"{registry_path}-wal").exists()  # all of it is in the file
    with sqlite3.connect(registry_path) as conn:
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        root = conn.execute(
            "SELECT rootpage FROM sqlite_master WHERE name = 'sqlite_autoindex_entries_1'"
        ).fetchone()[0]
    conn.close()
    data = bytearray(registry_path.read_bytes())
    page = (root - 1) * page_size
    at = data.index(b"flashinfer::mm_fp4", page, page + page_size)
    data[at + len("flashinfer::mm_fp")] = ord("5")  # one index record no longer matches its row
    registry_path.write_bytes(bytes(data))
    before = files_of(registry_path)

    result = cli("verify")

    assert (result.exit_code, result.stderr) == (1, "")
    assert result.stdout.startswith(
        f"registry {registry_path} (sqlite, schema {HEAD}), checked read-only\n"
        "note: data checks skipped: the database is damaged\n"
    )
    report = verify(str(registry_path))
    assert [kind for kind, _count in report.counts] == ["integrity"]
    assert all(p.message.startswith("integrity_check: ") for p in report.problems)
    assert report.checked is None
    assert files_of(registry_path) == before


def test_a_truncated_file_is_one_error_line(cli, registry_path: Path) -> None:
    build(str(registry_path))
    with registry_path.open("r+b") as handle:
        handle.truncate(registry_path.stat().st_size // 2)
    before = files_of(registry_path)

    result = cli("verify")

    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr == (
        f"error: registry {registry_path} is corrupt (database disk image is malformed); "
        "restore it or pass another --db\n"
    )
    assert files_of(registry_path) == before


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no registry at {path}; import a cache file first (ficache import FILE)"),
        (b"{}", "{path} is not a SQLite database; pass another --db or move the file away"),
    ],
    ids=["missing", "foreign"],
)
def test_what_is_not_a_registry_is_one_error_line(
    cli, registry_path: Path, content: bytes | None, message: str
) -> None:
    if content is not None:
        registry_path.write_bytes(content)

    result = cli("verify")

    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr == f"error: {message.format(path=registry_path)}\n"
    assert not registry_path.exists() if content is None else registry_path.read_bytes() == content


def test_a_foreign_or_newer_database_is_one_error_line(cli, registry_path: Path) -> None:
    with closing(sqlite3.connect(registry_path)) as conn, conn:
        conn.execute("CREATE TABLE notes (body TEXT)")
    assert cli("verify").stderr == (
        f"error: {registry_path} is a database but not a ficache registry; pass another --db\n"
    )
    with closing(sqlite3.connect(registry_path)) as conn, conn:
        conn.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        conn.execute("INSERT INTO alembic_version VALUES ('9999_future')")
    before = files_of(registry_path)

    result = cli("verify")

    # a newer schema is reported, not refused (issue 35)
    assert (result.exit_code, result.stderr) == (1, "")
    assert result.stdout.splitlines()[-1] == (
        f"  schema is at 9999_future, newer than this ficache knows (head {HEAD}); "
        "upgrade ficache (pip install -U ficache) to check its data"
    )
    assert files_of(registry_path) == before


@both_backends
def test_an_empty_database_is_no_registry(cli, registry_db: str, registry_path: Path) -> None:
    if registry_db == str(registry_path):
        registry_path.touch()

    result = cli("verify")

    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr == (
        f"error: no registry in {display(registry_db)}; import a cache file first "
        "(ficache import FILE)\n"
    )


def test_a_missing_column_is_drift_and_skips_the_data_checks(cli, registry_path: Path) -> None:
    build(str(registry_path))
    behind_the_back(str(registry_path), "ALTER TABLE entry_changes DROP COLUMN new_tactic")

    result = cli("verify")

    assert (result.exit_code, result.stderr) == (1, "")
    assert result.stdout == (
        f"registry {registry_path} (sqlite, schema {HEAD}), checked read-only\n"
        "note: data checks skipped: the schema lacks tables or columns\n"
        "1 problem:\n"
        "schema_drift: 1\n"
        "  column entry_changes.new_tactic is missing\n"
    )


WRITER_KILLED_MID_SESSION = """
import os, sqlite3, sys
from ficache.registry import Registry
sys.path.insert(0, {tests!r})
from test_verify import new, H200
reg = Registry.open({db!r})
holder = sqlite3.connect({db!r})  # a reader that keeps the WAL from being checkpointed
holder.execute("SELECT count(*) FROM entries").fetchall()
reg.write([new(H200, m, "1") for m in (16, 32, 64)], kind="import")
reg.write([new(H200, 16, "2")], kind="import")
os._exit(0)  # no close, no checkpoint: the commits live only in the WAL
"""


def test_a_registry_left_with_a_wal_by_a_killed_writer(registry_path: Path) -> None:
    script = WRITER_KILLED_MID_SESSION.format(
        tests=str(Path(__file__).resolve().parent), db=str(registry_path)
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    wal = Path(f"{registry_path}-wal")
    assert wal.stat().st_size > 0
    before = files_of(registry_path)

    report = verify(str(registry_path))

    assert (report.problems, report.checked) == (
        (),
        Checked(fingerprints=1, entries=3, commits=2, changes=4),
    )
    assert files_of(registry_path) == before  # read through the WAL, checkpointed nothing


WRITER_KILLED_MID_TRANSACTION = """
import os, signal, sqlite3
conn = sqlite3.connect({db!r}, isolation_level=None)
conn.execute("PRAGMA journal_mode = DELETE")  # a rollback journal, as the frozen 0001 file has
conn.execute("PRAGMA cache_size = 1")  # spill: the file itself is written before the commit
conn.execute("BEGIN IMMEDIATE")
conn.execute("UPDATE entries SET tactic = '99'")
conn.execute("DELETE FROM entry_changes")
conn.execute("DELETE FROM entries")
os.kill(os.getpid(), signal.SIGKILL)  # mid-transaction: the journal stays behind, hot
"""


def test_a_hot_journal_left_by_a_killed_writer_is_one_line_and_untouched(
    cli, registry_path: Path
) -> None:
    build(str(registry_path))
    script = WRITER_KILLED_MID_TRANSACTION.format(db=str(registry_path))
    killed = subprocess.run([sys.executable, "-c", script], timeout=120)
    journal = Path(f"{registry_path}-journal")
    assert killed.returncode == -9 and journal.stat().st_size > 0
    before = (registry_path.read_bytes(), journal.read_bytes())

    refused = cli("verify")

    assert (refused.exit_code, refused.stdout) == (1, "")
    assert refused.stderr == (
        f"error: registry {registry_path} holds a transaction a killed writer left unfinished "
        f"({journal.name}); open it once for writing (e.g. `ficache stats`) so SQLite rolls it "
        "back, then verify again\n"
    )
    assert (registry_path.read_bytes(), journal.read_bytes()) == before
    # Opened for writing, SQLite rolls the killed transaction back: nothing of it remains.
    assert cli("stats").exit_code == 0
    result = cli("verify")
    assert (result.exit_code, result.stderr) == (0, "")
    assert result.stdout.endswith("ok: no problems\n")


def test_a_read_only_file_is_verified(cli, registry_path: Path) -> None:
    build(str(registry_path))
    registry_path.chmod(0o444)
    try:
        result = cli("verify")
    finally:
        registry_path.chmod(0o644)

    assert (result.exit_code, result.stderr) == (0, "")
    assert result.stdout.endswith("ok: no problems\n")


# -- PostgreSQL ------------------------------------------------------------------------


@pytest.mark.postgres
def test_postgres_foreign_keys_not_enforced(postgres_url: str) -> None:
    build(postgres_url)
    behind_the_back(postgres_url, "ALTER TABLE entries DISABLE TRIGGER ALL")

    report = verify(postgres_url)

    assert report.counts == (("foreign_key", 1),)
    assert report.problems[0].message == (
        "6 internal trigger(s) of entries are disabled, so its foreign keys are not enforced "
        "(ALTER TABLE ... ENABLE TRIGGER ALL)"
    )


@pytest.mark.postgres
def test_postgres_indexes_are_checked_with_amcheck_when_installed(postgres_url: str) -> None:
    build(postgres_url)
    behind_the_back(postgres_url, "CREATE EXTENSION amcheck")

    report = verify(postgres_url)

    assert (report.problems, report.notes) == ((), ())


PAGE = 8192  # PostgreSQL's block size (the embedded server's default)


def corrupt_a_leaf_of(
    server: pg_server.PostgresServer, url: str, index: str, old: bytes, new: bytes
) -> int:
    """Overwrite ``old`` with ``new`` (as long) in the first leaf page of ``index`` that
    holds it, on disk, with the page's checksum recomputed, as a bad disk or a bad restore
    could leave it; returns the block. The index's buffers are written out and evicted
    first, so the server reads the damaged page back (``pageinspect`` reads the page and
    sums it, ``pg_buffercache`` evicts it; both are dropped again)."""
    assert len(old) == len(new)
    engine = create_engine(url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            run = conn.exec_driver_sql
            run("CREATE EXTENSION pageinspect")
            run("CREATE EXTENSION pg_buffercache")
            run("CHECKPOINT")  # every page of the index is on disk, as the buffers hold it
            relation = run(f"SELECT pg_relation_filepath('{index}')").scalar_one()
            blocks = run(f"SELECT pg_relation_size('{index}') / {PAGE}").scalar_one()
            for block in range(1, blocks):  # block 0 is the metapage
                page = bytearray(run(f"SELECT get_raw_page('{index}', {block})").scalar_one())
                if old in page:
                    break
            else:
                raise AssertionError(f"no page of {index} holds {old!r}")
            at = page.index(old)
            page[at : at + len(old)] = new
            checksum = run(
                "SELECT page_checksum(%(page)s, %(block)s)", {"page": bytes(page), "block": block}
            ).scalar_one()
            page[8:10] = struct.pack("<h", checksum)  # pd_checksum
            _evicted, _flushed, skipped = run(
                f"SELECT * FROM pg_buffercache_evict_relation('{index}')"
            ).one()
            assert skipped == 0, "a buffer of the index is pinned"
            with (server.pgdata / relation).open("r+b") as file:
                file.seek(block * PAGE)
                file.write(page)
            run("DROP EXTENSION pageinspect")
            run("DROP EXTENSION pg_buffercache")
    finally:
        engine.dispose()
    return block


@pytest.mark.postgres
def test_postgres_a_damaged_btree_index_is_found_by_amcheck(
    cli, postgres_server, postgres_url: str, dump_db
) -> None:
    build(postgres_url)
    behind_the_back(postgres_url, "CREATE EXTENSION amcheck")
    assert verify(postgres_url).ok
    # The unique index's leaf holds H200's shared keys in order, m16 before m32. Entry 2's
    # key becomes m10 in the index only: the heap row still says m32, and the leaf is out
    # of order, which amcheck detects (queries just miss the row).
    index = "uq_entries_fingerprint_scope_key"
    corrupt_a_leaf_of(postgres_server, postgres_url, index, b"((32, 4096)", b"((10, 4096)")
    before = dump_db(postgres_url)

    report = verify(postgres_url)
    result = cli("verify", db=postgres_url)

    assert report.counts == (("integrity", 1),)
    [problem] = report.problems
    assert problem.message.startswith(f"index {index} of entries: ")
    assert "item order invariant violated" in problem.message
    assert (report.checked, report.notes) == (
        None,
        ("data checks skipped: the database is damaged",),
    )
    assert (result.exit_code, result.stderr) == (1, "")
    assert result.stdout.splitlines()[-3:] == ["1 problem:", "integrity: 1", f"  {problem.message}"]
    assert dump_db(postgres_url) == before


def test_every_kind_is_documented() -> None:
    import ficache.verify

    doc = ficache.verify.__doc__ or ""
    assert [kind for kind in KINDS if f"``{kind}``" not in doc] == []


#: Damage cases outside the tables above: ``{(kind, backend): the test that finds it}``.
OTHER_DAMAGE_CASES = {
    ("integrity", "sqlite"): "test_a_damaged_index_page_fails_integrity_check",
    ("integrity", "postgres"): "test_postgres_a_damaged_btree_index_is_found_by_amcheck",
    ("foreign_key", "postgres"): "test_postgres_foreign_keys_not_enforced",
    **{
        (kind, backend): test
        for kind, test in (
            ("schema_revision", "test_an_older_revision_is_reported_and_skips_the_data_checks"),
            (
                "duplicate_entry",
                "test_a_duplicate_entry_is_refused_and_found_once_the_constraint_is_gone",
            ),
            (
                "record_revert_mismatch",
                "test_a_record_revert_that_does_not_invert_its_target_is_found",
            ),
            (
                "protocol_revert_mismatch",
                "test_a_protocol_revert_that_does_not_invert_its_target_is_found",
            ),
        )
        for backend in ("sqlite", "postgres")
    },
}


def test_every_kind_is_found_by_a_damage_case_on_each_backend() -> None:
    """Each kind verify reports is the expected finding of some damage case on SQLite and on
    PostgreSQL (the cases assert their exact counts, so a silenced check fails one)."""
    both = ("sqlite", "postgres")
    found = {
        (kind, backend)
        for _statements, counts, _first in (
            *DAMAGE.values(),
            *RECORD_DAMAGE.values(),
            *PROTOCOL_DAMAGE.values(),
        )
        for kind in counts
        for backend in both
    }
    found |= {
        (kind, on) for on, _s, counts, _f in DAMAGE_ON_ONE_BACKEND.values() for kind in counts
    }
    found |= set(OTHER_DAMAGE_CASES)

    assert [
        (kind, backend) for kind in KINDS for backend in both if (kind, backend) not in found
    ] == []
    assert [test for test in OTHER_DAMAGE_CASES.values() if not callable(globals().get(test))] == []


# -- a damaged registry is never written; verify always reports (issue 35) -----------------


def test_a_damaged_registry_is_never_written(cli, registry_path: Path, cache_file) -> None:
    """Bug 3: on a file SQLite reports malformed, `import` committed."""
    from damage import damage_history

    build(str(registry_path))
    damage_history(registry_path)
    before = files_of(registry_path)
    f = cache_file("f.json", {key(99): ["CutlassRunner", 1]}, metadata={**FIELDS, "gpu": "X"})

    result = cli("import", f)
    with pytest.raises(RegistryDamagedError) as raised, Registry.open(str(registry_path)) as reg:
        reg.write([new(H200, 99, "1")], kind="import")

    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr.startswith(f"error: registry {registry_path} is damaged (SQLite: ")
    assert result.stderr.endswith(
        "); nothing written; run `ficache verify`, then restore the file from a copy or pass "
        "another --db\n"
    )
    assert len(result.stderr.splitlines()) == 1
    assert str(raised.value) == result.stderr.removeprefix("error: ").rstrip("\n")
    assert files_of(registry_path) == before


def test_verify_json_is_json_on_a_damaged_file_and_on_an_error(
    cli, registry_path: Path, tmp_path: Path
) -> None:
    """Bug 3: `verify --format json` printed no JSON on a damaged file."""
    from damage import damage_history

    build(str(registry_path))
    whole = registry_path.read_bytes()
    damaged = tmp_path / "damaged.db"
    damaged.write_bytes(whole)
    damage_history(damaged)
    truncated = tmp_path / "truncated.db"
    truncated.write_bytes(whole[: len(whole) // 2])

    on_damaged = cli("verify", "--format", "json", db=damaged)
    on_truncated = cli("verify", "--format", "json", db=truncated)
    on_missing = cli("verify", "--format", "json", db=tmp_path / "none.db")

    report = json.loads(on_damaged.stdout)
    assert (on_damaged.exit_code, report["ok"], list(report["counts"])) == (1, False, ["integrity"])
    assert report["notes"] == ["data checks skipped: the database is damaged"]
    assert json.loads(on_truncated.stdout) == {
        "registry": str(truncated),
        "ok": False,
        "error": f"registry {truncated} is corrupt (database disk image is malformed); "
        "restore it or pass another --db",
    }
    assert json.loads(on_missing.stdout)["ok"] is False
    assert json.loads(on_missing.stdout)["error"].startswith("no registry at ")
    assert on_truncated.exit_code == on_missing.exit_code == 1
    # ... and the one error line every failing command prints, on stderr.
    assert on_truncated.stderr == f"error: {json.loads(on_truncated.stdout)['error']}\n"
    assert on_missing.stderr == f"error: {json.loads(on_missing.stdout)['error']}\n"


def test_db_current_and_verify_report_a_newer_schema(
    cli, registry_path: Path, tmp_path: Path
) -> None:
    """Bug 3: on a schema a newer ficache made, `db current` and `verify` failed."""
    from future_schema import REVISION, upgrade_to_future, write_future_migrations

    build(str(registry_path))
    upgrade_to_future(registry_path, write_future_migrations(tmp_path))
    before = files_of(registry_path)

    current = cli("db", "current")
    text = cli("verify")
    as_json = cli("verify", "--format", "json")

    assert (current.exit_code, current.stderr) == (0, "")
    assert current.stdout == (
        f"{REVISION} (head {HEAD}: newer than this ficache; upgrade ficache "
        "(pip install -U ficache))\n"
    )
    assert (text.exit_code, text.stderr) == (1, "")
    assert text.stdout.splitlines() == [
        f"registry {registry_path} (sqlite, schema {REVISION}), checked read-only",
        "note: data checks skipped: the schema is newer than this ficache",
        "1 problem:",
        "schema_revision: 1",
        f"  schema is at {REVISION}, newer than this ficache knows (head {HEAD}); upgrade "
        "ficache (pip install -U ficache) to check its data",
    ]
    report = json.loads(as_json.stdout)
    assert (report["revision"], report["counts"], report["checked"]) == (
        REVISION,
        {"schema_revision": 1},
        None,
    )
    assert files_of(registry_path) == before
