"""Supervised *format warm-up* of a freshly built tiny checkpoint.

A randomly initialised model never emits a parseable answer, so RL would see only zero rewards. The
warm-up teaches the answer format ``\\boxed{<option>}<|im_end|>`` with the option drawn uniformly at
random from each task's options (independently of the image), so the warmed-up policy answers in the
right format at chance accuracy: any accuracy above chance after RL comes from the pixels.
"""

from __future__ import annotations

import logging
import random

import torch

from rollplex_train.data.types import PromptSample
from rollplex_train.models.sequence import build_full_sequences, response_logprobs

log = logging.getLogger(__name__)


def answer_ids(tokenizer, answer: str) -> torch.Tensor:
    """(R,) int64 token ids of the target response ``\\boxed{answer}`` followed by EOS."""
    ids = tokenizer(f"\\boxed{{{answer}}}", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


def format_warmup(model, tokenizer, samples: list[PromptSample], *, steps: int, batch_size: int,
                  lr: float, seed: int) -> list[float]:
    """Train ``model`` in place on random-option answers; returns the per-step mean NLL (nats/token).

    Args:
        samples: prompts with non-empty ``options`` (samples without options are ignored).
        steps: optimizer steps. batch_size: prompts per step. lr: AdamW learning rate.

    Raises:
        ValueError: no sample has options.
    """
    pool = [s for s in samples if s.options]
    if not pool:
        raise ValueError("format warm-up needs samples with options (the `options` column)")
    rng = random.Random(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    pad = tokenizer.pad_token_id
    losses = []
    model.train()
    for step in range(steps):
        prompts = rng.sample(pool, min(batch_size, len(pool)))
        targets = [answer_ids(tokenizer, rng.choice(p.options)) for p in prompts]
        width = max(t.shape[0] for t in targets)
        resp = torch.full((len(targets), width), pad, dtype=torch.long)
        mask = torch.zeros((len(targets), width))
        for i, t in enumerate(targets):
            resp[i, : t.shape[0]] = t
            mask[i, : t.shape[0]] = 1
        group = torch.arange(len(prompts))
        ids, attn, plen, vision = build_full_sequences(prompts, group, resp, mask, pad)
        logp, _ = response_logprobs(model, ids, attn, vision, plen, resp, mask)
        loss = -(logp.sum() / mask.sum())
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            log.info("format warm-up step %d/%d: nll %.4f", step + 1, steps, losses[-1])
    model.eval()
    return losses
