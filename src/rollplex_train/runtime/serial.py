"""The ``serial`` schedule: verl's phases one after another on the whole device budget.

rollout (decode) -> reward -> old-policy log-probs -> reference log-probs -> advantages ->
actor update -> weight sync. Each phase is timed under verl's metric names (``timing_s/*``).

Weight sync (``timing_s/update_weights``): with ``sharing.enabled`` the rollout engine's parameters
are the trainer's own tensors, mapped once from IPC handles (``sharing/embedded.py``); a sync is the
trainer's ``publish_weights`` (rebuilds refreshed, version counter bumped) followed by the rollout's
``sync_shared_weights`` (counter checked, version adopted), one driver round trip, no weights
moved. With ``sharing.enabled=false`` the state dict is pickled through Ray and copied in.
"""

from __future__ import annotations

from typing import Optional

import torch

from rollplex_train.algo.rewards import RewardManager
from rollplex_train.config import Config
from rollplex_train.data.types import PromptSample
from rollplex_train.rollout.base import SamplingParams
from rollplex_train.runtime import batching
from rollplex_train.runtime.planner import place_groups
from rollplex_train.runtime.old_policy import actor_forward_is_old_policy, old_pass_groups
from rollplex_train.runtime.timeline import Timeline
from rollplex_train.tracking.timing import compute_throughput, timer, timing_metrics


def sampling_params(cfg: Config, step: int, validate: bool = False) -> SamplingParams:
    """The step's sampling parameters; the seed depends only on (rollout.seed, step), so a resumed
    run samples exactly what an uninterrupted one would."""
    r = cfg.rollout
    return SamplingParams(
        n=1 if validate else r.n,
        temperature=r.val_temperature if validate else r.temperature,
        top_p=1.0 if validate else r.top_p,
        top_k=-1 if validate else r.top_k,
        max_new_tokens=r.max_new_tokens,
        stop=tuple(r.stop),
        ignore_eos=r.ignore_eos,
        seed=r.seed + step,
    )


