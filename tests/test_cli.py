"""The ``ficache`` command line: every command, exact output, exit codes, and
bad input (one line on stderr, exit 1, registry unchanged).

Tests marked ``@both_backends`` run on SQLite and on PostgreSQL (the
PostgreSQL cases in ``tox -e postgres``); the others are about SQLite files."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import click
import pytest
import sqlalchemy
from samples import NO_DUPLICATES, SHORT_H200_METADATA
from terminal import run_in_a_terminal

from ficache import __version__, schema
from ficache.cli import cli as ficache_cli
from ficache.fingerprint import FLASHINFER_FIELDS, Fingerprint
from ficache.registry import Registry

REPO = Path(__file__).resolve().parent.parent
META = SHORT_H200_METADATA
B200 = {**META, "gpu": "NVIDIA B200"}
POLICY = ["cuda_graph_profile_replays", None, "l2_cache_policy", "hot"]
K16 = "('mm', 'Runner', ((16, 64),), (torch.bfloat16,))"
K32 = "('mm', 'Runner', ((32, 64),), (torch.bfloat16,))"
K64 = "('mm', 'Runner', ((64, 64),), (torch.bfloat16,))"
DIGEST = Fingerprint.from_flashinfer_metadata(META).digest

#: Runs a test on SQLite and on PostgreSQL: ``cli`` and ``populated`` follow ``backend``.
both_backends = pytest.mark.usefixtures("backend")


def when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


@pytest.fixture
def populated(cli, cache_file, registry_path: Path, registry_db: str, created_note) -> Path | str:
    """A registry with one import (commit 1) of two H200 entries: the SQLite
    file's path, or in a test's PostgreSQL case the database's URL."""
    path = cache_file(
        "h200.json", {K16: ["Runner", [1, [2, 3]], POLICY], K32: ["Runner", 4]}, metadata=META
    )
    result = cli("import", path)
    assert (result.exit_code, result.stderr) == (0, created_note(registry_db))
    return registry_path if registry_db == str(registry_path) else registry_db


def one_error_line(result, message: str) -> None:
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr == f"error: {message}\n"


# -- help ---------------------------------------------------------------------------


def _walk(command: click.Command, path: tuple[str, ...] = ()):
    yield path, command
    if isinstance(command, click.Group):
        for name, sub in sorted(command.commands.items()):
            yield from _walk(sub, (*path, name))


ALL_COMMANDS = list(_walk(ficache_cli))


def test_the_command_set() -> None:
    assert sorted(" ".join(path) for path, _ in ALL_COMMANDS) == sorted(
        [
            "",
            "db",
            "db current",
            "db downgrade",
            "db history",
            "db upgrade",
            "demo",
            "env",
            "export",
            "fingerprint",
            "fingerprints",
            "fold",
            "import",
            "list",
            "log",
            "merge",
            "prune",
            "revert",
            "show",
            "stats",
            "verify",
        ]
    )


@pytest.mark.parametrize(
    ("path", "command"), ALL_COMMANDS, ids=[" ".join(p) or "ficache" for p, _ in ALL_COMMANDS]
)
def test_every_command_and_option_has_help(
    cli, path: tuple[str, ...], command: click.Command
) -> None:
    assert (command.help or "").strip(), f"ficache {' '.join(path)} has no help text"
    for param in command.params:
        if isinstance(param, click.Option):
            assert (param.help or "").strip(), (
                f"ficache {' '.join(path)} {param.opts[0]} has no help text"
            )

    result = cli(*path, "--help", db=None)

    assert result.exit_code == 0
    assert result.stdout.startswith(f"Usage: ficache {' '.join(path)}".rstrip())
    assert " ".join(command.help.split()[:6]) in " ".join(result.stdout.split())


def test_version(cli) -> None:
    assert cli("--version", db=None).stdout == "ficache, version 0.10.0\n"


@pytest.mark.parametrize(
    "args",
    [
        ("nosuch",),
        ("list", "--format", "xml"),
        ("export",),
        ("import",),
        ("log", "--limit", "0"),
        ("prune", "--older-than", "soon"),
        ("revert", "x"),
        ("import", "--scope", "rank1", "x.json"),
        ("db",),
        ("db", "downgrade"),
    ],
)
def test_usage_errors_exit_2(cli, registry_path: Path, args: tuple[str, ...]) -> None:
    result = cli(*args)

    assert result.exit_code == 2
    assert "Usage: ficache" in result.output
    assert not registry_path.exists()


# -- import ------------------------------------------------------------------------------


@both_backends
def test_import_prints_counts_and_makes_one_commit(
    cli, cache_file, registry_db: str, created_note
) -> None:
    a = cache_file("a.json", {K16: ["Runner", 1], K32: ["Runner", 2]}, metadata=META)
    b = cache_file("b.json", {K16: ["Runner", 1]}, metadata=B200)

    result = cli("import", a, b)

    assert (result.exit_code, result.stderr) == (0, created_note(registry_db))
    assert (
        result.stdout
        == "imported 3 entries from 2 file(s): 3 added, 0 replaced, 0 unchanged (commit 1)\n"
    )
    with Registry.open(registry_db) as reg:
        [commit] = reg.log()
        assert (commit.kind, commit.added, commit.message) == ("import", 3, f"{a}, {b}")


@both_backends
def test_import_again_is_unchanged_and_creates_no_commit(
    cli, populated: str, cache_file, dump_db
) -> None:
    before = dump_db(populated)
    again = cache_file(
        "again.json", {K16: ["Runner", [1, [2, 3]], POLICY], K32: ["Runner", 4]}, metadata=META
    )

    result = cli("import", again)

    assert (
        result.stdout
        == "imported 2 entries from 1 file(s): 0 added, 0 replaced, 2 unchanged (nothing new, no commit)\n"
    )
    assert dump_db(populated) == before


@both_backends
def test_import_replaces_and_reports_json(cli, populated: str, cache_file) -> None:
    newer = cache_file(
        "newer.json", {K16: ["Runner", 9], K64: ["Runner", 1]}, metadata=META, generation="ab" * 32
    )

    result = cli("import", newer, "--format", "json")

    assert json.loads(result.stdout) == {
        "files": 1,
        "entries": 2,
        "commit": 2,
        "added": 1,
        "replaced": 1,
        "unchanged": 0,
        "records": 0,
        "records_added": 0,
        "records_replaced": 0,
        "records_unchanged": 0,
        **NO_DUPLICATES,
    }


def test_import_keeps_records_and_empty_namespaces_hold_none(
    cli, cache_file, registry_path: Path, created_note
) -> None:
    path = cache_file(
        "r.json",
        {"_records": {"vllm": {}, "sglang": {"k": [1, {"b": 2, "a": 1.5}]}}, K16: ["Runner", 1]},
        metadata=META,
    )

    result = cli("import", path)

    assert (result.exit_code, result.stderr) == (0, created_note(registry_path))
    assert result.stdout == (
        "imported 1 entries and 1 records from 1 file(s): 1 added, 0 replaced, 0 unchanged; "
        "records 1 added, 0 replaced, 0 unchanged (commit 1)\n"
    )
    assert cli("list", "--records").stdout.splitlines() == [
        "fingerprint  scope   namespace  key  value                commit",
        '1            shared  sglang     k    [1,{"a":1.5,"b":2}]  1',
    ]


@both_backends
def test_import_without_metadata_needs_a_fingerprint(
    cli, populated: str, cache_file, dump_db
) -> None:
    bare = cache_file("bare.json", {K64: ["Runner", 5]}, metadata=None)
    before = dump_db(populated)

    refused = cli("import", bare)

    one_error_line(
        refused,
        f"{bare} has no _metadata, so its environment is unknown; "
        "import it with --fingerprint ID|current",
    )
    assert dump_db(populated) == before

    accepted = cli("import", bare, "--fingerprint", "1", "--scope", "tp2/rank1")

    assert (
        accepted.stdout
        == "imported 1 entries from 1 file(s): 1 added, 0 replaced, 0 unchanged (commit 2)\n"
    )
    rows = json.loads(cli("list", "--scope", "tp2/rank1", "--format", "json").stdout)
    assert [(r["fingerprint"], r["key"], r["tactic"]) for r in rows] == [(1, K64, 5)]


def test_import_without_metadata_as_the_current_environment(cli, cache_file) -> None:
    from ficache.fingerprint import collect

    bare = cache_file("bare.json", {K64: ["Runner", 5]}, metadata=None)

    result = cli("import", bare, "--fingerprint", "current")

    assert result.exit_code == 0
    [info] = json.loads(cli("fingerprints", "--format", "json").stdout)
    assert info["digest"] == collect().digest


# -- import: the inputs' own duplicates and conflicts (issue 23) ------------------------------

#: Two files as in the operator's report: b.json holds K16 and K32 like a.json (K32
#: with another value) and K64 twice over with a.json's value.
A_ENTRIES = {K16: ["Runner", 1], K32: ["Runner", 2], K64: ["Runner", 3]}
B_ENTRIES = {K16: ["Runner", 1], K32: ["Runner", 20], K64: ["Runner", 3]}


def stored_tactics(db: str | Path) -> dict[str, object]:
    with Registry.open(str(db), create=False) as reg:
        return {e.key: json.loads(e.tactic_json) for e in reg.entries()}


@both_backends
def test_import_counts_duplicates_and_conflicts_and_keeps_the_first_file_as_merge_does(
    cli, cache_file, created_note, registry_db: str, tmp_path: Path
) -> None:
    a = cache_file("a.json", A_ENTRIES, metadata=META)
    b = cache_file("b.json", B_ENTRIES, metadata=META)

    result = cli("import", a, b)

    assert result.exit_code == 0
    assert result.stdout == (
        "imported 6 entries from 2 file(s): 3 added, 0 replaced, 0 unchanged, "
        "2 duplicates, 1 conflicts (commit 1)\n"
    )
    assert result.stderr == created_note(registry_db) + (
        f"warning: 1 entry held different values in two files, resolved by --on-conflict "
        f"keep; first: {K32} ({a}, {b}) -> source 1\n"
    )
    merged = tmp_path / "merged.db"
    assert cli("merge", a, b, db=merged).exit_code == 0
    assert stored_tactics(registry_db) == stored_tactics(merged) == {K16: 1, K32: 2, K64: 3}


@pytest.mark.parametrize(
    ("policy", "expected", "counts"),
    [
        ("keep", {K16: 1, K32: 2, K64: 3}, (3, 3, 2)),
        ("theirs", {K16: 1, K32: 30, K64: 3}, (3, 3, 2)),
        ("newest", {K16: 1, K32: 20, K64: 3}, (3, 3, 2)),
        ("vote", {K16: 1, K32: 20, K64: 3}, (3, 3, 2)),
        ("drop", {K16: 1, K64: 3}, (2, 3, 3)),
    ],
)
def test_import_on_conflict_follows_merge_and_every_entry_is_counted_once(
    cli, cache_file, registry_db: str, tmp_path: Path, policy: str, expected, counts
) -> None:
    """Four files hold K32 as 2 (a, the first), 20 (b, the newest, and c) and 30 (d, the
    last); K16 and K64 twice with one value. 8 entries: 3 duplicates (one per key), K32's
    other values are conflicts (all three of them when dropped)."""
    a = cache_file("a.json", A_ENTRIES, metadata=META)
    b = cache_file("b.json", B_ENTRIES, metadata=META)
    c = cache_file("c.json", {K32: ["Runner", 20]}, metadata=META)
    d = cache_file("d.json", {K32: ["Runner", 30]}, metadata=META)
    for age, path in enumerate((d, c, a, b)):  # b is the newest file, d the oldest
        os.utime(path, (1_700_000_000 + age, 1_700_000_000 + age))

    result = cli("import", a, b, c, d, "--on-conflict", policy, "--format", "json")

    report = json.loads(result.stdout)
    assert (report["added"], report["duplicates"], report["conflicts"]) == counts
    assert (
        report["added"]
        + report["replaced"]
        + report["unchanged"]
        + report["duplicates"]
        + report["conflicts"]
        == report["entries"]
        == 8
    )
    [conflict] = report["conflicting"]
    assert (conflict["key"], conflict["files"]) == (K32, [str(a), str(b), str(c), str(d)])
    merged = tmp_path / "merged.db"
    assert cli("merge", a, b, c, d, "--on-conflict", policy, db=merged).exit_code == 0
    assert stored_tactics(registry_db) == stored_tactics(merged) == expected


