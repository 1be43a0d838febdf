"""Every shipped algorithm (``conf/algorithm/*.yaml``) under ``serial`` and ``rollplex`` with 2
mini-batches: the old-policy log-probs are computed or exactly reused wherever they are read, so
the in-reward KL, the advantages and the final weights equal a run with
``actor.recompute_old_log_prob=true``, and ``rollout/logprob_diff_max`` measures the real
rollout-vs-trainer mismatch (``runtime/old_policy.py``'s reuse rule).

The runs are in-process (``cluster.executor=inprocess``: the engines in this process, no Ray), 2
steps of 4 prompts x 2 responses each.

Tolerances: the algorithms with the in-reward KL (``rloo``, ``reinforce_plus_plus``) read old
log-probs before the update, so both runs take the same separate pass: equal bit for bit. Under
``grpo`` and ``drgrpo`` the reuse run takes the first mini-batch's old log-probs from the update's
own forward; that forward's log-probs differ from the no-grad pass's in the last bits only (the same
kernels in training mode; ``tests/test_old_policy.py`` bounds the weights after 3 updates by 1e-6),
so the weights are compared to 1e-6 and the advantages (which read no old log-probs) exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from rollplex_train.cli import conf_dir
from rollplex_train.config import register_configs, to_config
from rollplex_train.paths import resolve_config_paths
from rollplex_train.runtime.old_policy import old_read_before_update, reuse_actor_forward
from rollplex_train.tracking.loggers import read_metrics_jsonl
from rollplex_train.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ALGORITHMS = sorted(p.stem for p in (conf_dir() / "algorithm").glob("*.yaml"))
SMALL = ["trainer.total_steps=2", "trainer.save_freq=0", "trainer.val_freq=0", "trainer.val_before_train=false",
         "data.rollout_batch_size=4", "rollout.n=2", "rollout.max_new_tokens=6", "actor.ppo_mini_batch_size=2",
         "actor.micro_batch_size=4", "trainer.loggers=[jsonl]", "trainer.export_hf=false",
         "trainer.progress_bar=false", "cluster.executor=inprocess", "cluster.threads_per_device=1",
         "model.shared_prefix=true"]
# what the two routes must agree on (telemetry, timings and the mismatch metric aside)
COMPARED = ("critic/kl", "critic/advantages/mean", "critic/advantages/max", "critic/advantages/min",
            "critic/rewards/mean", "critic/score/mean")


def _config(overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=tiny_cpu", *overrides])
    return resolve_config_paths(to_config(cfg), conf_dir().parent)


def _run(out: Path, algorithm: str, schedule: str, recompute: bool):
    """(metrics records, final actor weights) of a 2-step run."""
    cfg = _config([*SMALL, f"algorithm={algorithm}", f"schedule={schedule}",
                   f"actor.recompute_old_log_prob={str(recompute).lower()}", f"trainer.output_dir={out}"])
    trainer = Trainer(cfg, out)
    trainer.fit()  # saves the last step's checkpoint
    weights = torch.load(out / "checkpoints" / "global_step_2" / "actor.pt", weights_only=True)
    return read_metrics_jsonl(out / "metrics.jsonl"), weights, cfg


@pytest.mark.parametrize("schedule", ["serial", "rollplex"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_reuse_matches_recompute(embedded_assets, tmp_path, algorithm, schedule):
    reused, w_reused, cfg = _run(tmp_path / "reuse", algorithm, schedule, recompute=False)
    computed, w_computed, _ = _run(tmp_path / "recompute", algorithm, schedule, recompute=True)
    in_reward_kl = bool(old_read_before_update(cfg))
    assert in_reward_kl == (algorithm in ("rloo", "reinforce_plus_plus"))
    assert reuse_actor_forward(cfg) == (not in_reward_kl)
    assert [r["step"] for r in reused] == [r["step"] for r in computed] == [1, 2]
    for a, b in zip(reused, computed):
        keys = [k for k in COMPARED if k in b]
        assert ("critic/kl" in keys) == in_reward_kl
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, (algorithm, schedule, a["step"])
        # the mismatch metric reads computed old log-probs only: the rollout's own numbers, ~1e-6 nats
        assert b["rollout/logprob_diff_max"] < 1e-4
        if in_reward_kl:  # every row computed: the same figure
            assert a["rollout/logprob_diff_max"] == b["rollout/logprob_diff_max"]
        else:  # the second mini-batch's rows computed, the first's reused (not read)
            assert a["rollout/logprob_diff_max"] < 1e-4
    tol = 0.0 if in_reward_kl else 1e-6
    worst = max(float((w_reused[k] - w_computed[k]).abs().max()) for k in w_computed)
    assert worst <= tol, (algorithm, schedule, worst)
