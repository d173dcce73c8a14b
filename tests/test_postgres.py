"""PostgreSQL as the registry, against a real server (``tox -e postgres``).

The registry, CLI, prune-by-use, concurrency and warm-start suites run their
backend-independent tests on PostgreSQL too (the ``backend`` fixture). This
file holds what is PostgreSQL's own: migrations up to head, down to base and
up again, a frozen 0001 registry copied into PostgreSQL and upgraded, the
concurrent-upgrade lock, refusals (newer schema, foreign database, empty
database on read), one clear line for a server that cannot be reached,
warm starts on real gloo ranks whose rank 0 uses PostgreSQL, and a server
that stops answering mid-query (``ficache.deadline``; a proxy in
``tests/frozen_proxy.py`` freezes the connection, the server behind it is real).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import gloo_scenarios
import pg_server
import pytest
from frozen_proxy import FreezingProxy, ResettingProxy, freezing_proxy
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.pool import NullPool

import ficache
from ficache import schema
from ficache._ranks import run_ranks
from ficache.errors import NotARegistryError, SchemaTooNewError
from ficache.models import Base
from ficache.registry import Registry
from ficache.standin import standin_tune

pytestmark = pytest.mark.postgres
if not pg_server.enabled():  # one skip line for the module, with its reason
    pytest.skip(str(pg_server.unavailable_reason()), allow_module_level=True)

HEAD = schema.head_revision()
TABLES = {
    "alembic_version",
    "fingerprints",
    "commits",
    "policies",
    "entries",
    "entry_changes",
    "records",
    "record_changes",
    "schema_compat",
    "protocol_records",
    "protocol_record_changes",
}
REPO = Path(__file__).resolve().parent.parent
FROZEN_0001 = Path(__file__).parent / "data" / "registry-0001_registry.db"
K16 = "('mm', 'Runner', ((16, 64),), (torch.bfloat16,))"
META = {"gpu": "NVIDIA H200"}


def sql(url: str, statement: str, **params: Any) -> list[tuple[Any, ...]]:
    """One statement behind the registry's back, in its own transaction; its rows."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            result = conn.execute(text(statement), params)
            return [tuple(row) for row in result] if result.returns_rows else []
    finally:
        engine.dispose()


def tables(url: str) -> set[str]:
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return set(inspect(conn).get_table_names())
    finally:
        engine.dispose()


def display(url: str) -> str:
    return schema.resolve(url).display


def cut_line(what: str, seconds: float) -> str:
    """A regex of ``RegistryTimeoutError``'s line for ``what`` under a ``seconds`` limit; its
    group ``elapsed`` is the time the cut block ran (see ``cut_within``)."""
    return (
        re.escape(f"{what} did not answer within {seconds:g} s, so its connection was cut after ")
        + r"(?P<elapsed>\d+\.\d) s"
        + re.escape(": check that the server is running and reachable, or raise the limit")
    )


#: The promised bound's ceiling: a cut comes within 3 times the limit, far below any
#: hang guard here and far from the 20-times-late cut of a broken deadline.
CUT_CEILING = 3


def cut_within(text: str, what: str, seconds: float, prefix: str = "", suffix: str = "") -> float:
    """Assert ``text`` is ``prefix`` + the cut line + ``suffix``, and that the elapsed time it
    reports is at least the limit and under ``CUT_CEILING`` times it; that time."""
    match = re.fullmatch(re.escape(prefix) + cut_line(what, seconds) + re.escape(suffix), text)
    assert match is not None, text
    elapsed = float(match["elapsed"])
    assert seconds - 0.1 <= elapsed < CUT_CEILING * seconds, text
    return elapsed


def one_error_line(result: Any, message: str) -> None:
    assert (result.exit_code, result.stdout, result.stderr) == (1, "", f"error: {message}\n")


# -- migrations -------------------------------------------------------------------


def test_migrations_up_to_head_down_to_base_and_up_again(
    cli, postgres_url: str, cache_file
) -> None:
    data = cache_file("a.json", {K16: ["Runner", 1]}, metadata=META)

    first = cli("db", "upgrade", "0001_registry", db=postgres_url)
    head = cli("db", "upgrade", "--yes", db=postgres_url)  # a shared registry: asked

    assert (first.exit_code, first.stdout) == (
        0,
        f"registry {display(postgres_url)} is at 0001_registry\n",
    )
    assert head.exit_code == 0, head.stderr
    assert head.stdout.startswith(f"upgrade plan: {display(postgres_url)} from 0001_registry to")
    assert head.stdout.endswith(f"registry {display(postgres_url)} is at {HEAD}\n")
    assert tables(postgres_url) == TABLES
    assert cli("import", data, db=postgres_url).exit_code == 0

    down = cli("db", "downgrade", "base", "--yes", db=postgres_url)

    assert (down.exit_code, down.stdout.splitlines()[-1]) == (
        0,
        f"registry {display(postgres_url)} is at base",
    )
    assert tables(postgres_url) == {"alembic_version"}
    assert sql(postgres_url, "SELECT * FROM alembic_version") == []
    assert cli("db", "current", db=postgres_url).stdout == f"(none) (head {HEAD}: empty)\n"

    up = cli("db", "upgrade", db=postgres_url)

    assert (up.exit_code, up.stdout) == (0, f"registry {display(postgres_url)} is at {HEAD}\n")
    assert cli("db", "current", db=postgres_url).stdout == f"{HEAD} (head {HEAD}: up to date)\n"
    assert cli("list", "--format", "json", db=postgres_url).stdout == "[\n]\n"
    again = cli("import", data, db=postgres_url)
    assert again.stdout.startswith("imported 1 entries from 1 file(s): 1 added")


