"""The backend-neutral PPO loop: one training rank's actor updates over a ``ModelBackend``.

Loss per micro-batch (GRPO, Shao et al. 2024 eq. 3, with verl's options):
    loss = pg_loss + [use_kl_loss] kl_coef * KL(actor || ref) - entropy_coeff * entropy
where each term is aggregated with ``actor.loss_agg_mode`` over the *mini-batch* token/sequence
counts (over all DP ranks), so that the sum of micro-batch losses equals the mini-batch loss exactly
(no dependence on how responses are split into micro-batches or ranks). The loop owns the
mini-batches, micro-batches, metrics, the prefix store (``training/log_probs.py``), the
learning-rate schedule, the weights versions and the sharing bookkeeping; the backend
(``training/backend.py``: torch or Megatron) runs the model, sums and clips the gradients and
steps its optimizer.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Optional

import torch

from rollplex_train.algo.losses import agg_loss, kl_loss, policy_loss
from rollplex_train.config import ActorConfig, AlgorithmConfig, ModelConfig
from rollplex_train.data.types import TrainBatch
from rollplex_train.memory.step_plan import STATE_ROWS
from rollplex_train.models.loading import has_dropout
from rollplex_train.training.base import ChunkResult, PrefixResult, TrainEngine
from rollplex_train.training.log_probs import ResponseScorer
from rollplex_train.versioning import check_version

log = logging.getLogger(__name__)

PPO_METRICS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/kl_loss",
               "actor/entropy")


def lr_factor(step: int, actor: ActorConfig) -> float:
    """Multiplier of ``actor.lr`` at optimizer step ``step`` (0-based): linear warm-up
    ``min(1, (step + 1) / warmup)`` over ``actor.lr_warmup_steps``, then ``constant`` (1) or
    ``cosine``: ``r + (1 - r) (1 + cos(pi t)) / 2`` with ``t = min(1, (step - warmup) /
    lr_decay_steps)`` and ``r = actor.min_lr_ratio`` (the shape of verl's
    ``get_cosine_schedule_with_warmup``, verl/utils/torch_functional.py)."""
    warmup = max(actor.lr_warmup_steps, 0)
    if step < warmup:
        return (step + 1) / warmup
    if actor.lr_scheduler == "constant":
        return 1.0
    t = min(1.0, (step - warmup) / max(actor.lr_decay_steps, 1))
    return actor.min_lr_ratio + (1.0 - actor.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


class PPOEngine(TrainEngine):
    """The PPO loop of one training rank over ``backend`` (the ``TrainEngine`` the workers call).

    Args:
        backend: the rank's ``training.backend.ModelBackend``.
        model, actor, algorithm: config sections. rank: this process's training rank.

    Attributes:
        actor, ref, device, tokenizer, pad_id: the backend's. weights_version: completed actor
        updates (0 with the loaded checkpoint). param_version: optimizer steps taken in this
        process (keys the actor prefix states). optimizer_steps: steps of the learning-rate
        schedule (kept in checkpoints).
    """

    def __init__(self, backend, model: ModelConfig, actor: ActorConfig, algorithm: AlgorithmConfig, rank: int = 0):
        self.backend = backend
        self.model_cfg, self.cfg, self.algo, self.rank = model, actor, algorithm, rank
        self.actor, self.ref, self.device = backend.actor, backend.ref, backend.device
        self.tokenizer, self.pad_id = backend.tokenizer, backend.pad_id
        self.scorer = ResponseScorer(backend, model, owner=f"train-rank{rank}")
        self.prefixes = self.scorer.prefixes
        self.weights_version = 0
        self.param_version = 0
        self.optimizer_steps = 0
        self._shared = None  # sharing.share.WeightShare once export_shared_weights() ran
        # the class declares it (the config asks the registry); the backend must agree
        assert self.supports_suffix_chunks == (backend.prefix_passes.chunked is not None), type(self).__name__
        self._offloaded: set[str] = set()  # backend parts on the host now
        self._step_memory: Optional[dict[str, int]] = None

    # ---- scoring ----------------------------------------------------------------------------------
    @torch.no_grad()
    def compute_log_probs(self, batch: TrainBatch, role: str, temperature: float = 1.0,
                          with_entropy: bool = False):
        if role not in ("actor", "ref"):
            raise ValueError(f"role={role!r}: expected 'actor' or 'ref'")
        model = self.actor if role == "actor" else self.ref
        if model is None:
            raise ValueError("reference log-probs requested but no KL is configured (algorithm.kl_coef/use_kl_*)")
        model.eval()
        logps = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
        ents = torch.zeros_like(logps) if with_entropy else None
        for rows in self.scorer.micro_batches(batch, torch.arange(batch.num_responses), self.cfg.micro_batch_size):
            _, (lp, ent) = self.scorer.forward(model, role, batch, rows, param_version=self.param_version,
                                               temperature=temperature, with_entropy=with_entropy)
            logps[rows] = lp.to(logps.device)  # results go back where the batch lives (the driver's CPU)
            if with_entropy:
                ents[rows] = ent.to(ents.device)
        return logps, ents

    def precompute_prefixes(self, prompts, roles: list[str], weights_version: int,
                            export: bool = False) -> PrefixResult:
        """Encode the prefixes of ``prompts`` for later suffix passes (the decode-window work).

        Args:
            roles: any of ``ref`` (reference), ``old`` (old-policy log-probs), ``actor`` (with the
                autograd graph, for the first mini-batch of the next update).
            weights_version: the version the caller expects (the rollout's).
            export: also return the last role's states of ``prompts`` in order (``states``),
                detached (``PrefixState.detached``; they share the stored tensors): an ``old`` or
                ``actor`` state is the prompt's KV cache under the rollout's weights, which the
                rollout engine decodes from instead of prefilling (``schedule.prefill_from_actor``).

        Returns:
            per role its wall seconds and prompt tokens, the call's span (``time.perf_counter`` of
            this process: CLOCK_MONOTONIC, comparable with the driver's on one machine), threads,
            the bytes held after it (``metrics``: ``prefix/num_states``); with ``export`` the states
            (recorded under ``weights_version``).

        Raises:
            StaleWeightsError: ``weights_version`` differs from this engine's.
            ValueError: a ``ref`` prefix without a reference model, or an unknown role.
        """
        check_version(weights_version, self.weights_version, "prefix tasks", "the actor")
        return self.scorer.precompute(prompts, roles, param_version=self.param_version,
                                      weights_version=weights_version, export=export)

    def score_suffix_chunks(self, prompts, role: str, tokens: dict[int, torch.Tensor], width: int,
                            weights_version: int, final: bool = False) -> ChunkResult:
        """Run the suffix pass of decoding groups on the tokens decoded so far, in chunks that give
        the one-call pass's numbers (``models.prefix.ChunkedSuffix``); ``compute_log_probs`` of
        those groups then runs only the tokens left. Needs ``model.shared_prefix``.

        Args:
            prompts: the step's prompts; role: ``ref`` or ``actor`` (the old-policy pass).
            tokens: prompt index -> (n, t) int64, the first t tokens of the group's n responses.
            width: R, the width every response will have (``rollout.max_new_tokens`` under
                ``ignore_eos``). weights_version: the rollout's (must be this engine's).
            final: the pass's last chunk (``tokens`` hold whole responses): run every input left.

        Returns:
            the seconds and input tokens run (all rows), the call's span (``time.perf_counter``),
            threads; ``metrics``: ``suffix/bytes_held`` (chunked passes held).

        Raises:
            NotImplementedError: the backend cannot run suffix chunks (Megatron's TP shards).
            StaleWeightsError: ``weights_version`` differs from this engine's.
            ValueError: an unknown role, a missing reference or ``model.shared_prefix=false``.
        """
        if not self.supports_suffix_chunks:
            raise NotImplementedError(f"{type(self.backend).__name__} cannot score suffix chunks (its prefix "
                                      "states are TP shards)")
        check_version(weights_version, self.weights_version, "suffix chunks", "the actor")
        return self.scorer.score_chunks(prompts, role, tokens, width, param_version=self.param_version, final=final)

    # ---- update -----------------------------------------------------------------------------------
    def update_actor(self, batch: TrainBatch, temperature: float = 1.0, old_from_actor: bool = False) -> dict[str, float]:
        """PPO epochs x mini-batches x micro-batches over ``batch`` (see the module docstring).

        With ``old_from_actor`` (the step's decision, ``runtime/old_policy.reuse_actor_forward``)
        the first mini-batch of the first epoch takes its old-policy log-probs from its own forward
        (``old = logp.detach()``: ratio exactly 1), and later epochs reuse those values;
        ``batch.old_logprobs`` then holds only the other mini-batches' rows (None when there are none).

        Raises:
            ValueError: advantages, old log-probs (of the mini-batches that need them) or reference
                log-probs (with the KL loss) missing; ``old_from_actor`` on a model with dropout.
        """
        num_prompts = len(batch.prompts)
        mini = self.cfg.ppo_mini_batch_size if self.cfg.ppo_mini_batch_size > 0 else num_prompts
        specs = batch.plan_mini_batches(max(1, mini))
        from_actor = old_from_actor
        if batch.advantages is None or (batch.old_logprobs is None and not (from_actor and len(specs) == 1)):
            raise ValueError("update_actor needs batch.advantages and batch.old_logprobs (all mini-batches but "
                             "the first when old_from_actor)")
        if from_actor and has_dropout(self.actor.config.to_dict()):
            raise ValueError("old_from_actor: the checkpoint has dropout, so the training forward is "
                             "not the old policy; set actor.recompute_old_log_prob=true")
        use_kl = self.algo.use_kl_loss and self.ref is not None
        if use_kl and batch.ref_logprobs is None:
            raise ValueError("algorithm.use_kl_loss is on but batch.ref_logprobs is missing")
        if from_actor:  # filled by the first mini-batch's forward, read again by later epochs
            old = batch.old_logprobs.clone() if batch.old_logprobs is not None else torch.zeros_like(batch.response_mask)
            batch = dataclasses.replace(batch, old_logprobs=old)
        sums: dict[str, float] = {}
        count = 0
        if self._shared is not None:  # in-place writes ahead: the rollout refuses until publish_weights
            self._shared.begin_update()
        self._step_memory = None  # measured at this update's first optimizer step
        self.actor.train()
        for epoch in range(self.cfg.ppo_epochs):
            for index, spec in enumerate(specs):
                metrics = self._update_mini_batch(batch, batch.rows_of(spec.groups), use_kl, temperature,
                                                  spec.num_tokens, spec.num_seqs,
                                                  old_from_actor=from_actor and epoch == 0 and index == 0)
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
        self.actor.eval()
        self.backend.release_grads()  # the gradients live inside the update only (memory/groups.py)
        self.scorer.drop_stale(self.param_version)
        self.weights_version += 1
        out = {k: v / count for k, v in sums.items()}
        out["actor/lr"] = self.cfg.lr * lr_factor(self.optimizer_steps, self.cfg)  # the next step's
        if self._step_memory is not None:  # the update's and the optimizer step's rows (memory/step_plan.py)
            out["memory/actor_update/grads_gib"] = self._step_memory["grads"] / 2**30
            out.update({f"memory/optimizer_step/{g}_gib": b / 2**30 for g, b in self._step_memory.items()
                        if g in STATE_ROWS})
        return out

    def _update_mini_batch(self, batch: TrainBatch, rows: torch.Tensor, use_kl: bool, temperature: float,
                           num_tokens: int, num_seqs: int, old_from_actor: bool = False) -> dict[str, float]:
        """One optimizer step over this rank's ``rows`` of a mini-batch of ``num_tokens`` response
        tokens in ``num_seqs`` responses over all DP ranks; gradients summed over the DP group.
        ``old_from_actor``: this mini-batch's old-policy log-probs are its own forward, detached."""
        cfg, backend = self.cfg, self.backend
        metrics = dict.fromkeys(PPO_METRICS, 0.0)
        backend.zero_grad()
        for micro in self.scorer.micro_batches(batch, rows, cfg.micro_batch_size):
            part, (logp, ent) = self.scorer.forward(self.actor, "actor", batch, micro, param_version=self.param_version,
                                                    temperature=temperature, with_entropy=True)
            mask = part["response_mask"]
            weight = float(mask.sum()) / max(num_tokens, 1)  # token share of this micro-batch
            old = part["old_logprobs"]
            if old_from_actor:  # the weights that sampled: this forward is the old policy
                old = logp.detach()
                batch.old_logprobs[micro] = old.to(batch.old_logprobs.device)
            loss, pg = policy_loss(
                logp, old, part["advantages"], mask,
                clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c,
                loss_agg_mode=cfg.loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
            )
            metrics["actor/pg_loss"] += float(loss.detach())
            metrics["actor/pg_clipfrac"] += pg["actor/pg_clipfrac"] * weight
            metrics["actor/pg_clipfrac_lower"] += pg["actor/pg_clipfrac_lower"] * weight
            metrics["actor/ppo_kl"] += pg["actor/ppo_kl"] * weight
            entropy = agg_loss(ent, mask, cfg.loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
            metrics["actor/entropy"] += float(entropy.detach())
            if cfg.entropy_coeff:
                loss = loss - cfg.entropy_coeff * entropy
            if use_kl:
                kl = kl_loss(logp, part["ref_logprobs"], mask, self.algo.kl_estimator, cfg.loss_agg_mode,
                             num_tokens=num_tokens, num_seqs=num_seqs)
                metrics["actor/kl_loss"] += float(kl.detach())
                loss = loss + self.algo.kl_coef * kl
            loss.backward()  # each micro-batch's prefix graph (one group) has exactly this one backward
        backend.sync_grads()
        metrics = backend.sum_metrics(metrics, PPO_METRICS)  # each rank's share of the global means
        grad_norm = backend.clip_grad_norm(cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        if math.isfinite(grad_norm):
            backend.optimizer_step(cfg.lr * lr_factor(self.optimizer_steps, cfg))
            if self._step_memory is None:  # the states exist from the first step on; the grads are still held
                self._step_memory = self.memory_bytes()
            self.optimizer_steps += 1
            self.param_version += 1
        else:
            log.warning("non-finite grad norm %s: optimizer step skipped", grad_norm)
        backend.zero_grad()
        metrics["actor/grad_norm"] = grad_norm
        return metrics

    # ---- weights ----------------------------------------------------------------------------------
    def rollout_weights(self) -> dict[str, torch.Tensor]:
        return self.backend.rollout_weights()

    def export_shared_weights(self, same_process: bool = False, *, rollout_kind: str = "hf",
                              rollout_tp: Optional[int] = None, **options) -> dict:
        """Share the actor's weights in place with the rollout rank on this device (once; later
        calls, for the same layout only, export the same tensors again): ``update_actor`` and
        ``load_checkpoint`` then mark the weights in flux until ``publish_weights``. The payload and
        byte counts are ``sharing.share.WeightShare.export``'s (``docs/sharing.md``).

        Args:
            same_process: the rollout engine lives in this process (the payload holds the tensors).
            rollout_kind: the rollout engine's layout, ``hf`` (the built-in engine's names) or
                ``sglang`` (per-rank ``[q;k;v]``, merged ``gate_up``, padded vocabulary).
            rollout_tp: its TP degree (None: the run layout's ``rollout_tp``, 1 without one).
            options: ``split_qkv``/``split_gate_up`` of the ``sglang`` layout.

        Raises:
            ValueError: the weights are shared already for another layout or degree.
            RuntimeError: (Megatron) the plan puts another rollout rank on this device than the run.
        """
        layout = self.backend.layout
        r = rollout_tp or (layout.rollout_tp if layout is not None else 1)
        if self._shared is None:
            self._shared = self.backend.share_weights(rollout_kind, r, same_process, **options)
            self._shared.begin_update()  # a new counter reads 0: publish the actor's version on it
            self._shared.publish(self.weights_version)
        elif (self._shared.rollout_kind, self._shared.rollout_tp) != (rollout_kind, r):
            raise ValueError(f"the actor's weights are shared as {self._shared.rollout_kind} r={self._shared.rollout_tp}"
                             f" already, not {rollout_kind} r={r}")
        return self._shared.export()

    def publish_weights(self, version: int) -> dict[str, float]:
        if self._shared is None:
            raise RuntimeError("publish_weights before export_shared_weights")
        check_version(version, self.weights_version, "publish", "the actor")
        return self._shared.publish(version)

    def weights_digest(self) -> dict[str, str]:
        return self.backend.weights_digest()

    def offload_states(self, parts: tuple[str, ...]) -> int:
        if "params" in parts and self._shared is not None:
            raise ValueError("cannot offload the actor's parameters: the rollout engine decodes with them "
                             "(sharing.enabled=true)")
        moved = self.backend.offload(tuple(parts))
        self._offloaded.update(parts)
        return moved

    def prefetch_states(self, parts: tuple[str, ...]) -> int:
        self._offloaded.difference_update(parts)
        return self.backend.onload(tuple(parts))

    # ---- residency ------------------------------------------------------------------------------
    PARTS_OF_GROUP = {"actor_weights": "params", "optimizer_states": "optimizer", "ref_weights": "ref"}
    """The residency groups (``memory/groups.py``) this engine moves, and the backend part of each."""

    def memory_bytes(self) -> dict[str, int]:
        """Device bytes each group of this rank holds now, from its tensors: the backend's
        (``ModelBackend.memory_bytes``), the rebuilt rollout buffers and the held prefix KV caches."""
        out = self.backend.memory_bytes()
        out["rollout_rebuilt"] = 0 if self._shared is None else self._shared.rebuilt_device_bytes()
        out["old_prefix_kv"], out["ref_prefix_kv"] = self.prefixes.kv_bytes("old"), self.prefixes.kv_bytes("ref")
        return out

    def enter_phase(self, phase: str, resident: dict[str, bool]) -> dict:
        """Start ``phase`` of the run's residency plan (``memory/executor.py``): move each group of
        ``resident`` (a key of ``PARTS_OF_GROUP``) onto the device (True) or to host memory (False).

        Returns:
            ``closing``: the groups' bytes before the moves (the previous phase's end: what it
            made), ``rows``: after them, ``offloaded``/``prefetched``: bytes moved.

        Raises:
            KeyError: a group this engine does not move. ValueError: as :meth:`offload_states`.
        """
        closing, off, on = self.memory_bytes(), 0, 0
        for group, keep in resident.items():
            part = self.PARTS_OF_GROUP[group]
            if keep and part in self._offloaded:
                on += self.prefetch_states((part,))
            elif not keep and part not in self._offloaded:
                off += self.offload_states((part,))
        return {"closing": closing, "rows": self.memory_bytes(), "offloaded": off, "prefetched": on}

    # ---- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self, directory: Path) -> None:
        away = tuple(self._offloaded)  # the states are written from the device: bring them back meanwhile
        self.prefetch_states(away)
        self.backend.save(Path(directory), {"weights_version": self.weights_version,
                                            "optimizer_steps": self.optimizer_steps,
                                            "torch_rng": torch.get_rng_state()})
        self.offload_states(away)

    def load_checkpoint(self, directory: Path) -> None:
        if self._shared is not None:  # the load writes into the shared storage in place
            self._shared.begin_update()
        self.prefetch_states(tuple(self._offloaded))  # loaded onto the device; the next phase moves them
        state = self.backend.load(Path(directory))
        self.weights_version = int(state["weights_version"])
        # checkpoints written before the loop split keep the count as their LambdaLR's last_epoch
        self.optimizer_steps = int(state["optimizer_steps"] if "optimizer_steps" in state
                                   else state["scheduler"]["last_epoch"])
        self.param_version += 1  # new weights: prefix states made before are for another parameter state
        torch.set_rng_state(state["torch_rng"])

    def export_hf(self, directory: Path) -> None:
        self.backend.export_hf(Path(directory))
