"""The ``rollplex`` schedule's environment rollout: each turn's finished context scored while it decodes.

In a trajectory under ``env.context=full`` everything before the turn being decoded (the system
message, the observations, the earlier responses) is response-independent context for the rest of
the trajectory. While turn k decodes and the environments step, the training ranks run the
old-policy (role ``actor``) and reference teacher-forced scoring of that context against each
trajectory's cached prefix, its new frames through the vision tower
(``TrainWorker.score_turns``, ``models/turn_scoring.py``); after the last turn only each
trajectory's last response remains (``suffix_after``, on the whole device). The log-probs go to
the step as ``RolloutResult.log_probs``, so its log-prob phases compute nothing more for these rows.

Per step:

1. give the rollout and train workers half the cores each (``Workers.halves``);
2. stream the turn loop (``RolloutGroup.rollout_envs_stream``); each turn's ``TurnInput`` list is
   sent at once to the DP rank of its seed (seed position mod DP size), a rank's calls run in
   order (turn 0 of a seed is one pass its G trajectories share);
3. when the rollout ends: wait for the calls still running (``turns_exposed``), give the train
   workers the whole device and score the last responses (``suffix_after``).

Metrics: ``envs/turn_scoring_s`` (the calls' seconds, worker side), ``envs/turn_scoring_hidden_frac``
(the part inside the rollout's window), ``envs/turn_scoring_tokens``, ``envs/turn_scoring_calls``.
Under ``env.context=window:<k>`` (k >= ``env.max_turns``: ``config`` refuses less) the context
scored is still the whole trajectory, the training row.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from rollplex_train.config import Config
from rollplex_train.data.types import PromptSample
from rollplex_train.rollout.multiturn import TurnInput
from rollplex_train.runtime.serial import sampling_params
from rollplex_train.runtime.timeline import Timeline


def row_of(uid: str, position: dict[int, int], n: int) -> int:
    """The training row of trajectory ``uid`` (``<prefix>:<seed>/<g>``): seed position * G + g."""
    head, _, sample = uid.rpartition("/")
    return position[int(head.rpartition(":")[2])] * n + int(sample)


def overlapped_env_rollout(cfg: Config, workers, prompts: list[PromptSample], step: int, version: int,
                           timeline: Timeline, roles: list[str], old_rows: set[int]):
    """Trajectories (as ``runtime/envs.env_rollout``) with their rows' log-probs scored turn by turn
    inside the rollout (module docstring).

    Args:
        roles: ``actor`` (old policy) and/or ``ref``, the passes to run.
        old_rows: rows whose old-policy log-probs the step needs (the others get no ``actor`` pass).

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
        workers.share_threads(*workers.halves())
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
    return trajectories, log_probs, turn_metrics(results, names, gen_start, gen_end, timeline)


def turn_metrics(results: list, names: list[str], gen_start: float, gen_end: float,
                 timeline: Timeline) -> dict[str, float]:
    """The calls' spans on ``timeline`` (train lane, named ``names``: ``score(turn<k>)``, the scoring of
    the context turn k decodes from, and ``score(last responses)``) and the ``envs/turn_scoring_*``
    metrics: seconds, the fraction inside the rollout's window [``gen_start``, ``gen_end``] (seconds
    from the step's start), tokens scored, calls."""
    seconds = hidden = 0.0
    for r, name in zip(results, names):
        start, end = r.start_time - timeline.origin, r.end_time - timeline.origin
        timeline.add(name, "train", start, end)
        seconds += end - start
        hidden += max(0.0, min(end, gen_end) - max(start, gen_start))
    return {"envs/turn_scoring_s": seconds, "envs/turn_scoring_hidden_frac": hidden / seconds if seconds > 0 else 1.0,
            "envs/turn_scoring_tokens": float(sum(r.tokens for r in results)),
            "envs/turn_scoring_calls": float(len(results))}
