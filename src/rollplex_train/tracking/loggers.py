"""Metric loggers: console, jsonl, tensorboard and wandb behind one :class:`Tracker`.

Layout under ``output_dir``::

    metrics.jsonl          one JSON object per logged step: {"step": s, **metrics}
    tensorboard/           SummaryWriter event files
    wandb/                 WANDB_DIR, WANDB_CACHE_DIR, WANDB_CONFIG_DIR, WANDB_DATA_DIR

Non-finite values (NaN, +-inf) are passed through unchanged to console, tensorboard and wandb.
In ``metrics.jsonl`` they are written as ``null`` so that every line is strict JSON (``jq``,
pandas and other JSON readers accept it); :func:`read_metrics_jsonl` reads ``null`` back as NaN.

A resume keeps one history: ``resume_step=k`` cuts ``metrics.jsonl`` back to the records of steps
``<= k`` (the steps a crashed run logged after its last checkpoint are logged again by the resumed
run), opens TensorBoard with ``purge_step=k + 1`` (its events of later steps are dropped by every
reader) and continues the same wandb run (``wandb_run_id``, saved with the checkpoint). A fresh run
(``resume_step=None``) in a directory that already holds a ``metrics.jsonl`` moves it to
``metrics.jsonl.prev``.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Optional, Protocol

from rollplex_train.tracking.wandb_run import WandbBackend, wandb_mode_from_env

__all__ = ["LOGGER_NAMES", "Tracker", "read_metrics_jsonl", "wandb_mode_from_env"]

log = logging.getLogger(__name__)

LOGGER_NAMES = ("console", "jsonl", "tensorboard", "wandb")
METRICS_FILE = "metrics.jsonl"

# (metric key, short label) shown first on the console line, in this order; then val/*.
_CONSOLE_KEYS = (
    ("critic/score/mean", "score"),
    ("timing_s/step", "step_s"),
    ("actor/kl_loss", "kl_loss"),
    ("response_length/mean", "resp_len"),
)


class _Backend(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def _to_float(key: str, value: Any) -> float:
    """Coerce a metric value (python/numpy scalar, 0-d or 1-element tensor) to ``float``."""
    if hasattr(value, "item"):
        value = value.item()
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"metric {key!r} is not a number: {value!r} ({type(value).__name__})") from exc


def _fmt(value: float) -> str:
    return f"{value:.4g}"


class _ConsoleBackend:
    """One compact INFO line per step through ``logging``; the full metric set at DEBUG."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self._logger = logger or logging.getLogger("rollplex_train.metrics")

    def log(self, metrics: dict[str, float], step: int) -> None:
        parts = [f"step {step}"]
        for key, label in _CONSOLE_KEYS:
            if key in metrics:
                parts.append(f"{label} {_fmt(metrics[key])}")
        parts.extend(f"{k} {_fmt(v)}" for k, v in sorted(metrics.items()) if k.startswith("val/"))
        self._logger.info(" | ".join(parts))
        if self._logger.isEnabledFor(logging.DEBUG):
            rest = " ".join(f"{k}={_fmt(v)}" for k, v in sorted(metrics.items()))
            self._logger.debug("step %d all: %s", step, rest)

    def close(self) -> None:
        pass


