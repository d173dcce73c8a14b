"""Bundles: one self-describing file of tuned results, to ship inside images.

Layout (format versions 1 to 4)::

    ficache-bundle <version> <payload bytes> sha256=<hex of the payload>\\n
    <payload>

The payload is ASCII JSON with exactly four members, one entry per line::

    {"entries":[
    {"fingerprint":<digest>,"key":..,"policy":..,"runner":..,"scope":..,"tactic":..,"tuned_at":..},
    ...
    ],
    "fingerprints":{<digest>:{<Fingerprint fields>}},
    "provenance":{"entries":N,"fingerprints":{<digest>:{..}},"records":N},
    "records":{<digest>:{<scope>:{<namespace>:{<record key>:<JSON value>}}}}}

``key`` is FlashInfer's ``file_key`` verbatim; ``tactic`` and ``policy`` are
the registry's canonical JSON text (``policy`` may be null); ``tuned_at`` is
when the value was tuned (UNIX seconds). Version 2 adds to an entry whose
value FlashInfer chose by real tuning a member ``"selection"``: how it was
chosen (a cache value's fourth element), as canonical JSON text of an object
(``flashinfer_format.selection_json``). A bundle is written as version 2
when one of its entries has a selection, else as version 1 (the bytes it
had before version 2, which older ficache reads). ``records`` holds FlashInfer's
namespaced records (``ficache.records``) as parsed JSON values, each a value
``flashinfer_format.record_value_json`` accepts; they carry no tuning time.

Version 3 adds a fifth member, between ``fingerprints`` and ``provenance``,
holding FlashInfer 0.7.4's protocol records (``ficache.protocol_records``),
one per line, sorted by (fingerprint digest, scope, namespace, key)::

    "protocol_records":[
    {"fingerprint":<digest>,"key":..,"namespace":..,"policy":..,"scope":..,"tuned_at":..,"value":..},
    ...
    ],

``value`` and ``policy`` are canonical JSON text (``policy`` may be null),
``tuned_at`` when the value was tuned; the provenance of a version 3 bundle
counts them (``"protocol_records":N``). A bundle is written as version 3
exactly when it holds a protocol record; one without any is written as
version 1 or 2, byte for byte as before version 3 existed, so every older
ficache reads it.

Version 4 lets a fingerprint object hold a member ``"measurement"``: the
FlashInfer measurement policy its entries were tuned under
(``Fingerprint.measurement``, canonical JSON text; absent for the default
policy, so the digest is the one older versions computed). A bundle is
written as version 4 exactly when one of its fingerprints has one, and then
always holds the ``protocol_records`` member (maybe empty); older ficache
refuses it with "upgrade ficache" rather than merging another policy's
entries into the default one's.

Invariants:
- The same content gives the same bytes. A bundle is a pure function of
  its entries (fingerprint, scope, key, runner, tactic, policy, tuned_at,
  selection), records and protocol records (its format version too: 4
  exactly when a fingerprint has a measurement policy, else 3 exactly when
  it holds a protocol record, else 2 exactly when an entry has a selection): members, fingerprints and entries are sorted (by code point,
  in Python, never by a database collation), JSON is rendered one way, and
  nothing of the exporting registry or moment enters: no export time, host,
  commit id or row id. Two registries holding the same entries, whatever
  their histories, export identical bytes, and a bundle imported into an
  empty registry exports again byte for byte.
- Provenance is derived from the content alone: per fingerprint, the
  entries by scope and by op, the records, and the span of ``tuned_at``.
  Where a bundle came from is recorded where it lands: importing it writes
  its digest into the import commit's provenance.
- A reader trusts nothing before the checksum. It checks the magic, then
  the format version (a newer one is refused with "upgrade ficache"; the
  ``ficache-bundle <version>`` prefix is the one part every version keeps),
  then the size the header claims against a hard limit and the file, then
  the sha256 of the payload, and only then parses JSON. Content is then
  validated in full (keys by ``flashinfer_format.parse_key``, never
  evaluated; tactics and policies as JSON of lists, numbers, strings;
  scopes; fingerprint digests; provenance against the content), and the
  payload must be exactly what this module renders for that content, so
  every content has one encoding and the digest names the content.
  Every failure is one ``BundleError`` line; nothing partial escapes.
- Not compressed, on purpose: image layers are compressed already, so
  compressing inside them saves nothing on the wire; plain ASCII stays
  readable (``tail -n +2 FILE | jq``), diffs one entry per line, and leaves
  no decompression bomb to defend against.
- Writing renders, re-reads its own bytes (``encode_bundle``: a bundle
  ficache cannot read is never published), then publishes with
  ``ficache.publish.publish`` (``publish_bundle``: atomically for a regular
  file or a new path, temp removed on any failure; a device or FIFO is
  written to; a new file follows the umask, a replaced one keeps its mode,
  so a bundle baked into an image is readable).
- This module translates between bytes and content only; it never opens a
  registry. What a registry exports as a bundle is read by
  ``ficache.exporting`` (``bundle_bytes``, ``write_bundle``) and handed here
  as plain data; importing a bundle is ``ficache.importing``'s
  (``plan_bundle_import``, ``import_bundles``).
- Bump ``FORMAT_VERSION`` for any change a version-1 reader would refuse or
  misread; readers refuse versions newer than their own.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ficache.errors import BundleError, FingerprintError
from ficache.fingerprint import ALL_FIELDS, MEASUREMENT_FIELD, Fingerprint
from ficache.flashinfer_format import (
    canonical_json,
    check_namespace,
    check_protocol_identity,
    parse_key,
    protocol_policy_json,
    protocol_value_json,
    record_value_json,
    selection_json,
)
from ficache.publish import publish
from ficache.values import NewEntry, NewProtocolRecord, NewRecord, validate_scope

#: The newest format this module reads and writes; it writes 1 for content version 1 can carry.
FORMAT_VERSION = 4
#: The first version whose entries may carry a ``selection``.
SELECTION_VERSION = 2
#: The first version that may carry protocol records (``protocol_records``).
PROTOCOL_VERSION = 3
#: The first version whose fingerprints may carry a ``measurement``.
MEASUREMENT_VERSION = 4
MAGIC = b"ficache-bundle "
#: Longest header any version may write (magic, version, size, checksum).
MAX_HEADER_BYTES = 256
#: Largest payload ficache reads (a real bundle is kilobytes to megabytes).
MAX_PAYLOAD_BYTES = 512 * 1024 * 1024
#: Longest tactic or policy text, and their deepest nesting (as FlashInfer writes them).
MAX_TACTIC_CHARS = 64 * 1024
MAX_TACTIC_DEPTH = 8

#: ``{fingerprint digest: {scope: {namespace: {record key: JSON value}}}}``.
Records = dict[str, dict[str, dict[str, dict[str, Any]]]]

_VERSION = re.compile(rb"ficache-bundle ([0-9]{1,9})(?=[ \n])")
_HEADER = re.compile(rb"ficache-bundle [1234] (0|[1-9][0-9]{0,19}) sha256=([0-9a-f]{64})\n")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_MEMBERS = ("entries", "fingerprints", "provenance", "records")
_MEMBERS_PROTOCOL = (*_MEMBERS, "protocol_records")  # version 3
_PROTOCOL_FIELDS = ("fingerprint", "key", "namespace", "policy", "scope", "tuned_at", "value")
_ENTRY_FIELDS = ("fingerprint", "key", "policy", "runner", "scope", "tactic", "tuned_at")
_ENTRY_FIELDS_SELECTION = (*_ENTRY_FIELDS, "selection")  # version 2, an entry with a selection
_AGAIN = "copy it again or export it again with `ficache export --bundle`"


@dataclass(frozen=True)
class Bundle:
    """A verified bundle: what it holds, sorted, with the file's digest."""

    format_version: int
    digest: str  # sha256 hex of the whole file
    fingerprints: tuple[Fingerprint, ...]  # sorted by digest
    entries: tuple[NewEntry, ...]  # sorted by (fingerprint digest, scope, key); tuned_at set
    records: Records
    provenance: dict[str, Any]
    #: Sorted by (fingerprint digest, scope, namespace, key); tuned_at set (version 3).
    protocol_records: tuple[NewProtocolRecord, ...] = ()

    @property
    def record_namespaces(self) -> int:
        """How many (fingerprint, scope, namespace) record groups the bundle holds."""
        return sum(len(by_ns) for scopes in self.records.values() for by_ns in scopes.values())


