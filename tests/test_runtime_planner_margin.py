"""The planner's decision against the measured cost of sharing the device: an overlap must beat no
overlap by a margin built from measured noise and earlier shortfalls, else no overlap."""

from __future__ import annotations

import json

import pytest

from rollplex_train.runtime.cost_model import CostModel, amdahl
from rollplex_train.runtime.graph import build_step_graph
from rollplex_train.runtime.planner import MARGIN_Z, MIN_MARGIN_FRAC, PhasePlanner


def _graph():
    return build_step_graph([100] * 4, 8000, decode_steps=1000, mini_batch_groups=2, needs_reference=True,
                            weights_version=0)


def _cost(decode_at_1: float, noise: float = 0.0, prefix_at_1: float = 1.1) -> CostModel:
    """decode 1 ms/step at 2 threads and ``decode_at_1`` ms at 1 (the measured slowdown while
    sharing); prefix 1 ms/token at 2 threads, ``prefix_at_1`` at 1. Each rate is seen four times, the last
    two apart by ``noise`` (relative)."""
    cost = CostModel(ema=1.0)
    for scale in (1.0, 1.0, 1.0 + noise, 1.0):
        cost.observe("decode", 1000, 2, 1.0 * scale)
        cost.observe("decode", 1000, 1, decode_at_1 * scale)
        for role in ("old", "ref", "actor"):
            cost.observe(f"prefix/{role}", 1000, 2, 1.0 * scale)
            cost.observe(f"prefix/{role}", 1000, 1, prefix_at_1 * scale)
    cost.observe_switch(0.001)
    return cost


def test_overlap_chosen_only_when_gain_clears_the_margin():
    g, planner = _graph(), PhasePlanner(2)
    # sharing slows decode 1.2x while the window hides ~1 s of prefix work: a clear gain
    quiet = planner.plan(g, _cost(1.2))
    assert quiet.overlaps and quiet.planned_gain_s > quiet.margin_s > 0
    assert quiet.planned_gain_s == pytest.approx(quiet.predicted_no_overlap_s - quiet.predicted_s)
    assert quiet.margin_s == pytest.approx(MIN_MARGIN_FRAC * quiet.predicted_no_overlap_s)  # no measured noise
    # the same gain inside the measured noise of the rates: no overlap
    noisy = planner.plan(g, _cost(1.2, noise=0.5))
    assert not noisy.overlaps and noisy.planned_gain_s == 0.0
    assert noisy.predicted_s == noisy.predicted_no_overlap_s
    assert noisy.margin_s > noisy.predicted_no_overlap_s - noisy.candidates["overlap_1_1"]
    # decode and prefix both scale perfectly with threads: sharing hides nothing
    slow = planner.plan(g, _cost(2.0, prefix_at_1=2.0))
    assert not slow.overlaps and slow.candidates["overlap_1_1"] > slow.candidates["no_overlap"]


def test_margin_is_measured_noise_plus_shortfall():
    """The noise counted is that of the terms in which overlap and no overlap differ: the window's
    tasks at 1 and at 2 threads, and the decode steps beside them at 1 and at 2 threads."""
    g, planner = _graph(), PhasePlanner(2)
    cost = _cost(1.2, noise=0.1)
    assert cost.relative_noise("decode", 2) == pytest.approx(0.1 / 1.1)  # |1 / 1.1 - 1|, EMA weight 1
    assert cost.relative_noise("decode", 4) == cost.prior_noise
    movable = g.movable()
    plan = planner._overlap(movable, 500, 1, 1, cost)  # a 0.6 s window at 1 thread: about half the tasks
    window = [t for t in movable if t in plan.window_tasks]
    assert window and len(window) < len(movable)  # the window holds some of the tasks, not all
    per_kind = {}
    for t in window:  # seconds of each prefix kind in the window: 1.1 ms/token at 1 thread, 1 at 2
        per_kind[t.kind] = per_kind.get(t.kind, 0.0) + t.tokens * 1e-3
    window_s = 1.1 * sum(per_kind.values())
    terms = [1.1 * s for s in per_kind.values()] + list(per_kind.values())  # prefix at 1 and 2 threads
    terms += [window_s, window_s / 1.2]  # decode beside the window at 1 thread, those steps at 2
    baseline = 1.0 + sum(t.tokens for t in movable) * 1e-3
    expected = MARGIN_Z * (0.1 / 1.1) * sum(x ** 2 for x in terms) ** 0.5 + MIN_MARGIN_FRAC * baseline
    assert planner.margin_s(cost, plan, movable, baseline) == pytest.approx(expected)
    cost.observe_gain(planned_s=0.5, realised_s=-0.25)
    assert cost.gain_shortfall_s == pytest.approx(0.75)
    assert planner.margin_s(cost, plan, movable, baseline) == pytest.approx(expected + 0.75)
    no_overlap = planner.plan(g, CostModel())  # not calibrated: a profiling plan without overlap
    assert planner.margin_s(cost, no_overlap, movable, baseline) == pytest.approx(0.75 + MIN_MARGIN_FRAC * baseline)


def test_a_realised_loss_turns_the_next_step_to_no_overlap():
    g, planner, cost = _graph(), PhasePlanner(2), _cost(1.2)
    plan = planner.plan(g, cost)
    assert plan.overlaps
    # measured: the step took 0.4 s longer than the same work without overlap would have
    no_overlap_s = 1000 * 1e-3 + plan.prefix_full_s
    realised = planner.realised_gain_s(plan, cost, 1000, actual_s=no_overlap_s + 0.4)
    assert realised == pytest.approx(-0.4)
    assert cost.gain_shortfall_s == pytest.approx(plan.planned_gain_s + 0.4)
    after = planner.plan(g, cost)
    assert not after.overlaps and after.planned_gain_s == 0.0
    assert planner.realised_gain_s(after, cost, 1000, actual_s=5.0) == 0.0  # nothing overlapped, no feedback
    assert cost.gain_shortfall_s == pytest.approx(plan.planned_gain_s + 0.4)


def test_profile_split_step_reports_its_realised_gain():
    g, planner, cost = _graph(), PhasePlanner(2), CostModel(ema=1.0)
    for _ in range(2):
        cost.observe("decode", 1000, 2, 1.0)
        for role in ("old", "ref", "actor"):
            cost.observe(f"prefix/{role}", 1000, 2, 1.0)
    plan = planner.plan(g, cost)
    assert plan.mode == "profile_split" and plan.overlaps and plan.planned_gain_s == 0.0
    assert plan.predicted_no_overlap_s == pytest.approx(1.0 + plan.prefix_full_s)
    assert planner.realised_gain_s(plan, cost, 1000, actual_s=plan.predicted_no_overlap_s + 0.3) == pytest.approx(-0.3)
    assert cost.gain_shortfall_s == pytest.approx(0.3)  # a losing calibration step raises the margin


def test_noise_and_shortfall_survive_a_checkpoint():
    cost = _cost(1.2, noise=0.2)
    cost.observe_gain(1.0, 0.5)
    restored = CostModel()
    restored.load_state_dict(json.loads(json.dumps(cost.state_dict())))
    assert restored.noise == cost.noise and restored.gain_shortfall_s == cost.gain_shortfall_s
    legacy = {k: v for k, v in cost.state_dict().items() if k not in ("noise", "gain_shortfall_s")}
    CostModel().load_state_dict(legacy)  # a checkpoint written before these fields still loads
    assert amdahl(1, 0.5) == 1.0
