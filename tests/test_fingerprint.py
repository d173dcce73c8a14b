"""Fingerprints: collecting the environment and FlashInfer's matching rules."""

from __future__ import annotations

import hashlib
import json

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


def test_digest_is_sha256_of_canonical_fields() -> None:
    fp = Fingerprint.from_flashinfer_metadata(H200)

    canonical = json.dumps(fp.as_dict(), sort_keys=True, separators=(",", ":"))
    assert fp.digest == hashlib.sha256(canonical.encode()).hexdigest()


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
