"""Start or attach to a Ray cluster (the run's temp dir, logs kept in the output dir)."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import tempfile
import threading
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


class ClusterUnreachable(RuntimeError):
    """``cluster.address`` names no Ray cluster this driver can attach to (the CLI prints one line, exit 2)."""


def stop_ray() -> None:
    """End this process's Ray session, waiting for its processes (a Hydra sweep's next point in the
    same process then starts a cluster of its own, in its own directory); nothing without one."""
    import ray

    if ray.is_initialized():
        ray.shutdown(wait_for_processes=True)


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


def _ray_init(**kwargs) -> None:
    """``ray.init(**kwargs)``, then the program's own SIGTERM handler again, where it had one.

    ``ray.init`` takes SIGTERM over twice (Ray 2.60): a Python handler that calls ``sys.exit(15)``
    (``ray/_private/worker.py``, ``init``) and, when the driver's core worker starts, the C++ failure
    handler that prints a stack dump for it (``install_failure_signal_handler``, ``_raylet.pyx``).
    A Python handler installed before (the CLI's: one line naming the last checkpoint, exit code 143)
    would be lost; it is put back. A program without one keeps Ray's. Ray's automatic ``ray.init``
    on a call without a cluster is switched off for the rest of the process."""
    import ray

    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    ray.init(**kwargs)
    if callable(previous):
        signal.signal(signal.SIGTERM, previous)
    # A Ray call after ray.shutdown (a stream's feeder thread still reading when the run is stopped)
    # would otherwise start a new local cluster at interpreter exit: ``RAY_ENABLE_AUTO_CONNECT=0``,
    # read once when ray is imported (ray/_private/auto_init_hook.py, Ray 2.60), set for this
    # process too: such a call then raises instead.
    os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"
    from ray._private import auto_init_hook

    auto_init_hook.enable_auto_connect = False


def start_ray(cfg: Config, output_dir: Path) -> None:
    """``ray.init`` a local cluster (temp dir under the run's output dir) or attach to ``cluster.address``.

    Attaching handles Ray's token authentication (``ray_auth.enable_auth_for_address``).

    Raises:
        ClusterUnreachable: ``cluster.address`` cannot be reached or refuses this driver's
            credentials (one line naming the key, Ray's reason and the token sources).
    """
    import ray

    if ray.is_initialized():
        return
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}}
    if cfg.cluster.address:
        from rollplex_train.cluster.ray_auth import TOKEN_ENV, TOKEN_PATH_ENV, enable_auth_for_address

        mode = enable_auth_for_address(cfg.cluster.address)
        try:
            _ray_init(address=cfg.cluster.address, runtime_env=env, log_to_driver=True)
        except (ConnectionError, ray.exceptions.AuthenticationError) as err:
            cause = (str(err).strip().splitlines() or [""])[0]
            raise ClusterUnreachable(
                f"cluster.address={cfg.cluster.address}: cannot attach (Ray auth mode {mode}): {err.__class__.__name__}: "
                f"{cause} (no Ray cluster there, or one started in token mode whose token is not here: "
                f"${TOKEN_ENV}, ${TOKEN_PATH_ENV} or ~/.ray/auth_token; launch/slurm_ray.sbatch writes one per job)") from err
        return
    # Ray 2.60 warns on every local start that token authentication is on by default (or off);
    # for a cluster of this machine only that notice is noise (ray/_private/authentication).
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    _ray_init(
        num_cpus=cfg.cluster.num_cpus or os.cpu_count(),
        object_store_memory=cfg.cluster.object_store_memory_bytes,
        include_dashboard=False,
        _temp_dir=ray_temp_dir(output_dir),
        runtime_env=env,
        log_to_driver=True,
        configure_logging=False,
    )
