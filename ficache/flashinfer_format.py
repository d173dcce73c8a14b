"""Parse and render FlashInfer autotuner cache files (``save_configs`` JSON).

The format, as FlashInfer 0.7 writes it::

    {"_metadata": {<FlashInfer fields>},        # optional (older files lack it)
     "_records": {<namespace>: {...}},          # optional product records
     "<file_key>": [runner_class_name, tactic, policy?, selection?], ...,
     "_generation": "<sha256>"}                 # optional ("_cache_generation" too)

``file_key`` is ``str((custom_op, runner_class_name, nearest_profile, extras))``.
``selection`` (FlashInfer 0.7.4+, only after a policy) is how real tuning
chose the winner, a JSON object (``{"time_ms", "runner_up_ms", "margin",
"candidates"}``); FlashInfer keeps it only to save it back, ignores a
fourth element that is not an object, and 0.7.2 ignores any fourth element.

Invariants:
- Keys and tactics are data, never code. Keys are read by a tokenizer that
  accepts only Python literal syntax for strings, numbers and tuples plus
  bare dotted names (``torch.bfloat16``), kept as text; extras that are not
  literal syntax are kept as opaque text. Nothing is evaluated.
- Every key form FlashInfer wrote from 0.6.7 on is read (``parse_key``): the
  3-element keys of 0.6.7-0.6.12, the 4-element keys since, and keys whose
  extras are no literal (kept as text). An entry whose key ficache cannot
  read is skipped and counted (``CacheFile.unreadable_keys``), never a
  reason to refuse the rest of its file.
- Otherwise parsing is strict and all-or-nothing: a file with any invalid
  entry raises ``CacheFileError`` naming the count and the first problem; no
  partial result escapes. (The startup path, which must be forgiving, catches it.)
- The key string is kept verbatim and tactics and policies are stored as
  canonical JSON text, so rendering reproduces exactly what FlashInfer will
  look up. Rendering never parses stored JSON again.
- A selection is stored as canonical JSON text (``selection_json``: an
  object of finite numbers, at most ``MAX_SELECTION_DEPTH`` levels and
  ``MAX_SELECTION_CHARS`` characters; anything else makes the entry invalid)
  and rendered back as the fourth element, spliced in. A fourth element
  that is not an object is dropped, as FlashInfer drops it: the entry is
  kept without a selection and counted (``CacheFile.ignored_selections``).
  A selection is never part of an entry's value (``ficache.models``).
- Files are published by ``ficache.publish.publish``: a regular file or a
  new path atomically (temp file in the target's directory, ``os.replace``,
  temp removed on any failure), a device or FIFO written to; new files
  follow the umask, a replaced file keeps its mode.
- ``_records`` (FlashInfer's namespaced records) is validated as strictly
  as entries: an object of namespaces (non-empty, not starting with ``_``,
  as ``AutoTuner.publish_namespaced_records`` demands), each an object of
  record keys to JSON values (finite numbers, at most ``MAX_RECORD_DEPTH``
  levels, at most ``MAX_RECORD_CHARS`` of canonical JSON). A value is kept
  as canonical JSON text (``record_value_json``) and rendered back spliced
  in, so an export's ``_records`` holds the values FlashInfer saved
  (object members in sorted order, which JSON does not make significant).
- Bulk parsing is fast without being looser: entries of the common shape
  (a key as FlashInfer writes it, a JSON tactic and policy) take a fast path
  that decides exactly as the general checks do (tests compare the two on
  generated entries); anything else takes the general checks.
"""

from __future__ import annotations

import functools
import hashlib
import json
import operator
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ficache._gcpause import paused_gc
from ficache.errors import CacheFileError
from ficache.publish import publish

METADATA_KEY = "_metadata"
RECORDS_KEY = "_records"
GENERATION_KEYS = ("_generation", "_cache_generation")

#: Largest cache file ficache reads (a real one is kilobytes to megabytes).
MAX_FILE_BYTES = 512 * 1024 * 1024
MAX_KEY_CHARS = 16 * 1024
MAX_TACTIC_DEPTH = 8
#: Deepest nesting of one record value, its longest canonical JSON, longest namespace.
MAX_RECORD_DEPTH = 32
MAX_RECORD_CHARS = 4 * 1024 * 1024
MAX_NAMESPACE_CHARS = 256
#: Deepest nesting and longest canonical JSON of one selection (FlashInfer's is flat and short).
MAX_SELECTION_DEPTH = 8
MAX_SELECTION_CHARS = 64 * 1024


Shapes = tuple[tuple[int, ...], ...]
_tuple_new = tuple.__new__


def _shapes_text(shapes: Shapes) -> str:
    """Python's ``repr`` of integer shape tuples, the canonical text ``KeyFields`` keeps."""
    return repr(tuple(tuple(int(d) for d in s) for s in shapes))


