"""Round trips through the real FlashInfer AutoTuner:
``save_configs`` -> ``ficache import`` -> ``ficache export`` -> ``load_configs``.

FlashInfer cannot profile on a CPU, so ``fill_like_tuning`` is a stand-in
for tuning: it fills ``profiling_cache`` (and the policy map) with real
``ProfilingCacheKey`` objects exactly where FlashInfer's tuner stores its
winners. Everything after that is the real AutoTuner.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from flashinfer.autotuner import ProfilingCacheKey
from samples import H200_METADATA

HOT = ("cuda_graph_profile_replays", None, "l2_cache_policy", "hot")
COLD_GRAPH = ("cuda_graph_profile_replays", 3, "l2_cache_policy", "cold")
OTHER_GPU = H200_METADATA

#: (custom_op, runner, shapes, extras, tactic, policy or None) as a tuning run would leave them.
TUNED: list[tuple[str, str, tuple, tuple, Any, tuple | None]] = [
    (
        "flashinfer::mm_fp4",
        "CutlassFp4GemmRunner",
        ((16, 4096), (4096, 2048)),
        (torch.bfloat16, 1),
        7,
        HOT,
    ),
    (
        "flashinfer::mm_fp4",
        "CutlassFp4GemmRunner",
        ((32, 4096), (4096, 2048)),
        (torch.bfloat16, 1),
        -1,
        HOT,
    ),
    (
        "flashinfer::trtllm_fp8_block_scale_moe",
        "TrtllmGenMoERunner",
        ((8, 7168), (256, 7168)),
        (torch.float8_e4m3fn, 256, 8, None, 2.5, "renormalize"),
        (128, (1, 2), (3, (4, 5))),
        COLD_GRAPH,
    ),
    (
        "flashinfer::cute_dsl_moe",
        "CuteDslMoERunner",
        ((64, 2048),),
        (torch.float8_e5m2, True, float("-inf")),
        ((128, 64), 2, (0, 1)),
        None,
    ),
    (
        "flashinfer::attn",
        "BatchDecodeRunner",
        ((1, 32, 128), (4,)),
        ('it\'s "quoted"', 1e-05),
        [],
        None,
    ),
]


def fill_like_tuning(tuner: Any) -> dict[str, tuple[str, Any]]:
    """Stand-in for FlashInfer tuning (no GPU here): store winners as the tuner does."""
    expected = {}
    for i, (op, runner, shapes, extras, tactic, policy) in enumerate(TUNED):
        key = ProfilingCacheKey(op, runner, 1000 + i, shapes, extras)
        tuner.profiling_cache[key] = (tactic, None)
        if policy is not None:
            tuner._profiling_cache_policies[(None, key)] = policy
        expected[key.file_key] = (runner, tactic if not isinstance(tactic, list) else tuple(tactic))
    return expected


def loaded(tuner: Any, path: Path) -> tuple[bool, dict, dict]:
    """What a freshly cleared AutoTuner holds after ``load_configs(path)``."""
    tuner.clear_cache()
    ok = tuner.load_configs(str(path))
    return ok, dict(tuner._file_configs), dict(tuner._file_config_policies)


def entries_of(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


def test_save_import_export_load_is_exact(
    autotuner, cli, tmp_path: Path, registry_path: Path, created_note
) -> None:
    expected = fill_like_tuning(autotuner)
    saved = tmp_path / "saved.json"
    autotuner.save_configs(str(saved))
    assert "_generation" in json.loads(saved.read_text())
    original = loaded(autotuner, saved)
    assert original[0] is True
    assert original[1] == expected
    assert len(original[2]) == 3

    imported = cli("import", saved)
    out = tmp_path / "exported.json"
    exported = cli("export", "--fingerprint", "current", "-o", out)

    assert (imported.exit_code, imported.stderr) == (0, created_note(registry_path))
    assert (
        imported.stdout
        == "imported 5 entries from 1 file(s): 5 added, 0 replaced, 0 unchanged (commit 1)\n"
    )
    assert (exported.exit_code, exported.stderr) == (0, f"wrote 5 entries to {out}\n")
    assert loaded(autotuner, out) == original
    assert entries_of(out) == entries_of(saved)
    assert json.loads(out.read_text())["_metadata"] == json.loads(saved.read_text())["_metadata"]


def test_the_export_of_a_stored_id_is_the_same(autotuner, cli, tmp_path: Path) -> None:
    fill_like_tuning(autotuner)
    saved = tmp_path / "saved.json"
    autotuner.save_configs(str(saved))
    original = loaded(autotuner, saved)
    cli("import", saved)

    by_id = cli("export", "--fingerprint", "1")

    out = tmp_path / "by-id.json"
    out.write_text(by_id.stdout)
    assert loaded(autotuner, out) == original


@pytest.mark.parametrize("generation_key", ["_generation", "_cache_generation"])
def test_a_file_with_either_generation_key(
    autotuner, cli, tmp_path: Path, generation_key: str
) -> None:
    fill_like_tuning(autotuner)
    saved = tmp_path / "saved.json"
    autotuner.save_configs(str(saved))
    original = loaded(autotuner, saved)
    assert original[0] is True
    # FlashInfer 0.7.2 writes "_generation"; "_cache_generation" (which this
    # FlashInfer would misread as an entry) is accepted and dropped as well.
    data = json.loads(saved.read_text())
    data[generation_key] = data.pop("_generation")
    saved.write_text(json.dumps(data, indent=2))

    assert cli("import", saved).exit_code == 0
    out = tmp_path / "exported.json"
    assert cli("export", "--fingerprint", "current", "-o", out).exit_code == 0

    assert loaded(autotuner, out) == original


def test_a_file_without_metadata_round_trips_as_the_current_environment(
    autotuner, cli, tmp_path: Path
) -> None:
    fill_like_tuning(autotuner)
    saved = tmp_path / "saved.json"
    autotuner.save_configs(str(saved))
    bare = json.loads(saved.read_text())
    del bare["_metadata"], bare["_generation"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(bare))
    original = loaded(autotuner, old)
    assert original[0] is True

    refused = cli("import", old)
    assert refused.exit_code == 1
    accepted = cli("import", old, "--fingerprint", "current")
    assert accepted.exit_code == 0
    out = tmp_path / "exported.json"
    assert cli("export", "--fingerprint", "current", "-o", out).exit_code == 0

    assert loaded(autotuner, out) == original


def test_a_legacy_file_with_two_element_values(autotuner, cli, cache_file, tmp_path: Path) -> None:
    expected = fill_like_tuning(autotuner)
    legacy = cache_file(
        "legacy.json",
        {key: [runner, _as_json(tactic)] for key, (runner, tactic) in expected.items()},
    )
    original = loaded(autotuner, legacy)
    assert original == (True, expected, {})

    assert cli("import", legacy).exit_code == 0
    out = tmp_path / "exported.json"
    assert cli("export", "--fingerprint", "current", "-o", out).exit_code == 0

    assert loaded(autotuner, out) == original
    assert all(len(value) == 2 for value in entries_of(out).values())


def test_an_export_for_another_gpu_is_refused_by_flashinfer(
    autotuner, cli, cache_file, tmp_path: Path
) -> None:
    expected = fill_like_tuning(autotuner)
    other = cache_file(
        "h200.json",
        {key: [runner, _as_json(tactic)] for key, (runner, tactic) in expected.items()},
        metadata=OTHER_GPU,
    )
    assert cli("import", other).exit_code == 0
    out = tmp_path / "exported.json"

    exported = cli("export", "--fingerprint", "1", "-o", out)

    assert exported.exit_code == 0
    assert json.loads(out.read_text())["_metadata"] == OTHER_GPU
    assert loaded(autotuner, out) == (False, {}, {})
    # and nothing stored serves this (CPU-only) environment
    refused = cli("export", "--fingerprint", "current")
    assert refused.exit_code == 1
    assert refused.stderr.startswith("error: no stored fingerprint serves the current environment")


def _as_json(tactic: Any) -> Any:
    from flashinfer.autotuner import _tactic_to_json

    return _tactic_to_json(tactic)


def test_the_export_of_a_saved_file_is_what_save_configs_wrote_byte_for_byte(
    autotuner, cli, tmp_path: Path
) -> None:
    """Item 4 of issue 34: the export is save_configs' own layout (indent=2, its
    ``_generation``), not ficache's compact one, whatever form the import had."""
    fill_like_tuning(autotuner)
    autotuner.publish_namespaced_records("ns", {"a": {"k": [1, 2.5]}, "b": "x"})
    saved = tmp_path / "saved.json"
    autotuner.save_configs(str(saved))
    compact = tmp_path / "compact.json"
    compact.write_text(json.dumps(json.loads(saved.read_text())))  # no indent, as tests write

    assert cli("import", compact).exit_code == 0
    out = tmp_path / "exported.json"
    assert cli("export", "--fingerprint", "current", "-o", out).exit_code == 0

    assert out.read_bytes() == saved.read_bytes()


