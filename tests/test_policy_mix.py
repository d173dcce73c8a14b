"""One environment tuned under several FlashInfer measurement policies (issue 34, item 2).

FlashInfer keeps ``autotune_v2`` runs under the default policy and under
``MeasurementPolicy(cold_l2=True)`` apart: two environment directories of one
store (the policy's ``manifest_fields()`` are part of ``env_hash``). ficache
keeps them apart as two fingerprints (``Fingerprint.measurement``): imported
from one store in one command, merged without replacing each other, exported
back to each policy's own directory byte for byte, and loaded by FlashInfer
0.7.4 in fresh processes into the same tuner state as the original store.

FlashInfer cannot profile on a CPU, so ``two_policy_store`` is a stand-in for
tuning under each policy: FlashInfer's own ``ManagedAutotuneCache.publish``
writes each winner with the arguments ``AutoTuner`` passes (the stand-in op's
``file_key``, runner, tactic, ``key_fields``, the per-entry profiling policy
FlashInfer records under that measurement policy), and its own
``publish_protocol_record(persist=True)`` writes one protocol record per
policy. Everything read back is FlashInfer's real store and tuner.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from flashinfer.autotune_cache import ManagedAutotuneCache, MeasurementPolicy, autotune_v2
from flashinfer.autotuner import ProfilingCacheKey, _collect_metadata
from flashinfer_074 import has_protocol_records

from ficache.fingerprint import Fingerprint
from ficache.registry import Registry
from ficache.standin import STANDIN_OP, standin_keys

REPO = Path(__file__).resolve().parent.parent
COLD = MeasurementPolicy(cold_l2=True)
COLD_FIELDS = {"measure_cold_l2": "True"}
#: The per-entry profiling policy FlashInfer records under each measurement policy.
HOT_PROFILE = ("cuda_graph_profile_replays", None, "l2_cache_policy", "hot")
COLD_PROFILE = ("cuda_graph_profile_replays", None, "l2_cache_policy", "cold")
KEYS = standin_keys()
NAMESPACE = "moe_ep_megamoe"
#: FlashInfer 0.7.4 also publishes a protocol record per policy; 0.7.2.post1 (the vllm
#: env) has none, and its cases check the entries alone.
PROTOCOL = has_protocol_records()


def _key_fields(key: str) -> tuple:
    """The stand-in key's ``key_fields`` (what ``AutoTuner`` passes to ``publish``)."""
    import torch

    from ficache.standin import CpuStandInMatmulRunner

    runner = CpuStandInMatmulRunner()
    for k, n in ((128, 128), (128, 256), (256, 128)):
        for m in (1, 2, 4, 8, 16, 32):
            extras = runner.get_cache_key_extras([torch.empty(0, dtype=torch.float32)])
            cache_key = ProfilingCacheKey(
                STANDIN_OP, type(runner).__name__, 0, ((m, k), (k, n)), extras
            )
            if cache_key.file_key == key:
                return cache_key.key_fields
    raise KeyError(key)


def tactics(policy: MeasurementPolicy | None) -> dict[str, int]:
    """The winners each policy's stand-in tuning chose: the same keys, other tactics."""
    shift = 0 if policy is None else 2
    return {key: (n + shift) % 5 for n, key in enumerate(KEYS)}


def publish_policy(root: Path, policy: MeasurementPolicy | None, autotuner: Any) -> Path:
    """Stand-in for tuning under ``policy`` (module docstring); the environment directory."""
    manifest = dict(_collect_metadata())
    if policy is not None:
        manifest.update(policy.manifest_fields())
    store = ManagedAutotuneCache(manifest=manifest, root=root)
    profile = HOT_PROFILE if policy is None else COLD_PROFILE
    for key, tactic in tactics(policy).items():
        store.publish(
            key,
            "CpuStandInMatmulRunner",
            tactic,
            key_fields=_key_fields(key),
            profiling_policy=profile,
        )
    extra = {} if policy is None else {"measurement_policy": policy}
    if PROTOCOL:
        with autotune_v2(mode="tune", cache_root=root, cache_scope="context", **extra):
            autotuner.publish_protocol_record(
                NAMESPACE, "knobs", {"cold": policy is not None}, persist=True
            )
    return store.env_dir


