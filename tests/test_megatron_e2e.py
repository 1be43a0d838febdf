"""The flagship in miniature (``+experiment=flagship_cpu``) end to end through the CLI (Hydra -> Ray ->
worker groups) on two CPU devices: the Megatron actor at TP=2, its shards shared in place with one
built-in rollout engine at TP=2 (SGLang-layout tensors per rollout rank, every one a view at t = r = 2),
the residency plan driving the run (Adam states off the device outside the update, the reference off
it during the update), under the rollplex and the serial schedule; both end with the torch backend's
weights (DP=2 on the same devices, rollout TP=1, pickled weight sync), log the memory rows their plan
has, and a run killed at step 3 resumes to the uninterrupted run's step 4."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollplex_train.tracking.loggers import read_metrics_jsonl

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")
pytestmark = [pytest.mark.slow, pytest.mark.megatron]

# the torch backend is data parallel only; its whole replicas do not fit flagship_cpu's budget (the shards' plan)
TORCH = ["actor.backend=torch", "actor.tensor_parallel_size=1", "rollout.tensor_parallel_size=1", "memory.budget_gib=null"]
RUNS = {"torch": TORCH, "rollplex": [], "serial": ["schedule=serial"]}  # 4 steps each, a checkpoint per step
# planner telemetry and timings differ between runs; training results must not
TELEMETRY = ("timing_s/", "perf/throughput", "planner/", "rollplex/", "cost/", "prefix/", "sharing/", "memory/")


def _config(*overrides):
    from hydra import compose, initialize_config_dir

    from rollplex_train.cli import conf_dir
    from rollplex_train.config import hydra_version_base, register_configs, to_config

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), **hydra_version_base()):
        return to_config(compose(config_name="config", overrides=["+experiment=flagship_cpu",
                                                                  "trainer.output_dir=/tmp/unused", *overrides]))


@pytest.fixture(scope="module")
def runs(flagship_assets, run_cli, tmp_path_factory) -> dict[str, Path]:
    out = {}
    for name, extra in RUNS.items():
        path = tmp_path_factory.mktemp(name) / "run"
        proc = run_cli(path, *extra, experiment="flagship_cpu")
        assert proc.returncode == 0, proc.stderr[-4000:]
        out[name] = path
    return out


@pytest.mark.parametrize("schedule", ["rollplex", "serial"])
def test_flagship_gives_the_torch_backends_weights(runs, schedule):
    from safetensors.torch import load_file

    ours = load_file(str(runs[schedule] / "hf_actor" / "model.safetensors"))
    ref = load_file(str(runs["torch"] / "hf_actor" / "model.safetensors"))
    assert ours.keys() == ref.keys()
    assert max(float((ours[k] - ref[k]).abs().max()) for k in ref) <= 2e-5
    for got, expected in zip(read_metrics_jsonl(runs[schedule] / "metrics.jsonl"),
                             read_metrics_jsonl(runs["torch"] / "metrics.jsonl"), strict=True):
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/score/mean"):
            assert got[key] == pytest.approx(expected[key], rel=1e-3, abs=1e-5), (got["step"], key)
        # t = r = 2: every rollout tensor is a view of a Megatron shard, nothing copied at a sync
        assert got["sharing/shared_bytes_frac"] == 1.0 and got["sharing/copied_bytes"] == 0


@pytest.mark.parametrize("schedule", ["rollplex", "serial"])
def test_flagship_holds_what_its_memory_plan_says(runs, schedule):
    from rollplex_train.memory.step_plan import max_rel_err, plan_rows, row, run_plan
    from rollplex_train.models.arch import load_hf_config

    cfg = _config(*RUNS[schedule])
    planned = plan_rows(run_plan(cfg, load_hf_config(cfg.model)))
    metrics = read_metrics_jsonl(runs[schedule] / "metrics.jsonl")
    for m in metrics[1:]:  # step 1's update creates the Adam states: its update phase holds none yet
        assert max_rel_err(planned, m) == (0.0, []), m["step"]
    adam, ref = (round(planned[row(p, g)][0] * 2**30) for p, g in (("actor_update", "optimizer_states"),
                                                                  ("rollout_decode", "ref_weights")))
    # rollplex keeps the old/ref prefix states of the decode window, so its 0.019 GiB budget sends the
    # reference to the host for the update; the serial schedule's phases leave room for it
    ref_moves = planned[row("actor_update", "ref_weights")][0] == 0
    assert adam > 0 and ref > 0 and ref_moves == (schedule == "rollplex")
    # per step and summed over the 2 TP ranks: the Adam states leave after the update and come back for
    # the next one (none exist before step 1's); the reference leaves for the update and comes back for the sync
    moved = 2 * (adam + (ref if ref_moves else 0))
    assert [m["memory/offloaded_bytes"] for m in metrics] == [moved] * 4
    assert [m["memory/prefetched_bytes"] for m in metrics] == [2 * ref if ref_moves else 0] + [moved] * 3


def test_flagship_resume_after_kill_matches_uninterrupted(runs, run_cli, tmp_path):
    out = tmp_path / "killed"
    killed = run_cli(out, experiment="flagship_cpu", env={"ROLLPLEX_KILL_AT_STEP": "3"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = run_cli(out, experiment="flagship_cpu")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    expected = read_metrics_jsonl(runs["rollplex"] / "metrics.jsonl")[-1]
    got = read_metrics_jsonl(out / "metrics.jsonl")[-1]
    assert got["step"] == expected["step"] == 4
    compared = [k for k in expected if not k.startswith(TELEMETRY)]
    assert len(compared) > 20
    for key in compared:
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
