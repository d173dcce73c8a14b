"""``ficache merge``: every policy, idempotence, fingerprints and scopes kept apart,
registry and bundle sources, dry runs, and damaged sources (one line, exit 1,
the registry unchanged).

The target registry is the ``cli`` fixture's (``registry_db``); tests marked
``usefixtures("backend")`` also run against PostgreSQL where it is enabled.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import sqlite3
import time
from contextlib import closing
from pathlib import Path

import pytest
from samples import SHORT_H200_METADATA
from terminal import run_in_a_terminal

from ficache.errors import ConflictError, MergeConflictError, StalePlanError
from ficache.fingerprint import Fingerprint
from ficache.merge import POLICIES, merge_sources, open_source, plan_merge, registry_digest
from ficache.registry import NewEntry, Registry

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
META = SHORT_H200_METADATA
B200 = {**META, "gpu": "NVIDIA B200"}
H200_FP = Fingerprint.from_flashinfer_metadata(META)
B200_FP = Fingerprint.from_flashinfer_metadata(B200)
DIGEST = H200_FP.digest
K16 = "('mm', 'Runner', ((16, 64),), (torch.bfloat16,))"
K32 = "('mm', 'Runner', ((32, 64),), (torch.bfloat16,))"
K64 = "('mm', 'Runner', ((64, 64),), (torch.bfloat16,))"
ATTN = "('attn', 'Runner', ((8,),), ())"
GROUPS_HEADER = (
    "fingerprint  digest        gpu          scope   op  added  replaced  removed  identical  "
    "conflicting"
)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def one_error_line(result, message: str) -> None:
    assert (result.exit_code, result.stderr) == (1, f"error: {message}\n")


def stored(cli) -> dict[tuple[int, str, str], object]:
    """``(fingerprint id, scope, key) -> tactic`` of every stored entry."""
    result = cli("list", "--format", "json")
    assert result.exit_code == 0, result.stderr
    return {
        (r["fingerprint"], r["scope"], r["key"]): r["tactic"] for r in json.loads(result.stdout)
    }


def commits(cli) -> list[dict]:
    return json.loads(cli("log", "--format", "json").stdout)


def flashinfer_file(cache_file, name: str, values: dict[str, int], mtime: float, meta=META) -> Path:
    path = cache_file(name, {k: ["Runner", v] for k, v in values.items()}, metadata=meta)
    os.utime(path, (mtime, mtime))
    return path


@pytest.fixture
def target(cli, cache_file, registry_db: str, created_note) -> None:
    """The target registry: commit 1 imported K16=1 and K32=2 (tuned now)."""
    result = cli("import", cache_file("t.json", {K16: ["Runner", 1], K32: ["Runner", 2]}, META))
    assert (result.exit_code, result.stderr) == (0, created_note(registry_db))


@pytest.fixture
def sources(cache_file, target) -> list[Path]:
    """Four files that disagree about K16 with the target and with each other.

    K16: source 1 has 9 (tuned 1000 s ago), source 2 has 8 (the newest),
    source 3 has 9 (older), source 4 has 7 (oldest). Sources 1 and 2 also hold
    K32=2 (as the target does) and K64=5 (new to the target).
    """
    now = time.time()
    return [
        flashinfer_file(cache_file, "s1.json", {K16: 9, K32: 2, K64: 5}, now - 1000),
        flashinfer_file(cache_file, "s2.json", {K16: 8, K64: 5}, now + 1000),
        flashinfer_file(cache_file, "s3.json", {K16: 9}, now - 2000),
        flashinfer_file(cache_file, "s4.json", {K16: 7}, now - 3000),
    ]


def source_table(paths: list[Path], entries: list[int]) -> list[str]:
    return [
        "source  kind        entries  sha256        name",
        *(
            f"{n}       flashinfer  {count}        {sha256(p)[:12]}  {p}"
            for n, (p, count) in enumerate(zip(paths, entries, strict=True), start=1)
        ),
    ]


# -- the policies ----------------------------------------------------------------------


POLICY_OUTCOMES = {
    # policy: (K16 afterwards, None = removed), added, replaced, removed, resolution
    "keep": (1, 1, 0, 0, "target"),
    "theirs": (7, 1, 1, 0, "source 4"),
    "newest": (8, 1, 1, 0, "source 2"),
    "vote": (9, 1, 1, 0, "source 1"),
    "drop": (None, 1, 0, 1, "dropped"),
}


@pytest.mark.usefixtures("backend")
@pytest.mark.parametrize("policy", list(POLICY_OUTCOMES))
def test_each_policy_resolves_and_merging_again_changes_nothing(
    cli, sources: list[Path], registry_db: str, dump_db, policy: str
) -> None:
    k16, added, replaced, removed, resolution = POLICY_OUTCOMES[policy]

    result = cli("merge", *sources, "--on-conflict", policy)

    assert (result.exit_code, result.stderr) == (0, "")
    assert result.stdout.splitlines() == [
        f"merge plan (on conflict: {policy}, 4 source(s)):",
        *source_table(sources, [3, 2, 1, 1]),
        GROUPS_HEADER,
        f"1            {DIGEST[:12]}  NVIDIA H200  shared  mm  {added}      {replaced}         "
        f"{removed}        1          1",
        "conflicts (1):",
        f"  1 shared {K16}: target 1; source 1 9; source 2 8; source 3 9; source 4 7 "
        f"-> {resolution}",
        f"total: {added} added, {replaced} replaced, {removed} removed, 1 identical, 1 conflicting",
        f"merged as commit 2: {added} added, {replaced} replaced, {removed} removed",
    ]
    expected = {(1, "shared", K32): 2, (1, "shared", K64): 5}
    if k16 is not None:
        expected[(1, "shared", K16)] = k16
    assert stored(cli) == expected
    [merge, _import] = commits(cli)
    assert (merge["kind"], merge["added"], merge["replaced"], merge["removed"]) == (
        "merge",
        added,
        replaced,
        removed,
    )
    assert merge["provenance"] == {
        "policy": policy,
        "sources": [
            {
                "source": str(p),
                "kind": "flashinfer",
                "digest": sha256(p),
                "entries": n,
                "records": 0,
            }
            for p, n in zip(sources, [3, 2, 1, 1], strict=True)
        ],
    }
    before = dump_db(registry_db)

    again = cli("merge", *sources, "--on-conflict", policy)

    assert again.exit_code == 0
    assert again.stdout.splitlines()[-1] == "nothing to change, no commit"
    assert dump_db(registry_db) == before


@pytest.mark.usefixtures("backend")
def test_fail_lists_the_conflicts_exits_1_and_changes_nothing(
    cli, sources: list[Path], registry_db: str, dump_db
) -> None:
    before = dump_db(registry_db)

    result = cli("merge", *sources, "--on-conflict", "fail")

    assert result.exit_code == 1
    assert result.stdout.splitlines() == [
        "merge plan (on conflict: fail, 4 source(s)):",
        *source_table(sources, [3, 2, 1, 1]),
        GROUPS_HEADER,
        f"1            {DIGEST[:12]}  NVIDIA H200  shared  mm  1      0         0        1          1",
        "conflicts (1):",
        f"  1 shared {K16}: target 1; source 1 9; source 2 8; source 3 9; source 4 7 -> unresolved",
        "total: 1 added, 0 replaced, 0 removed, 1 identical, 1 conflicting",
    ]
    assert result.stderr == (
        "error: 1 conflicting entries; nothing merged; choose how to resolve them with "
        "--on-conflict keep|theirs|newest|vote|drop\n"
    )
    assert dump_db(registry_db) == before

    as_json = cli("merge", *sources, "--on-conflict", "fail", "--format", "json")

    assert as_json.exit_code == 1
    report = json.loads(as_json.stdout)
    assert (report["commit"], report["totals"]["conflicting"]) == (None, 1)
    assert [c["resolution"] for c in report["conflicts"]] == ["unresolved"]
    assert dump_db(registry_db) == before


def test_fail_without_conflicts_merges(cli, cache_file, target) -> None:
    new = flashinfer_file(cache_file, "new.json", {K64: 5, K32: 2}, time.time())

    result = cli("merge", new, "--on-conflict", "fail")

    assert result.exit_code == 0
    assert result.stdout.splitlines()[-1] == "merged as commit 2: 1 added, 0 replaced, 0 removed"


@pytest.mark.usefixtures("backend")
def test_an_entry_dropped_by_a_merge_stays_dropped_when_one_source_brings_it_again(
    cli, cache_file, target, registry_db: str, dump_db
) -> None:
    """A merge's removal is a tombstone: merging the one source whose K16 (9) conflicted
    with the target's (1) again finds no K16 stored, yet its 9 still conflicts with the
    removed 1 and is dropped again; a source bringing back the removed value agrees."""
    source = flashinfer_file(cache_file, "s.json", {K16: 9}, time.time())

    dropped = cli("merge", source, "--on-conflict", "drop")

    assert dropped.stdout.splitlines()[-1] == "merged as commit 2: 0 added, 0 replaced, 1 removed"
    assert (1, "shared", K16) not in stored(cli)
    before = dump_db(registry_db)

    again = cli("merge", source, "--on-conflict", "drop", "--format", "json")

    report = json.loads(again.stdout)
    assert report["commit"] is None
    assert [(c["key"], c["target"]["tactic"], c["resolution"]) for c in report["conflicts"]] == [
        (K16, 1, "dropped")
    ]
    assert dump_db(registry_db) == before
    removed_value = flashinfer_file(cache_file, "back.json", {K16: 1}, time.time())
    back = cli("merge", removed_value, "--on-conflict", "drop")
    assert back.stdout.splitlines()[-1] == "merged as commit 3: 1 added, 0 replaced, 0 removed"
    assert stored(cli)[(1, "shared", K16)] == 1


def test_newest_keeps_the_target_when_a_source_was_tuned_at_the_same_time(
    cli, cache_file, registry_db: str
) -> None:
    """``newest`` on a tie between the registry's value and a source's: the registry's,
    the earlier one, wins (a tie among sources goes to the first: ``sources only`` below)."""
    at = 1_700_000_000.0
    assert cli("import", flashinfer_file(cache_file, "t.json", {K16: 1}, at)).exit_code == 0
    tied = flashinfer_file(cache_file, "s.json", {K16: 2, K32: 3}, at)
    later = flashinfer_file(cache_file, "l.json", {K32: 4}, at + 1)

    result = cli("merge", tied, later, "--on-conflict", "newest", "--format", "json")

    report = json.loads(result.stdout)
    assert sorted((c["key"], c["resolution"]) for c in report["conflicts"]) == [
        (K16, "target"),  # tied with the registry's: the registry's stays
        (K32, "source 2"),  # the later of two sources wins
    ]
    assert stored(cli) == {(1, "shared", K16): 1, (1, "shared", K32): 4}


@pytest.mark.parametrize(
    ("policy", "k16", "resolution"),
    [
        ("keep", 3, "source 1"),  # no target value: the first source
        ("theirs", 2, "source 5"),  # the last source
        ("newest", 2, "source 3"),  # sources 3 and 5 are the newest: the first of them
        ("vote", 1, "source 2"),  # 1 and 2 tie with two votes: the first source holding one
        ("drop", None, "dropped"),
    ],
)
def test_conflicts_among_sources_only(
    cli, cache_file, policy: str, k16: int | None, resolution: str
) -> None:
    now = time.time()
    files = [
        flashinfer_file(cache_file, "a.json", {K16: 3}, now - 50),
        flashinfer_file(cache_file, "b.json", {K16: 1}, now - 100),
        flashinfer_file(cache_file, "c.json", {K16: 2}, now),
        flashinfer_file(cache_file, "d.json", {K16: 1}, now - 200),
        flashinfer_file(cache_file, "e.json", {K16: 2, K32: 4}, now),
    ]

    result = cli("merge", *files, "--on-conflict", policy, "--format", "json")

    assert result.exit_code == 0
    report = json.loads(result.stdout)
    assert [(c["target"], c["resolution"]) for c in report["conflicts"]] == [(None, resolution)]
    assert [(s["source"], s["tactic"]) for s in report["conflicts"][0]["sources"]] == [
        (1, 3),
        (2, 1),
        (3, 2),
        (4, 1),
        (5, 2),
    ]
    expected = {(1, "shared", K32): 4}
    if k16 is not None:
        expected[(1, "shared", K16)] = k16
    assert stored(cli) == expected
    again = cli("merge", *files, "--on-conflict", policy)
    assert again.stdout.splitlines()[-1] == "nothing to change, no commit"


def test_vote_tie_keeps_the_target(cli, cache_file, target) -> None:
    now = time.time()
    a = flashinfer_file(cache_file, "a.json", {K16: 5}, now)
    b = flashinfer_file(cache_file, "b.json", {K16: 6}, now)

    result = cli("merge", a, b, "--on-conflict", "vote")

    assert result.stdout.splitlines()[-3:] == [
        f"  1 shared {K16}: target 1; source 1 5; source 2 6 -> target",
        "total: 0 added, 0 replaced, 0 removed, 0 identical, 1 conflicting",
        "nothing to change, no commit",
    ]
    assert stored(cli)[(1, "shared", K16)] == 1


def test_newest_keeps_a_newer_target(cli, cache_file, target) -> None:
    old = flashinfer_file(cache_file, "old.json", {K16: 5}, time.time() - 86400)

    result = cli("merge", old, "--on-conflict", "newest")

    assert result.stdout.splitlines()[-1] == "nothing to change, no commit"
    assert stored(cli)[(1, "shared", K16)] == 1


def test_default_policy_is_keep(cli, sources: list[Path]) -> None:
    result = cli("merge", *sources, "--format", "json")

    assert json.loads(result.stdout)["policy"] == "keep"
    assert stored(cli)[(1, "shared", K16)] == 1


def test_the_cli_offers_every_library_policy() -> None:
    from ficache.cli import MERGE_POLICIES

    assert MERGE_POLICIES == POLICIES


def test_an_unknown_policy_is_a_usage_error(cli, sources: list[Path]) -> None:
    result = cli("merge", *sources, "--on-conflict", "mine")

    assert result.exit_code == 2
    assert "Invalid value for '--on-conflict'" in result.output


# -- what never conflicts ------------------------------------------------------------------


@pytest.mark.usefixtures("backend")
def test_other_fingerprints_never_conflict(cli, cache_file, target) -> None:
    b200 = flashinfer_file(cache_file, "b200.json", {K16: 9, ATTN: 3}, time.time(), meta=B200)

    result = cli("merge", b200, "--on-conflict", "fail")

    assert result.exit_code == 0
    assert result.stdout.splitlines()[3:] == [
        "fingerprint  digest        gpu          scope   op    added  replaced  removed  "
        "identical  conflicting",
        f"new          {B200_FP.digest[:12]}  NVIDIA B200  shared  attn  1      0         0        "
        "0          0",
        f"new          {B200_FP.digest[:12]}  NVIDIA B200  shared  mm    1      0         0        "
        "0          0",
        "total: 2 added, 0 replaced, 0 removed, 0 identical, 0 conflicting",
        "merged as commit 2: 2 added, 0 replaced, 0 removed",
    ]
    assert stored(cli) == {
        (1, "shared", K16): 1,
        (1, "shared", K32): 2,
        (2, "shared", ATTN): 3,
        (2, "shared", K16): 9,
    }


@pytest.mark.usefixtures("backend")
def test_scopes_are_kept_and_never_overwrite_each_other(
    cli, cache_file, target, tmp_path: Path
) -> None:
    # The target also holds a tp2/rank1 K16.
    cli("import", cache_file("r1.json", {K16: ["Runner", 3]}, META), "--scope", "tp2/rank1")
    other = tmp_path / "other.db"
    for scope, value in (("shared", 9), ("tp2/rank0", 4), ("tp2/rank1", 3)):
        path = cache_file(f"o-{value}.json", {K16: ["Runner", value]}, META)
        assert cli("import", path, "--scope", scope, db=other).exit_code == 0

    result = cli("merge", other, "--on-conflict", "theirs")

    assert result.exit_code == 0
    assert result.stdout.splitlines()[3:] == [
        "fingerprint  digest        gpu          scope      op  added  replaced  removed  "
        "identical  conflicting",
        f"1            {DIGEST[:12]}  NVIDIA H200  shared     mm  0      1         0        "
        "0          1",
        f"1            {DIGEST[:12]}  NVIDIA H200  tp2/rank0  mm  1      0         0        "
        "0          0",
        f"1            {DIGEST[:12]}  NVIDIA H200  tp2/rank1  mm  0      0         0        "
        "1          0",
        "conflicts (1):",
        f"  1 shared {K16}: target 1; source 1 9 -> source 1",
        "total: 1 added, 1 replaced, 0 removed, 1 identical, 1 conflicting",
        "merged as commit 3: 1 added, 1 replaced, 0 removed",
    ]
    report = json.loads(cli("merge", other, "--on-conflict", "theirs", "--format", "json").stdout)
    assert [(g["scope"], g["added"], g["replaced"], g["identical"]) for g in report["groups"]] == [
        ("shared", 0, 0, 1),
        ("tp2/rank0", 0, 0, 1),
        ("tp2/rank1", 0, 0, 1),
    ]
    assert stored(cli) == {
        (1, "shared", K16): 9,
        (1, "shared", K32): 2,
        (1, "tp2/rank0", K16): 4,
        (1, "tp2/rank1", K16): 3,
    }


# -- registry and bundle sources --------------------------------------------------------------


def _write_registry(path: Path, batches: list[list[NewEntry]]) -> None:
    with Registry.open(str(path)) as reg:
        for batch in batches:
            reg.write(batch, kind="import")


def test_a_registry_source_is_named_by_the_digest_of_its_content(
    cli, target, tmp_path: Path
) -> None:
    e16 = NewEntry(H200_FP, K16, "Runner", "9", tuned_at=1000.0)
    e64 = NewEntry(H200_FP, K64, "Runner", "5", scope="tp2/rank0", tuned_at=2000.0)
    one, two = tmp_path / "one.db", tmp_path / "two.db"
    _write_registry(one, [[e16, e64]])
    _write_registry(two, [[e64], [e16]])  # the same content, another history

    first = cli("merge", one, "--dry-run", "--format", "json")
    second = cli("merge", f"sqlite:///{two}", "--dry-run", "--format", "json")

    [s1] = json.loads(first.stdout)["sources"]
    [s2] = json.loads(second.stdout)["sources"]
    assert s1 == {
        "source": str(one),
        "kind": "registry",
        "digest": registry_digest([e16, e64]),
        "entries": 2,
        "records": 0,
    }
    assert (s2["source"], s2["digest"]) == (str(two), s1["digest"])
    assert len(s1["digest"]) == 64


def test_a_registry_source_keeps_tuned_at_and_is_never_written(
    cli, target, tmp_path: Path, registry_db: str
) -> None:
    other = tmp_path / "other.db"
    _write_registry(other, [[NewEntry(H200_FP, K64, "Runner", "5", tuned_at=1234.5)]])
    before = other.read_bytes()

    result = cli("merge", other)

    assert result.stdout.splitlines()[-1] == "merged as commit 2: 1 added, 0 replaced, 0 removed"
    assert other.read_bytes() == before
    with Registry.open(registry_db) as reg:
        [row] = [r for r in reg.entry_values([1]) if r[2] == K64]
    assert row[6] == 1234.5  # tuned_at


def test_a_bundle_source_keeps_scope_and_tuned_at(cli, target, tmp_path: Path) -> None:
    from ficache.bundle import render_bundle

    bundle = tmp_path / "fleet.bundle"
    bundle.write_bytes(
        render_bundle(
            [
                NewEntry(H200_FP, K16, "Runner", "6", tuned_at=time.time() + 500),
                NewEntry(H200_FP, K64, "Runner", "5", scope="tp4/rank3", tuned_at=100.0),
            ]
        )
    )

    result = cli("merge", bundle, "--on-conflict", "newest", "--format", "json")

    report = json.loads(result.stdout)
    assert report["sources"] == [
        {
            "source": str(bundle),
            "kind": "bundle",
            "digest": sha256(bundle),
            "entries": 2,
            "records": 0,
        }
    ]
    assert [c["resolution"] for c in report["conflicts"]] == ["source 1"]
    assert stored(cli) == {
        (1, "shared", K16): 6,
        (1, "shared", K32): 2,
        (1, "tp4/rank3", K64): 5,
    }
    again = cli("merge", bundle, "--on-conflict", "newest")
    assert again.stdout.splitlines()[-1] == "nothing to change, no commit"


def test_files_registries_and_bundles_in_one_merge(cli, cache_file, target, tmp_path: Path):
    from ficache.bundle import render_bundle

    other = tmp_path / "other.db"
    _write_registry(other, [[NewEntry(H200_FP, K64, "Runner", "5", tuned_at=10.0)]])
    bundle = tmp_path / "b.bundle"
    bundle.write_bytes(render_bundle([NewEntry(B200_FP, K16, "Runner", "3", tuned_at=20.0)]))
    flash = flashinfer_file(cache_file, "f.json", {ATTN: 1}, time.time())

    result = cli("merge", flash, other, bundle)

    assert result.exit_code == 0
    assert result.stdout.splitlines()[-1] == "merged as commit 2: 3 added, 0 replaced, 0 removed"
    [merge, _] = commits(cli)
    assert [s["kind"] for s in merge["provenance"]["sources"]] == [
        "flashinfer",
        "registry",
        "bundle",
    ]
    assert merge["message"] == f"merge (keep): {flash}, {other}, {bundle}"


# -- dry run, plans --------------------------------------------------------------------------


@pytest.mark.usefixtures("backend")
def test_dry_run_prints_the_plan_and_changes_nothing(
    cli, sources: list[Path], registry_db: str, dump_db
) -> None:
    before = dump_db(registry_db)

    result = cli("merge", *sources, "--on-conflict", "drop", "--dry-run")

    assert result.exit_code == 0
    assert result.stdout.splitlines()[-2:] == [
        "total: 1 added, 0 replaced, 1 removed, 1 identical, 1 conflicting",
        "dry run: nothing changed",
    ]
    assert dump_db(registry_db) == before
    as_json = json.loads(cli("merge", *sources, "--dry-run", "--format", "json").stdout)
    assert (as_json["dry_run"], as_json["commit"]) == (True, None)
    assert dump_db(registry_db) == before


def test_dry_run_never_creates_the_registry(cli, cache_file, registry_path: Path) -> None:
    path = flashinfer_file(cache_file, "a.json", {K16: 1}, time.time())

    result = cli("merge", path, "--dry-run", db=registry_path)

    one_error_line(
        result, f"no registry at {registry_path}; import a cache file first (ficache import FILE)"
    )
    assert not registry_path.exists()


def test_merge_creates_the_registry(cli, cache_file, registry_path: Path) -> None:
    path = flashinfer_file(cache_file, "a.json", {K16: 1}, time.time())

    result = cli("merge", path, db=registry_path)

    assert result.stdout.splitlines()[-1] == "merged as commit 1: 1 added, 0 replaced, 0 removed"


def test_the_json_report(cli, sources: list[Path], registry_path: Path) -> None:
    result = cli("merge", sources[0], "--on-conflict", "theirs", "--format", "json")

    report = json.loads(result.stdout)
    assert report.pop("target") == str(registry_path.resolve())
    assert report == {
        "policy": "theirs",
        "sources": [
            {
                "source": str(sources[0]),
                "kind": "flashinfer",
                "digest": sha256(sources[0]),
                "entries": 3,
                "records": 0,
            }
        ],
        "groups": [
            {
                "fingerprint": DIGEST,
                "fingerprint_id": 1,
                "gpu": "NVIDIA H200",
                "scope": "shared",
                "op": "mm",
                "added": 1,
                "replaced": 1,
                "removed": 0,
                "identical": 1,
                "conflicting": 1,
            }
        ],
        "totals": {"added": 1, "replaced": 1, "removed": 0, "identical": 1, "conflicting": 1},
        "conflicts": [
            {
                "fingerprint": DIGEST,
                "fingerprint_id": 1,
                "scope": "shared",
                "key": K16,
                "target": {"runner": "Runner", "tactic": 1, "policy": None},
                "sources": [{"source": 1, "runner": "Runner", "tactic": 9, "policy": None}],
                "resolution": "source 1",
            }
        ],
        "records": {
            "added": 0,
            "replaced": 0,
            "removed": 0,
            "identical": 0,
            "conflicting": 0,
            "conflicts": [],
        },
        "dry_run": False,
        "commit": 2,
    }


def test_plans_compare_equal_and_execute_as_planned(
    sources: list[Path], target, registry_db: str
) -> None:
    opened = [open_source(str(p)) for p in sources]
    with Registry.open(registry_db) as reg:
        plan = plan_merge(reg, opened, "newest")
        assert plan == plan_merge(reg, [open_source(str(p)) for p in sources], "newest")
        assert plan != plan_merge(reg, opened, "theirs")
        assert (plan.added, plan.replaced, plan.removed, plan.identical, plan.conflicting) == (
            1,
            1,
            0,
            1,
            1,
        )

        result = plan.execute(reg)

        assert (result.added, result.replaced, result.removed) == (1, 1, 0)
        assert plan_merge(reg, opened, "newest").is_empty


def test_a_plan_is_refused_when_the_registry_changed_since(
    cli, cache_file, sources: list[Path], registry_db: str, dump_db
) -> None:
    opened = [open_source(str(p)) for p in sources]
    with Registry.open(registry_db) as reg:
        plan = plan_merge(reg, opened, "theirs")
        # Someone else writes K16 between the plan and its execution.
        cli("import", cache_file("late.json", {K16: ["Runner", 42]}, META))
        before = dump_db(registry_db)

        with pytest.raises(ConflictError) as raised:
            plan.execute(reg)

    assert str(raised.value) == (
        "1 of 2 entries changed since the plan was made; nothing written, run the command again"
    )
    assert dump_db(registry_db) == before
    assert stored(cli)[(1, "shared", K16)] == 42


@pytest.mark.usefixtures("backend")
def test_a_merge_that_lost_the_race_plans_again_and_ends_as_if_run_after(
    cli, cache_file, sources: list[Path], registry_db: str, tmp_path: Path
) -> None:
    """``merge_sources`` (what ``ficache merge`` runs): a first plan gone stale under another
    writer's commit writes nothing, and the merge is planned again on the registry as it is
    now, ending exactly where the same merge run after that commit ends."""
    late = cache_file("late.json", {K16: ["Runner", 42]}, META)
    opened = [open_source(str(p)) for p in sources]
    with Registry.open(registry_db) as reg:
        stale = plan_merge(reg, opened, "theirs")
        assert cli("import", late).exit_code == 0  # another writer, between plan and write
        with pytest.raises(StalePlanError):
            stale.execute(reg)

        plan, result = merge_sources(reg, opened, "theirs", first_plan=stale)

    assert plan != stale and result is not None and result.commit_id == 3
    after = stored(cli)
    sequential = str(tmp_path / "sequential.db")
    for argv in (
        ["import", str(tmp_path / "t.json")],  # the target's commit 1
        ["import", str(late)],
        ["merge", *map(str, sources), "--on-conflict", "theirs"],
    ):
        assert cli(*argv, db=sequential).exit_code == 0
    assert after == stored(functools.partial(cli, db=sequential))
    assert (
        after[(1, "shared", K64)] == 5 and len(commits(functools.partial(cli, db=sequential))) == 3
    )


def test_a_merge_that_keeps_losing_gives_up_after_its_attempts(
    cli, cache_file, sources: list[Path], registry_db: str, dump_db
) -> None:
    opened = [open_source(str(p)) for p in sources]
    with Registry.open(registry_db) as reg:
        stale = plan_merge(reg, opened, "theirs")
        assert cli("import", cache_file("late.json", {K16: ["Runner", 42]}, META)).exit_code == 0
        before = dump_db(registry_db)

        with pytest.raises(StalePlanError, match="changed since the plan was made"):
            merge_sources(reg, opened, "theirs", attempts=1, first_plan=stale)

    assert dump_db(registry_db) == before


def test_a_plan_is_refused_when_the_entries_it_was_made_against_are_gone(
    cli, sources: list[Path], registry_db: str, dump_db
) -> None:
    opened = [open_source(str(p)) for p in sources]
    with Registry.open(registry_db) as reg:
        plan = plan_merge(reg, opened, "theirs")  # replaces K16, keeps K32, adds K64
        # Someone prunes every stored entry between the plan and its execution.
        assert cli("prune", "--fingerprint", "1", "--yes").exit_code == 0
        before = dump_db(registry_db)

        with pytest.raises(ConflictError) as raised:
            plan.execute(reg)

    assert str(raised.value) == (
        "1 of 2 entries changed since the plan was made; nothing written, run the command again"
    )
    assert dump_db(registry_db) == before


def test_a_refused_plan_raises_before_writing(sources: list[Path], target, registry_db: str):
    with Registry.open(registry_db) as reg:
        plan = plan_merge(reg, [open_source(str(p)) for p in sources], "fail")
        assert plan.refused
        with pytest.raises(MergeConflictError):
            plan.execute(reg)
        assert len(reg.log()) == 1


# -- progress -------------------------------------------------------------------------------


# -- large merges: a summary by default, everything with --verbose or JSON -------------------

ALL = "--verbose or --format json for all"


def sources_of_3(paths: list[Path]) -> list[str]:
    """The plan's source table for ``paths`` of 3 entries each (any source numbers)."""
    return [
        "source  kind        entries  sha256        name",
        *(f"{n:<6}  flashinfer  3        {sha256(p)[:12]}  {p}" for n, p in enumerate(paths, 1)),
    ]


