"""SGLang integration: every FlashInfer tuning pass of SGLang warm-starts from ficache.

Installed as the ``ficache`` entry point of group ``sglang.srt.plugins``;
SGLang's ``load_plugins()`` calls ``register()`` with no arguments in every
scheduler (TP/PP worker) process, the launcher and ``Engine``, then applies
the hooks registered. ``register`` registers one AROUND hook (SGLang's
``HookRegistry``) on
``sglang.srt.model_executor.runner.flashinfer_autotune.flashinfer_autotune_context``,
the context manager every startup tuning pass enters (decode, extend,
prefill, speculative draft: several times per process). ``HookRegistry``
rebinds the names other modules imported with ``from ... import``.

What the hook does. It returns a context manager that runs SGLang's own
context (its dummy-run mode, skip-ops, MegaMoE context, the TP group's
timing reduction) inside ``ficache.warm_start`` over the TP group's CPU
(gloo) group, the group SGLang synchronizes tuning over. Each pipeline stage
and each data-parallel replica has its own TP group, so its own warm start
and its own rank 0; its layout names the stage and the replica,
``tp{T}-pp{P}-dp{D}-ep{E}.pp{p}.dp{d}``, so the rank scopes of one stage
never serve another. SGLang's context sets its own autotune process group
(that same CPU group) in place of the tuning group ``warm_start`` set:
timings are all-reduced over the same ranks, and the protocol's collectives
on the group come only before and after SGLang's own, in the same order on
every rank. The commit's provenance records the SGLang version and the
model path. ``last_report()`` is this process's latest report; one INFO line
per pass summarizes it.

One read per process, every pass served. The first pass of a process reads
the registry (rank 0 exports, every rank loads its slice); the later passes
read nothing: each is ``warm_start(reuse=<the group's previous pass>)``, so
rank 0 neither opens the registry nor renders a slice, and every pass is
served from what the process then holds: the AutoTuner is never cleared
between passes (``_CarryOver``: nothing is loaded again, and ``tuned``
counts only what that pass profiled). Each pass still commits what it tuned
(its exit protocol), to the registry the first pass read, and leaves its
served mark (``ficache stats`` counts passes: one boot is one start per
pass). A pass after one that could not use the registry (uncached) reads it
again, as a first pass does. Clearing between passes
would re-read what was just committed at best, and at worst (a commit that
did not land: a read-only registry) throw away tactics an earlier pass
tuned, so the target's kernels would run untuned after the draft's pass.
Every rank of the group holds the same keys after each pass (the exit
protocol loads the final slices everywhere), so the next pass still starts
with the same hits on every rank.

SGLang's own per-rank files. SGLang loads
``$SGLANG_CACHE_DIR/flashinfer/autotune/.../rank_tp{t}_pp{p}_dp{d}.json``
before the pass (after dropping it on every rank when the ranks' digests
differ) and saves it after. Loaded under ficache it would (1) shadow the
registry: its entries hit, so what the registry lacks is never tuned and
never committed, and (2) make ranks start from more than the slice ficache
broadcast, which is what keeps synchronized tuning safe. Saved into the
user's tree it would diverge from the registry the moment the registry
changes (a prune, a revert, another server's commit), and SGLang without
ficache would then load that stale file. Decision: for the duration of the
pass, the context's path function (``flashinfer_autotune_cache_path``, looked
up as a module global) names a file in an empty directory made for this
pass: SGLang loads nothing, its digest check sees no file on any rank (no
deletion), its save lands in that directory, which is removed afterwards.
Nothing is created under ``SGLANG_CACHE_DIR``. With
``SGLANG_FLASHINFER_AUTOTUNE_CACHE=0`` SGLang's ``runs/`` file goes there
too; FlashInfer's ``autotune(cache=...)`` then clears what was loaded
(SGLang's own comment says so), so such a start tunes everything again, on
every rank alike: the switch's meaning ("no reuse") is kept.

Adopting what SGLang already tuned. On the first pass of a process whose
registry holds nothing for its fingerprint, rank 0 of the group first adopts
SGLang's own tree (``ficache.adopt`` with ``ficache.sglang_cache``: every
deployment and layout, ``runs/`` included) as one ``import`` commit, before
it exports, so every rank loads the adopted entries; its own deployment
directory (SGLang's path function, called once, as SGLang itself would) is
named with this start's sizes. Any failure is one warning and the start goes
on without it. ``FICACHE_ADOPT=0`` turns it off.

When SGLang's context raises on a rank (a failed dummy run, an out-of-memory
SGLang re-raises under synchronized tuning), the hook re-raises at once and
leaves that warm start abandoned: no exit protocol, nothing committed. The
other ranks are still inside SGLang's collectives on the same group (a
timing all-reduce), so an exit protocol would pair its collectives with
theirs. The exception is fatal to SGLang's scheduler, which exits, closing
the group: its peers fail at once, exactly as without ficache.

A registry server that stops answering costs the adoption, the export and
each commit at most ``FICACHE_REGISTRY_TIMEOUT`` seconds (default 60).

``FICACHE_MODE=replay`` (``ficache.engine_env.start_mode``, read at every
pass, as the vLLM plugin reads it): each pass is ``warm_start(mode="replay")``,
which profiles nothing and commits nothing, so the first pass adopts nothing
either; its line says ``replay`` and ``missed N``.

Invariants:
- ``register`` never raises and imports no SGLang module but its hook
  registry (SGLang then imports the target to apply the hook).
- ``FICACHE_SGLANG=0`` (``false``/``off``/``no``) turns the plugin off:
  no hook is registered, and SGLang behaves exactly as without ficache. It
  is also read at every pass: set later, the hook hands the call to SGLang's
  own context, unchanged.
- An SGLang whose version is not in ``KNOWN_VERSIONS``, or that lacks the
  target or a module attribute the hook relies on, or a warm start that
  cannot begin (found before any collective, alike on every rank): SGLang's
  own context runs unchanged, and one warning (per process) says why.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ficache import engine_env
from ficache.tuner import FlashInferTuner, Row

if TYPE_CHECKING:
    from ficache.adopt import KnownLayout
    from ficache.sync import WarmStart, WarmStartReport

logger = logging.getLogger("ficache.sglang")

TARGET_MODULE = "sglang.srt.model_executor.runner.flashinfer_autotune"
TARGET_FUNCTION = "flashinfer_autotune_context"
TARGET = f"{TARGET_MODULE}.{TARGET_FUNCTION}"
ENV_SWITCH = "FICACHE_SGLANG"
ENV_ADOPT = engine_env.ENV_ADOPT
ENV_REGISTRY_TIMEOUT = engine_env.ENV_REGISTRY_TIMEOUT
#: SGLang releases the hook was written against -> the target module's attributes it
#: relies on (the context, and the path function it looks up as a module global).
KNOWN_VERSIONS: dict[str, tuple[str, ...]] = {
    "0.5.23": (TARGET_FUNCTION, "flashinfer_autotune_cache_path"),
}
#: ``sglang.srt.runtime_context.get_parallel()`` names the hook reads.
PARALLEL_NAMES = ("tp_group", "tp_size", "pp_size", "moe_ep_size", "pp_rank", "dp_rank")

_lock = threading.Lock()
_warned: set[str] = set()
_last_report: WarmStartReport | None = None
#: Passes entered per tuning group (id of its CPU group) in this process.
_passes: dict[int, int] = {}
#: The latest warm start per tuning group (id of its CPU group): the next pass reuses its read.
_latest: dict[int, Any] = {}


def enabled() -> bool:
    return engine_env.switch(ENV_SWITCH)


def adopt_enabled() -> bool:
    """``FICACHE_ADOPT`` (default on): adopt SGLang's own files into an empty registry."""
    return engine_env.switch(ENV_ADOPT)


