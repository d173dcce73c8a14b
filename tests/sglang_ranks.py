"""One rank of the SGLang plugin tests: ``python tests/sglang_ranks.py SCENARIO RANK WORLD PORT OUT``.

``tests/test_sglang_plugin.py`` starts WORLD of these processes (a hard
timeout kills them) and asserts on the JSON each writes to
``OUT/rank{RANK}.json``. Everything is SGLang 0.5.23's own code: its plugin
loader (``sglang.srt.plugins.load_plugins``, which discovers ficache's entry
point and applies its hook), its runtime context (published with SGLang's
own test primitive ``override_server_args``), its process groups over gloo
(``init_distributed_environment`` / ``initialize_model_parallel``) and its
``flashinfer_autotune_context``, entered as SGLang's ``run_flashinfer_autotune_forward``
enters it. Inside each pass, FlashInfer's REAL tuning loop runs
(``ficache.standin_timing.real_loop_tune``: ``choose_one`` with its
all-reduces over the group SGLang set; only CUDA timing replaced).

The stand-ins, at the GPU boundary and named as such:

- ``StandInModelRunner``: what the context reads from SGLang's ``ModelRunner``
  (device, dtype, model config, the forward stream, draft flag).
- ``_CudaStandIn``: the ``torch`` that ``flashinfer_autotune``'s module sees
  (its module global only), whose ``cuda`` answers ``get_device_capability``
  with (9, 0) (an H100/H200: SGLang names its cache directory by it) and
  gives CPU streams (no-ops: CPU work is synchronous); every other ``torch``
  name is torch's own.

Scenarios:

- ``plugin``: ``start_cold`` (a decode pass, shapes A, fresh registry;
  rank 0 then copies the registry to ``partial.db``, which lacks B),
  ``extend_same_read`` (the same process, FICACHE_DB now names a file that
  does not exist: an extend pass of shapes A+B reads nothing, is served A
  from the first read and commits B where the first pass read), then
  restarts (the AutoTuner cleared and the plugin's pass state reset, as in a
  new process): ``start_warm`` (A), ``start_partial`` (A+B on ``partial.db``),
  ``replay_boot1`` and ``replay_extend`` (``FICACHE_MODE=replay`` on a copy of
  ``partial.db``, so B is missing: a decode pass of A+B, then an extend pass
  of A+B in the same process), ``replay_boot2`` (a new process, the same
  pass), ``adopt`` (``FICACHE_DB`` fresh again; SGLang's
  own files, written first by SGLang's own code with ficache switched off at
  run time in ``sglang_writes``, are adopted), and last ``rank1_fails`` (rank
  1 raises halfway through tuning; the process then ends, as SGLang's
  scheduler would).
- ``off`` (``FICACHE_SGLANG=0``) and ``bare`` (``SGLANG_PLUGINS`` lets no
  plugin load): two passes each, SGLang's files and the tuner recorded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

TARGET = "sglang.srt.model_executor.runner.flashinfer_autotune"
SHAPES_A = ((128, 128), (128, 256))
SHAPES_AB = ((128, 128), (128, 256), (256, 128))
#: Deterministic winners (off vs bare compare files byte for byte): every tactic but 4
#: (the default tactic -1 races too) is charged 50 ms more, on every rank (fault
#: injection, named as such).
SKEW = {-1: 50.0, 0: 50.0, 1: 50.0, 2: 50.0, 3: 50.0}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(
            {"logger": record.name, "level": record.levelname, "message": record.getMessage()}
        )

    def take(self) -> list[dict[str, Any]]:
        out, self.records = self.records, []
        return out


class _CpuStream:
    """STAND-IN for a CUDA stream: CPU work is synchronous, so waiting is nothing."""

    def wait_stream(self, other: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None


class _CudaNamespace:
    """STAND-IN for ``torch.cuda`` as ``flashinfer_autotune`` uses it."""

    def get_device_capability(self, device: Any = None) -> tuple[int, int]:
        return (9, 0)

    def current_stream(self, device: Any = None) -> _CpuStream:
        return _CpuStream()

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def empty_cache(self) -> None:
        return None

    def __getattr__(self, name: str) -> Any:  # OutOfMemoryError, ...: torch's own
        import torch

        return getattr(torch.cuda, name)


class _CudaStandIn(ModuleType):
    """STAND-IN for the ``torch`` global of ``flashinfer_autotune``'s module only."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaNamespace()

    def get_device_module(self, device: Any = None) -> Any:
        return self.cuda

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch, name)


