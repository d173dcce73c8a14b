"""What the ranks of a warm start send each other (``ficache.sync``), as typed messages.

Every message is a frozen dataclass with an explicit ``encode`` and a
``decode`` classmethod. Two wire forms:

- *byte messages* (broadcasts, gathers, all-gathers of objects):
  ``MAGIC + version + kind`` (5 bytes) then a pickle of the message's fields
  as a tuple of plain values (str, int, float, bool, None, bytes, tuple,
  list, dict). They are read back by an unpickler that refuses every global:
  a message carries data, never code, whatever the bytes say.
- *integer messages* (the confirm and the status exchange, one int64 tensor
  per rank): ``[kind, version, field, ...]``, a fixed length per kind.

Invariants:

- ``decode(encode(m)) == m`` for every message ``m``.
- Anything else (truncated bytes, another magic, version or kind, a field of
  the wrong type or count) raises ``MalformedMessageError`` with one line
  naming the message and what is wrong; never another exception, never a
  half-read message. All ranks of one start run the same code, so the format
  only has to agree within a start; ``VERSION`` changes when a field does.
- Decoding is a value, like every failure of the protocol: ``ficache.sync``
  turns the error into the start's reason on every rank that read the same
  bytes, so the ranks still agree on what happens next.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from ficache.errors import FicacheError

#: The first bytes of every byte message.
MAGIC = b"FIC"
#: The wire format's version; a start's ranks all run the same one.
VERSION = 2  # 2: protocol records (SliceOffer, StatusReport, TunedResults, CommitOutcome)

M = TypeVar("M", bound="_ByteMessage")
I = TypeVar("I", bound="_IntMessage")  # noqa: E741 - the integer-message type


class MalformedMessageError(FicacheError):
    """A message between ranks could not be decoded: truncated, foreign, or of another version."""


class _DataOnlyUnpickler(pickle.Unpickler):
    """Reads plain values only: any global (a class, a function) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused a global ({module}.{name}): messages hold data only")


def _check(name: str, value: Any, kinds: tuple[type, ...], what: str) -> None:
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise MalformedMessageError(f"malformed {name}: {what} is {type(value).__name__}")


def _optional_str(name: str, value: Any, what: str) -> None:
    if value is not None:
        _check(name, value, (str,), what)


def _text_map(name: str, value: Any, what: str) -> None:
    """``value`` is ``{namespace: {key: text}}`` (records, protocol records): strings only."""
    _check(name, value, (dict,), what)
    for ns, by_key in value.items():
        _check(name, ns, (str,), f"a namespace of {what}")
        _check(name, by_key, (dict,), f"a namespace's {what}")
        for key, text in by_key.items():
            _check(name, key, (str,), f"a key of {what}")
            _check(name, text, (str,), f"a value of {what}")


def _strs(name: str, value: Any, what: str, optional: bool = False) -> None:
    _check(name, value, (tuple,), what)
    for item in value:
        if not (optional and item is None):
            _check(name, item, (str,), f"an item of {what}")


class _ByteMessage:
    """Encoding shared by the byte messages; each subclass has its ``KIND`` and ``_validate``."""

    KIND: ClassVar[int]

    def encode(self) -> bytes:
        header = MAGIC + bytes((VERSION, self.KIND))
        return header + pickle.dumps(astuple_shallow(self), protocol=pickle.HIGHEST_PROTOCOL)

    @classmethod
    def decode(cls: type[M], data: Any) -> M:
        name = cls.__name__
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise MalformedMessageError(f"malformed {name}: got {type(data).__name__}, not bytes")
        data = bytes(data)
        if len(data) < len(MAGIC) + 2:
            raise MalformedMessageError(f"malformed {name}: truncated ({len(data)} bytes)")
        if data[: len(MAGIC)] != MAGIC:
            raise MalformedMessageError(f"malformed {name}: not a ficache message")
        version, kind = data[len(MAGIC)], data[len(MAGIC) + 1]
        if version != VERSION:
            raise MalformedMessageError(
                f"malformed {name}: wire version {version}, this ficache speaks {VERSION}; "
                "every rank of a start must run the same ficache"
            )
        if kind != cls.KIND:
            raise MalformedMessageError(f"malformed {name}: got a message of kind {kind}")
        try:
            values = _DataOnlyUnpickler(io.BytesIO(data[len(MAGIC) + 2 :])).load()
        except Exception as exc:  # noqa: BLE001 - truncated or hostile: one clear error
            text = " ".join(str(exc).split()) or type(exc).__name__
            raise MalformedMessageError(f"malformed {name}: unreadable ({text})") from None
        names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
        if not isinstance(values, tuple) or len(values) != len(names):
            raise MalformedMessageError(f"malformed {name}: expected {len(names)} fields")
        message = cls(*values)
        message._validate()
        return message

    def _validate(self) -> None:
        raise NotImplementedError


