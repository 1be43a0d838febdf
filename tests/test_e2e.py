"""End to end through the CLI: Hydra -> local Ray cluster -> workers -> metrics/checkpoints/export.

These runs use the embedded assets (`make assets`: the generated tasks and the format-warmed tiny
checkpoint under artifacts/), built here if missing, exactly as `make run` uses them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import trained_metric_keys
from rollplex_train.tracking.loggers import read_metrics_jsonl

pytestmark = pytest.mark.slow

# A user reward that raises or returns NaN on some answers (scored 0 and counted, the run goes on).
FLAKY_REWARD = '''
from rollplex_train.algo.rewards import auto_reward

def flaky(response, ground_truth, options=None):
    if ground_truth in ("red", "green", "left", "right", "1", "2"):
        raise RuntimeError("boom on " + ground_truth)
    if ground_truth in ("blue", "up", "3"):
        return float("nan")
    return auto_reward(response, ground_truth, options=options)
'''


def _short_run_overrides(reward_file: Path) -> list[str]:
    return [
        "trainer.total_steps=3", "trainer.save_freq=1", "trainer.val_freq=3", "trainer.val_before_train=false",
        "data.rollout_batch_size=4", "rollout.n=4", "data.max_val_samples=8",
        f"reward.function={reward_file}:flaky",
        # an entropy bonus moves the actor even when every group of a step scores alike (the flaky
        # reward zeroes most groups), so "the actor has moved" does not depend on the samples
        "actor.entropy_coeff=0.01",
    ]


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("reward") / "flaky_reward.py"
    path.write_text(FLAKY_REWARD)
    return path


@pytest.fixture(scope="module")
def uninterrupted(embedded_assets, run_cli, reward_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "uninterrupted"
    proc = run_cli(out, *_short_run_overrides(reward_file))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, proc


def test_run_writes_metrics_checkpoint_events_and_export(uninterrupted, embedded_assets):
    out, proc = uninterrupted
    _, ckpt = embedded_assets
    records = read_metrics_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in ("timing_s/gen", "timing_s/old_log_prob", "timing_s/ref", "timing_s/update_actor",
                "timing_s/update_weights", "timing_s/step", "perf/throughput", "critic/score/mean",
                "actor/kl_loss", "actor/pg_clipfrac", "actor/entropy", "actor/grad_norm",
                "response_length/mean", "data/skipped"):
        assert all(math.isfinite(r[key]) for r in records), key
    assert records[-1]["actor/weights_version"] == 3
    assert records[0]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7)  # actor == reference at step 1
    assert records[-1]["actor/kl_loss"] > 0  # after two updates the actor has moved
    assert 0.0 <= records[-1]["val/accuracy"] <= 1.0
    # the flaky reward: failures are scored 0, counted, and named in a warning with the sample id
    assert sum(r["reward/failed"] for r in records) > 0
    logs = proc.stdout + proc.stderr
    assert "boom on" in logs and "returned nan" in logs and "uid=train:" in logs
    # checkpoints (atomic dirs + pointer), tensorboard events, HF export
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert (out / "checkpoints" / "global_step_3" / "actor.pt").is_file()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    from transformers import AutoModelForImageTextToText

    exported = AutoModelForImageTextToText.from_pretrained(out / "hf_actor")
    initial = AutoModelForImageTextToText.from_pretrained(ckpt)
    saved = torch.load(out / "checkpoints" / "global_step_3" / "actor.pt", weights_only=True)
    name = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(exported.state_dict()[name], saved[name])
    assert not torch.equal(exported.state_dict()[name], initial.state_dict()[name])


def test_resume_after_kill_matches_uninterrupted(uninterrupted, run_cli, reward_file, tmp_path):
    ref_out, _ = uninterrupted
    out = tmp_path / "killed"
    killed = run_cli(out, *_short_run_overrides(reward_file), env={"ROLLPLEX_KILL_AT_STEP": "3"})
    assert killed.returncode == -9, killed.stderr[-2000:]  # SIGKILL at the start of step 3
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    # as if the killed run had logged step 3 after its last checkpoint: the resume drops it
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "critic/score/mean": 123.0}) + "\n")
    resumed = run_cli(out, *_short_run_overrides(reward_file))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    # one history: each step once in metrics.jsonl, one wandb run id across both processes
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3] and lines[-1]["critic/score/mean"] != 123.0
    run_id = json.loads((out / "checkpoints" / "global_step_3" / "trainer_state.json").read_text())["wandb_run_id"]
    wandb_runs = list((out / "wandb" / "wandb").glob("offline-run-*"))
    assert run_id and len(wandb_runs) == 2 and all(f"-{run_id}" in p.name for p in wandb_runs)
    expected = read_metrics_jsonl(ref_out / "metrics.jsonl")[-1]
    got = read_metrics_jsonl(out / "metrics.jsonl")[-1]
    assert got["step"] == expected["step"] == 3
    # Training results must match. The rollplex planner's telemetry does not (measured times); the
    # placement itself no longer changes numbers (tests/test_e2e_reproducible.py checks bit equality).
    compared = trained_metric_keys(expected)
    assert len(compared) > 20
    for key in compared:
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    # the planner's calibration is checkpointed: the resumed step is placed as the uninterrupted one
    for key in ("planner/profiling", "planner/decode_share", "planner/train_share"):
        assert got[key] == expected[key], key


def test_missing_column_fails_before_any_worker_starts(embedded_assets, run_cli, tmp_path):
    import pyarrow.parquet as pq

    tasks, _ = embedded_assets
    table = pq.read_table(tasks / "color_val.parquet").drop(["answer"])
    bad = tmp_path / "no_answer.parquet"
    pq.write_table(table, bad)
    out = tmp_path / "run"
    proc = run_cli(out, f"data.train_files={bad}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr  # one line, not Hydra's traceback
    assert "no_answer.parquet" in proc.stderr and "'answer'" in proc.stderr
    assert not (out / "ray").exists()  # failed before Ray (and any worker) started


def test_schedules_give_the_same_training_result(embedded_assets, run_cli, tmp_path):
    """Synchronous semantics: moving prefix work into decode (rollplex) or splitting the cores
    (disaggregated) changes no result over 3 steps; the rollplex step trace opens as Chrome JSON.
    The schedules run on the in-process executor (no Ray: the same worker groups in the driver)."""
    common = ["cluster.executor=inprocess", "trainer.save_freq=3", "trainer.val_freq=0", "trainer.val_before_train=false",
              "data.rollout_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2", "model.shared_prefix=true",
              "trainer.loggers=[jsonl]", "trainer.rollout_data_dir=rollouts",
              # hot sampling: responses of varied length, so groups finish at different decode steps
              "rollout.temperature=1.5"]
    runs = {}
    variants = {"serial": [], "disaggregated": [], "rollplex": [],
                "rollplex+offload": ["memory.offload_optimizer=true"],  # optimizer states to host and back
                # no prefix state may stay alive: the window is empty and the decode tail scores the
                # suffixes of finished groups beside the groups still decoding
                "rollplex+tail": ["schedule.prefix_memory_gib=0"],
                # nothing fits the window and no tail can form (every response runs to
                # max_new_tokens): after profiling, the step is the serial schedule's own
                "serial+ignore_eos": ["rollout.ignore_eos=true"],
                "rollplex+serial_step": ["schedule.prefix_memory_gib=0", "rollout.ignore_eos=true"],
                # reference suffix chunks of 4 tokens beside the decode (the calibration step 3)
                "rollplex+chunks": ["rollout.ignore_eos=true", "schedule.suffix_chunk_tokens=4"]}
    for schedule, extra in variants.items():
        out = tmp_path / schedule
        steps = 4 if schedule.endswith(("ignore_eos", "serial_step", "chunks")) else 3  # planned from step 4
        proc = run_cli(out, *common, f"schedule={schedule.split('+')[0]}", f"trainer.total_steps={steps}",
                       f"trainer.trace_steps=[{steps}]", *extra)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[schedule] = (read_metrics_jsonl(out / "metrics.jsonl"),
                          torch.load(out / "checkpoints" / f"global_step_{steps}" / "actor.pt", weights_only=True))
    serial, w_serial = runs["serial"]
    # the residency plan (memory/executor.py): the Adam states leave the device after each update and come
    # back for the next one (none exist before step 1's update: nothing to prefetch then)
    offloaded = [r["memory/offloaded_bytes"] for r in runs["rollplex+offload"][0]]
    prefetched = [r["memory/prefetched_bytes"] for r in runs["rollplex+offload"][0]]
    assert offloaded[0] > 0 and offloaded == [offloaded[0]] * 3 and prefetched == [0.0] + offloaded[1:]
    def rollouts(schedule: str, step: int) -> list[dict]:
        return [json.loads(line) for line in (tmp_path / schedule / "rollouts" / f"{step}.jsonl").read_text().splitlines()]

    for schedule in ("disaggregated", "rollplex", "rollplex+offload", "rollplex+tail"):
        for step in (1, 2, 3):  # identical response tokens, rewards within 1e-6
            a, b = rollouts("serial", step), rollouts(schedule, step)
            assert [r["token_ids"] for r in b] == [r["token_ids"] for r in a], (schedule, step)
            assert [r["score"] for r in b] == pytest.approx([r["score"] for r in a], abs=1e-6)
        other, w_other = runs[schedule]
        for a, b in zip(serial, other):
            for key in ("critic/score/mean", "reward/accuracy", "response_length/mean", "response_length/max"):
                assert b[key] == pytest.approx(a[key], abs=1e-6), (schedule, a["step"], key)
        for name, value in w_serial.items():
            assert (w_other[name] - value).abs().max() <= 1e-5, (schedule, name)
    same = runs["serial+ignore_eos"][1]
    for variant in ("rollplex+serial_step", "rollplex+chunks"):
        for name, value in runs[variant][1].items():
            assert (same[name] - value).abs().max() <= 1e-5, (variant, name)
    chunked = runs["rollplex+chunks"][0]
    assert chunked[2]["rollplex/suffix_chunks"] > 0 and chunked[2]["rollplex/suffix_chunks_s"] > 0
    assert chunked[2]["timing_s/ref"] < runs["serial+ignore_eos"][0][2]["timing_s/ref"]  # only the last chunks left
    # the chunks' baseline is the one-call pass, measured on the whole device in the steps without
    # chunks (the reference phase of steps 1-2), a separate kind from the chunks (both thread counts)
    state = json.loads((tmp_path / "rollplex+chunks" / "checkpoints" / "global_step_4" / "trainer_state.json").read_text())
    cost = state["schedule"]["cost"]
    whole = max(cost["rates"]["chunk/ref"], key=int)
    assert set(cost["rates"]["suffix/ref"]) == {whole} and len(cost["rates"]["chunk/ref"]) == 2
    counts = {(kind, threads): n for kind, threads, n in cost["counts"]}
    assert cost["rates"]["suffix/ref"][whole] > 0 and counts[("suffix/ref", int(whole))] in (2, 3)  # steps 1-2 (+4)
    fallback = runs["rollplex+serial_step"][0]
    # steps 1-2 measure the prefixes on the whole device; step 3 would split an empty window
    assert [r["rollplex/serial_step"] for r in fallback] == [0.0, 0.0, 1.0, 1.0]
    assert [r["rollplex/serial_step"] for r in runs["rollplex"][0]] == [0.0, 0.0, 0.0]
    trace = json.loads((tmp_path / "rollplex+serial_step" / "traces" / "step_4.json").read_text())
    assert not {"prefix_after", "reshare"} & {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    # the decode tail: some group finished decoding before the last one (sampling is seeded per
    # sequence, so this holds for every run of this command), and its suffixes were scored beside
    # the decode (the same results as above)
    lengths: dict[str, int] = {}
    for r in rollouts("rollplex+tail", 3):
        lengths[r["uid"]] = max(lengths.get(r["uid"], 0), len(r["token_ids"]))
    assert len(set(lengths.values())) > 1, f"step 3's groups all ended together ({lengths}): no decode tail to test"
    assert runs["rollplex+tail"][0][2]["rollplex/tail_groups"] > 0
    rollplex = runs["rollplex"][0]  # steps 1-2 profile serially, step 3 at the even split
    assert [r["planner/profiling"] for r in rollplex] == [1.0, 1.0, 1.0]
    assert [r["planner/train_share"] for r in rollplex] == [0.0, 0.0, 1.0]
    assert rollplex[0]["rollplex/prefix_hidden_frac"] == 0.0 and rollplex[2]["rollplex/prefix_hidden_frac"] > 0.0
    trace = json.loads((tmp_path / "rollplex" / "traces" / "step_3.json").read_text())
    rows = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    slices = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert rows == {"driver", "rollout", "train"}
    assert {"gen", "reshare", "prefix(old)", "prefix(ref)", "prefix(actor)", "old_log_prob", "update_actor",
            "prefix_before"} <= slices
    # the first mini-batch's actor prefixes (2 groups) were encoded before decode and the rollout
    # decoded from their KV caches (the same tokens as the serial run's own prefill, above); with no
    # prefix state allowed across decode, the rollout prefilled every prompt itself
    assert [r["rollplex/prefill_from_actor_groups"] for r in rollplex] == [2.0, 2.0, 2.0]
    assert [r["rollplex/prefill_from_actor_groups"] for r in runs["rollplex+tail"][0]] == [0.0, 0.0, 0.0]
