"""FlashInfer cache files: the key tokenizer, strict parsing, exact rendering."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from samples import H200_METADATA

from ficache.errors import CacheFileError
from ficache.flashinfer_format import (
    KeyFields,
    _check_entry,
    _common_key,
    _parse_key_general,
    _read_entries,
    canonical_json,
    parse_cache_bytes,
    parse_key,
    read_cache_file,
    render_cache,
    write_atomic,
)

POLICY = ["cuda_graph_profile_replays", None, "l2_cache_policy", "hot"]
KEY = str(
    ("flashinfer::mm_fp4", "CutlassFp4Runner", ((16, 4096), (4096, 2048)), (torch.bfloat16, 1))
)
KEY2 = str(
    ("flashinfer::mm_fp4", "CutlassFp4Runner", ((32, 4096), (4096, 2048)), (torch.bfloat16, 1))
)
METADATA = H200_METADATA


def _file(obj: object) -> bytes:
    return json.dumps(obj).encode()


# -- parse_key -----------------------------------------------------------------

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
]
scalars = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.text(max_size=12),
    st.booleans(),
    st.none(),
    st.floats(),  # includes inf, -inf and nan, whose reprs are bare names
    st.sampled_from(DTYPES),
)
extras_items = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3).map(tuple), max_leaves=6
)
keys = st.tuples(
    st.text(min_size=1, max_size=24),
    st.text(min_size=1, max_size=24),
    st.lists(
        st.lists(st.integers(min_value=-1, max_value=2**40), max_size=4).map(tuple), max_size=4
    ).map(tuple),
    st.lists(extras_items, max_size=5).map(tuple),
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(keys)
@example(("flashinfer::op", "Runner", (), ()))
@example(("op", "R", ((1,),), (torch.float8_e4m3fn,)))
@example(("op", "R", ((1, 2),), (float("-inf"), float("inf"), float("nan"), -0.0, 1e-05)))
@example(("it's", 'say "hi"', ((0,),), ("\\", "\n\t\x00\x7f", "\U000e0001", "é")))
@example(("op", "R", ((16, 4096),), ((torch.bfloat16, (1, None)), True, "x")))
def test_parse_key_reads_what_flashinfer_writes(parts: tuple) -> None:
    op, runner, shapes, extras = parts
    key = str((op, runner, shapes, extras))  # exactly ProfilingCacheKey.file_key

    fields = parse_key(key)

    assert fields == KeyFields(op, runner, shapes, str(extras))


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(keys)
@example(("flashinfer::mm", "MmRunner", ((16, 64), (64, 32)), (torch.bfloat16, 3)))
@example(("op", "R", (), ()))
def test_the_common_key_fast_path_agrees_with_the_general_parser(parts: tuple) -> None:
    key = str(parts)
    fast = _common_key(key)
    if fast is not None:  # None: the key falls through to the general parser
        general = _parse_key_general(key)
        assert fast == general
        assert fast.shapes_json == general.shapes_json  # read from the key's text


@pytest.mark.parametrize(
    "written",
    [
        "('op', 'R', ((16, 4096,),), (1,))",  # a comma after the last of several
        "('op', 'R', ((16,4096),), (1,))",  # no space
        "('op', 'R', ( (16, 4096), ), (1,))",  # spaces inside the brackets
    ],
)
def test_shapes_not_written_as_repr_writes_them_take_the_general_path(written: str) -> None:
    assert _common_key(written) is None
    fields = parse_key(written)
    assert fields == parse_key("('op', 'R', ((16, 4096),), (1,))")  # one text per value
    assert (fields.shapes_text, fields.shapes_json) == ("((16, 4096),)", "[[16, 4096]]")


def test_parse_key_of_a_real_profiling_cache_key() -> None:
    from flashinfer.autotuner import ProfilingCacheKey

    cache_key = ProfilingCacheKey(
        "flashinfer::trtllm_fp8_block_scale_moe",
        "TrtllmGenMoERunner",
        1234,
        ((8, 7168), (256, 7168)),
        (torch.float8_e4m3fn, 256, 8, None, 2.5),
    )

    fields = parse_key(cache_key.file_key)

    assert fields.op == "flashinfer::trtllm_fp8_block_scale_moe"
    assert fields.runner == "TrtllmGenMoERunner"
    assert fields.shapes == ((8, 7168), (256, 7168))
    assert fields.extras == "(torch.float8_e4m3fn, 256, 8, None, 2.5)"
    assert fields.shapes_json == "[[8, 7168], [256, 7168]]"


json_values = st.recursive(
    st.one_of(
        st.integers(min_value=-(2**70), max_value=2**70),
        st.booleans(),
        st.none(),
        st.text(alphabet='ab{}[]"\\é\n', max_size=6),
        st.floats(),  # inf and nan too: json.loads makes inf of 1e999
    ),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=2)
    ),
    max_leaves=12,
)
entry_values = st.one_of(
    st.tuples(st.sampled_from(["CutlassFp4Runner", "Other", ""]), json_values).map(list),
    st.tuples(st.just("CutlassFp4Runner"), json_values, json_values).map(list),
    st.tuples(st.just("CutlassFp4Runner"), json_values, st.just(POLICY)).map(list),
    # FlashInfer 0.7.4: a selection (any JSON here) after the policy
    st.tuples(st.just("CutlassFp4Runner"), json_values, st.just(POLICY), json_values).map(list),
    json_values,
)
entry_keys = st.one_of(
    st.just(KEY),
    st.just(KEY.replace("(16, 4096)", "(016, 4096)")),
    st.just(KEY.replace("(16, 4096)", "(-0, 4096)")),
    keys.map(str),
    st.text(max_size=30),
)


def _nested(depth: int) -> list:
    value: list = [1]
    for _ in range(depth):
        value = [value]
    return value


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(entry_keys, entry_values), max_size=6))
@example([(KEY, ["CutlassFp4Runner", _nested(7)]), (KEY2, ["CutlassFp4Runner", _nested(8)])])
@example([(KEY, ["CutlassFp4Runner", 1, _nested(7)]), (KEY2, ["CutlassFp4Runner", 1, _nested(8)])])
@example([(KEY, ["CutlassFp4Runner", ["[[[[[[[[["]]), (KEY2, ["CutlassFp4Runner", ["{"]])])
@example([(KEY, ["CutlassFp4Runner", [float("inf")]]), (KEY2, ["CutlassFp4Runner", 1, [1e300]])])
def test_the_fast_entry_path_decides_as_check_entry(items: list) -> None:
    top = dict(items)
    expected, problems, ignored = [], [], 0
    for key, value in top.items():
        try:
            expected.append(_check_entry(key, value))
        except ValueError as exc:
            problems.append(f"{key[:80]!r}: {exc}")
        else:
            ignored += len(value) == 4 and not isinstance(value[3], dict)

    entries, fast_problems, fast_ignored = _read_entries(top)

    assert (entries, fast_problems, fast_ignored) == (expected, problems, ignored)
    assert [e.fields.shapes_json for e in entries] == [e.fields.shapes_json for e in expected]


@settings(max_examples=300)
@given(st.text(max_size=200))
def test_parse_key_raises_only_value_error_on_any_text(text: str) -> None:
    with contextlib.suppress(ValueError):
        parse_key(text)


key_alphabet = st.sampled_from(
    list("()[],'\" \\-.0123456789eEabxuU_") + ["torch.bfloat16", "None", "'op'"]
)


@settings(max_examples=300)
@given(st.lists(key_alphabet, max_size=60).map("".join))
def test_parse_key_raises_only_value_error_on_key_like_text(text: str) -> None:
    try:
        fields = parse_key(text)
    except ValueError:
        return
    assert isinstance(fields, KeyFields)


@pytest.mark.parametrize(
    "extras",
    [
        "(__import__('os').system('touch PWNED'),)",
        "(torch.bfloat16.__class__('x'),)",
        "(x[0],)",
        "(lambda: 0,)",
        "(1 + 1,)",
        "(f'{x}',)",
        "(device(type='cuda', index=0), torch.bfloat16)",
        "(<ActivationType.Swiglu: 3>,)",
    ],
)
def test_extras_that_are_no_literal_are_kept_as_text_never_run(
    extras: str, tmp_path: Path, monkeypatch
) -> None:
    """FlashInfer's v2 ``lookup`` serves such a key by its text, and ``load_configs``
    keeps it: ficache reads op, runner and shapes, and keeps the extras verbatim."""
    monkeypatch.chdir(tmp_path)
    key = f"('op', 'R', ((1,),), {extras})"

    fields = parse_key(key)

    assert fields == KeyFields("op", "R", ((1,),), extras)
    assert not (tmp_path / "PWNED").exists()


def test_a_three_element_key_of_flashinfer_0_6_12_is_read() -> None:
    """0.6.7-0.6.12's ``save_configs`` wrote ``str((op, runner, profile))`` (FlashInfer's
    tests keep one as ``_OLD_KEY``); its extras are empty text, which no 4-element key has."""
    fields = parse_key("('old_op', 'FakeRunnerA', ((1, 1),))")

    assert fields == KeyFields("old_op", "FakeRunnerA", ((1, 1),), "")
    assert (fields.shapes_json, fields.extras) == ("[[1, 1]]", "")
    assert parse_key("('op', 'R', ((1, 1),), ())").extras == "()"


@pytest.mark.parametrize(
    "key",
    [
        "__import__('os').system('touch PWNED')",
        "('op', 'R', ((1,),), ()) or print(1)",
        "('op', 'R', ((1,),), ()) or print((1))",
        "('op', 'R', ((1,),), (x(), 'unclosed)",
        "(__import__('os'), 'R', ((1,),), ())",
        "('op', 'R', ((1,),), ()); import os",
        "('op', 'R', ((1.5,),), ())",
        "('op', 'R', ((True,),), ())",
        "(op, 'R', ((1,),), ())",
        "('op', 'R', ((1,),), torch.bfloat16)",
        "('', 'R', ((1,),), ())",
        "('op', 'R')",
        "('op', 'R', ((1,),), (), ())",
        "('op', 'R', ((1,),), (1,)",
        "('op' 'R', ((1,),), ())",
        "",
        "(" * 100 + ")" * 100,
    ],
)
def test_parse_key_rejects_code_and_malformed_keys(key: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)

    with pytest.raises(ValueError):
        parse_key(key)

    assert not (tmp_path / "PWNED").exists()


def test_parse_key_refuses_a_huge_key() -> None:
    with pytest.raises(ValueError, match="longer than"):
        parse_key(str(("op", "R", (), ("x" * 20_000,))))


# -- parse_cache_bytes ------------------------------------------------------------


def test_parses_a_file_as_flashinfer_writes_it() -> None:
    data = _file(
        {
            "_metadata": METADATA,
            KEY: ["CutlassFp4Runner", [3, [1, 2]], POLICY],
            KEY2: ["CutlassFp4Runner", -1],
            "_generation": "ab" * 32,
        }
    )

    cache = parse_cache_bytes(data)

    assert cache.metadata == METADATA
    assert cache.generation == "ab" * 32
    assert cache.records is None
    assert [(e.key, e.runner, e.tactic_json, e.policy_json) for e in cache.entries] == [
        (KEY, "CutlassFp4Runner", "[3,[1,2]]", canonical_json(POLICY)),
        (KEY2, "CutlassFp4Runner", "-1", None),
    ]
    assert cache.entries[0].fields == parse_key(KEY)


def test_accepts_cache_generation_records_and_no_metadata() -> None:
    cache = parse_cache_bytes(
        _file(
            {
                "_cache_generation": "cd" * 32,
                "_records": {"vllm": {"x": 1}},
                KEY: ["CutlassFp4Runner", 0],
            }
        )
    )

    assert cache.metadata is None
    assert cache.generation == "cd" * 32
    assert cache.records == {"vllm": {"x": 1}}
    assert len(cache.entries) == 1


def test_an_empty_object_is_an_empty_cache() -> None:
    assert parse_cache_bytes(b"{}").entries == ()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b'{"_metadata": {"gpu": "H200"}, "x": [', "invalid JSON"),
        (b"{'a': 1}", "invalid JSON"),
        (b'{"a": NaN}', "invalid JSON"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b"[1, 2]", "top level is a JSON list"),
        (b'"text"', "top level is a JSON str"),
        (_file({"_metadata": [1]}), "_metadata must be an object"),
        (_file({"_records": 3}), "_records must be an object"),
        (_file({"_generation": 3}), "_generation must be a string"),
        (_file({KEY: "CutlassFp4Runner"}), "value must be [runner, tactic]"),
        (_file({KEY: ["CutlassFp4Runner"]}), "value must be [runner, tactic]"),
        (_file({KEY: ["CutlassFp4Runner", 1, POLICY, {}, 4]}), "value must be [runner, tactic]"),
        (_file({KEY: ["CutlassFp4Runner", {"tile": 1}]}), "tactic holds a dict"),
        (_file({KEY: [7, 1]}), "runner must be a non-empty string"),
        (_file({KEY: ["OtherRunner", 1]}), "differs from the key's"),
        (_file({KEY: ["CutlassFp4Runner", 1, "hot"]}), "policy must be a list"),
        (_file({KEY: ["CutlassFp4Runner", [[[[[[[[[[1]]]]]]]]]]]}), "nested too deeply"),
        (b"[" * 100_000 + b"]" * 100_000, "invalid JSON"),
    ],
)
def test_rejects_bad_files_with_one_clear_error(
    data: bytes, message: str, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)

    with pytest.raises(CacheFileError) as info:
        parse_cache_bytes(data, source="c.json")

    text = str(info.value)
    assert text.startswith("c.json: ")
    assert message in text
    assert "\n" not in text
    assert not (tmp_path / "PWNED").exists()


def test_one_bad_entry_rejects_the_whole_file_with_a_count() -> None:
    data = _file({KEY: ["CutlassFp4Runner", 1], KEY2: ["Wrong", 1], "junk": ["R", {}]})

    with pytest.raises(
        CacheFileError, match=r"^x: 1 of 3 entries invalid, nothing imported; first: .*'Wrong'"
    ):
        parse_cache_bytes(data, source="x")


OLD_KEY = "('old_op', 'FakeRunnerA', ((1, 1),))"  # FlashInfer's tests' _OLD_KEY


def test_a_key_no_release_wrote_is_skipped_and_counted_the_rest_read(
    tmp_path: Path, monkeypatch
) -> None:
    """Before: "a key is a 4-tuple ... nothing imported" for the whole file, whose
    3-element key FlashInfer 0.7.4's load_configs loads."""
    monkeypatch.chdir(tmp_path)
    hostile = "__import__('os').system('touch PWNED')"
    data = _file(
        {
            "_metadata": METADATA,
            "_records": {"ns": {"k": 1}},
            OLD_KEY: ["FakeRunnerA", 3],
            KEY: ["CutlassFp4Runner", 1, POLICY],
            hostile: ["R", {"not": "even a tactic"}],
            "('op', 'R')": ["R", 1],
        }
    )

    cache = parse_cache_bytes(data, source="x")

    assert [(e.key, e.tactic_json, e.fields.extras) for e in cache.entries] == [
        (OLD_KEY, "3", ""),
        (KEY, "1", "(torch.bfloat16, 1)"),
    ]
    assert [p.split(":")[0] for p in cache.unreadable_keys] == [repr(hostile), "\"('op', 'R')\""]
    assert cache.record_rows == (("ns", "k", "1"),)
    assert not (tmp_path / "PWNED").exists()