class KeyFields(tuple[str, str, str, str]):
    """The readable parts of a ``file_key``; extras stay as their source text.

    A tuple ``(op, runner, extras, shapes_text)`` with named fields, so it is
    immutable, and equal and hashed by op, runner, shapes and extras.
    ``shapes_text`` is Python's ``repr`` of the shapes, exactly as
    FlashInfer's keys write them (``((16, 4096), (4096, 2048))``; a 1-tuple
    with its comma): one text per value, so it is canonical. Bulk parsing
    makes a ``KeyFields`` with one ``tuple.__new__`` from that text as the key
    holds it; ``shapes_json`` and ``shapes`` are made from it when asked for
    (rarely: display; writers store only op and runner).
    """

    __slots__ = ()

    def __new__(cls, op: str, runner: str, shapes: Shapes, extras: str) -> KeyFields:
        return _tuple_new(cls, (op, runner, extras, _shapes_text(shapes)))

    op = property(operator.itemgetter(0), doc="The custom op's name.")
    runner = property(operator.itemgetter(1), doc="The runner class's name.")
    extras = property(operator.itemgetter(2), doc="The key's own text of its fourth element.")
    shapes_text = property(operator.itemgetter(3), doc="The shapes as Python's repr writes them.")

    @property
    def shapes_json(self) -> str:
        """The shapes as JSON text: ``((1,), (2, 3))`` -> ``[[1], [2, 3]]``."""
        # Three replaces cost a fifth of one str.translate.
        return self[3].replace(",)", ")").replace("(", "[").replace(")", "]")

    @property
    def shapes(self) -> Shapes:
        return tuple(map(tuple, json.loads(self.shapes_json)))

    def __repr__(self) -> str:
        return (
            f"KeyFields(op={self.op!r}, runner={self.runner!r}, shapes={self.shapes!r}, "
            f"extras={self.extras!r})"
        )

    def __getnewargs__(self) -> tuple[str, str, Shapes, str]:
        return (self.op, self.runner, self.shapes, self.extras)


class FileEntry(NamedTuple):
    """One entry of a cache file, checked.

    A named tuple, so that bulk parsing makes one with a single
    ``tuple.__new__``. Tactic, policy and selection are canonical JSON text.
    """

    key: str  # verbatim
    runner: str
    tactic_json: str
    policy_json: str | None  # None when absent
    fields: KeyFields  # ``key`` parsed, once, when read
    selection_json: str | None = None  # None when absent


def _key_fields(op: str, runner: str, shapes_text: str, extras: str) -> KeyFields:
    """``KeyFields`` of a key whose shapes text ``_COMMON_KEY`` matched (repr form)."""
    return _tuple_new(KeyFields, (op, runner, extras, shapes_text))


@dataclass(frozen=True)
class CacheFile:
    metadata: dict[str, Any] | None
    entries: tuple[FileEntry, ...]
    records: dict[str, Any] | None = None
    generation: str | None = None
    #: ``records`` as ``(namespace, record key, canonical JSON value)``, sorted.
    record_rows: tuple[tuple[str, str, str], ...] = ()
    #: Entries whose fourth element was not an object: kept without a selection.
    ignored_selections: int = 0
    #: Entries skipped because ficache cannot read their key (``UnreadableKeyError``),
    #: each as ``'<key>': <why>``; the rest of the file is read.
    unreadable_keys: tuple[str, ...] = ()


def canonical_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True, allow_nan=False)


def _make_json_chunks() -> Callable[[Any, int], Iterable[str]]:
    """The encoder ``canonical_json`` runs, made once: ``"".join(chunks(v, 0))``.

    ``json.dumps`` builds a ``JSONEncoder`` and its C encoder on every call,
    which costs more than encoding a small tactic. Values come from
    ``json.loads``, so they hold no cycles (no ``markers`` needed) and no
    type ``default`` must handle.
    """
    make_encoder = getattr(json.encoder, "c_make_encoder", None)
    if make_encoder is None:  # a Python without the _json accelerator
        return lambda value, _level: (canonical_json(value),)

    def refuse(value: Any) -> Any:
        raise TypeError(f"{type(value).__name__} is not JSON")

    chunks: Callable[[Any, int], Iterable[str]] = make_encoder(
        None, refuse, json.encoder.encode_basestring_ascii, None, ":", ",", True, False, False
    )
    return chunks


_json_chunks = _make_json_chunks()


# --------------------------------------------------------------------------
# file_key tokenizer: a tiny recursive-descent reader for tuple reprs.

_TOKEN = re.compile(
    r"""(?P<ws>\s+)
      | (?P<str>'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")
      | (?P<num>-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)
      | (?P<name>-inf\b|[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)  # -inf: repr(float("-inf"))
      | (?P<open>[(\[])
      | (?P<close>[)\]])
      | (?P<comma>,)
      | (?P<bad>.)
    """,
    re.VERBOSE | re.DOTALL,
)
_ESCAPE = re.compile(r"""\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[nrt0\\'"abfv])""")
_SIMPLE_ESCAPES = {
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "0": "\0",
    "\\": "\\",
    "'": "'",
    '"': '"',
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "v": "\v",
}
_MAX_DEPTH = 32


