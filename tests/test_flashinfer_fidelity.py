"""FlashInfer holds the same state after loading a cache and after loading ficache's round
trip of it (``ficache import`` then ``ficache export``, the CLI a user runs), on FlashInfer
0.7.4 (this python) and 0.7.2.post1 (``FICACHE_TEST_FLASHINFER_072_PYTHON``).

Each ``CASES`` row builds an original (a cache file, or a v2 store as FlashInfer's own
``ManagedAutotuneCache`` publishes it) for the release under test, with that release's
``_collect_metadata()``. The original and the round trip are then loaded in fresh tuners
(``tests/flashinfer_state.py``: one process per release and case, one forked child per
load) and their whole states compared: file configs, policies, selections, ``_records``,
protocol records, what ``search_cache`` (``choose_one``'s lookup) serves for every key,
for a file what the next ``save_configs`` on its path writes (merged, healed or left alone
by its ``_metadata``), and for a store what ``preload`` and ``lookup`` return.

FlashInfer 0.7.2 has no selections and no protocol records: its state says ``"absent"``
for them, and a protocol record's entry file is, to it, one more store entry; what it
does hold is compared the same way.

A row is ``Case(name, kind, build)``; ``build(meta)`` returns the original's content.
Add rows (the measurement-policy mixes, say) to ``CASES``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from flashinfer_072 import flashinfer_072_python
from flashinfer_state import decode, file_key

STATE_SCRIPT = Path(__file__).with_name("flashinfer_state.py")
HOT = ["cuda_graph_profile_replays", None, "l2_cache_policy", "hot"]
COLD = ["cuda_graph_profile_replays", 3, "l2_cache_policy", "cold"]
SEL = {"time_ms": 0.0125, "runner_up_ms": 0.0131, "margin": 0.048, "candidates": 7}


def probe(op: str, runner: str, shapes: list, extras: Any) -> dict[str, Any]:
    """A key in ``flashinfer_state`` form (``extras`` None: a 3-element key)."""
    return {"op": op, "runner": runner, "shapes": shapes, "extras": extras}


def bf16(*rest: Any) -> dict[str, Any]:
    return {"__tuple__": [{"__dtype__": "bfloat16"}, *rest]}


MM = probe("flashinfer::mm_fp4", "CutlassFp4GemmRunner", [[16, 4096], [4096, 2048]], bf16(1))
MM32 = probe("flashinfer::mm_fp4", "CutlassFp4GemmRunner", [[32, 4096], [4096, 2048]], bf16(1))
MOE = probe(
    "flashinfer::trtllm_fp8_block_scale_moe",
    "TrtllmGenMoERunner",
    [[8, 7168], [256, 7168]],
    {"__tuple__": [{"__dtype__": "float8_e4m3fn"}, 256, 8, None, 2.5, "renormalize"]},
)
ODD = probe(
    "flashinfer::attn",
    "BatchDecodeRunner",
    [[1, 32, 128], [4]],
    {"__tuple__": ['it\'s "quoted" é', 1e-05, -0.0, 2**53 + 1, True]},
)
OLD = probe("old_op", "FakeRunnerA", [[1, 1]], None)  # 0.6.7-0.6.12's 3-element key
DEVICE = probe("flashinfer::op", "Runner", [[16, 64]], {"__tuple__": [{"__device__": "cpu"}, 2]})
EMPTY = probe("flashinfer::op", "Runner", [], {"__tuple__": []})


@dataclass(frozen=True)
class Case:
    """One original: ``kind`` ``"file"`` (``build`` gives ``(metadata or None, {probe index:
    value}, records)``) or ``"store"`` (``build`` gives ``(entries, protocol records)``:
    ``[(probe, runner, tactic, policy or None, with key_fields)]`` and ``[(namespace, key,
    value)]``); ``measurement``: the store's ``MeasurementPolicy`` fields."""

    name: str
    kind: str
    build: Callable[[dict[str, str]], Any]
    probes: tuple[dict[str, Any], ...]
    namespaces: tuple[str, ...] = ()
    measurement: dict[str, Any] = field(default_factory=dict)


def _file(metadata: Any, values: dict[int, list], probes: tuple, records: Any = None) -> dict:
    data: dict[str, Any] = {}
    if metadata is not None:
        data["_metadata"] = metadata
    if records is not None:
        data["_records"] = records
    for i, value in values.items():
        data[file_key(probes[i])] = value
    return data


KEYS = (MM, MM32, MOE, ODD, OLD, DEVICE, EMPTY)


def _entries(meta: dict[str, str]) -> tuple:
    """Every key form, tactic form and number the cases use, with policies."""
    return (
        meta,
        {
            0: ["CutlassFp4GemmRunner", 7, HOT],
            1: ["CutlassFp4GemmRunner", -1],
            2: ["TrtllmGenMoERunner", [128, [1, 2], [3, [4, 5]]], COLD],
            3: ["BatchDecodeRunner", "tile_128x64", HOT],
            4: ["FakeRunnerA", 3],
            5: ["Runner", [0.5, 2**40, -7, 1e-300]],
            6: ["Runner", [], HOT],
        },
        {"trtllm_moe_da": {"k1": {"tiles": [1, 2, {"n": 3}], "ok": True}}, "ns": {"x": 1.5}},
    )


