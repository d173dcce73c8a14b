"""Alembic owns the schema: creation at head, upgrades, refusal of newer
schemas, no drift between models and migrations, frozen past registries."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import past_releases
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, text

from ficache import schema
from ficache.errors import (
    ConflictError,
    NotARegistryError,
    RegistryReadOnlyError,
    SchemaTooNewError,
)
from ficache.exporting import plan_v2_export
from ficache.fingerprint import Fingerprint
from ficache.models import Base
from ficache.registry import Registry
from ficache.registry_schema import RegistrySchema

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
    "protocol_records",
    "protocol_record_changes",
    "schema_compat",
}
DATA = Path(__file__).parent / "data"
FROZEN = sorted(DATA.glob("registry-*.db"))
REPO = Path(__file__).resolve().parent.parent


def query(path: Path, sql: str, params: tuple = ()) -> list[tuple]:
    with closing(sqlite3.connect(path)) as conn:
        return conn.execute(sql, params).fetchall()


def tables(path: Path) -> set[str]:
    return {r[0] for r in query(path, "SELECT name FROM sqlite_master WHERE type = 'table'")}


def revision(path: Path) -> list[tuple]:
    return query(path, "SELECT version_num FROM alembic_version")


def entry_file(cache_file, name: str = "c.json", m: int = 16) -> Path:
    key = str(("flashinfer::mm_fp4", "CutlassRunner", ((m, 4096),), ("torch.bfloat16",)))
    return cache_file(name, {key: ["CutlassRunner", [1, 2]]}, metadata={"gpu": "NVIDIA H200"})


def test_a_new_registry_is_created_at_head(registry_path: Path) -> None:
    with Registry.open(str(registry_path)) as reg:
        assert reg.stats().revision == HEAD

    assert tables(registry_path) == TABLES
    assert revision(registry_path) == [(HEAD,)]
    assert query(registry_path, "PRAGMA journal_mode") == [("wal",)]


def test_history_and_head() -> None:
    rows = schema.history()

    assert rows[0] == (
        "0001_registry",
        None,
        "ficache 0.1: fingerprints, entries, commits and the entry change log.",
    )
    assert rows[-1][0] == HEAD


def test_models_and_migrations_do_not_drift(registry_path: Path) -> None:
    Registry.open(str(registry_path)).close()
    engine = create_engine(f"sqlite:///{registry_path}")
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn, opts={"compare_type": True, "compare_server_default": True}
            )
            diff = compare_metadata(context, Base.metadata)
    finally:
        engine.dispose()

    assert diff == []


def test_down_to_base_and_up_again_through_the_cli(cli, cache_file, registry_path: Path) -> None:
    assert cli("import", entry_file(cache_file)).exit_code == 0
    where = registry_path.resolve()

    down = cli("db", "downgrade", "base", "--yes")

    assert (down.exit_code, down.stdout) == (
        0,
        f"downgrade plan: {where} from {HEAD} to base (drops all stored entries)\n"
        "  0010_measurement_fingerprints -> 0009_protocol_records: keeps every stored value\n"
        "  0009_protocol_records -> 0008_start_counts: keeps every stored value\n"
        "  0008_start_counts -> 0007_compat: keeps every stored value\n"
        "  0007_compat -> 0006_policies: keeps every stored value\n"
        "  0006_policies -> 0005_drop_op_index: keeps every stored value\n"
        "  0005_drop_op_index -> 0004_selection: keeps every stored value\n"
        "  0004_selection -> 0003_records: keeps every stored value\n"
        "  0003_records -> 0002_fleet: keeps every stored value\n"
        # the import dated the entry by the file's mtime (``tuned_time``): 0001 loses it
        "  0002_fleet -> 0001_registry: when 1 entries were tuned (upgrading again takes "
        "their last write)\n"
        "  0001_registry -> base: 1 entries, 1 fingerprints, 1 commits and 1 change rows\n"
        "upgrading again does not bring back what a step drops\n"
        f"registry {where} is at base\n",
    )
    assert tables(registry_path) == {"alembic_version"}
    assert revision(registry_path) == []
    assert cli("db", "current").stdout == f"(none) (head {HEAD}: empty)\n"

    up = cli("db", "upgrade")

    assert (up.exit_code, up.stdout) == (0, f"registry {where} is at {HEAD}\n")
    assert tables(registry_path) == TABLES
    assert cli("db", "current").stdout == f"{HEAD} (head {HEAD}: up to date)\n"
    assert cli("list", "--format", "json").stdout == "[\n]\n"
    again = cli("import", entry_file(cache_file))
    assert again.stdout.startswith("imported 1 entries from 1 file(s): 1 added")


def test_db_upgrade_creates_a_new_registry_at_a_given_revision(cli, registry_path: Path) -> None:
    result = cli("db", "upgrade", "0001_registry")

    assert (result.exit_code, result.stdout) == (
        0,
        f"registry {registry_path.resolve()} is at 0001_registry\n",
    )
    assert revision(registry_path) == [("0001_registry",)]


def test_unknown_revisions_are_refused(cli, registry_path: Path, dump_db) -> None:
    Registry.open(str(registry_path)).close()
    before = dump_db(registry_path)

    up = cli("db", "upgrade", "0099_nope")
    down = cli("db", "downgrade", "0099_nope", "--yes")

    assert (up.exit_code, up.stderr) == (
        1,
        "error: unknown revision '0099_nope'; see ficache db history\n",
    )
    assert (down.exit_code, down.stderr) == (
        1,
        "error: unknown revision '0099_nope'; see ficache db history\n",
    )
    assert dump_db(registry_path) == before


def test_an_older_registry_is_upgraded_when_opened(cli, cache_file, registry_path: Path) -> None:
    Registry.open(str(registry_path)).close()
    assert cli("db", "downgrade", "base", "--yes").exit_code == 0

    with Registry.open(str(registry_path)) as reg:
        assert reg.stats().revision == HEAD

    assert tables(registry_path) == TABLES


def test_an_older_read_only_registry_is_refused_not_upgraded(cli, registry_path: Path) -> None:
    Registry.open(str(registry_path)).close()
    assert cli("db", "downgrade", "base", "--yes").exit_code == 0
    registry_path.chmod(0o444)
    before = registry_path.read_bytes()

    with pytest.raises(RegistryReadOnlyError, match=f"is empty, needs '{HEAD}', and is read-only"):
        Registry.open(str(registry_path))

    assert registry_path.read_bytes() == before


def _make_newer(path: Path) -> None:
    Registry.open(str(path)).close()
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("UPDATE alembic_version SET version_num = '0099_from_the_future'")
        conn.execute("CREATE TABLE future_things (id INTEGER PRIMARY KEY)")
    # a rollback journal, which a future ficache might choose: any write
    # (even switching it to WAL) would show in the file's bytes
    query(path, "PRAGMA journal_mode = DELETE")


@pytest.mark.parametrize(
    "command",
    [
        ("list",),
        ("stats",),
        # `db current` reports it (test_verify.py::test_db_current_and_verify_report_a_newer_schema)
        ("db", "upgrade"),
        ("db", "downgrade", "base", "--yes"),
        ("prune", "--older-than", "1s", "--yes"),
    ],
)
def test_a_newer_schema_is_refused_and_not_touched(
    cli, registry_path: Path, command: tuple[str, ...]
) -> None:
    _make_newer(registry_path)
    before = registry_path.read_bytes()
    listing = sorted(os.listdir(registry_path.parent))

    result = cli(*command)

    assert result.exit_code == 1
    assert result.stderr == (
        f"error: registry {registry_path.resolve()} has schema revision '0099_from_the_future', newer than "
        f"this ficache knows (head '{HEAD}'); upgrade ficache (pip install -U ficache)\n"
    )
    assert registry_path.read_bytes() == before
    assert sorted(os.listdir(registry_path.parent)) == listing


def test_a_newer_schema_is_refused_by_the_library(registry_path: Path) -> None:
    _make_newer(registry_path)
    before = registry_path.read_bytes()

    with pytest.raises(SchemaTooNewError, match="upgrade ficache"):
        Registry.open(str(registry_path))

    assert registry_path.read_bytes() == before


def test_a_foreign_sqlite_database_is_refused_and_not_touched(registry_path: Path) -> None:
    with closing(sqlite3.connect(registry_path)) as conn, conn:
        conn.execute("CREATE TABLE photos (id INTEGER PRIMARY KEY, name TEXT)")
        conn.execute("INSERT INTO photos (name) VALUES ('cat.jpg')")
    before = registry_path.read_bytes()

    with pytest.raises(NotARegistryError, match="is a database but not a ficache registry"):
        Registry.open(str(registry_path))

    assert registry_path.read_bytes() == before


def test_migrations_are_found_under_a_path_with_spaces(tmp_path: Path, monkeypatch) -> None:
    spaced = tmp_path / "My Projects, v2" / "migrations"
    shutil.copytree(schema.migrations_dir(), spaced)
    monkeypatch.setattr(schema, "migrations_dir", lambda: spaced)

    assert schema.head_revision() == HEAD
    with Registry.open(str(tmp_path / "r.db")) as reg:
        assert reg.stats().revision == HEAD


# -- frozen registries of past revisions ------------------------------------------


def test_every_revision_has_a_frozen_registry() -> None:
    frozen = {p.name.removeprefix("registry-").removesuffix(".db") for p in FROZEN}

    assert frozen == {rev for rev, _down, _title in schema.history()}, (
        "freeze a registry for each new revision: python tests/data/make_frozen_registry.py"
    )


@pytest.mark.parametrize("frozen", FROZEN, ids=[p.stem for p in FROZEN])
def test_a_frozen_registry_upgrades_to_head_and_keeps_its_data(
    frozen: Path, tmp_path: Path
) -> None:
    path = tmp_path / frozen.name
    shutil.copyfile(frozen, path)
    h200 = Fingerprint.from_flashinfer_metadata({**_FROZEN_FIELDS, "gpu": "NVIDIA H200"})
    b200 = Fingerprint.from_flashinfer_metadata({**_FROZEN_FIELDS, "gpu": "NVIDIA B200"})
    if schema.features_of(_frozen_revision(frozen)) is not None:
        # A revision this code uses as it is (rolling upgrades) moves only by `db upgrade`.
        with RegistrySchema.open(str(path), create=False) as target:
            target.upgrade()

    cold = h200.with_measurement({"measure_cold_l2": "True"})
    measured = frozen.name >= "registry-0010"  # a sixth commit: H200 under cold_l2

    with Registry.open(str(path)) as reg:
        assert reg.stats().revision == HEAD
        infos = {i.fingerprint: i for i in reg.fingerprints()}
        assert {fp: i.entries for fp, i in infos.items()} == {
            h200: 4,
            b200: 0,
            **({cold: 1} if measured else {}),
        }
        log = reg.log()
        if measured:  # its own fingerprint: nothing of H200's default policy replaced
            cold_commit = log.pop(0)
            assert (cold_commit.message, cold_commit.added, cold_commit.protocol_added) == (
                "frozen cold_l2 environment",
                1,
                1,
            )
            cold_text, _n = reg.export_text(infos[cold].id)
            assert json.loads(cold_text)[_frozen_key(16)] == ["CutlassFp4Runner", 4]
            assert plan_v2_export(reg, infos[cold].id).measurement == {"measure_cold_l2": "True"}
        if frozen.name >= "registry-0009":  # a fifth commit: protocol records (checked below)
            protocol_commit = log.pop(0)
            assert (protocol_commit.kind, protocol_commit.message) == (
                "import",
                "frozen protocol records",
            )
            assert (protocol_commit.added, protocol_commit.protocol_added) == (0, 2)
        assert [(c.kind, c.added, c.replaced, c.removed, c.host) for c in log] == [
            ("prune", 0, 0, 1, "frozen-host"),
            ("import", 0, 1, 0, "frozen-host"),
            ("import", 1, 0, 0, "frozen-host"),
            ("import", 4, 0, 0, "frozen-host"),
        ]
        text, n = reg.export_text(infos[h200].id, scope="tp2/rank1")
        assert n == 3
        exported = json.loads(text)
        exported.pop("_records", None)  # checked below, for the registries that hold records
        assert exported.pop("_generation")  # derived from the content (render_file)
        assert exported == {
            "_metadata": h200.flashinfer_metadata(),
            _frozen_key(16): ["CutlassFp4Runner", 9],
            _frozen_key(32): ["CutlassFp4Runner", 6],
            _frozen_key(64, '(torch.float8_e4m3fn, None, "it\'s")'): ["CutlassFp4Runner", -1],
        }
        # old data stays writable: undo the prune
        prune = log[0].id
        assert reg.revert(prune).added == 1
        assert {i.fingerprint: i.entries for i in reg.fingerprints()} == {
            h200: 4,
            b200: 1,
            **({cold: 1} if measured else {}),
        }

    # 0002 recovered what each past change wrote (from the next change, or the
    # entry as it stands) and when each entry was tuned.
    conn = sqlite3.connect(path)
    try:
        changes = [
            (commit, action, scope, key, json.loads(new) if new is not None else None)
            for commit, action, scope, key, new in conn.execute(
                "SELECT commit_id, action, scope, key, new_tactic FROM entry_changes "
                "WHERE commit_id <= 4 ORDER BY id"
            )
        ]
        untimed = conn.execute("SELECT count(*) FROM entries WHERE tuned_at IS NULL").fetchone()
    finally:
        conn.close()
    k64 = _frozen_key(64, '(torch.float8_e4m3fn, None, "it\'s")')
    assert sorted(changes, key=repr) == sorted(
        [
            (1, "added", "shared", _frozen_key(16), [3, [1, 2]]),
            (1, "added", "shared", _frozen_key(32), 5),
            (1, "added", "shared", k64, -1),
            (1, "added", "shared", _frozen_key(16), 7),  # the B200 entry
            (2, "added", "tp2/rank1", _frozen_key(16), 9),
            (3, "replaced", "shared", _frozen_key(32), 6),
            (4, "removed", "shared", _frozen_key(16), None),
        ],
        key=repr,
    )
    assert untimed == (0,)
    # 0006 stored the one policy once, named by the entry and its change rows.
    assert query(path, "SELECT policy FROM policies") == [
        ('["cuda_graph_profile_replays",null,"l2_cache_policy","hot"]',)
    ]
    assert (
        query(
            path,
            "SELECT e.scope, e.key FROM entries e JOIN policies p ON p.id = e.policy_id "
            "UNION ALL SELECT h.scope, h.key FROM entry_changes h "
            "JOIN policies p ON p.id = h.new_policy_id",
        )
        == [("shared", _frozen_key(16))] * 2
    )
    if frozen.name >= "registry-0003":  # records are frozen from 0003_records on
        with Registry.open(str(path)) as reg:
            text, _n = reg.export_text(infos[h200].id, scope="tp2/rank1")
            shared, _n = reg.export_text(infos[h200].id)
        assert json.loads(text)["_records"] == {
            "trtllm_moe_da": {'{"num_tokens":16}': {"schema": 1, "bodies": [{"tile_n": 16}]}}
        }
        assert json.loads(shared)["_records"] == {
            "trtllm_moe_da": {'{"num_tokens":16}': {"schema": 1, "bodies": [{"tile_n": 8}]}}
        }
    else:  # older registries upgrade to an empty records table
        assert query(path, "SELECT count(*) FROM records") == [(0,)]
    selections = query(
        path,
        "SELECT 'entry', selection FROM entries WHERE selection IS NOT NULL UNION ALL "
        "SELECT 'change', new_selection FROM entry_changes WHERE new_selection IS NOT NULL",
    )
    if frozen.name >= "registry-0004":  # a selection is frozen from 0004_selection on
        selection = '{"candidates":7,"margin":0.065041,"runner_up_ms":0.0131,"time_ms":0.0123}'
        assert sorted(selections) == [("change", selection), ("entry", selection)]
        with Registry.open(str(path)) as reg:
            shared, _n = reg.export_text(infos[h200].id)
        assert json.loads(shared)[_frozen_key(16)] == [
            "CutlassFp4Runner",
            [3, [1, 2]],
            ["cuda_graph_profile_replays", None, "l2_cache_policy", "hot"],
            json.loads(selection),
        ]
    else:  # older registries upgrade with no selections (FlashInfer 0.7.2 wrote none)
        assert selections == []
    with Registry.open(str(path)) as reg:
        counts = {fid: rest for fid, *rest in reg.stats().start_counts}
    if frozen.name >= "registry-0008":  # start counts are frozen from 0008_start_counts on
        assert counts == {
            infos[h200].id: [5, 2, 3],
            infos[b200].id: [0, 0, 0],
            **({infos[cold].id: [0, 0, 0]} if measured else {}),
        }
    else:  # older registries upgrade with every count at 0
        assert counts == {infos[h200].id: [0, 0, 0], infos[b200].id: [0, 0, 0]}
    protocol = query(
        path,
        "SELECT r.fingerprint_id, r.scope, r.namespace, r.key, r.value, p.policy, r.commit_id "
        "FROM protocol_records r LEFT JOIN policies p ON p.id = r.policy_id "
        "WHERE r.commit_id <= 5 ORDER BY r.key",
    )
    if frozen.name >= "registry-0009":  # protocol records are frozen from 0009 on
        hot = '["cuda_graph_profile_replays",null,"l2_cache_policy","hot"]'
        assert protocol == [
            (infos[h200].id, "shared", "moe_ep_megamoe", "", "7", hot, 5),
            (
                infos[h200].id,
                "shared",
                "moe_ep_megamoe",
                '{"tokens":128}',
                '{"knobs":[4,2],"ok":true}',
                None,
                5,
            ),
        ]
        # never mixed with the v1 records: these stay the namespaced records of 0003
        assert query(path, "SELECT DISTINCT namespace FROM records") == [("trtllm_moe_da",)]
        with Registry.open(str(path)) as reg:  # and still writable: revert their commit
            assert reg.revert(protocol_commit.id).protocol_removed == 2
        assert query(path, "SELECT count(*) FROM protocol_records") == [(1 if measured else 0,)]
    else:  # older registries upgrade to empty protocol record tables
        assert protocol == []
        assert query(path, "SELECT count(*) FROM protocol_record_changes") == [(0,)]


def test_downgrading_below_0003_drops_records_and_their_commits_only(
    cli, cache_file, registry_path: Path
) -> None:
    key = str(("flashinfer::mm_fp4", "CutlassRunner", ((16, 4096),), ("torch.bfloat16",)))
    meta = {"gpu": "NVIDIA H200"}
    both = cache_file(
        "both.json", {"_records": {"ns": {"a": 1}}, key: ["CutlassRunner", 1]}, metadata=meta
    )
    only = cache_file("only.json", {"_records": {"ns": {"b": [2]}}}, metadata=meta)
    assert cli("import", both).exit_code == 0
    assert cli("import", only).exit_code == 0
    assert cli("revert", "2", "--yes").exit_code == 0  # a commit of records only, reverted
    assert [r[0] for r in query(registry_path, "SELECT id FROM commits ORDER BY id")] == [1, 2, 3]

    down = cli("db", "downgrade", "0002_fleet", "--yes")

    assert down.exit_code == 0, down.stderr
    assert revision(registry_path) == [("0002_fleet",)]
    assert tables(registry_path) == TABLES - {
        "records",
        "record_changes",
        "policies",
        "schema_compat",
        "protocol_records",  # from 0009, above 0002 too
        "protocol_record_changes",
    }
    # The import of entries and records keeps its entries; the records-only ones are gone.
    assert query(registry_path, "SELECT id, added FROM commits") == [(1, 1)]
    assert cli("verify").exit_code == 1  # stale (0002), and says so
    assert cli("db", "upgrade", "--yes").exit_code == 0
    assert cli("verify").stdout.endswith("ok: no problems\n")
    assert query(registry_path, "SELECT count(*) FROM records") == [(0,)]
    again = cli("import", both)
    assert again.stdout.startswith("imported 1 entries and 1 records from 1 file(s): 0 added")


def test_downgrading_below_0004_drops_selections_and_keeps_values(
    cli, cache_file, registry_path: Path
) -> None:
    key = str(("flashinfer::mm_fp4", "CutlassRunner", ((16, 4096),), ("torch.bfloat16",)))
    selection = {"time_ms": 0.01, "runner_up_ms": 0.012, "margin": 0.2, "candidates": 5}
    four = cache_file(
        "four.json",
        {key: ["CutlassRunner", 3, ["cuda_graph_profile_replays", None], selection]},
        metadata={"gpu": "NVIDIA H200"},
    )
    assert cli("import", four).exit_code == 0

    down = cli("db", "downgrade", "0003_records", "--yes")

    assert down.exit_code == 0, down.stderr
    assert revision(registry_path) == [("0003_records",)]
    columns = {row[1] for row in query(registry_path, "PRAGMA table_info(entries)")}
    assert "selection" not in columns
    assert query(registry_path, "SELECT runner, tactic, policy FROM entries") == [
        ("CutlassRunner", "3", '["cuda_graph_profile_replays",null]')
    ]
    assert cli("db", "upgrade", "--yes").exit_code == 0
    assert cli("verify").stdout.endswith("ok: no problems\n")
    assert query(registry_path, "SELECT selection FROM entries") == [(None,)]
    # The same value again is unchanged: the selection is not part of it.
    again = cli("import", four)
    assert again.stdout.startswith("imported 1 entries from 1 file(s): 0 added, 0 replaced, 1 unch")


def test_downgrading_below_0006_puts_policies_and_key_columns_back(
    cli, cache_file, registry_path: Path
) -> None:
    def key(m: int) -> str:
        return str(("flashinfer::mm_fp4", "CutlassRunner", ((m, 4096),), ("torch.bfloat16", 1)))

    hot = ["cuda_graph_profile_replays", None, "l2_cache_policy", "hot"]
    meta = {"gpu": "NVIDIA H200"}
    first = cache_file(
        "a.json",
        {key(16): ["CutlassRunner", 1, hot], key(32): ["CutlassRunner", 2, ["cold"]]},
        metadata=meta,
    )
    second = cache_file(
        "b.json",
        {key(16): ["CutlassRunner", 3, ["cold"]], key(64): ["CutlassRunner", [4, 5]]},
        metadata=meta,
    )
    assert cli("import", first).exit_code == 0
    assert cli("import", second).exit_code == 0  # replaces key(16): the hot policy is an old value
    before = cli("export", "--fingerprint", "1").stdout
    assert json.loads(before)[key(16)] == ["CutlassRunner", 3, ["cold"]]
    assert query(registry_path, "SELECT count(*) FROM policies") == [(2,)]

    down = cli("db", "downgrade", "0005_drop_op_index", "--yes")

    assert down.exit_code == 0, down.stderr
    assert "policies" not in tables(registry_path)
    assert query(registry_path, "SELECT key, shapes, extras, policy FROM entries ORDER BY key") == [
        (key(16), "[[16, 4096]]", "('torch.bfloat16', 1)", '["cold"]'),
        (key(32), "[[32, 4096]]", "('torch.bfloat16', 1)", '["cold"]'),
        (key(64), "[[64, 4096]]", "('torch.bfloat16', 1)", None),
    ]
    hot_json = '["cuda_graph_profile_replays",null,"l2_cache_policy","hot"]'
    assert query(
        registry_path,
        "SELECT action, key, old_policy, new_policy FROM entry_changes ORDER BY id",
    ) == [
        ("added", key(16), None, hot_json),
        ("added", key(32), None, '["cold"]'),
        ("added", key(64), None, None),
        ("replaced", key(16), hot_json, '["cold"]'),
    ]
    assert cli("db", "upgrade", "--yes").exit_code == 0
    assert cli("verify").stdout.endswith("ok: no problems\n")
    assert cli("export", "--fingerprint", "1").stdout == before
    assert cli("revert", "2", "--yes").exit_code == 0  # the old policy comes back by its id
    restored = json.loads(cli("export", "--fingerprint", "1").stdout)
    assert restored[key(16)] == ["CutlassRunner", 1, hot]


def test_downgrading_below_0008_drops_the_start_counts_and_keeps_everything_else(
    cli, cache_file, registry_path: Path
) -> None:
    assert cli("import", entry_file(cache_file)).exit_code == 0
    assert cli("import", entry_file(cache_file, "b.json", m=32)).exit_code == 0
    with closing(sqlite3.connect(registry_path)) as conn, conn:
        conn.execute(
            "UPDATE fingerprints SET served_starts = 4, replay_starts = 1, replay_misses = 2"
        )
    entries_before = query(registry_path, "SELECT key, tactic, commit_id FROM entries ORDER BY key")

    plan = cli("db", "downgrade", "0007_compat", "--dry-run")
    down = cli("db", "downgrade", "0007_compat", "--yes")

    assert "  0008_start_counts -> 0007_compat: the start counts of 1 fingerprints\n" in plan.stdout
    assert down.exit_code == 0, down.stderr
    assert revision(registry_path) == [("0007_compat",)]
    columns = {row[1] for row in query(registry_path, "PRAGMA table_info(fingerprints)")}
    assert not columns & {"served_starts", "replay_starts", "replay_misses"}
    assert "last_served_at" in columns
    assert query(registry_path, "SELECT key, tactic, commit_id FROM entries ORDER BY key") == (
        entries_before
    )
    assert cli("db", "upgrade", "--yes").exit_code == 0
    assert cli("verify").stdout.endswith("ok: no problems\n")
    assert query(
        registry_path, "SELECT served_starts, replay_starts, replay_misses FROM fingerprints"
    ) == [(0, 0, 0)]


def test_downgrading_below_0009_drops_protocol_records_and_their_commits_only(
    cli, cache_file, registry_path: Path
) -> None:
    from ficache.values import NewProtocolRecord

    assert cli("import", entry_file(cache_file)).exit_code == 0
    fp = Fingerprint.from_flashinfer_metadata({**_FROZEN_FIELDS, "gpu": "NVIDIA H200"})
    with Registry.open(str(registry_path)) as reg:
        only = reg.write(
            [],
            kind="import",
            protocol_records=[NewProtocolRecord(fp, "moe_ep", "k", '{"a":1}', '["hot"]')],
        )
        assert (only.protocol_added, only.changed, only.records_changed) == (1, 0, 0)
        assert reg.revert(only.commit_id).protocol_removed == 1
        again = reg.write(
            [], kind="import", protocol_records=[NewProtocolRecord(fp, "moe_ep", "k", "2")]
        )
        assert again.protocol_added == 1
    entries_before = query(registry_path, "SELECT key, tactic, commit_id FROM entries ORDER BY key")
    commits_before = query(registry_path, "SELECT id FROM commits ORDER BY id")

    plan = cli("db", "downgrade", "0008_start_counts", "--dry-run")
    down = cli("db", "downgrade", "0008_start_counts", "--yes")

    assert (
        "  0009_protocol_records -> 0008_start_counts: 1 protocol records, 3 protocol record "
        "change rows and 3 commits that changed only protocol records\n"
    ) in plan.stdout
    assert down.exit_code == 0, down.stderr
    assert revision(registry_path) == [("0008_start_counts",)]
    assert "protocol_records" not in tables(registry_path)
    assert "protocol_record_changes" not in tables(registry_path)
    columns = {row[1] for row in query(registry_path, "PRAGMA table_info(commits)")}
    assert not columns & {"protocol_added", "protocol_replaced", "protocol_removed"}
    assert query(registry_path, "SELECT key, tactic, commit_id FROM entries ORDER BY key") == (
        entries_before
    )
    assert query(registry_path, "SELECT id FROM commits ORDER BY id") == commits_before[:1]
    assert cli("db", "upgrade", "--yes").exit_code == 0
    assert cli("verify").stdout.endswith("ok: no problems\n")
    assert query(registry_path, "SELECT count(*) FROM protocol_records") == [(0,)]


def test_downgrading_below_0010_drops_what_0009_cannot_keep_apart_and_recounts(
    cli, cache_file, registry_path: Path
) -> None:
    """A commit holding both policies keeps its default-policy changes (recounted); a
    commit holding only the other policy's goes; the default policy's data is untouched."""
    from ficache.values import NewEntry, NewProtocolRecord

    fp = Fingerprint.from_flashinfer_metadata({**_FROZEN_FIELDS, "gpu": "NVIDIA H200"})
    cold = fp.with_measurement({"measure_cold_l2": "True"})
    k16, k32 = _frozen_key(16), _frozen_key(32)
    with Registry.open(str(registry_path)) as reg:
        both = reg.write(
            [
                NewEntry(fp, k16, "CutlassFp4Runner", "1"),
                NewEntry(cold, k16, "CutlassFp4Runner", "2"),
            ],
            kind="import",
            protocol_records=[NewProtocolRecord(cold, "moe_ep", "k", "3")],
        )
        only_cold = reg.write([NewEntry(cold, k32, "CutlassFp4Runner", "4")], kind="import")
        assert (both.added, both.protocol_added, only_cold.added) == (2, 1, 1)
    kept = query(
        registry_path,
        "SELECT fingerprint_id, key, tactic, commit_id FROM entries "
        "WHERE fingerprint_id = 1 ORDER BY key",
    )

    plan = cli("db", "downgrade", "0009_protocol_records", "--dry-run")
    down = cli("db", "downgrade", "0009_protocol_records", "--yes")

    assert (
        "  0010_measurement_fingerprints -> 0009_protocol_records: 1 fingerprints under a "
        "non-default measurement policy, with their 2 entries, 0 records, 1 protocol records "
        "and 3 change rows (commits touching them: 2, removed where nothing else remains)\n"
    ) in plan.stdout
    assert down.exit_code == 0, down.stderr
    assert revision(registry_path) == [("0009_protocol_records",)]
    assert "measurement" not in {
        r[1] for r in query(registry_path, "PRAGMA table_info(fingerprints)")
    }
    assert query(registry_path, "SELECT id FROM fingerprints") == [(1,)]
    assert (
        query(
            registry_path, "SELECT fingerprint_id, key, tactic, commit_id FROM entries ORDER BY key"
        )
        == kept
    )
    assert query(registry_path, "SELECT count(*) FROM protocol_records") == [(0,)]
    assert query(registry_path, "SELECT id, added, protocol_added FROM commits ORDER BY id") == [
        (both.commit_id, 1, 0)
    ]
    assert cli("db", "upgrade").exit_code == 0
    assert cli("verify").stdout.endswith("ok: no problems\n")


_FROZEN_FIELDS = {
    "flashinfer_version": "0.7.2.post1",
    "cuda_version": "12.9",
    "cublas_version": "12.9.1",
    "cudnn_version": "91002",
    "cudnn_frontend_version": "1.32.0",
    "cutlass_dsl_version": "nvidia-cutlass-dsl==4.8.1",
}


def _frozen_revision(frozen: Path) -> str:
    return frozen.name.removeprefix("registry-").removesuffix(".db")


def _frozen_key(m: int, extras: str = "(torch.bfloat16, 1)") -> str:
    return f"('flashinfer::mm_fp4', 'CutlassFp4Runner', (({m}, 4096), (4096, 2048)), {extras})"


# -- concurrent first open -------------------------------------------------------------

_OPEN_AT = """
import sys, time
from ficache.registry import Registry
from ficache.registry_schema import RegistrySchema
start = float(sys.argv[2])
while time.time() < start:
    time.sleep(0.001)
