"""Hydra multirun sweeps through the submitit launcher (the ``submitit`` extra): ``submitit_local``
runs each point as a job of its own, as ``submitit_slurm`` does on a cluster (docs/cluster.md)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from rollplex_train.cluster.launch import check_sweep_job

from conftest import CLI, ROOT

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")


@pytest.mark.slow
def test_two_point_sweep_runs_both_jobs(tmp_path):
    """``rollplex-train -m hydra/launcher=submitit_local +experiment=tiny_cpu trainer.total_steps=1
    actor.lr=1e-4,3e-4``, made cheap (4 prompts x 2 responses, no validation, engines in the
    driver): each point trains one step in its own job directory with its own learning rate."""
    sweep = tmp_path / "sweep"
    cmd = [str(CLI), "-m", "hydra/launcher=submitit_local", "+experiment=tiny_cpu", "trainer.total_steps=1",
           "actor.lr=1e-4,3e-4", f"hydra.sweep.dir={sweep}", "trainer.val_before_train=false", "trainer.val_freq=0",
           "trainer.export_hf=false", "trainer.loggers=[jsonl]", "trainer.progress_bar=false",
           "cluster.executor=inprocess", "cluster.threads_per_device=1", "data.rollout_batch_size=4", "rollout.n=2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, WANDB_MODE="offline"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lr = {}
    for job in (0, 1):
        rows = [json.loads(line) for line in (sweep / str(job) / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1] and rows[0]["actor/weights_version"] == 1.0
        assert (sweep / str(job) / "checkpoints" / "global_step_1" / "actor.pt").is_file()
        overrides = (sweep / str(job) / ".hydra" / "overrides.yaml").read_text()
        lr[job] = rows[0]["actor/lr"]
        assert f"actor.lr={('0.0001', '0.0003')[job]}" in overrides
    # the same cosine schedule over one optimizer step, scaled by each point's actor.lr
    assert lr[1] == pytest.approx(3 * lr[0], rel=1e-6) and lr[0] == pytest.approx(1e-4 * 0.1, rel=1e-6)


def test_a_sweep_job_of_several_tasks_is_refused(monkeypatch):
    """Every task of a submitit job runs the whole driver: more than one is refused in one line."""
    check_sweep_job()  # not a submitit job: nothing to check
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    monkeypatch.setenv("SUBMITIT_LOCAL_NTASKS", "1")
    check_sweep_job()
    monkeypatch.setenv("SUBMITIT_LOCAL_NTASKS", "2")
    with pytest.raises(ValueError, match=r"hydra.launcher: this sweep job has 2 tasks.*hydra.launcher.nodes=1"):
        check_sweep_job()


@pytest.mark.slow
def test_a_basic_launcher_sweep_runs_each_point_on_a_cluster_of_its_own(tmp_path):
    """The README's sweep without a launcher plugin: Hydra's basic launcher runs the points one after
    the other in one process; each starts its own Ray cluster (the first one's placement group held
    the devices and the second point waited on it forever before ``cli.stop_ray``)."""
    sweep = tmp_path / "sweep"
    cmd = [str(CLI), "-m", "+experiment=tiny_cpu", "trainer.total_steps=1", "actor.lr=1e-4,3e-4",
           f"hydra.sweep.dir={sweep}", "trainer.val_before_train=false", "trainer.val_freq=0", "trainer.export_hf=false",
           "trainer.loggers=[jsonl]", "trainer.progress_bar=false", "data.rollout_batch_size=4", "rollout.n=2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, WANDB_MODE="offline"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for job in (0, 1):
        rows = [json.loads(line) for line in (sweep / str(job) / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1] and rows[0]["actor/weights_version"] == 1.0
        assert list((sweep / str(job) / "ray").glob("session_*")) or "Ray temp dir" in proc.stdout + proc.stderr
