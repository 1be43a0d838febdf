"""The step and its schedules: how the phases of one step are placed in time.

``schedule.name`` picks the decode strategy the step (``runtime/step.py``) calls: ``serial`` and
``disaggregated`` decode with one generate call (``runtime/serial.py``; ``disaggregated`` with the
rollout and train workers on fixed halves of the cores), ``rollplex`` with the planner's decode
window (``runtime/rollplex.py``).
"""

from __future__ import annotations


def make_run(cfg, workers, reward, pad_id):
    """The run's :class:`~rollplex_train.runtime.step.Run` with the strategy of ``schedule.name``.

    Raises:
        NotImplementedError: a schedule that this build does not have.
    """
    from rollplex_train.runtime.old_policy import reuse_actor_forward
    from rollplex_train.runtime.rollplex import PlannedDecode
    from rollplex_train.runtime.serial import PlainDecode
    from rollplex_train.runtime.step import Run

    old_from_actor = reuse_actor_forward(cfg)  # the first mini-batch skips the old pass (old_policy.py's rule)
    name = cfg.schedule.name
    if name == "rollplex":
        decode = PlannedDecode(cfg, workers, pad_id, old_from_actor)
    elif name in ("serial", "disaggregated"):
        decode = PlainDecode(cfg, workers)
        if name == "disaggregated":  # each side keeps its half of the cores for the whole run
            workers.share_threads(*workers.halves())
    else:
        raise NotImplementedError(f"schedule.name={name!r} is not built; use serial, disaggregated or rollplex")
    return Run(cfg, workers, reward, pad_id, decode, old_from_actor)
