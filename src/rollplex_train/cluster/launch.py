"""Start the run's workers: the executor, the placement, the train ranks and rollout engines.

``create_workers(cfg, output_dir)`` is the one entry point the trainer calls: with
``cluster.executor=ray`` it starts (or attaches to) Ray, places one bundle per device
(``cluster/placement.py``), hands the training ranks a torch.distributed rendezvous on rank 0's
node and builds the two groups; with ``inprocess`` the same groups hold engines in the driver.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from rollplex_train.cluster.groups import RolloutGroup, TrainGroup
from rollplex_train.config import Config
from rollplex_train.parallel import ParallelLayout
from rollplex_train.runtime.protocol import get_all

log = logging.getLogger(__name__)


@dataclass
class Workers:
    """The run's worker groups.

    Attributes:
        rollout: the rollout engines. train: the training ranks. layout: the run's layout.
        threads: torch threads of one device (the unit of the CPU device share).
    """

    rollout: RolloutGroup
    train: TrainGroup
    layout: ParallelLayout
    threads: int
    executor: object

    def halves(self) -> tuple[int, int]:
        """(rollout, train) threads when the two share a device's cores side by side."""
        return max(1, (self.threads + 1) // 2), max(1, self.threads // 2)

    def share_threads(self, rollout: int, train: int) -> None:
        """Give every device's workers their thread counts for the coming phase."""
        get_all([self.rollout.set_threads(rollout), self.train.set_threads(train)])

    def shutdown(self) -> None:
        """Stop the workers and free their placement (the in-process threads are joined)."""
        self.executor.shutdown(self.rollout.all_handles + self.train.handles)


def _tp_rendezvous(executor, device: int) -> tuple[str, int]:
    """(host, port) where the ranks of a rollout engine whose first device is ``device`` meet."""
    from rollplex_train.cluster.executors import free_port_and_ip

    if executor.kind == "inprocess":
        return free_port_and_ip()
    import ray

    return ray.get(ray.remote(free_port_and_ip).options(**executor.placement.actor_options(device, 0)).remote())


def check_sweep_job() -> None:
    """In a Hydra sweep job that submitit started (``hydra/launcher=submitit_slurm`` or
    ``submitit_local``): the job must be one task, since every task runs the whole driver (each would
    start a Ray cluster and train the same point). A point over several nodes runs through
    ``launch/slurm_ray.sbatch`` instead (docs/cluster.md).

    Raises:
        ValueError: the job has more than one task (names the ``hydra.launcher`` keys).
    """
    if not os.environ.get("SUBMITIT_EXECUTOR"):  # not a submitit job
        return
    import submitit

    tasks = submitit.JobEnvironment().num_tasks
    if tasks > 1:
        raise ValueError(f"hydra.launcher: this sweep job has {tasks} tasks, but each job runs one driver that starts "
                         "its own Ray cluster; set hydra.launcher.nodes=1 and hydra.launcher.tasks_per_node=1 (a "
                         "multi-node point runs through launch/slurm_ray.sbatch)")


def create_workers(cfg: Config, output_dir: Path) -> Workers:
    """Build and wait for every worker of the run (engines loaded, process groups joined).

    With ``sharing.enabled`` all workers get one fresh random multiprocessing authkey: the
    shared-memory handles of the weights are fetched from a train worker over a connection that
    checks it. In-process workers keep the driver's key: changing a process's key after its
    ``multiprocessing.resource_sharer`` listener started makes every later handle fetch fail
    ("digest sent was rejected").

    Raises:
        TimeoutError: the Ray cluster cannot hold the devices.
    """
    from rollplex_train.cluster.workers import RolloutWorker, TrainWorker
    from rollplex_train.device_share import check_machine, resolve_share

    layout = ParallelLayout.from_config(cfg)
    share = resolve_share(cfg.cluster.device_share, layout.device, cfg.cluster.executor)  # auto -> a share
    if cfg.cluster.executor == "inprocess" or cfg.cluster.address is None:  # the workers' machine is this one
        check_machine(share)  # a share it cannot give fails before any worker starts
    threads = layout.threads_per_device
    authkey = os.urandom(32) if cfg.sharing.enabled and cfg.cluster.executor != "inprocess" else None
    if cfg.cluster.executor == "inprocess":
        from rollplex_train.cluster.executors import InProcessExecutor

        executor, address = InProcessExecutor(), None
    else:
        import ray

        from rollplex_train.cluster.executors import RayExecutor, free_port_and_ip
        from rollplex_train.cluster.placement import create_device_placement
        from rollplex_train.cluster.ray_cluster import start_ray

        start_ray(cfg, output_dir)
        placement = create_device_placement(layout, timeout_s=300.0)
        executor = RayExecutor(placement)
        address = None
        if layout.world_size > 1:  # rendezvous on rank 0's node
            probe = ray.remote(free_port_and_ip).options(**placement.actor_options(0, 0))
            address = ray.get(probe.remote())
    gpu = 0.5 if layout.device == "cuda" else 0.0
    train = [executor.spawn(TrainWorker, (cfg.actor.backend, cfg.model, cfg.actor, cfg.algorithm, cfg.trainer.seed,
                                          threads, authkey, layout, rank, address, share),
                           rank, gpu)
             for rank in range(layout.world_size)]
    # concurrency 2: a share change (set_threads) reaches the rollout worker while it decodes. The
    # built-in engine runs one worker per device of its TP group (rank k on the engine's k-th device),
    # SGLang one per engine: it starts its TP processes itself, so at TP > 1 under Ray that worker
    # sees the node's GPUs (as slime starts its SGLang engines: slime/ray/rollout.py) and is told
    # which are the group's.
    ranks = layout.rollout_tp if cfg.rollout.name == "builtin" else 1
    node_gpus = cfg.rollout.name != "builtin" and layout.rollout_tp > 1 and executor.kind == "ray" and gpu > 0
    rollout = []
    for e in range(layout.rollout_dp):
        devices = layout.rollout_devices(e)
        tp_address = _tp_rendezvous(executor, devices[0]) if ranks > 1 else None
        engine_gpus = [executor.placement.gpu_id_of_device[d] for d in devices] if node_gpus else None
        env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"} if node_gpus else None
        rollout.append([executor.spawn(RolloutWorker, (cfg.rollout.name, cfg.model, threads, cfg.rollout.max_batch_size,
                                                       authkey, layout, devices[k], share,
                                                       cfg.rollout.share_prompt_kv, k, tp_address, engine_gpus),
                                       devices[k], gpu, concurrency=2, env_vars=env)
                        for k in range(ranks)])
    workers = Workers(rollout=RolloutGroup(executor, [r[0] for r in rollout], layout, [r[1:] for r in rollout]),
                      train=TrainGroup(executor, train, layout), layout=layout, threads=threads, executor=executor)
    from rollplex_train.runtime.protocol import Pending

    every = train + [h for engine in rollout for h in engine]
    Pending([executor.call(h, "weights_version") for h in every]).result()  # every engine built
    log.info("workers up: %s (%s executor)", layout.describe(), executor.kind)
    return workers