def test_a_200_source_plan_is_summarised_and_verbose_lists_all(
    cli, cache_file, target, registry_path: Path, dump_db
) -> None:
    """K16: five values over 200 sources against the target's 1; K32 as the target;
    K64: two values, new to the target."""
    now = time.time()
    paths = [
        flashinfer_file(cache_file, f"s{i:03}.json", {K16: 5 + i % 5, K32: 2, K64: i % 2}, now)
        for i in range(1, 201)
    ]
    before = dump_db(registry_path)

    summary = cli("merge", "--dry-run", *paths)

    assert (summary.exit_code, summary.stderr) == (0, "")
    assert summary.stdout.splitlines() == [
        "merge plan (on conflict: keep, 200 source(s)):",
        *sources_of_3(paths[:10]),
        f"  ... 190 more source(s); {ALL}",
        GROUPS_HEADER,
        f"1            {DIGEST[:12]}  NVIDIA H200  shared  mm  1      0         0        1          2",
        "conflicts (2):",
        f"  1 shared {K16}: target 1; 200 sources hold 5 value(s): 6 (source 1 and 39 more), "
        "7 (source 2 and 39 more), 8 (source 3 and 39 more), 2 more value(s) -> target",
        f"  1 shared {K64}: 200 sources hold 2 value(s): 1 (source 1 and 99 more), "
        "0 (source 2 and 99 more) -> source 1",
        "total: 1 added, 0 replaced, 0 removed, 1 identical, 2 conflicting",
        "dry run: nothing changed",
    ]

    verbose = cli("merge", "--dry-run", "--verbose", *paths)
    lines = verbose.stdout.splitlines()
    assert (verbose.exit_code, len(lines)) == (0, 1 + 201 + 2 + 1 + 2 + 2)
    assert lines[1:202] == sources_of_3(paths)
    assert lines[-4] == (
        f"  1 shared {K16}: target 1; "
        + "; ".join(f"source {i} {5 + i % 5}" for i in range(1, 201))
        + " -> target"
    )
    assert cli("merge", "--dry-run", "-v", *paths).stdout == verbose.stdout

    as_json = json.loads(cli("merge", "--dry-run", "--format", "json", *paths).stdout)
    assert [len(c["sources"]) for c in as_json["conflicts"]] == [200, 200]
    assert len(as_json["sources"]) == 200
    assert dump_db(registry_path) == before


