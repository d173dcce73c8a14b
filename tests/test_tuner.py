"""ficache.tuner (the AutoTuner adapter) and ficache.standin, on the real AutoTuner."""

from __future__ import annotations

from typing import Any

import pytest

from ficache.errors import TunerError
from ficache.fingerprint import collect
from ficache.flashinfer_format import canonical_json, parse_key, render_cache
from ficache.standin import STANDIN_OP, standin_keys, standin_tune
from ficache.tuner import FlashInferTuner


def _text(rows: dict[str, tuple[str, str, str | None, str | None]], **metadata: str) -> str:
    meta = {**collect().flashinfer_metadata(), **metadata}
    return render_cache(meta, [(k, *v) for k, v in rows.items()])


def test_standin_fills_the_real_autotuner_and_tuned_matches_save_configs(autotuner: Any) -> None:
    tuner = FlashInferTuner()
    result = standin_tune()
    assert (result.profiled, result.hits, result.reduces) == (18, 0, 0)
    tuned = tuner.tuned()
    assert sorted(tuned) == sorted(standin_keys())
    # What the adapter reads from memory is exactly what FlashInfer's save_configs writes.
    assert tuned == tuner.entries()
    for key, (runner, tactic, policy, selection) in tuned.items():
        fields = parse_key(key)
        assert fields.op == STANDIN_OP and fields.runner == runner == "CpuStandInMatmulRunner"
        assert fields.extras == "(torch.float32,)"
        assert tactic in {"0", "1", "2", "3", "4"} and policy is None and selection is None


def test_tuned_carries_the_measurement_policy_like_save_configs(autotuner: Any) -> None:
    standin_tune(shapes=((128, 128),), buckets=(1,))
    (key,) = autotuner.profiling_cache
    autotuner._profiling_cache_policies[(None, key)] = (
        "cuda_graph_profile_replays",
        None,
        "l2_cache_policy",
        "hot",
    )
    tuner = FlashInferTuner()
    (row,) = tuner.tuned().values()
    assert row[2] == canonical_json(["cuda_graph_profile_replays", None, "l2_cache_policy", "hot"])
    assert tuner.tuned() == tuner.entries()


def test_load_round_trip_serves_every_entry(autotuner: Any) -> None:
    tuner = FlashInferTuner()
    standin_tune()
    rows = tuner.tuned()
    tuner.clear()
    assert tuner.entries() == {} and tuner.tuned() == {}
    assert tuner.load(_text(rows)) == 18
    assert tuner.entries() == rows
    assert tuner.tuned() == {}  # loaded, not tuned
    again = standin_tune()
    assert (again.profiled, again.hits) == (0, 18)


def test_load_keeps_policies(autotuner: Any) -> None:
    tuner = FlashInferTuner()
    standin_tune(shapes=((128, 128),), buckets=(1, 2))
    rows = {
        k: (
            r,
            t,
            canonical_json(["cuda_graph_profile_replays", None, "l2_cache_policy", "hot"]),
            None,
        )
        for k, (r, t, _p, _s) in tuner.tuned().items()
    }
    tuner.clear()
    assert tuner.load(_text(rows)) == 2
    assert tuner.entries() == rows


def test_load_refused_by_flashinfer_raises(autotuner: Any) -> None:
    tuner = FlashInferTuner()
    standin_tune(shapes=((128, 128),), buckets=(1,))
    rows = tuner.tuned()
    tuner.clear()
    with pytest.raises(TunerError, match="refused"):
        tuner.load(_text(rows, gpu="Some Other GPU"))
    assert tuner.entries() == {}


def test_load_of_garbage_raises(autotuner: Any) -> None:
    with pytest.raises(TunerError, match="could not load"):
        FlashInferTuner().load("{ this is not json")


def test_load_failure_in_temp_dir_raises(autotuner: Any, tmp_path: Any) -> None:
    with pytest.raises(TunerError, match="temp file"):
        FlashInferTuner(tmpdir=tmp_path / "missing").load("{}")


def test_set_process_group_sets_flashinfer_global(autotuner: Any) -> None:
    from flashinfer.autotuner import get_autotune_process_group

    tuner = FlashInferTuner()
    sentinel = object()
    try:
        tuner.set_process_group(sentinel)
        assert get_autotune_process_group() is sentinel
    finally:
        tuner.set_process_group(None)
    assert get_autotune_process_group() is None


def test_standin_force_and_rank_tag(autotuner: Any) -> None:
    standin_tune(rank_tag="rank3", force_tactic=2)
    rows = FlashInferTuner().tuned()
    assert sorted(rows) == sorted(standin_keys(rank_tag="rank3"))
    assert {t for _r, t, _p, _s in rows.values()} == {"2"}
    assert all(parse_key(k).extras == "(torch.float32, 'rank3')" for k in rows)


def test_standin_rejects_unknown_bucket(autotuner: Any) -> None:
    with pytest.raises(ValueError, match="bucket"):
        standin_tune(buckets=(3,))
