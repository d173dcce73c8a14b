"""vLLM integration: every vLLM worker warm-starts FlashInfer's autotuner from ficache.

Installed as the ``ficache`` entry point of group ``vllm.general_plugins``;
vLLM calls ``register()`` with no arguments once in every process (API
server, engine core, each worker), long before model loading.

What ``register`` does: installs a lazy patch (an import hook, no vLLM import)
that replaces ``vllm.model_executor.warmup.kernel_warmup.flashinfer_autotune``
when that module is imported. vLLM looks the function up as a module
attribute at call time (``kernel_warmup`` and the weight-cache warm-up both
do), so replacing the attribute is enough.

What the replacement does: runs vLLM's own ``flashinfer_autotune`` (its dummy
runs, skip-ops, every version-specific detail) inside ``ficache.warm_start``
over vLLM's tuning group: the world group's gloo ``cpu_group``, or the TP
group's when pipeline parallelism is on (the same choice vLLM makes; with
PP each stage's TP group is its own warm start, and rank scopes name the
rank within that group). The layout is derived from the parallel config
(``tp2-pp1-dp1-ep1``), and the commit's provenance records the vLLM
version, the model and vLLM's config hash. During the dummy runs vLLM sets
its own autotune process group (that same ``cpu_group``) in place of the
tuning group ``warm_start`` set (which stays unused): timings are
all-reduced over the same ranks, and the protocol's collectives on that
group come only before and after vLLM's own, in the same order on every
rank. ``last_report()`` is this process's latest ``WarmStartReport``; one
INFO line per start summarizes it.

When vLLM's function raises on a rank (a failed dummy run, a broken
collective), the wrapper re-raises at once and leaves that start
abandoned: no exit protocol, nothing committed. The exit protocol would run
collectives on the group vLLM is still using: the other ranks are then
blocked in vLLM's own collectives on it (a tuning all-reduce, the barrier
after tuning), so ficache's exchange would pair with them and stall until
the group's timeout or garble both. An exception there is fatal to vLLM
(nothing catches it), so the failing worker dies, which closes the group
and fails its peers at once, exactly as without ficache.

vLLM's own autotune file cache. vLLM 0.32+ keeps a per-rank JSON file and,
when every rank has a "matching" one (same metadata and entry count, not
necessarily the same entries), loads it and skips its dummy runs. Under
ficache that would mean (1) nothing is tuned, so nothing ever reaches the
registry however incomplete it is, and (2) ranks no longer start from
exactly the slice ficache broadcast, which is what keeps synchronized
tuning (a cache hit on one rank and a miss on another deadlocks it) safe.
Decision: for the duration of the call vLLM's per-rank file is pointed into
an empty directory made for this start (vLLM's resolver is not called, so
nothing is created under ``VLLM_CACHE_ROOT``), vLLM never loads a cache of
its own, and its file is written into that directory and discarded. The
registry is the cache. Consequence: vLLM's weight-cache daemons, which seed
each other by shipping these per-rank files, find none; share a registry
(``FICACHE_DB``) instead. For the same reason FlashInfer's managed v2 store
(which vLLM 0.33 uses for single-GPU runs) is served by the start itself
where FlashInfer has one (``warm_start(v2=True)``, ``ficache.v2_mode``): each
rank's slice is written into a store root of its own, attached in place of
any store attached before (the sparse-MLA warmup's), every
``autotune_v2(cache_root=...)`` of the call is sent there, and what was
tuned into it is committed. vLLM's own gate then chooses v1 or v2 as it
would without ficache. Where FlashInfer has no managed store, vLLM's v2
switch is turned off for the call, as before.

Detected by behaviour. The wrapper needs ``flashinfer_autotune`` and vLLM's
process groups. vLLM's file-cache helpers (``FILE_CACHE_HELPERS``) are used
where present; a vLLM without them (vLLM PR #55671 runs its whole warmup
under ``autotune_v2`` and deletes them) is served through the managed store;
a vLLM without the helpers on a FlashInfer without the store is one warning
and vLLM's own function, unchanged.

Adopting what vLLM already tuned. A server that ran vLLM without ficache
has paid for its tuning in vLLM's own caches; installing ficache must not
make it pay again. So on a start whose registry holds nothing for its
fingerprint, rank 0 of the tuning group first adopts vLLM's caches
(``ficache.adopt``: every layout vLLM 0.27-0.33 writes under
``VLLM_CACHE_ROOT``, ``VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR`` and FlashInfer's
v2 store root) into the registry as one ``import`` commit, and logs one
line saying what it adopted; its own deployment directory (vLLM's
``flashinfer_autotune_root() / flashinfer_autotune_cache_hash(runner)``,
computed without creating anything) is scoped to this start's layout and
tuning-group ranks. This happens before the warm start, so rank 0 exports
the adopted entries and every rank loads the same slice; the other ranks
wait for it in the warm start's first collective. Adoption only reads
vLLM's files. It is tried once per start and costs one read-only query
once the registry holds entries. Any failure is logged and ignored (the
start goes on without it). ``FICACHE_ADOPT=0`` turns it off.

A registry server that stops answering (PostgreSQL) costs the adoption, the
warm start's export and its commit at most ``FICACHE_REGISTRY_TIMEOUT``
seconds each (default 60; ``ficache.deadline``), then the start goes on
without the registry.

Invariants:
- ``register`` never raises and imports nothing heavy (vLLM calls plugins
  outside any ``try``: a raising plugin would stop the server).
- ``FICACHE_VLLM=0`` (or ``false``/``off``/``no``) turns the plugin off:
  nothing is patched and vLLM behaves exactly as without ficache.
- ``FICACHE_VLLM`` is also read at every call: set to ``0`` after the patch,
  the wrapper calls vLLM's function as is.
- ``FICACHE_MODE`` (``ficache.engine_env.start_mode``, read at every call):
  ``replay`` runs vLLM's dummy runs with FlashInfer's profiling off
  (``warm_start(mode="replay")``): every key comes from the registry or is
  FlashInfer's fallback tactic, counted as missed in the start's log line;
  nothing is committed, so a replay start adopts nothing either (import
  vLLM's caches with ``ficache import --from-vllm``). A value it does not
  know is one warning, and tune.
- If the running vLLM lacks anything the wrapper relies on, or the warm
  start cannot begin (both are found before any collective, alike on every
  rank), the original function runs unchanged and one warning says why. A
  cache problem never stops the server: ``warm_start`` turns it into "tune
  uncached".
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.machinery
import logging
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ficache import engine_env

if TYPE_CHECKING:
    from ficache.adopt import KnownLayout
    from ficache.sync import WarmStartReport

logger = logging.getLogger("ficache.vllm")

TARGET_MODULE = "vllm.model_executor.warmup.kernel_warmup"
TARGET_FUNCTION = "flashinfer_autotune"
ENV_SWITCH = "FICACHE_VLLM"
ENV_ADOPT = engine_env.ENV_ADOPT
ENV_REGISTRY_TIMEOUT = engine_env.ENV_REGISTRY_TIMEOUT
#: vLLM's module of autotune cache helpers (where its deployment directory is named).
CACHE_HELPERS_MODULE = "vllm.model_executor.warmup.flashinfer_autotune_cache"
#: Module attributes of ``kernel_warmup`` the wrapper relies on, whatever vLLM's version.
REQUIRED_ATTRIBUTES = ("flashinfer_autotune",)
#: vLLM 0.32-0.33's helpers of its own autotune file cache: where present, the wrapper
#: points vLLM's per-rank file into a scratch directory (``_own_file_cache_isolated``).
#: vLLM PR #55671 deletes them (its warmup tunes under ``autotune_v2`` on every rank);
#: without them the wrapper needs FlashInfer's managed store (``ficache.v2_mode``).
FILE_CACHE_HELPERS = (
    "resolve_rank_flashinfer_autotune_file",
    "use_flashinfer_autotune_v2",
)
_WRAPPED_MARK = "__ficache_original__"

_lock = threading.Lock()
_finder: _PatchOnImport | None = None
_warned: set[str] = set()
_last_report: WarmStartReport | None = None


def enabled() -> bool:
    return engine_env.switch(ENV_SWITCH)


def adopt_enabled() -> bool:
    """``FICACHE_ADOPT`` (default on): adopt vLLM's own caches into an empty registry."""
    return engine_env.switch(ENV_ADOPT)


