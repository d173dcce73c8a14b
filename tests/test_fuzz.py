"""Fuzzing (hypothesis): the cache-file parser, the bundle reader, the v2-store
reader and the CLI's arguments. Hostile input is data: it is rejected with the
one documented error, or accepted as consistent data; never a traceback,
never executed, and what is rejected changes nothing.

Targets and what every example must satisfy:
- ``flashinfer_format.parse_cache_bytes``: random bytes, mutated valid files,
  and JSON documents with hostile keys and values (code that would run if
  evaluated, dtype reprs, deeply nested tuples and lists, huge integers,
  NaN/Infinity, unicode, lone surrogates): a ``CacheFile`` whose entries'
  keys parse to the fields returned and whose tactics and policies are
  canonical JSON, or ``CacheFileError`` with a one-line message.
- ``bundle.parse_bundle_bytes`` / ``bundle.read_bundle``: a valid bundle
  mutated (bytes, JSON members, header), its payload framed again with a
  correct size and checksum: a ``Bundle`` that renders back to exactly the
  bytes read, or ``BundleError`` (one line).
- ``v2_store.read_store``: a store root whose manifest, entry files and
  layout are fuzzed (built in a fresh directory per example): never an
  error for a store's content (malformed manifests and entries are skipped
  and counted, their counts add up), every entry returned valid;
  ``V2StoreError`` (one line) only for a path that is no store.
- The CLI (click's ``CliRunner``, in-process): argument lists drawn from the
  real commands and options (walked from the click tree) with random and
  curated values, against a small real registry file: exit code 0, 1 or 2;
  no traceback and no "unexpected" error in the output; on exit 1 exactly
  one ``error:`` line on stderr
  (``warning:`` lines aside); the registry
  byte-identical after every read command (dry runs included) and every
  rejected command; the input files never changed.
- Nothing executed: hostile strings that would create a canary file or set a
  canary environment variable if evaluated; after every example neither
  exists.

Each target runs ``FICACHE_FUZZ_EXAMPLES`` examples (default 1000, what CI
runs; raise it for a long run: ``FICACHE_FUZZ_EXAMPLES=20000 pytest
tests/test_fuzz.py``). The CLI target leaves out ``demo`` (it spawns ranks),
``fingerprint`` and the value ``current`` (they import FlashInfer and
torch), valid ``--measurement-policy`` specs (they import FlashInfer too)
and ``--debug`` (it shows tracebacks on purpose).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
import pytest
import reliability_log
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.errors import StopTest, UnsatisfiedAssumption
from samples import H200_METADATA

from ficache.bundle import Bundle, parse_bundle_bytes, read_bundle, render_bundle
from ficache.cli import cli as ficache_cli
from ficache.errors import BundleError, CacheFileError, V2StoreError
from ficache.fingerprint import Fingerprint
from ficache.flashinfer_format import (
    CacheFile,
    canonical_json,
    parse_cache_bytes,
    parse_key,
)
from ficache.registry import NewEntry, Registry
from ficache.v2_store import (
    SCHEMA_KEY,
    entry_file_name,
    env_hash,
    is_environment_dir,
    read_store,
)

EXAMPLES = int(os.environ.get("FICACHE_FUZZ_EXAMPLES", "1000"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)

# -- the canary: what hostile input would do if anything evaluated it ----------------------

CANARY_DIR = Path(tempfile.gettempdir()) / f"ficache-fuzz-canary-{os.getpid()}"
CANARY_FILE = CANARY_DIR / "executed"
CANARY_ENV = "FICACHE_FUZZ_CANARY"
_TOUCH = f"__import__('os').system('touch {CANARY_FILE}')"
_OPEN = f"open({str(CANARY_FILE)!r}, 'w')"
_SETENV = f"__import__('os').environ.__setitem__({CANARY_ENV!r}, '1')"
HUGE_INT = "9" * 5000  # past Python's 4300-digit limit of int(str)
HOSTILE = [
    _TOUCH,
    _OPEN,
    _SETENV,
    f"('op', 'R', ((1,),), ({_TOUCH},))",
    f"('op', 'R', ((1,),), ({_OPEN},))",
    f"('op', 'R', ((1,),), ({_SETENV},))",
    f"('op', 'R', ((1,),), (lambda: {_OPEN})())",
    f"('op', 'R', ((1,),), [x for x in ({_OPEN},)])",
    f"('op', 'R', ((1,),), (exec({_SETENV!r}),))",
    f"eval({_OPEN!r})",
    f"exec({_TOUCH!r})",
    "().__class__.__base__.__subclasses__()",
    "('op', 'R', ((1,),), (torch.__class__.__init__.__globals__,))",
    "('op', 'R', ((1,),), (torch.float8_e4m3fn, torch.bfloat16, None, True, inf, -inf, nan))",
    "torch.float8_e4m3fn",
    f"('op', 'R', (({HUGE_INT},),), ())",
    f"('op', 'R', ((1,),), ({HUGE_INT},))",
    f"('op', 'R', ((1,),), ({'(' * 40}{')' * 40},))",
    "(" * 3000,
    "[" * 3000 + "]" * 3000,
    "('op', 'R', ((1,),), ('\\udcff', '\u202e', '\\x00', '\\N{BULLET}'))",
    "('op', 'R', ((1,),), ('\ud800',))",
    "'; DROP TABLE entries; --",
    "{{7*7}}${jndi:ldap://127.0.0.1/x}",
    f"$(touch {CANARY_FILE})`touch {CANARY_FILE}`",
]


@pytest.fixture(autouse=True)
def canary() -> Iterator[None]:
    CANARY_DIR.mkdir(exist_ok=True)  # so that an executed `touch` or `open` would succeed
    os.environ.pop(CANARY_ENV, None)
    try:
        yield
    finally:
        shutil.rmtree(CANARY_DIR, ignore_errors=True)


def nothing_executed() -> None:
    if _running is not None and (CANARY_FILE.exists() or CANARY_ENV in os.environ):
        _running["canary tripped"] += 1
    assert not CANARY_FILE.exists(), "hostile input was executed (canary file created)"
    assert CANARY_ENV not in os.environ, "hostile input was executed (canary variable set)"


def test_the_canary_sees_hostile_input_that_runs() -> None:
    eval(_OPEN).close()  # what the parsers must never do
    assert CANARY_FILE.exists()
    CANARY_FILE.unlink()
    exec(_SETENV)
    assert os.environ.pop(CANARY_ENV) == "1"
    os.system(f"touch {CANARY_FILE}")  # what the shell in _TOUCH would do
    assert CANARY_FILE.exists()
    CANARY_FILE.unlink()
    nothing_executed()


def note(what: str) -> None:
    """Count ``what`` in hypothesis' statistics (``--hypothesis-show-statistics``) and
    in the running target's tally (its first words, for RELIABILITY.md)."""
    if currently_in_test_context():
        event(what)
    if _running is not None:
        _running[re.split(r"[,:]", what, maxsplit=1)[0]] += 1


