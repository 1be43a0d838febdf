"""What the step needs from the worker groups, free of Ray: pending calls and typed results.

The step (``runtime/step.py``) drives a ``RolloutGroup`` and a ``TrainGroup`` (``cluster/groups.py``)
whose calls return :class:`Pending` results: a list of ``concurrent.futures.Future`` (one per
worker called) and a function that combines their values. The Ray executor makes the futures from
``ObjectRef.future()``, the in-process executor from its per-worker threads, so the step reads
the same on both and never imports Ray (verl's ``single_controller`` dispatch / collect split,
slime's ``RayTrainGroup`` fan-out).

Workers answer with typed records: the training engines' ``PrefixResult`` and ``ChunkResult``
(``training/base.py``, each with its observability numbers in one ``metrics`` field; the groups put
the step's global prompt indices on them) and :class:`WeightsExport`. A decode strategy answers the step with a :class:`RolloutResult`. Times are
``time.perf_counter`` seconds of the process that measured them (CLOCK_MONOTONIC: comparable with
the driver's on one machine).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional


@dataclass
class WeightsExport:
    """A train rank's shared actor weights (``export_shared_weights``): ``payload`` for the rollout
    engine's ``map_shared_weights``, and the bytes shared as views, rebuilt per sync and held by the
    rollout in all."""

    payload: Any
    view_bytes: float
    rebuild_bytes: float
    rollout_bytes: float


@dataclass
class RolloutResult:
    """What a decode strategy hands the step (``runtime/step.py``).

    Attributes:
        responses: every response, grouped by prompt in the step's global prompt order
            (``Response.prompt_index`` global).
        log_probs: log-probs the strategy already computed, by role (``actor``: the old policy,
            ``ref``) and global prompt index: (n, R_g) float32, R_g the group's longest response.
            The log-prob phases compute only the groups missing here.
        metrics: the strategy's step metrics (``rollplex/*``, ``planner/*``, ``cost/*``).
        ref_pass_whole: the reference phase after it runs every group's suffix in one pass (nothing
            of it ran before): the strategy may time it (``DecodeStrategy.observe``).
    """

    responses: list
    log_probs: dict[str, dict[int, Any]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    ref_pass_whole: bool = False


class Pending:
    """A fanned-out call: its workers' futures and how to combine their values.

    Args:
        futures: one future per worker called. combine: values (in ``futures`` order) -> result
            (default: the list itself).
    """

    def __init__(self, futures: list[cf.Future], combine: Optional[Callable[[list], Any]] = None):
        self.futures = list(futures)
        self.combine = combine or (lambda values: values)
        self.started = time.perf_counter()
        self.finished_at: list[Optional[float]] = [None] * len(self.futures)
        for i, f in enumerate(self.futures):
            f.add_done_callback(lambda _, i=i: self.finished_at.__setitem__(i, time.perf_counter()))

    def seconds(self) -> list[float]:
        """Per worker, seconds from the call to its answer (after ``result()``)."""
        return [end - self.started for end in self.finished_at if end is not None]

    def imbalance(self) -> float:
        """Slowest worker's seconds over the mean (1.0: balanced; ranks that queue behind other work
        count as slow)."""
        seconds = self.seconds()
        return max(seconds) / max(1e-9, sum(seconds) / len(seconds)) if seconds else 1.0

    def done(self) -> bool:
        """True when every worker has answered (or failed)."""
        return all(f.done() for f in self.futures)

    def result(self, timeout: Optional[float] = None) -> Any:
        """The combined result; re-raises a worker's exception.

        Raises:
            concurrent.futures.TimeoutError: not done within ``timeout`` seconds.
        """
        return self.combine([f.result(timeout) for f in self.futures])

    @staticmethod
    def of(value: Any) -> "Pending":
        """An already finished result."""
        future: cf.Future = cf.Future()
        future.set_result(value)
        return Pending([future], lambda values: values[0])


def wait_first(items: Iterable[Any], timeout: Optional[float] = None) -> None:
    """Block until one of ``items`` (:class:`Pending` or ``Future``) has progressed: a Pending is
    counted as soon as any of its futures finishes; returns at once if one is already done."""
    futures: list[cf.Future] = []
    for item in items:
        futures.extend(item.futures if isinstance(item, Pending) else [item])
    if futures:
        cf.wait(futures, timeout=timeout, return_when=cf.FIRST_COMPLETED)


def get_all(items: Iterable[Pending]) -> list:
    """Results of several pendings, in order."""
    return [p.result() for p in items]


class ItemStream:
    """Items pushed by feeder threads (one per streaming worker), read by the driver.

    ``next_future()`` is a future for the next unread item (its value: the item, or ``None`` when
    every feeder has finished and nothing is left). A feeder's exception is re-raised by the read
    that reaches it.

    Args:
        num_feeders: feeders that will call :meth:`finish` once each.
    """

    def __init__(self, num_feeders: int):
        self._items: list[Any] = []
        self._read = 0
        self._open = num_feeders
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._waiter: Optional[cf.Future] = None

    def push(self, item: Any) -> None:
        with self._lock:
            self._items.append(item)
            self._wake()

    def finish(self, error: Optional[BaseException] = None) -> None:
        """A feeder is done (with the exception that stopped it, if any)."""
        with self._lock:
            self._open -= 1
            if error is not None and self._error is None:
                self._error = error
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done() and self._ready():
            waiter, self._waiter = self._waiter, None
            waiter.set_result(True)

    def _ready(self) -> bool:
        return self._read < len(self._items) or self._open == 0 or self._error is not None

    def next_future(self) -> cf.Future:
        """A future done when an unread item exists or the stream is over (``take`` will not block)."""
        with self._lock:
            future: cf.Future = cf.Future()
            if self._ready():
                future.set_result(True)
            else:
                self._waiter = future
            return future

    def take(self) -> list[Any]:
        """Every unread item (possibly none).

        Raises:
            the first feeder exception, once the items before it are read.
        """
        with self._lock:
            items, self._read = self._items[self._read:], len(self._items)
            if not items and self._error is not None:
                raise self._error
            return items

    @property
    def finished(self) -> bool:
        """Every feeder has finished and every item has been read."""
        with self._lock:
            return self._open == 0 and self._read == len(self._items) and self._error is None
