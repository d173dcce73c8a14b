"""One rank of the vLLM plugin tests: ``python tests/vllm_ranks.py SCENARIO RANK WORLD PORT OUT``.

``tests/test_vllm_plugin.py`` starts WORLD of these processes (a hard
timeout kills them) and asserts on the JSON each writes to
``OUT/rank{RANK}.json``. Everything is vLLM 0.33's own code: its plugin
loader (``vllm.plugins.load_general_plugins``), ``init_distributed_environment``
and ``initialize_model_parallel`` over gloo, its ``GroupCoordinator`` groups,
its ``VllmConfig`` and ``kernel_warmup.flashinfer_autotune``, called exactly
as vLLM's worker calls it (``kernel_warmup`` gates that call on SM90, which
a CPU never is, so the scenarios call it directly).

The one stand-in: ``StandInModelRunner``, in place of vLLM's GPU model
runner. Its ``_dummy_run`` (what vLLM's ``flashinfer_autotune`` runs under
FlashInfer's ``autotune`` context) is where FlashInfer's tuning would
happen on a GPU; here ``ficache.standin.standin_tune`` fills the real
AutoTuner's cache the same way, all-reducing each timing over
``get_autotune_process_group()`` (the group vLLM sets for the dummy runs),
and the runner counts the keys it had to profile and the keys it found.

Scenarios (each process runs every step of its scenario in order):

- ``plugin``: the plugin on. Rank 0 imports ``kernel_warmup`` before
  ``load_general_plugins()`` (patched in place), rank 1 after (patched by the
  import hook). Steps: ``start1`` (fresh registry), ``start2`` (the AutoTuner
  cleared, as in a restarted server), ``runtime_off`` (``FICACHE_VLLM=0`` set
  after the patch: the wrapper steps aside), ``unsupported`` (an older vLLM
  simulated), then adoption (``ficache.adopt``): each rank rewrites the
  per-rank file vLLM wrote in ``unsupported`` with one entry of its own (a
  tactic that differs per rank), through vLLM's
  ``write_flashinfer_autotune_cache`` at the path vLLM's
  ``resolve_rank_flashinfer_autotune_file`` names, and ``adopt`` (a fresh
  registry: rank 0 adopts vLLM's files, every rank loads them),
  ``adopt_again`` (the same registry: nothing adopted) and ``adopt_off``
  (``FICACHE_ADOPT=0``, a fresh registry: vLLM tunes) follow; then
  ``db_dir`` and ``db_garbage`` (FICACHE_DB unusable), and last
  ``rank1_fails`` (fault injection: rank 1's dummy run raises halfway; the
  process then ends, as a vLLM worker would; adoption off).
- ``off``: ``FICACHE_VLLM=0`` from the start. Rank 0 imports ``kernel_warmup``
  before the plugins load, rank 1 after. One ``start``.
- ``pp2``: WORLD ranks as tensor parallel WORLD/2 x pipeline parallel 2 (vLLM's
  layout: TP groups {0, 1} and {2, 3}). Each stage's TP group is its own
  tuning group and its own warm start, on one shared registry. Steps
  ``start1`` (fresh registry, both stages at once: every rank's first dummy run
  waits after tuning until all have tuned, so both stages exported before
  either commits) and ``start2`` (restarted).
  Rank 0 imports ``kernel_warmup`` before the plugins load, the others after.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import json
import logging
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

KW = "vllm.model_executor.warmup.kernel_warmup"
#: The entry each rank adds to its vLLM per-rank file before ``adopt``: tactic = its rank.
PROBE_RUNNER = "CpuStandInMatmulRunner"
PROBE_KEY = str(("ficache::vllm_adopt_probe", PROBE_RUNNER, ((8, 8),), ()))


class _Records(logging.Handler):
    """Collects the records of the ``ficache`` loggers."""

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


class StandInModelRunner:
    """STAND-IN for vLLM's ``GPUModelRunner``: what ``flashinfer_autotune`` reads from it.

    ``vllm_config`` and ``scheduler_config`` are vLLM's real config objects;
    ``get_model()`` is a plain module (vLLM scans it for quantized kernels
    and MoE layers and finds none). ``_dummy_run`` is the fake at the GPU
    boundary: instead of a forward pass whose FlashInfer ops tune
    themselves, it tunes the stand-in op (``ficache.standin``) and then
    marks the AutoTuner the way FlashInfer's ``choose_one`` does after a
    profile (the measurement policy of each new winner, ``_dirty``), so
    vLLM's own "save if dirty" logic sees what tuning would leave.
    """

    def __init__(self, vllm_config: Any) -> None:
        import torch

        self.vllm_config = vllm_config
        self.scheduler_config = vllm_config.scheduler_config
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 8))
        self.dummy_runs: list[dict[str, Any]] = []
        self.fail_after_first_shape = False  # fault injection, named as such
        # v2 scenarios: tune through FlashInfer's real ``choose_one`` (only CUDA timing stood
        # in, ``ficache.standin_timing``), which publishes to a managed store under
        # ``autotune_v2`` as FlashInfer does on a GPU.
        self.real_loop = False
        # pp2: (directory, world) where every rank waits after its first tuning, so both
        # stages exported before either commits (files, no collective).
        self.rendezvous: tuple[Path, int] | None = None
        self.profiled = 0
        self.hits = 0
        self.reduces = 0
        # ``replay``: the dummy run asks FlashInfer's real ``choose_one`` for every key
        # (``real_loop_serve``) instead of the stand-in's loop; ``tactics`` is what each got.
        self.serve = False
        self.tactics: dict[str, Any] = {}

    def get_model(self) -> Any:
        return self.model

    def reset_counts(self) -> None:
        self.dummy_runs, self.profiled, self.hits, self.reduces = [], 0, 0, 0

    def _dummy_run(self, num_tokens: int, **kwargs: Any) -> None:
        from flashinfer.autotuner import AutoTuner, get_autotune_process_group

        from ficache.standin import CONFIG, DEFAULT_SHAPES, standin_tune

        tuner = AutoTuner.get()
        before = set(tuner.profiling_cache)
        group = get_autotune_process_group()
        if self.serve:
            from ficache.standin_timing import real_loop_serve

            served = real_loop_serve()
            self.profiled += served.profiled
            self.reduces += served.reduces
            self.tactics = {k: v for k, v in served.tactics.items()}
            self.dummy_runs.append(
                {
                    "num_tokens": num_tokens,
                    "profiled": served.profiled,
                    "fallbacks": served.fallbacks,
                }
            )
            return
        if self.real_loop:
            from ficache.standin_timing import real_loop_tune

            loop = real_loop_tune()
            self.profiled += loop.profiled
            self.hits += loop.hits
            self.dummy_runs.append(
                {"num_tokens": num_tokens, "profiled": loop.profiled, "hits": loop.hits}
            )
            return
        if self.fail_after_first_shape:
            # Fault injection: tune one shape (its all-reduces included), then fail
            # while the other rank still tunes the next shapes.
            standin_tune(DEFAULT_SHAPES[:1])
            raise RuntimeError("injected failure in the dummy run")
        result = standin_tune()
        if self.rendezvous is not None:
            directory, world = self.rendezvous
            self.rendezvous = None
            (directory / f"rank{os.environ['FICACHE_TEST_RANK']}").write_text("tuned\n")
            deadline = time.monotonic() + 60
            while len(list(directory.iterdir())) < world and time.monotonic() < deadline:
                time.sleep(0.05)
        new = [key for key in tuner.profiling_cache if key not in before]
        if new:
            policy = tuner._profiling_policy(CONFIG)
            for key in new:
                tuner._profiling_cache_policies[(None, key)] = policy
            tuner._dirty = True
            tuner._dirty_seq += 1
        self.profiled += result.profiled
        self.hits += result.hits
        self.reduces += result.reduces
        self.dummy_runs.append(
            {
                "num_tokens": num_tokens,
                "kwargs": sorted(kwargs),
                "tuning_mode": bool(tuner.is_tuning_mode),
                "group_size": None if group is None else group.size(),
                "profiled": result.profiled,
                "hits": result.hits,
            }
        )


def autotuner_state() -> dict[str, Any]:
    """What the AutoTuner would save (entries only, no ``_metadata``/``_generation``), as
    ``[runner, tactic, policy]``: the value ranks agree on (a selection is per-rank timing)."""
    from ficache.tuner import FlashInferTuner, row_value

    return {key: list(row_value(row)) for key, row in sorted(FlashInferTuner().entries().items())}


def files_under(root: Path) -> list[str]:
    if not root.exists():
        return []
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def tree_state(root: Path) -> dict[str, list[Any]]:
    """Every path under ``root``: the sha256 of its bytes ("" for a directory) and its mtime."""
    return {
        str(p.relative_to(root)): [
            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "",
            p.stat().st_mtime_ns,
        ]
        for p in sorted(root.rglob("*"))
    }


class Rank:
    def __init__(self, scenario: str, rank: int, world: int, port: int, out: Path) -> None:
        self.scenario, self.rank, self.world, self.port, self.out = (
            scenario,
            rank,
            world,
            port,
            out,
        )
        self.result: dict[str, Any] = {"rank": rank, "steps": {}, "timings": {}}
        self.records = _Records()
        self._t = time.perf_counter()

    def tick(self, name: str) -> None:
        now = time.perf_counter()
        self.result["timings"][name] = round(now - self._t, 3)
        self._t = now

    # -- setup --------------------------------------------------------------

    def load_plugins(self) -> Any:
        """Import kernel_warmup before (rank 0) or after (other ranks) the plugins load."""
        for name in ("ficache", "flashinfer", "alembic"):
            logging.getLogger(name).setLevel(logging.DEBUG if name == "ficache" else logging.ERROR)
        logging.getLogger("ficache").addHandler(self.records)
        import vllm.plugins

        before = self.rank == 0
        self.result["kw_imported_before_plugins"] = before
        self.result["kw_in_modules_before_import"] = KW in sys.modules
        original = None
        if before:
            import vllm.model_executor.warmup.kernel_warmup as kw_early

            original = kw_early.flashinfer_autotune
        vllm.plugins.load_general_plugins()
        self.result["finder_installed"] = any(
            type(f).__module__ == "ficache.vllm_plugin" for f in sys.meta_path
        )
        import vllm.model_executor.warmup.kernel_warmup as kw

        fn = kw.flashinfer_autotune
        marked = getattr(fn, "__ficache_original__", None)
        self.result["patch"] = {
            "wrapped": marked is not None,
            "code_file": Path(fn.__code__.co_filename).name,
            "original_is_vllms": marked is not None
            and marked.__module__ == KW
            and marked.__code__.co_filename == kw.__file__,
            "unwrapped_is_vllms": marked is None
            and fn.__module__ == KW
            and fn.__code__.co_filename == kw.__file__,
            "same_object_as_before": original is None or fn is original,
        }
        self.tick("import_and_plugins")
        return kw

    def init_distributed(self) -> Any:
        from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
        from vllm.distributed.parallel_state import (
            init_distributed_environment,
            initialize_model_parallel,
        )

        tp, pp = (self.world // 2, 2) if self.scenario == "pp2" else (self.world, 1)
        config = VllmConfig(
            parallel_config=ParallelConfig(
                tensor_parallel_size=tp,
                pipeline_parallel_size=pp,
                cpu_distributed_timeout_seconds=60,
            )
        )
        with set_current_vllm_config(config):
            init_distributed_environment(
                world_size=self.world,
                rank=self.rank,
                distributed_init_method=f"tcp://127.0.0.1:{self.port}",
                local_rank=self.rank,
                backend="gloo",
                timeout=timedelta(seconds=60),
            )
            initialize_model_parallel(
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
            )
        self.tick("init_distributed")
        return config

    # -- one start ------------------------------------------------------------

    def start(
        self,
        name: str,
        kw: Any,
        runner: StandInModelRunner,
        config: Any,
        *,
        compare: bool = True,
    ) -> dict[str, Any]:
        """One server start: a clean AutoTuner, then vLLM's flashinfer_autotune."""
        import torch.distributed as dist
        from flashinfer.autotuner import AutoTuner
        from vllm.config import set_current_vllm_config
        from vllm.distributed.parallel_state import get_world_group

        import ficache.vllm_plugin as plugin

        # A restarted server holds nothing yet: no entries, and no managed store attached
        # (a start in v2 mode leaves its store attached for the rest of the process).
        AutoTuner.get().clear_cache()
        AutoTuner.get()._managed_cache = None
        runner.reset_counts()
        before = plugin.last_report()
        self.records.take()
        step: dict[str, Any] = {"exception": None}
        started = time.perf_counter()
        try:
            with set_current_vllm_config(config):
                kw.flashinfer_autotune(runner)
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            step["exception"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        step["seconds"] = round(time.perf_counter() - started, 3)
        # The served mark rank 0 writes on a thread of its own after a start on a SQLite
        # file: done before this step's plain SQL looks at the registry.
        import ficache.usage

        assert ficache.usage.wait_for_served_marks(timeout=120)
        after = plugin.last_report()
        step["report"] = after.as_json() if after is not None and after is not before else None
        step.update(profiled=runner.profiled, hits=runner.hits, reduces=runner.reduces)
        step["dummy_runs"] = runner.dummy_runs
        step["records"] = self.records.take()
        state = autotuner_state()
        step["entries"] = len(state)
        # Look at VLLM_CACHE_ROOT (shared by the ranks) before the all-gather
        # below, which no rank leaves before every rank has looked: otherwise a
        # faster rank could start the next step, where vLLM's own code may make
        # the directory, while a slower rank still looks at this one's result.
        vllm_cache = Path(os.environ["VLLM_CACHE_ROOT"])
        step["vllm_cache_exists"] = vllm_cache.exists()
        step["vllm_cache_files"] = files_under(vllm_cache)
        if compare:
            gathered: list[Any] = [None] * self.world
            dist.all_gather_object(gathered, state, group=get_world_group().cpu_group)
            step["identical_across_ranks"] = all(g == gathered[0] for g in gathered)
        self.result["steps"][name] = step
        self.tick(name)
        return step

    # -- scenarios ------------------------------------------------------------

    def run(self) -> None:
        from vllm.config import set_current_vllm_config

        kw = self.load_plugins()
        config = self.init_distributed()
        runner = StandInModelRunner(config)
        tmp = self.out
        if self.scenario == "off":
            self.start("start", kw, runner, config)
            return
        if self.scenario == "pp2":
            self.pipeline_parallel(kw, runner, config)
            return
        if self.scenario == "replay":
            self.replay(kw, runner, config)
            return
        if self.scenario in ("v2w1", "pr55671"):
            self.v2_starts(kw, runner, config)
            return
        if self.scenario != "plugin":
            raise SystemExit(f"unknown scenario {self.scenario}")
        if self.rank == 0:  # unusable registries for the last two starts
            (tmp / "a-directory").mkdir()
            (tmp / "garbage.db").write_bytes(b"this is not a SQLite database\n" * 100)
        self.start("start1", kw, runner, config)
        self.start("start2", kw, runner, config)

        # FICACHE_VLLM=0 after the patch: the wrapper calls vLLM's function as is.
        os.environ["FICACHE_VLLM"] = "0"
        try:
            self.start("runtime_off", kw, runner, config)
        finally:
            os.environ.pop("FICACHE_VLLM")

        # An older vLLM, simulated: kernel_warmup no longer exports the helper the
        # wrapper relies on (what ficache inspects), while vLLM's own function still
        # finds it (a global lookup falls back to builtins), so it can run unchanged.
        helper = kw.resolve_rank_flashinfer_autotune_file
        with set_current_vllm_config(config):
            helper(runner).unlink()  # written by runtime_off: vLLM starts from empty again
        # Without that helper ficache would serve FlashInfer's managed store instead, so
        # the FlashInfer is simulated without one too (``flashinfer.autotune_v2`` hidden:
        # vLLM's own gate then keeps its v1 path, as on a FlashInfer that predates it).
        import flashinfer

        delattr(kw, "resolve_rank_flashinfer_autotune_file")
        builtins.resolve_rank_flashinfer_autotune_file = helper  # type: ignore[attr-defined]
        autotune_v2 = flashinfer.autotune_v2
        del flashinfer.autotune_v2
        try:
            self.start("unsupported", kw, runner, config)
        finally:
            flashinfer.autotune_v2 = autotune_v2
            del builtins.resolve_rank_flashinfer_autotune_file  # type: ignore[attr-defined]
            kw.resolve_rank_flashinfer_autotune_file = helper

        self.adoption(kw, runner, config)

        # FICACHE_DB unusable: a directory, then a file that is not SQLite.
        registry = os.environ["FICACHE_DB"]
        for name, db in (("db_dir", tmp / "a-directory"), ("db_garbage", tmp / "garbage.db")):
            os.environ["FICACHE_DB"] = str(db)
            try:
                self.start(name, kw, runner, config)
            finally:
                os.environ["FICACHE_DB"] = registry

        # Last: rank 1 fails in the middle of tuning (fresh registry) while rank 0
        # goes on to its next tuning all-reduce. As in vLLM, where nothing catches
        # it, the failing worker then dies (here: the process ends after this step),
        # which must fail rank 0 at once. No collective follows this step.
        runner.fail_after_first_shape = self.rank == 1
        os.environ["FICACHE_DB"] = str(tmp / "fails.db")
        os.environ["FICACHE_ADOPT"] = "0"  # vLLM's files stay under VLLM_CACHE_ROOT
        self.start("rank1_fails", kw, runner, config, compare=False)

    def v2_starts(self, kw: Any, runner: StandInModelRunner, config: Any) -> None:
        """``v2w1``: vLLM 0.33's own ``flashinfer_autotune`` on one rank, which takes its v2
        path (``autotune_v2``). ``pr55671``: a module standing in for vLLM PR #55671's
        ``kernel_warmup`` (``vllm_pr55671.py``: no file-cache helpers), patched by the
        plugin as it patches vLLM's. Both: ``start1`` (fresh registry), ``start2``."""
        import ficache.vllm_plugin as plugin

        runner.real_loop = True
        if self.scenario == "pr55671":
            import vllm_pr55671

            module = vllm_pr55671.kernel_warmup_module()
            self.result["pr55671_patched"] = plugin.patch_module(module)
            kw = module
        self.start("start1", kw, runner, config, compare=self.world > 1)
        self.start("start2", kw, runner, config, compare=self.world > 1)

    def pipeline_parallel(self, kw: Any, runner: StandInModelRunner, config: Any) -> None:
        """``pp2``: each stage's TP group warm-starts on its own; both share FICACHE_DB."""
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group, get_world_group

        tp, pp = get_tp_group(), get_pp_group()
        self.result["groups"] = {
            "tp_ranks": list(tp.ranks),
            "tp_rank": tp.rank_in_group,
            "pp_ranks": list(pp.ranks),
            "pp_rank": pp.rank_in_group,
            "global_rank": dist.get_rank(),
        }
        together = self.out / "start1-tuned"
        if self.rank == 0:
            together.mkdir()
        dist.barrier(group=get_world_group().cpu_group)
        os.environ["FICACHE_TEST_RANK"] = str(self.rank)
        runner.rendezvous = (together, self.world)
        self.start("start1", kw, runner, config)
        self.result["start1_met"] = len(list(together.iterdir())) == self.world
        self.start("start2", kw, runner, config)

    def replay(self, kw: Any, runner: StandInModelRunner, config: Any) -> None:
        """``replay``: ``start1`` tunes (FICACHE_MODE unset), half the entries are deleted,
        then ``replay1`` and ``replay2`` with ``FICACHE_MODE=replay``; every dummy run asks
        FlashInfer's real ``choose_one`` for every key (``runner.serve``)."""
        import sqlite3

        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_world_group

        runner.serve = True
        self.start("start1", kw, runner, config)
        self.result["steps"]["start1"]["tactics"] = runner.tactics
        if self.rank == 0:
            conn = sqlite3.connect(os.environ["FICACHE_DB"])
            with conn:
                conn.execute("DELETE FROM entries WHERE id % 2 = 0")
            self.result["kept"] = dict(conn.execute("SELECT key, tactic FROM entries"))
            conn.close()
        dist.barrier(group=get_world_group().cpu_group)
        os.environ["FICACHE_MODE"] = "replay"
        try:
            for name in ("replay1", "replay2"):
                self.start(name, kw, runner, config)
                self.result["steps"][name]["tactics"] = runner.tactics
        finally:
            os.environ.pop("FICACHE_MODE")
        if self.rank == 0:
            conn = sqlite3.connect(os.environ["FICACHE_DB"])
            self.result["commits"] = conn.execute("SELECT count(*) FROM commits").fetchone()[0]
            self.result["counts"] = conn.execute(
                "SELECT served_starts, replay_starts, replay_misses FROM fingerprints"
            ).fetchall()
            conn.close()

    def adoption(self, kw: Any, runner: StandInModelRunner, config: Any) -> None:
        """Steps ``adopt``, ``adopt_again`` and ``adopt_off`` over vLLM's own per-rank files."""
        import torch.distributed as dist
        from vllm.config import set_current_vllm_config
        from vllm.distributed.parallel_state import get_world_group
        from vllm.model_executor.warmup.flashinfer_autotune_cache import (
            write_flashinfer_autotune_cache,
        )

        # vLLM's own file of this rank (its `unsupported` start wrote it), plus the probe.
        with set_current_vllm_config(config):
            path = kw.resolve_rank_flashinfer_autotune_file(runner)
        data = json.loads(path.read_text())
        data[PROBE_KEY] = [PROBE_RUNNER, self.rank]
        write_flashinfer_autotune_cache(path, json.dumps(data, indent=4).encode())
        dist.barrier(group=get_world_group().cpu_group)  # both files written before rank 0 reads
        vllm_cache = Path(os.environ["VLLM_CACHE_ROOT"])
        self.result["adopt_tree"] = files_under(vllm_cache)
        before = tree_state(vllm_cache)
        registry = os.environ["FICACHE_DB"]
        try:
            for name, db, adopt in (
                ("adopt", "adopt.db", "1"),
                ("adopt_again", "adopt.db", "1"),
                ("adopt_off", "adopt-off.db", "0"),
            ):
                os.environ["FICACHE_DB"] = str(self.out / db)
                os.environ["FICACHE_ADOPT"] = adopt
                step = self.start(name, kw, runner, config)
                step["probe"] = autotuner_state().get(PROBE_KEY)
        finally:
            os.environ["FICACHE_DB"] = registry
            os.environ.pop("FICACHE_ADOPT")
        self.result["adopt_tree_unchanged"] = tree_state(vllm_cache) == before

    def teardown(self) -> None:
        from vllm.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        with contextlib.suppress(Exception):
            destroy_model_parallel()
        with contextlib.suppress(Exception):
            destroy_distributed_environment()


def main(argv: list[str]) -> int:
    scenario, out = argv[0], Path(argv[4])
    rank, world, port = int(argv[1]), int(argv[2]), int(argv[3])
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    me = Rank(scenario, rank, world, port, out)
    code = 0
    try:
        me.run()
    except BaseException:  # noqa: BLE001 - reported to the test
        me.result["error"] = traceback.format_exc()
        code = 1
    finally:
        me.teardown()
    (out / f"rank{rank}.json").write_text(json.dumps(me.result, indent=1, default=str))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
