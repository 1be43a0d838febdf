"""One synchronous on-policy step: one function, its phases in one visible order.

    place -> rollout (the decode strategy) -> reward -> old-policy log-probs -> reference log-probs
          -> advantages -> [prefetch] -> actor update -> weight sync

:func:`run_step` is the step (slime's ``train.py`` step and torchtitan's ``train_step`` are the
models). Its per-step state is its local values: the placed prompts, the strategy's
:class:`RolloutResult`, the batch, the timeline. Each phase returns its result to the next as an
argument; the batch takes the phases' results in one place (``dataclasses.replace``). The
schedules differ only in the decode strategy the step calls (``runtime/__init__.make_run``): one
generate call (``serial``, and ``disaggregated`` on half the cores: ``runtime/serial.py``) or the
planner's decode window (``rollplex``: ``runtime/rollplex.py``). A strategy returns the responses,
the log-probs it already computed per role and group, and its metrics; the log-prob phases compute
only the groups missing there. A multi-turn environment rollout is one more strategy returning the
same :class:`RolloutResult`.

Weight sync (``timing_s/update_weights``): with ``sharing.enabled`` the rollout engine's parameters
are the trainer's own tensors, mapped once from IPC handles (``sharing/embedded.py``); a sync is the
trainer's ``publish_weights`` (rebuilds refreshed, version counter bumped) followed by the rollout's
``sync_shared_weights`` (counter checked, version adopted), one driver round trip, no weights
moved. With ``sharing.enabled=false`` the state dict is pickled through Ray and copied in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from rollplex_train.algo.rewards import RewardManager
from rollplex_train.config import Config
from rollplex_train.data.types import PromptSample, Response, TrainBatch
from rollplex_train.memory.executor import PhaseResidency, enter_phase
from rollplex_train.runtime import batching
from rollplex_train.runtime.envs import env_rollout, turn_logprob_mismatch
from rollplex_train.runtime.old_policy import groups_per_mini_batch, old_pass_groups
from rollplex_train.runtime.planner import place_groups
from rollplex_train.runtime.protocol import RolloutResult
from rollplex_train.runtime.serial import sampling_params
from rollplex_train.runtime.timeline import Timeline
from rollplex_train.tracking.timing import compute_throughput, timer, timing_metrics


class DecodeStrategy(Protocol):
    """How the step's responses are decoded (``runtime/serial.py``, ``runtime/rollplex.py``)."""

    def rollout(self, placed, step: int, version: int, timeline: Timeline) -> RolloutResult:
        """Decode the step's responses under weights ``version``; spans go on ``timeline``."""

    def observe(self, rollout: RolloutResult, batch: TrainBatch, placed, timeline: Timeline) -> None:
        """Learn from the finished phases of the step (a planner's cost model); may do nothing."""

    def state_dict(self) -> dict:
        """What is worth keeping across a resume (a checkpoint's ``trainer_state.json``)."""

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (``{}``: a checkpoint of another schedule)."""


@dataclass
class StepResult:
    """What one step leaves: its ``metrics``, its ``timeline`` (Chrome trace / Gantt), and the
    rollout as trained on (``batch``, ``responses``, (N,) float32 ``scores``) for dumps."""

    metrics: dict[str, float]
    timeline: Timeline
    batch: TrainBatch
    responses: list[Response]
    scores: torch.Tensor


class Run:
    """What every step of a run uses: config, worker groups, reward, the decode strategy and the
    weights version the rollout holds.

    Args:
        cfg: the run's config. workers: ``cluster.launch.Workers``. reward: the driver's reward
            manager. pad_id: the tokenizer's pad token id. decode: the schedule's strategy.
        old_from_actor: the first mini-batch takes its old-policy log-probs from the actor's own
            forward (``runtime/old_policy.reuse_actor_forward``: only when nothing reads them before
            the update).
    """

    def __init__(self, cfg: Config, workers, reward: RewardManager, pad_id: int, decode: DecodeStrategy,
                 old_from_actor: bool):
        self.cfg, self.workers, self.reward, self.pad_id = cfg, workers, reward, pad_id
        self.decode, self.old_from_actor = decode, old_from_actor
        self.weights_version = 0
        self.residency = PhaseResidency.from_config(cfg)  # the memory plan the phases execute (memory/executor.py)
        self.sharing_metrics = share_weights(workers) if cfg.sharing.enabled else {"sharing/shared_bytes_frac": 0.0}

    def place(self, prompts: list[PromptSample]):
        """The prompts placed on the DP ranks (``planner.place_groups``) and put in the object store
        once (``cluster.groups.StepPrompts``, the one translation to the ranks' own indices)."""
        mini = groups_per_mini_batch(self.cfg, len(prompts))
        ranks = place_groups([p.prompt_length for p in prompts], mini, self.workers.train.dp_size)
        return self.workers.train.place(prompts, ranks, mini)

    def sync_weights(self, version: int) -> dict[str, float]:
        """Give the rollout engines the actor's weights as ``version``: publish the shared ones
        (``sharing.enabled``) or push a pickled state dict; returns the sync's metrics."""
        w = self.workers
        if self.cfg.sharing.enabled:
            metrics = w.rollout.sync_shared_weights(version, w.train.publish_weights(version).result())
        else:
            metrics = w.rollout.update_weights(w.train.rollout_weights().result(), version)
        self.weights_version = version
        return metrics

    def generate_val(self, prompts: list[PromptSample], step: int) -> list[Response]:
        """Greedy (``rollout.val_temperature``) single responses for validation."""
        params = sampling_params(self.cfg, step, validate=True)
        return self.workers.rollout.generate(self.place(prompts), params, self.weights_version).result()

    def state_dict(self) -> dict:
        return self.decode.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.decode.load_state_dict(state)


def share_weights(workers) -> dict[str, float]:
    """Map the trainer's weights into the rollout engines, once: each train rank moves them to
    shared memory and exports handles, each engine points its parameters at its first device's (an
    engine with one worker over its TP group, SGLang: every device's).

    Returns:
        ``sharing/shared_bytes_frac``: the rollout's bytes that are views of the trainer's.

    Raises:
        RuntimeError: an engine mapped other bytes than its train rank shared.
    """
    exports = workers.train.export_shared_weights().result()  # per rank
    mapped = workers.rollout.map_shared_weights([e.payload for e in exports])
    used = []  # the exports the engines mapped
    for e, got in enumerate(mapped):
        mine = [exports[d] for d in workers.rollout.mapped_devices(e)]
        views, rebuilt = sum(x.view_bytes for x in mine), sum(x.rebuild_bytes for x in mine)
        if got != views + rebuilt:
            raise RuntimeError(f"a rollout engine mapped {got} bytes of shared weights, the trainer shared "
                               f"{views} + {rebuilt} rebuilt")
        used += mine
    return {"sharing/shared_bytes_frac": sum(e.view_bytes for e in used) / max(1, sum(e.rollout_bytes for e in used))}


def log_prob_phase(run: Run, placed, batch: TrainBatch, role: str, groups: list[int],
                   scored: dict[int, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """(N, R) float32 log-probs under ``role`` (``actor``: the old policy, ``ref``: the reference)
    of the rows of ``groups`` (global prompt indices): those the rollout scored already (``scored``:
    index -> (n, R_g)) as they are, the others computed now by the DP ranks owning them; the other
    rows stay 0. Also returns ``timing_s/<phase>_imbalance`` (slowest rank over the mean) when the
    ranks ran."""
    missing = [g for g in groups if g not in scored]
    out, imbalance = torch.zeros(batch.response_mask.shape, dtype=torch.float32), {}
    if missing:
        pending = run.workers.train.log_probs(batch, placed, missing, role, run.cfg.rollout.temperature)
        logp = pending.result()
        out[:, : logp.shape[1]] = logp
        imbalance[f"timing_s/{'old_log_prob' if role == 'actor' else 'ref'}_imbalance"] = pending.imbalance()
    for g, logp in scored.items():
        out[batch.rows_of([g]), : logp.shape[1]] = logp
    return out, imbalance


def run_step(run: Run, prompts: list[PromptSample], step: int) -> StepResult:
    """One synchronous on-policy step over ``prompts`` (global prompt index = position in the list).

    Returns:
        the step's metrics (verl's names: ``timing_s/*``, ``critic/*``, ``actor/*``, ...), timeline
        and rollout.
    """
    cfg, w, tl = run.cfg, run.workers, Timeline()
    version, num = run.weights_version, len(prompts)
    imbalance: dict[str, float] = {}
    memory: dict[str, float] = {}  # memory/<phase>/<group>_gib as the engines measure them (memory/executor.py)
    envs, groups, env_plan = None, None, None
    with timer("step", tl.seconds):
        enter_phase(w, run.residency, "rollout_decode", memory)  # what decode does not use leaves the device
        if cfg.env.name:  # trajectories: one row (and prompt) each, placed once they exist (runtime/envs.py)
            roles, rows = None, frozenset()
            if cfg.schedule.name == "rollplex":  # each turn's context scored while it decodes (runtime/env_window.py)
                rows = frozenset(old_pass_groups(cfg, num * cfg.rollout.n, run.old_from_actor))
                roles = (["actor"] if rows else []) + (["ref"] if cfg.algorithm.needs_reference else [])
                env_plan = run.decode.env_window.plan(num * cfg.rollout.n) if roles else None
                roles = roles if env_plan is not None and env_plan.overlap else None
            envs = env_rollout(cfg, w, prompts, step, version, tl, roles, rows, env_plan)
            prompts, num, groups = envs.prompts, len(envs.prompts), envs.seed_index
            placed = run.place(prompts)
            rollout = RolloutResult(envs.responses, envs.log_probs, metrics=envs.metrics)
        else:
            placed = run.place(prompts)
            rollout = run.decode.rollout(placed, step, version, tl)
        batch = TrainBatch.from_responses(prompts, rollout.responses, run.pad_id)
        if envs is not None:  # the environment's return is the score
            scores, failed, metrics = envs.scores, None, {}
        else:
            with tl.span("reward", "driver"):
                scores, failed, metrics = batching.score_responses(run.reward, batch, rollout.responses)
        metrics.update(rollout.metrics)
        enter_phase(w, run.residency, "old_log_prob", memory)
        old = None
        old_groups = old_pass_groups(cfg, num, run.old_from_actor)
        tl.seconds["old_log_prob"] = 0.0  # 0 s when the phase runs inside the update (verl's key kept)
        if old_groups:
            with tl.span("old_log_prob", "train"):
                old, more = log_prob_phase(run, placed, batch, "actor", old_groups, rollout.log_probs.get("actor", {}))
                imbalance.update(more)
        enter_phase(w, run.residency, "ref_log_prob", memory)
        ref = None
        if cfg.algorithm.needs_reference:
            with tl.span("ref", "train"):
                ref, more = log_prob_phase(run, placed, batch, "ref", list(range(num)), rollout.log_probs.get("ref", {}))
                imbalance.update(more)
        if envs is not None and old is not None:
            metrics.update(turn_logprob_mismatch(envs.trajectories, old, old_groups))
        with tl.span("adv", "driver"):
            advantages, more = batching.step_advantages(cfg, batch, scores, failed, old, ref, groups)
            metrics.update(more)
        batch = dataclasses.replace(batch, reward_failed=failed, old_logprobs=old, ref_logprobs=ref,
                                    advantages=advantages)
        with tl.span("prefetch", "train"):
            enter_phase(w, run.residency, "actor_update", memory)
        with tl.span("update_actor", "train"):
            pending = w.train.update_actor(batch, placed, cfg.rollout.temperature, run.old_from_actor)
            metrics.update(pending.result())
            imbalance["timing_s/update_actor_imbalance"] = pending.imbalance()
        enter_phase(w, run.residency, "weight_sync", memory)
        with tl.span("update_weights", "rollout"):
            sync_metrics = run.sync_weights(version + 1)
    metrics.update(memory)
    if envs is None:
        run.decode.observe(rollout, batch, placed, tl)
    elif env_plan is not None:  # the environment step's plan and what it cost
        run.decode.env_window.observe(env_plan, len(envs.trajectories), envs.metrics["env/turns/mean"], tl.seconds,
                                      envs.metrics.get("envs/turn_window_s", 0.0))
        metrics.update(run.decode.env_window.metrics(env_plan))
    computed = batch.rows_of(old_groups) if old_groups else None  # rows whose old log-probs were computed
    return StepResult(report(run, batch, rollout.responses, tl, metrics, imbalance, sync_metrics, computed), tl,
                      batch, rollout.responses, scores)


def report(run: Run, batch: TrainBatch, responses: list[Response], tl: Timeline, metrics: dict[str, float],
           imbalance: dict[str, float], sync_metrics: dict[str, float],
           old_rows: torch.Tensor | None = None) -> dict[str, float]:
    """The step's metrics: the phases' own, then the batch's (``response_length/*`` ...; the
    log-prob mismatch over ``old_rows``, the rows whose old log-probs were computed), the timings,
    per-phase DP imbalance (DP > 1), throughput, the weights version and the sharing's."""
    metrics.update(batching.batch_metrics(batch, responses, run.cfg.rollout.max_new_tokens, old_rows))
    metrics.update(timing_metrics(tl.seconds))
    if run.workers.train.dp_size > 1:  # slowest DP rank over the mean, per phase
        metrics.update(imbalance)
    tokens = batching.num_tokens(batch)
    metrics["perf/total_num_tokens"] = float(tokens)
    metrics["perf/throughput"] = compute_throughput(tokens, tl.seconds["step"], num_devices=run.workers.layout.world_size)
    metrics["actor/weights_version"] = float(run.weights_version)
    metrics.update(run.sharing_metrics)
    metrics.update(sync_metrics)
    return metrics