@both_backends
def test_import_on_conflict_fail_names_a_key_and_the_files_and_changes_nothing(
    cli, populated: str, cache_file, dump_db
) -> None:
    a = cache_file("a.json", A_ENTRIES, metadata=META)
    b = cache_file("b.json", B_ENTRIES, metadata=META)
    before = dump_db(populated)

    result = cli("import", a, b, "--on-conflict", "fail")

    one_error_line(
        result,
        f'{a} and {b} hold different values for entry "{K32}" (fingerprint {DIGEST[:12]}, '
        "scope shared); nothing imported; choose which wins with "
        "--on-conflict keep|theirs|newest|vote|drop",
    )
    assert dump_db(populated) == before
    agreeing = cli(
        "import",
        a,
        cache_file("k16.json", {K16: ["Runner", 1]}, metadata=META),
        "--on-conflict",
        "fail",
    )
    assert agreeing.stdout.endswith("1 duplicates, 0 conflicts (commit 2)\n")


def test_import_on_conflict_fail_on_a_new_registry_creates_none(
    cli, cache_file, registry_path: Path
) -> None:
    a = cache_file("a.json", A_ENTRIES, metadata=META)
    b = cache_file("b.json", B_ENTRIES, metadata=META)

    result = cli("import", a, b, "--on-conflict", "fail")

    assert result.exit_code == 1
    assert not registry_path.exists()


def test_import_resolves_conflicting_records_like_entries(cli, cache_file) -> None:
    a = cache_file(
        "a.json", {"_records": {"ns": {"k": 1, "same": 2}}, K16: ["Runner", 1]}, metadata=META
    )
    b = cache_file(
        "b.json", {"_records": {"ns": {"k": 5, "same": 2}}, K16: ["Runner", 1]}, metadata=META
    )

    refused = cli("import", a, b, "--on-conflict", "fail")
    one_error_line(
        refused,
        f"{a} and {b} hold different values for record ns/'k' (fingerprint {DIGEST[:12]}, "
        "scope shared); nothing imported; choose which wins with "
        "--on-conflict keep|theirs|newest|vote|drop",
    )
    result = cli("import", a, b, "--on-conflict", "theirs")

    assert result.stdout == (
        "imported 2 entries and 4 records from 2 file(s): 1 added, 0 replaced, 0 unchanged, "
        "1 duplicates, 0 conflicts; records 2 added, 0 replaced, 0 unchanged, 1 duplicates, "
        "1 conflicts (commit 1)\n"
    )
    assert cli("list", "--records").stdout.splitlines()[1:] == [
        "1            shared  ns         k     5      1",
        "1            shared  ns         same  2      1",
    ]


# -- import --dry-run -------------------------------------------------------------------------


@both_backends
def test_import_dry_run_shows_what_the_import_does_and_changes_nothing(
    cli, populated: str, cache_file, dump_db, registry_db: str
) -> None:
    a = cache_file("a.json", {K16: ["Runner", 9], K32: ["Runner", 4]}, metadata=META)
    b = cache_file("b.json", {K64: ["Runner", 1], K16: ["Runner", 8]}, metadata=META)
    before = dump_db(populated)
    file_bytes = Path(populated).read_bytes() if registry_db != str(populated) else None

    planned = cli("import", a, b, "--dry-run")

    summary = (
        "4 entries from 2 file(s): 1 added, 1 replaced, 1 unchanged, 0 duplicates, 1 conflicts"
    )
    assert (planned.exit_code, planned.stdout) == (
        0,
        f"would import {summary} (dry run: nothing changed)\n",
    )
    assert dump_db(populated) == before
    if file_bytes is not None:
        assert Path(populated).read_bytes() == file_bytes
    as_json = json.loads(cli("import", a, b, "--dry-run", "--format", "json").stdout)
    assert (as_json["dry_run"], as_json["commit"]) == (True, None)
    assert dump_db(populated) == before

    done = cli("import", a, b)

    assert done.stdout == f"imported {summary} (commit 2)\n"


def test_import_dry_run_on_a_missing_registry_creates_none(
    cli, cache_file, registry_path: Path
) -> None:
    a = cache_file("a.json", A_ENTRIES, metadata=META)

    result = cli("import", a, "--dry-run")

    assert result.stdout == (
        "would import 3 entries from 1 file(s): 3 added, 0 replaced, 0 unchanged "
        "(dry run: nothing changed)\n"
    )
    assert not registry_path.exists()


# -- list / fingerprints / stats / log ---------------------------------------------------------


@both_backends
def test_list_table(cli, populated: str) -> None:
    result = cli("list")

    assert result.exit_code == 0
    assert result.stdout.splitlines() == [
        "fingerprint  scope   op  runner  shapes      extras             tactic     commit",
        "1            shared  mm  Runner  [[16, 64]]  (torch.bfloat16,)  [1,[2,3]]  1",
        "1            shared  mm  Runner  [[32, 64]]  (torch.bfloat16,)  4          1",
    ]


@both_backends
def test_list_json_has_one_object_per_entry(cli, populated: str) -> None:
    rows = json.loads(cli("list", "--format", "json").stdout)

    assert [
        {
            k: r[k]
            for k in ("fingerprint", "scope", "op", "runner", "key", "tactic", "policy", "commit")
        }
        for r in rows
    ] == [
        {
            "fingerprint": 1,
            "scope": "shared",
            "op": "mm",
            "runner": "Runner",
            "key": K16,
            "tactic": [1, [2, 3]],
            "policy": POLICY,
            "commit": 1,
        },
        {
            "fingerprint": 1,
            "scope": "shared",
            "op": "mm",
            "runner": "Runner",
            "key": K32,
            "tactic": 4,
            "policy": None,
            "commit": 1,
        },
    ]
    assert rows[0]["shapes"] == [[16, 64]]
    assert rows[0]["extras"] == "(torch.bfloat16,)"


@both_backends
def test_list_filters(cli, populated: str, cache_file) -> None:
    other = "('attn', 'Runner', ((8,),), ())"
    cli("import", cache_file("b.json", {K16: ["Runner", 7], other: ["Runner", 1]}, metadata=B200))

    def keys(*args: str) -> list[tuple[int, str]]:
        result = cli("list", "--format", "json", *args)
        assert result.exit_code == 0
        return [(r["fingerprint"], r["key"]) for r in json.loads(result.stdout)]

    assert keys("--gpu", "NVIDIA B200") == [(2, other), (2, K16)]
    assert keys("--op", "attn") == [(2, other)]
    assert keys("--fingerprint", "1") == [(1, K16), (1, K32)]
    assert keys("--fingerprint", DIGEST[:10]) == [(1, K16), (1, K32)]
    assert keys("--flashinfer-version", "0.7.2", "--op", "mm") == [(1, K16), (1, K32), (2, K16)]
    assert keys("--flashinfer-version", "0.6") == []
    assert keys("--limit", "1") == [(1, K16)]
    assert cli("list", "--gpu", "none").stdout == (
        "fingerprint  scope  op  runner  shapes  extras  tactic  commit\n"
    )
    one_error_line(
        cli("list", "--fingerprint", "7"),
        "no fingerprint '7' in the registry; see `ficache fingerprints`",
    )


@both_backends
def test_fingerprints_table_and_json(cli, populated: str) -> None:
    table = cli("fingerprints")
    wide = cli("fingerprints", "--wide")

    assert table.stdout.splitlines() == [
        "id  gpu          cc  flashinfer  torch  cuda  entries  records  last served",
        "1   NVIDIA H200  *   0.7.2       *      12.9  2        0        never",
    ]
    assert wide.stdout.splitlines() == [
        "id  entries  records  last served  digest        flashinfer_version  cuda_version  "
        "cublas_version  cudnn_version  cudnn_frontend_version  cutlass_dsl_version  gpu          "
        "compute_capability  torch_version",
        f"1   2        0        never        {DIGEST[:12]}  0.7.2               12.9          "
        "12.9.1          91002          1.32.0                  4.8.1                NVIDIA H200  "
        "*                   *",
    ]
    [info] = json.loads(cli("fingerprints", "--format", "json").stdout)
    assert {
        k: info[k]
        for k in ("id", "digest", "entries", "records", "last_served_at", *FLASHINFER_FIELDS)
    } == {
        "id": 1,
        "digest": DIGEST,
        "entries": 2,
        "records": 0,
        "last_served_at": None,
        **META,
    }


def test_fingerprint_prints_the_current_environment(cli) -> None:
    from ficache.fingerprint import collect

    fp = collect()

    table = cli("fingerprint", db=None)
    as_json = cli("fingerprint", "--format", "json", db=None)

    width = len("cudnn_frontend_version")
    assert table.stdout.splitlines() == [
        "field".ljust(width) + "  value",
        "digest".ljust(width) + f"  {fp.digest}",
        *(name.ljust(width) + f"  {value}" for name, value in fp.as_dict().items()),
    ]
    assert json.loads(as_json.stdout) == {"digest": fp.digest, **fp.as_dict()}


@both_backends
def test_stats(cli, populated: str) -> None:
    with Registry.open(str(populated)) as reg:
        stats = reg.stats()

    result = cli("stats")

    assert result.stdout.splitlines() == [
        f"registry         {schema.resolve(str(populated)).display}",
        "schema revision  0010_measurement_fingerprints",
        f"size             {stats.size_bytes} bytes",
        "fingerprints     1",
        "entries          2 (2 shared, 0 rank-scoped)",
        "commits          1",
        f"last commit      {when(stats.last_commit_at)}",
        "",
        "op  entries",
        "mm  2",
        "",
        "fingerprint  last served  starts  replay starts  replay misses",
        "1            never        0       0              0",
    ]
    as_json = json.loads(cli("stats", "--format", "json").stdout)
    assert (as_json["ops"], as_json["last_served"]) == ({"mm": 2}, {"1": None})
    assert as_json["start_counts"] == {
        "1": {"served_starts": 0, "replay_starts": 0, "replay_misses": 0}
    }


@both_backends
def test_log(cli, populated: str, cache_file, tmp_path: Path) -> None:
    newer = cache_file("n.json", {K16: ["Runner", 9]}, metadata=META)
    cli("import", newer)
    with Registry.open(str(populated)) as reg:
        c2, c1 = reg.log()
    host = socket.gethostname().ljust(len("host"))

    result = cli("log")

    assert result.stdout.splitlines() == [
        f"commit  when                 kind    {'host'.ljust(len(host))}  added  replaced  removed  world  layout  message",
        f"2       {when(c2.created_at)}  import  {host}  0      1         0                       {str(newer)[:60]}",
        f"1       {when(c1.created_at)}  import  {host}  2      0         0                       "
        f"{str(tmp_path / 'h200.json')[:60]}",
    ]
    assert [c["id"] for c in json.loads(cli("log", "--limit", "1", "--format", "json").stdout)] == [
        2
    ]


