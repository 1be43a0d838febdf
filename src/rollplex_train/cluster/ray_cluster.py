"""Start or attach to a Ray cluster and place the colocated worker group on it."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rollplex_train.config import Config

log = logging.getLogger(__name__)

# Ray puts Unix sockets at <temp dir>/session_<date>_<pid>/sockets/plasma_store (about 70 bytes
# below the temp dir); a Unix socket path must stay under 108 bytes.
_MAX_RAY_TMP_LEN = 32


def ray_temp_dir(output_dir: Path) -> str:
    """The run's Ray temp dir: ``<output_dir>/ray`` when short enough for Ray's socket paths, else
    a short ``/tmp/rp-ray-*`` dir whose session logs are copied into ``<output_dir>/ray`` at exit
    (after Ray is shut down) before the short dir is removed."""
    target = output_dir.absolute() / "ray"
    if target.is_symlink():  # left by an older version of this function
        target.unlink()
    if len(str(target)) <= _MAX_RAY_TMP_LEN:
        target.mkdir(parents=True, exist_ok=True)
        return str(target)
    short = tempfile.mkdtemp(prefix="rp-ray-")
    atexit.register(_keep_logs, Path(short), target)
    log.info("Ray temp dir %s (the output path is too long for Ray's sockets); its logs are copied to %s "
             "at exit", short, target)
    return short


def _keep_logs(short: Path, target: Path) -> None:
    """Shut Ray down (waiting for its processes: a live one re-creates its session dir), copy
    ``short/session_*/logs`` to ``target/session_*/logs``, then remove ``short``."""
    import ray

    # Ray's own exit hook is registered when ray is imported, before this one, so it would run after.
    ray.shutdown(wait_for_processes=True)
    try:
        for session in short.glob("session_*"):
            if session.is_dir() and not session.is_symlink() and (session / "logs").is_dir():
                shutil.copytree(session / "logs", target / session.name / "logs", dirs_exist_ok=True,
                                ignore_dangling_symlinks=True)
    except OSError as err:  # never let log copying hide the run's own exit status
        log.warning("could not copy the Ray logs from %s to %s: %s", short, target, err)
    finally:
        shutil.rmtree(short, ignore_errors=True)


def start_ray(cfg: Config, output_dir: Path) -> None:
    """``ray.init`` a local cluster (temp dir under the run's output dir) or attach to ``cluster.address``."""
    import ray

    if ray.is_initialized():
        return
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}}
    if cfg.cluster.address:
        ray.init(address=cfg.cluster.address, runtime_env=env, log_to_driver=True)
        return
    # Ray 2.60 warns on every local start that token authentication is on by default (or off);
    # for a cluster of this machine only that notice is noise (ray/_private/authentication).
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    ray.init(
        num_cpus=cfg.cluster.num_cpus or os.cpu_count(),
        object_store_memory=cfg.cluster.object_store_memory_bytes,
        include_dashboard=False,
        _temp_dir=ray_temp_dir(output_dir),
        runtime_env=env,
        log_to_driver=True,
        configure_logging=False,
    )


@dataclass
class WorkerGroup:
    """Handles to the colocated workers of one device."""

    rollout: "object"
    train: "object"
    threads: int

    def halves(self) -> tuple[int, int]:
        """(rollout, train) threads when the two share the cores side by side."""
        return max(1, (self.threads + 1) // 2), max(1, self.threads // 2)

    def share_threads(self, rollout: int, train: int) -> None:
        """Give each worker its thread count for the coming phase (one Ray round trip each)."""
        import ray

        ray.get([self.rollout.set_threads.remote(rollout), self.train.set_threads.remote(train)])


def create_worker_group(cfg: Config) -> WorkerGroup:
    """Spawn one RolloutWorker and one TrainWorker and wait until both have loaded their models.

    The actors ask Ray for no CPU slot: they are colocated by design and share the cores through
    their torch thread counts (the schedule decides who computes when). With ``sharing.enabled``
    both get one fresh random multiprocessing authkey in their constructor: the shared-memory
    handles of the weights are fetched from the train worker over a connection that checks it.
    """
    import ray

    from rollplex_train.cluster.workers import RolloutWorker, TrainWorker

    threads = cfg.cluster.threads_per_worker or cfg.cluster.num_cpus or os.cpu_count() or 1
    opts = dict(num_cpus=0, num_gpus=cfg.cluster.num_gpus / 2 if cfg.cluster.num_gpus else 0)
    authkey = os.urandom(32) if cfg.sharing.enabled else None
    # max_concurrency=2: a share change (set_threads) reaches the rollout worker while it decodes
    rollout = ray.remote(RolloutWorker).options(max_concurrency=2, **opts).remote(
        cfg.rollout.name, cfg.model, threads, cfg.rollout.max_batch_size, authkey
    )
    train = ray.remote(TrainWorker).options(**opts).remote(
        cfg.actor.backend, cfg.model, cfg.actor, cfg.algorithm, cfg.trainer.seed, threads, authkey
    )
    ray.get([rollout.weights_version.remote(), train.weights_version.remote()])
    return WorkerGroup(rollout=rollout, train=train, threads=threads)