def registry_timeout() -> float:
    """``FICACHE_REGISTRY_TIMEOUT`` (default 60 s); not a positive number: one warning."""
    return engine_env.registry_timeout(_warn_once)


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def sglang_version() -> str | None:
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        return version("sglang")
    return None


def unsupported_reason() -> str | None:
    """Why this SGLang is not one the hook knows (None: it is), without importing the target."""
    found = sglang_version()
    if found not in KNOWN_VERSIONS:
        known = ", ".join(sorted(KNOWN_VERSIONS))
        return f"SGLang {found or '(version unknown)'} is not one ficache knows ({known})"
    try:
        spec = importlib.util.find_spec(TARGET_MODULE)
    except (ImportError, ValueError) as exc:
        return f"cannot find {TARGET_MODULE} ({type(exc).__name__}: {exc})"
    if spec is None:
        return f"SGLang has no module {TARGET_MODULE}"
    return None


def register() -> None:
    """SGLang's plugin entry point: register the AROUND hook (never raises)."""
    try:
        if not enabled():
            logger.debug("ficache: %s=0, the SGLang plugin is off", ENV_SWITCH)
            return
        reason = unsupported_reason()
        if reason is not None:
            _warn_once(
                "unsupported",
                f"ficache: SGLang's FlashInfer autotuning runs without ficache: {reason}",
            )
            return
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        with _lock:
            registered = HookRegistry._hooks.get(TARGET, ())
            if any(hook is around_autotune_context for _t, hook, _s in registered):
                return
            HookRegistry.register(TARGET, around_autotune_context, HookType.AROUND)
    except Exception as exc:  # noqa: BLE001 - a plugin must never stop SGLang
        _warn_once(
            "register", f"ficache: SGLang plugin not installed ({type(exc).__name__}: {exc})"
        )


