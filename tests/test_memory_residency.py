"""The residency planner: never over budget on random step graphs (property test), lifetimes,
the decode-window prefix count, the infeasible-phase error."""

import re
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollplex_train.memory.residency import GIB, Phase, minimum_budget, phases_from_groups, plan_residency


@dataclass(frozen=True)
class G:
    name: str
    item_bytes: int
    num_items: int = 1
    kind: str = "state"
    producer: str | None = None
    consumers: tuple = ()

    @property
    def nbytes(self):
        return self.item_bytes * self.num_items


@st.composite
def step_graphs(draw):
    """Random groups over 2..7 phases: states used anywhere, live groups produced before their
    consumers, scratch buffers; sizes 0..20 GiB in 1/4 GiB units; a budget of 4..120 GiB."""
    num_phases = draw(st.integers(2, 7))
    names = [f"p{i}" for i in range(num_phases)]
    groups = []
    for k in range(draw(st.integers(1, 10))):
        kind = draw(st.sampled_from(["state", "live", "scratch"]))
        size = draw(st.integers(0, 80)) * GIB // 4
        items = draw(st.integers(1, 6))
        if kind == "live":
            born = draw(st.integers(0, num_phases - 1))
            users = draw(st.lists(st.integers(born, num_phases - 1), min_size=1, max_size=3))
            groups.append(G(f"g{k}", size, items, kind, names[born], tuple(names[u] for u in sorted(set(users)))))
        else:
            users = draw(st.lists(st.integers(0, num_phases - 1), min_size=0 if kind == "state" else 1, max_size=4))
            groups.append(G(f"g{k}", size, items, kind, None, tuple(names[u] for u in sorted(set(users)))))
    budget = draw(st.integers(16, 480)) * GIB // 4
    return groups, phases_from_groups(groups, names), budget


def _minimum(phase, groups):
    return sum(g.item_bytes * (1 if g.num_items > 1 else g.num_items) for g in groups if g.name in phase.uses)


@settings(max_examples=300, deadline=None)
@given(step_graphs(), st.booleans())
def test_plan_never_exceeds_the_budget(graph, offload):
    groups, phases, budget = graph
    by_name = {g.name: g for g in groups}
    try:
        plan = plan_residency(groups, phases, budget, allow_offload=offload)
    except ValueError as err:
        match = re.search(r"phase '(\w+)' does not fit: it needs ([\d.]+) GiB .* short by ([\d.]+) GiB", str(err))
        assert match, str(err)
        phase = next(p for p in phases if p.name == match[1])
        if offload:  # the named phase really cannot hold its minimum
            assert _minimum(phase, groups) > budget
            assert float(match[3]) == pytest.approx((_minimum(phase, groups) - budget) / GIB, abs=0.006)
        return
    assert len(plan.phases) == len(phases)
    for phase, p in zip(phases, plan.phases):
        assert p.device_bytes == sum(by_name[g].item_bytes * k for g, k in p.resident.items()) <= budget
        for g, k in p.resident.items():
            assert 0 <= k <= by_name[g].num_items
        for g in phase.uses:  # what the phase uses is on the device, at least one item of it
            assert p.resident[g] >= (1 if by_name[g].num_items > 1 else by_name[g].num_items)
        for g, k in p.host.items():  # nothing is lost: device + host = all items of an alive group
            assert k + p.resident.get(g, 0) == by_name[g].num_items
        if offload:  # a scratch buffer is only resident where it is used
            for g in p.resident:
                if by_name[g].kind == "scratch":
                    assert g in phase.uses
    assert plan.peak_bytes <= budget


def _window_step(budget_gib):
    groups = [
        G("weights", 10 * GIB, consumers=("decode", "score", "update")),
        G("optim", 20 * GIB, consumers=("update",)),
        G("kv", 30 * GIB, kind="scratch", consumers=("decode",)),
        G("prefix", 2 * GIB, 8, "live", "decode", ("score",)),
        G("grads", 10 * GIB, kind="live", producer="update", consumers=("update",)),
    ]
    return groups, phases_from_groups(groups, ["decode", "score", "update"]), int(budget_gib * GIB)


def test_decode_window_keeps_as_many_prefix_states_as_fit():
    groups, phases, budget = _window_step(47)
    plan = plan_residency(groups, phases, budget)
    decode = plan["decode"]
    # 10 weights + 30 kv leave 7 GiB: 3 prefix states of 2 GiB; optimizer states go to the host
    assert decode.resident == {"prefix": 3, "weights": 1, "kv": 1}
    assert decode.host == {"optim": 1, "prefix": 5} and decode.streamed == {"prefix": 5}
    assert plan.items_alive("decode", ["prefix"]) == 3
    # score holds weights + all 16 GiB of prefix, then has 21 GiB left: the optimizer is prefetched for update
    assert plan["score"].resident == {"weights": 1, "prefix": 8, "optim": 1}
    assert plan["score"].prefetch == {"optim": 1} and plan["update"].exposed == {}
    assert plan["decode"].offload == {"optim": 1}
    assert plan.copy_bytes("decode")["d2h"] == 20 * GIB
    assert plan.peak_bytes <= budget


def test_infeasible_phase_names_the_phase_and_the_shortfall():
    groups, phases, _ = _window_step(0)
    with pytest.raises(ValueError, match=r"phase 'decode' does not fit: .* short by 2\.00 GiB"):
        plan_residency(groups, phases, 40 * GIB)  # 10 + 30 + one 2 GiB prefix state = 42
    big_grads = G("grads", 30 * GIB, kind="live", producer="update", consumers=("update",))
    with pytest.raises(ValueError, match=r"phase 'update' does not fit: .* short by 1\.00 GiB"):
        plan_residency([*groups[:4], big_grads], phases, 59 * GIB)  # 10 + 20 + 30 = 60


def test_minimum_budget_is_the_least_budget_that_plans():
    groups, phases, _ = _window_step(0)
    assert minimum_budget(groups, phases) == ("decode", 42 * GIB)  # 10 + 30 + one 2 GiB prefix state
    assert plan_residency(groups, phases, 42 * GIB).peak_bytes == 42 * GIB
    with pytest.raises(ValueError, match="short by 0.00 GiB"):
        plan_residency(groups, phases, 42 * GIB - 1)
    assert minimum_budget(groups, phases, allow_offload=False) == ("decode", 76 * GIB)  # 10 + 20 + 30 + 16


def test_without_offload_alive_groups_stay_whole():
    groups, phases, _ = _window_step(0)
    plan = plan_residency(groups, phases, 200 * GIB, allow_offload=False)
    assert plan["decode"].resident == {"weights": 1, "optim": 1, "kv": 1, "prefix": 8}
    assert plan["update"].resident == {"weights": 1, "optim": 1, "grads": 1}
    with pytest.raises(ValueError, match="phase 'decode'"):
        plan_residency(groups, phases, 70 * GIB, allow_offload=False)  # 10 + 20 + 30 + 16 = 76


def test_lifetime_errors():
    early = [G("x", GIB, kind="live", producer="b", consumers=("a",))]
    with pytest.raises(ValueError, match="needed in phase 'a' before 'b' produces it"):
        plan_residency(early, [Phase("a", needs=("x",)), Phase("b", produces=("x",))], 10 * GIB)
    with pytest.raises(ValueError, match="unknown group"):
        plan_residency([], [Phase("a", needs=("y",))], GIB)
    with pytest.raises(ValueError, match="not one of"):
        phases_from_groups([G("z", 1, consumers=("nowhere",))], ["a"])
