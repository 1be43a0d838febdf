"""The ``rollplex`` schedule: the phase planner moves prefix tasks into the rollout's decode window.

Per step: build the task graph (``runtime/graph.py``), ask the planner (``runtime/planner.py``) for a
placement under the cost model (``runtime/cost_model.py``), then drive it:

1. set the device shares (decode / prefix threads) and start decoding;
2. send the window's prefix tasks to the training worker in planned order (old-policy and
   reference KV caches, first-mini-batch actor prefixes with their graph) under the rollout's
   weights version — both workers check the version, so the update stays synchronous on-policy;
3. as soon as the window's tasks are done, give the decoder the whole device back (mid-decode);
4. after decode, run the movable tasks the planner left out on the whole device;
   when the plan overlaps nothing and no decode tail can form (``rollout.ignore_eos``), the step
   is the serial schedule's instead (``rollplex/serial_step``): the planner never makes it slower;
5. feed the measured seconds (decode per thread count, prefix per role and thread count, the
   re-share cost, reference suffix chunks, and the one-call reference suffix pass of steps whose
   reference prefixes were all held before it) back into the cost model.

The phases after decode are the serial ones, now running only the suffixes against the stored
prefixes.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import replace
from typing import Optional

import torch

from rollplex_train.data.types import PromptSample
from rollplex_train.models.prefix import chunk_end
from rollplex_train.runtime import batching
from rollplex_train.runtime.cost_model import CostModel
from rollplex_train.runtime.graph import build_step_graph
from rollplex_train.runtime.planner import PhasePlanner, WindowPlan
from rollplex_train.runtime.protocol import get_all, wait_first
from rollplex_train.runtime.serial import SerialSchedule, sampling_params

GIB = 1024**3

log = logging.getLogger(__name__)


class PrefillBudgetError(ValueError):
    """``schedule.prefill_from_actor=true`` but the first mini-batch's actor prefixes would outgrow
    ``schedule.prefix_memory_gib`` across decode (the CLI reports it on one line with the last checkpoint)."""


def rename_old_chunk_rates(cost: CostModel) -> None:
    """A cost model saved before the chunks had a kind of their own: its ``suffix/ref`` rates,
    counts and noise were the chunks' (``chunk/ref`` now); the one-call pass is then unmeasured, and
    the planner takes no chunks until a step without them measures it."""
    if "suffix/ref" not in cost.rates or "chunk/ref" in cost.rates:
        return
    cost.rates["chunk/ref"] = cost.rates.pop("suffix/ref")
    for table in (cost.counts, cost.noise):
        for key in [k for k in table if k[0] == "suffix/ref"]:
            table[("chunk/ref", key[1])] = table.pop(key)


def suffix_input_tokens(batch, groups: list[int]) -> int:
    """Input tokens of the suffix pass over ``groups`` of ``batch`` as the chunks count them: per
    group, its rows times (its longest response - 1) (the last response token is no input; shorter
    rows are padded to the longest)."""
    lengths = batch.response_mask.sum(-1)
    return sum(len(rows) * max(0, int(lengths[rows].max()) - 1)
               for rows in (batching.group_rows(batch, [g]) for g in groups))


def prefix_calls(task_names: list[str]) -> list[tuple[str, list[int]]]:
    """Batch consecutive same-role prefix tasks (``prefix/<role>/g<i>``) into worker calls:
    ``[(role, [group indices])]``, in task order."""
    calls: list[tuple[str, list[int]]] = []
    for name in task_names:
        _, role, group = name.split("/")
        if calls and calls[-1][0] == role:
            calls[-1][1].append(int(group[1:]))
        else:
            calls.append((role, [int(group[1:])]))
    return calls


ROLE_ORDER = {"old": 0, "ref": 1, "actor": 2}


def _globalise(task_names: list[str], groups: list[int]) -> list[str]:
    """Prefix task names of a DP rank's graph (``prefix/<role>/g<local>``) with global group indices."""
    out = []
    for name in task_names:
        kind, role, group = name.split("/")
        out.append(f"{kind}/{role}/g{groups[int(group[1:])]}")
    return out


