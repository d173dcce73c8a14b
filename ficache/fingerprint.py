"""Fingerprints: the hardware and software environment a tactic is valid for.

A ``Fingerprint`` holds FlashInfer's own cache metadata fields
(``flashinfer.autotuner._collect_metadata()``) plus two fields FlashInfer
does not check but a tactic depends on: the GPU's compute capability and the
torch version.

Invariants:
- Comparison follows FlashInfer's ``load_configs`` exactly: a stored value
  serves the running environment when it is equal or the wildcard ``"*"``.
  Otherwise a stored ``"unknown"`` (or a field missing from an old file) is
  a *soft* mismatch (not served, may be replaced) and anything else *hard*.
  As in FlashInfer, ``"unknown"`` equals ``"unknown"``: an environment that
  cannot tell a field is served what was tuned where it could not tell
  either (a CPU-only run, say), and never what was tuned elsewhere.
- ``digest`` is a pure function of the field values; two fingerprints with
  the same fields are the same fingerprint everywhere (files, registries,
  ranks).
- ``measurement`` is the measurement policy a FlashInfer v2 store keeps its
  entries under (the manifest's ``measure_*`` fields, ``MeasurementPolicy.
  manifest_fields()``), as canonical JSON, ``""`` for the default policy.
  FlashInfer makes it part of a store environment's identity (its
  ``env_hash``), so ficache makes it part of the fingerprint's: entries tuned
  under two policies in one environment are two fingerprints, stored, merged
  and exported apart, and a fingerprint serves only a start under its own
  policy. The default policy leaves ``digest``, ``as_dict()`` and every file
  as they were before the field existed (a v1 file has no policy of its own:
  its fingerprint is the default's). Stored in ``fingerprints.measurement``
  (``0010_measurement_fingerprints``; NULL for the default).
- Collecting never raises for a missing GPU or library: the field becomes
  ``"unknown"``. Only an unimportable FlashInfer is an error.
- A FlashInfer field a file's ``_metadata`` lacks (or holds as null, which
  FlashInfer reads the same way) is stored as ``MISSING`` and stays missing:
  ``flashinfer_metadata()`` leaves it out, so an export gives back the
  ``_metadata`` the file had, never a value it did not hold. Like a missing
  field in FlashInfer it is a soft mismatch, never served. ``MISSING`` is a
  non-empty string on purpose: the fingerprint columns are NOT NULL and
  ficache releases that share the schema reject an empty field, so an empty
  string would make every older reader of a shared registry fail. A file
  whose ``_metadata`` holds ``MISSING`` itself is refused.
- A stored ``"None"`` (FlashInfer's marker for a null that an old writer
  stringified, and what ficache before ``MISSING`` stored for a missing
  field) is a value: exported as ``"None"``, because which of the three a
  past import saw is not recorded, and FlashInfer reads all three alike.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from functools import cached_property

from ficache.errors import FingerprintError

WILDCARD = "*"
UNKNOWN = "unknown"
#: A FlashInfer field the file's ``_metadata`` lacked (or held as null): never written back.
MISSING = "<missing>"
# Values a writer records when it could not tell (FlashInfer's own list), and a missing field.
INDETERMINATE = (None, UNKNOWN, "None", MISSING)
#: How a table shows a missing field.
MISSING_SHOWN = "-"

#: FlashInfer's ``_metadata`` fields, in the order FlashInfer writes them.
FLASHINFER_FIELDS = (
    "flashinfer_version",
    "cuda_version",
    "cublas_version",
    "cudnn_version",
    "cudnn_frontend_version",
    "cutlass_dsl_version",
    "gpu",
)
#: Fields ficache adds; absent from FlashInfer files, where they mean "any".
EXTRA_FIELDS = ("compute_capability", "torch_version")
ALL_FIELDS = FLASHINFER_FIELDS + EXTRA_FIELDS


#: The field naming the measurement policy (not one of ``ALL_FIELDS``: not a column of
#: every table that shows a fingerprint, and absent from ``as_dict()`` when default).
MEASUREMENT_FIELD = "measurement"
MEASURE_PREFIX = "measure_"


def measurement_json(measurement: Mapping[str, object]) -> str:
    """The canonical text of a measurement policy's manifest fields ("" when none)."""
    if not measurement:
        return ""
    return json.dumps(
        {str(k): str(v) for k, v in measurement.items()}, sort_keys=True, separators=(",", ":")
    )