def _publish_and_save(tuner: Any, path: Path) -> str | None:
    """Publish a record (what arms FlashInfer's single-writer guard) and save to ``path``;
    the guard's message, or None where the save went through."""
    tuner.publish_namespaced_records("ns", {"late": 1})
    try:
        tuner.save_configs(str(path))
    except RuntimeError as exc:
        return str(exc)
    return None


GUARD = "Autotuner cache changed after it was loaded; namespaced records require one writer"


def test_a_newer_export_on_the_path_trips_save_configs_guard_as_flashinfer_files_do(
    autotuner, cli, cache_file, tmp_path: Path
) -> None:
    """Item 3 of issue 34: an export carries ``_generation``, derived from its content
    as FlashInfer derives it, so a server that loaded export A and finds export B on
    its path refuses to save over it. Before: no ``_generation``, the save went through
    and B's records were lost."""
    expected = fill_like_tuning(autotuner)
    rows = {key: [runner, _as_json(tactic)] for key, (runner, tactic) in expected.items()}
    first = dict(list(rows.items())[:2])
    # With FlashInfer's own files: B saved by another writer, A saved and loaded here,
    # then B lands on A's path.
    autotuner.clear_cache()
    autotuner.load_configs(str(cache_file("b.json", rows)))
    landing = tmp_path / "landing.json"
    autotuner.save_configs(str(landing))
    own = tmp_path / "own.json"
    autotuner.clear_cache()
    autotuner.load_configs(str(cache_file("a.json", first)))
    autotuner.save_configs(str(own))
    autotuner.clear_cache()
    assert autotuner.load_configs(str(own)) is True
    landing.replace(own)
    assert GUARD in str(_publish_and_save(autotuner, own))

    # With ficache's exports: the same sequence.
    path = tmp_path / "served.json"
    assert cli("import", cache_file("a3.json", first)).exit_code == 0
    assert cli("export", "--fingerprint", "current", "-o", path).exit_code == 0
    autotuner.clear_cache()
    assert autotuner.load_configs(str(path)) is True
    assert cli("import", cache_file("b3.json", rows)).exit_code == 0
    assert cli("export", "--fingerprint", "current", "-o", path).exit_code == 0

    assert GUARD in str(_publish_and_save(autotuner, path))


def test_the_same_export_again_does_not_trip_the_guard(autotuner, cli, cache_file, tmp_path):
    """An export of unchanged content has the same ``_generation``: exporting again over a
    file a server loaded is no other writer's change, as FlashInfer rewriting it would not be."""
    expected = fill_like_tuning(autotuner)
    rows = {key: [runner, _as_json(tactic)] for key, (runner, tactic) in expected.items()}
    assert cli("import", cache_file("a.json", rows)).exit_code == 0
    path = tmp_path / "served.json"
    assert cli("export", "--fingerprint", "current", "-o", path).exit_code == 0
    autotuner.clear_cache()
    assert autotuner.load_configs(str(path)) is True
    assert cli("export", "--fingerprint", "current", "-o", path).exit_code == 0

    assert _publish_and_save(autotuner, path) is None
    assert json.loads(path.read_text())["_records"] == {"ns": {"late": 1}}
