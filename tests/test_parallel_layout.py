"""ParallelLayout: degrees, rank grid (Megatron tp-dp-pp order), key-naming errors."""

import pytest

from rollplex_train.parallel import ParallelLayout


def test_32_gpu_layout_degrees_and_groups():
    lay = ParallelLayout(nnodes=4, devices_per_node=8, device="cuda", train_tp=4, rollout_tp=4)
    assert (lay.world_size, lay.train_dp, lay.rollout_dp) == (32, 8, 8)
    # TP fastest, then DP: rank 9 is tp 1 of DP rank 2
    c = lay.train_coords(9)
    assert (c.tp, c.dp, c.pp) == (1, 2, 0)
    assert lay.tp_group_ranks(9) == [8, 9, 10, 11]
    assert lay.dp_group_ranks(9) == [1, 5, 9, 13, 17, 21, 25, 29]
    assert lay.dp_leaders() == [0, 4, 8, 12, 16, 20, 24, 28]
    assert (lay.node_of(9), lay.local_index(9)) == (1, 1)
    assert lay.rollout_engine_of(9) == 2 and lay.rollout_devices(2) == [8, 9, 10, 11]


def test_pipeline_stage_is_slowest():
    lay = ParallelLayout(devices_per_node=8, train_tp=2, train_pp=2)
    assert lay.train_dp == 2
    assert [lay.train_coords(r).pp for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert lay.dp_group_ranks(5) == [5, 7]


@pytest.mark.parametrize("kwargs, key", [
    (dict(devices_per_node=6, train_tp=4), "actor.tensor_parallel_size=4"),
    (dict(nnodes=2, devices_per_node=2, train_tp=4), "a TP group stays inside one node"),
    (dict(devices_per_node=4, rollout_tp=8), "rollout.tensor_parallel_size=8"),
    (dict(devices_per_node=0), "cluster.devices_per_node=0"),
    (dict(device="tpu"), "cluster.device='tpu'"),
])
def test_errors_name_the_keys(kwargs, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.").replace("(", r"\(")):
        ParallelLayout(**kwargs)


def test_config_builds_layout_and_refuses_bad_degrees():
    from rollplex_train.config import ActorConfig, ClusterConfig, Config

    cfg = Config(cluster=ClusterConfig(devices_per_node=2, threads_per_device=1))
    lay = ParallelLayout.from_config(cfg)
    assert (lay.world_size, lay.train_dp, lay.threads_per_device) == (2, 2, 1)
    with pytest.raises(ValueError, match="actor.tensor_parallel_size=2"):
        Config(cluster=ClusterConfig(devices_per_node=3), actor=ActorConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="cluster.executor=inprocess"):
        ClusterConfig(executor="inprocess", devices_per_node=2)


def test_degrees_a_backend_cannot_run_are_refused():
    """What a backend can do is asked of its registry (its declared capabilities) when the run's
    config is resolved."""
    from rollplex_train.config import ActorConfig, ClusterConfig, Config, RolloutConfig
    from rollplex_train.resolve import resolve

    with pytest.raises(ValueError, match=r"actor.tensor_parallel_size=2.*data parallel only"):
        resolve(Config(cluster=ClusterConfig(devices_per_node=2), actor=ActorConfig(tensor_parallel_size=2)))
    with pytest.raises(ValueError, match=r"rollout.tensor_parallel_size=2: the builtin"):
        resolve(Config(cluster=ClusterConfig(devices_per_node=2), rollout=RolloutConfig(tensor_parallel_size=2)))


def test_cli_refuses_what_a_backend_cannot_honour_before_ray(embedded_assets, run_cli, tmp_path):
    """Settings a chosen backend cannot run end in one line (exit 2) before Ray starts."""
    cases = {"megatron_pp2": (["actor.backend=megatron", "actor.pipeline_parallel_size=2",
                               "cluster.devices_per_node=2"], "actor.pipeline_parallel_size=2"),
             "torch_tp2": (["actor.tensor_parallel_size=2", "cluster.devices_per_node=2"],
                           "actor.tensor_parallel_size=2"),
             "cuda_without_gpu": (["cluster.device=cuda"], "cluster.device=cuda")}
    for name, (overrides, key) in cases.items():
        out = tmp_path / name
        proc = run_cli(out, *overrides)
        assert proc.returncode == 2, (name, proc.stderr[-2000:])
        assert key in proc.stderr and "Traceback" not in proc.stderr, (name, proc.stderr[-2000:])
        assert not (out / "ray").exists(), name
