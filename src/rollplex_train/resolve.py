"""Resolve a run's derived config values in one step, asking the engine registries what they can do.

Some values follow from other sections or from the chosen engines' capabilities, which the engines
declare as class attributes (``RolloutEngine.accepts_prefix_states``, ``supports_progress``,
``supports_tensor_parallel``; ``TrainEngine.exports_prefix_states``, ``supports_suffix_chunks``,
``supports_model_parallel``). :func:`resolve` sets them once, before any worker starts (the
trainer calls it), logs each change in one line, and refuses a setting the engines cannot honour.
It sits above ``config.py`` and the engine registries, so the config sections import nothing of the
engines that build from them.
"""

from __future__ import annotations

import dataclasses
import logging

from rollplex_train.algo.advantages import needs_group
from rollplex_train.config import Config
from rollplex_train.registry import MissingExtraError
from rollplex_train.rollout.base import ROLLOUT_ENGINES
from rollplex_train.training.base import TRAIN_ENGINES

log = logging.getLogger(__name__)


def _engine_class(registry, name: str):
    """The engine class registered as ``name``, or None when its optional extra is not installed
    (then nothing can be asked of it here; the trainer stops on the missing extra before Ray)."""
    try:
        return registry.get(name)
    except MissingExtraError:
        return None


def _can(engine, capability: str) -> bool:
    """``engine``'s declared capability (an engine that could not be imported is taken at its word)."""
    return True if engine is None else bool(getattr(engine, capability))


def resolve(cfg: Config) -> Config:
    """The values derived from other sections or from the chosen engines' capabilities, resolved in
    one step, each change logged:

    - ``actor.lr_decay_steps=-1`` under a cosine schedule: the run's optimizer steps after the
      warm-up (``trainer.total_steps`` x mini-batches per step x ``actor.ppo_epochs`` - warm-up; verl
      injects ``total_training_steps`` into its optimizer config the same way);
    - ``schedule.prefill_from_actor=auto``: ``false`` where the actor's prefixes cannot be handed to
      the rollout (another schedule, an engine that prefills every prompt itself, a backend whose
      states are TP shards, ``schedule.prefix_memory_gib=0``);
    - ``schedule.suffix_chunk_tokens``: 0 where the reference suffix chunks cannot run.

    Before them, each chosen engine's own ``check_config(cfg)`` (where it declares one) refuses the
    settings only it can judge; whether this machine can run it (an extra, its version) is the
    engine's ``check_available``, which the trainer asks.

    Raises:
        ValueError: ``rollout.n < 2`` under a group-baseline estimator (``grpo``, ``drgrpo``,
            ``rloo``: ``algo.advantages.needs_group``); a setting the chosen engines cannot honour (TP/PP degrees, a required prefill
            handover, an engine's own refusal), naming the keys; an unknown engine name.
    """
    a, r, sch = cfg.actor, cfg.rollout, cfg.schedule
    if r.n < 2 and needs_group(cfg.algorithm.adv_estimator):
        raise ValueError(f"rollout.n={r.n}: algorithm.adv_estimator={cfg.algorithm.adv_estimator} takes its "
                         "baseline from the other responses of a prompt, so it needs rollout.n >= 2")
    rollout, train = _engine_class(ROLLOUT_ENGINES, r.name), _engine_class(TRAIN_ENGINES, a.backend)
    if (a.tensor_parallel_size > 1 or a.pipeline_parallel_size > 1) and not _can(train, "supports_model_parallel"):
        raise ValueError(f"actor.tensor_parallel_size={a.tensor_parallel_size}, actor.pipeline_parallel_size="
                         f"{a.pipeline_parallel_size}: actor.backend={a.backend} is data parallel only "
                         "(TP/PP need actor.backend=megatron)")
    if r.tensor_parallel_size > 1 and not _can(rollout, "supports_tensor_parallel"):
        raise ValueError(f"rollout.tensor_parallel_size={r.tensor_parallel_size}: the {r.name} rollout engine "
                         "runs on one device")
    handover = (sch.name == "rollplex" and not cfg.env.name and _can(rollout, "accepts_prefix_states")
                and _can(train, "exports_prefix_states") and sch.prefix_memory_gib != 0)
    if sch.prefill_from_actor == "true" and not handover:
        raise ValueError(f"schedule.prefill_from_actor=true needs schedule.name=rollplex, a rollout engine that "
                         f"accepts prefix states (builtin), a backend that exports whole ones (torch) and a "
                         f"schedule.prefix_memory_gib above 0 (got {sch.name}, {r.name}, {a.backend}, "
                         f"{sch.prefix_memory_gib})")
    chunks = (sch.name == "rollplex" and _can(rollout, "supports_progress") and _can(train, "supports_suffix_chunks")
              and cfg.model.shared_prefix and cfg.algorithm.needs_reference and r.ignore_eos)
    for engine in (rollout, train):  # what only the engine can judge (SGLang's GPUs, the builtin's TP devices)
        check = getattr(engine, "check_config", None)
        if check is not None:
            check(cfg)
    changes = {}
    if a.lr_scheduler == "cosine" and a.lr_decay_steps == -1:
        mini = a.ppo_mini_batch_size
        per_step = 1 if mini <= 0 else cfg.data.rollout_batch_size // mini
        changes[("actor", "lr_decay_steps")] = max(1, cfg.trainer.total_steps * per_step * a.ppo_epochs
                                                   - max(a.lr_warmup_steps, 0))
    if sch.prefill_from_actor == "auto" and not handover:
        changes[("schedule", "prefill_from_actor")] = "false"
    if sch.suffix_chunk_tokens > 0 and not chunks:
        changes[("schedule", "suffix_chunk_tokens")] = 0
    if not changes:
        return cfg
    log.info("config: resolved %s", ", ".join(f"{sec}.{key}={getattr(getattr(cfg, sec), key)!r} -> {value!r}"
                                              for (sec, key), value in changes.items()))
    sections = {}
    for (sec, key), value in changes.items():
        sections[sec] = dataclasses.replace(sections.get(sec, getattr(cfg, sec)), **{key: value})
    return dataclasses.replace(cfg, **sections)
