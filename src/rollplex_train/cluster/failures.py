"""A failed worker named in one line, and the workers torn down for a restart.

Ray reports a worker process that died (SIGKILL, the OOM killer, a crash) as
``ray.exceptions.ActorDiedError`` (a ``RayActorError``) to every call on it, its ``actor_id`` the
dead actor's hex id and its ``error_msg`` the death's context (exit type and detail); an exception
raised inside a live worker's method arrives as a ``RayTaskError`` carrying the original exception
(``.cause``) and the actor id (Ray 2.x, ``ray/exceptions.py``). A DP peer of a dead rank often
fails first with its own exception (gloo's "Connection closed by peer"), so :func:`diagnose` asks
every worker whether it is alive before blaming the one whose call failed.
"""

from __future__ import annotations

import logging
import re
from typing import Optional

log = logging.getLogger(__name__)


class WorkerFailure(RuntimeError):
    """A worker of the run failed.

    Attributes:
        role: ``train`` or ``rollout``. rank: the train rank, or the rollout worker's index
            (engines in order, their TP ranks in order). cause: ``killed by signal ...``, ``out of
            memory`` or the exception's ``Type: text``.
    """

    def __init__(self, role: str, rank: int, cause: str, raised: bool = False):
        super().__init__(f"{role} worker rank {rank} failed: {cause}")
        self.role, self.rank, self.cause, self.raised = role, rank, cause, raised  # raised: an exception, not a death
        self.step = 0  # set by the trainer: the step it failed in
        self.last_checkpoint = None  # set by the trainer: its newest checkpoint (None: none)


def _roles(workers) -> dict[str, tuple[str, int]]:
    """Ray actor id (hex) -> (role, rank) of every worker."""
    out = {}
    for role, handles in (("train", workers.train.handles), ("rollout", workers.rollout.all_handles)):
        for rank, handle in enumerate(handles):
            actor_id = getattr(handle, "_actor_id", None)
            if actor_id is not None:
                out[actor_id.hex()] = (role, rank)
    return out


def death_cause(message: str) -> str:
    """The cause in a Ray actor-death message (``ActorDiedError.error_msg``): ``out of memory``
    where Ray's memory monitor killed it (exit type ``NODE_OUT_OF_MEMORY``), ``killed by signal
    <name>`` where the message names one, ``killed by a signal`` where the process vanished without
    a word (Ray's "connection error ... End of file": SIGKILL, the kernel's OOM killer, a segfault;
    Ray cannot tell them apart), else the message's last line."""
    if re.search(r"NODE_OUT_OF_MEMORY|running low on memory", message):
        return "out of memory (Ray's memory monitor killed it)"
    signal = re.search(r"\b(SIG(?:KILL|TERM|SEGV|ABRT|BUS|INT))\b(?! or another)", message)
    if signal and "common causes" not in message:
        return f"killed by signal {signal.group(1)}"
    if re.search(r"connection error|End of file|worker process has died|UNEXPECTED_SYSTEM_EXIT", message):
        return "killed by a signal (SIGKILL, the kernel's OOM killer or a crash: its process exited without a reply)"
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[-1] if lines else "died"


def _exception_text(err: BaseException) -> str:
    cause = getattr(err, "cause", None) or err
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}".rstrip(": ")


def diagnose(workers, err: BaseException, probe_timeout_s: float = 5.0) -> Optional[WorkerFailure]:
    """The failed worker behind ``err`` (raised by a call on ``workers``), or None when ``err`` is
    not a worker's failure (a driver error, or the in-process executor, whose errors keep their
    traceback).

    A dead worker is preferred over one that raised: every worker is probed (Ray's
    ``__ray_ready__``, at most ``probe_timeout_s`` seconds in all) and the first dead one is named.
    """
    try:
        from ray.exceptions import RayActorError, RayTaskError
    except ImportError:
        return None
    if not isinstance(err, (RayActorError, RayTaskError)):
        return None
    import ray

    roles = _roles(workers)
    probes = {actor_id: h.__ray_ready__.remote() for h in (*workers.train.handles, *workers.rollout.all_handles)
              if (actor_id := h._actor_id.hex())}
    ray.wait(list(probes.values()), num_returns=len(probes), timeout=probe_timeout_s)
    for actor_id, ref in probes.items():
        try:
            ray.get(ref, timeout=0)
        except RayActorError as dead:
            return WorkerFailure(*roles[actor_id], death_cause(dead.error_msg))
        except Exception:  # noqa: BLE001 - still busy or unanswered: not known dead
            continue
    actor_id = getattr(err, "actor_id", None) or getattr(err, "_actor_id", None)
    role, rank = roles.get(actor_id, ("unknown", -1))
    if isinstance(err, RayActorError):
        return WorkerFailure(role, rank, death_cause(err.error_msg))
    return WorkerFailure(role, rank, _exception_text(err), raised=True)


def tear_down(workers) -> None:
    """Kill every Ray worker of ``workers`` and free their placement group, so a restart can
    place new ones on the same devices (the in-process executor: its threads are joined)."""
    executor = workers.executor
    if executor.kind != "ray":
        workers.shutdown()
        return
    import ray
    from ray.util.placement_group import remove_placement_group

    for handle in (*workers.train.handles, *workers.rollout.all_handles):
        ray.kill(handle, no_restart=True)
    remove_placement_group(executor.placement.pg)
