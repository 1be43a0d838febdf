"""The built-in rollout engine at tensor-parallel degree 2 (two gloo processes) against degree 1, on
the per-rank tensors of the ``sglang`` layout (tiny Qwen2.5-VL, image and video prompts)."""

from __future__ import annotations

import socket
import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollplex_train.models.loading import load_model
from rollplex_train.models.prefix import encode_prefix
from rollplex_train.rollout.base import SamplingParams, StaleWeightsError
from rollplex_train.rollout.builtin import BuiltinRolloutEngine
from rollplex_train.rollout.tensor_parallel import (
    RankLayout,
    TPGroup,
    VocabParallelEmbedding,
    VocabParallelHead,
    new_process_group,
)
from rollplex_train.sharing.embedded import LocalWeights
from rollplex_train.sharing.ipc import WeightsVersion

SAMPLED = SamplingParams(n=2, max_new_tokens=8, seed=3)
GREEDY = SamplingParams(n=1, max_new_tokens=8, temperature=0.0, ignore_eos=True)
LOGPROB_TOL = 1e-5  # row-parallel sums in another order: measured <= 1.9e-6 (scripts/check_rollout_tp.py)


def _tokens(responses) -> list[list[int]]:
    return [r.token_ids.tolist() for r in responses]


def _max_logprob_diff(a, b) -> float:
    return max(float((x.logprobs - y.logprobs).abs().max()) for x, y in zip(a, b))


def _perturbed(model, seed: int = 0) -> dict[str, torch.Tensor]:
    """The model's HF parameters (tied once) plus seeded noise: weights no rank has seen."""
    g = torch.Generator().manual_seed(seed)
    return {n: (p.detach() + 0.02 * torch.randn(p.shape, generator=g)).contiguous()
            for n, p in model.named_parameters()}


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def _in_threads(fn, size: int = 2) -> list:
    """``fn(rank, TPGroup)`` on ``size`` threads of this process, over one gloo group."""
    store, out = dist.HashStore(), [None] * size

    def run(rank: int) -> None:
        out[rank] = fn(rank, TPGroup(rank, size, group=dist.ProcessGroupGloo(store, rank, size)))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_vocab_parallel_embedding_and_head_with_a_padded_vocabulary():
    """V = 100 padded to 128 (the sglang layout's multiple of 64) over 2 ranks: the embedding equals
    the full one bitwise (each id looked up by one rank, zeros added), the head's gathered logits
    are the full head's columns bitwise, padding cut."""
    g = torch.Generator().manual_seed(0)
    full = torch.randn(100, 16, generator=g)
    padded = torch.cat([full, torch.zeros(28, 16)])
    ids = torch.tensor([[0, 63, 64, 99], [5, 70, 1, 98]])
    hidden = torch.randn(2, 4, 16, generator=g)

    def rank_side(rank, tp):
        rows = padded[rank * 64:(rank + 1) * 64].clone()
        return VocabParallelEmbedding(rows, tp)(ids), VocabParallelHead(rows, 100, tp)(hidden)

    for emb, logits in _in_threads(rank_side):
        assert torch.equal(emb, torch.nn.functional.embedding(ids, full))
        assert logits.shape == (2, 4, 100) and torch.equal(logits, hidden @ full.T)


def test_rank_layout_kv_heads_replicate_when_ranks_outnumber_them(tiny_ckpt_qwen25):
    model = load_model(str(tiny_ckpt_qwen25))  # 4 query heads, 2 KV heads
    assert [RankLayout.of_model(model, 2, i).kv_heads(2) for i in range(2)] == [slice(0, 1), slice(1, 2)]
    assert [RankLayout.of_model(model, 4, i).kv_heads(2) for i in range(4)] == [slice(0, 1), slice(0, 1),
                                                                                 slice(1, 2), slice(1, 2)]
    with pytest.raises(ValueError, match="TP 3 does not divide"):
        RankLayout.of_model(model, 3, 0)


def test_rank_tensors_at_degree_one_run_bitwise_the_hf_model(tiny_ckpt_qwen25, mixed_prompts):
    """The sglang layout at r = 1 (fused qkv_proj / gate_up_proj) bound in place: the same tokens and
    bitwise the same log-probs as the HF parameters; the trainer's tensors are used, not copied; a
    copied update of rank tensors lands in them; stale shared weights are refused."""
    plain = BuiltinRolloutEngine(str(tiny_ckpt_qwen25))
    new = _perturbed(plain.model)
    plain.update_weights(new, version=1)
    want = plain.generate(mixed_prompts, SAMPLED)

    engine = BuiltinRolloutEngine(str(tiny_ckpt_qwen25))
    layout = RankLayout.of_model(engine.model, 1, 0)
    rank = layout.shard(new)
    version = WeightsVersion()
    version.publish(1)
    assert engine.map_shared_weights(LocalWeights(rank, version)) == sum(t.nbytes for t in rank.values())
    assert _storages(engine.model.parameters()) == _storages(rank.values())  # views of the given tensors only
    got = engine.generate(mixed_prompts, SAMPLED, weights_version=1)
    assert _tokens(got) == _tokens(want)
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(got, want))
    version.begin_update()
    with pytest.raises(StaleWeightsError, match="being updated"):
        engine.generate(mixed_prompts, SAMPLED)

    copied = BuiltinRolloutEngine(str(tiny_ckpt_qwen25))
    copied.update_weights({n: t.clone() for n, t in rank.items()}, version=1)  # sharing.enabled=false
    assert _tokens(copied.generate(mixed_prompts, SAMPLED)) == _tokens(want)
    with pytest.raises(ValueError, match="missing="):
        copied.update_weights({n: t for n, t in list(rank.items())[1:]}, version=2)


