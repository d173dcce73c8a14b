"""FlashInfer's managed v2 store (``autotune_v2``) both ways, checked with
FlashInfer's own ``ManagedAutotuneCache`` and ``autotune_v2``.

FlashInfer cannot profile on a CPU, so ``publish_like_tuning`` is a stand-in
for tuning under ``autotune_v2``: it publishes each winner through
FlashInfer's own store class with the arguments ``AutoTuner`` passes when it
caches a profiled winner (``file_key``, runner, ``_tactic_to_json(tactic)``,
``key_fields``, ``profiling_policy``). Everything else is the real store.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import stat
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import torch
from flashinfer.autotune_cache import (
    ManagedAutotuneCache,
    ManagedCacheEntry,
    MeasurementPolicy,
    _encode_key_fields,
    autotune_v2,
)
from flashinfer.autotuner import ProfilingCacheKey, _collect_metadata, _tactic_to_json
from flashinfer_074 import require_protocol_records
from samples import H200_METADATA

from ficache.fingerprint import Fingerprint
from ficache.protocol_records import stored_protocol_records
from ficache.registry import Registry
from ficache.v2_store import encode_key_fields, read_store

HOT = ("cuda_graph_profile_replays", None, "l2_cache_policy", "hot")
COLD = ("cuda_graph_profile_replays", 3, "l2_cache_policy", "cold")
GRAPHS = MeasurementPolicy(execution_mode="cuda_graph")

#: (custom_op, runner, shapes, extras, tactic, profiling_policy or None).
TUNED: list[tuple[str, str, tuple, tuple, Any, tuple | None]] = [
    (
        "flashinfer::mm_fp4",
        "CutlassFp4GemmRunner",
        ((16, 4096), (4096, 2048)),
        (torch.bfloat16, 1),
        7,
        HOT,
    ),
    (
        "flashinfer::mm_fp4",
        "CutlassFp4GemmRunner",
        ((32, 4096), (4096, 2048)),
        (torch.bfloat16, 1),
        -1,
        HOT,
    ),
    (
        "flashinfer::trtllm_fp8_block_scale_moe",
        "TrtllmGenMoERunner",
        ((8, 7168), (256,)),
        (torch.float8_e4m3fn, 256, 8, None, 2.5, "renormalize"),
        (128, (1, 2), (3, (4, 5))),
        COLD,
    ),
    (
        "flashinfer::cute_dsl_moe",
        "CuteDslMoERunner",
        ((64, 2048),),
        (torch.float8_e5m2, True, float("-inf")),
        ((128, 64), 2, (0, 1)),
        None,
    ),
    ("flashinfer::attn", "BatchDecodeRunner", ((1, 32, 128), (4,)), ('it\'s "q"', 1e-05), [], None),
]


def cache_keys(tuned=TUNED) -> list[ProfilingCacheKey]:
    return [
        ProfilingCacheKey(op, runner, 1000 + i, shapes, extras)
        for i, (op, runner, shapes, extras, *_rest) in enumerate(tuned)
    ]


def publish_like_tuning(
    root: Path,
    *,
    policy: MeasurementPolicy | None = None,
    metadata: dict[str, str] | None = None,
    tuned=TUNED,
) -> ManagedAutotuneCache:
    """Stand-in for tuning under ``autotune_v2`` (no GPU here): FlashInfer's own store publishes."""
    manifest = dict(metadata if metadata is not None else _collect_metadata())
    if policy is not None:
        manifest.update(policy.manifest_fields())
    store = ManagedAutotuneCache(manifest=manifest, root=root)
    for key, (_op, runner, _shapes, _extras, tactic, profiling) in zip(
        cache_keys(tuned), tuned, strict=True
    ):
        store.publish(
            key.file_key,
            runner,
            _tactic_to_json(tactic),
            key_fields=key.key_fields,
            profiling_policy=profiling,
        )
    return store


def store_of(
    root: Path, policy: MeasurementPolicy | None = None, metadata: dict[str, str] | None = None
) -> ManagedAutotuneCache:
    """A fresh FlashInfer store object over ``root``, as ``autotune_v2`` builds one."""
    manifest = dict(metadata if metadata is not None else _collect_metadata())
    if policy is not None:
        manifest.update(policy.manifest_fields())
    return ManagedAutotuneCache(manifest=manifest, root=root)


