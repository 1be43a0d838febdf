"""Chosen-token log-probs without the full-vocabulary log-softmax (models/logprobs.py): values,
gradients and saved memory against the materialised log-softmax, and the trained weights of the
engine against today's route."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from rollplex_train.config import ActorConfig, AlgorithmConfig, ModelConfig
from rollplex_train.models import prefix, sequence
from rollplex_train.models.logprobs import chosen_token_logprobs
from rollplex_train.rollout.base import SamplingParams
from rollplex_train.rollout.builtin import BuiltinRolloutEngine
from rollplex_train.runtime.batching import to_train_batch
from rollplex_train.training.torch_engine import TorchTrainEngine


def materialised(hidden, head, tokens, temperature, with_entropy):
    """Today's route: full log-softmax, gather, entropy from the full distribution."""
    logp_all = F.log_softmax(head(hidden).float() / temperature, dim=-1)
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return logp, (-(logp_all.exp() * logp_all).sum(-1) if with_entropy else None)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
def test_values_and_gradients_match_the_full_log_softmax(temperature, bias):
    torch.manual_seed(0)
    head = torch.nn.Linear(48, 257, bias=bias)
    hidden = torch.randn(3, 11, 48, requires_grad=True)
    tokens = torch.randint(0, 257, (3, 11))
    g_logp, g_ent = torch.randn(3, 11), torch.randn(3, 11)
    grads = []
    for fn in (materialised, lambda *a: chosen_token_logprobs(*a[:3], temperature=a[3], with_entropy=a[4], chunk_rows=7)):
        logp, ent = fn(hidden, head, tokens, temperature, True)
        params = [hidden, *head.parameters()]
        grads.append((logp.detach(), ent.detach(), torch.autograd.grad((logp * g_logp + ent * g_ent).sum(), params)))
    (lp_a, ent_a, ga), (lp_b, ent_b, gb) = grads
    torch.testing.assert_close(lp_b, lp_a, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent_b, ent_a, atol=2e-6, rtol=0)
    for a, b in zip(ga, gb):
        assert float((a - b).abs().max()) <= 1e-6 * float(a.abs().max()) + 1e-7


def test_no_vocabulary_sized_tensor_is_kept_for_backward():
    head = torch.nn.Linear(32, 5000, bias=False)
    hidden = torch.randn(64, 32, requires_grad=True)
    tokens = torch.randint(0, 5000, (64,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        chosen_token_logprobs(hidden, head, tokens, with_entropy=True, chunk_rows=16)
    assert max(saved) <= 5000 * 32  # the head's weight; never (64, 5000) logits
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        materialised(hidden, head, tokens, 1.0, True)
    assert max(saved) >= 64 * 5000


def test_bad_arguments_refused():
    head = torch.nn.Linear(4, 9)
    with pytest.raises(ValueError, match="temperature=0"):
        chosen_token_logprobs(torch.zeros(2, 4), head, torch.zeros(2, dtype=torch.long), temperature=0)
    with pytest.raises(ValueError, match="leading shapes differ"):
        chosen_token_logprobs(torch.zeros(2, 4), head, torch.zeros(3, dtype=torch.long))


def _legacy_logprobs_from_hidden(model, hidden, response_ids, response_mask, temperature, with_entropy):
    logp, ent = materialised(hidden, model.lm_head, response_ids, temperature, with_entropy)
    return logp * response_mask, (ent * response_mask if with_entropy else None)


@pytest.mark.parametrize("shared_prefix", [False, True])
def test_engine_trains_todays_weights(tiny_ckpt_qwen25, make_prompts, monkeypatch, shared_prefix):
    """Below FULL_LOGSOFTMAX_MAX_BYTES the route is today's: weights within 1e-6 after 3 updates."""
    prompts = make_prompts(("color", "direction"), per_task=2)
    rollout = BuiltinRolloutEngine(str(tiny_ckpt_qwen25))
    batch = to_train_batch(prompts, rollout.generate(prompts, SamplingParams(n=2, max_new_tokens=6, seed=3)),
                           rollout.pad_id)
    batch.advantages = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(1)) * batch.response_mask
    states = []
    for legacy in (True, False):
        with monkeypatch.context() as m:
            if legacy:
                m.setattr(sequence, "logprobs_from_hidden", _legacy_logprobs_from_hidden)
                m.setattr(prefix, "logprobs_from_hidden", _legacy_logprobs_from_hidden)
            engine = TorchTrainEngine(ModelConfig(path=str(tiny_ckpt_qwen25), shared_prefix=shared_prefix),
                                      ActorConfig(lr=1e-4, micro_batch_size=4), AlgorithmConfig(kl_coef=0.05), seed=1)
            for _ in range(3):
                ref, _ = engine.compute_log_probs(batch, "ref")
                engine.update_actor(dataclasses.replace(batch, ref_logprobs=ref), old_from_actor=True)
            states.append(engine.actor.state_dict())
    worst = max(float((states[0][k] - states[1][k]).abs().max()) for k in states[0])
    assert worst <= 1e-6, worst


def test_large_vocabularies_take_the_chunked_route(tiny_ckpt_qwen25, monkeypatch):
    """Above the size limit the chunked kernel scores (same values, no (N, R, V) tensor kept)."""
    from rollplex_train.models.loading import load_model

    model = load_model(tiny_ckpt_qwen25)
    hidden = torch.randn(4, 9, model.config.get_text_config().hidden_size)
    ids = torch.randint(0, model.lm_head.weight.shape[0], (4, 9))
    mask = torch.ones(4, 9)
    full = sequence.logprobs_from_hidden(model, hidden, ids, mask, 0.8, True)
    calls = []
    real = sequence.chosen_token_logprobs
    monkeypatch.setattr(sequence, "chosen_token_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(sequence, "FULL_LOGSOFTMAX_MAX_BYTES", 4 * 9 * 4)
    chunked = sequence.logprobs_from_hidden(model, hidden, ids, mask, 0.8, True)
    assert calls == [1]
    torch.testing.assert_close(chunked[0], full[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(chunked[1], full[1], atol=2e-6, rtol=0)