@dataclass(frozen=True)
class BundleSummary:
    """What ``encode_bundle`` rendered (``ficache.exporting.write_bundle`` wrote)."""

    path: Path
    digest: str  # sha256 hex of the file
    size_bytes: int
    format_version: int
    fingerprints: int
    entries: int
    records: int
    protocol_records: int = 0


# --------------------------------------------------------------------------
# Rendering.


def _dumps(value: Any) -> str:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    )


def _provenance(
    entries: Sequence[NewEntry],
    ops: Sequence[str],
    records: Records,
    protocol: Sequence[NewProtocolRecord] = (),
) -> dict[str, Any]:
    per_fp: dict[str, dict[str, Any]] = {}

    def summary(digest: str) -> dict[str, Any]:
        return per_fp.setdefault(
            digest, {"entries": 0, "ops": {}, "records": 0, "scopes": {}, "tuned_at": None}
        )

    for entry, op in zip(entries, ops, strict=True):
        s = summary(entry.fingerprint.digest)
        s["entries"] += 1
        s["ops"][op] = s["ops"].get(op, 0) + 1
        s["scopes"][entry.scope] = s["scopes"].get(entry.scope, 0) + 1
        tuned = entry.tuned_at
        span = s["tuned_at"]
        if span is None:
            s["tuned_at"] = {"first": tuned, "last": tuned}
        else:
            span["first"], span["last"] = min(span["first"], tuned), max(span["last"], tuned)
    total_records = 0
    for digest, scopes in records.items():
        n = sum(len(recs) for by_ns in scopes.values() for recs in by_ns.values())
        summary(digest)["records"] += n
        total_records += n
    out: dict[str, Any] = {
        "entries": len(entries),
        "fingerprints": per_fp,
        "records": total_records,
    }
    if protocol:
        out["protocol_records"] = len(protocol)
    return out