def test_records_down_to_0002_and_up_again(cli, postgres_url: str, cache_file) -> None:
    both = cache_file(
        "both.json", {"_records": {"ns": {"a": 1}}, K16: ["Runner", 1]}, metadata=META
    )
    only = cache_file("only.json", {"_records": {"ns": {"b": [2]}}}, metadata=META)
    assert cli("import", both, db=postgres_url).exit_code == 0
    assert cli("import", only, db=postgres_url).exit_code == 0
    assert cli("revert", "2", "--yes", db=postgres_url).exit_code == 0

    down = cli("db", "downgrade", "0002_fleet", "--yes", db=postgres_url)

    assert down.exit_code == 0, down.stderr
    assert tables(postgres_url) == TABLES - {
        "records",
        "record_changes",
        "policies",
        "schema_compat",
        "protocol_records",
        "protocol_record_changes",
    }
    assert sql(postgres_url, "SELECT id, added FROM commits") == [(1, 1)]
    assert cli("db", "upgrade", "--yes", db=postgres_url).exit_code == 0
    assert tables(postgres_url) == TABLES
    assert cli("verify", db=postgres_url).stdout.endswith("ok: no problems\n")
    again = cli("import", both, db=postgres_url)
    assert again.stdout.startswith("imported 1 entries and 1 records from 1 file(s): 0 added")
    assert sql(postgres_url, "SELECT namespace, key, value FROM records") == [("ns", "a", "1")]


def test_selections_down_to_0003_and_up_again(cli, postgres_url: str, cache_file) -> None:
    selection = {"time_ms": 0.01, "runner_up_ms": 0.012, "margin": 0.2, "candidates": 5}
    four = cache_file("four.json", {K16: ["Runner", 1, ["hot"], selection]}, metadata=META)
    three = cache_file("three.json", {K16: ["Runner", 2, ["hot"]]}, metadata=META)
    assert cli("import", four, db=postgres_url).exit_code == 0
    assert cli("import", three, db=postgres_url).exit_code == 0
    stored = '{"candidates":5,"margin":0.2,"runner_up_ms":0.012,"time_ms":0.01}'
    assert sql(postgres_url, "SELECT old_selection FROM entry_changes WHERE commit_id = 2") == [
        (stored,)
    ]

    down = cli("db", "downgrade", "0003_records", "--yes", db=postgres_url)

    assert down.exit_code == 0, down.stderr
    assert sql(postgres_url, "SELECT runner, tactic, policy FROM entries") == [
        ("Runner", "2", '["hot"]')
    ]
    assert cli("db", "upgrade", "--yes", db=postgres_url).exit_code == 0
    assert cli("verify", db=postgres_url).stdout.endswith("ok: no problems\n")
    assert sql(postgres_url, "SELECT selection FROM entries") == [(None,)]
    assert cli("revert", "2", "--yes", db=postgres_url).exit_code == 0  # the selection is gone
    assert sql(postgres_url, "SELECT tactic, selection FROM entries") == [("1", None)]