class Unsupported(Exception):
    """The running SGLang lacks something the hook relies on."""


class _Plan:
    def __init__(
        self,
        module: ModuleType,
        group: Any,
        rank: int,
        world: int,
        layout: str,
        base_layout: str,
        provenance: dict[str, Any],
    ) -> None:
        self.module = module
        self.group = group
        self.rank = rank
        self.world = world
        self.layout = layout
        self.base_layout = base_layout
        self.provenance = provenance


def _plan(model_runner: Any) -> _Plan:
    """Everything the hook relies on, read before any collective; ``Unsupported`` if not."""
    version = sglang_version()
    needed = KNOWN_VERSIONS.get(version or "")
    if needed is None:
        raise Unsupported(f"SGLang {version or '(version unknown)'} is not one ficache knows")
    try:
        module = importlib.import_module(TARGET_MODULE)
        from sglang.srt.runtime_context import get_parallel
    except ImportError as exc:
        raise Unsupported(f"cannot import SGLang's modules ({exc})") from None
    missing = [name for name in needed if not hasattr(module, name)]
    if missing:
        raise Unsupported(f"{TARGET_MODULE} lacks {', '.join(missing)}")
    try:
        parallel = get_parallel()
        values = {name: getattr(parallel, name) for name in PARALLEL_NAMES}
        dp_size = int(getattr(parallel, "dp_size", 1) or 1)
        group = values["tp_group"]
        cpu_group, rank, world = group.cpu_group, int(group.rank_in_group), int(group.world_size)
        sizes = (int(values["tp_size"]), int(values["pp_size"]), dp_size)
        ep = int(values["moe_ep_size"] or 1)
        pp_rank, dp_rank = int(values["pp_rank"] or 0), int(values["dp_rank"] or 0)
    except Exception as exc:  # noqa: BLE001 - any shape we cannot read
        raise Unsupported(
            f"cannot read SGLang's parallel context ({type(exc).__name__}: {exc})"
        ) from None
    from ficache.sglang_cache import layout_name

    base = f"tp{sizes[0]}-pp{sizes[1]}-dp{sizes[2]}-ep{ep}"
    provenance: dict[str, Any] = {"framework": "sglang", "sglang_version": version}
    with contextlib.suppress(Exception):
        from sglang.srt.runtime_context import get_model

        provenance["model"] = str(get_model().model_path)
    return _Plan(
        module, cpu_group, rank, world, layout_name(base, pp_rank, dp_rank), base, provenance
    )


class _CarryOver(FlashInferTuner):
    """The tuner of a pass after the first in this process: nothing is cleared or reloaded.

    ``clear`` marks what the process holds (the first pass's read, what every
    pass tuned, the final slices), ``load`` keeps it (the slice offered again
    is the registry's state, already held or about to be committed) and
    returns what is held, the same on every rank, and ``tuned`` is what was
    profiled since the mark: this pass's tuning only.
    """

    def __init__(self) -> None:
        super().__init__()
        self._held: set[str] = set()

    def clear(self) -> None:
        self._held = set(super().tuned())

    def load(self, text: str) -> int:
        return len(getattr(self.autotuner, "_file_configs", {})) + len(self._held)

    def tuned(self) -> dict[str, Row]:
        return {k: v for k, v in super().tuned().items() if k not in self._held}


def around_autotune_context(
    original: Callable[..., Any], model_runner: Any, *args: Any, **kwargs: Any
) -> Any:
    """The AROUND hook: SGLang's context, served by ficache (or SGLang's own, as is)."""
    if not enabled():
        return original(model_runner, *args, **kwargs)
    return _served(original, model_runner, args, kwargs)