def _render(
    fingerprints: Mapping[str, Fingerprint],
    entries: Sequence[NewEntry],
    ops: Sequence[str],
    records: Records,
    protocol: Sequence[NewProtocolRecord] = (),
) -> bytes:
    """The whole file for sorted ``entries`` and ``protocol`` (header and payload)."""
    lines = ['{"entries":[\n']
    last = len(entries) - 1
    version = 1
    for i, e in enumerate(entries):
        item = {
            "fingerprint": e.fingerprint.digest,
            "key": e.key,
            "policy": e.policy_json,
            "runner": e.runner,
            "scope": e.scope,
            "tactic": e.tactic_json,
            "tuned_at": e.tuned_at,
        }
        if e.selection_json is not None:
            item["selection"] = e.selection_json
            version = SELECTION_VERSION
        lines.append(_dumps(item) + (",\n" if i < last else "\n"))
    fps = {digest: fp.as_dict() for digest, fp in fingerprints.items()}
    lines.append(f'],\n"fingerprints":{_dumps(fps)},\n')
    measured = any(fp.measurement for fp in fingerprints.values())
    if protocol or measured:
        version = MEASUREMENT_VERSION if measured else PROTOCOL_VERSION
        lines.append('"protocol_records":[\n')
        last = len(protocol) - 1
        for i, r in enumerate(protocol):
            item = {
                "fingerprint": r.fingerprint.digest,
                "key": r.key,
                "namespace": r.namespace,
                "policy": r.policy_json,
                "scope": r.scope,
                "tuned_at": r.tuned_at,
                "value": r.value_json,
            }
            lines.append(_dumps(item) + (",\n" if i < last else "\n"))
        lines.append("],\n")
    lines.append(f'"provenance":{_dumps(_provenance(entries, ops, records, protocol))},\n')
    lines.append(f'"records":{_dumps(records)}}}\n')
    payload = "".join(lines).encode("ascii")
    checksum = hashlib.sha256(payload).hexdigest()
    return b"%s%d %d sha256=%s\n%s" % (
        MAGIC,
        version,
        len(payload),
        checksum.encode(),
        payload,
    )


