"""The plain decode: the ``serial`` and ``disaggregated`` schedules' rollout, one generate call.

Under ``serial`` the rollout decodes on the whole device, then the step's later phases run on it
one after another (verl's phases). ``disaggregated`` is the same strategy with the rollout and train
workers pinned to halves of the cores for the whole run (``runtime/__init__.make_run``), as when the
rollout engine and the trainer sit on separate GPU sets: each side idles while the other works.
"""

from __future__ import annotations

from rollplex_train.config import Config
from rollplex_train.rollout.base import SamplingParams
from rollplex_train.runtime.protocol import RolloutResult
from rollplex_train.runtime.timeline import Timeline


def sampling_params(cfg: Config, step: int, validate: bool = False) -> SamplingParams:
    """The step's sampling parameters; the seed depends only on (rollout.seed, step), so a resumed
    run samples exactly what an uninterrupted one would."""
    r = cfg.rollout
    return SamplingParams(
        n=1 if validate else r.n,
        temperature=r.val_temperature if validate else r.temperature,
        top_p=1.0 if validate else r.top_p,
        top_k=-1 if validate else r.top_k,
        max_new_tokens=r.max_new_tokens,
        stop=tuple(r.stop),
        ignore_eos=r.ignore_eos,
        seed=r.seed + step,
    )


class PlainDecode:
    """Decode on the share the workers have, nothing beside it.

    Args:
        cfg: the run's config. workers: ``cluster.launch.Workers``.
    """

    def __init__(self, cfg: Config, workers):
        self.cfg, self.workers = cfg, workers

    def rollout(self, placed, step: int, version: int, timeline: Timeline) -> RolloutResult:
        """The responses, grouped by global prompt index, from one ``generate`` call (timed as
        ``gen``); no log-probs computed, no metrics of its own."""
        with timeline.span("gen", "rollout"):
            responses = self.workers.rollout.generate(placed, sampling_params(self.cfg, step), version).result()
        return RolloutResult(responses)

    def observe(self, rollout: RolloutResult, batch, placed, timeline: Timeline) -> None:
        """Nothing to learn."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing kept."""
