"""Runs of the same rollplex command give bit-identical training results, whatever placement the
phase planner picks as machine load or memory differs between them (end to end, through the CLI)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import trained_metric_keys
from rollplex_train.tracking.loggers import read_metrics_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]  # three runs; minutes on a busy 2-core machine

PLACEMENT = ("planner/decode_share", "planner/train_share", "rollplex/window_tasks", "rollplex/after_tasks",
             "rollplex/tail_groups")
BURN = "while True:\n    pass\n"  # killed when the run ends


def _burner() -> None:
    """Load one core only (as nice as Ray's workers, 15): a spread-out load slows every phase alike,
    so the planner's cost ratios and placement often stay the same; a load on one core slows the
    2-thread phases (whose threads meet at barriers) more than a 1-thread task on the other core."""
    os.nice(15)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        os.sched_setaffinity(0, {cores[0]})


def test_same_command_same_metrics_under_different_load(embedded_assets, run_cli, tmp_path):
    """The same command run quiet and beside a busy process, and once more with no memory for
    window prefixes (a placement that certainly differs: every prefix after decode, suffixes of
    finished groups scored in the decode tail): metrics and weights bit-identical. The load alone
    moves the placement only sometimes (the planner's margins are there to make it stable), so the
    memory-starved run is what makes the placement difference certain."""
    common = ["schedule=rollplex", "model.shared_prefix=true", "trainer.total_steps=6", "trainer.save_freq=6",
              "trainer.val_freq=0", "trainer.val_before_train=false", "data.rollout_batch_size=4", "rollout.n=4",
              "rollout.max_new_tokens=8", "actor.ppo_mini_batch_size=2", "trainer.loggers=[jsonl]", "trainer.export_hf=false",
              "data.curriculum=[]"]  # the three tasks mixed, the workload this test was written for
    runs = {}
    for name, burners, extra in (("quiet", 0, []), ("loaded", 1, []), ("no_window", 0, ["schedule.prefix_memory_gib=0"])):
        load = [subprocess.Popen([sys.executable, "-c", BURN], preexec_fn=_burner) for _ in range(burners)]
        try:
            proc = run_cli(tmp_path / name, *common, *extra, timeout=1500)
        finally:
            for p in load:
                p.kill()
                p.wait()
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[name] = (read_metrics_jsonl(tmp_path / name / "metrics.jsonl"),
                      torch.load(tmp_path / name / "checkpoints" / "global_step_6" / "actor.pt", weights_only=True))
    quiet, w_quiet = runs["quiet"]
    placements = {name: [tuple(r[k] for k in PLACEMENT) for r in records] for name, (records, _) in runs.items()}
    assert sum(r["rollplex/window_tasks"] for r in quiet) > 0  # the quiet run put prefixes in the window
    assert placements["no_window"] != placements["quiet"]
    assert all(r["rollplex/window_tasks"] == 0 for r in runs["no_window"][0])
    for name in ("loaded", "no_window"):
        other, w_other = runs[name]
        assert [r["step"] for r in other] == [r["step"] for r in quiet] == list(range(1, 7))
        for a, b in zip(quiet, other):
            # the rollout engine's side of the engine-vs-trainer mismatch rounds differently with the
            # placement (1e-6 on the std-0.06 checkpoint: 1.9e-6 against 1.4e-6; the trainer's side and
            # the weights stay bit-identical): bounded, not compared bit for bit
            assert b["rollout/logprob_diff_max"] < 1e-5 and a["rollout/logprob_diff_max"] < 1e-5
            compared = {k: a[k] for k in trained_metric_keys(a) if k != "rollout/logprob_diff_max"}
            assert len(compared) > 30
            assert {k: b[k] for k in compared} == compared, (name, a["step"])  # bit-identical, not approximately
        assert all(torch.equal(w_other[key], value) for key, value in w_quiet.items()), name