def test_many_groups_are_summed_per_op(cli, cache_file, target) -> None:
    """25 GPUs, two ops each: 50 (fingerprint, scope, op) groups, shown as one row per op."""
    now = time.time()
    paths = [
        flashinfer_file(
            cache_file, f"g{i:02}.json", {K16: 3, ATTN: 4}, now, meta={**META, "gpu": f"GPU {i}"}
        )
        for i in range(25)
    ]

    summary = cli("merge", "--dry-run", *paths)

    assert summary.exit_code == 0
    assert summary.stdout.splitlines()[12:] == [
        f"  ... 15 more source(s); {ALL}",
        "op    groups  added  replaced  removed  identical  conflicting",
        "attn  25      25     0         0        0          0",
        "mm    25      25     0         0        0          0",
        f"  (50 fingerprint/scope/op groups in 25 fingerprint(s); {ALL})",
        "total: 50 added, 0 replaced, 0 removed, 0 identical, 0 conflicting",
        "dry run: nothing changed",
    ]
    verbose = cli("merge", "--dry-run", "--verbose", *paths).stdout.splitlines()
    assert len(verbose) == 1 + 26 + 51 + 2
    assert sorted(line.split()[5] for line in verbose[28:78]) == ["attn"] * 25 + ["mm"] * 25


