#!/usr/bin/env python
"""The flagship in miniature next to its two references (issue 27): 3 steps of
``+experiment=flagship_cpu`` (Megatron actor at TP=2, built-in rollout at TP=2 mapping the actor's
shards in place, Adam states offloaded, rollplex schedule, shared prefix, image + video, KL loss) and
the same command with ``sharing.enabled=false`` (the pickled weight sync) and with
``actor.backend=torch rollout.tensor_parallel_size=1`` (the torch backend, which also needs
``actor.tensor_parallel_size=1 memory.budget_gib=null``: ``REFERENCES``).

    python scripts/check_flagship.py [--out DIR] [--steps 3]

Needs ``make assets assets-flagship``. Compares, and prints as its last line
``flagship: t=2 r=2 steps=3 max_weight_diff_vs_torch=<x> max_weight_diff_vs_unshared=<y> view_frac=<v>
copied_bytes=<c> memory_plan_max_rel_err=<m>``:

- the weight differences: largest element-wise |a - b| of the exported actors (``hf_actor/``) after
  the last step;
- ``view_frac``: the rollout bytes the run served as views of the trainer's tensors
  (``sharing/shared_bytes_frac``); the script fails if it is not ``rollplex-plan sharing``'s view
  fraction for the same layout;
- ``copied_bytes``: the most any weight sync of the run copied (``sharing/copied_bytes``, rollout
  rank 0) beyond the share plan's rebuilt bytes for that device;
- ``memory_plan_max_rel_err``: the largest relative difference between a ``memory/<phase>/<group>_gib``
  row the run measured and the row ``rollplex-plan memory +experiment=flagship_cpu`` plans
  (``memory/step_plan.max_rel_err``), over every step after the first (the first update creates
  the Adam states, so its update phase holds none yet); the script fails where an ``at most`` row
  (prefix states of the decode window) measured more than planned or a planned row was not logged.

Exit status 1 when a run fails or a check above does not hold; the acceptance thresholds
(weights <= 2e-5, copied_bytes = 0, memory_plan_max_rel_err <= 0.05) are the caller's to read.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = "flagship_cpu"
# The torch backend is data parallel only: it runs DP=2 whole replicas (actor.tensor_parallel_size=1), whose
# weights, Adam states and gradients need 0.0226 GiB per device, over flagship_cpu's residency budget
# (memory.budget_gib=0.019, set for the TP=2 shards): the reference runs without a budget.
REFERENCES = {"unshared": ["sharing.enabled=false"],
              "torch": ["actor.backend=torch", "rollout.tensor_parallel_size=1", "actor.tensor_parallel_size=1",
                        "memory.budget_gib=null"]}


def run(name: str, out: Path, steps: int, extra: list[str]) -> Path:
    """Train ``steps`` steps of the experiment with ``extra`` overrides into ``out/name``."""
    path = out / name
    cli = Path(sys.executable).parent / "rollplex-train"
    cmd = [str(cli), f"+experiment={EXPERIMENT}", f"trainer.total_steps={steps}", f"hydra.run.dir={path}",
           f"trainer.output_dir={path}", "trainer.progress_bar=false", "trainer.save_freq=0", *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, WANDB_MODE="offline"), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{name} run failed ({' '.join(cmd[1:])}):\n{proc.stderr[-4000:]}")
    print(f"{name}: {time.perf_counter() - start:.0f} s ({' '.join(extra) or 'as configured'})", flush=True)
    return path


def max_weight_diff(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    x, y = load_file(str(a / "hf_actor" / "model.safetensors")), load_file(str(b / "hf_actor" / "model.safetensors"))
    if x.keys() != y.keys():
        sys.exit(f"{a} and {b} export different tensors: {sorted(set(x) ^ set(y))[:5]}")
    return max(float((x[k].float() - y[k].float()).abs().max()) for k in x)


def compose(*overrides: str):
    from hydra import compose as hydra_compose, initialize_config_dir

    from rollplex_train.cli import conf_dir
    from rollplex_train.config import hydra_version_base, register_configs, to_config

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), **hydra_version_base()):
        return to_config(hydra_compose(config_name="config", overrides=[f"+experiment={EXPERIMENT}",
                                                                     "trainer.output_dir=unused", *overrides]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="run directory (default: a temporary one)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="check_flagship-"))

    from rollplex_train.memory.step_plan import max_rel_err, plan_rows, run_plan
    from rollplex_train.models.arch import load_hf_config
    from rollplex_train.sharing.report import configured_device_totals, rebuilt_bytes_per_device
    from rollplex_train.tracking.loggers import read_metrics_jsonl

    cfg = compose()
    hf = load_hf_config(cfg.model)
    flagship = run("flagship", out, args.steps, [])
    refs = {name: run(name, out, args.steps, extra) for name, extra in REFERENCES.items()}
    metrics = read_metrics_jsonl(flagship / "metrics.jsonl")
    if len(metrics) != args.steps:
        sys.exit(f"{flagship}/metrics.jsonl: {len(metrics)} steps logged, expected {args.steps}")
    failures = []

    totals = configured_device_totals(cfg, hf)
    views = sum(totals[0][k] for k in ("view", "strided_view"))
    planned_view_frac = views / sum(totals[0][k] for k in ("view", "strided_view", "local_rebuild", "gather"))
    view_frac = metrics[-1]["sharing/shared_bytes_frac"]
    if abs(view_frac - planned_view_frac) > 1e-9:
        failures.append(f"view_frac={view_frac:.6g}, rollplex-plan sharing says {planned_view_frac:.6g}")
    copied = max(m["sharing/copied_bytes"] for m in metrics) - rebuilt_bytes_per_device(totals)

    planned = plan_rows(run_plan(cfg, hf))
    worst = 0.0
    for m in metrics[1:]:
        err, broken = max_rel_err(planned, m)
        worst = max(worst, err)
        failures += [f"step {m['step']}: {b}" for b in broken]
    for name, (gib, kind) in planned.items():  # the side-by-side table of the last step
        got = metrics[-1].get(name)
        print(f"{name:<46} plan {'<=' if kind == 'at_most' else '  '}{gib:.6g}  run {got if got is None else f'{got:.6g}'}")
    for failure in failures:
        print("FAILED:", failure, file=sys.stderr)
    print(f"flagship: t={cfg.actor.tensor_parallel_size} r={cfg.rollout.tensor_parallel_size} steps={args.steps} "
          f"max_weight_diff_vs_torch={max_weight_diff(flagship, refs['torch']):.3g} "
          f"max_weight_diff_vs_unshared={max_weight_diff(flagship, refs['unshared']):.3g} "
          f"view_frac={view_frac:.4g} copied_bytes={int(copied)} memory_plan_max_rel_err={worst:.3g}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