@contextlib.contextmanager
def _own_files_isolated(module: ModuleType, rank: int) -> Iterator[None]:
    """Point SGLang's per-rank autotune file into an empty directory made for this pass.

    Removed afterwards. If no directory can be made, SGLang's own file stays
    in use (warned once): SGLang drops it on every rank when ranks' files
    differ, so ranks still start alike.
    """
    original = module.flashinfer_autotune_cache_path
    try:
        scratch = tempfile.mkdtemp(prefix=f"ficache-sglang-rank{rank}-")
    except OSError as exc:
        _warn_once(
            "scratch",
            f"ficache: no scratch directory for SGLang's autotune file ({exc}); "
            "SGLang's own per-rank file stays in use",
        )
        yield
        return
    path = Path(scratch) / "rank.json"
    module.flashinfer_autotune_cache_path = lambda model_runner: path  # type: ignore[attr-defined]
    try:
        yield
    finally:
        module.flashinfer_autotune_cache_path = original  # type: ignore[attr-defined]
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def _served(
    original: Callable[..., Any], model_runner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Iterator[Any]:
    """One pass: warm start (enter), SGLang's context, the exit protocol (commit)."""
    try:
        plan = _plan(model_runner)
    except Unsupported as exc:
        _warn_once(
            "unsupported", f"ficache: running SGLang's own FlashInfer autotuning unchanged: {exc}"
        )
        with original(model_runner, *args, **kwargs) as value:
            yield value
        return
    from ficache.engine_env import start_mode

    mode = start_mode()
    first = _passes.get(id(plan.group), 0) == 0
    # A replay start commits nothing, so it adopts nothing either (adoption is a commit).
    if first and plan.rank == 0 and adopt_enabled() and mode != "replay":
        _adopt_sglang_files(plan, model_runner)  # before rank 0 exports: every rank loads it
    stack = contextlib.ExitStack()
    try:
        ws = stack.enter_context(_warm_start(plan, first, mode))
    except Exception as exc:  # noqa: BLE001 - fails before any collective, alike on every rank
        _warn_once(
            "enter",
            "ficache: running SGLang's own FlashInfer autotuning unchanged: "
            f"the warm start could not begin ({type(exc).__name__}: {exc})",
        )
        with original(model_runner, *args, **kwargs) as value:
            yield value
        return
    _passes[id(plan.group)] = _passes.get(id(plan.group), 0) + 1
    _latest[id(plan.group)] = ws
    try:
        with (
            _own_files_isolated(plan.module, plan.rank),
            original(model_runner, *args, **kwargs) as value,
        ):
            yield value
    except BaseException as exc:
        _abandon(plan, exc)
        raise
    try:
        stack.close()  # the exit protocol: gather, commit, final slices
    finally:
        _log_report(ws.report, plan.layout)


def _warm_start(plan: _Plan, first: bool, mode: str) -> WarmStart:
    """This pass's warm start, not yet entered: a later pass carries the first one's over."""
    from ficache.sync import warm_start

    return warm_start(
        plan.group,
        db=os.environ.get("FICACHE_DB"),
        layout=plan.layout,
        tuner=None if first else _CarryOver(),
        provenance=plan.provenance,
        registry_timeout=registry_timeout(),
        mode=mode,
        reuse=None if first else _latest.get(id(plan.group)),
    )


def _abandon(plan: _Plan, exc: BaseException) -> None:
    """SGLang's context raised ``exc``: FlashInfer's process group unset, and one error logged.

    Abandoned, not closed: see "When SGLang's context raises" in the module
    docstring. The caller re-raises ``exc``.
    """
    with contextlib.suppress(Exception):
        from flashinfer.autotuner import set_autotune_process_group

        set_autotune_process_group(None)
    logger.error(
        "ficache: SGLang's FlashInfer autotuning raised on rank %d (%s); this warm start is "
        "abandoned, nothing is committed, and the exception propagates as without ficache",
        plan.rank,
        type(exc).__name__,
    )


def last_report() -> WarmStartReport | None:
    """This process's most recent warm-start report from the hook (None before the first)."""
    return _last_report


def _known_layout(plan: _Plan, model_runner: Any) -> KnownLayout | None:
    """This deployment's directory of SGLang files, with its sizes; None if SGLang can't say."""
    from ficache.adopt import KnownLayout

    try:
        directory = Path(plan.module.flashinfer_autotune_cache_path(model_runner)).parent
    except Exception as exc:  # noqa: BLE001 - layouts are then derived from file names
        logger.debug("ficache: cannot name SGLang's autotune directory (%s)", exc)
        return None
    return KnownLayout(directory, plan.base_layout, plan.world)


def _adopt_sglang_files(plan: _Plan, model_runner: Any) -> None:
    """Rank 0, first pass: adopt SGLang's own files when the registry holds nothing for us.

    Never raises: any failure is one warning, and the start goes on without it.
    """

    def sources() -> Any:
        from ficache.adopt import sglang_sources

        return sglang_sources()

    engine_env.adopt_at_start(
        sources,
        what="SGLang's FlashInfer autotune files",
        known=_known_layout(plan, model_runner),
        provenance=plan.provenance,
        timeout=registry_timeout(),
        log=logger,
    )


def _log_report(report: WarmStartReport, layout: str) -> None:
    global _last_report
    _last_report = report
    engine_env.log_report(logger, report, layout, unit="pass")