class _Name(str):
    """A bare identifier in a key (``torch.float16``): text, not a reference."""


def _unescape(match: re.Match[str]) -> str:
    code = match.group(1)
    if code[0] in "xuU":
        return chr(int(code[1:], 16))
    return _SIMPLE_ESCAPES[code]


def _unquote(literal: str) -> str:
    body = literal[1:-1]
    return _ESCAPE.sub(_unescape, body) if "\\" in body else body


def _parse_literal(text: str) -> tuple[Any, list[tuple[int, int]]]:
    """Parse a tuple repr iteratively; return it and the spans of its children.

    Accepts strings, numbers, bare dotted names and nested tuples/lists;
    anything else (calls, operators, subscripts) raises ``ValueError``.

    One body on purpose: every key of every import is parsed here, one
    character class at a time in a single loop with its explicit stack;
    splitting the branches into functions would add a call per token.
    """
    stack: list[list[Any]] = []
    starts: list[int] = []
    closers: list[str] = []
    child_spans: list[tuple[int, int]] = []
    result: Any = None
    done = False
    prev = "start"  # kind of the previous significant token
    for m in _TOKEN.finditer(text):
        kind = m.lastgroup
        if kind == "ws":
            continue
        if done:
            raise ValueError(f"trailing text after the key tuple at offset {m.start()}")
        if kind == "bad":
            raise ValueError(f"unexpected character {m.group()!r} at offset {m.start()}")
        if kind == "comma":
            if not stack or prev in ("open", "comma"):
                raise ValueError(f"misplaced ',' at offset {m.start()}")
            prev = kind
            continue
        if kind == "close":
            if not stack or m.group() != closers[-1] or prev == "comma" and not stack[-1]:
                raise ValueError(f"unbalanced {m.group()!r} at offset {m.start()}")
            value: Any = tuple(stack.pop())
            span = (starts.pop(), m.end())
            closers.pop()
        else:
            if prev not in ("start", "open", "comma"):
                raise ValueError(f"expected ',' before offset {m.start()}")
            if kind == "open":
                if len(stack) >= _MAX_DEPTH:
                    raise ValueError("nesting too deep")
                stack.append([])
                starts.append(m.start())
                closers.append(")" if m.group() == "(" else "]")
                prev = kind
                continue
            token = m.group()
            if kind == "str":
                value = _unquote(token)
            elif kind == "num":
                value = float(token) if any(c in token for c in ".eE") else int(token)
            else:
                value = _Name(token)
            span = (m.start(), m.end())
        prev = "value"
        if not stack:
            result, done = value, True
        else:
            if len(stack) == 1:
                child_spans.append(span)
            stack[-1].append(value)
    if stack:
        raise ValueError("unclosed bracket")
    if not done:
        raise ValueError("empty key")
    return result, child_spans


# The shape of nearly every key FlashInfer writes: quoted op and runner
# without escapes, integer shape tuples exactly as ``repr`` writes them (a
# comma after the one item of a 1-tuple, none after the last of several:
# the matched text is ``KeyFields.shapes_text``, canonical).
# Matching it in one step makes bulk imports cheap; the extras are still read
# by the literal parser (memoised: they repeat across keys), and any other
# shape of key falls through to the general path, which accepts more.
# No leading zeros, no "-0": also valid JSON. At most 19 digits: a longer
# integer takes the general path, which refuses one past Python's int limit.
_REPR_INT = r"(?:0|-?[1-9][0-9]{0,18})"


def _repr_tuple(item: str) -> str:
    """A pattern of a tuple of ``item`` as ``repr`` writes it: ``()``, ``(x,)``,
    ``(x, y, ...)``. The comma of a 1-tuple is told apart by a lookahead, so
    no item is matched twice (an alternation of the two forms would be)."""
    return rf"(?:\((?:{item})(?:,(?=\))|(?:, (?:{item}))++)\)|\(\))"


_COMMON_KEY = re.compile(
    rf"\('([^'\\\n]++)', '([^'\\\n]++)', ({_repr_tuple(_repr_tuple(_REPR_INT))}), (\(.*\))\)",
    re.DOTALL,
)


@functools.lru_cache(maxsize=4096)
def _is_tuple_literal(text: str) -> bool:
    """Extras repeat across keys (dtype tuples), so their check is memoised."""
    try:
        value, _spans = _parse_literal(text)
    except ValueError:
        return False
    return isinstance(value, tuple)


def _common_key(key: str) -> KeyFields | None:
    """``parse_key`` for the common shape of key; None for any other shape."""
    m = _COMMON_KEY.fullmatch(key)
    if m is None:
        return None
    op, runner, shapes_text, extras = m.groups()
    if not _is_tuple_literal(extras):
        return None
    return _key_fields(op, runner, shapes_text, extras)


