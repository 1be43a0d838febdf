"""Any gymnasium environment with ``render_mode="rgb_array"`` and a discrete action set, as a
:class:`~rollplex_train.envs.base.VisionEnv`.

The model sees the rendered frame (resized to the pixel budget with Qwen2-VL's ``smart_resize``
and PIL bicubic: ``envs.base.fit_frame``) and answers with action names (``envs/actions.py``);
each name is one gymnasium ``step``.
A turn's reward is the sum of its steps' rewards, minus ``format_penalty`` when the answer is
invalid (unparsable, an unknown name, too many names: counted as ``info["invalid"]``). The turn
ends early when gymnasium says ``terminated`` or ``truncated``.

API facts (gymnasium 1.4.0): ``Env.reset(seed=...) -> (obs, info)``, ``Env.step(a) -> (obs,
reward, terminated, truncated, info)``, ``Env.render()`` returns an (H, W, 3) uint8 array under
``render_mode="rgb_array"``.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import numpy as np
from PIL import Image

from rollplex_train.envs.actions import parse_answer
from rollplex_train.envs.base import EnvError, IMAGE_PLACEHOLDER, Observation, VisionEnv, fit_frame

# One render at a time in the process: gymnasium's toy-text environments (FrozenLake) load their
# PNG sprites with ``pygame.image.load`` at each new environment's first render, and concurrent loads
# from the environment worker threads fail with "pygame.error: Error reading the PNG file" (seen with
# 4 threads on pygame-ce 2.5.8). A later render of the 3x3 map takes about 0.6 ms on this machine's CPU.
_RENDER_LOCK = threading.Lock()


class GymnasiumEnv(VisionEnv):
    """A gymnasium environment driven by action names.

    Args:
        make: builds the gymnasium environment for an episode's seed (called at every ``reset``,
            so a seed may choose a map; an environment that ignores the seed is built anew too).
        actions: action name (lower case) -> gymnasium action.
        title: what the environment is, for the system prompt (e.g. "FrozenLake").
        rules: the task in a sentence or two, for the system prompt.
        describe: optional ``gym_env -> str`` text shown above each frame (e.g. a mission).
        max_actions_per_turn: most actions one answer may take.
        format_penalty: subtracted from the reward of an invalid turn (>= 0).
        answer_format: ``tag`` or ``words`` (``envs/actions.py``).
        min_pixels, max_pixels, factor: the frame's pixel budget (``fit_frame``).
        success: optional ``(reward, terminated, info) -> bool`` of the last step; default: the
            episode terminated with a positive last reward (FrozenLake, MiniGrid).

    The previous episode's gymnasium environment is dropped at ``reset``, not closed: gymnasium's
    toy-text ``close()`` quits pygame for the whole process, under other environments' renders.
    """

    def __init__(self, make: Callable[[int], Any], actions: dict[str, int], *, title: str, rules: str,
                 describe: Optional[Callable[[Any], str]] = None, max_actions_per_turn: int = 3,
                 format_penalty: float = 0.1, answer_format: str = "tag", min_pixels: int = 56 * 56,
                 max_pixels: int = 112 * 112, factor: int = 28,
                 success: Optional[Callable[[float, bool, dict], bool]] = None):
        if max_actions_per_turn < 1:
            raise ValueError(f"env.max_actions_per_turn={max_actions_per_turn}: expected >= 1")
        if format_penalty < 0:
            raise ValueError(f"env.format_penalty={format_penalty}: expected >= 0 (it is subtracted)")
        self.make, self.actions = make, dict(actions)
        self.vocabulary = tuple(self.actions)
        self.title, self.rules, self.describe = title, rules, describe
        self.max_actions, self.format_penalty, self.answer_format = max_actions_per_turn, format_penalty, answer_format
        self.min_pixels, self.max_pixels, self.factor = min_pixels, max_pixels, factor
        self.success = success or (lambda reward, terminated, info: terminated and reward > 0)
        self.env = None
        self.done = False

    def system_prompt(self) -> str:
        names = ", ".join(a.capitalize() for a in self.vocabulary)
        example = ", ".join(a.capitalize() for a in self.vocabulary[: min(2, self.max_actions)])
        how = (f"Answer with up to {self.max_actions} actions inside <answer></answer>, separated by commas, "
               f"e.g. <answer>{example}</answer>." if self.answer_format == "tag"
               else f"Answer with up to {self.max_actions} action names.")
        return f"You play {self.title}. {self.rules} Actions: {names}. {how}"

    def _frame(self) -> Image.Image:
        with _RENDER_LOCK:
            frame = self.env.render()
        if not isinstance(frame, np.ndarray) or frame.ndim != 3:
            raise EnvError(f"{self.title}: render() gave {type(frame).__name__}; expected an (H, W, 3) uint8 "
                           "array (make the gymnasium environment with render_mode='rgb_array')")
        image = Image.fromarray(np.ascontiguousarray(frame[..., :3]))
        return fit_frame(image, self.min_pixels, self.max_pixels, self.factor)

    def _observation(self, lead: str) -> Observation:
        text = lead + (self.describe(self.env) + "\n" if self.describe else "") + f"State: {IMAGE_PLACEHOLDER}"
        return Observation(text, [self._frame()])

    def reset(self, seed: int) -> tuple[Observation, dict[str, Any]]:
        self.env = self.make(seed)
        _, info = self.env.reset(seed=seed)
        self.done = False
        return self._observation(""), dict(info)

    def step(self, action_text: str) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        if self.env is None or self.done:
            raise EnvError(f"{self.title}: step() {'before reset()' if self.env is None else 'after the episode ended'}")
        parsed = parse_answer(action_text, self.vocabulary, self.max_actions, self.answer_format)
        reward, terminated, truncated, last, info, taken = 0.0, False, False, 0.0, {}, []
        for name in parsed.actions:
            _, last, terminated, truncated, info = self.env.step(self.actions[name])
            reward += float(last)
            taken.append(name)
            if terminated or truncated:
                break
        if parsed.invalid:
            reward -= self.format_penalty
        self.done = terminated or truncated
        lead = f"You took: {', '.join(a.capitalize() for a in taken) or 'no action'}."
        lead += f" Invalid answer ({parsed.reason}).\n" if parsed.invalid else "\n"
        record = {"actions": taken, "invalid": parsed.invalid, "invalid_reason": parsed.reason,
                  "success": bool(taken) and self.success(float(last), terminated, info)}
        return self._observation(lead), reward, terminated, truncated, record

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None
