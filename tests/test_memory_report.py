"""``rollplex-plan memory`` on the shipped experiments: the acceptance line and the per-phase table."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from rollplex_train.cli import conf_dir
from rollplex_train.config import hydra_version_base, register_configs, to_config
from rollplex_train.memory.groups import step_groups
from rollplex_train.memory.report import report
from rollplex_train.models.arch import load_hf_config
from rollplex_train.sharing.report import configured_device_totals, rebuilt_bytes_per_device

LAST = re.compile(r"^memory: naive_colocation=([\d.]+)GiB serial_offload=([\d.]+)GiB rollplex=([\d.]+)GiB "
                  r"budget=(\d+)GiB(?: short=([\d.]+)GiB)?$")
ROOT = Path(__file__).resolve().parents[1]


def _config(*overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), **hydra_version_base()):
        return to_config(compose(config_name="config", overrides=["trainer.output_dir=/tmp/unused", *overrides]))


def _group_gib(text: str, name: str) -> float:
    return float(re.search(rf"^{name}\s+([\d.]+)\s", text, re.M).group(1))


def test_32b_embodied_acceptance_line():
    text = report(_config("+experiment=qwen25vl32b_embodied"))
    match = LAST.match(text.rstrip("\n").splitlines()[-1])
    assert match, text.splitlines()[-1]
    assert match.group(5) is None, text.splitlines()[-1]  # no shortfall: the plan fits
    naive, serial, rollplex, budget = map(float, match.groups()[:4])
    # SGLang keeps one copy of a prompt's KV for its 8 samples (radix cache): the rollout KV cache is
    # 16 prompts x 4608 + 128 responses x 1024 tokens x 64 KiB = 12.5 GiB per GPU (was 44 GiB, one cache per sequence)
    assert _group_gib(text, "rollout_kv") == 12.5 and "SGLang's radix cache" in text
    assert naive == pytest.approx(127.1, abs=0.05)
    # the decode window at its least: actor 15.58 + master 3.90 + ref 15.58 + rebuilt 1.09 + KV 12.50 + prefix
    # states (held whole, nothing streams them) 17.13 + scratch 0.89 + reserve 3.50 = 70.17 GiB, within 80 GiB;
    # the plan keeps the Adam states resident too where the budget allows: 78.0 GiB
    assert budget == 80 and rollplex == pytest.approx(78.0, abs=0.05)
    assert "does not fit" not in text
    assert serial < rollplex <= budget < naive
    for phase in ("rollout_decode", "old_log_prob", "ref_log_prob", "actor_update", "optimizer_step", "weight_sync"):
        assert re.search(rf"^{phase}\s+127\.1\s", text, re.M), phase
    assert "TP=4 PP=1 DP=8" in text and "map the actor's" in text
    assert (_group_gib(text, "rollout_weights"), _group_gib(text, "rollout_rebuilt")) == (0.0, 1.1)
    assert _group_gib(text, "runtime_reserved") == 3.5


def test_32b_fits_80_gib_without_the_reserve():
    text = report(_config("+experiment=qwen25vl32b_embodied", "memory.reserved_gib=0"))
    naive, _, rollplex, budget, short = LAST.match(text.splitlines()[-1]).groups()
    assert short is None and float(rollplex) <= float(budget) == 80 and float(naive) == pytest.approx(123.6, abs=0.05)
    assert "does not fit" not in text


def test_rebuilt_buffers_are_the_share_plans_rebuilt_bytes():
    config = _config("+experiment=qwen25vl32b_embodied")
    hf = load_hf_config(config.model)
    per_device = configured_device_totals(config, hf)
    groups = {g.name: g for g in step_groups(config, hf, "rollplex")}
    rollout = sum(per_device[0][a] for a in ("view", "strided_view", "local_rebuild", "gather"))
    assert groups["rollout_rebuilt"].nbytes == rebuilt_bytes_per_device(per_device) == per_device[0]["local_rebuild"]
    assert groups["rollout_rebuilt"].nbytes / rollout == pytest.approx(0.070, abs=0.0005)  # 7.0% in rollplex-plan sharing
    assert groups["runtime_reserved"].nbytes == int(3.5 * 2**30) and groups["rollout_weights"].nbytes == 0
    # the rollout tensors that are views cost nothing: the split options make every one a view
    split = _config("+experiment=qwen25vl32b_embodied", "sharing.split_qkv=true", "sharing.split_gate_up=true")
    assert {g.name: g for g in step_groups(split, hf, "rollplex")}["rollout_rebuilt"].nbytes == 0
    # rollout TP 8 over training TP 4: a rollout rank is half a training shard, 55.5% of it rebuilt
    r8 = _config("+experiment=qwen25vl32b_embodied", "rollout.tensor_parallel_size=8")
    r8_groups = {g.name: g for g in step_groups(r8, hf, "rollplex")}
    r8_totals = configured_device_totals(r8, hf)
    assert r8_groups["rollout_rebuilt"].nbytes == rebuilt_bytes_per_device(r8_totals) > 0
    r8_rollout = sum(r8_totals[0][a] for a in ("view", "strided_view", "local_rebuild", "gather"))
    assert r8_groups["rollout_rebuilt"].nbytes / r8_rollout == pytest.approx(0.555, abs=0.001)
    # FSDP's flat shards are not a TP layout: the rollout keeps a copy, nothing is rebuilt
    fsdp = {g.name: g for g in step_groups(_config("+experiment=qwen25vl32b_embodied", "memory.train_strategy=fsdp"),
                                           hf, "rollplex")}
    assert fsdp["rollout_rebuilt"].nbytes == 0 and fsdp["rollout_weights"].nbytes == groups["actor_weights"].nbytes


def test_7b_geo3k_fits_and_fsdp_has_no_views():
    text = report(_config("+experiment=qwen25vl7b_geo3k"))
    naive, _, rollplex, budget, short = LAST.match(text.splitlines()[-1]).groups()
    assert short is None and float(rollplex) <= float(budget) == 80 < float(naive)
    assert "fsdp" in text and "rollout weights are a separate copy" in text


def test_small_budget_says_the_phase_and_shortfall():
    # decode needs at least 70.17 GiB (test above): 10.17 GiB short of a 60 GiB budget
    text = report(_config("+experiment=qwen25vl32b_embodied", "memory.budget_gib=60"))
    assert "rollplex does not fit the 60 GiB budget: rollout_decode needs at least 70.2 GiB, short by 10.17 GiB" in text
    assert LAST.match(text.splitlines()[-1]).group(5) == "10.17"


def test_cli_prints_the_report():
    cli = Path(sys.executable).parent / "rollplex-plan"
    out = subprocess.run([str(cli), "memory", "+experiment=qwen25vl32b_embodied"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert LAST.match(out.stdout.rstrip("\n").splitlines()[-1])
