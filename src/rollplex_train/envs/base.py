"""The vision environment contract: what a multi-turn rollout needs from an environment.

An environment is a stateful episode driven by text: ``reset(seed)`` starts an episode and returns
the first observation, ``step(action_text)`` takes the model's whole answer of one turn (the
environment parses it) and returns the next observation with a reward and the gymnasium
termination flags (``terminated``: the task ended, success or failure; ``truncated``: a limit
outside the task ended it). An observation is text with one ``<image>`` placeholder per image, and
the images (PIL images or (H, W, 3) uint8 arrays), in placeholder order.

The shape is VAGEN's ``GymImageEnv`` (``vagen/envs/gym_image_env.py``: ``reset(seed) -> obs, info``,
``step(action_str) -> obs, reward, done, info``, ``system_prompt()``, ``close()``, obs =
``{"obs_str": "... <image> ...", "multi_modal_input": {"<image>": [PIL.Image, ...]}}``), made
synchronous and with gymnasium's two flags; :class:`VagenEnv` wraps a VAGEN environment (its async
methods, dict observations and single ``done``) into this contract, so their environments port
without edits.

Environments must not know engines or devices: they see text in and give text + images out.
"""

from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np
from PIL import Image

from rollplex_train.data.vision import smart_resize

IMAGE_PLACEHOLDER = "<image>"  # the same placeholder as data/prompts.py and VAGEN

Frame = Union[Image.Image, np.ndarray]


class EnvError(RuntimeError):
    """An environment broke its contract or raised: the message is one line naming the
    environment, the seed, the turn and what was expected."""


@dataclass
class Observation:
    """What the model is shown after a reset or a step.

    Attributes:
        text: text with one ``<image>`` placeholder per image, where the image goes.
        images: the frames, in placeholder order: PIL images or (H, W, 3) uint8 arrays.
    """

    text: str
    images: list[Frame] = field(default_factory=list)


class VisionEnv(abc.ABC):
    """Base class of environments a multi-turn rollout drives (one episode at a time).

    A rollout creates one instance per trajectory, calls ``reset`` once, then ``step`` once per
    turn from a worker thread (never two calls at once on one instance), and ``close`` at the end.
    The same seed must give the same episode: the G trajectories of one seed share their first
    context, and a rollout checks that their first observations are equal.
    """

    @abc.abstractmethod
    def system_prompt(self) -> str:
        """The system message of the episode (task rules, action vocabulary, answer format)."""

    @abc.abstractmethod
    def reset(self, seed: int) -> tuple[Observation, dict[str, Any]]:
        """Start an episode from ``seed``; returns the first observation and an info dict."""

    @abc.abstractmethod
    def step(self, action_text: str) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        """Act on the model's answer of one turn.

        Returns:
            ``(observation, reward, terminated, truncated, info)``; ``info`` may hold ``success``
            (bool, the task was solved), ``invalid`` (bool, the answer could not be parsed or named
            an unknown action; counted) and anything else (kept in the trajectory record).
        """

    def close(self) -> None:
        """Release what the environment holds (renderers, processes)."""


def as_image(frame: Frame, where: str) -> Image.Image:
    """A frame as an RGB PIL image.

    Raises:
        EnvError: ``frame`` is neither a PIL image nor an (H, W, 3) / (H, W) uint8 array (names
            ``where``).
    """
    if isinstance(frame, Image.Image):
        return frame if frame.mode == "RGB" else frame.convert("RGB")
    if isinstance(frame, np.ndarray) and frame.dtype == np.uint8 and (
            frame.ndim == 2 or (frame.ndim == 3 and frame.shape[-1] in (3, 4))):
        return Image.fromarray(frame).convert("RGB")
    kind = f"array {frame.dtype} {frame.shape}" if isinstance(frame, np.ndarray) else type(frame).__name__
    raise EnvError(f"{where}: an image is a {kind}; expected a PIL image or an (H, W, 3) uint8 array")


def fit_frame(image: Image.Image, min_pixels: int, max_pixels: int, factor: int = 28) -> Image.Image:
    """``image`` resized (PIL bicubic) to Qwen2-VL's ``smart_resize`` target for the pixel budget:
    the size ``data/vision.patchify_images`` resizes it to, so patchifying it leaves it as it is.

    Args:
        min_pixels, max_pixels: area bounds, pixels. factor: ``patch_size * merge_size`` (28).
    """
    h, w = smart_resize(image.height, image.width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    return image if (image.height, image.width) == (h, w) else image.resize((w, h), resample=Image.Resampling.BICUBIC)


def check_observation(obs: Any, where: str) -> Observation:
    """``obs`` checked against the contract, its frames turned into RGB PIL images.

    Args:
        where: how errors name the call (environment, seed, turn).

    Raises:
        EnvError: ``obs`` is not an :class:`Observation`, has no image, or its placeholders and
            images disagree in number; a frame of the wrong kind.
    """
    if not isinstance(obs, Observation):
        raise EnvError(f"{where}: returned a {type(obs).__name__} as observation; expected "
                       f"envs.Observation(text, images)")
    if not isinstance(obs.text, str):
        raise EnvError(f"{where}: observation text is a {type(obs.text).__name__}; expected str")
    placeholders = obs.text.count(IMAGE_PLACEHOLDER)
    if placeholders != len(obs.images):
        raise EnvError(f"{where}: observation text has {placeholders} {IMAGE_PLACEHOLDER} placeholders "
                       f"but {len(obs.images)} images")
    if not obs.images:
        raise EnvError(f"{where}: observation has no image; a vision environment shows at least one frame a turn")
    return Observation(obs.text, [as_image(f, where) for f in obs.images])


class VagenEnv(VisionEnv):
    """A VAGEN ``GymImageEnv`` (async methods, dict observations, one ``done`` flag) in this contract.

    ``done`` becomes ``terminated`` (VAGEN has no separate truncation; the rollout's own
    ``max_turns`` truncates). Each call runs the coroutine to completion on a private event loop of
    the calling thread, so the rollout's worker threads can step several VAGEN environments at once.

    Args:
        env: the VAGEN environment instance (built with its ``env_config`` dict).
    """

    def __init__(self, env: Any):
        self.env = env
        self._loop = None

    def _run(self, coroutine):
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(coroutine)

    @staticmethod
    def _observation(obs: Any) -> Any:
        if not isinstance(obs, dict) or "obs_str" not in obs:
            return obs  # check_observation names what it is
        images = (obs.get("multi_modal_input") or {}).get(IMAGE_PLACEHOLDER, [])
        return Observation(obs["obs_str"], list(images))

    def system_prompt(self) -> str:
        return self._run(self.env.system_prompt())["obs_str"]

    def reset(self, seed: int) -> tuple[Observation, dict[str, Any]]:
        obs, info = self._run(self.env.reset(seed))
        return self._observation(obs), dict(info)

    def step(self, action_text: str) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        obs, reward, done, info = self._run(self.env.step(action_text))
        return self._observation(obs), float(reward), bool(done), False, dict(info)

    def close(self) -> None:
        try:
            self._run(self.env.close())
        finally:
            if self._loop is not None:
                self._loop.close()
