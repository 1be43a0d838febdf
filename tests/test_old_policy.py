"""The old-policy pass TRL skips: the first mini-batch's old log-probs are the actor's own forward.

Today's route (a separate no-grad pass before every update) and the reuse route must train the same
weights (within 1e-6 after 3 updates), the first update's ratio must be exactly 1, mini-batches after
the first keep the separate pass, and a checkpoint with dropout refuses the reuse.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from rollplex_train.config import ActorConfig, AlgorithmConfig, ModelConfig
from rollplex_train.models.loading import checkpoint_has_dropout, dropout_rates
from rollplex_train.rollout.base import SamplingParams
from rollplex_train.rollout.builtin import BuiltinRolloutEngine
from rollplex_train.runtime.batching import to_train_batch
from rollplex_train.runtime.graph import build_step_graph
from rollplex_train.training import ppo_loop
from rollplex_train.training.torch_engine import TorchTrainEngine

LR = 1e-4


@pytest.fixture(scope="module")
def batch(tiny_ckpt_qwen25, make_prompts):
    """4 prompts (images and videos) x 2 responses of 6 tokens, fixed random advantages."""
    prompts = make_prompts(("color", "direction"), per_task=2)
    engine = BuiltinRolloutEngine(str(tiny_ckpt_qwen25))
    responses = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=6, seed=3))
    out = to_train_batch(prompts, responses, engine.pad_id)
    g = torch.Generator().manual_seed(1)
    out.advantages = torch.randn(out.response_mask.shape, generator=g) * out.response_mask
    return out


def _engine(ckpt, shared_prefix: bool, **actor) -> TorchTrainEngine:
    return TorchTrainEngine(ModelConfig(path=str(ckpt), shared_prefix=shared_prefix),
                            ActorConfig(lr=LR, micro_batch_size=4, **actor), AlgorithmConfig(kl_coef=0.05), seed=1)


def _train(engine: TorchTrainEngine, batch, reuse: bool, steps: int = 3) -> list[dict]:
    """``steps`` updates, each preceded by the step's reference pass and, as the schedule does, the
    separate old-policy pass of the groups that need it."""
    metrics = []
    mini = engine.cfg.ppo_mini_batch_size if engine.cfg.ppo_mini_batch_size > 0 else len(batch.prompts)
    for _ in range(steps):
        ref, _ = engine.compute_log_probs(batch, "ref")
        old = None
        if not reuse:
            old, _ = engine.compute_log_probs(batch, "actor")
        elif mini < len(batch.prompts):  # only the rows outside the first mini-batch
            rest = list(range(mini, len(batch.prompts)))
            sub, _ = engine.compute_log_probs(batch.select_groups(rest), "actor")
            old = torch.zeros_like(batch.response_mask)
            old[(batch.group_index >= mini).nonzero().squeeze(1)] = sub
        step = dataclasses.replace(batch, ref_logprobs=ref, old_logprobs=old)
        metrics.append(engine.update_actor(step, old_from_actor=reuse))
    return metrics


@pytest.mark.parametrize("shared_prefix", [False, True])
@pytest.mark.parametrize("actor", [{}, {"ppo_mini_batch_size": 2, "ppo_epochs": 2}], ids=["one_mini", "two_mini_x2"])
def test_reuse_trains_todays_weights(tiny_ckpt_qwen25, batch, shared_prefix, actor):
    today, reuse = (_engine(tiny_ckpt_qwen25, shared_prefix, **actor) for _ in range(2))
    _train(today, batch, reuse=False)
    _train(reuse, batch, reuse=True)
    a, b = today.actor.state_dict(), reuse.actor.state_dict()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= 1e-6, worst
    moved = max(float((a[k] - v).abs().max()) for k, v in _engine(tiny_ckpt_qwen25, shared_prefix).actor.state_dict().items())
    assert moved > 100 * 1e-6  # the updates themselves are far above the tolerance


def test_first_update_ratio_is_exactly_one(tiny_ckpt_qwen25, batch, monkeypatch):
    seen = []
    real = ppo_loop.policy_loss

    def spy(logp, old, *args, **kwargs):
        seen.append((logp - old).detach())
        return real(logp, old, *args, **kwargs)

    monkeypatch.setattr(ppo_loop, "policy_loss", spy)
    engine = _engine(tiny_ckpt_qwen25, True, ppo_mini_batch_size=2)
    metrics = _train(engine, batch, reuse=True, steps=1)[0]
    first = [d for d in seen[: len(seen) // 2]]  # micro-batches of the first mini-batch (2 of 4 groups)
    assert first and all(torch.equal(d, torch.zeros_like(d)) for d in first)
    assert any(float(d.abs().max()) > 0 for d in seen[len(seen) // 2:])  # second mini-batch: stepped weights
    assert metrics["actor/ppo_kl"] != 0.0
    single = _train(_engine(tiny_ckpt_qwen25, False), batch, reuse=True, steps=1)[0]
    assert single["actor/ppo_kl"] == 0.0 and single["actor/pg_clipfrac"] == 0.0


def test_missing_old_logprobs_of_later_mini_batches_refused(tiny_ckpt_qwen25, batch):
    engine = _engine(tiny_ckpt_qwen25, False, ppo_mini_batch_size=2)
    ref, _ = engine.compute_log_probs(batch, "ref")
    with pytest.raises(ValueError, match="all mini-batches but the first"):
        engine.update_actor(dataclasses.replace(batch, ref_logprobs=ref), old_from_actor=True)
    assert engine.weights_version == 0


def test_dropout_refuses_reuse(tiny_ckpt_qwen25, batch, tmp_path):
    assert not checkpoint_has_dropout(tiny_ckpt_qwen25)
    cfg = json.loads((tiny_ckpt_qwen25 / "config.json").read_text())
    assert dropout_rates(cfg)["text_config.attention_dropout"] == 0.0
    engine = _engine(tiny_ckpt_qwen25, False)
    engine.actor.config.get_text_config().attention_dropout = 0.1
    ref, _ = engine.compute_log_probs(batch, "ref")
    with pytest.raises(ValueError, match="dropout"):
        engine.update_actor(dataclasses.replace(batch, ref_logprobs=ref), old_from_actor=True)


def test_graph_has_no_old_tasks_for_reused_groups():
    graph = build_step_graph([10, 12, 14, 16], 40, decode_steps=5, mini_batch_groups=2, needs_reference=True,
                             weights_version=3, old_from_actor_groups=2)
    names = set(graph.tasks)
    assert not {"prefix/old/g0", "suffix/old/g0", "prefix/old/g1", "suffix/old/g1"} & names
    assert {"prefix/old/g2", "suffix/old/g3", "prefix/ref/g0", "prefix/actor/g1"} <= names
    assert "suffix/old/g2" in graph["update/mb1"].deps and "suffix/ref/g0" in graph["update/mb0"].deps
    assert sum(t.kind == "prefix/old" for t in graph.movable()) == 2
