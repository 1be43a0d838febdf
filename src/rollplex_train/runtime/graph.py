"""The task graph of one synchronous on-policy step.

Per prompt group g (the G responses of one prompt):

    decode/g ──> reward/g ──────────────────────────────> adv ──> update/mb0 ──> ... ──> sync
    prefix/old/g ──> suffix/old/g ──────────────────────────────> update/mb(k of g)
    prefix/ref/g ──> suffix/ref/g ──────────────────────────────> update/mb(k of g)
    prefix/actor/g (first mini-batch only) ──────────────────────> update/mb0
    decode/g ──> suffix/old/g, suffix/ref/g

Prefix tasks (vision/video encoding and prompt tokens, per role) depend only on the prompt and the
weights version, so they are *movable*: the phase planner may run them inside the decode window.
Only the first mini-batch's actor prefixes are movable: later mini-batches run on weights that the
first optimizer step changes. Suffix tasks need the group's responses; updates need all advantages.

Each task carries its worker (``rollout``, ``train``, ``driver``), its work size in tokens (the
cost model turns tokens into seconds for a thread count) and the memory it creates and frees
(bytes of prefix state held between a prefix task and its last consumer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

PREFIX_ROLES = ("old", "ref", "actor")
"""Prefix roles: old-policy scoring, reference scoring, actor prefix with autograd graph."""


@dataclass(frozen=True)
class Task:
    """One node of the step graph.

    Attributes:
        name: unique, e.g. ``prefix/ref/g3``. kind: ``decode``, ``reward``, ``prefix/<role>``,
            ``suffix/<role>``, ``adv``, ``update``, ``sync``.
        worker: the worker that runs it: ``rollout``, ``train`` or ``driver``.
        group: prompt-group index for per-group tasks, else None.
        deps: names of the tasks that must finish first.
        tokens: work size in tokens (prefix: prompt tokens incl. vision tokens; suffix/update:
            response tokens; decode: sampled tokens) — the cost model's input.
        weights_version: the actor weights version the task must run under.
        movable: may run inside the decode window (depends only on the prompt and the version).
        creates_bytes: bytes of state the task leaves alive (a prefix KV cache / activations).
        frees: names of the tasks whose state this task is the last consumer of.
    """

    name: str
    kind: str
    worker: str
    group: Optional[int] = None
    deps: tuple[str, ...] = ()
    tokens: int = 0
    weights_version: int = 0
    movable: bool = False
    creates_bytes: int = 0
    frees: tuple[str, ...] = ()

    @property
    def role(self) -> Optional[str]:
        """``old``/``ref``/``actor`` for prefix and suffix tasks, else None."""
        head, _, role = self.kind.partition("/")
        return role if head in ("prefix", "suffix") else None


@dataclass
class StepGraph:
    """The tasks of one step by name, in insertion order (a valid topological order)."""

    tasks: dict[str, Task] = field(default_factory=dict)
    decode_steps: int = 0
    """Decode steps of the step's batched rollout (the window's length in steps: on small batches
    a decode step costs about the same whatever the number of live rows)."""

    def add(self, task: Task) -> Task:
        """Add ``task``; its dependencies must already be in the graph.

        Raises:
            ValueError: a duplicate name or an unknown dependency (so the graph stays acyclic).
        """
        if task.name in self.tasks:
            raise ValueError(f"task {task.name!r} is already in the graph")
        missing = [d for d in task.deps if d not in self.tasks]
        if missing:
            raise ValueError(f"task {task.name!r} depends on unknown tasks {missing}")
        self.tasks[task.name] = task
        return task

    def __getitem__(self, name: str) -> Task:
        return self.tasks[name]

    def __iter__(self):
        return iter(self.tasks.values())

    def movable(self) -> list[Task]:
        """Tasks the planner may place inside the decode window, in graph order."""
        return [t for t in self if t.movable]

    def of_kind(self, prefix: str) -> list[Task]:
        """Tasks whose kind starts with ``prefix`` (e.g. ``suffix``)."""
        return [t for t in self if t.kind.startswith(prefix)]

    def ready_after(self, done: Iterable[str]) -> list[Task]:
        """Tasks not in ``done`` whose dependencies all are."""
        finished = set(done)
        return [t for t in self if t.name not in finished and all(d in finished for d in t.deps)]

    def live_bytes(self, done: Iterable[str]) -> int:
        """Bytes of task state alive once the tasks in ``done`` have run: created by a done task
        and not yet freed by a done consumer."""
        finished = set(done)
        freed = {f for name in finished for f in self.tasks[name].frees}
        return sum(self.tasks[n].creates_bytes for n in finished if n not in freed)


def build_step_graph(prompt_tokens: list[int], response_tokens: int, *, decode_steps: int, mini_batch_groups: int,
                     needs_reference: bool, weights_version: int, prefix_bytes_per_token: float = 0.0,
                     actor_bytes_per_token: float = 0.0, old_from_actor_groups: int = 0,
                     actor_prefixes_movable: bool = True, groups: Optional[list[int]] = None) -> StepGraph:
    """The task graph of one step.

    Args:
        prompt_tokens: per group, the prompt length in tokens (vision tokens included).
        response_tokens: expected response tokens per group (G responses together).
        decode_steps: expected decode steps of the whole rollout (longest response, per chunk).
        mini_batch_groups: groups per PPO mini-batch (one optimizer step).
        needs_reference: KL to the reference is on (reference prefix/suffix tasks exist).
        weights_version: the rollout's weights version for this step.
        prefix_bytes_per_token / actor_bytes_per_token: state bytes per prompt token of a no-grad
            prefix (KV cache) / an actor prefix with its autograd graph.
        old_from_actor_groups: the first this-many groups take their old-policy log-probs from the
            actor's own forward in the first mini-batch (``runtime/old_policy.py``): no old tasks.
        actor_prefixes_movable: False when the first mini-batch's actor prefixes run before decode
            (their KV caches handed to the rollout, ``schedule.prefill_from_actor``): not the
            planner's to place.
        groups: the step's global prompt index of each group (a DP rank's graph covers some of the
            step's groups): the tasks' ``group`` and names (default ``0 .. len(prompt_tokens) - 1``).
            Mini-batch membership counts the groups in this order.

    Raises:
        ValueError: no groups, or ``mini_batch_groups`` < 1.
    """
    if not prompt_tokens:
        raise ValueError("build_step_graph: no prompt groups")
    if mini_batch_groups < 1:
        raise ValueError(f"mini_batch_groups={mini_batch_groups}: expected >= 1")
    g = StepGraph(decode_steps=decode_steps)
    v = weights_version
    ref_roles = ["ref"] if needs_reference else []
    num_groups = len(prompt_tokens)
    ids = list(range(num_groups)) if groups is None else list(groups)
    assert len(ids) == num_groups, (ids, num_groups)
    num_mini = (num_groups + mini_batch_groups - 1) // mini_batch_groups
    for i, (gid, tokens) in enumerate(zip(ids, prompt_tokens)):
        g.add(Task(f"decode/g{gid}", "decode", "rollout", gid, tokens=response_tokens, weights_version=v))
        g.add(Task(f"reward/g{gid}", "reward", "driver", gid, deps=(f"decode/g{gid}",), weights_version=v))
        for role in (ref_roles if i < old_from_actor_groups else ["old", *ref_roles]):
            prefix = g.add(Task(f"prefix/{role}/g{gid}", f"prefix/{role}", "train", gid, tokens=tokens,
                                weights_version=v, movable=True,
                                creates_bytes=int(tokens * prefix_bytes_per_token)))
            g.add(Task(f"suffix/{role}/g{gid}", f"suffix/{role}", "train", gid, deps=(f"decode/g{gid}", prefix.name),
                       tokens=response_tokens, weights_version=v, frees=(prefix.name,)))
        if i < mini_batch_groups:  # the first optimizer step runs on the rollout's weights version
            g.add(Task(f"prefix/actor/g{gid}", "prefix/actor", "train", gid, tokens=tokens, weights_version=v,
                       movable=actor_prefixes_movable, creates_bytes=int(tokens * actor_bytes_per_token)))
    g.add(Task("adv", "adv", "driver", deps=tuple(f"reward/g{gid}" for gid in ids), weights_version=v))
    previous = "adv"
    for k in range(num_mini):
        members = ids[k * mini_batch_groups : (k + 1) * mini_batch_groups]
        deps = [previous] + [f"suffix/{role}/g{gid}" for gid in members for role in ["old", *ref_roles]
                             if f"suffix/{role}/g{gid}" in g.tasks]
        frees: tuple[str, ...] = ()
        if k == 0:
            deps += [f"prefix/actor/g{gid}" for gid in members]
            frees = tuple(f"prefix/actor/g{gid}" for gid in members)
        previous = g.add(Task(f"update/mb{k}", "update", "train", deps=tuple(deps),
                              tokens=response_tokens * len(members), weights_version=v, frees=frees)).name
    g.add(Task("sync", "sync", "rollout", deps=(previous,), weights_version=v + 1))
    return g