def parse_key(key: str) -> KeyFields:
    """Read op, runner, shapes and extras from a ``file_key`` without eval.

    Reads every form of key FlashInfer wrote from 0.6.7 on:

    - ``(op, runner, shapes, extras)`` (0.6.13 and later); ``extras`` is the
      key's own text of the fourth element. Where the extras are not Python
      literal syntax (an object whose ``repr`` is a call or ``<...>``, which
      FlashInfer's v2 ``lookup`` still serves by the key's text), they are
      kept as opaque text: the parenthesised rest of the key, with balanced
      brackets, never evaluated.
    - ``(op, runner, shapes)`` (0.6.7 to 0.6.12's ``save_configs``);
      ``extras`` is ``""``, which no 4-element key has.

    Raises ``ValueError`` with the reason for anything else (an
    ``UnreadableKeyError``).
    """
    if len(key) > MAX_KEY_CHARS:
        raise UnreadableKeyError(f"key longer than {MAX_KEY_CHARS} characters")
    fast = _common_key(key)
    if fast is not None:
        return fast
    try:
        return _parse_key_general(key)
    except ValueError as exc:
        opaque = _opaque_extras_key(key)
        if opaque is None:
            raise UnreadableKeyError(str(exc)) from None
        return opaque


class UnreadableKeyError(ValueError):
    """A ``file_key`` of no form FlashInfer writes (``parse_key``): its entry is skipped
    and counted, never a reason to refuse the rest of its file."""


def _parse_key_general(key: str) -> KeyFields:
    """``parse_key`` for any key shape (the literal parser over the whole key)."""
    value, spans = _parse_literal(key)
    if not isinstance(value, tuple) or len(value) not in (3, 4):
        raise ValueError(
            "a key is a 4-tuple (op, runner, shapes, extras) or, before FlashInfer 0.6.13, "
            "a 3-tuple (op, runner, shapes)"
        )
    op, runner, shapes = value[:3]
    if not isinstance(op, str) or isinstance(op, _Name) or not op:
        raise ValueError("key op must be a non-empty string")
    if not isinstance(runner, str) or isinstance(runner, _Name) or not runner:
        raise ValueError("key runner must be a non-empty string")
    if not isinstance(shapes, tuple) or not all(
        isinstance(s, tuple) and all(type(d) is int for d in s) for s in shapes
    ):
        raise ValueError("key shapes must be a tuple of integer tuples")
    if len(value) == 3:
        return KeyFields(op, runner, shapes, "")
    if not isinstance(value[3], tuple):
        raise ValueError("key extras must be a tuple")
    start, end = spans[3]
    return KeyFields(op, runner, shapes, key[start:end])


# A key whose op, runner and shapes are read as literals and whose extras are
# not: ``('op', 'R', ((1,),), (device(type='cuda', index=0),))``.
_STR = r"'(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\""
_OPAQUE_KEY = re.compile(
    rf"\(({_STR}), ({_STR}), ({_repr_tuple(_repr_tuple(_REPR_INT))}), (\(.*\))\)", re.DOTALL
)
_OPENERS, _CLOSERS = "([{", ")]}"


def _balanced(text: str) -> bool:
    """Whether ``text`` is one bracketed group: brackets outside string literals
    balance, and the first one closes only at the end."""
    depth = 0
    quote = ""
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c in _OPENERS:
            depth += 1
        elif c in _CLOSERS:
            depth -= 1
            if depth < 0 or (depth == 0 and i != n - 1):
                return False
        i += 1
    return depth == 0 and not quote


def _opaque_extras_key(key: str) -> KeyFields | None:
    """``KeyFields`` of a 4-element key whose extras are not literal syntax (kept as
    text), or None where op, runner or shapes cannot be read or the extras are not
    one parenthesised group."""
    m = _OPAQUE_KEY.fullmatch(key)
    if m is None:
        return None
    op_text, runner_text, shapes_text, extras = m.groups()
    op, runner = _unquote(op_text), _unquote(runner_text)
    if not op or not runner or not _balanced(extras):
        return None
    return _key_fields(op, runner, shapes_text, extras)


# --------------------------------------------------------------------------
# Namespaced records.


def check_namespace(namespace: Any) -> str:
    """``namespace`` when FlashInfer would publish it; ``ValueError`` otherwise."""
    if not isinstance(namespace, str) or not namespace or namespace.startswith("_"):
        raise ValueError(f"namespace {str(namespace)[:80]!r} is not a public identifier")
    if len(namespace) > MAX_NAMESPACE_CHARS:
        raise ValueError(f"namespace longer than {MAX_NAMESPACE_CHARS} characters")
    return namespace


def _check_record_value(value: Any, depth: int, limit: int = MAX_RECORD_DEPTH) -> None:
    if depth > limit:
        raise ValueError(f"nested deeper than {limit} levels")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"an object key is a {type(k).__name__}, not a string")
            _check_record_value(v, depth + 1, limit)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_record_value(v, depth + 1, limit)
    elif isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError("holds a non-finite number")
    elif not (value is None or isinstance(value, (bool, int, str))):
        raise ValueError(f"holds a {type(value).__name__}, which JSON cannot carry")