def test_piped_output_has_no_progress(cli, cache_file, registry_path: Path, created_note) -> None:
    paths = [
        flashinfer_file(cache_file, f"p{i}.json", {K16: 1, K32: 2}, time.time()) for i in range(6)
    ]

    merged = cli("merge", *paths)
    imported = cli("import", *paths)

    assert merged.stderr == created_note(registry_path)
    assert "reading" not in merged.stdout
    assert merged.stdout.startswith("merge plan (on conflict: keep, 6 source(s)):\n")
    assert (imported.stdout, imported.stderr) == (
        "imported 12 entries from 6 file(s): 0 added, 0 replaced, 2 unchanged, "
        "10 duplicates, 0 conflicts (nothing new, no commit)\n",
        "",
    )


def test_a_terminal_shows_progress_for_many_sources(cache_file, tmp_path: Path) -> None:
    paths = [
        str(flashinfer_file(cache_file, f"p{i}.json", {K16: 1}, time.time())) for i in range(5)
    ]
    db = str(tmp_path / "tty.db")

    merged_status, merged = run_in_a_terminal(["--db", db, "merge", *paths])
    imported_status, imported = run_in_a_terminal(["--db", db, "import", *paths])

    assert (merged_status, imported_status) == (0, 0)
    assert "reading sources" in merged
    assert "merged as commit 1: 1 added, 0 replaced, 0 removed" in merged
    assert "reading files" in imported