def astuple_shallow(message: Any) -> tuple[Any, ...]:
    """A dataclass's field values in order, not copied (``dataclasses.astuple`` deep-copies)."""
    return tuple(getattr(message, f.name) for f in fields(message))


class _IntMessage:
    """Encoding shared by the integer messages: ``[KIND, VERSION, *fields]``, all ints."""

    KIND: ClassVar[int]

    def encode(self) -> list[int]:
        return [self.KIND, VERSION, *(int(v) for v in _flat(astuple_shallow(self)))]

    @classmethod
    def width(cls) -> int:
        """How many integers an encoded message of this kind holds."""
        return 2 + cls._field_width()

    @classmethod
    def _field_width(cls) -> int:
        return len(fields(cls))  # type: ignore[arg-type]

    @classmethod
    def decode(cls: type[I], values: Any) -> I:
        name = cls.__name__
        if not isinstance(values, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in values
        ):
            raise MalformedMessageError(f"malformed {name}: not a list of integers")
        if len(values) != cls.width():
            raise MalformedMessageError(
                f"malformed {name}: {len(values)} integers, expected {cls.width()}"
            )
        if values[0] != cls.KIND:
            raise MalformedMessageError(f"malformed {name}: got a message of kind {values[0]}")
        if values[1] != VERSION:
            raise MalformedMessageError(
                f"malformed {name}: wire version {values[1]}, this ficache speaks {VERSION}; "
                "every rank of a start must run the same ficache"
            )
        return cls._from_ints(list(values[2:]))

    @classmethod
    def _from_ints(cls: type[I], values: list[int]) -> I:
        return cls(*values)


def _flat(values: tuple[Any, ...]) -> list[Any]:
    out: list[Any] = []
    for value in values:
        out.extend(value if isinstance(value, tuple) else (value,))
    return out


def _flags(name: str, **values: int) -> None:
    for what, value in values.items():
        if value not in (0, 1):
            raise MalformedMessageError(f"malformed {name}: {what} is {value}, not 0 or 1")


def _counts(name: str, **values: int) -> None:
    for what, value in values.items():
        if value < 0:
            raise MalformedMessageError(f"malformed {name}: {what} is negative ({value})")


# --------------------------------------------------------------------------
# Enter


