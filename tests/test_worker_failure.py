"""A train worker killed mid-run (SIGKILL, ``ROLLPLEX_KILL_WORKER_AT_STEP``) on a DP=2 run: without
restarts the run ends within 10 s with one line naming the role, rank, cause and last checkpoint
(exit 1, no Ray process left); with ``trainer.max_restarts=1`` the driver starts the workers again,
resumes from the last checkpoint and ends with the uninterrupted run's weights."""

from __future__ import annotations

import re
import subprocess
import time
from datetime import datetime

import pytest
import torch

from rollplex_train.tracking.loggers import read_metrics_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

COMMON = ["trainer.total_steps=2", "trainer.save_freq=1", "trainer.val_freq=0", "trainer.val_before_train=false",
          "data.rollout_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2", "trainer.loggers=[jsonl]",
          "trainer.export_hf=false", "schedule=serial", "cluster.devices_per_node=2", "cluster.threads_per_device=1"]
KILL = {"ROLLPLEX_KILL_WORKER_AT_STEP": "2"}


def _weights(out):
    return torch.load(out / "checkpoints" / "global_step_2" / "actor.pt", weights_only=True)


def _ray_processes(out) -> list[str]:
    """Processes still running from this run's Ray session (its temp dir is under ``out``)."""
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
    return [p for p in ps if str(out) in p and "pytest" not in p]


def test_killed_worker_ends_the_run_in_one_line(embedded_assets, run_cli, tmp_path):
    out = tmp_path / "killed"
    proc = run_cli(out, *COMMON, env=KILL)
    ended = time.time()
    assert proc.returncode == 1, proc.stderr[-3000:]
    ours = [line for line in proc.stderr.splitlines() if line.startswith("rollplex-train:")]
    assert ours == [f"rollplex-train: error: train worker rank 1 failed: killed by a signal (SIGKILL, the kernel's "
                    f"OOM killer or a crash: its process exited without a reply) at step 2; last checkpoint "
                    f"{out / 'checkpoints' / 'global_step_1'}"]
    assert "Traceback" not in proc.stderr
    stamp = re.search(r"\[([\d-]+ [\d:]+,\d+)\]\[rollplex_train.trainer\]\[WARNING\] - ROLLPLEX_KILL_WORKER_AT_STEP",
                      proc.stdout).group(1)
    killed = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
    assert ended - killed < 10, ended - killed
    assert _ray_processes(out) == []


def test_restart_resumes_to_the_uninterrupted_weights(embedded_assets, run_cli, tmp_path):
    plain = run_cli(tmp_path / "plain", *COMMON)
    assert plain.returncode == 0, plain.stderr[-3000:]
    out = tmp_path / "restarted"
    proc = run_cli(out, *COMMON, "trainer.max_restarts=1", env=KILL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = proc.stdout + proc.stderr
    assert re.search(r"restart 1 of 1 \(trainer.max_restarts\): train worker rank 1 failed: killed by a signal .* "
                     r"at step 2; resuming from .*global_step_1", logs)
    assert [r["step"] for r in read_metrics_jsonl(out / "metrics.jsonl")] == [1, 2]
    expected, got = _weights(tmp_path / "plain"), _weights(out)
    assert expected.keys() == got.keys()
    assert all(torch.equal(got[k], v) for k, v in expected.items())  # bit-identical, as a resume is
    assert _ray_processes(out) == []