def render_bundle(
    entries: Iterable[NewEntry],
    records: Mapping[str, Mapping[str, Mapping[str, Mapping[str, Any]]]] | None = None,
    fingerprints: Iterable[Fingerprint] = (),
    protocol_records: Iterable[NewProtocolRecord] = (),
) -> bytes:
    """The bundle of ``entries``, ``records`` and ``protocol_records``, as bytes.

    The bundle holds exactly the fingerprints its entries and records use;
    ``fingerprints`` names those that only records use (protocol records
    carry their own). A protocol record without ``tuned_at`` is ``ValueError``. Tactics and policies
    are rendered as canonical JSON. Raises ``ValueError`` for an entry
    without ``tuned_at``, a key that is not a FlashInfer key, or records
    of an unknown fingerprint. A later duplicate (fingerprint, scope, key)
    wins, as in ``Registry.write``.
    """
    by_digest: dict[str, Fingerprint] = {fp.digest: fp for fp in fingerprints}
    unique = _canonical_entries(entries, by_digest)
    ordered = [unique[k] for k in sorted(unique)]
    ops = [(e.fields or parse_key(e.key)).op for e in ordered]
    recs: Records = {
        digest: {
            scope: {ns: dict(values) for ns, values in by_ns.items()}
            for scope, by_ns in scopes.items()
        }
        for digest, scopes in (records or {}).items()
    }
    protocol = _canonical_protocol_records(protocol_records, by_digest)
    unknown = sorted(set(recs) - set(by_digest))
    if unknown:
        raise ValueError(f"records of fingerprint {unknown[0]} with no Fingerprint given")
    used = {k[0] for k in unique} | set(recs) | {k[0] for k in protocol}
    return _render(
        {d: by_digest[d] for d in sorted(used)},
        ordered,
        ops,
        recs,
        [protocol[k] for k in sorted(protocol)],
    )


def _canonical_entries(
    entries: Iterable[NewEntry], by_digest: dict[str, Fingerprint]
) -> dict[tuple[str, str, str], NewEntry]:
    """``(digest, scope, key) -> entry`` with its tactic, policy and selection as canonical
    JSON, a later duplicate winning; each entry's fingerprint added to ``by_digest``.
    An entry without ``tuned_at`` is ``ValueError``."""
    unique: dict[tuple[str, str, str], NewEntry] = {}
    for e in entries:
        if e.tuned_at is None:
            raise ValueError(f"entry {e.key[:80]!r} has no tuned_at")
        digest = e.fingerprint.digest
        by_digest.setdefault(digest, e.fingerprint)
        unique[(digest, e.scope, e.key)] = NewEntry(
            e.fingerprint,
            e.key,
            e.runner,
            canonical_json(json.loads(e.tactic_json)),
            canonical_json(json.loads(e.policy_json)) if e.policy_json is not None else None,
            e.scope,
            e.fields,
            float(e.tuned_at),
            selection_json(json.loads(e.selection_json)) if e.selection_json is not None else None,
        )
    return unique


def _canonical_protocol_records(
    protocol_records: Iterable[NewProtocolRecord], by_digest: dict[str, Fingerprint]
) -> dict[tuple[str, str, str, str], NewProtocolRecord]:
    """``(digest, scope, namespace, key) -> protocol record`` with its value and policy as
    canonical JSON, a later duplicate winning; each record's fingerprint added to
    ``by_digest``. A protocol record without ``tuned_at`` is ``ValueError``."""
    protocol: dict[tuple[str, str, str, str], NewProtocolRecord] = {}
    for r in protocol_records:
        if r.tuned_at is None:
            raise ValueError(f"protocol record {r.namespace[:80]!r}/{r.key[:80]!r} has no tuned_at")
        digest = r.fingerprint.digest
        by_digest.setdefault(digest, r.fingerprint)
        protocol[(digest, r.scope, r.namespace, r.key)] = NewProtocolRecord(
            r.fingerprint,
            r.namespace,
            r.key,
            protocol_value_json(json.loads(r.value_json)),
            protocol_policy_json(json.loads(r.policy_json)) if r.policy_json is not None else None,
            r.scope,
            float(r.tuned_at),
        )
    return protocol


# --------------------------------------------------------------------------
# Reading.


class _Invalid(ValueError):
    """Content that passed the checksum but is not a valid bundle (one line)."""


