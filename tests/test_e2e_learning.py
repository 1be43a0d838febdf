"""RL works: on the colour task, greedy validation accuracy rises from chance to >= 0.8.

`rollplex-train +experiment=tiny_cpu_color` (fixed seeds): the format-warmed checkpoint answers in
the right format at chance (0.25); GRPO must learn to read the colour from the pixels.
"""

from __future__ import annotations

import time

import pytest

from rollplex_train.tracking.loggers import read_metrics_jsonl

pytestmark = pytest.mark.slow


def test_grpo_raises_colour_accuracy_from_chance(embedded_assets, run_cli, tmp_path):
    out = tmp_path / "color"
    start = time.perf_counter()
    proc = run_cli(out, "trainer.loggers=[console,jsonl]", experiment="tiny_cpu_color", timeout=900)  # a hang guard
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = read_metrics_jsonl(out / "metrics.jsonl")
    val = {r["step"]: r["val/color/accuracy"] for r in records if "val/color/accuracy" in r}
    print(f"colour val accuracy by step: {val} ({elapsed:.0f} s wall-clock)")
    assert 0.15 <= val[0] <= 0.35, val  # chance before RL
    assert val[max(val)] >= 0.8, val