class _JsonlBackend:
    """Appends ``{"step": s, **metrics}`` to ``metrics.jsonl``, flushing after every line."""

    def __init__(self, output_dir: Path, resume_step: Optional[int] = None) -> None:
        self.path = output_dir / METRICS_FILE
        if resume_step is None and self.path.exists():  # a new run (not a resume) in a used directory
            backup = self.path.with_name(METRICS_FILE + ".prev")
            os.replace(self.path, backup)
            log.warning("new run: the previous %s was moved to %s", self.path, backup)
        elif resume_step is not None and self.path.exists():
            self._cut_back(resume_step)
        needs_newline = False
        if self.path.exists() and self.path.stat().st_size > 0:
            # A crash mid-write can leave a partial last line; start the next record on a fresh line.
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                needs_newline = f.read(1) != b"\n"
        self._file = open(self.path, "a", encoding="utf-8")
        if needs_newline:
            self._file.write("\n")
            self._file.flush()

    def _cut_back(self, last_step: int) -> None:
        """Keep the lines of steps ``<= last_step`` (verbatim; unparsable lines dropped), atomically."""
        kept, dropped = [], 0
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    keep = int(json.loads(line)["step"]) <= last_step
                except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                    keep = False
                if keep:
                    kept.append(line if line.endswith("\n") else line + "\n")
                else:
                    dropped += line.strip() != ""
        if dropped:
            tmp = self.path.with_name(METRICS_FILE + ".tmp")
            tmp.write_text("".join(kept), encoding="utf-8")
            os.replace(tmp, self.path)
            log.info("resume at step %d: dropped %d later line(s) of %s", last_step, dropped, self.path)

    def log(self, metrics: dict[str, float], step: int) -> None:
        record: dict[str, Any] = {"step": step}
        for key, value in metrics.items():
            record[key] = value if math.isfinite(value) else None
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class _TensorboardBackend:
    """``torch.utils.tensorboard.SummaryWriter`` at ``<output_dir>/tensorboard``."""

    def __init__(self, output_dir: Path, config: Mapping[str, Any], resume_step: Optional[int] = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = output_dir / "tensorboard"
        # purge_step: readers drop this directory's events of steps >= it (logged before a crash)
        self._writer = SummaryWriter(log_dir=str(self.log_dir),
                                     purge_step=None if resume_step is None else resume_step + 1)
        if config and resume_step is None:
            text = json.dumps(config, indent=2, sort_keys=True, default=str)
            self._writer.add_text("config", f"```\n{text}\n```", global_step=0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class Tracker:
    """Fans each step's metrics out to the chosen backends.

    Args:
        loggers: Backend names, any of ``console``, ``jsonl``, ``tensorboard``, ``wandb``
            (duplicates are ignored).
        output_dir: Run directory; created if missing. See the module docstring for the layout.
        project: Project name (wandb project).
        experiment: Experiment name (wandb run name).
        config: The resolved run config as a plain dict (wandb config; tensorboard text "config").
        resume_step: The checkpoint step a resumed run continues from (None: a fresh run); see
            the module docstring.
        wandb_run_id: The wandb run to continue (saved with the checkpoint); None: a new id.
        wandb_init_timeout_s: Most seconds the wandb start may take before it falls back to offline.

    Attributes:
        wandb_run_id: The wandb run's id (None without the wandb logger): save it with checkpoints.

    Raises:
        ValueError: An unknown logger name (raised before any backend is created).

    Use as a context manager or call :meth:`close`; :meth:`close` is idempotent.
    """

    def __init__(
        self,
        loggers: Iterable[str],
        output_dir: str | Path,
        project: str,
        experiment: str,
        config: Mapping[str, Any] | None = None,
        resume_step: Optional[int] = None,
        wandb_run_id: Optional[str] = None,
        wandb_init_timeout_s: float = 30.0,
    ) -> None:
        names = list(dict.fromkeys(loggers))
        self.resume_step = resume_step
        unknown = [name for name in names if name not in LOGGER_NAMES]
        if unknown:
            raise ValueError(f"trainer.loggers: unknown logger(s) {unknown}; choose from {list(LOGGER_NAMES)}")
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.names = names
        self.wandb_run_id: Optional[str] = None
        self._backends: dict[str, _Backend] = {}
        config = dict(config or {})
        try:
            for name in names:
                if name == "console":
                    self._backends[name] = _ConsoleBackend()
                elif name == "jsonl":
                    self._backends[name] = _JsonlBackend(self.output_dir, resume_step)
                elif name == "tensorboard":
                    self._backends[name] = _TensorboardBackend(self.output_dir, config, resume_step)
                else:
                    run = WandbBackend(self.output_dir, project, experiment, config, wandb_run_id,
                                       wandb_init_timeout_s)
                    self._backends[name], self.wandb_run_id = run, run.run_id
        except BaseException:
            self.close()
            raise

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log one step's metrics to every backend.

        Args:
            metrics: Metric name -> number (python/numpy scalars and 1-element tensors are
                converted to ``float``); non-finite values are kept (jsonl: ``null``).
            step: The training step (x axis everywhere).

        Raises:
            ValueError: A value that is not a number (the message names the key).
        """
        values = {key: _to_float(key, value) for key, value in metrics.items()}
        for backend in self._backends.values():
            backend.log(values, int(step))

    def close(self) -> None:
        """Flush and close every backend; later calls do nothing."""
        backends, self._backends = self._backends, {}
        for name, backend in backends.items():
            try:
                backend.close()
            except Exception:  # one failing backend must not keep the others open
                log.exception("closing the %s logger failed", name)

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read ``metrics.jsonl`` back: one dict per step, last record per step wins, sorted by step.

    ``null`` values come back as ``float("nan")``; unparsable lines (a crash mid-write) are
    skipped with a warning.

    Raises:
        FileNotFoundError: ``path`` does not exist (named in the message).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"metrics file not found: {path}")
    by_step: dict[int, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                step = int(record["step"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                log.warning("%s:%d: skipping an unparsable metrics line", path, lineno)
                continue
            by_step[step] = {k: (math.nan if v is None else v) for k, v in record.items()}
    return [by_step[s] for s in sorted(by_step)]