def test_read_cache_file_errors(tmp_path: Path) -> None:
    with pytest.raises(CacheFileError, match="no such file"):
        read_cache_file(tmp_path / "missing.json")
    with pytest.raises(CacheFileError, match="is a directory"):
        read_cache_file(tmp_path)


# -- rendering ------------------------------------------------------------------------

tactics = st.recursive(
    st.one_of(
        st.integers(min_value=-(2**62), max_value=2**62),
        st.booleans(),
        st.none(),
        st.text(max_size=8),
        st.floats(allow_nan=False, allow_infinity=False),
    ),
    lambda inner: st.lists(inner, max_size=4),
    max_leaves=10,
)


@settings(max_examples=100)
@given(st.dictionaries(keys, st.tuples(tactics, st.none() | st.just(POLICY)), max_size=6))
def test_render_then_parse_is_exact(entries: dict) -> None:
    rows = []
    expected = {}
    for parts, (tactic, policy) in entries.items():
        key = str(parts)
        rows.append(
            (key, parts[1], canonical_json(tactic), canonical_json(policy) if policy else None)
        )
        expected[key] = [parts[1], tactic] + ([policy] if policy else [])

    text = render_cache(METADATA, rows)

    assert json.loads(text) == {"_metadata": METADATA, **expected}
    assert list(json.loads(text)) == ["_metadata", *sorted(expected)]
    reparsed = parse_cache_bytes(text.encode())
    assert sorted(
        (e.key, e.runner, e.tactic_json, e.policy_json) for e in reparsed.entries
    ) == sorted(rows)