def record_value_json(value: Any) -> str:
    """The canonical JSON text of one record value; ``ValueError`` for a value
    JSON cannot carry exactly (a non-string object key, a non-finite number,
    another type), nests too deeply or is too long."""
    _check_record_value(value, 0)
    text = canonical_json(value)
    if len(text) > MAX_RECORD_CHARS:
        raise ValueError(f"longer than {MAX_RECORD_CHARS} characters of JSON")
    return text


# FlashInfer 0.7.4's protocol records (``ficache.protocol_records`` stores them): the
# checks every rank may run, importing nothing heavy.

#: Longest protocol record key kept (FlashInfer's are short JSON texts).
MAX_PROTOCOL_KEY_CHARS = 4096


def check_protocol_identity(namespace: Any, key: Any) -> None:
    """``ValueError`` unless ``(namespace, key)`` is one ``publish_protocol_record`` accepts."""
    if not isinstance(namespace, str) or not namespace:
        raise ValueError(f"protocol namespace {str(namespace)[:80]!r} is not a non-empty string")
    if len(namespace) > MAX_NAMESPACE_CHARS:
        raise ValueError(f"protocol namespace longer than {MAX_NAMESPACE_CHARS} characters")
    if not isinstance(key, str):
        raise ValueError(f"protocol record key {str(key)[:80]!r} is not a string")
    if len(key) > MAX_PROTOCOL_KEY_CHARS:
        raise ValueError(f"protocol record key longer than {MAX_PROTOCOL_KEY_CHARS} characters")


def protocol_value_json(value: Any) -> str:
    """The canonical JSON of a protocol record's value; ``ValueError`` for one FlashInfer
    could not have written (a non-finite number, too deep, not JSON)."""
    try:
        return record_value_json(value)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def protocol_policy_json(policy: Any) -> str | None:
    """The canonical JSON of an entry file's ``profiling_policy`` (None: absent); ``ValueError``
    for one that is not a list of JSON scalars and lists."""
    if policy is None:
        return None
    if not isinstance(policy, list):
        raise ValueError("profiling_policy must be a list")
    return protocol_value_json(policy)


def record_rows(records: Any) -> tuple[tuple[str, str, str], ...]:
    """``{namespace: {key: value}}`` as sorted ``(namespace, key, canonical JSON)``.

    Raises ``ValueError`` naming the first problem.
    """
    if not isinstance(records, dict):
        raise ValueError("must be an object of namespaces")
    rows = []
    for namespace, by_key in records.items():
        check_namespace(namespace)
        if not isinstance(by_key, dict):
            raise ValueError(f"namespace {namespace[:80]!r} must be an object")
        for key, value in by_key.items():
            if not isinstance(key, str) or len(key) > MAX_KEY_CHARS:
                raise ValueError(f"namespace {namespace[:80]!r} has a key that is too long")
            try:
                rows.append((namespace, key, record_value_json(value)))
            except (ValueError, RecursionError) as exc:
                detail = str(exc) if isinstance(exc, ValueError) else "nested too deeply"
                raise ValueError(f"record {namespace[:80]!r}/{key[:80]!r}: {detail}") from None
    rows.sort()
    return tuple(rows)


def selection_json(value: Any) -> str:
    """The canonical JSON text of one selection (a value's fourth element).

    ``ValueError`` unless ``value`` is an object JSON carries exactly (string
    keys, finite numbers), at most ``MAX_SELECTION_DEPTH`` levels deep and
    ``MAX_SELECTION_CHARS`` characters long.
    """
    if not isinstance(value, dict):
        raise ValueError(f"selection must be an object, not a {type(value).__name__}")
    try:
        _check_record_value(value, 0, MAX_SELECTION_DEPTH)
    except ValueError as exc:
        raise ValueError(f"selection {exc}") from None
    text = canonical_json(value)
    if len(text) > MAX_SELECTION_CHARS:
        raise ValueError(f"selection longer than {MAX_SELECTION_CHARS} characters of JSON")
    return text


# --------------------------------------------------------------------------
# Whole files.


def _check_tactic(value: Any, depth: int = 0) -> None:
    if depth > MAX_TACTIC_DEPTH:
        raise ValueError("tactic nested too deeply")
    if isinstance(value, list):
        for v in value:
            _check_tactic(v, depth + 1)
    elif isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return
    elif isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError("tactic holds a non-finite number")
    else:
        raise ValueError(f"tactic holds a {type(value).__name__}; expected numbers and lists")


