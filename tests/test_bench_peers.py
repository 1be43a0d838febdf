"""scripts/bench_peers.py's own checks, without TRL: unknown workloads/systems and a round count
below 1, duplicate names and step counts that leave nothing to time are refused in one line (argparse's usage + error, exit 2) before anything starts; a run
killed by a signal is left out of the medians while the rounds go on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args, message", [
    (["--workloads", "bench_short,nope"], "--workloads: unknown 'nope'; expected some of bench_short, bench_image, bench_video"),
    (["--systems", "trl,fast"], "--systems: unknown 'fast'; expected some of trl, serial, serial_shared, rollplex"),
    (["--rounds", "0"], "--rounds=0: expected at least 1"),
    (["--workloads", "bench_short,bench_short"], "--workloads=bench_short,bench_short: a name given twice"),
    (["--trl-steps", "1"], "--trl-steps=1: expected at least 2 (timed from step 2)"),
    (["--steps", "3"], "--timed-from=4: expected 1..--steps (3)"),
])
def test_bench_peers_refuses_bad_arguments_in_one_line(args, message, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_peers.py"), *args, "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith(f"error: {message}"), proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "o").exists()


def test_a_killed_run_is_reported_left_out_and_the_rounds_go_on(monkeypatch, tmp_path):
    """A run ended by a signal (the OOM killer) does not stop the rounds; a failed run does."""
    import json

    from rollplex_train.bench import peers

    calls = []

    def fake_trl(workload, steps, timed_from, out, overrides):
        calls.append(("trl", workload))
        if len(calls) == 1:
            raise peers.RunKilled(f"{workload} trl killed by signal 9")
        return {"step": 10.0, "gen": 1.0, "ref": 1.0, "update": 8.0}

    def fake_rollplex(workload, system, steps, timed_from, out, overrides):
        calls.append((system, workload))
        return {"step": 2.0, "gen": 1.0, "ref": 0.1, "update": 0.9}

    monkeypatch.setattr(peers, "run_trl", fake_trl)
    monkeypatch.setattr(peers, "run_rollplex", fake_rollplex)
    monkeypatch.setattr(peers, "wait_for_idle", lambda *a: (0.0, 0.0))
    lines = []
    results = peers.run_rounds(["bench_short"], ["trl", "serial_shared", "rollplex"], 2, tmp_path, [], report=lines.append)
    assert len(calls) == 6 and [len(results["bench_short"][s]) for s in ("trl", "serial_shared", "rollplex")] == [1, 2, 2]
    assert "KILLED: bench_short trl killed by signal 9" in lines[0]
    assert json.loads((tmp_path / "results.json").read_text())["killed"] == ["round 1: bench_short trl killed by signal 9"]

    monkeypatch.setattr(peers, "run_trl", lambda *a: (_ for _ in ()).throw(RuntimeError("bench_short trl failed")))
    with pytest.raises(RuntimeError, match="trl failed"):
        peers.run_rounds(["bench_short"], ["trl"], 1, tmp_path, [], report=lines.append)
