"""Rolling upgrades: this ficache on the previous two releases' schemas, and they on its.

The matrix: each of the previous two releases' schema heads (a frozen registry
made by that release, ``tests/frozen_registries.py``; on PostgreSQL migrated
to that revision and loaded with the same rows) × this code's every read
command, ``verify``, commits (library and CLI, dry runs agreeing) and a real
warm start on 2 gloo ranks that commits and then serves; then the previous
release itself (a ``git archive`` of the commit before this release's
revision) reading and writing what this code committed to its schema. The
registry never moves: only ``ficache db upgrade`` does, with a plan.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path
from typing import Any

import past_releases
import pytest
from frozen_registries import frozen_file, frozen_registry
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.pool import NullPool

from ficache import schema
from ficache.fingerprint import Fingerprint
from ficache.flashinfer_format import parse_cache_bytes
from ficache.registry import Registry
from ficache.registry_schema import RegistrySchema
from ficache.values import NewProtocolRecord

HEAD = schema.head_revision()
REVISIONS = [rev for rev, _down, _title in schema.history()]
#: The schema heads of the previous two releases.
PREVIOUS = REVISIONS[-3:-1]
REPO = Path(__file__).resolve().parent.parent
#: Hang guard for the gloo ranks: they are killed after this long; never compared with a time.
HARD_TIMEOUT = 600.0

_FIELDS = {
    "flashinfer_version": "0.7.2.post1",
    "cuda_version": "12.9",
    "cublas_version": "12.9.1",
    "cudnn_version": "91002",
    "cudnn_frontend_version": "1.32.0",
    "cutlass_dsl_version": "nvidia-cutlass-dsl==4.8.1",
    "gpu": "NVIDIA H200",
}


def _key(m: int) -> str:
    return f"('flashinfer::mm_fp4', 'CutlassFp4Runner', (({m}, 4096), (4096, 2048)), (torch.bfloat16, 1))"


@pytest.fixture(params=PREVIOUS)
def previous(request: pytest.FixtureRequest, backend: str, registry_db: str) -> str:
    """The test's registry (``registry_db``), frozen at one previous release's schema head."""
    frozen_registry(request.param, registry_db)
    return str(request.param)


def _sql(db: str, statement: str) -> list[tuple[Any, ...]]:
    url = db if db.startswith("postgresql") else f"sqlite:///{db}"
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.execute(text(statement))]
    finally:
        engine.dispose()


def _tables(db: str) -> set[str]:
    url = db if db.startswith("postgresql") else f"sqlite:///{db}"
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return set(inspect(conn).get_table_names())
    finally:
        engine.dispose()


def _frozen(revision: str, statement: str) -> Any:
    """The one value ``statement`` selects from ``revision``'s frozen file."""
    ((value,),) = _sql(str(frozen_file(revision)), statement)
    return value


def _commits(revision: str) -> int:
    """How many commits ``revision``'s frozen file holds (its release made them)."""
    return int(_frozen(revision, "SELECT count(*) FROM commits"))


def _holds_protocol_records(revision: str) -> bool:
    found = schema.features_of(revision)
    assert found is not None
    return found.has_table("protocol_records")


def _compat(revision: str) -> tuple[str, str]:
    """``(readable_from, writable_from)`` that ``revision``'s module declares."""
    module = schema.script_directory().get_revision(revision).module
    return module.readable_from, module.writable_from


def _default_policy_bundle(cli, tmp_path: Path) -> tuple[Path, int]:
    """A bundle of this head's frozen registry's first fingerprint (the default measurement
    policy: what every previous release's schema keeps) with its entries, records and
    protocol records, and how many protocol records it holds."""
    bundle, head = tmp_path / "h200.bundle.json", tmp_path / "frozen-head.db"
    shutil.copyfile(frozen_file(HEAD), head)  # a read may switch the file to WAL
    assert _frozen(HEAD, "SELECT measurement FROM fingerprints WHERE id = 1") is None
    assert cli("export", "--bundle", bundle, "--fingerprint", "1", db=head).exit_code == 0
    protocol = _frozen(HEAD, "SELECT count(*) FROM protocol_records WHERE fingerprint_id = 1")
    assert protocol > 0
    return bundle, int(protocol)


