"""Online cost model: seconds of a task from its size in tokens and its share of the device.

Each task kind (``decode``, ``prefix/ref``, ``suffix/old``, ``update``, ...) has a rate in seconds per
token for each thread count it was measured at, kept as an exponential moving average of the
measurements (the first steps calibrate it, every later step updates it). A thread count that was
never measured is extrapolated with Amdahl's law, ``t(c) = t(1) * ((1 - f) + f / c)`` (Amdahl 1967),
where the parallel fraction ``f`` is fitted from two measured thread counts of the same kind, or
taken from ``prior_parallel_fraction`` while only one is known. The first measurement of a
(kind, threads) pair carries one-time warm-up costs (allocator growth, kernel selection, lazy
initialisation), so the second measurement replaces it instead of being averaged with it.

Noise: every later measurement's relative deviation from the current rate, ``|new / rate - 1|``, is
kept as an EMA per (kind, threads) (``prior_noise`` until one is seen); the planner's margin for
noise is built from it. The *gain shortfall* is an EMA of how far an overlapped step's measured
gain over no overlap fell short of the planned gain (:meth:`observe_gain`).

Units: seconds, tokens, threads. Pure Python, no processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


def amdahl(threads: int, parallel_fraction: float) -> float:
    """Run time at ``threads`` relative to one thread: ``(1 - f) + f / threads``."""
    return (1.0 - parallel_fraction) + parallel_fraction / threads


@dataclass
class CostModel:
    """Seconds-per-token rates by (kind, threads), updated online.

    Args:
        ema: weight of a new measurement (1.0: keep only the latest).
        prior_parallel_fraction: Amdahl ``f`` assumed for a kind measured at one thread count only.
    """

    ema: float = 0.5
    prior_parallel_fraction: float = 0.5
    rates: dict[str, dict[int, float]] = field(default_factory=dict)
    """kind -> threads -> seconds per token."""
    switch_s: Optional[float] = None
    """Measured cost of one change of the device shares (seconds), EMA."""
    counts: dict[tuple[str, int], int] = field(default_factory=dict)
    """Measurements seen per (kind, threads)."""
    prior_noise: float = 0.05
    """Relative step-to-step deviation assumed for a (kind, threads) rate until one is measured."""
    noise: dict[tuple[str, int], float] = field(default_factory=dict)
    """EMA of the relative deviation of a measurement from the rate it updates, per (kind, threads)."""
    gain_shortfall_s: float = 0.0
    """EMA of ``max(0, planned gain - realised gain)`` over overlapped steps, seconds."""

    def observe(self, kind: str, tokens: int, threads: int, seconds: float) -> None:
        """Record that ``tokens`` of ``kind`` took ``seconds`` on ``threads`` threads.

        Raises:
            ValueError: ``threads`` < 1 or a negative time.
        """
        if threads < 1 or seconds < 0:
            raise ValueError(f"observe({kind!r}): threads={threads}, seconds={seconds}: expected >= 1 and >= 0")
        if tokens <= 0:
            return
        rate = seconds / tokens
        by_threads = self.rates.setdefault(kind, {})
        seen = self.counts.get((kind, threads), 0)
        self.counts[(kind, threads)] = seen + 1
        old = by_threads.get(threads)
        if seen >= 2 and old > 0:  # past the warm-up measurement: how far this one strays
            deviation = abs(rate / old - 1.0)
            prev = self.noise.get((kind, threads))
            self.noise[(kind, threads)] = deviation if prev is None else (1 - self.ema) * prev + self.ema * deviation
        by_threads[threads] = rate if seen <= 1 else (1 - self.ema) * old + self.ema * rate

    def observe_switch(self, seconds: float) -> None:
        """Record one re-share of the device (thread counts / MPS share changed)."""
        self.switch_s = seconds if self.switch_s is None else (1 - self.ema) * self.switch_s + self.ema * seconds

    def observe_gain(self, planned_s: float, realised_s: float) -> None:
        """Record an overlapped step: the planner's predicted gain over no overlap and the measured
        one (seconds); the shortfall ``max(0, planned - realised)`` joins the planner's margin."""
        shortfall = max(0.0, planned_s - realised_s)
        self.gain_shortfall_s = (1 - self.ema) * self.gain_shortfall_s + self.ema * shortfall

    def relative_noise(self, kind: str, threads: int) -> float:
        """Measured relative step-to-step deviation of ``kind`` at ``threads`` (the prior if none)."""
        return self.noise.get((kind, threads), self.prior_noise)

    def known(self, kind: str, threads: Optional[int] = None) -> bool:
        """Whether ``kind`` was measured (at ``threads``, if given)."""
        by_threads = self.rates.get(kind, {})
        return bool(by_threads) if threads is None else threads in by_threads

    def calibrated(self, kind: str, threads: int) -> bool:
        """Whether ``kind`` at ``threads`` has a measurement past its warm-up one."""
        return self.counts.get((kind, threads), 0) >= 2

    def parallel_fraction(self, kind: str) -> float:
        """Amdahl ``f`` of ``kind`` fitted from its two most distant measured thread counts,
        clipped to [0, 1]; the prior while fewer than two are known."""
        by_threads = self.rates.get(kind, {})
        if len(by_threads) < 2:
            return self.prior_parallel_fraction
        lo, hi = min(by_threads), max(by_threads)
        ratio = by_threads[hi] / by_threads[lo]  # = amdahl(hi) / amdahl(lo)
        # (1 - f + f/hi) = ratio * (1 - f + f/lo)  =>  f = (1 - ratio) / ((1 - ratio) + ratio/lo - 1/hi)
        denom = (1 - ratio) + ratio / lo - 1 / hi
        if abs(denom) < 1e-12:
            return self.prior_parallel_fraction
        return min(1.0, max(0.0, (1 - ratio) / denom))

    def rate(self, kind: str, threads: int) -> float:
        """Seconds per token of ``kind`` at ``threads`` (measured, or Amdahl-extrapolated).

        Raises:
            KeyError: ``kind`` was never measured.
        """
        by_threads = self.rates.get(kind)
        if not by_threads:
            raise KeyError(f"cost model has no measurement of {kind!r} yet")
        if threads in by_threads:
            return by_threads[threads]
        f = self.parallel_fraction(kind)
        ref = min(by_threads, key=lambda c: abs(c - threads))
        return by_threads[ref] * amdahl(threads, f) / amdahl(ref, f)

    def seconds(self, kind: str, tokens: int, threads: int) -> float:
        """Predicted seconds of ``tokens`` of ``kind`` on ``threads`` threads (0 for no tokens)."""
        return 0.0 if tokens <= 0 else tokens * self.rate(kind, threads)

    def state_dict(self) -> dict:
        """JSON-ready state (rates, measurement counts, switch cost) for the driver's checkpoint."""
        return {"rates": {k: {str(c): r for c, r in v.items()} for k, v in self.rates.items()},
                "counts": [[kind, threads, n] for (kind, threads), n in self.counts.items()],
                "switch_s": self.switch_s,
                "noise": [[kind, threads, v] for (kind, threads), v in self.noise.items()],
                "gain_shortfall_s": self.gain_shortfall_s}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (a resumed run plans at once, no re-profiling)."""
        self.rates = {k: {int(c): float(r) for c, r in v.items()} for k, v in state["rates"].items()}
        self.counts = {(kind, int(threads)): int(n) for kind, threads, n in state["counts"]}
        self.switch_s = state["switch_s"]
        self.noise = {(kind, int(threads)): float(v) for kind, threads, v in state.get("noise", [])}
        self.gain_shortfall_s = float(state.get("gain_shortfall_s", 0.0))

    def metrics(self) -> dict[str, float]:
        """``cost/<kind>@<threads>``: the current rates in microseconds per token (step metrics)."""
        return {f"cost/{kind}@{threads}": rate * 1e6 for kind, by_threads in self.rates.items()
                for threads, rate in sorted(by_threads.items())}
