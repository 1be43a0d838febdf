"""Turn-by-turn teacher-forced scoring against the cached prefix (models/turn_scoring.py): extending
the cache to each turn's engine input, then by the last response, gives every sampled token the
engine's log-prob and the full-sequence pass's (1e-5, fp32), with each frame encoded once."""

from __future__ import annotations

import pytest
import torch

from rollplex_train.data.types import VisionInputs
from rollplex_train.models.loading import load_model
from rollplex_train.models.turn_scoring import TurnScorer, images_from
from rollplex_train.rollout.builtin import BuiltinRolloutEngine
from test_rollout_multiturn import PARAMS, _loop, _teacher_forced_logprobs


@pytest.fixture(scope="module")
def trajectories(tiny_ckpt_qwen25):
    return _loop(BuiltinRolloutEngine(str(tiny_ckpt_qwen25)), tiny_ckpt_qwen25).rollout([2], PARAMS, uid_prefix="ts")


def test_turn_by_turn_scores_equal_the_engine_and_the_full_pass(trajectories, tiny_ckpt_qwen25):
    model = load_model(tiny_ckpt_qwen25)
    for t in trajectories:
        assert t.num_turns == 3
        scorer, pieces = TurnScorer(model), []
        for k, turn in enumerate(t.turns):  # what the window runs while turn k decodes: up to its input
            end = len(turn.input_ids)
            vision = VisionInputs.concat([o.vision for o in t.observations[:k + 1]])
            pieces.append(scorer.extend(t.ids[:end], t.loss_mask[:end].bool(), vision))
            assert scorer.scored == end and scorer.images == k + 1
        last = len(t.turns[-1].input_ids)
        suffix = scorer.extend(t.ids, t.loss_mask.bool(), t.vision)  # after the last turn: its response only
        assert suffix.shape[0] == len(t.ids) - last == len(t.turns[-1].response_ids)
        logp = torch.cat([*pieces, suffix])
        on = t.loss_mask.bool()
        torch.testing.assert_close(logp[on], t.logprobs[on], atol=1e-5, rtol=0)
        torch.testing.assert_close(logp[1:], _teacher_forced_logprobs(model, t)[1:], atol=1e-5, rtol=0)
        assert scorer.keys[0].shape[2] == len(t.ids)


def test_images_from_skips_the_encoded_frames(trajectories):
    t = trajectories[0]
    rest = images_from(t.vision, 1)
    assert rest.image_grid_thw.equal(t.vision.image_grid_thw[1:])
    assert rest.pixel_values.equal(torch.cat([o.vision.pixel_values for o in t.observations[1:]]))
    assert images_from(t.vision, t.vision.num_images).num_images == 0


def test_turn_stream_scored_in_a_store_gives_every_row_the_engine_logprobs(tiny_ckpt_qwen25):
    """What a rollplex env step runs: each turn's inputs (rollout_stream) extend the trajectories'
    caches as the turn starts, turn 0 once per seed for its G trajectories; the final call runs
    only the last responses and returns whole rows."""
    import contextlib

    from rollplex_train.rollout.multiturn import TurnInput
    from rollplex_train.training.turn_store import TurnStore

    model = load_model(tiny_ckpt_qwen25)
    store = TurnStore({"actor": model, "ref": model}, contextlib.nullcontext)
    loop = _loop(BuiltinRolloutEngine(str(tiny_ckpt_qwen25)), tiny_ckpt_qwen25)
    items = list(loop.rollout_stream([2, 5], PARAMS, uid_prefix="ts"))
    *turns, trajectories = items
    assert [len(t) for t in turns] == [2, 4, 4]  # turn 0: one input per seed; then one per trajectory
    assert turns[0][0].uids == ("ts:2/0", "ts:2/1") and turns[1][1].uids == ("ts:2/1",)
    again = loop.rollout([2, 5], PARAMS, uid_prefix="ts")  # the stream is the same rollout
    assert all(a.uid == b.uid and a.ids.equal(b.ids) and a.logprobs.equal(b.logprobs) for a, b in zip(trajectories, again))
    tokens = 0
    for inputs in turns:
        tokens += store.extend(inputs, ["actor", "ref"], 1.0).tokens
    assert tokens == 2 * (sum(len(i.ids) for i in turns[0]) + sum(
        len(i.ids) - len(t.turns[k - 1].input_ids) for k, inputs in enumerate(turns[1:], 1)
        for i, t in zip(inputs, trajectories)))  # every token scored once per role, turn 0 once per seed
    final = store.extend([TurnInput(t.env_seed, (t.uid,), t.ids, t.loss_mask.bool(), t.vision) for t in trajectories],
                         ["actor", "ref"], 1.0, final=True)
    assert final.tokens == 2 * sum(len(t.turns[-1].response_ids) for t in trajectories) and not store.scorers
    for t in trajectories:
        on = t.loss_mask.bool()
        for role in ("actor", "ref"):
            torch.testing.assert_close(final.log_probs[role][t.uid][on], t.logprobs[on], atol=1e-5, rtol=0)
