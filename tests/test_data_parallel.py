"""Data parallelism end to end (Ray, gloo): DP=2 trains exactly as DP=1 on the same global batch,
and a DP=2 run killed with SIGKILL resumes to the uninterrupted run's metrics.

DP=1 reference runs use the in-process executor (same groups, engines in the driver); the DP=2
runs place two devices of one core each on a Ray placement group.
"""

from __future__ import annotations

import math

import pytest
import torch

from rollplex_train.tracking.loggers import read_metrics_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # each test starts up to 3 runs

COMMON = ["trainer.total_steps=3", "trainer.save_freq=1", "trainer.val_freq=0", "trainer.val_before_train=false",
          "data.rollout_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2", "actor.micro_batch_size=4",
          "trainer.max_ckpt_to_keep=3", "trainer.loggers=[jsonl]", "trainer.export_hf=false",
          "model.shared_prefix=true"]
DP1 = ["cluster.executor=inprocess", "cluster.threads_per_device=2"]
DP2 = ["cluster.devices_per_node=2", "cluster.threads_per_device=1"]
# values that depend on timing, placement or the device count, not on the training numerics
VOLATILE = ("timing_s/", "perf/", "planner/", "rollplex/", "cost/", "prefix/", "sharing/", "memory/")


def _weights(out):
    return torch.load(out / "checkpoints" / "global_step_3" / "actor.pt", weights_only=True)


def _numeric(record: dict) -> dict:
    return {k: v for k, v in record.items()
            if isinstance(v, float) and not k.startswith(VOLATILE) and math.isfinite(v)}


@pytest.fixture(scope="module")
def runs(embedded_assets, run_cli, tmp_path_factory):
    """``runs(agg, schedule, dp)`` -> output dir of that finished run (each run once per module)."""
    root = tmp_path_factory.mktemp("dp")
    done: dict[str, object] = {}

    def get(agg: str, schedule: str, dp: int):
        name = f"{agg}-{schedule}-dp{dp}"
        if name not in done:
            out = root / name
            proc = run_cli(out, *COMMON, f"actor.loss_agg_mode={agg}", f"schedule={schedule}",
                           *(DP1 if dp == 1 else DP2))
            assert proc.returncode == 0, (name, proc.stderr[-4000:])
            done[name] = out
        return done[name]

    return get


@pytest.mark.parametrize("agg, schedule", [("token-mean", "serial"), ("token-mean", "rollplex"),
                                           ("seq-mean-token-mean", "serial"),
                                           ("seq-mean-token-mean", "rollplex")])
def test_dp2_trains_like_dp1(runs, agg, schedule):
    one, two = runs(agg, "serial", 1), runs(agg, schedule, 2)
    m1, m2 = read_metrics_jsonl(one / "metrics.jsonl"), read_metrics_jsonl(two / "metrics.jsonl")
    assert [r["step"] for r in m2] == [1, 2, 3]
    for a, b in zip(m1, m2):
        for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert m2[-1]["perf/throughput"] > 0
    w1, w2 = _weights(one), _weights(two)
    assert w1.keys() == w2.keys()
    first = torch.load(one / "checkpoints" / "global_step_1" / "actor.pt", weights_only=True)
    for name, value in w1.items():
        assert (w2[name] - value).abs().max() <= 1e-5, name
    assert any(not torch.equal(w1[k], first[k]) for k in w1)  # the comparison is between trained weights


def test_dp2_resume_after_kill_matches_uninterrupted(runs, run_cli, tmp_path):
    uninterrupted = runs("token-mean", "serial", 2)
    out = tmp_path / "killed"
    args = [*COMMON, "actor.loss_agg_mode=token-mean", "schedule=serial", *DP2]
    killed = run_cli(out, *args, env={"ROLLPLEX_KILL_AT_STEP": "3"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    resumed = run_cli(out, *args)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    last_expected = read_metrics_jsonl(uninterrupted / "metrics.jsonl")[-1]
    last_got = read_metrics_jsonl(out / "metrics.jsonl")[-1]
    assert last_got["step"] == last_expected["step"] == 3
    expected, got = _numeric(last_expected), _numeric(last_got)
    compared = sorted(set(expected) & set(got))
    assert len(compared) > 15
    for key in compared:
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    w_a, w_b = _weights(uninterrupted), _weights(out)
    assert all(torch.equal(w_a[k], w_b[k]) for k in w_a)


def test_resume_on_another_dp_size(runs, run_cli, tmp_path):
    """A DP=2 checkpoint resumed with DP=1 (in process) trains step 3 as the DP=2 run did."""
    two = runs("token-mean", "serial", 2)
    out = tmp_path / "dp1_from_dp2"
    resumed = run_cli(out, *COMMON, "actor.loss_agg_mode=token-mean", "schedule=serial", *DP1,
                      f"trainer.resume={two / 'checkpoints' / 'global_step_2'}")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    got, expected = read_metrics_jsonl(out / "metrics.jsonl")[-1], read_metrics_jsonl(two / "metrics.jsonl")[-1]
    assert got["step"] == expected["step"] == 3
    for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/kl_loss"):
        assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
    w_a, w_b = _weights(two), _weights(out)
    assert all((w_a[k] - w_b[k]).abs().max() <= 1e-5 for k in w_a)
