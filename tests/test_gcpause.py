"""The collector pause used by bulk reads, plans and writes."""

from __future__ import annotations

import gc
import weakref

import pytest

from ficache._gcpause import PROMOTE_AFTER, paused_gc


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def _cycle() -> weakref.ref[Node]:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture(autouse=True)
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_a_bulk_block_leaves_no_young_collection_behind() -> None:
    started: list[int] = []

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(info["generation"])

    gc.callbacks.append(record)
    try:
        with paused_gc():
            assert not gc.isenabled()
            started.clear()
            bulk = [[i] for i in range(2 * PROMOTE_AFTER)]
            cycle = _cycle()
        after = [[i] for i in range(100)]  # would set off a young collection left behind
    finally:
        gc.callbacks.remove(record)

    assert gc.isenabled()
    assert started == []  # the block's objects went to the oldest generation unscanned
    assert gc.get_freeze_count() == 0
    assert len(bulk) == 2 * PROMOTE_AFTER and len(after) == 100
    gc.collect()
    assert cycle() is None  # still tracked: a full collection frees the cycle


def test_a_collector_the_caller_disabled_stays_disabled_also_on_errors() -> None:
    gc.disable()
    with pytest.raises(RuntimeError), paused_gc():
        raise RuntimeError("boom")

    assert not gc.isenabled()


def test_nested_pauses_restore_once() -> None:
    with paused_gc():
        with paused_gc():
            pass
        assert not gc.isenabled()

    assert gc.isenabled()


def test_objects_the_caller_froze_stay_frozen() -> None:
    gc.collect()
    kept = [Node() for _ in range(10)]
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with paused_gc():
            bulk = [[i] for i in range(2 * PROMOTE_AFTER)]

        assert gc.get_freeze_count() == frozen
        assert gc.isenabled()
        assert len(bulk) == 2 * PROMOTE_AFTER and len(kept) == 10
    finally:
        gc.unfreeze()
