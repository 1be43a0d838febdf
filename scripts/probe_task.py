"""Supervised probe: can a checkpoint learn a task at all from the right answers?

    python scripts/probe_task.py CKPT TRAIN.parquet VAL.parquet STEPS LR

Trains ``CKPT`` in place in memory (nothing is written) with cross-entropy on ``\\boxed{answer}``
for ``STEPS`` AdamW steps of 16 random train prompts (grad norm clipped to 1), and prints the
validation accuracy every 50 steps: for each val prompt the option with the highest likelihood is
its answer. A diagnostic for task design (``docs/benchmarks.md``, ``make run``): a task this probe
cannot learn, RL cannot either.
"""

import random
import sys

import torch

from rollplex_train.config import DataConfig
from rollplex_train.data.dataset import PromptDataset
from rollplex_train.models.loading import load_model, load_tokenizer
from rollplex_train.models.sequence import build_full_sequences, response_logprobs
from rollplex_train.models.warmup import answer_ids


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    ckpt, train, val, steps, lr = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
    model, tok = load_model(ckpt), load_tokenizer(ckpt)

    def samples(path):
        ds = PromptDataset(DataConfig(train_files=path, val_files=""), tok, path, "probe", merge_size=2)
        return [s for s in (ds.get(i) for i in range(len(ds))) if s is not None]

    tr, va = samples(train), samples(val)

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
            right = sum(s.options[int(nll([s] * len(s.options), list(s.options)).argmin())] == s.ground_truth
                        for s in va)
        model.train()
        return right / len(va)

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(0)
    print("step 0 acc", accuracy(), flush=True)
    for step in range(1, steps + 1):
        batch = rng.sample(tr, 16)
        loss = nll(batch, [s.ground_truth for s in batch]).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0:
            print("step", step, "loss", round(loss.item(), 3), "acc", accuracy(), flush=True)


if __name__ == "__main__":
    main()