@both_backends
def test_log_filters_by_kind_host_and_age_and_pages(
    cli, populated: str, cache_file, registry_db: str
) -> None:
    """``--kind``, ``--host`` and ``--since`` each narrow the log (every one given must
    hold); ``--limit`` with ``--before`` pages through it, the text naming the next page."""
    for tactic in (5, 6, 7):
        cli("import", cache_file(f"t{tactic}.json", {K16: ["Runner", tactic]}, metadata=META))
    assert cli("revert", "4", "--yes").exit_code == 0  # commit 5
    # Commit 1 made long ago, on another host (as a fleet's registry holds them).
    engine = sqlalchemy.create_engine(
        registry_db if "://" in registry_db else f"sqlite:///{registry_db}"
    )
    with engine.begin() as conn:
        conn.execute(
            sqlalchemy.text(
                "UPDATE commits SET host = 'far', created_at = created_at - 86400 * 10 WHERE id = 1"
            )
        )
    engine.dispose()

    def ids(*args: str) -> list[int]:
        shown = cli("log", *args, "--format", "json")
        assert shown.exit_code == 0, shown.stderr
        return [c["id"] for c in json.loads(shown.stdout)]

    here = socket.gethostname()
    assert ids() == [5, 4, 3, 2, 1]
    assert ids("--kind", "revert") == [5]
    assert ids("--kind", "revert", "--kind", "import") == [5, 4, 3, 2, 1]
    assert ids("--host", "far") == [1]
    assert ids("--host", here) == [5, 4, 3, 2]
    assert ids("--since", "1d") == [5, 4, 3, 2]
    assert ids("--since", "30d", "--host", "far") == [1]
    assert ids("--kind", "revert", "--host", "far") == []
    assert ids("--limit", "2") == [5, 4]
    assert ids("--limit", "2", "--before", "4") == [3, 2]
    assert ids("--limit", "2", "--before", "2") == [1]

    page = cli("log", "--limit", "2", "--kind", "import")
    assert page.stdout.splitlines()[-1] == "(more: ficache log --before 3 with the same filters)"
    last = cli("log", "--limit", "2", "--kind", "import", "--before", "3")
    assert "(more:" not in last.stdout
    assert [line.split()[0] for line in last.stdout.splitlines()[1:]] == ["2", "1"]
    assert cli("log", "--kind", "tuned").exit_code == 2


def test_list_sorts_shapes_as_numbers_and_op_matches_part_of_a_name(cli, cache_file) -> None:
    """``(128, 64)`` lists before ``(1024, 64)`` (text order put 1024 first); ``--op``
    takes a part of a name (any case) and says what it matched, and a name that matches
    nothing gets suggestions (issue 35)."""
    keys = {
        f"('flashinfer::mm_fp4', 'Runner', (({m}, 64),), ())": ["Runner", i]
        for i, m in enumerate((1024, 128, 16, 8192, 2))
    }
    keys["('flashinfer::bmm_fp8', 'Runner', ((4, 64),), ())"] = ["Runner", 9]
    keys["('trtllm::fused_moe', 'Moe', ((4, 64),), ())"] = ["Moe", 1]
    cli("import", cache_file("a.json", keys, metadata=META))

    listed = json.loads(cli("list", "--format", "json").stdout)
    exact = cli("list", "--op", "flashinfer::mm_fp4", "--format", "json")
    part = cli("list", "--op", "FP8", "--format", "json")
    both = cli("list", "--op", "flashinfer", "--format", "json")
    typo = cli("list", "--op", "flashinfer::mm_fp5")
    limited = json.loads(cli("list", "--op", "mm_fp4", "--limit", "3", "--format", "json").stdout)

    assert [(e["op"], e["shapes"]) for e in listed] == [
        ("flashinfer::bmm_fp8", [[4, 64]]),
        ("flashinfer::mm_fp4", [[2, 64]]),
        ("flashinfer::mm_fp4", [[16, 64]]),
        ("flashinfer::mm_fp4", [[128, 64]]),
        ("flashinfer::mm_fp4", [[1024, 64]]),
        ("flashinfer::mm_fp4", [[8192, 64]]),
        ("trtllm::fused_moe", [[4, 64]]),
    ]
    assert (len(json.loads(exact.stdout)), exact.stderr) == (5, "")
    assert [e["op"] for e in json.loads(part.stdout)] == ["flashinfer::bmm_fp8"]
    assert part.stderr == "note: --op 'FP8' matched 1 op(s): flashinfer::bmm_fp8\n"
    assert len(json.loads(both.stdout)) == 6
    assert (typo.exit_code, len(typo.stdout.splitlines())) == (0, 1)  # the header alone
    assert typo.stderr == (
        "warning: no stored op is or contains 'flashinfer::mm_fp5'; "
        "did you mean flashinfer::mm_fp4, flashinfer::bmm_fp8?\n"
    )
    assert [e["shapes"] for e in limited] == [[[2, 64]], [[16, 64]], [[128, 64]]]


# -- export ------------------------------------------------------------------------------------


@both_backends
def test_export_to_stdout_is_the_stored_file(cli, populated: str) -> None:
    result = cli("export", "--fingerprint", "1")

    # What FlashInfer's save_configs writes for this content, its _generation included.
    saved: dict[str, Any] = {"_metadata": META, K16: ["Runner", [1, [2, 3]], POLICY]}
    saved[K32] = ["Runner", 4]
    canonical = json.dumps(saved, sort_keys=True, separators=(",", ":")).encode()
    saved["_generation"] = hashlib.sha256(canonical).hexdigest()
    assert result.exit_code == 0
    assert result.stdout == json.dumps(saved, indent=2)


@both_backends
def test_export_to_a_file(cli, populated: str, tmp_path: Path) -> None:
    out = tmp_path / "out" / "cache.json"

    result = cli("export", "--fingerprint", DIGEST[:8], "-o", out)

    assert (result.exit_code, result.stdout, result.stderr) == (
        0,
        "",
        f"wrote 2 entries to {out}\n",
    )
    exported = json.loads(out.read_text())
    assert exported.pop("_generation")
    assert exported == {
        "_metadata": META,
        K16: ["Runner", [1, [2, 3]], POLICY],
        K32: ["Runner", 4],
    }
    assert os.listdir(out.parent) == ["cache.json"]


