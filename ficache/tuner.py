"""The adapter between the startup protocol and FlashInfer's ``AutoTuner``.

The protocol (``ficache.sync``) needs five things from a tuner, and nothing
else; ``Tuner`` names them. ``FlashInferTuner`` implements them over the
process-wide ``flashinfer.autotuner.AutoTuner.get()``.

An entry is ``file_key -> (runner, tactic_json, policy_json,
selection_json)``: the key string verbatim, the tactic, the measurement
policy and how FlashInfer chose the tactic (FlashInfer 0.7.4+: a JSON object
after the policy; None before, or when not chosen by tuning) as canonical
JSON (``ficache.flashinfer_format``), exactly as a FlashInfer cache file and
the registry hold them. The value is the first three (``row_value``): each
rank measures its own times, so ranks' selections differ while their values
agree, and nothing compares selections.

Invariants:
- ``load`` goes through FlashInfer's public ``load_configs`` (a private temp
  file, removed afterwards) and raises ``TunerError`` on any failure,
  including FlashInfer refusing the file (``load_configs`` returning False on
  a metadata mismatch). It adds to what the tuner holds; callers ``clear``
  first when they want exactly the loaded slice. Python's cyclic garbage
  collector is paused for the ``load_configs`` call: it allocates a few
  objects per entry, and a full collection triggered halfway (it walks
  torch's whole heap) used to cost 0.1-0.4 s of a 10k-entry load.
- ``entries`` is what FlashInfer would save: ``save_configs`` to a private
  temp file (never an existing one: ``save_configs`` merges with what is on
  disk), parsed strictly with ``parse_cache_bytes``.
- ``tuned`` is what this process profiled since the last ``clear`` (the
  public ``AutoTuner.profiling_cache``), rendered the way ``save_configs``
  renders it, without touching the disk. It costs nothing when nothing was
  profiled, which is the warm path. It reads two private attributes,
  ``_profiling_cache_policies`` (the measurement policy ``save_configs``
  writes as the third element) and, where FlashInfer has it,
  ``_profiling_cache_selections`` (the selection it writes as the fourth,
  after a policy only), read-only; a selection JSON cannot carry exactly is
  left out (``entries`` would refuse it: the startup path stays forgiving).
  A test checks that ``tuned`` agrees with ``entries`` so a FlashInfer
  change is caught.
- ``records`` is every namespaced record the tuner holds (loaded or
  published since), ``{namespace: {key: value}}`` as
  ``get_namespaced_records`` returns them (copies); the namespaces are read
  from the private ``_namespaced_records``, read-only. It is optional for
  other tuners (``ficache.sync`` treats a tuner without it as holding none).
- ``publish_protocol`` and ``protocol_records`` (optional for other tuners,
  as ``records``) are FlashInfer 0.7.4's protocol records
  (``ficache.protocol_records``). ``publish_protocol`` publishes each with the
  public ``publish_protocol_record(namespace, key, value, persist=False)``
  outside any ``autotune_v2`` context, so they land under the identity a v1
  block reads (FlashInfer's ``("__memory__",)``, no store and no policy), and
  it returns 0 without publishing on a FlashInfer that has none (0.7.2).
  ``protocol_records`` is what the tuner holds under the identities it is
  asked for (default: that one), ``{namespace: {key: value}}`` as copies; it
  reads the private ``_protocol_record_partitions`` under the tuner's lock,
  read-only, because ``get_protocol_records`` needs the namespace and reads
  only the calling thread's identity (a test checks the two agree).
- ``kept_slice`` and ``note_slice`` (optional for other tuners; ``ficache.sync``
  then always clears and loads) let a later start of this process skip a
  clear and a load it does not need. ``note_slice`` is called right after
  the tuner was cleared, loaded with a slice's texts and given its protocol
  records: it keeps, per ``AutoTuner`` object (a weak reference, so one
  process-wide tuner is shared by every ``FlashInferTuner`` over it), the
  texts, the protocol map, the counts that load returned and a snapshot of
  every container ``clear_cache`` empties that says what the tuner holds
  or serves (``_HELD_STATE``: the profiling cache, the loaded configs with
  their policies and selections, the namespaced and protocol records, the
  derived caches), as copies. ``kept_slice(texts, protocol)`` returns those
  counts only when the texts and the map are equal to the noted ones and
  every snapshotted container still equals what the tuner holds now (dict
  and set equality, O(n), no parsing), so the tuner provably holds exactly
  what clearing and loading would leave; else None. Left out of the
  comparison, as history rather than contents: ``_protocol_cache_generation``
  (a counter ``clear_cache`` bumps), ``_observed_cache_generations`` (keyed by
  the path a file was loaded from) and the log-once sets. A tuner that ever
  had a managed store attached (``_managed_cache``, ``_managed_stores``:
  their memos are reset only by ``clear_cache``), whose containers cannot
  be read or copied, or that has an attribute this module has not
  classified (``unclassified_state``: a FlashInfer release that added state)
  never keeps a slice. The snapshot holds its own
  containers, with the values (tactics, policies) shared: FlashInfer
  replaces them, never edits them in place.
- ``set_process_group`` is ``set_autotune_process_group``: while a group is
  set, FlashInfer all-reduces every per-tactic timing over it, so every rank
  of the group must profile the same sequence (see ``ficache.sync``).
- ``replay`` (optional for other tuners; ``ficache.sync``'s replay mode) is a
  context manager: while it is open FlashInfer never profiles and every
  lookup that misses is recorded. FlashInfer 0.7.2.post1 and 0.7.4 decide
  "profile or look up" on ``AutoTuner.is_tuning_mode``, which ``autotune()``
  recomputes on entry and exit as ``_active_tuning_contexts > 0`` (a
  reference count). ``replay`` lowers that count by ``_REPLAY_OFFSET`` for the
  block and sets ``is_tuning_mode`` False, so an engine's own
  ``autotune(True)`` inside the block leaves it False: ``choose_one`` takes
  its lookup path (``search_cache``: the cached tactic, or the fallback
  ``runners[0], -1`` on a miss, as FlashInfer does at inference). On exit it
  adds the offset back and recomputes ``is_tuning_mode`` as ``autotune()``
  would, so contexts opened or closed inside the block stay balanced. The
  misses are read from ``search_cache`` (its first element says hit or
  miss), wrapped on the instance for the block and restored afterwards;
  each distinct ``file_key`` (of the fallback runner ``runners[0]``, the key
  a tuned entry would have had) is one miss, however often it is asked.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ficache.errors import CacheFileError, TunerError
from ficache.flashinfer_format import canonical_json, parse_cache_bytes, selection_json

#: ``(runner, tactic_json, policy_json, selection_json)`` of one entry.
Row = tuple[str, str, str | None, str | None]


def row_value(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """A row's value, ``(runner, tactic_json, policy_json)``: what ranks must agree on."""
    return row[:3]


