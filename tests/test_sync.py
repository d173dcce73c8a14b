"""The startup protocol on real gloo ranks (world 2 and 4), real SQLite, the real AutoTuner.

Each world size spawns its ranks once (``ficache._ranks.run_ranks``, a hard
timeout: a deadlock fails every test here instead of hanging) and runs every
scenario of ``tests/gloo_scenarios.py`` in them, one after the other; the
tests below assert on what each rank returned. The AutoTuner's cache is
filled by the CPU stand-in (``ficache.standin``), 18 entries per start.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import gloo_scenarios
import pytest

from ficache._ranks import RanksFailedError, run_ranks

pytestmark = pytest.mark.slow

ALL = gloo_scenarios.ALL  # 18 keys
HALF = 9
WORLDS = (2, 4)
#: Hang guard: every rank of a world is killed after this long, far from the
#: 30-90 s a world normally takes, so a deadlock fails these tests at once
#: instead of hanging CI. Whether a failure path was *released* rather than
#: timed out is checked from what the ranks report (``assert_no_timeout``),
#: never by comparing a duration with a number.
HARD_TIMEOUT = 900.0


def _run(world: int, root: str) -> dict[int, dict[str, dict[str, Any]]]:
    names = list(gloo_scenarios.SCENARIOS)
    results = run_ranks(
        gloo_scenarios.run_plan,
        world,
        root,
        names,
        timeout=HARD_TIMEOUT,
        group_timeout=gloo_scenarios.GROUP_TIMEOUT,
    )
    return dict(enumerate(results))


def _reasons(value: Any) -> list[str]:
    """Every ``reason``, ``status``, ``exception`` and ``error`` text in a rank's result."""
    found = []
    if isinstance(value, dict):
        for key, item in value.items():
            if key in ("reason", "status", "exception", "error") and isinstance(item, str):
                found.append(item)
            else:
                found.extend(_reasons(item))
    elif isinstance(value, list):
        for item in value:
            found.extend(_reasons(item))
    return found


def assert_no_timeout(result: dict[str, Any], where: str) -> None:
    """No wait of this rank's start ended by running out its timeout.

    gloo ends a wait that ran out with "Operation timed out!" (or "Timed out
    waiting ...", "Application timeout caused pair closure"); the protocol
    carries what ended a failed collective into ``reason`` or the block's
    ``exception``. A peer released as designed fails with "Connection closed
    by peer" instead.
    """
    for text in _reasons(result):
        lowered = text.lower()
        assert "timed out" not in lowered and "timeout" not in lowered, (where, text)


