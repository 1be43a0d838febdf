"""Residency planner: which tensor groups are on the device in each phase of a step, which wait in
pinned host memory, and when they are copied (pure Python, no processes, no tensors).

Input: a device budget in bytes, the groups (size, items, kind; :class:`groups.TensorGroup` or any
object with ``name``, ``item_bytes``, ``num_items``, ``kind``) and the step's phases in order, each
with the groups it needs and the groups it produces (:class:`Phase`; :func:`phases_from_groups`
derives them from the groups' producer/consumers, a task graph can be folded into the same list).

Lifetimes: a ``state`` group is alive in every phase (its value crosses steps); a ``live`` group from
the phase that produces it to the last phase that needs it; a ``scratch`` group only in the phases
that need it. The step repeats, so the phase after the last is the first one of the next step.

Per phase the planner, greedily and in this order:

1. puts the phase's groups on the device at their minimum: all items, or one item for a group of
   several items (per-prompt state is streamed through the phase one prompt at a time). If that
   alone exceeds the budget the plan is infeasible: ``ValueError`` naming the phase, what it needs
   and the shortfall in GiB;
2. adds the remaining items of the phase's multi-item groups, one item of each group in turn
   (for the decode window this is the number of prefix states kept alive);
3. prefetches what the next phase needs (host -> device copies overlapped with this phase);
4. keeps other alive groups resident, the soonest-needed first;
5. everything else alive is offloaded to pinned host memory (device -> host at the phase's start);
   dead groups hold no memory.

With ``allow_offload=False`` every alive group stays whole on the device. Two per-group constraints
follow what the engines can do (``memory/groups.py::pinned_groups``/``evicted_groups``): a *pinned*
group stays whole on the device in every phase it is alive (no engine can move it: weights the
rollout maps, prefix states, Megatron's grad buffer while it lives); an *evicted* group is never
kept resident in step 4 (``memory.offload_optimizer``: it leaves the device after its last use of
the step and comes back by prefetch). A per-prompt group made and consumed within one phase (the
serial schedule's prefix states) passes through it one item at a time. The device bytes of a phase
never exceed the budget (property-tested in ``tests/test_memory_residency.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence

GIB = 1024**3


class GroupLike(Protocol):
    name: str
    item_bytes: int
    num_items: int
    kind: str


def made_and_used_in_one_phase(g: GroupLike) -> bool:
    """A per-prompt live group made and consumed in the same phase (the serial schedule's prefix
    states): the phase makes, uses and frees one item at a time, so it never holds more than one
    and none waits on the host. Groups without ``producer``/``consumers`` are not."""
    producer = getattr(g, "producer", None)
    return g.kind == "live" and g.num_items > 1 and producer is not None and set(getattr(g, "consumers", ())) <= {producer}


@dataclass(frozen=True)
class Phase:
    """One phase of the step: ``needs`` groups on the device, ``produces`` live groups."""

    name: str
    needs: tuple[str, ...] = ()
    produces: tuple[str, ...] = ()

    @property
    def uses(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.produces + self.needs))


@dataclass
class PhasePlan:
    """The plan of one phase. Item counts per group name.

    Attributes:
        resident: items on the device during the phase. host: alive items in pinned host memory.
        prefetch: items copied host -> device during this phase for the next one (overlapped).
        exposed: items copied host -> device at the start of this phase that no earlier phase
            prefetched (the phase waits for them). offload: items copied device -> host at the start.
        streamed: items of this phase's groups that pass through the device one at a time.
        device_bytes: bytes on the device (<= budget).
    """

    phase: str
    resident: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    prefetch: dict[str, int] = field(default_factory=dict)
    exposed: dict[str, int] = field(default_factory=dict)
    offload: dict[str, int] = field(default_factory=dict)
    streamed: dict[str, int] = field(default_factory=dict)
    device_bytes: int = 0


@dataclass
class ResidencyPlan:
    """A feasible residency plan: one :class:`PhasePlan` per phase, in step order."""

    budget_bytes: int
    phases: list[PhasePlan]
    item_bytes: dict[str, int]

    @property
    def peak_bytes(self) -> int:
        return max(p.device_bytes for p in self.phases)

    def __getitem__(self, phase: str) -> PhasePlan:
        for plan in self.phases:
            if plan.phase == phase:
                return plan
        raise KeyError(phase)

    def copy_bytes(self, phase: str) -> dict[str, int]:
        """Bytes copied in ``phase``: ``h2d_overlapped``, ``h2d_exposed``, ``d2h``."""
        plan = self[phase]

        def total(counts: dict[str, int]) -> int:
            return sum(self.item_bytes[g] * k for g, k in counts.items())

        return {"h2d_overlapped": total(plan.prefetch), "h2d_exposed": total(plan.exposed), "d2h": total(plan.offload)}

    def items_alive(self, phase: str, groups: Iterable[str]) -> int:
        """Fewest items of ``groups`` resident together in ``phase`` (e.g. prefix states in the window)."""
        plan = self[phase]
        return min(plan.resident.get(g, 0) for g in groups)


def phases_from_groups(groups: Sequence, order: Sequence[str]) -> list[Phase]:
    """Phases in ``order`` with needs/produces taken from each group's ``producer``/``consumers``.

    Raises:
        ValueError: a group names a phase that is not in ``order``.
    """
    needs: dict[str, list[str]] = {p: [] for p in order}
    produces: dict[str, list[str]] = {p: [] for p in order}
    for g in groups:
        for phase in (g.producer,) + tuple(g.consumers) if g.producer else tuple(g.consumers):
            if phase not in needs:
                raise ValueError(f"group {g.name!r} names phase {phase!r}, not one of {list(order)}")
        if g.producer:
            produces[g.producer].append(g.name)
        for c in g.consumers:
            if c != g.producer:
                needs[c].append(g.name)
    return [Phase(p, tuple(needs[p]), tuple(produces[p])) for p in order]


def _lifetimes(groups: dict[str, GroupLike], phases: Sequence[Phase]) -> dict[str, set[int]]:
    """Phase indices in which each group is alive (see the module docstring)."""
    alive: dict[str, set[int]] = {}
    for name, g in groups.items():
        used = [i for i, p in enumerate(phases) if name in p.uses]
        if g.kind == "state":
            alive[name] = set(range(len(phases)))
        elif g.kind == "scratch":
            alive[name] = set(used)
        else:
            born = [i for i, p in enumerate(phases) if name in p.produces]
            if len(born) != 1:
                raise ValueError(f"live group {name!r} must be produced by exactly one phase, got {len(born)}")
            if min(used) < born[0]:
                raise ValueError(f"live group {name!r} is needed in phase {phases[min(used)].name!r} before "
                                 f"{phases[born[0]].name!r} produces it")
            alive[name] = set(range(born[0], max(used) + 1))
    return alive


def plan_residency(groups: Sequence[GroupLike], phases: Sequence[Phase], budget_bytes: int, *,
                   allow_offload: bool = True, pinned: Iterable[str] = (), evict: Iterable[str] = ()) -> ResidencyPlan:
    """Plan per-phase residency of ``groups`` within ``budget_bytes`` (see the module docstring).
    ``pinned``: groups kept whole on the device wherever alive; ``evict``: groups never kept
    resident where not needed (both by name; unknown names are ignored).

    Raises:
        ValueError: a phase names an unknown group, a live group's producer/consumers are out of
            order, or a phase cannot fit what it needs — the message names the phase and the
            shortfall in GiB.
    """
    by_name = {g.name: g for g in groups}
    for p in phases:
        unknown = [g for g in p.uses if g not in by_name]
        if unknown:
            raise ValueError(f"phase {p.name!r} uses unknown group(s) {unknown}")
    alive = _lifetimes(by_name, phases)
    pinned, evict = frozenset(pinned), frozenset(evict)
    n = len(phases)
    plans: list[PhasePlan] = []
    prev: dict[str, int] = {}
    for _ in range(4):  # the step repeats: re-plan from the last phase's residency until steady
        first = dict(prev)
        plans = []
        for i in range(n):
            plans.append(_plan_phase(i, phases, by_name, alive, budget_bytes, allow_offload, prev, pinned, evict))
            prev = plans[-1].resident
        if prev == first:
            break
    for i, plan in enumerate(plans):
        _account_copies(i, plans, phases, by_name, alive)
    return ResidencyPlan(budget_bytes, plans, {g.name: g.item_bytes for g in groups})


def _account_copies(i: int, plans: list[PhasePlan], phases: Sequence[Phase], groups: dict[str, GroupLike],
                    alive: dict[str, set[int]]) -> None:
    """Fill ``offload``/``exposed``/``host`` of phase ``i`` from the residency of the phase before it."""
    n, plan, prev = len(phases), plans[i], plans[i - 1]
    for g, group in groups.items():
        if i not in alive[g] or group.kind == "scratch" or group.item_bytes == 0:
            continue
        now = plan.resident.get(g, 0)
        before = prev.resident.get(g, 0) if (i - 1) % n in alive[g] and g not in phases[i].produces else 0
        if now < before:
            plan.offload[g] = before - now
        elif now > before and g not in phases[i].produces:
            ready = before + prev.prefetch.get(g, 0) + plan.prefetch.get(g, 0)
            late = now - ready if group.num_items == 1 else int(ready == 0)  # the rest streams in behind
            if late > 0:
                plan.exposed[g] = late
        if group.num_items > now and not made_and_used_in_one_phase(group):  # the rest waits on the host
            plan.host[g] = group.num_items - now


def _plan_phase(i: int, phases: Sequence[Phase], groups: dict[str, GroupLike], alive: dict[str, set[int]],
                budget: int, allow_offload: bool, prev: dict[str, int], pinned: frozenset = frozenset(),
                evict: frozenset = frozenset()) -> PhasePlan:
    """Residency of phase ``i`` given the residency ``prev`` of the phase before it."""
    phase, n = phases[i], len(phases)
    plan = PhasePlan(phase.name)
    res = plan.resident
    uses = list(phase.uses)
    res.update(_minimum(i, phases, groups, alive, allow_offload, pinned))
    need = _bytes(res, groups)
    if need > budget:
        listed = ", ".join(f"{g} {groups[g].item_bytes * k / GIB:.2f}" for g, k in res.items() if k)
        raise ValueError(f"phase {phase.name!r} does not fit: it needs {need / GIB:.2f} GiB on the device ({listed}) "
                         f"with a budget of {budget / GIB:.2f} GiB: short by {(need - budget) / GIB:.2f} GiB")
    free = _fill_round_robin(res, [g for g in uses if groups[g].num_items > 1 and not made_and_used_in_one_phase(groups[g])],
                             groups, budget - need)
    for g in uses:
        if groups[g].num_items > res[g]:
            plan.streamed[g] = groups[g].num_items - res[g]
    if allow_offload:
        carried = {g: k for g, k in prev.items() if i in alive[g] and groups[g].kind != "scratch"
                   and (i - 1) % n in alive[g] and g not in phase.produces}
        nxt = phases[(i + 1) % n]
        for g in nxt.needs:  # what the next phase needs: keep it if here, else prefetch it (overlapped)
            if i not in alive[g] or (i + 1) % n not in alive[g] or groups[g].kind == "scratch":
                continue
            keep = min(carried.get(g, 0), groups[g].num_items) - res.get(g, 0)
            free = _add(res, g, keep, groups, free)
            got = _add(res, g, groups[g].num_items - res.get(g, 0), groups, free)
            if got < free:
                plan.prefetch[g] = (free - got) // groups[g].item_bytes if groups[g].item_bytes else 0
            free = got
        idle = sorted((g for g in carried if res.get(g, 0) < carried[g] and g not in evict),
                      key=lambda g: _next_use(g, i, phases, alive))
        for g in idle:  # keep what is already on the device, the soonest needed first
            free = _add(res, g, carried[g] - res.get(g, 0), groups, free)
    plan.device_bytes = budget - free
    assert plan.device_bytes == _bytes(res, groups) <= budget
    return plan


def _minimum(i: int, phases: Sequence[Phase], groups: dict[str, GroupLike], alive: dict[str, set[int]],
             allow_offload: bool, pinned: frozenset = frozenset()) -> dict[str, int]:
    """Items phase ``i`` must hold on the device: one item of each per-prompt group it uses and the
    other groups it uses whole, every ``pinned`` group alive in it whole (one item of a group made
    and used within the phase); without offload every group alive in it, whole."""
    if allow_offload:
        need = {g: 1 if groups[g].num_items > 1 else groups[g].num_items for g in phases[i].uses}
        need.update({g: groups[g].num_items for g in pinned
                     if g in alive and i in alive[g] and not made_and_used_in_one_phase(groups[g])})
        return need
    return {g: groups[g].num_items for g, phases_alive in alive.items() if i in phases_alive}


def minimum_budget(groups: Sequence[GroupLike], phases: Sequence[Phase], *,
                   allow_offload: bool = True, pinned: Iterable[str] = ()) -> tuple[str, int]:
    """``(phase, bytes)``: the phase whose minimum device footprint is the largest, and that footprint:
    the smallest budget :func:`plan_residency` accepts for ``groups`` (bytes, per device).

    Raises:
        ValueError: as :func:`plan_residency` does for unknown groups or out-of-order live groups.
    """
    by_name = {g.name: g for g in groups}
    alive = _lifetimes(by_name, phases)
    pinned = frozenset(pinned)
    needs = [(_bytes(_minimum(i, phases, by_name, alive, allow_offload, pinned), by_name), p.name)
             for i, p in enumerate(phases)]
    need, name = max(needs)
    return name, need


def _add(res: dict[str, int], g: str, want: int, groups: dict[str, GroupLike], free: int) -> int:
    """Put up to ``want`` more items of ``g`` on the device within ``free`` bytes; returns the bytes left."""
    size = groups[g].item_bytes
    k = max(0, min(want, free // size) if size else want)
    if k:
        res[g] = res.get(g, 0) + k
    return free - k * size


def _fill_round_robin(res: dict[str, int], names: list[str], groups: dict[str, GroupLike], free: int) -> int:
    """Add one item of each of ``names`` in turn while it fits; returns the bytes left."""
    progress = True
    while progress:
        progress = False
        for g in names:
            if res[g] < groups[g].num_items and groups[g].item_bytes <= free:
                res[g] += 1
                free -= groups[g].item_bytes
                progress = True
    return free


def _next_use(g: str, i: int, phases: Sequence[Phase], alive: dict[str, set[int]]) -> int:
    """Phases from ``i`` until ``g`` is next needed (cyclic), or len(phases) if never."""
    n = len(phases)
    for d in range(1, n + 1):
        if g in phases[(i + d) % n].uses and (i + d) % n in alive[g]:
            return d
    return n


def _bytes(resident: dict[str, int], groups: dict[str, GroupLike]) -> int:
    return sum(groups[g].item_bytes * k for g, k in resident.items())
