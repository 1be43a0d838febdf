"""The residency plan a run executes, and the rows of it the run measures.

:func:`plan_step` plans one step's tensor groups (``groups.step_groups``) within the device budget
under what the engines can do: the groups they cannot move stay whole on the device while alive
(``groups.pinned_groups``), the Adam states leave it after their last use with
``memory.offload_optimizer`` (``groups.evicted_groups``). ``rollplex-plan memory`` prints it
(``report.py``); :func:`run_plan` is the plan of the configured run itself (its schedule, its
sharing, its backend's layout), which the run executes phase by phase (``executor.py``).

Each phase of the run logs ``memory/<phase>/<group>_gib``: the bytes the group's tensors hold on
one device, measured from the engines' own tensors (the most of any device). :func:`plan_rows` is
the same rows from the plan:

* ``exact`` rows: the weights, master weights, Adam states, reference, rollout copy and rebuilt
  rollout buffers in every phase (read at the phase's start, after its moves); the gradients in
  every phase (read at the first optimizer step for ``actor_update``/``optimizer_step``: they live
  only inside the update); the rollout KV cache in ``rollout_decode`` (the engine's largest cache
  of the step's requests);
* ``at_most`` rows: the old-policy and reference prefix KV caches made in the decode window
  (``rollplex``; read when the window ends and when their consumer phase starts): the plan lets the
  window keep all of them, the window planner makes those the decode's time allows.

Activations, logits, the actor's prefix graphs and other scratch are planned but not measured.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from rollplex_train.memory import estimate as est
from rollplex_train.memory.groups import PHASES, TensorGroup, evicted_groups, pinned_groups, step_groups
from rollplex_train.memory.residency import (ResidencyPlan, made_and_used_in_one_phase, minimum_budget,
                                             phases_from_groups, plan_residency)

if TYPE_CHECKING:
    from rollplex_train.config import Config

log = logging.getLogger(__name__)

STATE_ROWS = ("actor_weights", "master_weights", "optimizer_states", "ref_weights", "rollout_weights",
              "rollout_rebuilt", "grads")
"""Groups measured exactly in every phase."""
UPDATE_PHASES = ("actor_update", "optimizer_step")
"""The phases of one update call: no phase boundary between them (``executor.BOUNDARIES``)."""
PREFIX_ROWS = ("old_prefix_kv", "ref_prefix_kv")
"""Groups measured as an upper bound where the decode window makes them."""


@dataclass
class StepPlan:
    """A step's groups and their residency plan.

    Attributes:
        groups: the step's tensor groups. plan: their residency per phase. worst_phase,
        short_bytes: the phase that sets the least budget and how far that is over the budget (0:
        the plan fits; else the plan is made at that least budget). pinned, evicted: the groups
        kept whole wherever alive / moved off after their last use.
    """

    groups: list[TensorGroup]
    plan: ResidencyPlan
    worst_phase: str
    short_bytes: int
    pinned: frozenset
    evicted: frozenset

    def group(self, name: str) -> TensorGroup:
        return next(g for g in self.groups if g.name == name)

    def resident_bytes(self, phase: str, name: str) -> int:
        """Bytes of group ``name`` the plan puts on the device in ``phase``."""
        return self.plan.item_bytes.get(name, 0) * self.plan[phase].resident.get(name, 0)

    def executed_items(self, phase: str, name: str) -> int:
        """Items of group ``name`` on the device in ``phase`` as the run executes the plan. The run
        moves groups at phase boundaries only and has none inside the update, so ``actor_update``
        and ``optimizer_step`` hold the same: what the update phase holds, plus what the optimizer
        step uses (brought in at the update's start); a group the plan prefetches during the
        optimizer step for a later phase comes at the next boundary (``weight_sync``)."""
        if phase not in UPDATE_PHASES:
            return self.plan[phase].resident.get(name, 0)
        held = self.plan["actor_update"].resident.get(name, 0)
        if "optimizer_step" in self.group(name).consumers:
            held = max(held, self.plan["optimizer_step"].resident.get(name, 0))
        return held

    def executed_update_bytes(self) -> int:
        """Device bytes of the update as the run executes it (:meth:`executed_items`): the plan's
        ``actor_update`` bytes and what the optimizer step's groups add at the update's start."""
        extra = sum((self.executed_items("actor_update", g.name) - self.plan["actor_update"].resident.get(g.name, 0))
                    * g.item_bytes for g in self.groups)
        return self.plan["actor_update"].device_bytes + extra


def budget_bytes(config: "Config") -> int:
    """Device budget per GPU: ``memory.budget_gib`` (or ``cluster.gpu_memory_gib``); ``runtime_reserved``
    is itself a group, so the whole budget is passed to the planner."""
    gib = config.memory.budget_gib if config.memory.budget_gib is not None else config.cluster.gpu_memory_gib
    return int(gib * est.GIB)


def plan_step(config: "Config", hf_config: Any, layout_name: str = "rollplex",
              shared: Optional[bool] = None) -> StepPlan:
    """The groups of ``layout_name`` (``groups.LAYOUTS``) for ``config`` and their residency plan
    (see the module docstring); ``shared``: as ``groups.step_groups``."""
    groups = step_groups(config, hf_config, layout_name, shared=shared)
    shared_weights = next(g for g in groups if g.name == "rollout_weights").nbytes == 0
    pinned, evicted = pinned_groups(config, shared_weights), evicted_groups(config)
    phases = phases_from_groups(groups, PHASES)
    budget, offload = budget_bytes(config), config.memory.pinned_host_offload
    phase, need = minimum_budget(groups, phases, allow_offload=offload, pinned=pinned)
    plan = plan_residency(groups, phases, max(budget, need), allow_offload=offload, pinned=pinned, evict=evicted)
    return StepPlan(groups, plan, phase, max(0, need - budget), pinned, evicted)


def run_config(config: "Config") -> "Config":
    """``config`` with the memory layout its backend runs: ``actor.backend=torch`` keeps whole
    replicas (``train_strategy=megatron`` at t = 1, no distributed optimizer), ``megatron`` its TP
    shards with megatron's distributed optimizer on CUDA only (``training/megatron/optimizer.py``)."""
    megatron = config.actor.backend == "megatron"
    memory = dataclasses.replace(config.memory, train_strategy="megatron",
                                 distributed_optimizer=megatron and config.cluster.device == "cuda")
    if memory != config.memory:
        log.info("the run plans its backend's memory layout: memory.train_strategy=megatron, "
                 "memory.distributed_optimizer=%s (the config says %s, %s)", memory.distributed_optimizer,
                 config.memory.train_strategy, config.memory.distributed_optimizer)
        return dataclasses.replace(config, memory=memory)
    return config


def run_plan(config: "Config", hf_config: Any) -> StepPlan:
    """The plan of the configured run: prefix work in the decode window with ``schedule.name=rollplex``
    (else in its phases), the rollout mapping the actor's weights with ``sharing.enabled``, the
    backend's own memory layout (:func:`run_config`)."""
    layout = "rollplex" if config.schedule.name == "rollplex" else "serial"
    return plan_step(run_config(config), hf_config, layout, shared=config.sharing.enabled)


def row(phase: str, group: str) -> str:
    """The metric name of a measured row: ``memory/<phase>/<group>_gib``."""
    return f"memory/{phase}/{group}_gib"


def plan_rows(step: StepPlan) -> dict[str, tuple[float, str]]:
    """``{row name: (GiB, "exact" | "at_most")}`` of the rows the run measures (module docstring)."""
    rows: dict[str, tuple[float, str]] = {}
    names = {g.name: g for g in step.groups}
    for phase in PHASES:
        for name in STATE_ROWS:
            if name in names and names[name].item_bytes:
                rows[row(phase, name)] = (step.executed_items(phase, name) * names[name].item_bytes / est.GIB, "exact")
        for name in PREFIX_ROWS:
            g = names.get(name)
            if g is not None and not made_and_used_in_one_phase(g) and _alive(g, phase):
                rows[row(phase, name)] = (step.resident_bytes(phase, name) / est.GIB, "at_most")
    if names["rollout_kv"].item_bytes:
        rows[row("rollout_decode", "rollout_kv")] = (names["rollout_kv"].nbytes / est.GIB, "exact")
    return rows


def _alive(g: TensorGroup, phase: str) -> bool:
    """Whether the live group ``g`` exists in ``phase`` (from its producer to its last consumer)."""
    return PHASES.index(g.producer) <= PHASES.index(phase) <= max(PHASES.index(c) for c in g.consumers)


def max_rel_err(planned: dict[str, tuple[float, str]], measured: dict[str, float]) -> tuple[float, list[str]]:
    """``(max relative error of the exact rows, rows that break the plan)``: an exact row's error is
    ``|measured - plan| / plan`` (0 when both are 0, infinite for bytes the plan does not have); an
    ``at_most`` row breaks the plan when it measures more than planned; a planned row the run did
    not log breaks it too."""
    worst, broken = 0.0, []
    for name, (gib, kind) in planned.items():
        if name not in measured:
            broken.append(f"{name}: not measured")
            continue
        got = measured[name]
        if kind == "at_most":
            if got > gib * (1 + 1e-9):
                broken.append(f"{name}: {got:.6g} GiB measured, at most {gib:.6g} planned")
            continue
        err = 0.0 if got == gib else abs(got - gib) / gib if gib else float("inf")
        worst = max(worst, err)
    return worst, broken
