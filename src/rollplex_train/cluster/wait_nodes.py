"""Wait until a Ray cluster has registered its nodes and their devices (used by ``launch/slurm_ray.sbatch``).

``python -m rollplex_train.cluster.wait_nodes --address HOST:PORT --nodes N --resource GPU --per-node 8
--timeout 300`` attaches as a driver (with the token authentication of :mod:`ray_auth`), polls the
GCS node table (``ray.nodes()``) until ``N`` nodes are alive, each with at least ``per-node`` units of
``resource``, and exits 0; exit 1 with one line naming what is missing when ``--timeout`` seconds pass.
A head that is still starting is retried until the same deadline.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

log = logging.getLogger(__name__)


def ready_nodes(nodes: list[dict], resource: str, per_node: float) -> list[str]:
    """Node ids of the alive nodes of ``ray.nodes()`` holding at least ``per_node`` of ``resource``."""
    return [n["NodeID"] for n in nodes if n.get("Alive") and n.get("Resources", {}).get(resource, 0) >= per_node]


def wait_for_nodes(address: str, nnodes: int, resource: str, per_node: float, timeout_s: float,
                   poll_s: float = 1.0) -> list[dict]:
    """Block until ``nnodes`` alive nodes with ``per_node`` x ``resource`` each are registered.

    Returns:
        the alive nodes (``ray.nodes()`` entries).

    Raises:
        TimeoutError: not all nodes registered within ``timeout_s`` seconds (counts what was seen).
        ConnectionError: the cluster at ``address`` could not be reached.
    """
    import ray

    from rollplex_train.cluster.ray_auth import enable_auth_for_address

    deadline = time.monotonic() + timeout_s
    enable_auth_for_address(address)
    while True:  # the head may still be starting its GCS
        try:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
            break
        except ConnectionError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(poll_s)
    try:
        while True:
            nodes = ray.nodes()
            ready = ready_nodes(nodes, resource, per_node)
            if len(ready) >= nnodes:
                return [n for n in nodes if n["NodeID"] in ready]
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{len(ready)} of {nnodes} nodes with {per_node:g} {resource} registered at "
                                   f"{address} after {timeout_s:g} s ({sum(bool(n.get('Alive')) for n in nodes)} alive)")
            time.sleep(poll_s)  # the GCS has no blocking wait for node registration
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--resource", default="GPU")
    p.add_argument("--per-node", type=float, required=True)
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.monotonic()
    try:
        nodes = wait_for_nodes(args.address, args.nodes, args.resource, args.per_node, args.timeout)
    except (TimeoutError, ConnectionError) as err:
        sys.stderr.write(f"wait_nodes: {err}\n")
        return 1
    log.info("%d node(s) with %g %s each registered at %s after %.1f s", len(nodes), args.per_node, args.resource,
             args.address, time.monotonic() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