# -- the tally of every target, for RELIABILITY.md (tests/reliability_log.py) ------------------

#: Per fuzz test: examples run, examples passed, and what ``note`` counted.
TALLY: dict[str, Counter[str]] = {}
_running: Counter[str] | None = None  # the tally of the example running now


def tallied(test: Callable[..., None]) -> Callable[..., None]:
    """Count the examples of a hypothesis test (under ``@given``) and their outcomes."""
    counts = TALLY.setdefault(test.__name__, Counter())

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        global _running
        counts["examples"] += 1
        _running = counts
        try:
            test(*args, **kwargs)
        except (UnsatisfiedAssumption, StopTest):  # an invalid draw: hypothesis discards it
            counts["examples"] -= 1
            raise
        finally:
            _running = None
        counts["passed"] += 1

    return run


@pytest.fixture(scope="module", autouse=True)
def _record_tallies() -> Iterator[None]:
    yield
    for test, counts in TALLY.items():
        if not counts["examples"]:
            continue
        seen = {
            k: n for k, n in counts.items() if k not in ("examples", "passed", "canary tripped")
        }
        failed = counts["examples"] - counts["passed"]
        reliability_log.record(
            item="4. fuzzing",
            test=f"test_fuzz.py::{test}",
            backend="sqlite" if "cli" in test else "-",
            applied=f"{counts['examples']} hypothesis examples (FICACHE_FUZZ_EXAMPLES={EXAMPLES})",
            outcome=(
                ", ".join(f"{k} {n}" for k, n in sorted(seen.items()))
                + f"; {failed} failed, canary tripped {counts['canary tripped']}"
            ),
            ok=failed == 0 and counts["canary tripped"] == 0,
            figures={
                "examples": counts["examples"],
                "failed": failed,
                "canary_tripped": counts["canary tripped"],
            },
        )


def one_line(exc: BaseException) -> None:
    message = str(exc)
    assert message and "\n" not in message and "\r" not in message, repr(message)


# -- JSON with what json.dumps cannot write: huge integers, deep nesting ----------------------

