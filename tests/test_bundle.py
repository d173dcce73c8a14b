"""Bundles: ``export --bundle`` and ``import`` of a bundle through the CLI on real
SQLite files, reproducible bytes, and every damaged, truncated, foreign or
hostile bundle refused with one line and the registry unchanged."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from samples import NO_DUPLICATES, SHORT_H200_METADATA

from ficache.bundle import (
    MAGIC,
    MAX_PAYLOAD_BYTES,
    Bundle,
    is_bundle,
    parse_bundle_bytes,
    read_bundle,
    render_bundle,
)
from ficache.errors import BundleError, CacheFileError
from ficache.fingerprint import Fingerprint
from ficache.flashinfer_format import read_cache_file
from ficache.protocol_records import NewProtocolRecord, stored_protocol_records
from ficache.registry import NewEntry, Registry

META = SHORT_H200_METADATA
B200 = {**META, "gpu": "NVIDIA B200"}
FP_H200 = Fingerprint.from_flashinfer_metadata(META)
FP_B200 = Fingerprint.from_flashinfer_metadata(B200)
FP_L40S = Fingerprint.from_flashinfer_metadata({**META, "gpu": "L40S"})
POLICY = ["cuda_graph_profile_replays", None]
K16 = "('mm', 'Runner', ((16, 64),), (torch.bfloat16,))"
K32 = "('mm', 'Runner', ((32, 64),), (torch.bfloat16,))"
AGAIN = "copy it again or export it again with `ficache export --bundle`"


def one_error_line(result: Any, message: str) -> None:
    assert result.stderr == f"error: {message}\n"
    assert result.stdout == ""
    assert result.exit_code == 1


def wrote(path: Path, entries: int, fingerprints: int) -> str:
    data = path.read_bytes()
    return (
        f"wrote bundle {path}: {entries} entries of {fingerprints} fingerprint(s), "
        f"{len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()}\n"
    )


def frame(payload: bytes, version: int = 1) -> bytes:
    """A bundle file around ``payload`` with a correct size and checksum."""
    checksum = hashlib.sha256(payload).hexdigest()
    return b"ficache-bundle %d %d sha256=%s\n" % (version, len(payload), checksum.encode())


def split(data: bytes) -> tuple[bytes, bytes]:
    header, _, payload = data.partition(b"\n")
    return header + b"\n", payload


def reframed(data: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    """``data``'s payload edited as JSON, framed with a correct checksum."""
    top = json.loads(split(data)[1])
    edit(top)
    payload = json.dumps(top, sort_keys=True, separators=(",", ":")).encode() + b"\n"
    return frame(payload) + payload


@pytest.fixture
def source(cli, cache_file, registry_path: Path, created_note) -> Path:
    """A registry with fingerprint 1 (H200: two shared, one tp2/rank1 entry) and
    fingerprint 2 (B200: one shared entry)."""
    h200 = cache_file(
        "h200.json", {K16: ["Runner", [1, [2, 3]], POLICY], K32: ["Runner", 4]}, metadata=META
    )
    b200 = cache_file("b200.json", {K16: ["Runner", 7]}, metadata=B200)
    rank1 = cache_file("rank1.json", {K32: ["Runner", 5]}, metadata=META)
    notes = [created_note(registry_path), ""]
    for args, note in zip(
        (("import", h200, b200), ("import", "--scope", "tp2/rank1", rank1)), notes, strict=True
    ):
        result = cli(*args)
        assert (result.exit_code, result.stderr) == (0, note)
    return registry_path


@pytest.fixture
def bundle_file(cli, source: Path, tmp_path: Path) -> Path:
    path = tmp_path / "all.bundle"
    assert cli("export", "--bundle", path, "--all").exit_code == 0
    return path


@pytest.fixture
def target(cli, cache_file, tmp_path: Path) -> Path:
    """A second registry holding one unrelated entry (commit 1)."""
    db = tmp_path / "target.db"
    other = cache_file("other.json", {K16: ["Runner", 1]}, metadata={**META, "gpu": "L40S"})
    assert cli("import", other, db=db).exit_code == 0
    return db


def stored(db: Path) -> list[tuple[Any, ...]]:
    """Every entry as (digest, scope, key, runner, tactic, policy, tuned_at, selection)."""
    with Registry.open(str(db), create=False) as reg:
        digests = {i.id: i.fingerprint.digest for i in reg.fingerprints()}
        return sorted((digests[r[0]], *r[1:]) for r in reg.entry_values(sorted(digests)))


# -- export ------------------------------------------------------------------------------


