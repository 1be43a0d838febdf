"""The run executes its residency plan: one driver call per phase boundary.

:class:`PhaseResidency` holds the run's plan (``step_plan.run_plan``) and says, per phase, which
of the groups the engines can move are on the device: the actor's Adam states
(``optimizer_states``), the reference's weights (``ref_weights``), the actor's weights where the
backend moves them (``actor_weights``: torch backend, sharing off) and the rollout engine's own
weights (``rollout_weights``, released/resumed by tag as SGLang's memory tags are). The groups no
engine moves stay whole on the device while alive (``groups.pinned_groups``); the gradients are
freed by the update itself after its last optimizer step (``ModelBackend.release_grads``).

:func:`enter_phase` is the step's hook: called at the start of each phase (``rollout_decode``,
``old_log_prob``, ``ref_log_prob``, ``actor_update``, ``weight_sync``; the optimizer steps run
inside the update), it sends each train rank and rollout worker the phase's targets and gathers
what they measured from their own tensors: the rows ``memory/<phase>/<group>_gib`` (the most of any
device) of the phase after its moves, and the previous phase's rows of the groups it made (prefix
states of the decode window, the rollout's KV cache), plus the bytes moved
(``memory/offloaded_bytes``, ``memory/prefetched_bytes``, summed over the step's boundaries).
``actor_update``'s gradients and the ``optimizer_step`` rows come from the update itself
(``PPOEngine.update_actor``, measured after the first optimizer step).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from rollplex_train.memory import estimate as est
from rollplex_train.memory.groups import PHASES
from rollplex_train.memory.step_plan import StepPlan, budget_bytes, plan_rows, row, run_plan

if TYPE_CHECKING:
    from rollplex_train.config import Config

log = logging.getLogger(__name__)

TRAIN_MOVES = ("actor_weights", "optimizer_states", "ref_weights")
"""Groups the train ranks move (``PPOEngine.PARTS_OF_GROUP``)."""
ROLLOUT_MOVES = ("rollout_weights",)
"""Groups the rollout workers move (``RolloutEngine.release_memory(("weights",))``)."""
MADE_IN = {"rollout_decode": ("old_prefix_kv", "ref_prefix_kv", "rollout_kv")}
"""Groups a phase makes, read when the next one starts (before its moves)."""
BOUNDARIES = ("rollout_decode", "old_log_prob", "ref_log_prob", "actor_update", "weight_sync")
"""The phases the step enters by :func:`enter_phase`; ``optimizer_step`` runs inside the update."""


class PhaseResidency:
    """What each phase of the run's residency plan puts on the device (module docstring).

    Args:
        step: the run's plan (``step_plan.run_plan``).
    """

    def __init__(self, step: StepPlan):
        self.step = step
        self.rows = plan_rows(step)
        names = {g.name: g for g in step.groups}
        self.moving = [g for g in TRAIN_MOVES + ROLLOUT_MOVES
                       if g in names and names[g].item_bytes and g not in step.pinned]

    @classmethod
    def from_config(cls, config: "Config") -> "PhaseResidency":
        """The plan of ``config``'s run (its checkpoint's architecture).

        Raises:
            ValueError: ``memory.budget_gib`` is set and the plan does not fit it (the message names
                the phase and the least budget); without it the plan is made at its least budget.
            FileNotFoundError: no architecture file (``model.path``/``model.hf_config``).
        """
        from rollplex_train.models.arch import load_hf_config

        step = run_plan(config, load_hf_config(config.model))
        budget = budget_bytes(config)
        if not step.short_bytes and step.executed_update_bytes() > budget:  # the optimizer step's groups come early
            step.short_bytes, step.worst_phase = step.executed_update_bytes() - budget, "actor_update"
        if step.short_bytes:
            need = (step.short_bytes + int((config.memory.budget_gib or config.cluster.gpu_memory_gib) * est.GIB))
            text = (f"the residency plan needs at least {need / est.GIB:.4g} GiB per device in {step.worst_phase} "
                    "(rollplex-plan memory prints it)")
            if config.memory.budget_gib is not None:
                raise ValueError(f"memory.budget_gib={config.memory.budget_gib}: {text}")
            log.warning("cluster.gpu_memory_gib=%s: %s; the run follows the plan made at that budget",
                        config.cluster.gpu_memory_gib, text)
        return cls(step)

    def resident(self, phase: str) -> dict[str, bool]:
        """``{group: on the device}`` in ``phase`` for the groups the engines move
        (``StepPlan.executed_items``: the optimizer steps run inside the update, with no boundary)."""
        return {g: self.step.executed_items(phase, g) > 0 for g in self.moving}


def enter_phase(workers, residency: PhaseResidency, phase: str, metrics: dict[str, float]) -> None:
    """Start ``phase`` (one of ``BOUNDARIES``) of the residency plan on every train rank and rollout
    worker of ``workers`` (``cluster.launch.Workers``) and add to ``metrics`` the rows they measured
    (``memory/<phase>/<group>_gib``, the most of any device; the previous phase's rows of what it
    made) and the bytes moved (summed into ``memory/offloaded_bytes``/``memory/prefetched_bytes``).

    Raises:
        ValueError: ``phase`` is not a boundary; an engine refused a move.
    """
    if phase not in BOUNDARIES:
        raise ValueError(f"phase {phase!r}: expected one of {list(BOUNDARIES)}")
    targets = residency.resident(phase)
    train = workers.train.enter_phase(phase, {g: v for g, v in targets.items() if g in TRAIN_MOVES})
    rollout = workers.rollout.enter_phase(phase, {g: v for g, v in targets.items() if g in ROLLOUT_MOVES})
    train_reports, rollout_reports = train.result(), rollout.result()
    made = MADE_IN.get(PHASES[PHASES.index(phase) - 1], ())
    rows: dict[str, int] = {}

    def note(name: str, nbytes: int) -> None:  # the most of any device
        rows[name] = max(rows.get(name, 0), nbytes)

    for report in train_reports + rollout_reports:
        for group, nbytes in report["rows"].items():
            if not (phase == "actor_update" and group == "grads"):  # the update measures its gradients
                note(row(phase, group), nbytes)
        for group in made:
            if group in report["closing"]:
                note(row(PHASES[PHASES.index(phase) - 1], group), report["closing"][group])
    if phase == "actor_update":  # the rollout keeps what it holds through the update's optimizer steps
        for report in rollout_reports:
            for group, nbytes in report["rows"].items():
                note(row("optimizer_step", group), nbytes)
    metrics.update({name: nbytes / est.GIB for name, nbytes in rows.items() if name in residency.rows})
    reports = train_reports + rollout_reports
    for key, field in (("memory/offloaded_bytes", "offloaded"), ("memory/prefetched_bytes", "prefetched")):
        metrics[key] = metrics.get(key, 0.0) + float(sum(r[field] for r in reports))
