"""Rule-based rewards, user reward files and the RewardManager."""

import dataclasses
import logging
import math

import pytest
import torch

from rollplex_train.algo.rewards import (
    RewardFailure,
    RewardManager,
    auto_reward,
    choice_reward,
    extract_boxed,
    format_reward,
    load_reward_function,
    math_reward,
    number_reward,
    parse_number,
)


def test_extract_boxed():
    assert extract_boxed(r"so \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert extract_boxed(r"\boxed{1} then \boxed{ 2 }") == "2"  # the last box, stripped
    assert extract_boxed(r"\boxed{a{b}c}") == "a{b}c"
    assert extract_boxed(r"\boxed{1} and \boxed{2") == "1"  # unbalanced last box -> previous one
    assert extract_boxed("no box here") is None


def test_format_reward():
    assert format_reward(r"answer \boxed{3}") == 1.0
    assert format_reward("answer 3") == 0.0
    assert format_reward(r"\boxed{ }") == 0.0


def test_choice_reward():
    assert choice_reward(r"\boxed{Cat.}", "cat") == 1.0  # case and trailing punctuation
    assert choice_reward(r"\boxed{  red   panda }", "Red Panda") == 1.0  # spaces
    assert choice_reward(r"\boxed{\text{dog}}", "dog") == 1.0
    assert choice_reward("cat", "cat") == 0.0  # no box -> 0
    assert choice_reward(r"\boxed{dog}", "cat") == 0.0
    options = ["dog", "cat"]
    assert choice_reward(r"\boxed{B}", "cat", options=options) == 1.0  # option letter
    assert choice_reward(r"\boxed{(b)}", "cat", options=options) == 1.0
    assert choice_reward(r"\boxed{A}", "cat", options=options) == 0.0
    assert choice_reward(r"\boxed{C}", "cat", options=options) == 0.0  # no option C
    labelled = ["A. dog", "B. cat"]
    assert choice_reward(r"\boxed{cat}", "B", options=labelled) == 1.0  # letter ground truth
    assert choice_reward(r"\boxed{B. cat}", "B", options=labelled) == 1.0


def test_number_reward():
    assert number_reward(r"\boxed{3.0}", "3") == 1.0
    assert number_reward(r"\boxed{1,000}", "1000") == 1.0
    assert number_reward(r"\boxed{3.0000001}", "3") == 1.0  # |diff| / 3 = 3.3e-8 <= 1e-6
    assert number_reward(r"\boxed{3.001}", "3") == 0.0  # 3.3e-4 > 1e-6
    assert number_reward(r"\boxed{-0.5}", "-1/2") == 1.0
    assert number_reward(r"\boxed{three}", "3") == 0.0  # digits only
    assert number_reward("3", "3") == 0.0  # no box
    assert parse_number("1e-3") == pytest.approx(0.001)
    assert parse_number(r"\frac{3}{4}") == pytest.approx(0.75)
    assert parse_number("inf") is None


def test_math_reward():
    assert math_reward(r"\boxed{0.5}", r"\frac{1}{2}") == 1.0
    assert math_reward(r"\boxed{1+x}", "x+1") == 1.0
    assert math_reward(r"\boxed{3}", "2") == 0.0
    assert math_reward("1/2", r"\frac{1}{2}") == 0.0  # no box


def test_auto_reward_dispatch():
    assert auto_reward(r"\boxed{4.0}", "4") == 1.0  # number
    assert auto_reward(r"\boxed{B}", "cat", options=["dog", "cat"]) == 1.0  # choice
    assert auto_reward(r"\boxed{four}", "4") == 0.0


def test_load_reward_function(tmp_path):
    assert load_reward_function("math") is math_reward
    path = tmp_path / "my_reward.py"
    path.write_text("def score(response, ground_truth, **kwargs):\n    return float(response == ground_truth)\n")
    fn = load_reward_function(f"{path}:score")
    assert fn("a", "a") == 1.0 and fn("a", "b") == 0.0
    with pytest.raises(FileNotFoundError, match="missing.py"):
        load_reward_function(f"{tmp_path / 'missing.py'}:score")
    with pytest.raises(ValueError, match=r"my_reward\.py.*'nope'"):
        load_reward_function(f"{path}:nope")
    with pytest.raises(ValueError, match="reward.function='nonsense'.*auto"):
        load_reward_function("nonsense")


def test_manager_builtin_with_format_weight():
    manager = RewardManager("choice", format_weight=0.1)
    scores, metrics = manager.score(
        responses=[r"\boxed{B}", r"\boxed{dog}", "cat"],
        ground_truths=["cat", "cat", "cat"],
        uids=["u0", "u1", "u2"],
        options=[["dog", "cat"], [], []],
    )
    # accuracy [1, 0, 0], format [1, 1, 0]; score = 0.9*acc + 0.1*fmt = [1.0, 0.1, 0.0]
    torch.testing.assert_close(scores, torch.tensor([1.0, 0.1, 0.0]))
    assert scores.dtype == torch.float32
    assert metrics["reward/accuracy"] == pytest.approx(1 / 3)
    assert metrics["reward/format"] == pytest.approx(2 / 3)
    assert metrics["reward/failed"] == 0.0
    assert metrics["reward/score"] == pytest.approx(1.1 / 3)


def test_manager_user_function_failures_are_logged_scored_zero_and_counted(tmp_path, caplog):
    path = tmp_path / "flaky.py"
    path.write_text(
        "def score(response, ground_truth):\n"  # no **kwargs: options must not be passed
        "    if response == 'boom':\n"
        "        raise RuntimeError('kaboom')\n"
        "    if response == 'nan':\n"
        "        return float('nan')\n"
        "    if response == 'str':\n"
        "        return 'high'\n"
        "    return 1.0\n"
    )
    manager = RewardManager(f"{path}:score", format_weight=0.5)
    with caplog.at_level(logging.WARNING, logger="rollplex_train.algo.rewards"):
        scores, metrics = manager.score(
            responses=["boom", "nan", r"ok \boxed{1}", "str"],
            ground_truths=["1", "1", "1", "1"],
            uids=["uid-raise", "uid-nan", "uid-ok", "uid-str"],
            options=[[], [], [], []],
        )
    # accuracy [0 (raised), 0 (NaN), 1, 0 (non-number)], format [0, 0, 1, 0]
    # score = 0.5*acc + 0.5*fmt = [0, 0, 1, 0]
    torch.testing.assert_close(scores, torch.tensor([0.0, 0.0, 1.0, 0.0]))
    assert metrics["reward/failed"] == 3.0
    assert metrics["reward/accuracy"] == pytest.approx(0.25)
    assert metrics["reward/format"] == pytest.approx(0.25)
    # one warning for the call: the count and the first failure of each kind (not one per sample)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "failed on 3 of 4 samples" in warnings[0]
    assert "uid=uid-raise raised RuntimeError: kaboom" in warnings[0]
    assert "uid=uid-nan returned nan" in warnings[0]
    assert "uid-str" not in warnings[0] and "uid-ok" not in warnings[0]
    assert all(math.isfinite(s) for s in scores.tolist())


def test_manager_stops_when_the_failed_fraction_is_reached(tmp_path, caplog):
    path = tmp_path / "broken.py"
    path.write_text("def score(response, ground_truth):\n    raise KeyError('no such field')\n")
    manager = RewardManager(f"{path}:score", format_weight=0.0)  # max_failed_frac=1.0: all must fail
    with pytest.raises(RewardFailure, match=r"failed on 3 of 3 samples .*uid=u0 raised KeyError: 'no such field'.*"
                                            r"reward.max_failed_frac=1"):
        manager.score(["a", "b", "c"], ["1", "1", "1"], ["u0", "u1", "u2"])
    half = RewardManager(f"{path}:score", format_weight=0.0, max_failed_frac=0.5)
    with pytest.raises(RewardFailure):
        half.score(["a"], ["1"], ["u0"])
    ok = RewardManager("auto", format_weight=0.0, max_failed_frac=0.5)
    scores, metrics = ok.score([r"\boxed{1}", "x"], ["1", "2"], ["u0", "u1"])
    assert scores.tolist() == [1.0, 0.0] and metrics["reward/failed"] == 0.0
    with pytest.raises(ValueError, match="reward.max_failed_frac"):
        RewardManager("auto", format_weight=0.0, max_failed_frac=0.0)
    message = ""
    try:
        manager.score(["a"], ["1"], ["u0"])
    except RewardFailure as err:
        message = str(err)
    assert "\n" not in message  # one line


def test_manager_errors():
    with pytest.raises(ValueError, match="reward.format_weight"):
        RewardManager("auto", format_weight=1.5)
    manager = RewardManager("auto", format_weight=0.0)
    with pytest.raises(ValueError, match="equal lengths"):
        manager.score(["a"], ["a", "b"], ["u"], [[]])


def _failing_reward_batch(tmp_path, on_failure: str):
    """One group of 4 responses; the user function raises on 'boom' and returns None on 'none'."""
    from rollplex_train.config import Config, RewardConfig
    from rollplex_train.data.types import PromptSample, Response, VisionInputs
    from rollplex_train.runtime import batching

    path = tmp_path / "partial.py"
    path.write_text(
        "def score(response, ground_truth):\n"
        "    if response == 'boom':\n"
        "        raise ValueError('cannot parse')\n"
        "    if response == 'none':\n"
        "        return None\n"
        "    return float(response == ground_truth)\n"
    )
    cfg = Config(reward=RewardConfig(function=f"{path}:score", on_failure=on_failure))
    manager = RewardManager(cfg.reward.function, cfg.reward.format_weight)
    prompt = PromptSample(uid="p0", prompt_ids=torch.tensor([1, 2]), vision=VisionInputs(), ground_truth="7")
    texts = ["7", "3", "boom", "none", "7", "5"]
    responses = [Response(prompt_index=0, token_ids=torch.tensor([5, 6]), logprobs=torch.zeros(2), text=t,
                          finish_reason="stop") for t in texts]
    batch = batching.to_train_batch([prompt], responses, pad_id=0)
    scores, failed, metrics = batching.score_responses(manager, batch, responses)
    advantages, _ = batching.step_advantages(cfg, batch, scores, failed, None, None)
    return dataclasses.replace(batch, reward_failed=failed, advantages=advantages), scores, metrics


def test_failed_reward_excluded_from_group_baseline(tmp_path):
    batch, scores, metrics = _failing_reward_batch(tmp_path, "exclude")
    assert metrics["reward/failed"] == 2.0
    assert batch.reward_failed.tolist() == [False, False, True, True, False, False]
    # GRPO over the 4 scored responses [1, 0, 1, 0]: mean 0.5, unbiased std sqrt(1/3)
    std = math.sqrt(1 / 3)
    expected = torch.tensor([0.5, -0.5, 0.0, 0.0, 0.5, -0.5]) / (std + 1e-6)
    torch.testing.assert_close(batch.advantages[:, 0], expected)
    assert torch.all(batch.advantages[2:4] == 0)


def test_failed_reward_zero_stays_in_group_baseline(tmp_path):
    batch, scores, metrics = _failing_reward_batch(tmp_path, "zero")
    assert metrics["reward/failed"] == 2.0
    # scores [1, 0, 0, 0, 1, 0]: mean 1/3, unbiased std sqrt(4/15); the failures are trained as wrong
    values = torch.tensor([1.0, 0, 0, 0, 1, 0])
    expected = (values - values.mean()) / (values.std() + 1e-6)
    torch.testing.assert_close(batch.advantages[:, 0], expected)
    assert batch.advantages[2, 0] < 0


def test_reward_on_failure_choices():
    from rollplex_train.config import RewardConfig

    with pytest.raises(ValueError, match="reward.on_failure"):
        RewardConfig(on_failure="ignore")