def test_models_and_migrations_do_not_drift(postgres_url: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    Registry.open(postgres_url).close()
    engine = create_engine(postgres_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn, opts={"compare_type": True, "compare_server_default": True}
            )
            assert compare_metadata(context, Base.metadata) == []
    finally:
        engine.dispose()


def _all_rows(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every ficache table, columns by name, rows in order."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            out = {}
            for table in sorted(TABLES):
                names = sorted(c["name"] for c in inspect(conn).get_columns(table))
                columns = ", ".join(f'"{n}"' for n in names)
                out[table] = [
                    tuple(row)
                    for row in conn.execute(
                        text(f'SELECT {columns} FROM "{table}" ORDER BY {columns}')
                    )
                ]
            return out
    finally:
        engine.dispose()


def test_a_frozen_0001_registry_copied_into_postgresql_upgrades_like_on_sqlite(
    cli, postgres_url: str, tmp_path: Path
) -> None:
    assert cli("db", "upgrade", "0001_registry", db=postgres_url).exit_code == 0
    copy = tmp_path / FROZEN_0001.name
    shutil.copyfile(FROZEN_0001, copy)
    engine = create_engine(postgres_url, poolclass=NullPool)
    try:
        with closing(sqlite3.connect(copy)) as source, engine.begin() as conn:
            for table in ("fingerprints", "commits", "entries", "entry_changes"):
                cursor = source.execute(f'SELECT * FROM "{table}" ORDER BY id')
                names = [d[0] for d in cursor.description]
                rows = [dict(zip(names, row, strict=True)) for row in cursor]
                columns = ", ".join(f'"{n}"' for n in names)
                values = ", ".join(f":{n}" for n in names)
                if rows:
                    conn.execute(text(f'INSERT INTO "{table}" ({columns}) VALUES ({values})'), rows)
                # Ids were given: move the table's sequence past them.
                conn.execute(
                    text(
                        f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), "
                        f'(SELECT max(id) FROM "{table}"))'
                    )
                )
    finally:
        engine.dispose()

    # A shared registry moves only by `ficache db upgrade`; the SQLite file on its first open.
    assert cli("db", "upgrade", "--yes", db=postgres_url).exit_code == 0
    with Registry.open(postgres_url) as reg, Registry.open(str(copy)) as sqlite_reg:
        assert reg.stats().revision == sqlite_reg.stats().revision == HEAD
    sqlite_rows = _all_rows(f"sqlite:///{copy}")
    assert _all_rows(postgres_url) == sqlite_rows
    assert len(sqlite_rows["entry_changes"]) > 0

    with Registry.open(postgres_url) as reg:  # old data stays writable; ids go on
        prune = reg.log()[0].id
        assert reg.revert(prune).commit_id == prune + 1


_OPEN_AT = """
import logging, sys, time
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
from ficache.registry import Registry
start = float(sys.argv[2])
while time.time() < start:
    time.sleep(0.001)
with Registry.open(sys.argv[1]) as reg:
    print(reg.stats().revision)
"""


def test_several_processes_opening_a_new_database_at_once_upgrade_it_once(
    postgres_url: str,
) -> None:
    start = time.time() + 4.0  # after every interpreter has imported ficache
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _OPEN_AT, postgres_url, repr(start)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(6)
    ]
    try:
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:  # the hard limit: none outlives the test
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)

    assert [(p.returncode, out) for p, (out, _err) in zip(procs, results, strict=True)] == [
        (0, f"{HEAD}\n")
    ] * 6
    # Alembic logs each revision it runs: exactly one process ran them, under the lock.
    upgraders = [err for _out, err in results if "Running upgrade" in err]
    assert len(upgraders) == 1
    assert upgraders[0].count("Running upgrade") == len(schema.history())
    assert tables(postgres_url) == TABLES
    assert sql(postgres_url, "SELECT version_num FROM alembic_version") == [(HEAD,)]


# -- refusals and faults: one line, exit 1, nothing changed ---------------------------------


def test_read_commands_do_not_create_a_registry_in_an_empty_database(
    cli, postgres_url: str
) -> None:
    for args in (("list",), ("stats",), ("log",), ("fingerprints",)):
        one_error_line(
            cli(*args, db=postgres_url),
            f"no registry in {display(postgres_url)}; import a cache file first "
            "(ficache import FILE)",
        )
    assert cli("db", "current", db=postgres_url).stdout == f"(none) (head {HEAD}: empty)\n"
    assert tables(postgres_url) == set()


def test_a_newer_schema_is_refused_and_not_touched(
    cli, postgres_url: str, cache_file, dump_db
) -> None:
    Registry.open(postgres_url).close()
    sql(postgres_url, "UPDATE alembic_version SET version_num = '0099_from_the_future'")
    before = dump_db(postgres_url)
    data = cache_file("a.json", {K16: ["Runner", 1]}, metadata=META)

    for args in (
        ("import", data),
        ("list",),
        ("db", "upgrade"),
        ("db", "downgrade", "base", "--yes"),
    ):
        one_error_line(
            cli(*args, db=postgres_url),
            f"registry {display(postgres_url)} has schema revision '0099_from_the_future', newer "
            f"than this ficache knows (head '{HEAD}'); upgrade ficache (pip install -U ficache)",
        )
    with pytest.raises(SchemaTooNewError):
        Registry.open(postgres_url)
    assert dump_db(postgres_url) == before


def test_a_foreign_database_is_refused_and_not_touched(postgres_url: str, dump_db) -> None:
    sql(postgres_url, "CREATE TABLE photos (id SERIAL PRIMARY KEY, name TEXT)")
    sql(postgres_url, "INSERT INTO photos (name) VALUES ('cat.jpg')")
    before = dump_db(postgres_url)

    with pytest.raises(NotARegistryError, match="is a database but not a ficache registry"):
        Registry.open(postgres_url)

    assert dump_db(postgres_url) == before


def test_a_server_that_cannot_be_reached_is_one_line(cli, cache_file) -> None:
    url = f"postgresql+psycopg://postgres@127.0.0.1:{pg_server.free_port()}/registry"
    data = cache_file("a.json", {K16: ["Runner", 1]}, metadata=META)

    for args in (("list",), ("import", data), ("db", "upgrade")):
        result = cli(*args, db=url)
        assert (result.exit_code, result.stdout) == (1, "")
        assert result.stderr.startswith(f"error: cannot reach registry {display(url)} (")
        assert result.stderr.endswith(
            "): the connection was refused; check that the server runs and the URL is right\n"
        )
        assert "Connection refused" in result.stderr
        assert result.stderr.count("\n") == 1


def test_a_database_that_does_not_exist_is_one_line(cli, postgres_server) -> None:
    url = postgres_server.url("no_such_database")

    result = cli("list", db=url)

    one_error_line(
        result,
        f'cannot reach registry {display(url)} (connection to server at "127.0.0.1", port '
        f'{postgres_server.port} failed: FATAL: database "no_such_database" does not exist); '
        "check that the server runs and the URL is right",
    )