def test_export_to_dash_is_standard_output(
    cli, populated: str, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    plain = cli("export", "--fingerprint", "1")

    result = cli("export", "--fingerprint", "1", "-o", "-")

    assert (result.exit_code, result.stderr) == (0, "wrote 2 entries to standard output\n")
    assert result.stdout_bytes == plain.stdout_bytes
    assert json.loads(result.stdout) == json.loads(plain.stdout)
    assert not (tmp_path / "-").exists()


def test_export_into_a_fifo_streams_and_leaves_the_fifo(
    cli, populated: str, tmp_path: Path
) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    plain = cli("export", "--fingerprint", "1").stdout_bytes
    assert len(plain) < 65536  # fits the pipe's buffer: the writer never waits for the read
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # the writer's open does not wait
    try:
        result = cli("export", "--fingerprint", "1", "-o", fifo)
        got = os.read(reader, 1 << 16)
    finally:
        os.close(reader)

    assert (result.exit_code, result.stderr) == (0, f"wrote 2 entries to {fifo}\n")
    assert got == plain
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_export_into_a_character_device_leaves_the_device(
    cli, populated: str, tmp_path: Path
) -> None:
    null = tmp_path / "null"
    devnull = os.stat(os.devnull)
    try:
        os.mknod(null, stat.S_IFCHR | 0o666, devnull.st_rdev)  # a /dev/null of the test's own
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD")
    before = os.lstat(null)

    result = cli("export", "--fingerprint", "1", "-o", null)

    after = os.lstat(null)
    assert (result.exit_code, result.stderr) == (0, f"wrote 2 entries to {null}\n")
    assert stat.S_ISCHR(after.st_mode)
    assert (after.st_rdev, after.st_mode, after.st_ino) == (
        before.st_rdev,
        before.st_mode,
        before.st_ino,
    )
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_export_through_a_symlink_replaces_its_target(cli, populated: str, tmp_path: Path) -> None:
    plain = cli("export", "--fingerprint", "1").stdout_bytes
    (tmp_path / "real").mkdir()
    real = tmp_path / "real" / "cache.json"
    real.write_text("old")
    real.chmod(0o644)
    link = tmp_path / "link.json"
    link.symlink_to("real/cache.json")

    result = cli("export", "--fingerprint", "1", "-o", link)

    assert result.exit_code == 0
    assert (link.is_symlink(), os.readlink(link)) == (True, "real/cache.json")
    assert real.read_bytes() == plain
    assert stat.S_IMODE(real.stat().st_mode) == 0o644
    assert os.listdir(real.parent) == ["cache.json"]


def test_export_through_a_dangling_symlink_creates_its_target(
    cli, populated: str, tmp_path: Path, umask
) -> None:
    plain = cli("export", "--fingerprint", "1").stdout_bytes
    link = tmp_path / "link.json"
    link.symlink_to("made/cache.json")
    umask(0o022)

    result = cli("export", "--fingerprint", "1", "-o", link)

    made = tmp_path / "made" / "cache.json"
    assert result.exit_code == 0
    assert (link.is_symlink(), os.readlink(link)) == (True, "made/cache.json")
    assert (made.read_bytes(), stat.S_IMODE(made.stat().st_mode)) == (plain, 0o644)


@pytest.mark.parametrize(("mask", "expected"), [(0o022, 0o644), (0o077, 0o600)], ids=oct)
def test_export_to_a_new_file_follows_the_umask(
    cli, populated: str, tmp_path: Path, umask, mask: int, expected: int
) -> None:
    out = tmp_path / "cache.json"
    umask(mask)

    assert cli("export", "--fingerprint", "1", "-o", out).exit_code == 0

    assert stat.S_IMODE(out.stat().st_mode) == expected


@pytest.mark.parametrize("kept", [0o644, 0o640], ids=oct)
def test_export_over_a_file_keeps_its_mode(
    cli, populated: str, tmp_path: Path, umask, kept: int
) -> None:
    out = tmp_path / "cache.json"
    out.write_text("old")
    out.chmod(kept)
    umask(0o077)  # not what decides a replaced file's mode

    assert cli("export", "--fingerprint", "1", "-o", out).exit_code == 0

    assert json.loads(out.read_text())["_metadata"] == META
    assert stat.S_IMODE(out.stat().st_mode) == kept
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_export_to_what_cannot_be_written_is_one_line(cli, populated: str, tmp_path: Path) -> None:
    sock_path = tmp_path / "sock"
    with closing(socket.socket(socket.AF_UNIX)) as sock:
        sock.bind(str(sock_path))
        one_error_line(
            cli("export", "--fingerprint", "1", "-o", sock_path),
            f"cannot write {sock_path}: a socket, not a file ficache can write",
        )
    assert stat.S_ISSOCK(os.lstat(sock_path).st_mode)


@both_backends
def test_export_errors(cli, populated: str, tmp_path: Path) -> None:
    one_error_line(
        cli("export", "--fingerprint", "5"),
        "no fingerprint '5' in the registry; see `ficache fingerprints`",
    )
    one_error_line(
        cli("export", "--fingerprint", "current"),
        "no stored fingerprint serves the current environment; see `ficache fingerprints` and "
        "`ficache fingerprint`",
    )
    assert cli("export", "--fingerprint", "1", "--scope", "tp2").exit_code == 2
    missing = tmp_path / "missing.db"
    one_error_line(
        cli("export", "--fingerprint", "1", db=missing),
        f"no registry at {missing}; import a cache file first (ficache import FILE)",
    )
    assert not missing.exists()


# -- prune / revert --------------------------------------------------------------------------


PLAN = [
    "prune plan (fingerprint=1):",
    "fingerprint  gpu          flashinfer  scope   entries",
    "1            NVIDIA H200  0.7.2       shared  2",
    "2 entries would be removed (revertible with `ficache revert`)",
]


@both_backends
def test_prune_dry_run_changes_nothing(cli, populated: str, dump_db) -> None:
    before = dump_db(populated)

    result = cli("prune", "--fingerprint", "1", "--dry-run")

    assert (result.exit_code, result.stdout.splitlines()) == (
        0,
        [*PLAN, "dry run: nothing changed"],
    )
    assert dump_db(populated) == before


@both_backends
def test_prune_without_a_tty_or_yes_is_refused(cli, populated: str, dump_db) -> None:
    before = dump_db(populated)

    result = cli("prune", "--fingerprint", "1")

    assert result.exit_code == 1
    assert result.stdout.splitlines() == PLAN
    assert (
        result.stderr == "error: refusing to change the registry without confirmation; pass --yes\n"
    )
    assert dump_db(populated) == before


@both_backends
def test_prune_yes_removes_as_one_commit_and_revert_restores(cli, populated: str) -> None:
    result = cli("prune", "--fingerprint", "1", "--yes")

    assert (result.exit_code, result.stdout.splitlines()) == (
        0,
        [*PLAN, "removed 2 entries (commit 2)"],
    )
    assert cli("list", "--format", "json").stdout == "[\n]\n"

    revert = cli("revert", "2", "--yes")

    assert revert.exit_code == 0
    assert (
        revert.stdout.splitlines()[1]
        == "reverted commit 2 as commit 3: 0 removed, 0 restored, 2 re-added"
    )
    assert len(json.loads(cli("list", "--format", "json").stdout)) == 2


@both_backends
def test_prune_other_criteria(cli, populated: str) -> None:
    assert (
        cli("prune", "--older-than", "1d", "--yes").stdout == "nothing matches: nothing to prune\n"
    )
    assert (
        cli("prune", "--flashinfer-version", "0.6", "--dry-run").stdout
        == "nothing matches: nothing to prune\n"
    )
    scoped = cli("prune", "--scope", "shared", "--flashinfer-version", "0.7.2", "--dry-run")
    assert scoped.stdout.splitlines()[0] == "prune plan (flashinfer_version=0.7.2, scope=shared):"
    no_criterion = cli("prune")
    assert (no_criterion.exit_code, no_criterion.stdout) == (2, "")
    assert no_criterion.stderr.splitlines()[-1] == (
        "Error: prune needs a criterion: --fingerprint, --flashinfer-version, --older-than, "
        "--unused-for or --scope"
    )
    one_error_line(
        cli("prune", "--fingerprint", "9", "--yes"),
        "no fingerprint '9' in the registry; see `ficache fingerprints`",
    )


@pytest.mark.parametrize(
    ("age", "seconds"),
    [
        ("30s", 30),
        ("90min", 5400),
        ("2h", 7200),
        ("1d", 86400),
        ("1w", 604800),
        ("1mo", 30 * 86400),
        ("1y", 365 * 86400),
        ("1.5d", 129600),
    ],
)
def test_ages_take_min_mo_and_y(age: str, seconds: float) -> None:
    from ficache.cli import AgeType

    assert AgeType().convert(age, None, None) == seconds


@pytest.mark.parametrize("option", ["--older-than", "--unused-for"])
def test_a_bare_m_age_is_refused_as_ambiguous(cli, populated: str, dump_db, option: str) -> None:
    before = dump_db(populated)

    result = cli("prune", option, "1m", "--yes")

    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr.splitlines()[-1] == (
        f"Error: Invalid value for '{option}': '1m' is ambiguous: write 1min for minutes "
        "or 1mo for months"
    )
    assert dump_db(populated) == before


HOUR = 3600.0


def backdate_entries(db: str | Path, ages: dict[str, float]) -> None:
    """Make entries (by key) last written ``age`` seconds ago, behind the registry's back."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    now = time.time()
    engine = create_engine(schema.resolve(str(db)).url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            for key, age in ages.items():
                updated = conn.execute(
                    text("UPDATE entries SET updated_at = :t WHERE key = :k"),
                    {"t": now - age, "k": key},
                )
                assert updated.rowcount == 1
    finally:
        engine.dispose()


@both_backends
def test_prune_older_than_removes_exactly_the_entries_written_before_that_age(
    cli, populated: str, cache_file, dump_db
) -> None:
    cli("import", cache_file("new.json", {K64: ["Runner", 5]}, metadata=META))  # written now
    backdate_entries(populated, {K32: 48 * HOUR, K16: 12 * HOUR})
    before = dump_db(populated)

    dry = cli("prune", "--older-than", "1d", "--dry-run")

    assert (dry.exit_code, dry.stdout.splitlines()) == (
        0,
        [
            "prune plan (older_than_seconds=86400):",
            "fingerprint  gpu          flashinfer  scope   entries",
            "1            NVIDIA H200  0.7.2       shared  1",
            "1 entries would be removed (revertible with `ficache revert`)",
            "dry run: nothing changed",
        ],
    )
    assert dump_db(populated) == before

    # Only the 2-day-old entry goes; the 12-hour-old and the new one stay.
    day = cli("prune", "--older-than", "1d", "--yes")

    assert (day.exit_code, day.stdout.splitlines()[-1]) == (0, "removed 1 entries (commit 3)")
    assert [e["key"] for e in json.loads(cli("list", "--format", "json").stdout)] == [K16, K64]
    with Registry.open(str(populated)) as reg:
        [prune] = reg.log(None, commit_id=3)
        assert (prune.kind, prune.removed) == ("prune", 1)
        assert prune.message == "older_than_seconds=86400"

    # A shorter age takes the 12-hour-old entry too, and still not the new one.
    hours = cli("prune", "--older-than", "6h", "--yes")

    assert (hours.exit_code, hours.stdout.splitlines()[-1]) == (0, "removed 1 entries (commit 4)")
    assert [e["key"] for e in json.loads(cli("list", "--format", "json").stdout)] == [K64]
    again = cli("prune", "--older-than", "6h", "--yes")
    assert again.stdout == "nothing matches: nothing to prune\n"


@pytest.mark.parametrize(
    ("answer", "code", "last_line", "remaining"),
    [(b"n\n", 1, "aborted: nothing changed", 2), (b"y\n", 0, "removed 2 entries (commit 2)", 0)],
)
def test_prune_asks_on_a_terminal(
    populated: Path, answer: bytes, code: int, last_line: str, remaining: int
) -> None:
    status, output = run_in_a_terminal(
        ["--db", str(populated), "prune", "--fingerprint", "1"], answer
    )

    assert status == code
    assert "Remove 2 entries? [y/N]: " in output
    assert output.strip().splitlines()[-1] == last_line
    with Registry.open(str(populated)) as reg:
        assert len(list(reg.entries())) == remaining


def dry_run_and_run(cli, *args: str):
    """``revert ARGS --dry-run`` then ``revert ARGS --yes``: the two results."""
    return cli("revert", *args, "--dry-run"), cli("revert", *args, "--yes")


@both_backends
def test_revert_dry_run_is_refused_as_the_run_is_after_a_later_change(
    cli, populated: str, cache_file, dump_db
) -> None:
    cli("import", cache_file("n.json", {K16: ["Runner", 9]}, metadata=META))
    before = dump_db(populated)
    with Registry.open(str(populated)) as reg:
        first = reg.log()[-1]

    dry, run = dry_run_and_run(cli, "1")

    plan = [
        f"revert plan: commit 1 (import, {when(first.created_at)}, {first.host}): remove 2 added, "
        "restore 0 replaced, restore 0 removed",
        "conflicts (changed by commit 2):",
        "kind   fingerprint  scope   key                                               commit did  "
        "changed by",
        f"entry  1            shared  {K16}  added       2",
    ]
    error = (
        "error: 1 of 2 entries of commit 1 changed in later commits; revert those first "
        "(ficache log)\n"
    )
    assert (dry.exit_code, dry.stdout.splitlines(), dry.stderr) == (1, plan, error)
    assert (run.exit_code, run.stdout.splitlines(), run.stderr) == (1, plan, error)
    one_error_line(cli("revert", "7", "--dry-run"), "no commit 7; see `ficache log`")
    one_error_line(cli("revert", "7", "--yes"), "no commit 7; see `ficache log`")
    assert dump_db(populated) == before


@both_backends
def test_revert_dry_run_and_run_agree_along_a_chain_of_reverts(
    cli, populated: str, dump_db
) -> None:
    """Revert 1 (commit 2), revert the revert (3: 1 is back), revert that (4)."""

    def refused(commit: str, message: str) -> None:
        before = dump_db(populated)
        dry, run = dry_run_and_run(cli, commit)
        assert (dry.exit_code, dry.stderr) == (1, f"error: {message}\n")
        assert (run.exit_code, run.stdout, run.stderr) == (1, dry.stdout, dry.stderr)
        assert dump_db(populated) == before

    def done(commit: str, made: str) -> None:
        dry, run = dry_run_and_run(cli, commit)
        assert (dry.exit_code, dry.stdout.splitlines()[-1]) == (0, "dry run: nothing changed")
        assert run.exit_code == 0, run.stderr
        assert run.stdout.splitlines()[:-1] == dry.stdout.splitlines()[:-1]
        assert run.stdout.splitlines()[-1] == made

    done("1", "reverted commit 1 as commit 2: 2 removed, 0 restored, 0 re-added")
    refused(
        "1",
        "commit 1 is already reverted by commit 2; nothing to revert (revert commit 2 to "
        "bring it back)",
    )
    done("2", "reverted commit 2 as commit 3: 0 removed, 0 restored, 2 re-added")
    # 1 is back in effect, holding what it wrote: it could be reverted again (issue 35)
    assert cli("revert", "1", "--dry-run").stdout.splitlines()[-1] == "dry run: nothing changed"
    refused(
        "2",
        "commit 2 is already reverted by commit 3; nothing to revert (revert commit 3 to "
        "bring it back)",
    )
    done("3", "reverted commit 3 as commit 4: 2 removed, 0 restored, 0 re-added")
    refused(
        "1",
        "commit 1 is already reverted by commit 4; nothing to revert (revert commit 4 to "
        "bring it back)",
    )
    assert cli("list", "--format", "json").stdout == "[\n]\n"


@both_backends
def test_revert_dry_run_counts_what_it_removes_restores_and_re_adds_each_apart(
    cli, registry_db: str, dump_db
) -> None:
    """A commit that added 3 entries, replaced 2 and removed 1 (three different counts, so
    a plan that swapped two of them differs): the dry run's plan, the JSON plan and the
    run's result count each, and agree."""
    from ficache.registry import NewEntry

    fp = Fingerprint.from_flashinfer_metadata(META)
    keys = [f"('mm', 'Runner', (({m}, 64),), (torch.bfloat16,))" for m in (1, 2, 3, 4, 5, 6)]
    with Registry.open(registry_db) as reg:
        reg.write([NewEntry(fp, k, "Runner", "1") for k in keys[:3]], kind="import")
        reg.write(
            [NewEntry(fp, k, "Runner", "2") for k in keys[1:]],  # 2 replaced, 3 added
            kind="merge",
            removals=[(fp, "shared", keys[0])],  # 1 removed
        )
        commit = reg.log()[0]
    assert (commit.id, commit.added, commit.replaced, commit.removed) == (2, 3, 2, 1)
    before = dump_db(registry_db)

    dry = cli("revert", "2", "--dry-run")
    as_json = cli("revert", "2", "--dry-run", "--format", "json")

    assert (dry.exit_code, dry.stderr) == (0, "")
    assert dry.stdout.splitlines()[0].endswith(
        ": remove 3 added, restore 2 replaced, restore 1 removed"
    ), dry.stdout
    assert dry.stdout.splitlines()[-1] == "dry run: nothing changed"
    assert json.loads(as_json.stdout)["entries"] == {"remove": 3, "restore": 2, "re_add": 1}
    assert dump_db(registry_db) == before

    run = cli("revert", "2", "--yes")

    assert run.stdout.splitlines()[:-1] == dry.stdout.splitlines()[:-1]
    assert run.stdout.splitlines()[-1] == (
        "reverted commit 2 as commit 3: 3 removed, 2 restored, 1 re-added"
    )
    listed = {r["key"]: r["tactic"] for r in json.loads(cli("list", "--format", "json").stdout)}
    assert listed == {k: 1 for k in keys[:3]}


@both_backends
def test_revert_plan_as_json(cli, populated: str, cache_file, dump_db) -> None:
    cli("import", cache_file("n.json", {K16: ["Runner", 9]}, metadata=META))
    before = dump_db(populated)

    refused = cli("revert", "1", "--dry-run", "--format", "json")
    fine = cli("revert", "2", "--dry-run", "--format", "json")

    assert (refused.exit_code, refused.stderr) == (
        1,
        "error: 1 of 2 entries of commit 1 changed in later commits; revert those first "
        "(ficache log)\n",
    )
    plan = json.loads(refused.stdout)
    assert (plan["reverts"]["id"], plan["entries"], plan["records"]) == (
        1,
        {"remove": 2, "restore": 0, "re_add": 0},
        {"remove": 0, "restore": 0, "re_add": 0},
    )
    assert plan["conflicts"] == [
        {
            "kind": "entry",
            "fingerprint_id": 1,
            "scope": "shared",
            "namespace": None,
            "key": K16,
            "action": "added",
            "changed_by": 2,
        }
    ]
    assert (plan["refused"], plan["dry_run"], plan["commit"]) == (
        refused.stderr.removeprefix("error: ").rstrip("\n"),
        True,
        None,
    )
    assert fine.exit_code == 0
    assert json.loads(fine.stdout)["conflicts"] == []
    assert dump_db(populated) == before

    done = cli("revert", "2", "--yes", "--format", "json")

    assert (done.exit_code, done.stderr) == (0, "")
    assert (json.loads(done.stdout)["dry_run"], json.loads(done.stdout)["commit"]) == (False, 3)


def test_revert_plan_shows_the_first_conflicts(cli, cache_file, registry_db: str) -> None:
    keys = [f"('mm', 'Runner', (({m}, 64),), (torch.bfloat16,))" for m in range(1, 13)]
    cli("import", cache_file("a.json", {k: ["Runner", 1] for k in keys}, metadata=META))
    cli("import", cache_file("b.json", {k: ["Runner", 2] for k in keys}, metadata=META))

    result = cli("revert", "1", "--dry-run")

    lines = result.stdout.splitlines()
    assert result.exit_code == 1
    assert len(lines) == 2 + 1 + 10 + 1
    assert lines[-1] == "... and 2 more (--format json lists all)"
    assert (
        len(json.loads(cli("revert", "1", "--dry-run", "--format", "json").stdout)["conflicts"])
        == 12
    )


# -- db ---------------------------------------------------------------------------------------


@both_backends
def test_db_commands(cli, populated: str, tmp_path: Path) -> None:
    assert cli("db", "current").stdout == (
        "0010_measurement_fingerprints (head 0010_measurement_fingerprints: up to date)\n"
    )
    # Who reads and writes each revision as it is: issue 35 (release numbers as --version's).
    assert cli("db", "history", db=None).stdout.splitlines() == [
        "revision                       release  read by         written by      title",
        "0001_registry                  0.1      0.1             0.1             fingerprints, entries, commits and the entry change log.",
        "0002_fleet                     0.2      0.2             0.2             tuned times, last served times, new values in the change log.",
        "0003_records                   0.3      0.3             0.3             FlashInfer's namespaced records and their change log.",
        "0004_selection                 0.4      0.4             0.4             how FlashInfer chose each value (a cache value's fourth element).",
        "0005_drop_op_index             0.5      0.5             0.5             entries lose their index on op, which cost every write and served no read.",
        "0006_policies                  0.6      0.6             0.6             measurement policies stored once; entries lose the columns their key holds.",
        "0007_compat                    0.7      0.7, 0.10       0.7, 0.10       the registry says which older ficache may still read and write it.",
        "0008_start_counts              0.8      0.7, 0.8, 0.10  0.7, 0.8, 0.10  how many starts each fingerprint served, and what replay starts missed.",
        "0009_protocol_records          0.9      0.8, 0.9, 0.10  0.9, 0.10       FlashInfer 0.7.4's protocol records, a kind of stored result of their own.",
        "0010_measurement_fingerprints  0.10     0.8, 0.9, 0.10  0.10            one environment under several FlashInfer measurement policies.",
    ]
    as_json = json.loads(cli("db", "history", "--format", "json", db=None).stdout)
    assert as_json[-1] == {
        "revision": "0010_measurement_fingerprints",
        "down": "0009_protocol_records",
        "release": "0.10",
        "title": "one environment under several FlashInfer measurement policies.",
        "read_by": ["0.8", "0.9", "0.10"],
        "written_by": ["0.10"],
    }
    assert __version__ == f"{as_json[-1]['release']}.0"  # the head's release is this one
    dry = cli("db", "downgrade", "base", "--dry-run")
    assert dry.stdout.splitlines() == [
        f"downgrade plan: {schema.resolve(str(populated)).display} from 0010_measurement_fingerprints "
        "to base (drops all stored entries)",
        "  0010_measurement_fingerprints -> 0009_protocol_records: keeps every stored value",
        "  0009_protocol_records -> 0008_start_counts: keeps every stored value",
        "  0008_start_counts -> 0007_compat: keeps every stored value",
        "  0007_compat -> 0006_policies: keeps every stored value",
        "  0006_policies -> 0005_drop_op_index: keeps every stored value",
        "  0005_drop_op_index -> 0004_selection: keeps every stored value",
        "  0004_selection -> 0003_records: keeps every stored value",
        "  0003_records -> 0002_fleet: keeps every stored value",
        # The import dated its entries by the file's mtime (``tuned_time``), not by the
        # import: 0001 has no tuned_at, so the step loses when they were tuned.
        "  0002_fleet -> 0001_registry: when 2 entries were tuned (upgrading again takes "
        "their last write)",
        "  0001_registry -> base: 2 entries, 1 fingerprints, 1 commits and 2 change rows",
        "upgrading again does not bring back what a step drops",
        "dry run: nothing changed",
    ]
    refused = cli("db", "downgrade", "base")
    assert refused.exit_code == 1
    assert (
        refused.stderr
        == "error: refusing to change the registry without confirmation; pass --yes\n"
    )
    assert len(json.loads(cli("list", "--format", "json").stdout)) == 2
    missing = tmp_path / "none.db"
    one_error_line(
        cli("db", "current", db=missing),
        f"no registry at {missing}; import a cache file first (ficache import FILE)",
    )


# -- where the registry is ------------------------------------------------------------------------


def test_registry_from_env_url_and_default(cli, cache_file, tmp_path: Path, monkeypatch) -> None:
    path = cache_file("a.json", {K16: ["Runner", 1]}, metadata=META)

    monkeypatch.setenv("FICACHE_DB", str(tmp_path / "env.db"))
    assert cli("import", path, db=None).exit_code == 0
    monkeypatch.delenv("FICACHE_DB")
    assert cli("import", path, db=f"sqlite:///{tmp_path / 'url.db'}").exit_code == 0
    assert cli("import", path, db=None).exit_code == 0

    default = tmp_path / "user-cache" / "ficache" / "registry.db"
    for db in (tmp_path / "env.db", tmp_path / "url.db", default):
        with Registry.open(str(db)) as reg:
            assert [e.key for e in reg.entries()] == [K16]
    assert cli("stats", db=None).stdout.splitlines()[0] == f"registry         {default}"


#: The commands that take no --db after their name: they open no registry (the group
#: ``db`` only names its subcommands; ``ficache`` itself takes --db before them all).
NO_DB_AFTER = {"db", "db history", "fingerprint"}


def test_db_is_taken_after_the_subcommand_and_wins_there(
    cli, populated: Path, cache_file, tmp_path: Path, monkeypatch
) -> None:
    takes_db = {
        " ".join(path)
        for path, command in ALL_COMMANDS
        if any("--db" in p.opts for p in command.params)
    }
    assert takes_db == {" ".join(path) for path, _ in ALL_COMMANDS} - NO_DB_AFTER
    for args in (
        ("list",),
        ("stats",),
        ("log",),
        ("fingerprints",),
        ("show", "1"),
        ("export", "--fingerprint", "1"),
    ):
        before = cli(*args)
        assert before.exit_code == 0
        after = cli(*args, "--db", populated, db=None)
        assert (after.exit_code, after.stdout, after.stderr) == (0, before.stdout, "")
    assert cli("db", "current", "--db", populated, db=None).stdout.startswith(
        "0010_measurement_fingerprints"
    )

    other = tmp_path / "other.db"
    data = cache_file("b.json", {K64: ["Runner", 5]}, metadata=META)
    assert cli("import", data, "--db", other, db=None).exit_code == 0
    assert [e.key for e in Registry.open(str(other)).entries()] == [K64]

    # Given both before and after the subcommand, the one after it wins.
    keys = cli("list", "--format", "json", "--db", other, db=populated)
    assert [e["key"] for e in json.loads(keys.stdout)] == [K64]
    # FICACHE_DB applies only where --db is given nowhere.
    monkeypatch.setenv("FICACHE_DB", str(tmp_path / "missing.db"))
    assert [
        e["key"] for e in json.loads(cli("list", "--format", "json", "--db", other, db=None).stdout)
    ] == [K64]
    assert not (tmp_path / "missing.db").exists()


def test_a_write_that_creates_a_registry_says_so_once_on_stderr(
    cli, cache_file, tmp_path: Path
) -> None:
    data = cache_file("a.json", {K16: ["Runner", 1]}, metadata=META)
    typo = tmp_path / "fleeet" / "registry.db"
    import_line = "imported 1 entries from 1 file(s): 1 added, 0 replaced, 0 unchanged (commit 1)\n"

    first = cli("import", data, db=typo)
    again = cli("import", data, db=typo)

    assert (first.exit_code, first.stdout) == (0, import_line)
    assert first.stderr == f"note: creating a new registry at {typo}\n"
    assert (again.exit_code, again.stderr) == (0, "")

    default = tmp_path / "user-cache" / "ficache" / "registry.db"
    assert cli("import", data, db=None).stderr == f"note: creating a new registry at {default}\n"
    merged = cli("merge", data, db=tmp_path / "merged.db")
    assert merged.stderr == f"note: creating a new registry at {tmp_path / 'merged.db'}\n"
    upgraded = cli("db", "upgrade", db=tmp_path / "upgraded.db")
    assert upgraded.stderr == f"note: creating a new registry at {tmp_path / 'upgraded.db'}\n"
    # A dry run and the reads create nothing, so they say nothing of it.
    missing = tmp_path / "missing.db"
    for args in (("merge", data, "--dry-run"), ("list",), ("db", "current")):
        assert "creating" not in cli(*args, db=missing).stderr
    assert not missing.exists()
    assert not missing.exists()

    with Registry.open(str(tmp_path / "lib.db")) as reg:
        assert reg.created
    with Registry.open(str(tmp_path / "lib.db")) as reg:
        assert not reg.created


@pytest.mark.parametrize(
    "args, error",
    [
        (("db", "upgrade", "base"), "unknown revision 'base'; see ficache db history"),
        (("import", "--fingerprint", "7", "{bad}"), "7"),
    ],
)
def test_a_write_that_fails_leaves_no_new_registry_behind(
    cli, tmp_path: Path, args: tuple[str, ...], error: str
) -> None:
    """A mistyped --db and a command that then fails: the note, one error line, exit 1, and
    neither the registry nor the directories made for it are left (the state as before)."""
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({K16: ["Runner", 1]}))
    typo = tmp_path / "fleeet" / "deep" / "registry.db"

    result = cli(*(a.format(bad=bad) for a in args), db=typo)

    note, failure = result.stderr.removesuffix("\n").split("\n")
    assert (result.exit_code, note) == (1, f"note: creating a new registry at {typo}")
    assert failure.startswith("error: ") and error in failure
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]