class Tuner(Protocol):
    """What the startup protocol needs from an autotuner."""

    def clear(self) -> None:
        """Forget every loaded and tuned entry."""

    def load(self, text: str) -> int:
        """Load a FlashInfer cache file's text; return the entries now loaded.

        Raises ``TunerError`` when the tuner refuses or fails to load it.
        """

    def entries(self) -> dict[str, Row]:
        """Everything the tuner holds now (loaded and tuned)."""

    def tuned(self) -> dict[str, Row]:
        """What the tuner profiled itself since the last ``clear``."""

    def set_process_group(self, group: Any | None) -> None:
        """Set (or clear, with None) the group timings are all-reduced over."""


#: FlashInfer's protocol-record identity with no managed store and no measurement policy
#: (``AutoTuner._winner_cache_identity() or ("__memory__",)``): what a v1 block reads.
MEMORY_IDENTITY: tuple[str, ...] = ("__memory__",)

#: How far ``FlashInferTuner.replay`` lowers ``AutoTuner._active_tuning_contexts``: far
#: more ``autotune(True)`` contexts than any process opens, so the count stays below 1.
_REPLAY_OFFSET = 1 << 40


@dataclass
class ReplayLookups:
    """What a replay block looked up: the ``file_key`` of every distinct miss, and how
    many lookups hit."""

    missed: set[str] = field(default_factory=set)
    hits: int = 0


#: The ``AutoTuner`` containers that say what it holds or serves (those ``clear_cache``
#: empties, less history and logging), by how deep a snapshot copies them: the container
#: only, one level more (containers of dicts or sets), or deep (JSON-like records).
_HELD_STATE: tuple[tuple[str, str], ...] = (
    ("profiling_cache", "shallow"),
    ("_profiling_cache_policies", "shallow"),
    ("_profiling_cache_selections", "two"),
    ("_ranked_tactics_cache", "shallow"),
    ("_ranked_tactics_partitions", "two"),
    ("_file_configs", "shallow"),
    ("_file_config_policies", "shallow"),
    ("_file_config_selections", "two"),
    ("_invalidated_file_keys", "shallow"),
    ("_excluded_file_keys", "two"),
    ("_namespaced_records", "deep"),
    ("_dirty_namespaces", "shallow"),
    ("_dirty", "value"),
    ("_winner_partitions", "two"),
    ("_protocol_record_partitions", "deep"),
    ("_managed_decoded", "shallow"),
    ("_preloaded_stores", "shallow"),
)

