"""FlashInfer 0.7.4's selection (a cache value's fourth element), in and out, losslessly.

FlashInfer 0.7.4 saves ``[runner, tactic, policy, selection]`` when its own
tuning chose the winner; ``selection`` (``{"time_ms", "runner_up_ms",
"margin", "candidates"}``) is kept only to be saved back. These tests cover
the parser (both paths, hostile selections), the registry (the selection is
not part of a value: never a conflict, never a change, written and replaced
with the value, restored by revert), merge, bundles, the round trip through
the real ``AutoTuner`` of 0.7.4 and a load by 0.7.2.post1, and warm starts
(one process through FlashInfer's real tuning loop; two gloo ranks whose
selections differ while their values agree).
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

import pytest
from flashinfer_072 import flashinfer_072_python
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ficache
from ficache._ranks import run_ranks
from ficache.bundle import parse_bundle_bytes, read_bundle
from ficache.errors import BundleError
from ficache.flashinfer_format import (
    MAX_SELECTION_CHARS,
    MAX_SELECTION_DEPTH,
    _check_entry,
    _read_entries,
    parse_cache_bytes,
    selection_json,
)
from ficache.merge import open_source, plan_merge
from ficache.registry import Registry
from ficache.tuner import FlashInferTuner

RUNNER = "CutlassRunner"
POLICY = ["cuda_graph_profile_replays", None, "l2_cache_policy", "hot"]
SEL = {"time_ms": 0.01, "runner_up_ms": 0.012, "margin": 0.2, "candidates": 5}
SEL_JSON = '{"candidates":5,"margin":0.2,"runner_up_ms":0.012,"time_ms":0.01}'
OTHER = {"time_ms": 0.02, "runner_up_ms": 0.021, "margin": 0.05, "candidates": 3}
OTHER_JSON = '{"candidates":3,"margin":0.05,"runner_up_ms":0.021,"time_ms":0.02}'
META = {"gpu": "NVIDIA H200"}


def key(m: int) -> str:
    return str(("flashinfer::mm_fp4", RUNNER, ((m, 4096), (4096, 2048)), ("torch.bfloat16",)))


def stored(db: str | Path) -> list[tuple[Any, ...]]:
    with Registry.open(str(db)) as reg:
        return [(e.key, e.tactic_json, e.selection_json) for e in reg.entries()]


# -- parsing ---------------------------------------------------------------------------


def test_a_fourth_element_object_is_kept_canonically_on_both_paths() -> None:
    odd = "('flashinfer::mm_fp4', 'CutlassRunner', ((16, 4096),), (torch.bfloat16,),)"  # general
    data = json.dumps({key(16): [RUNNER, 3, POLICY, SEL], odd: [RUNNER, [1, 2], POLICY, SEL]})

    parsed = parse_cache_bytes(data.encode())

    assert [(e.policy_json, e.selection_json) for e in parsed.entries] == [
        ('["cuda_graph_profile_replays",null,"l2_cache_policy","hot"]', SEL_JSON)
    ] * 2
    assert parsed.ignored_selections == 0
    assert _check_entry(key(16), [RUNNER, 3, POLICY, SEL]) == parsed.entries[0]


@pytest.mark.parametrize("fourth", [7, "fast", [1, 2], None, True])
def test_a_fourth_element_that_is_not_an_object_is_dropped_and_counted(
    cli, cache_file, registry_db: str, fourth: Any, created_note: Any
) -> None:
    path = cache_file("four.json", {key(16): [RUNNER, 3, POLICY, fourth]}, metadata=META)

    result = cli("import", path)

    assert (result.exit_code, result.stdout, result.stderr) == (
        0,
        "imported 1 entries from 1 file(s): 1 added, 0 replaced, 0 unchanged (commit 1)\n",
        created_note(registry_db)
        + "warning: 1 entry held a fourth element that is not an object; imported without a "
        "selection, as FlashInfer ignores it\n",
    )
    assert [s for _k, _t, s in stored(registry_db)] == [None]


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ([RUNNER, 3, None, SEL], "policy must be a list"),
        ([RUNNER, 3, POLICY, SEL, 1], "value must be [runner, tactic], [runner, tactic, policy]"),
        (
            [RUNNER, 3, POLICY, {"a": [[[[[[[[[1]]]]]]]]]}],
            f"selection nested deeper than {MAX_SELECTION_DEPTH} levels",
        ),
        (
            [RUNNER, 3, POLICY, {"a": "x" * MAX_SELECTION_CHARS}],
            f"selection longer than {MAX_SELECTION_CHARS} characters of JSON",
        ),
    ],
    ids=["no-policy", "five-elements", "nested", "huge"],
)
def test_an_invalid_selection_refuses_the_file_and_changes_nothing(
    cli, cache_file, dump_db, registry_db: str, value: list[Any], why: str
) -> None:
    good = cache_file("good.json", {key(32): [RUNNER, 1, POLICY, SEL]}, metadata=META)
    assert cli("import", good).exit_code == 0
    before = dump_db(registry_db)
    bad = cache_file("bad.json", {key(16): value}, metadata=META)

    result = cli("import", bad)

    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr.startswith(
        f"error: {bad}: 1 of 1 entries invalid, nothing imported; first: {key(16)[:80]!r}: {why}"
    )
    assert result.stderr.count("\n") == 1
    assert dump_db(registry_db) == before


@pytest.mark.parametrize("number", ["NaN", "Infinity", "1e999"])
def test_a_non_finite_selection_refuses_the_file_in_one_line(
    cli, tmp_path: Path, dump_db, registry_db: str, number: str
) -> None:
    path = tmp_path / "nan.json"
    path.write_text(
        '{"_metadata": {"gpu": "NVIDIA H200"}, '
        + json.dumps(key(16))
        + f': ["{RUNNER}", 3, ["hot"], {{"time_ms": {number}}}]}}'
    )
    Registry.open(registry_db).close()
    before = dump_db(registry_db)

    result = cli("import", path)

    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr.startswith(f"error: {path}: ") and result.stderr.count("\n") == 1
    assert dump_db(registry_db) == before


_json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(alphabet="ab[{}]\"'\\", max_size=4),
)
_json_values = st.recursive(
    _json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(_json_values, st.dictionaries(st.text(max_size=3), _json_values))))
def test_the_fast_path_decides_selections_as_check_entry(fourths: list[Any]) -> None:
    top = {key(m): [RUNNER, m, POLICY, fourth] for m, fourth in enumerate(fourths, start=1)}
    expected, problems, ignored = [], [], 0
    for k, value in top.items():
        try:
            expected.append(_check_entry(k, value))
            ignored += not isinstance(value[3], dict)
        except ValueError as exc:
            problems.append(f"{k[:80]!r}: {exc}")

    assert _read_entries(json.loads(json.dumps(top))) == (expected, problems, ignored)


def test_selection_json_refuses_what_json_cannot_carry() -> None:
    assert selection_json(SEL) == SEL_JSON
    for bad in ({"t": math.nan}, {"t": math.inf}, {1: 2}, {"t": object()}, [SEL]):
        with pytest.raises(ValueError):
            selection_json(bad)


# -- the registry: not part of the value -------------------------------------------------


def test_the_selection_is_written_with_the_value_and_is_not_part_of_it(
    cli, cache_file, registry_db: str
) -> None:
    db = registry_db
    first = cache_file("a.json", {key(16): [RUNNER, 3, POLICY, SEL]}, metadata=META)
    same = cache_file("b.json", {key(16): [RUNNER, 3, POLICY, OTHER]}, metadata=META)
    plain = cache_file("c.json", {key(16): [RUNNER, 3, POLICY]}, metadata=META)
    retuned = cache_file("d.json", {key(16): [RUNNER, 4, POLICY, OTHER]}, metadata=META)

    assert cli("import", first).exit_code == 0
    for again in (same, plain):  # equal values: unchanged, the stored selection stays
        result = cli("import", again)
        assert result.stdout.startswith("imported 1 entries from 1 file(s): 0 added, 0 replaced")
        assert stored(db) == [(key(16), "3", SEL_JSON)]
    assert cli("import", retuned).stdout.startswith(
        "imported 1 entries from 1 file(s): 0 added, 1 replaced"
    )
    assert stored(db) == [(key(16), "4", OTHER_JSON)]

    shown = json.loads(cli("show", "2", "--format", "json").stdout)["changes"][0]
    assert (shown["old"]["selection"], shown["new"]["selection"]) == (SEL, OTHER)
    listed = json.loads(cli("list", "--format", "json").stdout)
    assert [row["selection"] for row in listed] == [OTHER]

    assert cli("revert", "2", "--yes").exit_code == 0  # the old value, its selection with it
    assert stored(db) == [(key(16), "3", SEL_JSON)]
    # Commit 2's change was reverted, so nothing later stands in its way (issue 35 bug 4).
    assert cli("revert", "1", "--yes").exit_code == 0
    assert json.loads(cli("list", "--format", "json").stdout) == []
    assert cli("verify").stdout.endswith("ok: no problems\n")


def test_prune_and_revert_restore_the_selection(cli, cache_file, registry_db: str) -> None:
    db = registry_db
    path = cache_file("a.json", {key(16): [RUNNER, 3, POLICY, SEL]}, metadata=META)
    assert cli("import", path).exit_code == 0

    assert cli("prune", "--fingerprint", "1", "--yes").exit_code == 0
    assert stored(db) == []
    assert cli("revert", "2", "--yes").exit_code == 0

    assert stored(db) == [(key(16), "3", SEL_JSON)]
    assert cli("verify").stdout.endswith("ok: no problems\n")


def test_keep_existing_and_merge_never_see_selections_as_conflicts(
    tmp_path: Path, cache_file
) -> None:
    db = str(tmp_path / "target.db")
    a = cache_file("a.json", {key(16): [RUNNER, 3, POLICY, SEL]}, metadata=META)
    b = cache_file("b.json", {key(16): [RUNNER, 3, POLICY, OTHER], key(32): [RUNNER, 1]}, META)
    with Registry.open(db) as reg:
        sources = [open_source(str(a)), open_source(str(b))]
        plan = plan_merge(reg, sources, "fail")
        assert plan.conflicts == ()
        assert plan.execute(reg).commit_id == 1
        assert plan_merge(reg, sources, "fail").execute(reg).commit_id is None  # again: nothing
        # A registry source carries its selections along.
        other = str(tmp_path / "other.db")
        with Registry.open(other) as src:
            src.import_cache([("b", parse_cache_bytes(b.read_bytes()))])
        again = plan_merge(reg, [open_source(other)], "fail")
        assert again.conflicts == () and again.execute(reg).commit_id is None
    assert stored(db) == [(key(16), "3", SEL_JSON), (key(32), "1", None)]
    into = str(tmp_path / "into.db")
    with Registry.open(into) as reg:
        plan_merge(reg, [open_source(other)], "keep").execute(reg)
    assert stored(into) == [(key(16), "3", OTHER_JSON), (key(32), "1", None)]


def test_verify_finds_a_selection_that_is_not_a_canonical_object(
    cli, cache_file, registry_db: str
) -> None:
    import sqlite3

    path = cache_file("a.json", {key(16): [RUNNER, 3, POLICY, SEL]}, metadata=META)
    assert cli("import", path).exit_code == 0
    with sqlite3.connect(registry_db) as conn:  # damage behind the registry's back
        conn.execute("UPDATE entries SET selection = '[1]'")
        conn.execute("UPDATE entry_changes SET new_selection = '{\"a\": 1}'")
    conn.close()

    result = cli("verify")

    assert result.exit_code == 1
    assert "bad_selection" in result.stdout
    assert "entry 1: selection '[1]': selection must be an object, not a list" in result.stdout
    assert "change 1: new selection '{\"a\": 1}' is not canonical JSON" in result.stdout


# -- bundles -----------------------------------------------------------------------------


def test_a_bundle_carries_selections_as_format_version_2(
    cli, cache_file, registry_db: str, tmp_path: Path
) -> None:
    path = cache_file("a.json", {key(16): [RUNNER, 3, POLICY, SEL], key(32): [RUNNER, 1]}, META)
    assert cli("import", path).exit_code == 0
    out = tmp_path / "b.bundle"
    assert cli("export", "--bundle", out, "--all").exit_code == 0
    bundle = read_bundle(out)
    assert bundle.format_version == 2
    assert [e.selection_json for e in bundle.entries] == [SEL_JSON, None]

    empty = tmp_path / "empty.db"
    assert cli("import", out, db=empty).exit_code == 0
    assert stored(empty) == stored(registry_db)
    again = tmp_path / "again.bundle"
    assert cli("export", "--bundle", again, "--all", db=empty).exit_code == 0
    assert again.read_bytes() == out.read_bytes()

    # Hostile: a selection in a version-1 bundle, a non-canonical or non-object selection.
    data = out.read_bytes()
    for old, new in (
        (b"ficache-bundle 2 ", b"ficache-bundle 1 "),
        (json.dumps(SEL_JSON).encode()[1:-1], b'{\\"candidates\\": 5}'),
        (json.dumps(SEL_JSON).encode()[1:-1], b"[1]"),
    ):
        with pytest.raises(BundleError) as caught:
            parse_bundle_bytes(_reframe(data.replace(old, new, 1)), source="x")
        assert str(caught.value).startswith("x: invalid bundle (")


def _reframe(data: bytes) -> bytes:
    """The same header (version kept) over ``data``'s payload, with a correct size and sum."""
    import hashlib

    header, payload = data.split(b"\n", 1)
    version = header.split(b" ")[1]
    digest = hashlib.sha256(payload).hexdigest().encode()
    return b"ficache-bundle %s %d sha256=%s\n%s" % (version, len(payload), digest, payload)