# -- damaged sources: one line, exit 1, the registry unchanged ----------------------------


def _truncated_json(tmp: Path) -> tuple[Path, str]:
    path = tmp / "truncated.json"
    path.write_text(json.dumps({"_metadata": META, K16: ["Runner", 1]})[:-9])
    try:
        json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        detail = str(exc)
    return path, (
        f"{path}: invalid JSON ({detail}); the file is truncated or not a FlashInfer cache"
    )


def _corrupt_json(tmp: Path) -> tuple[Path, str]:
    path = tmp / "corrupt.json"
    path.write_text(json.dumps({"_metadata": META, K16: ["Runner", {"tile": 1}]}))
    return path, (
        f"{path}: 1 of 1 entries invalid, nothing imported; first: {K16!r}: tactic holds a dict; "
        "expected numbers and lists"
    )


def _no_metadata(tmp: Path) -> tuple[Path, str]:
    path = tmp / "bare.json"
    path.write_text(json.dumps({K16: ["Runner", 1]}))
    return path, (
        f"{path} has no _metadata, so its environment is unknown; "
        "import it with `ficache import --fingerprint ID|current` instead"
    )


def _truncated_bundle(tmp: Path) -> tuple[Path, str]:
    from ficache.bundle import render_bundle

    data = render_bundle([NewEntry(H200_FP, K16, "Runner", "1", tuned_at=1.0)])
    path = tmp / "cut.bundle"
    path.write_bytes(data[:-20])
    payload = len(data) - data.index(b"\n") - 1
    return path, (
        f"{path}: truncated bundle ({payload - 20} of {payload} payload bytes); "
        "copy it again or export it again with `ficache export --bundle`"
    )


