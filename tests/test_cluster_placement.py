"""The device placement group: bundle order by node, node checks, and a device's actors on its bundle."""

from __future__ import annotations

import shutil
import tempfile

import pytest

from rollplex_train.cluster.placement import bundles_of, node_sort_key
from rollplex_train.parallel import ParallelLayout


def test_bundles_per_device():
    assert bundles_of(ParallelLayout(nnodes=2, devices_per_node=2, threads_per_device=3)) == [{"CPU": 3}] * 4
    assert bundles_of(ParallelLayout(devices_per_node=8, device="cuda")) == [{"GPU": 1, "CPU": 1}] * 8


def test_node_sort_key_orders_ips_numerically_then_node_then_index():
    keys = [("10.0.0.10", "a", 0), ("10.0.0.9", "b", 1), ("10.0.0.9", "b", 0), ("10.0.0.9", "a", 7),
            ("node-x", "c", 0)]
    ordered = sorted(keys, key=lambda k: node_sort_key(*k))
    # 10.0.0.9 < 10.0.0.10 (as numbers, not text); one IP: node id, then GPU id; a hostname last
    assert ordered == [("10.0.0.9", "a", 7), ("10.0.0.9", "b", 0), ("10.0.0.9", "b", 1), ("10.0.0.10", "a", 0),
                       ("node-x", "c", 0)]


@pytest.fixture(scope="module")
def two_node_cluster():
    """A Ray cluster of two nodes of 2 CPUs on this machine (``ray.cluster_utils.Cluster``), its temp
    dir (and Ray's address file) under a private RAY_TMPDIR."""
    import ray
    from ray.cluster_utils import Cluster

    tmp = tempfile.mkdtemp(prefix="rp-")  # short: Ray's socket paths live under it
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_TMPDIR", tmp)
    node = dict(num_cpus=2, object_store_memory=80 * 1024**2)
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    cluster.add_node(**node)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        mp.undo()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.slow
def test_two_nodes_bundles_ordered_by_node_and_actors_share_their_devices_bundle(two_node_cluster):
    import ray
    from ray.util.placement_group import placement_group_table

    from rollplex_train.cluster.placement import create_device_placement

    layout = ParallelLayout(nnodes=2, devices_per_node=2, threads_per_device=1)
    placement = create_device_placement(layout, timeout_s=60)
    try:
        table = placement_group_table(placement.pg)
        assert table["strategy"] == "PACK" and table["bundles"] == {i: {"CPU": 1.0} for i in range(4)}
        # where Ray's GCS put each device's bundle: devices 0-1 on one node, 2-3 on the other
        nodes = [table["bundles_to_node_id"][b] for b in placement.bundle_of_device]
        assert nodes == placement.node_id_of_device
        assert nodes[0] == nodes[1] != nodes[2] == nodes[3]
        alive = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
        assert set(nodes) == set(alive) and placement.node_ip_of_device == [alive[n] for n in nodes]
        assert sorted(nodes[::2], key=lambda n: node_sort_key(alive[n], n, 0)) == nodes[::2]  # by (IP, node id)
        assert sorted(placement.bundle_of_device) == [0, 1, 2, 3]

        @ray.remote
        class Probe:
            def where(self):
                ctx = ray.get_runtime_context()
                return ctx.get_node_id(), ctx.get_placement_group_id()

        for d in range(4):  # a device's rollout and train actors: the same node and bundle
            opts = [placement.actor_options(d, 0) for _ in range(2)]
            assert {o["scheduling_strategy"].placement_group_bundle_index for o in opts} == {placement.bundle_of_device[d]}
            assert all(o["num_cpus"] == 0 and o["num_gpus"] == 0 for o in opts)
            probes = [Probe.options(**o).remote() for o in opts]
            seen = ray.get([p.where.remote() for p in probes])
            assert seen == [(nodes[d], placement.pg.id.hex())] * 2
            for p in probes:
                ray.kill(p)
        with pytest.raises(ValueError, match="gpu_fraction=0.5 on a CPU run"):
            placement.actor_options(0, 0.5)
        with pytest.raises(ValueError, match="device 4"):
            placement.actor_options(4, 0)
    finally:
        placement.remove()
    again = create_device_placement(layout, timeout_s=60)  # a restart on the same cluster: the same ranks
    try:
        assert again.node_id_of_device == placement.node_id_of_device
    finally:
        again.remove()


@pytest.mark.slow
def test_a_node_with_the_wrong_device_count_is_refused(two_node_cluster):
    from ray.util.placement_group import placement_group_table

    from rollplex_train.cluster.placement import create_device_placement

    # 2 devices of one thread on 2 nodes of 2 CPUs: PACK puts both bundles on one node
    with pytest.raises(RuntimeError, match=r"expected cluster.nnodes=2 nodes of cluster.devices_per_node=1"):
        create_device_placement(ParallelLayout(nnodes=2, devices_per_node=1, threads_per_device=1), timeout_s=60)
    with pytest.raises(RuntimeError, match=r"did not place 1 bundles of \{'CPU': 8\} within 2 s"):
        create_device_placement(ParallelLayout(nnodes=1, devices_per_node=1, threads_per_device=8), timeout_s=2)
    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())  # nothing left reserved