# -- the round trip through FlashInfer ----------------------------------------------------


def test_save_import_export_load_save_keeps_every_value_with_the_real_autotuner(
    cli, cache_file, autotuner: Any, tmp_path: Path
) -> None:
    from ficache.standin import standin_keys

    k16, k32, k64 = standin_keys()[:3]
    runner = "CpuStandInMatmulRunner"
    original = cache_file(
        "tuned.json",
        {
            k16: [runner, 2, POLICY, SEL],
            k32: [runner, [1, [2, 3]], POLICY],
            k64: [runner, 0],
        },
    )
    assert autotuner.load_configs(str(original))
    saved = tmp_path / "saved.json"
    autotuner.save_configs(str(saved))  # FlashInfer 0.7.4 saves the selection back
    before = _values(saved)
    assert before[k16] == [runner, 2, POLICY, SEL]

    assert cli("import", saved).exit_code == 0
    exported = tmp_path / "exported.json"
    assert cli("export", "--fingerprint", "current", "-o", exported).exit_code == 0
    autotuner.clear_cache()
    assert autotuner.load_configs(str(exported))
    resaved = tmp_path / "resaved.json"
    autotuner.save_configs(str(resaved))

    assert _values(resaved) == before
    assert FlashInferTuner(autotuner).entries()[k16] == (
        runner,
        "2",
        '["cuda_graph_profile_replays",null,"l2_cache_policy","hot"]',
        SEL_JSON,
    )


