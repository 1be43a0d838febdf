"""Executors: where a worker lives and how a call reaches it.

``RayExecutor``: each worker is a Ray actor on its device's placement-group bundle; a call is
``handle.method.remote(...)`` turned into a ``concurrent.futures.Future`` (``ObjectRef.future()``).
``InProcessExecutor``: each worker is an object in the driver with one thread of its own, so calls
to one worker run in order (as a Ray actor's do) and calls to different workers overlap, which is
what the rollplex schedule needs (tests without Ray, GPU benchmarks on machines without Ray).

Every ``.remote()``/``ray.get`` of the project lives in ``cluster/``.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Any, Optional

from rollplex_train.runtime.protocol import ItemStream


class InProcessHandle:
    """A worker object and its call thread."""

    def __init__(self, obj: Any, name: str):
        self.obj = obj
        self.pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)


class InProcessExecutor:
    """Workers as objects in this process, one thread each."""

    kind = "inprocess"

    def spawn(self, cls, args: tuple, device: int, gpu_fraction: float, concurrency: int = 1,
              env_vars: Optional[dict[str, str]] = None) -> InProcessHandle:
        """Build ``cls(*args)`` on the worker's own thread (torch thread settings are per thread);
        ``env_vars`` are a separate process's (Ray's) and do not apply here."""
        handle = InProcessHandle(None, cls.__name__)
        handle.obj = handle.pool.submit(cls, *args).result()
        return handle

    def call(self, handle: InProcessHandle, method: str, *args, concurrent: bool = False) -> cf.Future:
        """``handle.obj.method(*args)`` on the worker's thread; ``concurrent=True`` runs it on the
        caller's thread at once (a share change reaching a decoding worker)."""
        if concurrent:
            future: cf.Future = cf.Future()
            try:
                future.set_result(getattr(handle.obj, method)(*args))
            except BaseException as err:  # noqa: BLE001 - handed to the caller through the future
                future.set_exception(err)
            return future
        return handle.pool.submit(getattr(handle.obj, method), *args)

    def put(self, value: Any) -> Any:
        """Objects are shared by reference in one process."""
        return value

    def stream(self, handle: InProcessHandle, method: str, args: tuple, out: ItemStream, tag: Any) -> None:
        """Iterate ``handle.obj.method(*args)`` on the worker's thread, pushing ``(tag, item)``."""

        def feed() -> None:
            try:
                for item in getattr(handle.obj, method)(*args):
                    out.push((tag, item))
            except BaseException as err:  # noqa: BLE001
                out.finish(err)
                return
            out.finish()

        handle.pool.submit(feed)

    def shutdown(self, handles: list[InProcessHandle]) -> None:
        for h in handles:
            h.pool.shutdown(wait=True)


class RayExecutor:
    """Workers as Ray actors placed on their devices' bundles.

    Args:
        placement: a ``cluster.placement.DevicePlacement`` (bundles ordered by node and device).
    """

    kind = "ray"

    def __init__(self, placement):
        self.placement = placement

    def spawn(self, cls, args: tuple, device: int, gpu_fraction: float, concurrency: int = 1,
              env_vars: Optional[dict[str, str]] = None):
        import ray

        options = self.placement.actor_options(device, gpu_fraction, env_vars)
        if concurrency > 1:
            options["max_concurrency"] = concurrency
        return ray.remote(cls).options(**options).remote(*args)

    def call(self, handle, method: str, *args, concurrent: bool = False) -> cf.Future:
        return getattr(handle, method).remote(*args).future()

    def put(self, value: Any):
        """Into Ray's object store once; workers resolve the reference (``workers.resolve``)."""
        import ray

        return ray.put(value)

    def stream(self, handle, method: str, args: tuple, out: ItemStream, tag: Any) -> None:
        """A Ray streaming generator call, read by a feeder thread that pushes ``(tag, item)``."""
        import ray

        refs = getattr(handle, method).options(num_returns="streaming").remote(*args)

        def feed() -> None:
            try:
                for ref in refs:
                    out.push((tag, ray.get(ref)))
            except BaseException as err:  # noqa: BLE001
                out.finish(err)
                return
            out.finish()

        threading.Thread(target=feed, daemon=True, name=f"stream-{tag}").start()

    def shutdown(self, handles: list) -> None:
        """Nothing: the actors (and the shared-memory weights they map) end with the driver's Ray
        session, in Ray's own exit order."""


def free_port_and_ip() -> tuple[str, int]:
    """This node's IP address and a TCP port free right now (the torch.distributed rendezvous of
    the training ranks; asked of rank 0's node)."""
    import socket

    import ray

    ip = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return ip, int(s.getsockname()[1])
