"""Predicted step of each schedule, phase by phase, from a step graph and a :class:`CostModel`.

The same placement logic as at run time: the rollplex window is the run-time
:class:`~rollplex_train.runtime.planner.PhasePlanner`'s plan; the phases after decode follow
``runtime/serial.py`` (serial, disaggregated) and ``runtime/rollplex.py`` (suffix-only scoring).
Times are seconds of one device's step (every device of a synchronous step does the same work, so
one device's step is the step). The result carries a :class:`~rollplex_train.runtime.timeline.Timeline`
of predicted spans, drawn with ``timeline.plot_gantt`` like a measured step.

Phases (``timing_s/*`` names of the schedules): ``gen`` (prefill + decode), ``prefix_after`` (rollplex:
movable tasks the planner left for after decode), ``reward``, ``old_log_prob``, ``ref``, ``adv``,
``prefetch`` (exposed host-to-device copies of the memory plan), ``update_actor``, ``update_weights``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rollplex_train.runtime.cost_model import CostModel
from rollplex_train.runtime.graph import StepGraph, Task
from rollplex_train.runtime.planner import DEFAULT_SWITCH_S, PhasePlanner, WindowPlan
from rollplex_train.runtime.timeline import Timeline

PHASE_ROWS = {"gen": "rollout", "reward": "driver", "old_log_prob": "train", "ref": "train", "adv": "driver",
              "prefetch": "train", "update_actor": "train", "update_weights": "rollout", "prefix_after": "train"}


@dataclass
class Copies:
    """Host<->device copy seconds of one phase (from the memory plan): ``exposed`` the phase waits
    for, ``overlapped`` run beside it (exposed only where longer than the phase)."""

    exposed_s: float = 0.0
    overlapped_s: float = 0.0


@dataclass
class StepPrediction:
    """One schedule's predicted step.

    Attributes:
        schedule: ``serial``, ``disaggregated`` or ``rollplex``. phases: seconds per phase, in order.
        timeline: predicted spans (rows driver / rollout / train), seconds from step start.
        prefix_s / hidden_s: prefix-task seconds, and those inside the decode window.
        plan: the planner's placement (rollplex only).
    """

    schedule: str
    phases: dict[str, float] = field(default_factory=dict)
    timeline: Timeline = field(default_factory=lambda: Timeline(origin=0.0))
    prefix_s: float = 0.0
    hidden_s: float = 0.0
    plan: Optional[WindowPlan] = None

    @property
    def step_s(self) -> float:
        """Predicted seconds of the whole step."""
        return sum(self.phases.values())

    @property
    def hidden_frac(self) -> float:
        """Fraction of the prefix seconds inside the decode window (1.0 without prefix work)."""
        return self.hidden_s / self.prefix_s if self.prefix_s > 0 else 1.0

    def add(self, phase: str, seconds: float, copies: Optional[Copies] = None) -> None:
        """Append ``phase`` (``seconds`` of work) after the phases so far; its memory-plan copies
        first add an exposed ``prefetch`` span."""
        if copies is not None:
            wait = copies.exposed_s + max(0.0, copies.overlapped_s - seconds)
            if wait > 0:
                self.add("prefetch", wait)
        start = self.step_s
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds
        if seconds > 0:
            self.timeline.add(phase, PHASE_ROWS[phase], start, start + seconds)


def _seconds(cost: CostModel, tasks: list[Task], share: int) -> float:
    return sum(cost.seconds(t.kind, t.tokens, share) for t in tasks)


def _actor_prefix_in_update(graph: StepGraph) -> list[Task]:
    """Actor prefix passes the update computes itself: groups of later mini-batches (their prefix
    needs the weights after the first optimizer step), sized as the group's old-policy prefix."""
    precomputed = {t.group for t in graph.of_kind("prefix/actor")}
    return [Task(f"prefix/actor/g{t.group}", "prefix/actor", "train", t.group, tokens=t.tokens)
            for t in graph.of_kind("prefix/old") if t.group not in precomputed]