def _check_measurement(text: object) -> None:
    if text == "":
        return
    problem = None
    if not isinstance(text, str) or len(text) > 1000:
        problem = "must be a string of at most 1000 characters"
    else:
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not (
            isinstance(value, dict)
            and value
            and all(isinstance(k, str) and k.startswith(MEASURE_PREFIX) for k in value)
            and all(isinstance(v, str) for v in value.values())
            and measurement_json(value) == text
        ):
            problem = "must be the canonical JSON object of measure_* string fields, or empty"
    if problem:
        raise FingerprintError(f"fingerprint field 'measurement' {problem}, got {text!r:.80}")


@dataclass(frozen=True, order=True)
class Fingerprint:
    flashinfer_version: str
    cuda_version: str
    cublas_version: str
    cudnn_version: str
    cudnn_frontend_version: str
    cutlass_dsl_version: str
    gpu: str
    compute_capability: str = WILDCARD
    torch_version: str = WILDCARD
    #: The measurement policy's ``measure_*`` manifest fields, canonical JSON; "": default.
    measurement: str = ""

    def __post_init__(self) -> None:
        _check_measurement(self.measurement)
        for f in fields(self):
            if f.name == MEASUREMENT_FIELD:
                continue
            value = getattr(self, f.name)
            if not isinstance(value, str) or not value or len(value) > 1000:
                raise FingerprintError(
                    f"fingerprint field {f.name!r} must be a non-empty string "
                    f"of at most 1000 characters, got {value!r:.80}"
                )

    @cached_property
    def digest(self) -> str:
        """SHA-256 over the canonical JSON of all fields (stable identity); computed once per
        object (the fields are frozen), since a start asks for it several times."""
        canonical = json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    @property
    def short_digest(self) -> str:
        return self.digest[:12]

    def as_dict(self) -> dict[str, str]:
        """Every field; ``measurement`` only when it is not the default policy's."""
        values = asdict(self)
        if not self.measurement:
            del values[MEASUREMENT_FIELD]
        return values

    @property
    def measurement_fields(self) -> dict[str, str]:
        """The measurement policy's manifest fields (empty: the default policy)."""
        return dict(json.loads(self.measurement)) if self.measurement else {}

    def with_measurement(self, measurement: Mapping[str, str]) -> Fingerprint:
        """This environment under the measurement policy whose manifest fields are
        ``measurement`` (empty: the default policy)."""
        return replace(self, measurement=measurement_json(measurement))

    def flashinfer_metadata(self) -> dict[str, str]:
        """The ``_metadata`` object FlashInfer expects in a cache file (missing fields left out)."""
        return {
            name: value for name in FLASHINFER_FIELDS if (value := getattr(self, name)) != MISSING
        }

    def reported(self) -> dict[str, str | None]:
        """All fields as JSON reports give them: a missing field is ``None`` (null)."""
        return {name: None if value == MISSING else value for name, value in self.as_dict().items()}

    @classmethod
    def from_dict(cls, values: Mapping[str, object]) -> Fingerprint:
        unknown = set(values) - set(ALL_FIELDS) - {MEASUREMENT_FIELD}
        if unknown:
            raise FingerprintError(
                f"unknown fingerprint field(s) {sorted(unknown)}; expected {list(ALL_FIELDS)}"
            )
        missing = [n for n in FLASHINFER_FIELDS if n not in values]
        if missing:
            raise FingerprintError(f"fingerprint is missing field(s) {missing}")
        return cls(**{k: v for k, v in values.items()})  # type: ignore[arg-type]

    @classmethod
    def from_flashinfer_metadata(cls, metadata: Mapping[str, object]) -> Fingerprint:
        """The fingerprint a FlashInfer file's ``_metadata`` describes.

        FlashInfer fields missing from an old file, or recorded as null
        (FlashInfer reads both as ``saved_meta.get(name) is None``), become
        ``MISSING``: never served, not even to a running ``"unknown"``
        (mapping them to ``"unknown"`` would serve them there), and left out
        again by ``flashinfer_metadata()``. The fields FlashInfer does not
        record become the wildcard, because FlashInfer never checked them
        when it served the file.
        """
        reserved = [n for n in ALL_FIELDS if metadata.get(n) == MISSING]
        if reserved:
            name = reserved[0]
            raise FingerprintError(
                f"_metadata field {name!r} holds {MISSING!r}, which ficache reserves for a "
                "field a file lacks; remove the field or give its real value"
            )
        values: dict[str, str] = {}
        for name in FLASHINFER_FIELDS:
            raw = metadata.get(name)
            if raw is None:
                values[name] = MISSING
            elif isinstance(raw, str):
                values[name] = raw
            else:
                raise FingerprintError(
                    f"_metadata field {name!r} must be a string, got {type(raw).__name__}"
                )
        for name in EXTRA_FIELDS:
            raw = metadata.get(name, WILDCARD)
            values[name] = raw if isinstance(raw, str) and raw else WILDCARD
        return cls(**values)

    def mismatches(
        self, current: Fingerprint
    ) -> tuple[dict[str, tuple[str, str]], dict[str, tuple[str, str]]]:
        """Split the fields where ``self`` (stored) fails to serve ``current``.

        Returns ``(hard, soft)``, each ``field -> (stored, current)``.
        """
        hard: dict[str, tuple[str, str]] = {}
        soft: dict[str, tuple[str, str]] = {}
        if self.measurement != current.measurement:
            # Another measurement policy is another FlashInfer environment (``env_hash``).
            hard[MEASUREMENT_FIELD] = (self.measurement, current.measurement)
        for name in ALL_FIELDS:
            stored, running = getattr(self, name), getattr(current, name)
            if stored in (running, WILDCARD):
                continue
            (soft if stored in INDETERMINATE else hard)[name] = (stored, running)
        return hard, soft

    def serves(self, current: Fingerprint) -> bool:
        """True when entries stored under ``self`` may be used by ``current``."""
        hard, soft = self.mismatches(current)
        return not hard and not soft

    @property
    def wildcards(self) -> int:
        """How many fields are the wildcard (match any environment)."""
        return sum(getattr(self, name) == WILDCARD for name in ALL_FIELDS)

    @property
    def flashinfer_fields(self) -> tuple[str, ...]:
        """The fields FlashInfer records (``FLASHINFER_FIELDS``), as a FlashInfer file's
        ``_metadata`` and an export of this fingerprint hold them."""
        return tuple(getattr(self, name) for name in FLASHINFER_FIELDS)


