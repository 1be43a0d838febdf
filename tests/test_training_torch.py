"""The plain-torch training engine on the tiny Qwen2.5-VL: scoring, micro-batch invariance of the
update, frozen vision tower, versions, checkpoint round trip, HF export, KL loss, weight sync."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from rollplex_train.algo.losses import batch_counts, kl_loss
from rollplex_train.config import ActorConfig, AlgorithmConfig, ModelConfig
from rollplex_train.data.types import TrainBatch
from rollplex_train.models.loading import load_model
from rollplex_train.models.sequence import build_full_sequences, response_logprobs
from rollplex_train.rollout.base import SamplingParams
from rollplex_train.rollout.builtin import BuiltinRolloutEngine
from rollplex_train.runtime.batching import to_train_batch
from rollplex_train.training.base import create_train_engine
from rollplex_train.versioning import StaleWeightsError
from rollplex_train.training.torch_engine import TorchTrainEngine

LR = 1e-3  # large enough that one AdamW step moves every trained tensor visibly
N_PER_PROMPT = 2
MAX_NEW_TOKENS = 6


def make_engine(ckpt, *, freeze_vision: bool = False, algorithm: AlgorithmConfig | None = None,
                seed: int = 1, **actor) -> TorchTrainEngine:
    actor.setdefault("lr", LR)
    return TorchTrainEngine(ModelConfig(path=str(ckpt), freeze_vision_tower=freeze_vision), ActorConfig(**actor),
                            algorithm or AlgorithmConfig(), seed=seed)


def _clone(batch: TrainBatch, **fields) -> TrainBatch:
    """A copy of ``batch`` (tensors shared) with some fields replaced."""
    data = dict(prompts=batch.prompts, group_index=batch.group_index, response_ids=batch.response_ids,
                response_mask=batch.response_mask, advantages=batch.advantages, old_logprobs=batch.old_logprobs,
                ref_logprobs=batch.ref_logprobs, rollout_logprobs=batch.rollout_logprobs)
    data.update(fields)
    return TrainBatch(**data)


@pytest.fixture(scope="module")
def rollout_batch(tiny_ckpt_qwen25, mixed_prompts) -> TrainBatch:
    """6 sampled responses (image 56x56, image 112x112, video; n=2), cut to different lengths.

    ``rollout_logprobs`` holds the rollout engine's log-probs; ``advantages`` are fixed random values.
    """
    engine = BuiltinRolloutEngine(str(tiny_ckpt_qwen25))
    responses = engine.generate(mixed_prompts, SamplingParams(n=N_PER_PROMPT, max_new_tokens=MAX_NEW_TOKENS, seed=5))
    batch = to_train_batch(mixed_prompts, responses, engine.pad_id)
    keep = torch.tensor([6, 2, 5, 1, 4, 3])  # real tokens per response: right padding of varied width
    cut = torch.arange(MAX_NEW_TOKENS).view(1, -1) >= keep.view(-1, 1)
    batch.response_ids[cut] = engine.pad_id
    batch.response_mask[cut] = 0.0
    batch.rollout_logprobs[cut] = 0.0
    g = torch.Generator().manual_seed(0)
    batch.advantages = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    return batch


def _with_old(engine: TorchTrainEngine, batch: TrainBatch) -> TrainBatch:
    """The batch with old (and, if the engine has a reference, ref) log-probs from ``engine``."""
    old, _ = engine.compute_log_probs(batch, "actor")
    ref = engine.compute_log_probs(batch, "ref")[0] if engine.ref is not None else None
    return _clone(batch, old_logprobs=old, ref_logprobs=ref)


def _state(engine: TorchTrainEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.actor.state_dict().items()}


def _capture_grads(engine: TorchTrainEngine) -> list[dict[str, torch.Tensor]]:
    """Record the accumulated gradients right before each optimizer step."""
    names = {id(p): n for n, p in engine.actor.named_parameters()}
    steps: list[dict[str, torch.Tensor]] = []

    def hook(optimizer, args, kwargs):
        steps.append({names[id(p)]: p.grad.detach().clone() for group in optimizer.param_groups
                      for p in group["params"] if p.grad is not None})

    engine.backend.optimizer.register_step_pre_hook(hook)
    return steps


# ---- scoring -------------------------------------------------------------------------------------
def test_actor_ref_and_rollout_logprobs_agree(tiny_ckpt_qwen25, rollout_batch):
    engine = make_engine(tiny_ckpt_qwen25, micro_batch_size=4)
    assert engine.ref is not None  # default algorithm: KL loss with kl_coef 0.01
    actor, entropy = engine.compute_log_probs(rollout_batch, "actor", with_entropy=True)
    ref, none = engine.compute_log_probs(rollout_batch, "ref")
    mask = rollout_batch.response_mask
    assert actor.shape == mask.shape and actor.dtype == torch.float32 and none is None
    assert torch.equal(actor, ref)
    assert_close(actor, rollout_batch.rollout_logprobs, atol=1e-5, rtol=0)
    assert torch.all(actor[mask == 0] == 0) and torch.all(actor[mask == 1] < 0)
    # entropy of a ~1.1k-token vocabulary under a random model: positive, at most log(V)
    vocab = engine.actor.config.get_text_config().vocab_size
    assert torch.all(entropy[mask == 0] == 0)
    assert torch.all(entropy[mask == 1] > 0) and torch.all(entropy[mask == 1] <= torch.log(torch.tensor(vocab)))
    # scoring does not depend on the micro-batch split
    single, _ = make_engine(tiny_ckpt_qwen25, micro_batch_size=1).compute_log_probs(rollout_batch, "actor")
    assert_close(single, actor, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="role='critic'"):
        engine.compute_log_probs(rollout_batch, "critic")


def test_registry_builds_torch_engine(tiny_ckpt_qwen25):
    engine = create_train_engine("torch", model=ModelConfig(path=str(tiny_ckpt_qwen25)), actor=ActorConfig(),
                                 algorithm=AlgorithmConfig(kl_coef=0.0))
    assert isinstance(engine, TorchTrainEngine) and engine.weights_version == 0
    with pytest.raises(ValueError, match="actor.backend='jax'"):
        create_train_engine("jax")


# ---- update --------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_update_is_micro_batch_invariant(tiny_ckpt_qwen25, rollout_batch, loss_agg_mode):
    engines = [make_engine(tiny_ckpt_qwen25, micro_batch_size=mb, loss_agg_mode=loss_agg_mode) for mb in (1, 6)]
    init = _state(engines[0])
    batch = _with_old(engines[0], rollout_batch)
    grads = [_capture_grads(e) for e in engines]
    metrics = [e.update_actor(batch) for e in engines]

    # the accumulated gradient of 6 micro-batches of 1 equals that of one micro-batch of 6
    assert len(grads[0]) == len(grads[1]) == 1
    g1, g6 = grads[0][0], grads[1][0]
    assert g1.keys() == g6.keys() and len(g1) == len(list(engines[0].actor.parameters()))
    for name in g1:
        assert float((g1[name] - g6[name]).norm() / g1[name].norm()) < 1e-5, name
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm", "actor/pg_clipfrac"):
        assert metrics[0][key] == pytest.approx(metrics[1][key], rel=1e-5, abs=1e-7), key
    # ratio 1 at the first step: the loss is minus the aggregated advantage
    mask, adv = batch.response_mask, batch.advantages
    expected_pg = {
        "token-mean": -(adv * mask).sum() / mask.sum(),
        "seq-mean-token-mean": -((adv * mask).sum(-1) / mask.sum(-1)).mean(),
        "seq-mean-token-sum": -(adv * mask).sum(-1).mean(),
    }[loss_agg_mode]
    assert metrics[0]["actor/pg_loss"] == pytest.approx(float(expected_pg), rel=1e-5)
    # The weights: AdamW's first step is lr * g / (|g| + eps) per element, which magnifies float noise
    # in elements whose gradient is ~0; the updates agree to 1e-3 of their norm (measured ~1e-4).
    s1, s6 = _state(engines[0]), _state(engines[1])
    diff = sum(float(((s1[k] - s6[k]) ** 2).sum()) for k in s1) ** 0.5
    step = sum(float(((s1[k] - init[k]) ** 2).sum()) for k in s1) ** 0.5
    assert step > 0 and diff / step < 1e-3
    assert max(float((s1[k] - s6[k]).abs().max()) for k in s1) < 0.2 * LR


def test_weights_version_and_required_fields(tiny_ckpt_qwen25, rollout_batch):
    engine = make_engine(tiny_ckpt_qwen25, micro_batch_size=6, algorithm=AlgorithmConfig(kl_coef=0.0))
    with pytest.raises(ValueError, match="advantages and batch.old_logprobs"):
        engine.update_actor(_clone(rollout_batch, old_logprobs=None))
    assert engine.weights_version == 0
    for expected in (1, 2):
        metrics = engine.update_actor(_with_old(engine, rollout_batch))
        assert engine.weights_version == expected
        assert metrics["actor/lr"] == LR


def test_freeze_vision_tower(tiny_ckpt_qwen25, rollout_batch):
    engine = make_engine(tiny_ckpt_qwen25, freeze_vision=True, micro_batch_size=6)
    init = _state(engine)
    trained = {id(p) for p in engine.backend.params}
    for name, p in engine.actor.named_parameters():
        assert (id(p) in trained) == (not name.startswith("model.visual.")), name
    engine.update_actor(_with_old(engine, rollout_batch))
    after = _state(engine)
    vision = [k for k in after if k.startswith("model.visual.")]
    assert vision and any("merger" in k for k in vision)
    for k in after:
        if k in vision:
            assert torch.equal(after[k], init[k]), f"frozen {k} changed"
        else:
            assert not torch.equal(after[k], init[k]), f"trainable {k} did not change"


def test_checkpoint_round_trip_gives_identical_next_update(tiny_ckpt_qwen25, rollout_batch, tmp_path):
    # warm-up of 3 steps: the learning rate differs between steps, so a lost scheduler state shows
    kw = dict(micro_batch_size=3, lr_warmup_steps=3, weight_decay=0.01)
    first = make_engine(tiny_ckpt_qwen25, **kw)
    m1 = first.update_actor(_with_old(first, rollout_batch))
    assert m1["actor/lr"] == pytest.approx(LR * 2 / 3)
    second_batch = _with_old(first, rollout_batch)
    first.save_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["actor.pt", "optim.pt"]
    m2 = first.update_actor(second_batch)

    resumed = make_engine(tiny_ckpt_qwen25, seed=7, **kw)
    resumed.load_checkpoint(tmp_path)
    assert resumed.weights_version == 1
    old, _ = resumed.compute_log_probs(rollout_batch, "actor")
    assert torch.equal(old, second_batch.old_logprobs)
    r2 = resumed.update_actor(second_batch)
    assert resumed.weights_version == 2
    assert r2 == m2
    s_first, s_resumed = _state(first), _state(resumed)
    for k in s_first:
        assert torch.equal(s_first[k], s_resumed[k]), k

    with pytest.raises(FileNotFoundError, match="optim.pt"):
        (tmp_path / "optim.pt").unlink()
        make_engine(tiny_ckpt_qwen25).load_checkpoint(tmp_path)


def test_export_hf_loads_with_same_logprobs(tiny_ckpt_qwen25, rollout_batch, tmp_path):
    engine = make_engine(tiny_ckpt_qwen25, micro_batch_size=6, algorithm=AlgorithmConfig(kl_coef=0.0))
    engine.update_actor(_with_old(engine, rollout_batch))
    expected, _ = engine.compute_log_probs(rollout_batch, "actor")
    assert not torch.allclose(expected, rollout_batch.rollout_logprobs, atol=1e-4)  # the update moved them
    out = tmp_path / "hf_actor"
    engine.export_hf(out)
    assert (out / "config.json").is_file() and (out / "preprocessor_config.json").is_file()
    assert (out / "tokenizer.json").is_file()
    exported = load_model(out)
    b = rollout_batch
    ids, mask, plen, vision = build_full_sequences(b.prompts, b.group_index, b.response_ids, b.response_mask,
                                                   engine.pad_id)
    with torch.no_grad():
        got, _ = response_logprobs(exported, ids, mask, vision, plen, b.response_ids, b.response_mask)
    assert_close(got, expected, atol=1e-6, rtol=0)


def test_rollout_weights_sync_rollout_engine(tiny_ckpt_qwen25, rollout_batch):
    engine = make_engine(tiny_ckpt_qwen25, micro_batch_size=6, algorithm=AlgorithmConfig(kl_coef=0.0))
    engine.update_actor(_with_old(engine, rollout_batch))
    rollout = BuiltinRolloutEngine(str(tiny_ckpt_qwen25))
    rollout.update_weights(engine.rollout_weights(), version=engine.weights_version)
    prompts = rollout_batch.prompts
    responses = rollout.generate(prompts, SamplingParams(n=2, max_new_tokens=4, seed=9), weights_version=1)
    batch = to_train_batch(prompts, responses, rollout.pad_id)
    actor, _ = engine.compute_log_probs(batch, "actor")
    assert_close(actor, batch.rollout_logprobs, atol=1e-5, rtol=0)


# ---- KL ------------------------------------------------------------------------------------------
def test_kl_loss_zero_then_positive(tiny_ckpt_qwen25, rollout_batch):
    algo = AlgorithmConfig(use_kl_loss=True, kl_coef=0.1, kl_estimator="low_var_kl")
    engine = make_engine(tiny_ckpt_qwen25, micro_batch_size=3, algorithm=algo)
    with pytest.raises(ValueError, match="ref_logprobs is missing"):
        engine.update_actor(_clone(_with_old(engine, rollout_batch), ref_logprobs=None))
    first = engine.update_actor(_with_old(engine, rollout_batch))
    assert abs(first["actor/kl_loss"]) < 1e-7  # actor == reference before the first step

    batch = _with_old(engine, rollout_batch)
    assert not torch.equal(batch.old_logprobs, batch.ref_logprobs)
    num_tokens, num_seqs = batch_counts(batch.response_mask)
    expected = kl_loss(batch.old_logprobs, batch.ref_logprobs, batch.response_mask, "low_var_kl", "token-mean",
                       num_tokens=num_tokens, num_seqs=num_seqs)
    second = engine.update_actor(batch)
    assert second["actor/kl_loss"] > 1e-6
    assert second["actor/kl_loss"] == pytest.approx(float(expected), rel=1e-4)
    # the reference stays frozen at the checkpoint
    ref, _ = engine.compute_log_probs(rollout_batch, "ref")
    assert_close(ref, rollout_batch.rollout_logprobs, atol=1e-5, rtol=0)


def test_no_reference_without_kl(tiny_ckpt_qwen25, rollout_batch):
    engine = make_engine(tiny_ckpt_qwen25, micro_batch_size=6,
                         algorithm=AlgorithmConfig(use_kl_loss=True, kl_coef=0.0))
    assert engine.ref is None
    with pytest.raises(ValueError, match="reference log-probs requested"):
        engine.compute_log_probs(rollout_batch, "ref")
    metrics = engine.update_actor(_with_old(engine, rollout_batch))  # no ref_logprobs needed
    assert metrics["actor/kl_loss"] == 0.0 and engine.weights_version == 1


@pytest.mark.parametrize("freeze_vision", [False, True])
def test_shared_prefix_engine_matches_full_sequence(tiny_ckpt_qwen25, rollout_batch, freeze_vision):
    """model.shared_prefix=true: same log-probs, same gradients, prefix states freed after use."""
    algo = AlgorithmConfig(use_kl_loss=True, kl_coef=0.1)
    engines = {}
    for shared in (False, True):
        engine = TorchTrainEngine(
            ModelConfig(path=str(tiny_ckpt_qwen25), freeze_vision_tower=freeze_vision, shared_prefix=shared),
            ActorConfig(lr=LR, micro_batch_size=3), algo, seed=1)
        engines[shared] = engine
    full, split = engines[False], engines[True]
    for role in ("actor", "ref"):
        assert_close(split.compute_log_probs(rollout_batch, role)[0], full.compute_log_probs(rollout_batch, role)[0],
                     atol=1e-5, rtol=0)
    batch = _with_old(full, rollout_batch)
    grads = {}
    for shared, engine in engines.items():
        captured = _capture_grads(engine)
        metrics = engine.update_actor(batch)
        grads[shared] = (captured[0], metrics)
        assert len(engine.prefixes) == 0 and engine.prefixes.bytes_held == 0  # freed after the last consumer
    (g_full, m_full), (g_split, m_split) = grads[False], grads[True]
    assert g_full.keys() == g_split.keys()
    for name, g in g_full.items():
        assert float((g - g_split[name]).norm() / g.norm().clamp(min=1e-12)) <= 1e-4, name
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy"):
        assert m_split[key] == pytest.approx(m_full[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("mini,micro", [(1, 4), (3, 2)])
def test_precomputed_prefixes_give_the_same_step(tiny_ckpt_qwen25, rollout_batch, mini, micro):
    """Prefix tasks run ahead (the decode-window work) change nothing in the results — also when
    one batched actor-prefix call spans several micro-batches (its graph is shared by them)."""
    algo = AlgorithmConfig(use_kl_loss=True, kl_coef=0.1)
    engines = [TorchTrainEngine(ModelConfig(path=str(tiny_ckpt_qwen25), shared_prefix=True),
                                ActorConfig(lr=LR, micro_batch_size=micro, ppo_mini_batch_size=mini), algo, seed=1)
               for _ in range(2)]
    plain, ahead = engines
    with pytest.raises(StaleWeightsError):
        ahead.precompute_prefixes(rollout_batch.prompts, ["old"], weights_version=1)
    first_mini = rollout_batch.prompts[:mini]  # only the first mini-batch's actor prefixes may run ahead
    info = ahead.precompute_prefixes(rollout_batch.prompts, ["old", "ref"], weights_version=0)
    ahead.precompute_prefixes(first_mini, ["actor"], weights_version=0)
    assert info.metrics["prefix/num_states"] == 6 and len(ahead.prefixes) == 6 + mini
    results = []
    for engine in engines:
        old, _ = engine.compute_log_probs(rollout_batch, "actor")
        ref, _ = engine.compute_log_probs(rollout_batch, "ref")
        metrics = engine.update_actor(_clone(rollout_batch, old_logprobs=old, ref_logprobs=ref))
        results.append((old, ref, metrics, _state(engine)))
        assert len(engine.prefixes) == 0
    (old_a, ref_a, m_a, w_a), (old_b, ref_b, m_b, w_b) = results
    assert_close(old_b, old_a, atol=1e-6, rtol=0)
    assert_close(ref_b, ref_a, atol=1e-6, rtol=0)
    assert m_b["actor/pg_loss"] == pytest.approx(m_a["actor/pg_loss"], rel=1e-5, abs=1e-7)
    # AdamW's first step moves an element by lr * g / (|g| + 1e-8): where |g| ~ 1e-9 (median ~1e-5),
    # the float noise between batched and per-micro-batch prefix passes (~1e-10 in g) becomes up to
    # ~2e-5 in the weight at lr 1e-3 (measured); a real discrepancy moves weights by ~lr.
    for name, value in w_a.items():
        assert_close(w_b[name], value, atol=1e-5, rtol=0)


def _stitched_log_probs(engine: TorchTrainEngine, batch: TrainBatch, role: str, calls: list[list[int]]):
    """Log-probs of ``batch`` assembled from one call per group list (as a decode tail scores the
    groups finished so far, with groups renumbered per call)."""
    out = torch.zeros(batch.response_mask.shape)
    for groups in calls:
        part = batch.select_groups(groups)
        logp, _ = engine.compute_log_probs(part, role)
        out[batch.rows_of(groups), : logp.shape[1]] = logp
    return out


def test_shared_prefix_results_do_not_depend_on_placement(tiny_ckpt_qwen25, rollout_batch):
    """Under model.shared_prefix the numbers are bit-identical whichever calls the schedule uses:
    prefixes precomputed in any grouping and order, suffixes scored in subsets (the decode tail) or
    all at once, log-probs, metrics and updated weights all equal exactly. (At another torch thread
    count the video prompt's vision tower rounds differently, by 4.8e-7 in a log-prob here: the
    thread count is not part of this guarantee.)"""
    algo = AlgorithmConfig(use_kl_loss=True, kl_coef=0.1)
    actor = ActorConfig(lr=LR, micro_batch_size=4, ppo_mini_batch_size=2)
    engines = [TorchTrainEngine(ModelConfig(path=str(tiny_ckpt_qwen25), shared_prefix=True), actor, algo, seed=1)
               for _ in range(2)]
    plain, placed = engines
    threads = torch.get_num_threads()
    results = []
    try:
        # plain: everything in one call per phase, on this test's thread count
        old, _ = plain.compute_log_probs(rollout_batch, "actor")
        ref, _ = plain.compute_log_probs(rollout_batch, "ref")
        metrics = plain.update_actor(_clone(rollout_batch, old_logprobs=old, ref_logprobs=ref))
        results.append((old, ref, metrics, _state(plain)))
        # placed: window prefix tasks in another grouping/order, suffixes in subsets
        prompts = rollout_batch.prompts
        placed.precompute_prefixes([prompts[2], prompts[0]], ["ref"], weights_version=0)
        placed.precompute_prefixes([prompts[1]], ["old"], weights_version=0)
        placed.precompute_prefixes([prompts[1], prompts[0]], ["actor"], weights_version=0)
        old = _stitched_log_probs(placed, rollout_batch, "actor", [[2], [1, 0]])
        ref = _stitched_log_probs(placed, rollout_batch, "ref", [[0, 2], [1]])
        metrics = placed.update_actor(_clone(rollout_batch, old_logprobs=old, ref_logprobs=ref))
        results.append((old, ref, metrics, _state(placed)))
    finally:
        torch.set_num_threads(threads)
    (old_a, ref_a, m_a, w_a), (old_b, ref_b, m_b, w_b) = results
    assert torch.equal(old_b, old_a) and torch.equal(ref_b, ref_a)
    assert m_b == m_a
    assert all(torch.equal(w_b[name], value) for name, value in w_a.items())
    assert len(placed.prefixes) == 0
