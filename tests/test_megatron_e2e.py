"""The Megatron backend end to end through the CLI (Hydra -> Ray -> worker groups) on two CPU
devices: 3 steps at TP=2, its weights shared in place with one built-in rollout engine at TP=2
(SGLang-layout tensors per rollout rank, t=2 -> r=2) and its Adam states offloaded between updates,
end with the weights of the torch backend (DP=2 on the same devices, rollout TP=1, pickled weight
sync), and a killed TP=2 run resumes to the uninterrupted run's step 3."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollplex_train.tracking.loggers import read_metrics_jsonl

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")
pytestmark = [pytest.mark.slow, pytest.mark.megatron]

SHORT = ["trainer.total_steps=3", "trainer.save_freq=1", "trainer.val_freq=0", "trainer.val_before_train=false",
         "data.rollout_batch_size=4", "rollout.n=4", "cluster.devices_per_node=2", "cluster.threads_per_device=1"]
TP = {"torch": ["sharing.enabled=false"],
      "megatron": ["actor.tensor_parallel_size=2", "rollout.tensor_parallel_size=2", "sharing.enabled=true",
                   "memory.offload_optimizer=true"]}
# planner telemetry and timings differ between runs; training results must not
TELEMETRY = ("timing_s/", "perf/throughput", "planner/", "rollplex/", "cost/", "prefix/", "sharing/", "memory/")


@pytest.fixture(scope="module")
def runs(embedded_assets, run_cli, tmp_path_factory) -> dict[str, Path]:
    out = {}
    for backend in ("torch", "megatron"):
        path = tmp_path_factory.mktemp(backend) / "run"
        proc = run_cli(path, *SHORT, f"actor.backend={backend}", *TP[backend])
        assert proc.returncode == 0, proc.stderr[-4000:]
        out[backend] = path
    return out


def test_three_steps_give_the_torch_backends_weights(runs):
    from safetensors.torch import load_file

    ours = load_file(str(runs["megatron"] / "hf_actor" / "model.safetensors"))
    ref = load_file(str(runs["torch"] / "hf_actor" / "model.safetensors"))
    assert ours.keys() == ref.keys()
    assert max(float((ours[k] - ref[k]).abs().max()) for k in ref) <= 1e-4
    for got, expected in zip(read_metrics_jsonl(runs["megatron"] / "metrics.jsonl"),
                             read_metrics_jsonl(runs["torch"] / "metrics.jsonl")):
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/score/mean"):
            assert got[key] == pytest.approx(expected[key], rel=1e-3, abs=1e-5), (got["step"], key)
        # shared in place: the views of the t=2 -> r=2 plan (0.86 on the tiny model), [q;k;v] rebuilt at each sync
        assert 0.5 < got["sharing/shared_bytes_frac"] < 1 and got["sharing/copied_bytes"] > 0
        assert expected["sharing/shared_bytes_frac"] == 0
        # the Adam states left the device for the step's rollout and came back whole (none exist before step 1's update)
        assert got["memory/offloaded_bytes"] == got["memory/prefetched_bytes"]
        assert (got["memory/offloaded_bytes"] > 0) == (got["step"] > 1)


def test_megatron_resume_after_kill_matches_uninterrupted(runs, run_cli, tmp_path):
    out = tmp_path / "killed"
    killed = run_cli(out, *SHORT, "actor.backend=megatron", *TP["megatron"], env={"ROLLPLEX_KILL_AT_STEP": "3"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = run_cli(out, *SHORT, "actor.backend=megatron", *TP["megatron"])
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    expected = read_metrics_jsonl(runs["megatron"] / "metrics.jsonl")[-1]
    got = read_metrics_jsonl(out / "metrics.jsonl")[-1]
    assert got["step"] == expected["step"] == 3
    compared = [k for k in expected if not k.startswith(TELEMETRY)]
    assert len(compared) > 20
    for key in compared:
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