@pytest.fixture
def two_policy_store(tmp_path: Path, autotuner: Any) -> tuple[Path, Path, Path]:
    """A store root holding one environment under the default policy and under cold_l2."""
    root = tmp_path / "tuned"
    default = publish_policy(root, None, autotuner)
    cold = publish_policy(root, COLD, autotuner)
    autotuner.clear_cache()
    return root, default, cold


def files_of(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def stored(db: Path | str) -> dict[str, dict[str, Any]]:
    """``measurement -> {key: tactic}`` and protocol records, per stored fingerprint."""
    out: dict[str, dict[str, Any]] = {}
    with Registry.open(str(db), create=False, write=False) as reg:
        for info in reg.fingerprints():
            label = info.fingerprint.measurement or "default"
            rows = reg.slice_rows([info.id], ["shared"])
            out[label] = {
                "entries": {k: json.loads(r[2]) for k, r in rows.items()},
                "profiles": {k: json.loads(r[3] or "null") for k, r in rows.items()},
            }
        from ficache.protocol_records import stored_protocol_records

        with reg.engine.connect() as conn:
            for r in stored_protocol_records(conn):
                fp = reg.fingerprint(r.fingerprint_id).fingerprint
                out[fp.measurement or "default"].setdefault("protocol", {})[r.key] = json.loads(
                    r.value_json
                )
    return out


EXPECTED = {
    "default": {
        "entries": tactics(None),
        "profiles": {k: list(HOT_PROFILE) for k in KEYS},
        **({"protocol": {"knobs": {"cold": False}}} if PROTOCOL else {}),
    },
    '{"measure_cold_l2":"True"}': {
        "entries": tactics(COLD),
        "profiles": {k: list(COLD_PROFILE) for k in KEYS},
        **({"protocol": {"knobs": {"cold": True}}} if PROTOCOL else {}),
    },
}


# -- import and merge ---------------------------------------------------------------


@pytest.mark.usefixtures("backend")
def test_a_two_policy_store_imports_in_one_command(
    cli, two_policy_store: tuple[Path, Path, Path], registry_db: str
) -> None:
    """Before ``Fingerprint.measurement`` this exited 1: "... share one fingerprint under
    two measurement policies, which the registry cannot keep apart"."""
    root, default, cold = two_policy_store

    result = cli("import", root)

    assert (result.exit_code, result.stderr.count("error")) == (0, 0), result.stderr
    assert result.stdout.endswith(
        f"imported {2 * len(KEYS)} entries from 2 environment(s): {2 * len(KEYS)} added, "
        "0 replaced, 0 unchanged (commit 1)\n"
        + (
            "imported 2 protocol records (shared): 2 added, 0 replaced, 0 unchanged\n"
            if PROTOCOL
            else ""
        )
    )
    assert stored(registry_db) == EXPECTED
    here = Fingerprint.from_flashinfer_metadata(dict(_collect_metadata()))
    with Registry.open(registry_db, create=False, write=False) as reg:
        assert sorted(i.fingerprint.digest for i in reg.fingerprints()) == sorted(
            [here.digest, here.with_measurement(COLD_FIELDS).digest]
        )


@pytest.mark.usefixtures("backend")
def test_importing_the_directories_one_at_a_time_replaces_nothing(
    cli, two_policy_store: tuple[Path, Path, Path], registry_db: str
) -> None:
    """The advice the refusal gave: before the fix the second import replaced every entry
    and protocol record of the first policy with the second's (one fingerprint)."""
    _root, default, cold = two_policy_store

    first = cli("import", default)
    second = cli("import", cold)

    assert (first.exit_code, second.exit_code) == (0, 0), second.stderr
    assert f"{len(KEYS)} added, 0 replaced" in second.stdout
    assert not PROTOCOL or "1 added, 0 replaced" in second.stdout  # its protocol record
    assert stored(registry_db) == EXPECTED


@pytest.mark.usefixtures("backend")
def test_merging_two_registries_each_under_one_policy_keeps_both(
    cli, two_policy_store: tuple[Path, Path, Path], tmp_path: Path, registry_db: str
) -> None:
    _root, default, cold = two_policy_store
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    assert cli("import", default, db=a).exit_code == 0
    assert cli("import", cold, db=b).exit_code == 0

    merged = cli("merge", a, b)
    again = cli("merge", a, b)

    assert merged.exit_code == 0, merged.stderr
    assert stored(registry_db) == EXPECTED
    with Registry.open(registry_db, create=False, write=False) as reg:
        assert [c.kind for c in reg.log()] == ["merge"]  # the same sources again: no commit
    assert again.exit_code == 0


def test_a_bundle_carries_both_policies(
    cli, two_policy_store: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    root, _default, _cold = two_policy_store
    source, target = tmp_path / "source.db", tmp_path / "target.db"
    assert cli("import", root, db=source).exit_code == 0
    bundle = tmp_path / "both.ficache"

    written = cli("export", "--bundle", bundle, "--all", db=source)
    imported = cli("import", bundle, db=target)

    assert (written.exit_code, imported.exit_code) == (0, 0), written.stderr + imported.stderr
    assert bundle.read_bytes().startswith(b"ficache-bundle 4 ")
    assert stored(target) == EXPECTED


def test_a_bundle_of_a_policy_fingerprint_without_protocol_records_round_trips(
    cli, tmp_path: Path
) -> None:
    """Version 4 writes ``protocol_records`` whenever a fingerprint has a policy, empty
    here; the reader takes it (it refused an empty list, as version 3 never writes one)."""
    from ficache.values import NewEntry

    cold = Fingerprint.from_flashinfer_metadata(dict(_collect_metadata())).with_measurement(
        COLD_FIELDS
    )
    source, target = tmp_path / "source.db", tmp_path / "target.db"
    with Registry.open(str(source)) as reg:
        reg.write([NewEntry(cold, KEYS[0], "CpuStandInMatmulRunner", "2")], kind="import")
    bundle = tmp_path / "cold.ficache"

    written = cli("export", "--bundle", bundle, "--all", db=source)
    imported = cli("import", bundle, db=target)
    again = cli("export", "--bundle", tmp_path / "again.ficache", "--all", db=target)

    assert (written.exit_code, imported.exit_code, again.exit_code) == (0, 0, 0), (
        written.stderr + imported.stderr
    )
    assert b'"protocol_records":[\n],' in bundle.read_bytes()
    assert (tmp_path / "again.ficache").read_bytes() == bundle.read_bytes()
    assert stored(target) == {
        '{"measure_cold_l2":"True"}': {"entries": {KEYS[0]: 2}, "profiles": {KEYS[0]: None}}
    }


# -- export and FlashInfer serving it -------------------------------------------------


def test_export_v2_store_writes_each_policys_directory_as_flashinfer_wrote_it(
    cli,
    two_policy_store: tuple[Path, Path, Path],
    tmp_path: Path,
    autotuner: Any,
    registry_path: Path,
) -> None:
    """Before the fix ``export --v2-store`` wrote only the last policy's directory, so a
    server attaching with ``cold_l2=True`` found nothing."""
    root, default, cold = two_policy_store
    assert cli("import", root).exit_code == 0
    out = tmp_path / "served"

    result = cli("export", "--v2-store", out, "--fingerprint", "current")

    assert (result.exit_code, result.stderr) == (0, ""), result.stderr
    assert result.stdout.count("exported ") == 2
    assert files_of(out) == files_of(root)
    for policy in (None, COLD):
        manifest = {**_collect_metadata(), **(policy.manifest_fields() if policy else {})}
        store = ManagedAutotuneCache(manifest=manifest, root=out)
        preloaded, total, skipped = store.preload()
        n = len(KEYS) + PROTOCOL
        assert (len(preloaded), total, skipped) == (n, n, 0)
        for key, tactic in tactics(policy).items():
            entry = store.lookup(key)
            assert entry is not None and (entry.runner, entry.tactic) == (
                "CpuStandInMatmulRunner",
                tactic,
            )
        extra = {} if policy is None else {"measurement_policy": policy}
        if not PROTOCOL:
            continue
        with autotune_v2(mode="replay", cache_root=out, cache_scope="context", **extra):
            assert autotuner.get_protocol_records(NAMESPACE) == {
                "knobs": {"cold": policy is not None}
            }
    # One fingerprint, one directory: the cold one by id.
    with Registry.open(str(registry_path), create=False, write=False) as reg:
        [cold_id] = [i.id for i in reg.fingerprints() if i.fingerprint.measurement]
    one = tmp_path / "one"
    assert cli("export", "--v2-store", one, "--fingerprint", cold_id).exit_code == 0
    assert files_of(one) == {
        name: data for name, data in files_of(root).items() if name.startswith(f"v2/{cold.name}/")
    }
    mismatch = cli(
        "export",
        "--v2-store",
        tmp_path / "x",
        "--fingerprint",
        cold_id,
        "--measurement-policy",
        "default",
    )
    assert (mismatch.exit_code, mismatch.stdout) == (1, "")
    assert mismatch.stderr == (
        f"error: fingerprint {cold_id} was tuned under measurement policy cold_l2=True, not default; "
        "drop --measurement-policy\n"
    )


# -- v1 files: one value per key -----------------------------------------------------


def test_a_v1_file_holds_one_policy_per_key_as_flashinfer_loads_it(
    cli, tmp_path: Path, registry_path: Path, autotuner: Any
) -> None:
    """A v1 cache file is one JSON object: a key has one value, so one per-entry policy
    element. Written twice (two policies of one key), both FlashInfer's ``load_configs``
    and ficache keep the last, as JSON does: the two cannot coexist in a v1 file, and a v1
    file is the default measurement policy's (it has no manifest fields)."""
    key = KEYS[0]
    text = (
        "{"
        f'"_metadata": {json.dumps(dict(_collect_metadata()))}, '
        f'{json.dumps(key)}: ["CpuStandInMatmulRunner", 1, {json.dumps(HOT_PROFILE)}], '
        f'{json.dumps(key)}: ["CpuStandInMatmulRunner", 3, {json.dumps(COLD_PROFILE)}]'
        "}"
    )
    path = tmp_path / "two.json"
    path.write_text(text)

    assert autotuner.load_configs(str(path))
    result = cli("import", path)

    assert autotuner._file_configs[key] == ("CpuStandInMatmulRunner", 3)
    assert autotuner._file_config_policies[key] == COLD_PROFILE
    assert result.exit_code == 0, result.stderr
    assert stored(registry_path)["default"]["entries"] == {key: 3}


# -- the round trip in fresh FlashInfer processes -------------------------------------

#: Loads a store root in a fresh process under each policy and prints the tuner's state.
_STATE_PROGRAM = r"""
import inspect, json, sys
import torch
from flashinfer.autotune_cache import MeasurementPolicy, autotune_v2
from flashinfer.autotuner import AutoTuner
from ficache.standin import STANDIN_OP
from ficache.standin_timing import HookedStandInRunner, cpu_timing
from ficache.tunable_matmul import CONFIG

root, label = sys.argv[1], sys.argv[2]
tuner = AutoTuner.get()
state = {}
policy = None if label == "default" else MeasurementPolicy(cold_l2=True)
extra = {} if policy is None else {"measurement_policy": policy}
if "cache_scope" in inspect.signature(autotune_v2).parameters:  # FlashInfer 0.7.4
    extra["cache_scope"] = "context"
if True:
    with cpu_timing(), autotune_v2(mode="replay", cache_root=root, **extra):
        store = tuner._active_managed_store
        preloaded, total, skipped = store.preload()
        served = {}
        g = torch.Generator().manual_seed(0)
        for k, n in ((128, 128), (128, 256), (256, 128)):
            runner = HookedStandInRunner()
            b = torch.randn(k, n, generator=g)
            for m in (1, 2, 4, 8, 16, 32):
                inputs = [torch.randn(m, k, generator=g), b]
                _chosen, tactic = tuner.choose_one(STANDIN_OP, [runner], CONFIG, inputs)
                key = tuner._get_cache_key(
                    STANDIN_OP, runner, ((m, k), (k, n)), CONFIG,
                    runner.get_cache_key_extras(inputs),
                )
                served[key.file_key] = repr(tactic)
        identity = tuner._winner_cache_identity()
        state[label] = {
            "env_hash": store.env_hash,
            "manifest": store.manifest,
            "preload": sorted(
                [repr(kf), e.runner, repr(e.tactic), repr(e.profiling_policy)]
                for kf, e in preloaded
            ),
            "counts": [total, skipped],
            "served": served,
            "winners": sorted(
                [k.file_key, repr(v[0])] for k, v in tuner._winner_cache().items()
            ),
            "winner_policies": sorted(
                [k.file_key, repr(p)]
                for (ident, k), p in tuner._profiling_cache_policies.items()
                if ident == identity
            ),
            "protocol": (
                tuner.get_protocol_records("moe_ep_megamoe")
                if hasattr(tuner, "get_protocol_records") else None
            ),
            "file_configs": sorted(tuner._file_configs),
            "records": tuner.get_namespaced_records("moe_ep_megamoe"),
        }
print(json.dumps(state, sort_keys=True))
"""


def _state(root: Path) -> dict[str, Any]:
    """FlashInfer's whole tuner state after loading ``root`` under each policy, each in a
    fresh process of the interpreter running this test (FlashInfer 0.7.4 in the test env,
    0.7.2.post1 in the vllm env)."""
    state: dict[str, Any] = {}
    for label in ("default", "cold_l2"):
        done = subprocess.run(
            [sys.executable, "-c", _STATE_PROGRAM, str(root), label],
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        state.update(json.loads(done.stdout.splitlines()[-1]))
    return state


def test_a_policy_mix_round_trips_into_the_same_flashinfer_state(
    cli, two_policy_store: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """The original two-policy store and ficache's round trip of it (import, export
    --v2-store), each loaded in fresh FlashInfer processes under each policy: the same
    manifests, preloaded entries, tactics ``choose_one`` serves, winners and their
    profiling policies, and protocol records."""
    root, _default, _cold = two_policy_store
    assert cli("import", root).exit_code == 0
    out = tmp_path / "round-trip"
    assert cli("export", "--v2-store", out, "--fingerprint", "current").exit_code == 0

    original, again = _state(root), _state(out)

    assert again == original
    for label, policy in (("default", None), ("cold_l2", COLD)):
        served = original[label]["served"]
        assert served == {k: repr(t) for k, t in tactics(policy).items()}
        if PROTOCOL:
            assert original[label]["protocol"] == {"knobs": {"cold": policy is not None}}
        assert original[label]["counts"] == [len(KEYS) + PROTOCOL, 0]


def test_a_store_under_a_policy_lands_beside_the_default_fingerprint_of_its_fields(
    cli, tmp_path: Path
) -> None:
    """A v2 store under a measurement policy, imported where only the default policy's
    fingerprint of the same FlashInfer fields is stored (both with the wildcard compute
    capability and torch version that a FlashInfer file names): the import landed it in
    that fingerprint and replaced its entry. Now it is a fingerprint of its own."""
    import shutil
    import sqlite3
    from contextlib import closing

    from frozen_registries import frozen_file

    from ficache import schema

    revisions = [rev for rev, _down, _title in schema.history()]
    head, target = tmp_path / "head.db", tmp_path / "target.db"
    shutil.copyfile(frozen_file(revisions[-1]), head)
    shutil.copyfile(frozen_file("0009_protocol_records"), target)  # no policy fingerprint
    with closing(sqlite3.connect(head)) as conn:
        ((policy, measurement),) = conn.execute(
            "SELECT id, measurement FROM fingerprints WHERE measurement IS NOT NULL"
        ).fetchall()
    store = tmp_path / "store"
    assert cli("export", "--v2-store", store, "--fingerprint", str(policy), db=head).exit_code == 0
    assert cli("db", "upgrade", db=target).exit_code == 0
    default = cli("export", "--fingerprint", "1", db=target).stdout

    imported = cli("import", store, db=target)

    assert imported.exit_code == 0, imported.stderr
    assert "1 added, 0 replaced" in imported.stdout
    assert cli("export", "--fingerprint", "1", db=target).stdout == default
    with closing(sqlite3.connect(target)) as conn:
        assert conn.execute("SELECT measurement FROM fingerprints ORDER BY id").fetchall() == [
            (None,),
            (None,),
            (measurement,),
        ]