def _with_meta(change: Callable[[dict[str, str]], dict[str, Any]]) -> Callable:
    def build(meta: dict[str, str]) -> tuple:
        _meta, values, records = _entries(meta)
        return change(dict(meta)), values, records

    return build


def _drop_gpu(meta: dict[str, str]) -> dict[str, str]:
    meta.pop("gpu")
    return meta


CASES: list[Case] = [
    Case("every key form", "file", _entries, KEYS),
    Case(
        "selections",
        "file",
        lambda meta: (
            meta,
            {
                0: ["CutlassFp4GemmRunner", 7, HOT, SEL],
                1: ["CutlassFp4GemmRunner", 2, HOT, "not an object"],
                3: ["BatchDecodeRunner", [1, [2]], COLD, {"time_ms": 1, "nested": {"a": [1]}}],
            },
            None,
        ),
        KEYS,
    ),
    Case(
        "metadata unknown",
        "file",
        _with_meta(lambda m: {**m, "flashinfer_version": "unknown"}),
        KEYS,
    ),
    Case("metadata *", "file", _with_meta(lambda m: {k: "*" for k in m}), KEYS),
    Case("metadata None", "file", _with_meta(lambda m: {**m, "gpu": "None"}), KEYS),
    Case("metadata missing field", "file", _with_meta(_drop_gpu), KEYS),
    Case(
        "v2 store",
        "store",
        lambda meta: (
            [
                (MM, "CutlassFp4GemmRunner", 7, HOT, True),
                (MOE, "TrtllmGenMoERunner", [128, [1, 2]], COLD, True),
                (ODD, "BatchDecodeRunner", "tile", None, True),
                (DEVICE, "Runner", 5, HOT, False),  # FlashInfer cannot encode it: lookup only
            ],
            [("megamoe", '{"m":16}', {"knob": [1, 2], "t": 0.5}), ("megamoe", "k2", 3)],
        ),
        (MM, MOE, ODD, DEVICE),
        namespaces=("megamoe",),
    ),
]


def _write_original(case: Case, meta: dict[str, str], where: Path) -> Path:
    built = case.build(meta)
    if case.kind == "file":
        metadata, values, records = built
        path = where / "original.json"
        path.write_text(json.dumps(_file(metadata, values, case.probes, records), indent=2))
        return path
    from flashinfer.autotune_cache import ManagedAutotuneCache, MeasurementPolicy

    manifest = dict(meta)
    if case.measurement:
        manifest.update(MeasurementPolicy(**case.measurement).manifest_fields())
    store = ManagedAutotuneCache(manifest=manifest, root=where / "original")
    entries, protocol = built
    for p, runner, tactic, policy, encodable in entries:
        key_fields = (
            (p["op"], p["runner"], tuple(map(tuple, p["shapes"])), decode(p["extras"]))
            if encodable
            else None
        )
        store.publish(file_key(p), runner, tactic, key_fields=key_fields, profiling_policy=policy)
    for namespace, key, value in protocol:
        fields = ("__protocol__", namespace, key)
        store.publish(str(fields), namespace, value, key_fields=fields)
    return where / "original"


def _round_trip(cli: Any, case: Case, original: Path, where: Path) -> Path:
    imported = cli("import", original)
    assert imported.exit_code == 0, imported.output
    assert "skipped" not in imported.stderr, imported.stderr
    out = where / ("round-trip.json" if case.kind == "file" else "round-trip")
    if case.kind == "file":
        exported = cli("export", "--fingerprint", "1", "-o", out)
    else:
        exported = cli("export", "--fingerprint", "1", "--v2-store", out)
    assert exported.exit_code == 0, exported.output
    return out


_METADATA: dict[str, dict[str, str]] = {}


def _python(release: str) -> str:
    return sys.executable if release == "0.7.4" else flashinfer_072_python()


def _release_metadata(python: str) -> dict[str, str]:
    if python not in _METADATA:
        out = subprocess.run(
            [python, str(STATE_SCRIPT), "metadata"],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        _METADATA[python] = json.loads(out.stdout.splitlines()[-1])
    return _METADATA[python]


def _states(python: str, case: Case, paths: dict[str, Path], where: Path) -> dict[str, Any]:
    spec = {
        "items": [
            {
                "name": name,
                "kind": case.kind,
                "path": str(path),
                "probes": list(case.probes),
                "namespaces": list(case.namespaces),
                "measurement": case.measurement or None,
            }
            for name, path in paths.items()
        ]
    }
    (where / "spec.json").write_text(json.dumps(spec))
    subprocess.run(
        [python, str(STATE_SCRIPT), "state", str(where / "spec.json"), str(where / "states")],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads((where / "states").read_text())


@pytest.mark.parametrize("release", ["0.7.4", "0.7.2"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_flashinfer_holds_the_same_state_after_a_round_trip(
    cli, tmp_path: Path, case: Case, release: str
) -> None:
    python = _python(release)
    meta = _release_metadata(python)
    original = _write_original(case, meta, tmp_path)
    round_trip = _round_trip(cli, case, original, tmp_path)

    states = _states(python, case, {"original": original, "round trip": round_trip}, tmp_path)

    assert "error" not in states["original"], states["original"]
    assert states["round trip"] == states["original"]
    (tmp_path / "state.json").write_text(json.dumps(states["original"], indent=1))