@dataclass(frozen=True)
class SliceOffer(_ByteMessage):
    """Step 3, rank 0 to every rank: the slices for rank 0's fingerprint, or why there are none.

    ``base`` is what every rank loads, ``overlays[r]`` what rank ``r`` loads
    on top (its scoped entries), ``record_counts[r]`` the records rank ``r``
    then holds; ``reason`` set means every rank tunes uncached. ``mode`` is
    rank 0's start mode (``tune`` or ``replay``), which every rank follows.
    ``reused`` means rank 0 read nothing: every rank loads what its earlier
    start of this process (``warm_start(reuse=...)``) left it holding, and
    ``base``, ``overlays`` and ``record_counts`` are empty. ``protocol`` is
    the shared protocol records (``namespace -> key -> canonical JSON``) every
    rank publishes after its load (empty when reused: each rank publishes what
    its earlier start left it).
    """

    KIND: ClassVar[int] = 1
    fingerprint: str | None
    registry: str | None = None
    readonly: bool = False
    reason: str | None = None
    base: str | None = None
    overlays: tuple[str | None, ...] = ()
    cache: str = "off"
    warnings: tuple[str, ...] = ()
    record_counts: tuple[int, ...] = ()
    mode: str = "tune"  # rank 0's ``warm_start`` mode: every rank takes it
    reused: bool = False  # every rank loads what its earlier start left it (no base)
    protocol: dict[str, dict[str, str]] = field(default_factory=dict)

    def _validate(self) -> None:
        name = type(self).__name__
        _text_map(name, self.protocol, "protocol records")
        _check(name, self.mode, (str,), "mode")
        _check(name, self.reused, (bool,), "reused")
        _optional_str(name, self.fingerprint, "fingerprint")
        _optional_str(name, self.registry, "registry")
        _check(name, self.readonly, (bool,), "readonly")
        _optional_str(name, self.reason, "reason")
        _optional_str(name, self.base, "base")
        _strs(name, self.overlays, "overlays", optional=True)
        _check(name, self.cache, (str,), "cache")
        _strs(name, self.warnings, "warnings")
        _check(name, self.record_counts, (tuple,), "record_counts")
        for count in self.record_counts:
            _check(name, count, (int,), "a record count")

    def overlay(self, rank: int) -> str | None:
        return self.overlays[rank] if rank < len(self.overlays) else None

    def record_count(self, rank: int) -> int:
        return int(self.record_counts[rank]) if rank < len(self.record_counts) else 0


@dataclass(frozen=True)
class LoadConfirmation(_IntMessage):
    """Step 5, every rank to every rank (all-gather of integers): did my load work, how many
    entries I hold, whether I still hold a tuning group from an earlier start, and my
    fingerprint's digest (four 64-bit words)."""

    KIND: ClassVar[int] = 2
    ok: int
    loaded: int
    tuning_group_cached: int
    digest: tuple[int, int, int, int]

    @classmethod
    def _field_width(cls) -> int:
        return 3 + 4

    @classmethod
    def _from_ints(cls, values: list[int]) -> LoadConfirmation:
        message = cls(values[0], values[1], values[2], (values[3], values[4], values[5], values[6]))
        _flags(cls.__name__, ok=message.ok, tuning_group_cached=message.tuning_group_cached)
        _counts(cls.__name__, loaded=message.loaded)
        return message

    @staticmethod
    def digest_words(digest_hex: str | None) -> tuple[int, int, int, int]:
        raw = bytes.fromhex(digest_hex) if digest_hex else bytes(32)
        words = [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, 32, 8)]
        return (words[0], words[1], words[2], words[3])


@dataclass(frozen=True)
class LoadTrouble(_ByteMessage):
    """Step 5b, every rank to every rank, only when a load failed or fingerprints differ:
    this rank's fingerprint fields and its load error, for one shared reason."""

    KIND: ClassVar[int] = 3
    fields: dict[str, str] | None
    error: str | None

    def _validate(self) -> None:
        name = type(self).__name__
        if self.fields is not None:
            _check(name, self.fields, (dict,), "fields")
            for key, value in self.fields.items():
                _check(name, key, (str,), "a field name")
                _optional_str(name, value, f"field {key}")
        _optional_str(name, self.error, "error")


@dataclass(frozen=True)
class TuningGroupCreated(_ByteMessage):
    """Step 6, every rank to every rank, only when a dedicated tuning group is created:
    did ``new_group`` work here."""

    KIND: ClassVar[int] = 4
    ok: bool

    def _validate(self) -> None:
        _check(type(self).__name__, self.ok, (bool,), "ok")


# --------------------------------------------------------------------------
# Exit