class StandInModelRunner:
    """STAND-IN for SGLang's ``ModelRunner``: what the autotune context reads from it."""

    def __init__(self) -> None:
        import torch

        self.device = "cuda"
        self.dtype = torch.bfloat16
        self.is_draft_worker = False
        self.forward_stream = _CpuStream()

        class _HfConfig:
            pass

        class _ModelConfig:
            quantization = None
            hf_config = _HfConfig()

        self.model_config = _ModelConfig()


def tree_state(root: Path) -> dict[str, str]:
    """Every file under ``root``: the sha256 of its bytes."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


class Rank:
    def __init__(self, scenario: str, rank: int, world: int, port: int, out: Path) -> None:
        self.scenario, self.rank, self.world, self.port, self.out = scenario, rank, world, port, out
        self.result: dict[str, Any] = {"rank": rank, "steps": {}}
        self.records = _Records()
        self.runner = StandInModelRunner()
        # SGLang's autotune files (FlashInfer's JIT log lands elsewhere under the cache dir).
        self.cache_dir = Path(os.environ["SGLANG_CACHE_DIR"]) / "flashinfer" / "autotune"

    def setup(self) -> ModuleType:
        for name in ("ficache", "flashinfer", "alembic", "sglang"):
            logging.getLogger(name).setLevel(logging.DEBUG if name == "ficache" else logging.ERROR)
        logging.getLogger("ficache").addHandler(self.records)
        from sglang.srt.runtime_context import get_context

        get_context().override_server_args(
            tp_size=self.world, device="cpu", moe_runner_backend="flashinfer_trtllm"
        ).install()
        # This process's ranks, as SGLang's launcher publishes them.
        get_context().parallel.override_permanently(tp_rank=self.rank, pp_rank=0, dp_rank=0)
        import sglang.srt.plugins

        sglang.srt.plugins.load_plugins()
        import importlib

        module = importlib.import_module(TARGET)
        fn = module.flashinfer_autotune_context
        # SGLang's own: contextlib's wrapper around the generator defined in its module.
        # Hooked: HookRegistry's AROUND wrapper, whose __wrapped__ is SGLang's own.
        inner = getattr(fn, "__wrapped__", None)
        self.result["hook"] = {
            "wrapped": Path(fn.__code__.co_filename).name == "hook_registry.py",
            "module_of_fn": fn.__module__,
            "is_sglangs_own": Path(fn.__code__.co_filename).name == "contextlib.py"
            and inner is not None
            and inner.__code__.co_filename == module.__file__
            and inner.__qualname__ == "flashinfer_autotune_context",
        }
        from sglang.srt.distributed import parallel_state as ps

        ps.init_distributed_environment(
            world_size=self.world,
            rank=self.rank,
            distributed_init_method=f"tcp://127.0.0.1:{self.port}",
            local_rank=self.rank,
            backend="gloo",
            timeout=60,
        )
        ps.initialize_model_parallel(backend="gloo")
        module.torch = _CudaStandIn()  # the GPU boundary (see _CudaStandIn)
        return module

    def restart(self) -> None:
        """What a new process would hold: an empty AutoTuner, no pass yet."""
        from flashinfer.autotuner import AutoTuner

        import ficache.sglang_plugin as plugin

        AutoTuner.get().clear_cache()
        plugin._passes.clear()
        plugin._latest.clear()

    def run_pass(
        self, name: str, module: ModuleType, shapes: Any, *, fail: bool = False
    ) -> dict[str, Any]:
        """One tuning pass, as ``run_flashinfer_autotune_forward`` runs one."""
        import torch.distributed as dist
        from sglang.srt.runtime_context import get_parallel

        import ficache.sglang_plugin as plugin
        from ficache.standin_timing import real_loop_tune
        from ficache.tuner import FlashInferTuner, row_value

        before = plugin.last_report()
        self.records.take()
        step: dict[str, Any] = {"exception": None, "profiled": 0, "hits": 0}
        started = time.perf_counter()
        try:
            with module.flashinfer_autotune_context(self.runner, run_lm_head=False):
                if fail:
                    real_loop_tune(shapes[:1], skew=SKEW)
                    raise RuntimeError("injected failure in the dummy forward")
                result = real_loop_tune(shapes, skew=SKEW)
                step.update(profiled=result.profiled, hits=result.hits)
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            step["exception"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
        step["seconds"] = round(time.perf_counter() - started, 3)
        after = plugin.last_report()
        step["report"] = after.as_json() if after is not None and after is not before else None
        step["records"] = self.records.take()
        state = {k: list(row_value(r)) for k, r in sorted(FlashInferTuner().entries().items())}
        step["entries"] = len(state)
        step["state"] = state
        # This rank's own files only: the other rank may still be writing its own.
        mine = f"rank_tp{self.rank}_"
        step["sglang_files"] = {
            path: digest
            for path, digest in tree_state(self.cache_dir).items()
            if Path(path).name.startswith(mine)
        }
        if step["exception"] is None:
            gathered: list[Any] = [None] * self.world
            try:
                dist.all_gather_object(gathered, state, group=get_parallel().tp_group.cpu_group)
                step["identical_across_ranks"] = all(g == gathered[0] for g in gathered)
            except RuntimeError as exc:  # a peer that failed its pass has gone
                step["peer_gone"] = str(exc).splitlines()[0]
        self.result["steps"][name] = step
        return step

    def write(self) -> None:
        (self.out / f"rank{self.rank}.json").write_text(json.dumps(self.result, indent=1))

    def plugin(self, module: ModuleType) -> None:
        import shutil

        db = self.out / "registry.db"
        os.environ["FICACHE_DB"] = str(db)
        self.run_pass("start_cold", module, SHAPES_A)
        if self.rank == 0:  # only rank 0 reads the registry
            shutil.copy(db, self.out / "partial.db")
            shutil.copy(db, self.out / "replay.db")
        os.environ["FICACHE_DB"] = str(self.out / f"absent-rank{self.rank}" / "registry.db")
        self.run_pass("extend_same_read", module, SHAPES_AB)
        os.environ["FICACHE_DB"] = str(db)
        self.restart()
        self.run_pass("start_warm", module, SHAPES_A)
        self.restart()
        os.environ["FICACHE_DB"] = str(self.out / "partial.db")
        self.run_pass("start_partial", module, SHAPES_AB)
        self.restart()
        os.environ["FICACHE_DB"] = str(self.out / "replay.db")
        os.environ["FICACHE_MODE"] = "replay"
        self.run_pass("replay_boot1", module, SHAPES_AB)
        self.run_pass("replay_extend", module, SHAPES_AB)
        self.restart()
        self.run_pass("replay_boot2", module, SHAPES_AB)
        del os.environ["FICACHE_MODE"]
        self.restart()
        os.environ["FICACHE_SGLANG"] = "0"
        self.run_pass("sglang_writes", module, SHAPES_AB)
        del os.environ["FICACHE_SGLANG"]
        self.restart()
        os.environ["FICACHE_DB"] = str(self.out / "adopt.db")
        self.run_pass("adopt", module, SHAPES_AB)
        self.restart()
        os.environ["FICACHE_DB"] = str(self.out / "fails.db")
        os.environ["FICACHE_ADOPT"] = "0"
        step = self.run_pass("rank1_fails", module, SHAPES_AB, fail=self.rank == 1)
        self.write()
        if step["exception"] is not None or "peer_gone" in step:
            os._exit(3)  # SGLang's scheduler dies of it; so does this rank, without cleanup

    def twice(self, module: ModuleType) -> None:
        os.environ["FICACHE_DB"] = str(self.out / "registry.db")
        self.run_pass("first", module, SHAPES_A)
        self.run_pass("second", module, SHAPES_AB)
        self.restart()
        self.run_pass("restarted", module, SHAPES_AB)


def main() -> None:
    scenario, rank, world, port, out = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        int(sys.argv[4]),
        Path(sys.argv[5]),
    )
    os.environ["FICACHE_TEST_RANK"] = str(rank)
    worker = Rank(scenario, rank, world, port, out)
    try:
        module = worker.setup()
        if scenario == "plugin":
            worker.plugin(module)
        else:
            worker.twice(module)
    except Exception:  # noqa: BLE001 - reported to the test
        worker.result["error"] = traceback.format_exc()
    worker.write()


if __name__ == "__main__":
    main()