class _Worlds:
    """Spawns each world size once, on first use, and keeps what its ranks returned."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.results: dict[int, dict[int, dict[str, dict[str, Any]]]] = {}

    def __call__(self, world: int) -> dict[int, dict[str, dict[str, Any]]]:
        if world not in self.results:
            self.results[world] = _run(world, str(self.factory.mktemp(f"world{world}")))
        return self.results[world]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> _Worlds:
    return _Worlds(tmp_path_factory)


@pytest.fixture(params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def world(request: pytest.FixtureRequest, worlds: _Worlds) -> tuple[int, dict[int, dict[str, Any]]]:
    return request.param, worlds(request.param)


def scenario(results: dict[int, dict[str, Any]], name: str) -> list[dict[str, Any]]:
    out = [results[rank][name] for rank in sorted(results)]
    for rank, r in enumerate(out):
        assert "error" not in r, f"scenario {name} failed on rank {rank}:\n{r['error']}"
    return out


def reports(per_rank: list[dict[str, Any]], phase: str) -> list[dict[str, Any]]:
    return [r[phase]["report"] for r in per_rank]


def assert_uncached(per_rank: list[dict[str, Any]], phase: str, *fragments: str) -> None:
    """The failure-path outcome: tuned uncached, nothing committed, the reason on every rank."""
    for r in per_rank:
        rep = r[phase]["report"]
        assert (rep["status"], bool(rep["reason"])) == ("uncached", True), rep
        for fragment in fragments:
            assert fragment in rep["reason"], rep["reason"]
        assert rep["loaded"] == 0 and rep["tuned"] == ALL
        assert rep["committed"] == 0 and rep["commit_id"] is None
        assert r[phase]["standin"]["profiled"] == ALL
        assert r[phase]["exception"] is None
        assert_no_timeout(r[phase], phase)
    assert len({r[phase]["report"]["reason"] for r in per_rank}) == 1  # every rank says the same


# --------------------------------------------------------------------------


def test_cold_then_warm_then_half(world: tuple[int, Any]) -> None:
    n, results = world
    per_rank = scenario(results, "cold_warm")
    for rep, r in zip(reports(per_rank, "cold"), per_rank, strict=True):
        assert rep["status"] == "cold" and rep["reason"] is None
        assert rep["loaded"] == 0 and rep["tuned"] == ALL
        assert rep["committed"] == ALL and rep["commit_id"] == 1
        assert rep["shared"] == ALL and rep["scoped"] == 0 and rep["disagreements"] == 0
        assert rep["synchronized"] is True
        assert rep["loaded_by_rank"] == [0] * n and rep["tuned_by_rank"] == [ALL] * n
        assert r["cold"]["standin"]["profiled"] == ALL
        assert r["cold"]["standin"]["reduces"] == ALL * 5  # one all-reduce per tactic
    # Every rank then holds the same final cache.
    finals = [r["cold"]["entries"] for r in per_rank]
    assert len(finals[0]) == ALL and all(f == finals[0] for f in finals)

    for rep, r in zip(reports(per_rank, "warm"), per_rank, strict=True):
        assert rep["status"] == "warm" and rep["reason"] is None
        assert rep["loaded"] == ALL and rep["tuned"] == 0
        assert rep["committed"] == 0 and rep["commit_id"] is None
        assert rep["slice_cache"] == "hit"
        assert r["warm"]["standin"] == {
            **r["warm"]["standin"],
            "profiled": 0,
            "hits": ALL,
            "reduces": 0,
        }
        assert r["warm"]["entries"] == finals[0]

    # Half the entries deleted behind the registry's back: exactly that half is tuned again.
    for rep, r in zip(reports(per_rank, "half"), per_rank, strict=True):
        assert rep["status"] == "partial"
        assert rep["loaded"] == HALF and rep["tuned"] == HALF
        assert rep["committed"] == HALF and rep["commit_id"] == 2
        assert rep["shared"] == HALF and rep["disagreements"] == 0
        assert r["half"]["standin"]["profiled"] == HALF and r["half"]["standin"]["hits"] == HALF
        assert rep["slice_cache"] == "miss"  # the out-of-band delete changed the registry's state
    assert per_rank[0]["registry"] == {"commits": 2, "scopes": {"shared": ALL}}


def test_partial_start_tunes_only_what_is_missing(world: tuple[int, Any]) -> None:
    _n, results = world
    per_rank = scenario(results, "partial")
    for rep in reports(per_rank, "first"):
        assert (rep["status"], rep["loaded"], rep["tuned"], rep["committed"]) == ("cold", 0, 12, 12)
    for rep, r in zip(reports(per_rank, "second"), per_rank, strict=True):
        assert (rep["status"], rep["loaded"], rep["tuned"], rep["committed"]) == (
            "partial",
            12,
            6,
            6,
        )
        assert r["second"]["standin"]["profiled"] == 6
    assert per_rank[0]["registry"] == {"commits": 2, "scopes": {"shared": ALL}}


def test_a_start_that_reuses_an_earlier_one_reads_nothing_and_commits_where_it_read(
    world: tuple[int, Any],
) -> None:
    _n, results = world
    per_rank = scenario(results, "reuse")
    for r in per_rank:
        first, second = r["first"]["report"], r["second"]["report"]
        assert (first["status"], first["committed"]) == ("cold", 12)
        assert first["slice_cache"] != "reused"
        assert (second["status"], second["loaded"], second["tuned"]) == ("partial", 12, 6), second
        assert second["slice_cache"] == "reused"
        assert second["committed"] == 6 and second["reason"] is None
        assert r["second"]["standin"]["profiled"] == 6
        assert r["absent_created"] is False  # its own db was never opened, nor created
    # One rank reusing where another reads: every rank tunes uncached, with the reason.
    assert_uncached(per_rank, "mismatched", "reuse")
    for r in per_rank:
        after = r["after_uncached"]["report"]
        assert (after["status"], after["loaded"], after["tuned"]) == ("warm", ALL, 0), after
        assert after["slice_cache"] != "reused"
    # The second start's 6 landed in the first start's registry.
    assert per_rank[0]["registry"] == {"commits": 2, "scopes": {"shared": ALL}}


def test_per_rank_keys_are_stored_scoped_and_each_rank_gets_its_own(world: tuple[int, Any]) -> None:
    n, results = world
    per_rank = scenario(results, "per_rank_keys")
    for rep in reports(per_rank, "first"):
        assert rep["shared"] == 0 and rep["scoped"] == ALL * n and rep["committed"] == ALL * n
        assert rep["disagreements"] == 0
    assert per_rank[0]["registry"]["scopes"] == {f"world{n}/rank{r}": ALL for r in range(n)}
    for rank, r in enumerate(per_rank):
        rep = r["second"]["report"]
        assert (rep["status"], rep["loaded"], rep["tuned"], rep["committed"]) == ("warm", ALL, 0, 0)
        assert r["second"]["standin"]["profiled"] == 0
        assert all(f"'rank{rank}'" in key for key in r["second"]["entries"])


def test_rank_divergent_tactics_are_never_shared(world: tuple[int, Any]) -> None:
    n, results = world
    per_rank = scenario(results, "disagree")
    for rep in reports(per_rank, "first"):
        assert rep["disagreements"] == ALL
        assert rep["shared"] == 0 and rep["scoped"] == ALL * n
    assert "shared" not in per_rank[0]["registry"]["scopes"]
    for rank, r in enumerate(per_rank):
        rep = r["second"]["report"]
        assert (rep["status"], rep["loaded"], rep["tuned"]) == ("warm", ALL, 0)
        assert {row[1] for row in r["second"]["entries"].values()} == {str(rank % 5)}


def test_unsynchronized_entries_are_never_shared(world: tuple[int, Any]) -> None:
    n, results = world
    per_rank = scenario(results, "unsynchronized")
    for rep, r in zip(reports(per_rank, "first"), per_rank, strict=True):
        assert rep["synchronized"] is False
        assert r["first"]["standin"]["reduces"] == 0
        # Identical on every rank, yet tuned without synchronizing: stored per rank.
        assert rep["disagreements"] == 0 and rep["shared"] == 0 and rep["scoped"] == ALL * n
        assert (rep["committed"], rep["commit_id"]) == (ALL * n, 1)
    # The registry holds them so: one commit, every rank's entries in its own scope, none shared.
    assert per_rank[0]["registry"] == {
        "commits": 1,
        "scopes": {f"world{n}/rank{rank}": ALL for rank in range(n)},
    }


def test_registry_directory_cannot_be_created(world: tuple[int, Any]) -> None:
    _n, results = world
    per_rank = scenario(results, "missing_dir")
    assert_uncached(per_rank, "first", "cannot create directory for registry")
    assert not any(r["exists"] for r in per_rank)


def test_corrupt_registry(world: tuple[int, Any]) -> None:
    _n, results = world
    per_rank = scenario(results, "corrupt")
    assert_uncached(per_rank, "first", "is not a SQLite database")
    for r in per_rank:
        # The garbage is byte-identical, still unreadable (nothing stored in it), and
        # nothing else was written beside it (no side files, no second registry).
        assert r["unchanged"] is True
        assert r["after"] == {"sha256": r["written"], "files": ["registry.db"]}
        assert r["registry"] == {"error": "file is not a database"}


def test_truncated_registry(world: tuple[int, Any]) -> None:
    _n, results = world
    per_rank = scenario(results, "truncated")
    for rep in reports(per_rank, "setup"):  # the file was a registry holding entries
        assert (rep["status"], rep["committed"]) == ("cold", ALL)
    assert_uncached(per_rank, "first", "is corrupt")
    # The truncated file is byte-identical, still unreadable (the tuned entries were
    # stored nowhere in it), and nothing was written beside it.
    truncated = per_rank[0]
    assert truncated["before"]["files"] == ["registry.db"]
    assert truncated["after"] == truncated["before"]
    assert truncated["registry"] == {"error": "database disk image is malformed"}


def test_newer_schema(world: tuple[int, Any]) -> None:
    _n, results = world
    per_rank = scenario(results, "newer_schema")
    assert_uncached(per_rank, "first", "9999_from_the_future", "upgrade ficache")
    assert per_rank[0]["unchanged"] is True


def test_locked_registry_serves_but_commits_nothing(world: tuple[int, Any]) -> None:
    _n, results = world
    per_rank = scenario(results, "locked")
    for r in per_rank:
        rep = r["first"]["report"]
        assert (rep["status"], rep["loaded"], rep["tuned"], rep["committed"]) == (
            "partial",
            12,
            6,
            0,
        )
        assert rep["commit_id"] is None
        assert (
            rep["reason"].startswith("nothing committed: commit failed")
            and "locked" in rep["reason"]
        )
        # The wait the start bounded (busy_timeout=0.2), not SQLite's default.
        assert "each waiting up to 0.2 s for the lock" in rep["reason"], rep["reason"]
    assert len({r["first"]["report"]["reason"] for r in per_rank}) == 1
    assert per_rank[0]["registry"] == {"commits": 1, "scopes": {"shared": 12}}


def test_read_only_registry_serves_but_commits_nothing(world: tuple[int, Any]) -> None:
    _n, results = world
    per_rank = scenario(results, "read_only")
    # Both phases run as root too: a file without write bits is read-only to ficache.
    for phase in ("uri", "file"):
        for r in per_rank:
            rep = r[phase]["report"]
            assert (rep["loaded"], rep["tuned"], rep["committed"]) == (12, 6, 0)
            assert rep["commit_id"] is None
            assert "read-only" in rep["reason"]
    assert per_rank[0]["registry"] == {"commits": 1, "scopes": {"shared": 12}}


def test_a_rank_whose_load_fails_makes_every_rank_tune_from_empty(world: tuple[int, Any]) -> None:
    n, results = world
    per_rank = scenario(results, "load_fails")
    assert_uncached(per_rank, "first", "rank 1 could not load its slice", "injected load failure")
    for r in per_rank:
        assert r["first"]["report"]["loaded_by_rank"] == [0] * n
        assert r["first"]["report"]["synchronized"] is True
    assert per_rank[0]["registry"] == {"commits": 1, "scopes": {"shared": ALL}}  # the setup's


def test_heterogeneous_ranks_tune_uncached_and_commit_nothing(world: tuple[int, Any]) -> None:
    _n, results = world
    per_rank = scenario(results, "heterogeneous")
    assert_uncached(per_rank, "first", "different environments", "gpu", "Another GPU")
    for r in per_rank:
        # Still synchronized: they picked the same tactics.
        assert r["first"]["report"]["synchronized"] is True
    entries = [r["first"]["entries"] for r in per_rank]
    assert all(e == entries[0] for e in entries)
    assert per_rank[0]["registry"] == {"commits": 1, "scopes": {"shared": ALL}}  # the setup's


def test_exception_after_tuning_on_one_rank(world: tuple[int, Any]) -> None:
    _n, results = world
    per_rank = scenario(results, "raise_after")
    for rank, r in enumerate(per_rank):
        assert r["first"]["exception"] == ("ValueError: boom" if rank == 1 else None)
        rep = r["first"]["report"]
        assert rep["committed"] == 0 and rep["commit_id"] is None
        assert (
            rep["reason"]
            == "nothing committed: rank 1 raised ValueError: boom in the warm-start block"
        )
        assert_no_timeout(r["first"], "first")
    assert per_rank[0]["registry"] == {"commits": 0, "scopes": {}}


def test_exception_before_tuning_releases_the_peers(world: tuple[int, Any]) -> None:
    _n, results = world
    per_rank = scenario(results, "raise_before")
    for rank, r in enumerate(per_rank):
        if rank == 1:
            assert r["first"]["exception"] == "ValueError: boom"
        else:  # blocked in a tuning all-reduce with rank 1: released, not timed out
            assert r["first"]["exception"].startswith("RuntimeError")
            # gloo says "closed" or "reset", depending on which side saw the socket go first
            assert re.search("Connection (closed|reset) by peer", r["first"]["exception"])
        assert_no_timeout(r["first"], "first")
        rep = r["first"]["report"]
        assert rep["committed"] == 0
        assert rep["reason"].startswith("nothing committed: rank 1 raised ValueError: boom")
        # The next start in the same processes works.
        after = r["after"]["report"]
        assert (after["status"], after["tuned"], after["committed"], after["reason"]) == (
            "cold",
            ALL,
            ALL,
            None,
        )
    assert per_rank[0]["registry"] == {"commits": 0, "scopes": {}}


def test_a_peer_that_misses_where_the_others_hit_fails_fast(world: tuple[int, Any]) -> None:
    _n, results = world
    per_rank = scenario(results, "stuck_peer")
    for rank, r in enumerate(per_rank):
        if rank == 1:
            # gloo says "closed" or "reset", depending on which side saw the socket go first
            assert re.search("Connection (closed|reset) by peer", r["first"]["exception"])
        else:
            assert r["first"]["exception"] is None
        # Released after release_grace=1 s, not by the 60 s group timeout.
        assert_no_timeout(r["first"], "first")
        rep = r["first"]["report"]
        assert rep["committed"] == 0 and rep["reason"].startswith(
            "nothing committed: rank 1 raised RuntimeError"
        )
    assert per_rank[0]["registry"] == {"commits": 1, "scopes": {"shared": ALL}}  # the setup's


def test_no_collective_waited_out_its_timeout(world: tuple[int, Any]) -> None:
    """Every wait of every scenario ended by its peers or a release, never by a timeout.

    (A wait that never ended at all is the hard timeout's job: every rank is
    killed and every test here fails.)
    """
    _n, results = world
    for name in gloo_scenarios.SCENARIOS:
        for rank, r in enumerate(scenario(results, name)):
            assert_no_timeout(r, f"{name} rank {rank}")


# --------------------------------------------------------------------------
# The typed messages between ranks (``ficache.messages``)


def _message_samples() -> list[Any]:
    """One message of every kind, with values other than the defaults."""
    from ficache import messages as m

    row = ("RunnerA", "[1, [2, 3]]", '["l2", "hot"]', '{"margin": 0.1}')
    return [
        m.SliceOffer(
            "ab" * 32,
            registry="/tmp/r.db",
            readonly=True,
            reason=None,
            base='{"k": ["RunnerA", 1]}',
            overlays=(None, '{"k2": ["RunnerB", 2]}'),
            cache="hit",
            warnings=("w1", "w2"),
            record_counts=(3, 4),
            mode="replay",
            protocol={"moe_ep.sm100.next_cutedsl.native.v1": {'{"m": 8}': '{"tile": 128}'}},
        ),
        m.LoadConfirmation(1, 12, 0, m.LoadConfirmation.digest_words("cd" * 32)),
        m.LoadTrouble({"gpu": "H200", "cuda_version": "12.9"}, "rank 1 could not load"),
        m.TuningGroupCreated(False),
        m.StatusReport(1, 6, 0, 2, 3),
        m.FailureNote(1764680000.25, "rank 1 raised ValueError: boom in the warm-start block"),
        m.TunedResults(
            {"('op', 'RunnerA', ((1,),), ())": row},
            {"ns": {"k": '{"v": 1}'}},
            {"moe_ep.sm107.cutedsl.variants.v1": {"k": "[1,2]"}},
        ),
        m.CommitOutcome(
            reason=None,
            committed=6,
            commit_id=3,
            shared=5,
            scoped=1,
            disagreements=1,
            kept=0,
            records_committed=2,
            warnings=("one warning",),
            base="{}",
            overlays=("{}", None),
            protocol_committed=4,
            protocol={"moe_ep.sm107.cutedsl.native.v1": {"": "null"}},
        ),
    ]


def _assert_one_clear_error(kind: type, data: Any, *fragments: str) -> str:
    from ficache.errors import FicacheError
    from ficache.messages import MalformedMessageError

    with pytest.raises(MalformedMessageError) as caught:
        kind.decode(data)
    text = str(caught.value)
    assert isinstance(caught.value, FicacheError)
    assert "\n" not in text and len(text) < 300, text
    assert text.startswith(f"malformed {kind.__name__}: "), text
    for fragment in fragments:
        assert fragment in text, text
    return text


def test_every_message_survives_its_encoding() -> None:
    from ficache.messages import MESSAGES

    samples = _message_samples()
    assert {type(s) for s in samples} == set(MESSAGES.values())  # one sample per kind
    for sample in samples:
        encoded = sample.encode()
        assert type(sample).decode(encoded) == sample
        if isinstance(encoded, bytes):
            assert type(sample).decode(bytearray(encoded)) == sample  # what a tensor gives back


def test_a_malformed_message_is_one_clear_error() -> None:
    import pickle

    from ficache import messages as m

    for sample in _message_samples():
        kind = type(sample)
        encoded = sample.encode()
        others = [k for k in m.MESSAGES.values() if k is not kind]
        if isinstance(encoded, bytes):
            for cut in (0, 2, 4, 5, len(encoded) // 2, len(encoded) - 1):
                _assert_one_clear_error(kind, encoded[:cut])
            wrong_version = encoded[:3] + bytes([m.VERSION + 1]) + encoded[4:]
            _assert_one_clear_error(kind, wrong_version, f"wire version {m.VERSION + 1}")
            _assert_one_clear_error(kind, b"XYZ" + encoded[3:], "not a ficache message")
            _assert_one_clear_error(kind, encoded[:-1] + b"\x00")  # a damaged last byte
            _assert_one_clear_error(kind, None, "not bytes")
            no_fields = encoded[:5] + pickle.dumps(())
            _assert_one_clear_error(kind, no_fields, "fields")
        else:
            _assert_one_clear_error(kind, encoded[:-1], "integers, expected")
            _assert_one_clear_error(kind, encoded + [0], "integers, expected")
            wrong_version = [encoded[0], m.VERSION + 1, *encoded[2:]]
            _assert_one_clear_error(kind, wrong_version, f"wire version {m.VERSION + 1}")
            _assert_one_clear_error(kind, [str(v) for v in encoded], "not a list of integers")
        for other in others:  # another kind's message, whatever its length
            _assert_one_clear_error(other, encoded)


def test_a_message_carries_data_never_code_and_fields_of_the_right_type() -> None:
    import pickle

    from ficache import messages as m

    header = m.MAGIC + bytes([m.VERSION, m.SliceOffer.KIND])
    hostile = header + pickle.dumps(
        (os.system, None, False, None, None, (), "off", (), (), "tune", False, {})
    )
    assert "refused a global" in _assert_one_clear_error(m.SliceOffer, hostile, "unreadable")
    # Right count, wrong types: a base that is not text, counts that are not integers.
    bad_base = header + pickle.dumps(
        ("ab", None, False, None, 5, (), "off", (), (), "tune", False, {})
    )
    _assert_one_clear_error(m.SliceOffer, bad_base, "base is int")
    bad_mode = header + pickle.dumps(
        ("ab", None, False, None, None, (), "off", (), (), 1, False, {})
    )
    _assert_one_clear_error(m.SliceOffer, bad_mode, "mode is int")
    bad_reused = header + pickle.dumps(
        ("ab", None, False, None, None, (), "off", (), (), "tune", "yes", {})
    )
    _assert_one_clear_error(m.SliceOffer, bad_reused, "reused is str")
    short = header + pickle.dumps(("ab", None, False, None, None, (), "off", (), (), "tune", False))
    _assert_one_clear_error(m.SliceOffer, short, "expected 12 fields")
    # Protocol records are {namespace: {key: JSON text}}: a value that is not text is refused.
    bad_protocol = header + pickle.dumps(
        ("ab", None, False, None, None, (), "off", (), (), "tune", False, {"ns": {"k": 1}})
    )
    _assert_one_clear_error(m.SliceOffer, bad_protocol, "a value of protocol records is int")
    bad_tuned_protocol = m.TunedResults({}, {}, {"ns": ["k"]}).encode()  # type: ignore[dict-item]
    _assert_one_clear_error(m.TunedResults, bad_tuned_protocol, "protocol records is list")
    bad_counts = dataclasses.replace(_message_samples()[0], record_counts=("3",))
    _assert_one_clear_error(m.SliceOffer, bad_counts.encode(), "record count is str")
    bad_row = m.TunedResults({"k": ("RunnerA", 1, None)}, {}).encode()  # type: ignore[dict-item]
    _assert_one_clear_error(m.TunedResults, bad_row, "not a row of texts")
    _assert_one_clear_error(m.StatusReport, m.StatusReport(2, 0, 0, 0).encode(), "raised is 2")
    _assert_one_clear_error(m.StatusReport, m.StatusReport(0, -1, 0, 0).encode(), "negative")
    _assert_one_clear_error(m.FailureNote, m.FailureNote(1.0, None).encode(), "both")


# --------------------------------------------------------------------------
# Every rank makes the same collectives, whatever happens on one rank


def test_every_rank_makes_the_same_collectives_on_every_path(tmp_path: Any) -> None:
    import transcript_scenarios

    crashed = None
    try:
        run_ranks(
            transcript_scenarios.record_transcripts,
            2,
            str(tmp_path),
            timeout=HARD_TIMEOUT,
            group_timeout=gloo_scenarios.GROUP_TIMEOUT,
        )
    except RanksFailedError as exc:  # ranks out of step: compare what they recorded first
        crashed = str(exc).splitlines()[0]
    results = [json.loads((tmp_path / f"transcripts-rank{r}.json").read_text()) for r in (0, 1)]
    for name in results[0]:
        first, second = results[0][name], results[1].get(name, {"transcript": None})
        assert first["transcript"], name
        assert first["transcript"] == second["transcript"], (name, first, second)
    assert crashed is None, crashed
    cases = list(results[0])
    assert len(cases) == 12 and list(results[1]) == cases
    for name in cases:
        first, second = results[0][name], results[1][name]
        assert_no_timeout(first, name)
        assert_no_timeout(second, name)
    by_case = {name: results[1][name] for name in cases}
    # Each failure path was the one intended (so the sequences compared are its own).
    assert by_case["cold"]["status"] == "cold" and by_case["warm"]["status"] == "warm"
    assert by_case["corrupt_registry"]["status"] == "uncached"
    assert "could not load its slice" in by_case["load_fails_on_rank1"]["reason"]
    assert "different environments" in by_case["heterogeneous"]["reason"]
    assert by_case["raise_after_on_rank1"]["exception"] == "ValueError: boom"
    assert by_case["raise_before_on_rank1"]["exception"] == "ValueError: boom"
    assert "could not read its tuner" in by_case["unreadable_tuner_on_rank1"]["reason"]
    assert by_case["cold_again"]["status"] == "cold"
    garbled = [results[r]["garbled_offer_and_rank0_load_fails"]["reason"] for r in (0, 1)]
    assert garbled[0] == garbled[1] and garbled[0].startswith("malformed SliceOffer: "), garbled
    for r in (0, 1):  # rank 0 commits nothing of a start whose entries did not all arrive
        assert results[r]["unencodable_tuned_on_rank1"]["reason"] == (
            "nothing committed: malformed TunedResults: truncated (0 bytes) (from rank 1)"
        )
    outcome = [results[r]["unencodable_outcome_on_rank0"] for r in (0, 1)]
    assert outcome[0]["status"] == "cold" and outcome[0]["reason"] is None, outcome[0]
    assert outcome[1]["reason"] == (
        "commit outcome unknown: malformed CommitOutcome: truncated (0 bytes); "
        "rank 0 may have committed (see `ficache log`)"
    )
    # The paths differ in their collectives: the comparison is not of one sequence only.
    assert len({tuple(results[0][name]["transcript"]) for name in cases}) >= 4
