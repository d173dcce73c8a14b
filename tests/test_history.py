"""``ficache show`` of import, merge, prune and revert commits (text and JSON),
``history.commit_details``, and ``ficache revert`` of merge commits."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sqlite3
import time
from contextlib import closing
from pathlib import Path

import pytest
from samples import SHORT_H200_METADATA

from ficache.fingerprint import Fingerprint
from ficache.history import CommitDetails, EntryChange, EntryValue, commit_details
from ficache.registry import Registry

META = SHORT_H200_METADATA
DIGEST = Fingerprint.from_flashinfer_metadata(META).digest
POLICY = ["cuda_graph_profile_replays", None, "l2_cache_policy", "hot"]
POLICY_JSON = '["cuda_graph_profile_replays",null,"l2_cache_policy","hot"]'
K16 = "('mm', 'Runner', ((16, 64),), (torch.bfloat16,))"
K32 = "('mm', 'Runner', ((32, 64),), (torch.bfloat16,))"
K64 = "('mm', 'Runner', ((64, 64),), (torch.bfloat16,))"
OLD16 = f"[1,[2,3]] policy {POLICY_JSON}"  # K16's imported value, as `show` prints it


def when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def one_error_line(result, message: str) -> None:
    assert (result.exit_code, result.stdout, result.stderr) == (1, "", f"error: {message}\n")


def commit(registry_db: str, commit_id: int):
    with Registry.open(registry_db) as reg:
        [found] = reg.log(None, commit_id=commit_id)
    return found


def first_line(c) -> str:
    who = f"{c.user}@{c.host}" if c.user else c.host
    return f"commit {c.id}: {c.kind}, {when(c.created_at)}, {who}"


def tuned_at(registry_db: str) -> dict[tuple[str, str], float]:
    with Registry.open(registry_db) as reg:
        return {(r[1], r[2]): r[6] for r in reg.entry_values([1])}


@pytest.fixture
def imported(cli, cache_file, tmp_path: Path) -> Path:
    """Commit 1: an import of K16 (with a policy) and K32."""
    path = cache_file("a.json", {K16: ["Runner", [1, [2, 3]], POLICY], K32: ["Runner", 4]}, META)
    assert cli("import", path).exit_code == 0
    return path


@pytest.fixture
def merged(cli, cache_file, imported: Path) -> Path:
    """Commit 2: a merge (theirs) that replaced K16 and added K64."""
    source = cache_file(
        "b.json", {K16: ["Runner", 7], K32: ["Runner", 4], K64: ["Runner", 5]}, META
    )
    os.utime(source, (1000.0, 1000.0))
    result = cli("merge", source, "--on-conflict", "theirs")
    assert result.stdout.splitlines()[-1] == "merged as commit 2: 1 added, 1 replaced, 0 removed"
    return source


# -- show ----------------------------------------------------------------------------------


@pytest.mark.usefixtures("backend")
def test_show_an_import(cli, imported: Path, registry_db: str) -> None:
    c = commit(registry_db, 1)

    result = cli("show", "1")

    assert (result.exit_code, result.stderr) == (0, "")
    assert result.stdout.splitlines() == [
        first_line(c),
        f"message: {imported}",
        "changes: 2 added, 0 replaced, 0 removed",
        "action  fingerprint  scope   op  runner  shapes      extras             old  new",
        f"added   1            shared  mm  Runner  [[16, 64]]  (torch.bfloat16,)  -    {OLD16}",
        "added   1            shared  mm  Runner  [[32, 64]]  (torch.bfloat16,)  -    4",
    ]


@pytest.mark.usefixtures("backend")
def test_show_a_merge_with_old_and_new_values_and_provenance(
    cli, merged: Path, registry_db: str
) -> None:
    c = commit(registry_db, 2)
    digest = hashlib.sha256(merged.read_bytes()).hexdigest()

    result = cli("show", "2")

    assert result.stdout.splitlines() == [
        first_line(c),
        f"message: merge (theirs): {merged}",
        "changes: 1 added, 1 replaced, 0 removed",
        "provenance:",
        "  {",
        '    "policy": "theirs",',
        '    "sources": [',
        "      {",
        f'        "digest": "{digest}",',
        '        "entries": 3,',
        '        "kind": "flashinfer",',
        '        "records": 0,',
        f'        "source": "{merged}"',
        "      }",
        "    ]",
        "  }",
        "action    fingerprint  scope   op  runner  shapes      extras             "
        f"{'old'.ljust(len(OLD16))}  new",
        f"replaced  1            shared  mm  Runner  [[16, 64]]  (torch.bfloat16,)  {OLD16}  7",
        "added     1            shared  mm  Runner  [[64, 64]]  (torch.bfloat16,)  "
        f"{'-'.ljust(len(OLD16))}  5",
    ]


def test_show_stat_counts_per_op_and_limit_bounds_the_listing(
    cli, cache_file, merged: Path, registry_db: str
) -> None:
    """A large commit is read by its counts (``--stat``) or a bounded listing: the text
    lists at most ``--limit`` changes of each kind and says how many it left out; JSON
    and ``--limit 0`` list every one."""
    other = "('attn', 'Runner', ((8,),), ())"
    cli(
        "import",
        cache_file(
            "c.json", {K16: ["Runner", 11], K64: ["Runner", 12], other: ["Runner", 1]}, META
        ),
    )  # commit 3: 2 replaced (mm), 1 added (attn)
    c = commit(registry_db, 3)

    stat = cli("show", "3", "--stat")
    as_json = json.loads(cli("show", "3", "--stat", "--format", "json").stdout)
    limited = cli("show", "3", "--limit", "2")
    every = cli("show", "3", "--limit", "0")

    assert stat.exit_code == 0
    assert stat.stdout.splitlines()[-3:] == [
        "kind   op or namespace  added  replaced  removed",
        "entry  attn             1      0         0",
        "entry  mm               0      2         0",
    ]
    assert stat.stdout.splitlines()[0] == first_line(c)
    assert as_json["stat"] == [
        {"kind": "entry", "group": "attn", "added": 1, "replaced": 0, "removed": 0},
        {"kind": "entry", "group": "mm", "added": 0, "replaced": 2, "removed": 0},
    ]
    assert limited.stdout.splitlines()[-1] == (
        "... 1 more entry changes of 3: --limit 0 lists all, --stat counts them"
    )
    assert len(limited.stdout.splitlines()) == len(every.stdout.splitlines())
    assert "more entry changes" not in every.stdout
    assert (
        len(json.loads(cli("show", "3", "--format", "json", "--limit", "1").stdout)["changes"]) == 3
    )


def test_show_a_merge_as_json(cli, merged: Path, registry_db: str) -> None:
    result = cli("show", "2", "--format", "json")

    data = json.loads(result.stdout)
    assert data["commit"] == {**commit(registry_db, 2).as_json()}
    assert data["changes"] == [
        {
            "action": "replaced",
            "fingerprint": 1,
            "scope": "shared",
            "op": "mm",
            "shapes": [[16, 64]],
            "extras": "(torch.bfloat16,)",
            "key": K16,
            "old": {"runner": "Runner", "tactic": [1, [2, 3]], "policy": POLICY},
            "new": {"runner": "Runner", "tactic": 7, "policy": None},
            "old_commit": 1,
            "old_tuned_at": data["changes"][0]["old_tuned_at"],
        },
        {
            "action": "added",
            "fingerprint": 1,
            "scope": "shared",
            "op": "mm",
            "shapes": [[64, 64]],
            "extras": "(torch.bfloat16,)",
            "key": K64,
            "old": None,
            "new": {"runner": "Runner", "tactic": 5, "policy": None},
            "old_commit": None,
            "old_tuned_at": None,
        },
    ]
    assert data["changes"][0]["old_tuned_at"] == pytest.approx(commit(registry_db, 1).created_at)


def test_show_a_prune_and_its_revert(cli, imported: Path, registry_db: str) -> None:
    assert cli("prune", "--fingerprint", "1", "--yes").exit_code == 0
    assert cli("revert", "2", "--yes").exit_code == 0

    pruned = cli("show", "2")
    reverted = cli("show", "3")

    assert pruned.stdout.splitlines() == [
        first_line(commit(registry_db, 2)),
        "message: fingerprint=1",
        "changes: 0 added, 0 replaced, 2 removed",
        "action   fingerprint  scope   op  runner  shapes      extras             "
        f"{'old'.ljust(len(OLD16))}  new",
        f"removed  1            shared  mm  Runner  [[16, 64]]  (torch.bfloat16,)  {OLD16}  -",
        "removed  1            shared  mm  Runner  [[32, 64]]  (torch.bfloat16,)  "
        f"{'4'.ljust(len(OLD16))}  -",
    ]
    assert reverted.stdout.splitlines() == [
        first_line(commit(registry_db, 3)),
        "message: revert commit 2",
        "reverts: commit 2",
        "changes: 2 added, 0 replaced, 0 removed",
        "action  fingerprint  scope   op  runner  shapes      extras             old  new",
        f"added   1            shared  mm  Runner  [[16, 64]]  (torch.bfloat16,)  -    {OLD16}",
        "added   1            shared  mm  Runner  [[32, 64]]  (torch.bfloat16,)  -    4",
    ]


def test_show_a_startup_commit_with_world_and_layout(cli, registry_db: str) -> None:
    from ficache.registry import NewEntry

    fp = Fingerprint.from_flashinfer_metadata(META)
    with Registry.open(registry_db) as reg:
        reg.write(
            [NewEntry(fp, K16, "Runner", "3", scope="tp2/rank1")],
            kind="startup",
            world_size=2,
            layout="tp2",
        )

    result = cli("show", "1")

    assert result.stdout.splitlines()[1:] == [
        "world: 2, layout: tp2",
        "changes: 1 added, 0 replaced, 0 removed",
        "action  fingerprint  scope      op  runner  shapes      extras             old  new",
        "added   1            tp2/rank1  mm  Runner  [[16, 64]]  (torch.bfloat16,)  -    3",
    ]


def test_show_marks_values_history_did_not_keep(cli, imported: Path, registry_db: str) -> None:
    with closing(sqlite3.connect(registry_db)) as conn, conn:
        conn.execute("UPDATE entry_changes SET new_runner = NULL, new_tactic = NULL WHERE id = 2")

    result = cli("show", "1")

    assert result.stdout.splitlines()[-1] == (
        "added   1            shared  mm  Runner  [[32, 64]]  (torch.bfloat16,)  -    ?"
    )


def test_show_errors(cli, imported: Path, tmp_path: Path) -> None:
    one_error_line(cli("show", "9"), "no commit 9; see `ficache log`")
    assert cli("show", "0").exit_code == 2
    missing = tmp_path / "missing.db"
    one_error_line(
        cli("show", "1", db=missing),
        f"no registry at {missing}; import a cache file first (ficache import FILE)",
    )
    assert not missing.exists()


def test_commit_details_library(
    request: pytest.FixtureRequest, imported: Path, registry_db: str
) -> None:
    old_tuned = tuned_at(registry_db)[("shared", K16)]  # K16's, as the import stored it
    assert old_tuned != 1000.0  # the merge's source file's: the two can be told apart
    request.getfixturevalue("merged")  # commit 2, made after reading K16's tuned_at

    with Registry.open(registry_db) as reg:
        details = commit_details(reg, 2)

    assert details == CommitDetails(
        commit(registry_db, 2),
        (
            EntryChange(
                "replaced",
                1,
                "shared",
                K16,
                EntryValue("Runner", "[1,[2,3]]", POLICY_JSON),
                EntryValue("Runner", "7"),
                1,
                old_tuned,
            ),
            EntryChange("added", 1, "shared", K64, None, EntryValue("Runner", "5"), None, None),
        ),
    )
    assert (details.count("added"), details.count("replaced"), details.count("removed")) == (
        1,
        1,
        0,
    )
    assert details.commit.host == socket.gethostname()


# -- revert of merges ----------------------------------------------------------------------


@pytest.mark.usefixtures("backend")
def test_revert_of_a_merge_restores_values_and_tuned_at(
    cli, imported: Path, cache_file, registry_db: str
) -> None:
    before = cli("list", "--format", "json").stdout
    tuned_before = tuned_at(registry_db)
    source = cache_file("b.json", {K16: ["Runner", 7], K64: ["Runner", 5]}, META)
    os.utime(source, (1000.0, 1000.0))
    assert cli("merge", source, "--on-conflict", "theirs").exit_code == 0
    assert tuned_at(registry_db)[("shared", K16)] == 1000.0  # the merge carried the file's mtime

    result = cli("revert", "2", "--yes")

    assert result.stdout.splitlines()[-1] == (
        "reverted commit 2 as commit 3: 1 removed, 1 restored, 0 re-added"
    )
    after = json.loads(cli("list", "--format", "json").stdout)
    assert [(r["key"], r["tactic"]) for r in after] == [
        (r["key"], r["tactic"]) for r in json.loads(before)
    ]
    assert tuned_at(registry_db) == tuned_before


@pytest.mark.usefixtures("backend")
def test_revert_of_a_drop_merge_re_adds_what_it_removed(
    cli, imported: Path, cache_file, registry_db: str
) -> None:
    tuned_before = tuned_at(registry_db)
    source = cache_file("b.json", {K16: ["Runner", 7], K32: ["Runner", 4]}, META)
    merge = cli("merge", source, "--on-conflict", "drop")
    assert merge.stdout.splitlines()[-1] == "merged as commit 2: 0 added, 0 replaced, 1 removed"
    shown = json.loads(cli("show", "2", "--format", "json").stdout)["changes"]
    assert [(c["action"], c["key"], c["old"]["tactic"], c["new"]) for c in shown] == [
        ("removed", K16, [1, [2, 3]], None)
    ]

    result = cli("revert", "2", "--yes")

    assert result.stdout.splitlines()[-1] == (
        "reverted commit 2 as commit 3: 0 removed, 0 restored, 1 re-added"
    )
    rows = json.loads(cli("list", "--format", "json").stdout)
    assert [(r["key"], r["tactic"], r["policy"]) for r in rows] == [
        (K16, [1, [2, 3]], POLICY),
        (K32, 4, None),
    ]
    assert tuned_at(registry_db) == tuned_before
    # Merging the source again drops K16 again (it still conflicts): one more commit.
    again = cli("merge", source, "--on-conflict", "drop")
    assert again.stdout.splitlines()[-1] == "merged as commit 4: 0 added, 0 replaced, 1 removed"


@pytest.mark.usefixtures("backend")
def test_revert_of_a_merge_is_refused_after_a_later_change(
    cli, merged: Path, cache_file, registry_db: str, dump_db
) -> None:
    cli("import", cache_file("c.json", {K64: ["Runner", 6]}, META))
    before = dump_db(registry_db)

    result = cli("revert", "2", "--yes")
    dry = cli("revert", "2", "--dry-run")

    assert (result.exit_code, result.stderr) == (
        1,
        "error: 1 of 2 entries of commit 2 changed in later commits; revert those first "
        "(ficache log)\n",
    )
    assert result.stdout.splitlines()[1:] == [
        "conflicts (changed by commit 3):",
        "kind   fingerprint  scope   key                                               commit did  "
        "changed by",
        f"entry  1            shared  {K64}  added       3",
    ]
    assert (dry.exit_code, dry.stdout, dry.stderr) == (1, result.stdout, result.stderr)
    assert dump_db(registry_db) == before


@pytest.mark.usefixtures("backend")
def test_revert_conflict_names_the_commit_that_removed_an_entry(
    cli, merged: Path, cache_file, registry_db: str, dump_db
) -> None:
    """The merge replaced K16; a later drop merge removed it: reverting the merge is refused."""
    dropping = cache_file("c.json", {K16: ["Runner", 8]}, META)
    assert cli("merge", dropping, "--on-conflict", "drop").exit_code == 0  # commit 3
    before = dump_db(registry_db)

    dry = cli("revert", "2", "--dry-run", "--format", "json")
    run = cli("revert", "2", "--yes")

    conflicts = json.loads(dry.stdout)["conflicts"]
    assert [(c["key"], c["action"], c["changed_by"]) for c in conflicts] == [(K16, "replaced", 3)]
    assert dry.exit_code == run.exit_code == 1
    assert (
        dry.stderr
        == run.stderr
        == (
            "error: 1 of 2 entries of commit 2 changed in later commits; revert those first "
            "(ficache log)\n"
        )
    )
    assert dump_db(registry_db) == before


# -- history can always be undone (issue 35) ------------------------------------------------


def _state(cli) -> tuple[list, list]:
    entries = json.loads(cli("list", "--format", "json").stdout)
    records = json.loads(cli("list", "--records", "--format", "json").stdout)
    return (
        [(r["key"], r["tactic"]) for r in entries],
        [(r["namespace"], r["key"], r["value"]) for r in records],
    )


@pytest.mark.usefixtures("backend")
def test_revert_of_a_commit_whose_later_changer_was_reverted(
    cli, cache_file, registry_db: str
) -> None:
    """Bug 4: import A (1); import B (2); revert 2 (3); revert 1 was refused ("changed in
    later commits") and no order of reverts got past it. Entries and records alike."""
    a = cache_file("a.json", {K16: ["Runner", 1], "_records": {"ns": {"r": 1}}}, META)
    b = cache_file("b.json", {K16: ["Runner", 2], "_records": {"ns": {"r": 2}}}, META)
    assert cli("import", a).exit_code == 0
    assert cli("import", b).exit_code == 0
    assert cli("revert", "2", "--yes").exit_code == 0

    result = cli("revert", "1", "--yes")

    assert (result.exit_code, result.stderr) == (0, "")
    assert result.stdout.splitlines()[-1] == (
        "reverted commit 1 as commit 4: 1 removed, 0 restored, 0 re-added; "
        "records 1 removed, 0 restored, 0 re-added"
    )
    assert _state(cli) == ([], [])
    # and back again: each revert can be reverted in turn
    assert cli("revert", "4", "--yes").exit_code == 0
    assert _state(cli) == ([(K16, 1)], [("ns", "r", 1)])


@pytest.mark.usefixtures("backend")
def test_revert_to_returns_the_registry_to_its_state_after_a_commit(
    cli, cache_file, registry_db: str, dump_db
) -> None:
    a = cache_file("a.json", {K16: ["Runner", 1], K32: ["Runner", 2]}, META)
    b = cache_file("b.json", {K16: ["Runner", 3], K64: ["Runner", 4]}, META)
    c = cache_file("c.json", {"_records": {"ns": {"r": 5}}, K32: ["Runner", 6]}, META)
    for path in (a, b, c):
        assert cli("import", path).exit_code == 0
    assert (
        cli(
            "merge", cache_file("d.json", {K32: ["Runner", 9]}, META), "--on-conflict", "drop"
        ).exit_code
        == 0
    )
    after_1 = ([(K16, 1), (K32, 2)], [])
    after_4 = _state(cli)
    before = dump_db(registry_db)

    dry = cli("revert", "--to", "1", "--dry-run", "--format", "json")
    text = cli("revert", "--to", "1", "--dry-run")
    assert dump_db(registry_db) == before
    run = cli("revert", "--to", "1", "--yes")

    assert json.loads(dry.stdout) | {"to": None, "target": None} == {
        "target": None,
        "to": None,
        "undoes": [2, 3, 4],
        "entries": {"remove": 1, "restore": 1, "re_add": 1},
        "records": {"remove": 1, "restore": 0, "re_add": 0},
        "protocol_records": {"remove": 0, "restore": 0, "re_add": 0},
        "dry_run": True,
        "commit": None,
    }
    assert text.stdout.splitlines()[0].endswith(
        "undoing 3 later commit(s): entries: remove 1, restore 1, re-add 1; "
        "records: remove 1, restore 0, re-add 0"
    )
    assert text.stdout.splitlines()[-1] == "dry run: nothing changed"
    assert run.stdout.splitlines()[-1] == (
        "reverted to commit 1 as commit 5: 1 removed, 1 restored, 1 re-added; "
        "records 1 removed, 0 restored, 0 re-added"
    )
    assert _state(cli) == after_1
    assert commit(registry_db, 5).message == "revert to commit 1 (undoes commits 2-4)"
    again = cli("revert", "--to", "1", "--yes")
    assert again.stdout.splitlines()[-1] == (
        "nothing to revert: the registry holds its state after commit 1"
    )
    # one revertible commit: reverting it is where the registry was
    assert cli("revert", "5", "--yes").exit_code == 0
    assert _state(cli) == after_4


def test_revert_needs_a_commit_or_to(cli, imported: Path) -> None:
    both = cli("revert", "1", "--to", "1")
    neither = cli("revert")

    assert both.exit_code == neither.exit_code == 2
    assert both.stderr.splitlines()[-1] == "Error: give one COMMIT_ID to revert, or --to N"


def test_a_revert_to_commit_verifies_clean(cli, cache_file, registry_db: str) -> None:
    from ficache.verify import verify

    assert cli("import", cache_file("a.json", {K16: ["Runner", 1]}, META)).exit_code == 0
    assert cli("import", cache_file("b.json", {K16: ["Runner", 2]}, META)).exit_code == 0
    assert cli("revert", "--to", "1", "--yes").exit_code == 0

    report = verify(registry_db)

    assert report.ok, report.problems
    assert commit(registry_db, 3).provenance == {"revert_to": 1}