def test_export_one_fingerprint(cli, source: Path, tmp_path: Path) -> None:
    path = tmp_path / "h200.bundle"

    result = cli("export", "--bundle", path, "--fingerprint", "1")

    assert (result.exit_code, result.stderr) == (0, "")
    assert result.stdout == wrote(path, 3, 1)
    bundle = read_bundle(path)
    assert bundle.format_version == 1
    assert bundle.digest == hashlib.sha256(path.read_bytes()).hexdigest()
    assert bundle.fingerprints == (FP_H200,)
    assert [(e.scope, e.key, e.runner, e.tactic_json, e.policy_json) for e in bundle.entries] == [
        ("shared", K16, "Runner", "[1,[2,3]]", '["cuda_graph_profile_replays",null]'),
        ("shared", K32, "Runner", "4", None),
        ("tp2/rank1", K32, "Runner", "5", None),
    ]
    assert bundle.records == {}
    assert bundle.provenance["entries"] == 3
    assert bundle.provenance["fingerprints"][FP_H200.digest]["scopes"] == {
        "shared": 2,
        "tp2/rank1": 1,
    }
    assert bundle.provenance["fingerprints"][FP_H200.digest]["ops"] == {"mm": 3}


def test_export_several_fingerprints_equals_all(cli, source: Path, tmp_path: Path) -> None:
    several, everything = tmp_path / "several.bundle", tmp_path / "all.bundle"
    digest_prefix = FP_B200.digest[:8]

    first = cli("export", "--bundle", several, "--fingerprint", "1", "--fingerprint", digest_prefix)
    second = cli("export", "--bundle", everything, "--all")

    assert (first.exit_code, first.stdout) == (0, wrote(several, 4, 2))
    assert (second.exit_code, second.stdout) == (0, wrote(everything, 4, 2))
    assert several.read_bytes() == everything.read_bytes()
    assert read_bundle(everything).fingerprints == tuple(
        sorted((FP_H200, FP_B200), key=lambda fp: fp.digest)
    )


