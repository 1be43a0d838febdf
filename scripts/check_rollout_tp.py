"""How far the built-in engine at TP = 2 (two gloo processes) is from TP = 1: logits, tokens, log-probs.

    python scripts/check_rollout_tp.py                        # tiny checkpoint, 2 prompts per task
    python scripts/check_rollout_tp.py --per-task 4 --max-new-tokens 64

On ``--checkpoint`` (default: ``make assets``' tiny Qwen2.5-VL) and ``--per-task`` prompts of each
synthetic task of ``--tasks`` (images of two sizes and a video), the two ranks of a TP = 2 engine
each hold their ``sglang``-layout tensors; one engine holds the whole model. Prints the largest
difference of the logits of each prompt's first response token (the prefill: vision tower and
prompt, every row-parallel sum included), then for sampled (temperature 1, G = 4) and greedy
decoding whether every token is the same and the largest log-prob difference. Last line:
``rollout_tp: logits=<max |d|> sampled_tokens_equal=<bool> sampled_logprob=<max |d|> greedy_tokens_equal=<bool>
greedy_logprob=<max |d|>``. Exit 1 when a token differs.
"""

from __future__ import annotations

import argparse
import socket
import sys

import torch
import torch.multiprocessing as mp

from rollplex_train.config import DataConfig
from rollplex_train.data.dataset import PromptDataset
from rollplex_train.models.prefix import encode_prefix
from rollplex_train.rollout.base import SamplingParams
from rollplex_train.rollout.builtin import BuiltinRolloutEngine
from rollplex_train.rollout.tensor_parallel import TPGroup, new_process_group


def _decode(engine: BuiltinRolloutEngine, prompts, requests) -> dict:
    """First-token logits of each prompt and the responses of each request, as plain numbers."""
    with torch.no_grad():
        states = [encode_prefix(engine.model, [p], version=0)[0] for p in prompts]
        logits = [engine.model.lm_head(s.last_hidden).tolist() for s in states]
    out = {"logits": logits}
    for name, params in requests.items():
        out[name] = [(r.token_ids.tolist(), r.logprobs.tolist()) for r in engine.generate(prompts, params)]
    return out


def _rank(rank: int, port: int, checkpoint: str, prompts, requests, queue) -> None:
    torch.set_num_threads(1)
    tp = TPGroup(rank, 2, connect=lambda: new_process_group(rank, 2, ("127.0.0.1", port), "cpu"))
    queue.put((rank, _decode(BuiltinRolloutEngine(checkpoint, tp=tp), prompts, requests)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="artifacts/checkpoints/tiny-qwen25vl")
    parser.add_argument("--tasks", default="artifacts/data/visual_tasks/train.parquet")
    parser.add_argument("--per-task", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = BuiltinRolloutEngine(args.checkpoint)
    dataset = PromptDataset(DataConfig(train_files=args.tasks, val_files=""), engine.tokenizer, args.tasks, "train")
    by_task: dict[str, list] = {}
    for i in range(len(dataset)):
        sample = dataset.get(i)
        if sample is not None and len(by_task.setdefault(sample.task, [])) < args.per_task:
            by_task[sample.task].append(sample)
    prompts = [p for group in by_task.values() for p in group]
    requests = {"sampled": SamplingParams(n=4, max_new_tokens=args.max_new_tokens, seed=5),
                "greedy": SamplingParams(n=1, max_new_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True)}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, args.checkpoint, prompts, requests, queue)) for r in range(2)]
    for p in procs:
        p.start()
    ranks = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    want = _decode(engine, prompts, requests)
    got = ranks[0]
    assert got == ranks[1], "the two ranks returned different results"
    logits = max(abs(a - b) for x, y in zip(got["logits"], want["logits"]) for a, b in zip(x, y))
    summary = [f"logits={logits:.2e}"]
    print(f"{len(prompts)} prompts ({', '.join(f'{t} x{len(g)}' for t, g in by_task.items())}), "
          f"{args.max_new_tokens} new tokens; first-token logits max |d| {logits:.2e}")
    equal_all = True
    for name in requests:
        equal = [t for t, _ in got[name]] == [t for t, _ in want[name]]
        diff = max(abs(a - b) for (_, x), (_, y) in zip(got[name], want[name]) for a, b in zip(x, y))
        tokens = sum(len(t) for t, _ in want[name])
        print(f"{name}: {len(want[name])} responses, {tokens} tokens; same tokens: {equal}; log-prob max |d| {diff:.2e}")
        summary += [f"{name}_tokens_equal={equal}", f"{name}_logprob={diff:.2e}"]
        equal_all &= equal
    print("rollout_tp: " + " ".join(summary))
    if not equal_all:
        sys.exit(1)


if __name__ == "__main__":
    main()
