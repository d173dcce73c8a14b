"""Parse and render FlashInfer autotuner cache files (``save_configs`` JSON).

The format, as FlashInfer 0.7 writes it::

    {"_metadata": {<FlashInfer fields>},        # optional (older files lack it)
     "_records": {<namespace>: {...}},          # optional product records
     "<file_key>": [runner_class_name, tactic, policy?], ...,
     "_generation": "<sha256>"}                 # optional ("_cache_generation" too)

``file_key`` is ``str((custom_op, runner_class_name, nearest_profile, extras))``.

Invariants:
- Keys and tactics are data, never code. Keys are read by a tokenizer that
  accepts only Python literal syntax for strings, numbers and tuples plus
  bare dotted names (``torch.bfloat16``), kept as text. Nothing is evaluated.
- Parsing is strict and all-or-nothing: a file with any invalid entry raises
  ``CacheFileError`` naming the count and the first problem; no partial
  result escapes. (The startup path, which must be forgiving, catches it.)
- The key string is kept verbatim and tactics and policies are stored as
  canonical JSON text, so rendering reproduces exactly what FlashInfer will
  look up. Rendering never parses stored JSON again.
- Files are published atomically: temp file in the target's directory,
  ``os.replace``, temp removed on any failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ficache.errors import CacheFileError

METADATA_KEY = "_metadata"
RECORDS_KEY = "_records"
GENERATION_KEYS = ("_generation", "_cache_generation")

#: Largest cache file ficache reads (a real one is kilobytes to megabytes).
MAX_FILE_BYTES = 512 * 1024 * 1024
MAX_KEY_CHARS = 16 * 1024
MAX_TACTIC_DEPTH = 8


@dataclass(frozen=True, slots=True)
class KeyFields:
    """The readable parts of a ``file_key``; extras stay as their source text."""

    op: str
    runner: str
    shapes: tuple[tuple[int, ...], ...]
    extras: str


@dataclass(frozen=True, slots=True)
class FileEntry:
    key: str
    runner: str
    tactic_json: str  # canonical JSON text
    policy_json: str | None  # canonical JSON text, or None when absent

    @property
    def fields(self) -> KeyFields:
        return parse_key(self.key)


@dataclass(frozen=True)
class CacheFile:
    metadata: dict[str, Any] | None
    entries: tuple[FileEntry, ...]
    records: dict[str, Any] | None = None
    generation: str | None = None


def canonical_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True, allow_nan=False)


# --------------------------------------------------------------------------
# file_key tokenizer: a tiny recursive-descent reader for tuple reprs.

_TOKEN = re.compile(
    r"""\s*(?:
        (?P<str>'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")
      | (?P<num>-?\d+(?:\.\d+)?(?:e[-+]?\d+)?)
      | (?P<name>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)
      | (?P<punct>[()\[\],])
    )""",
    re.VERBOSE,
)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "0": "\0"}


class _Name(str):
    """A bare identifier in a key (``torch.float16``): text, not a reference."""


def _unquote(literal: str) -> str:
    body = literal[1:-1]
    out: list[str] = []
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == "\\" and i + 1 < len(body):
            nxt = body[i + 1]
            if nxt in _ESCAPES:
                out.append(_ESCAPES[nxt])
                i += 2
                continue
            if nxt == "x" and re.fullmatch(r"[0-9a-fA-F]{2}", body[i + 2 : i + 4]):
                out.append(chr(int(body[i + 2 : i + 4], 16)))
                i += 4
                continue
            if nxt == "u" and re.fullmatch(r"[0-9a-fA-F]{4}", body[i + 2 : i + 6]):
                out.append(chr(int(body[i + 2 : i + 6], 16)))
                i += 6
                continue
        out.append(ch)
        i += 1
    return "".join(out)


def _tokenize(text: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    pos = 0
    end = len(text.rstrip())
    while pos < end:
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"unexpected character {text[pos:pos + 1]!r} at offset {pos}")
        kind = m.lastgroup
        assert kind is not None
        tokens.append((kind, m.group(kind)))
        pos = m.end()
    return tokens


def _parse_value(tokens: list[tuple[str, str]], i: int, depth: int) -> tuple[Any, int]:
    if depth > 32:
        raise ValueError("nesting too deep")
    if i >= len(tokens):
        raise ValueError("unexpected end of key")
    kind, text = tokens[i]
    if kind == "str":
        return _unquote(text), i + 1
    if kind == "num":
        return (float(text) if ("." in text or "e" in text) else int(text)), i + 1
    if kind == "name":
        # A bare name must not be called or subscripted: reject "x(" forms.
        if i + 1 < len(tokens) and tokens[i + 1][1] in ("(", "["):
            raise ValueError(f"call syntax after {text!r} is not a literal")
        return _Name(text), i + 1
    if text in ("(", "["):
        closing = ")" if text == "(" else "]"
        items: list[Any] = []
        i += 1
        while True:
            if i >= len(tokens):
                raise ValueError("unclosed bracket")
            if tokens[i][1] == closing:
                return tuple(items), i + 1
            value, i = _parse_value(tokens, i, depth + 1)
            items.append(value)
            if i < len(tokens) and tokens[i][1] == ",":
                i += 1
            elif i < len(tokens) and tokens[i][1] != closing:
                raise ValueError(f"expected ',' or {closing!r}, got {tokens[i][1]!r}")
    raise ValueError(f"unexpected {text!r}")


def _source_text(value: Any) -> str:
    """Render a parsed literal back (used only for the extras display)."""
    if isinstance(value, _Name):
        return str(value)
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, tuple):
        inner = ", ".join(_source_text(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    return repr(value)


def parse_key(key: str) -> KeyFields:
    """Read op, runner, shapes and extras from a ``file_key`` without eval.

    Raises ``ValueError`` with the reason when the key is not a 4-tuple of
    (str, str, tuple of int tuples, tuple).
    """
    if len(key) > MAX_KEY_CHARS:
        raise ValueError(f"key longer than {MAX_KEY_CHARS} characters")
    tokens = _tokenize(key)
    value, i = _parse_value(tokens, 0, 0)
    if i != len(tokens):
        raise ValueError("trailing text after the key tuple")
    if not isinstance(value, tuple) or len(value) != 4:
        raise ValueError("a key is a 4-tuple (op, runner, shapes, extras)")
    op, runner, shapes, extras = value
    if not isinstance(op, str) or isinstance(op, _Name) or not op:
        raise ValueError("key op must be a non-empty string")
    if not isinstance(runner, str) or isinstance(runner, _Name) or not runner:
        raise ValueError("key runner must be a non-empty string")
    if not isinstance(shapes, tuple) or not all(
        isinstance(s, tuple) and all(isinstance(d, int) for d in s) for s in shapes
    ):
        raise ValueError("key shapes must be a tuple of integer tuples")
    if not isinstance(extras, tuple):
        raise ValueError("key extras must be a tuple")
    return KeyFields(str(op), str(runner), shapes, _source_text(extras))


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
    if not isinstance(value, list) or len(value) not in (2, 3):
        raise ValueError("value must be [runner, tactic] or [runner, tactic, policy]")
    runner, tactic = value[0], value[1]
    if not isinstance(runner, str) or not runner:
        raise ValueError("runner must be a non-empty string")
    _check_tactic(tactic)
    fields = parse_key(key)
    if fields.runner != runner:
        raise ValueError(f"runner {runner!r} differs from the key's {fields.runner!r}")
    policy_json = None
    if len(value) == 3:
        policy = value[2]
        if not isinstance(policy, list):
            raise ValueError("policy must be a list")
        _check_tactic(policy)
        policy_json = canonical_json(policy)
    return FileEntry(key, runner, canonical_json(tactic), policy_json)


def parse_cache_bytes(data: bytes, *, source: str = "<bytes>") -> CacheFile:
    """Parse and validate one FlashInfer cache file's contents."""
    if len(data) > MAX_FILE_BYTES:
        raise CacheFileError(f"{source}: larger than {MAX_FILE_BYTES} bytes; not a cache file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CacheFileError(f"{source}: not UTF-8 text (byte {exc.start}); not a cache file") from None

    def _reject_constant(name: str) -> Any:
        raise ValueError(f"non-standard JSON constant {name}")

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
    generation = None
    for gkey in GENERATION_KEYS:
        g = top.pop(gkey, None)
        if g is not None:
            if not isinstance(g, str):
                raise CacheFileError(f"{source}: {gkey} must be a string")
            generation = g

    entries: list[FileEntry] = []
    problems: list[str] = []
    for key, value in top.items():
        try:
            entries.append(_check_entry(key, value))
        except ValueError as exc:
            problems.append(f"{key[:80]!r}: {exc}")
    if problems:
        raise CacheFileError(
            f"{source}: {len(problems)} of {len(top)} entries invalid, nothing imported; "
            f"first: {problems[0]}"
        )
    return CacheFile(metadata, tuple(entries), records, generation)


def read_cache_file(path: str | os.PathLike[str]) -> CacheFile:
    p = Path(path)
    try:
        if p.stat().st_size > MAX_FILE_BYTES:
            raise CacheFileError(f"{p}: larger than {MAX_FILE_BYTES} bytes; not a cache file")
        data = p.read_bytes()
    except IsADirectoryError:
        raise CacheFileError(f"{p}: is a directory, expected a FlashInfer cache file") from None
    except FileNotFoundError:
        raise CacheFileError(f"{p}: no such file") from None
    except PermissionError:
        raise CacheFileError(f"{p}: permission denied") from None
    except OSError as exc:
        raise CacheFileError(f"{p}: cannot read ({exc.strerror})") from None
    return parse_cache_bytes(data, source=str(p))


def render_cache(
    metadata: Mapping[str, str] | None,
    entries: Iterable[tuple[str, str, str, str | None]],
) -> str:
    """Render ``(key, runner, tactic_json, policy_json)`` rows as a cache file.

    ``_metadata`` comes first, then entries sorted by key, as FlashInfer
    writes them. Stored JSON fragments are spliced in, not re-parsed.
    """
    parts: list[str] = []
    if metadata is not None:
        parts.append(f'"{METADATA_KEY}": {json.dumps(dict(metadata), sort_keys=False)}')
    for key, runner, tactic_json, policy_json in sorted(entries, key=lambda row: row[0]):
        head = f"{json.dumps(key)}: [{json.dumps(runner)}, {tactic_json}"
        parts.append(head + (f", {policy_json}]" if policy_json is not None else "]"))
    if not parts:
        return "{}\n"
    return "{\n" + ",\n".join(parts) + "\n}\n"


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` so readers see the old file or the new one."""
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