def _check_entry(key: str, value: Any) -> FileEntry:
    """One entry, checked; a fourth element that is not an object is dropped.

    The key is read first: one ficache cannot read raises ``UnreadableKeyError``
    whatever its value holds.
    """
    fields = parse_key(key)
    if not isinstance(value, list) or len(value) not in (2, 3, 4):
        raise ValueError(
            "value must be [runner, tactic], [runner, tactic, policy] "
            "or [runner, tactic, policy, selection]"
        )
    runner, tactic = value[0], value[1]
    if not isinstance(runner, str) or not runner:
        raise ValueError("runner must be a non-empty string")
    _check_tactic(tactic)
    if fields.runner != runner:
        raise ValueError(f"runner {runner!r} differs from the key's {fields.runner!r}")
    policy_json = selection = None
    if len(value) >= 3:
        policy = value[2]
        if not isinstance(policy, list):
            raise ValueError("policy must be a list")
        _check_tactic(policy)
        policy_json = canonical_json(policy)
    if len(value) == 4 and isinstance(value[3], dict):
        selection = selection_json(value[3])
    return FileEntry(key, runner, canonical_json(tactic), policy_json, fields, selection)


def parse_cache_bytes(data: bytes, *, source: str = "<bytes>") -> CacheFile:
    """Parse and validate one FlashInfer cache file's contents."""
    if len(data) > MAX_FILE_BYTES:
        raise CacheFileError(f"{source}: larger than {MAX_FILE_BYTES} bytes; not a cache file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CacheFileError(
            f"{source}: not UTF-8 text (byte {exc.start}); not a cache file"
        ) from None

    with paused_gc():  # tens of thousands of small objects, no cycles
        return _parse_text(text, source)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _parse_text(text: str, source: str) -> CacheFile:
    try:
        top = json.loads(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, ValueError, RecursionError) as exc:
        detail = str(exc) if not isinstance(exc, RecursionError) else "nested too deeply"
        raise CacheFileError(
            f"{source}: invalid JSON ({detail}); the file is truncated or not a FlashInfer cache"
        ) from None
    if not isinstance(top, dict):
        raise CacheFileError(
            f"{source}: top level is a JSON {type(top).__name__}, expected an object; "
            "not a FlashInfer cache file"
        )
    metadata = top.pop(METADATA_KEY, None)
    if metadata is not None and not isinstance(metadata, dict):
        raise CacheFileError(f"{source}: _metadata must be an object")
    records = top.pop(RECORDS_KEY, None)
    if records is not None and not isinstance(records, dict):
        raise CacheFileError(f"{source}: _records must be an object")
    rows: tuple[tuple[str, str, str], ...] = ()
    if records is not None:
        try:
            rows = record_rows(records)
        except ValueError as exc:
            raise CacheFileError(f"{source}: _records invalid, nothing imported: {exc}") from None
    generation = None
    for gkey in GENERATION_KEYS:
        g = top.pop(gkey, None)
        if g is not None:
            if not isinstance(g, str):
                raise CacheFileError(f"{source}: {gkey} must be a string")
            generation = g

    entries, problems, ignored = _read_entries(top)
    unreadable = tuple(p for p in problems if isinstance(p, _Unreadable))
    if len(unreadable) < len(problems):
        invalid = [p for p in problems if not isinstance(p, _Unreadable)]
        raise CacheFileError(
            f"{source}: {len(invalid)} of {len(top)} entries invalid, nothing imported; "
            f"first: {invalid[0]}"
        )
    return CacheFile(
        metadata, tuple(entries), records, generation, rows, ignored, tuple(map(str, unreadable))
    )


def unreadable_note(unreadable: tuple[str, ...]) -> str:
    """What every reader says of entries skipped for their key (``CacheFile.unreadable_keys``)."""
    n = len(unreadable)
    return (
        f"{n} entr{'y' if n == 1 else 'ies'} skipped: a key of no form FlashInfer writes "
        f"(first: {unreadable[0]})"
    )


class _Unreadable(str):
    """A problem of ``_read_entries`` that is an unreadable key (skipped, not refused)."""