with Registry.open(sys.argv[1]) as reg:
    print(reg.stats().revision)
"""


def test_several_processes_opening_a_new_registry_at_once(tmp_path: Path) -> None:
    path = tmp_path / "new" / "registry.db"
    start = time.time() + 3.0  # after every interpreter has imported ficache
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _OPEN_AT, str(path), repr(start)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    results = [p.communicate(timeout=120) for p in procs]

    assert [(p.returncode, out, err) for p, (out, err) in zip(procs, results, strict=True)] == [
        (0, f"{HEAD}\n", "")
    ] * 4
    assert tables(path) == TABLES
    assert revision(path) == [(HEAD,)]


def test_a_registry_path_with_uri_characters(cli, cache_file, tmp_path: Path) -> None:
    odd = tmp_path / "odd #1?x=%41 dir" / "registry.db"
    data = cache_file("a.json", {"('mm', 'R', ((1,),), ())": ["R", 1]}, metadata={"gpu": "H200"})
    assert cli("import", data, db=odd).exit_code == 0
    odd.chmod(0o444)  # read-only registries are opened through a SQLite URI

    listed = cli("list", "--format", "json", db=odd)

    assert listed.exit_code == 0
    assert [row["key"] for row in json.loads(listed.stdout)] == ["('mm', 'R', ((1,),), ())"]
    assert sorted(os.listdir(tmp_path)) == ["a.json", "odd #1?x=%41 dir"]
    assert os.listdir(odd.parent) == ["registry.db"]


# -- reads never upgrade; a shared registry moves only by `db upgrade` ------------------


def _older_line(db: str, revision: str) -> str:
    return (
        f"error: registry {schema.resolve(db).display} is at schema {revision!r}, older than "
        f"this ficache ({HEAD!r}); run `ficache db upgrade`\n"
    )


@pytest.mark.usefixtures("backend")
@pytest.mark.parametrize(
    "command",
    [
        ("stats",),
        ("list",),
        ("export", "--fingerprint", "1"),
        ("log",),
        ("show", "1"),
        ("fingerprints",),
        ("export", "--bundle", "-", "--all"),
        ("import", "{file}", "--dry-run"),
    ],
    ids=["stats", "list", "export", "log", "show", "fingerprints", "bundle-export", "import-dry"],
)
def test_a_read_never_upgrades_an_older_schema(
    cli, cache_file, registry_db: str, dump_db, command: tuple[str, ...]
) -> None:
    assert cli("import", entry_file(cache_file)).exit_code == 0
    assert cli("db", "downgrade", "0004_selection", "--yes").exit_code == 0
    other = entry_file(cache_file, "b.json", m=32)  # what `import --dry-run` would add
    before = dump_db(registry_db)

    result = cli(*(str(other) if word == "{file}" else word for word in command))

    if command[0] == "import" and not registry_db.startswith("postgresql"):
        # A local file the real import would upgrade first: the dry run plans it on an
        # upgraded copy and says so (tests/test_rolling_upgrade.py, issue 35 bug 6).
        display = schema.resolve(registry_db).display
        assert (result.exit_code, result.stderr) == (
            0,
            f"note: the import would first upgrade registry {display} from schema "
            f"'0004_selection' to {HEAD!r} (a local file older than "
            f"{schema.oldest_readable()!r}, which this ficache cannot use as it is)\n",
        )
        assert result.stdout.startswith("would import 1 entries from 1 file(s): 1 added")
    else:
        assert (result.exit_code, result.stdout, result.stderr) == (
            1,
            "",
            _older_line(registry_db, "0004_selection"),
        )
    assert dump_db(registry_db) == before
    assert cli("db", "current").stdout == f"0004_selection (head {HEAD}: needs upgrade)\n"


@pytest.mark.usefixtures("backend")
def test_a_read_never_recreates_a_schema_downgraded_to_base(
    cli, cache_file, registry_db: str, dump_db
) -> None:
    assert cli("import", entry_file(cache_file)).exit_code == 0
    assert cli("db", "downgrade", "base", "--yes").exit_code == 0
    before = dump_db(registry_db)

    result = cli("stats")

    assert (result.exit_code, result.stderr) == (
        1,
        f"error: registry {schema.resolve(registry_db).display} is empty (no schema revision), "
        f"older than this ficache ({HEAD!r}); run `ficache db upgrade`\n",
    )
    assert dump_db(registry_db) == before


@pytest.mark.usefixtures("backend")
def test_a_write_upgrades_an_older_sqlite_file_but_never_a_shared_registry(
    cli, cache_file, registry_db: str, registry_path: Path, dump_db
) -> None:
    assert cli("import", entry_file(cache_file)).exit_code == 0
    assert cli("db", "downgrade", "0004_selection", "--yes").exit_code == 0
    before = dump_db(registry_db)

    result = cli("import", entry_file(cache_file, "b.json", m=32))

    if registry_db == str(registry_path):  # a local file: upgraded under the lock, as before
        assert result.exit_code == 0, result.stderr
        assert revision(registry_path) == [(HEAD,)]
    else:  # PostgreSQL, shared by servers of other ficache versions: only `db upgrade`
        assert (result.exit_code, result.stderr) == (
            1,
            f"error: registry {schema.resolve(registry_db).display} is at schema "
            f"'0004_selection', older than this ficache ({HEAD!r}); a shared registry is "
            "upgraded only by `ficache db upgrade`\n",
        )
        assert dump_db(registry_db) == before
        assert cli("db", "upgrade", "--yes").exit_code == 0
        assert cli("import", entry_file(cache_file, "b.json", m=32)).exit_code == 0
    assert len(json.loads(cli("list", "--format", "json").stdout)) == 2


# -- db downgrade says what it drops --------------------------------------------------------


@pytest.mark.usefixtures("backend")
def test_a_downgrade_plan_counts_what_each_step_drops(
    cli, cache_file, registry_db: str, dump_db
) -> None:
    key = str(("flashinfer::mm_fp4", "CutlassRunner", ((16, 4096),), ("torch.bfloat16",)))
    selection = {"time_ms": 0.01, "runner_up_ms": 0.012, "margin": 0.2, "candidates": 5}
    four = cache_file(
        "four.json",
        {"_records": {"ns": {"a": 1, "b": 2}}, key: ["CutlassRunner", 3, ["hot"], selection]},
        metadata={"gpu": "NVIDIA H200"},
    )
    only = cache_file("only.json", {"_records": {"ns": {"c": 3}}}, metadata={"gpu": "NVIDIA H200"})
    assert cli("import", four).exit_code == 0
    assert cli("import", only).exit_code == 0
    before = dump_db(registry_db)

    dry = cli("db", "downgrade", "0002_fleet", "--dry-run")

    assert (dry.exit_code, dry.stdout) == (
        0,
        f"downgrade plan: {schema.resolve(registry_db).display} from {HEAD} to 0002_fleet\n"
        "  0010_measurement_fingerprints -> 0009_protocol_records: keeps every stored value\n"
        "  0009_protocol_records -> 0008_start_counts: keeps every stored value\n"
        "  0008_start_counts -> 0007_compat: keeps every stored value\n"
        "  0007_compat -> 0006_policies: keeps every stored value\n"
        "  0006_policies -> 0005_drop_op_index: keeps every stored value\n"
        "  0005_drop_op_index -> 0004_selection: keeps every stored value\n"
        "  0004_selection -> 0003_records: the selections of 1 entries and 1 change rows\n"
        "  0003_records -> 0002_fleet: 3 records, 3 record change rows and 1 commits that "
        "changed only records\n"
        "upgrading again does not bring back what a step drops\n"
        "dry run: nothing changed\n",
    )
    assert dump_db(registry_db) == before
    down = cli("db", "downgrade", "0003_records", "--yes")
    assert down.exit_code == 0, down.stderr
    assert "0004_selection -> 0003_records: the selections of 1 entries" in down.stdout
    assert cli("db", "upgrade", "--yes").exit_code == 0
    plan = cli("db", "downgrade", "0003_records", "--dry-run")  # nothing left to lose
    assert "0004_selection -> 0003_records: keeps every stored value\n" in plan.stdout
    assert "upgrading again" not in plan.stdout


# -- rolling upgrades: servers of two ficache versions share one registry -----------------


def _stamp_future(db: str, readable_from: str, writable_from: str) -> None:
    """Make the registry ``db`` look as a future ficache at ``0099_future`` leaves it."""
    location = schema.resolve(db)
    engine = create_engine(location.url)
    try:
        with engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = '0099_future'"))
            conn.execute(
                text(
                    "UPDATE schema_compat SET revision = '0099_future', "
                    "readable_from = :r, writable_from = :w"
                ),
                {"r": readable_from, "w": writable_from},
            )
    finally:
        engine.dispose()


@pytest.mark.usefixtures("backend")
def test_a_newer_schema_readable_but_not_writable_serves_reads_and_refuses_writes(
    cli, cache_file, registry_db: str, dump_db
) -> None:
    assert cli("import", entry_file(cache_file)).exit_code == 0
    _stamp_future(registry_db, HEAD, "0099_future")
    before = dump_db(registry_db)

    listed = cli("list", "--format", "json")
    imported = cli("import", entry_file(cache_file, "b.json", m=32))

    assert listed.exit_code == 0, listed.stderr
    assert len(json.loads(listed.stdout)) == 1
    assert (imported.exit_code, imported.stderr) == (
        1,
        f"error: registry {schema.resolve(registry_db).display} has schema revision "
        f"'0099_future', which only ficache with schema '0099_future' or newer may write "
        f"(this one's head is {HEAD!r}); upgrade ficache (pip install -U ficache)\n",
    )
    assert dump_db(registry_db) == before


@pytest.mark.usefixtures("backend")
def test_a_newer_schema_this_code_cannot_read_is_refused_as_before(
    cli, cache_file, registry_db: str, dump_db
) -> None:
    assert cli("import", entry_file(cache_file)).exit_code == 0
    _stamp_future(registry_db, "0099_future", "0099_future")
    before = dump_db(registry_db)

    for command in (("list",), ("import", entry_file(cache_file, "b.json", m=32))):
        result = cli(*command)
        assert (result.exit_code, result.stderr) == (
            1,
            f"error: registry {schema.resolve(registry_db).display} has schema revision "
            f"'0099_future', newer than this ficache knows (head {HEAD!r}); "
            "upgrade ficache (pip install -U ficache)\n",
        )
    assert dump_db(registry_db) == before


@pytest.mark.usefixtures("backend")
def test_a_rolling_upgrade_previous_release_serves_and_commits_on_the_newer_schema(
    cli, cache_file, registry_db: str, registry_path: Path, tmp_path: Path
) -> None:
    """2 gloo ranks of this code, a future additive revision applied between two warm starts.

    SQLite starts from this release's frozen registry; PostgreSQL from an empty database.
    """
    import future_schema as future
    import gloo_scenarios

    from ficache._ranks import run_ranks

    root = tmp_path / "ranks"
    where = root / "future_schema"
    where.mkdir(parents=True)
    future.write_future_migrations(where)
    db = registry_db
    if registry_db == str(registry_path):
        db = str(where / "registry.db")
        shutil.copyfile(DATA / f"registry-{HEAD}.db", db)

    results = run_ranks(
        gloo_scenarios.run_plan,
        2,
        str(root),
        ["future_schema"],
        {"future_schema": db},
        timeout=420,
        group_timeout=60,
    )

    for rank, result in enumerate(results):
        out = result["future_schema"]
        assert "error" not in out, f"rank {rank}:\n{out['error']}"
        setup, later = out["setup"]["report"], out["future"]["report"]
        assert (setup["status"], setup["committed"], setup["reason"]) == ("cold", 12, None)
        assert (later["status"], later["loaded"], later["tuned"]) == ("partial", 12, 6)
        assert (later["committed"], later["reason"], out["future"]["exception"]) == (6, None, None)
        assert later["commit_id"] == setup["commit_id"] + 1
    imported = cli("import", entry_file(cache_file), db=db)
    assert imported.exit_code == 0, imported.stderr
    assert imported.stdout.startswith("imported 1 entries from 1 file(s): 1 added")
    assert future.future_state(db) == {
        "revision": [(future.REVISION,)],
        "compat": [(future.REVISION, HEAD, HEAD)],
        "notes": [(1, "kept by older ficache")],
        "future_note": True,
        "noted": 0,
    }


# -- the previous releases against the newer frozen registries ----------------------------------


def _revisions_with_parent_commit() -> list[tuple[str, str]]:
    """(revision, the commit before the one that added it) for each revision after the first."""
    out = []
    for rev, down, _title in schema.history():
        if down is None:
            continue
        added = past_releases.commit_adding(rev)
        out.append((rev, f"{added}^" if added else ""))
    return out


@pytest.mark.parametrize(
    ("rev", "parent"), _revisions_with_parent_commit(), ids=lambda v: v if "_" in v else ""
)
def test_the_previous_release_refuses_the_newer_frozen_registry_and_leaves_it(
    rev: str, parent: str, tmp_path: Path
) -> None:
    """The code before each migration up to ``0007_compat`` predates ``schema_compat``: it
    refuses any newer revision. From then on, the previous release reads the revision's
    ``schema_compat`` row; a revision readable from it (``readable_from``) is served.

    One CLI call (``stats``) per revision, from a ``git archive`` of that commit.
    """
    if not parent:
        pytest.skip(f"no git history for migrations/versions/{rev}.py in this checkout")
    old = past_releases.release_tree(parent, tmp_path / "old")  # laid out as its wheel
    path = tmp_path / "registry.db"
    shutil.copyfile(DATA / f"registry-{rev}.db", path)
    before = path.read_bytes()

    result = subprocess.run(
        [sys.executable, "-m", "ficache", "--db", str(path), "stats"],
        cwd=old,
        env={**os.environ, "PYTHONPATH": str(old)},
        capture_output=True,
        text=True,
        timeout=120,
    )

    if rev > "0007_compat":  # that release reads schema_compat: this revision lets it read
        assert (result.returncode, result.stderr) == (0, ""), result.stderr
        # (the label column is as wide as the widest label that release prints)
        assert re.search(rf"^schema revision +{rev}$", result.stdout, re.MULTILINE)
        # Its read switched the file to WAL (a header byte): every row is as it was.
        frozen = DATA / f"registry-{rev}.db"
        with (
            closing(sqlite3.connect(path)) as now,
            closing(sqlite3.connect(f"{frozen.as_uri()}?mode=ro", uri=True)) as then,
        ):
            assert list(now.iterdump()) == list(then.iterdump())
        return
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.startswith(
        f"error: registry {path} has schema revision {rev!r}, newer than this ficache knows"
    ), result.stderr
    assert result.stderr.count("\n") == 1
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["old", "registry.db"]


# -- registry URLs: the forms operators write -------------------------------------------------


@pytest.mark.postgres
@pytest.mark.parametrize("scheme", ["postgres", "postgresql"])
def test_postgres_and_postgresql_urls_reach_the_server_from_the_cli_and_warm_start(
    cli, cache_file, postgres_url: str, autotuner, scheme: str
) -> None:
    import ficache
    from ficache.standin import standin_tune

    short = postgres_url.replace("postgresql+psycopg://", f"{scheme}://")
    assert short != postgres_url

    imported = cli("import", entry_file(cache_file), db=short)
    assert (imported.exit_code, imported.stderr) == (0, "")
    listed = cli("list", "--format", "json", db=short)
    assert (listed.exit_code, len(json.loads(listed.stdout))) == (0, 1)

    with ficache.warm_start(db=short) as ws:
        standin_tune()
    assert (ws.report.reason, ws.report.committed) == (None, 18)
    assert ws.report.registry == schema.resolve(postgres_url).display
    with Registry.open(postgres_url, create=False, write=False) as reg:
        assert [c.kind for c in reg.log()] == ["startup", "import"]


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("postgress://db.example/registry", "SQLAlchemy knows no database 'postgress'; give"),
        ("mysql://db.example/registry", "No module named 'MySQLdb'; install its driver, or give"),
    ],
)
def test_an_unknown_database_or_missing_driver_names_the_accepted_forms(
    cli, cache_file, url: str, why: str
) -> None:
    for args in (("list",), ("import", entry_file(cache_file))):
        result = cli(*args, db=url)
        assert (result.exit_code, result.stdout) == (1, "")
        assert result.stderr == (
            f"error: cannot use registry URL {url}: {why} {schema.ACCEPTED_FORMS}\n"
        )


def test_a_missing_psycopg_says_which_extra_to_install(tmp_path: Path) -> None:
    """psycopg made unimportable in a real CLI process (``sys.modules`` entry None)."""
    program = (
        "import sys; sys.modules['psycopg'] = None; from ficache.cli import main; "
        "main(['--db', 'postgres://fleet@127.0.0.1:1/registry', 'list'])"
    )
    result = subprocess.run(
        [sys.executable, "-c", program],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.startswith(
        "error: cannot use registry URL postgresql+psycopg://fleet@127.0.0.1:1/registry: "
    )
    assert result.stderr.endswith(
        "; install the PostgreSQL driver: pip install 'ficache[postgres]'\n"
    )
    assert result.stderr.count("\n") == 1


@pytest.mark.usefixtures("backend")
def test_registry_schema_reads_upgrades_and_downgrades_through_its_own_engine(
    registry_db: str,
) -> None:
    from ficache.registry_schema import RegistrySchema, RevisionState

    with RegistrySchema.open(registry_db, create=True) as target:
        assert target.revision() == RevisionState(None, HEAD)
        assert target.revision().state == "empty"
        assert target.upgrade("0001_registry") == "0001_registry"
        assert target.revision().state == "needs upgrade"
        assert target.upgrade() == HEAD
        assert target.revision() == RevisionState(HEAD, HEAD)
        assert target.revision().state == "up to date"
        plan = target.plan_downgrade("0001_registry")
        assert (plan.current, plan.target) == (HEAD, "0001_registry")
        target.downgrade(plan)
        assert target.revision().revision == "0001_registry"
        with pytest.raises(ConflictError, match="plan it again"):
            target.downgrade(plan)  # planned at head; the registry moved since
    # closed: its engine is disposed, and a new one reads what the last one wrote
    with RegistrySchema.open(registry_db, create=False) as again:
        assert again.revision().revision == "0001_registry"


def test_registry_schema_created_says_whether_it_made_the_sqlite_file(
    registry_path: Path,
) -> None:
    from ficache.registry_schema import RegistrySchema

    with RegistrySchema.open(str(registry_path), create=True) as target:
        assert target.created
        target.upgrade()
    with RegistrySchema.open(str(registry_path), create=True) as target:
        assert not target.created
