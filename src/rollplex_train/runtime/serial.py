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

import ray
import torch

from rollplex_train.algo.rewards import RewardManager
from rollplex_train.cluster.ray_cluster import WorkerGroup
from rollplex_train.config import Config
from rollplex_train.data.types import PromptSample
from rollplex_train.rollout.base import SamplingParams
from rollplex_train.runtime import batching
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
        cfg: the run's config. workers: the colocated rollout + train workers.
        reward: the reward manager (runs in the driver). pad_id: the tokenizer's pad token id.
    """

    def __init__(self, cfg: Config, workers: WorkerGroup, reward: RewardManager, pad_id: int):
        self.cfg, self.workers, self.reward, self.pad_id = cfg, workers, reward, pad_id
        self.weights_version = 0
        self.timeline = Timeline()  # the spans of the last step (Chrome trace / Gantt)
        self.sharing_metrics = {"sharing/shared_bytes_frac": 0.0}
        self.sync_metrics: dict[str, float] = {}
        self.old_from_actor = actor_forward_is_old_policy(cfg)  # the first mini-batch skips the old pass
        if cfg.sharing.enabled:
            self.share_weights()

    def share_weights(self) -> None:
        """Map the trainer's weights into the rollout engine, once: the train worker moves them to
        shared memory and exports handles, the rollout worker points its parameters at them."""
        export = ray.get(self.workers.train.export_shared_weights.remote())
        mapped = ray.get(self.workers.rollout.map_shared_weights.remote(export["payload"]))
        if mapped != export["view_bytes"] + export["rebuild_bytes"]:
            raise RuntimeError(f"the rollout mapped {mapped} bytes of shared weights, the trainer shared "
                               f"{export['view_bytes']} + {export['rebuild_bytes']} rebuilt")
        self.sharing_metrics = {"sharing/shared_bytes_frac": export["view_bytes"] / max(1, export["rollout_bytes"])}

    def sync_weights(self, version: int) -> None:
        """Give the rollout engine the actor's weights as ``version``: publish the shared ones
        (``sharing.enabled``) or push a pickled state dict."""
        w = self.workers
        if self.cfg.sharing.enabled:
            published = w.train.publish_weights.remote(version)  # resolved by Ray before the rollout call
            self.sync_metrics = ray.get(w.rollout.sync_shared_weights.remote(version, published))
        else:
            self.sync_metrics = ray.get(w.rollout.update_weights.remote(w.train.rollout_weights.remote(), version))
        self.weights_version = version

    def rollout_phase(self, prompts: list[PromptSample], step: int, t: dict[str, float]):
        """Decode the step's responses (timed as ``gen``); the serial schedule does nothing else
        meanwhile. Returns (responses, extra metrics)."""
        with self.timeline.span("gen", "rollout", t):
            responses = ray.get(self.workers.rollout.generate.remote(
                prompts, sampling_params(self.cfg, step), self.weights_version))
        return responses, {}

    def state_dict(self) -> dict:
        """Schedule state worth keeping across a resume (none for the serial phases)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (from a checkpoint's trainer_state.json)."""

    def log_probs(self, batch, role: str, temperature: float):
        """(B, R) float32 log-probs of every response under ``role`` (``actor``: the old policy,
        ``ref``: the reference), computed by the training worker."""
        return ray.get(self.workers.train.compute_log_probs.remote(batch, role, temperature))[0]

    def old_log_prob_phase(self, batch, temperature: float, t: dict[str, float]) -> None:
        """Old-policy log-probs of the groups that need the separate pass (all, or those outside the
        first mini-batch when it reuses the actor's forward: ``runtime/old_policy.py``)."""
        batch.old_logprobs_from_actor = self.old_from_actor
        groups = old_pass_groups(self.cfg, len(batch.prompts), self.old_from_actor)
        if not groups:
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
        offload = ("optimizer",) if cfg.memory.offload_optimizer else ()
        with timer("step", t):
            if offload:  # queued before any window task: the states leave the device as decode starts
                offloaded = w.train.offload_states.remote(offload)
            responses, window_metrics = self.rollout_phase(prompts, step, t)
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
                    metrics["memory/offloaded_bytes"] = float(ray.get(offloaded))
                    metrics["memory/prefetched_bytes"] = float(ray.get(w.train.prefetch_states.remote(offload)))
            with tl.span("update_actor", "train", t):
                metrics.update(ray.get(w.train.update_actor.remote(batch, temp)))
            with tl.span("update_weights", "rollout", t):
                self.sync_weights(self.weights_version + 1)
        metrics.update(batching.batch_metrics(batch, responses, cfg.rollout.max_new_tokens))
        metrics.update(timing_metrics(t))
        metrics["perf/total_num_tokens"] = float(batching.num_tokens(batch))
        metrics["perf/throughput"] = compute_throughput(batching.num_tokens(batch), t["step"], num_devices=1)
        metrics["actor/weights_version"] = float(self.weights_version)
        metrics.update(self.sharing_metrics)
        metrics.update(self.sync_metrics)
        return metrics

    def generate_val(self, prompts: list[PromptSample], step: int):
        """Greedy (``rollout.val_temperature``) single responses for validation."""
        params = sampling_params(self.cfg, step, validate=True)
        return ray.get(self.workers.rollout.generate.remote(prompts, params, self.weights_version))
