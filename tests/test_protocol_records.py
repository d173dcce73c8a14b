"""FlashInfer 0.7.4's protocol records as a kind of stored result of their own, through the
shared machinery: merge, show, log, revert, prune, list, stats and verify, on real SQLite
files (and PostgreSQL where marked), with v2 stores written by FlashInfer's own store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from flashinfer.autotune_cache import ManagedAutotuneCache
from samples import H200_METADATA

from ficache.fingerprint import Fingerprint
from ficache.protocol_records import NewProtocolRecord, stored_protocol_records
from ficache.registry import Registry
from ficache.verify import verify

FP = Fingerprint.from_flashinfer_metadata(H200_METADATA)
NS = "moe_ep_megamoe"
POLICY = '["cuda_graph",null]'


def protocol_rows(db: str | Path) -> list[tuple[Any, ...]]:
    """Every stored protocol record as (scope, namespace, key, value, policy, commit)."""
    with Registry.open(str(db), create=False) as reg, reg.engine.connect() as conn:
        return [
            (r.scope, r.namespace, r.key, r.value_json, r.policy_json, r.commit_id)
            for r in stored_protocol_records(conn)
        ]


def write(db: str | Path, *records: tuple[str, str, str | None], message: str = "") -> None:
    """One import commit of ``(key, value, policy)`` protocol records of ``FP``, shared."""
    with Registry.open(str(db)) as reg:
        reg.write(
            [],
            kind="import",
            message=message or None,
            protocol_records=[
                NewProtocolRecord(FP, NS, key, value, policy, tuned_at=float(n))
                for n, (key, value, policy) in enumerate(records, start=1)
            ],
        )


def publish_store(root: Path, values: dict[str, Any]) -> None:
    """FlashInfer's own store publishes ``values`` as protocol records of ``NS``."""
    store = ManagedAutotuneCache(manifest=dict(H200_METADATA), root=root)
    for key, value in values.items():
        fields = ("__protocol__", NS, key)
        store.publish(str(fields), NS, value, key_fields=fields)


@pytest.mark.usefixtures("backend")
def test_a_merge_of_two_registries_with_protocol_records(
    cli, registry_db: str, tmp_path: Path
) -> None:
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    write(a, ("t1", "1", None), ("t2", '{"k":[4,2]}', POLICY))
    write(b, ("t1", "9", None), ("t3", "3", None))  # t1 conflicts with a's

    first = cli("merge", a)
    conflict = cli("merge", b, "--on-conflict", "theirs")
    again = cli("merge", a, b, "--on-conflict", "theirs")

    assert first.exit_code == 0, first.output
    assert "protocol records: 2 added, 0 replaced, 0 removed, 0 identical, 0 conflicting" in (
        first.stdout
    )
    assert first.stdout.endswith(
        "merged as commit 1: 0 added, 0 replaced, 0 removed; protocol records 2 added, "
        "0 replaced, 0 removed\n"
    )
    assert conflict.exit_code == 0, conflict.output
    assert "protocol records: 1 added, 1 replaced, 0 removed, 0 identical, 1 conflicting" in (
        conflict.stdout
    )
    assert f"  protocol record 1 shared {NS} t1: target 1; source 1 9 -> source 1" in (
        conflict.stdout
    )
    assert [(k, v, p) for _s, _n, k, v, p, _c in protocol_rows(registry_db)] == [
        ("t1", "9", None),
        ("t2", '{"k":[4,2]}', POLICY),
        ("t3", "3", None),
    ]
    assert again.stdout.endswith("nothing to change, no commit\n")
    # the merge commit's provenance names the protocol records of each source
    [merged, _first] = json.loads(cli("log", "--format", "json").stdout)
    assert [s["protocol_records"] for s in merged["provenance"]["sources"]] == [2]
    assert (merged["protocol_added"], merged["protocol_replaced"]) == (1, 1)
    assert verify(registry_db).ok