def _values(path: Path) -> dict[str, Any]:
    return {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}


def standin_tune_with_selections(rank: int = 0) -> list[str]:
    """A STAND-IN for FlashInfer 0.7.4's tuning (no GPU): ``standin_tune``, then for each
    key it tuned a measurement policy and a rank-specific selection, set as
    ``AutoTuner._cache_profile_result`` sets them next to ``profiling_cache``."""
    from flashinfer.autotuner import AutoTuner

    from ficache.standin import standin_tune

    tuner = AutoTuner.get()
    before = set(tuner.profiling_cache)
    standin_tune()
    keys = []
    for cache_key in set(tuner.profiling_cache) - before:
        tuner._profiling_cache_policies[(None, cache_key)] = tuple(POLICY)
        tuner._profiling_cache_selections[(None, cache_key)] = AutoTuner._selection_record(
            [0.01 * (rank + 1), 0.02, math.inf], 0
        )
        keys.append(cache_key.file_key)
    return sorted(keys)


def test_the_tuner_reads_selections_as_save_configs_writes_them(autotuner: Any) -> None:
    keys = standin_tune_with_selections()

    tuned = FlashInferTuner(autotuner).tuned()

    assert tuned == FlashInferTuner(autotuner).entries()
    assert {row[3] for row in tuned.values()} == {
        '{"candidates":2,"margin":1.0,"runner_up_ms":0.02,"time_ms":0.01}'
    }
    assert sorted(tuned) == keys