def test_read_commands_do_not_create_a_registry(cli, registry_path: Path) -> None:
    for args in (("list",), ("stats",), ("log",), ("fingerprints",), ("db", "current")):
        result = cli(*args)
        one_error_line(
            result,
            f"no registry at {registry_path}; import a cache file first (ficache import FILE)",
        )
    assert not registry_path.exists()


# -- bad input: one line on stderr, exit 1, registry unchanged ------------------------------------------


def _json_error(text: str) -> str:
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        return str(exc)
    raise AssertionError("valid JSON")


TRUNCATED = json.dumps({"_metadata": META, K16: ["Runner", 1]})[:-9]
BAD_FILES = {
    "truncated": (
        TRUNCATED,
        "{path}: invalid JSON (" + _json_error(TRUNCATED) + "); the file is truncated or not a "
        "FlashInfer cache",
    ),
    "invalid": (
        "{'a': [1,]}",
        "{path}: invalid JSON (" + _json_error("{'a': [1,]}") + "); the file is truncated or "
        "not a FlashInfer cache",
    ),
    "empty": (
        "",
        "{path}: invalid JSON ("
        + _json_error("")
        + "); the file is truncated or not a FlashInfer cache",
    ),
    "top-level-list": (
        json.dumps([K16, ["Runner", 1]]),
        "{path}: top level is a JSON list, expected an object; not a FlashInfer cache file",
    ),
    "value-not-a-list": (
        json.dumps({K16: "Runner"}),
        "{path}: 1 of 1 entries invalid, nothing imported; first: "
        f"{K16!r}: value must be [runner, tactic], [runner, tactic, policy] "
        "or [runner, tactic, policy, selection]",
    ),
    "tactic-a-dict": (
        json.dumps({K16: ["Runner", {"tile": 128}]}),
        "{path}: 1 of 1 entries invalid, nothing imported; first: "
        f"{K16!r}: tactic holds a dict; expected numbers and lists",
    ),
    "runner-not-a-string": (
        json.dumps({K16: [3, 1]}),
        "{path}: 1 of 1 entries invalid, nothing imported; first: "
        f"{K16!r}: runner must be a non-empty string",
    ),
    "key-runner-mismatch": (
        json.dumps({K16: ["OtherRunner", 1], K32: ["Runner", 1]}),
        "{path}: 1 of 2 entries invalid, nothing imported; first: "
        f"{K16!r}: runner 'OtherRunner' differs from the key's 'Runner'",
    ),
    "metadata-not-strings": (
        json.dumps({"_metadata": {**META, "gpu": 90}, K16: ["Runner", 1]}),
        "_metadata field 'gpu' must be a string, got int",
    ),
}


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_a_bad_file_is_one_error_and_changes_nothing(
    cli, populated: str, tmp_path: Path, dump_db, name: str
) -> None:
    text, message = BAD_FILES[name]
    bad = tmp_path / f"{name}.json"
    bad.write_text(text)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"_metadata": META, K64: ["Runner", 1]}))
    before = dump_db(populated)

    result = cli("import", good, bad)

    one_error_line(result, message.format(path=bad))
    assert dump_db(populated) == before


