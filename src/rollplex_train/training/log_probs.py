"""Log-probs of responses on one model backend: full sequences, or stored prefixes + suffix passes.

``ResponseScorer`` is the part of the PPO loop (``training/ppo_loop.py``) that turns a micro-batch of
responses into (N, R) log-probs: with ``model.shared_prefix`` it takes the group's prefix state from
the rank's ``PrefixStore`` (encoding it now if no decode window did), runs the suffix pass (or
finishes one that ran in chunks while the responses decoded) and frees the state after its last
consumer; without it, one full-sequence forward. Prefix states are keyed by (prompt uid, store role,
version): ``ref`` (frozen), ``old`` (actor, no grad) and ``actor`` (with graph) states carry the
actor's ``param_version`` (optimizer steps taken in this process), which the caller passes.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from rollplex_train.config import ModelConfig
from rollplex_train.data.types import TrainBatch
from rollplex_train.device import compute_context
from rollplex_train.models.prefix import chunk_end
from rollplex_train.training.base import ChunkResult, PrefixResult
from rollplex_train.training.prefix_store import PrefixStore

log = logging.getLogger(__name__)

LOSS_INPUTS = ("group_index", "response_ids", "response_mask", "advantages", "old_logprobs", "ref_logprobs")
"""The per-response fields of a micro-batch the loss reads (``ResponseScorer.forward`` moves them to the device)."""


class ResponseScorer:
    """Scores responses with one backend's actor or reference and holds the prefix states it made.

    Args:
        backend: the rank's ``training.backend.ModelBackend``. model_cfg: ``shared_prefix``,
            ``compute_dtype``, ``freeze_vision_tower``. owner: the store's name in reports.
    """

    def __init__(self, backend, model_cfg: ModelConfig, owner: str):
        self.backend, self.model_cfg = backend, model_cfg
        self.prefixes = PrefixStore(owner=owner)
        self.chunked: dict[tuple, object] = {}  # (uid, store role, version) -> suffix pass under way

    def compute(self):
        """The forward-pass precision context (``model.compute_dtype``; ``device.py``)."""
        return compute_context(self.backend.device, self.model_cfg.compute_dtype)

    def micro_batches(self, batch: TrainBatch, rows: torch.Tensor, size: int) -> list[torch.Tensor]:
        """Split ``rows`` into micro-batches of at most ``size`` responses; with a shared prefix,
        one group per micro-batch, groups in ascending index order.

        One group per micro-batch fixes the composition of every prefix and suffix pass whatever
        call or phase the group arrives in (a decode-tail call with the groups finished so far, the
        window's prefix tasks, the update): the results are bit-identical however the schedule
        places the work, and each prefix graph gets exactly one backward, in a fixed order.
        """
        if not self.model_cfg.shared_prefix:
            return list(rows.split(size))
        by_group: dict[int, list[int]] = {}
        for row in rows.tolist():
            by_group.setdefault(int(batch.group_index[row]), []).append(row)
        return [torch.tensor(by_group[g]) for g in sorted(by_group)]

    def forward(self, model, role: str, batch: TrainBatch, rows: torch.Tensor, *, param_version: int,
                temperature: float, with_entropy: bool):
        """(part, (logp, entropy)): the per-response tensors at ``rows`` on the backend's device and
        their (n, R) float32 log-probs (and entropy or None) under ``model`` (``role``: ``actor`` or
        ``ref``; with grad enabled an actor pass keeps the graph)."""
        part = batch.at_rows(rows)
        if not self.model_cfg.shared_prefix:
            with self.compute():
                out = self.backend.score_full(model, part, temperature=temperature, with_entropy=with_entropy)
            return self._on_device(part), out
        groups = set(part.group_index.tolist())
        assert len(groups) == 1, "with a shared prefix a micro-batch is one group (micro_batches)"
        prompt = batch.prompts[groups.pop()]
        store_role, version = self.prefix_key(role, param_version)
        # the group's own width, not the batch's: the numbers do not depend on which groups share a call
        width = max(1, int(part.response_mask.sum(-1).max()))
        chunked = self.chunked.pop((prompt.uid, store_role, version), None)
        if chunked is not None and (chunked.width, chunked.n) != (width, len(rows)):
            chunked = None  # not the pass these rows need: score them in one call
        state = None if chunked is not None else self.held_prefix(prompt, store_role, version)
        with self.compute():
            if chunked is not None:  # scored in chunks during decode (score_chunks): finish it
                logp, ent = chunked.log_probs(part.response_ids[:, :width], part.response_mask[:, :width],
                                              temperature=temperature, with_entropy=with_entropy)
            else:
                logp, ent = self.backend.prefix_passes.score(
                    model, [state], torch.zeros(len(rows), dtype=torch.long), part.response_ids[:, :width],
                    part.response_mask[:, :width], temperature=temperature, with_entropy=with_entropy)
        self.prefixes.release(prompt.uid, store_role, version)  # the suffix pass was its last consumer
        pad = part.response_ids.shape[1] - width
        return self._on_device(part), (torch.nn.functional.pad(logp, (0, pad)),
                                       None if ent is None else torch.nn.functional.pad(ent, (0, pad)))

    def _on_device(self, part: TrainBatch) -> dict[str, Optional[torch.Tensor]]:
        """The loss inputs of ``part`` on the backend's device, by field name."""
        return {k: None if getattr(part, k) is None else getattr(part, k).to(self.backend.device) for k in LOSS_INPUTS}

    @staticmethod
    def prefix_key(role: str, param_version: int) -> tuple[str, object]:
        """(store role, version) of a pass: ``ref`` (frozen), ``old`` (actor, no grad) or ``actor``
        (with graph); actor prefixes are keyed by the exact parameter state (``param_version``)."""
        store_role = "ref" if role == "ref" else ("actor" if torch.is_grad_enabled() else "old")
        return store_role, ("ref" if store_role == "ref" else param_version)

    def held_prefix(self, prompt, store_role: str, version):
        """The stored prefix state of ``prompt`` (encoded now when no decode window made it)."""
        if not self.prefixes.holds(prompt.uid, store_role, version):
            self.encode([prompt], store_role, version)
        return self.prefixes.take(prompt.uid, store_role, version)

    def encode(self, prompts, store_role: str, version) -> None:
        """Prefix states of ``prompts`` under ``version``, one prefix pass per prompt: a prompt's
        numbers (padding, batch shape, autograd graph) are the same whichever prompts a call brings
        along."""
        backend = self.backend
        model = backend.ref if store_role == "ref" else backend.actor
        with torch.set_grad_enabled(store_role == "actor"), self.compute():
            for prompt in prompts:
                state, = backend.prefix_passes.encode(model, [prompt], version=version,
                                                      with_grad=store_role == "actor",
                                                      freeze_vision=self.model_cfg.freeze_vision_tower)
                self.prefixes.put(store_role, state)

    def precompute(self, prompts, roles: list[str], *, param_version: int, weights_version: int,
                   export: bool) -> PrefixResult:
        """Encode the prefixes of ``prompts`` for ``roles`` (``TrainEngine.precompute_prefixes``
        gives the arguments and the result).

        Raises:
            ValueError: a ``ref`` prefix without a reference model, or an unknown role.
        """
        ref = self.backend.ref
        start = time.perf_counter()
        seconds, tokens, states = {}, {}, []
        for role in roles:
            if role not in ("ref", "old", "actor") or (role == "ref" and ref is None):
                raise ValueError(f"cannot precompute {role!r} prefixes (reference present: {ref is not None})")
            begin = time.perf_counter()
            self.encode(prompts, role, "ref" if role == "ref" else param_version)
            seconds[role] = time.perf_counter() - begin
            tokens[role] = sum(p.prompt_length for p in prompts)
        if export:
            role = roles[-1]
            version = "ref" if role == "ref" else param_version
            states = [self.prefixes.take(p.uid, role, version).detached(weights_version) for p in prompts]
        end = time.perf_counter()
        return PrefixResult(seconds, tokens, start, end, torch.get_num_threads(), float(self.prefixes.bytes_held),
                            states, metrics={"prefix/num_states": float(len(self.prefixes)), "prefix/seconds": end - start})

    @torch.no_grad()
    def score_chunks(self, prompts, role: str, tokens: dict[int, torch.Tensor], width: int, *,
                     param_version: int, final: bool) -> ChunkResult:
        """Run decoding groups' suffix passes on their tokens so far (``TrainEngine.score_suffix_chunks``
        gives the arguments and the result).

        Raises:
            NotImplementedError: the backend's prefix passes have no chunked form.
            ValueError: an unknown role, a missing reference or ``model.shared_prefix=false``.
        """
        backend = self.backend
        if backend.prefix_passes.chunked is None:
            raise NotImplementedError(f"{type(backend).__name__} cannot score suffix chunks (its prefix states "
                                      "are TP shards)")
        if role not in ("ref", "actor") or (role == "ref" and backend.ref is None) or not self.model_cfg.shared_prefix:
            raise ValueError(f"cannot score {role!r} suffix chunks (reference present: {backend.ref is not None}, "
                             f"model.shared_prefix={self.model_cfg.shared_prefix})")
        start = time.perf_counter()
        model = backend.ref if role == "ref" else backend.actor
        model.eval()
        store_role, version = self.prefix_key(role, param_version)
        ran = 0
        for index, ids in tokens.items():
            prompt = prompts[index]
            chunked = self.chunked.get((prompt.uid, store_role, version))
            if chunked is None:
                chunked = backend.prefix_passes.chunked(model, self.held_prefix(prompt, store_role, version),
                                                        ids.shape[0], width)
                self.chunked[(prompt.uid, store_role, version)] = chunked
            end = min(ids.shape[1], width - 1) if final else chunk_end(chunked.scored, ids.shape[1], width)
            if end > chunked.scored:
                with self.compute():
                    ran += chunked.extend(ids[:, :end], torch.ones(ids.shape[0], end)) * ids.shape[0]
        end_time = time.perf_counter()
        return ChunkResult(role, end_time - start, ran, start, end_time, torch.get_num_threads(),
                           metrics={"suffix/bytes_held": float(sum(c.nbytes for c in self.chunked.values()))})

    def drop_stale(self, param_version: int) -> None:
        """After an update: free actor prefix states made for a parameter state that no longer
        exists and suffix chunk passes no log-prob pass finished (each logged)."""
        for role in ("old", "actor"):
            dropped = self.prefixes.drop_other_versions(role, param_version)
            if dropped:
                log.warning("dropped %d bytes of unused %s prefix states after the update", dropped, role)
        if self.chunked:
            log.warning("dropped %d unfinished suffix chunk passes after the update", len(self.chunked))
            self.chunked.clear()