def _read_entries(top: dict[str, Any]) -> tuple[list[FileEntry], list[str], int]:
    """Check and convert every entry; return them, the problems found and the
    number of fourth elements dropped (not objects: kept without a selection).

    Most entries take the fast path below, which decides exactly what
    ``_check_entry`` decides for them; anything it is not sure of (another
    shape of key, a dict-looking or deeply nested tactic, a non-finite
    number, a malformed value) goes to ``_check_entry``, which accepts it or
    names the problem.

    It is one body on purpose: it is the per-entry loop of every import
    (100k entries and more), and a helper called per entry would cost a call
    on each; the slow, rare cases are already ``_check_entry``'s.
    """
    entries: list[FileEntry] = []
    problems: list[str] = []
    append = entries.append
    match_key = _COMMON_KEY.fullmatch
    is_tuple_literal = _is_tuple_literal
    chunks = _json_chunks
    join = "".join
    new = _tuple_new
    max_key, max_depth = MAX_KEY_CHARS, MAX_TACTIC_DEPTH
    max_sel_depth, max_sel_chars = MAX_SELECTION_DEPTH, MAX_SELECTION_CHARS
    ignored = 0
    for key, value in top.items():
        if type(value) is list and 2 <= (n := len(value)) <= 4 and len(key) <= max_key:
            runner = value[0]
            m = match_key(key)
            if m is not None:
                op, key_runner, shapes_text, extras = m.groups()
            if (
                m is not None
                and type(runner) is str
                and key_runner == runner
                and is_tuple_literal(extras)
                and (n == 2 or type(value[2]) is list)
                and (n < 4 or type(value[3]) is dict)
            ):
                try:
                    tactic = value[1]
                    # An int's JSON is its str (bool, a subclass, is not an int here).
                    tactic_json = str(tactic) if type(tactic) is int else join(chunks(tactic, 0))
                    policy_json = join(chunks(value[2], 0)) if n >= 3 else None
                    sel_json = join(chunks(value[3], 0)) if n == 4 else None
                except (ValueError, RecursionError):  # a non-finite number, or deep nesting
                    pass
                else:
                    # No object and at most MAX_TACTIC_DEPTH brackets (also
                    # counting any inside strings): ``_check_tactic`` passes;
                    # at most MAX_SELECTION_DEPTH brackets of either kind and
                    # short enough: ``selection_json`` passes.
                    if (
                        "{" not in tactic_json
                        and tactic_json.count("[") <= max_depth
                        and (
                            policy_json is None
                            or ("{" not in policy_json and policy_json.count("[") <= max_depth)
                        )
                        and (
                            sel_json is None
                            or (
                                len(sel_json) <= max_sel_chars
                                and sel_json.count("{") + sel_json.count("[") <= max_sel_depth
                            )
                        )
                    ):
                        kf = new(KeyFields, (op, runner, extras, shapes_text))
                        entry = new(
                            FileEntry, (key, runner, tactic_json, policy_json, kf, sel_json)
                        )
                        append(entry)
                        continue
        try:
            append(_check_entry(key, value))
        except UnreadableKeyError as exc:
            problems.append(_Unreadable(f"{key[:80]!r}: {exc}"))
        except ValueError as exc:
            problems.append(f"{key[:80]!r}: {exc}")
        else:
            ignored += type(value) is list and len(value) == 4 and type(value[3]) is not dict
    return entries, problems, ignored


def read_cache_bytes(path: str | os.PathLike[str]) -> bytes:
    """The bytes of the file at ``path``, refused (one ``CacheFileError`` line) where it
    is missing, unreadable, a directory or larger than ``MAX_FILE_BYTES``.

    Every reader of FlashInfer files reads them here: ``read_cache_file``, and
    ``merge``, which also digests the bytes. The size is the open file's, so
    a file replaced between the check and the read is never read unchecked.
    """
    p = Path(path)
    try:
        with p.open("rb") as handle:
            if os.fstat(handle.fileno()).st_size > MAX_FILE_BYTES:
                raise CacheFileError(f"{p}: larger than {MAX_FILE_BYTES} bytes; not a cache file")
            return handle.read()
    except IsADirectoryError:
        raise CacheFileError(f"{p}: is a directory, expected a FlashInfer cache file") from None
    except FileNotFoundError:
        raise CacheFileError(f"{p}: no such file") from None
    except PermissionError:
        raise CacheFileError(f"{p}: permission denied") from None
    except OSError as exc:
        raise CacheFileError(f"{p}: cannot read ({exc.strerror})") from None


def read_cache_file(path: str | os.PathLike[str]) -> CacheFile:
    """The parsed FlashInfer file at ``path`` (``read_cache_bytes``, then ``parse_cache_bytes``)."""
    return parse_cache_bytes(read_cache_bytes(path), source=str(Path(path)))


#: One entry as ``render_cache`` writes it: ``(key, runner, tactic_json,
#: policy_json)``, or with ``selection_json`` as a fifth element.
CacheRow = tuple[str, str, str, str | None] | tuple[str, str, str, str | None, str | None]

# The JSON string encoder json.dumps itself uses, without its per-call set-up.
_json_string = json.encoder.encode_basestring_ascii


