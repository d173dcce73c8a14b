"""ficache.slices: each rank's slice of a real SQLite registry, and the slice cache."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from ficache.fingerprint import FLASHINFER_FIELDS, Fingerprint
from ficache.flashinfer_format import parse_cache_bytes
from ficache.registry import NewEntry, Registry, rank_scope
from ficache.slices import RankSlices, cached_slices, export_slices, registry_state

FP = Fingerprint(
    **{name: "v1" for name in FLASHINFER_FIELDS}, compute_capability="9.0", torch_version="2.13"
)


def key(i: int, extra: str = "") -> str:
    extras = ("torch.bfloat16", extra) if extra else ("torch.bfloat16",)
    return str(("flashinfer::mm", "Runner", ((1 << i, 64), (64, 64)), extras))


def entries_of(text: str) -> dict[str, str]:
    cache = parse_cache_bytes(text.encode())
    assert cache.metadata == FP.flashinfer_metadata()
    return {e.key: e.tactic_json for e in cache.entries}


def slice_of(slices: RankSlices, rank: int) -> dict[str, str]:
    """What rank ``rank`` holds after loading the base, then its overlay."""
    held = entries_of(slices.base)
    overlay = slices.overlays[rank]
    if overlay is not None:
        held.update(entries_of(overlay))
    assert len(held) == slices.counts[rank]
    return held


@pytest.fixture
def reg(tmp_path: Path):  # type: ignore[no-untyped-def]
    with Registry.open(str(tmp_path / "registry.db")) as registry:
        yield registry


def write(reg: Registry, rows: list[tuple[str, str, str]], fp: Fingerprint = FP) -> None:
    reg.write([NewEntry(fp, k, "Runner", t, None, s) for k, t, s in rows], kind="import")


def test_empty_registry_gives_empty_slices(reg: Registry, tmp_path: Path) -> None:
    slices = export_slices(reg, FP, "tp2", 2, cache_dir=tmp_path / "c")
    assert slices.counts == (0, 0) and slices.uniform
    assert slice_of(slices, 0) == {} and slices.overlays == (None, None)


def test_shared_only_is_one_text_for_every_rank(reg: Registry, tmp_path: Path) -> None:
    write(reg, [(key(i), str(i), "shared") for i in range(5)])
    slices = export_slices(reg, FP, "tp4", 4, cache_dir=tmp_path / "c")
    assert slices.counts == (5,) * 4 and slices.uniform
    assert slice_of(slices, 3) == {key(i): str(i) for i in range(5)}


def test_rank_scoped_entries_win_over_shared_for_their_rank(reg: Registry, tmp_path: Path) -> None:
    write(reg, [(key(0), "0", "shared"), (key(1), "1", "shared")])
    write(
        reg,
        [
            (key(1), "7", rank_scope("tp2", 1)),
            (key(2, "rank0"), "2", rank_scope("tp2", 0)),
            (key(2, "rank1"), "3", rank_scope("tp2", 1)),
            (key(3), "9", rank_scope("tp8", 1)),
        ],
    )
    slices = export_slices(reg, FP, "tp2", 2, cache_dir=tmp_path / "c")
    assert not slices.uniform and slices.counts == (3, 3)
    assert slice_of(slices, 0) == {key(0): "0", key(1): "1", key(2, "rank0"): "2"}
    assert slice_of(slices, 1) == {key(0): "0", key(1): "7", key(2, "rank1"): "3"}
    # The overlays hold only what differs from the shared base.
    assert entries_of(slices.overlays[1] or "") == {key(1): "7", key(2, "rank1"): "3"}


def test_asymmetric_scopes_fall_back_to_shared_only(reg: Registry, tmp_path: Path) -> None:
    write(
        reg,
        [
            (key(0), "0", "shared"),
            (key(1, "rank0"), "1", rank_scope("tp2", 0)),
            (key(2, "rank0"), "2", rank_scope("tp2", 0)),
            (key(1, "rank1"), "1", rank_scope("tp2", 1)),
        ],
    )
    slices = export_slices(reg, FP, "tp2", 2, cache_dir=tmp_path / "c")
    assert slices.counts == (1, 1) and slices.uniform
    assert "differ in number between ranks (3, 2)" in slices.warnings[0]
    # After tuning (nobody profiles any more) every rank gets all of its own entries.
    final = export_slices(reg, FP, "tp2", 2, cache_dir=tmp_path / "c", for_tuning=False)
    assert final.counts == (3, 2) and final.warnings == ()


def test_exact_fingerprint_wins_over_a_wildcard_one(reg: Registry, tmp_path: Path) -> None:
    wildcard = Fingerprint(**{**FP.as_dict(), "torch_version": "*"})
    write(reg, [(key(0), "1", "shared"), (key(1), "1", "shared")], fp=wildcard)
    write(reg, [(key(0), "2", "shared")])
    other = Fingerprint(**{**FP.as_dict(), "gpu": "other"})
    write(reg, [(key(5), "5", "shared")], fp=other)
    slices = export_slices(reg, FP, "world1", 1, cache_dir=tmp_path / "c")
    assert slice_of(slices, 0) == {key(0): "2", key(1): "1"}


def test_slice_cache_hit_miss_and_invalidation(reg: Registry, tmp_path: Path) -> None:
    cache_dir = tmp_path / "c"
    write(reg, [(key(i), str(i), "shared") for i in range(3)])
    first = export_slices(reg, FP, "tp2", 2, cache_dir=cache_dir)
    second = export_slices(reg, FP, "tp2", 2, cache_dir=cache_dir)
    assert (first.cache, second.cache) == ("miss", "hit")
    assert (second.base, second.overlays, second.counts) == (
        first.base,
        first.overlays,
        first.counts,
    )
    assert second.uniform
    assert second.state == registry_state(reg)
    # A commit changes the registry's state: the cache is stale.
    write(reg, [(key(9), "9", "shared")])
    third = export_slices(reg, FP, "tp2", 2, cache_dir=cache_dir)
    assert third.cache == "miss" and third.counts == (4, 4)
    # So does a change behind the registry's back.
    path = reg.location.path
    assert path is not None
    conn = sqlite3.connect(path)
    conn.execute("DELETE FROM entries WHERE key = ?", (key(9),))
    conn.commit()
    conn.close()
    assert export_slices(reg, FP, "tp2", 2, cache_dir=cache_dir).counts == (3, 3)
    # Other layouts and fingerprints have their own cache files.
    assert export_slices(reg, FP, "tp4", 4, cache_dir=cache_dir).cache == "miss"
    assert export_slices(reg, FP, "tp2", 2, cache_dir=cache_dir, use_cache=False).cache == "off"


@pytest.mark.parametrize("damage", ["truncate", "flip", "header", "empty"])
def test_a_damaged_slice_cache_is_a_miss_never_an_error(
    reg: Registry, tmp_path: Path, damage: str
) -> None:
    cache_dir = tmp_path / "c"
    write(reg, [(key(i), str(i), "shared") for i in range(3)])
    good = export_slices(reg, FP, "tp2", 2, cache_dir=cache_dir)
    (path,) = cache_dir.iterdir()
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[:-10])
    elif damage == "flip":
        path.write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
    elif damage == "header":
        head, _, body = data.partition(b"\n")
        header = json.loads(head.split(b" ", 1)[1])
        header["overlays"] = [None, None, None]  # three ranks for a layout of two
        path.write_bytes(b"FICACHE-SLICES " + json.dumps(header).encode() + b"\n" + body)
    else:
        path.write_bytes(b"")
    again = export_slices(reg, FP, "tp2", 2, cache_dir=cache_dir)
    assert again.cache == "miss" and (again.base, again.overlays) == (good.base, good.overlays)
    assert export_slices(reg, FP, "tp2", 2, cache_dir=cache_dir).cache == "hit"  # rewritten


def test_unwritable_cache_dir_only_costs_speed(reg: Registry, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    write(reg, [(key(0), "0", "shared")])
    slices = export_slices(reg, FP, "tp2", 2, cache_dir=blocker / "c")
    assert slices.counts == (1, 1)


def test_cached_slices_reads_the_cache_without_opening_the_registry(
    reg: Registry, tmp_path: Path
) -> None:
    cache_dir = tmp_path / "c"
    db = str(reg.location.path)
    write(reg, [(key(i), str(i), "shared") for i in range(3)])
    assert cached_slices(db, FP, "tp2", 2, cache_dir=cache_dir) is None  # nothing cached yet
    exported = export_slices(reg, FP, "tp2", 2, cache_dir=cache_dir)
    found = cached_slices(db, FP, "tp2", 2, cache_dir=cache_dir)
    assert found is not None
    slices, display = found
    assert display == db and slices.cache == "hit" and slices.base == exported.base
    write(reg, [(key(7), "7", "shared")])
    assert cached_slices(db, FP, "tp2", 2, cache_dir=cache_dir) is None  # stale


@pytest.mark.parametrize("change", ["revision", "corrupt", "missing"])
def test_cached_slices_doubts_send_the_caller_to_the_registry(
    reg: Registry, tmp_path: Path, change: str
) -> None:
    cache_dir = tmp_path / "c"
    path = reg.location.path
    assert path is not None
    write(reg, [(key(0), "0", "shared")])
    export_slices(reg, FP, "tp2", 2, cache_dir=cache_dir)
    assert cached_slices(str(path), FP, "tp2", 2, cache_dir=cache_dir) is not None
    if change == "revision":
        conn = sqlite3.connect(path)
        conn.execute("UPDATE alembic_version SET version_num = 'from_the_future'")
        conn.commit()
        conn.close()
    elif change == "corrupt":
        for suffix in ("-wal", "-shm"):
            Path(str(path) + suffix).unlink(missing_ok=True)
        path.write_bytes(b"garbage" * 100)
    else:
        path.unlink()
    assert cached_slices(str(path), FP, "tp2", 2, cache_dir=cache_dir) is None
