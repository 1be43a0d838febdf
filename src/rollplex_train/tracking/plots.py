"""The per-task validation curve of a run, drawn from its ``metrics.jsonl`` (matplotlib, Agg backend)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Optional

from rollplex_train.tracking.loggers import METRICS_FILE, read_metrics_jsonl

__all__ = ["VAL_PLOT_FILE", "plot_val_accuracy", "val_accuracy_curves"]

log = logging.getLogger(__name__)

VAL_PLOT_FILE = "val_accuracy.png"


def val_accuracy_curves(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """``{"all" | <task>: [(step, accuracy), ...]}`` from metrics records (``val/accuracy`` and
    ``val/<task>/accuracy``; steps without validation or with a NaN value are left out)."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for key, value in record.items():
            if not key.startswith("val/") or not key.endswith("accuracy") or not isinstance(value, (int, float)):
                continue
            if math.isnan(value):
                continue
            name = "all" if key == "val/accuracy" else key[len("val/"):-len("/accuracy")]
            curves.setdefault(name, []).append((int(record["step"]), float(value)))
    return curves


def plot_val_accuracy(output_dir: str | Path) -> Optional[Path]:
    """Draw ``<output_dir>/val_accuracy.png``: greedy validation accuracy per task and overall
    against the training step. Returns the path, or None when the run logged no validation.

    Raises:
        FileNotFoundError: ``<output_dir>/metrics.jsonl`` does not exist.
    """
    output_dir = Path(output_dir)
    curves = val_accuracy_curves(read_metrics_jsonl(output_dir / METRICS_FILE))
    if not curves:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in sorted(curves.items(), key=lambda item: (item[0] == "all", item[0])):
        steps, values = zip(*points)
        ax.plot(steps, values, marker="o", label=name, linewidth=2.5 if name == "all" else 1.5)
    ax.set_xlabel("training step")
    ax.set_ylabel("validation accuracy (greedy)")
    ax.set_ylim(0.0, 1.0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(output_dir.name)
    path = output_dir / VAL_PLOT_FILE
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    log.info("validation curves: %s", path)
    return path
