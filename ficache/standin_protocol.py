"""A STAND-IN for one of FlashInfer 0.7.4's tuning protocols (the MoE-EP MegaMoE ones).

FlashInfer 0.7.4 lets an operation own its tuning loop: it runs under
``AutoTuner.choose_with_protocol(namespace, protocol)``, looks results up
with its ``TuningContext`` (``lookup``) and keeps new ones with
``publish``, which FlashInfer files as protocol records
(``publish_protocol_record``): in memory, and in the managed store under
``autotune_v2``. The MegaMoE protocols publish on rank 0 with keys that do
not depend on the rank. Their kernels need an SM100 GPU and MoE-EP
weights, so the tests and the GPU proof use this instead, named as what it
is: ``StandInProtocol`` measures nothing. For every key it misses while
tuning is enabled, rank 0 publishes a fixed value (``standin_value``); the
other ranks publish nothing. What is real: ``choose_with_protocol``, the
``TuningContext``, FlashInfer's record storage and its identities.
"""

from __future__ import annotations

from typing import Any

#: The namespace of the MoE-EP protocol records on SM100 (FlashInfer 0.7.4).
NAMESPACE = "moe_ep.sm100.next_cutedsl.native.v1"
#: The keys the stand-in looks up, shaped like MegaMoE's (JSON texts of a problem size).
KEYS = ('{"experts":256,"m":8}', '{"experts":256,"m":64}', '{"experts":256,"m":512}')


def standin_value(key: str) -> dict[str, Any]:
    """What the stand-in "tunes" for ``key``: the same on every run and every machine."""
    return {"tile_n": 128, "stages": len(key) % 5 + 2, "key": key}


class StandInProtocol:
    """The stand-in (module docstring). After ``run``, ``hits`` counts the keys FlashInfer
    already held and ``published`` those this rank published."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.hits = 0
        self.published = 0

    def run(self, context: Any) -> Any:
        from flashinfer.autotuner.protocol import TuningResult

        values = {}
        for key in KEYS:
            value = context.lookup(key)
            if value is not None:
                self.hits += 1
            elif context.tuning_enabled and self.rank == 0:
                value = standin_value(key)
                context.publish(key, value)
                self.published += 1
            values[key] = value
        return TuningResult(values, cache_hit=self.hits == len(KEYS))


def run_standin_protocol(rank: int) -> StandInProtocol:
    """Run the stand-in through FlashInfer's ``choose_with_protocol`` on this process's tuner,
    under whatever ``autotune`` / ``autotune_v2`` context the caller opened."""
    from flashinfer.autotuner import AutoTuner

    protocol = StandInProtocol(rank)
    AutoTuner.get().choose_with_protocol(NAMESPACE, protocol)
    return protocol