def test_two_exports_give_identical_bytes(cli, source: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "a.bundle", tmp_path / "b.bundle"

    cli("export", "--bundle", a, "--all")
    cli("export", "--bundle", b, "--all")

    assert a.read_bytes() == b.read_bytes()


def test_round_trip_through_a_new_registry_gives_identical_bytes(
    cli, bundle_file: Path, tmp_path: Path
) -> None:
    fresh, again = tmp_path / "fresh.db", tmp_path / "again.bundle"

    imported = cli("import", bundle_file, db=fresh)
    exported = cli("export", "--bundle", again, "--all", db=fresh)

    assert imported.stdout == (
        "imported 4 entries from 1 bundle(s): 4 added, 0 replaced, 0 unchanged (commit 1)\n"
    )
    assert exported.stdout == wrote(again, 4, 2)
    assert again.read_bytes() == bundle_file.read_bytes()


def test_registries_with_different_histories_export_identical_bytes(cli, tmp_path: Path) -> None:
    final = [
        NewEntry(FP_H200, K16, "Runner", "[1,[2,3]]", None, "shared", None, 1000.25),
        NewEntry(FP_H200, K32, "Runner", "4", None, "tp2/rank0", None, 2000.5),
        NewEntry(FP_B200, K16, "Runner", "7", '["x",1]', "shared", None, 3000.0),
    ]
    one, two = tmp_path / "one.db", tmp_path / "two.db"
    with Registry.open(str(one)) as reg:
        reg.write(final, kind="import")
    with Registry.open(str(two)) as reg:  # other ids, other commits, a replaced value
        reg.write([final[2]], kind="startup")
        reg.write(
            [NewEntry(FP_H200, K16, "Runner", "9", None, "shared", None, 5.0), final[1]],
            kind="merge",
        )
        reg.write([final[0]], kind="import")
    a, b = tmp_path / "a.bundle", tmp_path / "b.bundle"

    cli("export", "--bundle", a, "--all", db=one)
    cli("export", "--bundle", b, "--all", db=two)

    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() == render_bundle(reversed(final))


def test_export_leaves_out_fingerprints_without_entries(cli, source: Path, tmp_path: Path) -> None:
    with Registry.open(str(source)) as reg:
        reg.plan_prune(fingerprint_ids=[2]).execute(reg)
    path = tmp_path / "x.bundle"

    everything = cli("export", "--bundle", path, "--all")
    empty = cli("export", "--bundle", tmp_path / "empty.bundle", "--fingerprint", "2")

    assert everything.stdout == wrote(path, 3, 1)
    one_error_line(
        empty, "no entries to bundle in the selected fingerprints; see `ficache fingerprints`"
    )
    assert not (tmp_path / "empty.bundle").exists()


def test_export_bundle_to_dash_is_standard_output(
    cli, source: Path, bundle_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)

    result = cli("export", "--bundle", "-", "--all")

    assert result.exit_code == 0
    assert result.stdout_bytes == bundle_file.read_bytes()
    assert result.stderr == wrote(bundle_file, 4, 2).replace(str(bundle_file), "standard output")
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize(("mask", "expected"), [(0o022, 0o644), (0o077, 0o600)], ids=oct)
def test_a_new_bundle_follows_the_umask(
    cli, source: Path, tmp_path: Path, umask: Callable[[int], int], mask: int, expected: int
) -> None:
    path = tmp_path / "image" / "all.bundle"
    umask(mask)

    assert cli("export", "--bundle", path, "--all").exit_code == 0

    assert stat.S_IMODE(path.stat().st_mode) == expected


def test_a_replaced_bundle_keeps_its_mode_and_its_link(
    cli, source: Path, tmp_path: Path, umask: Callable[[int], int]
) -> None:
    real = tmp_path / "real.bundle"
    real.write_bytes(b"an older bundle")
    real.chmod(0o640)
    link = tmp_path / "link.bundle"
    link.symlink_to(real.name)
    umask(0o077)

    result = cli("export", "--bundle", link, "--all")

    assert (result.exit_code, result.stdout) == (0, wrote(link, 4, 2))
    assert (link.is_symlink(), os.readlink(link)) == (True, real.name)
    assert read_bundle(real).entries
    assert stat.S_IMODE(real.stat().st_mode) == 0o640
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_export_bundle_errors(cli, source: Path, tmp_path: Path) -> None:
    path = tmp_path / "x.bundle"

    one_error_line(
        cli("export", "--bundle", path, "--fingerprint", "9"),
        "no fingerprint '9' in the registry; see `ficache fingerprints`",
    )
    for args in (
        ("export", "--bundle", path),
        ("export", "--bundle", path, "--all", "--fingerprint", "1"),
        ("export", "--bundle", path, "--fingerprint", "current"),
        ("export", "--bundle", path, "--all", "--scope", "tp2/rank1"),
        ("export", "--bundle", path, "--all", "-o", tmp_path / "y.json"),
        ("export", "--all", "--fingerprint", "1"),
        ("export", "--fingerprint", "1", "--fingerprint", "2"),
    ):
        result = cli(*args)
        assert result.exit_code == 2, args
        assert "Usage: ficache export" in result.output
    assert not path.exists()


def test_export_bundle_never_creates_a_registry(cli, tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"

    result = cli("export", "--bundle", tmp_path / "x.bundle", "--all", db=missing)

    assert result.exit_code == 1
    assert not missing.exists()


# -- import ------------------------------------------------------------------------------


def test_import_keeps_scopes_and_tuned_at(
    cli, source: Path, bundle_file: Path, target: Path
) -> None:
    result = cli("import", bundle_file, db=target)

    assert result.stdout == (
        "imported 4 entries from 1 bundle(s): 4 added, 0 replaced, 0 unchanged (commit 2)\n"
    )
    theirs = [row for row in stored(target) if row[0] != FP_L40S.digest]
    assert theirs == stored(source)
    assert {row[1] for row in theirs} == {"shared", "tp2/rank1"}


def test_two_bundles_holding_one_key_differently_follow_on_conflict_and_dry_run(
    cli, cache_file, bundle_file: Path, target: Path, tmp_path: Path, dump_db
) -> None:
    other_db, other = tmp_path / "other.db", tmp_path / "other.bundle"
    retuned = cache_file("retuned.json", {K16: ["Runner", 99]}, metadata=META)
    assert cli("import", retuned, db=other_db).exit_code == 0
    assert cli("export", "--bundle", other, "--all", db=other_db).exit_code == 0
    before, file_bytes = dump_db(target), target.read_bytes()

    planned = cli("import", bundle_file, other, "--dry-run", db=target)

    assert (planned.exit_code, planned.stdout) == (
        0,
        "would import 5 entries from 2 bundle(s): 4 added, 0 replaced, 0 unchanged, "
        "0 duplicates, 1 conflicts (dry run: nothing changed)\n",
    )
    assert (dump_db(target), target.read_bytes()) == (before, file_bytes)
    refused = cli("import", bundle_file, other, "--on-conflict", "fail", db=target)
    assert (refused.exit_code, refused.stdout) == (1, "")
    assert refused.stderr.startswith(
        f'error: {bundle_file} and {other} hold different values for entry "{K16}"'
    )
    assert dump_db(target) == before

    done = cli("import", bundle_file, other, "--on-conflict", "theirs", db=target)

    assert done.stdout.endswith("0 duplicates, 1 conflicts (commit 2)\n")
    h200 = Fingerprint.from_flashinfer_metadata(META).digest
    assert [row[4] for row in stored(target) if row[:3] == (h200, "shared", K16)] == ["99"]


def test_import_twice_makes_one_commit_naming_the_bundle(
    cli, bundle_file: Path, target: Path, dump_db
) -> None:
    first = cli("import", bundle_file, db=target)
    after_first = dump_db(target)
    second = cli("import", bundle_file, "--format", "json", db=target)

    assert first.exit_code == 0
    assert json.loads(second.stdout) == {
        "files": 1,
        "entries": 4,
        "commit": None,
        "added": 0,
        "replaced": 0,
        "unchanged": 4,
        "records": 0,
        "records_added": 0,
        "records_replaced": 0,
        "records_unchanged": 0,
        **NO_DUPLICATES,
    }
    assert dump_db(target) == after_first
    with Registry.open(str(target), create=False) as reg:
        newest = reg.log()[0]
    assert (newest.id, newest.kind, newest.message, newest.added) == (
        2,
        "import",
        str(bundle_file),
        4,
    )
    assert newest.provenance == {
        "bundles": [
            {
                "digest": hashlib.sha256(bundle_file.read_bytes()).hexdigest(),
                "entries": 4,
                "format_version": 1,
                "records": 0,
            }
        ]
    }


def test_import_recognises_content_not_names(
    cli, bundle_file: Path, cache_file, tmp_path: Path
) -> None:
    named_json = tmp_path / "bundle.json"
    named_json.write_bytes(bundle_file.read_bytes())
    named_bundle = cache_file("cache.bundle", {K32: ["Runner", 8]}, metadata=META)

    as_bundle = cli("import", named_json, db=tmp_path / "a.db")
    as_cache = cli("import", named_bundle, db=tmp_path / "b.db")

    assert as_bundle.stdout.startswith("imported 4 entries from 1 bundle(s)")
    assert as_cache.stdout.startswith("imported 1 entries from 1 file(s)")
    assert not is_bundle(named_bundle)
    assert is_bundle(named_json)


def test_records_are_read_and_imported(cli, target: Path, tmp_path: Path, dump_db) -> None:
    path = tmp_path / "records.bundle"
    records = {FP_H200.digest: {"shared": {"trtllm_moe_da": {"k1": [1, 2], "k2": {"a": None}}}}}
    path.write_bytes(
        render_bundle(
            [NewEntry(FP_B200, K16, "Runner", "3", None, "shared", None, 10.0)],
            records,
            fingerprints=[FP_H200],
        )
    )

    bundle = read_bundle(path)
    result = cli("import", path, db=target)

    assert bundle.records == records
    assert bundle.fingerprints == tuple(sorted((FP_H200, FP_B200), key=lambda fp: fp.digest))
    assert bundle.provenance["records"] == 2
    assert result.stdout == (
        "imported 1 entries and 2 records from 1 bundle(s): 1 added, 0 replaced, 0 unchanged; "
        "records 2 added, 0 replaced, 0 unchanged (commit 2)\n"
    )
    assert result.stderr == ""
    with Registry.open(str(target), create=False) as reg:
        h200 = next(i.id for i in reg.fingerprints() if i.fingerprint == FP_H200)
        assert reg.slice_records([h200], ["shared"]) == {
            "trtllm_moe_da": {"k1": "[1,2]", "k2": '{"a":null}'}
        }


#: Protocol records a version 3 bundle carries (H200 only: a fingerprint they alone use).
PROTOCOL = (
    NewProtocolRecord(FP_H200, "moe_ep_megamoe", "", "7", '["cuda_graph",null]', "shared", 5.0),
    NewProtocolRecord(
        FP_H200, "moe_ep_megamoe", '{"tokens":128}', '{"knobs":[4,2]}', None, "shared", 6.0
    ),
)


def test_a_bundle_without_protocol_records_is_written_as_before(tmp_path: Path) -> None:
    """No protocol record: the bytes of format version 1 exactly, as an older ficache wrote
    them (the frozen digest below), read back with no protocol records."""
    path = tmp_path / "all.bundle"
    entries = [
        NewEntry(
            FP_H200,
            K16,
            "Runner",
            "[1,[2,3]]",
            '["cuda_graph_profile_replays",null]',
            "shared",
            None,
            1.0,
        ),
        NewEntry(FP_B200, K32, "Runner", "4", None, "tp2/rank1", None, 2.0),
    ]
    records = {FP_H200.digest: {"shared": {"trtllm_moe_da": {"k": [1]}}}}
    data = render_bundle(entries, records)
    path.write_bytes(data)

    assert data.startswith(b"ficache-bundle 1 ")
    assert b"protocol_records" not in data
    assert render_bundle(entries, records, protocol_records=()) == data
    # The digest main's ficache (10ff7fe, before format version 3) renders for this content.
    assert hashlib.sha256(data).hexdigest() == (
        "aa57cb2a67c920aff253c41e912aae62df5b4e10db4347864f0d8abb8216610a"
    )
    assert read_bundle(path).protocol_records == ()


def test_protocol_records_travel_in_a_version_3_bundle(
    cli, target: Path, tmp_path: Path, dump_db
) -> None:
    path, again = tmp_path / "protocol.bundle", tmp_path / "again.bundle"
    entries = [NewEntry(FP_B200, K16, "Runner", "3", None, "shared", None, 10.0)]
    path.write_bytes(render_bundle(entries, protocol_records=reversed(PROTOCOL)))

    bundle = read_bundle(path)
    result = cli("import", path, db=target)
    second = cli("import", path, db=target)
    fresh = tmp_path / "fresh.db"
    assert cli("import", path, db=fresh).exit_code == 0
    exported = cli("export", "--bundle", again, "--all", db=fresh)

    assert bundle.format_version == 3
    assert bundle.protocol_records == PROTOCOL
    assert bundle.provenance["protocol_records"] == 2
    assert result.stdout == (
        "imported 1 entries and 2 protocol records from 1 bundle(s): 1 added, 0 replaced, "
        "0 unchanged; protocol records 2 added, 0 replaced, 0 unchanged (commit 2)\n"
    )
    assert second.stdout.endswith(
        "protocol records 0 added, 0 replaced, 2 unchanged (nothing new, no commit)\n"
    )
    with Registry.open(str(target), create=False) as reg, reg.engine.connect() as conn:
        assert [
            (r.scope, r.namespace, r.key, r.value_json, r.policy_json, r.tuned_at)
            for r in stored_protocol_records(conn)
        ] == [
            (p.scope, p.namespace, p.key, p.value_json, p.policy_json, p.tuned_at) for p in PROTOCOL
        ]
    # a registry holding them exports the same bundle again, byte for byte
    assert exported.stdout.startswith(
        f"wrote bundle {again}: 1 entries and 2 protocol records of 2"
    )
    assert again.read_bytes() == path.read_bytes()


def test_two_bundles_disagreeing_on_a_protocol_record_are_refused_with_on_conflict_fail(
    cli, target: Path, tmp_path: Path, dump_db
) -> None:
    """Two inputs holding one protocol record (namespace, key, scope) with different values:
    ``--on-conflict fail`` names it and imports nothing; ``theirs`` takes the later one."""
    first, second = tmp_path / "first.bundle", tmp_path / "second.bundle"
    first.write_bytes(render_bundle([], protocol_records=PROTOCOL))
    retuned = dataclasses.replace(PROTOCOL[1], value_json='{"knobs":[8,1]}', tuned_at=7.0)
    second.write_bytes(render_bundle([], protocol_records=(PROTOCOL[0], retuned)))
    before = dump_db(target)

    refused = cli("import", first, second, "--on-conflict", "fail", db=target)

    assert (refused.exit_code, refused.stdout) == (1, "")
    assert refused.stderr.startswith(f"error: {first} and {second} hold different values for ")
    assert "protocol record moe_ep_megamoe/'{\"tokens\":128}' (fingerprint " in refused.stderr
    assert refused.stderr.endswith(
        "nothing imported; choose which wins with --on-conflict keep|theirs|newest|vote|drop\n"
    )
    assert refused.stderr.count("\n") == 1
    assert dump_db(target) == before
    agreeing = cli("import", first, first, "--on-conflict", "fail", db=target)
    assert agreeing.exit_code == 0, agreeing.stderr
    taken = cli("import", first, second, "--on-conflict", "theirs", db=target)
    assert taken.exit_code == 0, taken.stderr
    with Registry.open(str(target), create=False) as reg, reg.engine.connect() as conn:
        values = {r.key: r.value_json for r in stored_protocol_records(conn)}
    assert values == {"": "7", '{"tokens":128}': '{"knobs":[8,1]}'}


def test_a_damaged_protocol_record_in_a_bundle_is_refused(
    cli, target: Path, tmp_path: Path, dump_db
) -> None:
    data = render_bundle([], protocol_records=PROTOCOL)
    before = dump_db(target)
    for bad, detail in (
        (b'"value":"7"', b'"value":"NaN"'),
        (b'"namespace":"moe_ep_megamoe","policy":"[', b'"namespace":"","policy":"['),
    ):
        path = tmp_path / "bad.bundle"
        header, payload = split(data)
        payload = payload.replace(bad, detail, 1)
        path.write_bytes(frame(payload, version=3) + payload)
        result = cli("import", path, db=target)
        assert result.exit_code == 1
        assert result.stderr.startswith(f"error: {path}: invalid bundle (protocol record 0")
        assert dump_db(target) == before


def test_import_refuses_mixed_bundles_and_cache_files(
    cli, bundle_file: Path, cache_file, target: Path, dump_db
) -> None:
    before = dump_db(target)
    other = cache_file("x.json", {K32: ["Runner", 8]}, metadata=META)

    mixed = cli("import", bundle_file, other, db=target)
    scoped = cli("import", "--scope", "tp2/rank0", bundle_file, db=target)

    for result in (mixed, scoped):
        assert result.exit_code == 2
        assert "Usage: ficache import" in result.output
    assert dump_db(target) == before


# -- bad bundles: one line, exit 1, the registry unchanged ---------------------------------


def _flip(data: bytes) -> bytes:
    header, payload = split(data)
    middle = len(payload) // 2
    return header + payload[:middle] + bytes([payload[middle] ^ 0x01]) + payload[middle + 1 :]


def _bad_key(top: dict[str, Any]) -> None:
    top["entries"][0]["key"] = "('mm', __import__('os').system('true'), (), ())"


def _non_json_tactic(top: dict[str, Any]) -> None:
    top["entries"][0]["tactic"] = "[1, 2"


def _object_tactic(top: dict[str, Any]) -> None:
    top["entries"][0]["tactic"] = '{"__class__":"os.system"}'


def _unknown_scope(top: dict[str, Any]) -> None:
    top["entries"][0]["scope"] = "rank1"


def _huge_provenance(top: dict[str, Any]) -> None:
    top["provenance"]["entries"] = 10**18


def _wrong_digest(top: dict[str, Any]) -> None:
    top["fingerprints"][FP_H200.digest]["gpu"] = "NVIDIA B300"


def _duplicate_entry(top: dict[str, Any]) -> None:
    top["entries"].insert(0, top["entries"][0])


def _unknown_member(top: dict[str, Any]) -> None:
    top["exec"] = "rm -rf /"


def _bad_records(top: dict[str, Any]) -> None:
    top["records"] = {FP_H200.digest: {"rank1": {"ns": {"k": 1}}}}


HOSTILE = {
    "bad key": (
        _bad_key,
        "entry 0 key \"('mm', __import__('os').system('true'), (), ())\" is not a FlashInfer key: "
        "expected ',' before offset 17",
    ),
    "non-JSON tactic": (_non_json_tactic, "entry 0 tactic '[1, 2' is not JSON"),
    "object tactic": (
        _object_tactic,
        "entry 0 tactic holds a JSON dict; expected numbers and lists",
    ),
    "unknown scope form": (
        _unknown_scope,
        "entry 0: scope must be 'shared' or '<layout>/rank<N>', got 'rank1'",
    ),
    "huge claimed counts": (_huge_provenance, "provenance does not describe the content"),
    "digest of other fields": (
        _wrong_digest,
        f"fingerprint {FP_H200.digest[:12]} does not match its fields",
    ),
    "duplicate entry": (_duplicate_entry, "entry 1 is out of order or a duplicate"),
    "unknown member": (_unknown_member, "the payload has unknown member 'exec'"),
    "records of an unknown scope form": (
        _bad_records,
        f"records of {FP_H200.digest[:12]}: scope must be 'shared' or '<layout>/rank<N>', "
        "got 'rank1'",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_content_with_a_right_checksum(
    cli, bundle_file: Path, target: Path, tmp_path: Path, dump_db, case: str
) -> None:
    edit, detail = HOSTILE[case]
    path = tmp_path / "hostile.bundle"
    path.write_bytes(reframed(bundle_file.read_bytes(), edit))
    before = dump_db(target)

    result = cli("import", path, db=target)

    one_error_line(result, f"{path}: invalid bundle ({detail}); {AGAIN}")
    assert dump_db(target) == before


def test_non_canonical_encoding_is_refused(bundle_file: Path, tmp_path: Path) -> None:
    path = tmp_path / "pretty.bundle"
    payload = json.dumps(json.loads(split(bundle_file.read_bytes())[1]), indent=2).encode()
    path.write_bytes(frame(payload) + payload)

    with pytest.raises(BundleError) as caught:
        read_bundle(path)

    assert str(caught.value) == f"{path}: invalid bundle (not in canonical form); {AGAIN}"


def _framing_cases(data: bytes) -> dict[str, tuple[bytes, str]]:
    header, payload = split(data)
    n = len(payload)
    newer = frame(payload, version=5) + payload
    huge = b"ficache-bundle 1 %d sha256=%s\n" % (10**15, b"0" * 64) + payload
    return {
        "one flipped byte": (_flip(data), f"damaged bundle (checksum mismatch); {AGAIN}"),
        "trailing bytes": (data + b"\n", f"damaged bundle (1 bytes after its payload); {AGAIN}"),
        "newer format version": (
            newer,
            "bundle format version 5 is newer than this ficache reads (up to 4); upgrade ficache",
        ),
        "version 0": (
            b"ficache-bundle 0" + newer[16:],
            f"unknown bundle format version 0; {AGAIN}",
        ),
        "huge claimed size": (
            huge,
            f"bundle claims a {10**15}-byte payload, over the {MAX_PAYLOAD_BYTES}-byte limit; "
            "not a bundle ficache reads",
        ),
        "damaged header": (
            header.replace(b"sha256=", b"sha512=") + payload,
            f"damaged bundle header; {AGAIN}",
        ),
        "payload cut short": (
            data[:-10],
            f"truncated bundle ({n - 10} of {n} payload bytes); {AGAIN}",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "one flipped byte",
        "trailing bytes",
        "newer format version",
        "version 0",
        "huge claimed size",
        "damaged header",
        "payload cut short",
    ],
)
def test_damaged_bundles(
    cli, bundle_file: Path, target: Path, tmp_path: Path, dump_db, case: str
) -> None:
    bad, detail = _framing_cases(bundle_file.read_bytes())[case]
    path = tmp_path / "bad.bundle"
    path.write_bytes(bad)
    before = dump_db(target)

    result = cli("import", path, db=target)

    one_error_line(result, f"{path}: {detail}")
    assert dump_db(target) == before


def test_truncated_anywhere(cli, bundle_file: Path, target: Path, tmp_path: Path, dump_db) -> None:
    data = bundle_file.read_bytes()
    header, payload = split(data)
    step = max(1, len(data) // 15)
    cuts = sorted(
        {1, 7, len(MAGIC), len(MAGIC) + 1, len(header) - 1, len(header), *range(1, len(data), step)}
    )
    before = dump_db(target)
    path = tmp_path / "cut.bundle"
    assert len(cuts) >= 15

    for cut in cuts:
        path.write_bytes(data[:cut])
        result = cli("import", path, db=target)
        if cut < len(header):
            detail = "truncated bundle (it ends inside its header)"
        else:
            detail = f"truncated bundle ({cut - len(header)} of {len(payload)} payload bytes)"
        one_error_line(result, f"{path}: {detail}; {AGAIN}")
    assert dump_db(target) == before


def test_empty_file(cli, target: Path, tmp_path: Path, dump_db) -> None:
    path = tmp_path / "empty.bundle"
    path.write_bytes(b"")
    before = dump_db(target)

    result = cli("import", path, db=target)

    # An empty file is no bundle, so import reads it as a FlashInfer file.
    one_error_line(
        result,
        f"{path}: invalid JSON (Expecting value: line 1 column 1 (char 0)); "
        "the file is truncated or not a FlashInfer cache",
    )
    assert dump_db(target) == before
    with pytest.raises(BundleError) as caught:
        read_bundle(path)
    assert str(caught.value) == f"{path}: empty file, not a ficache bundle; {AGAIN}"


def test_a_cache_file_where_a_bundle_is_expected_and_back(
    bundle_file: Path, cache_file, tmp_path: Path
) -> None:
    cache = cache_file("cache.json", {K16: ["Runner", 1]}, metadata=META)
    foreign = tmp_path / "foreign.bin"
    foreign.write_bytes(b"\x89PNG\r\n\x1a\n")

    with pytest.raises(BundleError) as as_bundle:
        read_bundle(cache)
    with pytest.raises(BundleError) as as_foreign:
        read_bundle(foreign)
    with pytest.raises(CacheFileError) as as_cache:
        read_cache_file(bundle_file)

    assert str(as_bundle.value) == (
        f"{cache}: a FlashInfer cache file, not a ficache bundle; import it with `ficache import`"
    )
    assert str(as_foreign.value) == (
        f"{foreign}: not a ficache bundle (no 'ficache-bundle' header); "
        "give a file written by `ficache export --bundle`"
    )
    assert str(as_cache.value) == (
        f"{bundle_file}: invalid JSON (Expecting value: line 1 column 1 (char 0)); "
        "the file is truncated or not a FlashInfer cache"
    )
    assert not is_bundle(cache)
    assert not is_bundle(foreign)
    assert not is_bundle(tmp_path)
    assert not is_bundle(tmp_path / "missing")


# -- any bytes at all: only BundleError ------------------------------------------------------

VALID = render_bundle(
    [
        NewEntry(FP_H200, K16, "Runner", "[1,[2,3]]", '["p",null]', "shared", None, 1.5),
        NewEntry(FP_H200, K32, "Runner", "4", None, "tp2/rank1", None, 2.5),
        NewEntry(FP_B200, K16, "Runner", "7", None, "shared", None, 3.5),
    ],
    {FP_B200.digest: {"shared": {"trtllm_moe_da": {"k": [1, 2]}}}},
)
FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _read_only_raises_bundle_error(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    try:
        result = read_bundle(path)
    except BundleError as exc:
        assert "\n" not in str(exc)
    else:
        assert isinstance(result, Bundle)


def test_the_fuzzed_bundle_is_valid() -> None:
    assert len(parse_bundle_bytes(VALID).entries) == 3


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=600),
        st.binary(max_size=300).map(lambda b: MAGIC + b),
        st.binary(max_size=300).map(lambda b: b"ficache-bundle 1 " + b),
    )
)
def test_random_bytes_only_raise_bundle_error(tmp_path: Path, data: bytes) -> None:
    _read_only_raises_bundle_error(tmp_path / "random.bundle", data)


_EDIT = st.tuples(
    st.sampled_from(["flip", "delete", "insert", "truncate"]),
    st.integers(min_value=0),
    st.binary(min_size=1, max_size=8),
)


def _mutate(data: bytes, edits: list[tuple[str, int, bytes]]) -> bytes:
    for op, at, chunk in edits:
        i = at % (len(data) + 1)
        if op == "flip" and i < len(data):
            data = data[:i] + bytes([data[i] ^ (chunk[0] or 1)]) + data[i + 1 :]
        elif op == "delete":
            data = data[:i] + data[i + len(chunk) :]
        elif op == "insert":
            data = data[:i] + chunk + data[i:]
        else:
            data = data[:i]
    return data


@FUZZ
@given(st.lists(_EDIT, min_size=1, max_size=4))
def test_mutated_bundles_only_raise_bundle_error(
    tmp_path: Path, edits: list[tuple[str, int, bytes]]
) -> None:
    _read_only_raises_bundle_error(tmp_path / "mutated.bundle", _mutate(VALID, edits))


@FUZZ
@given(st.lists(_EDIT, min_size=1, max_size=4))
def test_mutated_payloads_with_a_right_checksum_only_raise_bundle_error(
    tmp_path: Path, edits: list[tuple[str, int, bytes]]
) -> None:
    payload = _mutate(split(VALID)[1], edits)
    _read_only_raises_bundle_error(tmp_path / "reframed.bundle", frame(payload) + payload)


def test_a_record_json_cannot_carry_is_refused(bundle_file: Path, tmp_path: Path) -> None:
    def add_record(top: dict[str, Any]) -> None:
        top["records"] = {FP_H200.digest: {"shared": {"ns": {"k": 12345.5}}}}
        top["provenance"]["records"] = 1
        top["provenance"]["fingerprints"][FP_H200.digest]["records"] = 1

    _header, payload = split(reframed(bundle_file.read_bytes(), add_record))
    payload = payload.replace(b"12345.5", b"1e999")
    path = tmp_path / "inf.bundle"
    path.write_bytes(frame(payload) + payload)

    with pytest.raises(BundleError) as caught:
        read_bundle(path)

    assert str(caught.value) == (
        f"{path}: invalid bundle (records of {FP_H200.digest[:12]} shared: record 'k': holds a "
        f"non-finite number); {AGAIN}"
    )


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


def _json_paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [path]
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for k, child in items:
        found += _json_paths(child, (*path, k))
    return found


_VALID_PATHS = _json_paths(json.loads(split(VALID)[1]))[1:]


@FUZZ
@given(st.sampled_from(_VALID_PATHS), _JSON, st.booleans())
def test_json_edits_with_a_right_checksum_only_raise_bundle_error(
    tmp_path: Path, path: tuple[Any, ...], value: Any, delete: bool
) -> None:
    top = json.loads(split(VALID)[1])
    node = top
    for step in path[:-1]:
        node = node[step]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    payload = json.dumps(top, sort_keys=True, separators=(",", ":")).encode() + b"\n"
    _read_only_raises_bundle_error(tmp_path / "edited.bundle", frame(payload) + payload)