def test_render_exact_text() -> None:
    text = render_cache(
        {"gpu": "NVIDIA H200"},
        [
            (KEY2, "CutlassFp4Runner", "-1", None),
            (KEY, "CutlassFp4Runner", "[3,[1,2]]", canonical_json(POLICY)),
        ],
    )

    assert text == (
        "{\n"
        '"_metadata": {"gpu": "NVIDIA H200"},\n'
        f'{json.dumps(KEY)}: ["CutlassFp4Runner", [3,[1,2]], '
        '["cuda_graph_profile_replays",null,"l2_cache_policy","hot"]],\n'
        f'{json.dumps(KEY2)}: ["CutlassFp4Runner", -1]\n'
        "}\n"
    )
    assert render_cache(None, []) == "{}\n"


@pytest.mark.parametrize(
    "metadata",
    [
        {k: v for k, v in METADATA.items() if k != "gpu"},
        {k: v for k, v in METADATA.items() if not k.startswith("cudnn")},
        {"flashinfer_version": "0.7.2"},
        {},  # says nothing, yet is a _metadata: FlashInfer serves it nowhere
    ],
    ids=["no gpu", "no cudnn", "version only", "empty"],
)
def test_a_file_through_the_registry_gives_back_its_metadata(
    tmp_path: Path, metadata: dict
) -> None:
    from ficache.registry import Registry

    path = tmp_path / "cache.json"
    path.write_text(json.dumps({"_metadata": metadata, KEY: ["CutlassFp4Runner", 3]}))
    with Registry.open(str(tmp_path / "registry.db")) as reg:
        reg.import_cache([(str(path), read_cache_file(path))])
        [info] = reg.fingerprints()
        text, _count = reg.export_text(info.id)

    exported = json.loads(text)
    assert exported["_metadata"] == metadata
    assert list(exported["_metadata"]) == list(metadata)  # FlashInfer's field order
    assert exported[KEY] == ["CutlassFp4Runner", 3]


# -- atomic writes ---------------------------------------------------------------------


def test_write_atomic_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "cache.json"

    write_atomic(target, "one")
    write_atomic(target, "two")

    assert target.read_text() == "two"
    assert os.listdir(target.parent) == ["cache.json"]


def test_write_atomic_failure_keeps_the_old_file_and_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "cache.json"
    target.mkdir()  # os.replace of a file onto a directory fails

    with pytest.raises(OSError):
        write_atomic(target, "new")

    assert target.is_dir()
    assert os.listdir(tmp_path) == ["cache.json"]