def test_flashinfer_0_7_2_loads_an_export_with_selections(cli, cache_file, tmp_path: Path) -> None:
    python_072 = flashinfer_072_python()
    path = cache_file("a.json", {key(16): [RUNNER, 3, POLICY, SEL], key(32): [RUNNER, 1]}, META)
    assert cli("import", path).exit_code == 0
    exported = tmp_path / "exported.json"
    assert cli("export", "--fingerprint", "1", "-o", exported).exit_code == 0
    script = (
        "import json, sys\n"
        "import flashinfer\n"
        "from flashinfer.autotuner import AutoTuner, _collect_metadata\n"
        "data = json.load(open(sys.argv[1])); data['_metadata'] = _collect_metadata()\n"
        "json.dump(data, open(sys.argv[2], 'w'))\n"
        "t = AutoTuner.get()\n"
        "print(flashinfer.__version__, t.load_configs(sys.argv[2]))\n"
        "print(json.dumps(sorted([k, list(v)] for k, v in t._file_configs.items())))\n"
        "print(json.dumps(sorted([k, list(v)] for k, v in t._file_config_policies.items())))\n"
    )
    out = subprocess.run(
        [python_072, "-c", script, str(exported), str(tmp_path / "here.json")],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout.splitlines()

    assert out[0] == "0.7.2.post1 True"
    assert json.loads(out[1]) == [[key(16), [RUNNER, 3]], [key(32), [RUNNER, 1]]]
    assert json.loads(out[2]) == [[key(16), POLICY]]


# -- warm starts -------------------------------------------------------------------------


def test_a_warm_start_stores_what_flashinfer_s_real_loop_chose(
    registry_path: Path, autotuner: Any
) -> None:
    from ficache.standin_timing import real_loop_tune

    with ficache.warm_start(db=registry_path) as cold:
        real_loop_tune()
    assert (cold.report.tuned, cold.report.committed) == (18, 18)
    selections = [json.loads(s) for _k, _t, s in stored(registry_path)]
    assert all(set(s) == {"time_ms", "runner_up_ms", "margin", "candidates"} for s in selections)
    held = FlashInferTuner(autotuner).entries()

    autotuner.clear_cache()
    with ficache.warm_start(db=registry_path) as warm:
        again = real_loop_tune()

    assert (warm.report.status, warm.report.loaded, warm.report.tuned) == ("warm", 18, 0)
    assert (again.profiled, again.hits) == (0, 18)
    assert FlashInferTuner(autotuner).entries() == held  # selections loaded back exactly


def two_ranks_with_their_own_selections(rank: int, world: int, db: str) -> dict[str, Any]:
    """Rank ``rank`` of a synchronized start: equal tactics, rank-specific selections."""
    with ficache.warm_start(db=db) as ws:
        standin_tune_with_selections(rank)
    report = ws.report
    return {"shared": report.shared, "scoped": report.scoped, "dis": report.disagreements}


def test_ranks_whose_selections_differ_still_agree_and_store_rank_0_s(tmp_path: Path) -> None:
    db = str(tmp_path / "registry.db")

    reports = run_ranks(two_ranks_with_their_own_selections, 2, db, timeout=240)

    assert reports == [{"shared": 18, "scoped": 0, "dis": 0}] * 2
    selections = {s for _k, _t, s in stored(db)}
    assert selections == {'{"candidates":2,"margin":1.0,"runner_up_ms":0.02,"time_ms":0.01}'}