#: Every other ``AutoTuner`` attribute this code knows (FlashInfer 0.7.2.post1 and 0.7.4),
#: none of which says what the tuner holds: history (generation counters, the paths
#: loaded, log-once sets), settings, statistics, per-thread switches, the lock, and the
#: managed stores (a tuner that has any never keeps a slice).
_OTHER_STATE = frozenset(
    {
        "_active_tuning_contexts", "_blocklist", "_cupti_disabled", "_dirty_seq", "_lock",
        "_logged_cache_miss_oor", "_logged_file_hits", "_logged_invalid_tactic",
        "_managed_cache", "_managed_stores", "_measure_config_cache",
        "_observed_cache_generations", "_override_config_cache", "_override_local",
        "_protocol_cache_generation", "_record_global_timer", "_skip_ops_local",
        "_use_global_timer", "_v2_local", "_warned_cache_mismatch", "is_tuning_mode",
        "profiling_debug", "repeat", "stats", "stream_delay_micro_secs", "warmup",
    }
)  # fmt: skip


def unclassified_state(tuner: Any) -> set[str]:
    """``tuner``'s data attributes that are in neither ``_HELD_STATE`` nor ``_OTHER_STATE``.

    A FlashInfer that adds state this code has not classified could hold
    something a kept slice would not compare: such a tuner never keeps a
    slice (it clears and loads at every start, as before), and a test
    checks that each FlashInfer CI runs has none.
    """
    held = {name for name, _depth in _HELD_STATE}
    # Callables set on the instance are patched methods (a wrapped load), not state.
    state = {name for name, value in vars(tuner).items() if not callable(value)}
    return state - held - _OTHER_STATE


def _may_keep_slices(tuner: Any) -> bool:
    """Whether ``tuner`` may keep a slice at all: it never had a managed store, and every
    data attribute it has is classified (``unclassified_state``)."""
    if getattr(tuner, "_managed_cache", None) is not None or getattr(
        tuner, "_managed_stores", None
    ):
        return False
    return not unclassified_state(tuner)


#: Stands for a container this FlashInfer does not have (absent then and now: equal).
_ABSENT = ("ficache.tuner: absent",)


def _copied(value: Any, depth: str) -> Any:
    if value is _ABSENT or depth == "value":
        return value
    if depth == "deep":
        return copy.deepcopy(value)
    if depth == "two":
        return {k: copy.copy(v) for k, v in value.items()}
    return copy.copy(value)


@dataclass
class _NotedSlice:
    """What ``note_slice`` kept: the slice, the counts its load returned, the snapshot."""

    texts: tuple[str, ...]
    protocol: dict[str, dict[str, str]]
    counts: tuple[int, int]
    state: tuple[Any, ...]


#: ``AutoTuner`` object -> the slice it was last noted holding (``note_slice``).
_NOTED: weakref.WeakKeyDictionary[Any, _NotedSlice] = weakref.WeakKeyDictionary()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


