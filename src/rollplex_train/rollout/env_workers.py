"""A small pool of daemon threads for environment calls, with a per-call time limit.

``concurrent.futures.ThreadPoolExecutor`` joins its worker threads at interpreter exit, so one
environment ``step`` that never returns would hang the process after the rollout gave up on it.
These workers are daemon threads, and a call that overruns its limit gets its worker replaced, so
the pool keeps ``num_workers`` threads able to run the calls queued behind it.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future, wait
from typing import Any, Callable


class StepTimeout(TimeoutError):
    """An environment call ran past its limit (its thread is abandoned, still running)."""


class EnvWorkers:
    """Runs submitted calls on ``num_workers`` daemon threads.

    Args:
        num_workers: threads (>= 1).
        timeout_s: most seconds a call may run once started (queue time not counted).
    """

    def __init__(self, num_workers: int, timeout_s: float):
        self.timeout_s = timeout_s
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # a call's end and its time-out decided once
        self._threads = [self._start_worker() for _ in range(max(1, num_workers))]
        self.abandoned = 0
        """Calls given up on (their threads may still be running)."""

    def _start_worker(self) -> threading.Thread:
        thread = threading.Thread(target=self._work, name="env-worker", daemon=True)
        thread.start()
        return thread

    def _work(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            future, fn, args = task
            if not future.set_running_or_notify_cancel():
                continue
            future.started_at = time.monotonic()
            try:
                result, error = fn(*args), None
            except BaseException as err:  # noqa: BLE001 - handed to the waiter
                result, error = None, err
            with self._lock:
                if getattr(future, "abandoned", False):
                    return  # timed out: a replacement took this thread's place
                if error is None:
                    future.set_result(result)
                else:
                    future.set_exception(error)

    def submit(self, fn: Callable, *args: Any) -> Future:
        """Queue ``fn(*args)``; its future's result is the value, or the exception it raised."""
        future: Future = Future()
        self._tasks.put((future, fn, args))
        return future

    def wait(self, futures: list[Future]) -> None:
        """Return when every future is done or has run past ``timeout_s``; the latter get a
        :class:`StepTimeout` exception (their thread is abandoned and a new worker started)."""
        pending = {f for f in futures if not f.done()}
        while pending:
            running = [f.started_at for f in pending if getattr(f, "started_at", None) is not None]
            horizon = min(running) + self.timeout_s - time.monotonic() if running else self.timeout_s
            done, pending = wait(pending, timeout=max(horizon, 0.01))
            now = time.monotonic()
            for f in list(pending):
                started = getattr(f, "started_at", None)
                if started is None or now - started < self.timeout_s:
                    continue
                pending.discard(f)
                with self._lock:
                    if f.done():
                        continue
                    f.abandoned = True
                    self.abandoned += 1
                    self._threads.append(self._start_worker())
                    f.set_exception(StepTimeout(f"did not return within {self.timeout_s:g} s"))

    def shutdown(self) -> None:
        """Let idle workers exit (never waits for a running call)."""
        for _ in self._threads:
            self._tasks.put(None)
