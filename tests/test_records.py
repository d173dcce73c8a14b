"""FlashInfer's namespaced records (``_records``) through ficache, end to end.

The real ``AutoTuner`` publishes and saves records, ``ficache import`` stores
them, ``ficache export`` writes them back, and a fresh ``load_configs`` reads
the same data through ``get_namespaced_records``. Records ride in commits
(``show``, ``revert``), bundles, merges under every policy, ``verify``, and
warm starts in one process and on two real gloo ranks. Hostile records are
refused with one line and leave the registry as it was. Tests marked
``@both_backends`` also run on PostgreSQL.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from flashinfer_072 import flashinfer_072_python

import ficache
from ficache._ranks import run_ranks
from ficache.errors import ConflictError, RecordError
from ficache.fingerprint import Fingerprint
from ficache.flashinfer_format import canonical_json
from ficache.records import NewRecord, records_of_map
from ficache.registry import Registry
from ficache.standin import standin_tune
from ficache.verify import verify

both_backends = pytest.mark.usefixtures("backend")

NS = "trtllm_moe_da"
#: Records shaped like FlashInfer's fused-MoE runtime's: compact sorted JSON keys,
#: objects whose members are not in sorted order, floats, nesting, unicode.
DA_KEY = '{"custom_op":"moe","num_tokens":16}'
DA_VALUE = {
    "schema": 1,
    "policy": "da",
    "exemplar_spectra": [[0.5, 1e-07, -0.0], [3.0, 2.5, 1.0]],
    "bodies": [{"tile_n": 8, "tactic": [1, [2, 3]]}],
    "note": "caf\u00e9",
}
OTHER = {"k": [1, 2.0, None, True], "big": 12345678901234567890}
K16 = "('mm', 'Runner', ((16, 64),), (torch.bfloat16,))"
META = {"gpu": "NVIDIA H200"}
FP = Fingerprint.from_flashinfer_metadata(META)


def stored(
    db: str, scope: str = "shared", fp: Fingerprint | None = FP
) -> dict[str, dict[str, Any]]:
    """The records one rank of ``scope`` loads for ``fp`` (default: the H200 files'; None: all)."""
    with Registry.open(db, create=False) as reg:
        ids = [i.id for i in reg.fingerprints() if fp is None or i.fingerprint == fp]
        found = reg.slice_records(ids, ["shared"] if scope == "shared" else ["shared", scope])
    return {ns: {k: json.loads(v) for k, v in by.items()} for ns, by in found.items()}


def records_file(cache_file, name: str, records: dict[str, Any], entries: bool = True) -> Path:
    return cache_file(
        name, {"_records": records, **({K16: ["Runner", 1]} if entries else {})}, metadata=META
    )


# -- the real AutoTuner, both FlashInfer versions ---------------------------------------


@both_backends
def test_save_import_export_load_returns_identical_records(
    cli, registry_db: str, autotuner: Any, tmp_path: Path, created_note: Any
) -> None:
    autotuner.publish_namespaced_records(NS, {DA_KEY: DA_VALUE})
    autotuner.publish_namespaced_records("other", OTHER)
    saved = tmp_path / "saved.json"
    autotuner.save_configs(str(saved))

    imported = cli("import", saved)
    exported = cli("export", "--fingerprint", "1", "-o", tmp_path / "out.json")
    autotuner.clear_cache()
    assert autotuner.get_namespaced_records(NS) == {}
    loaded = autotuner.load_configs(str(tmp_path / "out.json"))

    assert (imported.exit_code, imported.stderr) == (0, created_note(registry_db))
    assert imported.stdout == (
        "imported 0 entries and 3 records from 1 file(s): 0 added, 0 replaced, 0 unchanged; "
        "records 3 added, 0 replaced, 0 unchanged (commit 1)\n"
    )
    assert exported.exit_code == 0, exported.stderr
    assert loaded is True
    assert autotuner.get_namespaced_records(NS) == {DA_KEY: DA_VALUE}
    assert autotuner.get_namespaced_records("other") == OTHER
    saved_records = json.loads(saved.read_text())["_records"]
    out_records = json.loads((tmp_path / "out.json").read_text())["_records"]
    assert out_records == saved_records
    # Every value is the same JSON, byte for byte, in its canonical spelling
    # (1.0 stays 1.0, -0.0 stays -0.0, 20-digit integers stay integers).
    assert {
        ns: {k: canonical_json(v) for k, v in by.items()} for ns, by in out_records.items()
    } == {ns: {k: canonical_json(v) for k, v in by.items()} for ns, by in saved_records.items()}
    assert canonical_json(out_records["other"]["k"]) == "[1,2.0,null,true]"
    # Importing the export again changes nothing.
    again = cli("import", tmp_path / "out.json")
    assert again.stdout.endswith(
        "records 0 added, 0 replaced, 3 unchanged (nothing new, no commit)\n"
    )


_SAVE_072 = """
import sys
from flashinfer.autotuner import AutoTuner
t = AutoTuner.get()
t.publish_namespaced_records("trtllm_moe_da", {sys.argv[2]: {"schema": 1, "bodies": [{"tile_n": 8}]}})
t.save_configs(sys.argv[1])
"""
_LOAD_072 = """
import json, sys
from flashinfer.autotuner import AutoTuner
t = AutoTuner.get()
print(json.dumps([t.load_configs(sys.argv[1]), t.get_namespaced_records("trtllm_moe_da")]))
"""


def test_flashinfer_0_7_2_saves_what_ficache_stores_and_loads_what_it_exports(
    cli, tmp_path: Path
) -> None:
    python_072 = flashinfer_072_python()
    saved = tmp_path / "saved-072.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([python_072, "-c", _SAVE_072, saved, DA_KEY], check=True, env=env, timeout=300)
    version = subprocess.run(
        [python_072, "-c", "import flashinfer; print(flashinfer.__version__)"],
        check=True,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout.strip()

    assert cli("import", saved).exit_code == 0
    assert cli("export", "--fingerprint", "1", "-o", tmp_path / "out.json").exit_code == 0
    loaded = subprocess.run(
        [python_072, "-c", _LOAD_072, tmp_path / "out.json"],
        check=True,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )

    assert version == "0.7.2.post1"
    assert json.loads(loaded.stdout.splitlines()[-1]) == [
        True,
        {DA_KEY: {"schema": 1, "bodies": [{"tile_n": 8}]}},
    ]


# -- hostile records -----------------------------------------------------------------------


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


HOSTILE = {
    "NaN": ('{"_records": {"ns": {"k": NaN}}}', "invalid JSON (non-standard JSON constant NaN)"),
    "deep": (
        json.dumps({"_records": {"ns": {"k": _nested(40)}}}),
        "_records invalid, nothing imported: record 'ns'/'k': nested deeper than 32 levels",
    ),
    "very deep": (
        '{"_records": {"ns": {"k": ' + "[" * 100_000 + "]" * 100_000 + "}}}",
        "invalid JSON (nested too deeply)",
    ),
    "private namespace": (
        json.dumps({"_records": {"_private": {"k": 1}}}),
        "_records invalid, nothing imported: namespace '_private' is not a public identifier",
    ),
    "namespace not an object": (
        json.dumps({"_records": {"ns": [1]}}),
        "_records invalid, nothing imported: namespace 'ns' must be an object",
    ),
}


@both_backends
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_records_are_refused_in_one_line(
    cli, registry_db: str, cache_file, tmp_path: Path, dump_db, case: str
) -> None:
    assert cli("import", records_file(cache_file, "ok.json", {"ns": {"k": 1}})).exit_code == 0
    before = dump_db(registry_db)
    text, message = HOSTILE[case]
    path = tmp_path / "hostile.json"
    path.write_text(text)

    result = cli("import", path)

    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.startswith(f"error: {path}: ")
    assert message in result.stderr
    assert result.stderr.count("\n") == 1
    assert dump_db(registry_db) == before


def test_the_library_refuses_values_json_cannot_carry(tmp_path: Path, dump_db) -> None:
    db = str(tmp_path / "r.db")
    with Registry.open(db) as reg:
        reg.write([], kind="import", records=[NewRecord(FP, "ns", "k", "1")])
    before = dump_db(db)

    for value in ({1: 2}, {"k": float("nan")}, {"k": {1, 2}}, _nested(33)):
        with pytest.raises(ValueError):
            records_of_map(FP, {"ns": {"k": value}}, "shared")
    with Registry.open(db) as reg:
        for text in ('{"b":1,"a":2}', "NaN", "[" * 5000 + "]" * 5000, "1 "):
            with pytest.raises(RecordError):
                reg.write([], kind="import", records=[NewRecord(FP, "ns", "k", text)])
        with pytest.raises(RecordError, match="not a public identifier"):
            reg.write([], kind="import", records=[NewRecord(FP, "_ns", "k", "1")])
    assert dump_db(db) == before


# -- history: show and revert --------------------------------------------------------------


@both_backends
def test_show_lists_record_changes_and_revert_undoes_them(
    cli, registry_db: str, cache_file
) -> None:
    first = records_file(cache_file, "a.json", {"ns": {"a": 1, "b": [1]}})
    second = records_file(cache_file, "b.json", {"ns": {"a": 2, "c": "x"}}, entries=False)
    assert cli("import", first).exit_code == 0
    assert cli("import", second).exit_code == 0

    shown = cli("show", "2")
    log = cli("log")
    reverted = cli("revert", "2", "--yes")

    assert shown.stdout.splitlines()[2:4] == [
        "changes: 0 added, 0 replaced, 0 removed",
        "record changes: 1 added, 1 replaced, 0 removed",
    ]
    assert shown.stdout.splitlines()[-3:] == [
        "action    fingerprint  scope   namespace  key  old  new",
        "replaced  1            shared  ns         a    1    2",
        'added     1            shared  ns         c    -    "x"',
    ]
    assert json.loads(cli("show", "2", "--format", "json").stdout)["record_changes"] == [
        {
            "action": "replaced",
            "fingerprint": 1,
            "scope": "shared",
            "namespace": "ns",
            "key": "a",
            "old": 1,
            "new": 2,
            "old_commit": 1,
        },
        {
            "action": "added",
            "fingerprint": 1,
            "scope": "shared",
            "namespace": "ns",
            "key": "c",
            "old": None,
            "new": "x",
            "old_commit": None,
        },
    ]
    assert log.stdout.splitlines()[0].split() == [
        "commit", "when", "kind", "host", "added", "replaced", "removed", "records",
        "+/~/-", "world", "layout", "message",
    ]  # fmt: skip
    assert reverted.exit_code == 0, reverted.stderr
    assert reverted.stdout.splitlines() == [
        reverted.stdout.splitlines()[0],
        "reverted commit 2 as commit 3: 0 removed, 0 restored, 0 re-added; records 1 removed, "
        "1 restored, 0 re-added",
    ]
    assert reverted.stdout.startswith("revert plan: commit 2 (import, ")
    assert reverted.stdout.splitlines()[0].endswith(
        "remove 0 added, restore 0 replaced, restore 0 removed; records: remove 1 added, "
        "restore 1 replaced, restore 0 removed"
    )
    assert stored(registry_db) == {"ns": {"a": 1, "b": [1]}}
    assert verify(registry_db).ok


@both_backends
def test_revert_refuses_when_a_later_commit_changed_its_records(
    cli, registry_db: str, cache_file, dump_db
) -> None:
    assert cli("import", records_file(cache_file, "a.json", {"ns": {"a": 1}})).exit_code == 0
    later = records_file(cache_file, "b.json", {"ns": {"a": 2}}, entries=False)
    assert cli("import", later).exit_code == 0
    before = dump_db(registry_db)

    with Registry.open(registry_db) as reg, pytest.raises(ConflictError) as caught:
        reg.revert(1)
    result = cli("revert", "1", "--yes")
    dry = cli("revert", "1", "--dry-run")

    assert str(caught.value) == (
        "1 of 1 records of commit 1 changed in later commits; revert those first (ficache log)"
    )
    assert (result.exit_code, result.stderr) == (1, f"error: {caught.value}\n")
    assert (dry.exit_code, dry.stdout, dry.stderr) == (1, result.stdout, result.stderr)
    assert result.stdout.splitlines()[1:] == [
        "conflicts (changed by commit 2):",
        "kind    fingerprint  scope   namespace  key  commit did  changed by",
        "record  1            shared  ns         a    added       2",
    ]
    assert dump_db(registry_db) == before


@both_backends
def test_revert_dry_run_counts_entries_and_records_and_refuses_as_the_run(
    cli, registry_db: str, cache_file, dump_db
) -> None:
    """Later commits changed commit 1's entry and one of its records; the other was
    changed and changed back by a revert, which is no conflict (issue 35)."""
    assert (
        cli("import", records_file(cache_file, "a.json", {"ns": {"a": 1, "b": 2}})).exit_code == 0
    )
    later = records_file(cache_file, "b.json", {"ns": {"a": 3}}, entries=False)
    assert cli("import", later).exit_code == 0
    assert cli("revert", "2", "--yes").exit_code == 0  # commit 3 restores a=1
    later = cache_file("c.json", {"_records": {"ns": {"b": 4}}, K16: ["Runner", 7]}, metadata=META)
    assert cli("import", later).exit_code == 0
    before = dump_db(registry_db)

    dry = cli("revert", "1", "--dry-run", "--format", "json")
    run = cli("revert", "1", "--yes", "--format", "json")

    assert dry.exit_code == run.exit_code == 1
    assert dry.stderr == run.stderr
    plan = json.loads(dry.stdout)
    assert plan == {**json.loads(run.stdout), "dry_run": True}
    assert (plan["entries"], plan["records"]) == (
        {"remove": 1, "restore": 0, "re_add": 0},
        {"remove": 2, "restore": 0, "re_add": 0},
    )
    assert [(c["kind"], c["key"], c["changed_by"]) for c in plan["conflicts"]] == [
        ("entry", K16, 4),
        ("record", "b", 4),
    ]
    assert dry.stderr == (
        "error: 1 of 1 entries and 1 of 2 records of commit 1 changed in later commits; "
        "revert those first (ficache log)\n"
    )
    assert dump_db(registry_db) == before


# -- prune ---------------------------------------------------------------------------------

B200_META = {"gpu": "NVIDIA B200"}


def all_records(db: str) -> set[tuple[int, str, str, str, str]]:
    """``(fingerprint id, scope, namespace, key, value JSON)`` of every stored record."""
    from ficache.records import list_records

    with Registry.open(db, create=False) as reg:
        return {
            (r.fingerprint_id, r.scope, r.namespace, r.key, r.value_json) for r in list_records(reg)
        }


def all_entries(db: str) -> set[tuple[int, str, str]]:
    with Registry.open(db, create=False) as reg:
        return {(e.fingerprint_id, e.scope, e.key) for e in reg.entries()}


def prune_registry(cli, cache_file) -> None:
    """Fingerprint 1 (H200): one shared entry, shared records ns/a and ns/b, and record
    ns/a of scope tp2/rank1 (commits 1, 2); fingerprint 2 (B200): one entry, record ns/z
    (commit 3)."""
    assert cli("import", records_file(cache_file, "a.json", {"ns": {"a": 1, "b": [1]}}))
    rank = records_file(cache_file, "r.json", {"ns": {"a": 5}}, entries=False)
    assert cli("import", rank, "--scope", "tp2/rank1").exit_code == 0
    other = cache_file("b.json", {"_records": {"ns": {"z": 9}}, K16: ["Runner", 2]}, B200_META)
    assert cli("import", other).exit_code == 0


BEFORE_PRUNE = {
    (1, "shared", "ns", "a", "1"),
    (1, "shared", "ns", "b", "[1]"),
    (1, "tp2/rank1", "ns", "a", "5"),
    (2, "shared", "ns", "z", "9"),
}


@both_backends
def test_prune_of_a_fingerprint_removes_its_records_and_revert_restores_them(
    cli, registry_db: str, cache_file, dump_db
) -> None:
    prune_registry(cli, cache_file)
    before = dump_db(registry_db)

    dry = cli("prune", "--fingerprint", "1", "--dry-run")
    unchanged = dump_db(registry_db)
    pruned = cli("prune", "--fingerprint", "1", "--yes")
    after_prune = (all_entries(registry_db), all_records(registry_db))
    shown = json.loads(cli("show", "4", "--format", "json").stdout)
    reverted = cli("revert", "4", "--yes")

    assert (dry.exit_code, dry.stderr) == (0, "")
    assert dry.stdout.splitlines() == [
        "prune plan (fingerprint=1):",
        "fingerprint  gpu          flashinfer  scope      entries  records",
        "1            NVIDIA H200  -           shared     1        2",
        "1            NVIDIA H200  -           tp2/rank1  0        1",
        "1 entries and 3 records would be removed (revertible with `ficache revert`)",
        "dry run: nothing changed",
    ]
    assert unchanged == before
    assert (pruned.exit_code, pruned.stderr) == (0, "")
    assert pruned.stdout.splitlines()[-1] == "removed 1 entries and 3 records (commit 4)"
    assert after_prune == ({(2, "shared", K16)}, {(2, "shared", "ns", "z", "9")})
    assert (shown["commit"]["kind"], shown["commit"]["removed"]) == ("prune", 1)
    assert (shown["commit"]["records_added"], shown["commit"]["records_removed"]) == (0, 3)
    assert [
        (c["action"], c["fingerprint"], c["scope"], c["key"], c["old"], c["new"], c["old_commit"])
        for c in shown["record_changes"]
    ] == [
        ("removed", 1, "shared", "a", 1, None, 1),
        ("removed", 1, "shared", "b", [1], None, 1),
        ("removed", 1, "tp2/rank1", "a", 5, None, 2),
    ]
    assert reverted.exit_code == 0, reverted.stderr
    assert reverted.stdout.splitlines()[-1] == (
        "reverted commit 4 as commit 5: 0 removed, 0 restored, 1 re-added; records 0 removed, "
        "0 restored, 3 re-added"
    )
    assert all_entries(registry_db) == {(1, "shared", K16), (2, "shared", K16)}
    assert all_records(registry_db) == BEFORE_PRUNE
    assert stored(registry_db, "tp2/rank1") == {"ns": {"a": 5, "b": [1]}}
    assert verify(registry_db).ok


@both_backends
def test_prune_by_scope_removes_only_that_scopes_records(cli, registry_db: str, cache_file) -> None:
    prune_registry(cli, cache_file)

    pruned = cli("prune", "--scope", "tp2/rank1", "--yes")
    after_prune = (all_entries(registry_db), all_records(registry_db))
    nothing = cli("prune", "--scope", "tp2/rank1", "--yes")
    shared = cli(
        "prune", "--scope", "shared", "--fingerprint", "1", "--fingerprint", "2", "--dry-run"
    )
    reverted = cli("revert", "4", "--yes")

    assert pruned.stdout.splitlines() == [
        "prune plan (scope=tp2/rank1):",
        "fingerprint  gpu          flashinfer  scope      entries  records",
        "1            NVIDIA H200  -           tp2/rank1  0        1",
        "0 entries and 1 records would be removed (revertible with `ficache revert`)",
        "removed 0 entries and 1 records (commit 4)",
    ]
    assert after_prune == (
        {(1, "shared", K16), (2, "shared", K16)},
        BEFORE_PRUNE - {(1, "tp2/rank1", "ns", "a", "5")},
    )
    assert nothing.stdout == "nothing matches: nothing to prune\n"
    assert shared.stdout.splitlines()[1:5] == [
        "fingerprint  gpu          flashinfer  scope   entries  records",
        "1            NVIDIA H200  -           shared  1        2",
        "2            NVIDIA B200  -           shared  1        1",
        "2 entries and 3 records would be removed (revertible with `ficache revert`)",
    ]
    assert reverted.exit_code == 0, reverted.stderr
    assert all_records(registry_db) == BEFORE_PRUNE
    assert verify(registry_db).ok


def test_prune_plans_count_records_and_refuse_a_stale_plan(
    registry_path: Path, cache_file, cli, dump_db
) -> None:
    from ficache.registry import PruneGroup

    prune_registry(cli, cache_file)
    db = str(registry_path)
    with Registry.open(db) as reg:
        written = max(c.created_at for c in reg.log())
        plan = reg.plan_prune(fingerprint_ids=[1])
        assert plan == reg.plan_prune(fingerprint_ids=[1])
        assert (plan.total, plan.records_total) == (1, 3)
        assert plan.groups == (
            PruneGroup(1, "NVIDIA H200", "<missing>", "shared", 1, 2),
            PruneGroup(1, "NVIDIA H200", "<missing>", "tp2/rank1", 0, 1),
        )
        # Every criterion applies to records: when they were written, whole fingerprints
        # no start served (never served: counted from when they were stored).
        assert reg.plan_prune(older_than_seconds=600.0, now=written + 300).is_empty
        assert reg.plan_prune(older_than_seconds=600.0, now=written + 900).records_total == 4
        assert reg.plan_prune(unused_for_seconds=600.0, now=written + 900).records_total == 4
        assert reg.plan_prune(flashinfer_versions=["0.1"]).is_empty
        # A record the plan would remove changed since: nothing is removed.
        changed = records_file(cache_file, "c.json", {"ns": {"b": [2]}}, entries=False)
        assert cli("import", changed).exit_code == 0
        before = dump_db(registry_path)
        with pytest.raises(ConflictError) as caught:
            plan.execute(reg)
    assert str(caught.value) == (
        "1 of 3 planned records changed since the plan was made; nothing removed, run prune again"
    )
    assert dump_db(registry_path) == before


# -- list and stats ------------------------------------------------------------------------


@both_backends
def test_list_and_stats_show_records(cli, cache_file) -> None:
    assert cli("import", records_file(cache_file, "a.json", {"ns": {"a": 1}, "z": {"q": {}}}))
    rank = records_file(cache_file, "r.json", {"ns": {"a": 5}}, entries=False)
    assert cli("import", rank, "--scope", "tp2/rank1").exit_code == 0

    listed = cli("list", "--records", "--format", "json")
    only = cli("list", "--records", "--namespace", "ns", "--scope", "tp2/rank1")
    stats = cli("stats")
    stats_json = json.loads(cli("stats", "--format", "json").stdout)
    refused = cli("list", "--records", "--op", "mm")

    assert [
        (r["scope"], r["namespace"], r["key"], r["value"]) for r in json.loads(listed.stdout)
    ] == [
        ("shared", "ns", "a", 1),
        ("shared", "z", "q", {}),
        ("tp2/rank1", "ns", "a", 5),
    ]
    assert only.stdout.splitlines() == [
        "fingerprint  scope      namespace  key  value  commit",
        "1            tp2/rank1  ns         a    5      2",
    ]
    assert "records          3" in stats.stdout.splitlines()
    assert stats.stdout.split("\n\n")[2].splitlines() == [
        "fingerprint  namespace  records",
        "1            ns         2",
        "1            z          1",
    ]
    assert (stats_json["records"], stats_json["record_namespaces"]) == (
        3,
        [
            {"fingerprint": 1, "namespace": "ns", "records": 2},
            {"fingerprint": 1, "namespace": "z", "records": 1},
        ],
    )
    assert refused.exit_code == 2


def test_export_of_a_rank_scope_overlays_its_records(cli, cache_file) -> None:
    shared = {"ns": {"a": 1, "b": 2}, "other": {"x": True}}
    assert cli("import", records_file(cache_file, "a.json", shared)).exit_code == 0
    rank = records_file(cache_file, "r.json", {"ns": {"a": 9}}, entries=False)
    assert cli("import", rank, "--scope", "tp2/rank1").exit_code == 0

    rank_text = cli("export", "--fingerprint", "1", "--scope", "tp2/rank1").stdout
    shared_text = cli("export", "--fingerprint", "1").stdout

    assert json.loads(rank_text)["_records"] == {"ns": {"a": 9, "b": 2}, "other": {"x": True}}
    assert json.loads(shared_text)["_records"] == shared
    # as save_configs lays them out: after _metadata, namespaces and keys sorted
    assert list(json.loads(shared_text))[:2] == ["_metadata", "_records"]
    assert '"_records": {\n    "ns": {\n      "a": 1,\n      "b": 2\n    },' in shared_text


# -- bundles -------------------------------------------------------------------------------


@both_backends
def test_bundles_carry_records_and_export_again_byte_for_byte(
    cli, registry_db: str, cache_file, tmp_path: Path
) -> None:
    assert (
        cli("import", records_file(cache_file, "a.json", {NS: {DA_KEY: DA_VALUE}})).exit_code == 0
    )
    rank = records_file(cache_file, "r.json", {NS: {DA_KEY: {"schema": 2}}}, entries=False)
    assert cli("import", rank, "--scope", "tp2/rank0").exit_code == 0
    # A fingerprint holding records only travels too.
    b200 = cache_file("b.json", {"_records": {"ns": {"k": 1}}}, metadata={"gpu": "NVIDIA B200"})
    assert cli("import", b200).exit_code == 0
    first = tmp_path / "first.bundle"
    second = tmp_path / "second.bundle"

    wrote = cli("export", "--bundle", first, "--all")
    imported = cli("import", first, db=tmp_path / "copy.db")
    cli("export", "--bundle", second, "--all", db=tmp_path / "copy.db")

    assert wrote.stdout.startswith(
        f"wrote bundle {first}: 1 entries and 3 records of 2 fingerprint(s)"
    )
    assert imported.stdout == (
        "imported 1 entries and 3 records from 1 bundle(s): 1 added, 0 replaced, 0 unchanged; "
        "records 3 added, 0 replaced, 0 unchanged (commit 1)\n"
    )
    assert second.read_bytes() == first.read_bytes()
    copy = str(tmp_path / "copy.db")
    assert (
        stored(copy, "tp2/rank0")
        == stored(registry_db, "tp2/rank0")
        == {NS: {DA_KEY: {"schema": 2}}}
    )
    assert verify(copy).ok


# -- merge ---------------------------------------------------------------------------------


def _merge_setup(cli, cache_file, tmp_path: Path) -> tuple[Path, Path]:
    """The registry holds ns/a=1 (tuned now); two files hold a=2 (old) and a=3 (newer)."""
    assert cli("import", records_file(cache_file, "t.json", {"ns": {"a": 1, "same": 0}}))
    older = records_file(cache_file, "s1.json", {"ns": {"a": 2, "same": 0, "new": 1}}, False)
    newer = records_file(cache_file, "s2.json", {"ns": {"a": 3}}, False)
    os.utime(older, (1_000_000, 1_000_000))
    future = time.time() + 3600
    os.utime(newer, (future, future))
    return older, newer


@both_backends
@pytest.mark.parametrize(
    ("policy", "sources", "value"),
    [
        ("keep", "both", 1),
        ("theirs", "both", 3),
        ("newest", "both", 3),
        ("newest", "older", 1),
        ("vote", "older twice", 2),
        ("drop", "both", None),
    ],
)
def test_merge_resolves_record_conflicts_by_policy(
    cli, registry_db: str, cache_file, tmp_path: Path, policy: str, sources: str, value: Any
) -> None:
    older, newer = _merge_setup(cli, cache_file, tmp_path)
    copy = tmp_path / "s1-copy.json"
    copy.write_bytes(older.read_bytes())
    given = {"both": [older, newer], "older": [older], "older twice": [older, copy]}[sources]

    result = cli("merge", *given, "--on-conflict", policy)
    again = cli("merge", *given, "--on-conflict", policy)

    assert result.exit_code == 0, result.stderr
    assert "record 1 shared ns a: target 1; source 1 2" in result.stdout
    assert stored(registry_db)["ns"].get("a") == value
    assert stored(registry_db)["ns"]["new"] == 1
    assert again.stdout.splitlines()[-1] == "nothing to change, no commit"
    assert verify(registry_db).ok


@both_backends
def test_merge_fail_refuses_record_conflicts_and_changes_nothing(
    cli, registry_db: str, cache_file, tmp_path: Path, dump_db
) -> None:
    older, newer = _merge_setup(cli, cache_file, tmp_path)
    before = dump_db(registry_db)

    result = cli("merge", older, newer, "--on-conflict", "fail")
    plan = json.loads(cli("merge", older, "--dry-run", "--format", "json").stdout)

    assert result.exit_code == 1
    assert result.stderr == (
        "error: 0 conflicting entries and 1 conflicting records; nothing merged; choose how to "
        "resolve them with --on-conflict keep|theirs|newest|vote|drop\n"
    )
    assert "records: 1 added, 0 replaced, 0 removed, 1 identical, 1 conflicting" in result.stdout
    assert plan["records"]["conflicts"] == [
        {
            "fingerprint": FP.digest,
            "fingerprint_id": 1,
            "scope": "shared",
            "namespace": "ns",
            "key": "a",
            "target": 1,
            "sources": [{"source": 1, "value": 2}],
            "resolution": "target",
        }
    ]
    assert dump_db(registry_db) == before


def test_merging_registries_carries_their_records(cli, cache_file, tmp_path: Path) -> None:
    source = tmp_path / "source.db"
    assert cli("import", records_file(cache_file, "a.json", {"ns": {"a": [1]}}), db=source)

    merged = cli("merge", source)

    assert merged.stdout.splitlines()[-1] == (
        "merged as commit 1: 1 added, 0 replaced, 0 removed; records 1 added, 0 replaced, 0 removed"
    )
    assert (
        json.loads(cli("log", "--format", "json").stdout)[0]["provenance"]["sources"][0]["records"]
        == 1
    )


# -- verify --------------------------------------------------------------------------------


@both_backends
def test_verify_counts_the_records_tables(cli, registry_db: str, cache_file) -> None:
    prune_registry(cli, cache_file)  # 2 entries, 4 records, each added once
    assert cli("prune", "--fingerprint", "2", "--yes").exit_code == 0  # 1 of each removed

    text = cli("verify")
    report = json.loads(cli("verify", "--format", "json").stdout)

    assert (text.exit_code, text.stderr) == (0, "")
    assert text.stdout.splitlines()[1] == (
        "checked 2 fingerprints, 1 entries, 4 commits, 3 changes, 3 records, 5 record changes"
    )
    assert (report["ok"], report["checked"]) == (
        True,
        {
            "fingerprints": 2,
            "entries": 1,
            "commits": 4,
            "changes": 3,
            "records": 3,
            "record_changes": 5,
            "policies": 0,
        },
    )


@pytest.mark.parametrize(
    ("tamper", "kind"),
    [
        ("UPDATE records SET value = '{\"x\":1}' WHERE id = 1", "record_unlogged"),
        ('UPDATE records SET value = \'{"b":1,"a":2}\' WHERE id = 1', "bad_record"),
        ("UPDATE records SET scope = 'rank1' WHERE id = 1", "bad_record"),
        ("UPDATE commits SET records_added = 5 WHERE id = 1", "record_counts"),
        ("DELETE FROM records WHERE id = 1", "record_unlogged"),
        ("DELETE FROM record_changes WHERE id = 1", "record_counts"),
    ],
)
def test_verify_checks_the_records_tables(
    cli, registry_path: Path, cache_file, tamper: str, kind: str
) -> None:
    assert (
        cli("import", records_file(cache_file, "a.json", {"ns": {"a": 1, "b": 2}})).exit_code == 0
    )
    assert verify(str(registry_path)).ok
    conn = sqlite3.connect(registry_path)
    with conn:
        conn.execute(tamper)
    conn.close()

    report = verify(str(registry_path))

    kinds = [p.kind for p in report.problems]
    assert kinds[0] == kind, kinds  # and what follows from it: the log no longer matches
    assert set(kinds) <= {kind, "record_unlogged"}, kinds


def test_verify_finds_a_record_of_a_missing_fingerprint(
    cli, registry_path: Path, cache_file
) -> None:
    assert cli("import", records_file(cache_file, "a.json", {"ns": {"a": 1}})).exit_code == 0
    conn = sqlite3.connect(registry_path)
    with conn:
        conn.execute("UPDATE records SET fingerprint_id = 7")
    conn.close()

    kinds = {p.kind for p in verify(str(registry_path)).problems}

    assert "orphan_record" in kinds and "foreign_key" not in kinds


# -- warm start ----------------------------------------------------------------------------


def _warm(db: str, publish: dict[str, dict[str, Any]] | None = None) -> tuple[Any, dict[str, Any]]:
    from flashinfer.autotuner import AutoTuner

    tuner = AutoTuner.get()
    with ficache.warm_start(db=db) as ws:
        seen = {ns: tuner.get_namespaced_records(ns) for ns in (NS, "other")}
        standin_tune()
        for ns, records in (publish or {}).items():
            tuner.publish_namespaced_records(ns, {**tuner.get_namespaced_records(ns), **records})
    return ws.report, seen


@both_backends
def test_a_warm_start_serves_and_commits_records(registry_db: str, autotuner: Any) -> None:
    cold, seen_cold = _warm(registry_db, {NS: {DA_KEY: DA_VALUE}})
    warm, seen_warm = _warm(registry_db)
    more, _seen = _warm(registry_db, {"other": {"x": 1}, NS: {DA_KEY: {"schema": 2}}})

    assert seen_cold == {NS: {}, "other": {}}
    assert (cold.status, cold.records_tuned, cold.records_committed) == ("cold", 1, 1)
    assert seen_warm == {NS: {DA_KEY: DA_VALUE}, "other": {}}
    assert (warm.status, warm.records_loaded, warm.records_tuned, warm.commit_id) == (
        "warm",
        1,
        0,
        None,
    )
    # A start adds records; a stored one keeps its value (as entries do) and every rank
    # loads the stored value back.
    assert (more.status, more.records_tuned, more.records_committed, more.kept) == (
        "partial",
        2,
        1,
        1,
    )
    assert more.warnings == [
        "1 published records not stored: the registry holds other values for those keys; "
        "every rank loads the stored ones"
    ]
    with Registry.open(registry_db) as reg:
        [startup] = [c for c in reg.log() if c.id == more.commit_id]
    assert (startup.kind, startup.added, startup.records_added, startup.records_replaced) == (
        "startup",
        0,
        1,
        0,
    )
    assert stored(registry_db, fp=None) == {NS: {DA_KEY: DA_VALUE}, "other": {"x": 1}}
    assert autotuner.get_namespaced_records("other") == {"x": 1}
    assert autotuner.get_namespaced_records(NS) == {DA_KEY: DA_VALUE}
    assert verify(registry_db).ok


def test_records_json_cannot_carry_are_skipped_and_the_start_goes_on(
    registry_path: Path, autotuner: Any
) -> None:
    report, _seen = _warm(str(registry_path), {NS: {"bad": {1: 2}, "nan": float("nan"), "ok": 1}})

    assert (report.status, report.records_tuned, report.records_committed) == ("cold", 1, 1)
    assert report.warnings == ["rank 0: 2 namespaced records JSON cannot carry exactly; not stored"]
    assert stored(str(registry_path), fp=None) == {NS: {"ok": 1}}


#: Hang guard of the gloo test: every rank is killed after this long.
HARD_TIMEOUT = 300.0


def two_ranks(rank: int, world: int, db: str) -> dict[str, Any]:
    """Rank function: two starts; both ranks publish one equal and one differing record."""
    import logging

    logging.getLogger("flashinfer").setLevel(logging.ERROR)
    mine = {"same": {"v": 1}, "mine": {"rank": rank}}
    first, seen_first = _warm(db, {NS: mine})
    second, seen_second = _warm(db)
    return {
        "first": first.as_json(),
        "second": second.as_json(),
        "seen_first": seen_first,
        "seen_second": seen_second,
    }


def test_two_gloo_ranks_share_equal_records_and_scope_the_rest(tmp_path: Path) -> None:
    db = str(tmp_path / "registry.db")

    results = run_ranks(two_ranks, 2, db, timeout=HARD_TIMEOUT, group_timeout=60.0)

    for rank, out in enumerate(results):
        assert out["first"]["records_tuned"] == 2, out
        assert out["first"]["records_committed"] == 3, out  # one shared, one per rank
        assert out["second"]["status"] == "warm", out
        assert out["second"]["records_loaded"] == 2, out
        assert out["seen_first"][NS] == {}
        assert out["seen_second"][NS] == {"same": {"v": 1}, "mine": {"rank": rank}}
    assert stored(db, fp=None) == {NS: {"same": {"v": 1}}}
    assert stored(db, "world2/rank1", fp=None) == {NS: {"same": {"v": 1}, "mine": {"rank": 1}}}
    with Registry.open(db) as reg:
        [commit] = reg.log()
    assert (commit.kind, commit.records_added, commit.provenance["records"]) == ("startup", 3, 3)
    assert verify(db).ok


def relaid_render_cache(
    metadata: Any, entries: Any, records: Any = None, *, rendered: list[str] | None = None
) -> str:
    """``render_cache`` with another layout (indented, entries first, ``_records`` last):
    a cache file FlashInfer loads the same, whose records sit nowhere near the top."""
    from ficache.flashinfer_format import RECORDS_KEY, render_cache

    parsed = json.loads(render_cache(metadata, entries, records))
    held = parsed.pop(RECORDS_KEY, None)
    if held is not None:
        parsed[RECORDS_KEY] = held
    text = json.dumps(parsed, indent=2)
    if rendered is not None:
        rendered.append(text)
    return text


def two_ranks_relaid(rank: int, world: int, db: str) -> dict[str, Any]:
    """``two_ranks`` with every slice rendered in ``relaid_render_cache``'s layout."""
    import functools

    import ficache.slices

    rendered: list[str] = []
    ficache.slices.render_cache = functools.partial(relaid_render_cache, rendered=rendered)
    out = two_ranks(rank, world, db)
    with_records = [json.loads(t) for t in rendered if '"_records"' in t]
    out["relaid"] = len(with_records), all(list(p)[-1] == "_records" for p in with_records)
    return out


def test_records_loaded_from_any_layout_are_not_new(tmp_path: Path) -> None:
    """The slices' ``_records`` last and indented (not where a line-based reading of
    ``render_cache``'s output would look): every rank loads the records, and the start
    that loaded them and published nothing tunes no record and commits nothing."""
    db = str(tmp_path / "registry.db")

    results = run_ranks(two_ranks_relaid, 2, db, timeout=HARD_TIMEOUT, group_timeout=60.0)

    for rank, out in enumerate(results):
        count, records_last = out["relaid"]
        assert rank > 0 or (count >= 2 and records_last), out["relaid"]  # rank 0 renders
        assert out["first"]["records_committed"] == 3, out
        second = out["second"]
        assert out["seen_second"][NS] == {"same": {"v": 1}, "mine": {"rank": rank}}
        assert (second["status"], second["records_loaded"], second["records_tuned"]) == (
            "warm",
            2,
            0,
        ), second
        assert (second["commit_id"], second["committed"], second["records_committed"]) == (
            None,
            0,
            0,
        ), second
    with Registry.open(db) as reg:
        assert len(reg.log()) == 1
