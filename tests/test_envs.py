"""The environment contract, the gymnasium adapter and the built-ins (``envs/``), without a model.

Scripted action lists replay byte-identical frames and identical reward/termination sequences for
the same seed; pinned episodes check the adapter's rewards, termination and format penalty.
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from rollplex_train.data.vision import patchify_images
from rollplex_train.envs import EnvError, Observation, VagenEnv, check_observation, env_builder
from rollplex_train.envs.actions import parse_answer
from rollplex_train.envs.base import fit_frame
from rollplex_train.registry import MissingExtraError

pytest.importorskip("gymnasium")
pytest.importorskip("minigrid")

LAKE_3X3 = ["SFF", "FHF", "FFG"]


def _replay(name: str, kwargs: dict, seed: int, answers: list[str]) -> tuple[list[bytes], list[tuple]]:
    """Frames (raw RGB bytes) and (reward, terminated, truncated, invalid) of a scripted episode."""
    env = env_builder(name, kwargs, {"max_actions_per_turn": 3})()
    obs, _ = env.reset(seed)
    frames, outcomes = [obs.images[0].tobytes()], []
    for answer in answers:
        obs, reward, terminated, truncated, info = env.step(answer)
        frames.append(obs.images[0].tobytes())
        outcomes.append((round(reward, 6), terminated, truncated, info["invalid"]))
        if terminated or truncated:
            break
    env.close()
    return frames, outcomes


@pytest.mark.parametrize("name,kwargs,seed,answers,expected", [
    # 3x3 fixed map: Right, Right (row 0 to the corner), junk (penalised, nothing moves), Down, Down -> goal
    ("frozenlake", {"desc": LAKE_3X3}, 0, ["<answer>Right, Right</answer>", "junk", "<answer>Down, Down</answer>"],
     [(0.0, False, False, False), (-0.1, False, False, True), (1.0, True, False, False)]),
    # into the hole at (1, 1): terminated with reward 0
    ("frozenlake", {"desc": LAKE_3X3}, 7, ["<answer>Down, Right</answer>"], [(0.0, True, False, False)]),
    # a random 4x4 map drawn from the seed (VAGEN's setting: SHFF/FFFF/FHFF/FHHG for seed 5); an unknown
    # name stops the turn, a fourth name is one too many (three taken: down to the bottom edge)
    ("frozenlake", {"size": 4}, 5, ["<answer>Down, Fly</answer>", "<answer>Down, Down, Down, Down</answer>"],
     [(-0.1, False, False, True), (-0.1, False, False, True)]),
    # Empty-5x5: start (1, 1) facing right, goal (3, 3); reward 1 - 0.9 * 5 / 100 on the fifth step
    ("minigrid:MiniGrid-Empty-5x5-v0", {}, 3, ["<answer>Forward, Forward, Right</answer>",
                                               "<answer>Forward, Forward</answer>"],
     [(0.0, False, False, False), (0.955, True, False, False)]),
    ("minigrid:BabyAI-GoToRedBall-v0", {}, 1, ["<answer>Left, Forward</answer>", "<answer>Toggle</answer>"],
     [(0.0, False, False, False), (0.0, False, False, False)]),
])
def test_same_seed_replays_byte_identical_frames_and_outcomes(name, kwargs, seed, answers, expected):
    frames, outcomes = _replay(name, kwargs, seed, answers)
    again_frames, again_outcomes = _replay(name, kwargs, seed, answers)
    assert outcomes == again_outcomes == expected
    assert frames == again_frames and len(frames) == len(expected) + 1
    assert len(set(frames)) > 1 or name.startswith("minigrid:BabyAI")  # the agent moved or turned


def test_random_maps_follow_the_seed():
    first = lambda seed: _replay("frozenlake", {"size": 4}, seed, [])[0][0]  # noqa: E731
    assert first(5) == first(5) and first(5) != first(6)
    env = env_builder("frozenlake", {"size": 4})()
    env.reset(5)
    assert [row.tobytes().decode() for row in env.env.unwrapped.desc] == ["SHFF", "FFFF", "FHFF", "FHHG"]


def test_frames_are_fitted_to_the_pixel_budget():
    """The adapter's frame is the size the patchifier resizes to (so its patches equal those of the raw
    render), within the budget's area."""
    env = env_builder("frozenlake", {"desc": LAKE_3X3}, {"min_pixels": 56 * 56, "max_pixels": 112 * 112})()
    obs, _ = env.reset(0)
    raw = Image.fromarray(env.env.render())
    frame = obs.images[0]
    assert raw.size == (192, 192) and frame.size == (84, 84)  # smart_resize(192, 192, 28, 3136, 12544)
    assert fit_frame(frame, 56 * 56, 112 * 112) is frame
    ours, grid = patchify_images([frame], min_pixels=56 * 56, max_pixels=112 * 112)
    theirs, grid_raw = patchify_images([raw], min_pixels=56 * 56, max_pixels=112 * 112)
    assert grid.tolist() == grid_raw.tolist() == [[1, 6, 6]] and torch.equal(ours, theirs)


@pytest.mark.parametrize("text,fmt,actions,invalid,reason", [
    ("I go <answer>Left, down</answer>", "tag", ("left", "down"), False, ""),
    ("<answer>up</answer> then <answer>Right</answer>", "tag", ("right",), False, ""),  # the last tag
    ("left, down", "tag", (), True, "no <answer>...</answer>"),
    ("<answer> </answer>", "tag", (), True, "empty answer"),
    ("<answer>Left, Jump, Up</answer>", "tag", ("left",), True, "unknown action 'jump'"),
    ("<answer>Up, Up, Up, Up</answer>", "tag", ("up", "up", "up"), True, "4 actions, at most 3"),
    ("go LEFT then up-left", "words", ("left", "up", "left"), False, ""),
    ("nothing here", "words", (), True, "no action named"),
])
def test_parse_answer(text, fmt, actions, invalid, reason):
    parsed = parse_answer(text, ("left", "down", "right", "up"), 3, fmt)
    assert (parsed.actions, parsed.invalid, parsed.reason) == (actions, invalid, reason)


