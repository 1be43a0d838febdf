"""Supervised probe: can a checkpoint learn a task at all from the right answers?

    python scripts/probe_task.py CKPT TRAIN.parquet VAL.parquet STEPS LR [--every N] [--stages S]

Trains ``CKPT`` in place in memory (nothing is written) with cross-entropy on ``\\boxed{answer}``
for ``STEPS`` AdamW steps of 16 random train prompts (grad norm clipped to 1), and prints the
validation accuracy every ``--every`` steps (default 50): for each val prompt the option with the
highest likelihood is its answer, one accuracy per val file (``VAL`` may list several, comma-
separated; so may ``TRAIN``). ``--stages "80:a.parquet;160:b.parquet,c.parquet"`` draws steps 1-80
from ``a``, 81-160 from ``b`` and ``c``, the rest from ``TRAIN``. A diagnostic for task design and
task order (``docs/benchmarks.md``, ``make run``): a task this probe cannot learn, RL cannot either.
"""

import argparse
import random

import torch

from rollplex_train.config import DataConfig
from rollplex_train.data.dataset import PromptDataset
from rollplex_train.models.loading import load_model, load_tokenizer
from rollplex_train.models.sequence import build_full_sequences, response_logprobs
from rollplex_train.models.warmup import answer_ids


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ckpt")
    parser.add_argument("train")
    parser.add_argument("val")
    parser.add_argument("steps", type=int)
    parser.add_argument("lr", type=float)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--stages", default="")
    args = parser.parse_args()
    model, tok = load_model(args.ckpt), load_tokenizer(args.ckpt)

    def samples(path):
        ds = PromptDataset(DataConfig(train_files=path, val_files=""), tok, path, "probe", merge_size=2)
        return [s for s in (ds.get(i) for i in range(len(ds))) if s is not None]

    def pool_of(files):
        return [s for f in files.split(",") for s in samples(f)]

    tr, vals = pool_of(args.train), [samples(f) for f in args.val.split(",")]
    stages = [(int(until), pool_of(files)) for until, files in
              (stage.split(":", 1) for stage in args.stages.split(";") if stage)]

    def nll(prompts, answers):  # (B,) summed NLL of each answer
        targets = [answer_ids(tok, a) for a in answers]
        width = max(t.shape[0] for t in targets)
        resp = torch.full((len(targets), width), tok.pad_token_id)
        mask = torch.zeros(len(targets), width)
        for i, t in enumerate(targets):
            resp[i, : len(t)] = t
            mask[i, : len(t)] = 1
        ids, attn, plen, vision = build_full_sequences(prompts, torch.arange(len(prompts)), resp, mask,
                                                       tok.pad_token_id)
        logp, _ = response_logprobs(model, ids, attn, vision, plen, resp, mask)
        return -(logp * mask).sum(-1)

    def accuracy():
        model.eval()
        with torch.no_grad():
            right = [sum(s.options[int(nll([s] * len(s.options), list(s.options)).argmin())] == s.ground_truth
                         for s in va) / len(va) for va in vals]
        model.train()
        return " ".join(f"{a:.2f}" for a in right)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    rng = random.Random(0)
    print("step 0 acc", accuracy(), flush=True)
    for step in range(1, args.steps + 1):
        pool = next((p for until, p in stages if step <= until), tr)
        batch = rng.sample(pool, 16)
        loss = nll(batch, [s.ground_truth for s in batch]).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.every == 0:
            print("step", step, "loss", round(loss.item(), 3), "acc", accuracy(), flush=True)


if __name__ == "__main__":
    main()
