"""The environment step's planner (``runtime/env_window.EnvWindowPlanner``): it measures the
overlapped and the serial step before it chooses, then takes the one its cost model predicts faster,
with the decode share that minimises the overlapped window; a run follows its plan."""

from __future__ import annotations

import math

import pytest

from rollplex_train.runtime.cost_model import CostModel
from rollplex_train.runtime.env_window import GEN, GEN_BESIDE, LAST, PASSES, TURNS, EnvWindowPlan, EnvWindowPlanner
from rollplex_train.tracking.loggers import read_metrics_jsonl


def measured(threads: int, gen: dict[int, float], turns: dict[int, float], last: float, passes: float) -> CostModel:
    """A cost model with every kind measured twice (past warm-up) at the given seconds per trajectory."""
    cost = CostModel()
    for _ in range(2):
        for d, s in gen.items():  # the rollout alone on the whole device, beside the scoring on less
            cost.observe(GEN if d == threads else GEN_BESIDE, 10, d, 10 * s)
        for t, s in turns.items():
            cost.observe(TURNS, 10, t, 10 * s)
        cost.observe(LAST, 10, threads, 10 * last)
        cost.observe(PASSES, 10, threads, 10 * passes)
    return cost


def test_profiles_overlap_then_serial_then_plans():
    planner = EnvWindowPlanner(CostModel(), threads=2, halves=(1, 1))
    seen = []
    for step in range(5):
        plan = planner.plan(32)
        seen.append((plan.mode, plan.overlap, plan.decode_threads, plan.train_threads))
        # a rollout that decodes no faster on 2 threads than on 1; the turn scoring fits inside it
        gen = {1: 3.0, 2: 3.2}[plan.decode_threads]
        seconds = {"gen": gen * 32, "suffix_after": 0.1 * 32, "old_log_prob": 0.2 * 32, "ref": 0.3 * 32}
        planner.observe(plan, 32, 1.0, seconds, turn_window_s=1.0 * 32)
    assert seen == [("profile_overlap", True, 1, 1)] * 2 + [("profile_serial", False, 2, 2)] * 2 + [("plan", True, 1, 1)]
    plan = planner.plan(32)
    assert plan.predicted_s == pytest.approx(32 * (3.0 + 0.1))  # max(rollout, turn scoring) + last responses
    assert plan.predicted_no_overlap_s == pytest.approx(32 * (3.2 + 0.5))
    assert plan.metrics()["planner/env_overlap"] == 1.0 and plan.metrics()["planner/profiling"] == 0.0


def test_keeps_the_serial_step_when_overlap_costs_more():
    # the rollout twice as fast on 2 threads, scoring that outlasts it on half the device: serial wins
    cost = measured(2, gen={1: 2.0, 2: 1.0}, turns={1: 2.5}, last=0.1, passes=0.6)
    plan = EnvWindowPlanner(cost, threads=2, halves=(1, 1)).plan(8)
    assert (plan.mode, plan.overlap, plan.decode_threads, plan.train_threads) == ("plan", False, 2, 2)
    assert plan.predicted_no_overlap_s == pytest.approx(8 * 1.6)
    assert plan.predicted_s == pytest.approx(8 * 2.6)
    assert "planner/predicted_s" in plan.metrics() and not math.isnan(plan.predicted_s)


def test_sizes_a_step_in_trajectory_turns_and_counts_the_reshares():
    # rates are per trajectory turn: a policy that learns shorter trajectories makes both sides
    # cheaper alike (the side not chosen is not measured again); an overlapped step's two re-shares
    # join the overlapped side
    cost = measured(2, gen={1: 2.0, 2: 1.0}, turns={1: 2.5}, last=0.1, passes=0.6)
    planner = EnvWindowPlanner(cost, threads=2, halves=(1, 1))
    one = planner.plan(8)
    planner.observe(EnvWindowPlan(True, 1, 1, "plan"), 8, 2.0, {"gen": 32.0, "suffix_after": 1.6, "reshare": 0.5},
                    turn_window_s=40.0)  # the same rates at 2 turns a trajectory
    two = planner.plan(8)
    assert two.predicted_no_overlap_s == pytest.approx(2 * one.predicted_no_overlap_s)
    assert cost.switch_s == pytest.approx(0.25)
    assert two.predicted_s == pytest.approx(2 * one.predicted_s + 2 * 0.25)


def test_picks_the_decode_share_that_balances_the_window():
    # 4 threads: the rollout beside the scoring scales (Amdahl f fitted from 1 and 3 threads), the
    # scoring is measured at 2 threads and extrapolated with the prior; the best split keeps the
    # longer side shortest
    cost = measured(4, gen={1: 4.0, 3: 2.0, 4: 1.6}, turns={2: 1.0}, last=0.1, passes=1.5)
    planner = EnvWindowPlanner(cost, threads=4, halves=(2, 2))
    plan = planner.plan(1)
    windows = {d: max(cost.seconds(GEN_BESIDE, 1, d), cost.seconds(TURNS, 1, 4 - d)) for d in (1, 2, 3)}
    best = min(windows, key=windows.get)
    assert plan.overlap and (plan.decode_threads, plan.train_threads) == (best, 4 - best)
    assert plan.predicted_s == pytest.approx(windows[best] + 0.1)
    assert plan.predicted_s < plan.predicted_no_overlap_s == pytest.approx(1.6 + 1.5)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_env_run_follows_its_plan(embedded_assets, run_cli, tmp_path):
    """Six rollplex steps of tiny_cpu_frozenlake with a reference: two overlapped and two serial
    steps measure, then the plan; the turn scoring runs exactly on the overlapped steps (the step's
    passes on the others); every row's old-policy log-probs match the engine's either way."""
    pytest.importorskip("gymnasium")
    proc = run_cli(tmp_path, "trainer.total_steps=6", "trainer.loggers=[jsonl]", "cluster.executor=inprocess",
                   "cluster.threads_per_device=2", "data.rollout_batch_size=2", "rollout.n=4",
                   "actor.ppo_mini_batch_size=1", "algorithm.use_kl_loss=true", "algorithm.kl_coef=0.01",
                   "schedule=rollplex", experiment="tiny_cpu_frozenlake")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics_jsonl(tmp_path / "metrics.jsonl")
    assert [r["planner/profiling"] for r in rows] == [1, 1, 1, 1, 0, 0]
    assert [r["planner/env_overlap"] for r in rows][:4] == [1, 1, 0, 0]
    for r in rows:
        assert ("envs/turn_scoring_calls" in r) == bool(r["planner/env_overlap"])
        diffs = [v for k, v in r.items() if k.startswith("env/logprob_diff_max/")]
        assert diffs and max(diffs) <= 1e-5
    for r in rows[4:]:
        assert bool(r["planner/env_overlap"]) == (r["planner/predicted_s"] < r["planner/predicted_no_overlap_s"])
