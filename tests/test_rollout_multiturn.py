"""The multi-turn turn loop (rollout/multiturn.py) on the built-in engine and the tiny checkpoint.

Token in / token out: a trajectory's ids start with every turn's engine input, the loss mask is 1
exactly on sampled tokens, the image pads are the frames' grid tokens, and one teacher-forced pass
over the final ids (M-RoPE positions of images after assistant text) gives the engine's log-probs.
Bad environments end in a one-line error or a counted, truncated trajectory, never a hang.
"""

from __future__ import annotations

import threading

import pytest
import torch
from PIL import Image

from rollplex_train.config import EnvConfig
from rollplex_train.envs import EnvError, Observation, VisionEnv, env_builder
from rollplex_train.models.loading import load_model, load_tokenizer
from rollplex_train.models.sequence import embed_with_vision, rope_positions
from rollplex_train.data.types import Response
from rollplex_train.rollout.base import RolloutEngine, SamplingParams
from rollplex_train.rollout.builtin import BuiltinRolloutEngine
from rollplex_train.rollout.multiturn import TurnLoop
from rollplex_train.rollout.trajectory import trajectory_metrics

SIZES = [(56, 56), (84, 56), (56, 84)]  # (width, height): grids (1, 4, 4), (1, 4, 6), (1, 6, 4)
GRID_TOKENS = [4, 6, 6]


class Scripted(VisionEnv):
    """Never terminates; observation t shows one frame of ``SIZES[t]`` in a colour of its own, and
    step t's reward is 0.5 * t. ``fail``: what step ``fail_at`` does instead."""

    def __init__(self, fail: str = "", fail_at: int = 1, release: threading.Event | None = None):
        self.turn, self.fail, self.fail_at, self.release = 0, fail, fail_at, release

    def _obs(self) -> Observation:
        frame = Image.new("RGB", SIZES[self.turn % 3], (40 * self.turn, 100, 200))
        return Observation(f"Turn {self.turn}: <image> go on", [frame])

    def system_prompt(self) -> str:
        return "Say anything."

    def reset(self, seed: int):
        if self.fail == "reset":
            raise ValueError("no such level")
        self.turn = 0
        return self._obs(), {}

    def step(self, action_text: str):
        reward = 0.5 * self.turn
        self.turn += 1
        if self.fail and self.turn == self.fail_at + 1:
            if self.fail == "raise":
                raise RuntimeError("boom\nsecond line")
            if self.fail == "text":
                return Observation("no frame"), 0.0, False, False, {}
            if self.fail == "hang":
                self.release.wait()
        return self._obs(), reward, False, False, {"invalid": self.turn == 2}


class Unseeded(Scripted):
    """reset ignores the seed: the G trajectories of a seed would start differently."""

    count = 0

    def reset(self, seed: int):
        Unseeded.count += 1
        self.turn = Unseeded.count
        return self._obs(), {}


@pytest.fixture(scope="module")
def engine(tiny_ckpt_qwen25):
    return BuiltinRolloutEngine(str(tiny_ckpt_qwen25))


def _loop(engine, ckpt, make_env=Scripted, **cfg) -> TurnLoop:
    settings = dict(max_turns=3, name="scripted")
    settings.update(cfg)
    return TurnLoop(engine, load_tokenizer(ckpt), make_env, EnvConfig(**settings))


PARAMS = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=11)


def _teacher_forced_logprobs(model, trajectory, text_positions: bool = False) -> torch.Tensor:
    """(L,) log-probs of every token of ``trajectory.ids`` from one forward over the whole of it, with
    M-RoPE positions (``text_positions``: 0..L-1 on all three axes instead, the wrong rule)."""
    ids = trajectory.ids.unsqueeze(0)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        positions, _ = rope_positions(model, ids, mask, trajectory.vision)
        if text_positions:
            positions = torch.arange(ids.shape[1]).expand(3, 1, -1)
        embeds = embed_with_vision(model, ids, trajectory.vision, vision_grad=False)
        hidden = model.model.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions).last_hidden_state
        logp = torch.log_softmax(model.lm_head(hidden[0, :-1]).float(), dim=-1)
    return torch.cat([torch.zeros(1), logp.gather(-1, trajectory.ids[1:, None]).squeeze(-1)])