def files_of(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def digest(metadata: dict[str, str], policy: MeasurementPolicy | None = None) -> str:
    """The fingerprint digest of an environment (under ``policy``'s manifest fields)."""
    fp = Fingerprint.from_flashinfer_metadata(metadata)
    return fp.with_measurement(policy.manifest_fields() if policy else {}).digest


# -- import ----------------------------------------------------------------------


def test_import_reads_every_environment_with_its_fingerprint_and_policy(
    cli, tmp_path: Path, registry_path: Path, created_note
) -> None:
    root = tmp_path / "autotune"
    here = publish_like_tuning(root, policy=GRAPHS)
    h200 = publish_like_tuning(root, metadata=H200_METADATA, tuned=TUNED[:2])
    # A protocol record (FlashInfer's own publish path for them): not a tactic, stored
    # as a protocol record of its own kind.
    fields = ("__protocol__", "trtllm_moe_da", "bucket8")
    here.publish(str(fields), "trtllm_moe_da", {"tiles": [1, 2]}, key_fields=fields)
    rows = sorted(
        [
            (here.env_hash, digest(_collect_metadata(), GRAPHS), "execution_mode=cuda_graph", 5),
            (h200.env_hash, digest(H200_METADATA), "default", 2),
        ]
    )

    result = cli("import", root)

    assert result.exit_code == 0
    assert result.stdout == (
        "environment       fingerprint   measurement                entries  skipped\n"
        + "".join(f"{h}  {d[:12]}  {m:<25}  {n:<7}  0\n" for h, d, m, n in rows)
        + "imported 7 entries from 2 environment(s): 7 added, 0 replaced, 0 unchanged (commit 1)\n"
        + "imported 1 protocol records (shared): 1 added, 0 replaced, 0 unchanged\n"
    )
    assert result.stderr == created_note(registry_path)
    # never a namespaced record: they stay apart from _records
    assert json.loads(cli("list", "--records", "--format", "json").stdout) == []
    with Registry.open(str(registry_path)) as reg, reg.engine.connect() as conn:
        assert [
            (r.scope, r.namespace, r.key, r.value_json, r.policy_json)
            for r in stored_protocol_records(conn)
        ] == [("shared", "trtllm_moe_da", "bucket8", '{"tiles":[1,2]}', None)]
    fingerprints = {
        f["digest"]: f for f in json.loads(cli("fingerprints", "--format", "json").stdout)
    }
    assert set(fingerprints) == {digest(_collect_metadata(), GRAPHS), digest(H200_METADATA)}
    stored_h200 = fingerprints[digest(H200_METADATA)]
    assert {k: stored_h200[k] for k in H200_METADATA} == H200_METADATA
    assert (stored_h200["compute_capability"], stored_h200["torch_version"]) == ("*", "*")
    entries = json.loads(cli("list", "--format", "json").stdout)
    by_key = {(e["fingerprint"], e["key"]): e for e in entries}
    here_id = fingerprints[digest(_collect_metadata(), GRAPHS)]["id"]
    for key, (*_fields, tactic, profiling) in zip(cache_keys(), TUNED, strict=True):
        entry = by_key[(here_id, key.file_key)]
        assert entry["tactic"] == _tactic_to_json(tactic)
        assert entry["policy"] == (list(profiling) if profiling is not None else None)
    [commit] = json.loads(cli("log", "--format", "json").stdout)
    environments = {e["env_hash"]: e for e in commit["provenance"]["v2_environments"]}
    assert commit["provenance"]["source"] == "flashinfer-v2-store"
    assert environments[here.env_hash]["measurement"] == {"measure_execution_mode": "cuda_graph"}
    assert environments[here.env_hash]["records"] == 1
    assert environments[h200.env_hash]["measurement"] == {}


def test_flashinfer_keeps_protocol_records_apart_from_namespaced_records(
    autotuner: Any, tmp_path: Path
) -> None:
    """Why protocol records are a kind of their own, never namespaced records
    (``ficache.protocol_records``): FlashInfer serves them through another API than
    ``_records``, never saves them in a cache file and never serves a ``_records`` value as
    one, so a ``_records`` export could give them back only as what they are not."""
    value = {"tiles": [1, 2]}
    autotuner.publish_protocol_record("trtllm_moe_da", "bucket8", value, persist=False)
    saved = tmp_path / "saved.json"
    autotuner.save_configs(str(saved))

    assert autotuner.get_protocol_records("trtllm_moe_da") == {"bucket8": value}
    assert autotuner.get_namespaced_records("trtllm_moe_da") == {}
    assert "_records" not in json.loads(saved.read_text())

    autotuner.clear_cache()
    as_records = tmp_path / "records.json"
    as_records.write_text(
        json.dumps(
            {
                "_metadata": dict(_collect_metadata()),
                "_records": {"trtllm_moe_da": {"bucket8": value}},
            }
        )
    )
    assert autotuner.load_configs(str(as_records)) is True
    assert autotuner.get_namespaced_records("trtllm_moe_da") == {"bucket8": value}
    assert autotuner.get_protocol_records("trtllm_moe_da") == {}


def test_one_environment_directory_imports_alone(
    cli, tmp_path: Path, registry_path: Path, created_note
) -> None:
    root = tmp_path / "autotune"
    publish_like_tuning(root, metadata=H200_METADATA)
    store = publish_like_tuning(root, policy=GRAPHS, tuned=TUNED[:1])

    result = cli("import", store.env_dir, "--format", "json")

    assert (result.exit_code, result.stderr) == (0, created_note(registry_path))
    report = json.loads(result.stdout)
    assert [e["env_hash"] for e in report["environments"]] == [store.env_hash]
    assert (report["entries"], report["added"], report["commit"]) == (1, 1, 1)


def test_importing_the_same_store_twice_makes_no_second_commit(cli, tmp_path: Path) -> None:
    root = tmp_path / "autotune"
    publish_like_tuning(root)
    assert cli("import", root).exit_code == 0

    again = cli("import", root)

    assert again.exit_code == 0
    assert again.stdout.endswith(
        "imported 5 entries from 1 environment(s): 0 added, 0 replaced, 5 unchanged "
        "(nothing new, no commit)\n"
    )


def test_two_stores_holding_one_key_differently_follow_on_conflict_and_dry_run(
    cli, tmp_path: Path, registry_path: Path
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    publish_like_tuning(first)
    retuned = [(*TUNED[0][:4], 77, TUNED[0][5]), *TUNED[1:]]
    publish_like_tuning(second, tuned=retuned)
    [key_of_retuned] = [k.file_key for k in cache_keys(retuned)[:1]]

    planned = cli("import", first, second, "--dry-run")

    assert planned.exit_code == 0
    assert planned.stdout.endswith(
        "would import 10 entries from 2 environment(s): 5 added, 0 replaced, 0 unchanged, "
        "4 duplicates, 1 conflicts (dry run: nothing changed)\n"
    )
    assert not registry_path.exists()
    refused = cli("import", first, second, "--on-conflict", "fail")
    assert (refused.exit_code, refused.stdout) == (1, "")
    assert refused.stderr.startswith(f"error: {first} and {second} hold different values for entry")
    assert not registry_path.exists()

    done = cli("import", first, second, "--on-conflict", "theirs")

    assert done.stdout.endswith(
        "imported 10 entries from 2 environment(s): 5 added, 0 replaced, 0 unchanged, "
        "4 duplicates, 1 conflicts (commit 1)\n"
    )
    listed = {e["key"]: e["tactic"] for e in json.loads(cli("list", "--format", "json").stdout)}
    assert listed[key_of_retuned] == 77


# -- export: FlashInfer serves it --------------------------------------------------


def test_an_export_is_served_by_flashinfers_own_store(cli, autotuner, tmp_path: Path) -> None:
    original = publish_like_tuning(tmp_path / "tuned", policy=GRAPHS)
    assert cli("import", tmp_path / "tuned").exit_code == 0
    out = tmp_path / "served"

    result = cli("export", "--v2-store", out, "--fingerprint", "current")

    served = store_of(out, GRAPHS)
    assert (result.exit_code, result.stderr) == (0, "")
    assert result.stdout == (
        f"exported 5 entries to {served.env_dir} (measurement policy execution_mode=cuda_graph): "
        "5 written, 0 unchanged\n"
    )
    for key in cache_keys():
        assert served.lookup(key.file_key) == original.lookup(key.file_key) is not None
    entries, total, skipped = store_of(out, GRAPHS).preload()
    assert (total, skipped) == (5, 0)
    assert sorted(map(str, (f for f, _ in entries))) == sorted(k.file_key for k in cache_keys())
    # Byte for byte what FlashInfer's own publish wrote.
    assert files_of(out) == files_of(tmp_path / "tuned")
    # autotune_v2 itself, attached with the same policy, hydrates every entry.
    with autotune_v2(
        mode="replay", cache_root=out, measurement_policy=GRAPHS, cache_scope="context"
    ):
        store = autotuner._active_managed_store
        hydrated = {k[2] for k in autotuner._managed_decoded if k[:2] == (str(out), store.env_hash)}
    assert store.env_dir == served.env_dir
    assert hydrated == {k.key_fields for k in cache_keys()}


#: Protocol records FlashInfer 0.7.4 publishes (a MegaMoE-like namespace): keys and values
#: of several shapes, an empty key and one needing quotes in the entry key's text.
PROTOCOL_VALUES = {
    "tokens=128": {"knobs": [4, 2], "ok": True},
    "": 7,
    'it\'s "q"': [1.5, None, "x"],
}


def test_protocol_records_round_trip_as_flashinfer_writes_and_reads_them(
    cli, autotuner, tmp_path: Path
) -> None:
    """FlashInfer's own ``publish_protocol_record(persist=True)`` writes them into a store;
    an import stores them as protocol records (shared, never ``_records``); an export writes
    them back byte for byte, and FlashInfer's own reader serves them from it."""
    tuned = tmp_path / "tuned"
    publish_like_tuning(tuned, policy=GRAPHS)
    with autotune_v2(
        mode="tune", cache_root=tuned, measurement_policy=GRAPHS, cache_scope="context"
    ):
        for key, value in PROTOCOL_VALUES.items():
            autotuner.publish_protocol_record("moe_ep_megamoe", key, value, persist=True)
    autotuner.clear_cache()
    imported = cli("import", tuned)
    assert imported.stdout.endswith(
        "imported 5 entries from 1 environment(s): 5 added, 0 replaced, 0 unchanged (commit 1)\n"
        "imported 3 protocol records (shared): 3 added, 0 replaced, 0 unchanged\n"
    )
    out = tmp_path / "served"

    result = cli("export", "--v2-store", out, "--fingerprint", "current")

    served = store_of(out, GRAPHS)
    assert (result.exit_code, result.stderr) == (0, "")
    assert result.stdout == (
        f"exported 5 entries and 3 protocol records to {served.env_dir} (measurement policy "
        "execution_mode=cuda_graph): 8 written, 0 unchanged\n"
    )
    assert files_of(out) == files_of(tuned)
    with autotune_v2(
        mode="replay", cache_root=out, measurement_policy=GRAPHS, cache_scope="context"
    ):
        assert autotuner.get_protocol_records("moe_ep_megamoe") == PROTOCOL_VALUES
    # Never exported into a v1 file's _records, nor served as namespaced records.
    v1 = json.loads(cli("export", "--fingerprint", "1").stdout)
    assert "_records" not in v1
    assert json.loads(cli("list", "--records", "--format", "json").stdout) == []
    again = cli("import", tuned)
    assert again.stdout.endswith(
        "imported 3 protocol records (shared): 0 added, 0 replaced, 3 unchanged\n"
    )


def test_a_store_is_dated_by_its_entry_files_through_import_and_adoption(
    cli, tmp_path: Path
) -> None:
    """The same v2 store imported into one registry and adopted (``--from-vllm``) into
    another: each entry is dated by its entry file's mtime both ways (import made it "now")."""
    root = tmp_path / "autotune"
    store = publish_like_tuning(root)
    dated = {}
    for n, entry_file in enumerate(sorted((store.env_dir / "entries").glob("*.json"))):
        os.utime(entry_file, (1000.0 + n, 1000.0 + n))
        dated[json.loads(entry_file.read_text())["key"]] = 1000.0 + n
    imported, adopted = tmp_path / "imported.db", tmp_path / "adopted.db"

    assert cli("import", root, db=imported).exit_code == 0
    assert cli("import", "--from-vllm", root, db=adopted).exit_code == 0

    def tuned_times(db: Path) -> dict[str, float]:
        with closing(sqlite3.connect(db)) as conn:
            return dict(conn.execute("SELECT key, tuned_at FROM entries").fetchall())

    assert len(dated) == len(cache_keys())
    assert tuned_times(imported) == dated
    assert tuned_times(adopted) == dated


def test_an_adopted_store_exports_to_its_own_environment(
    cli, autotuner, created_note, registry_db: str, tmp_path: Path
) -> None:
    """A vLLM v2 store tuned under a non-default measurement policy, adopted
    (``import --from-vllm``), exports to the environment it came from: the same
    ``env_hash`` and files, and FlashInfer's own loader serves every entry."""
    vllm_autotune_root = tmp_path / "vllm-autotune"  # VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR
    original = publish_like_tuning(vllm_autotune_root, policy=GRAPHS)
    adopted = cli("import", "--from-vllm", vllm_autotune_root)
    assert (adopted.exit_code, adopted.stderr) == (0, created_note(registry_db))
    [commit] = json.loads(cli("log", "--format", "json").stdout)
    [environment] = commit["provenance"]["v2_environments"]
    assert (environment["env_hash"], environment["measurement"]) == (
        original.env_hash,
        {"measure_execution_mode": "cuda_graph"},
    )
    out = tmp_path / "served"

    result = cli("export", "--v2-store", out, "--fingerprint", "current")

    assert (result.exit_code, result.stderr) == (0, "")
    assert "(measurement policy execution_mode=cuda_graph): 5 written" in result.stdout
    assert [p.name for p in (out / "v2").iterdir()] == [original.env_hash]
    assert files_of(out) == files_of(vllm_autotune_root)
    served = store_of(out, GRAPHS)
    for key in cache_keys():
        assert served.lookup(key.file_key) == original.lookup(key.file_key) is not None
    with autotune_v2(
        mode="replay", cache_root=out, measurement_policy=GRAPHS, cache_scope="context"
    ):
        store = autotuner._active_managed_store
        hydrated = {k[2] for k in autotuner._managed_decoded if k[:2] == (str(out), store.env_hash)}
    assert (store.env_dir, store.env_hash) == (served.env_dir, original.env_hash)
    assert hydrated == {k.key_fields for k in cache_keys()}


def test_an_export_by_id_lands_in_the_imported_environment(cli, tmp_path: Path) -> None:
    eager = MeasurementPolicy(execution_mode="eager", cold_l2=True)
    original = publish_like_tuning(tmp_path / "tuned", policy=eager, metadata=H200_METADATA)
    assert cli("import", tmp_path / "tuned").exit_code == 0
    out = tmp_path / "out"

    result = cli("export", "--v2-store", out, "--fingerprint", "1")

    assert result.exit_code == 0
    assert (out / "v2" / original.env_hash).is_dir()
    assert files_of(out) == files_of(tmp_path / "tuned")
    assert "(measurement policy cold_l2=True,execution_mode=eager)" in result.stdout


def test_exporting_twice_gives_identical_files_and_touches_nothing_else(
    cli, tmp_path: Path
) -> None:
    publish_like_tuning(tmp_path / "tuned")
    assert cli("import", tmp_path / "tuned").exit_code == 0
    out = tmp_path / "out"
    other = publish_like_tuning(out, metadata=H200_METADATA, tuned=TUNED[:1])  # another environment
    mine = store_of(out)
    foreign = mine.entries_dir / ("0" * 24 + ".json")
    foreign.parent.mkdir(parents=True)
    foreign.write_text("not ours")
    (out / "README").write_text("left alone")

    first = cli("export", "--v2-store", out, "--fingerprint", "current")
    after_first = files_of(out)
    second = cli("export", "--v2-store", out, "--fingerprint", "current")

    assert first.stdout.endswith(": 5 written, 0 unchanged\n")
    assert second.stdout.endswith(": 0 written, 5 unchanged\n")
    assert files_of(out) == after_first
    assert foreign.read_text() == "not ours"
    assert (out / "README").read_text() == "left alone"
    assert len(list(other.entries_dir.iterdir())) == 1
    assert not [p for p in out.rglob("*.tmp")]


def test_an_export_of_entries_from_a_cache_file(cli, cache_file, tmp_path: Path) -> None:
    """Entries tuned through the v1 path (load/save_configs) are published too."""
    keys = cache_keys()
    legacy = cache_file(
        "legacy.json",
        {
            k.file_key: [runner, _tactic_to_json(tactic)]
            for k, (_o, runner, _s, _e, tactic, _p) in zip(keys, TUNED, strict=True)
        },
    )
    assert cli("import", legacy).exit_code == 0

    result = cli("export", "--v2-store", tmp_path / "out", "--fingerprint", "current")

    assert "(measurement policy default): 5 written, 0 unchanged\n" in result.stdout
    served = store_of(tmp_path / "out")
    assert all(served.lookup(k.file_key) is not None for k in keys)
    assert store_of(tmp_path / "out").preload()[1:] == (5, 0)


def test_a_key_flashinfer_cannot_encode_is_served_by_lookup_only(
    cli, cache_file, tmp_path: Path
) -> None:
    opaque = "('flashinfer::op', 'Runner', ((16, 64),), (SomeEnum.FAST, 2))"
    assert cli("import", cache_file("odd.json", {opaque: ["Runner", 3]})).exit_code == 0

    result = cli("export", "--v2-store", tmp_path / "out", "--fingerprint", "current")

    assert result.stdout.endswith(
        "1 written, 0 unchanged; 1 not preloadable, served by lookup only\n"
    )
    served = store_of(tmp_path / "out")
    assert served.lookup(opaque) == ManagedCacheEntry("Runner", 3, None)
    assert served.preload()[1:] == (1, 1)


def test_the_measurement_policy_option_picks_flashinfers_directory(cli, tmp_path: Path) -> None:
    publish_like_tuning(tmp_path / "tuned")
    assert cli("import", tmp_path / "tuned").exit_code == 0
    out = tmp_path / "out"
    wanted = MeasurementPolicy(execution_mode="eager", cold_l2=True)

    result = cli(
        "export",
        "--v2-store",
        out,
        "--fingerprint",
        "current",
        "--measurement-policy",
        "execution_mode=eager, cold_l2=true",
    )

    assert result.exit_code == 0
    served = store_of(out, wanted)
    assert [p.name for p in (out / "v2").iterdir()] == [served.env_hash]
    assert all(served.lookup(k.file_key) is not None for k in cache_keys())


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "speed=fast",
            "measurement policy 'speed=fast': expected `default` or FIELD=VALUE[,...] "
            "with FIELD one of execution_mode, cold_l2, timer, graph_timing",
        ),
        ("cold_l2=maybe", "measurement policy 'cold_l2=maybe': cold_l2 is true or false"),
        (
            "execution_mode=turbo",
            "measurement policy 'execution_mode=turbo': "
            "MeasurementPolicy.execution_mode must be 'cuda_graph', 'eager', or 'auto', got 'turbo'",
        ),
    ],
)
def test_a_bad_measurement_policy_is_one_line(cli, tmp_path: Path, spec: str, message: str) -> None:
    publish_like_tuning(tmp_path / "tuned")
    assert cli("import", tmp_path / "tuned").exit_code == 0

    result = cli(
        "export", "--v2-store", tmp_path / "out", "--fingerprint", "1", "--measurement-policy", spec
    )

    assert (result.exit_code, result.stdout, result.stderr) == (1, "", f"error: {message}\n")
    assert not (tmp_path / "out").exists()


