"""v2 mode of a warm start: the registry's slice served as FlashInfer's managed store.

When the code inside ``warm_start`` tunes through ``flashinfer.autotune_v2``
(vLLM 0.33's world-1 path, its sparse-MLA warmup, vLLM PR #55671's warmup),
FlashInfer publishes new winners to a managed store and keeps them in its
winner partitions, not in ``profiling_cache``: a v1 start would see nothing
tuned and commit nothing. In v2 mode each rank instead:

1. keeps one private store root for the life of the process
   (``V2Mode.root``; ``warm_start(v2_root=...)`` names another), and, for
   every start, writes exactly the slice it loaded into that root's
   environment: the manifest is the live ``_collect_metadata()`` plus the
   measurement policy the caller passes (``warm_start(measurement_policy=
   ...)``), so its ``env_hash`` is the one FlashInfer computes. A caller
   that passes none gets the policy of the block's first redirected
   ``autotune_v2`` call (``V2Mode.adopt``): a warmup that tunes under its
   own ``MeasurementPolicy`` (vLLM PR #55671's draft passes one) is served,
   harvested and committed in that policy's environment. A policy passed (or
   an attached store's) is known before the slice is chosen, so it is part of
   the start's fingerprint (``Fingerprint.measurement``, set by
   ``ficache.sync``): the start is served that policy's entries only and
   commits under it; an adopted one is not (the slice was chosen before it
   was known), and serves and commits under the start's default fingerprint
   as before;
2. attaches that root as the process's ambient store (FlashInfer's
   ``_resolve_managed_store``, the function ``autotune_v2`` itself calls),
   which replaces any store attached before (a node-local store that only
   some ranks would hit is never consulted), and, for the block, sends
   every ``autotune_v2(cache_root=...)`` to that root whatever root the
   caller names (``redirected`` lists the roots it asked for);
3. after the block reads the environment back (``harvest``): entries that
   are new or differ from what was served are what the block tuned, and go
   through the start's usual exit (same shared/scoped rules, same
   synchronized-tuning guarantee, same failure handling); served entries
   whose files are gone are what FlashInfer discarded (counted and warned;
   a start only adds, so the registry keeps them).

Invariants:
- Every rank serves exactly the slice it loaded (the broadcast one); a
  start that clears its tuner (ranks that do not agree) empties the store
  too (``V2ModeTuner.clear``).
- The root stays attached after the start: FlashInfer keeps serving from
  it (the final slice after a commit, what was tuned otherwise), as with a
  process-scope ``autotune_v2``. It is removed when the process exits.
- Reading the store back never evaluates anything (``ficache.v2_store``'s
  reader); a store that changes while it is read (its entry files listed,
  sized and dated before and after) is refused: ``tuned`` raises
  ``TunerError``, the start reports one line and commits nothing.
- FlashInfer 0.7.4's protocol records travel in the store: the slice's are
  written as protocol entry files beside its entries (``add_protocol``),
  and what the block holds at exit is those files read back plus what it
  published in memory under the store's identity or none
  (``V2ModeTuner.protocol_records``); the start keeps the ones that differ
  from what was served.
- The served environment changes at most once per start, at the block's
  first redirected ``autotune_v2`` call, and only when the caller passed no
  measurement policy and that call's manifest has other ``measure_*``
  fields: the slice and protocol records loaded so far are (re)written
  into that call's environment before FlashInfer resolves it, and
  ``measurement``, ``manifest``, ``env_hash``, ``env_dir``, the report and
  what was served all name it from then on (so the commit's provenance,
  ``v2_mode`` and ``v2_environments``, and a later ``export --v2-store``
  name that policy). The environment served before keeps its files: they
  are not counted as tuned anywhere.
- Entries tuned under a measurement policy other than the served one (a
  later call under yet another policy, or any other policy when the caller
  passed one) land in another environment directory of the root: they are
  counted and warned about, never committed.
- Every rank decides the same way from the same calls; nothing here
  exchanges the decision.
- Nothing here runs a collective.
"""

from __future__ import annotations

import atexit
import json
import logging
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ficache import v2_store
from ficache.errors import TunerError
from ficache.flashinfer_format import canonical_json
from ficache.tuner import MEMORY_IDENTITY, Row, Tuner

logger = logging.getLogger(__name__)

CACHE_MODULE = "flashinfer.autotune_cache"
_RESOLVE = "_resolve_managed_store"

_process_roots: dict[str, Path] = {}
_lock = threading.Lock()


