"""The ``rollplex`` schedule's environment rollout: each turn's finished context scored while it decodes.

In a trajectory under ``env.context=full`` everything before the turn being decoded (the system
message, the observations, the earlier responses) is response-independent context for the rest of
the trajectory. While turn k decodes and the environments step, the training ranks run the
old-policy (role ``actor``) and reference teacher-forced scoring of that context against each
trajectory's cached prefix, its new frames through the vision tower
(``TrainWorker.score_turns``, ``models/turn_scoring.py``); after the last turn only each
trajectory's last response remains (``suffix_after``, on the whole device). The log-probs go to
the step as ``RolloutResult.log_probs``, so its log-prob phases compute nothing more for these rows.

Whether a step overlaps at all, and with which device shares, is the planner's decision
(:class:`EnvWindowPlanner`), made from the run's measured cost model (``runtime/cost_model.py``, the
one the single-turn window plans with): the overlapped step, ``max(rollout beside the scoring at d
threads, turn scoring at t threads) + last responses on the whole device + 2 re-shares``, against
the serial step's ``rollout alone on the whole device + the old/reference passes after it``. The first steps measure both
(two overlapped at half the cores, then two serial), so the planner never keeps a slower step once
both are known (the side not chosen is not measured again).

Per overlapped step:

1. give the rollout and train workers the plan's shares (decode / train threads);
2. stream the turn loop (``RolloutGroup.rollout_envs_stream``); each turn's ``TurnInput`` list is
   sent at once to the DP rank of its seed (seed position mod DP size), a rank's calls run in
   order (turn 0 of a seed is one pass its G trajectories share);
3. when the rollout ends: wait for the calls still running (``turns_exposed``), give the train
   workers the whole device and score the last responses (``suffix_after``).

Metrics: ``envs/turn_scoring_s`` (the calls' seconds, worker side), ``envs/turn_scoring_hidden_frac``
(the part inside the rollout's window), ``envs/turn_scoring_tokens``, ``envs/turn_scoring_calls``.
The plan: ``planner/env_overlap`` (1: overlapped), ``planner/profiling``, ``planner/decode_share``,
``planner/train_share``, ``planner/predicted_s`` and ``planner/predicted_no_overlap_s`` (seconds of
the rollout and the passes, once both are measured).
Under ``env.context=window:<k>`` (k >= ``env.max_turns``: ``config`` refuses less) the context
scored is still the whole trajectory, the training row.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from rollplex_train.config import Config
from rollplex_train.data.types import PromptSample
from rollplex_train.rollout.multiturn import TurnInput
from rollplex_train.runtime.cost_model import CostModel
from rollplex_train.runtime.serial import sampling_params
from rollplex_train.runtime.timeline import Timeline

# cost-model kinds of an environment step, in seconds per trajectory turn (trajectories x the mean
# turns of the step; the planner sizes a coming step by its trajectories and the last step's turns,
# so a policy that learns shorter trajectories shrinks both sides alike): the rollout (turn loop) alone and beside the turn scoring (which it shares the
# device with: on one thread the two take turns), the turn scoring inside it, the last responses'
# scoring after it (whole device), and the serial step's old/reference passes (whole device)
GEN, GEN_BESIDE, TURNS, LAST, PASSES = ("envs/rollout", "envs/rollout_beside_scoring", "envs/turn_scoring",
                                        "envs/last_responses", "envs/passes")


@dataclass(frozen=True)
class EnvWindowPlan:
    """One environment step's placement (:class:`EnvWindowPlanner`).

    Attributes:
        overlap: score each turn's context inside the rollout (else the step's passes after it, as
            the serial schedule runs them).
        decode_threads / train_threads: the rollout's and the training ranks' threads while it runs
            (an overlapped step; the whole device otherwise).
        mode: ``profile_overlap`` / ``profile_serial`` (measuring) or ``plan``.
        predicted_s / predicted_no_overlap_s: the cost model's seconds of the rollout and the passes
            overlapped (at these shares) and not (nan while profiling).
    """

    overlap: bool
    decode_threads: int
    train_threads: int
    mode: str
    predicted_s: float = math.nan
    predicted_no_overlap_s: float = math.nan

    def metrics(self) -> dict[str, float]:
        """The ``planner/*`` metrics of the plan (module docstring)."""
        out = {"planner/env_overlap": float(self.overlap), "planner/profiling": float(self.mode != "plan"),
               "planner/decode_share": float(self.decode_threads), "planner/train_share": float(self.train_threads)}
        if self.mode == "plan":
            out.update({"planner/predicted_s": self.predicted_s,
                        "planner/predicted_no_overlap_s": self.predicted_no_overlap_s})
        return out


class EnvWindowPlanner:
    """Decides per environment step whether the turn scoring overlaps the rollout, and the device
    shares, from the measured ``cost`` (module docstring); learns from each finished step.

    Args:
        cost: the run's cost model (kept in checkpoints with the single-turn planner's rates).
        threads: the device's threads (``Workers.threads``).
        halves: (rollout, train) threads side by side (``Workers.halves()``): the profiling split.
    """

    def __init__(self, cost: CostModel, threads: int, halves: tuple[int, int]):
        self.cost, self.threads, self.halves = cost, threads, halves
        self.turns = 1.0  # mean turns of the last step seen (1 until then: the choice does not depend on it)

    def plan(self, trajectories: int) -> EnvWindowPlan:
        """The plan of a step of ``trajectories`` trajectories: profile until an overlapped step (at
        half the cores) and the serial one have each been measured past their warm-up step, then
        the faster of the serial step and the overlapped one at its best decode share (thread
        counts never measured are extrapolated by the cost model, Amdahl's law)."""
        full, (d_half, t_half) = self.threads, self.halves
        cost, trajectories = self.cost, trajectories * self.turns  # the size: trajectory turns
        split = range(1, full) if full > 1 else (1,)  # decode shares of an overlapped step
        if not (any(cost.calibrated(GEN_BESIDE, d) for d in split) and any(cost.calibrated(TURNS, t) for t in split)
                and cost.calibrated(LAST, full)):
            return EnvWindowPlan(True, d_half, t_half, "profile_overlap")
        if not (cost.calibrated(GEN, full) and cost.calibrated(PASSES, full)):
            return EnvWindowPlan(False, full, full, "profile_serial")
        switch = 2 * (cost.switch_s or 0.0)
        serial = cost.seconds(GEN, trajectories, full) + cost.seconds(PASSES, trajectories, full)
        shares = [(d, full - d) for d in range(1, full)] or [(d_half, t_half)]
        best = min((max(cost.seconds(GEN_BESIDE, trajectories, d), cost.seconds(TURNS, trajectories, t))
                    + cost.seconds(LAST, trajectories, full) + switch, d, t) for d, t in shares)
        return EnvWindowPlan(best[0] < serial, best[1] if best[0] < serial else full,
                             best[2] if best[0] < serial else full, "plan", best[0], serial)

    def metrics(self, plan: EnvWindowPlan) -> dict[str, float]:
        """The plan's ``planner/*`` metrics and the ``cost/envs/*@<threads>`` rates it plans with
        (microseconds per trajectory turn)."""
        return {**plan.metrics(), **{k: v for k, v in self.cost.metrics().items() if k.startswith("cost/envs/")}}

    def observe(self, plan: EnvWindowPlan, trajectories: int, turns: float, seconds: dict[str, float],
                turn_window_s: float = 0.0) -> None:
        """Learn from a finished step run under ``plan``: ``trajectories`` of ``turns`` turns on
        average; ``seconds`` is its timeline's ``timing_s`` (``gen``, ``suffix_after``,
        ``old_log_prob``, ``ref``, ``reshare``: the two re-shares of an overlapped step);
        ``turn_window_s`` the turn scoring's seconds inside the rollout per DP rank (an overlapped step)."""
        full, self.turns = self.threads, max(turns, 1.0)
        trajectories = trajectories * self.turns
        if plan.overlap and "reshare" in seconds:
            self.cost.observe_switch(seconds["reshare"] / 2)
        self.cost.observe(GEN_BESIDE if plan.overlap else GEN, trajectories, plan.decode_threads, seconds.get("gen", 0.0))
        if plan.overlap:
            self.cost.observe(TURNS, trajectories, plan.train_threads, turn_window_s)
            self.cost.observe(LAST, trajectories, full, seconds.get("suffix_after", 0.0))
        else:
            self.cost.observe(PASSES, trajectories, full, seconds.get("old_log_prob", 0.0) + seconds.get("ref", 0.0))


def row_of(uid: str, position: dict[int, int], n: int) -> int:
    """The training row of trajectory ``uid`` (``<prefix>:<seed>/<g>``): seed position * G + g."""
    head, _, sample = uid.rpartition("/")
    return position[int(head.rpartition(":")[2])] * n + int(sample)


def overlapped_env_rollout(cfg: Config, workers, prompts: list[PromptSample], step: int, version: int,
                           timeline: Timeline, roles: list[str], old_rows: set[int], plan: EnvWindowPlan):
    """Trajectories (as ``runtime/envs.env_rollout``) with their rows' log-probs scored turn by turn
    inside the rollout (module docstring).

    Args:
        roles: ``actor`` (old policy) and/or ``ref``, the passes to run.
        old_rows: rows whose old-policy log-probs the step needs (the others get no ``actor`` pass).
        plan: the planner's overlapped plan (its device shares).

    Returns:
        (the trajectories, ``{role: {row: (1, R_row) float32}}``, metrics).

    Raises:
        EnvError / ValueError / StaleWeightsError: from the turn loop or the training ranks.
    """
    from rollplex_train.runtime.envs import env_seed

    seeds = [env_seed(p) for p in prompts]
    position, n, dp_size = {s: i for i, s in enumerate(seeds)}, cfg.rollout.n, workers.train.dp_size
    temperature, full = cfg.rollout.temperature, (workers.threads, workers.threads)
    calls, names, per_engine, turn = [], [], {}, defaultdict(int)  # turn: per engine, the turns started

    def send(items: list, name: str, final: bool = False) -> None:
        batches = defaultdict(list)  # (dp, roles) -> items
        for item in items:
            rows = [row_of(uid, position, n) for uid in item.uids]
            mine = tuple(r for r in roles if r != "actor" or any(row in old_rows for row in rows))
            if mine:
                batches[(position[item.seed] % dp_size, mine)].append(item)
        for (dp, mine), batch in batches.items():
            calls.append(workers.train.score_turns(dp, batch, list(mine), version, temperature, final))
            names.append(name)

    if roles:
        with timeline.span("reshare", "driver"):
            workers.share_threads(plan.decode_threads, plan.train_threads)
    try:
        with timeline.span("gen", "rollout"):
            gen_start = timeline.now()
            stream = workers.rollout.rollout_envs_stream(cfg.env, cfg.model.path, seeds, sampling_params(cfg, step),
                                                         version, f"step{step}")
            while not stream.finished:
                stream.next_future().result()
                for engine, item in stream.take():
                    if item and isinstance(item[0], TurnInput):
                        send(item, f"score(turn{turn[engine]})")
                        turn[engine] += 1
                    else:
                        per_engine[engine] = item
            gen_end = timeline.now()
        if not all(c.done() for c in calls):
            with timeline.span("turns_exposed", "train"):
                for c in calls:
                    c.result()
    finally:
        if roles:
            with timeline.span("reshare", "driver"):
                workers.share_threads(*full)
    trajectories = [t for e in sorted(per_engine) for t in per_engine[e]]
    window = len(calls)
    with timeline.span("suffix_after", "train"):
        send([TurnInput(t.env_seed, (t.uid,), t.ids, t.loss_mask.bool(), t.vision) for t in trajectories],
             "score(last responses)", final=True)
        results = [c.result() for c in calls]
    log_probs: dict[str, dict[int, torch.Tensor]] = {role: {} for role in roles}
    for r in results[window:]:
        for role, by_uid in r.log_probs.items():
            for uid, logp in by_uid.items():
                row = row_of(uid, position, n)
                start = int(trajectories[row].turns[0].input_ids.shape[0])
                log_probs[role][row] = logp[start:].unsqueeze(0)
    return trajectories, log_probs, turn_metrics(results, names, gen_start, gen_end, timeline, window, dp_size)


def turn_metrics(results: list, names: list[str], gen_start: float, gen_end: float,
                 timeline: Timeline, window: int, dp_size: int) -> dict[str, float]:
    """The calls' spans on ``timeline`` (train lane, named ``names``: ``score(turn<k>)``, the scoring of
    the context turn k decodes from, and ``score(last responses)``) and the ``envs/turn_scoring_*``
    metrics: seconds, the fraction inside the rollout's window [``gen_start``, ``gen_end``] (seconds
    from the step's start), tokens scored, calls, and ``envs/turn_window_s``: the seconds of the
    first ``window`` calls (those sent while the rollout ran) per DP rank (of ``dp_size``)."""
    seconds = hidden = 0.0
    for r, name in zip(results, names):
        start, end = r.start_time - timeline.origin, r.end_time - timeline.origin
        timeline.add(name, "train", start, end)
        seconds += end - start
        hidden += max(0.0, min(end, gen_end) - max(start, gen_start))
    return {"envs/turn_scoring_s": seconds, "envs/turn_scoring_hidden_frac": hidden / seconds if seconds > 0 else 1.0,
            "envs/turn_scoring_tokens": float(sum(r.tokens for r in results)),
            "envs/turn_scoring_calls": float(len(results)),
            "envs/turn_window_s": sum(r.seconds for r in results[:window]) / dp_size}
