"""Adopting vLLM's own autotune caches (``ficache.adopt``, ``import --from-vllm``).

The vLLM cache trees are written by hand, one directory per layout vLLM
writes (see ``ficache.adopt``): the single broadcast file of vLLM 0.27-0.31,
per-rank files of 0.32+ (tensor and data parallel), the override directory
``VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR`` and the v2 store of 0.33, plus bad
files of every kind. Real SQLite registries; the CLI through ``cli``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from samples import H200_METADATA

from ficache.adopt import (
    AdoptedLayout,
    AdoptedStore,
    KnownLayout,
    Sources,
    adopt_into_empty_registry,
    default_sources,
    plan_adoption,
    registry_holds_entries_for,
)
from ficache.errors import FicacheError
from ficache.fingerprint import Fingerprint
from ficache.registry import NewEntry, Registry
from ficache.v2_store import entry_file_name, env_hash, manifest_for

OLD_METADATA = {**H200_METADATA, "flashinfer_version": "0.6.18"}
FP = Fingerprint.from_flashinfer_metadata(H200_METADATA)
OLD_FP = Fingerprint.from_flashinfer_metadata(OLD_METADATA)
HASH_SINGLE = "1" * 64
HASH_TP2 = "2" * 64
HASH_DP2 = "3" * 64
HASH_ONE_GPU = "4" * 64
POLICY = ["cuda_graph_profile_replays", None, "l2_cache_policy", "hot"]
#: Modification times of the files (tuned_at of what they hold).
T_SINGLE, T_RANK0, T_RANK1 = 1_700_000_000.0, 1_700_000_100.0, 1_700_000_200.0


def gemm(m: int) -> str:
    """A FlashInfer ``file_key`` as ``str()`` of its tuple prints it (dtype bare)."""
    return (
        f"('flashinfer::mm_fp4', 'CutlassFp4GemmRunner', (({m}, 4096), (4096, 2048)), "
        "(torch.bfloat16, 1))"
    )


def moe(m: int) -> str:
    return (
        f"('flashinfer::trtllm_fp8_block_scale_moe', 'TrtllmGenMoERunner', (({m}, 7168), (256,)), "
        "(torch.float8_e4m3fn, 256, 8))"
    )


def value(key: str, tactic: Any, policy: list[Any] | None = None) -> list[Any]:
    runner = key.split("'")[3]
    return [runner, tactic] if policy is None else [runner, tactic, policy]


def write_file(
    path: Path,
    entries: dict[str, list[Any]],
    *,
    metadata: dict[str, str] | None = H200_METADATA,
    mtime: float | None = None,
    records: dict[str, dict[str, Any]] | None = None,
) -> Path:
    """A ``save_configs``-shaped file (``_metadata`` first, then ``_records``), as vLLM leaves it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {} if metadata is None else {"_metadata": metadata}
    if records is not None:
        data["_records"] = records
    data.update(entries)
    path.write_text(json.dumps(data, indent=2))
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def write_v2_store(root: Path, entries: dict[str, Any], metadata: dict[str, str]) -> Path:
    """FlashInfer's managed store layout (``ficache.v2_store``): manifest plus one file per key."""
    manifest = manifest_for(metadata, {})
    env_dir = root / "v2" / env_hash(manifest)
    (env_dir / "entries").mkdir(parents=True)
    (env_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    for key, tactic in entries.items():
        entry = {"key": key, "runner": key.split("'")[3], "tactic": tactic}
        (env_dir / "entries" / entry_file_name(key)).write_text(
            json.dumps(entry, indent=2, sort_keys=True)
        )
    return env_dir


def autotune_root(vllm_root: Path, version: str = "0.7.2.post1", arch: str = "90a") -> Path:
    """``$VLLM_CACHE_ROOT/flashinfer_autotune_cache/<FlashInfer version>/<arch>``."""
    return vllm_root / "flashinfer_autotune_cache" / version / arch


def vllm_tree(tmp_path: Path) -> dict[str, Path]:
    """Every layout vLLM 0.27-0.33 writes, under a cache root and an override directory."""
    vllm_root = tmp_path / "vllm"
    # vLLM 0.27-0.31: rank 0's file, broadcast to every rank (an older FlashInfer).
    single = autotune_root(vllm_root, "0.6.18", "100a") / HASH_SINGLE
    write_file(
        single / "autotune_configs.json",
        {gemm(8): value(gemm(8), 1), moe(8): value(moe(8), [1, 2])},
        metadata=OLD_METADATA,
        mtime=T_SINGLE,
    )
    # vLLM 0.32+: TP2, one file per rank; a stale 0.31 file beside them; a temp file.
    tp2 = autotune_root(vllm_root) / HASH_TP2
    write_file(
        tp2 / "autotune_configs_dp0_rank0.json",
        {
            gemm(16): value(gemm(16), 7, POLICY),  # equal on both ranks: shared
            moe(16): value(moe(16), 3),  # differs: scoped to each rank
        },
        mtime=T_RANK0,
    )
    write_file(
        tp2 / "autotune_configs_dp0_rank1.json",
        {
            gemm(16): value(gemm(16), 7, POLICY),
            moe(16): value(moe(16), 4),
            moe(32): value(moe(32), 5),  # only on rank 1: scoped to rank 1
        },
        mtime=T_RANK1,
    )
    write_file(tp2 / "autotune_configs.json", {gemm(16): value(gemm(16), 2)}, mtime=T_SINGLE)
    (tp2 / ".autotune_configs_dp0_rank0.json.k2j3.tmp").write_text("{half a fi")
    # vLLM 0.32+: DP2 x TP1, world ranks 0 and 1 (the config hash ignores the DP rank).
    dp2 = autotune_root(vllm_root) / HASH_DP2
    write_file(
        dp2 / "autotune_configs_dp0_rank0.json",
        {gemm(64): value(gemm(64), 9), moe(64): value(moe(64), 0)},
    )
    write_file(
        dp2 / "autotune_configs_dp1_rank1.json",
        {gemm(64): value(gemm(64), 9), moe(64): value(moe(64), 1)},
    )
    # VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR: vLLM 0.32+ one GPU, and 0.33's v2 store beside it.
    override = tmp_path / "override"
    one_gpu = override / HASH_ONE_GPU
    write_file(one_gpu / "autotune_configs_dp0_rank0.json", {gemm(128): value(gemm(128), 11)})
    env_dir = write_v2_store(override, {gemm(256): 12, gemm(512): [3, [4, 5]]}, H200_METADATA)
    return {
        "vllm": vllm_root,
        "override": override,
        "single": single,
        "tp2": tp2,
        "dp2": dp2,
        "one_gpu": one_gpu,
        "env": env_dir,
    }


def tree_state(root: Path) -> dict[str, tuple[bytes, float]]:
    """Every path under ``root``: its bytes (b"" for a directory) and modification time."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"", p.stat().st_mtime)
        for p in sorted(root.rglob("*"))
    }


def stored(db: str | Path) -> set[tuple[str, str, str, str, str | None]]:
    """``(fingerprint digest, scope, key, tactic, policy)`` of every entry."""
    with Registry.open(str(db), create=False) as reg:
        digests = {i.id: i.fingerprint.digest for i in reg.fingerprints()}
        return {
            (digests[e.fingerprint_id], e.scope, e.key, e.tactic_json, e.policy_json)
            for e in reg.entries()
        }


POLICY_JSON = json.dumps(POLICY, separators=(",", ":"))


# --------------------------------------------------------------------------
# The library


def test_every_layout_is_adopted_with_the_right_scopes(tmp_path: Path, registry_db: str) -> None:
    tree = vllm_tree(tmp_path)
    before = [tree_state(tree["vllm"]), tree_state(tree["override"])]
    sources = Sources((tree["vllm"], tree["override"]))
    plan = plan_adoption(sources)

    assert plan.layouts == (
        AdoptedLayout(tree["single"], "single file", "shared", ("autotune_configs.json",), 2, 0, 0),
        AdoptedLayout(tree["tp2"], "single file", "shared", ("autotune_configs.json",), 1, 0, 0),
        AdoptedLayout(
            tree["one_gpu"],
            "per rank",
            "tp1-pp1-dp1-ep1",
            ("autotune_configs_dp0_rank0.json",),
            1,
            0,
            0,
        ),
        AdoptedLayout(
            tree["tp2"],
            "per rank",
            "tp2-pp1-dp1-ep1",
            ("autotune_configs_dp0_rank0.json", "autotune_configs_dp0_rank1.json"),
            1,
            3,
            0,
        ),
        AdoptedLayout(
            tree["dp2"],
            "per rank",
            "tp1-pp1-dp2-ep1",
            ("autotune_configs_dp0_rank0.json", "autotune_configs_dp1_rank1.json"),
            1,
            2,
            0,
        ),
    )
    assert plan.stores == (AdoptedStore(tree["env"], tree["env"].name, FP.digest, (), 2, 0, 0),)
    # The stale single file's gemm(16) (tactic 2) lost to the per-rank files' (7).
    assert (plan.conflicts, plan.skipped_count, plan.skipped, plan.ignored_records) == (1, 0, (), 0)
    assert (len(plan.entries), plan.shared, plan.scoped, plan.files) == (12, 7, 5, 9)

    result = plan.execute(Registry.open(registry_db))
    assert (result.commit_id, result.added, result.replaced) == (1, 12, 0)
    new, old = FP.digest, OLD_FP.digest
    assert stored(registry_db) == {
        (old, "shared", gemm(8), "1", None),
        (old, "shared", moe(8), "[1,2]", None),
        (new, "shared", gemm(16), "7", POLICY_JSON),
        (new, "tp2-pp1-dp1-ep1/rank0", moe(16), "3", None),
        (new, "tp2-pp1-dp1-ep1/rank1", moe(16), "4", None),
        (new, "tp2-pp1-dp1-ep1/rank1", moe(32), "5", None),
        (new, "shared", gemm(64), "9", None),
        (new, "tp1-pp1-dp2-ep1/rank0", moe(64), "0", None),
        (new, "tp1-pp1-dp2-ep1/rank1", moe(64), "1", None),
        (new, "shared", gemm(128), "11", None),
        (new, "shared", gemm(256), "12", None),
        (new, "shared", gemm(512), "[3,[4,5]]", None),
    }
    with Registry.open(registry_db) as reg:
        (commit,) = reg.log()
        tuned = {(row[1], row[2]): row[6] for row in reg.entry_values([1, 2])}
    assert commit.kind == "import"
    assert commit.message == f"adopted from vLLM: {tree['vllm']}, {tree['override']}"
    assert commit.provenance == {
        "source": "vllm-cache",
        "roots": [str(tree["vllm"]), str(tree["override"])],
        "layouts": [layout.as_json() for layout in plan.layouts],
        "v2_environments": [store.as_json() for store in plan.stores],
        "entries": 12,
        "shared": 7,
        "scoped": 5,
        "conflicts": 1,
        "skipped_count": 0,
        "records": 0,
        "records_shared": 0,
        "records_scoped": 0,
        "record_conflicts": 0,
        "ignored_records": 0,
    }
    # tuned_at: the file's modification time, the earliest one for a shared entry.
    assert tuned[("shared", gemm(8))] == T_SINGLE
    assert tuned[("shared", gemm(16))] == T_RANK0
    assert tuned[("tp2-pp1-dp1-ep1/rank1", moe(32))] == T_RANK1
    # Nothing under the roots was written, created or touched.
    assert [tree_state(tree["vllm"]), tree_state(tree["override"])] == before


def test_adopting_the_same_tree_again_makes_no_commit(tmp_path: Path, registry_db: str) -> None:
    tree = vllm_tree(tmp_path)
    sources = Sources((tree["vllm"], tree["override"]))
    with Registry.open(registry_db) as reg:
        assert plan_adoption(sources).execute(reg).commit_id == 1
        again = plan_adoption(sources).execute(reg)
        assert (again.commit_id, again.added, again.unchanged) == (None, 0, 12)
        assert len(reg.log()) == 1


def test_each_root_kind_is_recognised(tmp_path: Path) -> None:
    """A cache root, an autotune root and a deployment directory all find the same files."""
    tree = vllm_tree(tmp_path)
    for root in (tree["vllm"], autotune_root(tree["vllm"]), tree["tp2"]):
        plan = plan_adoption(Sources((root,)))
        tp2 = [g for g in plan.layouts if g.directory == tree["tp2"] and g.kind == "per rank"]
        assert [(g.layout, g.shared, g.scoped) for g in tp2] == [("tp2-pp1-dp1-ep1", 1, 3)], root
    # The override directory alone: its deployment directory and its v2 store.
    plan = plan_adoption(Sources((tree["override"],)))
    assert [g.directory for g in plan.layouts] == [tree["one_gpu"]]
    assert [s.path for s in plan.stores] == [tree["env"]]
    # FlashInfer's own store root given as a v2 root; a missing root finds nothing.
    plan = plan_adoption(Sources((tmp_path / "missing",), (tree["override"],)))
    assert (plan.layouts, [s.env_hash for s in plan.stores]) == ((), [tree["env"].name])
    assert plan_adoption(Sources((tmp_path / "missing",))).is_empty


def test_the_one_recogniser_names_what_an_adoption_finds(tmp_path: Path) -> None:
    """``ingest.recognise`` tells a vLLM tree from a v2 store and any other directory, by the
    same search an adoption makes; ``import`` and ``merge`` read paths through it."""
    from ficache import ingest

    tree = vllm_tree(tmp_path)
    for root in (tree["vllm"], autotune_root(tree["vllm"]), tree["tp2"], tree["one_gpu"]):
        assert ingest.recognise(root) == ingest.VLLM_TREE, root
        plan = plan_adoption(Sources((root,)))
        assert not plan.is_empty, root
    assert ingest.recognise(tree["env"]) == ingest.V2_STORE
    (tmp_path / "plain").mkdir()
    assert ingest.recognise(tmp_path / "plain") == ingest.DIRECTORY
    # An import of a vLLM tree is an import of directories (refused with the hint); a merge
    # refuses it as a directory.
    assert ingest.import_kind([tree["vllm"]]) == ingest.V2_STORE
    from ficache.errors import CacheFileError
    from ficache.merge import open_source

    with pytest.raises(CacheFileError, match="is a directory, expected a registry"):
        open_source(tree["tp2"])


def test_a_known_layout_scopes_by_the_rank_in_the_tuning_group(tmp_path: Path) -> None:
    """TP2 x PP2: vLLM's world ranks 0-3, the plugin's tuning group is one stage's TP group."""
    directory = autotune_root(tmp_path / "vllm") / HASH_TP2
    for rank in range(4):
        stage = rank // 2
        entries = {gemm(8 * (stage + 1)): value(gemm(8), rank % 2)}  # each stage its own layers
        entries[moe(8)] = value(moe(8), 6)  # every rank
        write_file(directory / f"autotune_configs_dp0_rank{rank}.json", entries)
    known = KnownLayout(directory, "tp2-pp2-dp1-ep1", 2)
    plan = plan_adoption(Sources((tmp_path / "vllm",)), known=known)
    assert [(g.layout, g.shared, g.scoped) for g in plan.layouts] == [("tp2-pp2-dp1-ep1", 1, 4)]
    assert {(e.scope, e.key, e.tactic_json) for e in plan.entries} == {
        ("shared", moe(8), "6"),
        ("tp2-pp2-dp1-ep1/rank0", gemm(8), "0"),
        ("tp2-pp2-dp1-ep1/rank1", gemm(8), "1"),
        ("tp2-pp2-dp1-ep1/rank0", gemm(16), "0"),
        ("tp2-pp2-dp1-ep1/rank1", gemm(16), "1"),
    }
    # Another directory is named from its files; directory=None applies to every one.
    assert (
        plan_adoption(
            Sources((tmp_path / "vllm",)),
            known=KnownLayout(tmp_path / "other", "tp9-pp1-dp1-ep1", 9),
        )
        .layouts[0]
        .layout
        == "tp4-pp1-dp1-ep1"
    )
    everywhere = plan_adoption(
        Sources((tmp_path / "vllm",)), known=KnownLayout(None, "tp4-pp1-dp1-ep4")
    )
    assert {e.scope for e in everywhere.entries} == {"shared"} | {
        f"tp4-pp1-dp1-ep4/rank{r}" for r in range(4)
    }


def test_bad_files_are_skipped_and_counted_never_raised(tmp_path: Path, registry_db: str) -> None:
    root = autotune_root(tmp_path / "vllm")
    tp2 = root / HASH_TP2
    write_file(tp2 / "autotune_configs_dp0_rank0.json", {gemm(8): value(gemm(8), 1)})
    (tp2 / "autotune_configs_dp0_rank1.json").write_text('{"_metadata": {"gpu": "NVIDIA H2')
    hostile = root / HASH_SINGLE / "autotune_configs.json"
    write_file(hostile, {"__import__('os').system('touch pwned')": ["X", 1]})
    bare = root / HASH_DP2 / "autotune_configs_dp0_rank0.json"
    write_file(bare, {gemm(8): value(gemm(8), 1)}, metadata=None)
    (root / HASH_ONE_GPU / "autotune_configs_dp0_rank0.json").mkdir(parents=True)  # a directory
    env_dir = write_v2_store(tmp_path / "store", {gemm(16): 2}, H200_METADATA)
    (env_dir / "entries" / entry_file_name(gemm(32))).write_text("{}")

    plan = plan_adoption(Sources((tmp_path / "vllm",), (tmp_path / "store",)))

    assert plan.skipped_count == 5
    reasons = [(Path(s.path).relative_to(tmp_path).as_posix(), s.reason) for s in plan.skipped]
    top = "vllm/flashinfer_autotune_cache/0.7.2.post1/90a"
    assert [r for r, _ in reasons] == [
        f"{top}/{HASH_SINGLE}/autotune_configs.json",
        f"{top}/{HASH_TP2}/autotune_configs_dp0_rank1.json",
        f"{top}/{HASH_DP2}/autotune_configs_dp0_rank0.json",
        f"{top}/{HASH_ONE_GPU}/autotune_configs_dp0_rank0.json",
        f"store/v2/{env_dir.name}/entries/{entry_file_name(gemm(32))}",
    ]
    assert reasons[0][1].startswith(
        '1 entry skipped: a key of no form FlashInfer writes (first: "__import__('
    )
    assert reasons[1][1].startswith("invalid JSON (")
    assert reasons[2][1] == "no _metadata, so its environment is unknown"
    assert reasons[3][1] == "is a directory, expected a FlashInfer cache file"
    assert reasons[4][1] == "needs a string key, a string runner and a tactic"
    # Rank 1's file is unreadable: it counts as a rank holding nothing, so rank 0's
    # entry is not "equal on every rank" and stays scoped to rank 0.
    assert {(e.scope, e.key) for e in plan.entries} == {
        ("tp2-pp1-dp1-ep1/rank0", gemm(8)),
        ("shared", gemm(16)),
    }
    tp2_layout = [g for g in plan.layouts if g.directory == tp2]
    assert [(g.shared, g.scoped, g.skipped) for g in tp2_layout] == [(0, 1, 1)]
    result = plan.execute(Registry.open(registry_db))
    assert result.added == 2
    with Registry.open(registry_db) as reg:
        provenance = reg.log()[0].provenance
    assert provenance["skipped_count"] == 5
    assert len(provenance["skipped"]) == 5
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()


NS = "trtllm_moe_da"
PROTOCOL_KEY = "('__protocol__', 'trtllm_moe_da', 'bucket8')"


def records_tree(tmp_path: Path) -> dict[str, Path]:
    """vLLM files holding FlashInfer's namespaced records (``_records``), and a v2 store
    holding a protocol record, under one VLLM_CACHE_ROOT-like root."""
    root = tmp_path / "vllm"
    tp2 = root / HASH_TP2
    # vLLM 0.31's single file beside 0.32's per-rank files: "a" differs from theirs.
    write_file(
        tp2 / "autotune_configs.json",
        {gemm(8): value(gemm(8), 1)},
        records={NS: {"a": 0, "s": {"old": True}}},
        mtime=T_SINGLE,
    )
    write_file(
        tp2 / "autotune_configs_dp0_rank0.json",
        {gemm(8): value(gemm(8), 1)},
        records={NS: {"a": 1, "b": [1], "c": "x"}},
        mtime=T_RANK0,
    )
    write_file(
        tp2 / "autotune_configs_dp0_rank1.json",
        {gemm(8): value(gemm(8), 1)},
        records={NS: {"a": 1, "b": [2]}, "other": {"d": 4.5}},
        mtime=T_RANK1,
    )
    # DP2: rank 1's file is truncated, so rank 0's records, equal or not, stay its own.
    dp2 = root / HASH_DP2
    write_file(dp2 / "autotune_configs_dp0_rank0.json", {}, records={NS: {"a": 1}})
    (dp2 / "autotune_configs_dp1_rank1.json").write_text('{"_metadata": {"gpu": "NVIDIA H2')
    env_dir = write_v2_store(root, {gemm(32): 5}, H200_METADATA)
    protocol = {"key": PROTOCOL_KEY, "runner": NS, "tactic": {"tiles": [1, 2]}}
    (env_dir / "entries" / entry_file_name(PROTOCOL_KEY)).write_text(
        json.dumps(protocol, indent=2, sort_keys=True)
    )
    return {"root": root, "tp2": tp2, "dp2": dp2, "env": env_dir}


#: ``(scope, namespace, key, value JSON, tuned_at)`` of every record ``records_tree`` gives.
TREE_RECORDS = {
    ("shared", NS, "a", "1", T_RANK0),  # equal on both ranks; the single file's 0 lost
    ("shared", NS, "s", '{"old":true}', T_SINGLE),
    ("tp2-pp1-dp1-ep1/rank0", NS, "b", "[1]", T_RANK0),
    ("tp2-pp1-dp1-ep1/rank1", NS, "b", "[2]", T_RANK1),
    ("tp2-pp1-dp1-ep1/rank0", NS, "c", '"x"', T_RANK0),
    ("tp2-pp1-dp1-ep1/rank1", "other", "d", "4.5", T_RANK1),
    ("tp1-pp1-dp2-ep1/rank0", NS, "a", "1", None),  # tuned_at: that file's mtime
}


def stored_records(db: str) -> set[tuple[str, str, str, str, float]]:
    from ficache.records import list_records

    with Registry.open(db, create=False) as reg:
        return {(r.scope, r.namespace, r.key, r.value_json, r.tuned_at) for r in list_records(reg)}


def expected_records(tree: dict[str, Path]) -> set[tuple[str, str, str, str, float]]:
    dp2_time = (tree["dp2"] / "autotune_configs_dp0_rank0.json").stat().st_mtime
    return {(*r[:4], dp2_time if r[4] is None else r[4]) for r in TREE_RECORDS}


@pytest.mark.usefixtures("backend")
def test_records_are_adopted_shared_where_every_rank_holds_them(
    tmp_path: Path, registry_db: str
) -> None:
    tree = records_tree(tmp_path)
    plan = plan_adoption(Sources((tree["root"],)))

    assert [(g.kind, g.directory, g.records_shared, g.records_scoped) for g in plan.layouts] == [
        ("single file", tree["tp2"], 2, 0),
        ("per rank", tree["tp2"], 1, 4),
        ("per rank", tree["dp2"], 0, 1),
    ]
    assert {(r.scope, r.namespace, r.key, r.value_json, r.tuned_at) for r in plan.records} == (
        expected_records(tree)
    )
    assert {r.fingerprint for r in plan.records} == {FP}
    # The single file's "a" lost to the per-rank files'; the v2 store's protocol record
    # is adopted as a protocol record, shared, never a namespaced record (see ficache.adopt);
    # rank 1's truncated file is skipped.
    assert (plan.record_conflicts, plan.ignored_records, plan.skipped_count) == (1, 0, 1)
    assert (len(plan.records), plan.records_shared, plan.records_scoped) == (7, 2, 5)
    env_time = (tree["env"] / "entries" / entry_file_name(PROTOCOL_KEY)).stat().st_mtime
    assert [
        (p.fingerprint, p.scope, p.namespace, p.key, p.value_json, p.policy_json, p.tuned_at)
        for p in plan.protocol_records
    ] == [(FP, "shared", NS, "bucket8", '{"tiles":[1,2]}', None, env_time)]

    with Registry.open(registry_db) as reg:
        result = plan.execute(reg)
        again = plan_adoption(Sources((tree["root"],))).execute(reg)
        (commit,) = reg.log()
    assert (result.commit_id, result.added, result.records_added) == (1, 2, 7)
    assert (result.protocol_added, commit.protocol_added) == (1, 1)
    assert stored_records(registry_db) == expected_records(tree)
    assert (commit.records_added, commit.records_replaced, commit.records_removed) == (7, 0, 0)
    assert {k: commit.provenance[k] for k in ("records", "records_shared", "records_scoped")} == {
        "records": 7,
        "records_shared": 2,
        "records_scoped": 5,
    }
    assert (commit.provenance["record_conflicts"], commit.provenance["ignored_records"]) == (1, 0)
    assert (commit.provenance["protocol_records"], commit.provenance["protocol_conflicts"]) == (
        1,
        0,
    )
    assert (again.commit_id, again.records_added, again.records_unchanged) == (None, 0, 7)
    assert again.protocol_unchanged == 1


def test_a_rank_loads_the_adopted_records_it_held(tmp_path: Path, registry_db: str) -> None:
    """What each rank's slice serves is what that rank's own file held."""
    tree = records_tree(tmp_path)
    with Registry.open(registry_db) as reg:
        plan_adoption(Sources((tree["tp2"],))).execute(reg)
        ids = [i.id for i in reg.fingerprints()]
        for rank in (0, 1):
            own = json.loads((tree["tp2"] / f"autotune_configs_dp0_rank{rank}.json").read_text())
            served = reg.slice_records(ids, ["shared", f"tp2-pp1-dp1-ep1/rank{rank}"])
            loaded = {ns: {k: json.loads(v) for k, v in by.items()} for ns, by in served.items()}
            # The single file's "s", which every rank loaded before 0.32, is served too.
            assert loaded == {**own["_records"], NS: {**own["_records"][NS], "s": {"old": True}}}


def test_cli_reports_adopted_and_ignored_records(
    cli: Any, tmp_path: Path, registry_db: str, created_note: Any
) -> None:
    tree = records_tree(tmp_path)

    result = cli("import", "--from-vllm", str(tree["root"]))
    report = json.loads(cli("import", "--from-vllm", str(tree["root"]), "--format", "json").stdout)

    assert result.exit_code == 0
    assert result.stdout.splitlines()[-1] == (
        "adopted 2 entries (2 shared, 0 scoped) and 7 records (2 shared, 5 scoped) and 1 "
        "protocol records (shared) from 7 file(s): 2 added, 0 replaced, 0 unchanged; records 7 "
        "added, 0 replaced, 0 unchanged; protocol records 1 added, 0 replaced, 0 unchanged "
        "(commit 1)"
    )
    stderr = result.stderr.removeprefix(created_note(registry_db))
    assert stderr.splitlines()[1:] == [
        "warning: 1 record(s) held different values in two vLLM caches; the later cache's "
        "value was kept",
    ]
    assert stderr.startswith("warning: skipped 1 unreadable file(s)")
    assert {
        k: report[k]
        for k in (
            "records",
            "records_shared",
            "records_scoped",
            "record_conflicts",
            "ignored_records",
            "commit",
            "records_added",
            "records_unchanged",
            "protocol_records",
            "protocol_added",
            "protocol_unchanged",
        )
    } == {
        "records": 7,
        "records_shared": 2,
        "records_scoped": 5,
        "record_conflicts": 1,
        "ignored_records": 0,
        "commit": None,
        "records_added": 0,
        "records_unchanged": 7,
        "protocol_records": 1,
        "protocol_added": 0,
        "protocol_unchanged": 1,
    }
    assert stored_records(registry_db) == expected_records(tree)


def held_values(db: str) -> tuple[set[tuple[Any, ...]], set[tuple[Any, ...]], set[tuple[Any, ...]]]:
    """The values of every entry, record and protocol record ``db`` holds (read whole, as
    ``merge`` reads a registry source)."""
    from ficache.merge import open_source

    held = open_source(db)
    return values_of(held.entries, held.records, held.protocol_records)


def values_of(
    entries: Any, records: Any, protocol_records: Any
) -> tuple[set[tuple[Any, ...]], set[tuple[Any, ...]], set[tuple[Any, ...]]]:
    """``(fingerprint digest, scope, identity..., value...)`` of entries, records and
    protocol records (when they were tuned left out)."""
    return (
        {
            (e.fingerprint.digest, e.scope, e.key, e.runner, e.tactic_json, e.policy_json)
            for e in entries
        },
        {(r.fingerprint.digest, r.scope, r.namespace, r.key, r.value_json) for r in records},
        {
            (p.fingerprint.digest, p.scope, p.namespace, p.key, p.value_json, p.policy_json)
            for p in protocol_records
        },
    )


#: The counts of an adoption's JSON report that say what its commit did.
WRITE_COUNTS = (
    "added",
    "replaced",
    "unchanged",
    "records_added",
    "records_replaced",
    "records_unchanged",
    "protocol_added",
    "protocol_replaced",
    "protocol_unchanged",
)


@pytest.mark.usefixtures("backend")
def test_a_dry_run_counts_exactly_what_the_adoption_then_writes(
    cli: Any, tmp_path: Path, registry_db: str, dump_db: Any
) -> None:
    """Per-rank files (with records) and a v2 store (with a protocol record) adopted into a
    registry that holds some of their values already, others with other values: the dry
    run's counts are the run's, and the registry then holds every value the plan listed."""
    from dataclasses import replace

    tree = records_tree(tmp_path)
    plan = plan_adoption(Sources((tree["root"],)))
    (entry_kept, entry_replaced), (protocol,) = plan.entries, plan.protocol_records
    record_kept, record_replaced = plan.records[:2]
    other = NewEntry(FP, gemm(999), "CutlassFp4GemmRunner", "1")
    with Registry.open(registry_db) as reg:
        reg.write(
            [entry_kept, entry_replaced._replace(tactic_json="99"), other],
            kind="import",
            records=[record_kept, replace(record_replaced, value_json='"before"')],
            protocol_records=[replace(protocol, value_json='"before"')],
        )
        previewed = plan.preview(reg)
    before = dump_db(registry_db)

    dry = cli("import", "--from-vllm", str(tree["root"]), "--dry-run", "--format", "json")
    assert dump_db(registry_db) == before
    run = cli("import", "--from-vllm", str(tree["root"]), "--format", "json")

    assert (dry.exit_code, run.exit_code) == (0, 0), dry.output + run.output
    dry_report, run_report = json.loads(dry.stdout), json.loads(run.stdout)
    counts = {k: dry_report[k] for k in WRITE_COUNTS}
    assert counts == {
        "added": 0,
        "replaced": 1,
        "unchanged": 1,
        "records_added": len(plan.records) - 2,
        "records_replaced": 1,
        "records_unchanged": 1,
        "protocol_added": 0,
        "protocol_replaced": 1,
        "protocol_unchanged": 0,
    }
    assert {k: run_report[k] for k in WRITE_COUNTS} == counts
    assert {k: getattr(previewed, k) for k in WRITE_COUNTS} == counts
    # Apart from what it did, the two reports are one report.
    assert {k: v for k, v in dry_report.items() if k not in ("commit", "dry_run")} == {
        k: v for k, v in run_report.items() if k not in ("commit", "dry_run")
    }
    assert (dry_report["commit"], run_report["commit"]) == (None, 2)
    entries, records, protocol_records = values_of(
        plan.entries, plan.records, plan.protocol_records
    )
    assert held_values(registry_db) == (
        entries | values_of([other], (), ())[0],
        records,
        protocol_records,
    )


def test_two_measurement_policies_of_one_environment_are_both_adopted(tmp_path: Path) -> None:
    """Each its own fingerprint (``Fingerprint.measurement``): before, the second was
    skipped as "a second measurement policy for one fingerprint"."""
    write_v2_store(tmp_path / "a", {gemm(8): 1}, H200_METADATA)
    manifest = manifest_for(H200_METADATA, {"measure_execution_mode": "cuda_graph"})
    env_dir = tmp_path / "b" / "v2" / env_hash(manifest)
    (env_dir / "entries").mkdir(parents=True)
    (env_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    plan = plan_adoption(Sources((), (tmp_path / "a", tmp_path / "b")))
    assert [s.path for s in plan.stores] == [
        tmp_path / "a" / "v2" / env_hash(manifest_for(H200_METADATA, {})),
        env_dir,
    ]
    assert plan.skipped_count == 0


def test_default_sources_follow_vllm_and_flashinfer() -> None:
    env = {"XDG_CACHE_HOME": "/x/cache", "FLASHINFER_WORKSPACE_BASE": "/fi"}
    assert default_sources(env) == Sources(
        (Path("/x/cache/vllm"),), (Path("/fi/.cache/flashinfer/autotune"),)
    )
    env = {
        "VLLM_CACHE_ROOT": "/v",
        "VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR": "/o",
        "FLASHINFER_AUTOTUNE_CACHE_DIR": "/s",
    }
    assert default_sources(env) == Sources((Path("/v"), Path("/o")), (Path("/s"),))


# --------------------------------------------------------------------------
# At startup: only into a registry that holds nothing for the fingerprint


def test_startup_adopts_into_an_empty_registry_once(tmp_path: Path, registry_path: Path) -> None:
    tree = vllm_tree(tmp_path)
    sources = Sources((tree["vllm"], tree["override"]))
    assert not registry_holds_entries_for(registry_path, FP)  # no file yet: nothing
    first = adopt_into_empty_registry(
        registry_path, FP, sources, provenance={"framework": "vllm", "source": "not this"}
    )
    assert first is not None and first.result.commit_id == 1 and first.result.added == 12
    with Registry.open(str(registry_path)) as reg:
        provenance = reg.log()[0].provenance
    assert provenance["framework"] == "vllm" and provenance["source"] == "vllm-cache"
    assert registry_holds_entries_for(registry_path, FP)
    # The next start finds entries for its fingerprint: nothing is read or written.
    assert adopt_into_empty_registry(registry_path, FP, sources) is None
    # A fingerprint the stored ones do not serve (another GPU) still gets an adoption,
    # which finds nothing new.
    other = Fingerprint.from_flashinfer_metadata({**H200_METADATA, "gpu": "NVIDIA B200"})
    assert not registry_holds_entries_for(registry_path, other)
    again = adopt_into_empty_registry(registry_path, other, sources)
    assert again is not None and again.result.commit_id is None


def test_startup_with_nothing_to_adopt_creates_no_registry(
    tmp_path: Path, registry_path: Path
) -> None:
    outcome = adopt_into_empty_registry(registry_path, FP, Sources((tmp_path / "nothing",)))
    assert outcome is not None and outcome.plan.is_empty and outcome.result.commit_id is None
    assert not registry_path.exists()


def test_startup_with_an_unusable_registry_raises_and_leaves_it(
    tmp_path: Path, dump_db: Callable[[str | Path], list[str]]
) -> None:
    tree = vllm_tree(tmp_path)
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"not a database\n" * 100)
    with pytest.raises(FicacheError):
        adopt_into_empty_registry(garbage, FP, Sources((tree["vllm"],)))
    assert garbage.read_bytes() == b"not a database\n" * 100
    registry = tmp_path / "registry.db"
    with Registry.open(str(registry)) as reg:
        reg.write([NewEntry(FP, gemm(8), "CutlassFp4GemmRunner", "1")], kind="import")
    before = dump_db(registry)
    assert adopt_into_empty_registry(registry, FP, Sources((tree["vllm"],))) is None
    assert dump_db(registry) == before


def test_startup_adoption_into_a_locked_registry_says_the_wait_it_bounded(
    tmp_path: Path, registry_path: Path, dump_db: Callable[[str | Path], list[str]]
) -> None:
    """The startup's bound on the lock wait (``busy_timeout``) is the one its error states."""
    import re
    import sqlite3

    from ficache.errors import RegistryBusyError

    tree = vllm_tree(tmp_path)
    other = Fingerprint.from_flashinfer_metadata({**H200_METADATA, "gpu": "NVIDIA B200"})
    with Registry.open(str(registry_path)) as reg:  # holds entries, none for FP
        reg.write([NewEntry(other, gemm(8), "CutlassFp4GemmRunner", "1")], kind="import")
    before = dump_db(registry_path)
    holder = sqlite3.connect(registry_path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another writer holds the write lock throughout
    try:
        with pytest.raises(RegistryBusyError) as raised:
            adopt_into_empty_registry(registry_path, FP, Sources((tree["vllm"],)), busy_timeout=0.2)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    message = str(raised.value)
    assert re.fullmatch(
        rf"registry {re.escape(str(registry_path))} stayed locked by another writer for "
        r"\d+\.\d s \(4 attempts, each waiting up to 0\.2 s for the lock\); "
        r"retry when it finishes",
        message,
    ), message
    assert dump_db(registry_path) == before


# --------------------------------------------------------------------------
# The CLI


def small_tree(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A TP2 deployment of vLLM 0.33 and its v2 store, under one VLLM_CACHE_ROOT-like root."""
    root = tmp_path / "vllm"
    directory = root / HASH_TP2
    write_file(
        directory / "autotune_configs_dp0_rank0.json",
        {gemm(8): value(gemm(8), 1), moe(8): value(moe(8), 2)},
    )
    write_file(
        directory / "autotune_configs_dp0_rank1.json",
        {gemm(8): value(gemm(8), 1), moe(8): value(moe(8), 3), moe(16): value(moe(16), 4)},
    )
    env_dir = write_v2_store(root, {gemm(32): 5}, H200_METADATA)
    return root, directory, env_dir


def test_cli_adopts_a_tree_and_reports_it(
    cli: Any, tmp_path: Path, registry_db: str, created_note: Any
) -> None:
    root, directory, env_dir = small_tree(tmp_path)
    result = cli("import", "--from-vllm", str(root))
    assert (result.exit_code, result.stderr) == (0, created_note(registry_db))
    assert result.stdout.splitlines() == [
        "kind      layout           files  shared  scoped  skipped  directory",
        f"per rank  tp2-pp1-dp1-ep1  2      1       3       0        {directory}",
        f"v2 store  shared           1      1       0       0        {env_dir}",
        "adopted 5 entries (2 shared, 3 scoped) from 3 file(s): 5 added, 0 replaced, "
        "0 unchanged (commit 1)",
    ]
    assert {(scope, key) for _fp, scope, key, _t, _p in stored(registry_db)} == {
        ("shared", gemm(8)),
        ("shared", gemm(32)),
        ("tp2-pp1-dp1-ep1/rank0", moe(8)),
        ("tp2-pp1-dp1-ep1/rank1", moe(8)),
        ("tp2-pp1-dp1-ep1/rank1", moe(16)),
    }
    again = cli("import", "--from-vllm", str(root), "--format", "json")
    assert again.exit_code == 0
    report = json.loads(again.stdout)
    assert report == {
        "roots": [str(root)],
        "layouts": [
            {
                "directory": str(directory),
                "kind": "per rank",
                "layout": "tp2-pp1-dp1-ep1",
                "files": ["autotune_configs_dp0_rank0.json", "autotune_configs_dp0_rank1.json"],
                "shared": 1,
                "scoped": 3,
                "skipped": 0,
                "records_shared": 0,
                "records_scoped": 0,
            }
        ],
        "v2_environments": [
            {
                "path": str(env_dir),
                "env_hash": env_dir.name,
                "fingerprint": FP.digest,
                "measurement": {},
                "entries": 1,
                "skipped_entries": 0,
                "records": 0,
            }
        ],
        "files": 3,
        "entries": 5,
        "shared": 2,
        "scoped": 3,
        "conflicts": 0,
        "skipped": 0,
        "records": 0,
        "records_shared": 0,
        "records_scoped": 0,
        "record_conflicts": 0,
        "ignored_records": 0,
        "commit": None,
        "dry_run": False,
        "added": 0,
        "replaced": 0,
        "unchanged": 5,
        "records_added": 0,
        "records_replaced": 0,
        "records_unchanged": 0,
    }


def test_cli_dry_run_shows_the_adoption_and_changes_nothing(
    cli: Any, tmp_path: Path, registry_path: Path
) -> None:
    root, directory, env_dir = small_tree(tmp_path)
    table = [
        "kind      layout           files  shared  scoped  skipped  directory",
        f"per rank  tp2-pp1-dp1-ep1  2      1       3       0        {directory}",
        f"v2 store  shared           1      1       0       0        {env_dir}",
    ]
    summary = "5 entries (2 shared, 3 scoped) from 3 file(s): 5 added, 0 replaced, 0 unchanged"

    planned = cli("import", "--from-vllm", str(root), "--dry-run")

    assert (planned.exit_code, planned.stderr) == (0, "")
    assert planned.stdout.splitlines() == [
        *table,
        f"would adopt {summary} (dry run: nothing changed)",
    ]
    assert not registry_path.exists()
    assert cli("import", "--from-vllm", str(root)).stdout.splitlines() == [
        *table,
        f"adopted {summary} (commit 1)",
    ]
    before = registry_path.read_bytes()
    again = cli("import", "--from-vllm", str(root), "--dry-run", "--format", "json")
    assert {k: json.loads(again.stdout)[k] for k in ("dry_run", "commit", "unchanged")} == {
        "dry_run": True,
        "commit": None,
        "unchanged": 5,
    }
    assert registry_path.read_bytes() == before


def test_cli_layout_names_the_scopes(cli: Any, tmp_path: Path, registry_db: str) -> None:
    root, _directory, _env = small_tree(tmp_path)
    result = cli("import", "--from-vllm", str(root), "--layout", "tp2-pp1-dp1-ep2")
    assert result.exit_code == 0, result.output
    scopes = {scope for _fp, scope, _key, _t, _p in stored(registry_db)}
    assert scopes == {"shared", "tp2-pp1-dp1-ep2/rank0", "tp2-pp1-dp1-ep2/rank1"}


def test_cli_default_roots_are_vllms_and_flashinfers(
    cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, directory, env_dir = small_tree(tmp_path)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(root))
    monkeypatch.setenv("FLASHINFER_AUTOTUNE_CACHE_DIR", str(tmp_path / "flashinfer-store"))
    monkeypatch.delenv("VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR", raising=False)
    result = cli("import", "--from-vllm")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1].startswith("adopted 5 entries (2 shared, 3 scoped)")


def test_cli_reports_skipped_files_and_imports_the_rest(
    cli: Any, tmp_path: Path, registry_db: str, created_note: Any
) -> None:
    root, directory, _env = small_tree(tmp_path)
    broken = directory.parent / HASH_DP2 / "autotune_configs.json"
    broken.parent.mkdir()
    broken.write_bytes(b'{"_metadata": ')
    result = cli("import", "--from-vllm", str(root))
    assert result.exit_code == 0
    assert result.stdout.splitlines()[1] == (
        f"single file  shared           1      0       0       1        {broken.parent}"
    )
    assert result.stderr == created_note(registry_db) + (
        "warning: skipped 1 unreadable file(s), entr(ies) or environment(s); first: "
        f"{broken}: invalid JSON (Expecting value: line 1 column 15 (char 14)); "
        "the file is truncated or not a FlashInfer cache\n"
    )
    assert len(stored(registry_db)) == 5


#: Where ``--from-vllm`` looks under each ROOT, as "found nothing to adopt" names it.
SEARCHED = (
    "looked for autotune_configs.json (vLLM 0.27-0.31) and autotune_configs_dp<D>_rank<R>.json "
    "(vLLM 0.32+) in ROOT, ROOT/* and ROOT/flashinfer_autotune_cache/<version>/<arch>[/*], and "
    "for a FlashInfer v2 store (v2/) in those"
)


def test_cli_with_nothing_to_adopt_names_where_it_looked_and_writes_nothing(
    cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "empty"
    (empty / "other").mkdir(parents=True)
    (empty / "other" / "cache.json").write_text("{}")  # not a name vLLM writes: not looked at
    result = cli("import", "--from-vllm", str(empty))
    assert (result.exit_code, result.stdout, result.stderr) == (
        0,
        f"found nothing to adopt under {empty}: {SEARCHED}; ROOT: {empty}\n",
        "",
    )

    for name in (
        "VLLM_CACHE_ROOT",
        "VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR",
        "FLASHINFER_WORKSPACE_BASE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FLASHINFER_AUTOTUNE_CACHE_DIR", str(tmp_path / "fi"))
    (tmp_path / "fi").mkdir()
    vllm = tmp_path / "user-cache" / "vllm"
    defaults = cli("import", "--from-vllm")
    assert defaults.stdout == (
        f"found nothing to adopt under {vllm}, {tmp_path / 'fi'}: {SEARCHED}; ROOT: {vllm} "
        f"(missing); and for a v2 store in {tmp_path / 'fi'}\n"
    )
    assert not (tmp_path / "registry.db").exists()


def test_a_directory_given_to_import_says_which_import_fits_it(
    cli: Any, tmp_path: Path, dump_db: Any, registry_path: Path
) -> None:
    assert (
        cli("import", write_file(tmp_path / "seed.json", {gemm(8): value(gemm(8), 1)})).exit_code
        == 0
    )
    before = dump_db(registry_path)
    vllm = tmp_path / "vllm"
    write_file(
        autotune_root(vllm) / HASH_SINGLE / "autotune_configs.json", {gemm(8): value(gemm(8), 1)}
    )
    deployment = tmp_path / "deployment"
    write_file(deployment / "autotune_configs_dp0_rank0.json", {gemm(8): value(gemm(8), 1)})
    saved = tmp_path / "saved caches"
    for name in ("a.json", "b.json"):
        write_file(saved / name, {gemm(8): value(gemm(8), 1)})
    empty = tmp_path / "empty"
    empty.mkdir()
    not_a_store = "not a FlashInfer v2 store (no v2/ directory) nor one of its environment directories (no manifest.json)"

    for directory, hint in [
        (
            vllm,
            f"it holds vLLM's autotune caches: adopt them with `ficache import --from-vllm {vllm}`",
        ),
        (
            deployment,
            f"it holds vLLM's autotune caches: adopt them with `ficache import --from-vllm {deployment}`",
        ),
        (
            saved,
            f"to import the 2 cache file(s) in it, name them: `ficache import '{saved}'/*.json`",
        ),
        (
            empty,
            "it holds no cache file (*.json) and no vLLM autotune cache; give cache files "
            "(`ficache import DIR/*.json`) or vLLM's cache root (`ficache import --from-vllm DIR`)",
        ),
    ]:
        result = cli("import", directory)
        assert (result.exit_code, result.stdout) == (1, "")
        assert result.stderr == f"error: {directory}: {not_a_store}; {hint}\n"
    assert dump_db(registry_path) == before


def test_cli_refuses_a_root_that_is_not_a_directory(
    cli: Any, tmp_path: Path, registry_db: str, dump_db: Callable[[str | Path], list[str]]
) -> None:
    root, _directory, _env = small_tree(tmp_path)
    assert cli("import", "--from-vllm", str(root)).exit_code == 0
    before = dump_db(registry_db)
    missing = tmp_path / "nowhere"
    result = cli("import", "--from-vllm", str(missing))
    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr == (
        f"error: {missing} does not exist; give vLLM's cache root (VLLM_CACHE_ROOT, default "
        "~/.cache/vllm) or its VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR\n"
    )
    a_file = root / HASH_TP2 / "autotune_configs_dp0_rank0.json"
    result = cli("import", "--from-vllm", str(a_file))
    assert result.exit_code == 1
    assert result.stderr.startswith(f"error: {a_file} is not a directory; ")
    assert dump_db(registry_db) == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--from-vllm", "ROOT", "file.json"],
            "--from-vllm takes no FILES, --fingerprint or --scope",
        ),
        (["--from-vllm", "ROOT", "--scope", "tp2/rank0"], "--from-vllm takes no FILES"),
        (["--layout", "tp2-pp1-dp1-ep1", "file.json"], "--layout goes with --from-vllm"),
        ([], "give FILES to import, or --from-vllm"),
        (["--from-vllm", "ROOT", "--layout", "a/b"], "'a/b' is not a layout the vLLM plugin names"),
        (["--from-vllm", "ROOT", "--on-conflict", "theirs"], "--on-conflict goes with FILES"),
    ],
)
def test_cli_usage_errors(cli: Any, tmp_path: Path, args: list[str], message: str) -> None:
    root, _directory, _env = small_tree(tmp_path)
    argv = [str(root) if a == "ROOT" else a for a in args]
    result = cli("import", *argv)
    assert result.exit_code == 2
    assert message in result.stderr
    assert not (tmp_path / "registry.db").exists()