def is_bundle(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` looks like a bundle, from its first bytes only.

    True for a file that starts with the magic, and for a file so short it
    could only be a bundle cut inside its magic (so reading it says
    "truncated"). A FlashInfer cache file (JSON) is never a bundle.
    """
    try:
        with open(path, "rb") as handle:
            head = handle.read(len(MAGIC))
    except OSError:
        return False
    return looks_like_bundle(head)


def looks_like_bundle(head: bytes) -> bool:
    """``is_bundle`` of a file whose first bytes (all of them, if fewer) are ``head``."""
    if len(head) < len(MAGIC):
        return bool(head) and MAGIC.startswith(head)
    return head.startswith(MAGIC)


def _frame(data: bytes, source: str) -> tuple[int, bytes]:
    """Check magic, version, size and checksum; return (version, payload)."""
    if not data:
        raise BundleError(f"{source}: empty file, not a ficache bundle; {_AGAIN}")
    if not data.startswith(MAGIC):
        if MAGIC.startswith(data):
            raise BundleError(f"{source}: truncated bundle (it ends inside its header); {_AGAIN}")
        if data[:4096].lstrip()[:1] == b"{":
            raise BundleError(
                f"{source}: a FlashInfer cache file, not a ficache bundle; "
                "import it with `ficache import`"
            )
        raise BundleError(
            f"{source}: not a ficache bundle (no 'ficache-bundle' header); "
            "give a file written by `ficache export --bundle`"
        )
    end = data.find(b"\n", 0, MAX_HEADER_BYTES)
    version = _VERSION.match(data)
    if version is None:
        if end < 0 and len(data) < MAX_HEADER_BYTES:
            raise BundleError(f"{source}: truncated bundle (it ends inside its header); {_AGAIN}")
        raise BundleError(f"{source}: damaged bundle header; {_AGAIN}")
    number = int(version.group(1))
    if number > FORMAT_VERSION:
        raise BundleError(
            f"{source}: bundle format version {number} is newer than this ficache reads "
            f"(up to {FORMAT_VERSION}); upgrade ficache"
        )
    if number < 1:
        raise BundleError(f"{source}: unknown bundle format version {number}; {_AGAIN}")
    if end < 0:
        if len(data) < MAX_HEADER_BYTES:
            raise BundleError(f"{source}: truncated bundle (it ends inside its header); {_AGAIN}")
        raise BundleError(f"{source}: damaged bundle header; {_AGAIN}")
    header = _HEADER.fullmatch(data, 0, end + 1)
    if header is None:
        raise BundleError(f"{source}: damaged bundle header; {_AGAIN}")
    claimed = int(header.group(1))
    if claimed > MAX_PAYLOAD_BYTES:
        raise BundleError(
            f"{source}: bundle claims a {claimed}-byte payload, over the "
            f"{MAX_PAYLOAD_BYTES}-byte limit; not a bundle ficache reads"
        )
    payload = data[end + 1 :]
    if len(payload) < claimed:
        raise BundleError(
            f"{source}: truncated bundle ({len(payload)} of {claimed} payload bytes); {_AGAIN}"
        )
    if len(payload) > claimed:
        raise BundleError(
            f"{source}: damaged bundle ({len(payload) - claimed} bytes after its payload); {_AGAIN}"
        )
    if hashlib.sha256(payload).hexdigest() != header.group(2).decode():
        raise BundleError(f"{source}: damaged bundle (checksum mismatch); {_AGAIN}")
    return number, payload


def _object(value: Any, what: str, members: Sequence[str] | None = None) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Invalid(f"{what} must be a JSON object")
    if members is not None and sorted(value) != sorted(members):
        extra = sorted(set(value) - set(members))
        missing = sorted(set(members) - set(value))
        raise _Invalid(
            f"{what} has unknown member {extra[0]!r:.80}"
            if extra
            else f"{what} lacks member {missing[0]!r}"
        )
    return value


def _check_json_value(value: Any, what: str, depth: int = 0) -> None:
    """A tactic or policy: lists of numbers, strings, booleans and nulls."""
    if depth > MAX_TACTIC_DEPTH:
        raise _Invalid(f"{what} nested too deeply")
    if isinstance(value, list):
        for v in value:
            _check_json_value(v, what, depth + 1)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise _Invalid(f"{what} holds a non-finite number")
    elif not (value is None or isinstance(value, (bool, int, str))):
        raise _Invalid(f"{what} holds a JSON {type(value).__name__}; expected numbers and lists")


def _json_text(text: Any, what: str, *, list_only: bool) -> str:
    """Validate tactic or policy text: canonical JSON, data only."""
    if not isinstance(text, str):
        raise _Invalid(f"{what} must be a string of JSON")
    if len(text) > MAX_TACTIC_CHARS:
        raise _Invalid(f"{what} longer than {MAX_TACTIC_CHARS} characters")
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        raise _Invalid(f"{what} {text[:80]!r} is not JSON") from None
    if list_only and not isinstance(value, list):
        raise _Invalid(f"{what} must be a JSON list")
    _check_json_value(value, what)
    if canonical_json(value) != text:
        raise _Invalid(f"{what} {text[:80]!r} is not canonical JSON")
    return text


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _fingerprints(value: Any, version: int) -> dict[str, Fingerprint]:
    found: dict[str, Fingerprint] = {}
    for digest, fields in _object(value, "fingerprints").items():
        if not _DIGEST.fullmatch(digest):
            raise _Invalid(f"fingerprint digest {digest[:80]!r} is not a sha256 hex digest")
        measured = (
            version >= MEASUREMENT_VERSION
            and isinstance(fields, dict)
            and MEASUREMENT_FIELD in fields
        )
        members = (*ALL_FIELDS, MEASUREMENT_FIELD) if measured else ALL_FIELDS
        _object(fields, f"fingerprint {digest[:12]}", members)
        if measured and not fields[MEASUREMENT_FIELD]:
            raise _Invalid(f"fingerprint {digest[:12]}: an empty measurement is left out")
        try:
            fp = Fingerprint(**fields)
        except FingerprintError as exc:
            raise _Invalid(f"fingerprint {digest[:12]}: {exc}") from None
        if fp.digest != digest:
            raise _Invalid(f"fingerprint {digest[:12]} does not match its fields")
        found[digest] = fp
    return found


def _scope(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise _Invalid(f"{what} scope must be a string")
    try:
        return validate_scope(value)
    except ValueError as exc:
        raise _Invalid(f"{what}: {exc}") from None


def _selection_text(text: Any, what: str) -> str:
    """Validate selection text: canonical JSON of an object ``selection_json`` accepts."""
    if not isinstance(text, str):
        raise _Invalid(f"{what} must be a string of JSON")
    try:
        value = json.loads(text, parse_constant=_reject_constant)
        canonical = selection_json(value)
    except RecursionError:
        raise _Invalid(f"{what} nested too deeply") from None
    except ValueError as exc:
        raise _Invalid(f"{what} {text[:80]!r} is not a selection: {exc}") from None
    if canonical != text:
        raise _Invalid(f"{what} {text[:80]!r} is not canonical JSON")
    return text


def _entries(
    value: Any, fps: Mapping[str, Fingerprint], version: int = 1
) -> tuple[list[NewEntry], list[str]]:
    if not isinstance(value, list):
        raise _Invalid("entries must be a JSON list")
    entries: list[NewEntry] = []
    ops: list[str] = []
    previous: tuple[str, str, str] | None = None
    for index, item in enumerate(value):
        what = f"entry {index}"
        with_selection = (
            version >= SELECTION_VERSION and isinstance(item, dict) and "selection" in item
        )
        e = _object(item, what, _ENTRY_FIELDS_SELECTION if with_selection else _ENTRY_FIELDS)
        selection = _selection_text(e["selection"], f"{what} selection") if with_selection else None
        fp = fps.get(e["fingerprint"]) if isinstance(e["fingerprint"], str) else None
        if fp is None:
            raise _Invalid(
                f"{what} names fingerprint {str(e['fingerprint'])[:80]!r}, not in the bundle"
            )
        scope = _scope(e["scope"], what)
        key, runner = e["key"], e["runner"]
        if not isinstance(key, str) or not isinstance(runner, str):
            raise _Invalid(f"{what} key and runner must be strings")
        try:
            fields = parse_key(key)
        except ValueError as exc:
            raise _Invalid(f"{what} key {key[:80]!r} is not a FlashInfer key: {exc}") from None
        if fields.runner != runner:
            raise _Invalid(f"{what} runner {runner[:80]!r} differs from its key's")
        tactic = _json_text(e["tactic"], f"{what} tactic", list_only=False)
        policy = e["policy"]
        if policy is not None:
            policy = _json_text(policy, f"{what} policy", list_only=True)
        tuned_at = e["tuned_at"]
        if not isinstance(tuned_at, float) or not math.isfinite(tuned_at) or tuned_at < 0:
            raise _Invalid(f"{what} tuned_at must be a finite, non-negative float (seconds)")
        order = (e["fingerprint"], scope, key)
        if previous is not None and order <= previous:
            raise _Invalid(f"{what} is out of order or a duplicate")
        previous = order
        entries.append(
            NewEntry(fp, key, runner, tactic, policy, scope, fields, tuned_at, selection)
        )
        ops.append(fields.op)
    return entries, ops


def _records(value: Any, fps: Mapping[str, Fingerprint]) -> Records:
    records: Records = {}
    for digest, scopes in _object(value, "records").items():
        if digest not in fps:
            raise _Invalid(f"records name fingerprint {digest[:80]!r}, not in the bundle")
        for scope, by_ns in _object(scopes, f"records of {digest[:12]}").items():
            _scope(scope, f"records of {digest[:12]}")
            for ns, recs in _object(by_ns, f"records of {digest[:12]} {scope}").items():
                if not ns or not _object(recs, f"records namespace {ns[:80]!r}"):
                    raise _Invalid(f"records of {digest[:12]} {scope} hold an empty namespace")
                try:
                    check_namespace(ns)
                    for key, value in recs.items():
                        try:
                            record_value_json(value)
                        except ValueError as exc:
                            raise ValueError(f"record {key[:80]!r}: {exc}") from None
                except ValueError as exc:
                    raise _Invalid(f"records of {digest[:12]} {scope}: {exc}") from None
            if not by_ns:
                raise _Invalid(f"records of {digest[:12]} hold an empty scope")
        if not scopes:
            raise _Invalid(f"records of {digest[:12]} are empty")
        records[digest] = scopes
    return records


def _protocol_text(text: Any, what: str, canonical: Any) -> str:
    """A protocol record's value or policy text: canonical JSON ``canonical`` accepts."""
    if not isinstance(text, str):
        raise _Invalid(f"{what} must be a string of JSON")
    try:
        again = canonical(json.loads(text, parse_constant=_reject_constant))
    except (ValueError, RecursionError) as exc:
        detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise _Invalid(f"{what} {text[:80]!r} refused: {detail}") from None
    if again != text:
        raise _Invalid(f"{what} {text[:80]!r} is not canonical JSON")
    return text


def _protocol_records(
    value: Any, fps: Mapping[str, Fingerprint], version: int
) -> list[NewProtocolRecord]:
    """A version 3 or 4 bundle's protocol records, validated and in order (version 4 writes
    the member, maybe empty, whenever a fingerprint has a measurement policy)."""
    if not isinstance(value, list) or not (value or version >= MEASUREMENT_VERSION):
        raise _Invalid("protocol_records must be a non-empty JSON list")
    found: list[NewProtocolRecord] = []
    previous: tuple[str, str, str, str] | None = None
    for index, item in enumerate(value):
        what = f"protocol record {index}"
        r = _object(item, what, _PROTOCOL_FIELDS)
        fp = fps.get(r["fingerprint"]) if isinstance(r["fingerprint"], str) else None
        if fp is None:
            raise _Invalid(
                f"{what} names fingerprint {str(r['fingerprint'])[:80]!r}, not in the bundle"
            )
        scope = _scope(r["scope"], what)
        namespace, key = r["namespace"], r["key"]
        try:
            check_protocol_identity(namespace, key)
        except ValueError as exc:
            raise _Invalid(f"{what}: {exc}") from None
        text = _protocol_text(r["value"], f"{what} value", protocol_value_json)
        policy = r["policy"]
        if policy is not None:
            policy = _protocol_text(policy, f"{what} policy", protocol_policy_json)
        tuned_at = r["tuned_at"]
        if not isinstance(tuned_at, float) or not math.isfinite(tuned_at) or tuned_at < 0:
            raise _Invalid(f"{what} tuned_at must be a finite, non-negative float (seconds)")
        order = (r["fingerprint"], scope, namespace, key)
        if previous is not None and order <= previous:
            raise _Invalid(f"{what} is out of order or a duplicate")
        previous = order
        found.append(NewProtocolRecord(fp, namespace, key, text, policy, scope, tuned_at))
    return found


def parse_bundle_bytes(data: bytes, *, source: str = "<bytes>") -> Bundle:
    """Verify and parse one bundle's bytes; raises ``BundleError`` (one line)."""
    version, payload = _frame(data, source)
    try:
        try:
            top = json.loads(payload.decode("ascii"), parse_constant=_reject_constant)
        except UnicodeDecodeError:
            raise _Invalid("payload is not ASCII") from None
        except (ValueError, RecursionError) as exc:
            detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise _Invalid(f"payload is not JSON: {detail}") from None
        _object(top, "the payload", _MEMBERS_PROTOCOL if version >= PROTOCOL_VERSION else _MEMBERS)
        fps = _fingerprints(top["fingerprints"], version)
        entries, ops = _entries(top["entries"], fps, version)
        records = _records(top["records"], fps)
        protocol = (
            _protocol_records(top["protocol_records"], fps, version)
            if version >= PROTOCOL_VERSION
            else []
        )
        unused = sorted(
            set(fps)
            - {e.fingerprint.digest for e in entries}
            - set(records)
            - {r.fingerprint.digest for r in protocol}
        )
        if unused:
            raise _Invalid(f"fingerprint {unused[0][:12]} holds nothing")
        provenance = _provenance(entries, ops, records, protocol)
        if top["provenance"] != provenance:
            raise _Invalid("provenance does not describe the content")
        try:
            canonical = _render(fps, entries, ops, records, protocol)
        except (ValueError, RecursionError):  # a record holding 1e999, say
            raise _Invalid("records hold a value JSON cannot carry") from None
        if canonical != data:
            raise _Invalid("not in canonical form")
    except _Invalid as exc:
        raise BundleError(f"{source}: invalid bundle ({exc}); {_AGAIN}") from None
    return Bundle(
        version,
        hashlib.sha256(data).hexdigest(),
        tuple(fps[d] for d in sorted(fps)),
        tuple(entries),
        records,
        provenance,
        tuple(protocol),
    )


def read_bundle(path: str | os.PathLike[str]) -> Bundle:
    """Read and verify the bundle at ``path``; raises ``BundleError`` (one line)."""
    p = Path(path)
    try:
        if p.stat().st_size > MAX_HEADER_BYTES + MAX_PAYLOAD_BYTES:
            raise BundleError(
                f"{p}: larger than {MAX_HEADER_BYTES + MAX_PAYLOAD_BYTES} bytes; "
                "not a bundle ficache reads"
            )
        data = p.read_bytes()
    except IsADirectoryError:
        raise BundleError(f"{p}: is a directory, expected a ficache bundle") from None
    except FileNotFoundError:
        raise BundleError(f"{p}: no such file") from None
    except PermissionError:
        raise BundleError(f"{p}: permission denied") from None
    except OSError as exc:
        raise BundleError(f"{p}: cannot read ({exc.strerror})") from None
    return parse_bundle_bytes(data, source=str(p))


# --------------------------------------------------------------------------
# Bytes of given content, and the file (``ficache.exporting`` reads the registry).


def encode_bundle(
    entries: Iterable[NewEntry],
    records: Records,
    record_fingerprints: Iterable[Fingerprint],
    *,
    path: Path,
    protocol_records: Iterable[NewProtocolRecord] = (),
) -> tuple[bytes, BundleSummary]:
    """The bundle of ``entries`` and ``records``, re-read as any reader would, and its summary.

    ``record_fingerprints``: the fingerprints ``records`` name (those of
    ``entries`` are taken from them). ``path`` is where the bytes will go
    (named in the summary and in errors). Raises ``BundleError`` when the
    content is one a bundle cannot carry: a bundle ficache cannot read back
    is never returned.
    """
    try:
        data = render_bundle(entries, records, record_fingerprints, protocol_records)
        bundle = parse_bundle_bytes(data, source=str(path))
    except (ValueError, BundleError) as exc:
        raise BundleError(f"the registry holds an entry a bundle cannot carry: {exc}") from None
    summary = BundleSummary(
        path,
        bundle.digest,
        len(data),
        bundle.format_version,
        len(bundle.fingerprints),
        len(bundle.entries),
        int(bundle.provenance["records"]),
        len(bundle.protocol_records),
    )
    return data, summary


def publish_bundle(path: Path, data: bytes) -> None:
    """Publish ``data`` at ``path`` (``ficache.publish.publish``); ``BundleError`` when it cannot."""
    try:
        publish(path, data)
    except OSError as exc:
        raise BundleError(f"cannot write {path}: {exc.strerror}") from None


def bundle_records(bundle: Bundle, tuned_at: float | None = None) -> list[NewRecord]:
    """The records of a verified bundle, as ``Registry.write`` stores them.

    A bundle carries no tuning time for records: ``tuned_at`` is the one its
    reader dates them with (``tuned_time.tuned_at`` of the bundle file).
    """
    fps = {fp.digest: fp for fp in bundle.fingerprints}
    return [
        NewRecord(fps[digest], ns, key, record_value_json(value), scope, tuned_at)
        for digest, scopes in sorted(bundle.records.items())
        for scope, by_ns in sorted(scopes.items())
        for ns, by_key in sorted(by_ns.items())
        for key, value in sorted(by_key.items())
    ]


__all__ = [
    "FORMAT_VERSION",
    "Bundle",
    "BundleSummary",
    "bundle_records",
    "encode_bundle",
    "is_bundle",
    "looks_like_bundle",
    "parse_bundle_bytes",
    "publish_bundle",
    "read_bundle",
    "render_bundle",
]
