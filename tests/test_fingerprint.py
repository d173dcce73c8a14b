"""Fingerprints: collecting the environment and FlashInfer's matching rules."""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from samples import H200_METADATA

from ficache.errors import FingerprintError
from ficache.fingerprint import (
    ALL_FIELDS,
    EXTRA_FIELDS,
    FLASHINFER_FIELDS,
    Fingerprint,
    collect,
)
from ficache.fingerprint import MISSING as MISSING_FIELD

H200 = H200_METADATA


def _classify(saved: dict, current: dict) -> tuple[dict, dict]:
    from flashinfer.autotuner.autotuner import _classify_metadata_mismatches

    return _classify_metadata_mismatches(saved, current)


# Values a writer may record: definite ones, the wildcard, and FlashInfer's
# indeterminate ones (a missing field, null, "unknown", "None").
MISSING = object()
saved_values = st.sampled_from(["a", "b", "*", "unknown", "None", None, MISSING])
# What ``_collect_metadata()`` reports: a definite value or "unknown".
current_values = st.sampled_from(["a", "b", "unknown"])


@settings(deadline=None)  # the first example imports FlashInfer
@given(
    st.fixed_dictionaries({name: saved_values for name in FLASHINFER_FIELDS}),
    st.fixed_dictionaries({name: current_values for name in FLASHINFER_FIELDS}),
)
def test_comparison_follows_flashinfer_load_configs_exactly(saved_raw: dict, current: dict) -> None:
    saved = {k: v for k, v in saved_raw.items() if v is not MISSING}
    fi_hard, fi_soft = _classify(saved, current)

    stored = Fingerprint.from_flashinfer_metadata(saved)
    running = Fingerprint.from_flashinfer_metadata(current)
    hard, soft = stored.mismatches(running)

    assert set(hard) == set(fi_hard)
    assert set(soft) == set(fi_soft)
    assert stored.serves(running) == (not fi_hard and not fi_soft)
    # and the _metadata an export writes for ``stored`` gets the same verdict
    ex_hard, ex_soft = _classify(stored.flashinfer_metadata(), current)
    assert (set(ex_hard), set(ex_soft)) == (set(fi_hard), set(fi_soft))


fingerprints = st.builds(
    Fingerprint,
    **{name: st.sampled_from(["a", "b", "*", "unknown"]) for name in ALL_FIELDS},
)


@given(fingerprints)
def test_a_fingerprint_serves_itself(fp: Fingerprint) -> None:
    assert fp.serves(fp)
    assert fp.mismatches(fp) == ({}, {})


@given(fingerprints, fingerprints)
def test_wildcard_and_serves_properties(stored: Fingerprint, current: Fingerprint) -> None:
    hard, soft = stored.mismatches(current)

    assert not set(hard) & set(soft)
    for name in ALL_FIELDS:
        if getattr(stored, name) == "*":
            assert name not in hard and name not in soft
    for name, (was, now) in {**hard, **soft}.items():
        assert (was, now) == (getattr(stored, name), getattr(current, name))
        assert (name in soft) == (was == "unknown")
    assert stored.serves(current) == (not hard and not soft)
    everything = Fingerprint(**{name: "*" for name in ALL_FIELDS})
    assert everything.serves(current)


@given(fingerprints, fingerprints)
def test_digest_is_identity(a: Fingerprint, b: Fingerprint) -> None:
    assert (a.digest == b.digest) == (a == b)
    assert len(a.digest) == 64 and a.short_digest == a.digest[:12]
    assert Fingerprint.from_dict(a.as_dict()) == a


#: Digests pinned as literals: a digest is a fingerprint's identity in every registry,
#: bundle and slice cache ever written, so it may never change. The H200 and B200 ones
#: are the digests stored in the frozen registries (``tests/data/registry-*.db``).
H200_DIGEST = "c3e0f3f376006cd05fcf241b303ab3c543cd84b972ea07ca9d72b4ab27a36e43"
B200_DIGEST = "edb632176e38f2adb827d1b8c171084fc88e8dbd5a6b15e434a622998bddcfb0"
H200_SM90_DIGEST = "7b6f9dd504daea6a8370e8b6cc73b911fd4897cbc34153c226364bdc27b514ed"
#: The H200 under FlashInfer's ``cold_l2=True`` measurement policy (frozen from 0010 on).
H200_COLD_DIGEST = "3dbd92f0b8dcae781d4a23a1cff852836fe6afbb64aef73ec12e8319bee8f305"
COLD_L2 = {"measure_cold_l2": "True"}
FROZEN = sorted((Path(__file__).parent / "data").glob("registry-*.db"))


