"""GRPO over environment trajectories (``runtime/envs.py``): a trajectory as one training row is
scored by the trainer's full-sequence pass exactly as the engine sampled it, turn by turn; the
seed groups drive the advantages; an environment run trains the same on DP=2 as on DP=1."""

from __future__ import annotations

import math

import pytest
import torch

from rollplex_train.config import EnvConfig
from rollplex_train.data.types import TrainBatch
from rollplex_train.models.loading import load_model
from rollplex_train.models.sequence import build_full_sequences, response_logprobs
from rollplex_train.rollout.base import SamplingParams
from rollplex_train.rollout.builtin import BuiltinRolloutEngine
from rollplex_train.rollout.multiturn import TurnLoop
from rollplex_train.runtime.envs import trajectory_row, turn_logprob_mismatch
from rollplex_train.runtime.timeline import Timeline
from rollplex_train.tracking.loggers import read_metrics_jsonl

FROZENLAKE = dict(name="frozenlake", kwargs={"desc": ["SFG", "FHF", "FFF"], "is_slippery": False}, max_turns=3,
                  max_actions_per_turn=1, answer_format="words")


def test_trajectory_rows_score_every_turn_like_the_engine(embedded_assets):
    pytest.importorskip("gymnasium")
    _, ckpt = embedded_assets
    loop = TurnLoop.from_config(BuiltinRolloutEngine(str(ckpt)), str(ckpt), EnvConfig(**FROZENLAKE))
    trajectories = loop.rollout([3, 4], SamplingParams(n=4, max_new_tokens=8, temperature=1.0, seed=5), uid_prefix="s")
    rows = [trajectory_row(t, i) for i, t in enumerate(trajectories)]
    prompts, responses = [p for p, _ in rows], [r for _, r in rows]
    batch = TrainBatch.from_responses(prompts, responses, pad_id=0)
    model = load_model(ckpt)
    image = model.config.image_token_id
    for i, t in enumerate(trajectories):  # the row is the trajectory: ids, mask, the frames of every turn
        start = len(prompts[i].prompt_ids)
        length = len(t.ids) - start
        assert torch.equal(torch.cat([prompts[i].prompt_ids, batch.response_ids[i, :length]]), t.ids)
        assert torch.equal(batch.response_mask[i, :length], t.loss_mask[start:])
        assert batch.response_mask[i, length:].sum() == 0 and batch.response_mask[i].sum() == sum(
            len(turn.response_ids) for turn in t.turns)
        assert int((t.ids == image).sum()) == int(prompts[i].vision.image_grid_thw.prod(-1).sum()) // 4
        assert prompts[i].vision.num_images == t.num_turns
    assert max(t.num_turns for t in trajectories) >= 2  # later frames sit in the response part
    ids, mask, plen, vision = build_full_sequences(batch.prompts, batch.group_index, batch.response_ids,
                                                   batch.response_mask, pad_id=0)
    with torch.no_grad():
        logp, _ = response_logprobs(model, ids, mask, vision, plen, batch.response_ids, batch.response_mask)
    mismatch = turn_logprob_mismatch(trajectories, logp, list(range(len(trajectories))))
    assert set(mismatch) >= {"env/logprob_diff_max/turn0", "env/logprob_diff_max/turn1"}
    assert max(mismatch.values()) <= 1e-5, mismatch
    torch.testing.assert_close(logp * batch.response_mask, batch.rollout_logprobs, atol=1e-5, rtol=0)