@dataclass(frozen=True)
class StatusReport(_IntMessage):
    """Step 8, every rank to every rank (the status exchange, integers): did my block raise,
    how many new entries I hold, whether I could read my tuner, how many new records and
    new protocol records."""

    KIND: ClassVar[int] = 5
    raised: int
    new_entries: int
    tuner_failed: int
    new_records: int
    new_protocol: int = 0

    @classmethod
    def _from_ints(cls, values: list[int]) -> StatusReport:
        message = cls(*values)
        _flags(cls.__name__, raised=message.raised, tuner_failed=message.tuner_failed)
        _counts(
            cls.__name__,
            new_entries=message.new_entries,
            new_records=message.new_records,
            new_protocol=message.new_protocol,
        )
        return message

    @property
    def failed(self) -> bool:
        return bool(self.raised or self.tuner_failed)

    @property
    def tuned_any(self) -> bool:
        return bool(self.new_entries or self.new_records or self.new_protocol)


@dataclass(frozen=True)
class FailureNote(_ByteMessage):
    """Step 8b, every rank to every rank, only when a rank failed: when (wall clock) and why
    this rank failed, or nothing when it did not; the earliest failure is the root cause."""

    KIND: ClassVar[int] = 6
    at: float | None = None
    message: str | None = None

    def _validate(self) -> None:
        name = type(self).__name__
        if self.at is not None:
            _check(name, self.at, (float, int), "at")
        _optional_str(name, self.message, "message")
        if (self.at is None) != (self.message is None):
            raise MalformedMessageError(f"malformed {name}: a failure needs both a time and a text")


@dataclass(frozen=True)
class TunedResults(_ByteMessage):
    """Step 9a, every rank to rank 0 (gather): the entries, records and protocol records this
    rank holds that differ from what it loaded. Entries are ``key -> (runner, tactic, policy,
    selection)``; records and protocol records ``namespace -> key -> canonical JSON``."""

    KIND: ClassVar[int] = 7
    entries: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    records: dict[str, dict[str, str]] = field(default_factory=dict)
    protocol: dict[str, dict[str, str]] = field(default_factory=dict)

    def _validate(self) -> None:
        name = type(self).__name__
        _check(name, self.entries, (dict,), "entries")
        for key, row in self.entries.items():
            _check(name, key, (str,), "an entry key")
            _check(name, row, (tuple,), "an entry")
            if len(row) < 3 or not all(v is None or isinstance(v, str) for v in row):
                raise MalformedMessageError(f"malformed {name}: an entry is not a row of texts")
        _text_map(name, self.records, "records")
        _text_map(name, self.protocol, "protocol records")


@dataclass(frozen=True)
class CommitOutcome(_ByteMessage):
    """Step 9b, rank 0 to every rank: what the commit did (or why nothing was committed),
    and the final slices (the registry after the commit) when they could be exported, with
    the shared protocol records every rank then publishes."""

    KIND: ClassVar[int] = 8
    reason: str | None = None
    committed: int = 0
    commit_id: int | None = None
    shared: int = 0
    scoped: int = 0
    disagreements: int = 0
    kept: int = 0
    records_committed: int = 0
    warnings: tuple[str, ...] = ()
    base: str | None = None
    overlays: tuple[str | None, ...] = ()
    protocol_committed: int = 0
    protocol: dict[str, dict[str, str]] = field(default_factory=dict)

    def _validate(self) -> None:
        name = type(self).__name__
        _optional_str(name, self.reason, "reason")
        _text_map(name, self.protocol, "protocol records")
        counts = ("committed", "shared", "scoped", "disagreements", "kept", "records_committed")
        for what in (*counts, "protocol_committed"):
            _check(name, getattr(self, what), (int,), what)
        if self.commit_id is not None:
            _check(name, self.commit_id, (int,), "commit_id")
        _strs(name, self.warnings, "warnings")
        _optional_str(name, self.base, "base")
        _strs(name, self.overlays, "overlays", optional=True)

    def overlay(self, rank: int) -> str | None:
        return self.overlays[rank] if rank < len(self.overlays) else None


#: Every message kind, by its ``KIND`` (tests drive each through encode/decode).
MESSAGES: Mapping[int, type[Any]] = {
    m.KIND: m
    for m in (
        SliceOffer,
        LoadConfirmation,
        LoadTrouble,
        TuningGroupCreated,
        StatusReport,
        FailureNote,
        TunedResults,
        CommitOutcome,
    )
}