def test_a_key_that_looks_like_code_is_skipped_counted_and_never_run(
    cli, populated: str, tmp_path: Path, dump_db, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    key = "__import__('os').system('touch PWNED')"
    bad = tmp_path / "hostile.json"
    bad.write_text(json.dumps({"_metadata": META, key: ["Runner", 1]}))
    before = dump_db(populated)

    result = cli("import", bad)

    assert result.exit_code == 0
    assert result.stderr == (
        "warning: 1 entry skipped: a key of no form FlashInfer writes "
        f"(first: {key!r}: trailing text after the key tuple at offset 10)\n"
    )
    assert not (tmp_path / "PWNED").exists()
    assert not (REPO / "PWNED").exists()
    assert dump_db(populated) == before


def test_extras_that_look_like_code_are_kept_as_text_and_never_run(
    cli, populated: str, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    key = "('mm', 'Runner', ((16, 64),), (__import__('os').system('touch PWNED'),))"
    bad = tmp_path / "hostile.json"
    bad.write_text(json.dumps({"_metadata": META, key: ["Runner", 1]}))

    result = cli("import", bad)

    assert result.exit_code == 0, result.output
    listed = cli("list", "--op", "mm", "--format", "json")
    assert key in [e["key"] for e in json.loads(listed.stdout)]
    assert not (tmp_path / "PWNED").exists()
    assert not (REPO / "PWNED").exists()


@both_backends
def test_a_missing_file_is_one_error(cli, populated: str, tmp_path: Path, dump_db) -> None:
    before = dump_db(populated)

    one_error_line(cli("import", tmp_path / "nope.json"), f"{tmp_path / 'nope.json'}: no such file")
    assert dump_db(populated) == before


def test_a_non_sqlite_file_as_db_is_refused_and_kept(cli, cache_file, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes, not a database\n")
    good = cache_file("a.json", {K16: ["Runner", 1]}, metadata=META)

    for args in (("import", good), ("list",), ("db", "upgrade"), ("db", "current")):
        one_error_line(
            cli(*args, db=notes),
            f"{notes} is not a SQLite database; pass another --db or move the file away",
        )

    assert notes.read_text() == "my notes, not a database\n"
    assert sorted(os.listdir(tmp_path)) == ["a.json", "notes.txt"]  # no -wal, -shm or journal


def test_a_directory_as_db_is_refused(cli, cache_file, tmp_path: Path) -> None:
    good = cache_file("a.json", {K16: ["Runner", 1]}, metadata=META)

    for args in (("import", good), ("list",)):
        one_error_line(
            cli(*args, db=tmp_path),
            f"{tmp_path} is a directory; give the registry's file path (e.g. {tmp_path}/registry.db)",
        )


def test_a_newer_schema_is_refused(cli, populated: Path, cache_file) -> None:
    with closing(sqlite3.connect(populated)) as conn, conn:
        conn.execute("UPDATE alembic_version SET version_num = '0099_future'")
    before = populated.read_bytes()
    good = cache_file("b.json", {K64: ["Runner", 1]}, metadata=META)

    result = cli("import", good)

    one_error_line(
        result,
        f"registry {populated} has schema revision '0099_future', newer than this ficache knows "
        "(head '0010_measurement_fingerprints'); upgrade ficache (pip install -U ficache)",
    )
    assert populated.read_bytes() == before


def test_a_read_only_registry_can_be_read_but_not_written(
    cli, populated: Path, cache_file, dump_db
) -> None:
    before = dump_db(populated)
    populated.chmod(
        0o444
    )  # also read-only for root: ficache checks the mode bits, not only os.access
    good = cache_file("b.json", {K64: ["Runner", 1]}, metadata=META)

    one_error_line(cli("import", good), f"registry {populated} is read-only; pass a writable --db")
    for args in (("prune", "--fingerprint", "1", "--yes"), ("revert", "1", "--yes")):
        result = cli(*args)  # prints its plan, then fails to write it
        assert (result.exit_code, result.stderr) == (
            1,
            f"error: registry {populated} is read-only; pass a writable --db\n",
        )
    listed = cli("list", "--format", "json")

    assert listed.exit_code == 0 and len(json.loads(listed.stdout)) == 2
    assert dump_db(populated) == before


def test_a_write_to_a_read_only_db_via_db_upgrade(cli, populated: Path, dump_db) -> None:
    assert cli("db", "downgrade", "base", "--yes").exit_code == 0
    populated.chmod(0o444)
    before = dump_db(populated)

    result = cli("db", "upgrade")

    one_error_line(result, f"registry {populated} is read-only; pass a writable --db")
    assert dump_db(populated) == before


# -- tracebacks only with --debug -------------------------------------------------------------------


def _ficache(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "FICACHE_DB"}
    return subprocess.run(
        [sys.executable, "-m", "ficache", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_no_traceback_without_debug_and_one_with_it(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not a database")

    plain = _ficache("--db", str(notes), "list", cwd=tmp_path)
    debug = _ficache("--debug", "--db", str(notes), "list", cwd=tmp_path)

    assert (plain.returncode, plain.stdout) == (1, "")
    assert (
        plain.stderr
        == f"error: {notes} is not a SQLite database; pass another --db or move the file away\n"
    )
    assert debug.returncode == 1
    assert "Traceback (most recent call last)" in debug.stderr
    assert debug.stderr.rstrip().splitlines()[-1] == (
        f"ficache.errors.NotARegistryError: {notes} is not a SQLite database; pass another --db or move the file away"
    )


# -- friction (issue 23) -------------------------------------------------------------


def test_verify_takes_table_as_every_command_does_and_text_still(cli, populated: str) -> None:
    default = cli("verify")
    table = cli("verify", "--format", "table")
    text = cli("verify", "--format", "text")

    assert (table.exit_code, table.stderr) == (0, "")
    assert table.stdout == default.stdout == text.stdout
    assert table.stdout.endswith("ok: no problems\n")


# -- Ctrl-C after the commit ------------------------------------------------------------------


def _interrupted_after_commit(
    tmp_path: Path, db: Path, *args: str, signum: int = signal.SIGINT
) -> tuple[int, str, str]:
    """Run ``ficache --db DB ARGS`` in a child, send ``signum`` right after its commit is made."""

    marker = tmp_path / f"committed-{len(list(tmp_path.glob('committed-*')))}"
    env = {k: v for k, v in os.environ.items() if k != "FICACHE_DB"}
    env["FICACHE_TEST_PAUSE_AFTER_COMMIT"] = str(marker)
    child = subprocess.Popen(
        [sys.executable, "-m", "ficache", "--db", str(db), *args],
        cwd=Path(__file__).resolve().parent.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert marker.exists(), f"ficache {' '.join(args)} made no commit: {child.communicate()}"
        child.send_signal(signum)
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    return child.returncode, out, err


def test_ctrl_c_just_after_the_commit_reports_the_commit(cache_file, tmp_path: Path) -> None:
    db = tmp_path / "reg.db"
    a = cache_file("a.json", {K16: ["Runner", 1]}, metadata=META)
    b = cache_file("b.json", {K32: ["Runner", 2]}, metadata=META)

    imported = _interrupted_after_commit(tmp_path, db, "import", str(a))
    merged = _interrupted_after_commit(tmp_path, db, "merge", str(b))
    reverted = _interrupted_after_commit(tmp_path, db, "revert", "2", "--yes")

    note = "interrupted after commit {} was made; the commit stands\n"
    assert imported == (
        0,
        "imported 1 entries from 1 file(s): 1 added, 0 replaced, 0 unchanged (commit 1)\n",
        f"note: creating a new registry at {db}\n" + note.format(1),
    )
    assert (merged[0], merged[2]) == (0, note.format(2))
    assert merged[1].splitlines()[-1].startswith("merged as commit 2")
    assert (reverted[0], reverted[2]) == (0, note.format(3))
    assert reverted[1].splitlines()[-1].startswith("reverted commit 2 as commit 3")
    with Registry.open(str(db)) as reg:
        assert [c.kind for c in reg.log()] == ["revert", "merge", "import"]


def test_sigterm_just_after_the_commit_reports_the_commit_as_ctrl_c_does(
    cache_file, tmp_path: Path
) -> None:
    """A service manager's SIGTERM is a Ctrl-C: the commit made is reported, exit 0."""
    db = tmp_path / "reg.db"
    a = cache_file("a.json", {K16: ["Runner", 1]}, metadata=META)

    imported = _interrupted_after_commit(tmp_path, db, "import", str(a), signum=signal.SIGTERM)

    assert imported == (
        0,
        "imported 1 entries from 1 file(s): 1 added, 0 replaced, 0 unchanged (commit 1)\n",
        f"note: creating a new registry at {db}\n"
        "interrupted after commit 1 was made; the commit stands\n",
    )


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_ctrl_c_or_sigterm_at_a_prompt_exits_130_and_changes_nothing(
    cache_file, tmp_path: Path, signum: int
) -> None:
    """Stopped at "Revert? [y/N]", a command says "interrupted" and exits 130 (click's own
    Abort exits 1, which read as a failure, not a stop); the registry is as before."""
    db = tmp_path / "reg.db"
    a = cache_file("a.json", {K16: ["Runner", 1]}, metadata=META)
    imported = subprocess.run(
        [sys.executable, "-m", "ficache", "--db", str(db), "import", str(a)],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert imported.returncode == 0, imported.stderr
    before = _sqlite_dump(db)

    code, output = run_in_a_terminal(["--db", str(db), "revert", "1"], signal_at_prompt=signum)

    assert code == 130
    assert output.endswith("[y/N]: \ninterrupted\n")
    assert _sqlite_dump(db) == before


def _sqlite_dump(db: Path) -> list[str]:
    with closing(sqlite3.connect(db)) as conn:
        return list(conn.iterdump())


# -- issue 23: missing fields, and options that were accepted without a word ------------------


def test_control_characters_in_stored_strings_are_shown_escaped_never_sent_raw(
    cli, cache_file
) -> None:
    """A file's ``_metadata.gpu`` (or key) holding terminal control bytes is stored as
    given and exported as given, but tables show them escaped: a hostile file cannot
    clear the operator's screen or rewrite what ``fingerprints`` and ``list`` print."""
    hostile = {**META, "gpu": "H200\x1b[2J\x07\r"}
    key = "('op\x1b]0;title\x07', 'Runner', ((1,),), ())"
    cli("import", cache_file("h.json", {key: ["Runner", 1]}, metadata=hostile))

    shown = cli("fingerprints").stdout + cli("list").stdout

    assert "\x1b" not in shown and "\x07" not in shown and "\r" not in shown
    assert "H200\\x1b[2J\\x07\\r" in shown
    assert "op\\x1b]0;title\\x07" in shown
    assert (
        json.loads(cli("export", "--fingerprint", "1").stdout)["_metadata"]["gpu"]
        == (hostile["gpu"])
    )


def test_a_file_without_gpu_is_exported_without_gpu(cli, cache_file) -> None:
    no_gpu = {k: v for k, v in META.items() if k != "gpu"}
    cli("import", cache_file("a.json", {K16: ["Runner", 1]}, metadata=no_gpu))
    # What an old import of such a file stored, and what a file saying "None" holds: kept.
    said_none = {**META, "gpu": "None"}
    cli("import", cache_file("b.json", {K16: ["Runner", 2]}, metadata=said_none))

    table = cli("fingerprints").stdout.splitlines()
    infos = json.loads(cli("fingerprints", "--format", "json").stdout)

    assert [line.split()[:2] for line in table[1:]] == [["1", "-"], ["2", "None"]]
    assert [i["gpu"] for i in infos] == [None, "None"]
    assert json.loads(cli("export", "--fingerprint", "1").stdout)["_metadata"] == no_gpu
    assert json.loads(cli("export", "--fingerprint", "2").stdout)["_metadata"] == said_none
    warned = cli("list", "--gpu", "L40S")
    assert (
        warned.stderr == "warning: --gpu 'L40S' matches no stored fingerprint; stored: -, 'None'\n"
    )


def test_export_of_a_scope_that_holds_nothing_warns(
    cli, populated: str, cache_file, tmp_path: Path
) -> None:
    cli("import", cache_file("r.json", {K64: ["Runner", 9]}, metadata=META), "--scope", "tp2/rank0")
    shared = cli("export", "--fingerprint", "1").stdout

    stray = cli("export", "--fingerprint", "1", "--scope", "tp2/rank5")
    stored = cli("export", "--fingerprint", "1", "--scope", "tp2/rank0")
    store = cli(
        "export", "--v2-store", tmp_path / "v2", "--fingerprint", "1", "--scope", "tp4/rank0"
    )

    assert (stray.exit_code, stray.stdout) == (0, shared)
    assert stray.stderr == (
        "warning: fingerprint 1 holds nothing scoped to tp2/rank5 (its rank scopes: tp2/rank0); "
        "exported the shared entries only\n"
    )
    assert (stored.exit_code, stored.stderr) == (0, "")
    assert K64 in json.loads(stored.stdout)
    assert store.exit_code == 0
    assert store.stderr == (
        "warning: fingerprint 1 holds nothing scoped to tp4/rank0 (its rank scopes: tp2/rank0); "
        "exported the shared entries only\n"
    )


@pytest.mark.parametrize("layout", ["bogus", "tp4", "tp0-pp1-dp1-ep1", "tp2-pp1-dp1"])
def test_from_vllm_layout_must_be_one_the_plugin_names(cli, tmp_path: Path, layout: str) -> None:
    result = cli("import", "--from-vllm", tmp_path, "--layout", layout)

    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == (
        f"Error: Invalid value for '--layout': {layout!r} is not a layout the vLLM plugin names; "
        "give it as tp<T>-pp<P>-dp<D>-ep<E>, sizes of at least 1 (tp4-pp1-dp1-ep4)"
    )
    assert not (tmp_path / "registry.db").exists()


def test_import_fingerprint_is_refused_where_every_file_names_its_own(
    cli, populated: str, cache_file, dump_db
) -> None:
    b200 = cache_file("b.json", {K16: ["Runner", 7]}, metadata=B200)
    bare = cache_file("bare.json", {K64: ["Runner", 5]}, metadata=None)
    before = dump_db(populated)

    refused = cli("import", b200, "--fingerprint", "1")

    assert refused.exit_code == 2
    assert refused.stderr.splitlines()[-1] == (
        f"Error: --fingerprint is for files without _metadata, and {b200} has one naming its "
        "environment; drop --fingerprint"
    )
    assert dump_db(populated) == before

    mixed = cli("import", b200, bare, "--fingerprint", "1")

    assert mixed.exit_code == 0
    assert mixed.stderr == (
        "warning: --fingerprint applied to 1 file(s) without _metadata; 1 file(s) with "
        f"_metadata kept the fingerprint it names (first: {b200})\n"
    )
    rows = json.loads(cli("list", "--format", "json").stdout)
    assert sorted((r["fingerprint"], r["key"]) for r in rows) == [
        (1, K16),
        (1, K32),
        (1, K64),
        (2, K16),
    ]


def test_list_says_which_filter_matched_no_fingerprint(cli, populated: str, cache_file) -> None:
    cli("import", cache_file("b.json", {K16: ["Runner", 7]}, metadata=B200))
    header = "fingerprint  scope  op  runner  shapes  extras  tactic  commit\n"

    gpu = cli("list", "--gpu", "L40S")
    version = cli("list", "--flashinfer-version", "0.7.2.post1", "--format", "json")
    together = cli("list", "--gpu", "NVIDIA B200", "--fingerprint", "1")
    op = cli("list", "--op", "attn")
    found = cli("list", "--gpu", "NVIDIA B200")

    assert (gpu.exit_code, gpu.stdout) == (0, header)
    assert gpu.stderr == (
        "warning: --gpu 'L40S' matches no stored fingerprint; stored: 'NVIDIA B200', 'NVIDIA H200'\n"
    )
    assert (version.exit_code, json.loads(version.stdout)) == (0, [])
    assert version.stderr == (
        "warning: --flashinfer-version '0.7.2.post1' matches no stored fingerprint; stored: '0.7.2'\n"
    )
    assert together.stderr == (
        "warning: --gpu 'NVIDIA B200' does not match fingerprint 1, which has 'NVIDIA H200'\n"
    )
    assert (op.exit_code, op.stderr) == (0, "warning: no stored op is or contains 'attn'\n")
    assert (found.exit_code, found.stderr) == (0, "")


def test_fingerprints_fits_100_columns_filters_and_hides_empty_ones(cli, cache_file) -> None:
    from samples import H200_METADATA

    h100 = {**H200_METADATA, "gpu": "NVIDIA H100 80GB HBM3"}
    cli("import", cache_file("h200.json", {K16: ["Runner", 1]}, metadata=H200_METADATA))
    cli("import", cache_file("h100.json", {K16: ["Runner", 2]}, metadata=h100))
    cli("import", cache_file("b200.json", {K16: ["Runner", 3]}, metadata=B200))
    assert cli("prune", "--fingerprint", "3", "--yes").exit_code == 0  # B200 holds nothing now

    table = cli("fingerprints")
    everything = cli("fingerprints", "--all", "--format", "json")
    h100_only = cli("fingerprints", "--gpu", "NVIDIA H100 80GB HBM3")
    pruned = cli("fingerprints", "--gpu", "NVIDIA B200", "--all")
    missed = cli("fingerprints", "--flashinfer-version", "0.6")
    apart = cli("fingerprints", "--gpu", "NVIDIA B200", "--flashinfer-version", "0.7.2.post1")

    assert table.stdout.splitlines() == [
        "id  gpu                    cc  flashinfer   torch  cuda  entries  records  last served",
        "1   NVIDIA H200            *   0.7.2.post1  *      12.9  1        0        never",
        "2   NVIDIA H100 80GB HBM3  *   0.7.2.post1  *      12.9  1        0        never",
    ]
    assert max(len(line) for line in table.stdout.splitlines()) <= 100
    assert table.stderr == (
        "note: 1 fingerprint(s) without entries or records not shown; --all shows them\n"
    )
    assert [(i["id"], i["entries"]) for i in json.loads(everything.stdout)] == [
        (1, 1),
        (2, 1),
        (3, 0),
    ]
    assert [line.split()[0] for line in h100_only.stdout.splitlines()] == ["id", "2"]
    assert [line.split()[0] for line in pruned.stdout.splitlines()] == ["id", "3"]
    assert (missed.exit_code, missed.stdout.splitlines()[1:]) == (0, [])
    assert missed.stderr == (
        "warning: --flashinfer-version '0.6' matches no stored fingerprint; "
        "stored: '0.7.2', '0.7.2.post1'\n"
    )
    assert (apart.exit_code, apart.stdout.splitlines()[1:]) == (0, [])
    assert apart.stderr == (
        "warning: no stored fingerprint matches --gpu 'NVIDIA B200' and "
        "--flashinfer-version '0.7.2.post1' together\n"
    )


# -- ficache env (issue 35) ---------------------------------------------------------------


def test_env_reports_the_registry_variables_and_slice_cache_without_creating_anything(
    cli, registry_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache_file
) -> None:
    from ficache import schema
    from ficache.slices import default_cache_dir

    monkeypatch.setenv("FICACHE_SGLANG", "n")
    monkeypatch.setenv("FICACHE_MODE", "replay")
    monkeypatch.setenv("VLLM_PLUGINS", "other,ficache")
    monkeypatch.setenv("SGLANG_PLUGINS", "other")
    slices = default_cache_dir()
    slices.mkdir(parents=True)
    (slices / "a.bin").write_bytes(b"x" * 1000)
    (slices / "b.bin").write_bytes(b"y" * 24)

    missing = cli("env", "--format", "json")
    assert (missing.exit_code, missing.stderr) == (0, "")
    assert not registry_path.exists()
    before = json.loads(missing.stdout)
    assert before["registry"] == str(registry_path) and before["registry_source"] == "--db"
    assert (before["registry_revision"], before["registry_problem"]) == (None, "not created yet")
    assert (before["slice_cache"], before["slice_cache_files"], before["slice_cache_bytes"]) == (
        str(slices),
        2,
        1024,
    )
    effects = {v["name"]: (v["value"], v["effect"]) for v in before["variables"]}
    assert effects["FICACHE_SGLANG"] == ("n", "SGLang plugin: off")
    assert effects["FICACHE_VLLM"] == (None, "vLLM plugin: on")
    assert effects["FICACHE_MODE"] == ("replay", "start mode: replay")
    assert effects["VLLM_PLUGINS"][1] == "ficache is allowed"
    assert effects["SGLANG_PLUGINS"][1] == "ficache is NOT allowed: it never loads"

    cli("import", cache_file("a.json", {K16: ["Runner", 1]}, metadata=META))
    after = json.loads(cli("env", "--format", "json").stdout)
    head = schema.head_revision()
    assert (after["registry_revision"], after["registry_problem"]) == (head, None)
    table = cli("env")
    assert table.exit_code == 0
    assert table.stdout.splitlines()[0] == (
        f"registry     {registry_path} (--db; schema {head} (head))"
    )


def test_env_names_a_registry_it_cannot_read_and_still_exits_0(cli, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not a database\n")

    shown = cli("env", "--format", "json", db=notes)

    assert shown.exit_code == 0
    report = json.loads(shown.stdout)
    assert report["registry_revision"] is None
    assert "is not a SQLite database" in report["registry_problem"]
    assert notes.read_text() == "not a database\n"


# -- a fleet's operator, second trial (issue 35) -------------------------------------------


def test_import_reads_a_pipe_once(tmp_path: Path, cache_file) -> None:
    """Bug 5: a pipe (`<(cat f)`, `cat f | ... /dev/stdin`) and `-` were read twice
    (recognising, then reading), so the second read saw a truncated file."""
    f = cache_file("h200.json", {K16: ["Runner", 1], K32: ["Runner", 2]}, metadata=META)
    db = tmp_path / "reg.db"
    env = {k: v for k, v in os.environ.items() if k != "FICACHE_DB"}
    run = [sys.executable, "-m", "ficache", "--db", str(db)]
    substituted = subprocess.run(
        ["bash", "-c", f'exec "$@" import <(cat {f})', "bash", *run],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    piped = subprocess.run(
        [*run, "import", "/dev/stdin", "--format", "json"],
        input=cache_file("changed.json", {K32: ["Runner", 5]}, metadata=META).read_text(),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert (substituted.returncode, substituted.stdout) == (
        0,
        "imported 2 entries from 1 file(s): 2 added, 0 replaced, 0 unchanged (commit 1)\n",
    ), substituted.stderr
    assert piped.returncode == 0, piped.stderr
    assert json.loads(piped.stdout)["replaced"] == 1
    with Registry.open(str(db)) as reg:
        messages = sorted(c.message for c in reg.log())
    assert messages[1] == "/dev/stdin"
    assert messages[0].startswith("/dev/fd/")  # the name given, not the spooled copy


def test_import_dash_is_standard_input(cli, cache_file, registry_path: Path) -> None:
    f = cache_file("h200.json", {K16: ["Runner", 1]}, metadata=META)

    result = cli("import", "-", input=f.read_text())
    bad = cli("import", "-", input='{"_metadata": {')

    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("imported 1 entries from 1 file(s): 1 added")
    assert bad.exit_code == 1
    assert bad.stderr.startswith("error: <stdin>: ")
    with Registry.open(str(registry_path)) as reg:
        assert [c.message for c in reg.log()] == ["<stdin>"]


def test_export_v2_store_says_it_leaves_namespaced_records_out(
    cli, cache_file, tmp_path: Path
) -> None:
    """Bug 8: a v2 store has no place for ``_records``; the export dropped them silently."""
    path = cache_file(
        "r.json",
        {"_records": {"trtllm_moe_da": {"a": 1, "b": [2]}}, K16: ["Runner", 1]},
        metadata=META,
    )
    cli("import", path)

    store = cli("export", "--v2-store", tmp_path / "v2", "--fingerprint", "1")

    assert store.exit_code == 0
    assert store.stdout.startswith("exported 1 entries to ")
    assert store.stderr == (
        "warning: 2 namespaced records (_records) not exported: a v2 store has no place for "
        "them; export a file (-o FILE) or a bundle (--bundle) to carry them\n"
    )


#: The environment a warm start on an H200 records: FlashInfer's fields, compute capability
#: and torch version (a FlashInfer file, and an export of it, hold only the first).
STARTED = Fingerprint.from_dict({**META, "compute_capability": "9.0", "torch_version": "2.13.0"})
AS_A_FILE = Fingerprint.from_flashinfer_metadata(META)  # cc and torch the wildcard


def _write(db: str | Path, fp: Fingerprint, values: dict[str, int]) -> None:
    from ficache.values import NewEntry

    with Registry.open(str(db)) as reg:
        reg.write([NewEntry(fp, k, "Runner", str(v)) for k, v in values.items()], kind="startup")


def _served(db: str | Path, env: Fingerprint) -> dict[str, str]:
    with Registry.open(str(db)) as reg:
        ids = [i.id for i in reg.serving(env)]
        return {k: row[2] for k, row in reg.slice_rows(ids, ["shared"]).items()}


def test_reimporting_an_export_lands_in_the_fingerprint_it_came_from(
    cli, registry_path: Path, tmp_path: Path
) -> None:
    """Bug 2: `export --fingerprint 1 -o rt.json; import rt.json` made a second fingerprint
    (cc `*`, torch `*`) that never served; importing a changed copy "replaced" its values
    while starts kept serving fingerprint 1's."""
    _write(registry_path, STARTED, {K16: 1, K32: 2})
    rt = tmp_path / "rt.json"
    assert cli("export", "--fingerprint", "1", "-o", rt).exit_code == 0

    again = cli("import", rt)
    changed = json.loads(rt.read_text())
    changed[K16][1] = 7
    rt.write_text(json.dumps(changed))
    dry = cli("import", rt, "--dry-run")
    result = cli("import", rt)

    assert again.stdout.startswith(
        "imported 2 entries from 1 file(s): 0 added, 0 replaced, 2 unchanged"
    )
    assert dry.stdout.startswith(
        "would import 2 entries from 1 file(s): 0 added, 1 replaced, 1 unchanged"
    )
    assert result.stdout.startswith(
        "imported 2 entries from 1 file(s): 0 added, 1 replaced, 1 unchanged"
    )
    with Registry.open(str(registry_path)) as reg:
        assert [i.id for i in reg.fingerprints()] == [1]
    assert _served(registry_path, STARTED) == {K16: "7", K32: "2"}


def test_the_fingerprint_with_more_exact_fields_serves_then_the_newest(registry_path: Path) -> None:
    """Which of several matching fingerprints serves: fewest wildcards, then the newest."""
    env = Fingerprint.from_dict({**META, "compute_capability": "9.0", "torch_version": "2.14.0"})
    cc_only = Fingerprint.from_dict({**META, "compute_capability": "9.0"})  # torch `*`
    _write(registry_path, cc_only, {K16: 1})  # fingerprint 1
    _write(registry_path, AS_A_FILE, {K16: 2, K32: 2})  # 2: newer, but two wildcards
    _write(
        registry_path,
        AS_A_FILE.__class__(**{**AS_A_FILE.as_dict(), "torch_version": "2.14.0"}),
        {K64: 3},
    )  # 3

    with Registry.open(str(registry_path)) as reg:
        order = [i.id for i in reg.serving(env)]

    assert order == [3, 1, 2]  # one wildcard each (3 newer than 1), then two
    assert _served(registry_path, env) == {K16: "1", K32: "2", K64: "3"}


def test_fold_moves_one_fingerprint_into_another_as_one_revertible_commit(
    cli, registry_path: Path, dump_db
) -> None:
    _write(registry_path, STARTED, {K16: 1, K32: 2})  # fingerprint 1, commit 1
    _write(registry_path, AS_A_FILE, {K16: 7, K64: 3})  # fingerprint 2, commit 2
    before = dump_db(registry_path)

    dry = cli("fold", "2", "--into", "1", "--dry-run")
    as_json = cli("fold", "2", "--into", "1", "--dry-run", "--format", "json")
    assert dump_db(registry_path) == before
    run = cli("fold", "2", "--into", "1", "--yes")

    assert dry.stdout.splitlines() == [
        "fold plan: fingerprint 2 into 1: entries: move 1, replace 1, keep 0, same 0",
        "dry run: nothing changed",
    ]
    assert json.loads(as_json.stdout) | {"target": None} == {
        "target": None,
        "source": 2,
        "into": 1,
        "keep_target": False,
        "entries": {"moved": 1, "replaced": 1, "kept": 0, "same": 0},
        "records": {"moved": 0, "replaced": 0, "kept": 0, "same": 0},
        "protocol_records": {"moved": 0, "replaced": 0, "kept": 0, "same": 0},
        "dry_run": True,
        "commit": None,
    }
    assert run.stdout.splitlines()[-1] == "folded fingerprint 2 into 1 as commit 3"
    assert _served(registry_path, STARTED) == {K16: "7", K32: "2", K64: "3"}
    with Registry.open(str(registry_path)) as reg:
        assert {i.id: i.entries for i in reg.fingerprints()} == {1: 3, 2: 0}
    assert cli("revert", "3", "--yes").exit_code == 0
    assert _served(registry_path, STARTED) == {K16: "1", K32: "2", K64: "3"}
    with Registry.open(str(registry_path)) as reg:
        assert {i.id: i.entries for i in reg.fingerprints()} == {1: 2, 2: 2}


def test_fold_keeps_the_target_when_asked_and_refuses_two_environments(
    cli, registry_path: Path, dump_db
) -> None:
    _write(registry_path, STARTED, {K16: 1})
    _write(registry_path, AS_A_FILE, {K16: 7})
    _write(registry_path, Fingerprint.from_flashinfer_metadata(B200), {K16: 9})
    kept = cli("fold", "2", "--into", "1", "--keep-target", "--yes")
    before = dump_db(registry_path)

    other = cli("fold", "3", "--into", "1", "--yes")
    itself = cli("fold", "1", "--into", "1", "--yes")

    assert kept.stdout.splitlines()[0] == (
        "fold plan: fingerprint 2 into 1: entries: move 0, replace 0, keep 1, same 0"
    )
    assert _served(registry_path, STARTED) == {K16: "1"}
    one_error_line(
        other,
        "fingerprints 3 and 1 differ in gpu ('NVIDIA B200' vs 'NVIDIA H200'), so no environment "
        "is described by both; fold only fingerprints of one environment",
    )
    one_error_line(itself, "fingerprint 1 cannot fold into itself; name another")
    assert dump_db(registry_path) == before


def test_fingerprints_here_marks_the_one_that_serves(cli, registry_path: Path) -> None:
    from conftest import current_metadata

    from ficache.fingerprint import collect

    here = collect()
    _write(registry_path, here, {K16: 1})  # 1: exact
    _write(registry_path, Fingerprint.from_flashinfer_metadata(current_metadata()), {K32: 2})
    _write(registry_path, Fingerprint.from_flashinfer_metadata(B200), {K16: 9})

    shown = json.loads(cli("fingerprints", "--here", "--format", "json").stdout)
    table = cli("fingerprints", "--here").stdout.splitlines()
    plain = json.loads(cli("fingerprints", "--format", "json").stdout)

    assert [(f["id"], f.get("here")) for f in shown] == [(1, "serves"), (2, "fills in"), (3, None)]
    assert table[0].split()[-1] == "here"
    assert [line.split()[-1] for line in table[1:3]] == ["serves", "in"]
    assert all("here" not in f for f in plain)


OLD_KEY = (
    "('old_op', 'FakeRunnerA', ((1, 1),))"  # 0.6.7-0.6.12's save_configs; FlashInfer's _OLD_KEY
)
OPAQUE_KEY = "('mm', 'Runner', ((8, 64),), (device(type='cuda', index=0), torch.bfloat16))"


def test_every_key_form_goes_through_every_path_as_written(cli, cache_file, tmp_path: Path) -> None:
    """Issue 34 item 1: a 3-element key and a key whose extras are no literal are imported,
    listed and filtered by op, bundled, merged, verified and exported exactly as
    written (before: "a key is a 4-tuple ... nothing imported")."""
    values = {OLD_KEY: ["FakeRunnerA", 3], OPAQUE_KEY: ["Runner", [1, 2]], K16: ["Runner", 4]}
    original = cache_file("old.json", values, metadata=META)

    assert cli("import", original).exit_code == 0
    listed = json.loads(cli("list", "--op", "old_op", "--format", "json").stdout)
    assert [(e["key"], e["runner"], e["shapes"], e["extras"]) for e in listed] == [
        (OLD_KEY, "FakeRunnerA", [[1, 1]], "")
    ]
    every = json.loads(cli("list", "--op", "mm", "--format", "json").stdout)
    assert sorted((e["key"], e["runner"], e["extras"]) for e in every) == [
        (K16, "Runner", "(torch.bfloat16,)"),
        (OPAQUE_KEY, "Runner", "(device(type='cuda', index=0), torch.bfloat16)"),
    ]
    exported = tmp_path / "exported.json"
    assert cli("export", "--fingerprint", "1", "-o", exported).exit_code == 0
    assert {k: v for k, v in json.loads(exported.read_text()).items() if k[0] != "_"} == values
    bundle = tmp_path / "all.bundle"
    assert cli("export", "--all", "--bundle", bundle).exit_code == 0
    other = tmp_path / "other.db"
    assert cli("merge", bundle, original, db=other).exit_code == 0
    again = tmp_path / "again.json"
    assert cli("export", "--fingerprint", "1", "-o", again, db=other).exit_code == 0
    assert again.read_bytes() == exported.read_bytes()
    verified = cli("verify")
    assert (verified.exit_code, verified.stdout.splitlines()[-1]) == (0, "ok: no problems")