def available() -> bool:
    """Whether this FlashInfer has a managed store ficache can serve (``autotune_v2``)."""
    try:
        import importlib

        flashinfer = importlib.import_module("flashinfer")
        module = importlib.import_module(CACHE_MODULE)
    except Exception:  # noqa: BLE001 - no v2 store in this FlashInfer
        return False
    return callable(getattr(flashinfer, "autotune_v2", None)) and callable(
        getattr(module, _RESOLVE, None)
    )


def attached_store() -> Any | None:
    """The managed store FlashInfer has attached for the process (None: none, or no v2)."""
    try:
        from flashinfer.autotuner import AutoTuner

        return getattr(AutoTuner.get(), "_managed_cache", None)
    except Exception:  # noqa: BLE001
        return None


def open_context_store() -> Any | None:
    """The store of an ``autotune_v2`` context open on this thread, or None."""
    try:
        from flashinfer.autotuner import AutoTuner

        local = getattr(AutoTuner.get(), "_v2_local", None)
    except Exception:  # noqa: BLE001
        return None
    if local is None or not getattr(local, "active", False):
        return None
    return getattr(local, "store", None) or "<no store>"


def measurement_fields(policy: Any) -> dict[str, str]:
    """Manifest fields of ``policy``: a ``MeasurementPolicy``, a mapping of ``measure_*``
    fields, a ``parse_measurement_policy`` spec, or None (the default policy)."""
    if policy is None:
        return {}
    if isinstance(policy, str):
        return v2_store.parse_measurement_policy(policy)
    if isinstance(policy, Mapping):
        fields = {str(k): str(v) for k, v in policy.items()}
    else:
        fields = {str(k): str(v) for k, v in policy.manifest_fields().items()}
    bad = [k for k in fields if not k.startswith(v2_store.MEASURE_PREFIX)]
    if bad:
        raise ValueError(f"measurement fields must start with 'measure_': {', '.join(bad)}")
    return fields


def store_measurement(store: Any) -> dict[str, str]:
    """The ``measure_*`` fields of a managed store's manifest."""
    return store_measurement_of(getattr(store, "manifest", None) or {})


def store_measurement_of(manifest: Mapping[str, Any]) -> dict[str, str]:
    """The ``measure_*`` fields of a manifest (what ``autotune_v2`` resolves a store by)."""
    return {
        str(k): str(v) for k, v in manifest.items() if str(k).startswith(v2_store.MEASURE_PREFIX)
    }


def process_root(rank: int) -> Path:
    """This process's store root for ``rank`` (made once, removed at exit)."""
    name = f"rank{rank}"
    with _lock:
        root = _process_roots.get(name)
        if root is None:
            root = Path(tempfile.mkdtemp(prefix=f"ficache-v2-{name}-"))
            _process_roots[name] = root
            atexit.register(shutil.rmtree, root, True)
        return root


@dataclass
class V2Report:
    """What v2 mode did on one rank (``WarmStartReport.v2``)."""

    root: str
    env_hash: str = ""
    measurement: dict[str, str] = field(default_factory=dict)
    served: int = 0  # entry files written for the block
    harvested: int = 0  # new or changed entries read back
    discarded: int = 0  # served entry files FlashInfer removed
    replaced: str | None = None  # the root of the store attached before, if another
    redirected: list[str] = field(default_factory=list)  # roots autotune_v2 was asked for
    elsewhere: int = 0  # entries tuned under another measurement policy (not committed)

    def as_json(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "env_hash": self.env_hash,
            "measurement": dict(self.measurement),
            "served": self.served,
            "harvested": self.harvested,
            "discarded": self.discarded,
            "replaced": self.replaced,
            "redirected": list(self.redirected),
            "elsewhere": self.elsewhere,
        }


