"""The collectives each rank of a warm start makes, recorded on real gloo ranks.

``tests/test_sync.py`` runs ``record_transcripts`` through
``ficache._ranks.run_ranks`` and checks that every rank made the same
collective calls in the same order, on the happy paths and on each failure
path (a registry that cannot be read, a load that fails on one rank,
heterogeneous ranks, a block that raises on one rank before or after tuning,
a tuner that cannot be read at exit, a slice offer whose bytes do not
decode while rank 0's own load fails, a message a rank cannot encode). The recording wraps the
``torch.distributed`` functions ``ficache.sync`` calls (looked up on the
module at call time) for calls on the caller's group only: the tuning
group's all-reduces are FlashInfer's, not the protocol's. A call is recorded
before it is made, so a rank stuck in a collective its peers never make
still shows it. Each rank also writes what it recorded so far to
``root/transcripts-rank{r}.json`` after every case, so ranks that fell out of
step (and then failed at the next barrier) still show where.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gloo_scenarios
import torch.distributed as dist
from gloo_scenarios import FailingLoadTuner, start

from ficache.errors import TunerError
from ficache.tuner import FlashInferTuner

#: The torch.distributed calls ``ficache.sync`` makes on the caller's group.
RECORDED = ("broadcast", "all_gather", "all_gather_object", "gather_object", "new_group")


class UnreadableTuner(FlashInferTuner):
    """Fault injection: the real FlashInfer tuner, except that reading what it tuned fails."""

    def tuned(self) -> dict[str, Any]:
        raise TunerError("injected read failure")


def _install_recorder(transcript: list[str]) -> Callable[[], None]:
    """Wrap ``RECORDED`` on ``torch.distributed``; return the function that unwraps them."""
    originals = {name: getattr(dist, name) for name in RECORDED}

    def wrap(name: str) -> Callable[..., Any]:
        real = originals[name]

        def recorded(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            if group is None or group is dist.group.WORLD:
                transcript.append(name)
            return real(*args, **kwargs)

        return recorded

    for name in RECORDED:
        setattr(dist, name, wrap(name))

    def restore() -> None:
        for name, real in originals.items():
            setattr(dist, name, real)

    return restore


def _corrupt(rank: int, tmp: Path) -> Path:
    db = tmp / "corrupt.db"
    if rank == 0:
        db.write_bytes(b"this is not a database\n" * 100)
    return db


def _cases(rank: int, tmp: Path) -> dict[str, Callable[[], dict[str, Any]]]:
    """Case name -> one warm start (the registry ``tmp / "registry.db"`` is shared, in order)."""
    db = tmp / "registry.db"
    other = tmp / "other.db"

    def boom() -> None:
        raise ValueError("boom")

    one = rank == 1
    return {
        "cold": lambda: start(db),
        "warm": lambda: start(db),
        "corrupt_registry": lambda: start(_corrupt(rank, tmp)),
        "load_fails_on_rank1": lambda: start(db, tuner=FailingLoadTuner() if one else None),
        "heterogeneous": lambda: start(db, fingerprint=_other_gpu() if one else None),
        "raise_after_on_rank1": lambda: start(other, fail=boom if one else None),
        "raise_before_on_rank1": lambda: start(
            other, fail=boom if one else None, fail_before=True, release_grace=1.0
        ),
        "unreadable_tuner_on_rank1": lambda: start(other, tuner=UnreadableTuner() if one else None),
        "cold_again": lambda: start(other),
        "garbled_offer_and_rank0_load_fails": lambda: _garbled_offer(rank, db),
        "unencodable_tuned_on_rank1": lambda: _unencodable(
            "TunedResults", one, start, tmp / "third.db"
        ),
        "unencodable_outcome_on_rank0": lambda: _unencodable(
            "CommitOutcome", rank == 0, start, tmp / "fourth.db"
        ),
    }


def _unencodable(kind: str, here: bool, run: Callable[..., Any], db: Path) -> dict[str, Any]:
    """Fault injection: this rank's message of ``kind`` cannot be encoded (its ``encode``
    raises); the receivers must take that as a value, never wait for bytes that do not come."""
    from ficache import messages

    cls = getattr(messages, kind)
    real = cls.encode

    def fails(self: Any) -> Any:
        raise TypeError("injected encoding failure")

    if here:
        cls.encode = fails
    try:
        return run(db)
    finally:
        cls.encode = real


def _garbled_offer(rank: int, db: Path) -> dict[str, Any]:
    """Fault injection on rank 0: the slice offer it broadcasts is cut short (the bytes do
    not decode), and its own load fails: the confirm must not branch on rank 0 alone."""
    from ficache.messages import SliceOffer

    real = SliceOffer.encode
    if rank == 0:
        SliceOffer.encode = lambda self: real(self)[:-7]  # type: ignore[method-assign]
    try:
        return start(db, tuner=FailingLoadTuner() if rank == 0 else None)
    finally:
        SliceOffer.encode = real  # type: ignore[method-assign]


def _other_gpu() -> Any:
    import dataclasses

    from ficache.fingerprint import collect

    return dataclasses.replace(collect(), gpu="Another GPU")


def record_transcripts(rank: int, world: int, root: str) -> dict[str, Any]:
    """Run every case on this rank; per case, the collectives made and the start's status."""
    gloo_scenarios._quiet_logs()
    os.environ["XDG_CACHE_HOME"] = str(Path(root) / "user-cache")
    tmp = Path(root) / "transcripts"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    out: dict[str, Any] = {}
    for name, run in _cases(rank, tmp).items():
        dist.barrier()
        transcript: list[str] = []
        restore = _install_recorder(transcript)
        started = time.monotonic()
        try:
            result = run()
        finally:
            restore()
        report = result["report"]
        out[name] = {
            "transcript": transcript,
            "status": report["status"],
            "reason": report["reason"],
            "exception": result["exception"],
            "seconds": time.monotonic() - started,
        }
        # Kept as it goes: ranks that fell out of step may not get to return it.
        (Path(root) / f"transcripts-rank{rank}.json").write_text(json.dumps(out))
    return out