def registry_timeout() -> float:
    """``FICACHE_REGISTRY_TIMEOUT``: seconds a start waits, per phase, on a registry
    server that stopped answering (``ficache.deadline``; default 60). A value that is
    not a positive number is one warning, and the default."""
    return engine_env.registry_timeout(_warn_once)


def register() -> None:
    """vLLM's plugin entry point: install the lazy patch (idempotent, never raises)."""
    global _finder
    try:
        if not enabled():
            logger.debug("ficache: %s=0, the vLLM plugin is off", ENV_SWITCH)
            return
        with _lock:
            module = sys.modules.get(TARGET_MODULE)
            if module is not None:
                patch_module(module)
                return
            if _finder is None:
                _finder = _PatchOnImport()
                sys.meta_path.insert(0, _finder)
    except Exception as exc:  # noqa: BLE001 - a plugin must never stop vLLM
        _warn_once("register", f"ficache: vLLM plugin not installed ({type(exc).__name__}: {exc})")


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Wraps the target module's loader so the module is patched once executed."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET_MODULE:
            return None
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None and spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader)
                    return spec
        except Exception as exc:  # noqa: BLE001 - the normal import machinery takes over
            _warn_once("find", f"ficache: not patching vLLM ({type(exc).__name__}: {exc})")
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        create = getattr(self._inner, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        try:
            patch_module(module)
        except Exception as exc:  # noqa: BLE001 - never break vLLM's import
            _warn_once("patch", f"ficache: not patching vLLM ({type(exc).__name__}: {exc})")

    def __getattr__(self, name: str) -> Any:  # get_code, get_source, is_package, ...
        return getattr(self._inner, name)


def patch_module(module: ModuleType) -> bool:
    """Replace ``module.flashinfer_autotune`` with the ficache wrapper (idempotent)."""
    original = getattr(module, TARGET_FUNCTION, None)
    if original is None:
        _warn_once(
            "missing",
            f"ficache: {TARGET_MODULE} has no {TARGET_FUNCTION}; vLLM runs without ficache",
        )
        return False
    if getattr(original, _WRAPPED_MARK, None) is not None:
        return True
    setattr(module, TARGET_FUNCTION, make_wrapper(original, module))
    return True


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


class Unsupported(Exception):
    """The running vLLM lacks something the wrapper relies on."""


def make_wrapper(original: Callable[..., Any], module: ModuleType) -> Callable[..., Any]:
    @functools.wraps(original)
    def flashinfer_autotune(runner: Any, *args: Any, **kwargs: Any) -> Any:
        if not enabled():
            return original(runner, *args, **kwargs)
        try:
            plan = _plan(runner, module)
        except Unsupported as exc:
            _warn_once(
                "unsupported", f"ficache: running vLLM's own FlashInfer autotuning unchanged: {exc}"
            )
            return original(runner, *args, **kwargs)
        return _run(plan, original, module, runner, args, kwargs)

    setattr(flashinfer_autotune, _WRAPPED_MARK, original)
    return flashinfer_autotune


class _Plan:
    def __init__(
        self,
        coordinator: Any,
        layout: str,
        provenance: dict[str, Any],
        *,
        file_helpers: bool = True,
        v2: bool = False,
    ) -> None:
        self.coordinator = coordinator
        self.layout = layout
        self.provenance = provenance
        self.file_helpers = file_helpers  # vLLM's own file cache can be isolated
        self.v2 = v2  # FlashInfer's managed store can be served (``ficache.v2_mode``)


def _plan(runner: Any, module: ModuleType) -> _Plan:
    """Detect every feature the wrapper relies on; raise ``Unsupported`` if one is missing.

    By behaviour, not by vLLM version: vLLM's file-cache helpers are used where present;
    FlashInfer's managed store where it has one. A vLLM without the helpers is served
    through the managed store (vLLM PR #55671's warmup), or not at all.
    """
    from ficache import v2_mode

    missing = [name for name in REQUIRED_ATTRIBUTES if not hasattr(module, name)]
    if missing:
        raise Unsupported(f"{TARGET_MODULE} lacks {', '.join(missing)} (ficache targets vLLM 0.33)")
    lacking = [name for name in FILE_CACHE_HELPERS if not hasattr(module, name)]
    v2 = v2_mode.available()
    if lacking and not v2:
        raise Unsupported(
            f"{TARGET_MODULE} lacks {', '.join(lacking)} and this FlashInfer has no managed "
            "store (flashinfer.autotune_v2) to serve instead"
        )
    try:
        from vllm.distributed import parallel_state
    except ImportError as exc:
        raise Unsupported(f"cannot import vllm.distributed.parallel_state ({exc})") from None
    for name in ("get_world_group", "get_tp_group", "get_pp_group"):
        if not hasattr(parallel_state, name):
            raise Unsupported(f"vllm.distributed.parallel_state lacks {name}")
    config = getattr(runner, "vllm_config", None)
    parallel = getattr(config, "parallel_config", None)
    if parallel is None:
        raise Unsupported("the model runner has no vllm_config.parallel_config")
    try:
        world = parallel_state.get_world_group()
        pp_group = parallel_state.get_pp_group()
        coordinator = parallel_state.get_tp_group() if pp_group.world_size > 1 else world
        _ = coordinator.cpu_group, coordinator.rank_in_group, coordinator.world_size
    except Exception as exc:  # noqa: BLE001 - any shape we cannot read
        raise Unsupported(
            f"cannot read vLLM's process groups ({type(exc).__name__}: {exc})"
        ) from None
    return _Plan(
        coordinator,
        layout_of(parallel),
        provenance_of(config),
        file_helpers=not lacking,
        v2=v2,
    )


def layout_of(parallel: Any) -> str:
    """``tp{T}-pp{P}-dp{D}-ep{E}`` from vLLM's ``ParallelConfig``."""
    tp = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    dp = int(getattr(parallel, "data_parallel_size", 1) or 1)
    pcp = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
    ep = tp * dp * pcp if getattr(parallel, "enable_expert_parallel", False) else 1
    return f"tp{tp}-pp{pp}-dp{dp}-ep{ep}"


def provenance_of(config: Any) -> dict[str, Any]:
    """vLLM version, model and config hash, each best effort."""
    provenance: dict[str, Any] = {"framework": "vllm"}
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        provenance["vllm_version"] = version("vllm")
    model_config = getattr(config, "model_config", None)
    if model_config is not None:
        provenance["model"] = str(getattr(model_config, "model", None))
    with contextlib.suppress(Exception):
        provenance["vllm_config_hash"] = str(config.compute_hash())
    return provenance


@contextlib.contextmanager
def _own_file_cache_isolated(module: ModuleType, rank: int, *, keep_v2: bool) -> Iterator[None]:
    """Point vLLM's per-rank autotune file into an empty directory; turn v2 off unless
    ``keep_v2`` (the start serves FlashInfer's managed store: vLLM's own gate decides).

    The directory is made here, per start, and removed afterwards. The
    replacement never calls vLLM's resolver (which creates vLLM's cache
    directory and hashes the config). If no directory can be made, vLLM's
    own file is left in place (warned once): vLLM loads it only when every
    rank has a matching one, so ranks that differ in this stay consistent.
    """
    original_resolve = module.resolve_rank_flashinfer_autotune_file
    original_v2 = module.use_flashinfer_autotune_v2
    try:
        scratch = tempfile.mkdtemp(prefix=f"ficache-vllm-rank{rank}-")
    except OSError as exc:
        _warn_once(
            "scratch",
            f"ficache: no scratch directory for vLLM's autotune file ({exc}); "
            "vLLM's own per-rank file stays in use",
        )
        scratch = None
    if scratch is not None:
        path = Path(scratch) / "autotune_configs.json"
        module.resolve_rank_flashinfer_autotune_file = lambda runner: path  # type: ignore[attr-defined]
    if not keep_v2:
        module.use_flashinfer_autotune_v2 = lambda runner: False  # type: ignore[attr-defined]
    try:
        yield
    finally:
        module.resolve_rank_flashinfer_autotune_file = original_resolve  # type: ignore[attr-defined]
        module.use_flashinfer_autotune_v2 = original_v2  # type: ignore[attr-defined]
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def last_report() -> WarmStartReport | None:
    """This process's most recent warm-start report from the wrapper (None before the first)."""
    return _last_report


def _run(
    plan: _Plan,
    original: Callable[..., Any],
    module: ModuleType,
    runner: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    from ficache.engine_env import start_mode

    coordinator = plan.coordinator
    mode = start_mode()
    if coordinator.rank_in_group == 0 and adopt_enabled() and mode != "replay":
        _adopt_vllm_caches(plan, runner)  # before rank 0 exports: every rank loads the same
    stack = contextlib.ExitStack()
    try:
        from ficache.sync import warm_start

        ws = stack.enter_context(
            warm_start(
                coordinator.cpu_group,
                db=os.environ.get("FICACHE_DB"),
                layout=plan.layout,
                provenance=plan.provenance,
                registry_timeout=registry_timeout(),
                mode=mode,
                v2=True if plan.v2 else None,
            )
        )
    except Exception as exc:  # noqa: BLE001 - fails before any collective, alike on every rank
        _warn_once(
            "enter",
            "ficache: running vLLM's own FlashInfer autotuning unchanged: "
            f"the warm start could not begin ({type(exc).__name__}: {exc})",
        )
        return original(runner, *args, **kwargs)
    rank = coordinator.rank_in_group
    try:
        isolated = (
            _own_file_cache_isolated(module, rank, keep_v2=plan.v2)
            if plan.file_helpers
            else contextlib.nullcontext()
        )
        with isolated:
            result = original(runner, *args, **kwargs)
    except BaseException as exc:
        # Abandoned, not closed: see "When vLLM's function raises" in the module docstring.
        ws.abandon()
        logger.error(
            "ficache: vLLM's FlashInfer autotuning raised on rank %d (%s); this warm start is "
            "abandoned, nothing is committed, and the exception propagates as without ficache",
            rank,
            type(exc).__name__,
        )
        raise
    try:
        stack.close()  # the exit protocol: gather, commit, final slices
    finally:
        _log_report(ws.report, plan.layout)
    return result


def _known_layout(plan: _Plan, runner: Any) -> KnownLayout | None:
    """This deployment's directory of vLLM per-rank files, with its layout; None if unknown.

    vLLM's own helpers name it; neither creates anything (unlike its
    ``resolve_*`` functions, which make the directory).
    """
    from ficache.adopt import KnownLayout

    try:
        helpers = importlib.import_module(CACHE_HELPERS_MODULE)
        directory = Path(helpers.flashinfer_autotune_root()) / str(
            helpers.flashinfer_autotune_cache_hash(runner)
        )
    except Exception as exc:  # noqa: BLE001 - layouts are then derived from file names
        logger.debug("ficache: cannot name vLLM's autotune directory (%s)", exc)
        return None
    return KnownLayout(directory, plan.layout, int(plan.coordinator.world_size))


def _adopt_vllm_caches(plan: _Plan, runner: Any) -> None:
    """Rank 0: adopt vLLM's own autotune caches when the registry holds nothing for us.

    Never raises: any failure is one warning, and the start goes on without it.
    """

    def sources() -> Any:
        from ficache.adopt import default_sources

        return default_sources()

    engine_env.adopt_at_start(
        sources,
        what="vLLM's FlashInfer autotune caches",
        known=_known_layout(plan, runner),
        provenance=plan.provenance,
        timeout=registry_timeout(),
        log=logger,
        with_stores=True,
    )


def _log_report(report: WarmStartReport, layout: str) -> None:
    global _last_report
    _last_report = report
    engine_env.log_report(logger, report, layout, unit="start")