def test_a_missing_driver_says_what_to_install(cli, postgres_server) -> None:
    if importlib.util.find_spec("psycopg2") is not None:
        pytest.skip("psycopg2 is installed here")
    url = postgres_server.url("registry").replace("+psycopg://", "+psycopg2://")

    one_error_line(
        cli("list", db=url),
        f"cannot use registry URL {display(url)}: No module named 'psycopg2'; install the "
        "PostgreSQL driver: pip install 'ficache[postgres]' (and use a postgresql+psycopg:// URL)",
    )


def test_a_dropped_connection_is_replaced(postgres_url: str, postgres_server) -> None:
    with Registry.open(postgres_url) as reg:
        assert reg.stats().commits == 0
        assert postgres_server.terminate_connections(postgres_url.rsplit("/", 1)[1]) >= 1
        # The pool's connection died with its server process; the next use reconnects.
        assert reg.stats().commits == 0


def test_a_warm_start_whose_registry_cannot_be_reached_tunes_uncached(autotuner: Any) -> None:
    url = f"postgresql+psycopg://postgres@127.0.0.1:{pg_server.free_port()}/registry"

    # A refused connection is retried (the server may be restarting) within the limit.
    with ficache.warm_start(db=url, registry_timeout=2) as ws:
        tuned = standin_tune()

    report = ws.report
    assert (report.loaded, report.tuned, report.committed, tuned.profiled) == (0, 18, 0, 18)
    assert (report.status, bool(report.reason)) == ("uncached", True)
    assert report.reason.startswith(f"cannot reach registry {display(url)} (")
    assert "the connection was refused" in report.reason
    assert "\n" not in report.reason


# -- warm starts on real gloo ranks, rank 0 on PostgreSQL -------------------------------------

#: The scenarios of tests/gloo_scenarios.py that run on PostgreSQL (world 2): the
#: main paths and a held write lock; the SQLite-file faults stay in test_sync.py.
PG_SCENARIOS = ["cold_warm", "partial", "per_rank_keys", "disagree", "locked"]
ALL = gloo_scenarios.ALL
WORLD = 2


