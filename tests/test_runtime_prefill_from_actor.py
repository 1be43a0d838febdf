"""Which groups the rollplex window planner hands to the rollout as actor prefix KV caches
(``schedule.prefill_from_actor``): the first mini-batch, within the memory budget per DP rank."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir

from rollplex_train.cli import conf_dir
from rollplex_train.config import register_configs, to_config
from rollplex_train.resolve import resolve
from rollplex_train.runtime.window import PrefillBudgetError, WindowPlanner


class _Planner:
    """A WindowPlanner (no workers) and the size estimates it reads."""

    def __init__(self, *overrides: str, bytes_per_token: float = 0.0):
        register_configs()
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = resolve(to_config(compose(config_name="config", overrides=[
                "trainer.output_dir=/tmp/unused", "+experiment=tiny_cpu", "schedule=rollplex",
                "data.rollout_batch_size=4", "actor.ppo_mini_batch_size=2", *overrides])))
        self.window = WindowPlanner(cfg, threads=2, old_from_actor=True)
        self.window.estimates.bytes_per_token = {"actor": bytes_per_token}

    def _prefill_groups(self, step) -> list[int]:
        return self.window.prefill_groups(step)


def _schedule(*overrides: str, bytes_per_token: float = 0.0) -> _Planner:
    return _Planner(*overrides, bytes_per_token=bytes_per_token)


def _step(prompt_lengths: list[int], ranks: list[int]) -> SimpleNamespace:
    dp = max(ranks) + 1
    return SimpleNamespace(prompts=[SimpleNamespace(prompt_length=n) for n in prompt_lengths], rank_of_group=ranks,
                           groups_of_dp=[[g for g, r in enumerate(ranks) if r == d] for d in range(dp)],
                           groups_per_mini_batch=2, first_mini_batch=[0, 1])  # actor.ppo_mini_batch_size=2


def test_first_mini_batch_is_handed_over_within_the_budget(caplog):
    step = _step([100, 100, 100, 100], [0, 1, 0, 1])  # 2 DP ranks, one first-mini-batch group each
    assert _schedule()._prefill_groups(step) == [0, 1]
    # 100 tokens x 1 MiB per rank: within 0.2 GiB, not within 0.05 GiB
    fits = _schedule("schedule.prefix_memory_gib=0.2", bytes_per_token=2**20)
    assert fits._prefill_groups(step) == [0, 1]
    over = _schedule("schedule.prefix_memory_gib=0.05", bytes_per_token=2**20)
    assert over._prefill_groups(step) == [] and over._prefill_groups(step) == []
    said = [r.getMessage() for r in caplog.records if "prefill_from_actor=auto" in r.getMessage()]
    assert len(said) == 1 and "schedule.prefix_memory_gib=0.05" in said[0]  # said once, not every step
    assert _schedule("schedule.prefill_from_actor=false")._prefill_groups(step) == []
    assert _schedule("schedule.prefix_memory_gib=0")._prefill_groups(step) == []  # nothing may live across decode


def test_required_handover_over_the_budget_is_an_error():
    step = _step([100, 100, 100, 100], [0, 0, 0, 0])
    required = _schedule("schedule.prefill_from_actor=true", "schedule.prefix_memory_gib=0.1", bytes_per_token=2**20)
    with pytest.raises(PrefillBudgetError, match=r"take 0.195 GiB across decode, over schedule.prefix_memory_gib=0.1"):
        required._prefill_groups(step)
