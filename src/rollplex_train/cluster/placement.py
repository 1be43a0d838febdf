"""One placement-group bundle per device, ordered by node IP and device index.

slime ``slime/ray/placement_group.py`` and EasyR1's ``RayResourcePool`` do the same: after the
group is placed, bundles are sorted by (node IP, device index) so that device ``d`` (and so
training rank ``d``) lands on the same node and GPU across restarts. A device's rollout and train
actors share its bundle (``actor_options``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class DevicePlacement:
    """A placed group and the bundle of each device.

    Attributes:
        pg: the Ray placement group. bundle_of_device: (world,) bundle index of device d.
        node_ip_of_device: (world,) IP address of device d's node.
    """

    pg: object
    bundle_of_device: list[int]
    node_ip_of_device: list[str]

    def actor_options(self, device: int, gpu_fraction: float) -> dict:
        """``.options(...)`` kwargs placing an actor on ``device``'s bundle; actors ask for no CPU
        slot (colocated workers share the cores through their thread counts)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return dict(num_cpus=0, num_gpus=gpu_fraction,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.pg, placement_group_bundle_index=self.bundle_of_device[device]))

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)


def _probe() -> tuple[str, list]:
    import ray

    return ray.util.get_node_ip_address(), [int(g) for g in ray.get_gpu_ids()]


def create_device_placement(layout, timeout_s: float = 120.0) -> DevicePlacement:
    """Reserve one bundle per device of ``layout`` (``{"CPU": threads}`` on CPU runs,
    ``{"GPU": 1, "CPU": 1}`` on cuda), PACK strategy, and order bundles by (node IP, device index).

    Raises:
        TimeoutError: the cluster cannot hold the bundles within ``timeout_s`` (the message says
            what was asked).
        RuntimeError: a node got another number of bundles than ``cluster.devices_per_node``.
    """
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    gpu = layout.device == "cuda"
    bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": layout.threads_per_device}
    pg = placement_group([dict(bundle) for _ in range(layout.world_size)], strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        raise TimeoutError(f"the Ray cluster could not place {layout.world_size} bundles of {bundle} within "
                           f"{timeout_s:.0f} s ({layout.describe()}; cluster resources: {ray.cluster_resources()})")
    probe = ray.remote(_probe)
    found = ray.get([probe.options(num_cpus=0, num_gpus=1 if gpu else 0, scheduling_strategy=
                                   PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)).remote()
                     for i in range(layout.world_size)])
    keys = [(ip, gpus[0] if gpus else i) for i, (ip, gpus) in enumerate(found)]
    order = sorted(range(layout.world_size), key=lambda i: keys[i])
    ips = [found[i][0] for i in order]
    for node in range(layout.nnodes):
        on_node = ips[node * layout.devices_per_node:(node + 1) * layout.devices_per_node]
        if len(set(on_node)) != 1 or (node and on_node[0] == ips[node * layout.devices_per_node - 1]):
            raise RuntimeError(f"cluster.devices_per_node={layout.devices_per_node}: the placement put devices on "
                               f"nodes {ips}; every node must hold exactly devices_per_node bundles")
    return DevicePlacement(pg=pg, bundle_of_device=order, node_ip_of_device=ips)
