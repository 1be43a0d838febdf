"""Group protocol pieces without Ray: Pending futures, the item stream, placement of groups on DP
ranks, and the DP parts of a batch (global mini-batch counts, rows back in order)."""

import concurrent.futures as cf
import threading

import pytest
import torch

from rollplex_train.data.types import TrainBatch, gather_rows
from rollplex_train.runtime.planner import place_groups
from rollplex_train.runtime.protocol import ItemStream, Pending, wait_first


def test_pending_combines_and_reraises():
    a, b = cf.Future(), cf.Future()
    p = Pending([a, b], lambda values: sum(values))
    assert not p.done()
    a.set_result(2)
    b.set_result(3)
    assert p.done() and p.result() == 5 and len(p.seconds()) == 2 and p.imbalance() >= 1.0
    c = cf.Future()
    c.set_exception(ValueError("stale"))
    with pytest.raises(ValueError, match="stale"):
        Pending([c]).result()


def test_item_stream_delivers_in_order_and_ends():
    stream = ItemStream(num_feeders=2)
    first = stream.next_future()
    assert not first.done()

    def feed(tag):
        for i in range(3):
            stream.push((tag, i))
        stream.finish()

    threads = [threading.Thread(target=feed, args=(t,)) for t in "ab"]
    for t in threads:
        t.start()
    got = []
    while not stream.finished:
        wait_first([stream.next_future()], timeout=5)
        got += stream.take()
    assert first.done()
    assert sorted(got) == [(t, i) for t in "ab" for i in range(3)]
    assert [i for t, i in got if t == "a"] == [0, 1, 2]


def test_item_stream_reraises_a_feeder_error_after_its_items():
    stream = ItemStream(num_feeders=1)
    stream.push("x")
    stream.finish(RuntimeError("engine died"))
    assert stream.take() == ["x"]
    with pytest.raises(RuntimeError, match="engine died"):
        stream.take()


def test_place_groups_balances_every_mini_batch():
    tokens = [100, 10, 90, 20, 50, 50, 70, 30]
    ranks = place_groups(tokens, groups_per_mini_batch=4, dp_size=2)
    for start in (0, 4):  # each rank gets 2 groups of each mini-batch
        assert sorted(ranks[start:start + 4]) == [0, 0, 1, 1]
    assert ranks[:4] == [0, 0, 1, 1]  # 100+10 vs 90+20: largest first to the least loaded
    assert place_groups(tokens, 4, 1) == [0] * 8
    assert place_groups(tokens, 4, 2) == ranks  # deterministic


def _batch(lengths_per_group: list[list[int]]) -> TrainBatch:
    rows = [(g, n) for g, lengths in enumerate(lengths_per_group) for n in lengths]
    width = max(n for _, n in rows)
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for _, n in rows])
    from rollplex_train.data.types import PromptSample, VisionInputs

    prompts = [PromptSample(uid=f"p{g}", prompt_ids=torch.tensor([1, 2]), vision=VisionInputs(), ground_truth="")
               for g in range(len(lengths_per_group))]
    return TrainBatch(prompts=prompts, group_index=torch.tensor([g for g, _ in rows]),
                      response_ids=torch.zeros(len(rows), width, dtype=torch.long), response_mask=mask)


def _placed(batch: TrainBatch, rank_of_group: list[int], groups_per_mini_batch: int):
    from rollplex_train.cluster.executors import InProcessExecutor
    from rollplex_train.cluster.groups import StepPrompts

    return StepPrompts(InProcessExecutor(), batch.prompts, rank_of_group, max(rank_of_group) + 1, groups_per_mini_batch)


def test_update_parts_keep_global_counts_and_rows():
    batch = _batch([[3, 1], [2, 2], [4, 0], [1, 1]])  # 4 groups of 2, one empty response
    whole = batch.plan_mini_batches(2)
    assert [(s.num_tokens, s.num_seqs) for s in whole] == [(8, 4), (6, 3)]
    placed = _placed(batch, [0, 1, 1, 0], 2)
    parts = [placed.update_part(batch, dp, whole) for dp in range(2)]
    for part in parts:  # every rank sees the global counts of every mini-batch
        assert [(s.num_tokens, s.num_seqs) for s in part.mini_batches] == [(8, 4), (6, 3)]
    assert [s.groups for s in parts[0].mini_batches] == [(0,), (1,)]  # local indices of groups 0 and 3
    assert parts[0].group_index.tolist() == [0, 0, 1, 1] and parts[0].prompts == [batch.prompts[0], batch.prompts[3]]
    assert parts[1].source_rows.tolist() == [2, 3, 4, 5]
    assert torch.equal(parts[1].response_mask, batch.response_mask[2:6])
    values = [torch.full((p.num_responses, 4), float(r)) for r, p in enumerate(parts)]
    merged = gather_rows(parts, values, batch.num_responses)
    assert merged[:, 0].tolist() == [0, 0, 1, 1, 1, 1, 0, 0]
