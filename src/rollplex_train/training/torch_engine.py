"""The plain-torch training backend: actor + frozen reference + AdamW in one process.

Loss per micro-batch (GRPO, Shao et al. 2024 eq. 3, with verl's options):
    loss = pg_loss + [use_kl_loss] kl_coef * KL(actor || ref) - entropy_coeff * entropy
where each term is aggregated with ``actor.loss_agg_mode`` over the *mini-batch* token/sequence
counts, so that the sum of micro-batch losses equals the mini-batch loss exactly (no dependence on
how responses are split into micro-batches).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Optional

import torch

from rollplex_train.algo.losses import agg_loss, kl_loss, policy_loss
from rollplex_train.config import ActorConfig, AlgorithmConfig, ModelConfig
from rollplex_train.data.types import TrainBatch
from rollplex_train.device import compute_context, layout_device
from rollplex_train.models.loading import has_dropout, load_model, load_tokenizer
from rollplex_train.models.prefix import ChunkedSuffix, chunk_end, encode_prefix, score_suffix
from rollplex_train.training.base import PrefixFunctions, PrefixPasses
from rollplex_train.models.sequence import build_full_sequences, response_logprobs
from rollplex_train.training.base import TrainEngine, register_train_engine
from rollplex_train.training.prefix_store import PrefixStore
from rollplex_train.versioning import check_version

log = logging.getLogger(__name__)


def _rows(batch: TrainBatch, rows: torch.Tensor) -> dict[str, Optional[torch.Tensor]]:
    """The per-response tensors of ``batch`` at ``rows`` (group_index keeps global prompt ids)."""
    take = lambda t: None if t is None else t.index_select(0, rows)  # noqa: E731
    return dict(
        group_index=take(batch.group_index),
        response_ids=take(batch.response_ids),
        response_mask=take(batch.response_mask),
        advantages=take(batch.advantages),
        old_logprobs=take(batch.old_logprobs),
        ref_logprobs=take(batch.ref_logprobs),
    )


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


def build_optimizer(params: list[torch.nn.Parameter], actor: ActorConfig):
    """AdamW over ``params`` and its learning-rate schedule (``LambdaLR`` over :func:`lr_factor`)."""
    optimizer = torch.optim.AdamW(params, lr=actor.lr, betas=tuple(actor.betas), weight_decay=actor.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, actor))
    return optimizer, scheduler


@register_train_engine("torch")
class TorchTrainEngine(TrainEngine):
    """Actor and reference as transformers models on one device (``cpu``, or ``cuda:<local index>`` of the
    rank's device; ``device.py``), computing in ``model.compute_dtype``.

    Args:
        model: model section (checkpoint path, dtype, frozen vision tower).
        actor: optimizer and PPO settings. algorithm: KL settings.
        seed: seeds torch before the optimizer is built.
        layout: the run's :class:`rollplex_train.parallel.ParallelLayout` (None: one process).
        rank: this process's training rank; with DP > 1 torch.distributed is initialised over all
            ranks before the engine is built (``training/parallelize.py``).
    """

    def __init__(self, model: ModelConfig, actor: ActorConfig, algorithm: AlgorithmConfig, seed: int = 1,
                 layout=None, rank: int = 0):
        from rollplex_train.training.parallelize import parallelize_torch

        torch.manual_seed(seed)
        self.rank = rank
        self.model_cfg, self.cfg, self.algo = model, actor, algorithm
        self.device = layout_device(layout, rank)
        self.actor = load_model(model.path, model.dtype, model.attn_implementation).to(self.device)
        self.tokenizer = load_tokenizer(model.path)
        self.pad_id = self.tokenizer.pad_token_id
        self.ref = None
        if algorithm.needs_reference:
            self.ref = copy.deepcopy(self.actor).requires_grad_(False).eval()
        if model.freeze_vision_tower:
            self.actor.model.visual.requires_grad_(False)
        self.params = [p for p in self.actor.parameters() if p.requires_grad]
        self.dp = parallelize_torch(self.params, layout, rank)
        self.optimizer, self.scheduler = build_optimizer(self.params, actor)
        self.weights_version = 0
        self.param_version = 0  # optimizer steps taken by this process (keys actor prefix states)
        self.prefixes = PrefixStore(owner="train-worker")
        self.chunked: dict[tuple, ChunkedSuffix] = {}  # (uid, store role, version) -> suffix pass under way
        self.prefix_passes: PrefixPasses = PrefixFunctions(encode_prefix, score_suffix)  # models.prefix
        self._shared = None  # sharing.embedded.SharedActor once export_shared_weights() ran
        self._offloader = None  # memory.offload.ModuleOffloader on first offload_states()

    # ---- scoring ----------------------------------------------------------------------------------
    def _forward(self, model, role: str, batch: TrainBatch, rows: torch.Tensor, temperature: float,
                 with_entropy: bool):
        """Log-probs of the responses at ``rows``: full sequences, or shared prefix + suffixes."""
        part = _rows(batch, rows)
        if not self.model_cfg.shared_prefix:
            with self._compute():
                out = self._score_full(model, batch.prompts, part, temperature, with_entropy)
            return self._on_device(part), out
        groups = set(part["group_index"].tolist())
        assert len(groups) == 1, "with a shared prefix a micro-batch is one group (_micro_batches)"
        prompt = batch.prompts[groups.pop()]
        store_role, version = self._prefix_key(role)
        # the group's own width, not the batch's: the numbers do not depend on which groups share a call
        width = max(1, int(part["response_mask"].sum(-1).max()))
        chunked = self.chunked.pop((prompt.uid, store_role, version), None)
        if chunked is not None and (chunked.width, chunked.n) != (width, len(rows)):
            chunked = None  # not the pass these rows need: score them in one call
        state = None if chunked is not None else self._held_prefix(prompt, store_role, version)
        with self._compute():
            if chunked is not None:  # scored in chunks during decode (score_suffix_chunks): finish it
                logp, ent = chunked.log_probs(part["response_ids"][:, :width], part["response_mask"][:, :width],
                                              temperature=temperature, with_entropy=with_entropy)
            else:
                logp, ent = self.prefix_passes.score(model, [state], torch.zeros(len(rows), dtype=torch.long),
                                                     part["response_ids"][:, :width], part["response_mask"][:, :width],
                                                     temperature=temperature, with_entropy=with_entropy)
        self.prefixes.release(prompt.uid, store_role, version)  # the suffix pass was its last consumer
        pad = part["response_ids"].shape[1] - width
        return self._on_device(part), (torch.nn.functional.pad(logp, (0, pad)),
                                       None if ent is None else torch.nn.functional.pad(ent, (0, pad)))

    def _held_prefix(self, prompt, store_role: str, version):
        """The stored prefix state of ``prompt`` (encoded now when no decode window made it)."""
        if not self.prefixes.holds(prompt.uid, store_role, version):
            self._encode([prompt], store_role)
        return self.prefixes.take(prompt.uid, store_role, version)

    def _compute(self):
        """The forward-pass precision context (``model.compute_dtype``; ``device.py``)."""
        return compute_context(self.device, self.model_cfg.compute_dtype)

    def _on_device(self, part: dict) -> dict:
        """The per-response tensors of ``part`` on the actor's device (the loss inputs)."""
        return {k: None if v is None else v.to(self.device) for k, v in part.items()}

    def _score_full(self, model, prompts, part: dict, temperature: float, with_entropy: bool):
        """(N, R) log-probs (and entropy) of ``part``'s responses from full-sequence forwards (the
        model call another backend replaces, as it replaces ``prefix_passes``)."""
        ids, mask, plen, vision = build_full_sequences(
            prompts, part["group_index"], part["response_ids"], part["response_mask"], self.pad_id
        )
        return response_logprobs(model, ids, mask, vision, plen, part["response_ids"], part["response_mask"],
                                 temperature=temperature, with_entropy=with_entropy)

    def _clip_grad_norm(self, max_norm: float) -> float:
        """Global L2 norm of the actor's gradients; scales them to at most ``max_norm``."""
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))

    def _prefix_key(self, role: str) -> tuple[str, object]:
        """(store role, version) of a pass: ``ref`` (frozen), ``old`` (actor, no grad) or ``actor``
        (with graph)."""
        store_role = "ref" if role == "ref" else ("actor" if torch.is_grad_enabled() else "old")
        return store_role, self._prefix_version(store_role)

    def _prefix_version(self, store_role: str):
        """Actor prefixes are keyed by the exact parameter state (optimizer steps taken)."""
        return "ref" if store_role == "ref" else self.param_version

    def _encode(self, prompts, store_role: str) -> None:
        """Prefix states of ``prompts``, one prefix pass per prompt: a prompt's numbers (padding,
        batch shape, autograd graph) are the same whichever prompts a call brings along."""
        model = self.ref if store_role == "ref" else self.actor
        version = self._prefix_version(store_role)
        with torch.set_grad_enabled(store_role == "actor"), self._compute():
            for prompt in prompts:
                state, = self.prefix_passes.encode(model, [prompt], version=version, with_grad=store_role == "actor",
                                                   freeze_vision=self.model_cfg.freeze_vision_tower)
                self.prefixes.put(store_role, state)

    def precompute_prefixes(self, prompts, roles: list[str], weights_version: int,
                            export: bool = False) -> dict[str, float]:
        """Encode the prefixes of ``prompts`` for later suffix passes (the decode-window work).

        Args:
            roles: any of ``ref`` (reference), ``old`` (old-policy log-probs), ``actor`` (with the
                autograd graph, for the first mini-batch of the next update).
            weights_version: the version the caller expects (the rollout's).
            export: also return ``prefix/states``, the last role's states of ``prompts`` in order,
                detached (``PrefixState.detached``; they share the stored tensors): an ``old`` or
                ``actor`` state is the prompt's KV cache under the rollout's weights, which the
                rollout engine decodes from instead of prefilling (``schedule.prefill_from_actor``).

        Returns:
            ``prefix/<role>/seconds`` (wall time of that role's encoding), ``prefix/<role>/tokens``
            (prompt tokens encoded), ``prefix/start_time``/``prefix/end_time`` (``time.perf_counter``
            of this process: CLOCK_MONOTONIC, comparable with the driver's on one machine),
            ``prefix/threads``, and ``prefix/bytes_held``/``prefix/num_states`` after the call;
            with ``export``, ``prefix/states`` (recorded under ``weights_version``).

        Raises:
            StaleWeightsError: ``weights_version`` differs from this engine's.
            ValueError: a ``ref`` prefix without a reference model, or an unknown role.
        """
        check_version(weights_version, self.weights_version, "prefix task", "the actor")
        start = time.perf_counter()
        out = {"prefix/start_time": start, "prefix/threads": float(torch.get_num_threads())}
        for role in roles:
            if role not in ("ref", "old", "actor") or (role == "ref" and self.ref is None):
                raise ValueError(f"cannot precompute {role!r} prefixes (reference present: {self.ref is not None})")
            begin = time.perf_counter()
            self._encode(prompts, role)
            out[f"prefix/{role}/seconds"] = time.perf_counter() - begin
            out[f"prefix/{role}/tokens"] = float(sum(p.prompt_length for p in prompts))
        if export:
            role = roles[-1]
            version = self._prefix_version(role)
            out["prefix/states"] = [self.prefixes.take(p.uid, role, version).detached(weights_version)
                                    for p in prompts]
        out.update({"prefix/end_time": time.perf_counter(), "prefix/bytes_held": float(self.prefixes.bytes_held),
                    "prefix/num_states": float(len(self.prefixes))})
        out["prefix/seconds"] = out["prefix/end_time"] - start
        return out

    supports_suffix_chunks = True
    exports_prefix_states = True  # whole transformers KV caches (schedule.prefill_from_actor)

    @torch.no_grad()
    def score_suffix_chunks(self, prompts, role: str, tokens: dict[int, torch.Tensor], width: int,
                            weights_version: int, final: bool = False) -> dict[str, float]:
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
            ``suffix/<role>/seconds``, ``suffix/<role>/tokens`` (input tokens run, all rows),
            ``suffix/start_time``/``suffix/end_time`` (``time.perf_counter``), ``suffix/threads``,
            ``suffix/bytes_held`` (chunked passes held).

        Raises:
            StaleWeightsError: ``weights_version`` differs from this engine's.
            ValueError: an unknown role, a missing reference or ``model.shared_prefix=false``.
        """
        if not self.supports_suffix_chunks:
            raise NotImplementedError(f"{type(self).__name__} cannot score suffix chunks (its prefix states are TP shards)")
        check_version(weights_version, self.weights_version, "suffix chunk", "the actor")
        if role not in ("ref", "actor") or (role == "ref" and self.ref is None) or not self.model_cfg.shared_prefix:
            raise ValueError(f"cannot score {role!r} suffix chunks (reference present: {self.ref is not None}, "
                             f"model.shared_prefix={self.model_cfg.shared_prefix})")
        start = time.perf_counter()
        model = self.ref if role == "ref" else self.actor
        model.eval()
        store_role, version = self._prefix_key(role)
        ran = 0
        for index, ids in tokens.items():
            prompt = prompts[index]
            chunked = self.chunked.get((prompt.uid, store_role, version))
            if chunked is None:
                chunked = ChunkedSuffix(model, self._held_prefix(prompt, store_role, version), ids.shape[0], width)
                self.chunked[(prompt.uid, store_role, version)] = chunked
            end = min(ids.shape[1], width - 1) if final else chunk_end(chunked.scored, ids.shape[1], width)
            if end > chunked.scored:
                with self._compute():
                    ran += chunked.extend(ids[:, :end], torch.ones(ids.shape[0], end)) * ids.shape[0]
        end_time = time.perf_counter()
        return {f"suffix/{role}/seconds": end_time - start, f"suffix/{role}/tokens": float(ran),
                "suffix/start_time": start, "suffix/end_time": end_time,
                "suffix/threads": float(torch.get_num_threads()),
                "suffix/bytes_held": float(sum(c.nbytes for c in self.chunked.values()))}

    def _micro_batches(self, batch: TrainBatch, rows: torch.Tensor) -> list[torch.Tensor]:
        """Split ``rows`` into micro-batches of at most ``micro_batch_size`` responses; with a shared
        prefix, one group per micro-batch, groups in ascending index order.

        One group per micro-batch fixes the composition of every prefix and suffix pass whatever
        call or phase the group arrives in (a decode-tail call with the groups finished so far, the
        window's prefix tasks, the update): the results are bit-identical however the schedule
        places the work, and each prefix graph gets exactly one backward, in a fixed order.
        """
        if not self.model_cfg.shared_prefix:
            return list(rows.split(self.cfg.micro_batch_size))
        by_group: dict[int, list[int]] = {}
        for row in rows.tolist():
            by_group.setdefault(int(batch.group_index[row]), []).append(row)
        return [torch.tensor(by_group[g]) for g in sorted(by_group)]

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
        for rows in self._micro_batches(batch, torch.arange(batch.num_responses)):
            _, (lp, ent) = self._forward(model, role, batch, rows, temperature, with_entropy)
            logps[rows] = lp.to(logps.device)  # results go back where the batch lives (the driver's CPU)
            if with_entropy:
                ents[rows] = ent.to(ents.device)
        return logps, ents

    # ---- update -----------------------------------------------------------------------------------
    def update_actor(self, batch: TrainBatch, temperature: float = 1.0) -> dict[str, float]:
        """PPO epochs x mini-batches x micro-batches over ``batch`` (see the module docstring).

        With ``batch.old_logprobs_from_actor`` the first mini-batch of the first epoch takes its
        old-policy log-probs from its own forward (``old = logp.detach()``: ratio exactly 1), and
        later epochs reuse those values (``runtime/old_policy.py``).

        Raises:
            ValueError: advantages, old log-probs (of the mini-batches that need them) or reference
                log-probs (with the KL loss) missing; ``old_logprobs_from_actor`` on a model with dropout.
        """
        num_prompts = len(batch.prompts)
        mini = self.cfg.ppo_mini_batch_size if self.cfg.ppo_mini_batch_size > 0 else num_prompts
        specs = batch.plan_mini_batches(max(1, mini))
        from_actor = batch.old_logprobs_from_actor
        if batch.advantages is None or (batch.old_logprobs is None and not (from_actor and len(specs) == 1)):
            raise ValueError("update_actor needs batch.advantages and batch.old_logprobs (all mini-batches but "
                             "the first when old_logprobs_from_actor)")
        if from_actor and has_dropout(self.actor.config.to_dict()):
            raise ValueError("old_logprobs_from_actor: the checkpoint has dropout, so the training forward is "
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
        for role in ("old", "actor"):  # precomputed for a parameter state that no longer exists
            dropped = self.prefixes.drop_other_versions(role, self.param_version)
            if dropped:
                log.warning("dropped %d bytes of unused %s prefix states after the update", dropped, role)
        if self.chunked:  # suffix passes of this step that no log-prob pass finished
            log.warning("dropped %d unfinished suffix chunk passes after the update", len(self.chunked))
            self.chunked.clear()
        self.weights_version += 1
        out = {k: v / count for k, v in sums.items()}
        out["actor/lr"] = self.scheduler.get_last_lr()[0]
        return out

    def _held_actor_graphs(self, batch: TrainBatch, micros: list[torch.Tensor]) -> list[set]:
        """Per micro-batch, the graph ids of the precomputed actor prefixes it will consume (one
        batched ``precompute_prefixes`` call may span several micro-batches)."""
        if not self.model_cfg.shared_prefix:
            return [set() for _ in micros]
        out = []
        for micro in micros:
            uids = {batch.prompts[int(g)].uid for g in batch.group_index[micro].tolist()}
            ids = {self.prefixes.graph_id(uid, "actor", self.param_version) for uid in uids}
            out.append(ids - {None})
        return out

    def _update_mini_batch(self, batch: TrainBatch, rows: torch.Tensor, use_kl: bool, temperature: float,
                           num_tokens: int, num_seqs: int, old_from_actor: bool = False) -> dict[str, float]:
        """One optimizer step over this rank's ``rows`` of a mini-batch of ``num_tokens`` response
        tokens in ``num_seqs`` responses over all DP ranks; gradients summed over the DP group.
        ``old_from_actor``: this mini-batch's old-policy log-probs are its own forward, detached."""
        cfg = self.cfg
        metrics = {"actor/pg_loss": 0.0, "actor/pg_clipfrac": 0.0, "actor/pg_clipfrac_lower": 0.0,
                   "actor/ppo_kl": 0.0, "actor/kl_loss": 0.0, "actor/entropy": 0.0}
        self.optimizer.zero_grad(set_to_none=True)
        micros = self._micro_batches(batch, rows)
        graphs = self._held_actor_graphs(batch, micros)
        for i, micro in enumerate(micros):
            part, (logp, ent) = self._forward(self.actor, "actor", batch, micro, temperature, with_entropy=True)
            mask = part["response_mask"]
            weight = float(mask.sum()) / max(num_tokens, 1)  # token share of this micro-batch
            old = part["old_logprobs"]
            if old_from_actor:  # the weights that sampled: this forward is the old policy
                old = logp.detach()
                batch.old_logprobs[micro] = old
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
            # a precomputed prefix graph shared with a later micro-batch must survive this backward
            loss.backward(retain_graph=bool(graphs[i] & set().union(*graphs[i + 1:])))
        self.dp.all_reduce_grads()
        metrics = self.dp.sum_metrics(metrics, tuple(metrics))  # each rank's share of the global means
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        grad_norm = self._clip_grad_norm(max_norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
            self.scheduler.step()
            self.param_version += 1
        else:
            log.warning("non-finite grad norm %s: optimizer step skipped", grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        metrics["actor/grad_norm"] = grad_norm
        return metrics

    # ---- weights and checkpoints ------------------------------------------------------------------
    def rollout_weights(self) -> dict[str, torch.Tensor]:
        if self.device.type == "cuda":  # the optimizer's kernels are done before another stream copies
            torch.cuda.current_stream(self.device).synchronize()
        return {k: v.detach() for k, v in self.actor.state_dict().items()}

    def offload_states(self, parts: tuple[str, ...]) -> int:
        if "params" in parts and self._shared is not None:
            raise ValueError("cannot offload the actor's parameters: the rollout engine decodes with them "
                             "(sharing.enabled=true)")
        if self._offloader is None:
            from rollplex_train.memory.offload import ModuleOffloader

            self._offloader = ModuleOffloader(self.actor, self.optimizer)
        return self._offloader.offload(tuple(parts))

    def prefetch_states(self, parts: tuple[str, ...]) -> int:
        if self._offloader is None:
            return 0
        pending = self._offloader.prefetch(tuple(parts))
        pending.wait()
        return pending.nbytes

    def export_shared_weights(self, same_process: bool = False) -> dict:
        """Put the actor's parameters in shared memory (once, in place) and export handles to them
        for one rollout process (``sharing/embedded.py``); from then on ``update_actor`` and
        ``load_checkpoint`` mark the weights in flux until ``publish_weights``. ``same_process``: the
        rollout engine is in this process; the payload is the tensors themselves (``LocalWeights``)."""
        from rollplex_train.sharing.embedded import SharedActor

        if self._shared is None:
            self._shared = SharedActor(self.actor, self.weights_version, same_process=same_process)
        return self._shared.export()

    def publish_weights(self, version: int) -> dict[str, float]:
        if self._shared is None:
            raise RuntimeError("publish_weights before export_shared_weights")
        check_version(version, self.weights_version, "publish", "the actor")
        return self._shared.publish(version)

    def weights_digest(self) -> dict[str, str]:
        from rollplex_train.sharing.embedded import weights_digest

        return weights_digest(self.actor)

    def save_checkpoint(self, directory: Path) -> None:
        """Rank 0 writes the actor and the optimizer (DP replicas are identical: written once;
        resuming on another DP size loads the same files)."""
        if self.rank != 0:
            return
        directory = Path(directory)
        torch.save(self.actor.state_dict(), directory / "actor.pt")
        torch.save(
            {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
             "weights_version": self.weights_version, "torch_rng": torch.get_rng_state()},
            directory / "optim.pt",
        )

    def load_checkpoint(self, directory: Path) -> None:
        directory = Path(directory)
        for name in ("actor.pt", "optim.pt"):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"checkpoint {directory} lacks {name}")
        if self._shared is not None:  # load_state_dict copies into the shared storage in place
            self._shared.begin_update()
        self.actor.load_state_dict(torch.load(directory / "actor.pt", weights_only=True))
        state = torch.load(directory / "optim.pt", weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.weights_version = int(state["weights_version"])
        torch.set_rng_state(state["torch_rng"])

    def export_hf(self, directory: Path) -> None:
        from rollplex_train.tracking.export import export_hf

        export_hf(self.actor, self.tokenizer, Path(directory), extra_files_from=Path(self.model_cfg.path))
