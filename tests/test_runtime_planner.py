"""Task graph, cost model and phase planner: pure Python, no workers."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from rollplex_train.runtime.cost_model import CostModel, amdahl
from rollplex_train.runtime.graph import StepGraph, Task, build_step_graph
from rollplex_train.runtime.planner import PhasePlanner, PrefixCall, prefix_calls


def graph(num_groups=4, mini=2, ref=True, prompt=100, response=800, bytes_per_token=0.0):
    return build_step_graph([prompt] * num_groups, response, decode_steps=response // 8, mini_batch_groups=mini,
                            needs_reference=ref,
                            weights_version=3, prefix_bytes_per_token=bytes_per_token,
                            actor_bytes_per_token=2 * bytes_per_token)


def test_graph_structure_and_movable_tasks():
    g = graph(num_groups=4, mini=2)
    movable = {t.name for t in g.movable()}
    # old and ref prefixes of every group; actor prefixes of the first mini-batch only
    assert movable == {f"prefix/{r}/g{i}" for r in ("old", "ref") for i in range(4)} | {"prefix/actor/g0", "prefix/actor/g1"}
    assert all(t.weights_version == 3 for t in g.movable())
    assert g["suffix/ref/g2"].deps == ("decode/g2", "prefix/ref/g2")
    assert set(g["update/mb0"].deps) >= {"adv", "prefix/actor/g0", "suffix/old/g1"}
    assert "update/mb0" in g["update/mb1"].deps and g["sync"].deps == ("update/mb1",)
    assert g["sync"].weights_version == 4
    # no reference: no ref tasks at all
    assert not [t for t in graph(ref=False) if t.role == "ref"]


def test_graph_rejects_unknown_dependencies_and_duplicates():
    g = StepGraph()
    g.add(Task("a", "decode", "rollout"))
    with pytest.raises(ValueError, match="unknown tasks"):
        g.add(Task("b", "reward", "driver", deps=("missing",)))
    with pytest.raises(ValueError, match="already"):
        g.add(Task("a", "decode", "rollout"))
    with pytest.raises(ValueError, match="no prompt groups"):
        build_step_graph([], 10, decode_steps=2, mini_batch_groups=1, needs_reference=True, weights_version=0)


def test_live_bytes_follow_producers_and_last_consumers():
    g = graph(num_groups=2, mini=2, bytes_per_token=10.0)  # old/ref prefix 1000 B, actor 2000 B
    done = ["prefix/old/g0", "prefix/ref/g0", "prefix/actor/g0"]
    assert g.live_bytes(done) == 4000
    assert g.live_bytes(done + ["decode/g0", "suffix/old/g0"]) == 3000  # suffix/old frees prefix/old
    order = [t.name for t in g]  # insertion order is a topological order
    assert g.live_bytes(order) == 0  # everything is freed by the end of the step
    assert {t.name for t in g.ready_after([])} >= {"decode/g0", "prefix/old/g0"}


def test_cost_model_fits_amdahl_from_two_thread_counts():
    cost = CostModel(ema=1.0)
    with pytest.raises(KeyError):
        cost.rate("decode", 2)
    cost.observe("decode", 1000, 1, 10.0)
    assert cost.parallel_fraction("decode") == 0.5  # prior while one thread count is known
    assert cost.seconds("decode", 1000, 2) == pytest.approx(10.0 * amdahl(2, 0.5))
    cost.observe("decode", 1000, 2, 10.0 * amdahl(2, 0.8))
    assert cost.parallel_fraction("decode") == pytest.approx(0.8)
    assert cost.seconds("decode", 500, 4) == pytest.approx(5.0 * amdahl(4, 0.8))
    cost = CostModel(ema=0.5)
    cost.observe("prefix/ref", 100, 2, 9.0)  # warm-up: replaced by the next measurement
    cost.observe("prefix/ref", 100, 2, 1.0)
    assert cost.seconds("prefix/ref", 100, 2) == pytest.approx(1.0)
    cost.observe("prefix/ref", 100, 2, 3.0)
    assert cost.seconds("prefix/ref", 100, 2) == pytest.approx(2.0)
    assert cost.metrics()["cost/prefix/ref@2"] == pytest.approx(2e4)  # microseconds per token


def calibrated(decode_f=0.3, prefix_f=0.9, decode_rate=1e-3, prefix_rate=1e-3):
    """A cost model measured at 1 and 2 threads with the given Amdahl fractions."""
    cost = CostModel(ema=1.0)
    for threads in (1, 2, 2):
        cost.observe("decode", 1000, threads, 1000 * decode_rate * amdahl(threads, decode_f))
        for role in ("old", "ref", "actor"):
            cost.observe(f"prefix/{role}", 1000, threads, 1000 * prefix_rate * amdahl(threads, prefix_f))
    cost.observe_switch(0.001)
    return cost


def test_planner_profiles_first_then_plans():
    g, planner = graph(), PhasePlanner(2)
    first = planner.plan(g, CostModel())
    assert first.mode == "profile_serial" and not first.overlaps and len(first.after_tasks) == 10
    cost = CostModel()
    for _ in range(2):  # the first measurement is the warm-up: two are needed on the whole device
        assert planner.plan(g, cost).mode == "profile_serial"
        cost.observe("decode", 100, 2, 1.0)
        for role in ("old", "ref", "actor"):
            cost.observe(f"prefix/{role}", 100, 2, 1.0)
    second = planner.plan(g, cost)
    assert second.mode == "profile_split" and (second.decode_share, second.train_share) == (1, 1)
    assert len(second.window_tasks) == 10
    third = planner.plan(g, calibrated())
    assert third.mode == "plan" and third.predicted_s is not None


def test_planner_overlaps_when_decode_leaves_compute_idle():
    g = graph(num_groups=4, response=8000)  # 1000 decode steps, prefix 1000 tokens
    plan = PhasePlanner(2).plan(g, calibrated(decode_f=0.2, prefix_f=0.9))
    assert plan.overlaps and (plan.decode_share, plan.train_share) == (1, 1)
    assert len(plan.window_tasks) == 10 and plan.predicted_s < plan.predicted_no_overlap_s


def test_planner_keeps_decode_on_the_whole_device_when_overlap_does_not_pay():
    g = graph(num_groups=4, response=8000)
    plan = PhasePlanner(2).plan(g, calibrated(decode_f=1.0, prefix_f=1.0))  # perfectly parallel: no gain
    assert not plan.overlaps and plan.predicted_s == plan.predicted_no_overlap_s
    assert plan.candidates["overlap_1_1"] >= plan.candidates["no_overlap"]


def test_planner_never_outlasts_decode_or_the_memory_budget():
    rng = random.Random(0)
    for _ in range(200):
        num_groups = rng.randint(1, 8)
        g = build_step_graph([rng.randint(10, 500) for _ in range(num_groups)], rng.randint(10, 4000),
                             decode_steps=rng.randint(1, 500), mini_batch_groups=rng.randint(1, num_groups), needs_reference=rng.random() < 0.7,
                             weights_version=0, prefix_bytes_per_token=rng.uniform(0, 100),
                             actor_bytes_per_token=rng.uniform(0, 400))
        total = rng.randint(1, 8)
        budget = rng.choice([None, rng.randint(0, 200_000)])
        cost = CostModel(ema=1.0)
        for threads in [*range(1, total + 1), total]:  # the whole device twice (past warm-up)
            cost.observe("decode", 1000, threads, amdahl(threads, rng.uniform(0, 1)))
            for role in ("old", "ref", "actor"):
                cost.observe(f"prefix/{role}", 1000, threads, rng.uniform(0.1, 3) * amdahl(threads, rng.uniform(0, 1)))
        plan = PhasePlanner(total, budget).plan(g, cost)
        window = plan.window_tasks
        assert all(t.movable for t in window)
        assert sorted(t.name for t in plan.window_tasks + plan.after_tasks) == sorted(t.name for t in g.movable())
        if budget is not None:
            assert sum(t.creates_bytes for t in window) <= budget
        if plan.overlaps:
            window_s = sum(cost.seconds(t.kind, t.tokens, plan.train_share) for t in window)
            assert window_s <= g.decode_steps * cost.rate("decode", plan.decode_share) + 1e-9
            assert plan.decode_share + plan.train_share == total
        assert plan.predicted_s <= plan.predicted_no_overlap_s + 1e-12


def test_prefix_calls_batch_consecutive_roles():
    g = graph(num_groups=3, mini=1)
    tasks = [g[n] for n in ("prefix/old/g0", "prefix/old/g1", "prefix/ref/g0", "prefix/actor/g0", "prefix/old/g2")]
    assert prefix_calls(tasks) == [PrefixCall("old", (0, 1)), PrefixCall("ref", (0,)), PrefixCall("actor", (0,)),
                                   PrefixCall("old", (2,))]


def test_graph_tasks_carry_the_steps_global_prompt_indices():
    """A DP rank's graph over the step's groups 1 and 3: its tasks name and hold those indices, and
    its first mini-batch is its first group (mini-batch membership counts its own groups)."""
    g = build_step_graph([100, 120], 800, decode_steps=100, mini_batch_groups=1, needs_reference=True,
                         weights_version=0, groups=[1, 3])
    assert {t.group for t in g.movable()} == {1, 3}
    assert [t.name for t in g.movable() if t.role == "actor"] == ["prefix/actor/g1"]
    assert g["prefix/ref/g3"].tokens == 120


def test_cost_model_state_round_trips_through_json():
    import json

    cost = calibrated()
    restored = CostModel()
    restored.load_state_dict(json.loads(json.dumps(cost.state_dict())))
    assert restored.rates == cost.rates and restored.counts == cost.counts and restored.switch_s == cost.switch_s
    g = graph(num_groups=4, response=8000)
    assert PhasePlanner(2).plan(g, restored).__dict__ == PhasePlanner(2).plan(g, cost).__dict__


def with_suffix(cost: CostModel, suffix_f: float, rate: float = 1e-3, one_call: float = 0.8e-3) -> CostModel:
    """``cost`` with reference suffix chunk rates at 1 and 2 threads (Amdahl fraction ``suffix_f``)
    and the one-call pass's rate on 2 threads (``one_call`` s/token: cheaper than a chunk's)."""
    for threads in (1, 2, 2):
        cost.observe("chunk/ref", 1000, threads, 1000 * rate * amdahl(threads, suffix_f))
    cost.observe("suffix/ref", 1000, 2, 1000 * one_call)
    return cost


def test_suffix_chunks_calibrate_then_run_only_where_they_pay():
    """Reference suffix chunks: forced at the even split on the calibration step (until both
    rates are known), then chosen by prediction: taken where decode barely uses the second thread
    (prediction = the chunk timeline worked by hand), refused where decode scales perfectly."""
    g = graph(num_groups=2, response=800)  # 100 decode steps; two ref prefixes of 100 tokens
    planner, bounds, tokens = PhasePlanner(2), [32, 64], [256, 256]
    split = planner.plan(g, CostModel())  # profile_serial: no chunks before the rates exist
    assert planner.stream_chunks(split, g, CostModel(), bounds, tokens, 300, calibrating=False) is split
    calibration = planner.stream_chunks(replace(split, mode="profile_split"), g, CostModel(), bounds, tokens, 300,
                                        calibrating=True)
    assert calibration.chunk_bounds == bounds and (calibration.decode_share, calibration.train_share) == (1, 1)
    assert {"prefix/ref/g0", "prefix/ref/g1"} <= {t.name for t in calibration.window_tasks} and calibration.overlaps

    cost = with_suffix(calibrated(decode_f=0.0, prefix_f=1.0, decode_rate=0.02), suffix_f=1.0, rate=2e-3)
    base = planner.plan(g, cost)
    plan = planner.stream_chunks(base, g, cost, bounds, tokens, 300, calibrating=False)
    # train side at 1 thread: the window's six prefixes 0.6 s, then chunk 0 from 32*0.02=0.64 s to
    # 1.152, chunk 1 from 1.28 s to 1.792; decode ends at 2.0 s (decode_f=0: 0.02 s a step on any
    # share); after it the last chunk, 300 tokens on 2 threads: 0.3 s
    assert plan.chunk_bounds == bounds and plan.overlaps and len(plan.window_tasks) == 6 and not plan.after_tasks
    assert plan.predicted_s + plan.suffix_full_s == pytest.approx(2.0 + 0.3 + 2 * cost.switch_s)
    assert plan.suffix_full_s == pytest.approx(812 * 0.8e-3)  # the baseline: the one-call pass, not the chunks
    assert plan.planned_gain_s == pytest.approx(base.predicted_s + plan.suffix_full_s
                                                - (plan.predicted_s + plan.suffix_full_s))
    assert plan.planned_gain_s > plan.margin_s > 0
    # the same chunks against a one-call pass that is nearly free: no gain; and none planned before
    # the one-call pass was measured
    cheap = with_suffix(calibrated(decode_f=0.0, prefix_f=1.0, decode_rate=0.02), suffix_f=1.0, rate=2e-3, one_call=1e-5)
    assert not planner.stream_chunks(planner.plan(g, cheap), g, cheap, bounds, tokens, 300, calibrating=False).chunk_bounds
    unmeasured = calibrated(decode_f=0.0, prefix_f=1.0, decode_rate=0.02)
    for threads in (1, 2, 2):
        unmeasured.observe("chunk/ref", 1000, threads, 1000 * 2e-3 * amdahl(threads, 1.0))
    assert not planner.stream_chunks(planner.plan(g, unmeasured), g, unmeasured, bounds, tokens, 300,
                                     calibrating=False).chunk_bounds

    cost = with_suffix(calibrated(decode_f=1.0, prefix_f=1.0, decode_rate=0.02), suffix_f=1.0, rate=2e-3)
    base = planner.plan(g, cost)
    kept = planner.stream_chunks(base, g, cost, bounds, tokens, 300, calibrating=False)
    assert not kept.chunk_bounds and kept.predicted_s == base.predicted_s and "chunks_1_1" in kept.candidates


def test_cost_model_saved_before_chunk_rates_had_their_kind_is_renamed_on_load():
    """Checkpoints of the older code observed the chunks as ``suffix/ref``: on resume those rates
    become ``chunk/ref`` and the one-call pass is unmeasured (no chunks planned until it is)."""
    from rollplex_train.runtime.window import rename_old_chunk_rates

    old = CostModel()
    for threads in (1, 2, 2, 2):
        old.observe("suffix/ref", 1000, threads, 0.4 if threads == 1 else 0.25 + 0.01 * len(old.noise))
    state = old.state_dict()
    cost = CostModel()
    cost.load_state_dict(state)
    rename_old_chunk_rates(cost)
    assert "suffix/ref" not in cost.rates and cost.rates["chunk/ref"] == old.rates["suffix/ref"]
    assert cost.counts == {("chunk/ref", 1): 1, ("chunk/ref", 2): 3} and set(cost.noise) == {("chunk/ref", 2)}
    new = with_suffix(CostModel(), suffix_f=1.0)  # both kinds: left as they are
    before = new.state_dict()
    rename_old_chunk_rates(new)
    assert new.state_dict() == before