def test_show_log_list_and_stats(cli, registry_db: str) -> None:
    write(registry_db, ("t1", "1", POLICY), ("t2", "[2]", None), message="first")
    write(registry_db, ("t1", "5", POLICY), message="second")

    show = cli("show", "2")
    shown = json.loads(cli("show", "2", "--format", "json").stdout)
    log = cli("log")
    listed = cli("list", "--protocol-records")
    as_json = json.loads(cli("list", "--protocol-records", "--format", "json").stdout)
    stats = cli("stats")
    stats_json = json.loads(cli("stats", "--format", "json").stdout)

    assert "protocol record changes: 0 added, 1 replaced, 0 removed\n" in show.stdout
    assert show.stdout.splitlines()[-2:] == [
        "action    fingerprint  scope   namespace       key  old  new",
        f"replaced  1            shared  {NS}  t1   1    5",
    ]
    assert shown["protocol_changes"] == [
        {
            "action": "replaced",
            "fingerprint": 1,
            "scope": "shared",
            "namespace": NS,
            "key": "t1",
            "old": 1,
            "new": 5,
            "old_policy": ["cuda_graph", None],
            "new_policy": ["cuda_graph", None],
            "old_commit": 1,
        }
    ]
    assert "protocol +/~/-" in log.stdout.splitlines()[0]
    assert [line.split()[8] for line in log.stdout.splitlines()[1:]] == ["0/1/0", "2/0/0"]
    assert listed.stdout.splitlines() == [
        "fingerprint  scope   namespace       key  value  policy               commit",
        f"1            shared  {NS}  t1   5      {POLICY}  2",
        f"1            shared  {NS}  t2   [2]    -                    1",
    ]
    assert [(r["key"], r["value"], r["policy"]) for r in as_json] == [
        ("t1", 5, ["cuda_graph", None]),
        ("t2", [2], None),
    ]
    assert "\nprotocol records  2\n" in stats.stdout
    assert (
        f"\nfingerprint  namespace       protocol records\n1            {NS}  2\n\n" in stats.stdout
    )
    assert (stats_json["protocol_records"], stats_json["protocol_namespaces"]) == (
        2,
        [{"fingerprint": 1, "namespace": NS, "protocol_records": 2}],
    )
    # entries and namespaced records list as before, without them
    assert cli("list", "--format", "json").stdout == "[\n]\n"
    assert json.loads(cli("list", "--records", "--format", "json").stdout) == []


def test_list_turns_a_database_error_into_one_line_for_every_kind(cli, registry_db: str) -> None:
    """``list --protocol-records`` reads through the listing ``list --records`` uses, so a
    damaged registry is the same one line and exit 1 for both, not a SQL dump."""
    import sqlite3

    write(registry_db, ("t1", "1", None))
    with sqlite3.connect(registry_db) as conn:
        for table in ("protocol_record_changes", "protocol_records", "record_changes", "records"):
            conn.execute(f"DROP TABLE {table}")

    for flag, table in (("--records", "records"), ("--protocol-records", "protocol_records")):
        listed = cli("list", flag)
        assert (listed.exit_code, listed.output) == (
            1,
            f"error: registry {registry_db}: no such table: {table}\n",
        )


