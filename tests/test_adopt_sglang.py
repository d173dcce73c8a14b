"""Adopting SGLang's own autotune files (``ficache.sglang_cache``, ``import --from-sglang``).

The trees are SGLang 0.5.23's layout
(``<root>/flashinfer/autotune/<fi version>/sm<XY>/<hash16>/rank_tp{t}_pp{p}_dp{d}[_gpu<uuid>].json``
and ``runs/``), each file written by FlashInfer's real ``save_configs``
(``save_rank_file``: the AutoTuner loads the entries, then saves). SGLang's
own path function writes a tree in ``tests/test_sglang_plugin.py`` (the
sglang tox env). Real SQLite registries; the CLI through ``cli``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from ficache.adopt import KnownLayout, Sources, plan_adoption
from ficache.registry import Registry

HASH = "0123456789abcdef"
HASH_EP = "fedcba9876543210"


def key(m: int, op: str = "flashinfer::mm_fp4") -> str:
    return f"('{op}', 'CutlassFp4GemmRunner', (({m}, 4096), (4096, 2048)), (torch.bfloat16, 1))"


def deployment(root: Path, digest: str = HASH) -> Path:
    import flashinfer

    return root / "flashinfer" / "autotune" / flashinfer.__version__ / "sm90" / digest


def save_rank_file(path: Path, tactics: dict[str, int]) -> Path:
    """``path`` written by FlashInfer's ``save_configs`` holding ``tactics`` (and nothing else)."""
    from flashinfer.autotuner import AutoTuner, _collect_metadata

    tuner = AutoTuner.get()
    tuner.clear_cache()
    source = path.with_name(path.name + ".src")
    path.parent.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {"_metadata": _collect_metadata()}
    data.update({k: ["CutlassFp4GemmRunner", t] for k, t in tactics.items()})
    source.write_text(json.dumps(data))
    assert tuner.load_configs(str(source))
    source.unlink()
    tuner.save_configs(str(path))
    tuner.clear_cache()
    return path


def rank_file(directory: Path, t: int, p: int = 0, d: int = 0) -> Path:
    return directory / f"rank_tp{t}_pp{p}_dp{d}.json"


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    """A TP2 deployment whose ranks agree, an EP2 one whose ranks differ on one key,
    a PP2 deployment, and a runs/ directory."""
    root = tmp_path / "sglang"
    tp2 = deployment(root)
    for t in (0, 1):
        save_rank_file(rank_file(tp2, t), {key(1): 3, key(2): 4})
    ep2 = deployment(root, HASH_EP)
    save_rank_file(rank_file(ep2, 0), {key(4): 1, key(8): 2})
    save_rank_file(rank_file(ep2, 1), {key(4): 1, key(8): 5})  # expert ranks differ
    pp2 = deployment(root, "1" * 16)
    for p in (0, 1):
        save_rank_file(rank_file(pp2, 0, p), {key(16, f"op{p}"): p})
    runs = tp2 / "runs"
    save_rank_file(runs / f"rank_tp0_pp0_dp0.20260101_000000.{'a' * 32}.json", {key(32): 1})
    save_rank_file(runs / f"rank_tp1_pp0_dp0.20260101_000001.{'b' * 32}.json", {key(32): 1})
    return root


def sources(root: Path) -> Sources:
    return Sources((root,), engine="sglang")


def test_every_layout_is_found_and_equal_keys_are_shared(tree: Path) -> None:
    plan = plan_adoption(sources(tree))
    assert plan.skipped_count == 0, plan.skipped
    groups = {
        (Path(g.directory).name, g.kind, g.layout): (g.shared, g.scoped) for g in plan.layouts
    }
    assert groups == {
        (HASH, "sglang per rank", "tp2-pp1-dp1-ep1.pp0.dp0"): (2, 0),
        ("runs", "sglang runs", "tp2-pp1-dp1-ep1.pp0.dp0"): (1, 0),
        (HASH_EP, "sglang per rank", "tp2-pp1-dp1-ep1.pp0.dp0"): (1, 2),
        ("1" * 16, "sglang per rank", "tp1-pp2-dp1-ep1.pp0.dp0"): (1, 0),
        ("1" * 16, "sglang per rank", "tp1-pp2-dp1-ep1.pp1.dp0"): (1, 0),
    }
    scoped = sorted((e.scope, e.tactic_json) for e in plan.entries if e.key == key(8))
    assert scoped == [
        ("tp2-pp1-dp1-ep1.pp0.dp0/rank0", "2"),
        ("tp2-pp1-dp1-ep1.pp0.dp0/rank1", "5"),
    ]
    assert plan.provenance()["source"] == "sglang-cache"
    assert plan.conflicts == 0


def test_a_known_layout_names_the_ep_size(tree: Path) -> None:
    known = KnownLayout(deployment(tree, HASH_EP), "tp2-pp1-dp1-ep2", 2)
    plan = plan_adoption(sources(tree), known=known)
    scopes = sorted(e.scope for e in plan.entries if e.key == key(8))
    assert scopes == ["tp2-pp1-dp1-ep2.pp0.dp0/rank0", "tp2-pp1-dp1-ep2.pp0.dp0/rank1"]


def test_the_plugin_asks_for_the_scopes_adoption_stores(tree: Path, tmp_path: Path) -> None:
    """The layout the plugin names for rank 1 of an EP2 group serves rank 1's tactic."""
    from ficache.fingerprint import collect
    from ficache.slices import export_slices

    db = tmp_path / "r.db"
    known = KnownLayout(deployment(tree, HASH_EP), "tp2-pp1-dp1-ep2", 2)
    with Registry.open(str(db)) as reg:
        plan_adoption(sources(tree), known=known).execute(reg)
        exported = export_slices(reg, collect(), "tp2-pp1-dp1-ep2.pp0.dp0", 2)
    rank1 = json.loads(exported.base) | json.loads(exported.overlays[1] or "{}")
    assert rank1[key(8)][1] == 5