def render_cache(
    metadata: Mapping[str, str] | None,
    entries: Iterable[CacheRow],
    records: Mapping[str, Mapping[str, str]] | None = None,
) -> str:
    """Render ``(key, runner, tactic_json, policy_json[, selection_json])`` rows as a cache file.

    A selection (canonical JSON object, or None) is written as the fourth
    element after the policy, as FlashInfer 0.7.4 writes it; a row without a
    policy has none to write (FlashInfer writes one only after a policy).

    ``_metadata`` comes first, then ``_records`` (``{namespace: {key: canonical
    JSON}}``, namespaces and keys sorted; left out when empty), then entries
    sorted by key, as FlashInfer writes them. Stored JSON fragments are
    spliced in, not re-parsed.
    """
    quote = _json_string
    parts: list[str] = []
    if metadata is not None:
        parts.append(f'"{METADATA_KEY}": {json.dumps(dict(metadata), sort_keys=False)}')
    if records:
        namespaces = [
            quote(ns)
            + ": {"
            + ", ".join(f"{quote(key)}: {value}" for key, value in sorted(by_key.items()))
            + "}"
            for ns, by_key in sorted(records.items())
        ]
        parts.append(f'"{RECORDS_KEY}": {{{", ".join(namespaces)}}}')
    for row in sorted(entries, key=lambda row: row[0]):
        key, runner, tactic_json, policy_json = row[:4]
        selection = row[4] if len(row) == 5 else None
        if policy_json is None:
            parts.append(f"{quote(key)}: [{quote(runner)}, {tactic_json}]")
        elif selection is None:
            parts.append(f"{quote(key)}: [{quote(runner)}, {tactic_json}, {policy_json}]")
        else:
            parts.append(
                f"{quote(key)}: [{quote(runner)}, {tactic_json}, {policy_json}, {selection}]"
            )
    if not parts:
        return "{}\n"
    return "{\n" + ",\n".join(parts) + "\n}\n"


def render_file(
    metadata: Mapping[str, str] | None,
    entries: Iterable[CacheRow],
    records: Mapping[str, Mapping[str, str]] | None = None,
) -> str:
    """The cache file FlashInfer's ``save_configs`` writes for these rows, byte for byte.

    What ``export`` writes (``render_cache`` is the warm start's compact form).
    Its layout is save_configs' own, ``json.dump(ordered, indent=2)``, whatever
    form the imported files had: a registry merges many files, so no one
    input's form is the export's to keep, and a file FlashInfer saved comes
    back exactly as it saved it (``_records`` values and selections with
    their object members sorted, as ficache stores them).

    ``_generation``, FlashInfer's single-writer guard, is derived from the
    content as FlashInfer 0.7.2 and 0.7.4 derive it: the sha256 of the
    canonical JSON (sorted keys, no spaces) of ``_metadata``, ``_records``
    (when not empty) and the entries. Their guard compares only this text:
    ``load_configs`` remembers the one it read per path, and ``save_configs``
    with records published since raises where the file on disk now holds
    another. So a server that loaded an export and finds a different export
    (or FlashInfer file) on its path at its next save raises, as with
    FlashInfer's own files, and an export of what a file held gives that
    file's own ``_generation`` (it does not trip the guard).

    Stored canonical JSON is spliced in: the canonical text hashed is built
    from it, and each distinct tactic, policy and selection is laid out once
    (``_indented``), so exporting 100k entries stays well under a second.
    """
    quote = _json_string
    canonical: list[tuple[str, str]] = []  # (top-level key, canonical JSON of its value)
    parts: list[str] = []
    if metadata is not None:
        meta = dict(metadata)
        canonical.append((METADATA_KEY, canonical_json(meta)))
        parts.append(f'"{METADATA_KEY}": ' + _indent_value(json.dumps(meta, indent=2), 1))
    if records:
        loaded = {
            ns: {key: json.loads(value) for key, value in sorted(by_key.items())}
            for ns, by_key in sorted(records.items())
        }
        canonical.append((RECORDS_KEY, canonical_json(loaded)))
        parts.append(f'"{RECORDS_KEY}": ' + _indent_value(json.dumps(loaded, indent=2), 1))
    for row in sorted(entries, key=lambda row: row[0]):
        key, runner, tactic_json, policy_json = row[:4]
        selection = row[4] if len(row) == 5 and policy_json is not None else None
        fragments = [quote(runner), tactic_json]
        if policy_json is not None:
            fragments.append(policy_json)
            if selection is not None:
                fragments.append(selection)
        quoted = quote(key)
        canonical.append((key, "[" + ",".join(fragments) + "]"))
        items = ",\n    ".join(_indented(f) for f in fragments)
        parts.append(f"{quoted}: [\n    {items}\n  ]")
    canonical.sort()
    source = "{" + ",".join(f"{quote(k)}:{v}" for k, v in canonical) + "}"
    generation = hashlib.sha256(source.encode()).hexdigest()
    parts.append(f'"{GENERATION_KEYS[0]}": "{generation}"')
    return "{\n  " + ",\n  ".join(parts) + "\n}"


def _indent_value(text: str, level: int) -> str:
    """``json.dumps(v, indent=2)`` text as it sits ``level`` levels deep."""
    return text.replace("\n", "\n" + "  " * level)


@functools.lru_cache(maxsize=65536)
def _indented(fragment: str) -> str:
    """A canonical JSON fragment as ``json.dump(indent=2)`` writes it two levels deep
    (an element of an entry's value)."""
    return _indent_value(json.dumps(json.loads(fragment), indent=2), 2)


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Publish ``text`` at ``path``: readers see the old file or the new one.

    ``ficache.publish.publish`` decides how (devices and FIFOs are written
    to, symlinks followed, modes kept or taken from the umask).
    """
    publish(path, text)
