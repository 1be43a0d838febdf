"""Wall-clock timing of named stages and throughput arithmetic.

The driver loop reads as a straight sequence of named, timed stages (EasyR1 ``ray_trainer.fit``)::

    timings: dict[str, float] = {}
    with timer("gen", timings):
        ...
    with timer("update_actor", timings):
        ...
    metrics.update(timing_metrics(timings))   # {"timing_s/gen": ..., "timing_s/update_actor": ...}

Units: every duration is in seconds (``time.perf_counter``), throughput in tokens per second per
device.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

__all__ = ["timer", "timing_metrics", "compute_throughput"]


@contextmanager
def timer(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Time the ``with`` body and add the elapsed seconds to ``timings[name]``.

    The time is *added* (``timings[name] = timings.get(name, 0.0) + elapsed_s``), so a stage entered
    several times in one step (e.g. once per mini-batch) accumulates. Start a fresh dict per step.
    The time is recorded even when the body raises; the exception propagates unchanged.

    Args:
        name: Stage name, e.g. ``"gen"`` or ``"update_actor"``; becomes ``timing_s/<name>``
            through :func:`timing_metrics`.
        timings: The per-step dict of accumulated seconds, mutated in place.
    """
    start_s = time.perf_counter()
    try:
        yield
    finally:
        elapsed_s = time.perf_counter() - start_s
        timings[name] = timings.get(name, 0.0) + elapsed_s


def timing_metrics(timings: Mapping[str, float], prefix: str = "timing_s/") -> dict[str, float]:
    """Turn ``{stage: seconds}`` into metric names ``{"timing_s/<stage>": seconds}``.

    Args:
        timings: Accumulated seconds per stage (from :func:`timer`).
        prefix: Metric name prefix; the default carries the unit.

    Returns:
        A new dict; values are floats in seconds.
    """
    return {f"{prefix}{name}": float(seconds) for name, seconds in timings.items()}


def compute_throughput(num_tokens: int | float, seconds: float, num_devices: int) -> float:
    """Tokens per second per device.

    Args:
        num_tokens: Tokens processed in ``seconds`` across all devices (prompt + response, or
            whatever the caller counts); must be ``>= 0``.
        seconds: Wall-clock duration in seconds; must be ``> 0`` and finite.
        num_devices: Devices that shared the work; must be ``>= 1``.

    Returns:
        ``num_tokens / seconds / num_devices`` in tokens/s/device.

    Raises:
        ValueError: ``num_tokens < 0``, ``seconds`` not a positive finite number, or
            ``num_devices < 1`` (the message names the argument).
    """
    if num_tokens < 0:
        raise ValueError(f"compute_throughput: num_tokens must be >= 0, got {num_tokens}")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"compute_throughput: seconds must be > 0 and finite, got {seconds}")
    if num_devices < 1:
        raise ValueError(f"compute_throughput: num_devices must be >= 1, got {num_devices}")
    return float(num_tokens) / float(seconds) / float(num_devices)
