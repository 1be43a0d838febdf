"""The residency plan the run executes (``memory/step_plan.py``, ``memory/executor.py``) and the
in-place storage offload the rollout engine's weights use (``memory/offload.StorageOffload``)."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir

from rollplex_train.cli import conf_dir
from rollplex_train.config import hydra_version_base, register_configs, to_config
from rollplex_train.memory.executor import PhaseResidency
from rollplex_train.memory.offload import StorageOffload
from rollplex_train.memory.step_plan import max_rel_err, plan_rows, row


def _config(*overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), **hydra_version_base()):
        return to_config(compose(config_name="config", overrides=["trainer.output_dir=/tmp/unused", *overrides]))


def test_flagship_plan_moves_the_adam_states_and_the_reference(embedded_assets):
    residency = PhaseResidency.from_config(_config("+experiment=flagship_cpu"))
    # Megatron's parameters live in DDP's buffers and the rollout maps them: they never move; the
    # rollout's weights are views (0 bytes of its own), so the engines move the Adam states and the reference
    assert sorted(residency.moving) == ["optimizer_states", "ref_weights"]
    expected = {"rollout_decode": (False, True), "old_log_prob": (False, True), "ref_log_prob": (False, True),
                "actor_update": (True, False), "weight_sync": (False, True)}
    for phase, (adam, ref) in expected.items():
        assert residency.resident(phase) == {"optimizer_states": adam, "ref_weights": ref}, phase
    rows = residency.rows
    adam = rows[row("actor_update", "optimizer_states")][0]
    assert adam > 0 and rows[row("optimizer_step", "optimizer_states")][0] == adam
    assert rows[row("rollout_decode", "optimizer_states")] == (0.0, "exact")  # memory.offload_optimizer
    assert rows[row("actor_update", "ref_weights")] == (0.0, "exact")  # memory.budget_gib=0.019
    assert rows[row("rollout_decode", "old_prefix_kv")][1] == "at_most"


def test_plan_that_cannot_fit_a_set_budget_is_refused(embedded_assets):
    with pytest.raises(ValueError, match=r"memory.budget_gib=0.001: the residency plan needs at least .* GiB per "
                                         r"device in optimizer_step"):
        PhaseResidency.from_config(_config("+experiment=flagship_cpu", "memory.budget_gib=0.001"))


def test_max_rel_err_reads_exact_rows_and_bounds():
    planned = {"memory/a/x_gib": (2.0, "exact"), "memory/a/y_gib": (0.0, "exact"), "memory/a/z_gib": (1.0, "at_most")}
    err, broken = max_rel_err(planned, {"memory/a/x_gib": 2.1, "memory/a/y_gib": 0.0, "memory/a/z_gib": 0.5})
    assert err == pytest.approx(0.05) and broken == []
    err, broken = max_rel_err(planned, {"memory/a/x_gib": 2.0, "memory/a/y_gib": 1e-9, "memory/a/z_gib": 1.5})
    assert err == float("inf") and broken == ["memory/a/z_gib: 1.5 GiB measured, at most 1 planned"]
    assert max_rel_err(planned, {})[1] == [f"{n}: not measured" for n in planned]


def test_storage_offload_keeps_views_and_bytes():
    fused = torch.arange(12, dtype=torch.float32)
    q, kv = fused[:4].view(2, 2), fused[4:]  # the TP rank's [q; k; v]: views of one storage
    other = torch.ones(3)
    move = StorageOffload([q, kv, other, fused])
    assert move.offload() == 12 * 4 + 3 * 4  # each storage once
    assert fused.untyped_storage().nbytes() == 0 and other.untyped_storage().nbytes() == 0
    assert move.offload() == 0  # already away
    assert move.onload() == 60 and move.onload() == 0
    assert torch.equal(fused, torch.arange(12, dtype=torch.float32)) and torch.equal(other, torch.ones(3))
    q[0, 0] = -1.0  # still views of the same storage
    assert fused[0] == -1.0 and kv.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()


def test_plan_rows_name_every_phase_of_the_measured_groups(embedded_assets):
    from rollplex_train.memory.step_plan import run_plan
    from rollplex_train.models.arch import load_hf_config

    cfg = _config("+experiment=flagship_cpu")
    rows = plan_rows(run_plan(cfg, load_hf_config(cfg.model)))
    phases = ("rollout_decode", "old_log_prob", "ref_log_prob", "actor_update", "optimizer_step", "weight_sync")
    for group in ("actor_weights", "optimizer_states", "ref_weights", "grads"):
        assert all(row(p, group) in rows for p in phases), group
    assert rows[row("rollout_decode", "rollout_kv")][0] > 0
    # t = r = 2: every rollout tensor is a view, nothing rebuilt, no copy of its own
    assert row("rollout_decode", "rollout_rebuilt") not in rows and row("rollout_decode", "rollout_weights") not in rows


def test_storage_offload_makes_a_mapped_storage_resizable():
    weight = torch.nn.Parameter(torch.frombuffer(bytearray(range(16)), dtype=torch.float32))  # not resizable
    values = weight.detach().clone()
    move = StorageOffload([weight])
    assert weight.untyped_storage().resizable() and weight.requires_grad
    assert move.offload() == 16 and weight.untyped_storage().nbytes() == 0
    assert move.onload() == 16 and torch.equal(weight.detach(), values)