def _registry_file(tmp: Path, name: str) -> Path:
    path = tmp / name
    _write_registry(path, [[NewEntry(H200_FP, K64, "Runner", "5", tuned_at=1.0)]])
    return path


def _newer_schema(tmp: Path) -> tuple[Path, str]:
    path = _registry_file(tmp, "newer.db")
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("UPDATE alembic_version SET version_num = '0099_future'")
    from ficache.schema import head_revision

    return path, (
        f"registry {path} has schema revision '0099_future', newer than this ficache knows "
        f"(head {head_revision()!r}); upgrade ficache (pip install -U ficache)"
    )


def _older_schema(tmp: Path) -> tuple[Path, str]:
    from ficache.schema import head_revision

    path = tmp / "older.db"
    shutil.copy(DATA / "registry-0001_registry.db", path)
    return path, (
        f"source registry {path} is at schema revision '0001_registry', older than "
        f"{head_revision()!r}; upgrade it first (ficache --db {path} db upgrade)"
    )


def _truncated_registry(tmp: Path) -> tuple[Path, str]:
    full = _registry_file(tmp, "full.db")
    path = tmp / "cut.db"
    path.write_bytes(full.read_bytes()[:3000])
    return path, (
        f"registry {path} is corrupt (database disk image is malformed); "
        "restore it or pass another --db"
    )