def _file(tmp_path: Path, name: str, entries: dict[str, list[Any]], records: Any = None) -> Path:
    data: dict[str, Any] = {"_metadata": _FIELDS, **entries}
    if records:
        data["_records"] = records
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


# -- reads -----------------------------------------------------------------------------------

#: Every read command, as JSON where it has it (``show`` of each frozen commit, ``export``
#: of the H200 fingerprint's shared and rank-scoped entries).
READS: list[tuple[str, ...]] = [
    ("list", "--format", "json"),
    ("list", "--records", "--format", "json"),
    ("list", "--protocol-records", "--format", "json"),
    ("log", "--format", "json"),
    *[("show", str(n), "--format", "json") for n in (1, 2, 3, 4)],
    ("fingerprints", "--all", "--format", "json"),
    ("stats", "--format", "json"),
    ("export", "--fingerprint", "1"),
    ("export", "--fingerprint", "1", "--scope", "tp2/rank1"),
]


def _comparable(command: tuple[str, ...], stdout: str) -> Any:
    if command[0] == "export":
        return stdout
    out = json.loads(stdout)
    if command[0] == "stats":  # where the registry is, and its revision, differ by design
        for name in ("revision", "location", "size_bytes"):
            out.pop(name)
    return out


@pytest.mark.usefixtures("backend")
def test_every_read_command_serves_a_previous_releases_schema_and_changes_nothing(
    cli, previous: str, registry_db: str, dump_db, tmp_path: Path
) -> None:
    """Bug 1 (issue 35): these exited 1 ("older than this ficache; run `ficache db upgrade`").

    Each answer is the one the same data gives once upgraded to head.
    """
    before = dump_db(registry_db)
    upgraded = tmp_path / "upgraded.db"
    shutil.copyfile(frozen_file(previous), upgraded)
    with RegistrySchema.open(str(upgraded), create=False) as target:
        target.upgrade()

    for command in READS:
        old, new = cli(*command), cli(*command, db=upgraded)
        assert (old.exit_code, old.stderr) == (0, ""), (command, old.stderr)
        assert new.exit_code == 0, (command, new.stderr)
        assert _comparable(command, old.stdout) == _comparable(command, new.stdout), command

    assert dump_db(registry_db) == before
    assert cli("db", "current").stdout == f"{previous} (head {HEAD}: needs upgrade)\n"


@pytest.mark.usefixtures("backend")
def test_verify_checks_every_row_of_a_previous_releases_schema(
    cli, previous: str, registry_db: str
) -> None:
    """Bug 1: verify reported the schema as a problem and skipped every data check."""
    result = cli("verify", "--format", "json")

    assert (result.exit_code, result.stderr) == (0, ""), result.stdout
    report = json.loads(result.stdout)
    assert report["problems"] == []
    assert report["checked"]["entries"] == _frozen(previous, "SELECT count(*) FROM entries")
    assert report["checked"]["commits"] == _commits(previous)
    lacking = ", ".join(schema.release_of(r) for r in REVISIONS[REVISIONS.index(previous) + 1 :])
    assert lacking  # this release's revisions (named in the note by what they add)
    assert any(f"schema is at {previous}, older than head {HEAD}" in n for n in report["notes"])


# -- commits ----------------------------------------------------------------------------------