def _after_decode(pred: StepPrediction, graph: StepGraph, cost: CostModel, share: int, *, prefix_copies: int,
                  copies: dict[str, Copies]) -> None:
    """reward .. update_weights. ``prefix_copies``: 0 — the scoring and update phases run only what
    the decode window could not precompute (rollplex); 1 — each runs its own prefix passes, once per
    group (shared prefix); n — once per response (full sequences: the prompt is recomputed for each
    of the G responses, and the update also back-propagates through every copy)."""
    pred.add("reward", cost.seconds("reward", 1, share))
    for phase, role in (("old_log_prob", "old"), ("ref", "ref")):
        suffix = _seconds(cost, graph.of_kind(f"suffix/{role}"), share)
        if suffix or graph.of_kind(f"prefix/{role}"):
            prefix = prefix_copies * _seconds(cost, graph.of_kind(f"prefix/{role}"), share)
            pred.add(phase, suffix + prefix, copies.get(phase))
    pred.add("adv", cost.seconds("adv", 1, share))
    updates = graph.of_kind("update")
    later = _actor_prefix_in_update(graph)
    first = graph.of_kind("prefix/actor")
    prefix = _seconds(cost, later, share) + prefix_copies * _seconds(cost, first, share)
    if prefix_copies > 1:  # full sequences: every copy of the prefix is recomputed and back-propagated
        every = first + later
        prefix += (prefix_copies - 1) * (_seconds(cost, later, share) + sum(
            cost.seconds("prefix/backward", t.tokens, share) for t in every))
    pred.add("update_actor", _seconds(cost, updates, share) + prefix + len(updates) * cost.seconds("optimizer", 1, share),
             copies.get("update_actor"))
    pred.add("update_weights", cost.seconds("sync", 1, share), copies.get("update_weights"))


def predict_serial(graph: StepGraph, cost: CostModel, share: int, prefill_tokens: int, *,
                   schedule: str = "serial", rollout_share: Optional[int] = None, prefix_copies: int = 1,
                   copies: Optional[dict[str, Copies]] = None) -> StepPrediction:
    """The serial phases: decode on ``rollout_share`` (default ``share``), then every scoring and
    update phase with its prefix passes on ``share`` (``prefix_copies``: 1 with the shared prefix,
    G for full sequences; see :func:`_after_decode`). ``schedule="disaggregated"`` labels the same
    phases run on a disjoint device set / device share per side."""
    copies = copies or {}
    pred = StepPrediction(schedule)
    rollout = rollout_share or share
    pred.add("gen", cost.seconds("prefill", prefill_tokens, rollout) + cost.seconds("decode", graph.decode_steps, rollout),
             copies.get("gen"))
    _after_decode(pred, graph, cost, share, prefix_copies=prefix_copies, copies=copies)
    pred.prefix_s = prefix_copies * _seconds(cost, graph.movable(), share)
    return pred


def predict_rollplex(graph: StepGraph, cost: CostModel, share: int, prefill_tokens: int, *,
                     memory_budget_bytes: Optional[int] = None,
                     copies: Optional[dict[str, Copies]] = None) -> StepPrediction:
    """The rollplex step: prefill on the whole device, then the planner's decode window (movable
    prefix tasks on ``plan.train_share`` beside decode, the whole device back to decode once they
    are done, left-over movable tasks after decode), then suffix-only scoring and the update.

    Raises:
        ValueError: the cost model is not calibrated enough for the planner to plan (it asked for a
            profiling step).
    """
    copies = copies or {}
    plan = PhasePlanner(share, memory_budget_bytes).plan(graph, cost)
    if plan.mode != "plan":
        raise ValueError(f"the cost model cannot place the window yet (the planner asked for a {plan.mode} step): "
                         "calibrate from a rollplex run of at least 3 steps")
    pred = StepPrediction("rollplex", plan=plan)
    prefill = cost.seconds("prefill", prefill_tokens, share)
    pred.add("gen", prefill, copies.get("gen"))
    t0 = pred.step_s
    window, after = plan.window_tasks, plan.after_tasks
    hidden = _seconds(cost, window, plan.train_share) if plan.overlaps else 0.0
    tl = pred.timeline
    if plan.overlaps:
        switch = cost.switch_s if cost.switch_s is not None else DEFAULT_SWITCH_S
        tl.add("reshare", "driver", t0, t0 + switch)
        start = t0 + switch
        for role in ("old", "ref", "actor"):
            seconds = _seconds(cost, [t for t in window if t.role == role], plan.train_share)
            if seconds > 0:
                tl.add(f"prefix({role})", "train", start, start + seconds)
                start += seconds
        tl.add("reshare", "driver", start, start + switch)
        decoded = hidden / cost.rate("decode", plan.decode_share)
        decode_end = start + switch + (graph.decode_steps - decoded) * cost.rate("decode", share)
    else:
        decode_end = t0 + cost.seconds("decode", graph.decode_steps, share)
    tl.add("gen", "rollout", t0, decode_end)  # the decode window, named as the measured trace names it
    pred.phases["gen"] += decode_end - t0
    pred.add("prefix_after", _seconds(cost, after, share))
    pred.prefix_s, pred.hidden_s = hidden + pred.phases["prefix_after"], hidden
    _after_decode(pred, graph, cost, share, prefix_copies=0, copies=copies)
    return pred