def test_digest_is_pinned() -> None:
    h200 = Fingerprint.from_flashinfer_metadata(H200)
    b200 = Fingerprint.from_flashinfer_metadata({**H200, "gpu": "NVIDIA B200"})
    sm90 = Fingerprint(**H200, compute_capability="9.0", torch_version="2.9.1")

    assert (h200.digest, b200.digest, sm90.digest) == (H200_DIGEST, B200_DIGEST, H200_SM90_DIGEST)
    assert h200.short_digest == "c3e0f3f37600"
    # what it is: the sha256 of the fields' canonical JSON (sorted keys, no spaces)
    canonical = (
        '{"compute_capability":"9.0","cublas_version":"12.9.1","cuda_version":"12.9",'
        '"cudnn_frontend_version":"1.32.0","cudnn_version":"91002",'
        '"cutlass_dsl_version":"nvidia-cutlass-dsl==4.8.1","flashinfer_version":"0.7.2.post1",'
        '"gpu":"NVIDIA H200","torch_version":"2.9.1"}'
    )
    assert hashlib.sha256(canonical.encode()).hexdigest() == H200_SM90_DIGEST


@pytest.mark.parametrize("frozen", FROZEN, ids=[p.stem for p in FROZEN])
def test_the_frozen_registries_store_the_pinned_digests(frozen: Path) -> None:
    with closing(sqlite3.connect(f"file:{frozen}?mode=ro", uri=True)) as conn:
        rows = conn.execute("SELECT id, digest, gpu FROM fingerprints ORDER BY id").fetchall()

    cold = [(3, H200_COLD_DIGEST, "NVIDIA H200")] if frozen.name >= "registry-0010" else []
    assert rows == [(1, H200_DIGEST, "NVIDIA H200"), (2, B200_DIGEST, "NVIDIA B200"), *cold]


def test_a_measurement_policy_is_part_of_the_digest_and_the_default_changes_nothing() -> None:
    h200 = Fingerprint.from_flashinfer_metadata(H200)
    cold = h200.with_measurement(COLD_L2)

    assert (h200.with_measurement({}), h200.measurement) == (h200, "")
    assert h200.with_measurement({}).digest == H200_DIGEST
    assert cold.digest == H200_COLD_DIGEST
    assert (cold.measurement, cold.measurement_fields) == ('{"measure_cold_l2":"True"}', COLD_L2)
    assert cold.as_dict() == {**h200.as_dict(), "measurement": '{"measure_cold_l2":"True"}'}
    assert "measurement" not in h200.as_dict()
    # what it is: the sha256 of every field's canonical JSON, the policy one field more
    canonical = json.dumps(cold.as_dict(), sort_keys=True, separators=(",", ":"))
    assert hashlib.sha256(canonical.encode()).hexdigest() == H200_COLD_DIGEST
    # another policy is another FlashInfer environment (env_hash): never served across
    assert (h200.serves(cold), cold.serves(h200), cold.serves(cold)) == (False, False, True)
    assert cold.mismatches(h200)[0] == {"measurement": ('{"measure_cold_l2":"True"}', "")}
    assert Fingerprint.from_dict(cold.as_dict()) == cold


@pytest.mark.parametrize(
    "bad", ['{"cold_l2":"True"}', '{"measure_cold_l2": "True"}', "{}", "[1]", '{"measure_x":1}']
)
def test_a_measurement_that_is_not_canonical_measure_fields_is_refused(bad: str) -> None:
    with pytest.raises(FingerprintError, match="fingerprint field 'measurement'"):
        Fingerprint(**H200, measurement=bad)


@pytest.mark.parametrize("frozen", FROZEN, ids=[p.stem for p in FROZEN])
def test_importing_into_a_frozen_registry_reuses_its_fingerprint_row(
    frozen: Path, tmp_path: Path, cli, cache_file
) -> None:
    """A file written today with the H200's metadata lands on the H200 row stored by an
    older release: same fields, same digest, one fingerprint (no second row)."""
    copy = tmp_path / frozen.name
    shutil.copyfile(frozen, copy)
    key = (
        "('flashinfer::mm_fp4', 'CutlassFp4Runner', ((128, 4096), (4096, 2048)), "
        "(torch.bfloat16, 1))"
    )
    path = cache_file("today.json", {key: ["CutlassFp4Runner", 4]}, metadata=H200)

    from ficache import schema

    result = cli("import", path, db=copy)

    assert result.exit_code == 0
    # A file older than what this release reads as it is is upgraded by the write, which
    # says so; a newer one is written as it is, without a word.
    revision = frozen.name.removeprefix("registry-").removesuffix(".db")
    readable = schema.features_of(revision) is not None
    assert (result.stderr == "") is readable
    if not readable:
        assert result.stderr.startswith(f"note: upgraded registry {copy} from schema ")
    assert result.stdout.startswith("imported 1 entries from 1 file(s): 1 added")
    with closing(sqlite3.connect(copy)) as conn:
        fingerprints = conn.execute("SELECT id, digest FROM fingerprints ORDER BY id").fetchall()
        stored = conn.execute(
            "SELECT fingerprint_id, scope, tactic FROM entries WHERE key = ?", (key,)
        ).fetchall()
    cold = [(3, H200_COLD_DIGEST)] if frozen.name >= "registry-0010" else []
    assert fingerprints == [(1, H200_DIGEST), (2, B200_DIGEST), *cold]
    assert stored == [(1, "shared", "4")]