@pytest.mark.usefixtures("backend")
def test_a_commit_stores_entries_and_records_and_skips_protocol_records_with_one_warning(
    previous: str, registry_db: str, dump_db
) -> None:
    """Entries and records are committed; protocol records where the schema has their tables
    (0009 on), else left out with one warning and no commit."""
    h200 = Fingerprint.from_flashinfer_metadata(_FIELDS)
    records = {"trtllm_moe_da": {'{"num_tokens":32}': {"schema": 1}}}
    cache = json.dumps(
        {"_metadata": _FIELDS, "_records": records, _key(128): ["CutlassFp4Runner", 4]}
    ).encode()

    with Registry.open(registry_db) as reg:
        imported = reg.import_cache([("new.json", parse_cache_bytes(cache))])
        before = dump_db(registry_db)
        protocol = reg.write(
            [],
            kind="import",
            protocol_records=[NewProtocolRecord(h200, "moe_ep_megamoe", "k", "7")],
        )
        log = reg.log(limit=1)

    commits = _commits(previous)
    assert (imported.commit_id, imported.added, imported.records_added) == (commits + 1, 1, 1)
    assert imported.skipped is None
    assert _sql(registry_db, "SELECT version_num FROM alembic_version") == [(previous,)]
    if _holds_protocol_records(previous):
        assert (protocol.commit_id, protocol.protocol_added, protocol.skipped) == (
            commits + 2,
            1,
            None,
        )
        assert [(c.id, c.kind, c.added, c.records_added) for c in log] == [
            (commits + 2, "import", 0, 0)
        ]
        return
    assert protocol.commit_id is None and protocol.protocol_added == 0
    assert protocol.skipped == (
        f"registry {schema.resolve(registry_db).display} is at schema {previous!r}: "
        f"1 protocol records not stored (needs "
        + ", ".join(
            f"{rev} ({schema.script_directory().get_revision(rev).module.adds})"
            for rev in REVISIONS[REVISIONS.index(previous) + 1 :]
        )
        + "); run `ficache db upgrade` once every ficache that writes it reads that revision"
    )
    assert dump_db(registry_db) == before  # nothing else to write: no commit
    assert [(c.id, c.kind, c.added, c.records_added) for c in log] == [
        (commits + 1, "import", 1, 1)
    ]
    assert "protocol_records" not in _tables(registry_db)


@pytest.mark.usefixtures("backend")
def test_import_dry_run_and_import_agree_on_a_previous_releases_schema(
    cli, previous: str, registry_db: str, dump_db, tmp_path: Path
) -> None:
    """Bug 6 (issue 35): the dry run exited 1 where the import upgraded the schema silently.

    Both work on the schema as it is: the same counts, the same warning for what it
    cannot hold (a bundle's protocol records, before 0009), and the registry stays at its
    revision.
    """
    bundle, protocol = _default_policy_bundle(cli, tmp_path)
    changed = _file(tmp_path, "c.json", {_key(128): ["CutlassFp4Runner", 4]})
    before = dump_db(registry_db)

    for path in (changed, bundle):
        dry = cli("import", "--dry-run", path)
        assert dump_db(registry_db) == before
        real = cli("import", path)
        assert (dry.exit_code, real.exit_code) == (0, 0), (dry.stderr, real.stderr)
        assert dry.stderr == real.stderr
        assert (
            dry.stdout.replace("would import", "imported").split(" (")[0]
            == (real.stdout.split(" (")[0])
        )
        before = dump_db(registry_db)
    if _holds_protocol_records(previous):
        assert real.stderr == ""
    else:
        assert f"{protocol} protocol records not stored" in real.stderr
        assert real.stderr.count("\n") == 1
    assert cli("db", "current").stdout == f"{previous} (head {HEAD}: needs upgrade)\n"
    listed = cli("list", "--format", "json")
    entries = _frozen(previous, "SELECT count(*) FROM entries")
    assert listed.exit_code == 0 and len(json.loads(listed.stdout)) == entries + 1


