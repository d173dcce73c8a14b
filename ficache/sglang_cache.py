"""SGLang's own FlashInfer autotune files: where they are and how they group into layouts.

A description and its format code for ``ficache.adopt`` (``Sources(...,
engine="sglang")``), which does the reading, the shared-or-scoped rule and
the commit. Read from SGLang 0.5.23
(``sglang.srt.model_executor.runner.flashinfer_autotune.flashinfer_autotune_cache_path``).

The tree. Under ``${SGLANG_CACHE_DIR:-~/.cache/sglang}``::

    flashinfer/autotune/<FlashInfer version>/sm<XY>/<hash16>/
        rank_tp{t}_pp{p}_dp{d}[_gpu<uuid>].json                 # one per rank
        runs/rank_tp{t}_pp{p}_dp{d}[_gpu<uuid>].<YYYYmmdd_HHMMSS>.<uuid hex>.json

``<hash16>`` is the first 16 hex digits of the sha256 of the deployment's
model key (model, dtype, quantization, MoE backend, TP/PP/attention-DP/EP
sizes, ...): one directory per deployment, every rank of it writing its own
file, FlashInfer's ``save_configs`` JSON. ``runs/`` holds the files of
starts made with ``SGLANG_FLASHINFER_AUTOTUNE_CACHE=0`` (written, never read
by SGLang). ``_gpu<uuid>`` is added for FlashInfer's MegaMoE backend.
FlashInfer writes through ``.autotuner_*.tmp`` files in the same directory.

A root may be the cache dir, its ``flashinfer/autotune``, a version, arch or
deployment directory: directories are searched at most three levels below
``flashinfer/autotune`` (or the root), never further, and only the names
above are read.

Layout groups. In one deployment directory, the files of one pipeline stage
and one data-parallel replica (``pp{p}``, ``dp{d}``) are one layout group: a
TP group, which is what SGLang synchronizes its tuning over and what the
SGLang plugin warm-starts as one group. Its layout is named as the plugin
names it: ``tp{T}-pp{P}-dp{D}-ep{E}.pp{p}.dp{d}``, the scope's rank the
file's ``t``. File names give ``T``, ``P`` and ``D`` (the largest index + 1)
but not the EP size, so ``E`` is 1 unless the caller knows better
(``KnownLayout``: the plugin knows its own deployment directory and sizes;
the CLI's ``--layout``, whose ``tp-pp-dp-ep`` part then names every group).
The ``runs/`` files of a deployment are groups of their own, by the same
rule, every run's file of a rank counting as one file of that rank (the
newest run first, so it wins where runs differ). Then ``ficache.adopt``'s
rule: a key equal in every file of the group is stored shared; every other
key once per file, scoped to its rank.

Refused, each counted with a reason, never raised: a file whose
``_metadata`` says ``"unknown"`` for its FlashInfer version (SGLang names its
directory ``unknown`` then too): the release its tactics were tuned with is
not known. Other ``"unknown"`` fields (a CPU run's CUDA, cuDNN, GPU) follow
the fingerprint rule, as in FlashInfer: served only where the running
environment cannot tell either. Also refused: a temporary file; a file or
directory that is a symlink leading outside the root; and everything
``ficache.adopt`` refuses (truncated, NaN, a non-object root, a hostile key,
no ``_metadata``).

Invariants: reading never writes, never follows a symlink out of the root,
never evaluates a key; the search is of fixed depth.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

#: ``skip(path, reason)``: count one item left out, with its reason (``ficache.adopt``).
Skip = Callable[[Path, str], None]

#: Below the cache dir: FlashInfer's autotune files.
AUTOTUNE_PARTS = ("flashinfer", "autotune")
#: ``rank_tp{t}_pp{p}_dp{d}[_gpu<uuid>].json``.
RANK_FILE = re.compile(r"rank_tp(\d{1,6})_pp(\d{1,6})_dp(\d{1,6})(?:_gpu[0-9A-Za-z-]{1,80})?\.json")
#: ``runs/rank_tp{t}_pp{p}_dp{d}[_gpu<uuid>].<timestamp>.<uuid hex>.json``.
RUN_FILE = re.compile(
    r"rank_tp(\d{1,6})_pp(\d{1,6})_dp(\d{1,6})(?:_gpu[0-9A-Za-z-]{1,80})?"
    r"\.(\d{8}_\d{6})\.[0-9a-f]{32}\.json"
)
RUNS_DIR = "runs"
#: FlashInfer's ``save_configs`` temp files (``.autotuner_*.tmp``), and any ``*.tmp``.
TEMP_FILE = re.compile(r"\..*|.*\.tmp")
#: Directory levels searched below ``flashinfer/autotune`` (version / arch / hash).
MAX_DEPTH = 3
PER_RANK_KIND = "sglang per rank"
RUNS_KIND = "sglang runs"
FILE_PATTERN = "rank_tp<T>_pp<P>_dp<D>[_gpu<uuid>].json"


def default_root(environ: Mapping[str, str] | None = None) -> Path:
    """``SGLANG_CACHE_DIR`` as SGLang reads it (default ``~/.cache/sglang``)."""
    env = os.environ if environ is None else environ
    return Path(env.get("SGLANG_CACHE_DIR") or "~/.cache/sglang").expanduser()


def searched(roots: str) -> str:
    """What an SGLang adoption looks for, in one line (for "found nothing")."""
    return (
        f"looked for {FILE_PATTERN} (and {RUNS_DIR}/ of them) in ROOT, and up to "
        f"{MAX_DEPTH} levels below ROOT/{'/'.join(AUTOTUNE_PARTS)} (or ROOT): "
        f"<FlashInfer version>/sm<XY>/<hash>; ROOT: {roots}"
    )


def layout_name(base: str, pp_rank: int, dp_rank: int) -> str:
    """The plugin's name of one TP group's layout: ``tp2-pp2-dp1-ep1.pp0.dp0``."""
    return f"{base}.pp{pp_rank}.dp{dp_rank}"


def _inside(path: Path, root: Path) -> bool:
    try:
        return path.resolve().is_relative_to(root)
    except (OSError, RuntimeError):
        return False


class _Tree:
    """The deployment directories under one root, found without leaving it."""

    def __init__(self, root: Path, skip: Skip) -> None:
        self.skip = skip
        try:
            self.real_root = root.resolve()
        except (OSError, RuntimeError):
            self.real_root = root
        self.deployments: list[Path] = []
        base = root.joinpath(*AUTOTUNE_PARTS)
        start = base if base.is_dir() and _inside(base, self.real_root) else root
        self._visit(start, 0)

    def listing(self, directory: Path) -> list[Path]:
        try:
            return sorted(directory.iterdir())
        except OSError as exc:
            self.skip(directory, f"cannot list ({exc.strerror})")
            return []

    def allowed(self, path: Path) -> bool:
        """Inside the root once symlinks are resolved; else skipped and counted."""
        if _inside(path, self.real_root):
            return True
        self.skip(path, "a symlink that leads outside the root; not read")
        return False

    def _visit(self, directory: Path, depth: int) -> None:
        children = self.listing(directory)
        if any(RANK_FILE.fullmatch(p.name) for p in children) or ((directory / RUNS_DIR).is_dir()):
            self.deployments.append(directory)
        if depth >= MAX_DEPTH:
            return
        for child in children:
            if child.name == RUNS_DIR or not child.is_dir():
                continue
            if self.allowed(child):
                self._visit(child, depth + 1)


def _files(
    tree: _Tree, directory: Path, pattern: re.Pattern[str]
) -> list[tuple[Path, re.Match[str]]]:
    out = []
    for path in tree.listing(directory):
        match = pattern.fullmatch(path.name)
        if match is None:
            if TEMP_FILE.fullmatch(path.name) and path.is_file():
                tree.skip(path, "a temporary file (a save in progress or abandoned)")
            continue
        if tree.allowed(path):
            out.append((path, match))
    return out


def _sizes(matches: Sequence[re.Match[str]]) -> tuple[int, int, int]:
    return (
        max(int(m.group(1)) for m in matches) + 1,
        max(int(m.group(2)) for m in matches) + 1,
        max(int(m.group(3)) for m in matches) + 1,
    )


@dataclass(frozen=True)
class RankGroup:
    """One layout group: ``ranked`` is ``(rank in layout, path)``, the first of a rank winning."""

    directory: Path
    kind: str  # PER_RANK_KIND or RUNS_KIND
    layout: str
    ranked: tuple[tuple[int, Path], ...]
    names: tuple[str, ...]


def _groups(
    directory: Path,
    files: list[tuple[Path, re.Match[str]]],
    kind: str,
    known: tuple[Path | None, str] | None,
) -> list[RankGroup]:
    if not files:
        return []
    deployment = directory.parent if kind == RUNS_KIND else directory
    if known is not None and (known[0] is None or _same_dir(known[0], deployment)):
        base = known[1]
    else:
        tp, pp, dp = _sizes([m for _p, m in files])
        base = f"tp{tp}-pp{pp}-dp{dp}-ep1"
    by_group: dict[tuple[int, int], list[tuple[int, str, Path]]] = {}
    for path, m in files:
        stamp = m.group(4) if kind == RUNS_KIND else ""
        by_group.setdefault((int(m.group(2)), int(m.group(3))), []).append(
            (int(m.group(1)), stamp, path)
        )
    groups = []
    for (pp_rank, dp_rank), members in sorted(by_group.items()):
        # By rank; within a rank the newest run first (it wins where runs differ).
        members.sort(key=lambda item: (item[0], _negated(item[1]), item[2].name))
        groups.append(
            RankGroup(
                directory,
                kind,
                layout_name(base, pp_rank, dp_rank),
                tuple((rank, path) for rank, _stamp, path in members),
                tuple(sorted(path.name for _r, _s, path in members)),
            )
        )
    return groups


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except (OSError, RuntimeError):
        return a == b


def _negated(stamp: str) -> str:
    return "".join(chr(0x7F - ord(c)) for c in stamp)


def find_groups(
    roots: Sequence[Path], skip: Skip, known: tuple[Path | None, str] | None = None
) -> list[RankGroup]:
    """Every layout group under ``roots``; what cannot be used is ``skip``-ped with a reason.

    ``known``: (a deployment directory, its ``tp-pp-dp-ep`` sizes), for the groups there
    (a directory of None: every deployment).
    """
    groups: list[RankGroup] = []
    seen: set[Path] = set()
    for root in roots:
        if not root.is_dir():
            continue
        tree = _Tree(root, skip)
        for directory in tree.deployments:
            real = directory.resolve()
            if real in seen:
                continue
            seen.add(real)
            groups += _groups(directory, _files(tree, directory, RANK_FILE), PER_RANK_KIND, known)
            runs = directory / RUNS_DIR
            if runs.is_dir() and tree.allowed(runs):
                groups += _groups(runs, _files(tree, runs, RUN_FILE), RUNS_KIND, known)
    return groups