def _foreign_database(tmp: Path) -> tuple[Path, str]:
    path = tmp / "foreign.db"
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("CREATE TABLE notes (text)")
    return path, f"{path} is a database but not a ficache registry; nothing merged"


def _directory(tmp: Path) -> tuple[Path, str]:
    path = tmp / "a-directory"
    path.mkdir()
    return path, f"{path}: is a directory, expected a registry, a FlashInfer cache file or a bundle"


def _missing(tmp: Path) -> tuple[Path, str]:
    return tmp / "nope.json", f"{tmp / 'nope.json'}: no such file"


DAMAGED = {
    "truncated-json": _truncated_json,
    "corrupt-json": _corrupt_json,
    "no-metadata": _no_metadata,
    "truncated-bundle": _truncated_bundle,
    "newer-schema": _newer_schema,
    "older-schema": _older_schema,
    "truncated-registry": _truncated_registry,
    "foreign-database": _foreign_database,
    "directory": _directory,
    "missing": _missing,
}


@pytest.mark.parametrize("name", list(DAMAGED))
def test_a_damaged_source_is_one_error_and_changes_nothing(
    cli, cache_file, target, registry_db: str, dump_db, tmp_path: Path, name: str
) -> None:
    good = flashinfer_file(cache_file, "good.json", {K64: 5}, time.time())
    bad, message = DAMAGED[name](tmp_path)
    bad_before = bad.read_bytes() if bad.is_file() else None
    before = dump_db(registry_db)

    result = cli("merge", good, bad)

    assert (result.exit_code, result.stdout, result.stderr) == (1, "", f"error: {message}\n")
    assert dump_db(registry_db) == before
    if bad_before is not None:
        assert bad.read_bytes() == bad_before  # a source is never written, not even upgraded


def test_a_read_only_registry_is_refused(cli, sources: list[Path], registry_db: str, dump_db):
    before = dump_db(registry_db)
    Path(registry_db).chmod(0o444)

    result = cli("merge", *sources)

    one_error_line(result, f"registry {registry_db} is read-only; pass a writable --db")
    assert dump_db(registry_db) == before
    assert cli("merge", *sources, "--dry-run").exit_code == 0


# -- Registry.write's removals, the one write path a merge uses ------------------------------


def test_registry_write_removes_in_the_same_commit(registry_db: str) -> None:
    from ficache.history import EntryChange, EntryValue, commit_details

    with Registry.open(registry_db) as reg:
        reg.write(
            [
                NewEntry(H200_FP, K16, "Runner", "1", tuned_at=5.0),
                NewEntry(H200_FP, K32, "Runner", "2", scope="tp2/rank0"),
            ],
            kind="import",
        )

        result = reg.write(
            [NewEntry(H200_FP, K64, "Runner", "3")],
            kind="merge",
            removals=[
                (H200_FP, "shared", K16),
                (H200_FP, "shared", K32),  # absent: skipped
                (B200_FP, "shared", K16),  # an unknown fingerprint: skipped, never created
            ],
        )

        assert (result.commit_id, result.added, result.removed) == (2, 1, 1)
        assert [(e.scope, e.key) for e in reg.entries()] == [("shared", K64), ("tp2/rank0", K32)]
        assert [i.fingerprint for i in reg.fingerprints()] == [H200_FP]
        assert commit_details(reg, 2).changes == (
            EntryChange("removed", 1, "shared", K16, EntryValue("Runner", "1"), None, 1, 5.0),
            EntryChange("added", 1, "shared", K64, None, EntryValue("Runner", "3"), None, None),
        )
        assert reg.log(1)[0].removed == 1
        assert reg.write([], kind="merge", removals=[(H200_FP, "shared", K16)]).commit_id is None
        with pytest.raises(ValueError, match="both written and removed"):
            reg.write(
                [NewEntry(H200_FP, K64, "Runner", "4")],
                kind="merge",
                removals=[(H200_FP, "shared", K64)],
            )


def test_a_drop_plan_keeps_the_tombstones_of_its_candidates_only(registry_db: str) -> None:
    """``drop`` reads a merge's removals as tombstones; it keeps those of the identities
    its sources hold, as for entries, so planning one record against a long history of
    removed records holds no copy of that history (20,000 tombstones held cost 9 MB)."""
    import tracemalloc

    from ficache.merge import MergeSource
    from ficache.records import NewRecord, RecordWrite

    removed = [NewRecord(H200_FP, "ns", f"key-{i:06d}", "1") for i in range(20_000)]
    source = MergeSource("s", "flashinfer", "", (), (NewRecord(H200_FP, "ns", "key-000000", "2"),))
    with Registry.open(registry_db) as reg:
        reg.write([], kind="import", records=removed)
        reg.write(
            [], kind="merge", records=RecordWrite(removals=tuple(r.identity for r in removed))
        )
        plan_merge(reg, [source], "drop")  # statements compiled and cached outside the trace
        tracemalloc.start()
        try:
            plan = plan_merge(reg, [source], "drop")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    [conflict] = plan.records.conflicts
    assert (conflict.key, conflict.target, conflict.resolution) == ("key-000000", "1", "dropped")
    assert peak < 2_000_000  # the one candidate's plan, far below the history's size