@pytest.mark.usefixtures("backend")
def test_merge_dry_run_and_merge_agree_on_a_previous_releases_schema(
    cli, previous: str, registry_db: str, tmp_path: Path
) -> None:
    """Merging this release's registry (protocol records included) into a previous release's:
    the same plan and the same one warning (where it lacks the protocol records' tables),
    and the registry stays at its revision."""
    source = tmp_path / "head.db"
    bundle, protocol = _default_policy_bundle(cli, tmp_path)
    assert cli("import", bundle, db=source).exit_code == 0
    assert cli("db", "current", db=source).stdout == f"{HEAD} (head {HEAD}: up to date)\n"

    dry = cli("merge", source, "--dry-run")
    real = cli("merge", source)

    assert (dry.exit_code, real.exit_code) == (0, 0), (dry.stderr, real.stderr)
    assert dry.stderr == real.stderr
    if _holds_protocol_records(previous):
        assert real.stderr == ""
    else:
        assert f"{protocol} protocol records not stored" in real.stderr
        assert real.stderr.count("\n") == 1
    assert dry.stdout.replace("dry run: nothing changed\n", "") == real.stdout.replace(
        "nothing to change, no commit\n", ""
    )
    assert _sql(registry_db, "SELECT version_num FROM alembic_version") == [(previous,)]


@pytest.mark.usefixtures("backend")
def test_a_store_under_a_measurement_policy_is_refused_whole_where_the_schema_cannot_keep_it_apart(
    cli, previous: str, registry_db: str, dump_db, tmp_path: Path
) -> None:
    """A schema without ``fingerprints.measurement`` (before 0010) would store a fingerprint
    under a non-default policy as the default's and mix its entries in: the import of a v2
    store under such a policy, and the merge of a registry holding one, are refused by the
    dry run and the real run alike, in one line naming what to do, exit 1, registry as before.
    (The import landed the policy's entries in the default fingerprint, replacing its value;
    the merge dry run exited 0 where the merge exited 1.)"""
    found = schema.features_of(previous)
    assert found is not None
    if found.has_column("fingerprints", "measurement"):
        pytest.skip(f"{previous} keeps measurement policies apart")
    (policy,) = _sql(
        str(frozen_file(HEAD)), "SELECT id, measurement FROM fingerprints WHERE measurement != ''"
    )
    head = tmp_path / "head.db"
    shutil.copyfile(frozen_file(HEAD), head)
    store = tmp_path / "store"
    exported = cli("export", "--v2-store", store, "--fingerprint", str(policy[0]), db=head)
    assert exported.exit_code == 0, exported.stderr
    needs = ", ".join(f"{rev} ({adds})" for rev, adds in found.lacking)
    refusal = (
        f"error: the registry is at schema {previous!r}, which cannot keep entries tuned under "
        f"measurement policy {policy[1]} apart from the default policy's (needs {needs}); "
        "nothing written; run `ficache db upgrade` once every ficache that writes it reads "
        "that revision\n"
    )
    before = dump_db(registry_db)

    for command in (
        ("import", "--dry-run", store),
        ("import", store),
        ("merge", head, "--dry-run"),
        ("merge", head),
    ):
        result = cli(*command)
        assert (result.exit_code, result.stderr) == (1, refusal), (command, result.stdout)
        assert dump_db(registry_db) == before, command
    assert _sql(registry_db, "SELECT version_num FROM alembic_version") == [(previous,)]


def test_a_local_file_older_than_this_release_reads_is_upgraded_by_both_runs_and_said_so(
    cli, registry_path: Path, tmp_path: Path, dump_db
) -> None:
    """Bug 6, older still: the dry run shows the import on an upgraded copy, and says the
    real import upgrades the file first; the real import says that it did."""
    oldest = schema.oldest_readable()
    older = REVISIONS[REVISIONS.index(oldest) - 1]
    shutil.copyfile(frozen_file(older), registry_path)
    changed = _file(tmp_path, "c.json", {_key(128): ["CutlassFp4Runner", 4]})
    before = dump_db(registry_path)
    display = schema.resolve(str(registry_path)).display
    said = (
        f"registry {display} from schema {older!r} to {HEAD!r} (a local file older than "
        f"{oldest!r}, which this ficache cannot use as it is)\n"
    )

    dry = cli("import", "--dry-run", changed)
    assert dump_db(registry_path) == before
    real = cli("import", changed)

    assert (dry.exit_code, dry.stderr) == (0, f"note: the import would first upgrade {said}")
    assert (real.exit_code, real.stderr) == (0, f"note: upgraded {said}")
    assert dry.stdout.startswith("would import 1 entries from 1 file(s): 1 added, 0 replaced")
    assert real.stdout.startswith("imported 1 entries from 1 file(s): 1 added, 0 replaced")
    assert cli("db", "current").stdout == f"{HEAD} (head {HEAD}: up to date)\n"