def test_three_turn_trajectory_is_token_in_token_out(engine, tiny_ckpt_qwen25):
    loop = _loop(engine, tiny_ckpt_qwen25)
    trajectories = loop.rollout([0], PARAMS, uid_prefix="step0")
    model = load_model(tiny_ckpt_qwen25)
    image_token = model.config.image_token_id
    close = loop.turn_tokens.close_ids
    assert [t.uid for t in trajectories] == ["step0:0/0", "step0:0/1"]
    for traj in trajectories:
        assert traj.finish == "max_turns" and traj.num_turns == 3 and traj.rewards == [0.0, 0.5, 1.0]
        assert traj.num_invalid == 1 and len(traj.observations) == 3
        generated = torch.zeros(len(traj.ids))
        for k, turn in enumerate(traj.turns):
            assert traj.ids[:len(turn.input_ids)].equal(turn.input_ids)  # every engine input is a prefix
            start, end = turn.span
            assert traj.ids[start:end].equal(turn.response_ids) and traj.logprobs[start:end].equal(turn.logprobs)
            generated[start:end] = 1
            if k < 2:  # the next input is this one + the response + its closing tokens + the next observation
                user = traj.observations[k + 1]
                closing = close[1:] if turn.response_ids[-1] == close[0] else close
                assert traj.turns[k + 1].input_ids.equal(torch.cat([turn.input_ids, turn.response_ids, closing,
                                                                    traj.ids[user.span[0]:user.span[1]]]))
        assert traj.loss_mask.equal(generated) and traj.loss_mask.dtype == torch.float32
        assert int((traj.ids == image_token).sum()) == sum(GRID_TOKENS) == sum(
            int(o.vision.image_grid_thw.prod()) // 4 for o in traj.observations)
        assert [o.images[0].size for o in traj.observations] == SIZES
        tf = _teacher_forced_logprobs(model, traj)
        on = traj.loss_mask.bool()
        torch.testing.assert_close(tf[on], traj.logprobs[on], atol=1e-5, rtol=0)
        wrong = _teacher_forced_logprobs(model, traj, text_positions=True)  # the check tells the rules apart
        assert (wrong[on] - traj.logprobs[on]).abs().max() > 1e-3
    assert not trajectories[0].ids.equal(trajectories[1].ids)  # two samples of one seed differ


def test_same_seeds_same_trajectories_whatever_the_batch(engine, tiny_ckpt_qwen25):
    loop = _loop(engine, tiny_ckpt_qwen25)
    both = loop.rollout([0, 1], PARAMS)
    alone = loop.rollout([1], PARAMS)
    assert [t.uid for t in both] == ["env:0/0", "env:0/1", "env:1/0", "env:1/1"]
    for a, b in zip(both[2:], alone):
        assert a.ids.equal(b.ids) and a.loss_mask.equal(b.loss_mask)
        # the log-probs round with the batch's padding (differences of ~1e-6 on the std-0.06 tiny
        # checkpoint, none on the earlier std-0.02 one); the tokens are what a seed fixes
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("k", [1, 2])
def test_window_context_keeps_the_last_k_observations(engine, tiny_ckpt_qwen25, k):
    loop = _loop(engine, tiny_ckpt_qwen25, context=f"window:{k}")
    traj = loop.rollout([0], SamplingParams(n=1, max_new_tokens=5, seed=2))[0]
    system = traj.ids[:traj.observations[0].span[0]]
    last = traj.turns[2]
    if k == 1:
        expected = torch.cat([system, traj.ids[slice(*traj.observations[2].span)]])
    else:
        expected = torch.cat([system, traj.ids[traj.observations[1].span[0]:traj.observations[2].span[1]]])
    assert last.input_ids.equal(expected) and last.observations == tuple(range(3 - k, 3))
    assert traj.turn_prompt(2).vision.image_grid_thw.tolist() == [[1, 4, 6], [1, 6, 4]][2 - k:]
    assert traj.turns[0].input_ids.equal(traj.ids[:len(traj.turns[0].input_ids)])


@pytest.mark.parametrize("fail,words", [
    ("raise", "env.name=scripted seed 0 sample 0 turn 1 step raised RuntimeError: boom"),
    ("text", "env.name=scripted seed 0 sample 0 turn 1 step: observation has no image"),
    ("hang", "env.name=scripted seed 0 sample 0 turn 1 step raised StepTimeout: did not return within 0.5 s"),
])
def test_a_bad_step_truncates_its_trajectory_with_one_line(engine, tiny_ckpt_qwen25, fail, words):
    release = threading.Event()
    try:
        loop = _loop(engine, tiny_ckpt_qwen25, make_env=lambda: Scripted(fail, 1, release), step_timeout_s=0.5)
        trajectories = loop.rollout([0], PARAMS)
    finally:
        release.set()  # lets the abandoned thread of the hanging step end
    for traj in trajectories:
        assert traj.finish == "env_error" and traj.num_turns == 2 and traj.rewards == [0.0, 0.0]
        assert traj.error.startswith(words.replace("sample 0", f"sample {traj.sample_index}")) and "\n" not in traj.error
        assert traj.loss_mask.sum() == sum(len(t.response_ids) for t in traj.turns)
    assert trajectory_metrics(trajectories)["env/errors"] == 2.0


class OneByOneEngine(RolloutEngine):
    """Yields each prompt's responses as an item of its own and, after a request's first item, waits
    (10 s at most) until an environment step has begun: it records whether the turn loop stepped an
    environment while the rest of the request was still to come."""

    def __init__(self, step_started: threading.Event):
        self.step_started, self.overlapped = step_started, []

    def generate(self, prompts, params, weights_version=None, prefixes=None):
        return [r for item in self.generate_stream(prompts, params) for r in item]

    def generate_stream(self, prompts, params, weights_version=None, prefixes=None, progress_every=0):
        for index in range(len(prompts)):
            yield [Response(index, torch.tensor([5, 6, 7]), torch.full((3,), -1.0), "ok", "length")
                   for _ in range(params.n)]
            if index == 0:
                self.overlapped.append(self.step_started.wait(timeout=10))
                self.step_started.clear()

    def update_weights(self, named_tensors, version):
        raise NotImplementedError

    def release_memory(self, tags=()):
        pass

    def resume_memory(self, tags=()):
        pass


def test_environment_steps_overlap_the_rest_of_the_decode(tiny_ckpt_qwen25):
    started = threading.Event()

    class Signals(Scripted):
        def step(self, action_text):
            started.set()
            return super().step(action_text)

    engine = OneByOneEngine(started)
    loop = _loop(engine, tiny_ckpt_qwen25, make_env=Signals)
    trajectories = loop.rollout([0, 1], SamplingParams(n=1))
    assert engine.overlapped == [True, True, True] and [t.num_turns for t in trajectories] == [3, 3]
    first, second = trajectories[0].turns[:2]  # a response cut by its length is closed by the whole closing
    assert second.input_ids[len(first.input_ids):len(first.input_ids) + 3 + len(loop.turn_tokens.close_ids)].equal(
        torch.cat([torch.tensor([5, 6, 7]), loop.turn_tokens.close_ids]))


def test_errors_that_stop_the_rollout_are_one_line(engine, tiny_ckpt_qwen25):
    with pytest.raises(EnvError, match=r"^env.name=scripted seed 0 sample 0 turn 1 step raised RuntimeError: boom$"):
        _loop(engine, tiny_ckpt_qwen25, make_env=lambda: Scripted("raise"), on_error="raise").rollout([0], PARAMS)
    with pytest.raises(EnvError, match=r"^env.name=scripted seed 3 sample 0 reset raised ValueError: no such level$"):
        _loop(engine, tiny_ckpt_qwen25, make_env=lambda: Scripted("reset")).rollout([3], PARAMS)
    with pytest.raises(EnvError, match=r"sample 1 reset: the first observation differs from sample 0's"):
        _loop(engine, tiny_ckpt_qwen25, make_env=Unseeded).rollout([0], PARAMS)
    with pytest.raises(EnvError, match=r"the first input is \d+ tokens; with rollout.max_new_tokens=6 it exceeds "
                                       r"env.max_context_tokens=20"):
        _loop(engine, tiny_ckpt_qwen25, max_context_tokens=20).rollout([0], PARAMS)


def test_token_budget_and_max_turns_truncate_and_are_counted(engine, tiny_ckpt_qwen25):
    loop = _loop(engine, tiny_ckpt_qwen25, max_turns=1)
    first = len(loop.rollout([0], SamplingParams(n=1, max_new_tokens=6, seed=1))[0].turns[0].input_ids)
    budget = first + 6 + 20  # turn 0 fits, turn 1's input (+ a response, a closing and an observation) does not
    trajectories = _loop(engine, tiny_ckpt_qwen25, max_turns=50, max_context_tokens=budget).rollout([0], PARAMS)
    assert [t.finish for t in trajectories] == ["token_budget"] * 2 and [t.num_turns for t in trajectories] == [1, 1]
    metrics = trajectory_metrics(trajectories + _loop(engine, tiny_ckpt_qwen25).rollout([0], PARAMS))
    assert metrics["env/finish/token_budget"] == metrics["env/finish/max_turns"] == 0.5
    assert metrics["env/turns/mean"] == 2.0 and metrics["env/invalid_action_frac"] == 2 / 8


def test_frozenlake_trajectories_replay_in_a_fresh_environment(engine, tiny_ckpt_qwen25):
    """The environment got each turn's decoded text and the record holds what it showed: replaying the
    texts in a fresh FrozenLake gives the same rewards, flags and frames."""
    pytest.importorskip("gymnasium")
    cfg = EnvConfig(name="frozenlake", kwargs={"desc": ["SFF", "FHF", "FFG"]}, max_turns=3, answer_format="words")
    build = env_builder(cfg.name, cfg.kwargs, cfg.adapter_options())
    trajectories = TurnLoop.from_config(engine, str(tiny_ckpt_qwen25), cfg).rollout([0, 1], PARAMS)
    for traj in trajectories:
        env = build()
        obs, _ = env.reset(traj.env_seed)
        assert obs.images[0].tobytes() == traj.observations[0].images[0].tobytes()
        for k, turn in enumerate(traj.turns):
            obs, reward, terminated, truncated, info = env.step(turn.text)
            assert (reward, terminated, truncated, info["invalid"]) == (turn.reward, turn.terminated, turn.truncated,
                                                                        turn.invalid)
            if k + 1 < traj.num_turns:
                assert obs.images[0].tobytes() == traj.observations[k + 1].images[0].tobytes()
        assert traj.finish == ("terminated" if traj.turns[-1].terminated else "max_turns")
    metrics = trajectory_metrics(trajectories)
    assert metrics["env/invalid_action_frac"] == sum(t.num_invalid for t in trajectories) / sum(
        t.num_turns for t in trajectories)
