"""Spans of one step on named rows (driver, rollout, train): Chrome traces and Gantt plots."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

ROWS = ("driver", "rollout", "train")


@dataclass
class Span:
    """One task on one row; times in seconds from the step's start."""

    name: str
    row: str
    start_s: float
    end_s: float


@dataclass
class Timeline:
    """The spans of one step, measured with ``time.perf_counter`` in the driver, and the seconds
    per span name (``seconds``: the step's ``timing_s/*``)."""

    origin: float = field(default_factory=time.perf_counter)
    spans: list[Span] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    def now(self) -> float:
        """Seconds since the step started."""
        return time.perf_counter() - self.origin

    @contextmanager
    def span(self, name: str, row: str) -> Iterator[None]:
        """Record the block as a span; also add its seconds to ``seconds[name]`` (``timing_s/*``)."""
        start = self.now()
        try:
            yield
        finally:
            end = self.now()
            self.spans.append(Span(name, row, start, end))
            self.seconds[name] = self.seconds.get(name, 0.0) + end - start

    def add(self, name: str, row: str, start_s: float, end_s: float) -> None:
        """Record a span measured elsewhere (e.g. a worker's task inside the decode window)."""
        self.spans.append(Span(name, row, start_s, end_s))

    def chrome_trace(self) -> dict:
        """The Chrome trace-event JSON object (opens in Perfetto / chrome://tracing): one thread row
        per worker, tasks as complete ('X') slices in microseconds."""
        events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": row}}
                  for i, row in enumerate(ROWS)]
        for s in self.spans:
            events.append({"name": s.name, "ph": "X", "pid": 0, "tid": ROWS.index(s.row),
                           "ts": round(s.start_s * 1e6, 1), "dur": round((s.end_s - s.start_s) * 1e6, 1)})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    @classmethod
    def from_chrome_trace(cls, path: Path) -> "Timeline":
        """Read back what :meth:`write_chrome_trace` wrote (spans in seconds, rows by thread name).

        Raises:
            FileNotFoundError: no file at ``path``.
        """
        data = json.loads(Path(path).read_text())
        rows = {e["tid"]: e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M"}
        return cls(origin=0.0, spans=[Span(e["name"], rows[e["tid"]], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
                                      for e in data["traceEvents"] if e["ph"] == "X"])

    def write_chrome_trace(self, path: Path) -> Path:
        """Write :meth:`chrome_trace` to ``path`` (parents created)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.chrome_trace()))
        return path


def plot_gantt(timelines: dict[str, Timeline], path: Path, title: str = "") -> Path:
    """One Gantt chart per schedule (stacked, same time axis): rows = workers, bars = tasks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({s.name for tl in timelines.values() for s in tl.spans})
    colours = {n: (plt.cm.tab10 if len(names) <= 10 else plt.cm.tab20)(i % 20) for i, n in enumerate(names)}
    horizon = max((s.end_s for tl in timelines.values() for s in tl.spans), default=1.0)
    fig, axes = plt.subplots(len(timelines), 1, figsize=(11, 1.6 * len(timelines) + 0.8), sharex=True, squeeze=False)
    for ax, (label, tl) in zip(axes[:, 0], timelines.items()):
        for s in tl.spans:
            ax.barh(ROWS.index(s.row), s.end_s - s.start_s, left=s.start_s, color=colours[s.name], edgecolor="black",
                    linewidth=0.3)
        ax.set_yticks(range(len(ROWS)), ROWS)
        ax.set_xlim(0, horizon * 1.02)
        ax.set_title(label, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds from step start")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[n]) for n in names]
    fig.legend(handles, names, loc="upper right", fontsize=7, ncol=min(len(names), 5))
    if title:
        fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