# -- db upgrade ---------------------------------------------------------------------------------


@pytest.mark.usefixtures("backend")
def test_db_upgrade_names_the_releases_it_stops_and_asks_on_a_shared_registry(
    cli, previous: str, registry_db: str, dump_db
) -> None:
    before = dump_db(registry_db)
    shared = registry_db.startswith("postgresql")
    display = schema.resolve(registry_db).display

    dry = cli("db", "upgrade", "--dry-run")
    sql = cli("db", "upgrade", "--sql")
    unasked = cli("db", "upgrade")

    plan = [f"upgrade plan: {display} from {previous} to {HEAD}\n"]
    plan += [
        f"  {rev}: {title}\n"
        for rev, _down, title in schema.history()
        if REVISIONS.index(rev) > REVISIONS.index(previous)
    ]

    # Releases that use the registry now (at its revision, or as old as its revision's
    # readable_from/writable_from allow, from 0007_compat on, where the registry tells them)
    # and not once it is at this release's head, by the revision modules' own declarations.
    def access(release: str, revision: str) -> tuple[bool, bool]:
        if release == revision:
            return True, True
        readable, writable = _compat(revision)
        at = REVISIONS.index(release)
        return at >= REVISIONS.index(readable), at >= REVISIONS.index(writable)

    compat = REVISIONS.index(schema.COMPAT_REVISION)
    stops = []
    for release in REVISIONS[compat : REVISIONS.index(previous) + 1]:
        (reads, writes), (reads_after, writes_after) = (
            access(release, previous),
            access(release, HEAD),
        )
        assert reads_after <= reads and writes_after <= writes
        if writes and not writes_after:
            effect = (
                "stops reading and writing it: its warm starts tune uncached"
                if reads and not reads_after
                else "stops writing it: its warm starts still serve, and commit nothing"
            )
            stops.append(f"{schema.release_of(release)} (schema {release}) {effect}\n")
    assert stops  # the release at the registry's revision writes it now, and not after
    plan += stops
    plan.append(
        "upgrade once every server that shares this registry runs a ficache that writes "
        f"{HEAD} ({schema.release_of(HEAD)} or newer)\n"
    )
    assert (dry.exit_code, dry.stdout) == (0, "".join(plan) + "dry run: nothing changed\n")
    assert sql.exit_code == 0, sql.stderr
    for rev in REVISIONS[REVISIONS.index(previous) + 1 :]:  # what each revision adds
        module = schema.script_directory().get_revision(rev).module
        for table in module.adds_tables:
            assert f"CREATE TABLE {table} " in sql.stdout, (rev, table)
        for table, columns in module.adds_columns.items():
            for column in columns:
                assert f"ALTER TABLE {table} ADD COLUMN {column} " in sql.stdout, (rev, column)
    assert sql.stdout.rstrip().endswith("COMMIT;")
    assert (
        f"INSERT INTO schema_compat (revision, readable_from, writable_from) VALUES ('{HEAD}'"
        in sql.stdout
    )
    if shared:  # servers of other releases share it: asked, and no terminal to ask on
        assert (unasked.exit_code, unasked.stderr) == (
            1,
            "error: refusing to change the registry without confirmation; pass --yes\n",
        )
        assert dump_db(registry_db) == before
        unasked = cli("db", "upgrade", "--yes")
    assert unasked.exit_code == 0, unasked.stderr
    assert unasked.stdout == "".join(plan) + f"registry {display} is at {HEAD}\n"
    assert cli("verify").exit_code == 0