def test_observation_contract_errors_are_one_line():
    good = Observation("a <image>", [np.zeros((4, 4, 3), np.uint8)])
    assert check_observation(good, "w").images[0].mode == "RGB"
    cases = [(("a <image>",), "returned a tuple as observation"),
             (Observation("text only"), "has no image"),
             (Observation("<image> <image>", [Image.new("RGB", (4, 4))]), "2 <image> placeholders but 1 images"),
             (Observation("<image>", ["frame.png"]), "an image is a str"),
             (Observation("<image>", [np.zeros((4, 4, 3), np.float32)]), "array float32 (4, 4, 3)")]
    for obs, words in cases:
        with pytest.raises(EnvError, match=r"^w: ") as err:
            check_observation(obs, "w")
        assert words in str(err.value) and "\n" not in str(err.value)


def test_registry_names_and_errors(tmp_path):
    with pytest.raises(ValueError, match=r"env.name='lake': expected one of \['frozenlake', 'minigrid'\]"):
        env_builder("lake")
    with pytest.raises(ValueError, match="not a MiniGrid/BabyAI id"):
        env_builder("minigrid:MiniGrid-Nope-v0")
    with pytest.raises(ValueError, match="expected 'minigrid:<id>'"):
        env_builder("minigrid")
    with pytest.raises(FileNotFoundError, match="environment file 'missing.py' not found"):
        env_builder("missing.py:Env")
    user = tmp_path / "my_env.py"
    user.write_text(
        "from PIL import Image\n"
        "from rollplex_train.envs import Observation, VisionEnv\n"
        "class Env(VisionEnv):\n"
        "    def __init__(self, size=8):\n"
        "        self.size = size\n"
        "    def system_prompt(self):\n"
        "        return 'sys'\n"
        "    def reset(self, seed):\n"
        "        return Observation('<image>', [Image.new('RGB', (self.size, self.size))]), {}\n"
        "    def step(self, text):\n"
        "        return Observation('<image>', [Image.new('RGB', (self.size, self.size))]), 1.0, True, False, {}\n"
        "class VagenLike:\n"
        "    def __init__(self, env_config):\n"
        "        self.size = env_config['size']\n"
        "    async def system_prompt(self):\n"
        "        return {'obs_str': 'vagen sys'}\n"
        "    async def reset(self, seed):\n"
        "        return {'obs_str': 'see <image>', 'multi_modal_input': {'<image>': [Image.new('RGB', (self.size, 4))]}}, {}\n"
        "    async def step(self, action_str):\n"
        "        return {'obs_str': action_str + ' <image>', 'multi_modal_input': {'<image>': [Image.new('RGB', (4, 4))]}}, 0.5, True, {'success': True}\n"
        "    async def close(self):\n"
        "        self.closed = True\n")
    env = env_builder(f"{user}:Env", {"size": 16})()
    assert env.reset(0)[0].images[0].size == (16, 16)
    with pytest.raises(ValueError, match=r"env.max_actions_per_turn apply to the built-in environments only"):
        env_builder(f"{user}:Env", {}, {"max_actions_per_turn": 2})
    with pytest.raises(ValueError, match="has no class 'Nope' with reset, step and system_prompt"):
        env_builder(f"{user}:Nope")
    vagen = env_builder(f"{user}:VagenLike", {"size": 12})()
    assert isinstance(vagen, VagenEnv) and vagen.system_prompt() == "vagen sys"
    obs, _ = vagen.reset(3)
    assert obs.text == "see <image>" and obs.images[0].size == (12, 4)
    obs, reward, terminated, truncated, info = vagen.step("go")
    assert (obs.text, reward, terminated, truncated, info) == ("go <image>", 0.5, True, False, {"success": True})
    vagen.close()
    assert vagen.env.closed and not asyncio.iscoroutine(vagen.env.closed)


def test_missing_extra_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "gymnasium", None)  # import gymnasium -> ImportError
    with pytest.raises(MissingExtraError, match=r"^env.name='frozenlake' needs gymnasium, the 'envs' extra: pip install"):
        env_builder("frozenlake")


@pytest.mark.parametrize("option,name,context", [("frozenlake", "frozenlake", None),
                                                 ("minigrid", "minigrid:MiniGrid-Empty-5x5-v0", 2)])
def test_env_config_group_composes_and_a_run_refuses_what_it_cannot_honour(option, name, context):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from rollplex_train.cli import conf_dir
    from rollplex_train.config import EnvConfig, register_configs, to_config

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["trainer.output_dir=/tmp/unused", f"env={option}"])
    env = EnvConfig(**OmegaConf.to_container(cfg.env))
    assert (env.name, env.context_window, env.max_actions_per_turn) == (name, context, 3)
    assert env_builder(env.name, env.kwargs, env.adapter_options())().reset(0)[0].images
    with pytest.raises(ValueError, match=rf"^env.name='{name}': (validation runs single-turn|env.context=window:2 drops)"):
        to_config(cfg)  # the defaults validate every 5 steps; minigrid's window drops observations
    with pytest.raises(ValueError, match=r"env.context='window:0': expected 'full' or 'window:<k>' with k >= 1"):
        EnvConfig(context="window:0")
