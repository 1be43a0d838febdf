"""The phase planner: which prefix tasks run inside the decode window, and on what device share.

Given the step graph, the cost model and the device (``total`` share units: threads on CPU), the
planner compares placements and keeps the one with the shortest predicted time to the end of the
prefix work:

* **no overlap** — decode on the whole device, then every prefix task on the whole device;
* **overlap at (d, c)** for every split ``d + c = total`` — decode on ``d`` units while the train
  worker runs prefix tasks on ``c`` units; tasks are admitted in order of value (seconds they save
  after decode per second they take in the window) while they fit the *decode time left* (the
  overlap must end before decode does) and the *memory budget* (bytes of prefix state kept alive
  until their suffix tasks run). When the admitted tasks are done the decoder gets the whole device
  back for the rest of the window. Tasks not admitted run after decode on the whole device.

An overlap is chosen only when its predicted gain over no overlap exceeds a *margin* (:meth:`PhasePlanner.margin_s`):
the measured cost of sharing the device is already in the prediction (decode's rate at its share
of the device, measured while the window's prefix tasks ran beside it), and the margin adds
``MARGIN_Z`` times the measured step-to-step noise of the terms in which the two predictions
differ (the window's tasks and the decode steps beside them; the rest is common), the measured shortfall
of earlier overlapped steps (planned minus realised gain, ``CostModel.observe_gain``) and
``MIN_MARGIN_FRAC`` of the step. Otherwise the planner falls back to no overlap, so a step is not
planned slower than the same step without overlap. The schedule logs the planned gain and the
realised one (``rollplex/planned_gain_s``, ``rollplex/realised_gain_s``; :meth:`PhasePlanner.realised_gain_s`).

Only movable tasks (prefix tasks under the rollout's weights version) are ever placed in the window.
While the cost model lacks a measurement the planner returns a *profiling* plan: no overlap until
decode and every prefix kind have a post-warm-up measurement on the whole device (two steps), then
one step at the even split (measures both sides at the split), then planned steps.

Pure Python: no Ray, no tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

from rollplex_train.runtime.cost_model import CostModel
from rollplex_train.runtime.graph import StepGraph, Task

DEFAULT_SWITCH_S = 0.005
"""Assumed cost of one re-share until it is measured (seconds)."""
MARGIN_Z = 2.0
"""Standard deviations of measured rate noise an overlap's gain must clear."""
MIN_MARGIN_FRAC = 0.01
"""Smallest margin, as a fraction of the no-overlap time (re-share and bookkeeping costs that the
model does not see)."""


@dataclass
class WindowPlan:
    """Placement of the movable tasks for one decode window.

    Attributes:
        mode: ``plan`` (chosen by prediction), ``profile_serial`` or ``profile_split`` (calibration).
        decode_share / train_share: device units (threads) of the rollout and train workers while
            the window tasks run (``train_share == 0``: no overlap).
        window_tasks: the tasks to run inside the window, in run order (:func:`run_order`).
        after_tasks: movable tasks left for after decode (run on the whole device), in run order.
        predicted_s: predicted seconds from decode start to the end of all movable work.
        predicted_no_overlap_s: the same for the no-overlap placement (the planner's baseline).
        window_bytes: prefix-state bytes the window tasks leave alive.
        candidates: predicted seconds of every placement considered, by name.
        planned_gain_s: predicted seconds saved over no overlap (0 without overlap).
        margin_s: the gain an overlap had to exceed to be chosen (seconds).
        prefix_full_s: predicted seconds of all movable tasks on the whole device (the no-overlap
            placement's prefix work; the realised gain is measured against it).
    """

    mode: str
    decode_share: int
    train_share: int
    window_tasks: list[Task] = field(default_factory=list)
    after_tasks: list[Task] = field(default_factory=list)
    predicted_s: Optional[float] = None
    predicted_no_overlap_s: Optional[float] = None
    window_bytes: int = 0
    candidates: dict[str, float] = field(default_factory=dict)
    planned_gain_s: float = 0.0
    margin_s: float = 0.0
    prefix_full_s: Optional[float] = None
    chunk_bounds: list[int] = field(default_factory=list)
    """Decoded tokens at which the window scores reference suffix chunks (:meth:`PhasePlanner.stream_chunks`;
    empty: no chunks). The pass's last chunk runs after decode on the whole device."""
    suffix_full_s: Optional[float] = None
    """With chunks: predicted seconds of the whole reference suffix pass on the whole device (the
    no-overlap placement's; the realised gain is measured against it)."""

    @property
    def overlaps(self) -> bool:
        return self.train_share > 0 and (bool(self.window_tasks) or bool(self.chunk_bounds))