_RAW = {
    "\x00huge\x00": HUGE_INT,
    "\x00-huge\x00": "-" + HUGE_INT,
    "\x00deep\x00": "[" * 100_000 + "]" * 100_000,
    "\x00deepobj\x00": '{"a":' * 50_000 + "1" + "}" * 50_000,
    "\x00bigexp\x00": "1e99999",
}


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` (NaN and Infinity allowed) with the ``_RAW`` placeholders spliced in."""
    text = json.dumps(value, allow_nan=True, **kwargs)
    for placeholder, raw in _RAW.items():
        text = text.replace(json.dumps(placeholder), raw)
    return text


json_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),  # NaN, Infinity, -Infinity included
    st.text(max_size=8),
    st.sampled_from(HOSTILE + sorted(_RAW)),
)
json_values = st.recursive(
    json_leaves,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=4) | st.sampled_from(HOSTILE[:4]), inner, max_size=3)
    ),
    max_leaves=5,
)
#: Tactics FlashInfer writes: numbers, strings, booleans, nulls and lists of them.
good_tactics = st.recursive(
    st.integers(-1, 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6)
    | st.booleans()
    | st.none(),
    lambda inner: st.lists(inner, max_size=3),
    max_leaves=5,
)
#: Tactics FlashInfer writes (ints, nested lists) and ones it never would.
tactics = st.one_of(
    st.integers(-1, 64),
    st.lists(st.integers(-1, 64) | st.lists(st.integers(0, 9), max_size=2), max_size=3),
    st.integers(1, 40).map(lambda depth: json.loads("[" * depth + "]" * depth)),
    json_values,
)

# -- FlashInfer keys: the common shape, its corners, and hostile text ------------------------


def _tuple_text(items: list[str]) -> str:
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


# Pieces of keys, prebuilt so that a key costs a few draws: shapes and extras
# as FlashInfer writes them, and bent (floats, leading zeros, huge integers,
# lists for tuples, nesting, names, calls).
_SHAPES = [
    "()",
    "((16, 64),)",
    "((16, 64), (64, 8))",
    "((1,), (2, 3), ())",
    "((0, -1),)",
    "((007,),)",
    "((-0,),)",
    "((1.5,),)",
    "((1e3,),)",
    "((True,),)",
    "(('1',),)",
    "((inf,),)",
    f"(({HUGE_INT},),)",
    "((99999999999999999999,),)",
    "((9223372036854775807, -9223372036854775808),)",
    "((1 ,2),)",
    "((1,2),)",
    "([1], [2])",
    "(((1,),),)",
    "(1, 2)",
    "((1, 2)",
    "((1, 2),),)",
]
_EXTRAS = [
    "()",
    "(torch.bfloat16,)",
    "(torch.float8_e4m3fn, 1, 'it\\'s')",
    "(torch.bfloat16, None, True, inf, -inf, nan, 1e999)",
    "('\\udcff', '\\x00', '\\u202e')",
    "([1, (2, 3)], [])",
    "(os.system,)",
    "(__import__('os'),)",
    "(" + "(" * 40 + ")" * 40 + ",)",
    "(" + "(" * 31 + ")" * 31 + ",)",
    "(torch.bfloat16",
    "torch.bfloat16",
    "[torch.bfloat16]",
    f"({HUGE_INT},)",
]
_shapes_text = st.sampled_from(_SHAPES) | st.lists(
    st.integers(min_value=-1, max_value=2**70), max_size=3
).map(lambda dims: _tuple_text([_tuple_text([str(d) for d in dims])]))
_extras_text = st.sampled_from(_EXTRAS) | st.lists(
    st.integers().map(str) | st.text(max_size=6).map(repr), max_size=3
).map(_tuple_text)


_GOOD_SHAPES = _SHAPES[:5]
_GOOD_EXTRAS = _EXTRAS[:6]


@st.composite
def structured_keys(draw: st.DrawFn, valid: bool = False) -> tuple[str, str]:
    """``(key, runner)``: a ``file_key`` in FlashInfer's shape, often bent a little
    (``valid``: never bent, a key FlashInfer could write)."""
    if valid:
        op = draw(st.sampled_from(["flashinfer::mm_fp4", "op", "ö", "a b"]))
        runner = draw(st.sampled_from(["Runner", "CutlassFp4Runner"]))
        shapes = draw(st.sampled_from(_GOOD_SHAPES) | _shapes_text.filter(lambda t: "." not in t))
        extras = draw(st.sampled_from(_GOOD_EXTRAS))
        return _tuple_text([repr(op), repr(runner), shapes, extras]), runner
    op = draw(st.sampled_from(["flashinfer::mm_fp4", "op", "", "a'b", 'a"b', "ö", "x\ny"]))
    runner = draw(st.sampled_from(["Runner", "CutlassFp4Runner", "R'", ""]) | st.text(max_size=4))
    parts = [repr(op), repr(runner), draw(_shapes_text), draw(_extras_text)]
    bend = 19 - draw(st.integers(0, 19))  # mostly unbent: 0 is drawn most
    if bend == 0:
        parts = parts[: draw(st.integers(0, 3))] + parts[4:]
    elif bend == 1:
        parts.append(draw(_extras_text))
    elif bend == 2:
        parts[0], parts[1] = op, runner  # unquoted: bare names
    key = "[" + ", ".join(parts) + "]" if bend == 3 else _tuple_text(parts)
    return key, runner


keys = st.one_of(
    structured_keys().map(lambda kr: kr[0]),
    st.sampled_from(HOSTILE),
    st.text(max_size=40),
    st.text(alphabet="()[]',\" 0123456789-.eE_xtorch", max_size=60),
)
runners = st.sampled_from(["Runner", "CutlassFp4Runner", ""]) | st.text(max_size=6)


@st.composite
def cache_documents(draw: st.DrawFn) -> str:
    """A FlashInfer cache file's text, with hostile members among the valid ones."""
    doc: dict[str, Any] = {}
    metadata = draw(
        st.sampled_from(["valid", "hostile", "absent"]) | st.just("random"),
    )
    if metadata == "valid":
        doc["_metadata"] = dict(H200_METADATA)
    elif metadata == "hostile":
        doc["_metadata"] = {
            **H200_METADATA,
            draw(st.sampled_from(sorted(H200_METADATA))): draw(json_values),
        }
    elif metadata == "random":
        doc["_metadata"] = draw(json_values)
    for member in ("_records", "_generation", "_cache_generation"):
        if draw(st.integers(0, 4)) == 0:
            doc[member] = draw(json_values)
    # A third of the documents hold only entries FlashInfer could write (but for one
    # in four of them, which adds one hostile entry): the accepting path gets fuzzed too.
    valid = draw(st.integers(0, 2)) == 0
    for _ in range(draw(st.integers(0, 4))):
        value: Any
        if valid:
            key, runner = draw(structured_keys(valid=True))
            value = [runner, draw(good_tactics)]
            if draw(st.booleans()):
                value.append(draw(st.lists(good_tactics, max_size=3)))
            doc[key] = value
            continue
        if draw(st.booleans()):
            key, runner = draw(structured_keys())
        else:
            key, runner = draw(keys), draw(runners)
        shape = draw(st.integers(0, 5))
        if shape == 0:
            value = draw(json_values)
        elif shape == 1:
            value = [draw(runners), draw(tactics)]
        else:
            value = [runner, draw(tactics)]
            if shape >= 4:
                value.append(draw(st.just(["cuda_graph", None, "hot"]) | json_values))
        doc[key] = value
    if valid and draw(st.integers(0, 3)) == 3:
        doc[draw(keys)] = [draw(runners), draw(tactics)]
    return dumps(doc, indent=draw(st.sampled_from([None, 2])))


VALID_CACHE = json.dumps(
    {
        "_metadata": H200_METADATA,
        "('mm', 'Runner', ((16, 64),), (torch.bfloat16,))": ["Runner", [1, [2, 3]], ["p", None]],
        "('mm', 'Runner', ((32, 64), (64, 8)), (torch.float8_e4m3fn, 1, 'it\\'s'))": ["Runner", 4],
        "_generation": "abc",
    },
    indent=2,
).encode()

_EDIT = st.tuples(
    st.sampled_from(["flip", "delete", "insert", "truncate", "hostile"]),
    st.integers(min_value=0),
    st.binary(min_size=1, max_size=8),
    st.sampled_from(HOSTILE + ["NaN", "Infinity", "-Infinity", HUGE_INT, "1e999", '"\\ud800"']),
)


def mutate(data: bytes, edits: list[tuple[str, int, bytes, str]]) -> bytes:
    for op, at, chunk, hostile in edits:
        i = at % (len(data) + 1)
        if op == "flip" and i < len(data):
            data = data[:i] + bytes([data[i] ^ (chunk[0] or 1)]) + data[i + 1 :]
        elif op == "delete":
            data = data[:i] + data[i + len(chunk) :]
        elif op == "insert":
            data = data[:i] + chunk + data[i:]
        elif op == "hostile":
            data = data[:i] + hostile.encode("utf-8", "surrogatepass") + data[i:]
        else:
            data = data[:i]
    return data


def check_cache_bytes(data: bytes) -> None:
    try:
        parsed = parse_cache_bytes(data, source="fuzz.json")
    except CacheFileError as exc:
        one_line(exc)
        note("refused")
    else:
        note(f"accepted, {min(len(parsed.entries), 2)}+ entries")
        assert isinstance(parsed, CacheFile)
        for entry in parsed.entries:
            fields = parse_key(entry.key)
            assert fields == entry.fields and fields.runner == entry.runner
            assert canonical_json(json.loads(entry.tactic_json)) == entry.tactic_json
            if entry.policy_json is not None:
                policy = json.loads(entry.policy_json)
                assert isinstance(policy, list) and canonical_json(policy) == entry.policy_json
    nothing_executed()


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=400),
        st.lists(_EDIT, min_size=1, max_size=4).map(lambda edits: mutate(VALID_CACHE, edits)),
        st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
    )
)
@tallied
def test_the_cache_parser_takes_any_bytes(data: bytes) -> None:
    check_cache_bytes(data)


@FUZZ
@given(cache_documents())
@tallied
def test_the_cache_parser_takes_hostile_documents(text: str) -> None:
    check_cache_bytes(text.encode("utf-8", "surrogatepass"))


def test_a_key_with_a_huge_integer_is_skipped_and_counted() -> None:
    """Found by the fuzzer: a shape past Python's 4300-digit int limit escaped as ValueError.
    No FlashInfer writes such a key: it is skipped and counted, the rest of the file read."""
    key = f"('op', 'R', (({HUGE_INT},),), ())"
    cache = parse_cache_bytes(
        json.dumps({key: ["R", 1], "('op', 'R', ((1,),), ())": ["R", 2]}).encode(),
        source="huge.json",
    )
    assert [e.tactic_json for e in cache.entries] == ["2"]
    assert len(cache.unreadable_keys) == 1


# -- bundles --------------------------------------------------------------------------------

FP_H200 = Fingerprint.from_flashinfer_metadata(H200_METADATA)
FP_B200 = Fingerprint.from_flashinfer_metadata({**H200_METADATA, "gpu": "NVIDIA B200"})
VALID_BUNDLE = render_bundle(
    [
        NewEntry(
            FP_H200,
            "('mm', 'Runner', ((16, 64),), (torch.bfloat16,))",
            "Runner",
            "[1,[2,3]]",
            '["p",null]',
            "shared",
            None,
            1.5,
        ),
        NewEntry(
            FP_H200,
            "('mm', 'Runner', ((32, 64),), (torch.float8_e4m3fn, 'it\\'s'))",
            "Runner",
            "4",
            None,
            "tp2/rank1",
            None,
            2.5,
        ),
        NewEntry(FP_B200, "('mm', 'R2', (), ())", "R2", '"x"', None, "shared", None, 3.0),
    ],
    {FP_B200.digest: {"shared": {"trtllm_moe_da": {"k": [1, 2]}}}},
)
_HEADER, _, _PAYLOAD = VALID_BUNDLE.partition(b"\n")


def frame(payload: bytes) -> bytes:
    checksum = hashlib.sha256(payload).hexdigest()
    return b"ficache-bundle 1 %d sha256=%s\n%s" % (len(payload), checksum.encode(), payload)


def layout(top: Any) -> bytes:
    """A payload in the bundle's own layout (one entry per line), whatever ``top`` holds."""

    def one(value: Any) -> str:
        return dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)

    members = ("entries", "fingerprints", "provenance", "records")
    if (
        not isinstance(top, dict)
        or sorted(top) != list(members)
        or not isinstance(top["entries"], list)
    ):
        return (one(top) + "\n").encode()
    entries = top["entries"]
    lines = ['{"entries":[\n']
    lines += [one(e) + (",\n" if i < len(entries) - 1 else "\n") for i, e in enumerate(entries)]
    lines.append(f'],\n"fingerprints":{one(top["fingerprints"])},\n')
    lines.append(f'"provenance":{one(top["provenance"])},\n')
    lines.append(f'"records":{one(top["records"])}}}\n')
    return "".join(lines).encode("utf-8", "surrogatepass")


def _json_paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [path]
    if isinstance(value, dict):
        children: Any = value.items()
    elif isinstance(value, list):
        children = enumerate(value)
    else:
        children = ()
    for k, child in children:
        found += _json_paths(child, (*path, k))
    return found


_VALID_TOP = json.loads(_PAYLOAD)
_PATHS = _json_paths(_VALID_TOP)[1:]
assert layout(_VALID_TOP) == _PAYLOAD  # the layout above is the bundle's own


@st.composite
def edited_payloads(draw: st.DrawFn) -> bytes:
    """The valid payload with one to three members replaced, renamed or removed."""
    top = json.loads(_PAYLOAD)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_PATHS))
        node = top
        try:
            for step in path[:-1]:
                node = node[step]
            if not isinstance(node, dict if isinstance(path[-1], str) else list):
                continue  # an earlier edit replaced the path's parent
            action = draw(st.sampled_from(["replace", "replace", "delete", "rename"]))
            if action == "replace":
                node[path[-1]] = draw(json_values | keys | tactics.map(canonical_or_raw))
            elif action == "delete":
                del node[path[-1]]
            elif isinstance(node, dict):
                node[draw(st.text(max_size=8) | st.sampled_from(HOSTILE))] = node.pop(path[-1])
        except (KeyError, IndexError, TypeError):
            pass  # an earlier edit removed or replaced the path
    return layout(top)


def canonical_or_raw(value: Any) -> Any:
    """A tactic as bundles store it (canonical JSON text), when it can be one."""
    try:
        return canonical_json(value)
    except (ValueError, TypeError):
        return value


def check_bundle_bytes(
    data: bytes, path: Path | None = None, *, wrong_checksum: bool = False
) -> None:
    """``data`` read back as its rendering, or refused with one line; ``wrong_checksum``:
    its header is well formed, of the right size, and names another payload's checksum, so
    the refusal must be the checksum's (a reader that skipped it would parse the payload)."""
    try:
        if path is None:
            bundle = parse_bundle_bytes(data, source="fuzz.bundle")
        else:
            path.write_bytes(data)
            bundle = read_bundle(path)
    except BundleError as exc:
        one_line(exc)
        note("refused: " + re.sub(r"[0-9]+", "N", str(exc).partition(": ")[2])[:28])
        if wrong_checksum:
            assert "damaged bundle (checksum mismatch)" in str(exc), exc
    else:
        assert not wrong_checksum, "a payload that does not match its checksum was read"
        note("accepted")
        assert isinstance(bundle, Bundle)
        assert render_bundle(bundle.entries, bundle.records, bundle.fingerprints) == data
    nothing_executed()


@FUZZ
@given(st.lists(_EDIT, min_size=1, max_size=4), st.integers(0, 3))
@tallied
def test_the_bundle_reader_takes_mutated_payloads_with_a_right_checksum(
    tmp_path: Path, edits: list[tuple[str, int, bytes, str]], how: int
) -> None:
    payload = mutate(_PAYLOAD, edits)
    wrong_checksum = False
    if how == 0:  # the bytes as they are: the checksum no longer matches
        data = mutate(VALID_BUNDLE, edits)
        head, newline, rest = data.partition(b"\n")
        # The header intact over a payload of its size that changed: only the checksum tells.
        wrong_checksum = (head, newline) == (_HEADER, b"\n") and (
            len(rest) == len(_PAYLOAD) and rest != _PAYLOAD
        )
    elif how == 1:  # a damaged header over a right payload
        data = mutate(_HEADER + b"\n", edits) + _PAYLOAD
    else:
        data = frame(payload)
    check_bundle_bytes(
        data, tmp_path / "fuzz.bundle" if how == 3 else None, wrong_checksum=wrong_checksum
    )


@FUZZ
@given(edited_payloads())
@tallied
def test_the_bundle_reader_takes_hostile_members_with_a_right_checksum(payload: bytes) -> None:
    check_bundle_bytes(frame(payload))
    # The same payload under a header of its size naming another payload's checksum.
    head, _, body = frame(payload).partition(b"\n")
    other = hashlib.sha256(payload + b"\n").hexdigest().encode()
    check_bundle_bytes(
        re.sub(rb"sha256=[0-9a-f]{64}", b"sha256=" + other, head) + b"\n" + body,
        wrong_checksum=True,
    )


def test_the_bundle_fuzzers_start_from_a_valid_bundle() -> None:
    check_bundle_bytes(VALID_BUNDLE)
    check_bundle_bytes(frame(layout(json.loads(_PAYLOAD))))
    assert len(parse_bundle_bytes(VALID_BUNDLE).entries) == 3
    # One byte of a valid bundle's payload changed, its size kept: the checksum refuses it.
    flipped = VALID_BUNDLE[:-2] + bytes([VALID_BUNDLE[-2] ^ 1]) + VALID_BUNDLE[-1:]
    check_bundle_bytes(flipped, wrong_checksum=True)


# -- the v2 store ---------------------------------------------------------------------------

MANIFEST = {**H200_METADATA, SCHEMA_KEY: "v2"}


@st.composite
def manifests(draw: st.DrawFn) -> tuple[bytes, str]:
    """``(manifest.json's bytes, its directory's name)``: half of them valid."""
    kind = 9 - draw(st.integers(0, 9))
    if kind >= 5:
        kind = 9 if kind < 8 else 5  # valid, without or with a measurement field
    if kind == 0:
        return draw(st.binary(max_size=200)), draw(
            st.text("0123456789abcdef", min_size=16, max_size=16)
        )
    manifest: Any = dict(MANIFEST)
    if kind == 5:
        manifest[f"measure_{draw(st.sampled_from(['mode', 'cold_l2', 'x']))}"] = draw(
            st.text(max_size=6)
        )
    if kind in (2, 3):
        field = draw(
            st.sampled_from(sorted(MANIFEST)) | st.text(max_size=6) | st.sampled_from(HOSTILE)
        )
        manifest[field] = draw(json_values | st.sampled_from(HOSTILE))
    if kind == 4:
        del manifest[draw(st.sampled_from(sorted(MANIFEST)))]
    if kind == 1:
        manifest = draw(json_values)
    try:
        name = env_hash(manifest) if draw(st.integers(0, 5)) < 5 else "0123456789abcdef"
    except (TypeError, ValueError, AttributeError):
        name = "not-a-hash"
    return dumps(manifest, indent=2, sort_keys=False).encode("utf-8", "surrogatepass"), name


@st.composite
def entry_files(draw: st.DrawFn) -> tuple[str, bytes]:
    """``(file name, bytes)`` of one entry file; a third of them valid."""
    if draw(st.integers(0, 2)) == 0:
        key, runner = draw(structured_keys(valid=True))
        entry: Any = {"key": key, "runner": runner, "tactic": draw(good_tactics)}
        if draw(st.booleans()):
            entry["profiling_policy"] = draw(st.lists(good_tactics, max_size=3))
        text = json.dumps(entry, indent=2, sort_keys=True)
        return entry_file_name(key), text.encode("utf-8", "surrogatepass")
    if draw(st.booleans()):
        key, runner = draw(structured_keys())
    else:
        key, runner = draw(keys), draw(runners)
    kind = draw(st.integers(0, 9))
    entry = {"key": key, "runner": runner, "tactic": draw(tactics)}
    if kind in (1, 2):
        entry["profiling_policy"] = draw(st.just(["cuda_graph", None]) | json_values)
    if kind == 3:
        entry["key_fields"] = draw(json_values)
    if kind == 4:
        entry = draw(json_values)
    if kind == 5:
        entry["key"] = f"('__protocol__', 'trtllm_moe_da', {draw(st.text(max_size=6))!r})"
        key = entry["key"]
    if kind == 6:
        del entry[draw(st.sampled_from(["key", "runner", "tactic"]))]
    try:
        name = entry_file_name(key) if draw(st.integers(0, 4)) < 4 else "0" * 24 + ".json"
    except UnicodeEncodeError:  # a lone surrogate: no file name FlashInfer would write
        name = "surrogate.json"
    if kind == 7:
        return name, draw(st.binary(max_size=200))
    return name, dumps(entry, indent=2, sort_keys=True).encode("utf-8", "surrogatepass")


@st.composite
def stores(draw: st.DrawFn) -> list[tuple[str, bytes | None, list[tuple[str, bytes | None]]]]:
    """Environments: ``(directory name, manifest bytes or None, entry files)``; a None
    entry file is a directory of that name, a None manifest none at all."""
    envs = []
    for _ in range(draw(st.integers(1, 2))):
        manifest, name = draw(manifests())
        if draw(st.integers(0, 9)) == 9:
            manifest = None  # type: ignore[assignment]
        files: list[tuple[str, bytes | None]] = draw(st.lists(entry_files(), max_size=3))
        if draw(st.integers(0, 9)) == 9:
            files.append((draw(st.sampled_from(["dir.json", "x.txt"])), None))
        envs.append((name, manifest, files))
    return envs


def _count_json(entries: Path) -> int:
    return len(list(entries.glob("*.json"))) if entries.is_dir() else 0


@FUZZ
@given(stores(), st.integers(0, 9))
@tallied
def test_the_v2_store_reader_skips_and_counts_whatever_a_store_holds(
    tmp_path: Path,
    envs: list[tuple[str, bytes | None, list[tuple[str, bytes | None]]]],
    layout_kind: int,
) -> None:
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    try:
        for name, manifest, files in envs:
            env = root / "v2" / name
            env.mkdir(parents=True, exist_ok=True)
            if manifest is not None:
                (env / "manifest.json").write_bytes(manifest)
            if layout_kind == 9:
                (env / "entries").write_bytes(b"not a directory")
                continue
            (env / "entries").mkdir(exist_ok=True)
            for file_name, data in files:
                path = env / "entries" / file_name
                if data is None:
                    path.mkdir(exist_ok=True)
                else:
                    path.write_bytes(data)
        if layout_kind == 8:
            (root / "v2" / "stray-file").write_bytes(b"{}")

        store = read_store(root)
        note(
            f"{store.entries and 'some' or 'no'} entries read, {store.skipped_entries and 'some' or 'none'} skipped, {len(store.skipped_environments)} environments skipped"
        )
        env_dirs = [p for p in (root / "v2").iterdir() if p.is_dir()]
        assert len(store.environments) + len(store.skipped_environments) == len(env_dirs)
        for env in store.environments:
            assert len(env.entries) + env.records + env.skipped == _count_json(env.path / "entries")
            assert len(env.first_skipped) == min(env.skipped, 20)
            for entry in env.entries:
                fields = parse_key(entry.key)
                assert fields.runner == entry.runner == entry.fields.runner
                assert canonical_json(json.loads(entry.tactic_json)) == entry.tactic_json
        for env_dir in env_dirs:  # one environment directory given alone
            if is_environment_dir(env_dir):
                alone = read_store(env_dir)
                assert len(alone.environments) + len(alone.skipped_environments) == 1
        for not_a_store in (root / "v2", root / "nothing-here"):
            if not_a_store.is_dir() and is_environment_dir(not_a_store):
                continue
            with pytest.raises(V2StoreError) as caught:
                read_store(not_a_store)
            one_line(caught.value)
        nothing_executed()
    finally:
        shutil.rmtree(root)


# -- the CLI ----------------------------------------------------------------------------------

#: Commands left out (see the module docstring).
SKIPPED_COMMANDS = {("demo",), ("fingerprint",)}
#: Commands that may change the registry when they succeed (and are not a dry run).
WRITE_COMMANDS = {
    ("import",),
    ("merge",),
    ("prune",),
    ("revert",),
    ("fold",),
    ("db", "upgrade"),
    ("db", "downgrade"),
}


def _commands(
    group: click.Group, path: tuple[str, ...] = ()
) -> dict[tuple[str, ...], click.Command]:
    found: dict[tuple[str, ...], click.Command] = {}
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            found.update(_commands(command, (*path, name)))
        elif (*path, name) not in SKIPPED_COMMANDS:
            found[(*path, name)] = command
    return found


COMMANDS = _commands(ficache_cli)
#: Text a user could type: any characters but NUL (argv cannot hold it), path
#: separators (random text must not name a path outside the scratch directory) and
#: newlines (messages quote paths as they are: one with a newline spans two lines).
_typed = st.text(
    st.characters(blacklist_characters="\x00/\n", blacklist_categories=("Cs",)), max_size=12
)
#: Bytes that are not UTF-8 reach Python's argv as lone surrogates (surrogateescape).
_undecodable = st.binary(min_size=1, max_size=6).map(
    lambda b: bytes(c for c in b if c not in b"\0/\n").decode("utf-8", "surrogateescape")
)


class CliWorld(dict):  # type: ignore[type-arg]
    """What the CLI fuzzer works on (a dict with a short repr for hypothesis' reports)."""

    def __repr__(self) -> str:
        return f"CliWorld(registry={self['registry']})"


@pytest.fixture
def cli_world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliWorld:
    """A small real registry, input files of every kind, and a scratch working directory."""
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    key = "('flashinfer::mm', 'Runner', (({m}, 64),), (torch.bfloat16,))"
    h200 = {key.format(m=m): ["Runner", [m, [1]]] for m in (1, 2, 4, 8)}
    b200_meta = {**H200_METADATA, "gpu": "NVIDIA B200"}
    files = {
        "good": ("good.json", json.dumps({"_metadata": H200_METADATA, **h200})),
        "b200": ("b200.json", json.dumps({"_metadata": b200_meta, key.format(m=1): ["Runner", 3]})),
        "nometa": ("nometa.json", json.dumps({key.format(m=16): ["Runner", 1]})),
        "hostile": ("hostile.json", dumps({k: ["R", 1] for k in HOSTILE[:6]})),
        "truncated": ("truncated.json", json.dumps({"_metadata": H200_METADATA, **h200})[:90]),
        "text": ("notes.txt", "not a cache file\n"),
    }
    paths = {}
    for name, (file_name, content) in files.items():
        paths[name] = inputs / file_name
        paths[name].write_text(content, encoding="utf-8", errors="surrogatepass")
    paths["bundle"] = inputs / "good.bundle"
    paths["bundle"].write_bytes(VALID_BUNDLE)
    paths["damaged_bundle"] = inputs / "damaged.bundle"
    paths["damaged_bundle"].write_bytes(VALID_BUNDLE[:-20])
    env = inputs / "store" / "v2" / env_hash(MANIFEST)
    (env / "entries").mkdir(parents=True)
    (env / "manifest.json").write_text(json.dumps(MANIFEST, indent=2, sort_keys=True))
    store_key = key.format(m=32)
    (env / "entries" / entry_file_name(store_key)).write_text(
        json.dumps({"key": store_key, "runner": "Runner", "tactic": 2})
    )
    paths["store"] = inputs / "store"
    paths["empty_dir"] = inputs / "empty"
    paths["empty_dir"].mkdir()

    registry = tmp_path / "registry.db"
    with Registry.open(str(registry)) as reg:
        reg.import_cache([(str(paths["good"]), parse_cache_bytes(paths["good"].read_bytes()))])
        reg.import_cache([(str(paths["b200"]), parse_cache_bytes(paths["b200"].read_bytes()))])
        reg.import_cache(
            [
                (
                    "rank1.json",
                    parse_cache_bytes(json.dumps({key.format(m=1): ["Runner", 9]}).encode()),
                )
            ],
            fingerprint=FP_H200,
            scope="tp2/rank1",
        )
        reg.plan_prune(fingerprint_ids=[2]).execute(reg)
    paths["other_registry"] = inputs / "other.db"
    shutil.copyfile(registry, paths["other_registry"])
    assert not Path(f"{registry}-wal").exists()

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.chdir(scratch)
    for name in (
        "HOME",
        "VLLM_CACHE_ROOT",
        "FLASHINFER_AUTOTUNE_CACHE_DIR",
        "FLASHINFER_WORKSPACE_BASE",
    ):
        monkeypatch.setenv(name, str(scratch))
    monkeypatch.delenv("VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR", raising=False)
    return CliWorld(
        registry=registry,
        pristine=registry.read_bytes(),
        inputs=inputs,
        paths=paths,
        scratch=scratch,
        user_cache=tmp_path / "user-cache",
    )


def _input_hashes(inputs: Path) -> dict[str, str]:
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(inputs.rglob("*"))
        if p.is_file()
    }


def _values(world: CliWorld) -> dict[str, st.SearchStrategy[str]]:
    """Values for each parameter name of the CLI: curated ones, hostile ones, typed text."""
    paths = {k: str(v) for k, v in world["paths"].items()}
    registry = str(world["registry"])
    typeable = [
        s for s in HOSTILE if "/" not in s and not any("\ud800" <= c <= "\udfff" for c in s)
    ]
    typeable.append("$(touch canary)`touch canary`")  # a shell would create scratch/canary
    noise = st.one_of(_typed, _undecodable, st.sampled_from(typeable))
    inputs = st.sampled_from(sorted(paths.values()) + [registry, "missing.json", "."])
    outputs = st.sampled_from(["out.json", "out.bundle", "store-out", "sub/x.json", ".", "", "-"])
    ids = st.sampled_from(
        [
            "1",
            "2",
            "3",
            "0",
            "-1",
            "99",
            "99999999999999999999999",
            "abc",
            FP_H200.digest[:8],
            FP_H200.digest,
            "ffffff",
        ]
    )
    ages = st.sampled_from(["30d", "0s", "1.5h", "2w", "-1d", "1e400d", "12x", "", " 3 m "])
    scopes = st.sampled_from(
        ["shared", "tp2/rank1", "tp2/rank", "/rank1", "tp2/rank-1", "x" * 50 + "/rank1"]
    )
    counts = st.sampled_from(
        ["1", "2", "3", "4", "1", "2", "0", "-3", "10", "99999999999999999999"]
    )
    by_name: dict[str, st.SearchStrategy[str]] = {
        "db": st.sampled_from(
            [registry] * 14
            + [
                "missing.db",
                paths["good"],
                paths["empty_dir"],
                f"sqlite:///{registry}",
                "postgresql+psycopg://u@127.0.0.1:1/x",
                "nosuchdialect://x",
                "sqlite:///:memory:",
            ]
        ),
        "files": inputs,
        "sources": inputs,
        "from_vllm": st.sampled_from(["", ".", paths["store"], paths["empty_dir"], "missing"]),
        "layout": st.sampled_from(["tp2-pp1-dp1-ep1", "a/b", "", "x" * 41]),
        "fingerprint_ref": ids,
        "fingerprint_refs": ids,
        "scope": scopes,
        "output": outputs,
        "bundle_path": outputs,
        "v2_root": outputs | st.sampled_from([paths["store"], paths["empty_dir"]]),
        "measurement_spec": st.sampled_from(
            ["default", "", "cold_l2=maybe", "nope=1", "timer", "=x"]
        ),
        "op": st.sampled_from(["flashinfer::mm", "op"]),
        "gpu": st.sampled_from(["NVIDIA H200", "NVIDIA B200"]),
        "flashinfer_version": st.sampled_from([H200_METADATA["flashinfer_version"], "0.1"]),
        "versions": st.sampled_from([H200_METADATA["flashinfer_version"], "0.1"]),
        "limit": counts,
        "commit_id": counts,
        "older_than": ages,
        "unused_for": ages,
        "revision": st.sampled_from(
            ["head", "base", "heads", "0001_registry", "0002_fleet", "-1", "+1"]
        ),
    }
    # Mostly curated values (deeper paths), a quarter typed or hostile noise.
    return {name: st.one_of(s, s, s, noise) for name, s in by_name.items()} | {"noise": noise}


@st.composite
def argvs(
    draw: st.DrawFn, values: dict[str, st.SearchStrategy[str]]
) -> tuple[tuple[str, ...], list[str]]:
    """``(command path, argv)``."""
    path = draw(st.sampled_from(sorted(COMMANDS)))
    command = COMMANDS[path]
    argv: list[str] = []
    if draw(st.integers(0, 9)) < 9:
        argv += ["--db", draw(values["db"])]
    if draw(st.integers(0, 29)) == 29:
        argv.append(draw(st.sampled_from(["--version", "-h", "--help", "--nope"])))
    argv += path
    options = [p for p in command.params if isinstance(p, click.Option) and p.name != "help"]
    for option in draw(st.lists(st.sampled_from(options), max_size=3)) if options else []:
        argv.append(draw(st.sampled_from(option.opts + option.secondary_opts)))
        if not option.is_flag and not (option.flag_value == "" and draw(st.booleans())):
            if isinstance(option.type, click.Choice):  # its own choices, or noise
                value = st.sampled_from([str(c) for c in option.type.choices])
                argv.append(draw(st.one_of(value, value, value, values["noise"])))
            else:
                argv.append(draw(values.get(option.name or "", _typed)))
    for argument in (p for p in command.params if isinstance(p, click.Argument)):
        if draw(st.integers(0, 9)) == 9:
            continue  # missing
        count = 1 if argument.nargs == 1 else draw(st.integers(1, 3))
        argv += [draw(values.get(argument.name or "", _typed)) for _ in range(count)]
    if draw(st.integers(0, 9)) == 9:  # a stray word or option anywhere
        stray = draw(st.sampled_from(["--nope", "-x", "--", "extra", "--help"]) | _typed)
        argv.insert(draw(st.integers(0, len(argv))), stray)
    return path, argv


@FUZZ
@given(data=st.data())
@tallied
def test_the_cli_takes_random_arguments(cli_world: CliWorld, data: st.DataObject) -> None:
    world = cli_world
    registry: Path = world["registry"]
    values = _values(world)
    runner = CliRunner()
    inputs_before = _input_hashes(world["inputs"])
    command, argv = data.draw(argvs(values), label="argv")
    result = runner.invoke(ficache_cli, argv, catch_exceptions=True, prog_name="ficache")
    try:
        output = result.stdout + result.stderr
        note(f"exit {result.exit_code}")
        event(f"{' '.join(command)}: exit {result.exit_code}")
        assert result.exception is None or isinstance(result.exception, SystemExit), repr(
            result.exception
        )
        assert result.exit_code in (0, 1, 2), (result.exit_code, output)
        assert "Traceback" not in output, output
        # The CLI's last line of defence ("error: unexpected ...") is never reached.
        assert "error: unexpected " not in result.stderr, (argv, result.stderr)
        if result.exit_code == 1:
            lines = result.stderr.removesuffix("\n").split("\n")
            errors = [line for line in lines if line.startswith("error: ")]
            assert len(errors) == 1 and all(
                line.startswith(("error: ", "warning: ", "note: ")) for line in lines
            ), result.stderr
            for line in lines:  # a failed command leaves no registry it created
                created = line.removeprefix("note: creating a new registry at ")
                assert created == line or not Path(created).exists(), result.stderr
        dry_run = "dry run: nothing changed" in result.stdout or '"dry_run": true' in result.stdout
        may_change = result.exit_code == 0 and command in WRITE_COMMANDS and not dry_run
        if not may_change:
            assert registry.read_bytes() == world["pristine"], (argv, result.exit_code, output)
        assert not Path(f"{registry}-wal").exists() or Path(f"{registry}-wal").stat().st_size == 0
        assert not (world["scratch"] / "canary").exists(), "an argument ran in a shell"
        nothing_executed()
    finally:
        registry.write_bytes(world["pristine"])
        for suffix in ("-wal", "-shm", "-journal"):
            Path(f"{registry}{suffix}").unlink(missing_ok=True)
        shutil.rmtree(world["user_cache"], ignore_errors=True)
        for path in world["scratch"].iterdir():  # emptied, not removed: it is the cwd
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    assert _input_hashes(world["inputs"]) == inputs_before


NO_USER = "~no-such-user-ficache"
TOO_BIG = "99999999999999999999"  # past SQLite's 64-bit integers
RANGE = "is not in the range 1<=x<=9223372036854775807."


@pytest.mark.parametrize(
    ("argv", "code", "stderr"),
    [
        # Optional since ``revert --to N``: click names it in brackets.
        (["revert", TOO_BIG], 2, f"Error: Invalid value for '[COMMIT_ID]': {TOO_BIG} {RANGE}"),
        (["show", TOO_BIG], 2, f"Error: Invalid value for 'COMMIT_ID': {TOO_BIG} {RANGE}"),
        (["list", "--limit", TOO_BIG], 2, f"Error: Invalid value for '--limit': {TOO_BIG} {RANGE}"),
        (
            ["list", "--fingerprint", TOO_BIG],
            1,
            f"error: no fingerprint '{TOO_BIG}' in the registry; see `ficache fingerprints`\n",
        ),
        (
            ["export", "--fingerprint", "²"],
            1,
            "error: no fingerprint '²' in the registry; see `ficache fingerprints`\n",
        ),
        (
            ["--db", f"{NO_USER}/r.db", "stats"],
            1,
            f"error: cannot use registry path '{NO_USER}/r.db' (Could not determine home "
            "directory.); give another --db\n",
        ),
        (
            ["import", "--from-vllm", NO_USER],
            1,
            f"error: cannot find the home directory in '{NO_USER}'; give vLLM's cache root "
            "(VLLM_CACHE_ROOT, default ~/.cache/vllm) or its VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR\n",
        ),
        (
            ["--db", "r\udcff.db", "stats"],
            1,
            "error: registry path 'r\\udcff.db' is not valid UTF-8, which SQLite needs; "
            "rename the file or give another --db\n",
        ),
        (
            ["list", "--op", "x\udcff"],
            1,
            "error: argument 'x\\udcff' is not valid UTF-8, and ficache stores names, keys "
            "and paths as UTF-8; pass it in UTF-8\n",
        ),
        (
            ["--db", "a" * 300, "stats"],
            1,
            f"error: cannot use registry path '{'a' * 300}': File name too long; "
            "give another --db\n",
        ),
    ],
)
def test_arguments_the_fuzzer_found(
    cli_world: CliWorld, argv: list[str], code: int, stderr: str
) -> None:
    """Each was an "unexpected" error before (OverflowError, ValueError, RuntimeError,
    UnicodeEncodeError, OSError)."""
    registry = cli_world["registry"]
    if argv[0] != "--db":
        argv = ["--db", str(registry), *argv]
    result = CliRunner().invoke(ficache_cli, argv, prog_name="ficache")
    assert result.exit_code == code
    assert result.stderr == stderr if code == 1 else stderr in result.stderr
    assert result.stdout == ""
    assert registry.read_bytes() == cli_world["pristine"]


@pytest.mark.postgres  # runs where the driver is installed (tox -e test); needs no server
def test_db_current_on_a_server_that_cannot_be_reached_is_one_line(cli_world: CliWorld) -> None:
    url = "postgresql+psycopg://u@127.0.0.1:1/x"  # port 1: refused at once
    for argv in (["db", "current"], ["db", "downgrade", "base", "--yes"]):
        result = CliRunner().invoke(ficache_cli, ["--db", url, *argv], prog_name="ficache")
        assert (result.exit_code, result.stdout) == (1, "")
        assert result.stderr == (
            f'error: cannot reach registry {url} (connection to server at "127.0.0.1", port 1 '
            "failed: Connection refused): the connection was refused; check that the server "
            "runs and the URL is right\n"
        )


def test_the_cli_fuzzer_reaches_every_command() -> None:
    assert {p[0] for p in COMMANDS} >= {
        "import",
        "export",
        "list",
        "stats",
        "log",
        "show",
        "merge",
        "prune",
        "revert",
        "verify",
        "fingerprints",
        "fold",
        "db",
    }
    assert all(c.params is not None for c in COMMANDS.values())
