"""Entry points: ``rollplex-train`` (Hydra app: compose config, start the cluster, train) and
``rollplex-plan <memory|sharing>`` (the same config, printed plans; no cluster, no weights)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def conf_dir() -> Path:
    """The Hydra config directory: ``$ROLLPLEX_CONF_DIR`` or the repository's ``conf/``.

    Raises:
        FileNotFoundError: neither exists (a non-editable install without the configs).
    """
    path = Path(os.environ.get("ROLLPLEX_CONF_DIR") or Path(__file__).resolve().parents[2] / "conf")
    if not (path / "config.yaml").is_file():
        raise FileNotFoundError(f"no config.yaml in {path}: set ROLLPLEX_CONF_DIR to the repository's conf/")
    return path


@contextlib.contextmanager
def _user_errors(program: str):
    """Turn a bad config value, a missing file or bad data into one line on stderr and exit code 2
    (instead of Hydra's wrapped traceback); other errors keep their traceback."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        yield
    except (ValueError, FileNotFoundError, NotImplementedError, OmegaConfBaseException) as err:
        text = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())  # OmegaConf adds full_key lines
        sys.stderr.write(f"{program}: error: {text}\n")
        raise SystemExit(2) from err


class Terminated(BaseException):
    """SIGTERM reached the driver (a scheduler's time limit: SLURM sends it before SIGKILL; ``kill``).
    Raised in the main thread like ``KeyboardInterrupt`` for SIGINT, so the same ``finally`` blocks
    run (workers shut down, Ray's logs kept); a ``BaseException`` so no ``except Exception`` takes it."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated


@contextlib.contextmanager
def _run_errors(trainer):
    """Around ``Trainer.fit``: Ctrl-C (SIGINT) ends the run with one line naming the last
    checkpoint and exit code 130 (128 + SIGINT, the shell's convention), SIGTERM the same with exit
    code 143 (128 + SIGTERM); a reward function that
    fails on too many samples (``reward.max_failed_frac``) ends it with one line and exit code 1,
    and so does a failed worker with no restart left (``cluster.failures.WorkerFailure``: role,
    rank, cause, the step and the last checkpoint);
    a ``cluster.address`` Ray cannot attach to, data that stops yielding full batches (rows found bad
    only when loaded) and required actor
    prefixes over the memory budget (``schedule.prefill_from_actor=true``) with one line and exit
    code 2."""
    from rollplex_train.algo.rewards import RewardFailure
    from rollplex_train.cluster.failures import WorkerFailure
    from rollplex_train.cluster.ray_cluster import ClusterUnreachable
    from rollplex_train.data.loader import NoBatchError
    from rollplex_train.runtime.window import PrefillBudgetError

    previous = signal.signal(signal.SIGTERM, _raise_terminated)  # kept across ray.init (start_ray)
    try:
        yield
    except (KeyboardInterrupt, Terminated) as err:
        how, code = ("interrupted", 130) if isinstance(err, KeyboardInterrupt) else ("terminated (SIGTERM)", 143)
        last = trainer.last_checkpoint()
        where = (f"last checkpoint {last} (the same command resumes from it)" if last is not None
                 else "no checkpoint was written")
        sys.stderr.write(f"\nrollplex-train: {how} at step {trainer.step}; {where}\n")
        raise SystemExit(code) from None
    except RewardFailure as err:
        sys.stderr.write(f"rollplex-train: error: {err}\n")
        raise SystemExit(1) from None
    except WorkerFailure as err:  # its workers are torn down already (Trainer.fit)
        last = err.last_checkpoint
        sys.stderr.write(f"rollplex-train: error: {err} at step {err.step}; "
                         f"{'last checkpoint ' + str(last) if last is not None else 'no checkpoint was written'}\n")
        raise SystemExit(1) from None
    except (NoBatchError, ClusterUnreachable) as err:
        sys.stderr.write(f"rollplex-train: error: {err}\n")
        raise SystemExit(2) from None
    except PrefillBudgetError as err:
        last = trainer.last_checkpoint()
        sys.stderr.write(f"rollplex-train: error: {err} (at step {trainer.step}; "
                         f"{'last checkpoint ' + str(last) if last is not None else 'no checkpoint was written'})\n")
        raise SystemExit(2) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def follow_output_dir(argv: list[str]) -> list[str]:
    """``argv`` with ``hydra.run.dir=<dir>`` added when it sets ``trainer.output_dir=<dir>`` and no
    run dir of its own: Hydra's ``.hydra/`` record and ``cli.log`` then land in the run's output
    directory, not in the default ``outputs/<project>/<experiment>`` of the working directory
    (where they would overwrite another run's record). Multirun jobs keep Hydra's sweep dirs."""
    at = [i for i, a in enumerate(argv) if i > 0 and a.lstrip("+").startswith("trainer.output_dir=")]
    if not at or any(a.lstrip("+").startswith("hydra.run.dir=") for a in argv[1:]):
        return list(argv)
    value = argv[at[-1]].split("=", 1)[1]
    if value in ("", "null"):
        return list(argv)
    return [*argv[: at[-1] + 1], f"hydra.run.dir={value}", *argv[at[-1] + 1 :]]  # beside it: before any --flag


def config_error_line(err: BaseException) -> str:
    """One line for a config Hydra could not compose (a misspelt key, a value of the wrong type, an
    unknown group option, bad override syntax): Hydra's message without its hint to append the key
    with ``+`` (the schema refuses unknown keys either way), then OmegaConf's cause, then the
    options of a missing group entry. The same line on Hydra 1.3 and 1.4, except for OmegaConf 2.4's
    own "Did you mean: ..." suggestion after a misspelt key."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    lines = [ln.strip() for ln in str(err).splitlines()]
    if isinstance(err, MissingConfigException):
        lines = lines[:1]  # "In 'config': Could not find 'schedule/bogus'"; the options follow
    # dropped: the hint to append with ``+`` and Hydra 1.4's "Error when parsing index: <i>, string:
    # <override> out of [<all overrides>]." (the override is named once, below)
    lines = [ln for ln in lines if ln and not ln.startswith(("To append to your config", "Error when parsing index"))]
    if isinstance(err.__cause__, OmegaConfBaseException):
        lines.append(str(err.__cause__).splitlines()[0].strip())
    text = " ".join(dict.fromkeys(lines))
    override = getattr(err, "override", None)  # OverrideParseException: the override as typed
    if override and override not in text:
        text = f"override {override!r}: {text}"
    options = getattr(err, "options", None)
    if options:
        text += f"; expected one of: {', '.join(options)}"
    return text


def _hydra_main(task, program: str) -> None:
    """Run ``task`` as a Hydra app on the project's configs. A config Hydra cannot compose ends the
    program with one line (``config_error_line``) and exit code 2, as the schema's own checks do,
    instead of Hydra's multi-line report; ``HYDRA_FULL_ERROR=1`` keeps Hydra's full traceback."""
    import hydra
    from hydra.errors import CompactHydraException
    from omegaconf.errors import OmegaConfBaseException

    from rollplex_train.config import hydra_version_base, register_configs

    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises instead of printing and exiting 1
    register_configs()
    started = []

    @functools.wraps(task)
    def run(cfg) -> None:
        started.append(True)
        task(cfg)

    try:
        hydra.main(config_path=str(conf_dir()), config_name="config", **hydra_version_base())(run)()
    except (CompactHydraException, OmegaConfBaseException, ValueError) as err:
        # a ValueError before the task started is Hydra's own (``=3``: "Config group override must
        # be a string or a list"); one raised by the task keeps its traceback
        if full_error or (isinstance(err, ValueError) and started):
            raise
        sys.stderr.write(f"{program}: error: {config_error_line(err)}\n")
        raise SystemExit(2) from None


def _train(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from rollplex_train.cluster.launch import check_sweep_job
    from rollplex_train.cluster.ray_cluster import stop_ray
    from rollplex_train.config import to_config
    from rollplex_train.paths import resolve_config_paths
    from rollplex_train.trainer import Trainer

    import datasets
    import transformers

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    with _user_errors("rollplex-train"):  # config, files and data are checked before Ray starts
        check_sweep_job()
        config = resolve_config_paths(to_config(cfg), conf_dir().parent)
        output_dir = config.trainer.output_dir or HydraConfig.get().runtime.output_dir
        trainer = Trainer(config, Path(output_dir))
    with _run_errors(trainer):
        trainer.fit()
    if HydraConfig.get().mode == RunMode.MULTIRUN:  # the basic launcher runs the next point in this process:
        stop_ray()  # it starts its own cluster (its placement group would wait on this one's devices)


def train_main() -> None:
    """``rollplex-train +experiment=<name> [key=value ...]``."""
    sys.argv = follow_output_dir(sys.argv)
    _hydra_main(_train, "rollplex-train")


PLANS = {
    "memory": "rollplex_train.memory.report",
    "sharing": "rollplex_train.sharing.report",
    "timeline": "rollplex_train.runtime.timeline_report",
}
"""``rollplex-plan`` subcommand -> module with ``report(config: Config) -> str``."""


def _plan(kind: str, cfg) -> None:
    import importlib

    from rollplex_train.config import to_config

    from rollplex_train.paths import resolve_config_paths

    with _user_errors(f"rollplex-plan {kind}"):
        config = resolve_config_paths(to_config(cfg), conf_dir().parent, strict=False)
        text = importlib.import_module(PLANS[kind]).report(config)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")


def plan_main() -> None:
    """``rollplex-plan <memory|sharing> +experiment=<name> [key=value ...]``: print a plan.

    The subcommand is taken off ``sys.argv``; the rest are Hydra overrides as for ``rollplex-train``.
    Nothing is written to disk (no Hydra output directory, logging to stdout).
    """
    import functools

    if len(sys.argv) < 2 or sys.argv[1] not in PLANS:
        given = f"unknown subcommand {sys.argv[1]!r}; " if len(sys.argv) > 1 and sys.argv[1] not in ("-h", "--help") else ""
        sys.stderr.write(f"{given}usage: rollplex-plan {{{'|'.join(PLANS)}}} +experiment=<name> [key=value ...]\n")
        raise SystemExit(0 if given == "" and len(sys.argv) > 1 else 2)
    kind = sys.argv.pop(1)
    sys.argv += ["hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=stdout", "hydra/hydra_logging=none"]
    _hydra_main(functools.partial(_plan, kind), f"rollplex-plan {kind}")
