"""Driver-side batch metrics (runtime/batching.py)."""

from __future__ import annotations

import torch

from rollplex_train.data.types import PromptSample, Response, VisionInputs
from rollplex_train.runtime.batching import batch_metrics, to_train_batch

EOS = 882


def _response(tokens: list[int], finish_reason: str) -> Response:
    return Response(prompt_index=0, token_ids=torch.tensor(tokens), logprobs=torch.full((len(tokens),), -1.0),
                    text="", finish_reason=finish_reason)


def test_clip_ratio_counts_length_finishes_only():
    """max_new_tokens=4: a response ending on EOS as its 4th token is complete, not clipped."""
    prompt = PromptSample(uid="p", prompt_ids=torch.tensor([1, 2, 3]), vision=VisionInputs(), ground_truth="1")
    responses = [
        _response([5, 6, 7, EOS], "stop"),  # EOS exactly at the limit
        _response([5, 6, 7, 8], "length"),  # cut
        _response([5, EOS], "stop"),
        _response([5, 6, 7, 9], "stop"),  # a stop string ending at the limit
    ]
    batch = to_train_batch([prompt], responses, pad_id=0)
    metrics = batch_metrics(batch, responses, max_new_tokens=4)
    assert metrics["response_length/clip_ratio"] == 0.25
    assert metrics["response_length/max"] == 4.0 and metrics["response_length/mean"] == 3.5
