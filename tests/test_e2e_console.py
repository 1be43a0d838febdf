"""The console of a real run: Ctrl-C ends it in one line (exit 130, last checkpoint named), no
Ray notices or tracebacks, and no Ray temp directory left behind."""

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


def test_ctrl_c_prints_one_line_and_exits_130(embedded_assets, tmp_path):
    out = tmp_path / "a_run_directory_too_long_for_rays_unix_sockets"  # Ray gets a short /tmp dir
    cmd = [str(CLI), "+experiment=tiny_cpu", f"hydra.run.dir={out}", "trainer.total_steps=50", "trainer.val_freq=0",
           "trainer.val_before_train=false", "data.rollout_batch_size=4", "rollout.n=4",
           "actor.ppo_mini_batch_size=2", "trainer.save_freq=1", "trainer.export_hf=false"]
    env = dict(os.environ, WANDB_MODE="offline")
    # its own session, as a terminal's process group: SIGINT reaches the driver and Ray's processes.
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
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, f"stdout (the driver's log):\n{stdout[-4000:]}\nstderr:\n{stderr[-3000:]}"
    assert "Traceback" not in stdout + stderr and "Token authentication" not in stderr
    lines = [line for line in stderr.splitlines() if "interrupted" in line]
    assert len(lines) == 1 and re.fullmatch(
        rf"rollplex-train: interrupted at step \d+; last checkpoint {re.escape(str(out))}/checkpoints/global_step_\d+ "
        r"\(the same command resumes from it\)", lines[0]), lines
    short = re.search(r"Ray temp dir (/\S+)", stdout)
    assert short is not None and not Path(short.group(1)).exists()  # removed, its logs kept in <out>/ray
    assert list((out / "ray").glob("session_*/logs"))
