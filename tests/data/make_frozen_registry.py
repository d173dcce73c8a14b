"""Freeze a small registry at the current head revision, for upgrade tests.

Run once per schema revision, with the ficache release that adds it:

    python tests/data/make_frozen_registry.py

It writes ``tests/data/registry-<revision>.db`` through the public API (two
fingerprints, shared and rank-scoped entries, policies, nested tactics,
namespaced records from 0003 on, a FlashInfer 0.7.4 selection (a value's fourth element)
from 0004 on, start counts from 0008 on, a FlashInfer 0.7.4 protocol record (with a measurement
policy) in a fifth commit from 0009 on, the H200 environment under FlashInfer's ``cold_l2=True``
measurement policy (a fingerprint of its own, one entry and one protocol record) in a sixth
commit from 0010 on, and import, replace and prune commits), then pins times and hosts so the file is
reproducible, and leaves it as one self-contained file (no WAL).
``tests/test_schema.py`` copies each frozen file, upgrades it to head with the
current code and reads its data back through the API. ``tests/test_rolling_upgrade.py``
uses the previous two releases' files as they are (this code reads and writes them
without upgrading), on SQLite and, loaded into a database migrated to the same
revision, on PostgreSQL (``tests/frozen_registries.py``).
"""

from __future__ import annotations

import json
import sqlite3
import sys
import tempfile
from pathlib import Path

from ficache import schema
from ficache.fingerprint import Fingerprint
from ficache.flashinfer_format import parse_cache_bytes
from ficache.registry import Registry

FIELDS = {
    "flashinfer_version": "0.7.2.post1",
    "cuda_version": "12.9",
    "cublas_version": "12.9.1",
    "cudnn_version": "91002",
    "cudnn_frontend_version": "1.32.0",
    "cutlass_dsl_version": "nvidia-cutlass-dsl==4.8.1",
}
H200 = {**FIELDS, "gpu": "NVIDIA H200"}
B200 = {**FIELDS, "gpu": "NVIDIA B200"}
POLICY = ["cuda_graph_profile_replays", None, "l2_cache_policy", "hot"]


def key(m: int, extras: str = "(torch.bfloat16, 1)") -> str:
    return f"('flashinfer::mm_fp4', 'CutlassFp4Runner', (({m}, 4096), (4096, 2048)), {extras})"


#: FlashInfer ``_records`` of the frozen files (stored from revision 0003_records on).
RECORDS = {"trtllm_moe_da": {'{"num_tokens":16}': {"schema": 1, "bodies": [{"tile_n": 8}]}}}
#: How FlashInfer 0.7.4 chose the shared H200 m=16 entry (stored from 0004_selection on).
SELECTION = {"time_ms": 0.0123, "runner_up_ms": 0.0131, "margin": 0.065041, "candidates": 7}
#: FlashInfer 0.7.4 protocol records of the frozen files (from 0009_protocol_records on):
#: (namespace, key, value, policy JSON or None), in a fifth commit.
PROTOCOL_RECORDS = (
    ("moe_ep_megamoe", '{"tokens":128}', {"knobs": [4, 2], "ok": True}, None),
    ("moe_ep_megamoe", "", 7, json.dumps(POLICY, separators=(",", ":"))),
)
PROTOCOL_MESSAGE = "frozen protocol records"
#: The measurement policy of the sixth commit's fingerprint (from 0010 on):
#: ``MeasurementPolicy(cold_l2=True).manifest_fields()``.
COLD_L2 = {"measure_cold_l2": "True"}
COLD_L2_MESSAGE = "frozen cold_l2 environment"
RANK1_RECORDS = {"trtllm_moe_da": {'{"num_tokens":16}': {"schema": 1, "bodies": [{"tile_n": 16}]}}}


def cache(metadata: dict[str, str], entries: dict[str, list], records: dict | None = None) -> bytes:
    extra = {"_records": records} if records else {}
    return json.dumps({"_metadata": metadata, **extra, **entries}).encode()


