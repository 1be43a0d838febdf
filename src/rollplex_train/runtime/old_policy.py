"""Where the old-policy log-probs are the actor's own forward (the pass TRL's GRPOTrainer skips).

PPO's ratio is ``exp(logp - old_logp)`` with ``old_logp`` the log-probs under the weights that
sampled the responses. The actor update's first mini-batch runs its forward on exactly those
weights (synchronous on-policy: nothing has stepped the optimizer yet), at the same temperature,
so its detached log-probs *are* the old-policy log-probs; TRL's GRPOTrainer takes
``old = current.detach()`` there too (``trl/trainer/grpo_trainer.py::_compute_loss``, 1.16). The
separate no-grad pass is then only needed for the other mini-batches, whose forward runs after one
or more optimizer steps. Later PPO epochs reuse the first epoch's detached values.

Provable only when the training-mode forward equals the eval-mode scoring pass: no dropout in the
checkpoint (``models.loading.checkpoint_has_dropout``). ``actor.recompute_old_log_prob=true`` keeps
the separate pass for every mini-batch.

The reuse rule: old log-probs are either computed before the update or exactly reused, never read
unset. The reused rows get their values only inside the update, so reuse is taken only when
nothing reads old log-probs between the rollout and the update (:func:`old_read_before_update`):
the in-reward KL (``algorithm.use_kl_in_reward`` with a reference) reads every row, so it turns
reuse off; the rollout-vs-trainer mismatch metric (``rollout/logprob_diff_max``) reads only the
rows whose old log-probs were computed (none logged when all are reused); no advantage estimator
reads them.
"""

from __future__ import annotations

from typing import Optional

from rollplex_train.config import Config
from rollplex_train.models.loading import checkpoint_has_dropout, has_dropout


def actor_forward_is_old_policy(cfg: Config, hf_config: Optional[dict] = None) -> bool:
    """Whether the first mini-batch takes its old-policy log-probs from the actor's own forward.

    Args:
        hf_config: the model's ``config.json`` dict; None reads it from ``model.path``.
    """
    dropout = checkpoint_has_dropout(cfg.model.path) if hf_config is None else has_dropout(hf_config)
    return not cfg.actor.recompute_old_log_prob and not dropout


def old_read_before_update(cfg: Config) -> list[str]:
    """The config keys whose readers need every row's old-policy log-probs before the actor update
    (then no mini-batch may reuse the actor's forward): ``algorithm.use_kl_in_reward`` when a
    reference is computed (``AlgorithmConfig.needs_reference``). Empty: reuse is exact."""
    algo = cfg.algorithm
    return ["algorithm.use_kl_in_reward"] if algo.use_kl_in_reward and algo.needs_reference else []


def reuse_actor_forward(cfg: Config, hf_config: Optional[dict] = None) -> bool:
    """Whether this run's first mini-batch takes its old-policy log-probs from the actor's own
    forward: the forward is the old policy (:func:`actor_forward_is_old_policy`) and nothing reads
    old log-probs before the update (:func:`old_read_before_update`).

    Args:
        hf_config: the model's ``config.json`` dict; None reads it from ``model.path``.
    """
    return not old_read_before_update(cfg) and actor_forward_is_old_policy(cfg, hf_config)


def groups_per_mini_batch(cfg: Config, num_groups: int) -> int:
    """Prompt groups in a PPO mini-batch (one optimizer step) of a batch of ``num_groups``
    (``actor.ppo_mini_batch_size``, -1: all); the first mini-batch is groups ``0 ..`` that many.
    An environment run's groups are its trajectories (``runtime/envs.py``, one row each): a
    mini-batch of k seeds is k * ``rollout.n`` of them."""
    mini = cfg.actor.ppo_mini_batch_size * (cfg.rollout.n if cfg.env.name else 1)
    return num_groups if mini <= 0 else min(mini, num_groups)


def old_pass_groups(cfg: Config, num_groups: int, reuse: bool) -> list[int]:
    """Groups whose old-policy log-probs need the separate pass: all without ``reuse``, else the
    groups outside the first mini-batch (none when one mini-batch takes the whole batch)."""
    start = groups_per_mini_batch(cfg, num_groups) if reuse else 0
    return list(range(start, num_groups))
