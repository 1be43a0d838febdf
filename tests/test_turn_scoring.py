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