@pytest.mark.usefixtures("backend")
def test_reverting_an_import_restores_the_protocol_records(
    cli, registry_db: str, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    publish_store(root, {"t1": {"knobs": [4, 2]}, "t2": 7})
    assert cli("import", root).exit_code == 0
    before = protocol_rows(registry_db)
    publish_store(root, {"t1": {"knobs": [8, 1]}, "t3": [1]})  # t1 retuned, t3 new
    second = cli("import", root, "--on-conflict", "theirs")
    assert second.stdout.endswith(
        "imported 3 protocol records (shared): 1 added, 1 replaced, 1 unchanged\n"
    )

    plan = cli("revert", "2", "--dry-run")
    result = cli("revert", "2", "--yes")

    assert "; protocol records: remove 1 added, restore 1 replaced, restore 0 removed" in (
        plan.stdout
    )
    assert result.stdout.endswith(
        "reverted commit 2 as commit 3: 0 removed, 0 restored, 0 re-added; protocol records "
        "1 removed, 1 restored, 0 re-added\n"
    )
    assert [r[:5] for r in protocol_rows(registry_db)] == [r[:5] for r in before]
    assert verify(registry_db).ok
    # the first import's t1 was changed by commit 2 and changed back by its revert (3):
    # no conflict, reverting the first import goes through (issue 35, bug 4)
    first = cli("revert", "1", "--yes")
    assert (first.exit_code, first.stderr) == (0, "")
    assert first.stdout.endswith(
        "reverted commit 1 as commit 4: 0 removed, 0 restored, 0 re-added; protocol records "
        "2 removed, 0 restored, 0 re-added\n"
    )
    assert protocol_rows(registry_db) == []


def test_prune_removes_them_with_their_fingerprint_and_revert_restores(
    cli, registry_db: str
) -> None:
    write(registry_db, ("t1", "1", POLICY), ("t2", "2", None))
    before = protocol_rows(registry_db)

    plan = cli("prune", "--fingerprint", "1", "--dry-run")
    pruned = cli("prune", "--fingerprint", "1", "--yes")

    assert plan.stdout.splitlines()[1:] == [
        "fingerprint  gpu          flashinfer   scope   entries  protocol records",
        "1            NVIDIA H200  0.7.2.post1  shared  0        2",
        "0 entries and 2 protocol records would be removed (revertible with `ficache revert`)",
        "dry run: nothing changed",
    ]
    assert pruned.stdout.endswith("removed 0 entries and 2 protocol records (commit 2)\n")
    assert protocol_rows(registry_db) == []
    assert cli("revert", "2", "--yes").exit_code == 0
    assert [r[:5] for r in protocol_rows(registry_db)] == [r[:5] for r in before]
    assert verify(registry_db).ok


def test_protocol_records_never_collide_with_namespaced_records(registry_db: str) -> None:
    """One namespace and key held as a v1 ``_records`` record and as a protocol record:
    two rows of two kinds, each its own value, history and export."""
    from ficache.records import NewRecord, list_records

    with Registry.open(registry_db) as reg:
        reg.write(
            [],
            kind="import",
            records=[NewRecord(FP, NS, "t1", '"v1"')],
            protocol_records=[NewProtocolRecord(FP, NS, "t1", '"protocol"')],
        )
        [commit] = reg.log()
        ids = [i.id for i in reg.fingerprints()]
        assert [(r.key, r.value_json) for r in list_records(reg)] == [("t1", '"v1"')]
        assert reg.slice_records(ids, ["shared"]) == {NS: {"t1": '"v1"'}}
        exported = json.loads(reg.export_text(ids[0])[0])
    assert (commit.records_added, commit.protocol_added) == (1, 1)
    assert [r[2:4] for r in protocol_rows(registry_db)] == [("t1", '"protocol"')]
    assert exported["_records"] == {NS: {"t1": "v1"}}


def _deep(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


#: Protocol entry files FlashInfer could not have written: ``(entry key, runner, tactic text)``.
BAD_PROTOCOL_ENTRIES = {
    "empty namespace": ("('__protocol__', '', 'k')", "", "1"),
    "namespace not a string": ("('__protocol__', 7, 'k')", "7", "1"),
    "key not a string": (f"('__protocol__', '{NS}', 3)", NS, "1"),
    "key of four parts": (f"('__protocol__', '{NS}', 'k', 'x')", NS, "1"),
    "runner not its namespace": (f"('__protocol__', '{NS}', 'k')", "other", "1"),
    "NaN value": (f"('__protocol__', '{NS}', 'k')", NS, '{"x": NaN}'),
    "value nested 40 deep": (f"('__protocol__', '{NS}', 'k')", NS, json.dumps(_deep(40))),
}


@pytest.mark.parametrize("case", BAD_PROTOCOL_ENTRIES, ids=list(BAD_PROTOCOL_ENTRIES))
def test_a_malformed_protocol_entry_is_skipped_and_counted(
    cli, registry_db: str, tmp_path: Path, dump_db, case: str
) -> None:
    """As a malformed entry is: skipped, counted in one warning line, the registry unchanged
    (by ``import`` and by ``--from-vllm`` adoption alike)."""
    from ficache.v2_store import entry_file_name, env_hash, manifest_for

    write(registry_db, ("t1", "1", None))
    root = tmp_path / "store"
    manifest = manifest_for(H200_METADATA, {})
    env_dir = root / "v2" / env_hash(manifest)
    (env_dir / "entries").mkdir(parents=True)
    (env_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    key, runner, tactic = BAD_PROTOCOL_ENTRIES[case]
    (env_dir / "entries" / entry_file_name(key)).write_text(
        f'{{"key": {json.dumps(key)}, "runner": {json.dumps(runner)}, "tactic": {tactic}}}'
    )
    before = dump_db(registry_db)

    imported = cli("import", root)
    adopted = cli("import", "--from-vllm", root)

    assert imported.exit_code == 0, imported.output
    assert imported.stdout.endswith(
        "imported 0 entries from 1 environment(s): 0 added, 0 replaced, 0 unchanged "
        "(nothing new, no commit)\n"
    )
    [warning] = imported.stderr.splitlines()
    assert warning.startswith(
        "warning: skipped 1 malformed entry (FlashInfer treats them as misses)"
    )
    assert adopted.exit_code == 0, adopted.output
    assert adopted.stderr.startswith("warning: skipped 1 unreadable file(s), entr(ies)")
    assert dump_db(registry_db) == before


def test_a_write_that_stores_and_removes_one_identity_is_refused_for_every_namespaced_kind(
    registry_db: str,
) -> None:
    """Records and protocol records share one write shape (``values.NamespacedWrite``): a
    write that stores and removes the same identity is refused before anything is written,
    for both kinds alike (protocol records' own copy of the write once lacked this check)."""
    from ficache.protocol_records import ProtocolWrite
    from ficache.records import NewRecord, RecordWrite

    write(registry_db, ("t1", '"v1"', None))
    before = protocol_rows(registry_db)
    record = NewRecord(FP, NS, "t1", '"v2"')
    protocol = NewProtocolRecord(FP, NS, "t1", '"v2"')
    with Registry.open(registry_db) as reg:
        with pytest.raises(ValueError, match="record 't1' is both written and removed"):
            reg.write([], kind="import", records=RecordWrite((record,), (record.identity,)))
        with pytest.raises(ValueError, match="protocol record 't1' is both written and removed"):
            reg.write(
                [],
                kind="import",
                protocol_records=ProtocolWrite((protocol,), (protocol.identity,)),
            )
        assert len(reg.log()) == 1
    assert protocol_rows(registry_db) == before
