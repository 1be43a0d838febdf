"""The ``disaggregated`` baseline: rollout and training on disjoint halves of the same budget.

Synchronous like ``serial`` (the same phases in the same order, the same results), but the rollout
worker only ever uses its half of the cores and the training worker the other half, as when the
rollout engine and the trainer sit on separate GPU sets: each side idles while the other works.
"""

from __future__ import annotations

import ray

from rollplex_train.runtime.serial import SerialSchedule


class DisaggregatedSchedule(SerialSchedule):
    """Serial phases, each worker pinned to half of the threads for the whole run."""

    def run_step(self, prompts, step):
        total = self.workers.threads
        halves = (max(1, (total + 1) // 2), max(1, total // 2))  # (rollout, train)
        ray.get([self.workers.rollout.set_threads.remote(halves[0]), self.workers.train.set_threads.remote(halves[1])])
        return super().run_step(prompts, step)