# -- warm starts -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.usefixtures("backend")
def test_warm_starts_commit_and_serve_on_a_previous_releases_schema(
    previous: str, registry_db: str, tmp_path: Path
) -> None:
    """Bug 1: every upgraded server's warm start ran uncached for the whole rollout.

    2 gloo ranks: a cold start commits its 12 entries, the next serves them; the
    protocol records both publish are stored where the schema has their tables, else left
    out with one warning; the mark counts starts where the schema has the counters.
    """
    import upgrade_scenarios
    from flashinfer_074 import require_protocol_records

    from ficache._ranks import run_ranks

    require_protocol_records()
    results = run_ranks(
        upgrade_scenarios.serve_and_commit,
        2,
        str(tmp_path / "ranks"),
        registry_db,
        timeout=HARD_TIMEOUT,
    )

    skipped = f"registry {schema.resolve(registry_db).display} is at schema {previous!r}: "
    holds = _holds_protocol_records(previous)
    for rank, out in enumerate(results):
        assert "error" not in out, f"rank {rank}:\n{out['error']}"
        cold, warm = out["cold"]["report"], out["warm"]["report"]
        assert (out["cold"]["exception"], out["warm"]["exception"]) == (None, None)
        assert (cold["status"], cold["committed"], cold["commit_id"]) == (
            "cold",
            12,
            _commits(previous) + 1,
        )
        # Every entry served; "partial" only where the protocol records were not stored.
        assert (warm["status"], warm["loaded"], warm["tuned"]) == (
            "warm" if holds else "partial",
            12,
            0,
        )
        assert (warm["committed"], warm["commit_id"], warm["reason"]) == (0, None, None)
        for report in (cold, warm):
            said = [w for w in report["warnings"] if w.startswith(skipped)]
            if holds:
                assert said == []
            else:
                assert said == [
                    next(w for w in report["warnings"] if "protocol records not stored" in w)
                ]
    assert _sql(registry_db, "SELECT version_num FROM alembic_version") == [(previous,)]
    frozen_entries = _frozen(previous, "SELECT count(*) FROM entries")
    assert _sql(registry_db, "SELECT count(*) FROM entries") == [(frozen_entries + 12,)]
    served = "SELECT count(*) FROM fingerprints WHERE last_served_at > 1767225610"
    assert _sql(registry_db, served) == [(1,)]
    if schema.features_of(previous).has_column("fingerprints", "served_starts"):
        most = _frozen(previous, "SELECT max(served_starts) FROM fingerprints")
        assert _sql(registry_db, "SELECT max(served_starts) FROM fingerprints") == [(most,)]
        counted = "SELECT served_starts FROM fingerprints WHERE last_served_at > 1767225610"
        assert _sql(registry_db, counted) == [(1,)]


# -- the previous release on what this one wrote ------------------------------------------------


def _release_tree(head: str, into: Path) -> Path | None:
    """``ficache`` and ``migrations`` of the release whose schema head is ``head`` (the commit
    before the one that added the next revision), laid out as its wheel installs them; None
    without that git history."""
    added = past_releases.commit_adding(REVISIONS[REVISIONS.index(head) + 1])
    if added is None:
        return None
    try:
        return past_releases.release_tree(f"{added}^", into)
    except (OSError, subprocess.CalledProcessError):
        return None


