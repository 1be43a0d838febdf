"""A measured run's cost model, completed from its metrics, for ``rollplex-plan timeline``.

A rollplex run saves its planner calibration with every checkpoint (``trainer_state.json`` ->
``schedule`` -> ``cost``: decode and prefix rates per thread count, the re-share cost, the
reference suffix chunks' and one-call pass's rates per input token; plus the graph's size
estimates). The rates of the phases after decode come from the same run's ``metrics.jsonl``
(``timing_s/*``, medians over steps 2 .. the checkpoint's step; step 1 carries warm-up) at the thread
count the run used; the saved ``suffix/ref`` is replaced by this per-response-token rate:

- ``suffix/old`` / ``suffix/ref``: ``timing_s/old_log_prob`` / ``timing_s/ref`` per response token
  (under rollplex these phases run the suffixes only);
- ``update``: ``timing_s/update_actor`` per response token, less the actor prefixes of later
  mini-batches (the update computes those itself); the optimizer step is inside it (``optimizer`` 0);
- ``reward``, ``adv``, ``sync`` (``timing_s/update_weights``): seconds per step;
- ``prefix/backward`` (full-sequence baselines back-propagate every copy of the prompt): twice the
  ``prefix/actor`` forward rate (backward = 2 x forward FLOPs; the torch engine does not recompute);
- ``prefill``: 0 — the built-in engine's decode rate counts from the start of the rollout call,
  prefill included (``rollout/builtin.py`` decode accounting).

Thread counts the run never used for those kinds (the disaggregated halves) are extrapolated with
Amdahl's law, taking the parallel fraction measured for the matching prefix kind (same model passes,
``prefix/old`` for ``suffix/old`` ...). Pure Python, no processes.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rollplex_train.runtime.cost_model import CostModel, amdahl
from rollplex_train.tracking.checkpoint import CheckpointManager, load_json
from rollplex_train.tracking.loggers import read_metrics_jsonl

SIMILAR = {"suffix/old": "prefix/old", "suffix/ref": "prefix/ref", "update": "prefix/actor", "prefill": "prefix/old"}
"""Kind measured only at the run's thread count -> the prefix kind whose Amdahl fraction it borrows."""


@dataclass
class CalibratedRun:
    """The calibration of one checkpoint of a measured run.

    Attributes:
        cost: the saved cost model, completed with the post-decode kinds (see the module docstring).
        threads: the run's threads per device (the most the saved decode rates were measured at).
        step: the checkpoint's step. response_tokens: response tokens per group (saved estimate).
        decode_steps: decode steps of the rollout (saved). prompt_tokens: mean prompt tokens
            (``prompt_length/mean``). bytes_per_token: prefix-state bytes per prompt token by role.
        measured: median ``timing_s/<phase>`` (``step`` included) of the steps logged after the
            checkpoint, by phase name (empty: none logged). trace: the Chrome trace of the last such
            step (``traces/step_<k>.json``, ``trainer.trace_steps``), if the run wrote one.
        source: the ``trainer_state.json`` read.
    """

    cost: CostModel
    threads: int
    step: int
    response_tokens: int
    decode_steps: int
    prompt_tokens: int
    bytes_per_token: dict[str, float]
    measured: dict[str, float]
    source: Path
    trace: Optional[Path] = None


def _checkpoint(run_dir: Path) -> tuple[Path, Path]:
    """(trainer_state.json, metrics.jsonl) of ``run_dir`` (an output directory: its latest checkpoint;
    or a ``global_step_<k>`` directory)."""
    if (run_dir / "trainer_state.json").is_file():
        return run_dir / "trainer_state.json", run_dir.parent.parent / "metrics.jsonl"
    found = CheckpointManager(run_dir / "checkpoints", 1).list_checkpoints()
    if not found:
        raise FileNotFoundError(f"timeline.run_dir={str(run_dir)!r}: no checkpoints/global_step_<k>/trainer_state.json "
                                "(run with trainer.save_freq > 0, or point at a checkpoint directory)")
    return found[-1] / "trainer_state.json", run_dir / "metrics.jsonl"


