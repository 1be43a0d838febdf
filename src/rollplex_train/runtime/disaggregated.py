"""The ``disaggregated`` baseline: rollout and training on disjoint halves of the same budget.

Synchronous like ``serial`` (the same phases in the same order, the same results), but the rollout
worker only ever uses its half of the cores and the training worker the other half, as when the
rollout engine and the trainer sit on separate GPU sets: each side idles while the other works.
"""

from __future__ import annotations

from rollplex_train.runtime.serial import SerialSchedule


class DisaggregatedSchedule(SerialSchedule):
    """Serial phases, each worker pinned to half of the threads for the whole run."""

    def __init__(self, cfg, workers, reward, pad_id):
        super().__init__(cfg, workers, reward, pad_id)
        workers.share_threads(*workers.halves())