class FlashInferTuner:
    """``Tuner`` over FlashInfer's process-wide ``AutoTuner``.

    ``autotuner`` defaults to ``AutoTuner.get()``; ``tmpdir`` is where the
    short-lived files for ``load_configs`` / ``save_configs`` go (default:
    the system temp dir).
    """

    def __init__(
        self, autotuner: Any | None = None, *, tmpdir: str | os.PathLike[str] | None = None
    ) -> None:
        if autotuner is None:
            from flashinfer.autotuner import AutoTuner

            autotuner = AutoTuner.get()
        self.autotuner = autotuner
        self.tmpdir = os.fspath(tmpdir) if tmpdir is not None else None

    def clear(self) -> None:
        self.autotuner.clear_cache()

    def load(self, text: str) -> int:
        before = len(getattr(self.autotuner, "_file_configs", {}))
        try:
            # Not ficache.publish: a private scratch file FlashInfer reads once and
            # that is removed below, so mkstemp's 0600 is right for it.
            fd, path = tempfile.mkstemp(prefix="ficache-load-", suffix=".json", dir=self.tmpdir)
        except OSError as exc:
            raise TunerError(
                f"cannot create a temp file to load the cache: {_one_line(exc)}"
            ) from None
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
            paused = gc.isenabled()
            gc.disable()  # see the module docstring
            try:
                accepted = self.autotuner.load_configs(path)
            except Exception as exc:  # noqa: BLE001 - FlashInfer raises several kinds
                raise TunerError(f"FlashInfer could not load the cache: {_one_line(exc)}") from None
            finally:
                if paused:
                    gc.enable()
        except OSError as exc:
            raise TunerError(f"cannot write the cache to load it: {_one_line(exc)}") from None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)
        if not accepted:
            raise TunerError(
                "FlashInfer refused the cache: its _metadata does not match this environment "
                "(flashinfer.autotuner._collect_metadata())"
            )
        return max(len(getattr(self.autotuner, "_file_configs", {})) - before, 0)

    def entries(self) -> dict[str, Row]:
        try:
            directory = tempfile.mkdtemp(prefix="ficache-save-", dir=self.tmpdir)
        except OSError as exc:
            raise TunerError(
                f"cannot create a temp dir to read the tuner: {_one_line(exc)}"
            ) from None
        try:
            path = os.path.join(directory, "cache.json")
            try:
                self.autotuner.save_configs(path)
                with open(path, "rb") as handle:
                    data = handle.read()
            except FileNotFoundError:
                return {}
            except Exception as exc:  # noqa: BLE001 - FlashInfer raises several kinds
                raise TunerError(f"FlashInfer could not save its cache: {_one_line(exc)}") from None
            try:
                parsed = parse_cache_bytes(data, source="AutoTuner.save_configs")
            except CacheFileError as exc:
                raise TunerError(str(exc)) from None
            return {
                e.key: (e.runner, e.tactic_json, e.policy_json, e.selection_json)
                for e in parsed.entries
            }
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def records(self) -> dict[str, dict[str, Any]]:
        held = getattr(self.autotuner, "_namespaced_records", None)
        if not held:
            return {}
        get = self.autotuner.get_namespaced_records
        return {ns: get(ns) for ns in list(held) if isinstance(ns, str) and ns and ns[0] != "_"}

    def publish_protocol(self, records: Mapping[str, Mapping[str, str]]) -> int:
        """Publish protocol records (values as canonical JSON text) in memory, never to a
        store; how many were published (0: this FlashInfer has no protocol records)."""
        import json

        publish = getattr(self.autotuner, "publish_protocol_record", None)
        if publish is None or not records:
            return 0
        count = 0
        try:
            for namespace, by_key in records.items():
                for key, value_json in by_key.items():
                    publish(namespace, key, json.loads(value_json), persist=False)
                    count += 1
        except Exception as exc:  # noqa: BLE001 - FlashInfer raises several kinds
            raise TunerError(f"FlashInfer refused a protocol record: {_one_line(exc)}") from None
        return count

    def protocol_records(
        self, identities: tuple[tuple[Any, ...], ...] = (MEMORY_IDENTITY,)
    ) -> dict[str, dict[str, Any]]:
        """The protocol records held under ``identities`` (later ones win), as copies."""
        partitions = getattr(self.autotuner, "_protocol_record_partitions", None)
        if not partitions:
            return {}
        out: dict[str, dict[str, Any]] = {}
        with self.autotuner._lock:
            for identity in identities:
                for namespace, by_key in partitions.get(identity, {}).items():
                    if by_key:
                        out.setdefault(namespace, {}).update(copy.deepcopy(by_key))
        return out

    def tuned(self) -> dict[str, Row]:
        cache = self.autotuner.profiling_cache
        if not cache:
            return {}
        from flashinfer.autotuner import _tactic_to_json

        policies = getattr(self.autotuner, "_profiling_cache_policies", {})
        selections = getattr(self.autotuner, "_profiling_cache_selections", {})
        out: dict[str, Row] = {}
        for key, (tactic, _profile) in list(cache.items()):
            policy = policies.get((None, key))
            selection = None
            if policy is not None:  # save_configs writes a selection after a policy only
                chosen = selections.get((None, key))
                if isinstance(chosen, dict):
                    try:
                        selection = selection_json(chosen)
                    except (ValueError, TypeError, RecursionError):
                        selection = None  # JSON cannot carry it exactly: left out
            out[key.file_key] = (
                key.runner_class_name,
                canonical_json(_tactic_to_json(tactic)),
                canonical_json(list(policy)) if policy is not None else None,
                selection,
            )
        return out

    def _held_state(self) -> tuple[Any, ...] | None:
        """A snapshot of ``_HELD_STATE`` as copies (module docstring); None when this tuner
        cannot keep a slice (a managed store was attached, or a container is unreadable)."""
        tuner = self.autotuner
        try:
            if not _may_keep_slices(tuner):
                return None
            with tuner._lock:
                return tuple(
                    _copied(getattr(tuner, name, _ABSENT), depth) for name, depth in _HELD_STATE
                )
        except Exception:  # noqa: BLE001 - then it clears and loads, as always
            return None

    def _holds(self, state: tuple[Any, ...]) -> bool:
        """Whether every ``_HELD_STATE`` container equals ``state``'s, with no copy."""
        tuner = self.autotuner
        try:
            if not _may_keep_slices(tuner):
                return False
            with tuner._lock:
                return all(
                    getattr(tuner, name, _ABSENT) == held
                    for (name, _depth), held in zip(_HELD_STATE, state, strict=True)
                )
        except Exception:  # noqa: BLE001
            return False

    def note_slice(
        self,
        texts: Sequence[str],
        protocol: Mapping[str, Mapping[str, str]],
        counts: tuple[int, int],
    ) -> None:
        """Right after a clear, the load of ``texts`` and the publishing of ``protocol``:
        remember them, the counts returned, and a snapshot of what the tuner holds."""
        state = self._held_state()
        try:
            if state is None:
                _NOTED.pop(self.autotuner, None)
                return
            _NOTED[self.autotuner] = _NotedSlice(
                tuple(texts), {ns: dict(by) for ns, by in protocol.items()}, counts, state
            )
        except TypeError:  # an AutoTuner that cannot be weakly referenced: never kept
            return

    def kept_slice(
        self, texts: Sequence[str], protocol: Mapping[str, Mapping[str, str]]
    ) -> tuple[int, int] | None:
        """The counts ``note_slice`` kept when the tuner provably still holds exactly what
        clearing, loading ``texts`` and publishing ``protocol`` would leave; else None."""
        try:
            noted = _NOTED.get(self.autotuner)
        except TypeError:
            return None
        if noted is None or noted.texts != tuple(texts) or noted.protocol != protocol:
            return None
        return noted.counts if self._holds(noted.state) else None

    def set_process_group(self, group: Any | None) -> None:
        from flashinfer.autotuner import set_autotune_process_group

        set_autotune_process_group(group)

    @contextlib.contextmanager
    def replay(self) -> Iterator[ReplayLookups]:
        """Never profile in the block; record each lookup that misses (module docstring)."""
        tuner = self.autotuner
        lookups = ReplayLookups()
        search = tuner.search_cache
        own = "search_cache" in vars(tuner)

        def search_cache(
            custom_op: str,
            runners: Any,
            input_shapes: Any,
            tuning_config: Any,
            inputs: Any = None,
            **kwargs: Any,
        ) -> Any:
            found = search(custom_op, runners, input_shapes, tuning_config, inputs, **kwargs)
            if found[0]:
                lookups.hits += 1
            else:
                lookups.missed.add(
                    _miss_key(tuner, custom_op, runners, input_shapes, tuning_config, inputs)
                )
            return found

        with tuner._lock:
            tuner._active_tuning_contexts -= _REPLAY_OFFSET
            tuner.is_tuning_mode = False
        tuner.search_cache = search_cache
        try:
            yield lookups
        finally:
            if own:
                tuner.search_cache = search
            else:
                with contextlib.suppress(AttributeError):
                    del tuner.search_cache
            with tuner._lock:
                tuner._active_tuning_contexts += _REPLAY_OFFSET
                tuner.is_tuning_mode = tuner._active_tuning_contexts > 0


def _miss_key(
    tuner: Any, custom_op: str, runners: Any, input_shapes: Any, tuning_config: Any, inputs: Any
) -> str:
    """The ``file_key`` a tuned entry for this lookup would have (its fallback runner's)."""
    try:
        runner = runners[0]
        extras = runner.get_cache_key_extras(inputs) if inputs is not None else ()
        key = tuner._get_cache_key(custom_op, runner, input_shapes, tuning_config, extras)
        return str(key.file_key)
    except Exception:  # noqa: BLE001 - still one miss, named by what was asked
        return str((custom_op, tuple(map(tuple, input_shapes))))
