"""The rollplex step's decode-window plan over its DP ranks, and the measurements it is made from.

Each DP rank decodes and encodes only its own groups, so each gets a task graph of its groups
(``runtime/graph.py``, global prompt indices) and a plan of the phase planner
(``runtime/planner.py``) under the measured :class:`Estimates`; the plans are merged into one
(every device runs the same share, and the driver waits for the slowest). Also decided here: which
groups' actor prefixes are encoded before decode and handed to the rollout
(``schedule.prefill_from_actor``), and where the reference suffix chunks go
(``schedule.suffix_chunk_tokens``).

:class:`Estimates` holds the planner's inputs that the run measures: the cost model
(``runtime/cost_model.py``: decode per thread count, prefix per role and thread count, the re-share
cost, reference suffix chunks ``chunk/ref`` and the one-call reference suffix pass ``suffix/ref``)
and the graph's size estimates (response tokens per group, decode steps, prefix-state bytes per
prompt token). It is kept in checkpoints, so a resumed run plans without re-profiling.
:func:`window_metrics` turns one step's worker results into the ``rollplex/*`` and ``planner/*``
metrics and the timeline's worker spans.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field, replace

from rollplex_train.config import Config
from rollplex_train.data.types import Response, TrainBatch
from rollplex_train.models.prefix import chunk_end
from rollplex_train.runtime.cost_model import CostModel
from rollplex_train.runtime.graph import StepGraph, build_step_graph
from rollplex_train.runtime.planner import PhasePlanner, WindowPlan, run_order
from rollplex_train.runtime.timeline import Timeline
from rollplex_train.training.base import ChunkResult, PrefixResult

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


def suffix_input_tokens(batch: TrainBatch, groups: list[int]) -> int:
    """Input tokens of the suffix pass over ``groups`` of ``batch`` as the chunks count them: per
    group, its rows times (its longest response - 1) (the last response token is no input; shorter
    rows are padded to the longest)."""
    lengths = batch.response_mask.sum(-1)
    return sum(len(rows) * max(0, int(lengths[rows].max()) - 1) for rows in (batch.rows_of([g]) for g in groups))


@dataclass
class Estimates:
    """The planner's measured inputs (see the module docstring).

    Attributes:
        cost: the online cost model. response_tokens: expected response tokens per group (all n
            responses). decode_steps: expected decode steps of the whole rollout.
        bytes_per_token: prefix-state bytes per prompt token, by role (``old``/``ref``/``actor``).
    """

    response_tokens: int
    decode_steps: int
    cost: CostModel = field(default_factory=CostModel)
    bytes_per_token: dict[str, float] = field(default_factory=dict)

    def observe(self, responses: list[Response], results: list[PrefixResult], decode_stats: dict,
                num_groups: int) -> None:
        """Feed one step's decode (``{threads: (seconds, steps)}``) and prefix calls (in call order)
        into the cost model and the size estimates."""
        for threads, (seconds, steps) in decode_stats.items():
            self.cost.observe("decode", steps, threads, seconds)
        self.decode_steps = max(1, sum(steps for _, steps in decode_stats.values()))
        held: dict[int, float] = defaultdict(float)  # per DP rank: bytes held before the call
        for r in results:
            for role, seconds in r.seconds.items():
                self.cost.observe(f"prefix/{role}", r.tokens[role], r.threads, seconds)
                self.bytes_per_token[role] = max(0.0, r.bytes_held - held[r.dp]) / max(1, r.tokens[role])
            held[r.dp] = r.bytes_held
        self.response_tokens = max(1, round(sum(len(x.token_ids) for x in responses) / num_groups))

    def observe_chunks(self, window: list[ChunkResult], final: list[ChunkResult]) -> None:
        """Feed the reference suffix chunk rates into the cost model (kind ``chunk/ref``): the
        window's calls summed per thread count (one observation a step), and the last chunks run on
        the whole device. A chunk's rate is not the one-call pass's (``suffix/ref``): a chunk's GEMMs
        have fewer rows and its attention reads the pass's whole key/value width."""
        for results in (window, final):
            by_threads: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
            for r in results:
                by_threads[r.threads][0] += r.seconds
                by_threads[r.threads][1] += r.tokens
            for threads, (seconds, tokens) in by_threads.items():
                self.cost.observe("chunk/ref", int(tokens), threads, seconds)

    def state_dict(self) -> dict:
        return {"cost": self.cost.state_dict(), "response_tokens": self.response_tokens,
                "decode_steps": self.decode_steps, "bytes_per_token": dict(self.bytes_per_token)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (``{}``: a checkpoint written by another schedule: kept as is)."""
        if not state:
            return
        self.cost.load_state_dict(state["cost"])
        rename_old_chunk_rates(self.cost)
        self.response_tokens, self.decode_steps = int(state["response_tokens"]), int(state["decode_steps"])
        self.bytes_per_token = {k: float(v) for k, v in state["bytes_per_token"].items()}


def window_metrics(plan: WindowPlan, results: list[PrefixResult], chunks: list[ChunkResult], gen_start: float,
                   gen_end: float, timeline: Timeline, estimates: Estimates) -> dict[str, float]:
    """The worker-side prefix tasks and reference suffix chunks put on ``timeline``; their seconds,
    hidden/idle fractions and the planner's numbers as metrics. Feeds the realised gain of an
    overlapped step into the cost model (``PhasePlanner.realised_gain_s``).

    Args:
        gen_start / gen_end: the decode window, seconds from the step's start.
    """
    origin = timeline.origin
    chunk_s = chunk_hidden_s = 0.0
    for r in chunks:
        start, end = r.start_time - origin, r.end_time - origin
        timeline.add("suffix(ref)", "train", start, end)
        chunk_s += end - start
        chunk_hidden_s += max(0.0, min(end, gen_end) - max(start, gen_start))
    prefix_s = hidden_s = 0.0  # hidden: prefix seconds inside the decode window
    by_role: dict[str, float] = defaultdict(float)
    for r in results:
        start, end = r.start_time - origin, r.end_time - origin
        timeline.add(f"prefix({','.join(r.seconds)})", "train", start, end)
        for role, seconds in r.seconds.items():
            by_role[role] += seconds
        prefix_s += end - start
        hidden_s += max(0.0, min(end, gen_end) - max(start, gen_start))
    decode_s, cost = gen_end - gen_start, estimates.cost
    actual_s = max([gen_end, *(r.end_time - origin for r in results), *(r.end_time - origin for r in chunks)]) - gen_start
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
        "planner/actual_s": actual_s,
        "rollplex/suffix_chunks_s": chunk_s,
        "rollplex/suffix_chunks_hidden_s": chunk_hidden_s,
        "rollplex/suffix_chunks": float(len(plan.chunk_bounds)),
        "prefix/bytes_held": results[-1].bytes_held if results else 0.0,
        "rollplex/planned_gain_s": plan.planned_gain_s,  # over no overlap; 0 when none is planned
        "rollplex/realised_gain_s": PhasePlanner.realised_gain_s(plan, cost, estimates.decode_steps, actual_s),
    }
    metrics.update({f"timing_s/prefix_{role}": s for role, s in by_role.items()})
    metrics.update(cost.metrics())
    if plan.predicted_s is not None:
        metrics["planner/predicted_s"] = plan.predicted_s
        metrics["planner/predicted_no_overlap_s"] = plan.predicted_no_overlap_s
    if cost.switch_s is not None:
        metrics["planner/switch_s"] = cost.switch_s
    return metrics


class WindowPlanner:
    """Plans the decode window of each rollplex step.

    Args:
        cfg: the run's config (resolved: ``schedule.prefill_from_actor`` is ``false`` and
            ``schedule.suffix_chunk_tokens`` 0 where the engines cannot honour them).
        threads: torch threads of one device (the planner's share units).
        old_from_actor: the first mini-batch takes its old-policy log-probs from the actor's forward
            (its groups need no old-policy prefix).
    """

    def __init__(self, cfg: Config, threads: int, old_from_actor: bool):
        budget = cfg.schedule.prefix_memory_gib
        self.cfg, self.old_from_actor = cfg, old_from_actor
        self.planner = PhasePlanner(threads, None if budget is None else int(budget * GIB))
        # per group and of the whole rollout, until measured
        self.estimates = Estimates(cfg.rollout.n * cfg.rollout.max_new_tokens, cfg.rollout.max_new_tokens)
        self._told_budget = False

    def prefill_groups(self, placed) -> list[int]:
        """The global prompt indices whose actor prefixes are encoded before decode and handed to
        the rollout (``schedule.prefill_from_actor``): the first mini-batch's (encoded under the
        rollout's weights, as the first optimizer step needs them), none when off or when their
        states would not fit the memory budget (``schedule.prefix_memory_gib``, per DP rank) across
        decode (said once under ``auto``).

        Raises:
            PrefillBudgetError: over the budget under ``schedule.prefill_from_actor=true``.
        """
        cfg, prompts = self.cfg, placed.prompts
        if cfg.schedule.prefill_from_actor == "false":
            return []
        first = placed.first_mini_batch
        budget = self.planner.memory_budget_bytes
        if budget is not None:
            per_dp = [sum(prompts[g].prompt_length for g in first if placed.rank_of_group[g] == dp)
                      for dp in range(len(placed.groups_of_dp))]
            need = max(per_dp) * self.estimates.bytes_per_token.get("actor", 0.0)  # 0 until the first step measured it
            if need > budget:
                what = (f"the first mini-batch's actor prefixes take {need / GIB:.3g} GiB across decode, over "
                        f"schedule.prefix_memory_gib={cfg.schedule.prefix_memory_gib}")
                if cfg.schedule.prefill_from_actor == "true":
                    raise PrefillBudgetError(f"schedule.prefill_from_actor=true: {what}")
                if not self._told_budget:
                    log.warning("schedule.prefill_from_actor=auto: %s; the rollout prefills those prompts itself", what)
                    self._told_budget = True
                return []
        return first

    def plan(self, placed, version: int, handed: list[int]) -> WindowPlan:
        """One plan per DP rank over its own groups, merged: the window and after tasks of every rank
        (global prompt indices, in run order), the shares and predictions of the rank with the
        longest predicted window. ``handed``: the groups whose actor prefixes run before decode."""
        mini, estimates = placed.groups_per_mini_batch, self.estimates
        plans = []
        for groups in placed.groups_of_dp:
            if not groups:
                continue
            first = sum(g < mini for g in groups)  # this rank's groups in the first mini-batch
            held = sum(placed.prompts[g].prompt_length for g in groups if g in handed)
            graph = self._graph(placed, groups, first, estimates, version, actor_movable=not handed)
            plan = self.planner.plan(graph, estimates.cost, int(held * estimates.bytes_per_token.get("actor", 0.0)))
            plan = self._with_chunks(plan, graph, self.cfg.rollout.n * len(groups), estimates)
            keep = (lambda t: first > 0 or t.role != "actor")  # no actor prefix ahead of a foreign step
            plans.append(replace(plan, window_tasks=[t for t in plan.window_tasks if keep(t)],
                                 after_tasks=[t for t in plan.after_tasks if keep(t)]))
        lead = max(plans, key=lambda p: (p.predicted_s or 0.0, len(p.window_tasks)))
        return replace(lead, window_tasks=run_order([t for p in plans for t in p.window_tasks]),
                       after_tasks=run_order([t for p in plans for t in p.after_tasks]),
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

    def _with_chunks(self, plan: WindowPlan, graph: StepGraph, rows: int, estimates: Estimates) -> WindowPlan:
        """``plan``, or the planner's plan with reference suffix chunks in the window
        (``PhasePlanner.stream_chunks``) where they are on and their buffers fit the budget."""
        if self.cfg.schedule.suffix_chunk_tokens == 0:
            return plan
        budget = self.planner.memory_budget_bytes
        if budget is not None:  # each group's chunk buffers hold (prompt + R - 1) positions per row across decode
            width = self.cfg.rollout.max_new_tokens - 1
            per_token = estimates.bytes_per_token.get("ref")
            need = None if per_token is None else sum(
                self.cfg.rollout.n * (t.tokens + width) for t in graph.movable() if t.kind == "prefix/ref") * per_token
            if need is None or need + plan.window_bytes > budget:
                return plan
        bounds, tokens, final = self.chunk_layout(rows)
        return self.planner.stream_chunks(plan, graph, estimates.cost, bounds, tokens, final,
                                          calibrating=plan.mode == "profile_split")

    def _graph(self, placed, groups: list[int], first_groups: int, estimates: Estimates, version: int,
               actor_movable: bool) -> StepGraph:
        """The task graph of one DP rank's ``groups`` (global prompt indices); the first
        ``first_groups`` of them belong to the first global mini-batch (their actor prefixes may run
        in the window, unless they run before decode: ``actor_movable=False``; with the old-policy
        reuse they need no old-policy prefix)."""
        cfg, per_token = self.cfg, estimates.bytes_per_token
        return build_step_graph(
            [placed.prompts[g].prompt_length for g in groups], estimates.response_tokens,
            decode_steps=estimates.decode_steps, mini_batch_groups=max(1, first_groups),
            needs_reference=cfg.algorithm.needs_reference, weights_version=version,
            prefix_bytes_per_token=max(per_token.get("old", 0.0), per_token.get("ref", 0.0)),
            actor_bytes_per_token=per_token.get("actor", 0.0),
            old_from_actor_groups=first_groups if self.old_from_actor else 0,
            actor_prefixes_movable=actor_movable, groups=groups,
        )