def test_policies_recorded_by_older_versions_are_read(registry_path: Path) -> None:
    """Registries written before the one shape: an import's ``environments`` and an
    adoption's ``v2_environments`` (``source: vllm-cache``) both give their policy back;
    ``environments`` of another source is not a v2 import's."""
    from ficache.exporting import recorded_measurements
    from ficache.registry import NewEntry, Registry

    imported = Fingerprint.from_flashinfer_metadata(H200_METADATA)
    adopted = Fingerprint.from_flashinfer_metadata({**H200_METADATA, "gpu": "NVIDIA B200"})
    eager = {"measure_execution_mode": "eager"}

    commits = [  # oldest first
        (
            imported,
            {
                "source": "flashinfer-v2-store",
                "environments": [{"fingerprint": imported.digest, "measurement": eager}],
            },
        ),
        (
            adopted,
            {
                "source": "vllm-cache",
                "v2_environments": [{"fingerprint": adopted.digest, "measurement": eager}],
            },
        ),
        (
            adopted,
            {
                "source": "elsewhere",
                "environments": [{"fingerprint": adopted.digest, "measurement": {}}],
            },
        ),
    ]
    with Registry.open(str(registry_path)) as reg:
        for tactic, (fp, provenance) in enumerate(commits):
            result = reg.write(
                [NewEntry(fp, cache_keys()[0].file_key, "CutlassFp4GemmRunner", str(tactic), None)],
                kind="import",
                provenance=provenance,
            )
            assert result.commit_id == tactic + 1

        assert recorded_measurements(reg) == {imported.digest: eager, adopted.digest: eager}