def _rank_process(rank: int, port: int, ckpt: str, prompts, new: dict, queue) -> None:
    """One rank of a TP = 2 engine: what it samples from the checkpoint, from the actor's prefixes,
    with one prompt KV copy per group, after a copied HF update and on mapped per-rank tensors."""
    torch.set_num_threads(1)
    try:
        tp = TPGroup(rank, 2, connect=lambda: new_process_group(rank, 2, ("127.0.0.1", port), "cpu"))
        engine = BuiltinRolloutEngine(ckpt, tp=tp)
        out = {"own": engine.generate(prompts, SAMPLED), "greedy": engine.generate(prompts, GREEDY)}
        actor = load_model(ckpt)
        states = [encode_prefix(actor, [p], version=0)[0] for p in prompts]
        out["given"] = engine.generate(prompts, SAMPLED, prefixes=states)
        if engine.fused_decode_unsupported is None:  # share_prompt_kv needs it (refused below transformers 5.24)
            engine.share_prompt_kv = True
            out["shared_kv"] = engine.generate(prompts, SAMPLED)
            engine.share_prompt_kv = False
        engine.update_weights(new, version=1)  # full HF tensors, this rank's rows cut and copied
        out["updated"] = engine.generate(prompts, SAMPLED, weights_version=1)

        mapped = BuiltinRolloutEngine(ckpt, tp=tp)
        tensors = RankLayout.of_model(actor, 2, rank).shard(new)
        for t in tensors.values():
            t.share_memory_()
        version = WeightsVersion()
        version.publish(1)
        out["mapped_bytes"] = (mapped.map_shared_weights(LocalWeights(tensors, version)),
                               sum(t.nbytes for t in tensors.values()))
        out["in_place"] = _storages(mapped.model.parameters()) == _storages(tensors.values())
        out["mapped"] = mapped.generate(prompts, SAMPLED, weights_version=1)
        queue.put((rank, {k: _plain(v) for k, v in out.items()}))  # no tensors: the process ends first
    except BaseException as err:  # noqa: BLE001 -- reported to the test
        queue.put((rank, repr(err)))


def _plain(value):
    """Responses as ``[(tokens, log-probs)]`` of Python numbers (float32 values exactly)."""
    if isinstance(value, list):
        return [(r.token_ids.tolist(), r.logprobs.tolist()) for r in value]
    return value


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tp2_builtin_engine_tokens_equal_tp1(tiny_ckpt_qwen25, mixed_prompts):
    """Two gloo processes, each holding one rank's sglang-layout tensors, sample the same tokens as
    one engine holding the whole model (images and a video; temperature 1 and greedy), with
    log-probs within LOGPROB_TOL (not bitwise: the row-parallel sums add r partial GEMMs). Both
    ranks return the same responses. Also: the actor's whole-model prefixes cut to a rank's KV
    heads, one prompt KV copy per group, a copied HF update, and per-rank tensors mapped in place
    (the rank's parameters are views of them) give the one-device engine's tokens."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    single = BuiltinRolloutEngine(str(tiny_ckpt_qwen25))
    new = _perturbed(single.model)
    port = _free_port()
    procs = [ctx.Process(target=_rank_process, args=(r, port, str(tiny_ckpt_qwen25), mixed_prompts, new, queue),
                         daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()  # only on failure: a rank waits for the other in a collective
    assert all(isinstance(r, dict) for r in results.values()), results
    ranks = results[0], results[1]
    want = {"own": single.generate(mixed_prompts, SAMPLED), "greedy": single.generate(mixed_prompts, GREEDY)}
    single.update_weights(new, version=1)
    want["updated"] = single.generate(mixed_prompts, SAMPLED)
    for key, ref in [("own", "own"), ("greedy", "greedy"), ("given", "own"), ("shared_kv", "own"),
                     ("updated", "updated"), ("mapped", "updated")]:
        expected = _plain(want[ref])
        if key == "shared_kv" and single.fused_decode_unsupported:
            assert all(key not in out for out in ranks)  # transformers < 5.24: no fused step, no shared copy
            continue
        for out in ranks:
            assert [t for t, _ in out[key]] == [t for t, _ in expected], key
            diff = max(abs(a - b) for (_, x), (_, y) in zip(out[key], expected) for a, b in zip(x, y))
            assert diff <= LOGPROB_TOL, (key, diff)
        assert ranks[0][key] == ranks[1][key], key  # both ranks sampled from the same gathered logits
    for out in ranks:
        assert out["in_place"] and out["mapped_bytes"][0] == out["mapped_bytes"][1]


@pytest.mark.parametrize("overrides, message", [
    (["actor.backend=torch"], "must lie in one training replica"),  # DP-only ranks: one engine, two DP calls
    (["actor.backend=megatron", "actor.tensor_parallel_size=2", "sharing.split_qkv=true"], "split_qkv"),
])
def test_config_refuses_what_a_tp_builtin_engine_cannot_honour(overrides, message):
    from hydra import compose, initialize_config_dir

    from rollplex_train.cli import conf_dir
    from rollplex_train.config import register_configs, to_config
    from rollplex_train.resolve import resolve  # the engines' own refusals (BuiltinRolloutEngine.check_config)

    base = ["trainer.output_dir=/tmp/unused", "cluster.devices_per_node=2", "rollout.tensor_parallel_size=2",
            "sharing.enabled=false", "schedule=serial"]
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        ok = resolve(to_config(compose("config", [*base, "actor.backend=megatron", "actor.tensor_parallel_size=2"])))
        assert ok.rollout.tensor_parallel_size == 2 and not ok.rollout.share_prompt_kv
        with pytest.raises(ValueError, match=message):
            resolve(to_config(compose("config", [*base, *overrides])))