class V2Mode:
    """One rank's managed store for one warm start (see the module docstring)."""

    def __init__(
        self, root: Path, measurement: Mapping[str, str], *, adopt_policy: bool = False
    ) -> None:
        """``adopt_policy``: the caller passed no measurement policy, so the block's first
        redirected ``autotune_v2`` call may name the one served (``adopt``)."""
        from flashinfer.autotuner import _collect_metadata

        self.root = root
        self.metadata = {str(k): str(v) for k, v in _collect_metadata().items()}
        self.report = V2Report(str(root))
        self._use_measurement(measurement)
        #: Whether the next redirected ``autotune_v2`` call may still switch the policy.
        self.adopt_policy = adopt_policy
        #: ``env_hash -> what was served there`` of an environment served before ``adopt``.
        self._served_before: dict[str, dict[str, tuple[str, str, str | None]]] = {}
        self._loaded: list[str] = []  # every slice text loaded (re-written on ``adopt``)
        self._loaded_protocol: dict[str, dict[str, str]] = {}  # protocol records, likewise
        #: Whether the store is written and attached: at ``serve(eager=True)``, else at
        #: the block's first ``autotune_v2`` call (``_activate``).
        self.active = False
        self._pending: list[str] = []  # slice texts loaded before the store was written
        self._pending_protocol: dict[str, dict[str, str]] = {}  # protocol records, likewise
        self._served: dict[str, tuple[Any, ...]] = {}
        self._saved_resolve: Callable[..., Any] | None = None
        self.warnings: list[str] = []

    def _use_measurement(self, measurement: Mapping[str, str]) -> None:
        self.measurement = dict(measurement)
        self.manifest = v2_store.manifest_for(self.metadata, self.measurement)
        self.env_hash = v2_store.env_hash(self.manifest)
        self.env_dir = self.root / v2_store.SCHEMA / self.env_hash
        self.report.env_hash, self.report.measurement = self.env_hash, dict(self.measurement)

    # -- the files ----------------------------------------------------------

    def add_slice(self, text: str) -> None:
        """A slice text the tuner loaded: written now when active, else when activated."""
        self._loaded.append(text)
        if self.active:
            self.write_slice(text)
        else:
            self._pending.append(text)

    def add_protocol(self, records: Mapping[str, Mapping[str, str]]) -> None:
        """A slice's protocol records (canonical JSON values): written now when active, else
        when activated."""
        for ns, by_key in records.items():
            self._loaded_protocol.setdefault(ns, {}).update(by_key)
        if not self.active:
            for ns, by_key in records.items():
                self._pending_protocol.setdefault(ns, {}).update(by_key)
            return
        rows = [(ns, k, v, None) for ns, by_key in records.items() for k, v in by_key.items()]
        try:
            v2_store.store_export(self.metadata, self.measurement, [], rows).write(self.root)
        except v2_store.V2StoreError as exc:
            raise TunerError(f"cannot serve the protocol records as a v2 store: {exc}") from None

    def wipe(self) -> None:
        """Remove every entry file under the root (manifests stay) and forget pending slices."""
        self._pending, self._pending_protocol = [], {}
        self._loaded, self._loaded_protocol = [], {}
        schema_dir = self.root / v2_store.SCHEMA
        if not schema_dir.is_dir():
            return
        for env_dir in schema_dir.iterdir():
            entries = env_dir / v2_store.ENTRIES
            if entries.is_dir():
                for path in entries.iterdir():
                    path.unlink(missing_ok=True)

    def write_slice(self, text: str) -> None:
        """Write the entries of one slice text (a FlashInfer cache file) into the store."""
        data = json.loads(text)
        rows = [
            (
                key,
                value[0],
                canonical_json(value[1]),
                canonical_json(value[2]) if len(value) >= 3 else None,
                None,
            )
            for key, value in data.items()
            if not key.startswith("_") and isinstance(value, list) and len(value) >= 2
        ]
        try:
            v2_store.store_export(self.metadata, self.measurement, rows).write(self.root)
        except v2_store.V2StoreError as exc:
            raise TunerError(f"cannot serve the slice as a v2 store: {exc}") from None

    def _read(self) -> dict[str, tuple[str, str, str | None]]:
        """The environment's entries, ``key -> (runner, tactic, policy)``; refused when the
        files change while they are read."""
        env = self._read_environment()
        return {e.key: (e.runner, e.tactic_json, e.policy_json) for e in env.entries}

    def held_protocol(self) -> dict[str, dict[str, Any]]:
        """The environment's protocol records, ``{namespace: {key: value}}`` (nothing before
        the store is active); refused as ``_read`` is."""
        if not self.active:
            return {}
        out: dict[str, dict[str, Any]] = {}
        for entry, _at in self._read_environment().protocol:
            out.setdefault(entry.namespace, {})[entry.key] = json.loads(entry.value_json)
        return out

    @property
    def identity(self) -> tuple[str, str]:
        """FlashInfer's winner-cache identity of this store (``_winner_cache_identity``)."""
        return (str(self.root), self.env_hash)

    def _read_environment(self) -> v2_store.StoreEnvironment:
        try:
            return v2_store._read_environment(self.env_dir)
        except ValueError as exc:
            raise TunerError(f"v2 store {self.env_dir}: {exc}") from None

    # -- the block ----------------------------------------------------------

    def serve(self, *, eager: bool) -> None:
        """Redirect ``autotune_v2`` to the root for the block; write and attach the store now
        when ``eager`` (v2 mode asked for, or a store already attached), else at the block's
        first ``autotune_v2`` call."""
        import importlib

        module = importlib.import_module(CACHE_MODULE)
        original = getattr(module, _RESOLVE)

        def redirected(tuner: Any, cache_root: Any, manifest: Any, *a: Any, **kw: Any) -> Any:
            if self.adopt_policy:
                self.adopt_policy = False
                self.adopt(store_measurement_of(manifest))
            if not self.active:
                self._activate(original)
            if cache_root is None or Path(cache_root) != self.root:
                asked = "<flashinfer default>" if cache_root is None else str(cache_root)
                if asked not in self.report.redirected:
                    self.report.redirected.append(asked)
                    logger.info(
                        "ficache: autotune_v2(cache_root=%s) served from this start's store %s",
                        asked,
                        self.root,
                    )
            return original(tuner, self.root, manifest, *a, **kw)

        if eager:
            self._activate(original)
        setattr(module, _RESOLVE, redirected)
        self._saved_resolve = original

    def adopt(self, measurement: Mapping[str, str]) -> None:
        """Serve the environment of ``measurement`` from now on, when it is another policy:
        an active store has the slice and protocol records it loaded re-written there, and
        what it serves re-read there (module docstring's invariants)."""
        measurement = dict(measurement)
        if measurement == self.measurement:
            return
        before = v2_store.measurement_label(self.measurement)
        if self.active:
            self._served_before[self.env_hash] = self._served
        self._use_measurement(measurement)
        logger.info(
            "ficache: the block tunes under measurement policy %s (not %s): its slice is "
            "served in environment %s",
            v2_store.measurement_label(self.measurement),
            before,
            self.env_hash,
        )
        if not self.active:
            return  # ``_activate`` writes the pending slice under the new policy
        for text in self._loaded:
            self.write_slice(text)
        if self._loaded_protocol:
            self.add_protocol({ns: dict(by_key) for ns, by_key in self._loaded_protocol.items()})
        self._write_manifest()
        self._served = self._read()
        self.report.served = len(self._served)

    def _write_manifest(self) -> None:
        self.env_dir.mkdir(parents=True, exist_ok=True)
        if not (self.env_dir / v2_store.MANIFEST).exists():
            v2_store.store_export(self.metadata, self.measurement, []).write(self.root)

    def environments_provenance(self, fingerprint_digest: str) -> dict[str, Any]:
        """The commit's record of the served environment when the block tuned entries into
        it (``v2_store.environments_provenance``: what ``export --v2-store`` reads the
        policy back from); nothing otherwise. ``records`` is not counted here (0)."""
        if not self.report.harvested:
            return {}
        stored = v2_store.StoredEnvironment(
            self.env_dir,
            self.env_hash,
            fingerprint_digest,
            tuple(sorted(self.measurement.items())),
            self.report.harvested,
            0,
            0,
        )
        return v2_store.environments_provenance([stored])

    def _activate(self, resolve: Callable[..., Any]) -> None:
        """Write the slice loaded so far, attach the root, note what it serves."""
        from flashinfer.autotuner import AutoTuner

        self.active = True
        pending, self._pending = self._pending, []
        for text in pending:
            self.write_slice(text)
        pending_protocol, self._pending_protocol = self._pending_protocol, {}
        if pending_protocol:
            self.add_protocol(pending_protocol)
        self._write_manifest()
        before = attached_store()
        if before is not None and Path(str(getattr(before, "root", ""))) != self.root:
            self.report.replaced = str(getattr(before, "root", before))
            self.warnings.append(
                f"a FlashInfer managed store was attached when the start began "
                f"({self.report.replaced}); ficache served its slice through its own store "
                f"root in its place, so that store's entries were not consulted "
                f"(`ficache import --v2-store {self.report.replaced}` adds them)"
            )
        resolve(AutoTuner.get(), self.root, {**self.metadata, **self.measurement})
        self._served = self._read()
        self.report.served = len(self._served)

    def end_block(self) -> None:
        """Stop redirecting ``autotune_v2`` (the root stays attached). Idempotent."""
        if self._saved_resolve is None:
            return
        import importlib

        setattr(importlib.import_module(CACHE_MODULE), _RESOLVE, self._saved_resolve)
        self._saved_resolve = None

    def harvest(self) -> dict[str, Row]:
        """What the block tuned into the store: new or changed entries (module docstring);
        nothing when the store was never activated (the block tuned through v1 only)."""
        if not self.active:
            return {}
        now = self._read()
        tuned: dict[str, Row] = {}
        for key, value in now.items():
            if self._served.get(key) != value:
                tuned[key] = (value[0], value[1], value[2], None)
        self.report.harvested = len(tuned)
        self.report.discarded = sum(1 for key in self._served if key not in now)
        if self.report.discarded:
            self._warn_once(
                f"FlashInfer discarded {self.report.discarded} served entries of the v2 store "
                "and did not re-tune them; the registry keeps them"
            )
        self.report.elsewhere = self._count_elsewhere()
        if self.report.elsewhere:
            self._warn_once(
                f"{self.report.elsewhere} entries were tuned under another measurement policy "
                f"than the one served ({v2_store.measurement_label(self.measurement)}); not "
                "committed: pass that policy to warm_start(measurement_policy=...)"
            )
        return tuned

    def _count_elsewhere(self) -> int:
        """Entry files of the other environments, less what this start served in one
        before ``adopt`` (unchanged there)."""
        schema_dir = self.root / v2_store.SCHEMA
        count = 0
        for env_dir in schema_dir.iterdir() if schema_dir.is_dir() else ():
            entries = env_dir / v2_store.ENTRIES
            if env_dir.name == self.env_hash or not entries.is_dir():
                continue
            served = self._served_before.get(env_dir.name)
            if served is None:
                count += sum(1 for p in entries.iterdir() if p.suffix == ".json")
                continue
            try:
                env = v2_store._read_environment(env_dir)
            except ValueError as exc:
                raise TunerError(f"v2 store {env_dir}: {exc}") from None
            count += sum(
                1
                for e in env.entries
                if served.get(e.key) != (e.runner, e.tactic_json, e.policy_json)
            )
        return count

    def _warn_once(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)