def run_order(tasks: list[Task]) -> list[Task]:
    """``tasks`` in the order the suffix passes consume them — old-policy, reference, then actor
    prefixes, each by group — so consecutive tasks of one role batch into one worker call."""
    rank = {"prefix/old": 0, "prefix/ref": 1, "prefix/actor": 2}
    return sorted(tasks, key=lambda t: (rank.get(t.kind, 3), t.group or 0))


@dataclass(frozen=True)
class PrefixCall:
    """One worker call of prefix tasks: ``role`` (``old``/``ref``/``actor``) over the global prompt
    indices ``groups``, in order."""

    role: str
    groups: tuple[int, ...]


def prefix_calls(tasks: list[Task]) -> list[PrefixCall]:
    """Consecutive same-role prefix tasks batched into worker calls, in task order."""
    calls: list[PrefixCall] = []
    for t in tasks:
        if calls and calls[-1].role == t.role:
            calls[-1] = PrefixCall(t.role, calls[-1].groups + (t.group,))
        else:
            calls.append(PrefixCall(t.role, (t.group,)))
    return calls


class PhasePlanner:
    """Places the movable tasks of a step graph into the decode window.

    Args:
        total_share: device units to divide (CPU threads of the colocated workers).
        memory_budget_bytes: most prefix-state bytes the window may leave alive (None: no limit).
    """

    def __init__(self, total_share: int, memory_budget_bytes: Optional[int] = None):
        if total_share < 1:
            raise ValueError(f"total_share={total_share}: expected >= 1")
        self.total = total_share
        self.memory_budget_bytes = memory_budget_bytes

    def plan(self, graph: StepGraph, cost: CostModel, held_bytes: int = 0) -> WindowPlan:
        """The placement for this step's decode window (see the module docstring). ``held_bytes``:
        prefix-state bytes already kept across decode outside the plan (the actor prefixes handed
        to the rollout), taken off the memory budget."""
        budget = self.memory_budget_bytes
        if budget is not None:
            return PhasePlanner(self.total, max(0, budget - held_bytes))._plan(graph, cost)
        return self._plan(graph, cost)

    def _plan(self, graph: StepGraph, cost: CostModel) -> WindowPlan:
        movable = graph.movable()
        kinds = {t.kind for t in movable}
        split = (max(1, (self.total + 1) // 2), self.total // 2)
        if not movable:
            return WindowPlan("plan", self.total, 0)
        if not all(cost.calibrated(k, self.total) for k in ("decode", *kinds)):
            return WindowPlan("profile_serial", self.total, 0, [], run_order(movable))
        decode_steps = graph.decode_steps
        prefix_s = sum(cost.seconds(t.kind, t.tokens, self.total) for t in movable)
        baseline = cost.seconds("decode", decode_steps, self.total) + prefix_s
        if self.total > 1 and (not cost.known("decode", split[0]) or not all(cost.known(k, split[1]) for k in kinds)):
            window = self._fit_memory(movable)
            return WindowPlan("profile_split", split[0], split[1], run_order(window),
                              run_order([t for t in movable if t not in window]),
                              predicted_no_overlap_s=baseline, window_bytes=sum(t.creates_bytes for t in window),
                              prefix_full_s=prefix_s)
        plans = [WindowPlan("plan", self.total, 0, [], run_order(movable), baseline)]
        plans += [self._overlap(movable, decode_steps, self.total - c, c, cost) for c in range(1, self.total)]
        best = min(plans, key=lambda p: p.predicted_s)  # the first minimum: no overlap wins a tie
        margin = self.margin_s(cost, best, movable, baseline)
        if baseline - best.predicted_s <= margin:
            best = plans[0]  # the gain is not there (within the noise): no overlap
        best.planned_gain_s = baseline - best.predicted_s
        best.margin_s, best.prefix_full_s = margin, prefix_s
        best.predicted_no_overlap_s = baseline
        best.candidates = {"no_overlap" if p.train_share == 0 else f"overlap_{p.decode_share}_{p.train_share}":
                           p.predicted_s for p in plans}
        return best

    def margin_s(self, cost: CostModel, plan: WindowPlan, movable: list[Task], baseline_s: float) -> float:
        """Seconds the predicted gain of ``plan`` over no overlap must exceed: ``MARGIN_Z`` x the
        measured noise of the terms in which the two differ, plus the shortfall of earlier
        overlapped steps, plus ``MIN_MARGIN_FRAC`` of ``baseline_s``.

        The terms that differ: the window tasks at the train share (overlap) against the same tasks
        on the whole device (no overlap), and the decode steps done during the window at the decode
        share against the same steps on the whole device. Decode outside the window and the tasks
        left for after it are the same work at the same rate in both plans, so their noise moves
        both predictions alike and is left out. Rates of one (kind, threads) move together, so their
        seconds are summed per key before the quadrature sum. A plan without overlap gets the
        shortfall and fraction terms only."""
        per_key: dict[tuple[str, int], float] = {}
        if plan.overlaps:
            window = plan.window_tasks
            for t in window:
                for threads in (plan.train_share, self.total):
                    per_key[(t.kind, threads)] = per_key.get((t.kind, threads), 0.0) + cost.seconds(t.kind, t.tokens, threads)
            window_s = sum(cost.seconds(t.kind, t.tokens, plan.train_share) for t in window)
            steps = window_s / cost.rate("decode", plan.decode_share)  # decoded during the window
            per_key[("decode", plan.decode_share)] = window_s
            per_key[("decode", self.total)] = steps * cost.rate("decode", self.total)
        return self._margin(cost, per_key, baseline_s)

    @staticmethod
    def _margin(cost: CostModel, per_key: dict[tuple[str, int], float], baseline_s: float) -> float:
        """``MARGIN_Z`` x the quadrature sum of each (kind, threads) term's seconds times its
        measured relative noise, plus the shortfall of earlier overlapped steps, plus
        ``MIN_MARGIN_FRAC`` of ``baseline_s``."""
        spread = math.sqrt(sum((cost.relative_noise(kind, threads) * s) ** 2 for (kind, threads), s in per_key.items()))
        return MARGIN_Z * spread + cost.gain_shortfall_s + MIN_MARGIN_FRAC * baseline_s

    def stream_chunks(self, plan: WindowPlan, graph: StepGraph, cost: CostModel, bounds: list[int],
                      chunk_tokens: list[int], final_tokens: int, calibrating: bool) -> WindowPlan:
        """The step's plan with reference suffix chunks in the decode window, when that is predicted
        faster than ``plan`` (by more than the margin), else ``plan`` unchanged.

        With chunks the decoder runs at ``d`` threads for the whole decode while the train worker
        (``c`` threads) first runs every reference prefix (a chunk needs its group's prefix) and
        ``plan``'s other window tasks, then chunk ``j`` as soon as decode has produced
        ``bounds[j]`` tokens; the last chunk (``final_tokens``) runs after decode on the whole device.
        Predicted: ``max(decode end, window end) + last chunk + after tasks + 2 re-shares``, against
        ``plan.predicted_s`` plus the whole pass in one call on the whole device. Chunks are timed
        as ``chunk/ref`` (per thread count), the one-call pass as ``suffix/ref`` (whole device,
        measured in profiling and overlapped steps without chunks): a chunk costs more per token than the one call (fewer
        GEMM rows, attention over the pass's whole width), so taking the chunks' rate for the
        baseline would overstate the gain. The margin is :meth:`margin_s`'s, over the terms in which
        the two differ.

        Args:
            plan: the prefix-task plan (mode ``plan``); graph: the step graph it was made from
                (``decode_steps``, the movable tasks).
            bounds: decoded tokens at which chunk ``j`` can start; chunk_tokens: its input tokens
                (all rows); final_tokens: the last chunk's.
            calibrating: a ``profile_split`` step: chunks at the even split whatever the prediction
                (measures ``chunk/ref`` beside decode), when ``chunk/ref`` is not yet known there.

        Returns:
            a :class:`WindowPlan` with ``chunk_bounds`` set, or ``plan``.
        """
        if not bounds or self.total < 2:
            return plan
        kind, movable = "chunk/ref", graph.movable()
        d_share, c_share = max(1, (self.total + 1) // 2), self.total // 2
        known = cost.known(kind, c_share) and cost.known(kind, self.total)
        window = [t for t in movable if t.kind == "prefix/ref" or t in plan.window_tasks]  # refs first: chunks need them
        after = [t for t in movable if t not in window]
        if calibrating or plan.mode != "plan":
            if not calibrating or known:
                return plan
            return replace(plan, decode_share=d_share, train_share=c_share, window_tasks=run_order(window),
                           after_tasks=run_order(after), chunk_bounds=list(bounds))
        if not known or not cost.known("suffix/ref", self.total):
            return plan
        rate_d, rate_full = cost.rate("decode", d_share), cost.rate("decode", self.total)
        busy = sum(cost.seconds(t.kind, t.tokens, c_share) for t in window)  # train side, from decode start
        for bound, tokens in zip(bounds, chunk_tokens):
            busy = max(busy, bound * rate_d) + cost.seconds(kind, tokens, c_share)
        decode_s = graph.decode_steps * rate_d
        switch_s = cost.switch_s if cost.switch_s is not None else DEFAULT_SWITCH_S
        suffix_full_s = cost.seconds("suffix/ref", sum(chunk_tokens) + final_tokens, self.total)
        predicted = (max(decode_s, busy) + cost.seconds(kind, final_tokens, self.total) + 2 * switch_s
                     + sum(cost.seconds(t.kind, t.tokens, self.total) for t in after))
        baseline = plan.predicted_s + suffix_full_s
        per_key = {("decode", d_share): decode_s, ("decode", self.total): graph.decode_steps * rate_full,
                   (kind, c_share): cost.seconds(kind, sum(chunk_tokens), c_share),
                   (kind, self.total): cost.seconds(kind, final_tokens, self.total),
                   ("suffix/ref", self.total): suffix_full_s}
        for t in window:
            for threads in (c_share, self.total):
                per_key[(t.kind, threads)] = per_key.get((t.kind, threads), 0.0) + cost.seconds(t.kind, t.tokens, threads)
        margin = self._margin(cost, per_key, baseline)
        candidates = dict(plan.candidates, **{f"chunks_{d_share}_{c_share}": predicted - suffix_full_s})
        if baseline - predicted <= margin:
            return replace(plan, candidates=candidates)
        return replace(plan, decode_share=d_share, train_share=c_share, window_tasks=run_order(window),
                       after_tasks=run_order(after), predicted_s=predicted - suffix_full_s,
                       planned_gain_s=baseline - predicted, margin_s=margin, chunk_bounds=list(bounds),
                       suffix_full_s=suffix_full_s, candidates=candidates,
                       prefix_full_s=sum(cost.seconds(t.kind, t.tokens, self.total) for t in movable))

    @staticmethod
    def realised_gain_s(plan: WindowPlan, cost: CostModel, decode_steps: int, actual_s: float) -> float:
        """Measured seconds an overlapped step saved over the same step without overlap: the
        no-overlap time of the work it did (``decode_steps`` at the whole device's decode rate plus
        ``plan.prefix_full_s``) minus ``actual_s`` (decode start to the end of all movable work).
        0 for a step without overlap. Feeds the shortfall into ``cost`` (``observe_gain``)."""
        if not plan.overlaps or plan.prefix_full_s is None:
            return 0.0
        total = plan.decode_share + plan.train_share
        realised = cost.seconds("decode", decode_steps, total) + plan.prefix_full_s - actual_s
        if plan.chunk_bounds:  # actual_s then runs to the end of the reference suffix pass
            if plan.suffix_full_s is None:  # a calibration step: the pass's whole-device time is not known yet
                return 0.0
            realised += plan.suffix_full_s
        cost.observe_gain(plan.planned_gain_s, realised)
        return realised

    def _fit_memory(self, tasks: list[Task]) -> list[Task]:
        """The longest prefix of ``tasks`` whose state fits the memory budget."""
        kept, held = [], 0
        for t in tasks:
            if self.memory_budget_bytes is not None and held + t.creates_bytes > self.memory_budget_bytes:
                break
            kept.append(t)
            held += t.creates_bytes
        return kept

    def _overlap(self, movable: list[Task], decode_steps: int, decode_share: int, train_share: int,
                 cost: CostModel) -> WindowPlan:
        """Greedy admission for one split; predicted time to the end of all movable work."""
        decode_rate = cost.rate("decode", decode_share)
        window_left = decode_steps * decode_rate  # decode seconds at the split share
        value = {t.name: cost.seconds(t.kind, t.tokens, self.total) / max(1e-12, cost.seconds(t.kind, t.tokens, train_share))
                 for t in movable}
        order = sorted(movable, key=lambda t: -value[t.name])  # stable: graph order among equals
        admitted, held, overlap_s = [], 0, 0.0
        for t in order:
            s = cost.seconds(t.kind, t.tokens, train_share)
            if overlap_s + s > window_left:
                continue  # would outlast decode: exposed work is cheaper on the whole device
            if self.memory_budget_bytes is not None and held + t.creates_bytes > self.memory_budget_bytes:
                continue
            admitted.append(t)
            held += t.creates_bytes
            overlap_s += s
        switch_s = cost.switch_s if cost.switch_s is not None else DEFAULT_SWITCH_S
        decoded = overlap_s / decode_rate  # steps decoded during the overlap
        rest = (decode_steps - decoded) * cost.rate("decode", self.total)
        done = {t.name for t in admitted}
        after = [t for t in movable if t.name not in done]
        predicted = overlap_s + (2 * switch_s if admitted else 0.0) + rest + sum(
            cost.seconds(t.kind, t.tokens, self.total) for t in after)
        return WindowPlan("plan", decode_share, train_share, run_order(admitted), run_order(after),
                          predicted, None, held)


def place_groups(prompt_tokens: list[int], groups_per_mini_batch: int, dp_size: int) -> list[int]:
    """The DP rank of each prompt group for one step, decided before decoding.

    Each global mini-batch (``groups_per_mini_batch`` consecutive prompts) is dealt over the DP
    ranks, largest prompt first to the rank with the fewest groups, then the fewest prompt tokens
    (ties: lower rank), so every rank
    takes part in every optimizer step with a balanced share of the prefix work. A group's prefix
    and suffix tasks then run on that rank (its prefix states stay where they were made).

    Args:
        prompt_tokens: (P,) prompt lengths in tokens. groups_per_mini_batch: prompts per optimizer
            step. dp_size: data-parallel ranks.

    Returns:
        (P,) rank per prompt; deterministic for the same inputs.
    """
    ranks = [0] * len(prompt_tokens)
    if dp_size == 1:
        return ranks
    for start in range(0, len(prompt_tokens), groups_per_mini_batch):
        members = range(start, min(start + groups_per_mini_batch, len(prompt_tokens)))
        load = [0] * dp_size
        count = [0] * dp_size
        for g in sorted(members, key=lambda g: (-prompt_tokens[g], g)):
            rank = min(range(dp_size), key=lambda r: (count[r], load[r], r))
            ranks[g] = rank
            load[rank] += prompt_tokens[g]
            count[rank] += 1
    return ranks