def build(path: Path) -> None:
    with Registry.open(str(path)) as reg:
        # commit 1: H200 and B200 files in one import
        reg.import_cache(
            [
                (
                    "h200.json",
                    parse_cache_bytes(
                        cache(
                            H200,
                            {
                                key(16): [
                                    "CutlassFp4Runner",
                                    [3, [1, 2]],
                                    POLICY,
                                    *([SELECTION] if head_has_selection() else []),
                                ],
                                key(32): ["CutlassFp4Runner", 5],
                                key(64, '(torch.float8_e4m3fn, None, "it\'s")'): [
                                    "CutlassFp4Runner",
                                    -1,
                                ],
                            },
                            RECORDS,
                        )
                    ),
                ),
                ("b200.json", parse_cache_bytes(cache(B200, {key(16): ["CutlassFp4Runner", 7]}))),
            ]
        )
        # commit 2: rank-scoped entries of a tp2 layout, and one replaced shared entry
        reg.import_cache(
            [
                (
                    "tp2-rank1.json",
                    parse_cache_bytes(
                        cache(H200, {key(16): ["CutlassFp4Runner", 9]}, RANK1_RECORDS)
                    ),
                )
            ],
            scope="tp2/rank1",
        )
        reg.import_cache(
            [
                (
                    "h200-retuned.json",
                    parse_cache_bytes(cache(H200, {key(32): ["CutlassFp4Runner", 6]})),
                )
            ]
        )
        # commit 4: prune B200
        b200 = next(
            i.id
            for i in reg.fingerprints()
            if i.fingerprint == Fingerprint.from_flashinfer_metadata(B200)
        )
        reg.plan_prune(fingerprint_ids=[b200]).execute(reg)
        if head_has_protocol_records():  # commit 5: protocol records, shared, one with a policy
            from ficache.values import NewProtocolRecord

            h200 = Fingerprint.from_flashinfer_metadata(H200)
            reg.write(
                [],
                kind="import",
                message=PROTOCOL_MESSAGE,
                protocol_records=[
                    NewProtocolRecord(h200, ns, k, json.dumps(v, separators=(",", ":")), pol)
                    for ns, k, v, pol in PROTOCOL_RECORDS
                ],
            )
        if head_has_measurement():  # commit 6: the H200 environment under cold_l2
            from ficache.values import NewEntry, NewProtocolRecord

            cold = Fingerprint.from_flashinfer_metadata(H200).with_measurement(COLD_L2)
            reg.write(
                [NewEntry(cold, key(16), "CutlassFp4Runner", "4", None)],
                kind="import",
                message=COLD_L2_MESSAGE,
                protocol_records=[NewProtocolRecord(cold, "moe_ep_megamoe", "", "8", None)],
            )
    conn = sqlite3.connect(path)
    with conn:
        conn.execute(
            "UPDATE commits SET created_at = 1767225600 + id, host = 'frozen-host', user = 'frozen'"
        )
        conn.execute("UPDATE entries SET updated_at = 1767225600 + commit_id")
        if head_has_records():
            conn.execute(
                "UPDATE records SET updated_at = 1767225600 + commit_id, "
                "tuned_at = 1767225600 + commit_id"
            )
        if head_has_protocol_records():
            conn.execute(
                "UPDATE protocol_records SET updated_at = 1767225600 + commit_id, "
                "tuned_at = 1767225600 + commit_id"
            )
        conn.execute("UPDATE fingerprints SET created_at = 1767225600")
        if head_has_start_counts():  # the H200 fingerprint served 5 starts, 2 of them replays
            conn.execute(
                "UPDATE fingerprints SET last_served_at = 1767225610, served_starts = 5, "
                "replay_starts = 2, replay_misses = 3 WHERE gpu = 'NVIDIA H200'"
                + (" AND measurement IS NULL" if head_has_measurement() else "")
            )
    conn.execute("PRAGMA journal_mode = DELETE")
    conn.execute("VACUUM")
    conn.close()


def head_has_records() -> bool:
    return any(rev == "0003_records" for rev, _down, _title in schema.history())


def head_has_selection() -> bool:
    return any(rev == "0004_selection" for rev, _down, _title in schema.history())


def head_has_protocol_records() -> bool:
    return any(rev == "0009_protocol_records" for rev, _down, _title in schema.history())


def head_has_measurement() -> bool:
    return any(rev == "0010_measurement_fingerprints" for rev, _d, _t in schema.history())


def head_has_start_counts() -> bool:
    return any(rev == "0008_start_counts" for rev, _down, _title in schema.history())


def main() -> None:
    head = schema.head_revision()
    target = Path(__file__).resolve().parent / f"registry-{head}.db"
    if target.exists():
        sys.exit(f"{target} exists; a frozen registry is made once, for a new revision")
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp) / "registry.db"
        build(tmp_path)
        target.write_bytes(tmp_path.read_bytes())
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