def test_from_flashinfer_metadata() -> None:
    fp = Fingerprint.from_flashinfer_metadata({**H200, "some_future_field": 3})

    assert fp.flashinfer_metadata() == H200
    assert list(fp.flashinfer_metadata()) == list(FLASHINFER_FIELDS)
    assert {name: getattr(fp, name) for name in EXTRA_FIELDS} == {
        "compute_capability": "*",
        "torch_version": "*",
    }


def test_metadata_of_wrong_type_is_refused() -> None:
    with pytest.raises(FingerprintError, match="'gpu' must be a string, got int"):
        Fingerprint.from_flashinfer_metadata({**H200, "gpu": 3})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({**H200, "colour": "red"}, "unknown fingerprint field"),
        ({k: v for k, v in H200.items() if k != "gpu"}, "missing field"),
        ({**H200, "gpu": ""}, "must be a non-empty string"),
        ({**H200, "gpu": "x" * 1001}, "must be a non-empty string"),
        ({**H200, "gpu": 7}, "must be a non-empty string"),
    ],
)
def test_from_dict_validates(values: dict, message: str) -> None:
    with pytest.raises(FingerprintError, match=message):
        Fingerprint.from_dict(values)


def test_collect_reports_flashinfer_metadata_and_extra_fields() -> None:
    from flashinfer.autotuner import _collect_metadata

    fp = collect()
    metadata = _collect_metadata()

    assert fp.flashinfer_metadata() == {name: str(metadata[name]) for name in FLASHINFER_FIELDS}
    assert fp.torch_version == str(torch.__version__)
    if not torch.cuda.is_available():
        assert fp.compute_capability == "unknown"
        assert fp.gpu == "unknown"
    assert collect() == fp
    # what this environment wrote, it is served (FlashInfer's own rule)
    assert Fingerprint.from_flashinfer_metadata(metadata).serves(fp)


def test_a_field_the_metadata_lacks_stays_missing() -> None:
    # Issue 23 bug 6: a missing field came back as "None", a value the file never had.
    for name in FLASHINFER_FIELDS:
        lacking = {k: v for k, v in H200.items() if k != name}
        fp = Fingerprint.from_flashinfer_metadata(lacking)
        assert fp.flashinfer_metadata() == lacking, name
        assert list(fp.flashinfer_metadata()) == [f for f in FLASHINFER_FIELDS if f != name]
        assert fp.reported()[name] is None
        # null reads as missing in FlashInfer (saved_meta.get(name) is None), and here
        assert Fingerprint.from_flashinfer_metadata({**H200, name: None}) == fp
    nothing = Fingerprint.from_flashinfer_metadata({})
    assert nothing.flashinfer_metadata() == {}
    # A stored "None" is a value some FlashInfer files hold: it stays.
    assert Fingerprint.from_flashinfer_metadata({**H200, "gpu": "None"}).flashinfer_metadata() == {
        **H200,
        "gpu": "None",
    }


def test_a_missing_field_serves_nothing() -> None:
    lacking = Fingerprint.from_flashinfer_metadata({k: v for k, v in H200.items() if k != "gpu"})
    running = Fingerprint.from_flashinfer_metadata(H200)
    cannot_tell = Fingerprint.from_flashinfer_metadata({**H200, "gpu": "unknown"})

    assert lacking.mismatches(running) == ({}, {"gpu": (MISSING_FIELD, "NVIDIA H200")})
    assert not lacking.serves(cannot_tell)


def test_metadata_holding_the_missing_marker_is_refused() -> None:
    with pytest.raises(FingerprintError, match="'gpu' holds '<missing>', which ficache reserves"):
        Fingerprint.from_flashinfer_metadata({**H200, "gpu": MISSING_FIELD})
