"""A thin tqdm progress bar over training steps."""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Mapping
from typing import Any, Optional

__all__ = ["ProgressBar"]

log = logging.getLogger(__name__)

SCORE_KEY = "critic/score/mean"
STEP_TIME_KEY = "timing_s/step"


class ProgressBar:
    """One tqdm bar over training steps, with the score and step time in its postfix.

    Args:
        total: Total number of training steps (the bar's end).
        initial: Steps already done (``> 0`` when resuming).
        enabled: ``False`` -> no bar and no output at all; every method is a no-op.
        interactive: stderr is a terminal (None: ask ``sys.stderr.isatty()``).

    On a terminal the bar writes to stderr (tqdm's default). While it is open, the console handlers
    of the root logger write through ``tqdm.write`` (``tqdm.contrib.logging.logging_redirect_tqdm``),
    so a log line is printed above the bar instead of being glued to it. Elsewhere (a log file, a
    pipe, CI) a bar's carriage-return frames would pile up in the file, so progress is one log line
    every twentieth of the run and at its last step. Use it as a context manager or call :meth:`close`.
    """

    def __init__(self, total: int, initial: int = 0, enabled: bool = True,
                 interactive: Optional[bool] = None) -> None:
        self.enabled = bool(enabled)
        self._bar: Any = None
        self._redirect: Any = None
        self.total, self.n = total, initial
        self._every = max(1, total // 20)
        interactive = sys.stderr.isatty() if interactive is None else interactive
        if self.enabled and interactive:
            from tqdm.auto import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)
            self._redirect = logging_redirect_tqdm(tqdm_class=tqdm)
            self._redirect.__enter__()

    def update(self, step_metrics: Mapping[str, Any] | None = None, num_steps: int = 1) -> None:
        """Advance by ``num_steps`` and show ``score`` and ``step_s`` from ``step_metrics``.

        Args:
            step_metrics: The step's metrics; ``critic/score/mean`` and ``timing_s/step`` (seconds)
                are shown when present and finite, other keys are ignored.
            num_steps: Steps to advance.
        """
        if not self.enabled:
            return
        self.n += num_steps
        postfix: dict[str, str] = {}
        for label, key in (("score", SCORE_KEY), ("step_s", STEP_TIME_KEY)):
            value = (step_metrics or {}).get(key)
            if value is None:
                continue
            try:
                value = float(value)
            except (TypeError, ValueError):
                continue
            if math.isfinite(value):
                postfix[label] = f"{value:.3g}" if label == "score" else f"{value:.1f}"
        if self._bar is None:  # no terminal: a line now and then
            if self.n % self._every == 0 or self.n >= self.total:
                log.info("train %d/%d%s", self.n, self.total, "".join(f" {k}={v}" for k, v in postfix.items()))
            return
        if postfix:
            self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(num_steps)

    def close(self) -> None:
        """Close the bar (idempotent)."""
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
