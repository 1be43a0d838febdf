"""One Ray placement group for the run's devices, with stable device -> bundle ranks.

A bundle per device of the :class:`~rollplex_train.parallel.ParallelLayout`: ``{"GPU": 1, "CPU": 1}``
on a GPU run, ``{"CPU": threads_per_device}`` on a CPU run (a device is a set of cores), placed with
strategy ``PACK``. Ray numbers bundles in request order, not by where they land, so the placement
asks one probe actor per bundle for its node (IP and Ray node id) and, on GPU, its GPU id
(``ray.get_gpu_ids()``), and orders the bundles by (node IP, node id, GPU id or bundle index):
device ``d`` is the ``d``-th bundle in that order. The same cluster therefore gives the same device
-> node/GPU map on every start, and devices ``k * devices_per_node ..`` are node ``k``'s, as the
layout's node-major numbering says. The shape is slime's ``slime/ray/placement_group.py``
(``InfoActor`` + ``sort_key``) and EasyR1's ``RayResourcePool``; the node id tie-break is ours
(several Ray nodes may share one IP, e.g. ``ray.cluster_utils.Cluster`` in tests).

The worker groups place a device's actors with :meth:`DevicePlacement.actor_options`: the rollout
and train actors of one device share its bundle (``gpu_fraction`` 0.5 each on GPU, 0 on CPU, where
they share the bundle's cores through their torch thread counts).
"""

from __future__ import annotations

import ipaddress
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

from rollplex_train.parallel import ParallelLayout

log = logging.getLogger(__name__)


def bundles_of(layout: ParallelLayout) -> list[dict[str, float]]:
    """The placement group's bundles: one per device (``layout.world_size`` of them)."""
    bundle = {"GPU": 1, "CPU": 1} if layout.device == "cuda" else {"CPU": layout.threads_per_device}
    return [dict(bundle) for _ in range(layout.world_size)]


def node_sort_key(node_ip: str, node_id: str, index: int) -> tuple:
    """Order of a bundle: by node IP (numerically; a name that is no IP sorts after all IPs, by its
    text), then Ray node id (several nodes on one IP), then ``index`` (GPU id or bundle index)."""
    try:
        ip: tuple = (0, int(ipaddress.ip_address(node_ip)), "")
    except ValueError:
        ip = (1, 0, node_ip)
    return ip, node_id, index


@dataclass
class DevicePlacement:
    """The run's placement group and where each device's bundle landed.

    Attributes:
        pg: the Ray ``PlacementGroup`` (one bundle per device).
        layout: the layout it was made for.
        bundle_of_device: device d -> bundle index in ``pg``.
        node_ip_of_device, node_id_of_device: device d -> its node's IP / Ray node id.
        gpu_id_of_device: device d -> the GPU id Ray gave its bundle (GPU runs; None on CPU).
    """

    pg: Any
    layout: ParallelLayout
    bundle_of_device: list[int]
    node_ip_of_device: list[str]
    node_id_of_device: list[str]
    gpu_id_of_device: list[Optional[int]] = field(default_factory=list)

    def actor_options(self, device: int, gpu_fraction: float, env_vars: Optional[dict[str, str]] = None) -> dict[str, Any]:
        """``.options(**kwargs)`` that place an actor on ``device``'s bundle: the placement-group
        scheduling strategy, ``num_cpus=0`` (the bundle's cores are the device's; its actors share
        them) and ``num_gpus=gpu_fraction`` (a share of the bundle's GPU; 0 on CPU runs);
        ``env_vars``: the actor's environment additions (Ray ``runtime_env``).

        Raises:
            ValueError: ``device`` outside ``0 .. world_size - 1``, or a GPU share outside
                (0, 1] on a GPU run / not 0 on a CPU run.
        """
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not 0 <= device < len(self.bundle_of_device):
            raise ValueError(f"device {device}: the placement has devices 0..{len(self.bundle_of_device) - 1}")
        if self.layout.device == "cpu" and gpu_fraction != 0:
            raise ValueError(f"gpu_fraction={gpu_fraction} on a CPU run (cluster.device=cpu): expected 0")
        if self.layout.device == "cuda" and not 0 < gpu_fraction <= 1:
            raise ValueError(f"gpu_fraction={gpu_fraction}: expected 0 < share <= 1 of the device's GPU")
        strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                    placement_group_bundle_index=self.bundle_of_device[device])
        options = {"scheduling_strategy": strategy, "num_cpus": 0, "num_gpus": gpu_fraction}
        if env_vars:
            options["runtime_env"] = {"env_vars": dict(env_vars)}
        return options

    def remove(self) -> None:
        """Release the placement group (its actors must be gone first, or Ray kills them)."""
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)


