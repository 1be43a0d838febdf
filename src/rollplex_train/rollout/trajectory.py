"""The typed record of one multi-turn trajectory, as the turn loop (``rollout/multiturn.py``) returns it.

Legend: L trajectory tokens, L_t turn t's engine input tokens, R_t turn t's response tokens,
T turns, Np patches, D patch features.

``ids`` is everything in order (``rollout/turns.py``): system, observation 0, response 0, its
closing tokens, observation 1, ... the last response. Under ``env.context=full`` turn t's engine
input is ``ids[:len(input_ids_t)]`` and one teacher-forced pass over ``ids`` with ``loss_mask``
scores every turn; under ``window:<k>`` each turn's input is its own sequence
(:meth:`Trajectory.turn_prompt`), scored turn by turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

from rollplex_train.data.types import PromptSample, VisionInputs

FINISH_REASONS = ("terminated", "truncated", "max_turns", "token_budget", "env_error")
"""Why a trajectory ended: the environment ended the task (``terminated``) or cut it
(``truncated``); ``rollout.max_turns`` / ``env.max_turns`` turns were taken; the next turn would
not fit ``env.max_context_tokens``; the environment failed (``env.on_error=truncate``: the failed
step's turn is kept with reward 0 and ``Trajectory.error`` says what failed)."""


@dataclass
class ObservationRecord:
    """One observation shown to the model.

    Attributes:
        text: the environment's text, ``<image>`` placeholders included.
        images: the frames as the model sees them (resized to the pixel budget), RGB.
        vision: their patches (``pixel_values`` (Np, D) float32, ``image_grid_thw`` (n, 3) int64).
        span: ``(start, end)`` of its user-message tokens in ``Trajectory.ids``.
    """

    text: str
    images: list[Image.Image]
    vision: VisionInputs
    span: tuple[int, int] = (0, 0)


@dataclass
class TurnRecord:
    """One model answer and the environment's reply to it.

    Attributes:
        input_ids: (L_t,) int64, exactly the ids the engine was given.
        observations: indices (into ``Trajectory.observations``) of the observations in the input,
            in order: their images are the input's images.
        response_ids: (R_t,) int64 sampled ids (end-of-turn token included when sampled).
        logprobs: (R_t,) float32 the engine's log-probs of them (logits / temperature).
        text: the response decoded (special tokens skipped), what the environment parsed.
        finish_reason: the engine's ``stop`` or ``length``.
        span: ``(start, end)`` of the response in ``Trajectory.ids``.
        reward: the environment's reward for this turn (format penalty included).
        terminated, truncated: the environment's flags after this turn.
        invalid: the answer was unparsable or named an unknown action (counted).
        info: the environment's info dict.
    """

    input_ids: torch.Tensor
    observations: tuple[int, ...]
    response_ids: torch.Tensor
    logprobs: torch.Tensor
    text: str
    finish_reason: str
    span: tuple[int, int]
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    invalid: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Trajectory:
    """One episode of one environment seed.

    Attributes:
        uid: ``<prefix>:<seed>/<sample>``.
        env_seed: the seed given to ``reset``. sample_index: g in 0..G-1 among the seed's trajectories.
        ids: (L,) int64 the whole trajectory (module docstring).
        loss_mask: (L,) float32, 1 exactly on sampled tokens (the responses).
        logprobs: (L,) float32 the engine's log-probs on sampled tokens, 0 elsewhere.
        turns: the T turns. observations: observations 0..T-1 (each turn's last input observation).
        finish: one of ``FINISH_REASONS``. error: the environment's one-line error (``env_error``).
        context: ``env.context`` it ran under.
    """

    uid: str
    env_seed: int
    sample_index: int
    ids: torch.Tensor
    loss_mask: torch.Tensor
    logprobs: torch.Tensor
    turns: list[TurnRecord]
    observations: list[ObservationRecord]
    finish: str
    error: str = ""
    context: str = "full"

    @property
    def rewards(self) -> list[float]:
        """Per-turn rewards."""
        return [t.reward for t in self.turns]

    @property
    def episode_return(self) -> float:
        """Sum of the per-turn rewards."""
        return float(sum(self.rewards))

    @property
    def success(self) -> bool:
        """Some turn's info says ``success``."""
        return any(bool(t.info.get("success", False)) for t in self.turns)

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def num_invalid(self) -> int:
        """Turns whose answer was invalid."""
        return sum(t.invalid for t in self.turns)

    @property
    def response_spans(self) -> list[tuple[int, int]]:
        """``(start, end)`` of each turn's response in ``ids`` (per-turn boundaries)."""
        return [t.span for t in self.turns]

    def vision_of(self, observations: tuple[int, ...]) -> VisionInputs:
        """The patches of the given observations, concatenated in order."""
        return VisionInputs.concat([self.observations[i].vision for i in observations])

    @property
    def vision(self) -> VisionInputs:
        """The patches of every observation in ``ids`` (for a pass over the whole trajectory)."""
        return self.vision_of(tuple(range(len(self.observations))))

    def turn_prompt(self, turn: int) -> PromptSample:
        """Turn ``turn``'s engine input as a prompt (ids + its images): the prefix against which its
        response is scored. Under ``context=full`` the prefixes of successive turns nest."""
        record = self.turns[turn]
        return PromptSample(uid=f"{self.uid}/turn{turn}", prompt_ids=record.input_ids,
                            vision=self.vision_of(record.observations), ground_truth="", task="env")


def trajectory_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Rollout metrics of environment trajectories.

    Returns:
        ``env/success_rate``, ``env/return/mean``, ``env/turns/mean``, ``env/invalid_action_frac``
        (invalid turns / turns), ``env/errors`` (trajectories ended by an environment error) and
        ``env/finish/<reason>`` (fraction of trajectories per ``FINISH_REASONS`` entry).
    """
    n = max(len(trajectories), 1)
    turns = sum(t.num_turns for t in trajectories)
    out = {
        "env/success_rate": sum(t.success for t in trajectories) / n,
        "env/return/mean": sum(t.episode_return for t in trajectories) / n,
        "env/turns/mean": turns / n,
        "env/invalid_action_frac": sum(t.num_invalid for t in trajectories) / max(turns, 1),
        "env/errors": float(sum(t.finish == "env_error" for t in trajectories)),
    }
    for reason in FINISH_REASONS:
        out[f"env/finish/{reason}"] = sum(t.finish == reason for t in trajectories) / n
    return out
