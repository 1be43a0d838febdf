"""The planned decode: the ``rollplex`` schedule's rollout, with prefix work in the decode window.

Per step (:meth:`PlannedDecode.rollout`):

1. plan the window (``runtime/window.py``: a task graph per DP rank, the phase planner's placement
   under the measured cost model) and encode the actor prefixes handed to the rollout, if any;
2. set the device shares (decode / prefix threads) and start decoding;
3. send the window's prefix tasks to the training ranks in planned order (old-policy and reference
   KV caches, first-mini-batch actor prefixes with their graph) under the rollout's weights version
   (the workers check it, so the update stays synchronous on-policy); score the suffixes of groups
   that finished early beside the decode tail, and reference suffix chunks as decode goes on;
4. as soon as the window's tasks are done, give the decoder the whole device back (mid-decode);
5. after decode, run the movable tasks the planner left out on the whole device;
   when the plan overlaps nothing and no decode tail can form (``rollout.ignore_eos``), the step
   decodes as the serial schedule does (``rollplex/serial_step``): the planner never makes it slower;
6. feed the measured seconds back into the cost model (``runtime/measure.py``); after the step's
   log-prob phases, :meth:`PlannedDecode.observe` adds the one-call reference suffix pass.

The step's phases after decode then run only the suffixes against the stored prefixes, and only of
the groups the rollout did not score already (``RolloutResult.log_probs``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

from rollplex_train.config import Config
from rollplex_train.data.types import TrainBatch
from rollplex_train.runtime.env_window import EnvWindowPlanner
from rollplex_train.runtime.planner import PrefixCall, WindowPlan, prefix_calls
from rollplex_train.runtime.protocol import RolloutResult, get_all, wait_first
from rollplex_train.runtime.serial import sampling_params
from rollplex_train.runtime.timeline import Timeline
from rollplex_train.runtime.window import WindowPlanner, suffix_input_tokens, window_metrics
from rollplex_train.training.base import PrefixResult


class PlannedDecode:
    """Decode with the planner's window (see the module docstring).

    Args:
        cfg: the run's config (resolved). workers: ``cluster.launch.Workers``. pad_id: the
            tokenizer's pad token id. old_from_actor: as ``runtime/old_policy.py`` decides.
    """

    def __init__(self, cfg: Config, workers, pad_id: int, old_from_actor: bool):
        self.cfg, self.workers, self.pad_id, self.old_from_actor = cfg, workers, pad_id, old_from_actor
        self.window = WindowPlanner(cfg, workers.threads, old_from_actor)
        self.estimates = self.window.estimates  # the cost model and size estimates it plans with
        # an environment run's steps: the turn scoring's overlap planned on the same cost model
        self.env_window = EnvWindowPlanner(self.estimates.cost, workers.threads, workers.halves())

    def state_dict(self) -> dict:
        """The calibrated cost model and size estimates: a resumed run plans without re-profiling."""
        return self.estimates.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.estimates.load_state_dict(state)

    def rollout(self, placed, step: int, version: int, tl: Timeline) -> RolloutResult:
        """The step's responses, the suffix log-probs scored beside the decode tail, and the
        ``rollplex/*``, ``planner/*``, ``cost/*`` metrics."""
        cfg, w, total, n = self.cfg, self.workers, self.workers.threads, len(placed.prompts)
        handed = self.window.prefill_groups(placed)
        plan = self.window.plan(placed, version, handed)
        prefixes, before = self._prefill_before_decode(placed, handed, version, tl)
        # profile_serial steps measure the prefix rates on the whole device: they keep the planned path
        if plan.mode != "profile_serial" and not plan.overlaps and not self.decode_tail_possible():
            return self._serial_rollout(plan, placed, step, version, tl, prefixes, before)
        full = (total, total)
        split = (plan.decode_share, plan.train_share) if plan.overlaps else w.halves()
        stream_suffix = cfg.schedule.stream_suffix and total > 1 and plan.mode != "profile_serial"
        # tail suffixes: old log-probs (role "actor") only where no mini-batch reuses the actor's forward
        roles = ([] if self.old_from_actor else ["actor"]) + (["ref"] if cfg.algorithm.needs_reference else [])
        scored: dict[str, dict[int, torch.Tensor]] = {"actor": {}, "ref": {}}
        groups: dict[int, list] = {}  # global prompt index -> its finished responses
        submitted: set[int] = set()
        tail: list = []  # suffix calls in flight: (their batch, prompt indices, roles, Pendings)
        # shares change only while the training ranks are idle (their calls run in order)
        share = self._set_share(split if plan.overlaps else full, full, tl)
        chunks, width = bool(plan.chunk_bounds), cfg.rollout.max_new_tokens
        chunk_calls: list = []  # reference suffix chunk calls (Pending), in order
        decoded: dict[int, torch.Tensor] = {}  # group -> tokens so far, not yet sent to a chunk call
        with tl.span("gen", "rollout"):
            gen_start = tl.now()
            stream = w.rollout.generate_stream(placed, sampling_params(cfg, step), version, prefixes,
                                               cfg.schedule.suffix_chunk_tokens if chunks else 0)
            window = self._submit(placed, prefix_calls(plan.window_tasks), version) if plan.overlaps else []
            pending, decoding = list(window), True
            while decoding:
                wait_first([stream.next_future(), *pending, *(p for *_, ps in tail for p in ps),
                            *(c for c in chunk_calls[-1:] if not c.done())])
                for r in stream.take():
                    groups.setdefault(r.prompt_index, []).append(r)
                decoded.update((p.prompt_index, p.token_ids) for p in stream.take_progress())
                if decoded and not (chunk_calls and not chunk_calls[-1].done()):  # one chunk call in flight
                    chunk_calls.append(w.train.score_suffix_chunks(placed, "ref", decoded, width, version))
                    decoded = {}
                decoding = sum(len(rs) == cfg.rollout.n for rs in groups.values()) < n and not stream.finished
                pending = [p for p in pending if not p.done()]
                self._collect_tail(tail, scored, wait=False)
                fresh = sorted(set(groups) - submitted)
                start_tail = decoding and stream_suffix and bool(roles) and bool(fresh) and not pending and not tail
                share = self._set_share(split if pending or tail or start_tail or chunks else full, share, tl)
                if start_tail:  # suffix tasks of the groups already finished, beside the decode tail
                    batch = TrainBatch.from_responses(placed.prompts, [r for g in fresh for r in groups[g]], self.pad_id)
                    tail.append((batch, fresh, roles, [w.train.log_probs(batch, placed, fresh, role,
                                                                                 cfg.rollout.temperature)
                                                       for role in roles]))
                    submitted.update(fresh)
            gen_end = tl.now()
        if pending or tail or (chunk_calls and not chunk_calls[-1].done()):
            with tl.span("prefix_exposed", "train"):  # window / tail work that outlasted decode
                get_all(pending)
                self._collect_tail(tail, scored, wait=True)
                get_all(chunk_calls)
        self._set_share(full, share, tl)
        chunk_results = [r for per_dp in get_all(chunk_calls) for r in per_dp]
        if chunks:  # the pass's last chunk, on the whole device
            with tl.span("suffix_after", "train"):
                last = {g: torch.stack([r.token_ids for r in groups[g]]) for g in range(n)}
                final = w.train.score_suffix_chunks(placed, "ref", last, width, version, final=True).result()
            self.estimates.observe_chunks(chunk_results, final)
            chunk_results += final
        tail_role = {"old": "actor", "ref": "ref"}  # prefix role -> the suffix role scored in the tail
        after_tasks = [t for t in plan.after_tasks  # groups whose old/ref suffixes already ran need no prefix
                       if t.role == "actor" or t.group not in scored[tail_role[t.role]]]
        with tl.span("prefix_after", "train"):
            after = get_all(self._submit(placed, prefix_calls(after_tasks), version))
        results = [r for per_call in [before, *get_all(window), *after] for r in per_call]
        responses = [r for g in range(n) for r in groups[g]]
        self.estimates.observe(responses, results, w.rollout.decode_stats(), n)
        metrics = window_metrics(plan, results, chunk_results, gen_start, gen_end, tl, self.estimates)
        metrics["rollplex/tail_groups"] = float(max(len(v) for v in scored.values()))
        metrics["rollplex/serial_step"] = 0.0
        metrics["rollplex/prefill_from_actor_groups"] = float(len(handed))
        # without chunks every reference prefix ran in the window or after it: the ref phase is suffixes only
        return RolloutResult(responses, scored, metrics, ref_pass_whole=not chunks)

    def observe(self, rollout: RolloutResult, batch, placed, tl: Timeline) -> None:
        """The reference phase's one suffix pass (all groups, prefixes held before it) on the whole
        device is the chunks' baseline (``suffix/ref``); timed per device, as the planner plans each
        DP rank: the rank with the most input tokens ends last."""
        if (rollout.ref_pass_whole and not rollout.log_probs.get("ref") and "ref" in tl.seconds
                and self.cfg.schedule.suffix_chunk_tokens > 0):
            tokens = max(suffix_input_tokens(batch, groups) for groups in placed.groups_of_dp)
            self.estimates.cost.observe("suffix/ref", tokens, self.workers.threads, tl.seconds["ref"])

    def decode_tail_possible(self) -> bool:
        """Whether suffixes may be scored beside the decode tail: groups can finish at different
        decode steps (EOS or stop strings end responses; not under ``rollout.ignore_eos``), the
        schedule streams suffixes (``schedule.stream_suffix``) and the device has two threads.
        Under ``ignore_eos`` the one tail left — the builtin engine's later chunks of more than
        ``rollout.max_batch_size`` sequences — is given up."""
        return self.cfg.schedule.stream_suffix and self.workers.threads > 1 and not self.cfg.rollout.ignore_eos

    def _prefill_before_decode(self, placed, groups: list[int], version: int,
                               tl: Timeline) -> tuple[Optional[dict], list[PrefixResult]]:
        """Encode the actor prefixes of ``groups`` (with their graph, kept for the update) on the
        whole device before decode; returns (global prompt index -> the state without its graph,
        for the rollout engines; the calls' results, their states dropped)."""
        if not groups:
            return None, []
        with tl.span("prefix_before", "train"):
            out = self.workers.train.precompute_prefixes(placed, groups, ["actor"], version, export=True).result()
        prefixes = {g: state for r in out for g, state in zip(r.groups, r.states)}
        return prefixes, [dataclasses.replace(r, states=[]) for r in out]

    def _serial_rollout(self, plan: WindowPlan, placed, step: int, version: int, tl: Timeline,
                        prefixes: Optional[dict], before: list[PrefixResult]) -> RolloutResult:
        """A step whose plan overlaps nothing (after the whole-device calibration steps) and whose
        decode has no tail to use: one ``generate`` call, from the handed-over ``prefixes`` where
        there are some, so that the step costs what the serial schedule's does; the other prefixes
        run inside the later phases, as there. The decode rate still feeds the cost model."""
        with tl.span("gen", "rollout"):
            gen_start = tl.now()
            responses = self.workers.rollout.generate(placed, sampling_params(self.cfg, step), version,
                                                      prefixes).result()
            gen_end = tl.now()
        self.estimates.observe(responses, before, self.workers.rollout.decode_stats(), len(placed.prompts))
        metrics = window_metrics(plan, before, [], gen_start, gen_end, tl, self.estimates)
        metrics["rollplex/prefill_from_actor_groups"] = float(len(prefixes or ()))
        metrics.update({"rollplex/prefix_hidden_frac": 0.0, "rollplex/serial_step": 1.0, "rollplex/tail_groups": 0.0})
        return RolloutResult(responses, metrics=metrics)  # its reference prefixes run inside the ref phase

    def _set_share(self, wanted: tuple[int, int], current: tuple[int, int], tl: Timeline) -> tuple[int, int]:
        """Change the (rollout, train) thread shares if ``wanted`` differs from ``current``; the round
        trip is the measured switching cost. Returns the shares now in effect."""
        if wanted != current:
            with tl.span("reshare", "driver"):
                begin = time.perf_counter()
                self.workers.share_threads(*wanted)
                self.estimates.cost.observe_switch(time.perf_counter() - begin)
        return wanted

    def _submit(self, placed, calls: list[PrefixCall], version: int) -> list:
        """One Pending per prefix call, each fanned out to the DP ranks that own its groups."""
        return [self.workers.train.precompute_prefixes(placed, list(c.groups), [c.role], version) for c in calls]

    def _collect_tail(self, tail: list, scored: dict[str, dict[int, torch.Tensor]], wait: bool) -> None:
        """Move finished suffix calls of the decode tail into ``scored[role][prompt index]`` ((n, R_g)
        log-probs of that group's rows); ``wait=True`` waits for all."""
        for entry in list(tail):
            batch, indices, roles, pendings = entry
            if not wait and not all(p.done() for p in pendings):
                continue
            tail.remove(entry)
            for role, logp in zip(roles, get_all(pendings)):
                for g in indices:
                    scored[role][g] = logp[batch.rows_of([g])]