def _probe_class():
    import ray

    @ray.remote
    class BundleProbe:
        """Reports where its bundle landed: (node IP, Ray node id, GPU ids Ray assigned)."""

        def where(self) -> tuple[str, str, list]:
            ctx = ray.get_runtime_context()
            return ray.util.get_node_ip_address(), ctx.get_node_id(), list(ray.get_gpu_ids())

    return BundleProbe


def create_device_placement(layout: ParallelLayout, timeout_s: float) -> DevicePlacement:
    """Reserve one bundle per device on the connected Ray cluster and order them (module docstring).

    Args:
        layout: the run's layout (``nnodes`` x ``devices_per_node`` devices of ``device`` kind).
        timeout_s: seconds to wait for the cluster to hold every bundle.

    Raises:
        RuntimeError: the bundles are not placed within ``timeout_s`` (names the bundle and the
            cluster's registered resources), or a node did not get exactly ``cluster.devices_per_node``
            bundles / the bundles span another number of nodes than ``cluster.nnodes``. The placement
            group is removed before raising.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundles = bundles_of(layout)
    pg = placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise RuntimeError(
            f"the Ray cluster did not place {len(bundles)} bundles of {bundles[0]} within {timeout_s:g} s "
            f"(cluster.nnodes={layout.nnodes} x cluster.devices_per_node={layout.devices_per_node}, "
            f"cluster.device={layout.device}); registered resources: {ray.cluster_resources()}")
    probe = _probe_class()
    gpus = 1 if layout.device == "cuda" else 0
    probes = [probe.options(num_cpus=0, num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=i)).remote() for i in range(len(bundles))]
    try:
        where = ray.get([p.where.remote() for p in probes], timeout=timeout_s)
    finally:
        for p in probes:
            ray.kill(p)
    gpu_ids = [int(g[0]) if g else None for _, _, g in where]
    order = sorted(range(len(bundles)), key=lambda i: node_sort_key(where[i][0], where[i][1],
                                                                    gpu_ids[i] if gpus else i))
    placement = DevicePlacement(pg=pg, layout=layout, bundle_of_device=order,
                                node_ip_of_device=[where[i][0] for i in order],
                                node_id_of_device=[where[i][1] for i in order],
                                gpu_id_of_device=[gpu_ids[i] for i in order])
    per_node = Counter(placement.node_id_of_device)
    if len(per_node) != layout.nnodes or set(per_node.values()) != {layout.devices_per_node}:
        placement.remove()
        counts = {f"{ip}/{nid[:8]}": per_node[nid] for ip, nid in
                  dict.fromkeys(zip(placement.node_ip_of_device, placement.node_id_of_device))}
        raise RuntimeError(
            f"the placement group landed {dict(counts)} bundles per node, expected cluster.nnodes="
            f"{layout.nnodes} nodes of cluster.devices_per_node={layout.devices_per_node}: give each node's Ray "
            "exactly its devices (ray start --num-gpus / --num-cpus) or fix the two keys")
    for d in range(layout.world_size):
        log.info("device %d: bundle %d on node %s%s", d, order[d], placement.node_ip_of_device[d],
                 f" GPU {placement.gpu_id_of_device[d]}" if gpus else "")
    return placement
