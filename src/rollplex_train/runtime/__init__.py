"""Step schedules: how the phases of one step are placed in time."""

from __future__ import annotations


def make_schedule(cfg, workers, reward, pad_id):
    """The schedule named by ``schedule.name``.

    Raises:
        NotImplementedError: a schedule that this build does not have yet.
    """
    from rollplex_train.runtime.disaggregated import DisaggregatedSchedule
    from rollplex_train.runtime.rollplex import RollplexSchedule
    from rollplex_train.runtime.serial import SerialSchedule

    if cfg.schedule.name == "serial":
        return SerialSchedule(cfg, workers, reward, pad_id)
    if cfg.schedule.name == "rollplex":
        return RollplexSchedule(cfg, workers, reward, pad_id)
    if cfg.schedule.name == "disaggregated":
        return DisaggregatedSchedule(cfg, workers, reward, pad_id)
    raise NotImplementedError(f"schedule.name={cfg.schedule.name!r} is not built yet; use 'serial'")
