"""What a FlashInfer AutoTuner holds after loading a cache file or attaching a v2 store.

Run by ``tests/test_flashinfer_fidelity.py`` with the python of the FlashInfer
release under test (0.7.4 here, 0.7.2.post1 in the vllm env)::

    python flashinfer_state.py metadata           # that release's _collect_metadata(), as JSON
    python flashinfer_state.py state SPEC OUT     # each item's tuner state, as JSON

``SPEC`` is ``{"items": [{"name", "kind": "file"|"store", "path", "probes",
"namespaces", "measurement"}]}``. FlashInfer is imported once; every item is
loaded in a child forked before anything is loaded, so each starts from a
fresh tuner, as a fresh process would. A probe is a key in ``encode`` form
(``{"op", "runner", "shapes", "extras"}``, ``extras`` None for a 3-element
key): the state holds what ``search_cache`` (the lookup ``choose_one`` makes
before it falls back) serves for it, asked with a stand-in runner of that
class whose ``get_cache_key_extras`` returns the key's extras (no GPU here),
and, for a store, what the store's ``lookup`` returns for its text.

Imports only the standard library, torch and FlashInfer (never ficache).
Where a release lacks a feature (0.7.2: selections, protocol records) the
state says ``"absent"``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any


def decode(value: Any) -> Any:
    """A key part from its JSON form: ``{"__tuple__": [..]}``, ``{"__dtype__": name}``,
    ``{"__device__": type}``; lists and scalars as they are."""
    import torch

    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(decode(v) for v in value["__tuple__"])
        if "__dtype__" in value:
            return getattr(torch, value["__dtype__"])
        if "__device__" in value:
            return torch.device(value["__device__"])
        raise ValueError(f"unknown key part {value!r}")
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def file_key(probe: dict[str, Any]) -> str:
    """The key text FlashInfer writes for ``probe`` (``str`` of its tuple)."""
    shapes = tuple(tuple(s) for s in probe["shapes"])
    if probe["extras"] is None:
        return str((probe["op"], probe["runner"], shapes))
    return str((probe["op"], probe["runner"], shapes, decode(probe["extras"])))


def plain(value: Any) -> Any:
    """A tuner value as JSON that keeps tuples and lists apart."""
    if isinstance(value, tuple):
        return {"tuple": [plain(v) for v in value]}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def _served(tuner: Any, probes: list[dict[str, Any]]) -> dict[str, Any]:
    from flashinfer.autotuner import TunableRunner, TuningConfig

    served = {}
    for probe in probes:
        extras = () if probe["extras"] is None else decode(probe["extras"])
        stand_in = type(
            probe["runner"],
            (TunableRunner,),
            {
                "get_valid_tactics": lambda self, inputs, profile: [],
                "forward": lambda self, inputs, tactic=-1, do_preparation=False, **kw: None,
                "get_cache_key_extras": lambda self, inputs, _e=extras: _e,
            },
        )()
        shapes = tuple(tuple(s) for s in probe["shapes"])
        hit, runner_id, tactic, _profile = tuner.search_cache(
            probe["op"], [stand_in], shapes, TuningConfig(), [None]
        )
        served[file_key(probe)] = plain([hit, runner_id, tactic])
    return served


def _common(tuner: Any, item: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, Any] = {
        "file_configs": plain(dict(sorted(tuner._file_configs.items()))),
        "policies": plain(dict(sorted(tuner._file_config_policies.items()))),
        "selections": plain(dict(sorted(getattr(tuner, "_file_config_selections", {}).items())))
        if hasattr(tuner, "_file_config_selections")
        else "absent",
        "records": plain(tuner._namespaced_records),
        "served": _served(tuner, item["probes"]),
    }
    if hasattr(tuner, "get_protocol_records"):
        state["protocol"] = {ns: plain(tuner.get_protocol_records(ns)) for ns in item["namespaces"]}
    else:
        state["protocol"] = "absent"
    return state


def _load_file(item: dict[str, Any]) -> dict[str, Any]:
    from flashinfer.autotuner import AutoTuner

    tuner = AutoTuner.get()
    loaded = tuner.load_configs(item["path"])
    state = {"loaded": loaded, **_common(tuner, item)}
    # What the next save makes of the file (merged, healed or left alone by its
    # _metadata): its content but the _generation it derives.
    shutil.copyfile(item["path"], item["path"] + ".saved")
    tuner.save_configs(item["path"] + ".saved")
    with open(item["path"] + ".saved") as handle:
        saved = json.load(handle)
    saved.pop("_generation", None)
    state["saved"] = saved
    return state


def _load_store(item: dict[str, Any]) -> dict[str, Any]:
    from flashinfer.autotune_cache import ManagedAutotuneCache, MeasurementPolicy, autotune_v2
    from flashinfer.autotuner import AutoTuner, _collect_metadata

    tuner = AutoTuner.get()
    policy = MeasurementPolicy(**item["measurement"]) if item["measurement"] else None
    manifest = dict(_collect_metadata())
    if policy is not None:
        manifest.update(policy.manifest_fields())
    store = ManagedAutotuneCache(manifest=manifest, root=item["path"])
    preloaded, total, skipped = store.preload()
    with autotune_v2(mode="tune", cache_root=item["path"], measurement_policy=policy):
        state = _common(tuner, item)
        decoded = getattr(tuner, "_managed_decoded", {})
        state["decoded"] = _sorted([plain(key[2:]), plain(value)] for key, value in decoded.items())
    fresh = ManagedAutotuneCache(manifest=manifest, root=item["path"])
    state["lookup"] = {file_key(p): plain(fresh.lookup(file_key(p))) for p in item["probes"]}
    state["preload"] = [_sorted([plain(k), plain(v)] for k, v in preloaded), total, skipped]
    return state


def _sorted(items: Any) -> list[Any]:
    return sorted(items, key=lambda item: json.dumps(item, sort_keys=True))


def _child(item: dict[str, Any], out: str) -> None:
    try:
        state = (_load_file if item["kind"] == "file" else _load_store)(item)
    except Exception as exc:  # noqa: BLE001 - reported to the test as the state
        state = {"error": f"{type(exc).__name__}: {exc}"}
    with open(out, "w") as handle:
        json.dump(state, handle, sort_keys=True)


def main(argv: list[str]) -> None:
    import logging

    logging.disable(logging.WARNING)
    import flashinfer.autotuner  # noqa: F401 - imported once, before every fork

    if argv[1] == "metadata":
        from flashinfer.autotuner import _collect_metadata

        print(json.dumps(dict(_collect_metadata())))
        return
    with open(argv[2]) as handle:
        spec = json.load(handle)
    states = {}
    for i, item in enumerate(spec["items"]):
        out = f"{argv[3]}.{i}"
        pid = os.fork()
        if pid == 0:
            try:
                _child(item, out)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        with open(out) as handle:
            states[item["name"]] = json.load(handle)
    with open(argv[3], "w") as handle:
        json.dump(states, handle, sort_keys=True)


if __name__ == "__main__":
    main(sys.argv)