def serving_order(stored_id: int, stored: Fingerprint) -> tuple[int, int]:
    """The sort key of the stored fingerprints that serve one environment: the one first
    in this order serves it (its value of a key wins), the others fill in keys it lacks.

    Exact fields over wildcards (fewer ``*`` first: an exact match has none), then the
    newest (the larger id).
    """
    return (stored.wildcards, -stored_id)


def shown(value: str) -> str:
    """A field's value as a table shows it: a missing field is ``-``."""
    return MISSING_SHOWN if value == MISSING else value


def collect() -> Fingerprint:
    """The running process's fingerprint (imports torch and FlashInfer)."""
    try:
        import torch
        from flashinfer import autotuner
    except ImportError as exc:  # pragma: no cover - both are dependencies
        raise FingerprintError(
            f"cannot import FlashInfer to collect the environment ({exc}); "
            "install flashinfer-python"
        ) from exc
    collect_metadata = getattr(autotuner, "_collect_metadata", None)
    if collect_metadata is not None:
        metadata = dict(collect_metadata())
    else:  # pragma: no cover - FlashInfer releases before cache metadata
        metadata = {"flashinfer_version": getattr(autotuner, "__version__", UNKNOWN)}
    try:
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(torch.cuda.current_device())
            capability = f"{major}.{minor}"
        else:
            capability = UNKNOWN
    except Exception:  # noqa: BLE001 - any driver failure means "cannot tell"
        capability = UNKNOWN
    values = {name: str(metadata.get(name) or UNKNOWN) for name in FLASHINFER_FIELDS}
    values["compute_capability"] = capability
    values["torch_version"] = str(torch.__version__)
    return Fingerprint(**values)