class SerialSchedule:
    """Drives one training step through the worker group, phase after phase.

    Args:
        cfg: the run's config. workers: the rollout and train groups (``cluster.launch.Workers``).
        reward: the reward manager (runs in the driver). pad_id: the tokenizer's pad token id.
    """

    def __init__(self, cfg: Config, workers, reward: RewardManager, pad_id: int):
        self.cfg, self.workers, self.reward, self.pad_id = cfg, workers, reward, pad_id
        self.weights_version = 0
        self.timeline = Timeline()  # the spans of the last step (Chrome trace / Gantt)
        self.sharing_metrics = {"sharing/shared_bytes_frac": 0.0}
        self.sync_metrics: dict[str, float] = {}
        self.imbalance: dict[str, float] = {}  # timing_s/<phase>_imbalance of the last step (DP > 1)
        self.old_from_actor = actor_forward_is_old_policy(cfg)  # the first mini-batch skips the old pass
        if cfg.sharing.enabled:
            self.share_weights()

    def share_weights(self) -> None:
        """Map the trainer's weights into the rollout engine, once: the train worker moves them to
        shared memory and exports handles, the rollout worker points its parameters at them."""
        exports = self.workers.train.export_shared_weights().result()  # per rank
        mapped = self.workers.rollout.map_shared_weights([e["payload"] for e in exports])
        first = [exports[self.workers.layout.rollout_devices(e)[0]] for e in range(len(mapped))]
        for got, export in zip(mapped, first):
            if got != export["view_bytes"] + export["rebuild_bytes"]:
                raise RuntimeError(f"a rollout engine mapped {got} bytes of shared weights, the trainer shared "
                                   f"{export['view_bytes']} + {export['rebuild_bytes']} rebuilt")
        self.sharing_metrics = {"sharing/shared_bytes_frac":
                                sum(e["view_bytes"] for e in first) / max(1, sum(e["rollout_bytes"] for e in first))}

    def sync_weights(self, version: int) -> None:
        """Give the rollout engine the actor's weights as ``version``: publish the shared ones
        (``sharing.enabled``) or push a pickled state dict."""
        w = self.workers
        if self.cfg.sharing.enabled:
            self.sync_metrics = w.rollout.sync_shared_weights(version, w.train.publish_weights(version).result())
        else:
            self.sync_metrics = w.rollout.update_weights(w.train.rollout_weights().result(), version)
        self.weights_version = version

    def place(self, prompts: list[PromptSample]):
        """The step's prompts placed on the DP ranks (``planner.place_groups``) and put in the
        object store once (``cluster.groups.StepPrompts``)."""
        ranks = place_groups([p.prompt_length for p in prompts], self.groups_per_mini_batch(len(prompts)),
                             self.workers.train.dp_size)
        return self.workers.train.place(prompts, ranks)

    def groups_per_mini_batch(self, num_prompts: int) -> int:
        mini = self.cfg.actor.ppo_mini_batch_size
        return mini if mini > 0 else num_prompts

    def rollout_phase(self, step_prompts, step: int, t: dict[str, float], prefixes: Optional[dict] = None):
        """Decode the step's responses (timed as ``gen``); the serial schedule does nothing else
        meanwhile. ``prefixes``: KV caches the engines decode from instead of prefilling
        (``RolloutGroup.generate``). Returns (responses, extra metrics)."""
        with self.timeline.span("gen", "rollout", t):
            responses = self.workers.rollout.generate(step_prompts, sampling_params(self.cfg, step),
                                                      self.weights_version, prefixes).result()
        return responses, {}

    def state_dict(self) -> dict:
        """Schedule state worth keeping across a resume (none for the serial phases)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (from a checkpoint's trainer_state.json)."""

    def log_probs(self, batch, role: str, temperature: float):
        """(B, R) float32 log-probs of every response under ``role`` (``actor``: the old policy,
        ``ref``: the reference), computed by the training ranks on their DP parts."""
        parts = self.workers.train.parts(batch, self.step_prompts_for(batch), self.groups_per_mini_batch(len(batch.prompts)))
        pending = self.workers.train.compute_log_probs(parts, role, temperature, batch.num_responses)
        out = pending.result()
        self.imbalance[f"timing_s/{'old_log_prob' if role == 'actor' else 'ref'}_imbalance"] = pending.imbalance()
        return out

    def step_prompts_for(self, batch):
        """The step placement of ``batch``'s prompts (the whole step, or a sub-batch of groups:
        placed afresh)."""
        if batch.prompts is self.step_prompts.prompts:
            return self.step_prompts
        uid_rank = {p.uid: r for p, r in zip(self.step_prompts.prompts, self.step_prompts.rank_of_group)}
        return self.workers.train.place(batch.prompts, [uid_rank[p.uid] for p in batch.prompts])

    def old_log_prob_phase(self, batch, temperature: float, t: dict[str, float]) -> None:
        """Old-policy log-probs of the groups that need the separate pass (all, or those outside the
        first mini-batch when it reuses the actor's forward: ``runtime/old_policy.py``)."""
        batch.old_logprobs_from_actor = self.old_from_actor
        groups = old_pass_groups(self.cfg, len(batch.prompts), self.old_from_actor)
        if not groups:
            t["old_log_prob"] = 0.0  # the phase ran inside the update (verl's timing key kept: 0 s)
            return
        with self.timeline.span("old_log_prob", "train", t):
            if len(groups) == len(batch.prompts):
                batch.old_logprobs = self.log_probs(batch, "actor", temperature)
                return
            old = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
            logp = self.log_probs(batch.select_groups(groups), "actor", temperature)
            old[batching.group_rows(batch, groups), : logp.shape[1]] = logp
            batch.old_logprobs = old

    def run_step(self, prompts: list[PromptSample], step: int) -> dict[str, float]:
        """One synchronous on-policy step; returns the step's metrics."""
        cfg, w = self.cfg, self.workers
        temp = cfg.rollout.temperature
        t: dict[str, float] = {}
        self.timeline = tl = Timeline()
        self.imbalance: dict[str, float] = {}
        offload = ("optimizer",) if cfg.memory.offload_optimizer else ()
        with timer("step", t):
            if offload:  # queued before any window task: the states leave the device as decode starts
                offloaded = w.train.offload_states(offload)
            self.step_prompts = self.place(prompts)
            responses, window_metrics = self.rollout_phase(self.step_prompts, step, t)
            batch = batching.to_train_batch(prompts, responses, self.pad_id)
            with tl.span("reward", "driver", t):
                scores, metrics = batching.score_responses(self.reward, batch, responses)
            self.last_rollout = (batch, responses, scores)  # for trainer.rollout_data_dir
            metrics.update(window_metrics)
            self.old_log_prob_phase(batch, temp, t)
            if cfg.algorithm.needs_reference:
                with tl.span("ref", "train", t):
                    batch.ref_logprobs = self.log_probs(batch, "ref", temp)
            with tl.span("adv", "driver", t):
                metrics.update(batching.add_advantages(cfg, batch, scores))
            if offload:
                with tl.span("prefetch", "train", t):
                    metrics["memory/offloaded_bytes"] = float(offloaded.result())
                    metrics["memory/prefetched_bytes"] = float(w.train.prefetch_states(offload).result())
            with tl.span("update_actor", "train", t):
                parts = w.train.parts(batch, self.step_prompts, self.groups_per_mini_batch(len(prompts)))
                pending = w.train.update_actor(parts, temp)
                metrics.update(pending.result())
                self.imbalance["timing_s/update_actor_imbalance"] = pending.imbalance()
            with tl.span("update_weights", "rollout", t):
                self.sync_weights(self.weights_version + 1)
        metrics.update(batching.batch_metrics(batch, responses, cfg.rollout.max_new_tokens))
        metrics.update(timing_metrics(t))
        if self.workers.train.dp_size > 1:  # slowest DP rank over the mean, per phase
            metrics.update(self.imbalance)
        metrics["perf/total_num_tokens"] = float(batching.num_tokens(batch))
        metrics["perf/throughput"] = compute_throughput(batching.num_tokens(batch), t["step"],
                                                        num_devices=self.workers.layout.world_size)
        metrics["actor/weights_version"] = float(self.weights_version)
        metrics.update(self.sharing_metrics)
        metrics.update(self.sync_metrics)
        return metrics

    def generate_val(self, prompts: list[PromptSample], step: int):
        """Greedy (``rollout.val_temperature``) single responses for validation."""
        params = sampling_params(self.cfg, step, validate=True)
        return self.workers.rollout.generate(self.place(prompts), params, self.weights_version).result()