def _run_order(task_names: list[str]) -> list[str]:
    """Old-policy, reference, then actor prefixes, each by group (``planner.run_order``'s order)."""
    return sorted(task_names, key=lambda n: (ROLE_ORDER[n.split("/")[1]], int(n.split("/")[2][1:])))


class RollplexSchedule(SerialSchedule):
    """Serial phases after decode; prefix tasks placed by the phase planner."""

    def __init__(self, cfg, workers, reward, pad_id):
        super().__init__(cfg, workers, reward, pad_id)
        self.cost = CostModel()
        budget = cfg.schedule.prefix_memory_gib
        self.planner = PhasePlanner(workers.threads, None if budget is None else int(budget * GIB))
        self.response_tokens = cfg.rollout.n * cfg.rollout.max_new_tokens  # per group, until measured
        self.decode_steps = cfg.rollout.max_new_tokens  # of the whole rollout, until measured
        self.bytes_per_token: dict[str, float] = {}
        self.last_plan: WindowPlan | None = None
        self.streamed: dict[str, dict] = {"actor": {}, "ref": {}}  # role -> group -> tail log-probs
        self.ref_pass_measurable = False  # this step's reference phase is one suffix pass (prefixes held)

    def state_dict(self) -> dict:
        """The calibrated cost model and size estimates: a resumed run plans without re-profiling."""
        return {"cost": self.cost.state_dict(), "response_tokens": self.response_tokens,
                "decode_steps": self.decode_steps, "bytes_per_token": dict(self.bytes_per_token)}

    def load_state_dict(self, state: dict) -> None:
        if not state:  # a checkpoint written by another schedule
            return
        self.cost.load_state_dict(state["cost"])
        rename_old_chunk_rates(self.cost)
        self.response_tokens, self.decode_steps = int(state["response_tokens"]), int(state["decode_steps"])
        self.bytes_per_token = {k: float(v) for k, v in state["bytes_per_token"].items()}

    def _prefill_groups(self, step_prompts) -> list[int]:
        """The groups whose actor prefixes are encoded before decode and handed to the rollout
        (``schedule.prefill_from_actor``): the first mini-batch's (encoded under the rollout's
        weights, as the first optimizer step needs them), none when off or when their states would
        not fit the memory budget (``schedule.prefix_memory_gib``, per DP rank) across decode."""
        cfg, prompts = self.cfg, step_prompts.prompts
        if cfg.schedule.prefill_from_actor == "false" or not cfg.prefill_from_actor_possible():
            return []
        first = list(range(min(len(prompts), self.groups_per_mini_batch(len(prompts)))))
        budget = self.planner.memory_budget_bytes
        if budget is not None:
            per_dp = [sum(prompts[g].prompt_length for g in first if step_prompts.rank_of_group[g] == dp)
                      for dp in range(len(step_prompts.groups_of_dp))]
            need = max(per_dp) * self.bytes_per_token.get("actor", 0.0)  # 0 until the first step measured it
            if need > budget:
                what = (f"the first mini-batch's actor prefixes take {need / GIB:.3g} GiB across decode, over "
                        f"schedule.prefix_memory_gib={cfg.schedule.prefix_memory_gib}")
                if cfg.schedule.prefill_from_actor == "true":
                    raise PrefillBudgetError(f"schedule.prefill_from_actor=true: {what}")
                if not getattr(self, "_told_budget", False):
                    log.warning("schedule.prefill_from_actor=auto: %s; the rollout prefills those prompts itself", what)
                    self._told_budget = True
                return []
        return first

    def _prefill_before_decode(self, step_prompts, groups: list[int], t: dict[str, float]):
        """Encode the actor prefixes of ``groups`` (with their graph, kept for the update) on the
        whole device before decode; returns (global group index -> the state without its graph, for
        the rollout engine, and the call's results in ``_observe``'s form)."""
        if not groups:
            return None, []
        with self.timeline.span("prefix_before", "train", t):
            out = self.workers.train.precompute_prefixes(step_prompts, groups, ["actor"], self.weights_version,
                                                         export=True).result()
        prefixes = {}
        for dp, result in out:
            mine = [g for g in groups if step_prompts.rank_of_group[g] == dp]
            prefixes.update(zip(mine, result.pop("prefix/states")))
        return prefixes, out

    def _plan(self, step_prompts, handed: list[int] = ()) -> WindowPlan:
        """One window plan per DP rank over its own groups (each device decodes and encodes only
        its groups), merged: the window and after tasks of every rank (global group indices, in
        run order), the shares and predictions of the rank with the longest predicted window (all
        devices run the same share, and the driver waits for the slowest)."""
        mini = self.groups_per_mini_batch(len(step_prompts.prompts))
        plans = []
        for groups in step_prompts.groups_of_dp:
            if not groups:
                continue
            first = sum(g < mini for g in groups)  # this rank's groups in the first mini-batch
            held = sum(step_prompts.prompts[g].prompt_length for g in groups if g in handed)
            graph = self._graph([step_prompts.prompts[g] for g in groups], first, actor_movable=not handed)
            plan = self.planner.plan(graph, self.cost, int(held * self.bytes_per_token.get("actor", 0.0)))
            plan = self._with_chunks(plan, graph, self.cfg.rollout.n * len(groups))
            keep = (lambda n: first > 0 or "/actor/" not in n)  # no actor prefix ahead of a foreign step
            plans.append(replace(plan, window_tasks=_globalise([n for n in plan.window_tasks if keep(n)], groups),
                                 after_tasks=_globalise([n for n in plan.after_tasks if keep(n)], groups)))
        lead = max(plans, key=lambda p: (p.predicted_s or 0.0, len(p.window_tasks)))
        return replace(lead, window_tasks=_run_order([t for p in plans for t in p.window_tasks]),
                       after_tasks=_run_order([t for p in plans for t in p.after_tasks]),
                       window_bytes=max(p.window_bytes for p in plans))

    def chunk_layout(self, rows: int) -> tuple[list[int], list[int], int]:
        """The reference suffix chunks of a window over ``rows`` responses of ``rollout.max_new_tokens``
        tokens, chunk size ``schedule.suffix_chunk_tokens``: (decoded tokens at which each chunk can
        start, its input tokens over all rows, the last chunk's input tokens, run after decode).
        Chunk ends follow ``models.prefix.chunk_end`` (what the train worker will run)."""
        every, width = self.cfg.schedule.suffix_chunk_tokens, self.cfg.rollout.max_new_tokens
        bounds, tokens, scored = [], [], 0
        for decoded in range(every, width, every):  # the engine reports progress every `every` steps
            end = chunk_end(scored, decoded, width)
            if end > scored:
                bounds.append(decoded)
                tokens.append((end - scored) * rows)
                scored = end
        return bounds, tokens, (width - 1 - scored) * rows

    def _with_chunks(self, plan: WindowPlan, graph, rows: int) -> WindowPlan:
        """``plan``, or the planner's plan with reference suffix chunks in the window
        (``PhasePlanner.stream_chunks``) where they can run (``Config.suffix_chunks_possible``)."""
        if not self.cfg.suffix_chunks_possible():
            return plan
        budget = self.planner.memory_budget_bytes
        if budget is not None:  # each group's chunk buffers hold (prompt + R - 1) positions per row across decode
            width = self.cfg.rollout.max_new_tokens - 1
            per_token = self.bytes_per_token.get("ref")
            need = None if per_token is None else sum(
                self.cfg.rollout.n * (t.tokens + width) for t in graph.movable() if t.kind == "prefix/ref") * per_token
            if need is None or need + plan.window_bytes > budget:
                return plan
        bounds, tokens, final = self.chunk_layout(rows)
        return self.planner.stream_chunks(plan, graph, self.cost, bounds, tokens, final,
                                          calibrating=plan.mode == "profile_split")

    def _graph(self, prompts: list[PromptSample], first_groups: int, actor_movable: bool = True):
        """The task graph of one DP rank's groups; the first ``first_groups`` of them belong to the
        first global mini-batch (their actor prefixes may run in the window, unless they run before
        decode: ``actor_movable=False``; with the old-policy reuse they need no old-policy prefix)."""
        cfg = self.cfg
        return build_step_graph(
            [p.prompt_length for p in prompts], self.response_tokens, decode_steps=self.decode_steps,
            mini_batch_groups=max(1, first_groups),
            needs_reference=cfg.algorithm.needs_reference, weights_version=self.weights_version,
            prefix_bytes_per_token=max(self.bytes_per_token.get("old", 0.0), self.bytes_per_token.get("ref", 0.0)),
            actor_bytes_per_token=self.bytes_per_token.get("actor", 0.0),
            old_from_actor_groups=first_groups if self.old_from_actor else 0,
            actor_prefixes_movable=actor_movable,
        )

    def _set_share(self, wanted: tuple[int, int], current: tuple[int, int], t: dict[str, float]) -> tuple[int, int]:
        """Change the (rollout, train) thread shares if ``wanted`` differs from ``current``; the round
        trip is the measured switching cost. Returns the shares now in effect."""
        if wanted != current:
            with self.timeline.span("reshare", "driver", t):
                begin = time.perf_counter()
                self.workers.share_threads(*wanted)
                self.cost.observe_switch(time.perf_counter() - begin)
        return wanted

    def _submit(self, step_prompts, calls: list[tuple[str, list[int]]]) -> list:
        """One Pending per prefix call, each fanned out to the DP ranks that own its groups."""
        return [self.workers.train.precompute_prefixes(step_prompts, groups, [role], self.weights_version)
                for role, groups in calls]

    def decode_tail_possible(self) -> bool:
        """Whether suffixes may be scored beside the decode tail: groups can finish at different
        decode steps (EOS or stop strings end responses; not under ``rollout.ignore_eos``), the
        schedule streams suffixes (``schedule.stream_suffix``) and the device has two threads.
        Under ``ignore_eos`` the one tail left — the builtin engine's later chunks of more than
        ``rollout.max_batch_size`` sequences — is given up."""
        return self.cfg.schedule.stream_suffix and self.workers.threads > 1 and not self.cfg.rollout.ignore_eos

    def _serial_rollout(self, plan: WindowPlan, step_prompts, step: int, t: dict[str, float],
                        prefixes: Optional[dict], before: list):
        """A step whose plan overlaps nothing (after the whole-device calibration steps) and whose
        decode has no tail to use: the serial schedule's own rollout phase (one ``generate`` call,
        from the handed-over ``prefixes`` where there are some), so that the step costs what the
        serial schedule's does; the other prefixes run inside the later phases, as there. The
        decode rate still feeds the cost model."""
        self.streamed = {"actor": {}, "ref": {}}
        self.ref_pass_measurable = False  # its reference prefixes run inside the reference phase
        gen_start = self.timeline.now()
        responses, metrics = super().rollout_phase(step_prompts, step, t, prefixes)
        gen_end = self.timeline.now()
        self._observe(responses, before, self.workers.rollout.decode_stats(), len(step_prompts.prompts))
        metrics.update(self._metrics(plan, [r for _, r in before], gen_start, gen_end))
        metrics["rollplex/prefill_from_actor_groups"] = float(len(prefixes or ()))
        metrics.update({"rollplex/prefix_hidden_frac": 0.0, "rollplex/serial_step": 1.0,
                        "rollplex/tail_groups": 0.0})
        return responses, metrics

    def rollout_phase(self, step_prompts, step: int, t: dict[str, float]):
        w, tl, total = self.workers, self.timeline, self.workers.threads
        prompts = step_prompts.prompts
        handed = self._prefill_groups(step_prompts)
        plan = self.last_plan = self._plan(step_prompts, handed)
        prefixes, before = self._prefill_before_decode(step_prompts, handed, t)
        # profile_serial steps measure the prefix rates on the whole device: they keep the rollplex path
        if plan.mode != "profile_serial" and not plan.overlaps and not self.decode_tail_possible():
            return self._serial_rollout(plan, step_prompts, step, t, prefixes, before)
        full = (total, total)
        split = (plan.decode_share, plan.train_share) if plan.overlaps else w.halves()
        stream_suffix = self.cfg.schedule.stream_suffix and total > 1 and plan.mode != "profile_serial"
        self.streamed = {"actor": {}, "ref": {}}
        # tail suffixes: old log-probs (role "actor") only where no mini-batch reuses the actor's forward
        roles = ([] if self.old_from_actor else ["actor"]) + (["ref"] if self.cfg.algorithm.needs_reference else [])
        groups: dict[int, list] = {}
        submitted: set[int] = set()
        tail: list[tuple[list[int], list, list]] = []  # suffix calls in flight: (prompt indices, roles, refs)
        # shares change only while the training worker is idle (its calls run in order)
        share = self._set_share(split if plan.overlaps else full, full, t)
        chunks = bool(plan.chunk_bounds)
        self.ref_pass_measurable = not chunks  # every reference prefix runs in the window or after it
        chunk_calls: list = []  # reference suffix chunk calls (Pending), in order
        decoded: dict[int, torch.Tensor] = {}  # group -> tokens so far, not yet sent to a chunk call
        with tl.span("gen", "rollout", t):
            gen_start = tl.now()
            stream = w.rollout.generate_stream(step_prompts, sampling_params(self.cfg, step), self.weights_version,
                                               prefixes, self.cfg.schedule.suffix_chunk_tokens if chunks else 0)
            window = self._submit(step_prompts, prefix_calls(plan.window_tasks)) if plan.overlaps else []
            pending, decoding = list(window), True
            while decoding:
                wait_first([stream.next_future(), *pending, *(p for *_, ps in tail for p in ps),
                            *(c for c in chunk_calls[-1:] if not c.done())])
                for r in stream.take():
                    groups.setdefault(r.prompt_index, []).append(r)
                decoded.update((p.prompt_index, p.token_ids) for p in stream.take_progress())
                if decoded and not (chunk_calls and not chunk_calls[-1].done()):  # one chunk call in flight
                    chunk_calls.append(w.train.score_suffix_chunks(step_prompts, "ref", decoded,
                                                                   self.cfg.rollout.max_new_tokens,
                                                                   self.weights_version))
                    decoded = {}
                n_done = sum(len(rs) == self.cfg.rollout.n for rs in groups.values())
                decoding = n_done < len(prompts) and not stream.finished  # groups still decoding: the tail
                pending = [p for p in pending if not p.done()]
                self._collect_tail(tail, wait=False)
                fresh = sorted(set(groups) - submitted)
                start_tail = decoding and stream_suffix and bool(roles) and bool(fresh) and not pending and not tail
                share = self._set_share(split if pending or tail or start_tail or chunks else full, share, t)
                if start_tail:  # suffix tasks of the groups already finished, beside the decode tail
                    batch = batching.groups_batch(prompts, groups, fresh, self.pad_id)
                    temp = self.cfg.rollout.temperature
                    parts = w.train.parts(batch, self.step_prompts_for(batch), len(batch.prompts))
                    tail.append((fresh, roles, [w.train.compute_log_probs(parts, role, temp, batch.num_responses)
                                                for role in roles]))
                    submitted.update(fresh)
            gen_end = tl.now()
        if pending or tail or (chunk_calls and not chunk_calls[-1].done()):
            with tl.span("prefix_exposed", "train", t):  # window / tail work that outlasted decode
                get_all(pending)
                self._collect_tail(tail, wait=True)
                get_all(chunk_calls)
        self._set_share(full, share, t)
        chunk_results = [r for per_dp in get_all(chunk_calls) for _, r in per_dp]
        if chunks:  # the pass's last chunk, on the whole device
            with tl.span("suffix_after", "train", t):
                last = {g: torch.stack([r.token_ids for r in groups[g]]) for g in range(len(prompts))}
                final = [r for _, r in w.train.score_suffix_chunks(step_prompts, "ref", last,
                                                                  self.cfg.rollout.max_new_tokens,
                                                                  self.weights_version, final=True).result()]
            self._observe_chunks(chunk_results, final)
            chunk_results += final
        tail_role = {"old": "actor", "ref": "ref"}  # prefix role -> the suffix role scored in the tail
        after_tasks = [n for n in plan.after_tasks  # groups whose old/ref suffixes already ran need no prefix
                       if n.split("/")[1] == "actor" or int(n.split("/")[2][1:]) not in self.streamed[tail_role[n.split("/")[1]]]]
        with tl.span("prefix_after", "train", t):
            after = get_all(self._submit(step_prompts, prefix_calls(after_tasks)))
        results = [r for per_dp in [before] + get_all(window) + after for r in per_dp]  # (dp, result dict)
        responses = [r for i in range(len(prompts)) for r in groups[i]]
        self._observe(responses, results, w.rollout.decode_stats(), len(prompts))
        metrics = self._metrics(plan, [r for _, r in results], gen_start, gen_end, chunk_results)
        metrics["rollplex/tail_groups"] = float(max(len(v) for v in self.streamed.values()))
        metrics["rollplex/serial_step"] = 0.0
        metrics["rollplex/prefill_from_actor_groups"] = float(len(handed))
        return responses, metrics

    def _collect_tail(self, tail: list, wait: bool) -> None:
        """Move finished suffix calls of the decode tail into ``self.streamed[role][prompt index]``
        ((n, R_g) log-probs of that group's rows); ``wait=True`` waits for all."""
        n = self.cfg.rollout.n
        for entry in list(tail):
            indices, roles, pendings = entry
            if not wait and not all(p.done() for p in pendings):
                continue
            tail.remove(entry)
            for role, logp in zip(roles, get_all(pendings)):
                for k, i in enumerate(indices):  # groups_batch keeps each group's n rows together, in order
                    self.streamed[role][i] = logp[k * n : (k + 1) * n]

    def log_probs(self, batch, role: str, temperature: float):
        """Suffix log-probs: groups scored during the decode tail are reused, the rest computed now."""
        scored = self.streamed.get(role, {})
        if not scored:
            begin = time.perf_counter()
            out = super().log_probs(batch, role, temperature)
            if role == "ref" and self.ref_pass_measurable and self.cfg.suffix_chunks_possible():
                # the whole pass in one call: the chunks' baseline
                # per device, as the planner plans each DP rank: the rank with the most tokens ends last
                tokens = max(suffix_input_tokens(batch, groups) for groups in self.step_prompts.groups_of_dp)
                self.cost.observe("suffix/ref", tokens, self.workers.threads, time.perf_counter() - begin)
            return out
        out = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
        missing = [g for g in range(len(batch.prompts)) if g not in scored]
        if missing:
            logp = super().log_probs(batch.select_groups(missing), role, temperature)
            out[batching.group_rows(batch, missing), : logp.shape[1]] = logp
        for g, logp in scored.items():
            out[batching.group_rows(batch, [g]), : logp.shape[1]] = logp
        return out

    def _observe(self, responses, results: list[tuple[int, dict]], decode_stats: dict, num_groups: int) -> None:
        """Update the cost model and the graph's size estimates with this step's measurements."""
        for threads, (seconds, steps) in decode_stats.items():
            self.cost.observe("decode", steps, threads, seconds)
        self.decode_steps = max(1, sum(steps for _, steps in decode_stats.values()))
        held: dict[int, float] = defaultdict(float)  # per DP rank: bytes held before the call
        for dp, r in results:
            threads = int(r["prefix/threads"])
            for role in ("old", "ref", "actor"):
                if f"prefix/{role}/seconds" in r:
                    tokens = int(r[f"prefix/{role}/tokens"])
                    self.cost.observe(f"prefix/{role}", tokens, threads, r[f"prefix/{role}/seconds"])
                    self.bytes_per_token[role] = max(0.0, r["prefix/bytes_held"] - held[dp]) / max(1, tokens)
            held[dp] = r["prefix/bytes_held"]
        self.response_tokens = max(1, round(sum(len(x.token_ids) for x in responses) / num_groups))

    def _observe_chunks(self, window: list[dict], final: list[dict]) -> None:
        """Feed the reference suffix chunk rates into the cost model (kind ``chunk/ref``): the
        window's calls summed per thread count (one observation a step), and the last chunks run on
        the whole device. A chunk's rate is not the one-call pass's (``suffix/ref``): a chunk's GEMMs
        have fewer rows and its attention reads the pass's whole key/value width."""
        for results in (window, final):
            by_threads: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
            for r in results:
                entry = by_threads[int(r["suffix/threads"])]
                entry[0] += r["suffix/ref/seconds"]
                entry[1] += r["suffix/ref/tokens"]
            for threads, (seconds, tokens) in by_threads.items():
                self.cost.observe("chunk/ref", int(tokens), threads, seconds)

    def _metrics(self, plan: WindowPlan, results: list[dict], gen_start: float, gen_end: float,
                 chunk_results: list[dict] = ()) -> dict[str, float]:
        """Spans of the worker-side prefix tasks and reference suffix chunks, hidden/idle fractions
        and the planner's numbers."""
        tl = self.timeline
        chunk_s = chunk_hidden_s = 0.0
        for r in chunk_results:
            start, end = r["suffix/start_time"] - tl.origin, r["suffix/end_time"] - tl.origin
            tl.add("suffix(ref)", "train", start, end)
            chunk_s += end - start
            chunk_hidden_s += max(0.0, min(end, gen_end) - max(start, gen_start))
        prefix_s = hidden_s = 0.0  # hidden: prefix seconds inside the decode window
        by_role: dict[str, float] = defaultdict(float)
        for r in results:
            start, end = r["prefix/start_time"] - tl.origin, r["prefix/end_time"] - tl.origin
            roles = [k.split("/")[1] for k in r if k.endswith("/seconds") and k.count("/") == 2]
            tl.add(f"prefix({','.join(roles)})", "train", start, end)
            for role in roles:
                by_role[role] += r[f"prefix/{role}/seconds"]
            prefix_s += end - start
            hidden_s += max(0.0, min(end, gen_end) - max(start, gen_start))
        decode_s = gen_end - gen_start
        metrics = {
            "rollplex/prefix_s": prefix_s,
            "rollplex/prefix_hidden_frac": hidden_s / prefix_s if prefix_s > 0 else 1.0,
            "rollplex/decode_idle_frac": max(0.0, decode_s - hidden_s) / decode_s if decode_s > 0 else 0.0,
            "rollplex/window_tasks": float(len(plan.window_tasks)),
            "rollplex/after_tasks": float(len(plan.after_tasks)),
            "rollplex/window_bytes": float(plan.window_bytes),
            "planner/decode_share": float(plan.decode_share),
            "planner/train_share": float(plan.train_share),
            "planner/profiling": float(plan.mode != "plan"),
            "planner/actual_s": max([gen_end, *(r["prefix/end_time"] - tl.origin for r in results),
                                     *(r["suffix/end_time"] - tl.origin for r in chunk_results)]) - gen_start,
            "rollplex/suffix_chunks_s": chunk_s,
            "rollplex/suffix_chunks_hidden_s": chunk_hidden_s,
            "rollplex/suffix_chunks": float(len(plan.chunk_bounds)),
            "prefix/bytes_held": results[-1]["prefix/bytes_held"] if results else 0.0,
        }
        metrics["rollplex/planned_gain_s"] = plan.planned_gain_s  # over no overlap; 0 when none is planned
        metrics["rollplex/realised_gain_s"] = self.planner.realised_gain_s(plan, self.cost, self.decode_steps,
                                                                           metrics["planner/actual_s"])
        metrics.update({f"timing_s/prefix_{role}": s for role, s in by_role.items()})
        metrics.update(self.cost.metrics())
        if plan.predicted_s is not None:
            metrics["planner/predicted_s"] = plan.predicted_s
            metrics["planner/predicted_no_overlap_s"] = plan.predicted_no_overlap_s
        if self.cost.switch_s is not None:
            metrics["planner/switch_s"] = self.cost.switch_s
        return metrics