def load_run(run_dir: str | Path, groups: int, mini_batch_groups: int) -> CalibratedRun:
    """The calibration of ``run_dir`` for a device holding ``groups`` prompt groups per step, of which
    ``mini_batch_groups`` form the first mini-batch (their actor prefixes are precomputed).

    Raises:
        FileNotFoundError: no checkpoint / metrics file (named). ValueError: the checkpoint holds no
            cost model (a serial or disaggregated run), or the metrics lack the calibration steps.
    """
    state_path, metrics_path = _checkpoint(Path(run_dir))
    state = load_json(state_path)
    schedule = state.get("schedule") or {}
    if "cost" not in schedule:
        raise ValueError(f"{state_path}: no schedule.cost (only schedule=rollplex runs save a cost model): "
                         "calibrate from a rollplex run")
    cost = CostModel()
    cost.load_state_dict(schedule["cost"])
    if "decode" not in cost.rates:
        raise ValueError(f"{state_path}: the saved cost model has no decode measurement yet")
    step = int(state["step"])
    rows = [r for r in read_metrics_jsonl(metrics_path) if 2 <= r["step"] <= step]
    if not rows:
        raise ValueError(f"{metrics_path}: no logged steps 2..{step} to calibrate the post-decode phases from")
    threads = max(cost.rates["decode"])

    def median(key: str) -> float:
        values = [r[key] for r in rows if key in r]
        return statistics.median(values) if values else 0.0

    response_tokens = int(schedule["response_tokens"])
    prompt_tokens = round(median("prompt_length/mean"))
    tokens = groups * response_tokens
    later = [r for r in read_metrics_jsonl(metrics_path) if r["step"] > step]
    measured = {k[len("timing_s/"):]: statistics.median(r[k] for r in later if k in r)
                for k in (later[0] if later else {}) if k.startswith("timing_s/")}
    in_update = cost.seconds("prefix/actor", max(0, groups - mini_batch_groups) * prompt_tokens, threads)
    _complete(cost, threads, {
        "suffix/old": median("timing_s/old_log_prob") / tokens,
        "suffix/ref": median("timing_s/ref") / tokens,
        "update": max(0.0, median("timing_s/update_actor") - in_update) / tokens,
        "reward": median("timing_s/reward"), "adv": median("timing_s/adv"),
        "sync": median("timing_s/update_weights"), "optimizer": 0.0, "prefill": 0.0})
    backward = {c: 2 * r for c, r in cost.rates["prefix/actor"].items()}  # backward = 2 x forward FLOPs, no recompute
    cost.rates["prefix/backward"] = backward
    cost.counts.update({("prefix/backward", c): 2 for c in backward})
    return CalibratedRun(cost=cost, threads=threads, step=step, response_tokens=response_tokens,
                         decode_steps=int(schedule["decode_steps"]), prompt_tokens=prompt_tokens,
                         bytes_per_token={k: float(v) for k, v in schedule["bytes_per_token"].items()},
                         measured=measured, source=state_path,
                         trace=next((t for r in reversed(later)
                                     if (t := metrics_path.parent / "traces" / f"step_{r['step']}.json").is_file()), None))


def _complete(cost: CostModel, threads: int, rates: dict[str, float]) -> None:
    """Add ``rates`` (at ``threads``) to ``cost`` and extrapolate them to every thread count below it."""
    for kind, rate in rates.items():
        f = cost.parallel_fraction(SIMILAR[kind]) if kind in SIMILAR else 0.0  # per-step kinds: fixed seconds
        cost.rates[kind] = {c: rate * amdahl(c, f) / amdahl(threads, f) for c in range(1, threads + 1)}
        cost.counts.update({(kind, c): 2 for c in range(1, threads + 1)})
