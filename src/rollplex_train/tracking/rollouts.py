"""Per-step rollout dumps (verl's ``trainer.rollout_data_dir``): what was sampled and how it scored."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rollplex_train.data.types import Response, TrainBatch


def dump_rollouts(directory: Path, step: int, batch: TrainBatch, responses: list[Response],
                  scores: torch.Tensor) -> Path:
    """Write ``<directory>/<step>.jsonl``: one line per response with the prompt's ``uid``,
    ``task``, ``prompt`` (its text as the data file holds it), ``media`` (the image/video paths that
    were loaded: relative ones joined to the data file's directory) and ``ground_truth``, the response ``text``, its ``token_ids``,
    ``finish_reason`` and ``score`` (the (N,) float32 reward of the step), so a dump reads on its
    own. Written to a temporary name and renamed, so a crash never leaves a half file. Returns the
    path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{step}.jsonl"
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row, r in enumerate(responses):
            prompt = batch.prompts[int(batch.group_index[row])]
            f.write(json.dumps({"step": step, "uid": prompt.uid, "task": prompt.task, "prompt": prompt.problem,
                                "media": list(prompt.media), "ground_truth": prompt.ground_truth, "text": r.text,
                                "token_ids": r.token_ids.tolist(), "finish_reason": r.finish_reason,
                                "score": float(scores[row])}) + "\n")
    tmp.replace(path)
    return path
