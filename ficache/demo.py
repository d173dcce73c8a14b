"""``ficache demo``: two consecutive warm starts on N local processes.

``run_demo`` spawns N processes once (one rank each, joined in a gloo
group) and runs two starts in them, one after the other, against the
registry:

- With a GPU per rank: rank r uses ``cuda:r`` and FlashInfer's real
  ``AutoTuner`` tunes the bundled op (``ficache.tunable_matmul``: 52 entries).
- Otherwise, CPU ranks with the CPU STAND-IN for profiling
  (``ficache.standin``: FlashInfer cannot profile without CUDA; the stand-in
  times CPU matmul variants and fills the real AutoTuner's cache, 18 entries).
  Its output says so.

On a fresh registry the first start tunes and commits, and the second loads
everything and tunes nothing. With no registry named (``db``, else
``FICACHE_DB``) the demo uses one of its own, ``demo.db`` beside the default
registry (``demo_registry_path``), so trying it never writes the stand-in's
CPU timings into the registry real servers start from. The result is ``{"starts": [report, report],
"profiling": ...}`` with rank 0's reports (``WarmStartReport.as_json``);
``render_table`` is the CLI's table.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ficache.errors import FicacheError
from ficache.location import ENV_VAR

PROFILING_GPU = "FlashInfer AutoTuner on CUDA (ficache.tunable_matmul)"
PROFILING_CPU = "CPU stand-in for profiling (ficache.standin): no GPU per rank, FlashInfer cannot profile on CPU"


def _demo_rank(
    rank: int, world: int, db: str | None, use_gpu: bool, timeout: float
) -> list[dict[str, Any]]:
    logging.getLogger("flashinfer").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    from ficache.sync import warm_start

    if use_gpu:
        import torch

        from ficache.tunable_matmul import warmup

        torch.cuda.set_device(rank)
    else:
        from ficache.standin import standin_tune
    reports = []
    for _start in range(2):
        with warm_start(None, db=db, timeout=timeout) as ws:
            if use_gpu:
                warmup()
            else:
                standin_tune()
        reports.append(ws.report.as_json())
    return reports


def demo_registry_path() -> Path:
    """The demo's own registry: ``demo.db`` beside the default ``registry.db``."""
    from ficache.location import default_registry_path

    return default_registry_path().with_name("demo.db")


def run_demo(
    world: int | None = None,
    db: str | os.PathLike[str] | None = None,
    *,
    device: str = "auto",
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Run two consecutive warm starts on ``world`` local ranks; return rank 0's reports.

    ``world`` defaults to the number of GPUs (2 without GPUs). ``device`` is
    ``"auto"`` (GPUs when there is one per rank, else the CPU stand-in),
    ``"cuda"`` or ``"cpu"``. ``db`` as for ``warm_start``, except that with
    neither ``db`` nor ``FICACHE_DB`` the demo's own registry
    (``demo_registry_path``) is used, never the default one. ``timeout`` bounds the whole run: ranks still
    running then are killed and ``FicacheError`` is raised.
    """
    if device not in ("auto", "cuda", "cpu"):
        raise FicacheError(f"--device must be auto, cuda or cpu, got {device!r}")
    gpus = 0
    if device != "cpu":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if world is None:
        world = gpus if gpus >= 1 and device != "cpu" else 2
    if world < 1:
        raise FicacheError(f"--world must be at least 1, got {world}")
    if device == "cuda" and gpus < world:
        raise FicacheError(
            f"--device cuda needs one GPU per rank: {world} ranks, {gpus} GPU(s) visible"
        )
    use_gpu = device == "cuda" or (device == "auto" and gpus >= world)

    from ficache._ranks import RanksFailedError, RanksTimeoutError, run_ranks

    # FlashInfer's logger reads its level from the environment when created
    # (in each rank); keep the demo's output to the reports unless asked.
    os.environ.setdefault("FLASHINFER_LOGGING_LEVEL", "warning")

    if db is None and not os.environ.get(ENV_VAR):
        db = demo_registry_path()
    try:
        results = run_ranks(
            _demo_rank,
            world,
            os.fspath(db) if db is not None else None,
            use_gpu,
            timeout,
            timeout=timeout,
            group_timeout=timeout,
        )
    except RanksTimeoutError as exc:
        raise FicacheError(f"demo did not finish: {exc}") from None
    except RanksFailedError as exc:
        logging.getLogger(__name__).debug("demo ranks failed:\n%s", exc)
        raise FicacheError(
            f"demo failed: {str(exc).splitlines()[0]} (run with --debug for the ranks' tracebacks)"
        ) from None
    return {"starts": results[0], "profiling": PROFILING_GPU if use_gpu else PROFILING_CPU}


def render_table(result: dict[str, Any]) -> str:
    """The demo's result as a small table (the CLI's default output)."""
    starts = result["starts"]
    first = starts[0] if starts else {}
    lines = [
        f"ficache demo: {first.get('world_size', '?')} rank(s), layout {first.get('layout', '?')}",
        f"profiling: {result.get('profiling', '?')}",
        f"registry: {first.get('registry') or '(none)'}",
        "",
    ]
    header = (
        "start",
        "status",
        "loaded",
        "tuned",
        "committed",
        "commit",
        "disagreements",
        "seconds",
    )
    rows = []
    for i, r in enumerate(starts, 1):
        rows.append(
            (
                str(i),
                r["status"],
                str(r["loaded"]),
                str(r["tuned"]),
                str(r["committed"]),
                str(r["commit_id"]) if r["commit_id"] is not None else "-",
                str(r["disagreements"]),
                f"{r['seconds'].get('total', 0.0):.3f}",
            )
        )
    widths = [max(len(h), *(len(row[c]) for row in rows)) for c, h in enumerate(header)]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
    for row in rows:
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    notes = [f"start {i}: {r['reason']}" for i, r in enumerate(starts, 1) if r.get("reason")]
    notes += [f"start {i}: {w}" for i, r in enumerate(starts, 1) for w in r.get("warnings", ())]
    if notes:
        lines.append("")
        lines.extend(notes)
    lines.append("(loaded and tuned are rank 0's; committed counts every rank's rows)")
    return "\n".join(lines)