@pytest.fixture(scope="module")
def pg_ranks(
    postgres_server: pg_server.PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Any:
    names = [postgres_server.create_database() for _ in PG_SCENARIOS]
    dbs = {
        scenario: postgres_server.url(name)
        for scenario, name in zip(PG_SCENARIOS, names, strict=True)
    }
    try:
        root = str(tmp_path_factory.mktemp("pg-ranks"))
        results = run_ranks(
            gloo_scenarios.run_plan, WORLD, root, PG_SCENARIOS, dbs, timeout=420, group_timeout=60
        )
        yield dict(enumerate(results))
    finally:
        for name in names:
            postgres_server.drop_database(name)


def scenario(results: dict[int, dict[str, Any]], name: str) -> list[dict[str, Any]]:
    out = [results[rank][name] for rank in sorted(results)]
    for rank, r in enumerate(out):
        assert "error" not in r, f"scenario {name} failed on rank {rank}:\n{r['error']}"
    return out


def test_gloo_cold_then_warm_then_half_on_postgresql(pg_ranks: Any) -> None:
    per_rank = scenario(pg_ranks, "cold_warm")
    for r in per_rank:
        cold, warm, half = (r[phase]["report"] for phase in ("cold", "warm", "half"))
        assert (cold["status"], cold["tuned"], cold["committed"], cold["commit_id"]) == (
            "cold",
            ALL,
            ALL,
            1,
        )
        assert cold["registry"].startswith("postgresql+psycopg://")
        assert (warm["status"], warm["loaded"], warm["tuned"], warm["committed"]) == (
            "warm",
            ALL,
            0,
            0,
        )
        assert warm["slice_cache"] == "hit" and r["warm"]["standin"]["profiled"] == 0
        assert (half["status"], half["loaded"], half["tuned"], half["committed"]) == (
            "partial",
            ALL // 2,
            ALL // 2,
            ALL // 2,
        )
        assert r["warm"]["entries"] == per_rank[0]["cold"]["entries"]
    # The warm start served the fingerprint the cold one stored.
    [served] = per_rank[0]["last_served"]
    assert served is not None
    assert per_rank[0]["registry"] == {"commits": 2, "scopes": {"shared": ALL}}


def test_gloo_partial_per_rank_and_disagreeing_starts_on_postgresql(pg_ranks: Any) -> None:
    partial = scenario(pg_ranks, "partial")
    for r in partial:
        second = r["second"]["report"]
        assert (second["status"], second["loaded"], second["tuned"], second["committed"]) == (
            "partial",
            12,
            6,
            6,
        )
    assert partial[0]["registry"] == {"commits": 2, "scopes": {"shared": ALL}}

    per_rank = scenario(pg_ranks, "per_rank_keys")
    assert per_rank[0]["registry"]["scopes"] == {f"world{WORLD}/rank{r}": ALL for r in range(WORLD)}
    for rank, r in enumerate(per_rank):
        assert (r["second"]["report"]["status"], r["second"]["report"]["loaded"]) == ("warm", ALL)
        assert all(f"'rank{rank}'" in key for key in r["second"]["entries"])

    disagree = scenario(pg_ranks, "disagree")
    for rank, r in enumerate(disagree):
        assert r["first"]["report"]["disagreements"] == ALL
        assert r["first"]["report"]["shared"] == 0
        assert {row[1] for row in r["second"]["entries"].values()} == {str(rank % 5)}


def test_gloo_a_held_write_lock_serves_but_commits_nothing_on_postgresql(pg_ranks: Any) -> None:
    per_rank = scenario(pg_ranks, "locked")
    for r in per_rank:
        rep = r["first"]["report"]
        assert (rep["status"], rep["loaded"], rep["tuned"], rep["committed"]) == (
            "partial",
            12,
            6,
            0,
        )
        assert (
            rep["reason"].startswith("nothing committed: commit failed")
            and "locked" in (rep["reason"])
        )
    assert len({r["first"]["report"]["reason"] for r in per_rank}) == 1
    assert per_rank[0]["registry"] == {"commits": 1, "scopes": {"shared": 12}}


# -- a server that stops answering (ficache.deadline) ---------------------------------------

#: What each freezing proxy waits for: a query of the test's own, the warm start's
#: read of its fingerprint (step 2), the commit's insert of the new entries (step 9).
OWN_QUERY = b"SELECT 'the server freezes here'"
EXPORT_QUERY = b"fingerprints.digest, fingerprints.flashinfer_version"
COMMIT_INSERT = b"INSERT INTO entries"

#: Run in a child (a deadline that never fires would hang it; the parent kills it):
#: a cut read, a block that ended in time, and a descriptor reused after a close.
_DEADLINE_CHILD = r"""
import json, socket, sys, time
from sqlalchemy import text
from ficache.deadline import registry_deadline
from ficache.registry import Registry

frozen_url, direct_url = sys.argv[1:3]
out = {}
reg = Registry.open(frozen_url)  # through the proxy, before anything froze
try:
    with registry_deadline(1.0, "registry under test"):
        with reg.engine.connect() as conn:
            conn.execute(text("SELECT 'the server freezes here'"))
    out["frozen"] = "no error"
except Exception as exc:
    out["frozen"] = f"{type(exc).__name__}: {exc}"
reg.close()

with Registry.open(direct_url) as reg:
    with registry_deadline(0.5, "registry under test"):
        commits = reg.stats().commits
    time.sleep(1.0)  # past the deadline: the block ended in time, nothing is cut
    out["in_time"] = [commits, reg.stats().commits]

with registry_deadline(0.5, "registry under test"):
    with Registry.open(direct_url) as reg:
        reg.stats()
    # The registry's connections are closed; their descriptors are free for reuse.
    a, b = socket.socketpair()
    time.sleep(1.0)  # the deadline passes with nothing of the registry left open
a.sendall(b"x")
out["reused"] = b.recv(1).decode()
print(json.dumps(out))
"""


def test_a_frozen_server_is_cut_at_the_deadline_and_nothing_else_is(
    postgres_server: pg_server.PostgresServer, postgres_url: str
) -> None:
    name = postgres_url.rsplit("/", 1)[1]
    with freezing_proxy("127.0.0.1", postgres_server.port, OWN_QUERY) as proxy:
        child = subprocess.run(
            [sys.executable, "-c", _DEADLINE_CHILD, proxy.url(name), postgres_url],
            capture_output=True,
            text=True,
            timeout=120,  # the hang guard: a deadline that never fires fails here
            cwd=REPO,
        )
        assert child.returncode == 0, child.stderr
        assert proxy.frozen == 1
    out = json.loads(child.stdout)
    cut_within(out["frozen"], "registry under test", 1, prefix="RegistryTimeoutError: ")
    assert out["in_time"] == [0, 0]
    assert out["reused"] == "x"


_ADOPTION_CHILD = r"""
import sys
from pathlib import Path
sys.path.insert(0, "tests")
from samples import H200_METADATA
from ficache.adopt import Sources, adopt_into_empty_registry
from ficache.fingerprint import Fingerprint

url, root = sys.argv[1:3]
fingerprint = Fingerprint.from_flashinfer_metadata(H200_METADATA)
try:
    adopt_into_empty_registry(
        url, fingerprint, Sources((Path(root),)), registry_timeout=float(sys.argv[3])
    )
    print("no error")
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}")
"""


def test_a_server_frozen_in_the_adoption_costs_the_limit_and_writes_nothing(
    postgres_server: pg_server.PostgresServer, postgres_url: str, tmp_path: Path
) -> None:
    from test_adopt import vllm_tree

    tree = vllm_tree(tmp_path)
    name = postgres_url.rsplit("/", 1)[1]
    # The limit bounds the adoption's whole registry work: 3 s leaves a loaded machine
    # room to reach the write (at 1 s, CI once cut the reads before the INSERT came).
    limit = 3.0
    with freezing_proxy("127.0.0.1", postgres_server.port, COMMIT_INSERT) as proxy:
        child = subprocess.run(
            [
                sys.executable,
                "-c",
                _ADOPTION_CHILD,
                proxy.url(name),
                str(tree["vllm"]),
                str(limit),
            ],
            capture_output=True,
            text=True,
            timeout=120,  # the hang guard
            cwd=REPO,
        )
        assert child.returncode == 0, child.stderr
        assert proxy.frozen == 1, child.stdout  # the check passed; the adoption's write froze
        url_shown = display(proxy.url(name))
    cut_within(
        child.stdout, f"registry {url_shown}", limit, prefix="RegistryTimeoutError: ", suffix="\n"
    )
    # The server rolled the cut transaction back: the registry holds no commit.
    assert sql(postgres_url, "SELECT count(*) FROM commits") == [(0,)]


FROZEN = {"frozen_export": EXPORT_QUERY, "frozen_commit": COMMIT_INSERT}


@pytest.fixture(scope="module")
def frozen_ranks(
    postgres_server: pg_server.PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> Any:
    names = {scenario: postgres_server.create_database() for scenario in FROZEN}
    proxies = {
        scenario: FreezingProxy("127.0.0.1", postgres_server.port, trigger)
        for scenario, trigger in FROZEN.items()
    }
    try:
        root = str(tmp_path_factory.mktemp("frozen-ranks"))
        dbs = {scenario: proxies[scenario].url(names[scenario]) for scenario in FROZEN}
        results = run_ranks(
            gloo_scenarios.run_plan, WORLD, root, list(FROZEN), dbs, timeout=300, group_timeout=60
        )
        frozen = {scenario: proxy.frozen for scenario, proxy in proxies.items()}
        for proxy in proxies.values():
            proxy.close()  # the server sees the frozen connections go and rolls back
        after = {
            scenario: gloo_scenarios.registry_summary(postgres_server.url(name))
            for scenario, name in names.items()
        }
        yield {"ranks": dict(enumerate(results)), "frozen": frozen, "after": after, "dbs": dbs}
    finally:
        for proxy in proxies.values():
            proxy.close()
        for name in names.values():
            postgres_server.drop_database(name)


def frozen_starts(frozen_ranks: Any, name: str) -> list[dict[str, Any]]:
    """Each rank's start of scenario ``name``, after what every frozen start shares: the
    proxy froze once, no rank raised, every rank tuned every key and holds the same
    entries, nothing was loaded or committed, and every rank gives the same reason."""
    starts = [r["first"] for r in scenario(frozen_ranks["ranks"], name)]
    assert frozen_ranks["frozen"][name] == 1
    for start in starts:
        rep = start["report"]
        assert (rep["loaded"], rep["tuned"], rep["committed"]) == (0, ALL, 0)
        assert start["exception"] is None
        assert len(start["entries"]) == ALL
    assert all(start["entries"] == starts[0]["entries"] for start in starts)
    assert len({start["report"]["reason"] for start in starts}) == 1
    return starts


def test_gloo_a_server_frozen_in_the_export_costs_the_limit_and_every_rank_tunes_uncached(
    frozen_ranks: Any,
) -> None:
    starts = frozen_starts(frozen_ranks, "frozen_export")
    what = f"registry {display(frozen_ranks['dbs']['frozen_export'])}"
    for start in starts:  # tuned from the same empty cache
        reason = start["report"]["reason"]
        cut_within(reason, what, gloo_scenarios.FROZEN_LIMIT)
        assert (start["report"]["status"], start["report"]["reason"]) == ("uncached", reason)
    assert frozen_ranks["after"]["frozen_export"] == {"commits": 0, "scopes": {}}


def test_gloo_a_server_frozen_in_the_commit_costs_the_limit_and_writes_nothing(
    frozen_ranks: Any,
) -> None:
    starts = frozen_starts(frozen_ranks, "frozen_commit")
    what = f"registry {display(frozen_ranks['dbs']['frozen_commit'])}"
    for start in starts:  # every rank keeps what it tuned
        assert start["report"]["commit_id"] is None
        cut_within(
            start["report"]["reason"],
            what,
            gloo_scenarios.FROZEN_LIMIT,
            prefix="nothing committed: commit failed: ",
            suffix="; if the server had received the commit before it stopped answering, it "
            "lands when the server resumes, whole",
        )
    # The cut transaction never reached COMMIT: the server rolled it back whole.
    assert frozen_ranks["after"]["frozen_commit"] == {"commits": 0, "scopes": {}}


# -- restart storms: a server that refuses for now (ficache.retrying) -------------------------


def storm_role_url(server: pg_server.PostgresServer, url: str, *, limit: int) -> tuple[str, str]:
    """Give ``url``'s database to a login role that is no superuser (a database's
    ``CONNECTION LIMIT`` binds only those), limited to ``limit`` connections; the
    role's SQLAlchemy URL and its plain libpq URL."""
    name = url.rsplit("/", 1)[1]
    role = f"ficache_storm_{os.getpid()}"
    admin = server._admin
    exists = admin.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [role]).fetchone()
    if exists is None:
        admin.execute(f'CREATE ROLE "{role}" LOGIN')
    admin.execute(f'ALTER DATABASE "{name}" OWNER TO "{role}"')
    sql(url, f'ALTER SCHEMA public OWNER TO "{role}"')
    admin.execute(f'ALTER DATABASE "{name}" CONNECTION LIMIT {limit}')
    plain = f"postgresql://{role}@127.0.0.1:{server.port}/{name}"
    return plain.replace("postgresql://", "postgresql+psycopg://"), plain


def wait_for_no_sessions(server: pg_server.PostgresServer, name: str, limit_s: float = 60) -> None:
    """Wait until the server reports no session on database ``name`` (``pg_stat_activity``):
    a client's closed connection is freed by its server process exiting, some time after the
    close, and until then it still takes one of the database's connection slots."""
    deadline = time.monotonic() + limit_s
    while True:
        rows = server._admin.execute(
            "SELECT pid, state FROM pg_stat_activity WHERE datname = %s", [name]
        ).fetchall()
        if not rows:
            return
        assert time.monotonic() < deadline, f"sessions on {name} never ended: {rows}"
        time.sleep(0.02)


def hold_connections(server: pg_server.PostgresServer, plain_url: str, count: int) -> list[Any]:
    """``count`` idle connections of the storm role: the database's every slot, taken, once
    the server reports the connections before them (an earlier start's) gone."""
    import psycopg

    name = plain_url.rsplit("/", 1)[1]
    deadline = time.monotonic() + 60
    while True:
        wait_for_no_sessions(server, name)
        held: list[Any] = []
        try:
            for _ in range(count):
                held.append(psycopg.connect(plain_url, autocommit=True))
            break
        except psycopg.OperationalError as exc:
            # A server process leaves pg_stat_activity a moment before it gives its slot
            # back: ask the server again, never sleep a guessed time.
            for conn in held:
                conn.close()
            assert "too many connections" in str(exc), exc
            assert time.monotonic() < deadline, exc
    with pytest.raises(psycopg.OperationalError, match="too many connections"):
        psycopg.connect(plain_url).close()
    return held


def release_later(held: list[Any], seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, lambda: [conn.close() for conn in held])
    timer.start()
    return timer


def test_a_start_refused_with_too_many_clients_is_served_once_a_connection_frees(
    autotuner: Any, postgres_server: pg_server.PostgresServer, postgres_url: str
) -> None:
    url, plain = storm_role_url(postgres_server, postgres_url, limit=2)
    with ficache.warm_start(db=url) as ws:
        standin_tune()
    assert ws.report.committed == 18
    held = hold_connections(postgres_server, plain, 2)
    release_later(held, 1.5)

    started = time.monotonic()
    with ficache.warm_start(db=url, registry_timeout=30) as ws:
        tuned = standin_tune()
    elapsed = time.monotonic() - started

    report = ws.report
    assert report.reason is None, report.reason
    assert (report.loaded, tuned.profiled) == (18, 0)
    assert elapsed >= 1.4  # it was refused until the connections were released


def test_a_start_refused_past_the_registry_timeout_tunes_uncached_and_names_the_cause(
    autotuner: Any, postgres_server: pg_server.PostgresServer, postgres_url: str
) -> None:
    url, plain = storm_role_url(postgres_server, postgres_url, limit=2)
    with ficache.warm_start(db=url) as ws:
        standin_tune()
    held = hold_connections(postgres_server, plain, 2)
    limit = 2.0
    try:
        started = time.monotonic()
        with ficache.warm_start(db=url, registry_timeout=limit) as ws:
            tuned = standin_tune()
        elapsed = time.monotonic() - started
    finally:
        for conn in held:
            conn.close()

    report = ws.report
    assert (report.loaded, tuned.profiled, report.committed) == (0, 18, 0)
    assert (report.status, bool(report.reason)) == ("uncached", True)
    assert report.reason.startswith(f"cannot reach registry {display(url)} (")
    assert "too many connections" in report.reason
    assert "raise max_connections on the server or put a pooler such as PgBouncer" in (
        report.reason
    )
    attempts = re.search(r"still refused after (\d+) attempt\(s\) over ", report.reason)
    assert attempts is not None and int(attempts[1]) > 1, report.reason
    assert "\n" not in report.reason
    assert elapsed < CUT_CEILING * limit + 2  # the start's own work beside the limit


def test_a_commit_retried_after_a_connection_reset_lands_once(
    autotuner: Any, postgres_server: pg_server.PostgresServer, postgres_url: str
) -> None:
    name = postgres_url.rsplit("/", 1)[1]
    Registry.open(postgres_url).close()  # created at head, outside the proxy
    proxy = ResettingProxy("127.0.0.1", postgres_server.port, armed_by=COMMIT_INSERT)
    try:
        with ficache.warm_start(db=proxy.url(name), registry_timeout=30) as ws:
            standin_tune()
    finally:
        proxy.close()

    assert proxy.resets == 1  # the COMMIT reached the server, its answer never came back
    report = ws.report
    commits = sql(postgres_url, "SELECT id, added FROM commits WHERE kind = 'startup'")
    assert commits == [(report.commit_id, 18)], report.reason
    assert (report.reason, report.committed) == (None, 18)
    assert sql(postgres_url, "SELECT count(*) FROM entries") == [(18,)]


def test_a_commit_whose_answer_was_lost_while_it_was_still_landing_is_reported_once(
    autotuner: Any, postgres_server: pg_server.PostgresServer, postgres_url: str
) -> None:
    """The server received the COMMIT, the client saw a reset, and the COMMIT is still being
    made when the retry starts (a deferred trigger holds it 1.5 s): the retry's token check
    must wait for the write lock, find the commit and report it, not write a second time."""
    name = postgres_url.rsplit("/", 1)[1]
    Registry.open(postgres_url).close()  # created at head, outside the proxy
    sql(
        postgres_url,
        "CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN PERFORM pg_sleep(1.5); RETURN NULL; END $$",
    )
    sql(
        postgres_url,
        "CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON commits "
        "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit()",
    )
    proxy = ResettingProxy("127.0.0.1", postgres_server.port, armed_by=COMMIT_INSERT, delay_s=0.1)
    try:
        with ficache.warm_start(db=proxy.url(name), registry_timeout=30) as ws:
            standin_tune()
    finally:
        proxy.close()

    assert proxy.resets == 1  # the COMMIT reached the server, its answer never came back
    report = ws.report
    commits = sql(postgres_url, "SELECT id, added FROM commits WHERE kind = 'startup'")
    assert len(commits) == 1, commits
    assert commits == [(report.commit_id, 18)], report.reason
    assert (report.reason, report.committed) == (None, 18)
    assert sql(postgres_url, "SELECT count(*) FROM entries") == [(18,)]


def _adopt_tree(url: str, root: Path, registry_timeout: float) -> Any:
    from samples import H200_METADATA

    from ficache.adopt import Sources, adopt_into_empty_registry
    from ficache.fingerprint import Fingerprint

    fingerprint = Fingerprint.from_flashinfer_metadata(H200_METADATA)
    return adopt_into_empty_registry(
        url, fingerprint, Sources((root,)), registry_timeout=registry_timeout
    )


def _adopted(url: str) -> list[tuple[Any, ...]]:
    return sql(
        url,
        "SELECT f.digest, e.scope, e.key, e.runner, e.tactic FROM entries e "
        "JOIN fingerprints f ON f.id = e.fingerprint_id ORDER BY 1, 2, 3",
    )


def test_an_adoption_refused_with_too_many_clients_adopts_once_a_connection_frees(
    postgres_server: pg_server.PostgresServer, postgres_url: str, tmp_path: Path
) -> None:
    """The plugin's adoption in a restart storm: refused at first, then it adopts what a
    registry nobody else was using adopts (the same tree, another database)."""
    from test_adopt import vllm_tree

    tree = vllm_tree(tmp_path)
    reference_url = postgres_server.url(postgres_server.create_database())
    reference = _adopt_tree(reference_url, tree["vllm"], registry_timeout=30)
    assert reference is not None and reference.result.added > 0

    url, plain = storm_role_url(postgres_server, postgres_url, limit=2)
    Registry.open(url).close()  # created at head, by the role, before the slots are taken
    held = hold_connections(postgres_server, plain, 2)
    release_later(held, 1.5)
    started = time.monotonic()
    adoption = _adopt_tree(url, tree["vllm"], registry_timeout=30)
    elapsed = time.monotonic() - started

    assert adoption is not None
    assert adoption.result.added == reference.result.added
    assert _adopted(postgres_url) == _adopted(reference_url)
    assert sql(postgres_url, "SELECT count(*) FROM commits") == [(1,)]
    assert elapsed >= 1.4  # it was refused until the connections were released


def test_an_adoption_refused_past_the_registry_timeout_names_the_cause_and_writes_nothing(
    postgres_server: pg_server.PostgresServer, postgres_url: str, tmp_path: Path
) -> None:
    from test_adopt import vllm_tree

    from ficache.errors import FicacheError

    tree = vllm_tree(tmp_path)
    url, plain = storm_role_url(postgres_server, postgres_url, limit=2)
    Registry.open(url).close()
    held = hold_connections(postgres_server, plain, 2)
    limit = 2.0
    try:
        started = time.monotonic()
        with pytest.raises(FicacheError) as raised:
            _adopt_tree(url, tree["vllm"], registry_timeout=limit)
        elapsed = time.monotonic() - started
    finally:
        for conn in held:
            conn.close()

    message = str(raised.value)
    assert "too many connections" in message and "\n" not in message
    assert "raise max_connections on the server or put a pooler such as PgBouncer" in message
    attempts = re.search(r"still refused after (\d+) attempt\(s\) over ", message)
    assert attempts is not None and int(attempts[1]) > 1, message
    assert elapsed < CUT_CEILING * limit + 2
    assert sql(postgres_url, "SELECT count(*) FROM commits") == [(0,)]


def test_an_adoption_whose_commit_answer_was_lost_is_written_once(
    postgres_server: pg_server.PostgresServer, postgres_url: str, tmp_path: Path
) -> None:
    """The adoption's COMMIT reached the server and its answer never came back: the retry
    finds the registry no longer empty for the fingerprint and writes nothing again."""
    from test_adopt import vllm_tree

    tree = vllm_tree(tmp_path)
    name = postgres_url.rsplit("/", 1)[1]
    Registry.open(postgres_url).close()  # created at head, outside the proxy
    proxy = ResettingProxy("127.0.0.1", postgres_server.port, armed_by=COMMIT_INSERT)
    try:
        adoption = _adopt_tree(proxy.url(name), tree["vllm"], registry_timeout=30)
    finally:
        proxy.close()

    assert proxy.resets == 1
    assert adoption is not None
    assert sql(postgres_url, "SELECT count(*) FROM commits") == [(1,)]
    assert adoption.plan.entries and len(_adopted(postgres_url)) == len(adoption.plan.entries)
