"""Several processes writing one SQLite registry at once, and a writer killed
before its commit: nothing is lost, nothing is half-written."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

from ficache.flashinfer_format import read_cache_file
from ficache.registry import Registry

REPO = Path(__file__).resolve().parent.parent
META = {
    "flashinfer_version": "0.7.2",
    "cuda_version": "12.9",
    "cublas_version": "12.9.1",
    "cudnn_version": "91002",
    "cudnn_frontend_version": "1.32.0",
    "cutlass_dsl_version": "4.8.1",
    "gpu": "NVIDIA H200",
}
ENTRIES_PER_FILE = 400


def key(writer: int, m: int) -> str:
    return str(
        (f"flashinfer::op{writer}", "Runner", ((m, 4096), (4096, 1024)), ("torch.bfloat16", writer))
    )


def write_file(path: Path, writer: int, gpu: str = "NVIDIA H200") -> None:
    entries = {key(writer, m): ["Runner", [m % 7, [writer, m]]] for m in range(ENTRIES_PER_FILE)}
    path.write_text(json.dumps({"_metadata": {**META, "gpu": gpu}, **entries}))


# Waits for a shared start time, so every process writes at the same moment.
_IMPORT_AT = """
import sys, time
import ficache.registry  # import everything before the start line
from ficache.cli import main
start = float(sys.argv[1])
while time.time() < start:
    time.sleep(0.001)
main(sys.argv[2:])
"""


def test_parallel_importers_all_succeed_and_lose_nothing(
    tmp_path: Path, registry_path: Path
) -> None:
    Registry.open(str(registry_path)).close()
    files = []
    for writer in range(5):
        files.append(tmp_path / f"rank{writer}.json")
        write_file(files[-1], writer, gpu="NVIDIA H200" if writer < 3 else "NVIDIA B200")
    start = time.time() + 3.0  # after every interpreter has imported ficache
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _IMPORT_AT,
                repr(start),
                "--db",
                str(registry_path),
                "import",
                str(f),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for f in files
    ]
    outputs = [p.communicate(timeout=180) for p in procs]

    assert [(p.returncode, err) for p, (_out, err) in zip(procs, outputs, strict=True)] == [
        (0, "")
    ] * 5
    for _out, _err in outputs:
        assert _out.startswith(
            f"imported {ENTRIES_PER_FILE} entries from 1 file(s): {ENTRIES_PER_FILE} added"
        )
    with Registry.open(str(registry_path)) as reg:
        stored = {e.key: json.loads(e.tactic_json) for e in reg.entries()}
        commits = reg.log(None)
        fingerprints = {i.fingerprint.gpu: i.entries for i in reg.fingerprints()}
    assert stored == {key(w, m): [m % 7, [w, m]] for w in range(5) for m in range(ENTRIES_PER_FILE)}
    assert sorted(c.message for c in commits) == sorted(str(f) for f in files)
    assert {(c.kind, c.added) for c in commits} == {("import", ENTRIES_PER_FILE)}
    assert fingerprints == {
        "NVIDIA H200": 3 * ENTRIES_PER_FILE,
        "NVIDIA B200": 2 * ENTRIES_PER_FILE,
    }


# Imports through the library, but pauses after the last insert, just before
# COMMIT, and waits to be killed. The pause is the only stand-in: it wraps the
# real write transaction (``ficache.schema.write_transaction``) that every
# registry write goes through.
_KILLED_BEFORE_COMMIT = """
import sys, time
from contextlib import contextmanager
from ficache import schema
from ficache.flashinfer_format import read_cache_file
from ficache.registry import Registry

real_write_transaction = schema.write_transaction

@contextmanager
def write_transaction_that_stalls_before_commit(engine):
    with real_write_transaction(engine) as conn:
        yield conn
        print("inserted, not committed", flush=True)
        time.sleep(120)

schema.write_transaction = write_transaction_that_stalls_before_commit
with Registry.open(sys.argv[1]) as reg:
    reg.import_cache([(sys.argv[2], read_cache_file(sys.argv[2]))])
print("committed?!", flush=True)
"""


def _dump(path: Path) -> list[str]:
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        return list(conn.iterdump())


def test_a_writer_killed_before_commit_leaves_the_registry_as_it_was(
    tmp_path: Path, registry_path: Path
) -> None:
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    write_file(first, 0)
    write_file(second, 1)
    with Registry.open(str(registry_path)) as reg:
        reg.import_cache([(str(first), read_cache_file(first))])
    before = _dump(registry_path)

    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_BEFORE_COMMIT, str(registry_path), str(second)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line == "inserted, not committed\n", proc.stderr.read() if proc.stderr else ""
        # the uncommitted write holds the lock; readers still see the old state
        assert _dump(registry_path) == before
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    assert _dump(registry_path) == before
    with closing(sqlite3.connect(registry_path)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    with Registry.open(str(registry_path)) as reg:
        assert len(reg.log()) == 1
        result = reg.import_cache([(str(second), read_cache_file(second))])
        assert (result.commit_id, result.added) == (2, ENTRIES_PER_FILE)
        assert len(list(reg.entries())) == 2 * ENTRIES_PER_FILE
