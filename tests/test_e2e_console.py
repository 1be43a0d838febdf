"""The console of a real run: Ctrl-C ends it in one line (exit 130, last checkpoint named), SIGTERM
(a scheduler's time limit) the same with exit 143; no Ray notices, stack dumps or tracebacks, and no
Ray temp directory left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import CLI, ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.mark.parametrize("sig, code, how", [(signal.SIGINT, 130, "interrupted"),
                                           (signal.SIGTERM, 143, r"terminated \(SIGTERM\)")], ids=["sigint", "sigterm"])
def test_a_stop_signal_prints_one_line_and_exits_128_plus_signal(embedded_assets, tmp_path, sig, code, how):
    out = tmp_path / "a_run_directory_too_long_for_rays_unix_sockets"  # Ray gets a short /tmp dir
    cmd = [str(CLI), "+experiment=tiny_cpu", f"hydra.run.dir={out}", "trainer.total_steps=50", "trainer.val_freq=0",
           "trainer.val_before_train=false", "data.rollout_batch_size=4", "rollout.n=4",
           "actor.ppo_mini_batch_size=2", "trainer.save_freq=1", "trainer.export_hf=false"]
    env = dict(os.environ, WANDB_MODE="offline")
    # its own session, as a terminal's process group: the signal reaches the driver and Ray's processes
    # (SLURM's time limit, too, sends SIGTERM to every process of the job step).
    # A terminal's foreground job has SIGINT at its default; under a shell's `cmd &` (no job control)
    # pytest inherits SIGINT ignored, and an ignored signal stays ignored across exec: the run would
    # finish with exit 0. Python's own handler is reset to the default in the child at exec.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    pointer = out / "checkpoints" / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + 600
    while not pointer.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    os.killpg(proc.pid, sig)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == code, f"stdout (the driver's log):\n{stdout[-4000:]}\nstderr:\n{stderr[-3000:]}"
    assert "Traceback" not in stdout + stderr and "Token authentication" not in stderr
    assert "SIGTERM received" not in stderr and "not the main thread" not in stderr  # no dump, no second Ray
    lines = [line for line in stderr.splitlines() if line.startswith("rollplex-train:")]
    assert len(lines) == 1 and re.fullmatch(
        rf"rollplex-train: {how} at step \d+; last checkpoint {re.escape(str(out))}/checkpoints/global_step_\d+ "
        r"\(the same command resumes from it\)", lines[0]), lines
    short = re.search(r"Ray temp dir (/\S+)", stdout)
    assert short is not None and not Path(short.group(1)).exists()  # removed, its logs kept in <out>/ray
    assert list((out / "ray").glob("session_*/logs"))
