"""First start: what a server pays at boot, ficache beside the JSON-file protocol.

    python benchmarks/first_start.py                       # 1k and 10k entries, 4 ranks, 3 runs
    python benchmarks/first_start.py --sizes 1000 --runs 5 --world 2

Every start is a new set of ``--world`` (4) processes, as at a server's boot:
``python benchmarks/first_start.py --child ...`` per rank, started together,
joined into a gloo group, then one of:
- file protocol (vLLM 0.27-0.31): rank 0 reads the one FlashInfer cache file,
  broadcasts its bytes, every rank writes them to its own file and calls
  ``AutoTuner.load_configs`` (``warm_start.file_protocol_start``);
- ficache: ``ficache.warm_start`` on a SQLite registry holding the same
  entries, nothing to tune (``warm_start.ficache_start``).
Both end with an empty tuning block (the autotune process group set and
cleared) and their exit exchange. The figure is the slowest rank's wall time
from just before its process was started (before the interpreter, torch or
ficache load) to the end of that start: what a rank pays before it can run
its warmup. "imports+group" is the part up to the joined gloo group, the same
code for both; the protocol column is the rest, its imports of FlashInfer
and ficache included.

Both sides run compiled code, as installed packages are: ficache and these
benchmarks are byte-compiled first, as pip compiles a wheel it installs
(``_compile_like_an_install``).

Registries and files are built once per size (``warm_start._prepare``: the
file is what ``save_configs`` writes for the registry's entries). One ficache
start per size runs untimed first, so the slice cache exists, as it does for
every start after a server's first (a restart). Runs alternate the order of
the two protocols; medians over ``--runs`` (3). Targets (issue 21): ficache /
file protocol at most 1.5 at 1k entries and 1.0 at 10k. Nothing here
asserts on time; exit code 1 only when a start failed or loaded nothing.
"""

from __future__ import annotations

import time

_PROCESS_TOP = time.time()  # the first thing a child does, before any heavy import

import argparse  # noqa: E402 - after the clock above, on purpose
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PROTOCOLS = ("file", "ficache")
CHILD_TIMEOUT_S = 300.0


def child(args: argparse.Namespace) -> int:
    """One rank of one start: join the group, run the protocol, print timestamps as JSON."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=CHILD_TIMEOUT_S),
    )
    grouped = time.time()
    sys.path.insert(0, str(HERE))
    loaded = -1
    if args.protocol == "file":
        from warm_start import file_protocol_start

        file_protocol_start(None, args.file, Path(args.workdir))
        done = time.time()
        from ficache.tuner import FlashInferTuner  # after the clock: counts what loaded

        loaded = len(FlashInferTuner().entries())
    else:
        from warm_start import ficache_start

        loaded = int(ficache_start(None, args.db)["loaded"])
        done = time.time()
    dist.destroy_process_group()
    print(json.dumps({"top": _PROCESS_TOP, "grouped": grouped, "done": done, "loaded": loaded}))
    return 0


def one_start(protocol: str, world: int, db: str, file: str, workdir: Path) -> dict[str, float]:
    """Start ``world`` fresh rank processes for one start; the slowest rank's figures."""
    from ficache._ranks import free_port

    port = free_port()
    env = dict(os.environ, XDG_CACHE_HOME=str(workdir / "user-cache"), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("FICACHE_DB", None)
    launched = time.time()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--child",
                protocol,
                "--rank",
                str(rank),
                "--world",
                str(world),
                "--port",
                str(port),
                "--db",
                db,
                "--file",
                file,
                "--workdir",
                str(workdir),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
            if proc.returncode != 0:
                raise RuntimeError(f"{protocol} rank failed ({proc.returncode}): {err[-2000:]}")
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if min(o["loaded"] for o in outs) <= 0:
        raise RuntimeError(f"{protocol}: a rank loaded nothing: {outs}")
    return {
        "total": max(o["done"] for o in outs) - launched,
        "group": max(o["grouped"] for o in outs) - launched,
        "protocol": max(o["done"] - o["grouped"] for o in outs),
        "loaded": min(o["loaded"] for o in outs),
    }


def prepare(sizes: list[int], workdir: Path) -> dict[int, tuple[str, str]]:
    """Per size: the registry and the equivalent FlashInfer file (``warm_start._prepare``)."""
    sys.path.insert(0, str(HERE))
    os.environ["XDG_CACHE_HOME"] = str(workdir / "user-cache")
    from warm_start import _prepare

    return {n: _prepare(workdir, n) for n in sizes}


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:8.0f}"


def _compile_like_an_install() -> None:
    """Byte-compile ficache and these benchmarks, as pip does when it installs a wheel.

    Torch and FlashInfer come installed, compiled; run from a source tree with
    ``PYTHONDONTWRITEBYTECODE`` set (as on the GPU host), ficache's side would
    otherwise compile its own modules in every fresh process, a cost no
    installed ficache pays. Python reads existing ``__pycache__`` files under
    that setting too; only writing them is off.
    """
    import compileall

    for tree in (ROOT / "ficache", HERE):
        compileall.compile_dir(str(tree), quiet=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--child", choices=PROTOCOLS, dest="protocol")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--db", default="")
    parser.add_argument("--file", default="")
    parser.add_argument("--workdir", default="")
    args = parser.parse_args(argv)
    if args.protocol is not None:
        return child(args)
    workdir = Path(tempfile.mkdtemp(prefix="ficache-first-start-"))
    _compile_like_an_install()
    built = prepare(args.sizes, workdir)
    for db, file in built.values():  # untimed: renders the slice cache, as a first start did
        one_start("ficache", args.world, db, file, workdir)
    figures: dict[tuple[int, str], list[dict[str, float]]] = {}
    for run in range(args.runs):
        order = PROTOCOLS if run % 2 == 0 else PROTOCOLS[::-1]
        for n, (db, file) in built.items():
            for protocol in order:
                figures.setdefault((n, protocol), []).append(
                    one_start(protocol, args.world, db, file, workdir)
                )
    cores = os.cpu_count()
    print(
        f"first start, {args.world} gloo ranks in fresh processes, medians of {args.runs} runs "
        f"(alternating), {cores} cores; ms from process launch"
    )
    print(
        f"{'entries':>8} {'protocol':>8} {'total':>8} {'imp+grp':>8} {'protocol':>8} {'loaded':>7}"
    )
    for n in args.sizes:
        for protocol in PROTOCOLS:
            runs = figures[(n, protocol)]
            med = {k: statistics.median(r[k] for r in runs) for k in ("total", "group", "protocol")}
            print(
                f"{n:>8} {protocol:>8} {_ms(med['total'])} {_ms(med['group'])} "
                f"{_ms(med['protocol'])} {int(runs[0]['loaded']):>7}"
            )
    print(
        "ratio ficache / file protocol (total; protocol part); targets: <= 1.5 at 1k, <= 1.0 at 10k"
    )
    for n in args.sizes:
        fic, fil = figures[(n, "ficache")], figures[(n, "file")]
        total = statistics.median(r["total"] for r in fic) / statistics.median(
            r["total"] for r in fil
        )
        part = statistics.median(r["protocol"] for r in fic) / statistics.median(
            r["protocol"] for r in fil
        )
        print(f"{n:>8}: {total:.2f}x ; {part:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