def test_entries_imported_under_two_policies_export_to_two_directories(cli, tmp_path: Path) -> None:
    """Each policy's fingerprint goes to its own environment directory; a default-policy
    one that serves here too (``gpu: *``) goes to the default directory, never into
    another policy's; ``--measurement-policy`` picks one directory."""
    publish_like_tuning(tmp_path / "tuned", policy=GRAPHS, tuned=TUNED[:2])
    anywhere = {**_collect_metadata(), "gpu": "*"}  # a second fingerprint that serves here too
    publish_like_tuning(tmp_path / "tuned", metadata=anywhere, tuned=TUNED[2:])
    assert cli("import", tmp_path / "tuned").exit_code == 0

    both = cli("export", "--v2-store", tmp_path / "out", "--fingerprint", "current")
    chosen = cli(
        "export",
        "--v2-store",
        tmp_path / "one",
        "--fingerprint",
        "current",
        "--measurement-policy",
        "default",
    )

    assert (both.exit_code, both.stderr) == (0, "")
    assert both.stdout.count("exported ") == 2
    assert store_of(tmp_path / "out").preload()[1:] == (3, 0)
    assert store_of(tmp_path / "out", GRAPHS).preload()[1:] == (2, 0)
    assert chosen.exit_code == 0
    assert store_of(tmp_path / "one").preload()[1:] == (3, 0)
    assert not store_of(tmp_path / "one", GRAPHS).env_dir.exists()


