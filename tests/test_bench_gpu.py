"""scripts/bench_gpu.py's dry run: the GPU benchmark's code path (in-process executor, all four
schedules, no Hydra/Ray/datasets imports) on CPU with the tiny model, fp32."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_gpu_dry_run_runs_every_schedule_with_identical_tokens(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gpu.py"), "--dry-run", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines[1:5]] == ["serial", "serial_shared", "disaggregated", "rollplex"]
    assert "tokens: step-1 responses identical across schedules=yes" in lines
    assert "imports: none of hydra,omegaconf,ray,datasets,decord,av" in lines
    assert re.fullmatch(r"schedules: rollplex/serial=\d+\.\d\d rollplex/serial_shared=\d+\.\d\d "
                        r"rollplex/disaggregated=\d+\.\d\d prefix_hidden=\d+%", lines[-1]), lines[-1]
    assert (tmp_path / "rollplex" / "traces" / "step_4.json").is_file()
