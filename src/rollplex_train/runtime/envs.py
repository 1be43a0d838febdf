"""The rollout phase of an environment run (``env.name`` set): trajectories become training rows.

For the step's P prompts (their dataset rows are the environment seeds: row ``r`` of ``uid``
``<split>:<r>`` is ``reset(seed=r)``), the rollout engines run G = ``rollout.n`` trajectories per
seed through the turn loop (``rollout/multiturn.TurnLoop``, one call per engine). Each trajectory
becomes one training row, its own "prompt group" of one response, so the existing log-prob and
update phases apply unchanged:

    prompt   = turn 0's engine input (system + observation 0 + assistant header), with the
               vision of every observation in the trajectory (in order)
    response = the rest of the trajectory's ids (responses, closing tokens, later observations),
               loss mask 1 exactly on the sampled tokens (``Response.loss_mask``), the engine's
               log-probs there

The full-sequence pass treats every token the policy did not sample as a possible vision slot
(``models/sequence.response_logprobs``), so the later frames are embedded where they were shown.
The score of a row is the trajectory's return (sum of the per-turn environment rewards; the
per-turn rewards stay on the ``Trajectory``); advantages are taken over the G trajectories of a
seed (:func:`seed_groups`), with any estimator and loss aggregation. A PPO mini-batch of k seeds is
k * G rows (``runtime/old_policy.groups_per_mini_batch``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from rollplex_train.config import Config
from rollplex_train.data.types import PromptSample, Response
from rollplex_train.rollout.trajectory import Trajectory, trajectory_metrics
from rollplex_train.runtime.serial import sampling_params
from rollplex_train.runtime.timeline import Timeline


def env_seed(prompt: PromptSample) -> int:
    """The environment seed of a dataset prompt: its row index (``uid`` = ``<split>:<row>``).

    Raises:
        ValueError: a uid without a row index.
    """
    tail = prompt.uid.rpartition(":")[2]
    if not tail.isdigit():
        raise ValueError(f"prompt uid {prompt.uid!r}: an environment run takes its seeds from the rows "
                         "'<split>:<row index>' of data.train_files")
    return int(tail)


@dataclass
class EnvRollout:
    """What the environment rollout hands the step.

    Attributes:
        trajectories: P * G trajectories, seed-major.
        prompts: one prompt per trajectory (its turn-0 input and every frame's vision).
        responses: one response per trajectory (``prompt_index`` = its position).
        scores: (P * G,) float32 returns.
        seed_index: (P * G,) int64 the seed (position in the step's prompts) of each row: the GRPO group.
        metrics: ``env/*`` (``rollout.trajectory.trajectory_metrics``) and, scored in the rollout,
            ``envs/turn_scoring_*`` (``runtime/env_window.py``).
        log_probs: what the rollout scored already: role -> row -> (1, R_row) float32
            (``RolloutResult.log_probs``; empty under ``serial``).
    """

    trajectories: list[Trajectory]
    prompts: list[PromptSample]
    responses: list[Response]
    scores: torch.Tensor
    seed_index: torch.Tensor
    metrics: dict[str, float]
    log_probs: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)


def trajectory_row(t: Trajectory, index: int) -> tuple[PromptSample, Response]:
    """Trajectory ``t`` as a prompt (turn 0's input, every observation's vision) and a response
    (the rest of ``ids``; ``loss_mask``/``logprobs`` the trajectory's from there).

    Raises:
        ValueError: a trajectory whose first turn's input is not a prefix of its ids (``env.context``
            ``window:<k>`` with more than k observations: its later turns saw another sequence).
    """
    first = t.turns[0].input_ids
    start = int(first.shape[0])
    if t.context != "full" and not all(len(turn.observations) == turn_index + 1 for turn_index, turn in enumerate(t.turns)):
        raise ValueError(f"trajectory {t.uid}: env.context={t.context} dropped observations; training on "
                         "trajectories needs env.context=full (or a window no shorter than env.max_turns)")
    if not torch.equal(t.ids[:start], first):
        raise ValueError(f"trajectory {t.uid}: turn 0's input is not a prefix of the trajectory's ids")
    prompt = PromptSample(uid=t.uid, prompt_ids=first, vision=t.vision, ground_truth="", task="env")
    response = Response(prompt_index=index, token_ids=t.ids[start:], logprobs=t.logprobs[start:],
                        text=t.turns[-1].text, finish_reason=t.turns[-1].finish_reason,
                        loss_mask=t.loss_mask[start:])
    return prompt, response


def env_rollout(cfg: Config, workers, prompts: list[PromptSample], step: int, version: int,
                timeline: Timeline, roles: Optional[list[str]] = None, old_rows: frozenset = frozenset(),
                plan=None) -> EnvRollout:
    """G = ``rollout.n`` trajectories per seed of ``prompts`` under weights ``version`` (timed as
    ``gen``), as training rows (module docstring). Sampling seeds: (``rollout.seed`` + step,
    trajectory uid ``step<k>:<seed>/<g>``), so the same seeds give the same tokens whatever the
    schedule or the number of engines.

    Args:
        roles: None: the rollout only (``serial``, or a ``rollplex`` step its planner does not
            overlap); else the log-prob passes (``actor``, ``ref``) to run turn by turn inside it
            (``rollplex``: ``runtime/env_window.py``), the ``actor`` pass only for ``old_rows``.
        plan: with ``roles``, the planner's ``EnvWindowPlan`` (its device shares).

    Raises:
        EnvError / ValueError: as ``TurnLoop.rollout`` and :func:`trajectory_row`.
    """
    seeds = [env_seed(p) for p in prompts]
    log_probs, more = {}, {}
    if roles is None:
        with timeline.span("gen", "rollout"):
            trajectories = workers.rollout.rollout_envs(cfg.env, cfg.model.path, seeds, sampling_params(cfg, step),
                                                        version, f"step{step}").result()
    else:
        from rollplex_train.runtime.env_window import overlapped_env_rollout

        trajectories, log_probs, more = overlapped_env_rollout(cfg, workers, prompts, step, version, timeline,
                                                               roles, set(old_rows), plan)
    rows = [trajectory_row(t, i) for i, t in enumerate(trajectories)]
    position = {s: i for i, s in enumerate(seeds)}
    return EnvRollout(
        trajectories=trajectories,
        prompts=[p for p, _ in rows],
        responses=[r for _, r in rows],
        scores=torch.tensor([t.episode_return for t in trajectories], dtype=torch.float32),
        seed_index=torch.tensor([position[t.env_seed] for t in trajectories], dtype=torch.long),
        metrics={**trajectory_metrics(trajectories), **more},
        log_probs=log_probs,
    )


def turn_logprob_mismatch(trajectories: list[Trajectory], old: torch.Tensor, rows: list[int]) -> dict[str, float]:
    """``env/logprob_diff_max/turn<k>``: per turn k, the largest |trainer - engine| log-prob over the
    sampled tokens of that turn of the trajectories ``rows`` (those the old-policy pass scored), from
    the (N, R) old-policy log-probs ``old`` (row i = trajectory i; column 0 = the first token after
    turn 0's input)."""
    worst: dict[int, float] = {}
    for i in rows:
        t = trajectories[i]
        start = int(t.turns[0].input_ids.shape[0])
        for k, turn in enumerate(t.turns):
            a, b = turn.span[0] - start, turn.span[1] - start
            if b > a:
                diff = float((old[i, a:b] - turn.logprobs).abs().max())
                worst[k] = max(worst.get(k, 0.0), diff)
    return {f"env/logprob_diff_max/turn{k}": v for k, v in sorted(worst.items())}