# -- one tuned_at rule for every ingest path -------------------------------------

RECORDS = {"_records": {"trtllm_moe_da": {"bucket8": {"tiles": [1, 2]}}}}


def tuned_times(db: Path) -> dict[tuple[str, str], float]:
    """``(namespace or "entry", key) -> tuned_at`` of every entry and record in ``db``."""
    with closing(sqlite3.connect(db)) as conn:
        rows = conn.execute(
            "SELECT 'entry', key, tuned_at FROM entries "
            "UNION ALL SELECT namespace, key, tuned_at FROM records"
        ).fetchall()
    return {(kind, key): at for kind, key, at in rows}


def test_a_file_is_dated_by_its_mtime_through_import_and_merge(
    cli, cache_file, tmp_path: Path
) -> None:
    """The same FlashInfer file, imported into one registry and merged into another:
    its entries and records are dated by the file's mtime both ways (import made them "now")."""
    path = cache_file("a.json", {K16: ["Runner", 1], **RECORDS}, META)
    os.utime(path, (1000.0, 1000.0))
    imported, merged = tmp_path / "imported.db", tmp_path / "merged.db"

    assert cli("import", path, db=imported).exit_code == 0
    assert cli("merge", path, db=merged).exit_code == 0

    assert tuned_times(imported) == {("entry", K16): 1000.0, ("trtllm_moe_da", "bucket8"): 1000.0}
    assert tuned_times(merged) == tuned_times(imported)


@pytest.mark.parametrize("first", ["import", "merge"])
def test_newest_picks_the_same_value_whichever_path_brought_the_older_one(
    cli, cache_file, tmp_path: Path, first: str
) -> None:
    """An older file (mtime 1000) came in by ``first``; a newer one (mtime 2000) is merged
    with ``newest``: the newer value wins both ways (imported, the older one was "now")."""
    older = flashinfer_file(cache_file, "older.json", {K16: 1}, 1000.0)
    newer = flashinfer_file(cache_file, "newer.json", {K16: 2}, 2000.0)
    db = tmp_path / "target.db"
    assert cli(first, older, db=db).exit_code == 0

    result = cli("merge", newer, "--on-conflict", "newest", db=db)

    assert result.exit_code == 0, result.stderr
    listed = json.loads(cli("list", "--format", "json", db=db).stdout)
    assert [(r["key"], r["tactic"]) for r in listed] == [(K16, 2)]
    assert tuned_times(db) == {("entry", K16): 2000.0}


def test_a_bundle_dates_its_records_by_its_file_through_import_and_merge(
    cli, cache_file, tmp_path: Path
) -> None:
    """A bundle keeps its entries' tuned_at; its records carry none, so both ``import`` and
    ``merge`` date them by the bundle file's mtime (before: each path's own "now")."""
    path = cache_file("a.json", {K16: ["Runner", 1], **RECORDS}, META)
    os.utime(path, (1000.0, 1000.0))
    source, bundle = tmp_path / "source.db", tmp_path / "fleet.bundle"
    assert cli("import", path, db=source).exit_code == 0
    assert cli("export", "--bundle", bundle, "--all", db=source).exit_code == 0
    os.utime(bundle, (3000.0, 3000.0))
    imported, merged = tmp_path / "imported.db", tmp_path / "merged.db"

    assert cli("import", bundle, db=imported).exit_code == 0
    assert cli("merge", bundle, db=merged).exit_code == 0

    assert tuned_times(imported) == {("entry", K16): 1000.0, ("trtllm_moe_da", "bucket8"): 3000.0}
    assert tuned_times(merged) == tuned_times(imported)


# -- one place that says what a path is ------------------------------------------


def test_one_function_says_what_every_source_path_is(cli, cache_file, tmp_path: Path) -> None:
    """``ingest.recognise`` is what ``import`` and ``merge`` both dispatch on: a URL or a SQLite
    file is a registry, a bundle (even one cut inside its magic) a bundle, a v2 store root or
    environment directory a store, any other directory a directory, anything else (missing,
    unreadable, JSON or not) a FlashInfer file whose reading says what is wrong with it."""
    from ficache import ingest
    from ficache.bundle import MAGIC

    flash = flashinfer_file(cache_file, "a.json", {K16: 1}, 1000.0)
    registry = tmp_path / "other.db"
    assert cli("import", flash, db=registry).exit_code == 0
    bundle = tmp_path / "fleet.bundle"
    assert cli("export", "--bundle", bundle, "--all", db=registry).exit_code == 0
    cut = tmp_path / "cut.bundle"
    cut.write_bytes(MAGIC[:5])
    root = tmp_path / "autotune"
    env = root / "v2" / "0123456789abcdef"
    env.mkdir(parents=True)
    (env / "manifest.json").write_text("{}")
    plain = tmp_path / "plain"
    plain.mkdir()
    empty = tmp_path / "empty.json"
    empty.write_bytes(b"")

    kinds = {
        "postgresql+psycopg://u@h/db": ingest.REGISTRY,
        registry: ingest.REGISTRY,
        bundle: ingest.BUNDLE,
        cut: ingest.BUNDLE,
        root: ingest.V2_STORE,
        env: ingest.V2_STORE,
        plain: ingest.DIRECTORY,
        flash: ingest.FLASHINFER,
        empty: ingest.FLASHINFER,
        tmp_path / "missing.json": ingest.FLASHINFER,
        tmp_path / ("x" * 5000): ingest.FLASHINFER,  # a name too long to look up
    }
    assert {spec: ingest.recognise(spec) for spec in kinds} == kinds

    assert ingest.import_kind([flash, registry, empty]) == ingest.FLASHINFER
    assert ingest.import_kind([bundle, cut]) == ingest.BUNDLE
    assert ingest.import_kind([root, plain]) == ingest.V2_STORE
    with pytest.raises(ingest.MixedSourcesError, match="^import bundles and FlashInfer cache"):
        ingest.import_kind([flash, bundle])
    with pytest.raises(ingest.MixedSourcesError, match="^import v2 store directories and files"):
        ingest.import_kind([bundle, root])