def test_an_env_run_refuses_what_it_cannot_honour():
    from rollplex_train.config import Config, ModelConfig, ScheduleConfig, TrainerConfig

    quiet = TrainerConfig(val_freq=0, val_before_train=False)
    with pytest.raises(ValueError, match=r"^env.name='frozenlake': a trajectory's later frames .* model.shared_prefix=false"):
        Config(env=EnvConfig(**FROZENLAKE), model=ModelConfig(shared_prefix=True), trainer=quiet)
    with pytest.raises(ValueError, match=r"^env.name='frozenlake': validation runs single-turn prompts"):
        Config(env=EnvConfig(**FROZENLAKE))
    with pytest.raises(ValueError, match=r"env.context=window:2 drops observations"):
        Config(env=EnvConfig(**dict(FROZENLAKE, context="window:2")), trainer=quiet)
    assert Config(env=EnvConfig(**FROZENLAKE), trainer=quiet).env.name == "frozenlake"
    # rollplex scores an env run's turns with its own prefix passes (runtime/env_window.py), not the shared-prefix ones
    assert Config(env=EnvConfig(**FROZENLAKE), trainer=quiet, schedule=ScheduleConfig(name="rollplex")).schedule.name == "rollplex"
    with pytest.raises(ValueError, match=r"^env.name='frozenlake': schedule.prefill_from_actor=true hands"):
        Config(env=EnvConfig(**FROZENLAKE), trainer=quiet, schedule=ScheduleConfig(name="rollplex", prefill_from_actor="true"))
    with pytest.raises(ValueError, match=r"^schedule.name=rollplex moves prefix work into decode"):
        Config(schedule=ScheduleConfig(name="rollplex"))