class V2ModeTuner:
    """A ``Tuner`` whose loads are also served as a v2 store, and whose ``tuned`` adds what
    the block tuned into that store (``V2Mode.harvest``) to what the inner tuner profiled."""

    def __init__(self, inner: Tuner, mode: V2Mode) -> None:
        self.inner = inner
        self.mode = mode

    def clear(self) -> None:
        self.inner.clear()
        self.mode.wipe()

    def load(self, text: str) -> int:
        loaded = self.inner.load(text)
        self.mode.add_slice(text)
        return loaded

    def entries(self) -> dict[str, Row]:
        return self.inner.entries()

    def kept_slice(
        self, texts: Sequence[str], protocol: Mapping[str, Mapping[str, str]]
    ) -> tuple[int, int] | None:
        """The inner tuner's ``kept_slice``; when it keeps the slice, the store is still
        given the texts and protocol records, as ``load`` and ``publish_protocol`` would."""
        keep = getattr(self.inner, "kept_slice", None)
        counts = keep(texts, protocol) if keep is not None else None
        if counts is not None:
            for text in texts:
                self.mode.add_slice(text)
            if counts[1]:
                self.mode.add_protocol(protocol)
        return counts

    def note_slice(
        self,
        texts: Sequence[str],
        protocol: Mapping[str, Mapping[str, str]],
        counts: tuple[int, int],
    ) -> None:
        note = getattr(self.inner, "note_slice", None)
        if note is not None:
            note(texts, protocol, counts)

    def tuned(self) -> dict[str, Row]:
        out = dict(self.inner.tuned())
        out.update(self.mode.harvest())
        return out

    def records(self) -> dict[str, dict[str, Any]]:
        read = getattr(self.inner, "records", None)
        return read() if read is not None else {}

    def publish_protocol(self, records: Mapping[str, Mapping[str, str]]) -> int:
        """Publish in memory (as a v1 block reads them) and serve them in the store."""
        publish = getattr(self.inner, "publish_protocol", None)
        published = publish(records) if publish is not None else 0
        if published:
            self.mode.add_protocol(records)
        return published

    def protocol_records(self) -> dict[str, dict[str, Any]]:
        """What the block holds: published in memory with no store or under this store's
        identity, then the store's protocol entry files (which win)."""
        read = getattr(self.inner, "protocol_records", None)
        out: dict[str, dict[str, Any]] = {}
        if read is not None:
            out = read((MEMORY_IDENTITY, self.mode.identity))
        for ns, by_key in self.mode.held_protocol().items():
            out.setdefault(ns, {}).update(by_key)
        return out

    def set_process_group(self, group: Any | None) -> None:
        self.inner.set_process_group(group)

    def __getattr__(self, name: str) -> Any:
        """Optional tuner abilities (``replay``, for a replay start) are the inner tuner's:
        wrapping for v2 mode must never take one away (absent there: absent here)."""
        if name in ("replay",):
            return getattr(self.inner, name)
        raise AttributeError(name)