def _old_ficache(tree: Path, db: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ficache", "--db", db, *args],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.usefixtures("backend")
@pytest.mark.parametrize("previous", PREVIOUS)
def test_the_previous_release_reads_and_writes_what_this_one_committed_to_its_schema(
    cli, previous: str, registry_db: str, tmp_path: Path
) -> None:
    """A mixed fleet: this release commits to a previous release's schema, then that
    release (its own code, from git history) lists, imports and verifies it."""
    tree = _release_tree(previous, tmp_path / "previous")
    if tree is None:
        pytest.skip(f"no git history for the release at {previous} in this checkout")
    frozen_registry(previous, registry_db)
    mine = _file(tmp_path, "mine.json", {_key(128): ["CutlassFp4Runner", 4]})
    theirs = _file(tmp_path, "theirs.json", {_key(256): ["CutlassFp4Runner", 2]})
    assert cli("import", mine).exit_code == 0

    listed = _old_ficache(tree, registry_db, "list", "--format", "json")
    imported = _old_ficache(tree, registry_db, "import", str(theirs))
    verified = _old_ficache(tree, registry_db, "verify")

    assert (listed.returncode, listed.stderr) == (0, ""), listed.stderr
    assert len(json.loads(listed.stdout)) == _frozen(previous, "SELECT count(*) FROM entries") + 1
    assert (imported.returncode, imported.stderr) == (0, ""), imported.stderr
    assert imported.stdout.startswith("imported 1 entries from 1 file(s): 1 added")
    assert (verified.returncode, verified.stderr) == (0, ""), verified.stdout
    assert cli("verify").exit_code == 0
    assert _sql(registry_db, "SELECT version_num FROM alembic_version") == [(previous,)]
    assert [c["id"] for c in json.loads(cli("log", "--format", "json").stdout)] == list(
        range(_commits(previous) + 2, 0, -1)
    )


@pytest.mark.parametrize("previous", PREVIOUS)
def test_a_previous_release_reads_this_heads_registry_as_its_readable_from_says(
    previous: str, tmp_path: Path
) -> None:
    """During a rollout, the previous releases still on old code read a registry already at
    this head where the head's ``readable_from`` lets them (0.8 and 0.9 for 0010: only a
    nullable column separates 0010 from 0009, which 0.8 reads), and refuse it otherwise;
    either way every row is left as it was."""
    tree = _release_tree(previous, tmp_path / "previous")
    if tree is None:
        pytest.skip(f"no git history for the release at {previous} in this checkout")
    registry = tmp_path / "head.db"
    shutil.copyfile(frozen_file(HEAD), registry)
    reads = REVISIONS.index(previous) >= REVISIONS.index(_compat(HEAD)[0])

    for command in (("stats",), ("list", "--format", "json"), ("export", "--fingerprint", "1")):
        result = _old_ficache(tree, str(registry), *command)
        if reads:
            assert (result.returncode, result.stderr) == (0, ""), (command, result.stderr)
        else:
            assert result.returncode == 1 and "newer than this ficache knows" in result.stderr
    listed = _old_ficache(tree, str(registry), "list", "--format", "json")
    if reads:
        assert len(json.loads(listed.stdout)) == _frozen(HEAD, "SELECT count(*) FROM entries")
    with (
        closing(sqlite3.connect(registry)) as now,
        closing(sqlite3.connect(f"{frozen_file(HEAD).as_uri()}?mode=ro", uri=True)) as then,
    ):
        assert list(now.iterdump()) == list(then.iterdump())


# -- expand, then contract ----------------------------------------------------------------------


def test_every_revision_this_release_reads_past_only_adds() -> None:
    """Expand, then contract (``ficache.schema``): each revision above the oldest this code
    uses as it is declares what it adds, and only adds: the release before it can read it
    (its ``readable_from`` is not newer than the revision below it)."""
    oldest = schema.oldest_readable()
    assert REVISIONS.index(oldest) <= REVISIONS.index(PREVIOUS[0])
    for rev in REVISIONS[REVISIONS.index(oldest) + 1 :]:
        module = schema.script_directory().get_revision(rev).module
        down = schema.script_directory().get_revision(rev).down_revision
        assert isinstance(module.adds, str) and module.adds, rev
        assert REVISIONS.index(module.readable_from) <= REVISIONS.index(down), rev
        lacks = schema.features_of(down)
        assert lacks is not None and (rev, module.adds) in lacks.lacking