# -- bad input --------------------------------------------------------------------


def _entry(key: str, **fields: Any) -> tuple[str, str]:
    return hashlib.sha256(key.encode()).hexdigest()[:24] + ".json", json.dumps(
        {"key": key, **fields}
    )


GOOD_KEY = cache_keys()[0].file_key
MALFORMED: dict[str, Callable[[], tuple[str, str | bytes]]] = {
    "invalid JSON": lambda: (_entry(GOOD_KEY)[0], '{"key": "trunc'),
    "not an object": lambda: (_entry(GOOD_KEY)[0], "[1, 2]"),
    "no tactic": lambda: _entry(GOOD_KEY, runner="CutlassFp4GemmRunner"),
    "renamed": lambda: (
        "0" * 24 + ".json",
        _entry(GOOD_KEY, runner="CutlassFp4GemmRunner", tactic=1)[1],
    ),
    "runner differs": lambda: _entry(GOOD_KEY, runner="OtherRunner", tactic=1),
    "hostile key": lambda: _entry("__import__('os').system('touch pwned')", runner="R", tactic=1),
    "long key": lambda: _entry(f"('op', 'R', ((1,),), ('{'x' * 20000}',))", runner="R", tactic=1),
    "tactic object": lambda: _entry(GOOD_KEY, runner="CutlassFp4GemmRunner", tactic={"a": 1}),
    "tactic NaN": lambda: (
        _entry(GOOD_KEY)[0],
        f'{{"key": {json.dumps(GOOD_KEY)}, "runner": "CutlassFp4GemmRunner", "tactic": NaN}}',
    ),
    "policy not a list": lambda: _entry(
        GOOD_KEY, runner="CutlassFp4GemmRunner", tactic=1, profiling_policy="hot"
    ),
    "not UTF-8": lambda: (_entry(GOOD_KEY)[0], b'{"key": "\xff\xfe"}'),
}
REASONS = {
    "invalid JSON": "invalid JSON (Unterminated string starting at: line 1 column 9 (char 8))",
    "not an object": "not a JSON object",
    "no tactic": "needs a string key, a string runner and a tactic",
    "renamed": "file name is not the hash of its key",
    "runner differs": "runner 'OtherRunner' differs from the key's 'CutlassFp4GemmRunner'",
    "hostile key": "trailing text after the key tuple at offset 10",
    "long key": "key longer than 16384 characters",
    "tactic object": "tactic holds a dict; expected numbers and lists",
    "tactic NaN": "tactic holds a non-finite number",
    "policy not a list": "policy must be a list",
    "not UTF-8": "not UTF-8 text",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_entry_is_skipped_and_counted(
    cli, tmp_path: Path, case: str, registry_path: Path, created_note
) -> None:
    root = tmp_path / "autotune"
    store = publish_like_tuning(root, tuned=TUNED[1:])
    name, content = MALFORMED[case]()
    path = store.entries_dir / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    (store.entries_dir / "notes.txt").write_text("not an entry")  # not *.json: not looked at

    result = cli("import", root)

    assert result.exit_code == 0
    assert result.stdout.endswith(
        "imported 4 entries from 1 environment(s): 4 added, 0 replaced, 0 unchanged (commit 1)\n"
    )
    assert result.stderr == created_note(registry_path) + (
        "warning: skipped 1 malformed entry (FlashInfer treats them as misses); "
        f"first: {path}: {REASONS[case]}\n"
    )
    assert [e["key"] for e in json.loads(cli("list", "--format", "json").stdout)] == sorted(
        k.file_key for k in cache_keys()[1:]
    )


def test_malformed_entries_are_counted_together(tmp_path: Path) -> None:
    store = publish_like_tuning(tmp_path, tuned=TUNED[1:])
    for case in ("renamed", "hostile key", "long key", "not UTF-8"):
        name, content = MALFORMED[case]()
        (store.entries_dir / name).write_bytes(
            content if isinstance(content, bytes) else content.encode()
        )
    (store.entries_dir / "dir.json").mkdir()

    [env] = read_store(tmp_path).environments

    assert (len(env.entries), env.skipped, env.records) == (4, 5, 0)
    assert sorted(s.reason for s in env.first_skipped) == sorted(
        [REASONS[c] for c in ("renamed", "hostile key", "long key", "not UTF-8")]
        + ["not a regular file"]
    )


def _rewrite_manifest(env_dir: Path, change: Callable[[dict], Any]) -> None:
    manifest = json.loads((env_dir / "manifest.json").read_text())
    result = change(manifest)
    (env_dir / "manifest.json").write_text(
        result if isinstance(result, str) else json.dumps(manifest)
    )


BAD_MANIFESTS: dict[str, tuple[Callable[[dict], Any], str]] = {
    "missing": (None, "no manifest.json"),
    "invalid JSON": (
        lambda m: "{",
        "manifest.json: invalid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))",
    ),
    "other schema": (
        lambda m: m.update(cache_schema="v3"),
        "manifest.json: cache_schema is 'v3', not 'v2'",
    ),
    "not hashing to its name": (lambda m: m.update(gpu="NVIDIA B200"), None),
    "unknown field": (
        lambda m: m.update(driver_version="575"),
        "manifest.json has field(s) ficache does not know (driver_version); a newer FlashInfer wrote it",
    ),
    "a number": (lambda m: m.update(gpu=7), "manifest.json: every value must be a string"),
}


@pytest.mark.parametrize("case", sorted(BAD_MANIFESTS))
def test_a_malformed_manifest_skips_its_environment(
    cli, tmp_path: Path, case: str, registry_path: Path, created_note
) -> None:
    root = tmp_path / "autotune"
    publish_like_tuning(root, tuned=TUNED[:1])
    bad = publish_like_tuning(root, metadata=H200_METADATA)
    change, reason = BAD_MANIFESTS[case]
    if change is None:
        (bad.env_dir / "manifest.json").unlink()
    else:
        _rewrite_manifest(bad.env_dir, change)
    if reason is None:
        new = json.loads((bad.env_dir / "manifest.json").read_text())
        new_hash = hashlib.sha256(
            json.dumps(new, sort_keys=True, separators=(",", ":")).encode()
        ).hexdigest()[:16]
        reason = f"manifest.json hashes to {new_hash}, not to its directory's name, so FlashInfer never serves it"

    result = cli("import", root)

    assert result.exit_code == 0
    assert result.stdout.endswith(
        "imported 1 entries from 1 environment(s): 1 added, 0 replaced, 0 unchanged (commit 1)\n"
    )
    assert result.stderr == created_note(registry_path) + (
        f"warning: skipped 1 environment(s) with a malformed manifest; first: {bad.env_dir}: {reason}\n"
    )


def test_an_environment_written_while_it_is_read_is_skipped_whole(
    cli, tmp_path: Path, registry_path: Path, dump_db, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ficache import v2_store

    root = tmp_path / "autotune"
    publish_like_tuning(root, tuned=TUNED[:1])
    busy_store = publish_like_tuning(root, metadata=H200_METADATA)
    assert cli("import", root).exit_code == 0
    before = dump_db(registry_path)
    op, runner, _shapes, extras, tactic, _profiling = TUNED[0]
    read_entry = v2_store._read_entry
    landed: list[Path] = []

    def read_entry_while_another_process_tunes(path: Path) -> Any:
        """Fault injection: FlashInfer's own store publishes a new entry into the H200
        environment (another process tuning) while its second entry file is read."""
        if path.parent == busy_store.entries_dir and len(landed) < 2:
            landed.append(path)
            if len(landed) == 2:
                key = ProfilingCacheKey(op, runner, 1000, ((5000, 4096), (4096, 2048)), extras)
                store_of(root, metadata=H200_METADATA).publish(
                    key.file_key, runner, _tactic_to_json(tactic), key_fields=key.key_fields
                )
        return read_entry(path)

    monkeypatch.setattr(v2_store, "_read_entry", read_entry_while_another_process_tunes)
    result = cli("import", root)

    # The environment being written is left out whole (never half its files); the other
    # one is read as usual, and holds nothing new.
    assert len(landed) == 2
    assert result.exit_code == 0, result.output
    assert result.stdout.endswith(
        "imported 1 entries from 1 environment(s): 0 added, 0 replaced, 1 unchanged "
        "(nothing new, no commit)\n"
    ), result.stdout
    assert result.stderr == (
        "warning: skipped 1 environment(s) whose entries changed while they were read "
        "(another process writes that store); import again once it is done; "
        f"first: {busy_store.env_dir}: entries changed while it was read; nothing taken "
        "from it (stop other writers to that store root)\n"
    )
    assert dump_db(registry_path) == before
    # Once the writer is done, the same import takes the environment, new entry included.
    monkeypatch.setattr(v2_store, "_read_entry", read_entry)
    again = cli("import", root)
    assert again.exit_code == 0 and "1 added" in again.stdout, again.output


def _publish_protocol_record(
    store: ManagedAutotuneCache, namespace: str, key: str, value: Any
) -> None:
    """What FlashInfer's ``publish_protocol_record(..., persist=True)`` does to the active
    store, done to ``store`` (an environment other than this process's)."""
    from flashinfer.autotuner.autotuner import _protocol_cache_key

    fields = _protocol_cache_key(namespace, key)
    store.publish(str(fields), namespace, value, key_fields=fields)


def test_an_environment_whose_protocol_records_change_while_read_is_skipped_whole(
    cli, tmp_path: Path, registry_path: Path, dump_db, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As for entries: FlashInfer's store republishes one of an environment's protocol
    records with another value (the file replaced in place) while that environment's entry
    files are read: it is left out whole, with the same one line; the registry is unchanged."""
    from ficache import v2_store

    require_protocol_records()
    root = tmp_path / "autotune"
    publish_like_tuning(root, tuned=TUNED[:1])
    busy_store = store_of(root, metadata=H200_METADATA)
    for key, value in PROTOCOL_VALUES.items():
        _publish_protocol_record(busy_store, "moe_ep_megamoe", key, value)
    first = cli("import", root)
    assert first.exit_code == 0 and "3 protocol records (shared): 3 added" in first.stdout
    before = dump_db(registry_path)
    read_entry = v2_store._read_entry
    landed: list[Path] = []

    def read_entry_while_another_process_publishes(path: Path) -> Any:
        """Fault injection: another process republishes a protocol record of the H200
        environment while its second entry file is read."""
        if path.parent == busy_store.entries_dir and len(landed) < 2:
            landed.append(path)
            if len(landed) == 2:
                store = store_of(root, metadata=H200_METADATA)
                _publish_protocol_record(store, "moe_ep_megamoe", "tokens=128", {"knobs": [8]})
        return read_entry(path)

    monkeypatch.setattr(v2_store, "_read_entry", read_entry_while_another_process_publishes)
    result = cli("import", root)

    assert len(landed) == 2
    assert result.exit_code == 0, result.output
    assert result.stdout.endswith(
        "imported 1 entries from 1 environment(s): 0 added, 0 replaced, 1 unchanged "
        "(nothing new, no commit)\n"
    ), result.stdout
    assert "protocol record" not in result.stdout
    assert result.stderr == (
        "warning: skipped 1 environment(s) whose entries changed while they were read "
        "(another process writes that store); import again once it is done; "
        f"first: {busy_store.env_dir}: entries changed while it was read; nothing taken "
        "from it (stop other writers to that store root)\n"
    )
    assert dump_db(registry_path) == before
    # Once the writer is done, the same import takes the new value.
    monkeypatch.setattr(v2_store, "_read_entry", read_entry)
    again = cli("import", root)
    assert again.exit_code == 0, again.output
    assert "3 protocol records (shared): 0 added, 1 replaced, 2 unchanged" in again.stdout


@pytest.fixture
def populated(cli, tmp_path: Path, registry_path: Path) -> Path:
    publish_like_tuning(tmp_path / "tuned", metadata=H200_METADATA)
    assert cli("import", tmp_path / "tuned").exit_code == 0
    return registry_path


def test_a_directory_that_is_not_a_store_is_refused(
    cli, populated: Path, dump_db, tmp_path: Path
) -> None:
    before = dump_db(populated)
    empty = tmp_path / "empty"
    empty.mkdir()
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("hello")

    for directory in (empty, stray):
        result = cli("import", directory)
        assert (result.exit_code, result.stdout) == (1, "")
        assert result.stderr == (
            f"error: {directory}: not a FlashInfer v2 store (no v2/ directory) nor one of its "
            "environment directories (no manifest.json); it holds no cache file (*.json) and no "
            "vLLM autotune cache; give cache files (`ficache import DIR/*.json`) or vLLM's cache "
            "root (`ficache import --from-vllm DIR`)\n"
        )
    assert dump_db(populated) == before


def test_export_refuses_what_is_not_a_store(cli, populated: Path, dump_db, tmp_path: Path) -> None:
    before = dump_db(populated)
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("hello")
    a_file = tmp_path / "file.json"
    a_file.write_text("{}")
    env_dir = next((tmp_path / "tuned" / "v2").iterdir())
    env_before = files_of(env_dir)
    cases = {
        stray: f"{stray} is not a FlashInfer v2 store (no v2/ directory) and not empty; "
        "give a store root, an empty directory or a new path",
        a_file: f"{a_file} is not a directory; give a FlashInfer v2 store root",
        env_dir: f"{env_dir} is an environment directory; give the store root "
        "(the directory holding v2/)",
    }

    for target, message in cases.items():
        result = cli("export", "--v2-store", target, "--fingerprint", "1")
        assert (result.exit_code, result.stdout, result.stderr) == (1, "", f"error: {message}\n")

    assert files_of(stray) == {"notes.txt": b"hello"}
    assert a_file.read_text() == "{}"
    assert files_of(env_dir) == env_before
    assert dump_db(populated) == before


def test_exported_files_follow_the_umask_and_replaced_ones_keep_their_mode(
    cli, populated: Path, tmp_path: Path, umask: Callable[[int], int]
) -> None:
    """A store read by a server running as another user must be readable by it."""
    out = tmp_path / "out"
    umask(0o022)
    assert cli("export", "--v2-store", out, "--fingerprint", "1").exit_code == 0
    exported = sorted(p for p in out.rglob("*") if p.is_file())
    assert {stat.S_IMODE(p.stat().st_mode) for p in exported} == {0o644}
    manifest = next(p for p in exported if p.name == "manifest.json")
    changed, removed = [p for p in exported if p.parent.name == "entries"][:2]
    changed.write_text("stale")
    changed.chmod(0o640)
    removed.unlink()
    umask(0o077)

    again = cli("export", "--v2-store", out, "--fingerprint", "1")

    assert again.stdout.endswith(": 2 written, 3 unchanged\n")
    assert stat.S_IMODE(changed.stat().st_mode) == 0o640  # replaced: its mode is kept
    assert stat.S_IMODE(removed.stat().st_mode) == 0o600  # new: the umask's
    assert stat.S_IMODE(manifest.stat().st_mode) == 0o644
    assert files_of(out) == files_of(tmp_path / "tuned")
    assert not [p for p in out.rglob("*.tmp")]


def test_export_refuses_an_environment_with_a_different_manifest(
    cli, populated: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    target = next((tmp_path / "tuned" / "v2").iterdir()).name
    (out / "v2" / target).mkdir(parents=True)
    manifest = out / "v2" / target / "manifest.json"
    manifest.write_text('{"gpu": "forged"}')

    result = cli("export", "--v2-store", out, "--fingerprint", "1")

    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr == (
        f"error: {manifest} differs from the manifest this export writes; not touching it\n"
    )
    assert files_of(out) == {f"v2/{target}/manifest.json": b'{"gpu": "forged"}'}


def test_files_and_stores_import_in_separate_commands(cli, cache_file, tmp_path: Path) -> None:
    publish_like_tuning(tmp_path / "tuned", tuned=TUNED[:1])
    legacy = cache_file("legacy.json", {})

    mixed = cli("import", tmp_path / "tuned", legacy)
    with_fingerprint = cli("import", tmp_path / "tuned", "--fingerprint", "current")

    assert mixed.exit_code == 2
    assert "import v2 store directories and files in separate commands" in mixed.stderr
    assert with_fingerprint.exit_code == 2
    assert (
        "a v2 store's manifest names its environments; drop --fingerprint"
        in with_fingerprint.stderr
    )


# -- key_fields ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "extras",
    [
        (torch.bfloat16, 1),
        (torch.float8_e4m3fn, 256, 8, None, 2.5, "renormalize"),
        (torch.float8_e5m2, True, False, float("-inf"), float("inf")),
        ('it\'s "q"', 1e-05, "\\n\x00é"),
        ((1, (2,)), [3, [4, (5,)]], ()),
        (),
    ],
)
def test_key_fields_are_flashinfers_own_encoding(extras: tuple) -> None:
    key = ProfilingCacheKey("flashinfer::op", "Runner", 7, ((16, 4096), (8,), ()), extras)

    assert encode_key_fields(key.file_key) == _encode_key_fields(key.key_fields) is not None


@pytest.mark.parametrize(
    "key",
    [
        "('op', 'R', ((1,),), (SomeEnum.FAST,))",  # FlashInfer has no encoding for it either
        "('op', 'R', ((1,),), (torch.float16,)) trailing",
        "('op', 'R', ((1,), (2.50,)))",  # not what str() writes
        "('op', 'R', ((1,),), ({'a': 1},))",
    ],
)
def test_keys_without_an_exact_encoding_get_none(key: str) -> None:
    assert encode_key_fields(key) is None


def test_a_store_of_only_malformed_entries_reports_no_fingerprint_export_cannot_find(
    cli, tmp_path: Path
) -> None:
    """Issue 34 item 4: before, the import's table named the environment's fingerprint
    although nothing was stored under it, and ``export --fingerprint`` then said it does
    not exist. Every fingerprint an import reports is one ``export`` finds."""
    root = tmp_path / "autotune"
    store = store_of(root)
    name, content = MALFORMED["no tactic"]()
    store._ensure_dirs()
    (store.entries_dir / name).write_text(content)
    good = tmp_path / "good"
    publish_like_tuning(good, metadata=H200_METADATA, tuned=TUNED[:1])

    result = cli("import", root, good, "--format", "json")

    assert result.exit_code == 0, result.output
    reported = [e["fingerprint"] for e in json.loads(result.stdout)["environments"]]
    assert reported == [None, digest(H200_METADATA)]
    for fingerprint in filter(None, reported):
        assert cli("export", "--fingerprint", fingerprint[:12]).exit_code == 0
    table = cli("import", root).stdout.splitlines()
    assert table[1].split()[:2] == [store.env_hash, "-"]


def test_an_entry_whose_key_is_no_literal_is_kept_and_served_by_lookup(
    cli, autotuner, tmp_path: Path
) -> None:
    """Issue 34 item 4: FlashInfer writes a key whose extras hold a ``torch.device`` (its
    repr a call) without ``key_fields``, and its lazy ``lookup`` serves it; ficache skipped
    it as malformed. Now it is imported, and exported where ``lookup`` serves it again."""
    odd = [("flashinfer::op", "Runner", ((16, 64),), (torch.device("cpu"), torch.bfloat16), 5, HOT)]
    [key] = cache_keys(odd)
    publish_like_tuning(tmp_path / "tuned", tuned=odd)
    written = json.loads(next((tmp_path / "tuned").rglob("entries/*.json")).read_text())
    assert "key_fields" not in written  # FlashInfer could not encode it

    imported = cli("import", tmp_path / "tuned")
    exported = cli("export", "--v2-store", tmp_path / "out", "--fingerprint", "current")

    assert imported.exit_code == 0, imported.output
    assert "malformed" not in imported.stderr
    assert exported.exit_code == 0, exported.output
    served = store_of(tmp_path / "out").lookup(key.file_key)
    assert served == ManagedCacheEntry("Runner", 5, HOT)
    assert files_of(tmp_path / "out") == files_of(tmp_path / "tuned")