VOLATILE = ("timing_s/", "perf/", "sharing/", "memory/")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_env_run_dp2_trains_like_dp1(embedded_assets, run_cli, tmp_path):
    pytest.importorskip("gymnasium")
    common = ["trainer.total_steps=2", "trainer.loggers=[jsonl]", "data.rollout_batch_size=4", "rollout.n=4",
              "actor.ppo_mini_batch_size=2", "actor.micro_batch_size=4"]
    one = run_cli(tmp_path / "dp1", *common, "cluster.executor=inprocess", "cluster.threads_per_device=2",
                  experiment="tiny_cpu_frozenlake")
    assert one.returncode == 0, one.stderr[-4000:]
    two = run_cli(tmp_path / "dp2", *common, "cluster.devices_per_node=2", "cluster.threads_per_device=1",
                  experiment="tiny_cpu_frozenlake")
    assert two.returncode == 0, two.stderr[-4000:]
    m1, m2 = (read_metrics_jsonl(tmp_path / d / "metrics.jsonl") for d in ("dp1", "dp2"))
    assert [r["step"] for r in m2] == [1, 2]
    for a, b in zip(m1, m2):
        env_keys = [k for k in a if k.startswith("env/") and "logprob_diff" not in k]
        assert len(env_keys) >= 5
        for key in env_keys + ["critic/score/mean", "actor/pg_loss", "actor/entropy"]:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
        diffs = [v for k, v in a.items() | b.items() if k.startswith("env/logprob_diff_max/")]
        assert diffs and max(diffs) <= 1e-5
        assert not any(math.isnan(v) for k, v in b.items() if isinstance(v, float) and not k.startswith(VOLATILE))
    w1, w2 = (torch.load(tmp_path / d / "checkpoints" / "global_step_2" / "actor.pt", weights_only=True)
              for d in ("dp1", "dp2"))
    for name, value in w1.items():
        assert (w2[name] - value).abs().max() <= 1e-5, name


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_env_run_under_rollplex_samples_what_serial_does(embedded_assets, run_cli, tmp_path):
    """Same seeds: the same tokens and scores under serial (DP=1, in process) and rollplex (DP=2,
    Ray) (rollout dumps, 2 steps); under rollplex the old-policy log-probs of the rows outside the
    first mini-batch come from the turn-by-turn scoring inside the rollout, on the DP rank of their
    seed (the reference's of every row), and equal the engine's on every turn within 1e-5."""
    pytest.importorskip("gymnasium")
    common = ["trainer.total_steps=2", "trainer.loggers=[jsonl]", "data.rollout_batch_size=2", "rollout.n=4",
              "actor.ppo_mini_batch_size=1", "actor.micro_batch_size=4", "trainer.rollout_data_dir=dumps",
              "trainer.trace_steps=[2]", "algorithm.use_kl_loss=true", "algorithm.kl_coef=0.01"]
    runs = {"serial": ["cluster.executor=inprocess", "cluster.threads_per_device=2"],
            "rollplex": ["cluster.devices_per_node=2", "cluster.threads_per_device=1"]}
    for schedule, where in runs.items():
        proc = run_cli(tmp_path / schedule, *common, *where, f"schedule={schedule}", experiment="tiny_cpu_frozenlake")
        assert proc.returncode == 0, proc.stderr[-4000:]
    for step in (1, 2):
        serial, planned = ((tmp_path / s / "dumps" / f"{step}.jsonl").read_text() for s in ("serial", "rollplex"))
        assert planned == serial and serial.count("token_ids") == 8
    for row in read_metrics_jsonl(tmp_path / "rollplex" / "metrics.jsonl"):
        diffs = {k: v for k, v in row.items() if k.startswith("env/logprob_diff_max/")}
        assert len(diffs) >= 2 and max(diffs.values()) <= 1e-5, diffs
        assert row["envs/turn_scoring_calls"] >= 6 and row["envs/turn_scoring_tokens"] > 0  # turns x 2 ranks
        assert 0.0 <= row["envs/turn_scoring_hidden_frac"] <= 1.0
    trace = Timeline.from_chrome_trace(tmp_path / "rollplex" / "traces" / "step_2.json")
    names = {s.name for s in trace.spans if s.row == "train"}
    assert {"score(turn0)", "score(turn1)", "score(last responses)"} <= names


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiny_cpu_frozenlake_learns(embedded_assets, run_cli, tmp_path):
    """The sampled training trajectories' success rate (temperature 1) rises from the untrained
    policy's (at most 0.25) to >= 0.5 within 8 steps (the 30-step curves: docs/benchmarks.md)."""
    pytest.importorskip("gymnasium")
    proc = run_cli(tmp_path, "trainer.total_steps=8", "trainer.loggers=[jsonl]", "cluster.executor=inprocess",
                   "cluster.threads_per_device=2", experiment="tiny_cpu_frozenlake")
    assert proc.returncode == 0, proc.stderr[-4000:]
    success = [r["env/success_rate"] for r in read_metrics_jsonl(tmp_path / "metrics.jsonl")]
    assert len(success) == 8 and success[0] <= 0.25, success  # 0.19 on the std-0.06 checkpoint, <= 0.15 before
    assert max(success[5:]) >= 0.5, success


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo", "reinforce_plus_plus"])
def test_advantages_are_taken_over_the_seed_groups(estimator):
    """Trajectory rows are prompt groups of one; the advantages of every estimator come out as for a
    batch whose groups are the seeds (rows 0-3 seed 0, rows 4-7 seed 1), masks with holes included."""
    from rollplex_train.algo.advantages import known_adv_estimators
    from rollplex_train.config import AlgorithmConfig, Config
    from rollplex_train.data.types import PromptSample, VisionInputs
    from rollplex_train.runtime.batching import step_advantages

    assert estimator in known_adv_estimators()
    cfg = Config(algorithm=AlgorithmConfig(adv_estimator=estimator))
    mask = torch.tensor([[1, 1, 0, 0, 1, 1]] * 8, dtype=torch.float32)  # turn, observation, turn
    mask[3, 4:] = 0
    scores = torch.tensor([1.0, 0.0, -0.1, 1.0, 0.0, 0.0, 1.0, -0.2])
    seeds = torch.tensor([0] * 4 + [1] * 4)
    prompts = [PromptSample(uid=f"t:{i}", prompt_ids=torch.tensor([1, 2]), vision=VisionInputs(), ground_truth="")
               for i in range(8)]
    rows = TrainBatch(prompts=prompts, group_index=torch.arange(8), response_ids=torch.ones(8, 6, dtype=torch.long),
                      response_mask=mask)
    by_seed = TrainBatch(prompts=prompts[:2], group_index=seeds, response_ids=rows.response_ids, response_mask=mask)
    got, _ = step_advantages(cfg, rows, scores, None, None, None, seeds)
    want, _ = step_advantages(cfg, by_seed, scores, None, None, None)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert (got * (1 - mask)).abs().max() == 0  # nothing on the observations between turns
    if estimator in ("grpo", "rloo"):
        assert got[:4].abs().sum() > 0 and got[0, 0] != got[1, 0]
