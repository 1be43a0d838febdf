"""The ``rollplex`` schedule: the step's prefix tasks run inside the rollout's decode window.

While the rollout worker decodes, the training worker encodes the prefixes that do not depend on
the responses — old-policy and reference KV caches for every prompt, and the actor prefix (with its
autograd graph) for the prompts of the first PPO mini-batch — under the same weights version as the
rollout (synchronous on-policy: both sides check it). The device is shared by core sets: during the
window the decoder and the prefix encoder each get half of the worker threads, afterwards the
training worker gets them all. The phases after decode are the serial ones, now running only the
suffixes against the stored prefixes.
"""

from __future__ import annotations

import ray

from rollplex_train.data.types import PromptSample
from rollplex_train.runtime.serial import SerialSchedule, sampling_params


class RollplexSchedule(SerialSchedule):
    """Serial phases, with prefix tasks moved into the decode window."""

    def rollout_phase(self, prompts: list[PromptSample], step: int, t: dict[str, float]):
        cfg, w = self.cfg, self.workers
        mini = cfg.actor.ppo_mini_batch_size if cfg.actor.ppo_mini_batch_size > 0 else len(prompts)
        roles = ["old"] + (["ref"] if cfg.algorithm.needs_reference else [])
        tl = self.timeline
        w.share_threads(*w.halves())  # (decode, prefix) threads inside the window
        with tl.span("gen", "rollout", t):
            start = tl.now()
            generated = w.rollout.generate.remote(prompts, sampling_params(cfg, step), self.weights_version)
            prefix_tasks = [
                w.train.precompute_prefixes.remote(prompts, roles, self.weights_version),
                w.train.precompute_prefixes.remote(prompts[:mini], ["actor"], self.weights_version),
            ]
            responses = ray.get(generated)
            decode_s = tl.now() - start
        with tl.span("prefix_exposed", "train", t):  # prefix work still running after decode ended
            results = ray.get(prefix_tasks)
        w.share_threads(w.threads, w.threads)
        offset = start
        for name, r in zip(("prefix(old,ref)", "prefix(actor)"), results):  # worker-side durations
            tl.add(name, "train", offset, offset + r["prefix/seconds"])
            offset += r["prefix/seconds"]
        prefix_s = sum(r["prefix/seconds"] for r in results)
        hidden_s = max(0.0, prefix_s - t["prefix_exposed"])
        metrics = {
            "rollplex/prefix_s": prefix_s,
            "rollplex/prefix_hidden_frac": hidden_s / prefix_s if prefix_s > 0 else 1.0,
            "rollplex/decode_idle_frac": max(0.0, decode_s - prefix_s) / decode_s if decode_s > 0 else 0.0,
            "prefix/bytes_held": results[-1]["prefix/bytes_held"],
        }
        return responses, metrics