def _registry_bytes(db: Path) -> bytes:
    return db.read_bytes() if db.exists() else b""


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("truncated", '{"_metadata": {"flashinfer_version": "0.7', "JSON"),
        ("nan", None, "NaN"),
        ("non_object", "[1, 2, 3]", "object"),
        ("hostile_key", None, "key"),
        ("unknown", None, "unknown"),
    ],
)
def test_bad_files_are_skipped_and_counted_and_nothing_runs(
    tmp_path: Path, cli: Any, registry_db: str, name: str, content: str | None, reason: str
) -> None:
    from flashinfer.autotuner import _collect_metadata

    root = tmp_path / "sglang"
    good = deployment(root)
    save_rank_file(rank_file(good, 0), {key(1): 3})
    bad = deployment(root, "9" * 16) / "rank_tp0_pp0_dp0.json"
    bad.parent.mkdir(parents=True)
    marker = tmp_path / "PWNED"
    if name == "nan":
        content = json.dumps({"_metadata": _collect_metadata()})[:-1] + ', "k": ["R", NaN]}'
    elif name == "hostile_key":
        hostile = f"__import__('os').system('touch {marker}')"
        content = json.dumps({"_metadata": _collect_metadata(), hostile: ["R", 1]})
    elif name == "unknown":
        content = json.dumps(
            {
                "_metadata": {**_collect_metadata(), "flashinfer_version": "unknown"},
                key(2): ["CutlassFp4GemmRunner", 1],
            }
        )
    assert content is not None
    bad.write_text(content)
    plan = plan_adoption(sources(root))
    assert plan.skipped_count == 1, plan.skipped
    assert reason.lower() in plan.skipped[0].reason.lower() or name == "hostile_key"
    assert [e.key for e in plan.entries] == [key(1)]
    db = Path(registry_db)
    before = _registry_bytes(db)
    dry = cli("import", "--from-sglang", str(root), "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert "skipped 1" in dry.stderr
    assert _registry_bytes(db) == before
    done = cli("import", "--from-sglang", str(root))
    assert done.exit_code == 0, done.output
    assert "adopted 1 entries" in done.stdout
    assert not marker.exists()


def test_a_symlink_that_leaves_the_root_is_refused(tmp_path: Path) -> None:
    """The directory link is refused as a whole, never entered: the outside directory holds
    several rank files, a runs/ directory and deployments below it, so a walk that entered
    it and then refused each file would skip more, and name other paths, than the link."""
    elsewhere = tmp_path / "elsewhere"
    outside = deployment(elsewhere)
    for t in (0, 1, 2):
        save_rank_file(rank_file(outside, t), {key(1): 3})
    save_rank_file(outside / "runs" / f"rank_tp0_pp0_dp0.20260101_000000.{'c' * 32}.json", {})
    for nested in ("1" * 16, "2" * 16):
        save_rank_file(rank_file(outside / nested, 0), {key(64): 1})
    root = tmp_path / "sglang"
    inside = deployment(root)
    save_rank_file(rank_file(inside, 0), {key(2): 4})
    linked_dir = inside.parent / ("e" * 16)
    os.symlink(outside, linked_dir)  # a directory link out of ROOT
    os.symlink(rank_file(outside, 0), rank_file(inside, 1))  # a file link out of ROOT
    plan = plan_adoption(sources(root))
    assert [e.key for e in plan.entries] == [key(2)]
    assert plan.skipped_count == 2, plan.skipped
    assert sorted(str(s.path) for s in plan.skipped) == sorted(
        [str(linked_dir), str(rank_file(inside, 1))]
    )
    assert all("outside the root" in s.reason for s in plan.skipped)


def test_temp_files_are_skipped(tmp_path: Path) -> None:
    root = tmp_path / "sglang"
    directory = deployment(root)
    save_rank_file(rank_file(directory, 0), {key(1): 3})
    (directory / ".autotuner_x1y2.tmp").write_text('{"_metadata": {}, "half')
    plan = plan_adoption(sources(root))
    assert [e.key for e in plan.entries] == [key(1)]
    assert plan.skipped_count == 1 and "temporary" in plan.skipped[0].reason


def test_cli_default_root_is_sglang_cache_dir(
    tree: Path, cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SGLANG_CACHE_DIR", str(tree))
    result = cli("import", "--from-sglang", "--format", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["entries"] == 8 and report["scoped"] == 2


def test_cli_refuses_a_missing_root_and_mixed_sources(tmp_path: Path, cli: Any) -> None:
    missing = cli("import", "--from-sglang", str(tmp_path / "nope"))
    assert missing.exit_code == 1
    assert "SGLANG_CACHE_DIR" in missing.output and len(missing.output.strip().splitlines()) == 1
    both = cli("import", "--from-sglang", str(tmp_path), "--from-vllm", str(tmp_path))
    assert both.exit_code == 2


def test_cli_layout_names_the_sizes_of_every_deployment(tree: Path, cli: Any) -> None:
    result = cli("import", "--from-sglang", str(tree), "--layout", "tp2-pp1-dp1-ep2")
    assert result.exit_code == 0, result.output
    listed = cli("list", "--format", "json")
    assert listed.exit_code == 0, listed.output
    assert "tp2-pp1-dp1-ep2.pp0.dp0/rank1" in listed.stdout
    bad = cli("import", "--from-sglang", str(tree), "--layout", "tp2")
    assert bad.exit_code == 2
